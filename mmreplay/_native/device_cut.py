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


@numba.njit(cache=True, nogil=True)
def _select_held(p0, p1, r0, r1, pdst, prows, prefs, c, row_nbytes, want_run, want_row, out_p, out_r,
                 counts):  # pragma: no cover (compiled)
    needed = np.zeros(c, dtype=np.bool_)
    produced = np.zeros(c, dtype=np.bool_)
    ref_of = np.empty(c, dtype=np.int64)
    n_p = n_r = w = 0
    for i in range(p0.size):
        ref_of[:] = -2  # -2: the row is not in the entry
        for j in range(r0[i], r1[i]):
            ref_of[prows[j]] = prefs[j]
        needed[:] = False
        while w < want_run.size and want_run[w] == i:
            needed[want_row[w]] = True
            w += 1
        for _ in range(c + 1):  # needed rows, their references, and the rows their pieces produce: to a fixed point
            for k in range(c):
                if needed[k]:
                    m = k
                    while m >= 0 and ref_of[m] >= 0 and not needed[ref_of[m]]:
                        needed[ref_of[m]] = True
                        m = ref_of[m]
            produced[:] = False
            for p in range(p0[i], p1[i]):
                lo, hi = pdst[p, 0] // row_nbytes, (pdst[p, 1] + row_nbytes - 1) // row_nbytes
                if needed[lo:hi].any():
                    produced[lo:hi] = True
            grew = False
            for k in range(c):
                if produced[k] and not needed[k]:
                    needed[k] = True
                    grew = True
            if not grew:
                break
        start_p, start_r = n_p, n_r
        for p in range(p0[i], p1[i]):
            lo = pdst[p, 0] // row_nbytes
            if produced[lo]:
                out_p[n_p] = p
                n_p += 1
        for j in range(r0[i], r1[i]):
            if produced[prows[j]]:
                out_r[n_r] = j
                n_r += 1
        counts[i, 0], counts[i, 1] = n_p - start_p, n_r - start_r
    return n_p, n_r


def select_held(p0: np.ndarray, p1: np.ndarray, r0: np.ndarray, r1: np.ndarray, pdst: np.ndarray, prows: np.ndarray,
                prefs: np.ndarray, c: int, row_nbytes: int, rows: list):
    """Of held chunks' pieces (entry ``i``: pieces ``p0[i]:p1[i]`` decoding to ``pdst``, rows ``r0[i]:r1[i]`` with
    their references ``prefs``, chunk-relative), those a batch needs for rows ``rows[i]`` and the rows they lead to:
    ``(piece indices, row indices, counts)``, each chunk's in order. Inputs checked before the kernel runs."""
    n = p0.size
    if not (p1.size == r0.size == r1.size == len(rows) == n) or pdst.ndim != 2 or prows.shape != prefs.shape \
            or c < 1 or row_nbytes < 1:
        raise ValueError(f"select_held: {n} entries with {p1.size}/{r0.size}/{r1.size} ranges and {len(rows)} row "
                         f"lists, {pdst.shape} pieces, {prows.shape}/{prefs.shape} rows; expected one of each an entry")
    if n and ((p1 < p0).any() or p1.max() > len(pdst) or (r1 < r0).any() or r1.max() > prows.size):
        raise ValueError("select_held: a piece or row range outside the arrays")
    if n:
        rix, pix = ranges_of(r0, r1), ranges_of(p0, p1)
        if (prows[rix] < 0).any() or (prows[rix] >= c).any() or (prefs[rix] >= c).any() or (pdst[pix] < 0).any() \
                or (pdst[pix] > c * row_nbytes).any():
            raise ValueError(f"select_held: a row, reference or piece outside its chunk of {c} rows")
    lens = np.fromiter(map(len, rows), dtype=np.int64, count=n)
    want_row = np.concatenate(rows).astype(np.int64) if n else np.zeros(0, dtype=np.int64)
    if want_row.size and (want_row.min() < 0 or want_row.max() >= c):
        raise ValueError(f"select_held: rows asked for outside 0..{c - 1}")
    out_p = np.empty(int((p1 - p0).sum()), dtype=np.int64)
    out_r = np.empty(int((r1 - r0).sum()), dtype=np.int64)
    counts = np.zeros((n, 2), dtype=np.int64)
    n_p, n_r = _select_held(p0, p1, r0, r1, np.ascontiguousarray(pdst), prows, prefs, c, row_nbytes,
                            np.repeat(np.arange(n, dtype=np.int64), lens), want_row, out_p, out_r, counts)
    return out_p[:n_p], out_r[:n_r], counts


def ranges_of(starts: np.ndarray, ends: np.ndarray) -> np.ndarray:
    lens = ends - starts
    if not lens.size:
        return np.zeros(0, dtype=np.int64)
    return np.repeat(starts - np.r_[0, np.cumsum(lens)[:-1]], lens) + np.arange(int(lens.sum()), dtype=np.int64)
