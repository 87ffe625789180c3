"""Compressor specs: one JSON description, mapped both to numcodecs (our fast path) and to zarr's codec
metadata (so any zarr v3 reader decodes the same bytes).

Invariant: for a spec ``s`` and dtype ``d``, bytes written by ``numcodecs_compressor(s, d)`` decode with
the zarr codec ``zarr_compressor(s, d)`` and vice versa; Blosc runs single-threaded (we parallelise
across chunks instead, like zarr does).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np
from numcodecs import blosc, zstd

from mmreplay.storage import temporal

blosc.use_threads = False  # many small chunks in parallel beat Blosc's own threads (zarr does the same)

BLOSC_CNAMES = ("lz4", "lz4hc", "zstd", "zlib", "blosclz")


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
    """A temporal codec spec (``storage/temporal.py``): zstd level, frames per run, reference search."""
    level, run = spec.get("level", temporal.DEFAULT_LEVEL), spec.get("run", temporal.DEFAULT_RUN)
    search = spec.get("search", temporal.DEFAULT_SEARCH)
    for key, value, lo, hi in (("level", level, -7, 22), ("run", run, 1, temporal.MAX_RUN),
                               ("search", search, 0, temporal.MAX_RUN)):
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
        if spec["name"] == "temporal":
            level = int(spec.get("level", temporal.DEFAULT_LEVEL))
            search = int(spec.get("search", temporal.DEFAULT_SEARCH))
            self.encode = lambda arr: temporal.encode_run(arr, level, search)
            self._decompress = None
        elif spec["name"] == "blosc":
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
        if self._decompress is None:
            temporal.decode_run(data, out)
        elif self._decompress is blosc.decompress:
            announced = struct.unpack_from("<I", data, 4)[0] if len(data) >= 16 else None  # header: nbytes
            if announced != out.nbytes:
                raise ValueError(f"blosc header announces {announced} bytes")
            self._decompress(data, out)
        else:
            decoded = self._decompress(data)
            if len(decoded) != out.nbytes:
                raise ValueError(f"payload holds {len(decoded)} bytes")
            out.reshape(-1).view(np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
        return out


def numcodecs_compressor(spec: Mapping[str, Any], dtype: np.dtype) -> Compressor:
    return Compressor(spec, dtype)


def zarr_compressor(spec: Mapping[str, Any], dtype: np.dtype):
    from zarr.codecs import BloscCodec, ZstdCodec

    spec = validate_codec(spec)
    dtype = np.dtype(dtype)
    if spec["name"] == "temporal":
        temporal.register_with_zarr()
        return temporal.zarr_codec_class()(level=int(spec.get("level", temporal.DEFAULT_LEVEL)),
                                           search=int(spec.get("search", temporal.DEFAULT_SEARCH)))
    if spec["name"] == "blosc":
        return BloscCodec(cname=spec.get("cname", "lz4"), clevel=int(spec.get("clevel", 5)),
                          shuffle="noshuffle" if dtype.itemsize == 1 else "shuffle", typesize=dtype.itemsize,
                          blocksize=0)
    return ZstdCodec(level=int(spec.get("level", 1)), checksum=False)
