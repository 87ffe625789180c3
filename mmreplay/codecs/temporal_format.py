"""The temporal codec's run headers: their sizes, their parsing and checks, and zstd's announced frame size.

Invariant: ``parse_header`` and ``parse_header2`` return a run's counts, references (and, layout 2/3, frame ends)
only when they describe a run that decodes to exactly the bytes expected, every reference inside the run and
no reference cycle, and the ends tiling the payload; otherwise they raise ``ValueError`` saying what is
malformed. ``zstd_content_size`` reads a size only from a well-formed zstd frame header (RFC 8878, 3.1.1).

Why a module of its own: both the CPU codec (``temporal.py``) and the device path's cut of runs into pieces
(``temporal_device.py``) check the same headers, and neither should import the other's work to do it.
The format itself is described in ``temporal.py``.
"""

from __future__ import annotations

import numpy as np

from mmreplay._native.temporal_header import HEADER, MAGIC, MAGIC2, MAX_RUN, ZSTD_MAGIC
from mmreplay.codecs.run_spec import parse_run_header


def header_nbytes(n_frames: int) -> int:
    return HEADER.size + n_frames


def parse_header(data, expected_nbytes: int) -> tuple[int, int, np.ndarray]:
    """(n_frames, frame_nbytes, references) of a coded run that must decode to ``expected_nbytes``."""
    return parse_run_header(data, expected_nbytes, HEADER, MAGIC, MAX_RUN, "temporal")


FCS_BYTES = (0, 2, 4, 8)
DICT_ID_BYTES = (0, 1, 2, 4)


def zstd_content_size(frame) -> int | None:
    """The decompressed size a zstd frame's header announces (RFC 8878, 3.1.1), or None if it announces
    none or is not a zstd frame. (numcodecs decompresses a smaller frame into a larger buffer silently.)"""
    if len(frame) < 6 or int.from_bytes(frame[:4], "little") != ZSTD_MAGIC:
        return None
    descriptor = frame[4]
    single_segment = (descriptor >> 5) & 1
    fcs_bytes = FCS_BYTES[descriptor >> 6] or (1 if single_segment else 0)
    start = 5 + (0 if single_segment else 1) + DICT_ID_BYTES[descriptor & 3]
    if fcs_bytes == 0 or len(frame) < start + fcs_bytes:
        return None
    size = int.from_bytes(frame[start:start + fcs_bytes], "little")
    return size + 256 if fcs_bytes == 2 else size


def header2_nbytes(n_frames: int) -> int:
    return HEADER.size + 5 * n_frames


def parse_header2(data, expected_nbytes: int) -> tuple[int, int, np.ndarray, np.ndarray]:
    """(n_frames, frame_nbytes, references, ends) of a layout-2 run that must decode to ``expected_nbytes``,
    every reference checked to point inside the run without cycles and the ends to tile the payload."""
    if len(data) < HEADER.size:
        raise ValueError(f"temporal chunk is {len(data)} bytes, shorter than its {HEADER.size}-byte header")
    magic, n, frame_nbytes = HEADER.unpack_from(data, 0)
    if magic != MAGIC2:
        raise ValueError(f"temporal chunk starts with {magic!r}, expected {MAGIC2!r}")
    if not 1 <= n <= 127 or n * frame_nbytes != expected_nbytes:
        raise ValueError(f"temporal chunk announces {n} frames of {frame_nbytes} bytes, expected "
                         f"{expected_nbytes} bytes in all")
    if len(data) < header2_nbytes(n):
        raise ValueError(f"temporal chunk is {len(data)} bytes, shorter than its header of {n} frames")
    refs = np.frombuffer(data, dtype=np.int8, count=n, offset=HEADER.size).astype(np.int64)
    ends = np.frombuffer(data, dtype="<u4", count=n, offset=HEADER.size + n).astype(np.int64)
    targets = np.arange(n) - refs
    if ((targets < 0) | (targets >= n)).any():
        bad = int(np.argmax((targets < 0) | (targets >= n)))
        raise ValueError(f"temporal chunk: frame {bad} refers to frame {int(targets[bad])}, outside the run of {n}")
    if chain_depths(refs) is None:
        raise ValueError("temporal chunk: its references form a cycle")
    if (np.diff(ends) < 0).any() or ends[-1] != len(data) - header2_nbytes(n):
        raise ValueError(f"temporal chunk: frame ends {ends.tolist()} do not tile its {len(data) - header2_nbytes(n)}"
                         "-byte payload")
    return n, frame_nbytes, refs, ends


def chain_depths(refs: np.ndarray) -> np.ndarray | None:
    """Steps from each frame to the frame coded alone its references lead to, or None if one never does."""
    n = refs.size
    depths = np.zeros(n, dtype=np.int64)
    for i in range(n):
        j, d = i, 0
        while refs[j] != 0:
            j -= int(refs[j])
            d += 1
            if d >= n:
                return None
        depths[i] = d
    return depths
