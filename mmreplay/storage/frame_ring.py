"""The frame ring: every distinct observation stored once, on disk, shard by shard.

Invariants:
- Frames have global ids ``0, 1, 2, ...``; frame ``f`` lives in row ``f % rows`` (``rows`` fixed for a
  ring, grown by doubling when unbounded). Frames ``[oldest, head)`` are readable; ``head - oldest <= rows``.
- The shard holding row ``head`` is the *staging shard*: its rows live in RAM (``staging``) and reads of
  them are served from there. The shard before it may be *sealed*: full, being encoded and written by a
  background thread (at most one at a time), and read from its RAM copy until that write finished.
  Every other shard is read from its file through the chunk cache.
- Entering a shard that holds frames of the previous lap first gives those frames up (``oldest`` moves
  past the shard, ``on_invalidate`` tells the store) and drops them from the cache; the file itself is
  replaced only after ``before_overwrite`` returned (the store commits the new ``oldest`` first, so a
  crash never leaves a commit pointing at overwritten frames).
"""

from __future__ import annotations

import os
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Mapping, Sequence

import numpy as np

from mmreplay.columns.spec import ColumnSpec
from mmreplay.reading.cache import ChunkCache
from mmreplay.reading.gather import gather_cached, gather_stacks
from mmreplay.storage import forking
from mmreplay.storage.encoder import ShardEncoder
from mmreplay.storage.layout import frame_layout
from mmreplay.storage.sharded import ShardedArray
from mmreplay.storage.shardfile import build_shard, encode_chunk

# Below this, handing the copy to two threads costs more than it saves. Measured with PER steps on Atari
# stacks: batch-32 (0.9 MB per output) 4,010 steps/s inline vs 2,613 split; batch-256 (7.2 MB) 852 split vs
# 665 inline.
PARALLEL_GATHER_BYTES = 4 << 20
# Misses are decoded inline: half of a miss is GIL-holding Python, so pool threads mostly took turns
# (17.8 us per miss through the pool vs 6.9 us inline; batch-256 1.5x faster inline at a 75% hit rate).
# Only very large miss counts (a cold store, big batches) are split across the codec threads.
PARALLEL_MIN_CHUNKS = 4096
MIN_CHILD_SHARE = 0.5  # the split of sealed-shard encoding between the child and the adding process
INITIAL_CHILD_SHARE = 0.85
SHARE_STEP = 0.05
_POOL: ThreadPoolExecutor | None = None


def decode_pool() -> ThreadPoolExecutor:
    """One process-wide pool: numcodecs releases the GIL, so decoding scales across cores."""
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2), thread_name_prefix="mmreplay-codec")
    return _POOL


def _forget_pool() -> None:
    global _POOL
    _POOL = None  # a forked child has none of the pool's threads: make a new pool on first use


forking.on_fork(_forget_pool)


