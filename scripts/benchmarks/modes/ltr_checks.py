"""What both larger-than-RAM modes measure a store with: a rate per second, sampled rows against the real
Atari frames they came from, and a warm-up until the decoded cache's hit rate is stable.

Invariant: imports no mode, so ``larger_than_ram`` and ``ltr_big`` both build on it without importing each other.
"""
from __future__ import annotations

import time

import numpy as np

from ..sources import AtariSource


def per_second(fn, seconds: float) -> list[float]:
    """Calls of ``fn`` in each second of the next ``seconds`` (the last one partial, scaled)."""
    rates, t0 = [], time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        w0, k = time.perf_counter(), 0
        while time.perf_counter() - w0 < 1.0 and time.perf_counter() - t0 < seconds:
            fn()
            k += 1
        rates.append(k / (time.perf_counter() - w0))
    return rates


def ground_truth(src: AtariSource, g: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    rows = [src.get(int(i), int(i) + 1, stacks=True) for i in g]
    return np.concatenate([r["obs"] for r in rows]), np.concatenate([r["next_obs"] for r in rows])


def verify_batches(store, n_batches: int, batch: int = 256) -> dict:
    """Sampled transitions (obs and next_obs stacks) against the real frames they were made from."""
    src, wrong, checked = AtariSource(), 0, 0
    smp = store.sampler(batch, seed=777, name="verify")
    for _ in range(n_batches):
        b = next(smp)
        g = b.indices.numpy()
        exp_o, exp_n = ground_truth(src, g)
        ok = np.all((b.obs.numpy() == exp_o).reshape(len(g), -1), axis=1) & \
            np.all((b.next_obs.numpy() == exp_n).reshape(len(g), -1), axis=1)
        wrong += int((~ok).sum())
        checked += len(g)
    smp.close()
    return {"verified": checked, "wrong": wrong}


def warm_up(store, smp, window_s: float, max_s: float) -> float:
    """Sample until the decoded cache's hit rate is stable (two windows within half a point); returns it."""
    t0, prev, stable, rate = time.perf_counter(), None, 0, 0.0
    while time.perf_counter() - t0 < max_s and stable < 2:
        st0 = store.inspect.cache_stats()["obs"]
        t_end = time.perf_counter() + window_s
        while time.perf_counter() < t_end:
            next(smp)
        st1 = store.inspect.cache_stats()["obs"]
        looked = (st1["hits"] - st0["hits"]) + (st1["misses"] - st0["misses"])
        rate = (st1["hits"] - st0["hits"]) / looked if looked else 1.0
        stable = stable + 1 if prev is not None and abs(rate - prev) < 0.005 else 0
        prev = rate
    return rate
