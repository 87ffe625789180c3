"""The dataset of the ``dreamer`` workload (issue #42) and its ground truth: DreamerV3's replay on DeepMind
Control, 64x64 RGB frames (the cached DMC pool of 4 tasks x 500 real 84x84 renders, resized once to 64x64,
channels last as DreamerV3's ``image`` key) cycled over episodes of 1,000 steps, one stream.

Invariant: dataset step ``i`` (the store's transition ``i``; the store never wraps) is episode ``i // 1000``,
step ``i % 1000``; its frame, next frame, action, reward and flags are functions of ``i`` and the pool alone,
so every sampled step is checked against the real frames. Episode ``e`` ends at its 1,000th step,
*terminated* when ``e % 3 == 2`` (``is_terminal``: the world model's ``cont`` target is 0 there), else
*truncated* (DMC's time limit: ``is_last`` without ``is_terminal``).

    python -m benchmarks.dreamer_data --n N [--codec C]          (from scripts/; builds the store)
"""
from __future__ import annotations

import contextlib
import json
import os
import time

import numpy as np

from . import run_memo
from .ltr_data import BUILD_MARKER, codec_label, frame_codec
from .measure import dir_bytes, log

EPISODE = 1000             # DreamerV3 on DMC: 1,000 env steps at action repeat 2 = 500 agent steps; 1,000 here
PERIOD = 20 * EPISODE      # the dataset repeats: episode e's frames depend on e % 4 and (e // 4) % 5 only
SIZE = 64                  # DreamerV3's image size
ACTION_DIM = 6
POOL_PER_TASK = 500
FRAME_SHAPE = (SIZE, SIZE, 3)
FRAME_BYTES = SIZE * SIZE * 3


def resize_pool(pool: np.ndarray) -> np.ndarray:
    """(N, 3, 84, 84) renders -> (N, 64, 64, 3) uint8: antialiased bilinear resampling (what an image library's
    resize to DreamerV3's 64x64 gives), rounded."""
    import torch
    x = torch.from_numpy(np.ascontiguousarray(pool)).float()
    y = torch.nn.functional.interpolate(x, size=(SIZE, SIZE), mode="bilinear", antialias=True, align_corners=False)
    return np.ascontiguousarray(y.round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).numpy())


def load_pool(cache_dir: str = "/tmp/mmreplay_dmc_pool") -> np.ndarray:
    """The resized pool, cached beside the DMC pool (``dmc64.npy``)."""
    path = os.path.join(cache_dir, "dmc64.npy")
    if os.path.exists(path):
        return np.load(path)
    import dmc_frames
    pool = resize_pool(dmc_frames.load_dmc_pool(POOL_PER_TASK, cache_dir))
    np.save(path + ".tmp.npy", pool)
    os.replace(path + ".tmp.npy", path)
    return pool


