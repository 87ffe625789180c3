"""Compiled decoding of temporal-codec runs (``codecs/temporal.py``): whole runs, and the frames a batch asks
for out of runs, each frame rebuilt from the frames its references lead to.

Invariant: a kernel here writes a frame to its destination only after the run's crc32c matched the 4 bytes that
end its chunk (``decode_frame_groups``; a whole run's caller, ``chunk_decode._decode_one``, checks it first),
or, with ``verified``, after the caller's word that it matched where the bytes came into this process (the
compressed tier checks every chunk once as it installs a shard: ``reading/resident.py``), after the run's header
was checked against the bytes asked for and every reference found to point inside the run, and reports ``OK``
only when every frame it decoded came to exactly the frame's bytes; a reference chain longer than the run (a
cycle) is ``BAD_CODEC``, never a loop. Destinations are checked by the entry points
(``decode.check_frame_decodes``) before these kernels run.

Layouts (``_native/temporal_header.py``): 1 codes the run's residuals as one zstd frame; 2 and 3 code each
frame alone (zstd, or an LZ4 block for layout 3's keys) behind a signed one-byte reference and its end, so
that a batch decodes only the frames it needs and the ones they refer to (``decode_chains``, shared with the
partial reads of ``_native/runs.py``).
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import delta_lz4, intrinsics, kernel_cache, linked
from mmreplay._native import temporal_header as temporal
from mmreplay._native.delta_lz4 import MAGIC as DELTA_LZ4_MAGIC
from mmreplay._native.delta_lz4 import decode_delta_lz4_run
from mmreplay._native.intrinsics import address
from mmreplay._native.linked import (BAD_CHECKSUM, BAD_CODEC, BAD_SIZE, OK, crc32c, lz4_decompress_safe, memcpy,
                                     zstd_create_dctx, zstd_free_dctx, zstd_into, zstd_is_error)

kernel_cache.follow(__file__, intrinsics, temporal, linked, delta_lz4)  # the kernels inline these (see kernel_cache)

# the temporal codec's header (_native/temporal_header.py): magic, run length, frame bytes, one reference a frame
TEMPORAL_MAGIC = int.from_bytes(temporal.MAGIC, "little")
TEMPORAL_MAGIC2 = int.from_bytes(temporal.MAGIC2, "little")
TEMPORAL_HEADER = temporal.HEADER.size
TEMPORAL_MAX_RUN = temporal.MAX_RUN
RUN2_MAX = 128  # layout 2: references are signed bytes, so runs hold at most 127 frames

ZSTD_FRAME_MAGIC = temporal.ZSTD_MAGIC
LZ4_MAX_BYTES = temporal.LZ4_MAX_BYTES


@numba.njit(cache=True, nogil=True)
def decode_frame(dctx, dst, fb, src, size):  # pragma: no cover (compiled)
    """One frame of a layout-2 or -3 run (``size`` bytes at ``src``) into the ``fb`` bytes at ``dst``: a zstd
    frame, or an LZ4 block behind its 4-byte little-endian size, which must be ``fb`` (layout 3). A status:
    ``OK`` only when exactly ``fb`` bytes were decoded."""
    if size < 4:
        return BAD_SIZE
    word = numba.carray(address(src), (4,), np.uint8)
    first = np.int64(word[0]) | np.int64(word[1]) << 8 | np.int64(word[2]) << 16 | np.int64(word[3]) << 24
    if first != ZSTD_FRAME_MAGIC:
        if first != fb or fb > LZ4_MAX_BYTES or size - 4 > LZ4_MAX_BYTES:
            return BAD_SIZE
        got = lz4_decompress_safe(src + 4, dst, np.int32(size - 4), np.int32(fb))
        if got < 0:
            return BAD_CODEC
        return OK if got == fb else BAD_SIZE
    got = zstd_into(dctx, dst, fb, src, size)
    if zstd_is_error(got) != 0:
        return BAD_CODEC
    return OK if got == fb else BAD_SIZE


@numba.njit(cache=True, nogil=True)
def header_words(header):  # pragma: no cover (compiled)
    """The run header's first three little-endian uint32 (magic, frames, frame bytes) from ``header``'s bytes
    (a ``view`` would compile numba's shape-error formatting: seconds of first-use compile)."""
    magic = np.int64(header[0]) | np.int64(header[1]) << 8 | np.int64(header[2]) << 16 | np.int64(header[3]) << 24
    n = np.int64(header[4]) | np.int64(header[5]) << 8 | np.int64(header[6]) << 16 | np.int64(header[7]) << 24
    fb = np.int64(header[8]) | np.int64(header[9]) << 8 | np.int64(header[10]) << 16 | np.int64(header[11]) << 24
    return magic, n, fb


@numba.njit(cache=True, nogil=True)
def decode_temporal_run(src, body, dst, dst_nbytes, header, dctx, work, ends):  # pragma: no cover (compiled)
    """A temporal run (``codecs/temporal.py``), either layout, whole into ``dst``. Layout 1: the header checked
    against ``dst_nbytes``, every reference checked to point inside the run, zstd into ``dst``, then each
    frame rebuilt from its reference. Layout 2: ``_decode_frames2`` with every frame asked for."""
    if body < TEMPORAL_HEADER:
        return BAD_SIZE
    memcpy(header.ctypes.data, src, TEMPORAL_HEADER)
    magic, n, frame_nbytes = header_words(header)
    if magic == TEMPORAL_MAGIC2:
        if n < 1 or n >= RUN2_MAX or n * frame_nbytes != dst_nbytes:
            return BAD_SIZE
        js, dsts = work[:RUN2_MAX], work[RUN2_MAX:2 * RUN2_MAX]
        for i in range(n):
            js[i] = i
            dsts[i] = dst + i * frame_nbytes
        return _decode_frames2(src, body, dst_nbytes, frame_nbytes, js[:n], dsts[:n], np.int64(0), dctx, header,
                               ends, work[2 * RUN2_MAX:])
    if magic != TEMPORAL_MAGIC or n < 1 or n > TEMPORAL_MAX_RUN or n * frame_nbytes != dst_nbytes:
        return BAD_SIZE
    if body < TEMPORAL_HEADER + n:
        return BAD_SIZE
    memcpy(header.ctypes.data, src + TEMPORAL_HEADER, n)
    for i in range(n):
        if header[i] > i:
            return BAD_CODEC
    got = zstd_into(dctx, dst, dst_nbytes, src + TEMPORAL_HEADER + n, body - TEMPORAL_HEADER - n)
    if zstd_is_error(got) != 0:
        return BAD_CODEC
    if got != dst_nbytes:
        return BAD_SIZE
    for i in range(1, n):
        d = np.int64(header[i])
        if d:  # 1-D views: a row assigned into a 2-D one would compile numba's shape-error formatting
            frame = numba.carray(address(dst + i * frame_nbytes), (frame_nbytes,), np.uint8)
            frame += numba.carray(address(dst + (i - d) * frame_nbytes), (frame_nbytes,), np.uint8)
    return OK


@numba.njit(cache=True, nogil=True)
def mark_wanted(js, dsts, n, done, want):  # pragma: no cover (compiled)
    """Before a run's frames ``js`` are decoded to ``dsts``: ``done[:n]`` and ``want[:n]`` cleared, then
    ``want[j]`` = the first address asked for frame ``j``. False if a frame is outside the run of ``n``."""
    for f in range(n):
        done[f] = 0
        want[f] = 0
    for r in range(js.size):
        j = js[r]
        if j < 0 or j >= n:
            return False
        if want[j] == 0:
            want[j] = dsts[r]
    return True


@numba.njit(cache=True, nogil=True)
def _decode_frames2(src, body, run_nbytes, frame_nbytes, js, dsts, scratch, dctx, header, ends,
                    loc):  # pragma: no cover (compiled)
    """Frames ``js[r]`` of a layout-2 or -3 run (``body`` bytes at ``src``, checksum already checked) to addresses
    ``dsts[r]``, decoding only them and the frames their references lead to (those not asked for land in
    ``scratch``, an address of ``run_nbytes`` bytes, 0 when every frame is asked for). A frame asked for
    more than once is decoded once, into its first address, and copied to the others. Checked before any
    decode: the header against ``run_nbytes`` (and ``frame_nbytes``), every reference inside the run, the
    frame ends tiling the payload; while decoding: no chain longer than the run (a cycle), every zstd frame
    exactly ``frame_nbytes`` (``decode_chains``). ``loc``: 5 * RUN2_MAX + 1 int64 of workspace."""
    if body < TEMPORAL_HEADER:
        return BAD_SIZE
    memcpy(header.ctypes.data, src, TEMPORAL_HEADER)
    magic, n, fb = header_words(header)
    if magic != TEMPORAL_MAGIC2 or n < 1 or n >= RUN2_MAX or n * fb != run_nbytes or fb != frame_nbytes:
        return BAD_SIZE
    start = TEMPORAL_HEADER + 5 * n
    if body < start:
        return BAD_SIZE
    memcpy(header.ctypes.data, src + TEMPORAL_HEADER, n)
    memcpy(ends.ctypes.data, src + TEMPORAL_HEADER + n, 4 * n)
    # the header as ``decode_chains`` reads it: signed references, and where each frame's bytes start in the chunk
    refs, bounds = loc[3 * RUN2_MAX:4 * RUN2_MAX], loc[4 * RUN2_MAX:5 * RUN2_MAX + 1]
    previous = np.int64(0)
    for i in range(n):
        d = np.int64(header[i])
        if d > 127:
            d -= 256
        if i - d < 0 or i - d >= n:
            return BAD_CODEC
        if np.int64(ends[i]) < previous:
            return BAD_SIZE
        refs[i] = d
        bounds[i] = start + previous
        previous = np.int64(ends[i])
    if previous != body - start:
        return BAD_SIZE
    bounds[n] = start + previous
    return decode_chains(src, n, refs, bounds, ends[:0], 0, n - 1, js, dsts, fb, scratch, dctx, loc)


@numba.njit(cache=True, nogil=True)
def decode_chains(base, n, refs, bounds, fcrc, first, last, js, dsts, fb, scratch, dctx, loc):  # pragma: no cover
    """The temporal codec's reconstruction, shared by whole runs (``_decode_frames2``) and partial reads
    (``_native/runs.py``): frames ``js[r]`` of a run of ``n`` frames to addresses ``dsts[r]``, each decoded
    with the frames its references lead to, from the root of its chain outward (each reference rebuilt
    first); a frame asked for more than once is decoded once, into its first address, and copied to the
    others; frames not asked for land in ``scratch`` (an address of ``n * fb`` bytes). Frame ``f`` refers to
    frame ``f - refs[f]`` (0: coded alone) and its coded bytes are ``[base + bounds[f], base + bounds[f + 1])``;
    with ``fcrc`` (empty: none) each is checked against its crc32c before it is decoded. A chain longer than
    the run (a cycle) or leaving frames ``first..last`` is ``BAD_CODEC``. ``loc``: 3 * n int64 of workspace."""
    done, want, stack = loc[:n], loc[n:2 * n], loc[2 * n:3 * n]
    if not mark_wanted(js, dsts, n, done, want):
        return BAD_SIZE
    for q in range(js.size):
        j = js[q]
        if done[j] == 0:
            m, f = 0, j
            while done[f] == 0:  # the chain down to a frame decoded already, or one coded alone
                if m >= n or f < first or f > last:
                    return BAD_CODEC  # longer than the run (the references form a cycle), or outside the bytes
                stack[m] = f
                m += 1
                d = np.int64(refs[f])
                if d == 0:
                    break
                f -= d
                if f < 0 or f >= n:
                    return BAD_CODEC
            for s in range(m - 1, -1, -1):  # from the chain's root outward: each reference is rebuilt first
                f = stack[s]
                at = want[f] if want[f] != 0 else scratch + f * fb
                a, b = np.int64(bounds[f]), np.int64(bounds[f + 1])
                if fcrc.size != 0 and crc32c(base + a, b - a) != fcrc[f]:
                    return BAD_CHECKSUM
                status = decode_frame(dctx, at, fb, base + a, b - a)
                if status != OK:
                    return status
                d = np.int64(refs[f])
                if d != 0:
                    frame = numba.carray(address(at), (fb,), np.uint8)
                    frame += numba.carray(address(done[f - d]), (fb,), np.uint8)
                done[f] = at
        if dsts[q] != done[j]:
            memcpy(dsts[q], done[j], fb)
    return OK


@numba.njit(cache=True, nogil=True)
def _decode_run_frames(src, size, js, dsts, frame_nbytes, run_nbytes, scratch, dctx, header, ends, loc,
                       work, crc, verified):  # pragma: no cover (compiled)
    """Frames ``js`` of one temporal chunk (``size`` bytes at ``src``, checksum included) to ``dsts``: only
    after its crc32c matched (``verified``: it matched already, where the bytes came into this process); layouts
    2 and 3 decode only what they need, layout 1 the whole run into ``scratch``."""
    if size < 4 + TEMPORAL_HEADER:
        return BAD_SIZE
    body = size - 4
    if not verified:
        memcpy(crc.ctypes.data, src + body, 4)
        if crc32c(src, body) != (crc[0] & np.uint64(0xFFFFFFFF)):
            return BAD_CHECKSUM
    memcpy(crc.ctypes.data, src, 4)
    if crc[0] & np.uint64(0xFFFFFFFF) == TEMPORAL_MAGIC2:
        return _decode_frames2(src, body, run_nbytes, frame_nbytes, js, dsts, scratch, dctx, header, ends, loc)
    if crc[0] & np.uint64(0xFFFFFFFF) == DELTA_LZ4_MAGIC:  # a delta-lz4 run: decoded up to its last frame asked for
        upto = np.int64(0)
        straight = js.size > 0
        for r in range(js.size):
            upto = max(upto, js[r] + 1)
            straight = straight and js[r] == r and dsts[r] == dsts[0] + r * frame_nbytes
        if straight and upto * frame_nbytes <= run_nbytes:
            # frames 0..m-1 to consecutive places (a sequence through the run's start): LZ4 writes them there
            # (each place was checked to hold its frame, so together they hold the m frames), no scratch copy
            return decode_delta_lz4_run(src, body, dsts[0], run_nbytes, upto)
        status = decode_delta_lz4_run(src, body, scratch, run_nbytes, upto)
    else:
        status = decode_temporal_run(src, body, scratch, run_nbytes, header, dctx, work, ends)
    if status != OK:
        return status
    for r in range(js.size):
        if js[r] < 0 or (js[r] + 1) * frame_nbytes > run_nbytes:
            return BAD_SIZE
        memcpy(dsts[r], scratch + js[r] * frame_nbytes, frame_nbytes)
    return OK


@numba.njit(cache=True, nogil=True)
def decode_frame_groups(src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows, status,
                        verified=False):  # pragma: no cover (compiled)
    """Group ``g``: the temporal chunk of ``sizes[g]`` bytes (checksum included) at ``src_addrs[g]``, whose
    frames ``js[starts[g]:starts[g + 1]]`` go to addresses ``dsts[starts[g]:starts[g + 1]]`` (runs of
    ``run_rows`` frames of ``frame_nbytes``); ``status[g]`` says how it went. Returns the failures. Nothing
    is written to a group's addresses before its checksum matched; a failed group may have written some.
    ``verified``: every chunk's checksum matched already, where its bytes came into this process (the
    compressed tier's install): not computed again."""
    dctx = zstd_create_dctx()
    bad = decode_frame_groups_with(dctx, src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows, status,
                                   verified)
    if dctx != 0:
        zstd_free_dctx(dctx)
    return bad


@numba.njit(cache=True, nogil=True)
def decode_frame_groups_with(dctx, src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows, status,
                             verified=False):  # pragma: no cover (compiled)
    """``decode_frame_groups`` with the caller's zstd context (0: none): a codec helper keeps one while it
    works, since making one per piece of a batch cost ~3% of a pixel batch's time."""
    run_nbytes = run_rows * frame_nbytes
    scratch = np.empty(run_nbytes, dtype=np.uint8)
    header = np.zeros(TEMPORAL_HEADER + TEMPORAL_MAX_RUN + 1, dtype=np.uint8)
    ends = np.zeros(RUN2_MAX, dtype=np.uint32)
    loc = np.zeros(5 * RUN2_MAX + 1, dtype=np.int64)
    work = np.zeros(7 * RUN2_MAX + 1, dtype=np.int64)  # js, dsts and ``_decode_frames2``'s workspace
    crc = np.zeros(1, dtype=np.uint64)
    bad = 0
    for g in range(src_addrs.size):
        lo, hi = starts[g], starts[g + 1]
        status[g] = _decode_run_frames(src_addrs[g], sizes[g], js[lo:hi], dsts[lo:hi], frame_nbytes, run_nbytes,
                                       np.int64(scratch.ctypes.data), dctx, header, ends, loc, work, crc,
                                       verified)
        if status[g] != OK:
            bad += 1
    return bad


@numba.njit(cache=True, nogil=True)
def group_frame_requests(ids, dsts, ring_rows, run_rows):  # pragma: no cover (compiled)
    """Frame requests (frame ``ids[r]`` to address ``dsts[r]``) grouped by chunk: ``(chunks, starts, js,
    dsts, order)`` with the requests of chunk ``chunks[g]`` at ``starts[g]:starts[g + 1]`` of ``js`` (the
    frame's row in its run), ``dsts`` and ``order`` (their positions in ``ids``)."""
    total = ids.size
    chunk_of = np.empty(total, dtype=np.int64)
    for r in range(total):
        row = ids[r] % ring_rows if ring_rows else ids[r]
        chunk_of[r] = row // run_rows
    order = np.argsort(chunk_of, kind="mergesort")
    js = np.empty(total, dtype=np.int64)
    out = np.empty(total, dtype=np.int64)
    starts = np.empty(total + 1, dtype=np.int64)
    chunks = np.empty(total, dtype=np.int64)
    g = 0
    for q in range(total):
        r = order[q]
        if q == 0 or chunk_of[r] != chunks[g - 1]:
            chunks[g] = chunk_of[r]
            starts[g] = q
            g += 1
        row = ids[r] % ring_rows if ring_rows else ids[r]
        js[q] = row - chunk_of[r] * run_rows
        out[q] = dsts[r]
    starts[g] = total
    return chunks[:g].copy(), starts[:g + 1].copy(), js, out, order



@numba.njit(cache=True, nogil=True)
def stack_frame_requests(obs_ids, next_ids, shifted, obs_addr, next_addr, nbytes):  # pragma: no cover (compiled)
    """The frame requests of a pair of stacks ``(n, k)`` (``RunRequests.of_stacks``) in one pass: ``(ids,
    dsts)``, the obs stack's frames to consecutive ``nbytes`` places from ``obs_addr``, then the next stack's
    to those from ``next_addr``; ``shifted``: next frame ``j < k - 1`` is asked as obs frame ``j + 1`` (the
    same frame, so grouped requests decode it once) and only the last column of ``next_ids`` is read."""
    n, k = obs_ids.shape
    ids = np.empty(2 * n * k, dtype=np.int64)
    dsts = np.empty(2 * n * k, dtype=np.int64)
    for i in range(n):
        for j in range(k):
            p = i * k + j
            ids[p] = obs_ids[i, j]
            dsts[p] = obs_addr + p * nbytes
            ids[n * k + p] = obs_ids[i, j + 1] if shifted and j < k - 1 else next_ids[i, j]
            dsts[n * k + p] = next_addr + p * nbytes
    return ids, dsts


@numba.njit(cache=True, nogil=True)
def locate_chunks(chunk_addr, chunk_size, chunks):  # pragma: no cover (compiled)
    """Where the compressed tier holds ``chunks`` (``reading/resident.py``'s index): ``(src, sizes, held)``,
    ``src[i]`` the chunk's address (0: not held, negative: empty) and ``sizes[i]`` its bytes, both 0 for a
    chunk outside the index; ``held`` counts the chunks at an address (``src > 0``)."""
    src = np.zeros(chunks.size, dtype=np.int64)
    sizes = np.zeros(chunks.size, dtype=np.int64)
    held = 0
    for i in range(chunks.size):
        c = chunks[i]
        if 0 <= c < chunk_addr.size:
            src[i] = chunk_addr[c]
            sizes[i] = chunk_size[c]
            if src[i] > 0:
                held += 1
    return src, sizes, held
