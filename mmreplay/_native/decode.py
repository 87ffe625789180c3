"""Compiled chunk decoding: checksum and decompress many chunks in one call, with the GIL released.

Invariant: ``decode_chunks`` writes chunk ``i`` into ``dst_addrs[i]`` only after its crc32c matched the
4 checksum bytes that end it, and sets ``status[i]`` to ``OK`` only when the codec produced exactly
``dst_nbytes`` bytes; any other outcome is a nonzero status and the caller raises (never returns the
destination as data). The bytes are the same ``compressor(bytes) + crc32c`` chunks that zarr writes
(see ``storage/format/shardfile.py``), so nothing about the format changes.

Why compiled: the Python path spends ~7 us per 84x84 frame (pread, crc32c, blosc and the Python around
them), the codec itself ~1 us. The C functions come from the libraries the package already depends on —
c-blosc and zstd inside numcodecs' extension modules, crc32c inside google-crc32c — linked by name into
numba kernels, so a batch of misses is one call without Python per chunk. If a build of those packages
does not export the symbols, ``AVAILABLE`` is False and the reader keeps the Python path.

Entry points (end of the module): the package calls the kernels through ``checked_*`` functions that check
every destination address and size first (``_native/bounds.py``) and, once a process, decode known chunks
through the linked symbols (``self_test``): a symbol that decodes otherwise than numcodecs is a
``LinkError`` naming it, never garbage returned as frames.
"""

from __future__ import annotations

import importlib
import threading
from typing import NamedTuple

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

from mmreplay._native.bounds import check_addresses, check_array, check_indices, span
from mmreplay._native.intrinsics import address, prefetch
from mmreplay._native import codec_kinds, intrinsics, kernel_cache
from mmreplay._native import temporal_header as temporal
# the kinds the kernels switch on; which codec has which is said by the codec's module (``mmreplay/codecs/``)
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_TEMPORAL, CODEC_ZSTD, CODECS

kernel_cache.follow(__file__, intrinsics, temporal, codec_kinds)  # the kernels inline these (see kernel_cache)

OK, BAD_CHECKSUM, BAD_SIZE, BAD_CODEC = 0, 1, 2, 3
# the temporal codec's header (_native/temporal_header.py): magic, run length, frame bytes, one reference a frame
TEMPORAL_MAGIC = int.from_bytes(temporal.MAGIC, "little")
TEMPORAL_MAGIC2 = int.from_bytes(temporal.MAGIC2, "little")
TEMPORAL_HEADER = temporal.HEADER.size
TEMPORAL_MAX_RUN = temporal.MAX_RUN
RUN2_MAX = 128  # layout 2: references are signed bytes, so runs hold at most 127 frames
STATUS_TEXT = {BAD_CHECKSUM: "checksum mismatch (stored data is corrupt)",
               BAD_SIZE: "chunk does not decode to the expected number of bytes",
               BAD_CODEC: "the codec failed to decode the chunk"}
_SYMBOLS = {"numcodecs.blosc": ("blosc_decompress_ctx", "blosc_cbuffer_validate"),
            "numcodecs.zstd": ("ZSTD_decompress", "ZSTD_isError", "ZSTD_createDCtx", "ZSTD_freeDCtx",
                               "ZSTD_decompressDCtx"),
            "numcodecs.lz4": ("LZ4_decompress_safe",),
            "google_crc32c._crc32c": ("crc32c_value",)}


def _load_symbols() -> bool:
    """Make the C functions linkable by name (they are called as external symbols, not addresses, so
    numba's on-disk cache of the kernels stays valid across processes). False if one is missing."""
    try:
        for module, names in _SYMBOLS.items():
            llvm.load_library_permanently(importlib.import_module(module).__file__)
            if not all(llvm.address_of_symbol(name) for name in names):
                return False
    except (ImportError, RuntimeError, AttributeError, TypeError):
        return False
    return True


