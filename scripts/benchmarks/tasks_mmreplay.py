"""Child tasks on mmreplay stores: fill a store (``add`` for one Atari env, ``extend`` otherwise), and
sample one opened fresh from disk (a cold first pass, warm windows, a check against the inputs).

Invariant: a sampling child opens the store itself (after dropping the page cache when allowed), so
"cold" is a freshly opened store and an empty decoded-frame cache; the sampled transitions are compared
with the inputs (``verify_fraction_ok``), so a fast wrong answer never counts.
"""
from __future__ import annotations

import math
import os
import shutil
import time

import numpy as np

from .cgroup import read_cgroup_stats
from .measure import child_setup, cur_rss_bytes, dir_bytes, drop_caches, io_read_bytes, log, peak_rss_bytes, rate_windows, time_adds
from .sources import ATARI_ACTIONS, AtariSource, atari_chunks


def mm_spaces(wl: str):
    from gymnasium import spaces
    if wl == "lowdim":
        return spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2), 1, None
    return spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(ATARI_ACTIONS), 4, (-1, 0, 1)


def task_mm_fill(spec: dict) -> dict:
    """Create an mmreplay store and fill it (add for n_envs=1 Atari, extend otherwise)."""
    tuned, threads = child_setup()
    import mmreplay
    n, E, wl, path = spec["n"], spec["n_envs"], spec["workload"], spec["path"]
    if os.path.exists(path):
        shutil.rmtree(path)
    obs_space, act_space, stack, rv = mm_spaces(wl)
    if wl == "lowdim":
        data = np.load(spec["data"])
        chunks = ((data["action"].shape[0], {k: data[k] for k in data.files}),)
    else:
        chunks = atari_chunks(AtariSource(), n, E, stacks=False)
    rss0 = cur_rss_bytes()
    t0 = time.perf_counter()
    codec = {"frame_codec": spec["frame_codec"]} if spec.get("frame_codec") else {}  # else the library's default
    s = mmreplay.Store.create(path, obs_space, act_space, capacity=n, frame_stack=stack, reward_values=rv, **codec)
    t_add = time.perf_counter() - t0
    added = 0
    last_log = time.perf_counter()
    for steps, d in chunks:
        if E == 1 and wl != "lowdim":  # single adds, values as an env step gives them (python scalars)
            o, no = d["obs"][:, 0], d["next_obs"][:, 0]
            a, r = d["action"][:, 0].tolist(), d["reward"][:, 0].tolist()
            te, tr = d["terminated"][:, 0].tolist(), d["truncated"][:, 0].tolist()
            t_add += time_adds(s.add, (o, a, r, no, te, tr), steps)
        else:
            o, a, r, no, te, tr = (d[k] for k in ("obs", "action", "reward", "next_obs", "terminated",
                                                  "truncated"))
            t_add += time_adds(s.extend, (o, a, r, no, te, tr), steps)
        added += steps * E
        del d, o, no
        if time.perf_counter() - last_log > 30:
            last_log = time.perf_counter()
            log(f"  [mmreplay fill] {added}/{n} transitions, {added / t_add:,.0f}/s")
    t0 = time.perf_counter()
    s.close()
    t_close = time.perf_counter() - t0
    t_add += t_close
    rss_filled = cur_rss_bytes()
    s = mmreplay.Store.open(path, mode="r")
    stored = len(s)
    s.close()
    disk = dir_bytes(path)
    return {"stored": stored, "added": added, "add_per_s": added / t_add, "add_s": t_add, "close_s": t_close,
            "disk_bytes": disk, "store_bytes": disk, "rss_fill_growth": max(0, rss_filled - rss0),
            "peak_rss": peak_rss_bytes(), "malloc_tuned": tuned, "torch_threads": threads}


def cache_totals(store) -> tuple[int, int, int]:
    st = store.inspect.cache_stats()
    return (sum(v["hits"] for v in st.values()), sum(v["misses"] for v in st.values()),
            sum(v["bytes"] for v in st.values()))


def hit_rate(h0, m0, h1, m1):
    d = (h1 - h0) + (m1 - m0)
    return (h1 - h0) / d if d else 1.0


def warm_up(smp, store, window_s: float, min_s: float, max_s: float) -> float:
    """Sample in windows of ``window_s`` until the cache hit rate is stable (three windows within 0.5 points
    of each other) and ``min_s`` has passed, or ``max_s`` has; returns the last window's hit rate."""
    t_start = time.perf_counter()
    prev, stable = None, 0
    while True:
        h0, m0, _ = cache_totals(store)
        t_end = time.perf_counter() + window_s
        next(smp)
        while time.perf_counter() < t_end:
            next(smp)
        h1, m1, _ = cache_totals(store)
        hr = hit_rate(h0, m0, h1, m1)
        stable = stable + 1 if prev is not None and abs(hr - prev) < 0.005 else 0
        prev = hr
        el = time.perf_counter() - t_start
        if (stable >= 2 and el >= min_s) or el >= max_s:
            return hr


