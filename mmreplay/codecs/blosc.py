"""Blosc frame codec (``{"name": "blosc", "cname": ..., "clevel": ...}``): lz4, lz4hc, zstd, zlib or blosclz
inside blosc, one chunk a call, the bytes numcodecs' and zarr's ``BloscCodec`` write.

Invariant: ``decode_chunk`` hands a payload to c-blosc only after its header is checked against the payload
and the expected chunk (version, flags, codec, typesize, sizes, blocksize and block starts): c-blosc trusts
its header, so a truncated or edited payload whose checksum was recomputed would otherwise be read past its
end. Blosc runs single-threaded (chunks are decoded in parallel instead, as zarr does).
"""

from __future__ import annotations

import struct
from typing import Any, Mapping

import numpy as np
from numcodecs import blosc

from mmreplay._native.codec_kinds import CODEC_BLOSC
from mmreplay.codecs.base import PIECE_COPY, PIECE_LZ4, PIECE_ZSTD, DevicePieces, FrameCodec, read_le
from mmreplay.codecs.registry import register

blosc.use_threads = False  # many small chunks in parallel beat Blosc's own threads (zarr does the same)

BLOSC_CNAMES = ("lz4", "lz4hc", "zstd", "zlib", "blosclz")
DEVICE_CNAMES = ("lz4", "lz4hc", "zstd")  # blocks a batched device decoder takes (raw LZ4 blocks, zstd frames)
BLOSC_FORMAT_CODE = {"blosclz": 0, "lz4": 1, "lz4hc": 1, "zlib": 3, "zstd": 4}  # header flags >> 5
BLOSC_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
BLOSC_MAX_VERSION = 2  # c-blosc 1.x writes format 2 (1: older releases)
BLOSC_SHUFFLE, BLOSC_MEMCPYED, BLOSC_BITSHUFFLE, BLOSC_RESERVED = 0x1, 0x2, 0x4, 0x8