AVAILABLE = _load_symbols()
_vp, _sz, _int = types.voidptr, types.uintp, types.intc
blosc_decompress = types.ExternalFunction("blosc_decompress_ctx", _int(_vp, _vp, _sz, _int))
blosc_validate = types.ExternalFunction("blosc_cbuffer_validate", _int(_vp, _sz, _vp))
zstd_decompress = types.ExternalFunction("ZSTD_decompress", _sz(_vp, _sz, _vp, _sz))
zstd_is_error = types.ExternalFunction("ZSTD_isError", types.uintc(_sz))
# One decompression context per kernel call, reused for every frame: ``ZSTD_decompress`` makes and frees
# one per call, which cost ~20-40% of decoding an 84x84 RGB residual (measured: 49 -> 28 us, loaded box).
zstd_create_dctx = types.ExternalFunction("ZSTD_createDCtx", _sz())
zstd_free_dctx = types.ExternalFunction("ZSTD_freeDCtx", _sz(_sz))
zstd_decompress_dctx = types.ExternalFunction("ZSTD_decompressDCtx", _sz(_sz, _vp, _sz, _vp, _sz))
# layout 3's LZ4 blocks: never reads past ``src + size`` nor writes past ``dst + capacity``; negative if malformed
lz4_decompress_safe = types.ExternalFunction("LZ4_decompress_safe", _int(_vp, _vp, _int, _int))
crc32c = types.ExternalFunction("crc32c_value", types.uint32(_vp, _sz))
memcpy = types.ExternalFunction("memcpy", _vp(_vp, _vp, _sz))


@numba.njit(cache=True, nogil=True)
def _zstd(dctx, dst, capacity, src, size):  # pragma: no cover (compiled)
    if dctx != 0:
        return zstd_decompress_dctx(dctx, dst, capacity, src, size)
    return zstd_decompress(dst, capacity, src, size)


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
    got = _zstd(dctx, dst, fb, src, size)
    if zstd_is_error(got) != 0:
        return BAD_CODEC
    return OK if got == fb else BAD_SIZE


@numba.njit(cache=True, nogil=True)
def _header_words(header):  # pragma: no cover (compiled)
    """The run header's first three little-endian uint32 (magic, frames, frame bytes) from ``header``'s bytes
    (a ``view`` would compile numba's shape-error formatting: seconds of first-use compile)."""
    magic = np.int64(header[0]) | np.int64(header[1]) << 8 | np.int64(header[2]) << 16 | np.int64(header[3]) << 24
    n = np.int64(header[4]) | np.int64(header[5]) << 8 | np.int64(header[6]) << 16 | np.int64(header[7]) << 24
    fb = np.int64(header[8]) | np.int64(header[9]) << 8 | np.int64(header[10]) << 16 | np.int64(header[11]) << 24
    return magic, n, fb


@numba.njit(cache=True, nogil=True)
def _decode_temporal(src, body, dst, dst_nbytes, header, dctx, work, ends):  # pragma: no cover (compiled)
    """A temporal run (``codecs/temporal.py``), either layout, whole into ``dst``. Layout 1: the header checked
    against ``dst_nbytes``, every reference checked to point inside the run, zstd into ``dst``, then each
    frame rebuilt from its reference. Layout 2: ``_decode_frames2`` with every frame asked for."""
    if body < TEMPORAL_HEADER:
        return BAD_SIZE
    memcpy(header.ctypes.data, src, TEMPORAL_HEADER)
    magic, n, frame_nbytes = _header_words(header)
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
    got = _zstd(dctx, dst, dst_nbytes, src + TEMPORAL_HEADER + n, body - TEMPORAL_HEADER - n)
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
    magic, n, fb = _header_words(header)
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
                       work, crc):  # pragma: no cover (compiled)
    """Frames ``js`` of one temporal chunk (``size`` bytes at ``src``, checksum included) to ``dsts``: only
    after its crc32c matched; layouts 2 and 3 decode only what they need, layout 1 the whole run into ``scratch``."""
    if size < 4 + TEMPORAL_HEADER:
        return BAD_SIZE
    body = size - 4
    memcpy(crc.ctypes.data, src + body, 4)
    if crc32c(src, body) != (crc[0] & np.uint64(0xFFFFFFFF)):
        return BAD_CHECKSUM
    memcpy(crc.ctypes.data, src, 4)
    if crc[0] & np.uint64(0xFFFFFFFF) == TEMPORAL_MAGIC2:
        return _decode_frames2(src, body, run_nbytes, frame_nbytes, js, dsts, scratch, dctx, header, ends, loc)
    status = _decode_temporal(src, body, scratch, run_nbytes, header, dctx, work, ends)
    if status != OK:
        return status
    for r in range(js.size):
        if js[r] < 0 or (js[r] + 1) * frame_nbytes > run_nbytes:
            return BAD_SIZE
        memcpy(dsts[r], scratch + js[r] * frame_nbytes, frame_nbytes)
    return OK


