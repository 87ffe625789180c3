"""The in-RAM index ring: which transitions exist, where their frames are, which are valid.

Invariants:
- Transitions have global ids ``g = 0, 1, 2, ...``; ``g`` lives in slot ``g % rows`` (``rows`` is the
  ring size, or grows by doubling when unbounded). Every per-transition column is resident here, packed
  where the schema says so; the observations themselves live in the frame ring on disk.
- ``obs_frame[slot]`` / ``next_frame[slot]`` are the global ids (mod 2**32) of the newest frame of the
  observation and of the next observation; ``prev_delta[slot]`` is ``g`` minus the global id of the
  previous transition of the same episode, 0 at an episode start.
- A transition ``g`` is valid iff ``oldest <= g < head`` and every predecessor its frame stack needs is
  ``>= oldest``. ``oldest`` is only ever advanced so that every frame a valid transition needs is still
  in the frame ring (see ``advance_past_frames``).
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np

from mmreplay.columns import packing
from mmreplay.columns.spec import ColumnSpec
from mmreplay.index.ring_scans import NO_FRAME, live_max_prev_delta, shard_min_frames
from mmreplay.storage.format.layout import RingGeometry, transition_layout
from mmreplay.storage.format.sharded import ShardedArray
from mmreplay._native import ring as kernels

U32 = np.uint32


class TransitionRing:
    """The per-transition columns of a store in RAM (packed where the schema says so) and their shard files."""

    INDEX_COLUMNS = ("obs_frame", "next_frame", "prev_delta")
    FLAG_COLUMNS = ("terminated", "truncated")

    def __init__(self, root: str, data_columns: Sequence[ColumnSpec], geometry: RingGeometry, *,
                 capacity: int | None, head: int = 0, oldest: int = 0):
        """The ring of a store at ``root`` laid out as ``geometry``, holding transitions ``[oldest, head)``
        (nothing is read from disk until ``load``); ``capacity=None``: unbounded (rows grow by doubling)."""
        rows, shard_rows = geometry.rows, geometry.shard_rows
        if rows % shard_rows or shard_rows % 8:
            raise ValueError(f"transition rows {rows} / shard rows {shard_rows} must be multiples of 8 and nest")
        self.root = root
        self.rows = rows
        self.shard_rows = shard_rows
        self.capacity = capacity  # None: unbounded
        self.head = head
        self.oldest = oldest
        self.max_prev_delta = 0
        self.specs: dict[str, ColumnSpec] = {c.name: c for c in data_columns}
        self.arrays: dict[str, np.ndarray] = {}
        self.bits: dict[str, int] = {}  # packed columns: name -> bits
        self.disk: dict[str, ShardedArray] = {}
        for name in self.INDEX_COLUMNS:
            self._add_column(name, np.dtype(U32), (), 0, None)
        for name in self.FLAG_COLUMNS:
            self._add_column(name, np.dtype(np.uint8), (), 1, (False, True))
        for spec in data_columns:
            if spec.kind == "packed":
                self._add_column(spec.name, np.dtype(np.uint8), (), spec.bits, spec.values)
            else:
                self._add_column(spec.name, spec.np_dtype, spec.shape, 0, None)
        n_shards = rows // shard_rows
        self.shard_min_frame = np.full(n_shards, NO_FRAME, dtype=np.int64)  # per file shard, this lap
        self.dirty: set[int] = set()  # global shard numbers changed since the last flush
        self.written: list[str] = []
        self.before_overwrite: Callable[[], None] = lambda: None
        self.on_grow: Callable[[int], None] = lambda rows: None
        self._valid_count_cache: tuple | None = None

    def _add_column(self, name: str, dtype: np.dtype, shape: tuple, bits: int, values) -> None:
        layout = transition_layout(name, self.rows, self.shard_rows, dtype.name, shape, bits, values)
        self.disk[name] = ShardedArray(self.root, layout)
        if bits:
            self.bits[name] = bits
            self.arrays[name] = np.zeros(packing.packed_nbytes(self.rows, bits), dtype=np.uint8)
        else:
            self.arrays[name] = np.zeros((self.rows, *shape), dtype=dtype)

    def index_nbytes_per_row(self) -> float:
        """RAM the index itself (frame pointers, episode links, flags) costs per transition."""
        return sum(self.arrays[n].itemsize for n in self.INDEX_COLUMNS) + len(self.FLAG_COLUMNS) / 8

    @property
    def nbytes(self) -> int:
        """RAM the ring's arrays take (index and data columns, all held in RAM)."""
        return sum(a.nbytes for a in self.arrays.values()) + self.shard_min_frame.nbytes

    def layouts(self):
        return [a.layout for a in self.disk.values()]

    # -- geometry ---------------------------------------------------------------------------------
    def slot(self, g):
        return g if self.capacity is None else g % self.rows

    def file_shard(self, global_shard: int) -> int:
        return global_shard if self.capacity is None else global_shard % (self.rows // self.shard_rows)

    # -- writing ----------------------------------------------------------------------------------
    def append(self, n: int, index: Mapping[str, np.ndarray], codes: Mapping[str, np.ndarray],
               frame_globals_of_obs: np.ndarray) -> int:
        """Store ``n`` transitions (index columns, flags and data columns already encoded)."""
        first = self.head
        done = 0
        while done < n:
            shard = self.head // self.shard_rows
            if self.head % self.shard_rows == 0:
                self._enter_shard(shard)
            take = min(n - done, (shard + 1) * self.shard_rows - self.head)
            slots = self.slot(np.arange(self.head, self.head + take, dtype=np.int64))
            part = slice(done, done + take)
            for name, values in index.items():
                if name in self.bits:
                    packing.write_codes(self.arrays[name], self.bits[name], slots, values[part])
                else:
                    self.arrays[name][slots] = values[part]
            for name, values in codes.items():
                if name in self.bits:
                    packing.write_codes(self.arrays[name], self.bits[name], slots, values[part])
                else:
                    self.arrays[name][slots] = values[part]
            fs = self.file_shard(shard)
            self.shard_min_frame[fs] = min(int(self.shard_min_frame[fs]), int(frame_globals_of_obs[part].min()))
            self.dirty.add(shard)
            self.head += take
            done += take
        if self.capacity is not None:
            self.oldest = max(self.oldest, self.head - self.capacity)
        delta_max = int(index["prev_delta"].max())
        if delta_max > self.max_prev_delta:
            self.max_prev_delta = delta_max
        return first

    def _enter_shard(self, global_shard: int) -> None:
        start = global_shard * self.shard_rows
        if self.capacity is None:
            if start + self.shard_rows > self.rows:
                self._grow(max(2 * self.rows, start + self.shard_rows))
        elif start >= self.rows:  # the previous lap's transitions in this shard are given up now
            self.oldest = max(self.oldest, start + self.shard_rows - self.rows)
        fs = self.file_shard(global_shard)
        self.shard_min_frame[fs] = NO_FRAME
        lo, hi = fs * self.shard_rows, (fs + 1) * self.shard_rows
        for name, arr in self.arrays.items():  # zero the shard so rows past head never show stale data
            bits = self.bits.get(name)
            if bits:
                arr[lo * bits // 8: hi * bits // 8] = 0
            else:
                arr[lo:hi] = 0

    def _grow(self, rows: int) -> None:
        rows = -(-rows // self.shard_rows) * self.shard_rows
        for name, arr in self.arrays.items():
            bits = self.bits.get(name)
            new_len = packing.packed_nbytes(rows, bits) if bits else rows
            grown = np.zeros((new_len, *arr.shape[1:]), dtype=arr.dtype)
            grown[: arr.shape[0]] = arr
            self.arrays[name] = grown
        grown_min = np.full(rows // self.shard_rows, NO_FRAME, dtype=np.int64)
        grown_min[: self.shard_min_frame.size] = self.shard_min_frame
        self.shard_min_frame = grown_min
        self.rows = rows
        self.on_grow(rows)

    def advance_past_frames(self, frame_oldest: int) -> None:
        """Frames below ``frame_oldest`` are gone: drop every transition shard that may need them."""
        shard = self.oldest // self.shard_rows
        while self.oldest < self.head and self.shard_min_frame[self.file_shard(shard)] < frame_oldest:
            self.oldest = min(self.head, (shard + 1) * self.shard_rows)
            shard += 1

    def flush(self) -> None:
        """Write every shard changed since the last flush."""
        for shard in sorted(self.dirty):
            if self.capacity is not None and shard * self.shard_rows >= self.rows:
                self.before_overwrite()  # the file still holds the previous lap
            fs = self.file_shard(shard)
            for name, disk in self.disk.items():
                lo, hi = fs * self.shard_rows, (fs + 1) * self.shard_rows
                bits = self.bits.get(name)
                data = self.arrays[name][lo * bits // 8: hi * bits // 8] if bits else self.arrays[name][lo:hi]
                self.written.append(disk.write_shard(fs, data, disk.layout.shard_rows))
        self.dirty.clear()

    def load(self, head: int, frame_head: int) -> None:
        """After open: read every committed shard back into RAM, then rebuild from the episode links in RAM,
        not from the record, what the record does not say: the longest link among transitions ``[oldest,
        head)`` (what n-step and stack-validity scans need: exact, and immune to an edited record) and each
        shard's minimum obs frame (``frame_head``: the record's, for the frame ids' high bits). The scans
        are in ``ring_scans.py``."""
        n_shards_used = -(-min(head, self.rows) // self.shard_rows) if self.capacity is not None else \
            -(-head // self.shard_rows)
        for name, disk in self.disk.items():
            bits = self.bits.get(name)
            scale = (bits / 8) if bits else 1
            for fs in range(n_shards_used):
                lo, hi = int(fs * self.shard_rows * scale), int((fs + 1) * self.shard_rows * scale)
                self.arrays[name][lo:hi] = disk.read_rows(lo, hi)
        self.max_prev_delta = live_max_prev_delta(self)
        self.shard_min_frame[:] = shard_min_frames(self, frame_head)

    def file_shard_array(self, global_shards: np.ndarray) -> np.ndarray:
        return global_shards if self.capacity is None else global_shards % (self.rows // self.shard_rows)

    # -- reading ----------------------------------------------------------------------------------
    @staticmethod
    def frame_globals(frames_u32: np.ndarray, frame_head: int) -> np.ndarray:
        """Global frame ids from their low 32 bits (every live frame is within 2**32 of the head)."""
        age = (np.uint32(frame_head & 0xFFFFFFFF) - frames_u32.astype(U32, copy=False)).astype(np.int64)
        return frame_head - age

    def read(self, name: str, g: np.ndarray) -> np.ndarray:
        """Stored values (codes for packed columns) of column ``name`` at transitions ``g``."""
        return self.read_slots(name, self.slot(g))

    def read_range(self, name: str, lo: int, hi: int, what: str = "read") -> np.ndarray:
        """Stored values of column ``name`` at transitions ``lo <= g < hi``, which must lie in ``[oldest, head)``
        (``what`` names the caller in the error)."""
        if not self.oldest <= lo <= hi <= self.head:
            raise IndexError(f"{what}({lo}, {hi}): the range must lie within the valid range "
                             f"[{self.oldest}, {self.head})")
        return self.read(name, np.arange(lo, hi, dtype=np.int64))

    def episode_links(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(prev, terminated, truncated)`` of transitions ``[lo, hi)``: ``prev`` the global id of the
        previous step of the episode (-1 at an episode start), the flags as bools."""
        delta = self.read_range("prev_delta", lo, hi, "episode_links").astype(np.int64)
        g = np.arange(lo, hi, dtype=np.int64)
        return np.where(delta > 0, g - delta, -1), self.read("terminated", g).astype(bool), \
            self.read("truncated", g).astype(bool)

    def read_slots(self, name: str, slots: np.ndarray) -> np.ndarray:
        if name in self.bits:
            return packing.read_codes(self.arrays[name], self.bits[name], slots)
        return self.arrays[name][slots]

    def read_into(self, name: str, slots: np.ndarray, out: np.ndarray, decode_table: np.ndarray | None) -> None:
        """``out[i]`` = the value of column ``name`` at ``slots[i]``: packed codes go through
        ``decode_table`` (code -> value) in one compiled pass."""
        if name in self.bits:
            packing.decode_into(self.arrays[name], self.bits[name], slots, decode_table, out)
        else:
            out[...] = self.arrays[name][slots]

    def read_flags_into(self, slots: np.ndarray, terminated: np.ndarray, truncated: np.ndarray) -> None:
        """The episode flags at ``slots`` into boolean ``terminated`` / ``truncated``, in one pass."""
        packing.bits_into(self.arrays["terminated"], self.arrays["truncated"], slots, terminated, truncated)

    def stack_frames(self, g: np.ndarray, k: int, frame_head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Frame ids of the obs stack and next-obs stack of transitions ``g`` (shape (n, k) each, oldest
        first) and a mask of which ``g`` are valid. Stacks never cross an episode start: they are
        padded by repeating the episode's first frame."""
        g = np.ascontiguousarray(g, dtype=np.int64).reshape(-1)
        obs_ids = np.empty((g.size, k), dtype=np.int64)
        next_ids = np.empty((g.size, k), dtype=np.int64)
        valid = np.empty(g.size, dtype=np.bool_)
        kernels.stack_frames(g, k, self.arrays["obs_frame"], self.arrays["next_frame"], self.arrays["prev_delta"],
                             0 if self.capacity is None else self.rows, self.oldest, self.head, frame_head,
                             obs_ids, next_ids, valid)
        return obs_ids, next_ids, valid

    def count_valid(self, k: int, frame_head: int | None = None, *, compiled: bool = True) -> int:
        """Number of valid transitions for stacks of ``k`` frames (cached until the ring changes).
        ``compiled=False`` walks the stacks in numpy instead of the compiled kernel: the same count, ~7x
        slower on the few dozen rows a sampler's check walks, but it never loads numba's compiler (~0.5 s
        of a process's first kernel call), which a one-shot tool (``mmreplay info``) does not need."""
        key = (self.head, self.oldest, k)
        if self._valid_count_cache and self._valid_count_cache[0] == key:
            return self._valid_count_cache[1]
        total = self.head - self.oldest
        if k > 1 and total > 0:
            # Only transitions whose stack may reach below ``oldest`` can be invalid.
            window = min(total, (k - 1) * max(1, self.max_prev_delta))
            g = np.arange(self.oldest, self.oldest + window, dtype=np.int64)
            if compiled:
                invalid = window - np.count_nonzero(self.stack_frames(g, k, frame_head or 0)[2])
            else:
                invalid = np.count_nonzero(self._stack_reaches_below_oldest(g, k))
            total -= int(invalid)
        self._valid_count_cache = (key, total)
        return total

    def _stack_reaches_below_oldest(self, g: np.ndarray, k: int) -> np.ndarray:
        """For transitions ``g`` (within ``[oldest, head)``): does the stack of ``k`` frames need a
        transition below ``oldest``? The walk of ``stack_frames_into``, validity only, in numpy."""
        prev_delta = self.arrays["prev_delta"]
        cur, lost = g.copy(), np.zeros(g.size, dtype=bool)
        for _ in range(k - 1):
            delta = prev_delta[self.slot(cur)].astype(np.int64)
            prev = cur - delta
            lost |= (delta > 0) & (prev < self.oldest)
            cur = np.where((delta > 0) & (prev >= self.oldest), prev, cur)  # an episode start stays put
        return lost


def as_transition_ids(indices) -> np.ndarray:
    """``indices`` (a sequence, numpy array or torch tensor of integers) as a flat int64 array; anything
    else (floats, bools, strings) is a ``TypeError``, never a silently truncated id."""
    if hasattr(indices, "detach"):
        indices = indices.detach().cpu().numpy()
    g = np.asarray(indices)
    if g.size and g.dtype.kind not in "iu":
        raise TypeError(f"expected integer transition ids (e.g. Batch.indices), got dtype {g.dtype}: "
                        f"{g.reshape(-1)[:4].tolist()}")
    return np.ascontiguousarray(g, dtype=np.int64).reshape(-1)
