"""The ``delta-lz4`` frame codec: a chunk is a run of consecutive frames, each frame coded as its byte
difference from an earlier frame of the run (or alone), the run's differences then one LZ4 block (LZ4's
high-compression encoder). For sequences of colour frames (DreamerV3's 64 consecutive 64x64 RGB steps).

Invariant: ``decode_run(encode_run(frames, ...), out)`` writes ``frames`` into ``out`` bit for bit, for any
frames of any dtype (differences are taken on the bytes, modulo 256, which is invertible); ``decode_run``
either writes exactly ``out.nbytes`` bytes rebuilt from a well-formed run or raises ``ValueError`` saying what
is malformed (the header must describe ``out``'s size, a reference can only point to an earlier frame of the
run, and LZ4 must yield exactly the run's bytes).

Format of one chunk (little-endian), before zarr's ``crc32c`` codec appends its checksum
(``_native/delta_lz4_header.py``):

    4 bytes   magic ``b"MRL1"``
    uint32    n_frames (the chunk's rows)
    uint32    frame_nbytes
    n_frames  uint8 references: 0 = the frame is coded alone; d > 0 = its bytes minus those of frame ``i - d``
              (``d <= i``: the first frame is always coded alone)
    rest      one LZ4 block (no size prefix) of the n_frames * frame_nbytes residual bytes

Why: the temporal codec (``codecs/temporal.py``) codes residuals with zstd, whose entropy stage is what a
sample of 64 consecutive steps waits for: on real DMC frames resized to 64x64 a zstd residual decodes ~5x
slower than an LZ4 one (31 vs 5.6 us of CPU, loaded 2-core box). LZ4 alone finds no skew in byte values,
so a residual coded alone is ~3.4x smaller than raw; coded as one block over the run, LZ4 also finds what
repeats across the run's residuals within its 64 KiB window, and a run of 32 frames comes to ~4.5x (runs of
64: ~4.7x; docs/format.md). A sequence decodes each run it touches once, front to back, and stops at its last
frame (``_native/delta_lz4.py``); with runs of 32, a window of 64 steps decodes ~80 frames.

How the encoder chooses references (the decoder does not care): each frame takes whichever of the last
``search`` frames leaves the smallest differences on a strided sample (``temporal.choose_references``): a
vector env's interleaved streams and episodes starting inside a run find their own predecessor.

On a device (``mmreplay/device/``): a run is one piece, its LZ4 block decoded whole by the batched LZ4 decoder
(nvCOMP's raw LZ4 blocks; a device decoder has no "stop at this frame"), every frame listed with its
reference, so the device rebuilds the chains as it does the temporal codec's layout-1 runs. The header is
checked on the CPU first, as ``decode_run`` checks it (``device_pieces``, ``device_pieces_many``); the LZ4
block's size is held to the run's bytes by the decoder.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from mmreplay._native import lz4
from mmreplay._native.codec_kinds import CODEC_DELTA_LZ4
from mmreplay._native.delta_lz4_header import HEADER, LZ4_MAX_BYTES, MAGIC, MAX_RUN
from mmreplay.codecs.base import PIECE_LZ4, DevicePieces, FrameCodec, read_le
from mmreplay.codecs.registry import register
from mmreplay.codecs.run_spec import check_settings, parse_run_header
from mmreplay.codecs.temporal import choose_references, reconstruct

DEFAULT_RUN = 32  # frames a chunk: ~4.5x on 64x64 RGB control frames; a 64-step window decodes ~80 frames
DEFAULT_LEVEL = 9  # LZ4HC: level 12 saves ~2% more at several times the encode time
DEFAULT_SEARCH = 8


def encode_run(chunk: np.ndarray, level: int = DEFAULT_LEVEL, search: int = DEFAULT_SEARCH) -> bytes:
    """The coded bytes of ``chunk``, a run of frames along axis 0 (any dtype)."""
    chunk = np.ascontiguousarray(chunk)
    n = chunk.shape[0]
    if not 1 <= n <= MAX_RUN:
        raise ValueError(f"a delta-lz4 chunk holds 1..{MAX_RUN} frames, got {n}")
    if chunk.nbytes > LZ4_MAX_BYTES:
        raise ValueError(f"a delta-lz4 chunk holds at most {LZ4_MAX_BYTES} bytes, got {chunk.nbytes}")
    frames = chunk.reshape(n, -1).view(np.uint8)
    refs, residuals = choose_references(frames, search)
    block = lz4.compress_hc_block(residuals.reshape(-1), level)[4:]  # numcodecs' size prefix: the header has it
    return b"".join((HEADER.pack(MAGIC, n, frames.shape[1]), refs.tobytes(), block))


def parse_header(data, expected_nbytes: int) -> tuple[int, int, np.ndarray]:
    """(n_frames, frame_nbytes, references) of a run that must decode to ``expected_nbytes`` (``run_spec``'s
    checks, which the temporal codec's layout-1 header shares)."""
    return parse_run_header(data, expected_nbytes, HEADER, MAGIC, MAX_RUN, "delta-lz4", LZ4_MAX_BYTES)


def decode_run(data, out: np.ndarray) -> np.ndarray:
    """Decode a coded run into ``out`` (C-contiguous, the chunk's shape and dtype)."""
    data = memoryview(data).cast("B")
    n, frame_nbytes, refs = parse_header(data, out.nbytes)
    flat = out.reshape(-1).view(np.uint8)
    got = lz4.decompress_block(data[HEADER.size + n:], flat)
    if got != out.nbytes:
        raise ValueError(f"delta-lz4 chunk: its LZ4 block decodes to {got} bytes, expected {out.nbytes} "
                         "(negative: malformed)")
    reconstruct(flat.reshape(n, frame_nbytes), refs)
    return out


def validate_delta_lz4(spec: Mapping[str, Any]) -> None:
    """LZ4HC level, frames per run (a power of two), reference search; ``ValueError`` naming what is wrong."""
    check_settings("delta-lz4", spec, (("level", spec.get("level", DEFAULT_LEVEL), 1, 12),
                                       ("run", spec.get("run", DEFAULT_RUN), 1, 128),
                                       ("search", spec.get("search", DEFAULT_SEARCH), 0, 128)),
                   known=("level", "run", "search"))


@register
class DeltaLz4FrameCodec(FrameCodec):
    """Runs of frames coded as differences, one LZ4 block a run (``{"name": "delta-lz4", "level", "run",
    "search"}``)."""

    name = "delta-lz4"
    kernel_kind = CODEC_DELTA_LZ4  # ``_native/delta_lz4.py``: whole runs, or a run up to the last frame asked for
    decodes_frames_of_runs = True
    device_decoder = ("lz4",)  # one raw LZ4 block a run (module docstring)

    def __init__(self, spec: Mapping[str, Any], dtype: Any = np.uint8):
        super().__init__(spec, dtype)
        self.level = int(spec.get("level", DEFAULT_LEVEL))
        self.search = int(spec.get("search", DEFAULT_SEARCH))

    @classmethod
    def validate(cls, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        super().validate(spec)
        validate_delta_lz4(spec)
        return spec

    @classmethod
    def chunk_rows(cls, spec: Mapping[str, Any]) -> int | None:
        return int(spec.get("run", DEFAULT_RUN))

    def encode_chunk(self, chunk: np.ndarray) -> bytes:
        return encode_run(chunk, self.level, self.search)

    def decode_chunk(self, data, out: np.ndarray) -> np.ndarray:
        return decode_run(data, out)

    def device_pieces(self, body, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
        """The run's LZ4 block as one piece producing every row (module docstring), the header checked first."""
        data = memoryview(body).cast("B")
        nbytes = chunk_rows * row_nbytes
        n, _, refs = parse_header(data, nbytes)
        if n != chunk_rows:
            raise ValueError(f"delta-lz4 chunk announces {n} frames, its column's chunks hold {chunk_rows}")
        start = HEADER.size + n
        if len(data) <= start:
            raise ValueError(f"delta-lz4 chunk is {len(data)} bytes: no LZ4 block after its {start}-byte header")
        every = np.arange(n, dtype=np.int64)
        return DevicePieces(np.array([PIECE_LZ4], dtype=np.int8), np.array([[start, len(data)]], dtype=np.int64),
                            np.array([[0, nbytes]], dtype=np.int64), every,
                            np.where(refs != 0, every - refs.astype(np.int64), -1).astype(np.int64))

    def device_pieces_many(self, buf, at, length, chunk_rows, row_nbytes, rows):
        """``device_pieces`` of a batch's runs in array operations (the same checks; the loop, which names what is
        wrong, where any run fails one)."""
        n, r = chunk_rows, at.size
        start = HEADER.size + n
        if not r or n > MAX_RUN or n * row_nbytes > LZ4_MAX_BYTES or (length <= start).any() or \
                (read_le(buf, at, 4) != int.from_bytes(MAGIC, "little")).any() or \
                (read_le(buf, at + 4, 4) != n).any() or (read_le(buf, at + 8, 4) != row_nbytes).any():
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        cols = np.arange(n, dtype=np.int64)
        back = buf[at[:, None] + HEADER.size + cols].astype(np.int64)
        if (back > cols).any():
            return super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)
        pieces = DevicePieces(np.full(r, PIECE_LZ4, dtype=np.int8), np.stack([at + start, at + length], axis=1),
                              np.tile(np.array([[0, n * row_nbytes]], dtype=np.int64), (r, 1)), np.tile(cols, r),
                              np.where(back > 0, cols - back, -1).reshape(-1))
        return pieces, np.stack([np.ones(r, dtype=np.int64), np.full(r, n, dtype=np.int64)], axis=1)
