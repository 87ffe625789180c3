"""Shard encoding in a child process, so compression runs beside the adds instead of against them.

Why a process: numcodecs releases the GIL while compressing, but an encoder *thread* must take the GIL
back for every chunk, and the adding thread holds it almost all the time. Measured on the 2-core box:
10 image shards encoded with lz4hc took 709 ms in a thread while adds ran, 186 ms alone. A child
process encodes at full speed on the other core.

Invariants: shared buffers are backed by reserved pages (``posix_fallocate``): a /dev/shm too small for
them is an ``OSError`` when they are allocated, never a SIGBUS later. A staging buffer handed to
``submit`` lives in shared memory and is not written again until
its job's ``result()`` returned; a job's shard files are complete (temp file + rename, like every shard
write) when ``result()`` returns — or, for a job with an output buffer, its first ``head_chunks`` encoded
chunks lie back to back in that buffer with their sizes returned, and the caller (``FrameRing``, which
encodes the rest itself while it would otherwise wait) writes the file. A failure raises ``OSError`` with
the child's errno. The child exits when its stdin closes, so it never outlives the store (or a crashed
parent) for long; it runs in a session of its own, so a Ctrl-C meant for the script does not kill it (a
child that dies anyway costs time, not data: ``FrameRing`` then encodes the shard itself).

The shared buffers are ``shared_segments`` named after the store and the writer's pid, which Python's resource
tracker never hears of: a SIGKILLed writer prints no "leaked shared_memory" warning, and its child, which
outlives it until its stdin closes, removes them as it exits (the next writer of the store removes what a
child killed too left).

The child imports only numpy, numcodecs and google_crc32c (``python -m mmreplay.storage.format.encoder <prefix>``).
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import sys

import numpy as np

from mmreplay.storage.format import shared_segments
from mmreplay.storage.format.codecs import numcodecs_compressor
from mmreplay.storage.files import atomic_write
from mmreplay.storage.format.shardfile import build_shard, encode_chunk

MIN_ROW_BYTES = 1024  # small rows (low-dim observations) encode fast enough inline


class ShardEncoder:
    """Client side: shared staging buffers and the child that encodes them.

    The buffers are ``shared_segments`` named after the store and this process: never reported by Python's
    resource tracker when a writer is killed, removed by ``close``, else by the child as it exits, else by
    the next writer of the store (``shared_segments.remove_orphans``)."""

    def __init__(self, store: str = ""):
        shared_segments.remove_orphans(store)  # a killed writer's, its child killed too
        self._prefix = shared_segments.segment_prefix(store)
        self._serial = 0
        self._segments: dict[int, shared_segments.Segment] = {}  # data pointer of a buffer -> its segment
        self._proc: subprocess.Popen | None = None

    @classmethod
    def for_rows(cls, row_nbytes: int, store: str = "", encoder: str = "process") -> "ShardEncoder | None":
        """An encoder for image-sized rows of the store at ``store``, or None (small rows, or ``encoder ==
        "thread"``: the session's ``Settings.encoder``, which ``MMREPLAY_ENCODER`` overrides)."""
        if row_nbytes < MIN_ROW_BYTES or encoder == "thread":
            return None
        return cls(store)

    def allocate(self, shape: tuple, dtype) -> np.ndarray:
        """A zeroed array in a new shared segment (its pages reserved: a full /dev/shm is an ``OSError`` here)."""
        dtype = np.dtype(dtype)
        nbytes = max(1, int(np.prod(shape, dtype=np.int64)) * dtype.itemsize)
        while True:
            self._serial += 1
            try:
                segment = shared_segments.Segment(f"{self._prefix}{id(self) % 4096:x}_{self._serial}", nbytes,
                                                  create=True)
                break
            except FileExistsError:  # an unclosed encoder of this store in this process holds that name
                continue
        array = np.ndarray(shape, dtype=dtype, buffer=segment.buf)
        array[...] = 0
        self._segments[array.ctypes.data] = segment
        return array

    def submit(self, jobs: list[dict], arrays: list[np.ndarray], outputs: list[np.ndarray] | None = None
               ) -> "PendingShard":
        """Encode ``arrays[i]`` per ``jobs[i]`` (path, root: the store's path, rows, chunk_rows, codec) in the
        child, which writes the shard file; or, with ``outputs`` (shared uint8 buffers from ``allocate``) and
        ``jobs[i]["head_chunks"] = m``, only chunks ``[0, m)``, back to back into ``outputs[i]``: ``result()`` then gives their sizes
        and the caller finishes the shard."""
        for i, (job, array) in enumerate(zip(jobs, arrays)):
            job.update(segment=self._segments[array.ctypes.data].name, shape=list(array.shape),
                       dtype=array.dtype.name)
            if outputs is not None:
                job.update(out_segment=self._segments[outputs[i].ctypes.data].name, out_capacity=outputs[i].size)
        proc = self._child()
        try:
            proc.stdin.write(json.dumps(jobs).encode() + b"\n")
            proc.stdin.flush()
        except BrokenPipeError:
            raise OSError(errno.EIO, "the shard encoder process died") from None
        return PendingShard(proc, [job["path"] for job in jobs])

    def start(self) -> None:
        self._child()

    def _child(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            # A session of its own: a Ctrl-C at the terminal (SIGINT to the foreground process group) stops the
            # script, whose exit commit may still need the child; the child ends when its stdin closes.
            self._proc = subprocess.Popen([sys.executable, "-m", "mmreplay.storage.format.encoder", self._prefix],
                                          stdin=subprocess.PIPE,
                                          stdout=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                          start_new_session=True)
        return self._proc

    def close(self) -> None:
        if self._proc is not None:
            try:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
            self._proc = None
        for segment in self._segments.values():
            segment.unlink()  # the name goes now; the pages go with the last mapping
            try:
                segment.close()
            except BufferError:
                pass  # still viewed by a live array: unmapped when the process exits
        self._segments.clear()


class PendingShard:
    """One submitted encoding job of the encoder child: ``result()`` waits for its reply.

    Invariant: replies come back in submission order on the child's stdout, so each ``PendingShard``'s
    ``result()`` must be called, once, in the order the jobs were submitted; until it returned, the staging
    buffers handed to ``submit`` belong to the child and must not be written.
    """

    def __init__(self, proc: subprocess.Popen, paths: list[str]):
        self._proc = proc
        self.paths = paths

    def ready(self) -> bool:
        """Whether ``result()`` would return at once: the child answered (or died). One job of the child's is
        waited for at a time (``FrameRing``), so nothing of a later answer sits in the pipe's buffer."""
        return bool(select.select([self._proc.stdout.raw], [], [], 0)[0])

    def result(self) -> list:
        """The written paths, or (jobs with an output buffer) the encoded chunk sizes per job."""
        line = self._proc.stdout.raw.readline()
        if not line:
            raise OSError(errno.EIO, "the shard encoder process died")
        reply = json.loads(line)
        if not reply["ok"]:
            raise OSError(reply.get("errno") or errno.EIO, reply["message"])
        sizes = reply.get("sizes")
        return sizes if sizes and sizes[0] is not None else self.paths


# -- the child ---------------------------------------------------------------------------------------

def _attach(name: str) -> shared_segments.Segment:
    return shared_segments.Segment(name, 0, create=False)  # the parent owns it (and no tracker hears of it)


def _segment(segments: dict, name: str):
    segment = segments.get(name)
    if segment is None:
        segment = segments[name] = _attach(name)
    return segment


def encode_job(job: dict, segments: dict, compressors: dict) -> list[int] | None:
    array = np.ndarray(tuple(job["shape"]), dtype=np.dtype(job["dtype"]), buffer=_segment(segments, job["segment"]).buf)
    key = (json.dumps(job["codec"], sort_keys=True), job["dtype"])
    compressor = compressors.get(key)
    if compressor is None:
        compressor = compressors[key] = numcodecs_compressor(job["codec"], np.dtype(job["dtype"]))
    c, rows, n_chunks = job["chunk_rows"], job["rows"], job["shape"][0] // job["chunk_rows"]
    n_used = -(-rows // c)
    if "out_segment" in job:  # the head of the shard only, into the caller's buffer
        out = np.ndarray((job["out_capacity"],), dtype=np.uint8, buffer=_segment(segments, job["out_segment"]).buf)
        sizes, at = [], 0
        for i in range(job["head_chunks"]):
            chunk = encode_chunk(compressor, array[i * c:(i + 1) * c])
            if at + len(chunk) > out.size:
                raise ValueError(f"encoded head of {job['path']} overflows its {out.size}-byte buffer")
            out[at:at + len(chunk)] = np.frombuffer(chunk, dtype=np.uint8)
            sizes.append(len(chunk))
            at += len(chunk)
        return sizes
    encoded = [encode_chunk(compressor, array[i * c:(i + 1) * c]) for i in range(n_used)]
    # job["root"]: the store's path; the file's directories are made inside it, never through a link
    atomic_write(job["path"], build_shard(encoded + [None] * (n_chunks - n_used)), root=job["root"])
    return None


def main(prefix: str = "") -> int:
    """Encode the jobs read from stdin until it closes: the parent closed the store, or died. Then remove the
    parent's segments (``prefix``: a dead parent cannot; after a close the parent finds them gone)."""
    try:
        return _serve()
    finally:
        if prefix:
            shared_segments.remove_all(prefix)


def _serve() -> int:
    segments: dict = {}
    compressors: dict = {}
    for line in sys.stdin.buffer:
        try:
            reply = {"ok": True, "sizes": [encode_job(job, segments, compressors) for job in json.loads(line)]}
        except OSError as exc:
            reply = {"ok": False, "errno": exc.errno, "message": str(exc)}
        except Exception as exc:  # reported to the parent, which raises it
            reply = {"ok": False, "errno": errno.EIO, "message": f"{type(exc).__name__}: {exc}"}
        sys.stdout.write(json.dumps(reply) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1] if len(sys.argv) > 1 else ""))
