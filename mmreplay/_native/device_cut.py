"""The device path's cut of a batch's temporal runs of layouts 2 and 3 (``codecs/temporal_device.device_runs_many``)
in one compiled call: every header check, the references followed, the pieces listed.

Invariant: ``cut_runs`` reads only inside ``buf`` (every offset is bounds-checked: a byte past the end reads as
zero, as ``codecs.base.read_le`` reads it) and returns ``OK`` with the pieces exactly when the array version's every
check passes (the run's frame count, frame size, magic, length, references inside the run and ending at a frame
coded alone, frame ends non-decreasing and summing to the payload, each frame's first word and a zstd frame's
declared size): else ``FAIL`` and the caller's loop names what is wrong. The pieces are in the loop's order (runs
in order, rows ascending): for each row a batch needs and each row its references lead to.

Why compiled: the array version costs ~2 ms a DMC batch-256 (about 330 runs of 16 frames, a dozen numpy calls a
header field and a loop per chain step); the host side of a device batch has ~2 ms in all.
"""

from __future__ import annotations

import numba
import numpy as np

OK, FAIL = 0, 1
FCS = np.array([0, 2, 4, 8], dtype=np.int64)
DICT_ID = np.array([0, 1, 2, 4], dtype=np.int64)


@numba.njit(cache=True, nogil=True)
def _le(buf, at, width):  # pragma: no cover (compiled)
    v = 0
    for k in range(width):
        if 0 <= at + k < buf.size:
            v |= np.int64(buf[at + k]) << (8 * k)
    return v


@numba.njit(cache=True, nogil=True)
def _zstd_size(buf, at, length, zstd_magic, fcs_table, dict_table):  # pragma: no cover (compiled)
    """The content size a zstd frame at ``at`` of ``length`` bytes declares, -1 where it declares none."""
    d = _le(buf, at + 4, 1)
    single = (d >> 5) & 1
    fcs = fcs_table[d >> 6]
    if fcs == 0:
        fcs = single
    start = 5 + (1 - single) + dict_table[d & 3]
    if length < 6 or _le(buf, at, 4) != zstd_magic or fcs <= 0 or length < start + fcs:
        return -1
    return _le(buf, at + start, fcs) + (256 if fcs == 2 else 0)


@numba.njit(cache=True, nogil=True)
def _cut_runs(buf, at, length, n, row_nbytes, header, magic2, zstd_magic, want_run, want_row, fcs_table, dict_table,
              kinds, src, dst, rows, refs, per_run):  # pragma: no cover (compiled)
    """Runs ``buf[at[i]:at[i] + length[i]]`` (layouts 2/3, ``n`` frames of ``row_nbytes``), rows ``want_row[j]`` of run
    ``want_run[j]`` asked for: the pieces into ``kinds``/``src``/``dst``/``rows``/``refs`` (room for ``n`` a run),
    their count per run into ``per_run``; returns (status, pieces)."""
    r = at.size
    body = header + 5 * n
    needed = np.zeros(n, dtype=np.bool_)
    ref = np.empty(n, dtype=np.int64)
    ends = np.empty(n, dtype=np.int64)
    out = 0
    w = 0
    for i in range(r):
        a = at[i]
        if _le(buf, a, 4) != magic2 or _le(buf, a + 4, 4) != n or _le(buf, a + 8, 4) != row_nbytes \
                or length[i] < body:
            return FAIL, 0
        for j in range(n):
            b = np.int64(buf[a + header + j])
            ref[j] = b - 256 if b > 127 else b  # int8
            if j - ref[j] < 0 or j - ref[j] >= n:
                return FAIL, 0
            ends[j] = _le(buf, a + header + n + 4 * j, 4)
            if j and ends[j] < ends[j - 1]:
                return FAIL, 0
        if ends[n - 1] != length[i] - body:
            return FAIL, 0
        for j in range(n):  # every chain ends at a frame coded alone (no cycle), within n steps
            k, steps = j, 0
            while ref[k] != 0 and steps <= n:
                k -= ref[k]
                steps += 1
            if ref[k] != 0:
                return FAIL, 0
        needed[:] = False
        while w < want_run.size and want_run[w] == i:
            k = want_row[w]
            if k < 0 or k >= n:
                return FAIL, 0
            while not needed[k]:
                needed[k] = True
                k -= ref[k]
            w += 1
        count = 0
        for j in range(n):
            if not needed[j]:
                continue
            start = ends[j - 1] if j else 0
            lo = a + body + start
            size = ends[j] - start
            first = _le(buf, lo, 4)
            if size >= 4 and first != zstd_magic:  # an LZ4 block after its 4-byte decoded size
                if first != row_nbytes or size == 4:
                    return FAIL, 0
                kinds[out], src[out, 0] = 1, lo + 4
            else:
                if _zstd_size(buf, lo, size, zstd_magic, fcs_table, dict_table) != row_nbytes:
                    return FAIL, 0
                kinds[out], src[out, 0] = 0, lo
            src[out, 1] = lo + size
            dst[out, 0], dst[out, 1] = j * row_nbytes, (j + 1) * row_nbytes
            rows[out] = j
            refs[out] = j - ref[j] if ref[j] != 0 else -1
            out += 1
            count += 1
        per_run[i] = count
    return OK, out


def cut_runs(buf: np.ndarray, at: np.ndarray, length: np.ndarray, n: int, row_nbytes: int, header: int, magic2: int,
             zstd_magic: int, rows: list):
    """The kernel above, its inputs checked first (a contiguous uint8 buffer; runs inside it; rows of each run):
    ``None`` where a check of the kernel's fails, else ``(kinds, src, dst, rows, refs, per_run)``."""
    at = np.ascontiguousarray(at, dtype=np.int64)
    length = np.ascontiguousarray(length, dtype=np.int64)
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous or at.shape != length.shape \
            or len(rows) != at.size or not 0 < n <= 255:
        raise ValueError(f"cut_runs: a {buf.dtype} {buf.shape} buffer, {at.size} runs, {length.size} lengths, "
                         f"{len(rows)} row lists, {n} frames a run; expected a contiguous 1-D uint8 buffer, one "
                         "length and one row list a run, 1..255 frames")
    if at.size and (at.min() < 0 or (at + length).max() > buf.size or length.min() < 0):
        raise ValueError(f"cut_runs: runs at {at.min()}..{(at + length).max()} outside a buffer of {buf.size}")
    r = at.size
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=r)
    want_row = np.concatenate(rows).astype(np.int64) if r else np.zeros(0, dtype=np.int64)
    m = r * n
    kinds, src, dst = np.empty(m, dtype=np.int8), np.empty((m, 2), dtype=np.int64), np.empty((m, 2), dtype=np.int64)
    rows_out, refs_out, per_run = np.empty(m, dtype=np.int64), np.empty(m, dtype=np.int64), np.zeros(r, dtype=np.int64)
    status, k = _cut_runs(buf, at, length, n, row_nbytes, header, magic2, zstd_magic,
                          np.repeat(np.arange(r, dtype=np.int64), lens), want_row, FCS, DICT_ID, kinds, src, dst,
                          rows_out, refs_out, per_run)
    if status != OK:
        return None
    return kinds[:k], src[:k], dst[:k], rows_out[:k], refs_out[:k], per_run
