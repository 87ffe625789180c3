"""The C functions the decode kernels call, linked by name from the libraries the package already depends on,
and the statuses the kernels report.

Invariant: ``AVAILABLE`` is True only if every symbol below was found in the library named for it (c-blosc
and zstd inside numcodecs' extension modules, LZ4 too, crc32c inside google-crc32c); when it is False no
kernel of ``chunk_decode``, ``run_decode``, ``stack_plan`` or ``runs`` may be called (the reader keeps the
Python path). A kernel's status is ``OK`` only when a chunk decoded to exactly the bytes asked for;
``STATUS_TEXT`` names every other one. That a linked symbol decodes as numcodecs does is proved once a
process, before the first decode, by ``selftest.ensure_linked``.

Why by name: the functions are called as external symbols, not addresses, so numba's on-disk cache of the
kernels stays valid across processes.
"""

from __future__ import annotations

import importlib

import llvmlite.binding as llvm
import numba
from numba import types

OK, BAD_CHECKSUM, BAD_SIZE, BAD_CODEC = 0, 1, 2, 3
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
def zstd_into(dctx, dst, capacity, src, size):  # pragma: no cover (compiled)
    """The zstd frame of ``size`` bytes at ``src`` into at most ``capacity`` bytes at ``dst``, with the caller's
    decompression context ``dctx`` (0: zstd makes one for this call); zstd's result (``zstd_is_error`` tells)."""
    if dctx != 0:
        return zstd_decompress_dctx(dctx, dst, capacity, src, size)
    return zstd_decompress(dst, capacity, src, size)


