"""Where a batch's frames go: the places in the batch buffers each frame id of a pair of stacks is written to,
as the sources (``reading/sources/``) take them.

Invariant: every place of the batch (row ``i * k + j`` of the obs and of the next-obs output) is named exactly
once, by the frame id that belongs there; a frame that several places need is asked for once where the stacks
are shifted (frame ``j > 0`` of an obs stack is frame ``j - 1`` of its next stack) and copied to its second
place (``copies``), and grouped runs list each run once (``RunRequests``). Nothing here reads frames.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from mmreplay._native import decode as native
from mmreplay._native.bounds import address_of


class RunRequests(NamedTuple):
    """A batch's frames grouped by the run (multi-frame chunk) holding them (``native.group_frame_requests``):
    run ``chunks[g]`` is asked for frames ``js[starts[g]:starts[g + 1]]`` of it, to be written to addresses
    ``dsts[...]`` inside the arrays ``into``; ``order`` maps those requests back to positions of ``ids``."""
    ids: np.ndarray
    chunks: np.ndarray
    starts: np.ndarray
    js: np.ndarray
    dsts: np.ndarray
    order: np.ndarray
    nbytes: int  # bytes of a frame
    run_rows: int  # frames of a run
    into: tuple

    @classmethod
    def of_stacks(cls, obs_ids, next_ids, obs_words, next_words, shifted: bool, nbytes: int, ring_rows: int,
                  run_rows: int) -> "RunRequests":
        """The requests of a pair of stacks (``gather_stacks``'s arguments): shifted, the next stack asks only
        for its last frame; its others are the obs stack's, written twice (two requests of one run)."""
        # one compiled pass instead of ~8 array operations (~15% of a batch-32's CPU besides its decodes)
        ids, dsts = native.checked_stack_frame_requests(obs_ids, next_ids, bool(shifted), address_of(obs_words),
                                                address_of(next_words), nbytes)
        chunks, starts, js, dsts, order = native.checked_group_frame_requests(ids, dsts, ring_rows, run_rows)
        return cls(ids, chunks, starts, js, dsts, order, nbytes, run_rows, (obs_words, next_words))

    @classmethod
    def of_frames(cls, ids, words, nbytes: int, ring_rows: int, run_rows: int) -> "RunRequests":
        """The requests of frames ``ids`` (a vector) into consecutive rows of ``words`` (``gather``'s output in
        the words of ``FrameReader.stack_words``): each place named once."""
        return cls.of_frame_sets([(ids, words)], nbytes, ring_rows, run_rows)

    @classmethod
    def of_frame_sets(cls, sets, nbytes: int, ring_rows: int, run_rows: int) -> "RunRequests":
        """``of_frames`` of several ``(ids, words)`` pairs as one set of requests: a run that frames of several
        outputs need is one group, decoded once. Each output's places are named once, as in ``of_frames``."""
        ids = np.concatenate([np.asarray(i, dtype=np.int64).reshape(-1) for i, _ in sets])
        dsts = np.concatenate([address_of(w) + np.arange(np.asarray(i).size, dtype=np.int64) * nbytes
                               for i, w in sets])
        chunks, starts, js, dsts, order = native.checked_group_frame_requests(ids, dsts, ring_rows, run_rows)
        return cls(ids, chunks, starts, js, dsts, order, nbytes, run_rows, tuple(w for _, w in sets))

    def requests_of(self, groups: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The requests of ``groups`` (positions ``take`` in ``js`` / ``dsts``) and their group starts."""
        lo, hi = self.starts[groups], self.starts[groups + 1]
        sub_starts = np.concatenate([[0], np.cumsum(hi - lo)]).astype(np.int64)
        take = np.repeat(lo - sub_starts[:-1], hi - lo) + np.arange(int(sub_starts[-1]), dtype=np.int64)
        return take, sub_starts


class FramePlaces(NamedTuple):
    """The frames of a pair of stacks of one-frame chunks: frame ``ids[i]`` decoded to address ``dst[i]`` and,
    where ``copies[i]`` is not 0, copied there too. The first ``n_obs`` are the obs stacks' frames (place ``i``
    of ``obs_words``); the others go to places ``next_pos`` of ``next_words``."""
    ids: np.ndarray
    dst: np.ndarray
    copies: np.ndarray
    next_pos: np.ndarray
    n_obs: int

    @classmethod
    def of_stacks(cls, obs_ids, next_ids, obs_words, next_words, shifted: bool, nbytes: int) -> "FramePlaces":
        n, k = obs_ids.shape
        obs_pos = np.arange(n * k, dtype=np.int64)
        obs_dst = address_of(obs_words) + obs_pos * nbytes
        if shifted:
            ids = np.concatenate([obs_ids.reshape(-1), next_ids[:, -1]])
            next_pos = obs_pos[k - 1::k]
            also = np.where(obs_pos % k > 0, address_of(next_words) + (obs_pos - 1) * nbytes, 0)
            copies = np.concatenate([also, np.zeros(n, dtype=np.int64)])
        else:
            ids = np.concatenate([obs_ids.reshape(-1), next_ids.reshape(-1)])
            next_pos = obs_pos
            copies = np.zeros(ids.size, dtype=np.int64)
        dst = np.concatenate([obs_dst, address_of(next_words) + next_pos * nbytes])
        return cls(ids, dst, copies, next_pos, n * k)
