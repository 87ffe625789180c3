"""The encoder child's side of sealing frame shards: its shared buffers, and each shard's chunks split between
the child and the adding process.

Invariants:
- Every buffer the child reads or writes is one of its shared segments (``ShardEncoder.allocate``): the staging
  sets (``new_buffers``) and, for each of the ``CHILD_JOBS`` jobs it may hold, an output it encodes a shard's
  head chunks into. They are allocated before the first add (``start``), later only while shared memory keeps
  half of it free (``spare_buffers``): too little shared memory shows at create or open, or caps how many
  shards queue, and never fails an add.
- A shard handed to the child (``hand_over``) is encoded in two parts: the child encodes the first
  ``head_chunks[name]`` chunks of each column into an output, this process the rest (``finish``), which then
  writes the file. Until ``finish`` read the child's answer, nothing writes the shard's buffers or that output
  (the output is free again after). If the child failed (it died: a Ctrl-C at the terminal, an OOM kill),
  ``finish`` encodes the head here from the same buffers: a shard, and a commit that waits for it, never
  depends on the child.
- The split follows the load: waiting here for the child moves chunks to this process, a child done first
  gets more (``child_share``, between ``MIN_CHILD_SHARE`` and 1).
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import Future
from typing import Callable, Mapping

import numpy as np

from mmreplay.index.frame_column import FrameColumn
from mmreplay.storage.format.encoder import ShardEncoder
from mmreplay.storage.format.shardfile import build_shard, encode_chunk

MIN_CHILD_SHARE = 0.5  # the split of sealed-shard encoding between the child and the adding process
INITIAL_CHILD_SHARE = 0.85
SHARE_STEP = 0.05
CHILD_JOBS = 2  # sealed shards handed to the child at once: it starts the next as it answers one


class EncoderPipe:
    """The shard encoder child (``storage/format/encoder.py``) as the frame ring uses it: its shared buffers,
    the jobs handed to it, and the shards finished here (see the module's invariants)."""

    def __init__(self, encoder: ShardEncoder, columns: Mapping[str, FrameColumn], root: str, shard_rows: int,
                 install: Callable[[str, int, bytes], str]):
        self.encoder = encoder
        self.columns = columns
        self.root = root
        self.shard_rows = shard_rows
        self.install = install  # writes a column's shard file and tells the readers; returns its path
        self.child_share = INITIAL_CHILD_SHARE  # fraction of a sealed shard's chunks the child encodes
        self._free_outputs: list[dict[str, np.ndarray]] = []  # where the child encodes a job's head chunks

    def start(self) -> dict[str, np.ndarray]:
        """Every shared buffer the child will ever use, allocated now: each column's ``staging``, one spare
        staging set (returned), and the outputs of ``CHILD_JOBS`` jobs; then the child starts (it imports numpy
        & co. while the first shard fills). ``OSError`` when shared memory is short."""
        for col in self.columns.values():
            col.staging = self._new_buffer(col)
        spare = self.new_buffers()
        self._free_outputs = [self._new_outputs() for _ in range(CHILD_JOBS)]
        self.encoder.start()
        return spare

    def shard_nbytes(self) -> int:
        """Shared memory one staging set takes."""
        return sum(self.shard_rows * max(1, col.row_nbytes) for col in self.columns.values())

    def new_buffers(self) -> dict[str, np.ndarray]:
        return {name: self._new_buffer(col) for name, col in self.columns.items()}

    def spare_buffers(self) -> dict[str, np.ndarray] | None:
        """Another staging set, or None when it would leave less than half of shared memory free (or the
        allocation fails): more sealed shards only speed adds up."""
        if not _shared_memory_to_spare(self.shard_nbytes()):
            return None
        try:
            return self.new_buffers()
        except OSError:
            return None

    def can_take(self) -> bool:
        """Whether the child has room for another job (fewer than ``CHILD_JOBS`` in hand)."""
        return bool(self._free_outputs)

    def hand_over(self, file: int, buffers: Mapping[str, np.ndarray]):
        """Give the child the head chunks of the sealed shard in ``buffers`` (file shard ``file``; ``can_take``
        first): ``(future, head_chunks, outputs)``, which ``finish`` takes."""
        head_chunks = {name: max(1, round(self.child_share * self.shard_rows // col.spec.chunk_rows))
                       for name, col in self.columns.items()}
        jobs = [{"path": col.layout.shard_file(self.root, file), "rows": self.shard_rows,
                 "chunk_rows": col.spec.chunk_rows, "codec": dict(col.spec.codec),
                 "head_chunks": head_chunks[name]} for name, col in self.columns.items()]
        outputs = self._free_outputs.pop()
        try:
            future = self.encoder.submit(jobs, [buffers[name] for name in self.columns],
                                         [outputs[name] for name in self.columns])
        except OSError as exc:  # the child cannot take it (it died, e.g. of a Ctrl-C): ``finish`` encodes it here
            future = Future()
            future.set_exception(exc)
        return future, head_chunks, outputs

    def finish(self, file: int, buffers: Mapping[str, np.ndarray], future, head_chunks: dict,
               outputs: dict) -> list[str]:
        """Encode the tail of each column's shard here, take the head from the child, write the files (their
        paths returned), and move the split so neither side waits for the other: on 2 cores with lz4hc, the
        child alone bounds the add rate, while the adding process idles here. ``outputs`` is free again."""
        t0 = time.perf_counter()
        tails = {}
        try:
            for name, col in self.columns.items():
                n_chunks = self.shard_rows // col.spec.chunk_rows
                tails[name] = _encode_chunks(col, buffers[name], head_chunks[name], n_chunks)
        finally:  # the child's reply is always read, or the next one would be taken for it
            t1 = time.perf_counter()
            try:
                heads = self._encoded_heads(buffers, future, head_chunks, outputs)
            finally:
                self._free_outputs.append(outputs)
        waited = time.perf_counter() - t1
        written = [self.install(name, file, build_shard(heads[name] + tails[name])) for name in self.columns]
        # Feedback: waited for the child -> take more chunks here; the child was done first -> give it more.
        tail_s = t1 - t0
        if waited > 0.1 * tail_s + 1e-4:
            self.child_share = max(MIN_CHILD_SHARE, self.child_share - SHARE_STEP)
        elif waited < 1e-4:
            self.child_share = min(1.0, self.child_share + SHARE_STEP)
        return written

    def close(self) -> None:
        """Stop the child; its shared buffers (the staging sets and outputs) go with it."""
        self._free_outputs = []
        self.encoder.close()

    def _encoded_heads(self, buffers, future, head_chunks: dict, outputs: dict) -> dict[str, list[bytes]]:
        """Per column, the head chunks the child encoded; if it failed, they are encoded here from the sealed
        buffers, which nothing wrote since ``hand_over``."""
        try:
            sizes = future.result()
        except OSError as exc:
            warnings.warn(f"mmreplay: the shard encoder process failed ({exc}); encoding its part of the shard "
                          "here instead", RuntimeWarning, stacklevel=2)
            return {name: _encode_chunks(col, buffers[name], 0, head_chunks[name])
                    for name, col in self.columns.items()}
        heads = {}
        for name, col_sizes in zip(self.columns, sizes):
            out = outputs[name]
            ends = np.cumsum(col_sizes)
            heads[name] = [out[e - s:e].tobytes() for s, e in zip(col_sizes, ends.tolist())]
        return heads

    def _new_buffer(self, col: FrameColumn) -> np.ndarray:
        return self.encoder.allocate((self.shard_rows, *col.spec.shape), col.spec.np_dtype)

    def _new_outputs(self) -> dict[str, np.ndarray]:
        """Shared buffers the child encodes a shard's head chunks into (worst case: incompressible)."""
        outputs = {}
        for name, col in self.columns.items():
            n_chunks = self.shard_rows // col.spec.chunk_rows
            chunk_nbytes = col.row_nbytes * col.spec.chunk_rows
            outputs[name] = self.encoder.allocate((n_chunks * (chunk_nbytes + chunk_nbytes // 64 + 256),), np.uint8)
        return outputs


def _encode_chunks(col: FrameColumn, rows: np.ndarray, first: int, end: int) -> list[bytes]:
    """Chunks ``first..end-1`` of a shard's ``rows`` of ``col``, encoded as its array stores them."""
    c, compressor = col.spec.chunk_rows, col.array.compressor
    return [encode_chunk(compressor, rows[i * c:(i + 1) * c]) for i in range(first, end)]


def _shared_memory_to_spare(nbytes: int, path: str = "/dev/shm") -> bool:
    """Whether ``nbytes`` more of shared memory leave at least half of it free: more sealed shards only speed
    adds up, and must not take what DataLoader workers or other stores need (a container's /dev/shm may
    be 64 MB)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - nbytes >= st.f_blocks * st.f_frsize // 2
