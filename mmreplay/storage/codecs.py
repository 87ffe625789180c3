"""Compressor specs: one JSON description, mapped both to numcodecs (our fast path) and to zarr's codec
metadata (so any zarr v3 reader decodes the same bytes).

Invariant: for a spec ``s`` and dtype ``d``, bytes written by ``numcodecs_compressor(s, d)`` decode with
the zarr codec ``zarr_compressor(s, d)`` and vice versa; Blosc runs single-threaded (we parallelise
across chunks instead, like zarr does). ``Compressor.decode`` hands a payload to the codec library only
after its header is checked against the payload and the expected chunk (blosc: version, flags, codec,
typesize, sizes, blocksize and block starts; zstd: magic, no dictionary, a declared content size equal to
the chunk's): the libraries trust their headers, so a truncated or edited payload whose checksum was
recomputed would otherwise be read past its end or decoded into garbage.
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np
from numcodecs import blosc, zstd

from mmreplay.storage import temporal

blosc.use_threads = False  # many small chunks in parallel beat Blosc's own threads (zarr does the same)

BLOSC_CNAMES = ("lz4", "lz4hc", "zstd", "zlib", "blosclz")
BLOSC_FORMAT_CODE = {"blosclz": 0, "lz4": 1, "lz4hc": 1, "zlib": 3, "zstd": 4}  # header flags >> 5
BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
BLOSC_MAX_VERSION = 2  # c-blosc 1.x writes format 2 (1: older releases)
BLOSC_SHUFFLE, BLOSC_MEMCPYED, BLOSC_BITSHUFFLE, BLOSC_RESERVED = 0x1, 0x2, 0x4, 0x8
ZSTD_MAGIC = 0xFD2FB528


def validate_codec(spec: Any) -> Mapping[str, Any]:
    if not isinstance(spec, Mapping) or spec.get("name") not in ("blosc", "zstd", "temporal"):
        raise ValueError(f"codec {spec!r} unknown: expected {{'name': 'blosc', 'cname': ..., 'clevel': ...}}, "
                         "{'name': 'zstd', 'level': ...} or {'name': 'temporal', 'level': ..., 'run': ...}")
    if spec["name"] == "temporal":
        validate_temporal(spec)
    elif spec["name"] == "blosc":
        if spec.get("cname", "lz4") not in BLOSC_CNAMES or not 0 <= int(spec.get("clevel", 5)) <= 9:
            raise ValueError(f"blosc codec {dict(spec)} invalid: cname one of {BLOSC_CNAMES}, clevel 0..9")
    elif not -7 <= int(spec.get("level", 1)) <= 22:
        raise ValueError(f"zstd codec {dict(spec)} invalid: level must be in -7..22")
    return spec


def validate_temporal(spec: Mapping[str, Any]) -> None:
    """A temporal codec spec (``storage/temporal.py``): zstd level, frames per run, reference search, layout
    (and for layout 3 the chain depth up to which frames are LZ4)."""
    level, run = spec.get("level", temporal.DEFAULT_LEVEL), spec.get("run", temporal.DEFAULT_RUN)
    search = spec.get("search", temporal.DEFAULT_SEARCH)
    layout = spec.get("layout", temporal.DEFAULT_LAYOUT)
    if layout not in temporal.LAYOUTS or isinstance(layout, bool):
        raise ValueError(f"temporal codec {dict(spec)} invalid: layout must be one of {temporal.LAYOUTS}, "
                         f"got {layout!r}")
    max_run = temporal.MAX_RUN if layout == 1 else 64  # layouts 2 and 3: references are signed bytes
    checks = [("level", level, -7, 22), ("run", run, 1, max_run), ("search", search, 0, temporal.MAX_RUN)]
    if layout == 3:  # frames up to this many references from a key are LZ4 (a chain is shorter than the run)
        checks.append(("lz4_depth", spec.get("lz4_depth", temporal.DEFAULT_LZ4_DEPTH), 0, max_run))
    elif "lz4_depth" in spec:
        raise ValueError(f"temporal codec {dict(spec)} invalid: lz4_depth applies to layout 3 only")
    for key, value, lo, hi in checks:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"temporal codec {dict(spec)} invalid: {key} must be an integer in {lo}..{hi}, "
                             f"got {value!r}")
    if run & (run - 1):
        raise ValueError(f"temporal codec {dict(spec)} invalid: run must be a power of two (chunks tile shards), "
                         f"got {run}")


def _shuffle(dtype: np.dtype) -> int:
    return blosc.NOSHUFFLE if dtype.itemsize == 1 else blosc.SHUFFLE


class Compressor:
    """encode(array) -> bytes and decode(bytes, out=array) through numcodecs' module-level functions:
    the same bytes as ``numcodecs.Blosc``/``Zstd``, without their per-call Python wrapping (which costs
    more than compressing an 84x84 frame). Both release the GIL while they work."""

    def __init__(self, spec: Mapping[str, Any], dtype: np.dtype):
        spec = validate_codec(spec)
        self.spec = spec
        self.itemsize = np.dtype(dtype).itemsize
        if spec["name"] == "temporal":
            level = int(spec.get("level", temporal.DEFAULT_LEVEL))
            search = int(spec.get("search", temporal.DEFAULT_SEARCH))
            layout = int(spec.get("layout", temporal.DEFAULT_LAYOUT))
            lz4_depth = int(spec.get("lz4_depth", temporal.DEFAULT_LZ4_DEPTH))
            self.encode = lambda arr: temporal.encode(arr, level, search, layout, lz4_depth)
            self._decompress = None
        elif spec["name"] == "blosc":
            self.format_code = BLOSC_FORMAT_CODE[spec.get("cname", "lz4")]
            cname = spec.get("cname", "lz4").encode()
            clevel, shuffle = int(spec.get("clevel", 5)), _shuffle(np.dtype(dtype))
            self.encode = lambda arr: blosc.compress(arr, cname, clevel, shuffle, 0)
            self._decompress = blosc.decompress
        else:
            level = int(spec.get("level", 1))
            self.encode = lambda arr: zstd.compress(arr, level)
            self._decompress = zstd.decompress

    def decode(self, data, out: np.ndarray) -> np.ndarray:
        """Decode into ``out``; a payload of another decoded size is an error (neither library says so
        when decoding into a buffer)."""
        if self._decompress is None:  # temporal: checks its own header and zstd's announced size
            temporal.decode_run(data, out)
        elif self._decompress is blosc.decompress:
            check_blosc_header(data, out.nbytes, self.itemsize, self.format_code)
            self._decompress(data, out)
        else:
            check_zstd_header(data, out.nbytes)
            decoded = self._decompress(data)
            if len(decoded) != out.nbytes:
                raise ValueError(f"payload holds {len(decoded)} bytes")
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
        return out


def check_blosc_header(data, nbytes: int, itemsize: int, format_code: int) -> None:
    """``ValueError`` unless ``data`` is a blosc 1 payload of exactly ``len(data)`` bytes that decodes to
    ``nbytes`` bytes of items of ``itemsize`` with the compressor of ``format_code``, whose blocks all start
    inside it: what c-blosc trusts without checking (it reads ``cbytes`` from the header, not the buffer)."""
    if not isinstance(data, bytes):
        data = memoryview(data).cast("B")
    if len(data) < BLOSC_HEADER.size:
        raise ValueError(f"blosc payload of {len(data)} bytes is shorter than its header ({BLOSC_HEADER.size})")
    version, _, flags, typesize, announced, blocksize, cbytes = BLOSC_HEADER.unpack_from(data)
    if not 1 <= version <= BLOSC_MAX_VERSION:
        raise ValueError(f"blosc header: format version {version}, expected 1..{BLOSC_MAX_VERSION}")
    if flags & BLOSC_RESERVED or (flags & BLOSC_SHUFFLE and flags & BLOSC_BITSHUFFLE) or flags >> 5 != format_code:
        raise ValueError(f"blosc header: flags {flags:#04x} do not describe this column's codec "
                         f"(compressor format {format_code})")
    if typesize != (itemsize if itemsize <= 255 else 1):
        raise ValueError(f"blosc header: typesize {typesize}, expected {itemsize}")
    if announced != nbytes:
        raise ValueError(f"blosc header announces {announced} bytes, expected {nbytes}")
    if cbytes != len(data):
        raise ValueError(f"blosc header says the payload is {cbytes} bytes, it is {len(data)} (truncated or "
                         "padded chunk)")
    if not 0 < blocksize <= max(nbytes, 1):
        raise ValueError(f"blosc header: blocksize {blocksize} outside [1, {nbytes}]")
    if flags & BLOSC_MEMCPYED:
        if cbytes != nbytes + BLOSC_HEADER.size:
            raise ValueError(f"blosc header: an uncompressed payload of {nbytes} bytes takes {cbytes}")
        return
    n_blocks = -(-nbytes // blocksize)
    first = BLOSC_HEADER.size + 4 * n_blocks
    if first > cbytes:
        raise ValueError(f"blosc header: {n_blocks} block starts do not fit a payload of {cbytes} bytes")
    starts = struct.unpack_from(f"<{n_blocks}i", data, BLOSC_HEADER.size)  # few: n_blocks * 4 <= cbytes
    if n_blocks and (min(starts) < first or max(starts) >= cbytes):
        raise ValueError(f"blosc header: a block starts outside [{first}, {cbytes})")


def check_zstd_header(data, nbytes: int) -> None:
    """``ValueError`` unless ``data`` starts with a zstd frame, made without a dictionary, that declares a
    content size of ``nbytes`` (so the library never allocates what a damaged header claims)."""
    if not isinstance(data, bytes):
        data = memoryview(data).cast("B")
    if len(data) < 6 or int.from_bytes(data[:4], "little") != ZSTD_MAGIC:
        raise ValueError("not a zstd frame (bad magic number)")
    descriptor = data[4]
    fcs_flag, single_segment, reserved, dict_flag = descriptor >> 6, (descriptor >> 5) & 1, descriptor & 8, \
        descriptor & 3
    if reserved or dict_flag:
        raise ValueError(f"zstd frame descriptor {descriptor:#04x}: reserved bit or dictionary set")
    fcs_size = (1 if single_segment else 0, 2, 4, 8)[fcs_flag]
    start = 5 + (0 if single_segment else 1)
    if fcs_size == 0 or len(data) < start + fcs_size:
        raise ValueError("zstd frame does not declare its content size")
    declared = int.from_bytes(data[start:start + fcs_size], "little") + (256 if fcs_size == 2 else 0)
    if declared != nbytes:
        raise ValueError(f"zstd frame declares {declared} bytes, expected {nbytes}")


def numcodecs_compressor(spec: Mapping[str, Any], dtype: np.dtype) -> Compressor:
    return Compressor(spec, dtype)


def zarr_compressor(spec: Mapping[str, Any], dtype: np.dtype):
    from zarr.codecs import BloscCodec, ZstdCodec

    spec = validate_codec(spec)
    dtype = np.dtype(dtype)
    if spec["name"] == "temporal":
        temporal.register_with_zarr()
        return temporal.zarr_codec_class()(level=int(spec.get("level", temporal.DEFAULT_LEVEL)),
                                           search=int(spec.get("search", temporal.DEFAULT_SEARCH)),
                                           layout=int(spec.get("layout", temporal.DEFAULT_LAYOUT)),
                                           lz4_depth=int(spec.get("lz4_depth", temporal.DEFAULT_LZ4_DEPTH)))
    if spec["name"] == "blosc":
        return BloscCodec(cname=spec.get("cname", "lz4"), clevel=int(spec.get("clevel", 5)),
                          shuffle="noshuffle" if dtype.itemsize == 1 else "shuffle", typesize=dtype.itemsize,
                          blocksize=0)
    return ZstdCodec(level=int(spec.get("level", 1)), checksum=False)
