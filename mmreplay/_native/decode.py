"""Compiled chunk decoding: checksum and decompress many chunks in one call, with the GIL released.

Invariant: ``decode_chunks`` writes chunk ``i`` into ``dst_addrs[i]`` only after its crc32c matched the
4 checksum bytes that end it, and sets ``status[i]`` to ``OK`` only when the codec produced exactly
``dst_nbytes`` bytes; any other outcome is a nonzero status and the caller raises (never returns the
destination as data). The bytes are the same ``compressor(bytes) + crc32c`` chunks that zarr writes
(see ``storage/shardfile.py``), so nothing about the format changes.

Why compiled: the Python path spends ~7 us per 84x84 frame (pread, crc32c, blosc and the Python around
them), the codec itself ~1 us. The C functions come from the libraries the package already depends on —
c-blosc and zstd inside numcodecs' extension modules, crc32c inside google-crc32c — linked by name into
numba kernels, so a batch of misses is one call without Python per chunk. If a build of those packages
does not export the symbols, ``AVAILABLE`` is False and the reader keeps the Python path.
"""

from __future__ import annotations

import importlib

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

from mmreplay._native.intrinsics import address, prefetch
from mmreplay._native import intrinsics, kernel_cache
from mmreplay._native import temporal_header as temporal

kernel_cache.follow(__file__, intrinsics, temporal)  # the kernels inline both (see kernel_cache)

OK, BAD_CHECKSUM, BAD_SIZE, BAD_CODEC = 0, 1, 2, 3
CODEC_BLOSC, CODEC_ZSTD, CODEC_TEMPORAL = 0, 1, 2
# the temporal codec's header (_native/temporal_header.py): magic, run length, frame bytes, one reference a frame
TEMPORAL_MAGIC = int.from_bytes(temporal.MAGIC, "little")
TEMPORAL_HEADER = temporal.HEADER.size
TEMPORAL_MAX_RUN = temporal.MAX_RUN
STATUS_TEXT = {BAD_CHECKSUM: "checksum mismatch (stored data is corrupt)",
               BAD_SIZE: "chunk does not decode to the expected number of bytes",
               BAD_CODEC: "the codec failed to decode the chunk"}
_SYMBOLS = {"numcodecs.blosc": ("blosc_decompress_ctx", "blosc_cbuffer_validate"),
            "numcodecs.zstd": ("ZSTD_decompress", "ZSTD_isError"),
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
crc32c = types.ExternalFunction("crc32c_value", types.uint32(_vp, _sz))
memcpy = types.ExternalFunction("memcpy", _vp(_vp, _vp, _sz))


@numba.njit(cache=True, nogil=True)
def _decode_temporal(src, body, dst, dst_nbytes, header):  # pragma: no cover (compiled)
    """A temporal run (``storage/temporal.py``): the header checked against ``dst_nbytes``, every reference
    checked to point inside the run, zstd into ``dst``, then each frame rebuilt from its reference."""
    if body < TEMPORAL_HEADER:
        return BAD_SIZE
    memcpy(header.ctypes.data, src, TEMPORAL_HEADER)
    words = header[:TEMPORAL_HEADER].view(np.uint32)
    n, frame_nbytes = np.int64(words[1]), np.int64(words[2])
    if words[0] != TEMPORAL_MAGIC or n < 1 or n > TEMPORAL_MAX_RUN or n * frame_nbytes != dst_nbytes:
        return BAD_SIZE
    if body < TEMPORAL_HEADER + n:
        return BAD_SIZE
    memcpy(header.ctypes.data, src + TEMPORAL_HEADER, n)
    for i in range(n):
        if header[i] > i:
            return BAD_CODEC
    got = zstd_decompress(dst, dst_nbytes, src + TEMPORAL_HEADER + n, body - TEMPORAL_HEADER - n)
    if zstd_is_error(got) != 0:
        return BAD_CODEC
    if got != dst_nbytes:
        return BAD_SIZE
    frames = numba.carray(address(dst), (n, frame_nbytes), np.uint8)
    for i in range(1, n):
        d = np.int64(header[i])
        if d:
            frames[i] += frames[i - d]
    return OK


@numba.njit(cache=True, nogil=True)
def _decode_one(src, size, dst, dst_nbytes, codec, scratch, header):  # pragma: no cover (compiled)
    if size < 4:
        return BAD_SIZE
    body = size - 4
    memcpy(scratch.ctypes.data, src + body, 4)
    if crc32c(src, body) != (scratch[0] & np.uint64(0xFFFFFFFF)):
        return BAD_CHECKSUM
    if codec == CODEC_TEMPORAL:
        return _decode_temporal(src, body, dst, dst_nbytes, header)
    if codec == CODEC_BLOSC:
        # validate first: blosc_decompress_ctx trusts the compressed size in the chunk's header
        if blosc_validate(src, body, scratch.ctypes.data) != 0 or scratch[0] != dst_nbytes:
            return BAD_SIZE
        if blosc_decompress(src, dst, dst_nbytes, 1) != dst_nbytes:
            return BAD_CODEC
        return OK
    got = zstd_decompress(dst, dst_nbytes, src, body)
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
    bad = 0
    n = src_addrs.size
    for i in range(min(PREFETCH_AHEAD, n)):
        _prefetch_chunk(src_addrs[i], sizes[i])
    for i in range(n):
        if i + PREFETCH_AHEAD < n:
            _prefetch_chunk(src_addrs[i + PREFETCH_AHEAD], sizes[i + PREFETCH_AHEAD])
        status[i] = _decode_one(src_addrs[i], sizes[i], dst_addrs[i], dst_nbytes, codec, scratch, header)
        if status[i] != OK:
            bad += 1
        elif copy_addrs[i] != 0:
            memcpy(copy_addrs[i], dst_addrs[i], dst_nbytes)
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


def codec_kind(spec) -> int | None:
    """The kernel's code for a codec spec (``storage/codecs.py``), or None if it has none."""
    if spec.get("name") == "blosc":
        return CODEC_BLOSC
    if spec.get("name") == "zstd":
        return CODEC_ZSTD
    if spec.get("name") == "temporal":
        return CODEC_TEMPORAL
    return None