def _verify_mm(store, spec) -> dict:
    """Check sampled transitions against the input data (catches wrong frames / stacks)."""
    b = store.sample(256, seed=12345)
    g = b.indices.numpy()
    ok_overlap = bool((b.next_obs[:, :-1] == b.obs[:, 1:]).all()) if b.obs.ndim > 2 else True
    wl, E, n = spec["workload"], spec["n_envs"], spec["n"]
    S = n // E
    step, k = g // E, g % E          # extend rows go in order: global id = step * E + stream
    if wl == "lowdim":
        d = np.load(spec["data"])
        exp_o, exp_n = d["obs"][step, k], d["next_obs"][step, k]
        exp_a, exp_r = d["action"][step, k], d["reward"][step, k]
        exp_te = d["terminated"][step, k]
        got_o, got_n = b.obs.numpy(), b.next_obs.numpy()
    else:
        src = AtariSource()
        rows = [src.get(int(kk * S + st), int(kk * S + st) + 1, stacks=True) for st, kk in zip(step, k)]
        exp = {key: np.concatenate([r[key] for r in rows]) for key in rows[0]}
        exp_a, exp_r, exp_te = exp["action"], exp["reward"], exp["terminated"]
        if E == 1:   # full stacks comparable (with E > 1 a stream's first stack is padded by mmreplay)
            exp_o, exp_n = exp["obs"], exp["next_obs"]
            got_o, got_n = b.obs.numpy(), b.next_obs.numpy()
        else:
            exp_o, exp_n = exp["obs"][:, -1], exp["next_obs"][:, -1]
            got_o, got_n = b.obs[:, -1].numpy(), b.next_obs[:, -1].numpy()
    same = (np.all((got_o == exp_o).reshape(len(g), -1), axis=1) & np.all((got_n == exp_n).reshape(len(g), -1), axis=1)
            & (b.action.numpy() == exp_a) & (b.reward.numpy() == exp_r) & (b.terminated.numpy() == exp_te))
    return {"verify_fraction_ok": float(same.mean()), "stack_overlap_ok": ok_overlap}


def task_mm_sample(spec: dict) -> dict:
    """Open an mmreplay store fresh (page cache dropped) and sample: a cold first pass and/or warm windows."""
    tuned, threads = child_setup()
    import torch  # noqa: F401

    import mmreplay
    res = {"malloc_tuned": tuned, "torch_threads": threads, "cache_bytes": spec["cache_bytes"]}
    if spec.get("drop_caches", True):
        res["page_cache_dropped"] = drop_caches()
    io0 = io_read_bytes()
    t0 = time.perf_counter()
    s = mmreplay.Store.open(spec["path"], mode="r", cache_bytes=spec["cache_bytes"])
    res["open_s"] = time.perf_counter() - t0
    res["stored"] = n = len(s)
    prof = None
    cold_B = spec.get("cold_batch")
    smp = None
    if cold_B:
        smp = s.sampler(cold_B, prefetch=0, seed=1)
        want = math.ceil(n / cold_B)
        h0, m0, _ = cache_totals(s)
        t0 = time.perf_counter()
        first = None
        k = 0
        while k < want:
            next(smp)
            k += 1
            if first is None:
                first = time.perf_counter() - t0
            if k % 64 == 0 and time.perf_counter() - t0 > spec["cold_max_s"]:
                break
        dt = time.perf_counter() - t0
        h1, m1, _ = cache_totals(s)
        res.update({f"cold_b{cold_B}_per_s": k / dt, f"cold_b{cold_B}_batches": k, f"cold_b{cold_B}_s": dt,
                    f"cold_b{cold_B}_first_batch_s": first, f"cold_b{cold_B}_hit_rate": hit_rate(h0, m0, h1, m1),
                    f"cold_b{cold_B}_full_pass": k >= want})
        io1 = io_read_bytes()
        if io0 is not None:
            res["cold_disk_read_bytes"] = io1 - io0
    if spec.get("warm"):
        Bw = max(spec["batch_sizes"])
        if smp is None or smp.batch_size != Bw:
            smp = s.sampler(Bw, prefetch=0, seed=2)
        t_start = time.perf_counter()
        hr = warm_up(smp, s, spec["window_s"], spec["warmup_s"], spec["warm_max_s"])
        res["warmup_s"] = time.perf_counter() - t_start
        res["warmup_end_hit_rate"] = hr
        io_w0 = io_read_bytes()
        for B in sorted(spec["batch_sizes"], reverse=True):
            if smp.batch_size != B:
                smp = s.sampler(B, prefetch=0, seed=3)
            h0, m0, _ = cache_totals(s)
            it = smp.__next__
            prof = None
            if spec.get("profile"):
                from pyinstrument import Profiler
                prof = Profiler(interval=0.0005)
                prof.start()
            rates = rate_windows(it, spec["windows"], spec["window_s"], min(spec["warmup_s"], 1.0))
            if prof is not None:
                prof.stop()
                with open(spec["profile"] + f"_b{B}.txt", "w") as f:
                    f.write(prof.output_text(unicode=False, color=False))
            h1, m1, _ = cache_totals(s)
            res[f"b{B}_per_s"] = float(np.median(rates))
            res[f"b{B}_windows"] = rates
            res[f"b{B}_hit_rate"] = hit_rate(h0, m0, h1, m1)
        io_w1 = io_read_bytes()
        if io_w0 is not None:
            res["warm_disk_read_bytes"] = io_w1 - io_w0
        res["cache_held_bytes"] = cache_totals(s)[2]
    if spec.get("verify"):
        res.update(_verify_mm(s, spec))
    res["peak_rss"] = peak_rss_bytes()
    res["rss_end"] = cur_rss_bytes()
    cg = spec.get("cgroup_dir")
    if cg:
        res["cgroup"] = read_cgroup_stats(cg)
    s.close()
    return res
