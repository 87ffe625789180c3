"""The temporal frame codec: a chunk holds a run of consecutive frames, each coded alone (a key frame) or
as its byte difference from an earlier frame of the same run, and the run is compressed with zstd.

Invariant: ``decode_run(encode_run(frames, ...), out)`` writes ``frames`` into ``out`` bit for bit, for
any frames of any dtype (the differences are taken on the bytes, modulo 256, which is invertible); and
``decode_run`` either writes exactly ``out.nbytes`` bytes reconstructed from a well-formed run or raises
``ValueError`` saying what is malformed, writing nothing it has not validated (a reference can only point
to an earlier frame of the run, the header must describe ``out``'s size, and zstd's output must be
exactly the size the header announces).

Format of one chunk (little-endian), before zarr's ``crc32c`` codec appends its checksum:

    4 bytes   magic ``b"MRT1"``
    uint32    n_frames (the chunk's rows)
    uint32    frame_nbytes (bytes of one frame)
    n_frames  uint8 references: 0 = the frame is coded alone; d > 0 = it is coded as its bytes minus
              those of frame ``i - d`` of this run (``d <= i``, so the first frame is always a key frame)
    rest      one zstd frame holding the n_frames * frame_nbytes residual bytes

Why: consecutive frames of one stream differ in few pixels. Compressed one by one (lz4hc), an 84x84
Atari frame takes ~430 B and an 84x84 RGB control frame ~13 KB; the same frames coded against their
predecessor take 3-6x fewer bytes (docs/format.md has the figures). A random frame decodes from its
chunk's first frame, so runs are short (``chunk_rows``, 8 by default): one sample's stack and next
observation mostly fall in one chunk, which the decoded cache then holds.

How the encoder chooses (the decoder does not care): it codes the run twice and keeps the smaller, once
with every frame alone (zstd then finds what repeats across the run: on Atari frames that often beats
differences, in which a moved sprite appears twice) and once with references. A reference is searched,
not fixed to "the previous frame": a vector env's frames interleave in the ring (rows ``i`` and ``i + 1``
come from different envs), and an episode may start inside a run; each frame takes whichever of the last
``search`` frames leaves the smallest differences.

Layout 2 (``layout: 2`` in the codec spec; the default for colour frames): one zstd frame per frame, so
that a reader decodes only the frames a sample needs and the frames they are coded against:

    4 bytes   magic ``b"MRT2"``
    uint32    n_frames
    uint32    frame_nbytes
    n_frames  int8 references: 0 = coded alone; d != 0 = coded as its bytes minus those of frame ``i - d``
              (``0 <= i - d < n_frames``; following references from any frame reaches a frame coded alone
              in fewer than ``n_frames`` steps: no cycles)
    n_frames  uint32 ends: frame ``i``'s zstd frame is ``payload[ends[i - 1]:ends[i]]`` (``ends[-1]`` is the
              payload's length; ends never decrease)
    rest      the payload: n_frames zstd frames, each of frame_nbytes residual bytes

Why: a batch of pixel-control samples (frame stack 3, n-step 3) needs 6 consecutive frames each. Decoding a
run of 16 whole for them cost ~21 frame decodes a sample (a sample straddles runs ~1/3 of the time). The
encoder of layout 2 makes the run's middle frame (``key_position``) its key and codes every other frame
against a neighbour on the key's side, so a chain runs outward from the key in both directions: 6
consecutive frames then decode with ~10 frame decodes (measured on real DMC frames: the same bytes as
coding against the previous frame, 5.2x smaller than raw at level 9; deltas against the key frame alone
would cost 35% more bytes, a 2-level pyramid 16% more). Coding each frame as its own zstd frame costs
nothing measurable against one zstd frame for the run (RGB residuals have few repeats across frames).

Layout 3 (``layout: 3``; the default for colour frames): layout 2's bytes, with the frames at most
``lz4_depth`` references from a key coded as LZ4 blocks in numcodecs' LZ4 format (a uint32 equal to
``frame_nbytes``, then the block) instead of zstd frames; a frame's first word tells the two apart (zstd's
magic, or its size). Why: nearly every sample touching a run decodes its key, and on real DMC frames an LZ4
block decodes ~3x faster than zstd for ~23% more bytes (docs/format.md has the figures).

The codec is registered with zarr (``mmreplay.temporal``, through the package's ``zarr.codecs`` entry
point and on import) so that ``zarr.open_array`` reads these arrays like any other; its ``layout`` is part
of its configuration, and the decoder reads either layout whatever the configuration says (each chunk
names its own by its magic).

Where its pieces live: this module is the format, the Python encoder and decoder and ``TemporalFrameCodec``
(the codec's registration: kernel kind, runs decoded frame by frame, partial runs). The headers' parsing and
checks are ``temporal_format.py``; a run cut into pieces for a batched device decoder is ``temporal_device.py``.
The compiled decode is
``_native/run_decode.py``: whole layout-1 runs (``decode_temporal_run``), and one reconstruction kernel for layouts 2
and 3 (``decode_chains``: chosen frames, each with the frames its references lead to), which whole runs
(``_decode_frames2``: references and frame ends read from the run's header) and partial reads from files
(``_native/runs.py``: read from the directory ``reading/runs.py`` keeps, each frame's crc32c checked first)
share, the offset encoding converted at the edge (absolute byte bounds within the chunk).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, Mapping

import numpy as np
from numcodecs import zstd

from mmreplay._native import lz4
from mmreplay._native.codec_kinds import CODEC_TEMPORAL
# one header for encoder and decoder
from mmreplay._native.temporal_header import HEADER, LZ4_MAX_BYTES, MAGIC, MAGIC2, MAX_RUN, ZSTD_MAGIC
from mmreplay.codecs.base import DevicePieces, FrameCodec
from mmreplay.codecs.registry import register
from mmreplay.codecs.temporal_device import device_run_pieces, device_runs_many
# the headers' parsing lives in temporal_format (shared with temporal_device); named here as the format's API
from mmreplay.codecs.temporal_format import (DICT_ID_BYTES, FCS_BYTES, chain_depths, header2_nbytes,  # noqa: F401
                                             header_nbytes, parse_header, parse_header2, zstd_content_size)

if TYPE_CHECKING:  # zarr is imported lazily: the storage layer's readers never need it
    from zarr.core.array_spec import ArraySpec
    from zarr.core.buffer import Buffer

LAYOUTS = (1, 2, 3)  # 1: one zstd frame for the run (``MAGIC``); 2: one zstd frame per frame (``MAGIC2``);
# 3: layout 2's bytes, the frames nearest the key coded with LZ4 instead of zstd (``lz4_depth``)
DEFAULT_LAYOUT = 1
CODEC_NAME = "mmreplay.temporal"
DEFAULT_LEVEL = 3
DEFAULT_RUN = 8  # frames per chunk: a stack of 4 and its next frame mostly fall in one run
DEFAULT_SEARCH = 8  # covers vector envs of up to 8 interleaved streams
DEFAULT_LZ4_DEPTH = 0  # layout 3: the frames coded alone (chain depth 0) in LZ4, every residual in zstd
LZ4HC_LEVEL = 9  # LZ4's high-compression default: level 12 saved ~1% more here at several times the time


SAMPLED_BYTES = 1024  # bytes of each frame that the reference search compares (a stride through it)


def choose_references(frames: np.ndarray, search: int) -> tuple[np.ndarray, np.ndarray]:
    """Per frame of ``frames`` (``(n, frame_nbytes)`` uint8), the reference distance (1..``search`` back, 0
    for the first frame or ``search == 0``) and the residual bytes it leaves. The closest reference is the
    one whose differences are smallest in magnitude (read as signed bytes) on a strided sample of the
    frame: small differences, not only zero ones, are what compresses (a scene whose light drifts); a tie
    goes to the nearest. One pass per distance over the whole run (not per frame): int8 subtraction wraps
    modulo 256 into the signed difference, and its magnitude read as uint8 counts -128 as 128."""
    n = frames.shape[0]
    refs = np.zeros(n, dtype=np.uint8)
    depth = min(n - 1, search)
    if depth <= 0:
        return refs, frames.copy()
    step = max(1, frames.shape[1] // SAMPLED_BYTES)
    sample = np.ascontiguousarray(frames[:, ::step]).view(np.int8)  # < 2 * SAMPLED_BYTES bytes a frame
    cost = np.full((n, depth), np.iinfo(np.uint32).max, np.uint32)  # cost[i, d - 1]: frame i against i - d
    for d in range(1, depth + 1):
        cost[d:, d - 1] = np.abs(sample[d:] - sample[:-d]).view(np.uint8).sum(axis=1, dtype=np.uint32)
    refs[1:] = 1 + np.argmin(cost[1:], axis=1)
    residuals = frames.copy()
    residuals[1:] -= frames[np.arange(1, n) - refs[1:]]  # uint8 arithmetic wraps: modulo 256
    return refs, residuals


def encode_run(chunk: np.ndarray, level: int = DEFAULT_LEVEL, search: int = DEFAULT_SEARCH) -> bytes:
    """The coded bytes of ``chunk``, a run of frames along axis 0 (any dtype)."""
    chunk = np.ascontiguousarray(chunk)
    n = chunk.shape[0]
    if not 1 <= n <= MAX_RUN:
        raise ValueError(f"a temporal chunk holds 1..{MAX_RUN} frames, got {n}")
    frames = chunk.reshape(n, -1).view(np.uint8)
    header = HEADER.pack(MAGIC, n, frames.shape[1])
    # Every frame coded alone: zstd still finds what repeats across the run (Atari's static backgrounds and
    # sprites, often smaller than differences, whose moved sprites appear twice).
    alone = b"".join((header, bytes(n), zstd.compress(frames, level)))
    if search == 0 or n == 1:  # no reference to search: what ``choose_references`` would leave (all alone)
        return alone
    refs, residuals = choose_references(frames, search)
    if not refs.any():
        return alone
    # Differences: what wins when pixel values drift (rendered scenes, lighting, camera motion).
    coded = b"".join((header, refs.tobytes(), zstd.compress(residuals, level)))
    return coded if len(coded) < len(alone) else alone


def decode_run(data, out: np.ndarray) -> np.ndarray:
    """Decode a coded run (either layout) into ``out`` (C-contiguous, the chunk's shape and dtype)."""
    data = memoryview(data).cast("B")
    if len(data) >= 4 and bytes(data[:4]) == MAGIC2:
        return decode_frames_run(data, out)
    n, frame_nbytes, refs = parse_header(data, out.nbytes)
    flat = out.reshape(-1).view(np.uint8)
    payload = data[header_nbytes(n):]
    announced = zstd_content_size(payload)
    if announced != out.nbytes:
        raise ValueError(f"temporal chunk: zstd frame announces {announced} bytes, expected {out.nbytes}")
    try:  # zstd checks that the frame decodes to exactly the size it announces
        zstd.decompress(payload, flat)
    except RuntimeError as exc:
        raise ValueError(f"temporal chunk: {exc}") from None
    reconstruct(flat.reshape(n, frame_nbytes), refs)
    return out


def reconstruct(frames: np.ndarray, refs: np.ndarray) -> None:
    """Residuals to frames, in place, in run order (a reference always points to a frame already rebuilt)."""
    for i in np.flatnonzero(refs):
        frames[i] += frames[i - int(refs[i])]


# ------------------------------------------------------------------------------------------------
# layout 2: one zstd frame per frame, references toward the run's middle
# ------------------------------------------------------------------------------------------------


def key_position(n_frames: int) -> int:
    """The frame of a run coded alone in layout 2: the middle one, so that chains run both ways from it."""
    return (n_frames - 1) // 2


def choose_references_toward_key(frames: np.ndarray, search: int) -> tuple[np.ndarray, np.ndarray]:
    """Per frame of ``frames`` (``(n, frame_nbytes)`` uint8), the signed reference distance (``i - target``)
    toward the key frame (``key_position``) and its residual bytes: a frame after the key takes the best of
    the ``search`` frames before it (not before the key), a frame before the key the best of the ``search``
    frames after it (not after the key). Every chain thus ends at the key. ``search == 0``: all alone."""
    n = frames.shape[0]
    key = key_position(n)
    step = max(1, frames.shape[1] // SAMPLED_BYTES)
    sample = frames[:, ::step].astype(np.int16)
    refs = np.zeros(n, dtype=np.int8)
    residuals = frames.copy()
    if search == 0:
        return refs, residuals
    for i in range(n):
        if i == key:
            continue
        if i > key:
            targets = np.arange(i - 1, max(key, i - search) - 1, -1)
        else:
            targets = np.arange(i + 1, min(key, i + search) + 1)
        diffs = (sample[i] - sample[targets] + 128) % 256 - 128
        target = int(targets[int(np.argmin(np.abs(diffs).sum(axis=1)))])
        refs[i] = i - target
        residuals[i] = frames[i] - frames[target]  # uint8 arithmetic wraps: modulo 256
    return refs, residuals


# A residual whose zstd frame takes at least this share of the key frame's is also tried coded alone (a
# frame of another episode than its reference: an episode starting inside the run).
ALONE_TRY_SHARE = 0.75


def encode_frames_run(chunk: np.ndarray, level: int = DEFAULT_LEVEL, search: int = DEFAULT_SEARCH,
                      lz4_depth: int = -1) -> bytes:
    """The layout-2 coded bytes of ``chunk``, a run of frames along axis 0 (any dtype); with ``lz4_depth >= 0``
    (layout 3) the frames at most that many references from a frame coded alone are LZ4 blocks."""
    chunk = np.ascontiguousarray(chunk)
    n = chunk.shape[0]
    if not 1 <= n <= min(MAX_RUN, 127):
        raise ValueError(f"a layout-2 temporal chunk holds 1..127 frames, got {n}")
    frames = chunk.reshape(n, -1).view(np.uint8)
    refs, residuals = choose_references_toward_key(frames, search)
    key = key_position(n)
    key_coded = zstd.compress(frames[key], level)  # coded alone: its residual is the frame itself
    parts = []
    for i in range(n):
        coded = key_coded if i == key else zstd.compress(residuals[i], level)
        if refs[i] and len(coded) >= ALONE_TRY_SHARE * len(key_coded):
            alone = zstd.compress(frames[i], level)
            if len(alone) < len(coded):
                refs[i], coded = 0, alone  # chains through frame i still decode: it is the same frame
                residuals[i] = frames[i]
        parts.append(coded)
    if 0 <= lz4_depth and frames.shape[1] <= LZ4_MAX_BYTES:  # the frames most samples decode: LZ4, ~3x faster
        depths = chain_depths(refs.astype(np.int64))
        parts = [lz4_block(residuals[i]) if depths[i] <= lz4_depth else part for i, part in enumerate(parts)]
    ends = np.cumsum([len(p) for p in parts]).astype("<u4")
    return b"".join([HEADER.pack(MAGIC2, n, frames.shape[1]), refs.tobytes(), ends.tobytes(), *parts])


def decode_frame(part, out: np.ndarray, i: int) -> None:
    """One frame's coded bytes (a zstd frame, or an LZ4 block after its 4-byte size: layout 3) into ``out``
    (``frame_nbytes`` uint8), or ``ValueError`` naming frame ``i`` and what is wrong."""
    if len(part) >= 4 and int.from_bytes(part[:4], "little") != ZSTD_MAGIC:
        announced = int.from_bytes(part[:4], "little")
        if announced != out.nbytes:
            raise ValueError(f"temporal chunk: frame {i} is neither a zstd frame nor an LZ4 block of "
                             f"{out.nbytes} bytes (its first word is {announced:#x})")
        got = lz4.decompress_block(part[4:], out)
        if got != out.nbytes:
            raise ValueError(f"temporal chunk: frame {i}'s LZ4 block decodes to {got} bytes, expected {out.nbytes} "
                             "(negative: malformed)")
        return
    announced = zstd_content_size(part)
    if announced != out.nbytes:
        raise ValueError(f"temporal chunk: frame {i}'s zstd frame announces {announced} bytes, expected "
                         f"{out.nbytes}")
    try:
        zstd.decompress(part, out)
    except RuntimeError as exc:
        raise ValueError(f"temporal chunk: frame {i}: {exc}") from None


def decode_frames_run(data, out: np.ndarray) -> np.ndarray:
    """Decode a layout-2 run into ``out`` (C-contiguous, the chunk's shape and dtype)."""
    data = memoryview(data).cast("B")
    n, frame_nbytes, refs, ends = parse_header2(data, out.nbytes)
    frames = out.reshape(-1).view(np.uint8).reshape(n, frame_nbytes)
    payload = data[header2_nbytes(n):]
    for i in range(n):
        decode_frame(payload[(ends[i - 1] if i else 0):ends[i]], frames[i], i)
    depths = chain_depths(refs)
    for i in np.argsort(depths, kind="stable"):  # a frame's reference is rebuilt before it (one step shallower)
        if refs[i]:
            frames[i] += frames[i - int(refs[i])]
    return out


def encode(chunk: np.ndarray, level: int = DEFAULT_LEVEL, search: int = DEFAULT_SEARCH, layout: int = 1,
           lz4_depth: int = DEFAULT_LZ4_DEPTH) -> bytes:
    """``encode_run`` (layout 1) or ``encode_frames_run`` (layout 2; layout 3 with ``lz4_depth``)."""
    if layout == 3:
        return encode_frames_run(chunk, level, search, lz4_depth)
    if layout == 2:
        return encode_frames_run(chunk, level, search)
    return encode_run(chunk, level, search)


# ------------------------------------------------------------------------------------------------
# layout 3's LZ4 blocks: numcodecs' LZ4 format (4-byte little-endian size, then the block), coded with
# LZ4's high-compression mode through ``_native/lz4.py`` (where the raw-address calls live)
# ------------------------------------------------------------------------------------------------
def lz4_block(data: np.ndarray) -> bytes:
    """``data`` (1-D uint8, contiguous) as a size-prefixed LZ4 block at ``LZ4HC_LEVEL``."""
    return lz4.compress_hc_block(data, LZ4HC_LEVEL)


# ------------------------------------------------------------------------------------------------
# the codec's registration: what readers and writers ask of it (``codecs/base.py``)
# ------------------------------------------------------------------------------------------------
def validate_temporal(spec: Mapping[str, Any]) -> None:
    """A temporal codec spec: zstd level, frames per run, reference search, layout (and for layout 3 the chain
    depth up to which frames are LZ4); ``ValueError`` naming what is wrong."""
    level, run = spec.get("level", DEFAULT_LEVEL), spec.get("run", DEFAULT_RUN)
    search = spec.get("search", DEFAULT_SEARCH)
    layout = spec.get("layout", DEFAULT_LAYOUT)
    if layout not in LAYOUTS or isinstance(layout, bool):
        raise ValueError(f"temporal codec {dict(spec)} invalid: layout must be one of {LAYOUTS}, got {layout!r}")
    max_run = MAX_RUN if layout == 1 else 64  # layouts 2 and 3: references are signed bytes
    checks = [("level", level, -7, 22), ("run", run, 1, max_run), ("search", search, 0, MAX_RUN)]
    if layout == 3:  # frames up to this many references from a key are LZ4 (a chain is shorter than the run)
        checks.append(("lz4_depth", spec.get("lz4_depth", DEFAULT_LZ4_DEPTH), 0, max_run))
    elif "lz4_depth" in spec:
        raise ValueError(f"temporal codec {dict(spec)} invalid: lz4_depth applies to layout 3 only")
    for key, value, lo, hi in checks:
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise ValueError(f"temporal codec {dict(spec)} invalid: {key} must be an integer in {lo}..{hi}, "
                             f"got {value!r}")
    if run & (run - 1):
        raise ValueError(f"temporal codec {dict(spec)} invalid: run must be a power of two (chunks tile shards), "
                         f"got {run}")


@register
class TemporalFrameCodec(FrameCodec):
    """Runs of frames (``{"name": "temporal", "level", "run", "search", "layout", "lz4_depth"}``): a chunk is
    a run of ``run`` frames; the compiled decoder takes single frames out of it, and layout-2/3 runs are read
    from files in part."""

    name = "temporal"
    kernel_kind = CODEC_TEMPORAL
    device_decoder = ("zstd", "lz4")
    decodes_frames_of_runs = True

    def __init__(self, spec: Mapping[str, Any], dtype: Any = np.uint8):
        super().__init__(spec, dtype)
        self.level = int(spec.get("level", DEFAULT_LEVEL))
        self.search = int(spec.get("search", DEFAULT_SEARCH))
        self.layout = int(spec.get("layout", DEFAULT_LAYOUT))
        self.lz4_depth = int(spec.get("lz4_depth", DEFAULT_LZ4_DEPTH))

    @property
    def decodes_partial_runs(self) -> bool:
        """Layouts 2 and 3 only: a layout-1 run is one zstd frame, read whole. Said per configuration because a
        reader pays for the partial reads' directory from its compressed tier (``reading/runs.py``): at 10M Atari
        transitions that directory took 142 MB of a 2 GB cgroup's tier for runs it could never read in part, and
        8% of the runs then came from the files."""
        return self.layout >= 2

    @classmethod
    def validate(cls, spec: Mapping[str, Any]) -> Mapping[str, Any]:
        super().validate(spec)
        validate_temporal(spec)
        return spec

    @classmethod
    def chunk_rows(cls, spec: Mapping[str, Any]) -> int | None:
        return int(spec.get("run", DEFAULT_RUN))

    def encode_chunk(self, chunk: np.ndarray) -> bytes:
        return encode(chunk, self.level, self.search, self.layout, self.lz4_depth)

    def decode_chunk(self, data, out: np.ndarray) -> np.ndarray:
        """Checks its own header and zstd's announced sizes (``decode_run``)."""
        return decode_run(data, out)

    def device_pieces(self, body, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
        """``temporal_device.device_run_pieces``: whichever layout the chunk names."""
        return device_run_pieces(body, chunk_rows, row_nbytes, rows)

    def device_pieces_many(self, buf, at, length, chunk_rows, row_nbytes, rows):
        """``temporal_device.device_runs_many``: a batch's runs cut in array operations (the loop where they
        cannot be)."""
        got = device_runs_many(buf, at, length, chunk_rows, row_nbytes, rows)
        return got if got is not None else super().device_pieces_many(buf, at, length, chunk_rows, row_nbytes, rows)

    def zarr_codec(self):
        register_with_zarr()
        return zarr_codec_class()(level=self.level, search=self.search, layout=self.layout, lz4_depth=self.lz4_depth)


# ------------------------------------------------------------------------------------------------
# zarr v3: the same bytes as a BytesBytesCodec, so plain zarr reads (and writes) these arrays
# ------------------------------------------------------------------------------------------------
def zarr_codec_class():
    """The zarr v3 codec class (built on first use: importing zarr costs ~0.3 s)."""
    global _ZARR_CODEC
    if _ZARR_CODEC is None:
        _ZARR_CODEC = _make_zarr_codec_class()
    return _ZARR_CODEC


_ZARR_CODEC = None


def _make_zarr_codec_class():
    from zarr.abc.codec import BytesBytesCodec
    from zarr.core.common import parse_named_configuration

    @dataclass(frozen=True)
    class TemporalCodec(BytesBytesCodec):
        """zarr v3 codec ``mmreplay.temporal``: runs of frames along the chunk's first axis (see the module
        docstring of ``mmreplay.codecs.temporal`` for the byte format)."""

        is_fixed_size = False
        level: int = DEFAULT_LEVEL
        search: int = DEFAULT_SEARCH
        layout: int = DEFAULT_LAYOUT  # what the encoder writes; the decoder reads all three
        lz4_depth: int = DEFAULT_LZ4_DEPTH  # layout 3 only

        @classmethod
        def from_dict(cls, data):
            _, config = parse_named_configuration(data, CODEC_NAME)
            layout = int(config.get("layout", DEFAULT_LAYOUT))
            if layout not in LAYOUTS:
                raise ValueError(f"{CODEC_NAME}: layout {layout} unknown, expected one of {LAYOUTS}")
            return cls(level=int(config.get("level", DEFAULT_LEVEL)), search=int(config.get("search", DEFAULT_SEARCH)),
                       layout=layout, lz4_depth=int(config.get("lz4_depth", DEFAULT_LZ4_DEPTH)))

        def to_dict(self):
            config = {"level": self.level, "search": self.search}
            if self.layout != DEFAULT_LAYOUT:  # layout-1 arrays keep the metadata they always had
                config["layout"] = self.layout
            if self.layout == 3:
                config["lz4_depth"] = self.lz4_depth
            return {"name": CODEC_NAME, "configuration": config}

        def evolve_from_array_spec(self, array_spec: "ArraySpec"):
            return replace(self)

        def _decode_sync(self, chunk_bytes: "Buffer", chunk_spec: "ArraySpec") -> "Buffer":
            nbytes = int(np.prod(chunk_spec.shape)) * chunk_spec.dtype.to_native_dtype().itemsize
            out = np.empty(nbytes, dtype=np.uint8)
            decode_run(chunk_bytes.as_numpy_array(), out)
            return chunk_spec.prototype.buffer.from_bytes(out.tobytes())

        async def _decode_single(self, chunk_bytes, chunk_spec):
            return self._decode_sync(chunk_bytes, chunk_spec)

        def _encode_sync(self, chunk_bytes: "Buffer", chunk_spec: "ArraySpec") -> "Buffer":
            raw = chunk_bytes.as_numpy_array().view(np.uint8)
            run = raw.reshape(chunk_spec.shape[0] if chunk_spec.shape else 1, -1)
            return chunk_spec.prototype.buffer.from_bytes(encode(run, self.level, self.search, self.layout,
                                                                        self.lz4_depth))

        async def _encode_single(self, chunk_bytes, chunk_spec):
            return self._encode_sync(chunk_bytes, chunk_spec)

        def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
            raise NotImplementedError

    return TemporalCodec


def register_with_zarr() -> None:
    """Make ``mmreplay.temporal`` known to zarr (idempotent)."""
    from zarr.registry import register_codec

    register_codec(CODEC_NAME, zarr_codec_class())


def __getattr__(name: str):
    """``TemporalCodec``, the zarr codec class, for the ``zarr.codecs`` entry point (built on first use)."""
    if name == "TemporalCodec":
        return zarr_codec_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
