"""Compiled kernels of partial run reads: what a layout-2 (or -3) temporal run's directory entry holds, which bytes of
the run a batch needs, and the decode of those bytes alone (``reading/runs.py`` keeps the entries).

Invariant: ``decode_partial_groups`` writes a frame to its destination only after the crc32c of every zstd
frame on its chain matched the one the directory recorded for it, every frame on the chain lies within the
frames read, and zstd produced exactly ``frame_nbytes`` bytes for each; anything else is a nonzero status
(the caller then reads the whole run, whose chunk checksum decides). ``index_runs`` records an entry only
from a run whose chunk checksum the caller's decode has just matched (it is handed only those).

An entry (row ``r`` of the directory's arrays): ``n[r]`` frames (0: no entry), ``refs[r, :n]`` the signed
references of the run's header, ``bounds[r, :n + 1]`` where each frame's zstd frame starts within the chunk
(``bounds[r, f + 1]`` is where it ends; ``bounds[r, 0]`` is the header's size), ``fcrc[r, :n]`` the crc32c
of each frame's zstd bytes.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import intrinsics, kernel_cache, linked, run_decode
from mmreplay._native.bounds import check_array, check_indices, span
from mmreplay._native import temporal_header as temporal
from mmreplay._native.decode import check_frame_decodes
from mmreplay._native.intrinsics import address
from mmreplay._native.linked import BAD_SIZE, OK, crc32c, zstd_create_dctx, zstd_free_dctx
from mmreplay._native.run_decode import TEMPORAL_HEADER, TEMPORAL_MAGIC2, decode_chains
from mmreplay._native.selftest import ensure_linked

kernel_cache.follow(__file__, run_decode, linked, intrinsics, temporal)  # the kernels inline run_decode's


@numba.njit(cache=True, nogil=True)
def index_runs(src_addrs, sizes, rows, dir_n, dir_refs, dir_bounds, dir_fcrc):  # pragma: no cover (compiled)
    """Entry ``rows[g]`` from the chunk of ``sizes[g]`` bytes (its 4 checksum bytes included) at
    ``src_addrs[g]``, whose checksum the caller matched: layout-2 (or -3) runs of at most ``dir_refs.shape[1]``
    frames whose header is well formed get one (``dir_n`` set last); others none (``dir_n`` 0). Returns the
    number of entries made."""
    made = 0
    room = dir_refs.shape[1]
    for g in range(src_addrs.size):
        r = rows[g]
        dir_n[r] = 0
        body = sizes[g] - 4
        if body < TEMPORAL_HEADER:
            continue
        src = numba.carray(address(src_addrs[g]), (body,), np.uint8)
        magic = np.uint32(src[0]) | (np.uint32(src[1]) << 8) | (np.uint32(src[2]) << 16) | (np.uint32(src[3]) << 24)
        n = np.int64(src[4]) | (np.int64(src[5]) << 8) | (np.int64(src[6]) << 16) | (np.int64(src[7]) << 24)
        if magic != TEMPORAL_MAGIC2 or n < 1 or n > room:
            continue
        start = TEMPORAL_HEADER + 5 * n
        if body < start:
            continue
        ok = True
        previous = np.int64(0)
        for f in range(n):
            d = np.int64(src[TEMPORAL_HEADER + f])
            if d > 127:
                d -= 256
            if f - d < 0 or f - d >= n:
                ok = False
                break
            at = TEMPORAL_HEADER + n + 4 * f
            end = np.int64(src[at]) | (np.int64(src[at + 1]) << 8) | (np.int64(src[at + 2]) << 16) | \
                (np.int64(src[at + 3]) << 24)
            if end < previous:
                ok = False
                break
            dir_refs[r, f] = d
            dir_bounds[r, f] = start + previous
            previous = end
        if not ok or start + previous != body:
            continue
        dir_bounds[r, n] = body
        for f in range(n):
            lo = dir_bounds[r, f]
            dir_fcrc[r, f] = crc32c(src_addrs[g] + lo, dir_bounds[r, f + 1] - lo)
        dir_n[r] = n
        made += 1
    return made


@numba.njit(cache=True, nogil=True)
def plan_partial(rows, starts, js, offsets, sizes, listed, dir_n, dir_refs, dir_bounds, dir_offset, dir_size,
                 dir_crc, first, last, lo, hi):  # pragma: no cover (compiled)
    """Per group ``g`` (the run of directory row ``rows[g]``, now ``sizes[g]`` bytes at file offset
    ``offsets[g]``, its checksum listed by its file's tag as ``listed[g]``, -1 when none is listed; frames
    ``js[starts[g]:starts[g + 1]]`` wanted): when its entry describes that chunk (same offset, size and listed
    checksum), the frames from ``first[g]`` to ``last[g]`` that the wanted frames' chains cover, and the bytes
    ``[lo[g], hi[g])`` of the chunk that hold them; otherwise ``first[g] = -1`` and the whole chunk. Returns
    how many groups are partial."""
    partial = 0
    for g in range(rows.size):
        r = rows[g]
        first[g], last[g], lo[g], hi[g] = -1, -1, 0, sizes[g]
        n = np.int64(dir_n[r])
        if n == 0 or dir_offset[r] != offsets[g] or dir_size[r] != sizes[g] or \
                (listed[g] >= 0 and np.int64(dir_crc[r]) != listed[g]):
            continue
        a, b, ok = n, np.int64(-1), True
        for q in range(starts[g], starts[g + 1]):
            f, steps = js[q], 0
            if f < 0 or f >= n:
                ok = False
                break
            while True:  # the chain down to the frame coded alone
                a, b = min(a, f), max(b, f)
                d = np.int64(dir_refs[r, f])
                if d == 0:
                    break
                f -= d
                steps += 1
                if steps >= n or f < 0 or f >= n:
                    ok = False
                    break
            if not ok:
                break
        if not ok or b < a:
            continue
        first[g], last[g] = a, b
        lo[g], hi[g] = np.int64(dir_bounds[r, a]), np.int64(dir_bounds[r, b + 1])
        partial += 1
    return partial


@numba.njit(cache=True, nogil=True)
def _decode_partial(src, first, last, r, js, dsts, fb, scratch, dctx, dir_n, dir_refs, dir_bounds, dir_fcrc,
                    loc):  # pragma: no cover (compiled)
    """Frames ``js`` of the run of directory row ``r`` to ``dsts``, from its frames ``first..last`` whose
    bytes start at ``src`` (see ``decode_partial_groups``)."""
    n = np.int64(dir_n[r])
    if n < 1 or first < 0 or last >= n or first > last:
        return BAD_SIZE
    base = src - np.int64(dir_bounds[r, first])  # the chunk's first byte, as if it were all there
    return decode_chains(base, n, dir_refs[r], dir_bounds[r], dir_fcrc[r], first, last, js, dsts, fb, scratch,
                         dctx, loc)


@numba.njit(cache=True, nogil=True)
def decode_partial_groups(src_addrs, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, dir_n, dir_refs,
                          dir_bounds, dir_fcrc, status):  # pragma: no cover (compiled)
    """Group ``g``: the bytes of frames ``firsts[g]..lasts[g]`` of the run of directory row ``rows[g]`` (from
    ``dir_bounds[r, first]`` to ``dir_bounds[r, last + 1]`` of the chunk) at ``src_addrs[g]``; its frames
    ``js[starts[g]:starts[g + 1]]`` go to ``dsts[starts[g]:starts[g + 1]]``, each decoded with the frames its
    references lead to, every one checked against its recorded crc32c first. ``status[g]`` says how it went;
    returns the failures."""
    dctx = zstd_create_dctx()
    bad = decode_partial_groups_with(dctx, src_addrs, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows,
                                     dir_n, dir_refs, dir_bounds, dir_fcrc, status)
    if dctx != 0:
        zstd_free_dctx(dctx)
    return bad


@numba.njit(cache=True, nogil=True)
def decode_partial_groups_with(dctx, src_addrs, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, dir_n,
                               dir_refs, dir_bounds, dir_fcrc, status):  # pragma: no cover (compiled)
    """``decode_partial_groups`` with the caller's zstd context (0: none; a codec helper keeps one)."""
    scratch = np.empty(max(run_rows, dir_refs.shape[1]) * frame_nbytes, dtype=np.uint8)
    loc = np.zeros(3 * max(1, dir_refs.shape[1]), dtype=np.int64)
    bad = 0
    for g in range(src_addrs.size):
        a, b = starts[g], starts[g + 1]
        status[g] = _decode_partial(src_addrs[g], firsts[g], lasts[g], rows[g], js[a:b], dsts[a:b], frame_nbytes,
                                    np.int64(scratch.ctypes.data), dctx, dir_n, dir_refs, dir_bounds, dir_fcrc, loc)
        if status[g] != OK:
            bad += 1
    return bad