@numba.njit(cache=True, nogil=True)
def decode_frame_groups(src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows, status):  # pragma: no cover
    """Group ``g``: the temporal chunk of ``sizes[g]`` bytes (checksum included) at ``src_addrs[g]``, whose
    frames ``js[starts[g]:starts[g + 1]]`` go to addresses ``dsts[starts[g]:starts[g + 1]]`` (runs of
    ``run_rows`` frames of ``frame_nbytes``); ``status[g]`` says how it went. Returns the failures. Nothing
    is written to a group's addresses before its checksum matched; a failed group may have written some."""
    dctx = zstd_create_dctx()
    bad = decode_frame_groups_with(dctx, src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows, status)
    if dctx != 0:
        zstd_free_dctx(dctx)
    return bad


@numba.njit(cache=True, nogil=True)
def decode_frame_groups_with(dctx, src_addrs, sizes, starts, js, dsts, frame_nbytes, run_rows,
                             status):  # pragma: no cover (compiled)
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
                                       np.int64(scratch.ctypes.data), dctx, header, ends, loc, work, crc)
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
def copy_rows_to(base, rows, row_nbytes, dsts):  # pragma: no cover (compiled)
    """Row ``rows[i]`` of the ``row_nbytes``-byte rows at address ``base`` to address ``dsts[i]``."""
    for i in range(rows.size):
        memcpy(dsts[i], base + rows[i] * row_nbytes, row_nbytes)


@numba.njit(cache=True, nogil=True)
def _decode_one(src, size, dst, dst_nbytes, codec, scratch, header, dctx, work, ends):  # pragma: no cover
    if size < 4:
        return BAD_SIZE
    body = size - 4
    memcpy(scratch.ctypes.data, src + body, 4)
    if crc32c(src, body) != (scratch[0] & np.uint64(0xFFFFFFFF)):
        return BAD_CHECKSUM
    if codec == CODEC_TEMPORAL:
        return _decode_temporal(src, body, dst, dst_nbytes, header, dctx, work, ends)
    if codec == CODEC_BLOSC:
        # validate first: blosc_decompress_ctx trusts the compressed size in the chunk's header
        if blosc_validate(src, body, scratch.ctypes.data) != 0 or scratch[0] != dst_nbytes:
            return BAD_SIZE
        if blosc_decompress(src, dst, dst_nbytes, 1) != dst_nbytes:
            return BAD_CODEC
        return OK
    got = _zstd(dctx, dst, dst_nbytes, src, body)
    if zstd_is_error(got) != 0:
        return BAD_CODEC
    return OK if got == dst_nbytes else BAD_SIZE


# Chunks whose bytes are requested from memory ahead of their decode: a chunk picked at random in 0.5 GB
# is a cache miss per line, and the hardware prefetcher does not know the next chunk's address (measured:
# Atari batch-256 decodes 7-12% faster on one core with 2 chunks ahead, 1 gave less).
PREFETCH_AHEAD = 2


@numba.njit(cache=True, nogil=True)
def _prefetch_chunk(src, size):  # pragma: no cover (compiled)
    for offset in range(0, size, 64):
        prefetch(src + offset)


@numba.njit(cache=True, nogil=True)
def decode_chunks(src_addrs, sizes, dst_addrs, copy_addrs, dst_nbytes, codec, status):  # pragma: no cover
    """Decode chunk i (``sizes[i]`` bytes at address ``src_addrs[i]``, checksum included) to address
    ``dst_addrs[i]``, and copy it on to ``copy_addrs[i]`` unless that is 0 (while the bytes are still in
    the core's cache: a frame that two outputs need is decoded once); ``status[i]`` says how it went.
    Returns the number of failures."""
    scratch = np.zeros(1, dtype=np.uint64)
    header = np.zeros(TEMPORAL_HEADER + TEMPORAL_MAX_RUN + 1, dtype=np.uint8)
    work = np.zeros(7 * RUN2_MAX + 1, dtype=np.int64)  # js, dsts and ``_decode_frames2``'s workspace
    ends = np.zeros(RUN2_MAX, dtype=np.uint32)
    dctx = np.uint64(0)
    if codec != CODEC_BLOSC:
        dctx = zstd_create_dctx()
    bad = 0
    n = src_addrs.size
    for i in range(min(PREFETCH_AHEAD, n)):
        _prefetch_chunk(src_addrs[i], sizes[i])
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _prefetch_chunk(src_addrs[i + PREFETCH_AHEAD], sizes[i + PREFETCH_AHEAD])
        status[i] = _decode_one(src_addrs[i], sizes[i], dst_addrs[i], dst_nbytes, codec, scratch, header, dctx,
                                work, ends)
        if status[i] != OK:
            bad += 1
        elif copy_addrs[i] != 0:
            memcpy(copy_addrs[i], dst_addrs[i], dst_nbytes)
    if dctx != 0:
        zstd_free_dctx(dctx)
    return bad