class DreamerSource:
    """Episode ``e`` is task ``e % 4`` started at pool frame ``((e // 4) * 100) % 500`` of that task and cycling
    through its 500 frames: step ``s``'s frame is task frame ``(start + s) % 500``, its next frame ``s + 1``."""

    def __init__(self, pool: np.ndarray | None = None):
        self.pool = load_pool() if pool is None else pool
        self.per_task = self.pool.shape[0] // 4

    def frame_ids(self, i, step_offset=0) -> np.ndarray:
        i = np.asarray(i, np.int64)
        e, s = i // EPISODE, i % EPISODE + step_offset
        start = ((e // 4) * 100) % self.per_task
        return (e % 4) * self.per_task + (start + s) % self.per_task

    def frames(self, i, step_offset=0) -> np.ndarray:
        return self.pool[self.frame_ids(i, step_offset)]

    @staticmethod
    def reward(i) -> np.ndarray:
        return ((np.asarray(i, np.int64) * 7919) % 1000 / 1000.0).astype(np.float32)

    @staticmethod
    def action(i) -> np.ndarray:
        i = np.asarray(i, np.int64)[..., None]
        return (((i * 31 + np.arange(ACTION_DIM)) % 200) / 100.0 - 1.0).astype(np.float32)

    @staticmethod
    def is_first(i) -> np.ndarray:
        return np.asarray(i, np.int64) % EPISODE == 0

    @staticmethod
    def is_last(i) -> np.ndarray:
        return np.asarray(i, np.int64) % EPISODE == EPISODE - 1

    @classmethod
    def is_terminal(cls, i) -> np.ndarray:
        i = np.asarray(i, np.int64)
        return cls.is_last(i) & ((i // EPISODE) % 3 == 2)

    def chunk(self, a: int, b: int) -> dict:
        i = np.arange(a, b)
        term = self.is_terminal(i)
        return {"obs": self.frames(i), "next_obs": self.frames(i, 1), "action": self.action(i),
                "reward": self.reward(i), "terminated": term, "truncated": self.is_last(i) & ~term}


def spaces():
    from gymnasium import spaces as sp
    return sp.Box(0, 255, FRAME_SHAPE, np.uint8), sp.Box(-1.0, 1.0, (ACTION_DIM,), np.float32)


def store_path(workdir: str, n: int, codec: str) -> str:
    return os.path.join(workdir, f"store_dreamer_{n}_{codec_label(codec)}")


def build(path: str, n: int, codec: str, step: int = 4096, reuse_runs: bool = True) -> dict:
    """Create the store at ``path`` (``codec`` ``"auto"``: the library's default) and fill it with ``extend``
    of ``step`` steps of one stream; the build's figures go to ``BUILD_MARKER`` last. ``reuse_runs``: the
    dataset repeats every ``PERIOD`` steps, so a run coded once is reused by content (``run_memo``: the same
    bytes the codec writes, compared in full), the store encoding in this process (``encoder="thread"``)."""
    import shutil

    import mmreplay
    from mmreplay.codecs import registry
    if os.path.exists(path):
        shutil.rmtree(path)
    obs_space, act_space = spaces()
    src = DreamerSource()
    t0 = time.perf_counter()
    s = mmreplay.Store.create(path, obs_space, act_space, capacity=n, frame_codec=frame_codec(codec), durable=False,
                              commit_every=1_000_000, commit_seconds=600.0,
                              **({"encoder": "thread"} if reuse_runs else {}))
    codec_used = s.schema.observations[0].codec
    memo = run_memo.reuse_coded_runs(registry.get(codec_used["name"])) if reuse_runs else contextlib.nullcontext()
    with memo as runs:
        last = time.perf_counter()
        for a in range(0, n, step):
            d = src.chunk(a, min(n, a + step))
            s.extend(d["obs"], d["action"], d["reward"], d["next_obs"], d["terminated"], d["truncated"],
                     streams=np.zeros(len(d["reward"]), np.int64))
            if time.perf_counter() - last > 60:
                last = time.perf_counter()
                done, el = a + step, last - t0
                log(f"[dreamer build] {done:,}/{n:,} in {el:.0f} s ({done / el:,.0f}/s, "
                    f"~{(n - done) / (done / el) / 60:.0f} min left)")
        s.close()
    build_s = time.perf_counter() - t0
    s = mmreplay.Store.open(path, mode="r")
    stored = len(s)
    s.close()
    disk, frames = dir_bytes(path), dir_bytes(os.path.join(path, "frames"))
    raw = FRAME_BYTES * n * (1 + 1 / EPISODE)  # distinct frames: one more than steps an episode
    out = {"workload": "dreamer", "n": n, "stored": stored, "codec": codec, "codec_spec": codec_used,
           "build_s": build_s, "add_per_s": n / build_s, "store_bytes": disk, "frames_bytes": frames,
           "bytes_per_step": disk / max(1, stored), "frame_bytes_per_step": frames / max(1, stored),
           "frames_smaller_than_raw": raw / max(1, frames), "runs_reused": bool(reuse_runs),
           **(runs.stats() if reuse_runs else {})}
    with open(os.path.join(path, BUILD_MARKER), "w") as f:
        json.dump(out, f)
    return out


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="build the dreamer benchmark store")
    p.add_argument("--n", type=int, default=100_000)
    p.add_argument("--codec", default="auto")
    p.add_argument("--workdir", default="/tmp/mmreplay_bench")
    p.add_argument("--path", default=None)
    p.add_argument("--no-reuse", action="store_true", help="code every run (no reuse of runs coded already)")
    a = p.parse_args()
    print(json.dumps(build(a.path or store_path(a.workdir, a.n, a.codec), a.n, a.codec, reuse_runs=not a.no_reuse),
                     default=str))