# -- entry points: every row, address and size checked before a kernel writes --------------------------
def check_directory(dir_n, dir_refs, dir_bounds, dir_fcrc, *more) -> None:
    """The directory's arrays agree: ``n`` rows (uint8), refs ``(n, r)`` int8, bounds ``(n, r + 1)`` and frame
    crcs ``(n, r)`` uint32, ``more`` (offset, size, crc) int64 of ``n``; all C-contiguous."""
    n = dir_n.size
    want = [("dir_n", dir_n, np.uint8, (n,)), ("dir_refs", dir_refs, np.int8, (n, dir_refs.shape[-1])),
            ("dir_bounds", dir_bounds, np.uint32, (n, dir_refs.shape[-1] + 1)),
            ("dir_fcrc", dir_fcrc, np.uint32, (n, dir_refs.shape[-1]))]
    want += [(f"directory array {i}", a, np.int64, (n,)) for i, a in enumerate(more)]
    for name, a, dtype, shape in want:
        if not isinstance(a, np.ndarray) or a.dtype != dtype or a.shape != shape or not a.flags.c_contiguous:
            raise ValueError(f"{name}: expected a C-contiguous {np.dtype(dtype)} array of shape {shape}, got "
                             f"{getattr(a, 'dtype', type(a).__name__)} {getattr(a, 'shape', '')}")


