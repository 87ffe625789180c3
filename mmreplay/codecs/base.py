"""What a frame codec is: the capabilities a reader and a writer ask of it, in one small base class.

Invariant: an instance is made from a configuration that ``validate`` accepted (a malformed one is a
``ValueError`` naming it before anything is written), and for every C-contiguous chunk ``c`` of its dtype,
``decode_chunk(encode_chunk(c), out)`` writes ``c`` into ``out`` bit for bit, or raises ``ValueError`` saying
what is malformed, for any bytes at all (chunks are read from files that may be damaged or hostile).

The capabilities, all class attributes so that readers ask them once, when a column is set up (never per
frame):
- ``name``: the on-disk id, the ``"name"`` of the codec spec in the store's metadata (``{"name": ..., **config}``);
- ``kernel_kind``: the compiled decoder's kind for these chunks (``_native/codec_kinds.py``), or None: its
  chunks are then decoded one by one through ``decode_chunk`` (correct, slower) and no compressed tier is kept;
- ``decodes_frames_of_runs``: the compiled decoder takes single frames out of a chunk of several rows
  (``_native/run_decode.py``'s ``decode_frame_groups``), so frames go straight into batches;
- ``decodes_partial_runs``: a chunk's frames can be read from a file in part (``reading/runs.py`` keeps what
  the runs' headers say, ``_native/runs.py`` decodes); the temporal codec says it per configuration (a property:
  layout-1 runs are one zstd frame, read whole, and a reader would pay for a directory it never uses);
- ``device_decoder``: the batched decoders (``"zstd"``, ``"lz4"``) a device decodes this codec's chunks with (None:
  none); ``device_pieces`` then cuts a chunk into what they take (``DevicePieces``: each piece one zstd frame, one
  raw LZ4 block or bytes stored as they are, and for runs of frames the references to rebuild), having checked
  on the CPU every header it reads; ``mmreplay/device/`` runs the pieces (issue 38 "Compressed until the consumer").

A codec that zarr does not know gets a zarr v3 codec made for it (``codecs/zarr_adapter.py``), so plain zarr
reads its arrays wherever the codec is registered.
"""

from __future__ import annotations

from typing import Any, ClassVar, Mapping, NamedTuple

import numpy as np

# what one piece of a chunk is, for a device decoder (``DevicePieces.kinds``)
PIECE_ZSTD, PIECE_LZ4, PIECE_COPY = 0, 1, 2
PIECE_NAMES = {PIECE_ZSTD: "zstd", PIECE_LZ4: "lz4", PIECE_COPY: "copy"}


class DevicePieces(NamedTuple):
    """A chunk cut for a batched device decoder (``FrameCodec.device_pieces``): piece ``i`` is
    ``body[src[i, 0]:src[i, 1]]``, of kind ``kinds[i]`` (``PIECE_ZSTD``: a zstd frame; ``PIECE_LZ4``: a raw LZ4
    block; ``PIECE_COPY``: bytes stored as they are), and decodes to bytes ``[dst[i, 0], dst[i, 1])`` of the
    decoded chunk. ``rows``: the chunk rows the pieces produce (ascending; a piece never spans a row that is
    not listed); ``refs[j]``: the chunk row that row ``rows[j]`` was coded against (its bytes are its residual
    from that row's, modulo 256), -1 for a row decoded as it is. Every row a listed row refers to is listed."""
    kinds: np.ndarray  # int8 (m,)
    src: np.ndarray  # int64 (m, 2)
    dst: np.ndarray  # int64 (m, 2)
    rows: np.ndarray  # int64 (r,)
    refs: np.ndarray  # int64 (r,)


def concat_pieces(parts: list[DevicePieces]) -> DevicePieces:
    if not parts:
        return DevicePieces(np.zeros(0, np.int8), np.zeros((0, 2), np.int64), np.zeros((0, 2), np.int64),
                            np.zeros(0, np.int64), np.zeros(0, np.int64))
    return DevicePieces(*(np.concatenate(field) for field in zip(*parts)))