@numba.njit(cache=True, nogil=True)
def _prefetch_chunk_rows(obs_ids, next_ids, ring_rows, chunk_addr, chunk_size):  # pragma: no cover (compiled)
    """Ask for the chunk addresses and sizes of a batch's frames before the plan reads them: random rows of
    two 1M-entry tables are cache misses that overlap when asked for at once (a stack's frames are
    neighbours: its first and last frame cover its rows)."""
    addr_at, size_at = chunk_addr.ctypes.data, chunk_size.ctypes.data
    for ids in (obs_ids, next_ids):
        for i in range(ids.shape[0]):
            for j in (0, ids.shape[1] - 1):
                row = ids[i, j] % ring_rows if ring_rows else ids[i, j]
                if 0 <= row < chunk_addr.size:
                    prefetch(addr_at + row * 8)
                    prefetch(size_at + row * 8)


@numba.njit(cache=True, nogil=True)
def plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                       chunk_size):  # pragma: no cover (compiled)
    """The ``decode_chunks`` arguments that fill a batch's obs and next-obs stacks (``(n, k)`` frame ids,
    one frame a chunk) from held chunks into the contiguous outputs ``obs_out`` / ``next_out`` (``n * k``
    frames of ``nbytes`` each): frame ``p`` of the flat obs stacks goes to row ``p`` of ``obs_out``, and
    with ``shifted`` on to row ``p - 1`` of ``next_out``, so that only each next stack's last frame is
    decoded on its own. Returns ``(rows, src, sizes, dst, copies, absent)``: ``absent`` counts frames
    whose chunk address is not held (0); the caller then takes the general path."""
    n, k = obs_ids.shape
    obs_base, next_base = obs_out.ctypes.data, next_out.ctypes.data
    total = n * k + (n if shifted else n * k)
    rows = np.empty(total, dtype=np.int64)
    src = np.empty(total, dtype=np.int64)
    sizes = np.empty(total, dtype=np.int64)
    dst = np.empty(total, dtype=np.int64)
    copies = np.zeros(total, dtype=np.int64)
    absent = 0
    _prefetch_chunk_rows(obs_ids, next_ids, ring_rows, chunk_addr, chunk_size)
    for t in range(total):
        if t < n * k:
            fid = obs_ids[t // k, t % k]
            dst[t] = obs_base + t * nbytes
            if shifted and t % k > 0:
                copies[t] = next_base + (t - 1) * nbytes
        elif shifted:
            i = t - n * k
            fid = next_ids[i, k - 1]
            dst[t] = next_base + (i * k + k - 1) * nbytes
        else:
            p = t - n * k
            fid = next_ids[p // k, p % k]
            dst[t] = next_base + p * nbytes
        row = fid % ring_rows if ring_rows else fid
        rows[t] = row
        if 0 <= row < chunk_addr.size:
            src[t] = chunk_addr[row]
            sizes[t] = chunk_size[row]
        else:  # beyond what the tier has room for yet: the general path deals with it
            src[t] = sizes[t] = 0
        if src[t] <= 0:
            absent += 1
    return rows, src, sizes, dst, copies, absent


@numba.njit(cache=True, nogil=True)
def decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr, chunk_size, codec,
                  status):  # pragma: no cover (compiled)
    """``plan_stack_decodes`` and ``decode_chunks`` in one call (a batch too small to split over threads).
    Returns ``(failures, rows)``, with ``failures == -1`` and nothing written when a chunk is not held;
    ``status`` (at least one entry per decode) and ``rows`` say which chunk failed."""
    rows, src, sizes, dst, copies, absent = plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out,
                                                               nbytes, ring_rows, chunk_addr, chunk_size)
    if absent:
        return -1, rows
    return decode_chunks(src, sizes, dst, copies, nbytes, codec, status[:src.size]), rows


