"""Zstandard frame codec (``{"name": "zstd", "level": ...}``): one zstd frame a chunk, the bytes numcodecs'
and zarr's ``ZstdCodec`` (without checksum) write.

Invariant: ``decode_chunk`` hands a payload to zstd only after its header declares, without a dictionary,
a content size equal to the chunk's (so the library never allocates what a damaged header claims), and
writes ``out`` only when zstd produced exactly that many bytes.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np
from numcodecs import zstd

from mmreplay._native.codec_kinds import CODEC_ZSTD
from mmreplay.codecs.base import PIECE_ZSTD, DevicePieces, FrameCodec, read_le, whole_chunk_pieces
from mmreplay.codecs.registry import register

ZSTD_MAGIC = 0xFD2FB528


@register
class ZstdFrameCodec(FrameCodec):
    """zstd through numcodecs' module-level functions (the GIL released)."""

    name = "zstd"
    kernel_kind = CODEC_ZSTD
    device_decoder = ("zstd",)

    def __init__(self, spec: Mapping[str, Any], dtype: Any = np.uint8):
        super().__init__(spec, dtype)
        self.level = int(spec.get("level", 1))

    @classmethod
    def validate(cls, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        super().validate(spec)
        if not -7 <= int(spec.get("level", 1)) <= 22:
            raise ValueError(f"zstd codec {dict(spec)} invalid: level must be in -7..22")
        return spec

    def encode_chunk(self, chunk: np.ndarray) -> bytes:
        return zstd.compress(chunk, self.level)

    def decode_chunk(self, data, out: np.ndarray) -> np.ndarray:
        check_zstd_header(data, out.nbytes)
        decoded = zstd.decompress(data)
        if len(decoded) != out.nbytes:
            raise ValueError(f"payload holds {len(decoded)} bytes")
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(decoded, dtype=np.uint8)
        return out

    def device_pieces(self, body, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
        """The chunk is one zstd frame (its header checked to declare the chunk's size)."""
        check_zstd_header(body, chunk_rows * row_nbytes)
        return whole_chunk_pieces(PIECE_ZSTD, len(body), chunk_rows * row_nbytes, chunk_rows)

    def device_pieces_many(self, buf, at, length, chunk_rows, row_nbytes, rows):
        """One-frame chunks in a few numpy operations: every header checked as ``check_zstd_header`` checks it;
        where one fails, the loop names it."""
        nbytes = chunk_rows * row_nbytes
        if chunk_rows != 1 or not at.size:
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        descriptor = read_le(buf, at + 4, 1)
        single = (descriptor >> 5) & 1
        fcs_size = np.array([0, 2, 4, 8])[descriptor >> 6]
        fcs_size = np.where((descriptor >> 6 == 0) & (single == 1), 1, fcs_size)
        start = 5 + (1 - single)
        declared = np.zeros(at.size, dtype=np.int64)
        for width in (1, 2, 4, 8):
            sel = fcs_size == width
            if sel.any():
                declared[sel] = read_le(buf, at[sel] + start[sel], width) + (256 if width == 2 else 0)
        good = (length >= 6) & (read_le(buf, at, 4) == ZSTD_MAGIC) & ((descriptor & 8) == 0) & ((descriptor & 3) == 0) \
            & (fcs_size > 0) & (length >= start + fcs_size) & (declared == nbytes)
        if not good.all():
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        n = at.size
        return DevicePieces(np.full(n, PIECE_ZSTD, dtype=np.int8), np.stack([at, at + length], axis=1),
                            np.tile(np.array([[0, nbytes]], dtype=np.int64), (n, 1)), np.zeros(n, dtype=np.int64),
                            np.full(n, -1, dtype=np.int64)), np.ones((n, 2), dtype=np.int64)

    def zarr_codec(self):
        from zarr.codecs import ZstdCodec

        return ZstdCodec(level=self.level, checksum=False)


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
