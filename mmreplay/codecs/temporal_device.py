"""The temporal codec's runs cut for a batched device decoder: which zstd frames and LZ4 blocks of a coded run a
batch needs, where each goes, and what it is coded against (``FrameCodec.device_pieces``).

Invariant: the pieces listed for a run are exactly the frames asked for plus every frame their references
lead to, each checked as ``temporal.decode_run`` checks it (the header's counts and references, each frame's
first word, zstd's announced size) before it is listed; a run that fails a check is refused with
``ValueError`` (``device_run_pieces``) or handed back to the caller's loop, which names it
(``device_runs_many`` returns None). Nothing here decodes: the device path does, on whatever decoder it has.

Why a module of its own: the format and the CPU codec (``temporal.py``) do not need it; the device path's
gather (``mmreplay/device/staging.py``) does, on every batch: layout-1 runs in array operations over all of them,
layouts 2 and 3 in one compiled pass (``_native/device_cut.py``).
"""

from __future__ import annotations

import numpy as np

from mmreplay._native.device_cut import cut_runs
from mmreplay._native.temporal_header import HEADER, MAGIC, MAGIC2, MAX_RUN, ZSTD_MAGIC
from mmreplay.codecs.base import PIECE_LZ4, PIECE_ZSTD, DevicePieces
from mmreplay.codecs.temporal_format import (
    DICT_ID_BYTES,
    FCS_BYTES,
    header2_nbytes,
    header_nbytes,
    parse_header,
    parse_header2,
    zstd_content_size,
)


def device_run_pieces(data, chunk_rows: int, row_nbytes: int, rows: np.ndarray) -> DevicePieces:
    """A coded run cut for a batched device decoder (``FrameCodec.device_pieces``), its header parsed and checked
    as ``decode_run`` checks it. Layout 1: the run's one zstd frame, every row listed. Layouts 2 and 3: the zstd
    frames or LZ4 blocks of ``rows`` and of every row their references lead to, no others."""
    data = memoryview(data).cast("B")
    nbytes = chunk_rows * row_nbytes
    if len(data) >= 4 and bytes(data[:4]) == MAGIC2:
        n, frame_nbytes, refs, ends = parse_header2(data, nbytes)
        if n != chunk_rows:
            raise ValueError(f"temporal chunk announces {n} frames, its column's chunks hold {chunk_rows}")
        needed = np.zeros(n, dtype=bool)
        for row in np.asarray(rows, dtype=np.int64).tolist():
            while not needed[row]:  # the references lead to a frame coded alone (parse_header2: no cycles)
                needed[row] = True
                row -= int(refs[row])
        listed = np.flatnonzero(needed)
        base = header2_nbytes(n)
        kinds = np.empty(listed.size, dtype=np.int8)
        src = np.empty((listed.size, 2), dtype=np.int64)
        for j, i in enumerate(listed.tolist()):
            lo, hi = (int(ends[i - 1]) if i else 0), int(ends[i])
            part = data[base + lo:base + hi]
            if len(part) >= 4 and int.from_bytes(part[:4], "little") != ZSTD_MAGIC:
                if int.from_bytes(part[:4], "little") != frame_nbytes or len(part) == 4:
                    raise ValueError(f"temporal chunk: frame {i} is neither a zstd frame nor an LZ4 block of "
                                     f"{frame_nbytes} bytes")
                kinds[j], src[j] = PIECE_LZ4, (base + lo + 4, base + hi)
            else:
                if zstd_content_size(part) != frame_nbytes:
                    raise ValueError(f"temporal chunk: frame {i}'s zstd frame announces {zstd_content_size(part)} "
                                     f"bytes, expected {frame_nbytes}")
                kinds[j], src[j] = PIECE_ZSTD, (base + lo, base + hi)
        dst = np.stack([listed * frame_nbytes, (listed + 1) * frame_nbytes], axis=1).astype(np.int64)
        targets = np.where(refs[listed] != 0, listed - refs[listed], -1).astype(np.int64)
        return DevicePieces(kinds, src, dst, listed.astype(np.int64), targets)
    n, frame_nbytes, refs = parse_header(data, nbytes)
    if n != chunk_rows:
        raise ValueError(f"temporal chunk announces {n} frames, its column's chunks hold {chunk_rows}")
    payload_at = header_nbytes(n)
    announced = zstd_content_size(data[payload_at:])
    if announced != nbytes:
        raise ValueError(f"temporal chunk: zstd frame announces {announced} bytes, expected {nbytes}")
    every = np.arange(n, dtype=np.int64)
    targets = np.where(refs != 0, every - refs.astype(np.int64), -1).astype(np.int64)
    return DevicePieces(np.array([PIECE_ZSTD], dtype=np.int8), np.array([[payload_at, len(data)]], dtype=np.int64),
                        np.array([[0, nbytes]], dtype=np.int64), every, targets)


