"""Real DeepMind Control pixels for mmreplay benchmarks: 84x84 RGB frames, channel first, as DrQ-v2 sees them.

``load_dmc_pool(n_per_task)`` renders ``n_per_task`` consecutive frames of uniform-random play from each of
several tasks (walker-walk, cheetah-run, quadruped-walk, reacher-easy; camera 0 as DrQ-v2 uses, 2 for
quadruped), in episodes of ``EPISODE_STEPS`` steps with action repeat 2, once, and caches them as one raw
``.npy`` (``(tasks * n_per_task, 3, 84, 84)`` uint8, the tasks one after the other) plus a ``meta.json`` in
``cache_dir`` (default ``/tmp/mmreplay_dmc_pool``; too large for git). Rendering is the slow part (~0.2 s a
frame here with ``MUJOCO_GL=egl``), one process per task. Needs ``pip install dm_control``.

``dmc_episodes(n_steps)`` cycles the pool's tasks as episodes of ``EPISODE_STEPS`` transitions to build a
store of any size (a 1M store repeats the pool's frames, which compress then as they did the first time:
the temporal codec only ever references frames of the same run).
"""

from __future__ import annotations

import argparse
import json
import os
from concurrent.futures import ProcessPoolExecutor

import numpy as np

DEFAULT_CACHE_DIR = "/tmp/mmreplay_dmc_pool"
TASKS = (("walker", "walk", 0), ("cheetah", "run", 0), ("quadruped", "walk", 2), ("reacher", "easy", 0))
EPISODE_STEPS = 250  # per pool episode (DrQ-v2: 500 env steps / action repeat 2)
ACTION_REPEAT = 2


def _render_task(domain: str, task: str, camera: int, n: int, seed: int) -> np.ndarray:
    os.environ.setdefault("MUJOCO_GL", "egl")
    from dm_control import suite

    env = suite.load(domain, task, task_kwargs={"random": seed})
    spec = env.action_spec()
    rng = np.random.default_rng(seed)
    frames = np.empty((n, 3, 84, 84), dtype=np.uint8)
    env.reset()
    for i in range(n):
        if i % EPISODE_STEPS == 0 and i:
            env.reset()
        frames[i] = env.physics.render(84, 84, camera_id=camera).transpose(2, 0, 1)
        action = rng.uniform(spec.minimum, spec.maximum, spec.shape)
        for _ in range(ACTION_REPEAT):
            env.step(action)
    return frames


def load_dmc_pool(n_per_task: int = 500, cache_dir: str = DEFAULT_CACHE_DIR, seed: int = 0) -> np.ndarray:
    meta = {"tasks": [list(t) for t in TASKS], "n_per_task": n_per_task, "seed": seed,
            "episode_steps": EPISODE_STEPS, "action_repeat": ACTION_REPEAT}
    path, meta_path = os.path.join(cache_dir, "frames.npy"), os.path.join(cache_dir, "meta.json")
    try:
        with open(meta_path) as f:
            if json.load(f) == meta:
                return np.load(path, mmap_mode="r")
    except (OSError, ValueError):
        pass
    os.makedirs(cache_dir, exist_ok=True)
    with ProcessPoolExecutor(max_workers=min(len(TASKS), os.cpu_count() or 1)) as pool:
        parts = list(pool.map(_render_task, *zip(*[(d, t, c, n_per_task, seed + k) for k, (d, t, c) in
                                                    enumerate(TASKS)])))
    np.save(path, np.concatenate(parts))
    with open(meta_path, "w") as f:
        json.dump(meta, f)
    return np.load(path, mmap_mode="r")


def episode_frames(pool: np.ndarray, n_per_task: int):
    """The pool's episodes (each ``EPISODE_STEPS`` frames of one task), task by task."""
    for t in range(pool.shape[0] // n_per_task):
        for lo in range(0, n_per_task - EPISODE_STEPS + 1, EPISODE_STEPS):
            yield pool[t * n_per_task + lo: t * n_per_task + lo + EPISODE_STEPS]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description="render (or load) the DMC frame pool")
    parser.add_argument("--n-per-task", type=int, default=500)
    args = parser.parse_args()
    frames = load_dmc_pool(args.n_per_task)
    print(frames.shape, frames.dtype)