class FrameColumn:
    """One observation key: its on-disk array, staging block and decoded-chunk cache."""

    def __init__(self, root: str, spec: ColumnSpec, rows: int, shard_rows: int, cache_bytes: int):
        self.spec = spec
        self.row_nbytes = spec.row_nbytes  # a property that costs microseconds: read per batch
        self.layout = frame_layout(spec, rows, shard_rows)
        self.array = ShardedArray(root, self.layout)
        self.staging = np.zeros((shard_rows, *spec.shape), dtype=spec.np_dtype)
        self.cache = ChunkCache(rows // spec.chunk_rows, (spec.chunk_rows, *spec.shape), spec.np_dtype, cache_bytes)

    def fill_missing(self, chunks: np.ndarray, slots: np.ndarray, ram_chunk) -> np.ndarray:
        """Bring the chunks the cache lacks into it — copied from RAM (``ram_chunk(name, chunk)``) when
        they are in the staging or sealed shard, else decoded from their file. Returns all slots. If any
        read fails (I/O error, corrupt chunk), none of the chunks admitted here stays cached: their slots
        would hold whatever was there before, and later hits would return it as data."""
        missing = np.unique(chunks[slots < 0])
        new_slots = self.cache.admit(missing)
        try:
            self._fill_slots(missing, new_slots, ram_chunk)
        except BaseException:
            self.cache.forget(missing)
            raise
        return self.cache.slot_of[chunks]

    def _fill_slots(self, missing: np.ndarray, new_slots: np.ndarray, ram_chunk) -> None:
        slab = self.cache.slab
        to_decode = []
        for chunk, slot in zip(missing.tolist(), new_slots.tolist()):
            in_ram = ram_chunk(self.spec.name, chunk)
            if in_ram is None:
                to_decode.append((chunk, slot))
            else:
                slab[slot] = in_ram
        read = self.array.read_chunk

        def decode_all(pairs) -> None:
            for chunk, slot in pairs:
                read(chunk, slab[slot])

        if len(to_decode) >= PARALLEL_MIN_CHUNKS:  # one task per worker: per-task overhead is ~20 us
            workers = decode_pool()._max_workers
            groups = [to_decode[i::workers] for i in range(workers)]
            list(decode_pool().map(decode_all, groups))
        else:
            decode_all(to_decode)


class FrameRing:
    def __init__(self, root: str, specs: Sequence[ColumnSpec], rows: int, shard_rows: int, *, unbounded: bool,
                 cache_bytes: int, head: int = 0, oldest: int = 0, writable: bool = True):
        if rows % shard_rows:
            raise ValueError(f"frame rows {rows} must be a multiple of shard rows {shard_rows}")
        self.root = root
        self.rows = rows
        self.shard_rows = shard_rows
        self.unbounded = unbounded
        total_row_bytes = sum(max(1, s.row_nbytes) for s in specs)
        self.columns = {s.name: FrameColumn(root, s, rows, shard_rows, cache_bytes * max(1, s.row_nbytes)
                                            // total_row_bytes) for s in specs}
        self.head = head
        self.oldest = oldest
        self.staging_shard = head // shard_rows  # global shard number (not modulo the ring)
        self.dirty = False  # staging holds rows not yet in its file
        self.before_overwrite: Callable[[], None] = lambda: None
        self.on_invalidate: Callable[[int], None] = lambda oldest: None
        self.on_grow: Callable[[int], None] = lambda rows: None
        self.written: list[str] = []  # files written since the last commit (to fsync)
        self._sealed: tuple | None = None  # (global shard, buffers, future, file shard, head chunks) being written
        self._child_share = INITIAL_CHILD_SHARE  # fraction of a sealed shard's chunks the child encodes
        self._encoded_out: dict[str, np.ndarray] = {}
        self._spare: dict[str, np.ndarray] = {}
        self._executor: ThreadPoolExecutor | None = None
        self._encoder = ShardEncoder.for_rows(total_row_bytes) if writable else None
        if self._encoder is not None:
            self._start_encoder()

    def _start_encoder(self) -> None:
        """Every shared buffer the encoder child will ever use, allocated now (two staging shards and the
        encoded head per column), so that too little shared memory shows here, not in the middle of adds:
        then shards are encoded by a thread instead (slower adds, same files)."""
        try:
            for col in self.columns.values():
                col.staging = self._new_buffer(col)
                self._spare[col.spec.name] = self._new_buffer(col)
                self._encoded_out_buffer(col)
            self._encoder.start()  # the child imports numpy & co. while the first shard fills
        except OSError as exc:
            self._encoder.close()
            self._encoder = None
            self._spare, self._encoded_out = {}, {}
            for col in self.columns.values():
                col.staging = np.zeros((self.shard_rows, *col.spec.shape), dtype=col.spec.np_dtype)
            warnings.warn(f"mmreplay: no room in shared memory for the shard encoder ({exc}); encoding shards in a "
                          "thread instead (adds are slower; a larger /dev/shm restores the encoder process)",
                          RuntimeWarning, stacklevel=4)

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
        if hi <= lo:
            return
        for col in self.columns.values():
            c = col.spec.chunk_rows
            if c > 1:
                first_row = int(self.row_of(np.int64(lo)))
                col.cache.invalidate(first_row // c, first_row // c + -(-(hi - lo) // c) + 1)

    def flush(self) -> None:
        """Write the staging shard (partial) so a commit can cover every frame up to ``head``."""
        self.wait_sealed()
        if self.dirty:
            self._check_overwrite(self.staging_shard)
            shard = self._file_shard(self.staging_shard)
            n_rows = self.head - self.shard_start(self.staging_shard)
            for col in self.columns.values():
                self.written.append(col.array.write_shard(shard, col.staging, n_rows))
            self.dirty = False

    def _finish_staging_shard(self) -> None:
        """Seal the full staging shard: it is encoded and written in the background while adds go on
        (by the encoder child process for image rows, else by a thread)."""
        self.wait_sealed()
        self._check_overwrite(self.staging_shard)
        buffers = {name: col.staging for name, col in self.columns.items()}
        shard = self._file_shard(self.staging_shard)
        head_chunks = None
        if self._encoder is not None:
            # The child encodes the first chunks of the shard; this process encodes the rest when it next
            # waits for the child (see ``_finish_split_shard``) and writes the file.
            head_chunks = {name: max(1, round(self._child_share * self.shard_rows // col.spec.chunk_rows))
                           for name, col in self.columns.items()}
            jobs = [{"path": col.layout.shard_file(self.root, shard), "rows": self.shard_rows,
                     "chunk_rows": col.spec.chunk_rows, "codec": dict(col.spec.codec),
                     "head_chunks": head_chunks[name]} for name, col in self.columns.items()]
            future = self._encoder.submit(jobs, [buffers[name] for name in self.columns],
                                          [self._encoded_out_buffer(col) for col in self.columns.values()])
        else:
            future = self._writer().submit(self._write_buffers, shard, buffers)
        self._sealed = (self.staging_shard, buffers, future, shard, head_chunks)
        for name, col in self.columns.items():
            col.staging = self._spare.pop(name, None)
            if col.staging is None:
                col.staging = self._new_buffer(col)
        self.dirty = False
        self.staging_shard += 1
        self._enter_shard(self.staging_shard)

    def _new_buffer(self, col: FrameColumn) -> np.ndarray:
        shape = (self.shard_rows, *col.spec.shape)
        if self._encoder is not None:
            return self._encoder.allocate(shape, col.spec.np_dtype)
        return np.zeros(shape, dtype=col.spec.np_dtype)

    def _write_buffers(self, shard: int, buffers: Mapping[str, np.ndarray]) -> list[str]:
        return [col.array.write_shard(shard, buffers[name], self.shard_rows) for name, col in self.columns.items()]

    def wait_sealed(self) -> None:
        """Block until the sealed shard is on disk (raising what its write raised)."""
        if self._sealed is None:
            return
        _, buffers, future, shard, head_chunks = self._sealed
        try:
            if head_chunks is None:
                self.written.extend(future.result())
            else:
                self._finish_split_shard(shard, buffers, future, head_chunks)
        finally:
            self._sealed = None
            self._spare = dict(buffers)
            if head_chunks is None and self._encoder is not None:  # another process wrote the file
                for col in self.columns.values():
                    col.array.forget([shard])

    def _encoded_out_buffer(self, col: FrameColumn) -> np.ndarray:
        """Shared buffer the child encodes a shard's head chunks into (worst case: incompressible)."""
        buf = self._encoded_out.get(col.spec.name)
        if buf is None:
            n_chunks = self.shard_rows // col.spec.chunk_rows
            chunk_nbytes = col.row_nbytes * col.spec.chunk_rows
            buf = self._encoded_out[col.spec.name] = self._encoder.allocate(
                (n_chunks * (chunk_nbytes + chunk_nbytes // 64 + 256),), np.uint8)
        return buf

    def _finish_split_shard(self, shard: int, buffers, future, head_chunks: dict) -> None:
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
            sizes = future.result()
        waited = time.perf_counter() - t1
        for (name, col), col_sizes in zip(self.columns.items(), sizes):
            out = self._encoded_out[name]
            ends = np.cumsum(col_sizes)
            head = [out[e - s:e].tobytes() for s, e in zip(col_sizes, ends.tolist())]
            self.written.append(col.array.install_shard(shard, build_shard(head + tails[name])))
        # Feedback: waited for the child -> take more chunks here; the child was done first -> give it more.
        tail_s = t1 - t0
        if waited > 0.1 * tail_s + 1e-4:
            self._child_share = max(MIN_CHILD_SHARE, self._child_share - SHARE_STEP)
        elif waited < 1e-4:
            self._child_share = min(1.0, self._child_share + SHARE_STEP)

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
            file_shard = self._file_shard(global_shard)
            for col in self.columns.values():
                c = col.spec.chunk_rows
                col.cache.invalidate(file_shard * self.shard_rows // c, (file_shard + 1) * self.shard_rows // c)
        for col in self.columns.values():
            col.staging[...] = 0

    def _file_shard(self, global_shard: int) -> int:
        return global_shard if self.unbounded else global_shard % (self.rows // self.shard_rows)

    def _grow(self, rows: int) -> None:
        rows = -(-rows // self.shard_rows) * self.shard_rows
        self.rows = rows
        for col in self.columns.values():
            col.cache.grow_address_space(rows // col.spec.chunk_rows)
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
            changed = {self._file_shard(s) for s in range(first_shard, last_shard)}
        for col in self.columns.values():
            col.array.forget(changed)
            c = col.spec.chunk_rows
            for fs in changed:
                col.cache.invalidate(fs * self.shard_rows // c, (fs + 1) * self.shard_rows // c)
        self.head, self.oldest = head, oldest
        self.staging_shard = head // self.shard_rows
        self.load_staging()

    def drop_cached(self) -> None:
        """Forget every cached chunk and shard index (readers, after a load that broke off)."""
        for col in self.columns.values():
            col.cache.clear()
            col.array.forget()

    def load_staging(self) -> None:
        """After open: bring the committed rows of the staging shard back into RAM."""
        offset = self.head - self.shard_start(self.staging_shard)
        if offset == 0:
            return
        row0 = self._file_shard(self.staging_shard) * self.shard_rows
        for col in self.columns.values():
            col.staging[:offset] = col.array.read_rows(row0, row0 + offset)

    # -- reading ----------------------------------------------------------------------------------
    def gather(self, name: str, frame_ids: np.ndarray, out: np.ndarray) -> None:
        """``out[...] = frame[frame_ids]`` (``out`` shaped ``frame_ids.shape + frame shape``).

        The caller guarantees ``oldest <= frame_ids < head``.
        """
        col = self.columns[name]
        flat = col.cache.slab.reshape(col.cache.n_slots * col.spec.chunk_rows, *col.spec.shape)
        index = self._slab_index(col, frame_ids.reshape(-1))
        out[...] = np.take(flat, index, axis=0, mode="clip").reshape(out.shape)

    def gather_stacks(self, name: str, obs_ids: np.ndarray, next_ids: np.ndarray, obs_words: np.ndarray,
                      next_words: np.ndarray, *, shifted: bool = True) -> None:
        """Frames ``obs_ids[i, j]`` into row ``i * k + j`` of ``obs_words`` and likewise for ``next_ids``:
        the outputs are (n * k, words) views of the batch tensors in the words of ``stack_words``. With
        ``shifted`` (as a transition's two stacks are) ``next_ids[:, :-1] == obs_ids[:, 1:]`` and only the
        last column of ``next_ids`` is read; otherwise (n-step: the next stack is a later transition's)
        all of it. Each frame is looked up once, and both outputs are filled straight from the cache slab."""
        col = self.columns[name]
        cache = col.cache
        n, k = obs_ids.shape
        # 8-byte words when rows allow (Atari's 7,056-byte frames do): the copy loops run at memcpy speed
        slab = cache.slab_words(col.row_nbytes)
        big = n > 1 and n * k * col.row_nbytes >= PARALLEL_GATHER_BYTES
        if not big:  # the common case, every frame cached: lookup, LRU marks and copy in one compiled pass
            cache.tick += 1
            hits = gather_cached(cache.slot_of, cache.last_used, cache.tick, 0 if self.unbounded else self.rows,
                                  col.spec.chunk_rows, slab, obs_ids, next_ids, shifted, obs_words, next_words)
            if hits >= 0:
                cache.stats.hits += hits
                return
        union = np.concatenate([obs_ids, next_ids[:, -1:] if shifted else next_ids], axis=1)
        index = self._slab_index(col, union.reshape(-1)).reshape(n, union.shape[1])
        slab = cache.slab_words(col.row_nbytes)  # filling misses may have grown the slab
        if big:
            # Big copies: the two halves of the batch at once on the codec threads (the kernel releases the
            # GIL). Not torch.index_select: its OpenMP workers spin while idle, and measured here, whenever
            # the codec threads or other processes (env workers, a trainer) wanted the cores too, the copy
            # became 5-15x slower (e.g. 63 instead of 886 Atari batch-256/s).
            h = n // 2
            parts = ((0, h), (h, n))
            list(decode_pool().map(lambda p: gather_stacks(slab, index[p[0]:p[1]], k, shifted,
                                                            obs_words[p[0] * k:p[1] * k],
                                                            next_words[p[0] * k:p[1] * k]), parts))
        else:
            gather_stacks(slab, index, k, shifted, obs_words, next_words)

    @staticmethod
    def stack_words(out: np.ndarray, row_nbytes: int) -> np.ndarray:
        """A batch buffer of stacks ``(n, [k,] *frame shape)`` as (n * k, words) for ``gather_stacks``."""
        word = np.uint64 if row_nbytes % 8 == 0 else np.uint8
        return out.view(np.uint8).reshape(-1, row_nbytes).view(word)

    def _slab_index(self, col: FrameColumn, ids: np.ndarray) -> np.ndarray:
        """Rows of the cache's flat slab holding frames ``ids`` (decoding the missing chunks first)."""
        c = col.spec.chunk_rows
        slab_rows, chunks, n_hit = col.cache.lookup_rows(ids, 0 if self.unbounded else self.rows, c)
        if n_hit < ids.size:
            rows = self.row_of(ids)
            slots = col.cache.slot_of[chunks]
            slots = col.fill_missing(chunks, slots, self._ram_chunk).astype(np.int64)
            slab_rows = slots if c == 1 else slots * c + rows % c
        return slab_rows

    def _ram_chunk(self, name: str, chunk: int) -> np.ndarray | None:
        """Chunk ``chunk`` (file rows) if it lies in the staging or the sealed shard, else None."""
        c = self.columns[name].spec.chunk_rows
        file_shard, offset = divmod(chunk * c, self.shard_rows)
        if file_shard == self._file_shard(self.staging_shard):
            return self.columns[name].staging[offset:offset + c]
        if self._sealed is not None and file_shard == self._file_shard(self._sealed[0]):
            return self._sealed[1][name][offset:offset + c]
        return None

    def read_frame(self, name: str, frame_id: int) -> np.ndarray:
        col = self.columns[name]
        out = np.empty((1, *col.spec.shape), dtype=col.spec.np_dtype)
        self.gather(name, np.array([frame_id], dtype=np.int64), out)
        return out[0]

    def close(self) -> None:
        try:
            self.wait_sealed()
        finally:
            if self._executor is not None:
                self._executor.shutdown(wait=True)
            if self._encoder is not None:
                for col in self.columns.values():
                    col.staging = None  # the shared buffers go with the encoder
                self._spare = {}
                self._encoder.close()
            for col in self.columns.values():
                col.array.close()
