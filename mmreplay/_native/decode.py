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
import threading

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import types

from mmreplay._native.bounds import check_addresses, check_array, span
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


# -- entry points: every address and size checked before a kernel writes -------------------------------
CODECS = (CODEC_BLOSC, CODEC_ZSTD, CODEC_TEMPORAL)


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
    check_addresses("dst", dst, nbytes, into)
    check_addresses("copies", copies, nbytes, into, allow_zero=True)


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


def checked_plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                               chunk_size):
    """``plan_stack_decodes`` for outputs checked to hold the batch (its destinations then lie inside them)."""
    _check_stack_outputs(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, chunk_addr, chunk_size)
    return plan_stack_decodes(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                              chunk_size)


def checked_decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, chunk_addr,
                          chunk_size, codec, status):
    """``decode_stacks`` after checking the outputs hold the batch and ``status`` has an entry a decode."""
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
    from numcodecs import Blosc, Zstd, zstd

    frames = (np.arange(2 * 96, dtype=np.int64) * 7 % 251).astype(np.uint8).reshape(2, 96)
    frames[1] = frames[0] + 3  # a second frame close to the first, as a temporal run's are
    raw = frames.tobytes()

    def sealed(body: bytes) -> bytes:
        return body + int(google_crc32c.value(body)).to_bytes(4, "little")

    blosc = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    run = b"".join((temporal.HEADER.pack(temporal.MAGIC, 2, frames.shape[1]), bytes([0, 1]),
                    zstd.compress(np.stack([frames[0], frames[1] - frames[0]]).tobytes(), 3)))
    return [(CODEC_BLOSC, "numcodecs.blosc: blosc_decompress_ctx / blosc_cbuffer_validate (lz4)",
             sealed(blosc.encode(raw)), bytes(blosc.decode(blosc.encode(raw)))),
            (CODEC_ZSTD, "numcodecs.zstd: ZSTD_decompress / ZSTD_isError",
             sealed(Zstd(level=1).encode(raw)), bytes(Zstd(level=1).decode(Zstd(level=1).encode(raw)))),
            (CODEC_TEMPORAL, "numcodecs.zstd: ZSTD_decompress (temporal run)", sealed(run), raw)]


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


def available() -> bool:
    """Whether the compiled decoder can be used: the symbols are linked (else the Python path) and decode
    known chunks right (else ``LinkError``: garbage is never decoded)."""
    if not AVAILABLE:
        return False
    ensure_linked()
    return True