# -- entry points: every address and size checked before a kernel writes -------------------------------


def check_decodes(src, sizes, dst, copies, nbytes, codec, status, into) -> None:
    """Raise ``ValueError`` unless ``decode_chunks`` with these arguments writes only inside ``into`` (the
    one or two arrays the destination addresses point into): one size, destination and copy address
    (0: none) and status entry a chunk, each destination and copy with ``nbytes`` bytes of room."""
    n = src.size
    if sizes.size != n or dst.size != n or copies.size != n:
        raise ValueError(f"decode arrays disagree in length: {n} sources, {sizes.size} sizes, {dst.size} "
                         f"destinations, {copies.size} copies")
    check_array("status", status, ndim=1, min_size=n, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")
    if len(into) in (1, 2) and nbytes >= 0 and dst.dtype == copies.dtype == np.int64 and dst.ndim == copies.ndim == 1:
        (lo0, hi0), (lo1, hi1) = span(into[0], "the buffer dst points into"), span(into[-1], "the buffer dst points into")
        if _decodes_fit(dst, copies, nbytes, lo0, hi0, lo1, hi1):
            return  # one compiled pass (every batch's misses are checked); the checks below name a fault
    check_addresses("dst", dst, nbytes, into)
    check_addresses("copies", copies, nbytes, into, allow_zero=True)


@numba.njit(cache=True, nogil=True)
def _decodes_fit(dst, copies, nbytes, lo0, hi0, lo1, hi1):  # pragma: no cover (compiled)
    """Every ``dst[i]`` and every nonzero ``copies[i]`` has ``nbytes`` bytes inside ``[lo0, hi0)`` or
    ``[lo1, hi1)``: ``check_addresses`` for both in one pass."""
    for i in range(dst.size):
        a = dst[i]
        if not ((lo0 <= a and a + nbytes <= hi0) or (lo1 <= a and a + nbytes <= hi1)):
            return False
        c = copies[i]
        if c != 0 and not ((lo0 <= c and c + nbytes <= hi0) or (lo1 <= c and c + nbytes <= hi1)):
            return False
    return True


@numba.njit(cache=True, nogil=True)
def _frame_requests_fit(starts, js, run_rows, dsts, nbytes, lo0, hi0, lo1, hi1):  # pragma: no cover (compiled)
    """``check_frame_decodes``'s per-entry tests in one pass: starts never decrease, every frame is in
    ``[0, run_rows)`` and every destination has ``nbytes`` bytes inside ``[lo0, hi0)`` or ``[lo1, hi1)``."""
    for i in range(starts.size - 1):
        if starts[i + 1] < starts[i]:
            return False
    for i in range(js.size):
        if not 0 <= js[i] < run_rows:
            return False
        a = dsts[i]
        if not ((lo0 <= a and a + nbytes <= hi0) or (lo1 <= a and a + nbytes <= hi1)):
            return False
    return True


def check_frame_decodes(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into) -> None:
    """Raise ``ValueError`` unless ``decode_frame_groups`` with these arguments writes only inside ``into``:
    one size and status entry a group, group starts that tile the requests, every frame in ``[0, run_rows)``
    and every destination with ``frame_nbytes`` bytes of room. The entries are tested by one compiled pass
    (a batch's requests are checked on every draw); only when it finds a fault do the slower checks run,
    to name it."""
    n = src.size
    if sizes.size != n or starts.size != n + 1 or js.size != dsts.size:
        raise ValueError(f"frame-decode arrays disagree: {n} sources, {sizes.size} sizes, {starts.size} group starts, "
                         f"{js.size} frames, {dsts.size} destinations")
    if starts[0] != 0 or starts[-1] != js.size:
        raise ValueError(f"group starts {starts[:4]}...{starts[-2:]} do not tile the {js.size} requests")
    check_array("status", status, ndim=1, min_size=n, contiguous=False)
    plain = (len(into) in (1, 2) and frame_nbytes >= 0 and starts.dtype == js.dtype == dsts.dtype == np.int64
             and dsts.ndim == 1)
    if plain:
        (lo0, hi0), (lo1, hi1) = span(into[0], "the buffer dsts points into"), span(into[-1], "the buffer dsts points into")
        if _frame_requests_fit(starts, js, run_rows, dsts, frame_nbytes, lo0, hi0, lo1, hi1):
            return
    if (np.diff(starts) < 0).any():
        raise ValueError(f"group starts {starts[:4]}...{starts[-2:]} do not tile the {js.size} requests")
    check_indices("js", js, 0, run_rows)
    check_addresses("dsts", dsts, frame_nbytes, into)


def checked_decode_frame_groups(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into) -> int:
    """``decode_frame_groups`` after ``check_frame_decodes`` (and the linking self-test)."""
    check_frame_decodes(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status, into)
    ensure_linked()
    return decode_frame_groups(src, sizes, starts, js, dsts, frame_nbytes, run_rows, status)


def checked_group_frame_requests(ids, dsts, ring_rows, run_rows):
    """``group_frame_requests`` after checking its inputs (it writes only the arrays it returns)."""
    if ids.ndim != 1 or dsts.shape != ids.shape or ids.dtype != np.int64 or dsts.dtype != np.int64:
        raise ValueError(f"frame requests: ids {ids.dtype}{ids.shape} and dsts {dsts.dtype}{dsts.shape} must be "
                         "int64 vectors of one length")
    if run_rows < 1 or ring_rows < 0 or (ids.size and ids.min() < 0):
        raise ValueError(f"frame requests: run_rows {run_rows} (>= 1), ring_rows {ring_rows} (>= 0), ids >= 0")
    return group_frame_requests(ids, dsts, ring_rows, run_rows)


def checked_copy_rows_to(source: np.ndarray, rows, row_nbytes, dsts, into) -> None:
    """``copy_rows_to`` from the rows of ``source`` (C-contiguous) after checking each row is inside it and
    each destination has ``row_nbytes`` of room in ``into``."""
    lo, hi = span(source, "source")
    check_indices("rows", rows, 0, (hi - lo) // max(1, row_nbytes))
    check_addresses("dsts", dsts, row_nbytes, into)
    copy_rows_to(lo, rows, row_nbytes, dsts)


def checked_decode_chunks(src, sizes, dst, copies, nbytes, codec, status, into) -> int:
    """``decode_chunks`` after ``check_decodes`` (and, at the first call, the linking self-test); the
    number of failed chunks."""
    check_decodes(src, sizes, dst, copies, nbytes, codec, status, into)
    ensure_linked()
    return decode_chunks(src, sizes, dst, copies, nbytes, codec, status)


def _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size) -> int:
    """The number of decodes of a batch's stacks, after checking the outputs have room for ``n * k``
    frames of ``nbytes`` each and the chunk table's sizes cover its addresses."""
    if obs_ids.ndim != 2 or next_ids.shape != obs_ids.shape:
        raise ValueError(f"frame ids of shapes {obs_ids.shape} and {next_ids.shape} (expected the same (n, k))")
    n, k = obs_ids.shape
    for name, out in (("obs_out", obs_out), ("next_out", next_out)):
        lo, hi = span(out, name)
        if hi - lo < n * k * nbytes:
            raise ValueError(f"{name} holds {hi - lo} bytes, {n} stacks of {k} frames of {nbytes} bytes need "
                             f"{n * k * nbytes}; nothing was written")
    if chunk_size.size < chunk_addr.size:
        raise ValueError(f"a chunk table of {chunk_addr.size} addresses but {chunk_size.size} sizes")
    return n * k + (n if shifted else n * k)


class StackPlan(NamedTuple):
    """A batch's stack decodes as ``checked_plan_stack_decodes`` made them (and only it makes them): outputs
    checked to hold the batch, every destination and copy computed by the compiled plan from their bases,
    so they lie inside them and decoding the plan needs no second address check (``checked_decode_plan``,
    ``CodecHelpers.decode_plan``). ``absent``: frames whose chunk is not held (then the plan is not run)."""
    rows: np.ndarray
    src: np.ndarray
    sizes: np.ndarray
    dst: np.ndarray
    copies: np.ndarray
    absent: int
    nbytes: int


def checked_plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                               chunk_size) -> StackPlan:
    """``plan_stack_decodes`` for outputs checked to hold the batch (its destinations then lie inside them):
    the types here, the sizes in the compiled call; a fault is named by ``_check_stack_outputs``."""
    if _plain_stacks(obs_ids, next_ids, obs_out, next_out):
        planned = _plan_stack_decodes_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                              chunk_addr, chunk_size)
        if planned[-1] != -2:
            return StackPlan(*planned, nbytes)
    _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size)
    return StackPlan(*plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                         chunk_addr, chunk_size), nbytes)


