"""The frame ring: every distinct observation stored once, on disk, shard by shard.

Invariants:
- Frames have global ids ``0, 1, 2, ...``; frame ``f`` lives in row ``f % rows`` (``rows`` fixed for a
  ring, grown by doubling when unbounded). Frames ``[oldest, head)`` are readable; ``head - oldest <= rows``.
- The shard holding row ``head`` is the *staging shard*: its rows live in RAM (``FrameColumn.staging``) and
  reads of them are served from there. The shards before it may be *sealed* (``sealed``, a ``SealedShards``):
  full, being encoded and written in the background, oldest first, by a thread or by the encoder child
  (``EncoderPipe``), and read from their RAM copies until their writes finished; all within the last lap
  of the ring, so no two of them (nor the staging shard) are one file. Adds wait only when
  ``sealed.max_sealed`` are sealed; a commit waits for all of them (``flush``), so what it covers is on
  disk as before, and a seal never depends on anything but this process (``index/sealed_shards.py``).
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

from typing import Callable, Mapping, Sequence

import numpy as np

from mmreplay.codecs import known_to_new_processes
from mmreplay.columns.spec import ColumnSpec
from mmreplay.errors import CorruptDataError
from mmreplay.index.frame_column import FrameColumn
from mmreplay.index.sealed_shards import SealedShards
from mmreplay.storage.format import shared_segments
from mmreplay.storage.format.encoder import ShardEncoder


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


class FrameRing:
    """The ring of distinct observation frames of one store (one ``FrameColumn`` per observation key).

    Invariant (the module's, in short): frames ``[oldest, head)`` are readable, ``head - oldest <= rows``;
    the shard holding ``head`` lives in RAM (``staging``), the full shards before it still being written are
    ``sealed`` (read from RAM until written), and every other shard is read from its file. A file is
    replaced only after ``before_overwrite`` returned.
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
        self._writable = writable
        self.staging_damage: dict[str, list] = {}  # column -> [(chunk, error)] of the staging shard (readers)
        # the encoder child finds only codecs a new process finds (a plug-in passed to ``register`` alone is not)
        in_child = all(known_to_new_processes(s.codec.get("name")) for s in specs)
        child = ShardEncoder.for_rows(total_row_bytes, root, encoder) if writable and in_child else None
        # shards being written, oldest first (the encoder child's shared buffers are allocated here)
        self.sealed = SealedShards(self.columns, root, shard_rows, child, self._install, self.written.extend)
        if child is None:  # whoever opens the store next removes a killed writer's staging buffers (the encoder too)
            shared_segments.remove_orphans(root)

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
        # a sealed shard a lap behind the one entered next shares its file: written first
        self.sealed.make_room(self.staging_shard + 1 - self.rows // self.shard_rows)
        self._check_overwrite(self.staging_shard)
        buffers = {name: col.staging for name, col in self.columns.items()}
        spare = self.sealed.seal(self.staging_shard, self.file_shard(self.staging_shard), buffers)
        for name, col in self.columns.items():
            col.staging = spare[name]
        self.dirty = False
        self.staging_shard += 1
        self._enter_shard(self.staging_shard)
        self.sealed.pump()

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
        self.sealed.wait_all()

    def _check_overwrite(self, global_shard: int) -> None:
        if not self.unbounded and global_shard * self.shard_rows >= self.rows:
            self.before_overwrite()  # this file still holds the previous lap's frames

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
        the staging shard and the sealed ones until their writes finished."""
        shards = {} if name in self.staging_damage else {self.file_shard(self.staging_shard): self.columns[name].staging}
        for entry in tuple(self.sealed.entries):  # a snapshot: the background loader asks without the store's lock
            shards[entry.file] = entry.buffers[name]
        return shards

    def close(self) -> None:
        try:
            self.sealed.close()  # every sealed shard written; the encoder child's shared buffers go with it
        finally:
            for col in self.columns.values():
                col.array.close()
