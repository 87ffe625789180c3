"""The frame ring: every distinct observation stored once, on disk, shard by shard.

Invariants:
- Frames have global ids ``0, 1, 2, ...``; frame ``f`` lives in row ``f % rows`` (``rows`` fixed for a
  ring, grown by doubling when unbounded). Frames ``[oldest, head)`` are readable; ``head - oldest <= rows``.
- The shard holding row ``head`` is the *staging shard*: its rows live in RAM (``staging``) and reads of
  them are served from there. The shards before it may be *sealed*: full, being encoded and written in
  the background, oldest first, and read from their RAM copies until their writes finished. At most one
  is sealed when a thread encodes (small rows); with the encoder child (image rows) up to
  ``max_sealed``: as many as ``SEALED_BUFFER_BYTES`` of shared buffers hold, all within the last lap of
  the ring (the writer enters no shard whose previous lap is still sealed), so no two of them (nor the
  staging shard) are one file. Adds wait only when that many are
  sealed; a commit waits for all of them (``flush``), so what it covers is on disk as before. A seal
  never depends on anything but this process: when the writer thread's pool refuses work (interpreter
  exit) the adding thread writes the shard itself, and when the encoder child fails its part is encoded
  here, so a commit at exit always completes.
  Every other shard is read from its file through the chunk cache.
- Entering a shard that holds frames of the previous lap first gives those frames up (``oldest`` moves
  past the shard, ``on_invalidate`` tells the store) and drops them from the cache; the file itself is
  replaced only after ``before_overwrite`` returned (the store commits the new ``oldest`` first, so a
  crash never leaves a commit pointing at overwritten frames).
- Whoever reads frames (``reading/frames.py``) is told through ``listener`` (a ``FrameEvents``) of every
  shard written (with its bytes), every shard whose file changed elsewhere, rows about to be replaced, and
  growth; this module never reads frames back except the staging rows it reloads at open. Damage there
  stays local (``load_staging``): a reader reads that column's staging shard from its file instead
  (``ram_shards`` leaves it out, so a damaged chunk raises when read), a writer refuses to open.
"""

from __future__ import annotations

import os
import time
import warnings
from dataclasses import dataclass, field
from typing import Any
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import numpy as np

from mmreplay.codecs import known_to_new_processes
from mmreplay.columns.spec import ColumnSpec
from mmreplay.errors import CorruptDataError
from mmreplay.storage.format import shared_segments
from mmreplay.storage.format.encoder import ShardEncoder
from mmreplay.storage.format.layout import frame_layout
from mmreplay.storage.format.sharded import ShardedArray
from mmreplay.storage.format.shardfile import build_shard, encode_chunk

MIN_CHILD_SHARE = 0.5  # the split of sealed-shard encoding between the child and the adding process
INITIAL_CHILD_SHARE = 0.85
SHARE_STEP = 0.05
#: shared memory that shards sealed for the encoder child may hold (their rows and encoded heads): the
#: child encodes them while adds go on, and adds wait only when this much is queued. A collector's batch
#: of a few thousand Atari frames (~35 MB) then costs a copy, not the encoding (issue 24, TorchRL extend).
SEALED_BUFFER_BYTES = 96 << 20
CHILD_JOBS = 2  # sealed shards handed to the child at once: it starts the next as it answers one


class FrameEvents:
    """What a frame reader needs to hear from the ring (all no-ops here). ``shard_written`` comes while the
    shard's rows are still readable from RAM (staging or sealed), possibly from the writer thread."""

    def shard_written(self, name: str, shard: int, raw: bytes) -> None:
        """File shard ``shard`` of column ``name`` now holds ``raw``."""

    def shards_changed(self, shards) -> None:
        """These file shards' files were (or are about to be) replaced: anything read from them is stale."""

    def rows_replaced(self, lo: int, hi: int) -> None:
        """Array rows [lo, hi) are about to get new frames."""

    def grown(self, rows: int) -> None:
        """The (unbounded) ring now has ``rows`` rows."""

    def cleared(self) -> None:
        """Forget everything read so far."""


@dataclass(eq=False)
class _Sealed:
    """A full shard waiting to be written (``future`` None), or being written: by the writer thread
    (``head_chunks`` None), or by the encoder child and this process (the child's share in ``head_chunks``)."""

    shard: int  # global shard number
    file: int  # its file shard
    buffers: dict[str, np.ndarray]
    future: Any = None  # the thread's Future or the child's PendingShard
    head_chunks: dict[str, int] | None = None
    outputs: dict[str, np.ndarray] | None = field(default=None, repr=False)


