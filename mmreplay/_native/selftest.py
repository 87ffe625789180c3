"""The linked C symbols proved once a process: known chunks decoded through the compiled decoder, before
its first use, must give numcodecs' bytes.

Invariant: ``ensure_linked`` returns only after ``self_test`` passed in this process (it runs it at most
once, under a lock); ``self_test`` decodes each of ``_known_chunks`` through ``chunk_decode.decode_chunks``
and raises ``LinkError`` naming the library and symbol whose result differs. The entry points
(``decode.py``, ``helpers.py``, ``runs.py``) call ``ensure_linked`` before a kernel decodes stored bytes, so
a build of numcodecs or google-crc32c whose exported symbols do something else than their names say is an
error, never garbage returned as frames.

A new codec kind adds a case to ``_known_chunks``: a small chunk coded by the Python encoder, and its bytes.
"""

from __future__ import annotations

import threading

import numpy as np

from mmreplay._native import delta_lz4_header
from mmreplay._native import temporal_header as temporal
from mmreplay._native.chunk_decode import decode_chunks
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_DELTA_LZ4, CODEC_TEMPORAL, CODEC_ZSTD
from mmreplay._native.linked import BAD_CHECKSUM, OK, STATUS_TEXT


class LinkError(RuntimeError):
    """The C functions linked into the kernels do not decode a known chunk to its bytes (a build of
    numcodecs or google-crc32c whose exported symbols do something else than their names say)."""


_LINK_CHECKED = False
_LINK_LOCK = threading.Lock()


def _known_chunks() -> list[tuple[int, str, bytes, bytes]]:
    """``(codec, what, chunk, expected)``: a small frame run coded by numcodecs (and by hand for the
    temporal codec), checksum appended as zarr does, and the bytes numcodecs decodes it to."""
    import google_crc32c
    from numcodecs import Blosc, Zstd, lz4, zstd

    frames = (np.arange(2 * 96, dtype=np.int64) * 7 % 251).astype(np.uint8).reshape(2, 96)
    frames[1] = frames[0] + 3  # a second frame close to the first, as a temporal run's are
    raw = frames.tobytes()

    def sealed(body: bytes) -> bytes:
        return body + int(google_crc32c.value(body)).to_bytes(4, "little")

    blosc = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    run = b"".join((temporal.HEADER.pack(temporal.MAGIC, 2, frames.shape[1]), bytes([0, 1]),
                    zstd.compress(np.stack([frames[0], frames[1] - frames[0]]).tobytes(), 3)))
    # layout 3: the key an LZ4 block in numcodecs' format (4-byte size, then the block), the residual zstd
    parts = [lz4.compress(frames[0].tobytes()), zstd.compress((frames[1] - frames[0]).tobytes(), 3)]
    run3 = b"".join((temporal.HEADER.pack(temporal.MAGIC2, 2, frames.shape[1]), bytes([0, 1]),
                     np.cumsum([len(p) for p in parts]).astype("<u4").tobytes(), *parts))
    # delta-lz4: the run's residuals one LZ4 block, without numcodecs' 4-byte size
    run_lz4 = b"".join((delta_lz4_header.HEADER.pack(delta_lz4_header.MAGIC, 2, frames.shape[1]), bytes([0, 1]),
                        lz4.compress(np.stack([frames[0], frames[1] - frames[0]]).tobytes())[4:]))
    return [(CODEC_BLOSC, "numcodecs.blosc: blosc_decompress_ctx / blosc_cbuffer_validate (lz4)",
             sealed(blosc.encode(raw)), bytes(blosc.decode(blosc.encode(raw)))),
            (CODEC_ZSTD, "numcodecs.zstd: ZSTD_decompress / ZSTD_isError",
             sealed(Zstd(level=1).encode(raw)), bytes(Zstd(level=1).decode(Zstd(level=1).encode(raw)))),
            (CODEC_TEMPORAL, "numcodecs.zstd: ZSTD_decompress (temporal run)", sealed(run), raw),
            (CODEC_TEMPORAL, "numcodecs.lz4: LZ4_decompress_safe (temporal run, layout 3)", sealed(run3), raw),
            (CODEC_DELTA_LZ4, "numcodecs.lz4: LZ4_decompress_safe_partial (delta-lz4 run)", sealed(run_lz4), raw)]


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


