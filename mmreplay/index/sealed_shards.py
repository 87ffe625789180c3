"""Full frame shards sealed by the writer: encoded and written in the background, oldest first, their rows
read from RAM until their files hold them.

Invariants:
- ``entries`` are the sealed shards not yet retired, oldest first; an entry's ``buffers`` are not written
  until it is retired (its file written, or its write failed), and then become a spare staging set. What
  reads them without the store's lock takes a snapshot (``tuple(entries)``).
- Without the encoder child a thread writes each shard (one at a time, in order) and at most one is sealed;
  with it (``pipe``, ``index/encoder_pipe.py``) up to ``max_sealed``: as many as ``SEALED_BUFFER_BYTES`` of
  shared buffers hold, lowered to what is sealed when shared memory runs short. ``make_room`` retires shards
  until another may be sealed, and first every shard a lap behind the one the writer enters next (that
  shard's file must hold it before its rows are given up and replaced), so no two sealed shards (nor the
  staging shard) are one file.
- A seal never depends on anything but this process: when the writer thread's pool refuses work
  (interpreter exit) the shard is written here, and when the encoder child fails its part is encoded
  here, so ``wait_all`` (a commit, even at exit) always completes, raising the first write's error.
- The paths of the files written go to ``record`` on the thread that retires the shard (never from the
  writer thread), so a commit fsyncs only files whose writes finished.
"""

from __future__ import annotations

import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import numpy as np

from mmreplay.index.encoder_pipe import EncoderPipe
from mmreplay.index.frame_column import FrameColumn, heap_buffer
from mmreplay.storage.format.encoder import ShardEncoder

#: shared memory that shards sealed for the encoder child may hold (their rows and encoded heads): the
#: child encodes them while adds go on, and adds wait only when this much is queued. A collector's batch
#: of a few thousand Atari frames (~35 MB) then costs a copy, not the encoding (issue 24, TorchRL extend).
SEALED_BUFFER_BYTES = 96 << 20


@dataclass(eq=False)
class SealedShard:
    """A full shard waiting to be written (``future`` None), or being written: by the writer thread
    (``head_chunks`` None), or by the encoder child and this process (the child's share in ``head_chunks``)."""

    shard: int  # global shard number
    file: int  # its file shard
    buffers: dict[str, np.ndarray]
    future: Any = None  # the thread's Future or the child's PendingShard
    head_chunks: dict[str, int] | None = None
    outputs: dict[str, np.ndarray] | None = field(default=None, repr=False)


