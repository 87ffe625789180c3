"""Episode state per stream (one stream per sub-env of a vector env).

Invariant: for stream ``s``, ``last[s]`` is the global id of its newest transition and ``ended[s]``
whether that transition ended its episode. A new transition of ``s`` continues the episode (its
observation is not stored again; its frame stack reaches back) iff the episode has not ended, the last
transition is still in the ring, and the new observation equals the last next observation exactly.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from mmreplay.columns.spec import ColumnSpec

MAX_STREAM_ID = (1 << 31) - 1


class Streams:
    """The episode state of every stream (see the module invariant)."""

    def __init__(self, obs_specs: Sequence[ColumnSpec]):
        self.obs_names = [s.name for s in obs_specs]
        self.last: dict[int, int] = {}
        self.ended: dict[int, bool] = {}
        self._next_obs: dict[int, dict[str, np.ndarray]] = {}  # copy of each stream's last next obs

    @staticmethod
    def validate_ids(ids, n: int) -> np.ndarray:
        ids = np.asarray(ids)
        if ids.shape != (n,) or ids.dtype.kind not in "iu":
            raise ValueError(f"streams: expected {n} integer stream ids, got {ids.tolist() if ids.size < 20 else ids}")
        if ids.size and (ids.min() < 0 or ids.max() > MAX_STREAM_ID):
            raise ValueError(f"streams: ids must lie in [0, {MAX_STREAM_ID}], got {ids.tolist()[:8]}")
        return ids.astype(np.int64)

    def resolve(self, ids: np.ndarray, obs: dict[str, np.ndarray], next_obs: dict[str, np.ndarray], done: np.ndarray,
                ring, frames) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For each row of a block (a stream may repeat): does it continue its stream's episode, the row of
        its predecessor in this block (-1 if none) and the global id of an earlier predecessor (-1)."""
        n = ids.size
        cont = np.zeros(n, dtype=bool)
        pred_row = np.full(n, -1, dtype=np.int64)
        pred_g = np.full(n, -1, dtype=np.int64)
        last_row: dict[int, int] = {}
        for i, sid in enumerate(ids.tolist()):
            j = last_row.get(sid)
            if j is not None:
                pred_row[i] = j
            else:
                pred_g[i] = self._continued(sid, i, obs, ring, frames)
            last_row[sid] = i
        cont[pred_g >= 0] = True
        rows = np.flatnonzero(pred_row >= 0)
        if rows.size:
            preds = pred_row[rows]
            same = ~done[preds]
            for k in self.obs_names:
                same &= rows_equal(obs[k], rows, next_obs[k], preds)
            cont[rows] = same
        return cont, pred_row, pred_g

    def _continued(self, sid: int, row: int, obs: dict[str, np.ndarray], ring, frames) -> int:
        """Global id of the transition that row ``row`` (first of stream ``sid`` in its block) continues, or -1."""
        last = self.last.get(sid, -1)
        if last < ring.oldest or self.ended.get(sid, True):
            return -1
        expected = self._last_next_obs(sid, last, ring, frames)
        if expected is None or not all(obs[k][row].tobytes() == expected[k].tobytes() for k in self.obs_names):
            return -1
        return last

    def _last_next_obs(self, sid: int, last: int, ring, frames) -> dict[str, np.ndarray] | None:
        cached = self._next_obs.get(sid)
        if cached is None:  # after reopen: read it back from the frame ring
            frame = int(ring.frame_globals(ring.read("next_frame", np.array([last])), frames.head)[0])
            if frame < frames.oldest:
                return None
            cached = {k: frames.read_frame(k, frame) for k in self.obs_names}
            self._next_obs[sid] = cached
        return cached

    def record(self, ids: np.ndarray, g: np.ndarray, done: np.ndarray, next_obs: dict[str, np.ndarray]) -> None:
        last_row = {sid: i for i, sid in enumerate(ids.tolist())}  # the newest row of each stream wins
        for sid, i in last_row.items():
            self.last[sid] = int(g[i])
            self.ended[sid] = bool(done[i])
            if done[i]:
                self._next_obs.pop(sid, None)
            else:
                kept = self._next_obs.get(sid)
                if kept is None:
                    # np.array, not .copy(): a scalar-shaped key's row is a numpy scalar, which is immutable
                    self._next_obs[sid] = {k: np.array(next_obs[k][i], copy=True) for k in self.obs_names}
                else:
                    for k in self.obs_names:
                        kept[k][...] = next_obs[k][i]

    def to_json(self) -> list[list[int]]:
        return [[sid, last, int(self.ended[sid])] for sid, last in sorted(self.last.items())]

    def restore(self, entries: list[list[int]]) -> None:
        for sid, last, ended in entries:
            self.last[sid] = last
            self.ended[sid] = bool(ended)


def rows_equal(a: np.ndarray, rows: np.ndarray, b: np.ndarray, preds: np.ndarray) -> np.ndarray:
    """``a[rows[i]] == b[preds[i]]`` (whole rows) for each i, without copies in the usual layouts."""
    n = a.shape[0]
    gap = int(rows[0] - preds[0])
    if rows.size == n - gap and rows[0] == gap and np.all(rows - preds == gap):
        x, y = a[gap:], b[: n - gap]  # every row continues the row ``gap`` before it: plain slices
    else:
        x, y = a[rows], b[preds]
    # Bitwise equality (a NaN observation continues itself), 8 bytes at a time where rows allow.
    x, y = x.reshape(rows.size, -1).view(np.uint8), y.reshape(rows.size, -1).view(np.uint8)
    if x.shape[1] % 8 == 0:
        x, y = x.view(np.uint64), y.view(np.uint64)
    return (x == y).all(axis=1)