def _le(buf: np.ndarray, at: np.ndarray, width: int) -> np.ndarray:
    """``read_le`` in one gather of ``(len(at), width)`` bytes (offsets past the end read as zero bytes, as there):
    the batch's hot reads, one numpy call a field instead of one a byte."""
    if not buf.size or not at.size:
        return np.zeros(at.size, dtype=np.int64)
    idx = at[:, None] + np.arange(width)
    b = buf[np.minimum(idx, buf.size - 1)].astype(np.int64)
    b[idx >= buf.size] = 0
    return (b << (8 * np.arange(width))).sum(axis=1)  # the fields do not overlap: the sum is their OR


def _zstd_sizes(buf: np.ndarray, at: np.ndarray, length: np.ndarray) -> np.ndarray:
    """``zstd_content_size`` of the frames at ``at`` (``length`` bytes each) of ``buf``, -1 where none."""
    descriptor = _le(buf, at + 4, 1)
    single = (descriptor >> 5) & 1
    fcs = np.array(FCS_BYTES)[descriptor >> 6]
    fcs = np.where(fcs == 0, single, fcs)
    start = 5 + (1 - single) + np.array(DICT_ID_BYTES)[descriptor & 3]
    size = np.full(at.size, -1, dtype=np.int64)
    for width in (1, 2, 4, 8):
        sel = fcs == width
        if sel.any():
            size[sel] = _le(buf, at[sel] + start[sel], width) + (256 if width == 2 else 0)
    ok = (length >= 6) & (_le(buf, at, 4) == ZSTD_MAGIC) & (fcs > 0) & (length >= start + fcs)
    return np.where(ok, size, -1)


def device_runs_many(buf: np.ndarray, at: np.ndarray, length: np.ndarray, chunk_rows: int, row_nbytes: int,
                     rows: list) -> tuple[DevicePieces, np.ndarray] | None:
    """``device_run_pieces`` of many runs at once (run ``i`` is ``buf[at[i]:at[i] + length[i]]``, rows ``rows[i]``
    asked for): every check of ``parse_header``/``parse_header2`` and of the frames' first words, on all runs (layout 1
    in array operations, layouts 2 and 3 in one compiled pass); the pieces in the loop's order. None (the caller
    loops, and names what is wrong) when the runs mix layouts or any check fails."""
    n, r = chunk_rows, at.size
    h = HEADER.size
    if not r or (_le(buf, at + 4, 4) != n).any() or (_le(buf, at + 8, 4) != row_nbytes).any():
        return None
    cols = np.arange(n)
    magic = _le(buf, at, 4)
    if (magic == int.from_bytes(MAGIC, "little")).all() and n <= MAX_RUN and (length >= h + n).all():
        # layout 1: the run's one zstd frame, every row; references point back inside the run
        back = buf[at[:, None] + h + cols].astype(np.int64)
        if (back > cols).any() or (_zstd_sizes(buf, at + h + n, length - h - n) != n * row_nbytes).any():
            return None
        pieces = DevicePieces(np.full(r, PIECE_ZSTD, dtype=np.int8), np.stack([at + h + n, at + length], axis=1),
                              np.tile(np.array([[0, n * row_nbytes]], dtype=np.int64), (r, 1)), np.tile(cols, r),
                              np.where(back > 0, cols - back, -1).reshape(-1))
        return pieces, np.stack([np.ones(r, dtype=np.int64), np.full(r, n, dtype=np.int64)], axis=1)
    if n > 127 or (length < h + 5 * n).any() or (magic != int.from_bytes(MAGIC2, "little")).any():
        return None
    # layouts 2 and 3: one compiled pass over the runs (``_native/device_cut.py``: the same checks, the loop's order)
    got = cut_runs(buf, at, length, n, row_nbytes, h, int.from_bytes(MAGIC2, "little"), ZSTD_MAGIC, rows)
    if got is None:
        return None
    kinds, src, dst, rows_out, refs_out, per_run = got
    pieces = DevicePieces(kinds, src, dst, rows_out, refs_out)
    return pieces, np.stack([per_run, per_run], axis=1)