class FrameColumn:
    """One observation key: its on-disk array and staging block."""

    def __init__(self, root: str, spec: ColumnSpec, rows: int, shard_rows: int):
        self.spec = spec
        self.row_nbytes = spec.row_nbytes  # a property that costs microseconds: read per batch
        self.layout = frame_layout(spec, rows, shard_rows)
        self.array = ShardedArray(root, self.layout)
        self.staging = np.zeros((shard_rows, *spec.shape), dtype=spec.np_dtype)


class FrameRing:
    """The ring of distinct observation frames of one store (one ``FrameColumn`` per observation key).

    Invariant (the module's, in short): frames ``[oldest, head)`` are readable, ``head - oldest <= rows``;
    the shard holding ``head`` lives in RAM (``staging``), at most one full shard before it is being sealed
    (encoded and written in the background, read from RAM until written), and every other shard is read
    from its file. A file is replaced only after ``before_overwrite`` returned.
    """

    def __init__(self, root: str, specs: Sequence[ColumnSpec], rows: int, shard_rows: int, *, unbounded: bool,
                 head: int = 0, oldest: int = 0, writable: bool = True, encoder: str = "process"):
        if rows % shard_rows:
            raise ValueError(f"frame rows {rows} must be a multiple of shard rows {shard_rows}")
        self.root = root
        self.rows = rows
        self.shard_rows = shard_rows
        self.unbounded = unbounded
        total_row_bytes = sum(max(1, s.row_nbytes) for s in specs)
        self.columns = {s.name: FrameColumn(root, s, rows, shard_rows) for s in specs}
        self.head = head
        self.oldest = oldest
        self.staging_shard = head // shard_rows  # global shard number (not modulo the ring)
        self.dirty = False  # staging holds rows not yet in its file
        self.before_overwrite: Callable[[], None] = lambda: None
        self.on_invalidate: Callable[[int], None] = lambda oldest: None
        self.on_grow: Callable[[int], None] = lambda rows: None
        self.listener = FrameEvents()
        self.written: list[str] = []  # files written since the last commit (to fsync)
        self._sealed: list[_Sealed] = []  # shards being written, oldest first
        self._child_share = INITIAL_CHILD_SHARE  # fraction of a sealed shard's chunks the child encodes
        self._spares: list[dict[str, np.ndarray]] = []  # staging buffers free to take the next shard's rows
        self._free_outputs: list[dict[str, np.ndarray]] = []  # where the child encodes a job's head chunks
        self.max_sealed = 1  # see the module invariant; raised once the encoder child's buffers exist
        self._executor: ThreadPoolExecutor | None = None
        self._writable = writable
        self.staging_damage: dict[str, list] = {}  # column -> [(chunk, error)] of the staging shard (readers)
        # the encoder child finds only codecs a new process finds (a plug-in passed to ``register`` alone is not)
        in_child = all(known_to_new_processes(s.codec.get("name")) for s in specs)
        self._encoder = ShardEncoder.for_rows(total_row_bytes, root, encoder) if writable and in_child else None
        if self._encoder is not None:
            self._start_encoder()
        else:  # whoever opens the store next removes a killed writer's staging buffers (the encoder does too)
            shared_segments.remove_orphans(root)

    def _start_encoder(self) -> None:
        """Every shared buffer the encoder child will ever use, allocated now (two staging shards and the
        encoded head per column), so that too little shared memory shows here, not in the middle of adds:
        then shards are encoded by a thread instead (slower adds, same files)."""
        try:
            for col in self.columns.values():
                col.staging = self._new_buffer(col)
            self._spares.append(self._new_buffers())
            self._free_outputs = [self._new_outputs() for _ in range(CHILD_JOBS)]
            self._encoder.start()  # the child imports numpy & co. while the first shard fills
        except OSError as exc:
            self._encoder.close()
            self._encoder = None
            self._spares, self._free_outputs = [], []
            for col in self.columns.values():
                col.staging = np.zeros((self.shard_rows, *col.spec.shape), dtype=col.spec.np_dtype)
            warnings.warn(f"mmreplay: no room in shared memory for the shard encoder ({exc}); encoding shards in a "
                          "thread instead (adds are slower; a larger /dev/shm restores the encoder process)",
                          RuntimeWarning, stacklevel=4)
            return
        per_shard = sum(map(self._staging_nbytes, self.columns.values()))
        self.max_sealed = max(1, SEALED_BUFFER_BYTES // max(1, per_shard))

    # -- geometry ---------------------------------------------------------------------------------
    def row_of(self, frame_ids: np.ndarray) -> np.ndarray:
        return frame_ids if self.unbounded else frame_ids % self.rows

    def shard_start(self, global_shard: int) -> int:
        return global_shard * self.shard_rows

    # -- writing ----------------------------------------------------------------------------------
    def append(self, values: Mapping[str, np.ndarray]) -> int:
        """Store ``n`` frames per key (arrays of shape (n, *shape)); returns the first new frame id."""
        n = len(next(iter(values.values())))
        first = self.head
        self._forget_open_chunks(first, first + n)
        done = 0
        while done < n:
            offset = self.head - self.shard_start(self.staging_shard)
            take = min(n - done, self.shard_rows - offset)
            for name, col in self.columns.items():
                col.staging[offset:offset + take] = values[name][done:done + take]
            self.head += take
            done += take
            self.dirty = True
            if offset + take == self.shard_rows:
                self._finish_staging_shard()
        return first

    def _forget_open_chunks(self, lo: int, hi: int) -> None:
        """Cached copies of chunks that rows [lo, hi) are about to extend are stale (multi-row chunks only;
        staging rows are cached straight from RAM, so a chunk may have been cached half filled)."""
        if hi <= lo or max(col.spec.chunk_rows for col in self.columns.values()) == 1:
            return
        first_row = int(self.row_of(np.int64(lo)))
        self.listener.rows_replaced(first_row, first_row + (hi - lo))

    def flush(self) -> None:
        """Write the staging shard (partial) so a commit can cover every frame up to ``head``."""
        self.wait_sealed()
        if self.dirty:
            self._check_overwrite(self.staging_shard)
            shard = self.file_shard(self.staging_shard)
            n_rows = self.head - self.shard_start(self.staging_shard)
            for name, col in self.columns.items():
                self.written.append(self._install(name, shard, col.array.encode_shard(col.staging, n_rows)))
            self.dirty = False

    def _finish_staging_shard(self) -> None:
        """Seal the full staging shard: it is encoded and written in the background while adds go on
        (by the encoder child process for image rows, else by a thread)."""
        self._make_room()
        self._check_overwrite(self.staging_shard)
        buffers = {name: col.staging for name, col in self.columns.items()}
        entry = _Sealed(self.staging_shard, self.file_shard(self.staging_shard), buffers)
        if self._encoder is None:
            entry.future = self._submit_write(entry.file, buffers)
        self._sealed.append(entry)
        spare = self._spares.pop() if self._spares else self._new_buffers()
        for name, col in self.columns.items():
            col.staging = spare[name]
        self.dirty = False
        self.staging_shard += 1
        self._enter_shard(self.staging_shard)
        self._pump()

    # -- sealed shards: the child takes the oldest (CHILD_JOBS at a time); this process the newest when it must wait
    def _pump(self) -> None:
        """Encoder child: finish the shards whose jobs it has done (oldest first), then hand it the oldest
        waiting ones while it has fewer than ``CHILD_JOBS``. Never blocks."""
        if self._encoder is None:
            return
        busy = [e for e in self._sealed if e.future is not None]
        for entry in busy:
            if not _ready(entry.future):
                break
            self._finish(entry)
        for entry in [e for e in self._sealed if e.future is None]:
            if not self._free_outputs:
                break
            self._hand_to_child(entry)

    def _hand_to_child(self, entry: "_Sealed") -> None:
        """The child encodes the first chunks of the shard; this process encodes the rest when it finishes
        the shard (see ``_finish_split_shard``) and writes the file."""
        entry.head_chunks = {name: max(1, round(self._child_share * self.shard_rows // col.spec.chunk_rows))
                             for name, col in self.columns.items()}
        jobs = [{"path": col.layout.shard_file(self.root, entry.file), "rows": self.shard_rows,
                 "chunk_rows": col.spec.chunk_rows, "codec": dict(col.spec.codec),
                 "head_chunks": entry.head_chunks[name]} for name, col in self.columns.items()]
        entry.outputs = self._free_outputs.pop()
        entry.future = self._submit_to_encoder(jobs, entry.buffers, entry.outputs)

    def _work_off_one(self) -> None:
        """Retire at least one sealed shard: with the encoder child, encode the newest one nobody took here
        (while the child works on the oldest), else wait for the child's; without, wait for the thread."""
        if self._encoder is None:
            self._finish(self._sealed[0])
            return
        self._pump()
        waiting = [e for e in self._sealed if e.future is None]
        if waiting:
            entry = waiting[-1]
            try:
                self.written.extend(self._write_buffers(entry.file, entry.buffers))
            finally:
                self._retire(entry)
        elif self._sealed:
            self._finish(self._sealed[0])

    def _finish(self, entry: "_Sealed") -> None:
        """Wait for the write of ``entry`` (finishing it here for the encoder child's jobs)."""
        try:
            if entry.head_chunks is None:
                self.written.extend(entry.future.result())
            else:
                self._finish_split_shard(entry.file, entry.buffers, entry.future, entry.head_chunks, entry.outputs)
        finally:
            self._retire(entry)

    def _retire(self, entry: "_Sealed") -> None:
        """``entry`` is written (or failed): its rows are read from the file from now on, its buffers reused."""
        self._sealed.remove(entry)
        self._spares.append(dict(entry.buffers))
        if entry.outputs is not None:
            self._free_outputs.append(entry.outputs)

    def _make_room(self) -> None:
        """Before sealing the staging shard: retire sealed shards until another may be sealed (fewer than
        ``max_sealed`` and a spare staging buffer), and the oldest first while it is a lap behind the shard
        the writer enters next: that shard's file must hold it before its rows are given up and replaced."""
        while self._sealed:
            if self._sealed[0].shard <= self.staging_shard + 1 - self.rows // self.shard_rows:
                self._retire_oldest()
            elif len(self._sealed) >= self.max_sealed or not self._spare_free():
                self._work_off_one()
            else:
                return

    def _retire_oldest(self) -> None:
        entry = self._sealed[0]
        if entry.future is not None or self._encoder is None:
            self._finish(entry)
            return
        try:
            self.written.extend(self._write_buffers(entry.file, entry.buffers))
        finally:
            self._retire(entry)

    def _spare_free(self) -> bool:
        """A spare staging set is free or could be allocated now; shared memory that runs short caps
        ``max_sealed`` at what is sealed, and never fails an add."""
        if self._spares or self._encoder is None:
            return True
        if not _shared_memory_to_spare(sum(map(self._staging_nbytes, self.columns.values()))):
            self.max_sealed = max(1, len(self._sealed))
            return False
        try:
            self._spares.append(self._new_buffers())
        except OSError:
            self.max_sealed = max(1, len(self._sealed))
            return False
        return True

    def _new_buffers(self) -> dict[str, np.ndarray]:
        return {name: self._new_buffer(col) for name, col in self.columns.items()}

    def _new_outputs(self) -> dict[str, np.ndarray]:
        """Shared buffers the child encodes a shard's head chunks into (worst case: incompressible)."""
        return {name: self._encoder.allocate((self._output_nbytes(col),), np.uint8)
                for name, col in self.columns.items()}

    def _staging_nbytes(self, col: FrameColumn) -> int:
        return self.shard_rows * max(1, col.row_nbytes)

    def _output_nbytes(self, col: FrameColumn) -> int:
        n_chunks = self.shard_rows // col.spec.chunk_rows
        chunk_nbytes = col.row_nbytes * col.spec.chunk_rows
        return n_chunks * (chunk_nbytes + chunk_nbytes // 64 + 256)

    def _submit_to_encoder(self, jobs: list[dict], buffers: Mapping[str, np.ndarray], outputs: Mapping[str, np.ndarray]):
        """The head chunks of a sealed shard, to the encoder child; a child that cannot take them (it died,
        e.g. of a Ctrl-C) gives a future that fails, and ``_finish_split_shard`` encodes them here."""
        try:
            return self._encoder.submit(jobs, [buffers[name] for name in self.columns],
                                        [outputs[name] for name in self.columns])
        except OSError as exc:
            return _failed(exc)

    def _submit_write(self, shard: int, buffers: Mapping[str, np.ndarray]) -> Future:
        """Write a sealed shard on the writer thread, or here once ``concurrent.futures`` refuses new work:
        it does from the start of interpreter exit, before the store's exit commit runs (see
        ``storage/durability/forking.py``), and in a thread still adding after the main thread finished."""
        try:
            return self._writer().submit(self._write_buffers, shard, buffers)
        except RuntimeError:  # "cannot schedule new futures after (interpreter) shutdown"
            done: Future = Future()
            try:
                done.set_result(self._write_buffers(shard, buffers))
            except Exception as exc:  # raised by wait_sealed, as from the writer thread
                done.set_exception(exc)
            return done

    def _new_buffer(self, col: FrameColumn) -> np.ndarray:
        shape = (self.shard_rows, *col.spec.shape)
        if self._encoder is not None:
            return self._encoder.allocate(shape, col.spec.np_dtype)
        return np.zeros(shape, dtype=col.spec.np_dtype)

    def _write_buffers(self, shard: int, buffers: Mapping[str, np.ndarray]) -> list[str]:
        return [self._install(name, shard, col.array.encode_shard(buffers[name], self.shard_rows))
                for name, col in self.columns.items()]

    def _install(self, name: str, shard: int, raw: bytes) -> str:
        """Write a shard's bytes and tell the listener; returns the file's path (to fsync)."""
        array = self.columns[name].array
        raw = array.tagged(shard, raw)  # the file's bytes, identity tag included
        path = array.install_shard(shard, raw, tagged=True)
        self.listener.shard_written(name, shard, raw)
        return path

    def wait_sealed(self) -> None:
        """Block until every sealed shard is on disk (raising what a write raised; the others are still
        finished)."""
        try:
            while self._sealed:
                self._work_off_one()
        finally:
            while self._sealed:  # a write failed: finish the rest, the first error stands
                try:
                    self._work_off_one()
                except Exception:
                    pass

    def _finish_split_shard(self, shard: int, buffers, future, head_chunks: dict, outputs: dict) -> None:
        """Encode the tail of each column's sealed shard here, take the head from the child, write the file,
        and move the split so neither side waits for the other: on 2 cores with lz4hc, the child alone
        bounds the add rate, while the adding process idles here."""
        t0 = time.perf_counter()
        tails = {}
        try:
            for name, col in self.columns.items():
                c = col.spec.chunk_rows
                compressor = col.array.compressor
                tails[name] = [encode_chunk(compressor, buffers[name][i * c:(i + 1) * c])
                               for i in range(head_chunks[name], self.shard_rows // c)]
        finally:  # the child's reply is always read, or the next one would be taken for it
            t1 = time.perf_counter()
            heads = self._encoded_heads(buffers, future, head_chunks, outputs)
        waited = time.perf_counter() - t1
        for name in self.columns:
            self.written.append(self._install(name, shard, build_shard(heads[name] + tails[name])))
        # Feedback: waited for the child -> take more chunks here; the child was done first -> give it more.
        tail_s = t1 - t0
        if waited > 0.1 * tail_s + 1e-4:
            self._child_share = max(MIN_CHILD_SHARE, self._child_share - SHARE_STEP)
        elif waited < 1e-4:
            self._child_share = min(1.0, self._child_share + SHARE_STEP)

    def _encoded_heads(self, buffers, future, head_chunks: dict, outputs: dict) -> dict[str, list[bytes]]:
        """Per column, the head chunks the child encoded; if it failed (it died: a Ctrl-C at the terminal,
        an OOM kill), they are encoded here from the sealed buffers, which nothing wrote since ``submit``:
        the shard, and a commit at exit that waits for it, never depend on the child."""
        try:
            sizes = future.result()
        except OSError as exc:
            warnings.warn(f"mmreplay: the shard encoder process failed ({exc}); encoding its part of the shard "
                          "here instead", RuntimeWarning, stacklevel=2)
            heads = {}
            for name, col in self.columns.items():
                c, compressor = col.spec.chunk_rows, col.array.compressor
                heads[name] = [encode_chunk(compressor, buffers[name][i * c:(i + 1) * c])
                               for i in range(head_chunks[name])]
            return heads
        heads = {}
        for name, col_sizes in zip(self.columns, sizes):
            out = outputs[name]
            ends = np.cumsum(col_sizes)
            heads[name] = [out[e - s:e].tobytes() for s, e in zip(col_sizes, ends.tolist())]
        return heads

    def _check_overwrite(self, global_shard: int) -> None:
        if not self.unbounded and global_shard * self.shard_rows >= self.rows:
            self.before_overwrite()  # this file still holds the previous lap's frames

    def _writer(self) -> ThreadPoolExecutor:
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="mmreplay-writer")
        return self._executor

    def _enter_shard(self, global_shard: int) -> None:
        start = self.shard_start(global_shard)
        if self.unbounded:
            if start + self.shard_rows > self.rows:
                self._grow(max(2 * self.rows, start + self.shard_rows))
        elif start >= self.rows:  # this shard's rows held frames of the previous lap: give them up
            self.oldest = max(self.oldest, start + self.shard_rows - self.rows)
            self.on_invalidate(self.oldest)
            self.listener.shards_changed([self.file_shard(global_shard)])
        for col in self.columns.values():
            col.staging[...] = 0

    def file_shard(self, global_shard: int) -> int:
        return global_shard if self.unbounded else global_shard % (self.rows // self.shard_rows)

    def _grow(self, rows: int) -> None:
        rows = -(-rows // self.shard_rows) * self.shard_rows
        self.rows = rows
        self.listener.grown(rows)
        self.on_grow(rows)

    def catch_up(self, old_head: int, head: int, oldest: int, rows: int) -> None:
        """Readers: move to a newer commit. Shards written since ``old_head`` (including any the ring
        overwrote) are re-read from their files; cached chunks of other shards stay valid."""
        if rows > self.rows:
            self._grow(rows)
        first_shard = old_head // self.shard_rows
        last_shard = -(-head // self.shard_rows)
        n_files = self.rows // self.shard_rows
        if not self.unbounded and last_shard - first_shard >= n_files:
            changed = set(range(n_files))  # the writer went round the whole ring
        else:
            changed = {self.file_shard(s) for s in range(first_shard, last_shard)}
        for col in self.columns.values():
            col.array.forget(changed)
        self.listener.shards_changed(sorted(changed))
        self.head, self.oldest = head, oldest
        self.staging_shard = head // self.shard_rows
        self.load_staging()

    def drop_cached(self) -> None:
        """Forget every cached chunk and shard index (readers, after a load that broke off)."""
        for col in self.columns.values():
            col.array.forget()
        self.listener.cleared()

    def load_staging(self) -> None:
        """After open: bring the committed rows of the staging shard back into RAM. Damage there stays
        local: a reader keeps reading that column's staging shard from its file (each damaged chunk raises
        ``CorruptDataError`` when read, the rest reads); a writer refuses to open, since its next commit
        would rewrite the shard from RAM without the damaged rows."""
        self.staging_damage = {}
        offset = self.head - self.shard_start(self.staging_shard)
        if offset == 0:
            return
        shard = self.file_shard(self.staging_shard)
        row0 = shard * self.shard_rows
        for name, col in self.columns.items():
            damaged = []
            col.staging[:offset] = col.array.read_rows(row0, row0 + offset, damaged)
            if damaged:
                self.staging_damage[name] = damaged
        if self.staging_damage and self._writable:
            first = next(iter(self.staging_damage.values()))[0][1]
            raise CorruptDataError(
                f"{first}; this is the partly filled shard {shard} that a writer continues and rewrites from RAM at "
                "its next commit, which would lose the damaged rows: open the store with mode='r' to read every "
                "intact row (verify() lists the damage), or restore the shard file from a backup")

    # -- rows still in RAM -------------------------------------------------------------------------
    def ram_shards(self, name: str) -> dict[int, np.ndarray]:
        """{file shard: its rows} for the shards of ``name`` whose rows are read from RAM, not their file:
        the staging shard and the sealed one until its write finished."""
        shards = {} if name in self.staging_damage else {self.file_shard(self.staging_shard): self.columns[name].staging}
        for entry in tuple(self._sealed):  # a snapshot: the background loader asks without the store's lock
            shards[entry.file] = entry.buffers[name]
        return shards

    def close(self) -> None:
        try:
            self.wait_sealed()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._encoder is not None:
                for col in self.columns.values():
                    col.staging = None  # the shared buffers go with the encoder
                self._spares, self._free_outputs = [], []
                self._encoder.close()
            for col in self.columns.values():
                col.array.close()


def _shared_memory_to_spare(nbytes: int, path: str = "/dev/shm") -> bool:
    """Whether ``nbytes`` more of shared memory leave at least half of it free: more sealed shards only speed
    adds up, and must not take what DataLoader workers or other stores need (a container's /dev/shm may
    be 64 MB)."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize - nbytes >= st.f_blocks * st.f_frsize // 2


def _ready(future) -> bool:
    """Whether waiting for ``future`` (a Future, or the encoder child's PendingShard) would return at once."""
    return future.done() if isinstance(future, Future) else future.ready()


def _failed(exc: BaseException) -> Future:
    future: Future = Future()
    future.set_exception(exc)
    return future
