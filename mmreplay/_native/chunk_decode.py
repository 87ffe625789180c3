"""Compiled chunk decoding: checksum and decompress many chunks in one call, with the GIL released.

Invariant: ``decode_chunks`` writes chunk ``i`` into ``dst_addrs[i]`` only after its crc32c matched the
4 checksum bytes that end it (with ``verified``: after ``verify_chunks`` found it matched where the bytes came
into this process, the compressed tier's install, ``reading/resident.py``; held bytes are not re-checked, as
decoded frames are not), and sets ``status[i]`` to ``OK`` only when the codec produced exactly
``dst_nbytes`` bytes; any other outcome is a nonzero status and the caller raises (never returns the
destination as data). The bytes are the same ``compressor(bytes) + crc32c`` chunks that zarr writes
(see ``storage/format/shardfile.py``), so nothing about the format changes. Every destination is checked
by the entry points (``decode.check_decodes``) before these kernels run.

Why compiled: the Python path spends ~7 us per 84x84 frame (pread, crc32c, blosc and the Python around
them), the codec itself ~1 us. The C functions (``linked.py``) come from the libraries the package already
depends on, so a batch of misses is one call without Python per chunk.
"""

from __future__ import annotations

import numba
import numpy as np

from mmreplay._native import codec_kinds, delta_lz4, intrinsics, kernel_cache, linked, run_decode
from mmreplay._native import temporal_header as temporal
from mmreplay._native.intrinsics import prefetch
# the kinds the kernels switch on; which codec has which is said by the codec's module (``mmreplay/codecs/``)
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_DELTA_LZ4, CODEC_TEMPORAL
from mmreplay._native.delta_lz4 import decode_delta_lz4_run
from mmreplay._native.linked import (BAD_CHECKSUM, BAD_CODEC, BAD_SIZE, OK, blosc_decompress, blosc_validate, crc32c,
                                     memcpy, zstd_create_dctx, zstd_free_dctx, zstd_into, zstd_is_error)
from mmreplay._native.run_decode import RUN2_MAX, TEMPORAL_HEADER, TEMPORAL_MAX_RUN, decode_temporal_run

# the kernels inline these (see kernel_cache)
kernel_cache.follow(__file__, intrinsics, temporal, codec_kinds, linked, run_decode, delta_lz4)


@numba.njit(cache=True, nogil=True)
def copy_rows_to(base, rows, row_nbytes, dsts):  # pragma: no cover (compiled)
    """Row ``rows[i]`` of the ``row_nbytes``-byte rows at address ``base`` to address ``dsts[i]``."""
    for i in range(rows.size):
        memcpy(dsts[i], base + rows[i] * row_nbytes, row_nbytes)


@numba.njit(cache=True, nogil=True)
def _decode_one(src, size, dst, dst_nbytes, codec, scratch, header, dctx, work, ends,
                verified):  # pragma: no cover (compiled)
    """One chunk of ``codec`` (``size`` bytes at ``src``, checksum included) into the ``dst_nbytes`` bytes at
    ``dst``, only after its crc32c matched (``verified``: it did, when the bytes came in); a status. A new codec
    kind is a branch here."""
    if size < 4:
        return BAD_SIZE
    body = size - 4
    if not verified:
        memcpy(scratch.ctypes.data, src + body, 4)
        if crc32c(src, body) != (scratch[0] & np.uint64(0xFFFFFFFF)):
            return BAD_CHECKSUM
    if codec == CODEC_TEMPORAL:
        return decode_temporal_run(src, body, dst, dst_nbytes, header, dctx, work, ends)
    if codec == CODEC_DELTA_LZ4:
        return decode_delta_lz4_run(src, body, dst, dst_nbytes, 0)
    if codec == CODEC_BLOSC:
        # validate first: blosc_decompress_ctx trusts the compressed size in the chunk's header
        if blosc_validate(src, body, scratch.ctypes.data) != 0 or scratch[0] != dst_nbytes:
            return BAD_SIZE
        if blosc_decompress(src, dst, dst_nbytes, 1) != dst_nbytes:
            return BAD_CODEC
        return OK
    got = zstd_into(dctx, dst, dst_nbytes, src, body)
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
def decode_chunks(src_addrs, sizes, dst_addrs, copy_addrs, dst_nbytes, codec, status,
                  verified=False):  # pragma: no cover (compiled)
    """Decode chunk i (``sizes[i]`` bytes at address ``src_addrs[i]``, checksum included) to address
    ``dst_addrs[i]``, and copy it on to ``copy_addrs[i]`` unless that is 0 (while the bytes are still in
    the core's cache: a frame that two outputs need is decoded once); ``status[i]`` says how it went.
    Returns the number of failures. ``verified``: every chunk's checksum matched already (``verify_chunks``
    when its bytes came into this process): not computed again."""
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
                                work, ends, verified)
        if status[i] != OK:
            bad += 1
        elif copy_addrs[i] != 0:
            memcpy(copy_addrs[i], dst_addrs[i], dst_nbytes)
    if dctx != 0:
        zstd_free_dctx(dctx)
    return bad


@numba.njit(cache=True, nogil=True)
def verify_chunks(src_addrs, sizes, ok):  # pragma: no cover (compiled)
    """``ok[i]``: chunk ``i`` (``sizes[i]`` bytes at ``src_addrs[i]``) ends with the crc32c of the bytes before
    those 4. Where bytes come into this process once and are then held (the compressed tier), this is their
    one check; ``decode_chunks`` and ``run_decode.decode_frame_groups`` are told so (``verified``). Returns
    how many failed."""
    word = np.zeros(1, dtype=np.uint64)
    bad = 0
    for i in range(src_addrs.size):
        size = sizes[i]
        ok[i] = False
        if size >= 4:
            memcpy(word.ctypes.data, src_addrs[i] + size - 4, 4)
            ok[i] = crc32c(src_addrs[i], size - 4) == (word[0] & np.uint64(0xFFFFFFFF))
        if not ok[i]:
            bad += 1
    return bad