@register
class BloscFrameCodec(FrameCodec):
    """Blosc through numcodecs' module-level functions: the same bytes as ``numcodecs.Blosc``, without its
    per-call Python wrapping (which costs more than compressing an 84x84 frame); the GIL is released."""

    name = "blosc"
    kernel_kind = CODEC_BLOSC
    device_decoder = ("lz4", "zstd")  # its blocks, for the compressors ``device_supported`` names

    def __init__(self, spec: Mapping[str, Any], dtype: Any = np.uint8):
        super().__init__(spec, dtype)
        self.cname = spec.get("cname", "lz4")
        self._cname_bytes = self.cname.encode()
        self.clevel = int(spec.get("clevel", 5))
        self.format_code = BLOSC_FORMAT_CODE[self.cname]
        self.shuffle = blosc.NOSHUFFLE if self.itemsize == 1 else blosc.SHUFFLE

    @classmethod
    def validate(cls, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        super().validate(spec)
        if spec.get("cname", "lz4") not in BLOSC_CNAMES or not 0 <= int(spec.get("clevel", 5)) <= 9:
            raise ValueError(f"blosc codec {dict(spec)} invalid: cname one of {BLOSC_CNAMES}, clevel 0..9")
        return spec

    def encode_chunk(self, chunk: np.ndarray) -> bytes:
        return blosc.compress(chunk, self._cname_bytes, self.clevel, self.shuffle, 0)

    def decode_chunk(self, data, out: np.ndarray) -> np.ndarray:
        """Decode into ``out``; a payload of another decoded size is an error (blosc does not say so when
        decoding into a buffer)."""
        check_blosc_header(data, out.nbytes, self.itemsize, self.format_code)
        blosc.decompress(data, out)
        return out

    def device_supported(self) -> bool:
        """Blocks of LZ4 (lz4, lz4hc) or zstd over one-byte items (frames: never shuffled) decode on a device."""
        return self.itemsize == 1 and self.cname in DEVICE_CNAMES

    def device_pieces(self, body, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
        """One piece per blosc block (c-blosc 1.x, format 2: one stream a block for one-byte items): a raw LZ4
        block or a zstd frame after its 4-byte compressed size, or the block as it is when that size equals the
        block's; the header and every block bound checked against the chunk first."""
        nbytes = chunk_rows * row_nbytes
        check_blosc_header(body, nbytes, self.itemsize, self.format_code)
        if not self.device_supported():
            raise ValueError(f"blosc codec {self.spec!r}: no device decoder for compressor {self.cname!r} with "
                             f"{self.itemsize}-byte items (expected one of {DEVICE_CNAMES} over bytes)")
        data = body if isinstance(body, bytes) else memoryview(body).cast("B")
        _, _, flags, _, _, blocksize, cbytes = BLOSC_HEADER.unpack_from(data)
        every = np.arange(chunk_rows, dtype=np.int64)
        alone = np.full(chunk_rows, -1, dtype=np.int64)
        if flags & BLOSC_MEMCPYED:
            return DevicePieces(np.array([PIECE_COPY], dtype=np.int8),
                                np.array([[BLOSC_HEADER.size, BLOSC_HEADER.size + nbytes]], dtype=np.int64),
                                np.array([[0, nbytes]], dtype=np.int64), every, alone)
        if flags & (BLOSC_SHUFFLE | BLOSC_BITSHUFFLE):
            raise ValueError(f"blosc header: flags {flags:#04x} say the items are shuffled; one-byte frames never are")
        n_blocks = -(-nbytes // blocksize)
        starts = struct.unpack_from(f"<{n_blocks}i", data, BLOSC_HEADER.size)  # bounds checked by the header check
        kind = PIECE_LZ4 if self.format_code == BLOSC_FORMAT_CODE["lz4"] else PIECE_ZSTD
        kinds = np.empty(n_blocks, dtype=np.int8)
        src = np.empty((n_blocks, 2), dtype=np.int64)
        dst = np.empty((n_blocks, 2), dtype=np.int64)
        for b, at in enumerate(starts):
            block = min(blocksize, nbytes - b * blocksize)
            size = struct.unpack_from("<i", data, at)[0] if at + 4 <= cbytes else -1
            if not 0 < size <= cbytes - at - 4:
                raise ValueError(f"blosc block {b}: compressed size {size} does not fit the {cbytes}-byte payload "
                                 f"from byte {at + 4}")
            kinds[b] = PIECE_COPY if size == block else kind
            src[b] = (at + 4, at + 4 + size)
            dst[b] = (b * blocksize, b * blocksize + block)
        return DevicePieces(kinds, src, dst, every, alone)

    def device_pieces_many(self, buf, at, length, chunk_rows, row_nbytes, rows):
        """Chunks of one blosc block (84x84 frames) in a few numpy operations, every check of
        ``check_blosc_header`` and ``device_pieces`` made on all at once; anything else (several blocks, a
        check that fails: the loop names it) goes through ``device_pieces`` one by one."""
        nbytes = chunk_rows * row_nbytes
        if not at.size or not self.device_supported():
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        h = BLOSC_HEADER.size
        version, flags, typesize = read_le(buf, at, 1), read_le(buf, at + 2, 1), read_le(buf, at + 3, 1)
        announced, blocksize, cbytes = read_le(buf, at + 4, 4), read_le(buf, at + 8, 4), read_le(buf, at + 12, 4)
        memcpyed = (flags & BLOSC_MEMCPYED) != 0
        start = read_le(buf, at + h, 4)
        csize = read_le(buf, at + start, 4)  # the block's compressed size; meaningful where ``start`` is checked
        good = (length >= h + 4) & (version >= 1) & (version <= BLOSC_MAX_VERSION) & ((flags & BLOSC_RESERVED) == 0) \
            & ((flags & (BLOSC_SHUFFLE | BLOSC_BITSHUFFLE)) == 0) & ((flags >> 5) == self.format_code) \
            & (typesize == 1) & (announced == nbytes) & (cbytes == length) & (blocksize > 0) & (blocksize <= nbytes)
        good &= np.where(memcpyed, cbytes == nbytes + h,
                         (blocksize >= nbytes) & (start >= h + 4) & (start + 4 <= cbytes) & (csize > 0)
                         & (csize <= cbytes - start - 4))
        if not good.all():
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        n = at.size
        stored_as_is = memcpyed | (csize == nbytes)
        kind = PIECE_LZ4 if self.format_code == BLOSC_FORMAT_CODE["lz4"] else PIECE_ZSTD
        kinds = np.where(stored_as_is, PIECE_COPY, kind).astype(np.int8)
        lo = np.where(memcpyed, at + h, at + start + 4)
        hi = np.where(memcpyed, at + h + nbytes, at + start + 4 + csize)
        pieces = DevicePieces(kinds, np.stack([lo, hi], axis=1),
                              np.tile(np.array([[0, nbytes]], dtype=np.int64), (n, 1)),
                              np.tile(np.arange(chunk_rows, dtype=np.int64), n),
                              np.full(n * chunk_rows, -1, dtype=np.int64))
        return pieces, np.stack([np.ones(n, dtype=np.int64), np.full(n, chunk_rows, dtype=np.int64)], axis=1)

    def zarr_codec(self):
        from zarr.codecs import BloscCodec

        return BloscCodec(cname=self.cname, clevel=self.clevel,
                          shuffle="noshuffle" if self.itemsize == 1 else "shuffle", typesize=self.itemsize,
                          blocksize=0)


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
