"""Partial reads of temporal runs from their files: a directory, in RAM, of the layout-2 (and -3) runs the disk
path has read, so that a later miss reads only the bytes of the frames it needs.

Invariant: a frame decoded from a partial read is returned only if the crc32c of each zstd frame on its chain
equals the one recorded here, and what is recorded here was computed from bytes whose whole-chunk checksum
(and, where the file's identity tag lists one, the listed checksum) had just matched. A partial read is made
only when the entry describes the chunk the file's index now points at (same offset, size, and listed
checksum when the tag lists one); a stale entry that slips through (a file replaced in place by a writer,
an entry torn by two threads) fails its frame checksums, and the caller then reads the whole run, whose chunk
checksum decides: corrupt bytes are ``CorruptDataError``, never frames.

Why: layout 2 (``codecs/temporal.py``) codes each frame as its own zstd frame, chains running out from the
run's middle, and lists where each frame's bytes end in the run's header. A sample (frame stack 3, n-step 3)
needs 6 consecutive frames, and those need the frames between them and the key: ~60% of a run of 16 (85 KB
of DMC colour frames). Reading the header first would cost a dependent read per miss (the device's latency,
twice); this directory holds what the header says and the frames' checksums instead, built the first time
the disk path reads a run whole (then verified by its chunk checksum): ~170 bytes a run of 16 frames, ~11 MB
for 1M frames, counted against the frame budget (``TierPlanner.plan_columns``). Checksums: the chunk's crc32c covers
the whole chunk, so a partial read cannot check it; zarr's bytes are unchanged, so the frames' own checksums
live here, not in the file.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import numpy as np

from mmreplay._native import runs as kernels


@dataclass
class PartialPlan:
    """Per chunk asked for: frames ``first..last`` read (``first`` -1: the whole chunk), bytes ``[lo, hi)``
    of the chunk."""
    first: np.ndarray
    last: np.ndarray
    lo: np.ndarray
    hi: np.ndarray


class RunDirectory:
    """What the headers of the runs read from files say, and their frames' checksums (see the module
    invariant); one per temporal column read through the disk path, rows indexed by the array's chunk."""

    def __init__(self, n_chunks: int, run_rows: int):
        self.run_rows = int(run_rows)
        self._lock = threading.Lock()
        self._alloc(int(n_chunks))

    def _alloc(self, n: int) -> None:
        r = self.run_rows
        self.offset = np.full(n, -1, dtype=np.int64)  # file offset of the chunk the entry describes
        self.size = np.zeros(n, dtype=np.int64)
        self.crc = np.zeros(n, dtype=np.int64)  # the chunk's stored checksum (its last 4 bytes)
        self.n = np.zeros(n, dtype=np.uint8)  # frames in the run; 0: no entry
        self.refs = np.zeros((n, r), dtype=np.int8)
        self.bounds = np.zeros((n, r + 1), dtype=np.uint32)
        self.fcrc = np.zeros((n, r), dtype=np.uint32)

    @staticmethod
    def entry_nbytes(run_rows: int) -> int:
        return 8 + 8 + 8 + 1 + run_rows + 4 * (run_rows + 1) + 4 * run_rows

    @classmethod
    def planned_nbytes(cls, n_chunks: int, run_rows: int) -> int:
        return n_chunks * cls.entry_nbytes(run_rows)

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.offset, self.size, self.crc, self.n, self.refs, self.bounds, self.fcrc))

    @property
    def entries(self) -> int:
        return int(np.count_nonzero(self.n))

    def grow(self, n_chunks: int) -> None:
        """Room for ``n_chunks`` chunks (an unbounded ring grew); entries kept."""
        if n_chunks <= self.offset.size:
            return
        with self._lock:
            old = (self.offset, self.size, self.crc, self.n, self.refs, self.bounds, self.fcrc)
            self._alloc(n_chunks)
            for new, was in zip((self.offset, self.size, self.crc, self.n, self.refs, self.bounds, self.fcrc), old):
                new[:was.shape[0]] = was

    def forget(self, lo: int, hi: int) -> None:
        """No entry for chunks ``[lo, hi)`` (their rows are rewritten)."""
        with self._lock:
            self.n[max(0, lo):max(0, hi)] = 0
            self.offset[max(0, lo):max(0, hi)] = -1

    def forget_chunks(self, chunks: np.ndarray) -> None:
        with self._lock:
            self.n[chunks] = 0
            self.offset[chunks] = -1

    def clear(self) -> None:
        with self._lock:
            self.n[:] = 0
            self.offset[:] = -1

    def plan(self, chunks, starts, js, offsets, sizes, listed) -> PartialPlan:
        """Which bytes of each chunk to read (``kernels.plan_partial``): chunk ``chunks[g]`` lies at
        ``offsets[g]`` in its file, ``sizes[g]`` bytes, its tag listing checksum ``listed[g]`` (-1: none), and
        frames ``js[starts[g]:starts[g + 1]]`` of it are wanted."""
        g = chunks.size
        first, last = np.empty(g, dtype=np.int64), np.empty(g, dtype=np.int64)
        lo, hi = np.empty(g, dtype=np.int64), np.empty(g, dtype=np.int64)
        kernels.checked_plan_partial(chunks, starts, js, offsets, sizes, listed, (self.n, self.refs, self.bounds,
                                     self.offset, self.size, self.crc), first, last, lo, hi)
        return PartialPlan(first, last, lo, hi)

    def record(self, chunks, buffer: np.ndarray, pos, sizes, offsets) -> int:
        """Entries for whole chunks just read and decoded (their checksums matched): chunk ``chunks[g]``,
        ``sizes[g]`` bytes at ``buffer[pos[g]:]``, from file offset ``offsets[g]``. Returns how many were
        made (layout-1 runs get none)."""
        if not chunks.size:
            return 0
        if chunks.min() < 0 or chunks.max() >= self.n.size:
            raise ValueError(f"chunks {int(chunks.min())}..{int(chunks.max())} outside the directory's {self.n.size}")
        if (sizes < 4).any() or (pos < 0).any() or (pos + sizes > buffer.size).any():
            raise ValueError("chunks to record must lie in the buffer, each at least its checksum long")
        crcs = np.zeros(chunks.size, dtype=np.int64)
        for k in range(4):  # the little-endian checksum that ends each chunk
            crcs |= buffer[pos + sizes - 4 + k].astype(np.int64) << (8 * k)
        src = buffer.ctypes.data + pos
        with self._lock:
            self.offset[chunks] = -1  # no plan matches a half-made entry
            made = kernels.checked_index_runs(src, sizes, chunks, buffer, self.n, self.refs, self.bounds, self.fcrc)
            self.size[chunks] = sizes
            self.crc[chunks] = crcs
            self.offset[chunks] = offsets
        return int(made)

    def decode(self, src, plan_first, plan_last, chunks, starts, js, dsts, frame_nbytes, run_rows, status,
               into, helpers=None) -> int:
        """``kernels.decode_partial_groups`` (shared with the codec ``helpers`` when given and free), its
        requests checked first (``kernels.check_partial_decodes``); the number of groups that failed
        (``status`` says which)."""
        return kernels.checked_decode_partial_groups(src, plan_first, plan_last, chunks, starts, js, dsts, frame_nbytes,
                                                     run_rows, (self.n, self.refs, self.bounds, self.fcrc), status,
                                                     into, helpers)