def check_plan(plan: StackPlan, codec, status) -> None:
    """A plan to decode: made by ``checked_plan_stack_decodes`` with every chunk held, a known codec, and a
    status entry a decode (its addresses need no check: see ``StackPlan``)."""
    if type(plan) is not StackPlan:
        raise TypeError(f"a StackPlan from checked_plan_stack_decodes expected, got {type(plan).__name__}")
    if plan.absent:
        raise ValueError(f"the plan has {plan.absent} frames whose chunk is not held: nothing to decode them from")
    check_array("status", status, ndim=1, min_size=plan.src.size, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")


def checked_decode_plan(plan: StackPlan, codec, status) -> int:
    """``decode_chunks`` of a checked plan (``check_plan``); the number of failed chunks."""
    check_plan(plan, codec, status)
    ensure_linked()
    return decode_chunks(plan.src, plan.sizes, plan.dst, plan.copies, plan.nbytes, codec, status)


@numba.njit(cache=True, nogil=True)
def _outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size):  # pragma: no cover
    """What ``_check_stack_outputs`` checks, compiled: the outputs are C-contiguous and hold the batch."""
    n, k = obs_ids.shape
    return (next_ids.shape == obs_ids.shape and nbytes >= 0 and obs_out.flags.c_contiguous
            and next_out.flags.c_contiguous and obs_out.nbytes >= n * k * nbytes
            and next_out.nbytes >= n * k * nbytes and chunk_size.size >= chunk_addr.size)


