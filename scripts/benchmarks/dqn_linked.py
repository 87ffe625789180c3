"""A whole DQN Replay Dataset run (50 checkpoints, ~50M transitions) from ``distinct`` written checkpoints.

Writing a checkpoint of 1M real Atari rows takes ~2 min of both cores (``dqn_data``), so the 50 of a game take
~100 min before the import is even measured. Linked instead: checkpoint ``i``'s four ``$store$`` files are hard
links of checkpoint ``i % distinct``'s (in the directory the distinct ones were written to), and its
``add_count`` and ``invalid_range`` are its own, so an import reads 50 checkpoints, each as its own and
continuing the run, from ``distinct`` x ~94 MB of files. The import's work a transition is the same as for
distinct frames (the codec sees real frames; runs repeat only every ``distinct`` checkpoints).

Invariant (the ground truth, ``LinkedRun.truth``): checkpoint ``i`` holds real checkpoint ``i % distinct``'s
rows, placed at the linked run's rows ``first_row(i) ..``; a store imported from checkpoints ``0..n-1`` holds, as
its transition ``t``, the ``t``-th non-padding row of that sequence, its stacks the linked run's rows before it
(zero frames for padding and for rows before the first checkpoint), as Dopamine's sampling gives.
"""
from __future__ import annotations

import os

import numpy as np

from .dqn_data import STACK, DopamineRun

STORE_FILES = ("observation", "action", "reward", "terminal")


def link_checkpoints(written: str, linked: str, rows: int, distinct: int, n: int) -> None:
    """Checkpoints ``0..n-1`` in ``linked``: hard links of ``written``'s checkpoint ``i % distinct`` files, with
    their own ``add_count`` and ``invalid_range`` (kept if already there)."""
    from mmreplay.datasets.dopamine_files import invalid_range
    from mmreplay.datasets.npy_stream import save_small
    os.makedirs(linked, exist_ok=True)
    run = DopamineRun.__new__(DopamineRun)  # add_count only: no pool needed
    run.rows = rows
    for i in range(n):
        for k in STORE_FILES:
            dst = os.path.join(linked, f"$store$_{k}_ckpt.{i}.gz")
            if not os.path.exists(dst):
                os.link(os.path.join(written, f"$store$_{k}_ckpt.{i % distinct}.gz"), dst)
        a = run.add_count(i)
        save_small(os.path.join(linked, f"add_count_ckpt.{i}.gz"), np.array(a, np.int64))
        save_small(os.path.join(linked, f"invalid_range_ckpt.{i}.gz"), invalid_range(a % rows, rows, STACK, 1))


class LinkedRun(DopamineRun):
    """The run the links make (see the module invariant)."""

    def __init__(self, rows: int, distinct: int, n: int, pool: dict | None = None):
        super().__init__(rows, pool)
        self.distinct, self.n = distinct, n
        firsts = [self.first_row(k) for k in range(distinct)]
        # per distinct checkpoint: its rows (offsets from its first row) that hold a transition
        self.held = [np.flatnonzero(self.steps(np.arange(f, f + rows)) >= 0) for f in firsts]
        counts = np.array([self.held[i % distinct].size for i in range(n)], np.int64)
        self.starts = np.r_[0, np.cumsum(counts)]  # store transition where each checkpoint's rows begin

    def checkpoint_starts(self) -> np.ndarray:
        """The store transitions where checkpoints ``1..n-1`` begin (a stack there crosses a join)."""
        return self.starts[1:-1]

    def _row_of_transition(self, t: np.ndarray) -> np.ndarray:
        i = np.searchsorted(self.starts, t, side="right") - 1
        out = np.empty(t.shape, np.int64)
        for k in range(self.distinct):
            m = i % self.distinct == k
            out[m] = self.first_row(i[m]) + self.held[k][t[m] - self.starts[i[m]]]
        return out

    def _frames(self, g: np.ndarray) -> np.ndarray:
        """Frames of linked rows ``g``: the real rows they copy; zeros before the first checkpoint."""
        f0 = self.first_row(0)
        i = np.maximum(g - f0, 0) // self.rows
        real = self.first_row(i % self.distinct) + (g - self.first_row(i))
        out = DopamineRun.frames_of(self, real)
        out[g < f0] = 0
        return out

    def truth(self, t: np.ndarray) -> dict:
        t = np.asarray(t, np.int64)
        g = self._row_of_transition(t)
        f0 = self.first_row(0)
        i = (g - f0) // self.rows
        cols = self.columns(self.first_row(i % self.distinct) + (g - self.first_row(i)))
        return {"obs": self._frames(g[:, None] + np.arange(-STACK + 1, 1)),
                "next_obs": self._frames(g[:, None] + np.arange(-STACK + 2, 2)),
                "action": cols["action"], "reward": cols["reward"], "terminal": cols["terminal"].astype(bool)}