def _check_rows(rows, n_rows: int, count: int) -> None:
    check_array("rows", rows, np.int64, ndim=1, contiguous=False)
    if rows.size != count:
        raise ValueError(f"{rows.size} directory rows for {count} groups")
    check_indices("rows", rows, 0, n_rows)


def checked_index_runs(src_addrs, sizes, rows, buffer, dir_n, dir_refs, dir_bounds, dir_fcrc) -> int:
    """``index_runs`` after checking the directory's arrays, one row (inside it) and size a chunk, and every
    chunk inside ``buffer`` (it only reads there)."""
    check_directory(dir_n, dir_refs, dir_bounds, dir_fcrc)
    _check_rows(rows, dir_n.size, src_addrs.size)
    check_array("sizes", sizes, np.int64, ndim=1, contiguous=False)
    lo, hi = span(buffer, "buffer")
    if sizes.size != src_addrs.size or (src_addrs.size and (
            (src_addrs < lo).any() or (sizes < 0).any() or (src_addrs + sizes > hi).any())):
        raise ValueError("chunks to index must lie inside the buffer read, one size each")
    return index_runs(src_addrs, sizes, rows, dir_n, dir_refs, dir_bounds, dir_fcrc)


def checked_plan_partial(rows, starts, js, offsets, sizes, listed, directory, first, last, lo, hi) -> int:
    """``plan_partial`` after checking its arrays: one row (inside the directory), offset, size, listed
    checksum and output entry a group, group starts that tile ``js``. ``directory``: (n, refs, bounds,
    offset, size, crc) of ``RunDirectory``."""
    dir_n, dir_refs, dir_bounds, dir_offset, dir_size, dir_crc = directory
    g = rows.size
    _check_rows(rows, dir_n.size, g)
    for name, a in (("starts", starts), ("js", js), ("offsets", offsets), ("sizes", sizes), ("listed", listed),
                    ("first", first), ("last", last), ("lo", lo), ("hi", hi)):
        check_array(name, a, np.int64, ndim=1, contiguous=False)
    if starts.size != g + 1 or any(a.size != g for a in (offsets, sizes, listed, first, last, lo, hi)):
        raise ValueError(f"partial-read plan arrays disagree with its {g} groups")
    if g and (starts[0] != 0 or starts[-1] != js.size or (np.diff(starts) < 0).any()):
        raise ValueError(f"group starts {starts[:4]}...{starts[-2:]} do not tile the {js.size} requests")
    for name, a, dtype in (("dir_n", dir_n, np.uint8), ("dir_refs", dir_refs, np.int8),
                           ("dir_bounds", dir_bounds, np.uint32), ("dir_offset", dir_offset, np.int64),
                           ("dir_size", dir_size, np.int64), ("dir_crc", dir_crc, np.int64)):
        if a.dtype != dtype or a.shape[0] != dir_n.size:
            raise ValueError(f"{name}: expected {np.dtype(dtype)} with {dir_n.size} rows, got {a.dtype} {a.shape}")
    if dir_bounds.shape[1] != dir_refs.shape[1] + 1:
        raise ValueError(f"dir_bounds {dir_bounds.shape} and dir_refs {dir_refs.shape} disagree")
    return plan_partial(rows, starts, js, offsets, sizes, listed, dir_n, dir_refs, dir_bounds, dir_offset, dir_size,
                        dir_crc, first, last, lo, hi)


def check_partial_decodes(src, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, directory, status,
                          into) -> None:
    """Raise ``ValueError`` unless ``decode_partial_groups`` with these arguments writes only inside ``into``
    (``decode.check_frame_decodes``) and reads only directory rows that exist, frames ``0 <= first <= last
    < run width``. ``directory``: (n, refs, bounds, fcrc)."""
    check_directory(*directory)
    check_frame_decodes(src, src, starts, js, dsts, frame_nbytes, run_rows, status, into)
    _check_rows(rows, directory[0].size, src.size)
    for name, a in (("firsts", firsts), ("lasts", lasts)):
        check_array(name, a, np.int64, ndim=1, contiguous=False)
        if a.size != src.size:
            raise ValueError(f"{name}: {a.size} entries for {src.size} groups")
    width = directory[1].shape[1]
    if src.size and ((firsts < 0).any() or (lasts < firsts).any() or (lasts >= width).any()):
        raise ValueError(f"partial decodes of frames outside runs of {width}")


def checked_decode_partial_groups(src, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, directory,
                                  status, into, helpers=None) -> int:
    """``decode_partial_groups`` (shared with the codec ``helpers`` when given and free) after
    ``check_partial_decodes`` (and the linking self-test); the number of failed groups."""
    check_partial_decodes(src, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, directory, status, into)
    ensure_linked()
    if helpers is not None:
        bad = helpers.decode_partial(src, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, directory,
                                     status)
        if bad is not None:
            return int(bad)
    return int(decode_partial_groups(src, firsts, lasts, rows, starts, js, dsts, frame_nbytes, run_rows, *directory,
                                     status))
