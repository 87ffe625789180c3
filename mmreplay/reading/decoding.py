"""Compiled decodes of compressed chunks, wherever their bytes lie (the compressed tier's shards, a batch's file
reads): the one way every source of frames (``reading/sources/``) turns bytes into frames.

Invariant: every call's requests are checked (addresses inside the arrays ``into``, sizes, codec kind) before
the first byte is written (the ``checked_*`` entry points of ``_native/decode.py``); a failed decode raises
``CorruptDataError`` naming the shard file and chunk of the first failure, after every decode of the call ended,
so no helper thread writes into a batch after the error. A chunk's crc32c is checked by its decode unless the
caller passes ``verified=True``: the compressed tier's chunks, checked once as the tier installed their shard
(``reading/resident.py``: where bytes come into this process is the integrity boundary; held bytes are trusted
as the decoded cache's frames are), whichever thread decodes them (the codec helpers are told too). From
``SHARED_MIN_*`` requests a call is shared with the codec helpers (``_native/helpers.py``: a piece of ~10-20 us
costs two atomic operations to hand over); below, one compiled call in the caller's thread is cheaper.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from mmreplay.errors import CorruptDataError
from mmreplay._native import decode as native
from mmreplay._native.helpers import DECODES_PER_PIECE, RUNS_PER_PIECE, codec_helpers

if TYPE_CHECKING:
    from mmreplay.reading.requests import RunRequests
    from mmreplay.reading.tiers import ColumnReader

SHARED_MIN_DECODES = 2 * DECODES_PER_PIECE
SHARED_MIN_RUNS = 2 * RUNS_PER_PIECE


class Decoder:
    """The compiled decodes of one reader, shared with the process's codec helpers (made, at the first batch
    that shares, with the session's ``codec_threads``). See the module invariant."""

    def __init__(self, codec_threads: int | None):
        self.codec_threads = codec_threads

    def helpers(self, requests: int = 0, threshold: int = 0):
        """The codec helpers (None where there are none) when ``requests`` reach ``threshold``, else None."""
        return codec_helpers(self.codec_threads) if requests >= threshold else None

    def decode_chunks(self, col: "ColumnReader", chunks, src, sizes, dst, copies, nbytes, into,
                      verified: bool = False) -> None:
        """Chunks (``sizes`` bytes at addresses ``src``) decoded to addresses ``dst`` / ``copies`` inside the arrays
        ``into``; raises on the first bad one (``chunks``: their chunk numbers, for the error). ``verified``: see
        the module invariant."""
        status = np.empty(src.size, dtype=np.int8)
        helpers = self.helpers(src.size, SHARED_MIN_DECODES)
        bad = None if helpers is None else helpers.decode(src, sizes, dst, copies, nbytes, col.codec, status, into,
                                                          verified)
        if bad is None:
            bad = native.checked_decode_chunks(src, sizes, dst, copies, nbytes, col.codec, status, into, verified)
        if bad:
            raise_bad_chunk(col, chunks, status)

    def decode_stack_plan(self, col: "ColumnReader", plan, verified: bool = False) -> None:
        """``decode_chunks`` of a batch's checked ``native.StackPlan`` (every chunk held)."""
        status = np.empty(plan.src.size, dtype=np.int8)
        helpers = codec_helpers(self.codec_threads)
        bad = None if helpers is None else helpers.decode_plan(plan, col.codec, status, verified)
        if bad is None:
            bad = native.checked_decode_plan(plan, col.codec, status, verified)
        if bad:
            raise_bad_chunk(col, plan.rows, status)

    def decode_run_groups(self, col: "ColumnReader", req: "RunRequests", src, sizes, groups,
                          verified: bool = False) -> None:
        """``native.decode_frame_groups`` over the runs ``groups`` of ``req`` (``sizes`` bytes at ``src``): each
        decodes only the frames asked of it and those their references lead to. All groups (``groups`` None, or
        all of them listed), or those given: then their requests are regrouped. Raises on the first bad run."""
        chunks, starts, js, dsts = req.chunks, req.starts, req.js, req.dsts
        if groups is not None and groups.size < chunks.size:
            lo, hi = starts[groups], starts[groups + 1]
            take = np.concatenate([np.arange(a, b) for a, b in zip(lo.tolist(), hi.tolist())])
            starts = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
            js, dsts, chunks, src, sizes = js[take], dsts[take], chunks[groups], src[groups], sizes[groups]
        status = np.empty(src.size, dtype=np.int8)
        helpers = self.helpers(src.size, SHARED_MIN_RUNS)
        bad = None if helpers is None else helpers.decode_frames(src, sizes, starts, js, dsts, req.nbytes,
                                                                 req.run_rows, status, req.into, verified)
        if bad is None:
            bad = native.checked_decode_frame_groups(src, sizes, starts, js, dsts, req.nbytes, req.run_rows, status,
                                                     req.into, verified)
        if bad:
            raise_bad_chunk(col, chunks, status)


def raise_bad_chunk(col: "ColumnReader", chunks: np.ndarray, status: np.ndarray) -> None:
    """The first failed decode (``status`` by decode, ``chunks`` its chunk) as an error naming the chunk."""
    i = int(np.flatnonzero(status[:chunks.size] != native.OK)[0])
    shard, inner = divmod(int(chunks[i]), col.column.layout.chunks_per_shard)
    raise CorruptDataError(f"{col.column.array.where(shard, inner)}: "
                           f"{native.STATUS_TEXT.get(int(status[i]), 'unreadable')}")
