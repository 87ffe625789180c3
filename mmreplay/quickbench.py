"""``mmreplay bench``: a one-minute look at this machine's add and sample rates on synthetic Atari-sized
frames (smooth moving blobs, so they compress like real ones). ``scripts/bench.py`` is the full
benchmark against SB3, cpprb, TorchRL and a numpy ring on real Atari frames."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
from gymnasium import spaces

from mmreplay.store import Store


def synthetic_frames(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[:84, :84]
    frames = np.zeros((n, 84, 84), np.uint8)
    pos = rng.uniform(10, 74, (3, 2))
    vel = rng.uniform(-1.5, 1.5, (3, 2))
    for t in range(n):
        pos = np.clip(pos + vel, 5, 79)
        for (py, px), v in zip(pos, (90, 160, 230)):
            frames[t][(yy - py) ** 2 + (xx - px) ** 2 < 16] = v
    return frames


def run(n: int = 20_000, batch_sizes=(32, 256), seconds: float = 2.0) -> dict:
    frames = synthetic_frames(n + 1)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-")
    path = os.path.join(root, "store")
    try:
        store = Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(4), capacity=n,
                             frame_stack=4, reward_values=(-1, 0, 1))
        t0 = time.perf_counter()
        for i in range(n):
            store.add(frames[i], i % 4, 0, frames[i + 1], (i + 1) % 1000 == 0, False)
        store.close()
        add_rate = n / (time.perf_counter() - t0)
        disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
        print(f"add: {add_rate:,.0f} transitions/s, {disk / n:.0f} bytes/transition on disk")
        result = {"add_per_s": add_rate, "disk_bytes_per_transition": disk / n}
        with Store.open(path, mode="r", cache_bytes=n * 84 * 84 * 2) as store:
            for b in batch_sizes:
                with store.sampler(b, seed=0) as sampler:
                    for _ in range(20):
                        next(sampler)
                    count, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        next(sampler)
                        count += 1
                rate = count / (time.perf_counter() - t0)
                print(f"sample: batch {b}: {rate:,.0f} batches/s (stack 4, obs + next_obs, warm cache)")
                result[f"batch{b}_per_s"] = rate
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)