def read_le(buf: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """The little-endian unsigned integers of ``width`` bytes at offsets ``at`` of ``buf`` (uint8), as int64;
    offsets past the end read as zero bytes (the callers check lengths first)."""
    out = np.zeros(at.size, dtype=np.int64)
    if not buf.size:
        return out
    for k in range(width):
        where = at + k
        inside = where < buf.size
        out |= np.where(inside, buf[np.minimum(where, max(buf.size - 1, 0))].astype(np.int64), 0) << (8 * k)
    return out


def whole_chunk_pieces(kind: int, body_nbytes: int, nbytes: int, chunk_rows: int) -> DevicePieces:
    """One piece for the whole chunk (a zstd frame, say), every row decoded as it is."""
    return DevicePieces(np.array([kind], dtype=np.int8), np.array([[0, body_nbytes]], dtype=np.int64),
                        np.array([[0, nbytes]], dtype=np.int64), np.arange(chunk_rows, dtype=np.int64),
                        np.full(chunk_rows, -1, dtype=np.int64))


class FrameCodec:
    """One frame codec with one configuration, for one dtype: encode and decode a chunk, and say what the
    compiled readers can do with its chunks (see the module docstring). Subclass it, set ``name``, write
    ``validate``, ``encode_chunk`` and ``decode_chunk``, and register the class (``mmreplay.codecs.register``
    or an entry point in the ``mmreplay.codecs`` group)."""

    name: ClassVar[str] = ""
    kernel_kind: ClassVar[int | None] = None
    decodes_frames_of_runs: ClassVar[bool] = False
    decodes_partial_runs: ClassVar[bool] = False
    device_decoder: ClassVar[tuple[str, ...] | None] = None

    def __init__(self, spec: Mapping[str, Any], dtype: Any = np.uint8):
        self.spec = self.validate(spec)
        self.dtype = np.dtype(dtype)
        self.itemsize = self.dtype.itemsize

    @classmethod
    def validate(cls, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        """``spec`` if it is a valid configuration of this codec, else ``ValueError`` naming what is wrong."""
        if not isinstance(spec, Mapping) or spec.get("name") != cls.name:
            raise ValueError(f"codec spec {spec!r} is not a {cls.name!r} codec spec")
        return spec

    @property
    def config(self) -> dict:
        """The spec without its name: what the store's metadata keeps beside it."""
        return {k: v for k, v in self.spec.items() if k != "name"}

    @classmethod
    def chunk_rows(cls, spec: Mapping[str, Any]) -> int | None:
        """Rows (frames) a chunk of image frames holds with this codec, or None: one frame a chunk."""
        return None

    def encode_chunk(self, chunk: np.ndarray) -> bytes:
        raise NotImplementedError

    def decode_chunk(self, data, out: np.ndarray) -> np.ndarray:
        """Decode ``data`` into ``out`` (C-contiguous, the chunk's shape and dtype) and return it."""
        raise NotImplementedError

    def device_supported(self) -> bool:
        """Whether this configuration's chunks decode on a device (``device_pieces``); a codec may say no for
        some configurations (blosc: only its LZ4 and zstd compressors, one-byte items)."""
        return self.device_decoder is not None

    def device_pieces(self, body, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
        """``body`` (a chunk of ``chunk_rows`` rows of ``row_nbytes`` bytes, its checksum removed) cut for a batched
        device decoder, producing at least the chunk rows ``rows`` (ascending); ``ValueError`` naming what is
        malformed, checked before anything is decoded."""
        raise NotImplementedError(f"codec {self.name!r} has no device decoder")

    def device_pieces_many(self, buf: np.ndarray, at: np.ndarray, length: np.ndarray, chunk_rows: int,
                           row_nbytes: int, rows: list) -> tuple[DevicePieces, np.ndarray]:
        """``device_pieces`` of many chunks (chunk ``i`` is ``buf[at[i]:at[i] + length[i]]``, ``rows[i]`` its rows
        asked for): the pieces of all, concatenated (``src`` relative to ``buf``; ``dst`` and ``rows`` relative to
        each chunk), and each chunk's number of pieces and of rows (``(n, 2)``). A codec may do this in fewer
        steps (one-frame codecs: a few numpy operations a batch); the result must equal this loop's. A
        ``ValueError`` names the chunk's index in its first argument (``args[1]``)."""
        parts, counts = [], np.empty((at.size, 2), dtype=np.int64)
        for i, (lo, n) in enumerate(zip(at.tolist(), length.tolist())):
            try:
                p = self.device_pieces(memoryview(buf[lo:lo + n]), chunk_rows, row_nbytes, rows[i])
            except ValueError as exc:
                raise ValueError(str(exc), i) from None
            parts.append(p._replace(src=p.src + lo))
            counts[i] = (p.kinds.size, p.rows.size)
        return concat_pieces(parts), counts

    # the names the storage layer calls (``storage/format/shardfile.py``): the chunk codec of a shard file
    def encode(self, chunk: np.ndarray) -> bytes:
        return self.encode_chunk(chunk)

    def decode(self, data, out: np.ndarray) -> np.ndarray:
        return self.decode_chunk(data, out)

    def zarr_codec(self):
        """The zarr v3 codec that writes and reads the same bytes (registered with zarr on first use)."""
        from mmreplay.codecs.zarr_adapter import zarr_codec_for

        return zarr_codec_for(self)