class SealedShards:
    """The queue of sealed frame shards of one ring (see the module's invariants)."""

    def __init__(self, columns: Mapping[str, FrameColumn], root: str, shard_rows: int, encoder: ShardEncoder | None,
                 install: Callable[[str, int, bytes], str], record: Callable[[list[str]], Any]):
        self.columns = columns
        self.shard_rows = shard_rows
        self.install = install  # writes a column's shard file and tells the readers; returns its path
        self.record = record  # takes the paths of files written (to fsync at the next commit)
        self.entries: list[SealedShard] = []
        self.spares: list[dict[str, np.ndarray]] = []  # staging sets free to take the next shard's rows
        self.max_sealed = 1
        self.pipe: EncoderPipe | None = None
        self._executor: ThreadPoolExecutor | None = None
        if encoder is not None:
            self._start(EncoderPipe(encoder, columns, root, shard_rows, install))

    def _start(self, pipe: EncoderPipe) -> None:
        """Allocate the encoder child's shared buffers now, so that too little shared memory shows here, not in
        the middle of adds: then shards are encoded by a thread instead (slower adds, same files)."""
        try:
            self.spares.append(pipe.start())
        except OSError as exc:
            pipe.close()
            self.spares = []
            for col in self.columns.values():
                col.staging = heap_buffer(col.spec, self.shard_rows)
            warnings.warn(f"mmreplay: no room in shared memory for the shard encoder ({exc}); encoding shards in a "
                          "thread instead (adds are slower; a larger /dev/shm restores the encoder process)",
                          RuntimeWarning, stacklevel=5)
            return
        self.pipe = pipe
        self.max_sealed = max(1, SEALED_BUFFER_BYTES // max(1, pipe.shard_nbytes()))

    def seal(self, shard: int, file: int, buffers: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Queue full shard ``shard`` (file shard ``file``) whose rows are ``buffers`` (``make_room`` first);
        returns the staging set the next shard's rows go to."""
        entry = SealedShard(shard, file, buffers)
        if self.pipe is None:
            entry.future = self._submit_write(file, buffers)
        self.entries.append(entry)
        if self.spares:
            return self.spares.pop()
        if self.pipe is not None:
            return self.pipe.new_buffers()
        return {name: heap_buffer(col.spec, self.shard_rows) for name, col in self.columns.items()}

    # -- the child takes the oldest (CHILD_JOBS at a time); this process the newest when it must wait
    def pump(self) -> None:
        """Encoder child: finish the shards whose jobs it has done (oldest first), then hand it the oldest
        waiting ones while it has room. Never blocks."""
        if self.pipe is None:
            return
        for entry in [e for e in self.entries if e.future is not None]:
            if not _ready(entry.future):
                break
            self._finish(entry)
        for entry in [e for e in self.entries if e.future is None]:
            if not self.pipe.can_take():
                break
            entry.future, entry.head_chunks, entry.outputs = self.pipe.hand_over(entry.file, entry.buffers)

    def make_room(self, lap_behind: int) -> None:
        """Before a shard is sealed: retire sealed shards until another may be sealed (fewer than ``max_sealed``
        and a spare staging set), and first, oldest first, those numbered ``lap_behind`` or less (a lap behind
        the shard the writer enters next: one file)."""
        while self.entries:
            if self.entries[0].shard <= lap_behind:
                self._retire_oldest()
            elif len(self.entries) >= self.max_sealed or not self._spare_free():
                self._work_off_one()
            else:
                return

    def wait_all(self) -> None:
        """Block until every sealed shard is on disk (raising what a write raised; the others are still
        finished)."""
        try:
            while self.entries:
                self._work_off_one()
        finally:
            while self.entries:  # a write failed: finish the rest, the first error stands
                try:
                    self._work_off_one()
                except Exception:
                    pass

    def close(self) -> None:
        """``wait_all``, then the writer thread and the encoder child stop (the shared staging sets go with the
        child: the columns' ``staging`` too)."""
        try:
            self.wait_all()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self.pipe is not None:
                for col in self.columns.values():
                    col.staging = None
                self.spares = []
                self.pipe.close()

    def _work_off_one(self) -> None:
        """Retire at least one sealed shard: with the encoder child, encode the newest one nobody took here
        (while the child works on the oldest), else wait for the child's; without, wait for the thread."""
        if self.pipe is None:
            self._finish(self.entries[0])
            return
        self.pump()
        waiting = [e for e in self.entries if e.future is None]
        if waiting:
            self._write_here(waiting[-1])
        elif self.entries:
            self._finish(self.entries[0])

    def _retire_oldest(self) -> None:
        entry = self.entries[0]
        if entry.future is not None or self.pipe is None:
            self._finish(entry)
        else:
            self._write_here(entry)

    def _finish(self, entry: SealedShard) -> None:
        """Wait for the write of ``entry`` (finishing it here for the encoder child's jobs)."""
        try:
            if entry.head_chunks is None:
                self.record(entry.future.result())
            else:
                self.record(self.pipe.finish(entry.file, entry.buffers, entry.future, entry.head_chunks,
                                             entry.outputs))
        finally:
            self._retire(entry)

    def _write_here(self, entry: SealedShard) -> None:
        try:
            self.record(self._write_buffers(entry.file, entry.buffers))
        finally:
            self._retire(entry)

    def _retire(self, entry: SealedShard) -> None:
        """``entry`` is written (or failed): its rows are read from the file from now on, its buffers reused."""
        self.entries.remove(entry)
        self.spares.append(dict(entry.buffers))

    def _spare_free(self) -> bool:
        """A spare staging set is free or could be allocated now; shared memory that runs short caps
        ``max_sealed`` at what is sealed, and never fails an add."""
        if self.spares or self.pipe is None:
            return True
        spare = self.pipe.spare_buffers()
        if spare is None:
            self.max_sealed = max(1, len(self.entries))
            return False
        self.spares.append(spare)
        return True

    def _submit_write(self, shard: int, buffers: Mapping[str, np.ndarray]) -> Future:
        """Write a sealed shard on the writer thread, or here once ``concurrent.futures`` refuses new work:
        it does from the start of interpreter exit, before the store's exit commit runs (see
        ``storage/durability/forking.py``), and in a thread still adding after the main thread finished."""
        try:
            if self._executor is None:
                self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmreplay-writer")
            return self._executor.submit(self._write_buffers, shard, buffers)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future = Future()
            try:
                done.set_result(self._write_buffers(shard, buffers))
            except Exception as exc:  # raised by wait_all, as from the writer thread
                done.set_exception(exc)
            return done

    def _write_buffers(self, shard: int, buffers: Mapping[str, np.ndarray]) -> list[str]:
        return [self.install(name, shard, col.array.encode_shard(buffers[name], self.shard_rows))
                for name, col in self.columns.items()]


def _ready(future) -> bool:
    """Whether waiting for ``future`` (a Future, or the encoder child's PendingShard) would return at once."""
    return future.done() if isinstance(future, Future) else future.ready()