@numba.njit(cache=True, nogil=True)
def _plan_stack_decodes_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                                chunk_size):  # pragma: no cover (compiled)
    """``plan_stack_decodes`` if the outputs hold the batch (``_outputs_fit``), else ``absent == -2``."""
    if not _outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size):
        none = np.empty(0, dtype=np.int64)
        return none, none, none, none, none, -2
    return plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                              chunk_size)


@numba.njit(cache=True, nogil=True)
def _decode_stacks_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                           chunk_size, codec, status):  # pragma: no cover (compiled)
    """``decode_stacks`` if the checks of ``checked_decode_stacks`` pass (they are tested here, in the one
    compiled call a batch makes), else ``(-2, rows)`` and nothing written: the entry point then names the
    fault."""
    n, k = obs_ids.shape
    total = n * k + (n if shifted else n * k)
    if not (_outputs_fit(obs_ids, next_ids, obs_out, next_out, nbytes, chunk_addr, chunk_size)
            and status.size >= total and (codec == CODEC_BLOSC or codec == CODEC_ZSTD or codec == CODEC_TEMPORAL)):
        return -2, np.empty(0, dtype=np.int64)
    return decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr, chunk_size,
                         codec, status)


_I64 = np.dtype(np.int64)


def _plain_stacks(obs_ids, next_ids, obs_out, next_out) -> bool:
    """The types the compiled checks take, in one expression (this runs every batch): 2-D int64 frame ids
    and numpy outputs (their layout and sizes are tested in the compiled call)."""
    return (type(obs_ids) is type(next_ids) is type(obs_out) is type(next_out) is np.ndarray
            and obs_ids.dtype == _I64 and next_ids.dtype == _I64 and obs_ids.ndim == 2 and next_ids.ndim == 2)


def checked_decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                          chunk_size, codec, status):
    """``decode_stacks`` after checking the outputs hold the batch and ``status`` has an entry a decode.
    The types are tested here, the sizes inside the compiled call; a fault is then named by the checks
    below."""
    if (_plain_stacks(obs_ids, next_ids, obs_out, next_out) and type(status) is np.ndarray and status.ndim == 1
            and type(codec) is int):
        ensure_linked()
        bad, rows = _decode_stacks_checked(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows,
                                           chunk_addr, chunk_size, codec, status)
        if bad != -2:
            return bad, rows
    total = _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size)
    check_array("status", status, ndim=1, min_size=total, contiguous=False)
    if codec not in CODECS:
        raise ValueError(f"codec {codec!r} is none of the compiled decoder's {CODECS}")
    ensure_linked()
    return decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr, chunk_size,
                         codec, status)


