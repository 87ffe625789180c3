"""The ``dqn-replay`` workload's data (issue #42): a Dopamine run of real Atari frames, written as the DQN Replay
Dataset's checkpoints, and the ground truth of every transition a store imported from them holds.

The run: the Atari pool's episodes (``scripts/atari_frames.py``: Pong, Breakout, Seaquest, random play; the
pool atari10m tiles) in order, cycled. Dopamine's ``OutOfGraphReplayBuffer`` adds ``STACK - 1`` all-zero
padding rows before each episode, then one row per step: the observation before the step (84x84 uint8), the
action (int32), the reward clipped to -1..1 (float32; Dopamine's runner clips before it stores) and terminal
(uint8), 1 on the episode's last step. Checkpoint ``i`` of ``rows`` rows is the buffer after
``rows // 10 + (i + 1) * rows`` adds: circular, run row ``g`` at ``g % rows``, so every checkpoint lies wrapped
in its files (the newest rows first), as a long run's do, and each starts where the previous one ended.

Files as Dopamine's ``save`` writes them: ``$store$_{observation,action,reward,terminal}_ckpt.{i}.gz``,
``add_count_ckpt.{i}.gz`` and ``invalid_range_ckpt.{i}.gz``, each ``np.save`` (format 1.0 header) inside
a gzip stream (written streamed, ``npy_stream.NpyWriter``: the bytes ``np.save`` of the whole array gives,
without holding the 7 GB array of a checkpoint). Dopamine's ``gzip.GzipFile`` compresses at level 9; the
benchmark writes level 6 by default (``gzip_level``): the same format and inflate cost (13 us a frame at
either level here), 85 instead of 75 bytes a row, and 4.5x less time to write (2.2 against 0.5 CPU-s per
20k rows on this VM), which decides how many checkpoints a run can afford.

Invariant (the ground truth): a store imported from checkpoints ``0..N-1`` holds, as its transition ``t``,
dataset transition ``d0 + t`` (the ``d``-th step of the cycled pool), ``d0`` the first step at or after the
first checkpoint's oldest row; its stacks are run rows ``g - 3 .. g`` (next: ``g - 2 .. g + 1``), padding
rows and rows before the first checkpoint being zero frames, which is what Dopamine's own sampling gives.
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from .measure import log

STACK = 4
GZIP_LEVEL = 6  # Dopamine's save: 9 (gzip.GzipFile's default); the same format, see the module docstring
DONE = ".ckpt_{}.json"  # written after a checkpoint's files: its build record


class DopamineRun:
    """The run's rows from the pool: ``cycle`` maps a row of one pass over the pool (its episodes, each after
    ``STACK - 1`` padding rows) to the pool step it holds (-1: padding)."""

    def __init__(self, rows: int, pool: dict | None = None):
        if pool is None:
            import atari_frames
            pool = atari_frames.load_atari_pool(verbose=True)
        self.rows = rows
        self.frames = pool["frames"]  # read-only memmap
        self.obs_index = np.asarray(pool["obs_index"], np.int64)
        self.action = np.asarray(pool["action"], np.int32)
        self.reward = np.clip(np.asarray(pool["reward"], np.float32), -1, 1)
        self.P = len(self.action)
        starts = np.asarray(pool["episode_start"], np.int64)
        ends = np.r_[starts[1:], self.P]
        self.terminal = np.zeros(self.P, np.uint8)
        self.terminal[ends - 1] = 1
        pieces, pos = [], np.empty(self.P, np.int64)
        at = 0
        for s, e in zip(starts.tolist(), ends.tolist()):
            pieces += [np.full(STACK - 1, -1, np.int64), np.arange(s, e)]
            pos[s:e] = at + STACK - 1 + np.arange(e - s)
            at += STACK - 1 + e - s
        self.cycle = np.concatenate(pieces)
        self.C = len(self.cycle)
        self.step_row = pos  # row of pool step j within a pass

    # -- the run -------------------------------------------------------------------------------------
    def add_count(self, i: int) -> int:
        return self.rows // 10 + (i + 1) * self.rows

    def first_row(self, i: int) -> int:
        return self.add_count(i) - self.rows

    def steps(self, g: np.ndarray) -> np.ndarray:
        """Pool step of each run row (-1: padding)."""
        return self.cycle[np.asarray(g, np.int64) % self.C]

    def row_of(self, d: np.ndarray) -> np.ndarray:
        """Run row of dataset transition ``d``."""
        d = np.asarray(d, np.int64)
        return (d // self.P) * self.C + self.step_row[d % self.P]

    def first_transition(self, g: int) -> int:
        """The first dataset transition whose run row is ``g`` or later."""
        c, r = divmod(g, self.C)
        j = int(np.searchsorted(self.step_row, r))
        return (c + 1) * self.P if j == self.P else c * self.P + j

    def frames_of(self, g: np.ndarray, first: int = 0) -> np.ndarray:
        """Frames of run rows ``g`` (any shape): zeros for padding rows and rows before ``first``."""
        g = np.asarray(g, np.int64)
        step = self.steps(g)
        real = (step >= 0) & (g >= first)
        out = np.zeros((*g.shape, *self.frames.shape[1:]), np.uint8)
        idx = self.obs_index[step[real]]
        if idx.size:
            order = np.argsort(idx, kind="stable")  # the memmap read in ascending order
            out[real] = np.asarray(self.frames[idx[order]])[np.argsort(order)]
        return out

    def columns(self, g: np.ndarray) -> dict:
        step = self.steps(g)
        real = step >= 0
        out = {"action": np.zeros(g.shape, np.int32), "reward": np.zeros(g.shape, np.float32),
               "terminal": np.zeros(g.shape, np.uint8)}
        for k in out:
            out[k][real] = getattr(self, k)[step[real]]
        return out

    # -- the files ------------------------------------------------------------------------------------
    def write_checkpoint(self, directory: str, i: int, block: int = 20_000, gzip_level: int = GZIP_LEVEL) -> dict:
        """Checkpoint ``i``'s six files, streamed a block of physical rows at a time; its record last."""
        from mmreplay.datasets.dopamine_files import invalid_range
        from mmreplay.datasets.npy_stream import NpyWriter, save_small
        os.makedirs(directory, exist_ok=True)
        t0 = time.perf_counter()
        cap, a = self.rows, self.add_count(i)
        lo = a - cap
        g_of = lambda p: lo + (np.asarray(p, np.int64) - lo) % cap  # noqa: E731  (the run row at file row p)
        name = lambda k: os.path.join(directory, f"{k}_ckpt.{i}.gz")  # noqa: E731
        cols = self.columns(g_of(np.arange(cap)))
        for k in ("action", "reward", "terminal"):
            save_small(name(f"$store$_{k}"), cols[k])
        shape = (cap, *self.frames.shape[1:])
        with NpyWriter(name("$store$_observation"), shape, np.uint8, compresslevel=gzip_level) as w:
            for p in range(0, cap, block):
                w.write_rows(self.frames_of(g_of(np.arange(p, min(cap, p + block)))))
        save_small(name("add_count"), np.array(a, np.int64))
        save_small(name("invalid_range"), invalid_range(a % cap, cap, STACK, 1))
        rec = {"checkpoint": i, "rows": cap, "add_count": a, "gzip_level": gzip_level,
               "seconds": time.perf_counter() - t0,
               "gz_bytes": sum(os.path.getsize(name(k)) for k in ("$store$_observation", "$store$_action",
                                                                  "$store$_reward", "$store$_terminal"))}
        with open(os.path.join(directory, DONE.format(i)), "w") as f:
            json.dump(rec, f)
        log(f"[dqn-replay] wrote checkpoint {i} ({cap:,} rows) in {rec['seconds']:.0f} s")
        return rec

    # -- the ground truth ---------------------------------------------------------------------------
    def truth(self, t: np.ndarray) -> dict:
        """What a store imported from checkpoint 0 on holds as its transitions ``t``."""
        first = self.first_row(0)
        d = self.first_transition(first) + np.asarray(t, np.int64)
        g = self.row_of(d)
        cols = self.columns(g)
        return {"obs": self.frames_of(g[:, None] + np.arange(-STACK + 1, 1), first),
                "next_obs": self.frames_of(g[:, None] + np.arange(-STACK + 2, 2), first),
                "action": cols["action"], "reward": cols["reward"], "terminal": cols["terminal"].astype(bool)}

    def subset(self, n: int) -> dict:
        """The first ``n`` rows of the run from checkpoint 0's oldest, as a 1% loader holds them in RAM: the
        checkpoint arrays' rows (padding included), run order."""
        g = self.first_row(0) + np.arange(n)
        out = self.columns(g)
        obs = np.empty((n, *self.frames.shape[1:]), np.uint8)
        for a in range(0, n, 50_000):
            obs[a:a + 50_000] = self.frames_of(g[a:a + 50_000])
        out["observation"] = obs
        return out


def ensure_checkpoints(directory: str, rows: int, n: int, gzip_level: int = GZIP_LEVEL, workers: int = 2) -> dict:
    """Write the checkpoints ``0..n-1`` not yet written at ``gzip_level`` (each carries its record), ``workers``
    at a time in processes of their own; their records."""
    recs, todo = {}, []
    for i in range(n):
        try:
            with open(os.path.join(directory, DONE.format(i))) as f:
                rec = json.load(f)
            if rec["rows"] == rows and rec.get("gzip_level") == gzip_level:
                recs[i] = rec
                continue
        except (OSError, ValueError, KeyError):
            pass
        todo.append(i)
    if todo:
        import multiprocessing as mp
        from concurrent.futures import ProcessPoolExecutor
        with ProcessPoolExecutor(min(workers, len(todo)), mp_context=mp.get_context("spawn")) as ex:
            for i, rec in zip(todo, ex.map(_write_one, [(directory, rows, i, gzip_level) for i in todo])):
                recs[i] = rec
    return recs


def _write_one(job: tuple) -> dict:
    directory, rows, i, gzip_level = job
    return DopamineRun(rows).write_checkpoint(directory, i, gzip_level=gzip_level)