# -- the C symbols checked once, at first use ----------------------------------------------------------
class LinkError(RuntimeError):
    """The C functions linked into the kernels do not decode a known chunk to its bytes (a build of
    numcodecs or google-crc32c whose exported symbols do something else than their names say)."""


_LINK_CHECKED = False
_LINK_LOCK = threading.Lock()


def _known_chunks() -> list[tuple[int, str, bytes, bytes]]:
    """``(codec, what, chunk, expected)``: a small frame run coded by numcodecs (and by hand for the
    temporal codec), checksum appended as zarr does, and the bytes numcodecs decodes it to."""
    import google_crc32c
    from numcodecs import Blosc, Zstd, lz4, zstd

    frames = (np.arange(2 * 96, dtype=np.int64) * 7 % 251).astype(np.uint8).reshape(2, 96)
    frames[1] = frames[0] + 3  # a second frame close to the first, as a temporal run's are
    raw = frames.tobytes()

    def sealed(body: bytes) -> bytes:
        return body + int(google_crc32c.value(body)).to_bytes(4, "little")

    blosc = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    run = b"".join((temporal.HEADER.pack(temporal.MAGIC, 2, frames.shape[1]), bytes([0, 1]),
                    zstd.compress(np.stack([frames[0], frames[1] - frames[0]]).tobytes(), 3)))
    # layout 3: the key an LZ4 block in numcodecs' format (4-byte size, then the block), the residual zstd
    parts = [lz4.compress(frames[0].tobytes()), zstd.compress((frames[1] - frames[0]).tobytes(), 3)]
    run3 = b"".join((temporal.HEADER.pack(temporal.MAGIC2, 2, frames.shape[1]), bytes([0, 1]),
                     np.cumsum([len(p) for p in parts]).astype("<u4").tobytes(), *parts))
    return [(CODEC_BLOSC, "numcodecs.blosc: blosc_decompress_ctx / blosc_cbuffer_validate (lz4)",
             sealed(blosc.encode(raw)), bytes(blosc.decode(blosc.encode(raw)))),
            (CODEC_ZSTD, "numcodecs.zstd: ZSTD_decompress / ZSTD_isError",
             sealed(Zstd(level=1).encode(raw)), bytes(Zstd(level=1).decode(Zstd(level=1).encode(raw)))),
            (CODEC_TEMPORAL, "numcodecs.zstd: ZSTD_decompress (temporal run)", sealed(run), raw),
            (CODEC_TEMPORAL, "numcodecs.lz4: LZ4_decompress_safe (temporal run, layout 3)", sealed(run3), raw)]


def self_test() -> None:
    """Decode each known chunk through the linked symbols and compare with numcodecs' bytes; raises
    ``LinkError`` naming the library and symbol whose result differs."""
    for codec, what, chunk, expected in _known_chunks():
        src = np.frombuffer(chunk, dtype=np.uint8).copy()
        out = np.zeros(len(expected), dtype=np.uint8)
        status = np.zeros(1, dtype=np.int8)
        decode_chunks(np.array([src.ctypes.data], np.int64), np.array([src.size], np.int64),
                      np.array([out.ctypes.data], np.int64), np.zeros(1, np.int64), out.size, codec, status)
        if status[0] == BAD_CHECKSUM:
            raise LinkError("google_crc32c._crc32c: crc32c_value computed another checksum of a known chunk "
                            "than google_crc32c.value; the compiled decoder cannot be used")
        if status[0] != OK or out.tobytes() != expected:
            got = STATUS_TEXT.get(int(status[0]), "bytes that differ")
            raise LinkError(f"{what}: a known {len(expected)}-byte chunk decoded through the linked symbol "
                            f"gave {got}, not numcodecs' bytes; the compiled decoder cannot be used")


def ensure_linked() -> None:
    """``self_test`` once a process (a no-op after it passed)."""
    global _LINK_CHECKED
    if _LINK_CHECKED:
        return
    with _LINK_LOCK:
        if not _LINK_CHECKED:
            self_test()
            _LINK_CHECKED = True


