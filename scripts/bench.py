#!/usr/bin/env python
"""mmreplay against peer replay buffers, in one run, on the same inputs.

    python scripts/bench.py --quick                 # ~1 min smoke test (tiny N, few windows)
    python scripts/bench.py                         # Atari 100k (+ 8-stream run) and low-dim 1M, ~20 min
    python scripts/bench.py --atari-n 1000000       # Atari 1M (peers that cannot fit are skipped)
    python scripts/bench.py --cgroup                # only the "larger than RAM" test (1M Atari store)
    python scripts/bench.py --json out.json         # also dump every figure

Workloads
---------
``atari``     real preprocessed Atari frames (``scripts/atari_frames.py`` pool: Pong, Breakout, Seaquest,
              uniform-random play; tiled beyond the 100k pool), frame stack 4, capacity = N, n_envs = 1.
              mmreplay gets single 84x84 frames through ``Store.add``; the peers get 4x84x84 stacks
              (what ``FrameStackObservation`` hands them) through ``add_batch``.
``atari_x8``  the same N transitions as 8 streams (stream k = the k-th contiguous eighth of the data, so
              its episodes continue): mmreplay ``Store.extend`` with 8 rows, peers ``n_envs=8``.
``lowdim``    CartPole-v1 (4 float32 obs, 2 actions, uniform-random play, 8 envs), 1M transitions, added 8
              at a time (mmreplay ``extend`` with 8 streams, peers ``n_envs=8``).
``cgroup``    (``--cgroup``) a 1M-transition Atari store on disk, sampled by a child in a memory cgroup
              smaller than the uncompressed buffer, against the same child unconstrained.

Method
------
Every system runs in a FRESH child process (``peers.tune_malloc()`` in each, torch threads left at their
default), so its peak RSS (``ru_maxrss``) is that system alone.  Input preparation (reading frames from
the pool, building stacks) is done per chunk of ~512 transitions and is not timed; only the add calls are.

* add/s:  transitions per second while filling the empty buffer (mmreplay: including the final
  ``close()``, which commits and fsyncs; the store is ``durable=True``, the default).
* b32/s, b256/s:  batches per second, the MEDIAN of ``--windows`` timed windows of ``--window-s``
  seconds each, after a warm-up.  A batch has obs and next_obs (B,4,84,84) uint8 torch tensors (or
  (B,4) float32), action, reward, done/terminated.
* mmreplay is sampled from a store opened FRESH from disk in a new child (the page cache dropped first,
  ``echo 3 > /proc/sys/vm/drop_caches``, when we may): "cold" = batches/s over the first pass
  (ceil(N/B) batches, capped at ``--cold-max-s``) with an empty decoded-frame cache; "warm" = the steady
  rate after a warm-up that runs until the cache hit rate is stable.  The cache budget is printed.
* peak RSS: ``ru_maxrss`` of the child (for mmreplay the max over its fill child and sampling children).
* store B/tr: bytes the buffer's storage takes per stored transition: the store directory on disk
  (mmreplay), the memmap scratch directory (TorchRL), the RSS growth over the fill (in-RAM peers).

The machine is shared and noisy: rates are medians of several windows, and ratios within one run are
more meaningful than absolute figures.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
import traceback

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.insert(0, _p)

if os.environ.get("MMREPLAY_BENCH_SRC"):  # --mmreplay-rev: benchmark a snapshot, not the working tree
    sys.path.insert(0, os.environ["MMREPLAY_BENCH_SRC"])

PEERS = ("numpy", "sb3", "cpprb", "torchrl")
PER_SYSTEMS = ("mmreplay", "cpprb_per", "torchrl_per")
SYSTEMS = ("mmreplay",) + PEERS
WORKLOADS = ("atari", "atari_x8", "lowdim")
MiB = 1 << 20
FRAME_BYTES = 84 * 84
ATARI_ACTIONS = 18  # the pool mixes Pong (6), Breakout (4) and Seaquest (18)
DEFAULT_WORKDIR = "/tmp/mmreplay_bench"


# ==========================================================================================
# small helpers (parent and children)
# ==========================================================================================
def peak_rss_bytes() -> int:
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def cur_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def io_read_bytes() -> int | None:
    """Bytes this process made the kernel read from block devices (page-cache misses)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dir_bytes(path: str) -> int:
    """Allocated bytes (st_blocks) of every file under ``path``."""
    tot = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                tot += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return tot


def drop_caches() -> bool:
    """sync + drop the page cache (root only). Returns whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rate_windows(fn, n_windows: int, window_s: float, warmup_s: float) -> list[float]:
    """Calls/s of ``fn`` in ``n_windows`` windows of >= ``window_s`` seconds after ``warmup_s`` of calls."""
    t_end = time.perf_counter() + warmup_s
    fn()
    while time.perf_counter() < t_end:
        fn()
    rates = []
    for _ in range(n_windows):
        k, t0 = 0, time.perf_counter()
        while True:
            fn()
            k += 1
            dt = time.perf_counter() - t0
            if dt >= window_s:
                break
        rates.append(k / dt)
    return rates


class CpuMeter:
    """How many cores OTHER processes kept busy while we ran (from /proc/stat minus our own CPU time):
    the noise indicator printed next to each result (the machine is shared)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> int:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # not idle, not iowait
        except (OSError, ValueError, IndexError):
            return 0

    @staticmethod
    def _own() -> int:
        try:
            with open("/proc/self/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            return int(v[11]) + int(v[12])  # utime + stime, all threads
        except (OSError, ValueError, IndexError):
            return 0

    def result(self) -> dict:
        wall = time.perf_counter() - self.t0
        tck = os.sysconf("SC_CLK_TCK")
        own = (self._own() - self.own0) / tck
        others = max(0.0, (self._busy() - self.busy0) / tck - own)
        return {"own_cpu_cores": own / wall if wall else 0.0, "other_cpu_cores": others / wall if wall else 0.0,
                "loadavg_end": os.getloadavg()[0]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


# ==========================================================================================
# inputs
# ==========================================================================================
class AtariSource:
    """The real-frame pool, read WITHOUT mmap (pread into small anonymous buffers), so that feeding a
    system does not add the pool's file pages to its RSS.  Dataset transition ``i`` is pool transition
    ``i % pool_size`` (the pool's episodes tiled, as ``atari_frames`` does for n > pool_size)."""

    def __init__(self):
        import atari_frames
        pool = atari_frames.load_atari_pool(verbose=True)
        self.P = len(pool["action"])
        self.oi = np.array(pool["obs_index"], np.int64)
        self.ni = np.array(pool["next_obs_index"], np.int64)
        self.action = np.array(pool["action"], np.int64)
        self.reward = np.sign(np.array(pool["reward"], np.float32)).astype(np.float32)
        self.term = np.array(pool["terminated"], bool)
        self.trunc = np.array(pool["truncated"], bool)
        starts = np.array(pool["episode_start"], np.int64)
        self.ep_start = starts[np.searchsorted(starts, np.arange(self.P), side="right") - 1]
        del pool
        path = os.path.join(atari_frames.DEFAULT_CACHE_DIR, "frames.npy")
        with open(path, "rb") as f:
            version = np.lib.format.read_magic(f)
            if version == (1, 0):
                np.lib.format.read_array_header_1_0(f)
            else:
                np.lib.format.read_array_header_2_0(f)
            self.offset = f.tell()
        self.fd = os.open(path, os.O_RDONLY)

    def read_frames(self, lo: int, hi: int) -> np.ndarray:
        out = np.empty((hi - lo, 84, 84), np.uint8)
        mv = memoryview(out).cast("B")
        pos, off = 0, self.offset + lo * FRAME_BYTES
        while pos < len(mv):
            k = os.preadv(self.fd, [mv[pos:]], off + pos)
            if k <= 0:
                raise OSError("short read from the Atari pool")
            pos += k
        return out

    def get(self, a: int, b: int, stacks: bool) -> dict:
        """Dataset transitions [a, b): single frames (``stacks=False``: obs/next_obs (n,84,84)) or
        FrameStack stacks (n,4,84,84), oldest first, episode starts padded with the first frame."""
        parts = []
        while a < b:
            p0 = a % self.P
            take = min(b - a, self.P - p0)
            parts.append(self._piece(p0, p0 + take, stacks))
            a += take
        return {k: np.concatenate([p[k] for p in parts]) if len(parts) > 1 else parts[0][k] for k in parts[0]}

    def _piece(self, p0, p1, stacks):
        ids = np.arange(p0, p1)
        ni = self.ni[ids]
        if stacks:
            tt = np.maximum(self.ep_start[ids][:, None], ids[:, None] + np.arange(-3, 1))
            so = self.oi[tt]
            sn = np.concatenate([so[:, 1:], ni[:, None]], axis=1)
        else:
            so, sn = self.oi[ids], ni
        lo, hi = int(min(so.min(), sn.min())), int(max(so.max(), sn.max())) + 1
        buf = self.read_frames(lo, hi)
        return {"obs": buf[so - lo], "next_obs": buf[sn - lo], "action": self.action[ids],
                "reward": self.reward[ids], "terminated": self.term[ids], "truncated": self.trunc[ids]}


def atari_chunks(src: AtariSource, n: int, n_envs: int, stacks: bool, chunk_transitions: int = 512):
    """Yield (steps, dict of arrays shaped (steps, n_envs, ...)); stream k holds dataset transitions
    [k*S, (k+1)*S) with S = n // n_envs, so each stream's episodes continue."""
    S = n // n_envs
    cs = max(1, chunk_transitions // n_envs)
    for u in range(0, S, cs):
        v = min(S, u + cs)
        parts = [src.get(k * S + u, k * S + v, stacks) for k in range(n_envs)]
        yield v - u, {key: np.stack([p[key] for p in parts], axis=1) for key in parts[0]}


def lowdim_path(workdir: str, n: int, n_envs: int) -> str:
    return os.path.join(workdir, f"cartpole_{n}_{n_envs}.npz")


def make_lowdim_data(workdir: str, n: int, n_envs: int, seed: int = 0) -> str:
    """CartPole-v1 transitions from uniform-random play, ``n_envs`` independent envs stepped in
    lockstep (cached).  Arrays shaped (steps, n_envs, ...); next_obs is the real final obs at episode
    ends (the next step starts from the reset obs)."""
    path = lowdim_path(workdir, n, n_envs)
    if os.path.exists(path):
        return path
    import gymnasium as gym
    steps = n // n_envs
    t0 = time.perf_counter()
    rng = np.random.default_rng(seed)
    act = rng.integers(0, 2, (steps, n_envs)).astype(np.int64)
    obs = np.empty((steps, n_envs, 4), np.float32)
    nxt = np.empty_like(obs)
    rew = np.empty((steps, n_envs), np.float32)
    term = np.zeros((steps, n_envs), bool)
    trunc = np.zeros((steps, n_envs), bool)
    for e in range(n_envs):
        env = gym.make("CartPole-v1")
        o, _ = env.reset(seed=seed + e)
        for t in range(steps):
            o2, r, te, tr, _ = env.step(int(act[t, e]))
            obs[t, e], nxt[t, e], rew[t, e], term[t, e], trunc[t, e] = o, o2, r, te, tr and not te
            o = env.reset()[0] if (te or tr) else o2
        env.close()
    os.makedirs(workdir, exist_ok=True)
    tmp = path + ".tmp.npz"
    np.savez(tmp, obs=obs, next_obs=nxt, action=act, reward=rew, terminated=term, truncated=trunc)
    os.replace(tmp, path)
    log(f"[bench] generated {steps * n_envs} CartPole transitions in {time.perf_counter() - t0:.1f}s -> {path}")
    return path


# ==========================================================================================
# children
# ==========================================================================================
def _child_setup():
    import peers
    tuned = peers.tune_malloc()
    import torch
    return tuned, torch.get_num_threads()


def task_peer(spec: dict) -> dict:
    """Fill one peer buffer and sample from it (all in this process)."""
    import peers
    rb, res, scratch, S = _peer_fill(spec)
    for B in spec["batch_sizes"]:
        rates = rate_windows(lambda B=B: rb.sample(B), spec["windows"], spec["window_s"], spec["warmup_s"])
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
    res["stack_err"] = peers.check_peer(rb, S) if S > 1 else 0.0
    res["peak_rss"] = peak_rss_bytes()
    rb.close()
    if scratch:
        shutil.rmtree(scratch, ignore_errors=True)
    return res


def _peer_fill(spec: dict):
    """Build peer ``spec["system"]`` and add the workload's transitions: (buffer, figures, scratch dir,
    frame stack)."""
    tuned, threads = _child_setup()
    import logging

    import peers
    kind, n, E, wl = spec["system"], spec["n"], spec["n_envs"], spec["workload"]
    torchrl_kind = kind in ("torchrl", "torchrl_per")
    scratch = None
    if torchrl_kind:
        import torchrl  # noqa: F401
        logging.getLogger("torchrl").setLevel(logging.WARNING)
        scratch = tempfile.mkdtemp(prefix="torchrl_", dir=spec["workdir"])
    # import the peer's library and load the inputs first: RSS growth from here on is the buffer
    __import__({"sb3": "stable_baselines3.common.buffers", "cpprb": "cpprb", "numpy": "numpy",
                "torchrl": "torchrl.data", "cpprb_per": "cpprb", "torchrl_per": "torchrl.data"}[kind])
    if wl == "lowdim":
        data = np.load(spec["data"])
        steps = data["action"].shape[0]
        chunks = ((steps, {k: data[k] for k in data.files}),)
        S = 1
    else:
        src = AtariSource()
        chunks = atari_chunks(src, n, E, stacks=True)
        S = 4
    rss0 = cur_rss_bytes()
    if wl == "lowdim":
        rb = peers.make_lowdim(kind, n, n_envs=E, scratch_dir=scratch)
    else:
        rb = peers.make(kind, n, (84, 84), np.uint8, E, 4, n_actions=ATARI_ACTIONS, scratch_dir=scratch)
    rss_made = cur_rss_bytes()
    t_add = 0.0
    added = 0
    for steps, d in chunks:
        o, a, r, no, te, tr = (d[k] for k in ("obs", "action", "reward", "next_obs", "terminated", "truncated"))
        add = rb.add_batch
        t0 = time.perf_counter()
        for i in range(steps):
            add(o[i], a[i], r[i], no[i], te[i], tr[i])
        t_add += time.perf_counter() - t0
        added += steps * E
        del d, o, no
    rss_filled = cur_rss_bytes()
    res = {"stored": len(rb), "added": added, "add_per_s": added / t_add, "add_s": t_add,
           "malloc_tuned": tuned, "torch_threads": threads}
    if torchrl_kind:
        res["disk_bytes"] = rb.disk_bytes()
        res["store_bytes"] = res["disk_bytes"]
    else:
        res["store_bytes"] = max(0, rss_filled - rss0)
    res["rss_fill_growth"] = max(0, rss_filled - rss0)
    res["rss_create_growth"] = max(0, rss_made - rss0)
    return rb, res, scratch, S


def task_per(spec: dict) -> dict:
    """Prioritized replay, one system: fill, then time the learner's step, ``sample(B)`` (with IS
    weights, beta 0.4) + ``update_priorities(indices, new priorities)``, for each batch size."""
    rng = np.random.default_rng(0)
    if spec["system"] == "mmreplay":
        import mmreplay
        res = task_mm_fill(spec)
        store = mmreplay.Store.open(spec["path"], mode="r", cache_bytes=spec["cache_bytes"])
        close = store.close
        samplers = {B: store.sampler(B, prioritized=True, alpha=0.6, beta=0.4, seed=B, prefetch=0, name=f"b{B}")
                    for B in spec["batch_sizes"]}

        def step(B):
            smp = samplers[B]
            batch = next(smp)
            smp.update_priorities(batch.indices, rng.random(B) + 1e-3)
    else:
        rb, res, scratch, _ = _peer_fill(spec)

        def step(B):
            batch = rb.sample(B, beta=0.4)
            rb.update_priorities(batch["indices"], rng.random(B) + 1e-3)

        def close():
            rb.close()
            if scratch:
                shutil.rmtree(scratch, ignore_errors=True)
    for B in spec["batch_sizes"]:
        rates = rate_windows(lambda B=B: step(B), spec["windows"], spec["window_s"], spec["warmup_s"])
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
    res["peak_rss"] = peak_rss_bytes()
    close()
    return res


def _mm_spaces(wl: str):
    from gymnasium import spaces
    if wl == "lowdim":
        return spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2), 1, None
    return spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(ATARI_ACTIONS), 4, (-1, 0, 1)


def task_mm_fill(spec: dict) -> dict:
    """Create an mmreplay store and fill it (add for n_envs=1 Atari, extend otherwise)."""
    tuned, threads = _child_setup()
    import mmreplay
    n, E, wl, path = spec["n"], spec["n_envs"], spec["workload"], spec["path"]
    if os.path.exists(path):
        shutil.rmtree(path)
    obs_space, act_space, stack, rv = _mm_spaces(wl)
    if wl == "lowdim":
        data = np.load(spec["data"])
        chunks = ((data["action"].shape[0], {k: data[k] for k in data.files}),)
    else:
        chunks = atari_chunks(AtariSource(), n, E, stacks=False)
    rss0 = cur_rss_bytes()
    t0 = time.perf_counter()
    s = mmreplay.Store.create(path, obs_space, act_space, capacity=n, frame_stack=stack, reward_values=rv)
    t_add = time.perf_counter() - t0
    added = 0
    last_log = time.perf_counter()
    for steps, d in chunks:
        if E == 1 and wl != "lowdim":  # single adds, values as an env step gives them (python scalars)
            o, no = d["obs"][:, 0], d["next_obs"][:, 0]
            a, r = d["action"][:, 0].tolist(), d["reward"][:, 0].tolist()
            te, tr = d["terminated"][:, 0].tolist(), d["truncated"][:, 0].tolist()
            add = s.add
            t0 = time.perf_counter()
            for i in range(steps):
                add(o[i], a[i], r[i], no[i], te[i], tr[i])
            t_add += time.perf_counter() - t0
        else:
            o, a, r, no, te, tr = (d[k] for k in ("obs", "action", "reward", "next_obs", "terminated",
                                                  "truncated"))
            ext = s.extend
            t0 = time.perf_counter()
            for i in range(steps):
                ext(o[i], a[i], r[i], no[i], te[i], tr[i])
            t_add += time.perf_counter() - t0
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


def _cache_totals(store) -> tuple[int, int, int]:
    st = store.cache_stats()
    return (sum(v["hits"] for v in st.values()), sum(v["misses"] for v in st.values()),
            sum(v["bytes"] for v in st.values()))


def _hit_rate(h0, m0, h1, m1):
    d = (h1 - h0) + (m1 - m0)
    return (h1 - h0) / d if d else 1.0


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
    tuned, threads = _child_setup()
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
        h0, m0, _ = _cache_totals(s)
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
        h1, m1, _ = _cache_totals(s)
        res.update({f"cold_b{cold_B}_per_s": k / dt, f"cold_b{cold_B}_batches": k, f"cold_b{cold_B}_s": dt,
                    f"cold_b{cold_B}_first_batch_s": first, f"cold_b{cold_B}_hit_rate": _hit_rate(h0, m0, h1, m1),
                    f"cold_b{cold_B}_full_pass": k >= want})
        io1 = io_read_bytes()
        if io0 is not None:
            res["cold_disk_read_bytes"] = io1 - io0
    if spec.get("warm"):
        Bw = max(spec["batch_sizes"])
        if smp is None or smp.batch_size != Bw:
            smp = s.sampler(Bw, prefetch=0, seed=2)
        # warm-up: windows until the cache hit rate is stable (two windows within 0.5 points)
        t_start = time.perf_counter()
        prev, stable, hr = None, 0, None
        while True:
            h0, m0, _ = _cache_totals(s)
            t_end = time.perf_counter() + spec["window_s"]
            next(smp)
            while time.perf_counter() < t_end:
                next(smp)
            h1, m1, _ = _cache_totals(s)
            hr = _hit_rate(h0, m0, h1, m1)
            stable = stable + 1 if prev is not None and abs(hr - prev) < 0.005 else 0
            prev = hr
            el = time.perf_counter() - t_start
            if (stable >= 2 and el >= spec["warmup_s"]) or el >= spec["warm_max_s"]:
                break
        res["warmup_s"] = time.perf_counter() - t_start
        res["warmup_end_hit_rate"] = hr
        io_w0 = io_read_bytes()
        for B in sorted(spec["batch_sizes"], reverse=True):
            if smp.batch_size != B:
                smp = s.sampler(B, prefetch=0, seed=3)
            h0, m0, _ = _cache_totals(s)
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
            h1, m1, _ = _cache_totals(s)
            res[f"b{B}_per_s"] = float(np.median(rates))
            res[f"b{B}_windows"] = rates
            res[f"b{B}_hit_rate"] = _hit_rate(h0, m0, h1, m1)
        io_w1 = io_read_bytes()
        if io_w0 is not None:
            res["warm_disk_read_bytes"] = io_w1 - io_w0
        res["cache_held_bytes"] = _cache_totals(s)[2]
    if spec.get("verify"):
        res.update(_verify_mm(s, spec))
    res["peak_rss"] = peak_rss_bytes()
    res["rss_end"] = cur_rss_bytes()
    cg = spec.get("cgroup_dir")
    if cg:
        res["cgroup"] = read_cgroup_stats(cg)
    s.close()
    return res


TASKS = {"peer": task_peer, "mm_fill": task_mm_fill, "mm_sample": task_mm_sample, "per": task_per}


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        meter = CpuMeter()
        res = TASKS[spec["task"]](spec)
        res.update(meter.result())
        import mmreplay
        res["mmreplay_file"] = mmreplay.__file__
        rc = 0
    except Exception:  # noqa: BLE001  (any failure is reported to the parent)
        res = {"error": traceback.format_exc()}
        log(res["error"])
        rc = 1
    with open(spec["out"], "w") as f:
        json.dump(res, f)
    return rc


# ==========================================================================================
# cgroups
# ==========================================================================================
def _own_cgroup(controller: str | None) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return "/"


def make_memory_cgroup(limit_bytes: int, name: str) -> dict:
    """A memory cgroup below our own one: cgroup v1 (``/sys/fs/cgroup/memory``) or v2 (unified, with the
    memory controller).  Page cache is charged to the cgroup in both.  Returns {dir, procs, version}."""
    limit_bytes = int(limit_bytes)
    v2_root = "/sys/fs/cgroup"
    ctl = os.path.join(v2_root, "cgroup.controllers")
    with open(ctl) if os.path.exists(ctl) else open(os.devnull) as f:
        v2_memory = "memory" in f.read().split()
    if v2_memory:
        d = os.path.join(v2_root, _own_cgroup(None).lstrip("/"), name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "memory.max"), "w") as f:
            f.write(str(limit_bytes))
        try:
            with open(os.path.join(d, "memory.swap.max"), "w") as f:
                f.write("0")
        except OSError:
            pass
        return {"dir": d, "procs": os.path.join(d, "cgroup.procs"), "version": 2}
    v1_root = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1_root):
        d = os.path.join(v1_root, _own_cgroup("memory").lstrip("/"), name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        sw = os.path.join(d, "memory.memsw.limit_in_bytes")
        if os.path.exists(sw):
            try:
                with open(sw, "w") as f:
                    f.write(str(limit_bytes))
            except OSError:
                pass
        return {"dir": d, "procs": os.path.join(d, "cgroup.procs"), "version": 1}
    raise RuntimeError("no memory cgroup controller found (neither cgroup v2 with 'memory' nor v1 "
                       "/sys/fs/cgroup/memory)")


def read_cgroup_stats(d: str) -> dict:
    out = {}
    for key, fn in (("limit", "memory.limit_in_bytes"), ("max_usage", "memory.max_usage_in_bytes"),
                    ("failcnt", "memory.failcnt"), ("limit", "memory.max"), ("max_usage", "memory.peak")):
        p = os.path.join(d, fn)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    out[key] = int(f.read().split()[0])
            except (OSError, ValueError):
                pass
    p = os.path.join(d, "memory.stat")
    if os.path.exists(p):
        with open(p) as f:
            st = dict(line.split() for line in f if len(line.split()) == 2)
        for k in ("cache", "rss", "file", "anon", "pgmajfault", "total_pgmajfault", "workingset_refault",
                  "workingset_refault_file"):
            if k in st:
                out["stat_" + k] = int(st[k])
    p = os.path.join(d, "memory.events")
    if os.path.exists(p):
        with open(p) as f:
            out["events"] = {a: int(b) for a, b in (line.split() for line in f)}
    return out


def remove_cgroup(cg: dict) -> None:
    d = cg["dir"]
    for _ in range(20):
        try:
            if cg["version"] == 1 and os.path.exists(os.path.join(d, "memory.force_empty")):
                try:
                    with open(os.path.join(d, "memory.force_empty"), "w") as f:
                        f.write("0")
                except OSError:
                    pass
            os.rmdir(d)
            return
        except OSError:
            time.sleep(0.25)
    log(f"[bench] could not remove cgroup {d}")


# ==========================================================================================
# parent
# ==========================================================================================
class Runner:
    def __init__(self, args):
        self.args = args
        self.workdir = args.workdir
        os.makedirs(self.workdir, exist_ok=True)

    def child(self, spec: dict, cgroup: dict | None = None, timeout: float = 3600, label: str = "",
              wrap: list[str] | None = None) -> dict:
        fd, out = tempfile.mkstemp(prefix="child_", suffix=".json", dir=self.workdir)
        os.close(fd)
        spec = {**spec, "out": out, "workdir": self.workdir}
        if cgroup:
            spec["cgroup_dir"] = cgroup["dir"]
            for fn in ("memory.max_usage_in_bytes", "memory.failcnt"):  # v1: per-child peak and failures
                try:
                    with open(os.path.join(cgroup["dir"], fn), "w") as f:
                        f.write("0")
                except OSError:
                    pass
        cmd = (wrap or []) + [sys.executable, os.path.abspath(__file__), "--child", json.dumps(spec)]
        if cgroup:  # the shell joins the cgroup, then execs the child: everything it maps is charged there
            cmd = ["sh", "-c", f'echo $$ > {cgroup["procs"]} && exec "$@"', "sh"] + cmd
        quiet = self.wait_quiet(label)
        log(f"[bench] {label} ...")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=timeout, check=False)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {}
        os.remove(out)
        if rc != 0 and "error" not in res:
            res["error"] = f"child exited with {rc} (killed? OOM?)"
        res["child_wall_s"] = wall
        res["other_cpu_before_start"] = quiet
        log(f"[bench] {label} done in {wall:.1f}s" + (f"  ERROR: {res['error'].strip().splitlines()[-1]}"
                                                       if "error" in res else ""))
        return res

    def wait_quiet(self, label: str) -> float | None:
        """Shared machine: before a child starts, wait (at most --quiet-max-wait s) until other processes
        used < --quiet-cores cores over a 2 s probe.  Returns the last probe's figure."""
        a = self.args
        if a.quiet_max_wait <= 0:
            return None
        t_end = time.perf_counter() + a.quiet_max_wait
        waited = False
        while True:
            m = CpuMeter()
            time.sleep(2.0)
            other = m.result()["other_cpu_cores"]
            if other < a.quiet_cores or time.perf_counter() >= t_end:
                if waited:
                    log(f"[bench] {label}: other processes now use {other:.2f} cores"
                        + ("" if other < a.quiet_cores else " (gave up waiting)"))
                return other
            if not waited:
                log(f"[bench] {label}: other processes use {other:.2f} cores; waiting for quiet "
                    f"(< {a.quiet_cores}, at most {a.quiet_max_wait:.0f}s)")
                waited = True

    # -- workloads ---------------------------------------------------------------------------
    def rate_spec(self):
        a = self.args
        return {"windows": a.windows, "window_s": a.window_s, "warmup_s": a.warmup_s, "warm_max_s": a.warm_max_s,
                "cold_max_s": a.cold_max_s}

    def run_workload(self, wl: str) -> dict:
        a = self.args
        if wl == "lowdim":
            n, E = a.lowdim_n, 8
            data = make_lowdim_data(self.workdir, n, E)
            caches = [a.cache_mib[0] * MiB]  # the decoded low-dim store is a few MiB: one budget is enough
        else:
            n, E = a.atari_n, (8 if wl == "atari_x8" else 1)
            data = None
            caches = [m * MiB for m in a.cache_mib]
        n = (n // E) * E
        Bs = list(a.batch_sizes)
        base = {"workload": wl, "n": n, "n_envs": E, "batch_sizes": Bs, "data": data, **self.rate_spec()}
        out = {"n": n, "n_envs": E, "cache_bytes": caches[0], "cache_budgets": caches, "rounds": a.repeats,
               "systems": {}}
        systems = [s for s in a.systems if not (wl == "atari_x8" and s != "mmreplay" and not a.x8_peers)]
        runs: dict[str, list] = {}
        for rnd in range(a.repeats):  # rounds interleave the systems, so a burst of load hits one run only
            for system in systems:
                if system == "mmreplay":
                    for name, r in self.run_mmreplay(wl, base, caches, rnd).items():
                        runs.setdefault(name, []).append(r)
                    continue
                skip = self.peer_skip_reason(system, wl, n)
                if skip:
                    if rnd == 0:
                        log(f"[bench] {wl}/{system}: skipped ({skip})")
                    runs[system] = [{"skipped": skip}]
                    continue
                runs.setdefault(system, []).append(self.child(
                    {**base, "task": "peer", "system": system},
                    label=f"{wl}/{system} fill+sample (round {rnd + 1}/{a.repeats})", timeout=a.child_timeout))
        for name, rs in runs.items():
            out["systems"][name] = aggregate_runs(rs, a.quiet_cores)
        return out

    def run_mmreplay(self, wl: str, base: dict, caches: list[int], rnd: int) -> dict:
        """One fill child, then sampling children (each opens the store fresh): per cache budget a
        'cold first pass of the largest batch + warm windows' child, and (first budget only, not in
        --quick) a cold-first-pass child for each smaller batch size."""
        a = self.args
        tag = f"(round {rnd + 1}/{a.repeats})"
        path = os.path.join(self.workdir, f"store_{wl}_{base['n']}")
        fill = self.child({**base, "task": "mm_fill", "path": path}, label=f"{wl}/mmreplay fill {tag}",
                          timeout=a.child_timeout)
        Bs = sorted(base["batch_sizes"])
        Bmax = Bs[-1]
        out = {}
        if "error" in fill:
            return {"mmreplay": {"error": fill["error"], "fill": fill}}
        for ci, cache in enumerate(caches):
            name = "mmreplay" if ci == 0 else f"mmreplay@{cache // MiB}MiB"
            sample_base = {**base, "task": "mm_sample", "path": path, "cache_bytes": cache,
                           "drop_caches": not a.no_drop_caches}
            res = {"fill": fill}
            children = [fill]
            if ci == 0 and not a.quick:   # cold first pass of each smaller batch size in its own fresh child
                for B in Bs[:-1]:
                    c = self.child({**sample_base, "cold_batch": B, "warm": False},
                                   label=f"{wl}/mmreplay cold b{B}, cache {cache // MiB} MiB {tag}",
                                   timeout=a.child_timeout)
                    res[f"cold_b{B}"] = c
                    children.append(c)
            prof = None
            if a.profile_dir:
                os.makedirs(a.profile_dir, exist_ok=True)
                prof = os.path.join(a.profile_dir, f"{wl}_{name.replace('@', '_')}_r{rnd + 1}")
            w = self.child({**sample_base, "cold_batch": Bmax, "warm": True, "verify": True, "profile": prof},
                           label=f"{wl}/mmreplay cold b{Bmax} + warm, cache {cache // MiB} MiB {tag}",
                           timeout=a.child_timeout)
            res["sample"] = w
            children.append(w)
            errs = [c["error"] for c in children if "error" in c]
            if errs:
                res["error"] = errs[0]
            # flat figures for the tables
            res.update({"stored": w.get("stored", fill.get("stored")), "add_per_s": fill.get("add_per_s"),
                        "disk_bytes": fill.get("disk_bytes"), "store_bytes": fill.get("store_bytes"),
                        "peak_rss": max(c.get("peak_rss", 0) for c in children),
                        "peak_rss_fill": fill.get("peak_rss"),
                        "peak_rss_sample": max(c.get("peak_rss", 0) for c in children[1:]),
                        "cache_bytes": cache, "stack_err": 0.0 if w.get("stack_overlap_ok", True) else 1.0,
                        "verify_fraction_ok": w.get("verify_fraction_ok"),
                        "other_cpu_cores": max((c.get("other_cpu_cores", 0) for c in children), default=None)})
            for B in Bs:
                res[f"b{B}_per_s"] = w.get(f"b{B}_per_s")
                res[f"b{B}_windows"] = w.get(f"b{B}_windows")
                res[f"b{B}_hit_rate"] = w.get(f"b{B}_hit_rate")
                src = w if B == Bmax else res.get(f"cold_b{B}", {})
                res[f"cold_b{B}_per_s"] = src.get(f"cold_b{B}_per_s")
                res[f"cold_b{B}_full_pass"] = src.get(f"cold_b{B}_full_pass")
            out[name] = res
        if not a.keep_stores:
            shutil.rmtree(path, ignore_errors=True)
        return out

    def run_per(self) -> dict:
        """Prioritized replay: for Atari (single env) and low-dim (8 envs), each system in its own child,
        rounds interleaved; the figure is learner steps/s (sample + update_priorities)."""
        a = self.args
        out = {}
        for wl in ("atari", "lowdim"):
            if wl == "lowdim":
                n, E, data = a.lowdim_n, 8, make_lowdim_data(self.workdir, a.lowdim_n, 8)
            else:
                n, E, data = a.atari_n, 1, None
            n = (n // E) * E
            base = {"task": "per", "workload": wl, "n": n, "n_envs": E, "batch_sizes": list(a.batch_sizes),
                    "data": data, "path": os.path.join(self.workdir, f"store_per_{wl}_{n}"),
                    "cache_bytes": a.cache_mib[-1] * MiB, **self.rate_spec()}
            runs: dict[str, list] = {}
            for rnd in range(a.repeats):
                for system in PER_SYSTEMS:
                    runs.setdefault(system, []).append(self.child(
                        {**base, "system": system},
                        label=f"per/{wl}/{system} (round {rnd + 1}/{a.repeats})", timeout=a.child_timeout))
            if not a.keep_stores:
                shutil.rmtree(base["path"], ignore_errors=True)
            out[wl] = {"n": n, "n_envs": E, "cache_bytes": base["cache_bytes"],
                       "systems": {k: aggregate_runs(v, a.quiet_cores) for k, v in runs.items()}}
        return out

    def peer_skip_reason(self, system: str, wl: str, n: int) -> str | None:
        """Skip peers that cannot hold ``n`` Atari transitions on this box (e.g. --atari-n 1000000)."""
        if wl == "lowdim":
            return None
        import psutil
        avail = psutil.virtual_memory().available
        disk = shutil.disk_usage(self.workdir).free
        need_ram = {"numpy": 1.15 * n * FRAME_BYTES, "sb3": 4.0 * n * FRAME_BYTES,
                    "cpprb": 2.3 * n * FRAME_BYTES, "torchrl": 0}[system]
        need_disk = 8.0 * n * FRAME_BYTES if system == "torchrl" else 0
        if need_ram > 0.8 * avail:
            return f"needs ~{need_ram / 1e9:.0f} GB RAM, {avail / 1e9:.0f} GB available"
        if need_disk > 0.8 * disk:
            return f"needs ~{need_disk / 1e9:.0f} GB disk, {disk / 1e9:.0f} GB free"
        if system == "torchrl" and n > 300_000:
            return f"its 2 x 4x84x84 memmap is {need_disk / 1e9:.0f} GB of dirty page cache on a {avail / 1e9:.0f} " \
                   "GB box (thrashes; use --atari-n <= 300000)"
        return None

    def run_cgroup(self) -> dict:
        a = self.args
        n = a.cgroup_n
        path = os.path.join(self.workdir, f"store_cgroup_atari_{n}")
        marker = os.path.join(path, ".bench_complete.json")
        base = {"workload": "atari", "n": n, "n_envs": 1, "batch_sizes": list(a.batch_sizes), "data": None,
                **self.rate_spec()}
        out = {"n": n, "limit_bytes": a.cgroup_limit, "cache_bytes": a.cgroup_cache_mib * MiB,
               "uncompressed_frame_bytes": n * FRAME_BYTES, "uncompressed_stacked_bytes": 2 * 4 * n * FRAME_BYTES}
        if os.path.exists(marker) and a.reuse_store:
            with open(marker) as f:
                out["fill"] = json.load(f)
            out["fill"]["reused"] = True
            log(f"[bench] cgroup: reusing the store at {path}")
        else:
            fill = self.child({**base, "task": "mm_fill", "path": path}, label=f"cgroup/mmreplay fill {n}",
                              timeout=max(a.child_timeout, 3600))
            out["fill"] = fill
            if "error" in fill:
                out["error"] = fill["error"]
                return out
            with open(marker, "w") as f:
                json.dump(fill, f)
        out["disk_bytes"] = dir_bytes(path)
        cg = make_memory_cgroup(a.cgroup_limit, f"mmreplay_bench_{os.getpid()}")
        out["cgroup_version"] = cg["version"]
        out["cgroup_dir"] = cg["dir"]
        spec = {**base, "task": "mm_sample", "path": path, "cache_bytes": a.cgroup_cache_mib * MiB,
                "drop_caches": not a.no_drop_caches, "cold_batch": max(a.batch_sizes), "warm": True,
                "verify": True, "cold_max_s": a.cgroup_cold_max_s}
        runs = {"unconstrained": [], "constrained": []}
        try:
            for rep in range(a.cgroup_repeats):
                for mode in ("constrained", "unconstrained"):
                    r = self.child(spec, cgroup=cg if mode == "constrained" else None,
                                   label=f"cgroup/{mode} run {rep + 1}", timeout=a.child_timeout)
                    runs[mode].append(r)
        finally:
            remove_cgroup(cg)
        out["runs"] = runs
        for mode, rs in runs.items():
            if not rs:
                out[mode] = {"error": "not run"}
                continue
            agg = aggregate_runs(rs, a.quiet_cores)
            agg.pop("runs", None)
            cgs = [r["cgroup"] for r in rs if isinstance(r.get("cgroup"), dict)]
            if cgs:
                agg["cgroup"] = {**cgs[-1], "max_usage": max(c.get("max_usage", 0) for c in cgs),
                                 "failcnt": max(c.get("failcnt", 0) for c in cgs)}
            out[mode] = agg
        if not a.keep_stores and not a.keep_cgroup_store:
            shutil.rmtree(path, ignore_errors=True)
        return out


QUIET_CORES = 0.3


def aggregate_runs(runs: list[dict], quiet_cores: float = QUIET_CORES) -> dict:
    """Combine one system's rounds.  Interference on this shared box only ever slows a run down, and can
    make it bimodal (see docs/performance.md: torch's OpenMP copies collapse when another process takes a
    core), so the figures come from the QUIET rounds: those whose children saw other processes use less
    than ``quiet_cores`` cores (if none, the quietest round).  Over those: batch rates = median of all their
    timed windows, other figures = median over rounds, peak RSS = max.  Every round stays under "runs"."""
    ok = [r for r in runs if "error" not in r and "skipped" not in r]
    if not ok:
        return runs[0] if len(runs) == 1 else {**runs[0], "runs": runs}
    if len(runs) == 1:
        return {**runs[0], "rounds_used": [1]}
    noise = [r.get("other_cpu_cores") or 0.0 for r in ok]
    use = [r for r, x in zip(ok, noise) if x < quiet_cores] or [ok[int(np.argmin(noise))]]
    out = {"runs": runs, "rounds_used": [i + 1 for i, r in enumerate(runs) if any(r is u for u in use)]}
    for k in [k for k, v in use[0].items() if not isinstance(v, dict)]:
        vals = [r.get(k) for r in use]
        if k.endswith("_windows"):
            out[k] = [x for v in vals if v for x in v]
        elif all(isinstance(v, bool) for v in vals):
            out[k] = all(vals)
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = max(vals) if k.startswith("peak_rss") or k == "other_cpu_cores" else float(np.median(vals))
        else:
            out[k] = vals[0]
    for k in list(out):
        if k.endswith("_windows") and out[k]:
            out[k[: -len("_windows")] + "_per_s"] = float(np.median(out[k]))
    out["peak_rss"] = max(r.get("peak_rss", 0) for r in ok)  # memory is not noise: the max over every round
    if any("error" in r for r in runs):
        out["error_rounds"] = [r["error"] for r in runs if "error" in r]
    return out


def rounds_table(results: dict, Bs, md=False) -> str:
    """Every round of every system: the raw material behind the quiet-round selection."""
    T = md_table if md else table
    rows = []
    for wl, W in results.get("workloads", {}).items():
        for name, r in W["systems"].items():
            for i, x in enumerate(r.get("runs", [r])):
                if "skipped" in x:
                    continue
                rows.append([wl, name, i + 1, "yes" if i + 1 in r.get("rounds_used", [i + 1]) else "no",
                             f"{x.get('other_cpu_cores', 0):.2f}"]
                            + [_f(x.get(f"b{B}_per_s")) for B in sorted(Bs)] + [_f(x.get("add_per_s"))])
    return T(["workload", "system", "round", "used", "other CPU"] + [f"b{B}/s" for B in sorted(Bs)] + ["add/s"],
             rows)


# ==========================================================================================
# reporting
# ==========================================================================================
def _f(v, kind="rate"):
    if v is None:
        return "-"
    if kind == "rate":
        return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"
    if kind == "mib":
        return f"{v / MiB:,.0f}"
    if kind == "bpt":
        return f"{v:,.0f}" if v >= 100 else f"{v:,.1f}"
    if kind == "x":
        return f"{v:.2f}x"
    if kind == "pct":
        return f"{100 * v:.1f}%"
    return str(v)


def table(headers, rows) -> str:
    w = [max(len(str(h)), *(len(str(r[i])) for r in rows)) for i, h in enumerate(headers)]
    lines = [" | ".join(str(h).rjust(w[i]) for i, h in enumerate(headers)),
             "-|-".join("-" * x for x in w)]
    lines += [" | ".join(str(c).rjust(w[i]) for i, c in enumerate(r)) for r in rows]
    return "\n".join(lines)


def md_table(headers, rows) -> str:
    lines = ["| " + " | ".join(str(h) for h in headers) + " |",
             "|" + "|".join("---:" if i else "---" for i in range(len(headers))) + "|"]
    lines += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(lines)


def workload_tables(name: str, wl: dict, Bs, md=False) -> str:
    T = md_table if md else table
    sysd = wl["systems"]
    n = wl["n"]
    Bs = sorted(Bs)
    headers = ["system", "stored", "add/s"] + [f"b{B}/s" for B in Bs] + [f"b{B}/s cold" for B in Bs] + \
        ["peak RSS MiB", "disk MiB", "store B/tr", "stack_err", "other CPU", "note"]
    rows = []
    for sname, r in sysd.items():
        if "skipped" in r:
            rows.append([sname] + ["-"] * (len(headers) - 2) + [f"skipped: {r['skipped']}"])
            continue
        if "error" in r and r.get("add_per_s") is None:
            rows.append([sname] + ["-"] * (len(headers) - 2) + ["ERROR: " + r["error"].strip().splitlines()[-1]])
            continue
        note = ""
        if sname == "mmreplay":
            hits = ", ".join(f"b{B} hit {_f(r.get(f'b{B}_hit_rate'), 'pct')}" for B in Bs
                             if r.get(f"b{B}_hit_rate") is not None)
            note = f"cache {r['cache_bytes'] / MiB:.0f} MiB; {hits}; verify {_f(r.get('verify_fraction_ok'), 'pct')}"
            part = [f"b{B}" for B in Bs if r.get(f"cold_b{B}_full_pass") is False]
            if part:
                note += f"; cold pass capped ({', '.join(part)})"
        stored = int(r["stored"]) if r.get("stored") is not None else None
        rows.append([sname, f"{stored:,}" if stored is not None else "-", _f(r.get("add_per_s"))]
                    + [_f(r.get(f"b{B}_per_s")) for B in Bs]
                    + [_f(r.get(f"cold_b{B}_per_s")) for B in Bs]
                    + [_f(r.get("peak_rss"), "mib"), _f(r.get("disk_bytes"), "mib") if r.get("disk_bytes") else "-",
                       _f(r["store_bytes"] / max(1, stored or n), "bpt") if r.get("store_bytes") is not None else "-",
                       f"{r.get('stack_err', 0):.3f}",
                       f"{r['other_cpu_cores']:.2f}" if r.get("other_cpu_cores") is not None else "-", note])
    out = [T(headers, rows)]
    out.append("(other CPU = cores kept busy by OTHER processes while the child ran: the noise level; "
               f"this box has {os.cpu_count()} cores)")
    mms = [(k, r) for k, r in sysd.items() if k.startswith("mmreplay") and r.get("add_per_s") is not None]
    peers_ = [(k, r) for k, r in sysd.items() if not k.startswith("mmreplay") and "skipped" not in r
              and r.get("add_per_s") is not None]
    if mms and peers_:
        rh = ["ratio", "add/s"] + [f"b{B}/s" for B in Bs] + [f"b{B}/s cold" for B in Bs] + \
             ["peak RSS", "store B/tr"]

        def ratio(a, b):
            return "-" if not a or not b else _f(a / b, "x")
        rr = []
        for mname, mm in mms:
            for sname, r in peers_:
                rr.append([f"{mname} / {sname}", ratio(mm.get("add_per_s"), r.get("add_per_s"))]
                          + [ratio(mm.get(f"b{B}_per_s"), r.get(f"b{B}_per_s")) for B in Bs]
                          + [ratio(mm.get(f"cold_b{B}_per_s"), r.get(f"b{B}_per_s")) for B in Bs]
                          + [ratio(mm.get("peak_rss"), r.get("peak_rss")),
                             ratio(mm.get("store_bytes"), r.get("store_bytes"))])
        out.append("\n" + T(rh, rr))
        out.append("(rates: > 1x = mmreplay faster; peak RSS and store B/tr: < 1x = mmreplay smaller; 'cold' = "
                   "mmreplay's first pass from a freshly opened store vs the peer's steady rate; mmreplay@X = "
                   "the same store sampled with an X cache budget)")
    return "\n".join(out)


def evaluate_targets(results: dict, args) -> list[dict]:
    t = []
    W = results.get("workloads", {})

    def add(name, value, threshold, unit="x", le=False):
        ok = None if value is None else (value <= threshold if le else value >= threshold)
        t.append({"target": name, "value": value, "threshold": threshold, "unit": unit, "pass": ok})

    at = W.get("atari")
    if at:
        sb3 = at["systems"].get("sb3", {})
        for name, mm in at["systems"].items():
            if not name.startswith("mmreplay"):
                continue
            cb = f"cache {mm.get('cache_bytes', 0) / MiB:.0f} MiB"
            for B in (32, 256):
                a_, b_ = mm.get(f"b{B}_per_s"), sb3.get(f"b{B}_per_s")
                add(f"Atari {at['n']:,}, {cb}: batch-{B} rate >= 1.5x SB3 (warm)",
                    a_ / b_ if a_ and b_ else None, 1.5)
            if mm.get("peak_rss"):
                lim = 400e6 + mm["cache_bytes"]
                add(f"Atari {at['n']:,}, {cb}: peak RSS <= 400 MB + cache = {lim / MiB:,.0f} MiB",
                    mm["peak_rss"] / MiB, lim / MiB, "MiB", le=True)
    ld = W.get("lowdim")
    if ld:
        mm, sb3 = ld["systems"].get("mmreplay", {}), ld["systems"].get("sb3", {})
        a_, b_ = mm.get("b256_per_s"), sb3.get("b256_per_s")
        add(f"Low-dim {ld['n']:,}: batch-256 rate >= 1x SB3 (warm)", a_ / b_ if a_ and b_ else None, 1.0)
    for wl, per in results.get("per", {}).items():
        systems = per["systems"]
        for B in args.batch_sizes:
            mine = systems.get("mmreplay", {}).get(f"b{B}_per_s")
            peer_rates = [systems.get(k, {}).get(f"b{B}_per_s") for k in PER_SYSTEMS[1:]]
            best = max((r for r in peer_rates if r), default=None)
            add(f"PER {wl} {per['n']:,}: batch-{B} steps/s >= 1x the faster peer",
                mine / best if mine and best else None, 1.0)
    cg = results.get("cgroup")
    if cg:
        c, u = cg.get("constrained", {}), cg.get("unconstrained", {})
        for B in sorted(args.batch_sizes, reverse=True):
            a_, b_ = c.get(f"b{B}_per_s"), u.get(f"b{B}_per_s")
            add(f"cgroup {cg['n']:,} ({cg['limit_bytes'] / 1e9:.1f} GB limit): warm batch-{B} >= 80% of "
                f"unconstrained", a_ / b_ if a_ and b_ else None, 0.8)
    return t


def per_table(per: dict, Bs, md=False) -> str:
    systems = per["systems"]
    rows = []
    for name in PER_SYSTEMS:
        r = systems.get(name, {})
        if "error" in r:
            rows.append([name, "error: " + str(r["error"]).strip().splitlines()[-1][:60]] + [""] * (len(Bs) * 2 + 1))
            continue
        row = [name, _f(r.get("add_per_s"))]
        for B in Bs:
            mine, theirs = systems.get("mmreplay", {}).get(f"b{B}_per_s"), r.get(f"b{B}_per_s")
            row += [_f(theirs), f"{mine / theirs:.2f}x" if mine and theirs else "-"]
        row.append(_f(r.get("peak_rss"), "mib"))
        rows.append(row)
    headers = ["system", "add/s"] + [h for B in Bs for h in (f"b{B} steps/s", f"mmreplay / this, b{B}")] + \
        ["peak RSS MiB"]
    return (md_table if md else table)(headers, rows)


def targets_text(targets, md=False) -> str:
    rows = []
    for x in targets:
        v = x["value"]
        vs = "-" if v is None else (f"{v:.2f}x" if x["unit"] == "x" else f"{v:,.0f} {x['unit']}")
        th = f"{'<=' if 'RSS' in x['target'] else '>='} " + (f"{x['threshold']:.2f}x" if x["unit"] == "x"
                                                             else f"{x['threshold']:,.0f} {x['unit']}")
        rows.append([x["target"], vs, th, {True: "PASS", False: "FAIL", None: "n/a"}[x["pass"]]])
    return (md_table if md else table)(["target", "measured", "needed", "result"], rows)


def cgroup_text(cg: dict, md=False) -> str:
    T = md_table if md else table
    if "error" in cg and "constrained" not in cg:
        return f"cgroup test failed: {cg['error']}"
    lines = [f"store: {cg['n']:,} Atari transitions, {cg.get('disk_bytes', 0) / MiB:,.0f} MiB on disk "
             f"(uncompressed: {cg['uncompressed_frame_bytes'] / MiB:,.0f} MiB of distinct frames, "
             f"{cg['uncompressed_stacked_bytes'] / MiB:,.0f} MiB as obs+next_obs stacks); "
             f"fill {_f(cg['fill'].get('add_per_s'))} adds/s"
             + (" (store reused from an earlier run)" if cg["fill"].get("reused") else ""),
             (f"cgroup v{cg.get('cgroup_version')} memory limit {cg['limit_bytes'] / 1e9:.2f} GB "
              f"({cg['limit_bytes'] / MiB:,.0f} MiB), page cache charged to it; decoded-frame cache budget "
              f"{cg['cache_bytes'] / MiB:,.0f} MiB; page cache dropped before each child; "
              f"{len(cg['runs']['constrained'])} run(s) each, medians")]
    Bs = sorted(int(k[1:-6]) for k in cg.get("unconstrained", {}) if k.startswith("b") and k.endswith("_per_s"))
    headers = ["child", "cold b256/s (first pass)"] + [f"warm b{B}/s" for B in Bs] + \
        [f"hit b{B}" for B in Bs] + ["peak RSS MiB", "cgroup max usage MiB", "disk read cold MiB",
                                     "disk read warm MiB", "other CPU"]
    rows = []
    for mode in ("unconstrained", "constrained"):
        r = cg.get(mode, {})
        if "error" in r:
            rows.append([mode, "ERROR: " + str(r["error"]).strip().splitlines()[-1]] + ["-"] * (len(headers) - 2))
            continue
        cs = r.get("cgroup") or {}
        rows.append([mode, _f(r.get("cold_b256_per_s"))] + [_f(r.get(f"b{B}_per_s")) for B in Bs]
                    + [_f(r.get(f"b{B}_hit_rate"), "pct") for B in Bs]
                    + [_f(r.get("peak_rss"), "mib"), _f(cs.get("max_usage"), "mib") if cs else "-",
                       _f(r.get("cold_disk_read_bytes"), "mib"), _f(r.get("warm_disk_read_bytes"), "mib"),
                       f"{r['other_cpu_cores']:.2f}" if r.get("other_cpu_cores") is not None else "-"])
    c, u = cg.get("constrained", {}), cg.get("unconstrained", {})
    ratio_row = ["constrained / unconstrained",
                 _f(c["cold_b256_per_s"] / u["cold_b256_per_s"], "x") if c.get("cold_b256_per_s") and
                 u.get("cold_b256_per_s") else "-"] + \
        [_f(c[f"b{B}_per_s"] / u[f"b{B}_per_s"], "x") if c.get(f"b{B}_per_s") and u.get(f"b{B}_per_s") else "-"
         for B in Bs] + [""] * (len(headers) - 2 - len(Bs))
    rows.append(ratio_row)
    return "\n".join(lines) + "\n" + T(headers, rows)


def report(results: dict, args) -> str:
    Bs = args.batch_sizes
    out = []
    meta = results["meta"]
    out.append(f"mmreplay benchmark  ({meta['host']}; {meta['cpus']} CPUs; torch {meta['torch']} "
               f"({meta['torch_threads']} threads, default); tune_malloc in every child; load avg at start "
               f"{meta['loadavg_start']})")
    g = meta.get("git", {})
    out.append(f"mmreplay: {meta.get('mmreplay_source')} ({meta.get('mmreplay')}); repo HEAD {g.get('head')}"
               + (", mmreplay/ has uncommitted changes" if g.get("dirty_mmreplay") and
                  meta.get("mmreplay_source") == "working tree" else ""))
    out.append(f"rates: median of {args.windows} windows x {args.window_s}s after warm-up per child; "
               f"{args.repeats} interleaved round(s) of fresh children per system, figures from the quiet rounds "
               f"(other processes < {args.quiet_cores} cores; else the quietest round), peak RSS the max over all; "
               "the machine is shared and noisy, so compare ratios within this run rather than absolute numbers")
    titles = {"atari": "Atari (real frames, stack 4, n_envs=1: mmreplay add(), peers add_batch of stacks)",
              "atari_x8": "Atari, 8 streams (mmreplay extend(8 rows), peers n_envs=8)",
              "lowdim": "Low-dim CartPole (4 float32 obs, 2 actions, 8 envs per add)"}
    for name, wl in results.get("workloads", {}).items():
        out.append(f"\n== {titles[name]}: N = {wl['n']:,} transitions, capacity N, mmreplay cache budget "
                   f"{wl['cache_bytes'] / MiB:,.0f} MiB ==")
        out.append(workload_tables(name, wl, Bs))
    if results.get("workloads") and args.repeats > 1:
        out.append("\n== every round (figures above use the 'used' ones) ==")
        out.append(rounds_table(results, Bs))
    for name, per in results.get("per", {}).items():
        out.append(f"\n== prioritized replay, {titles[name].split(':')[0].split(' (')[0]}: N = {per['n']:,}, "
                   f"n_envs = {per['n_envs']}; learner steps/s = sample(B, beta=0.4) + update_priorities(B) ==")
        out.append(per_table(per, Bs))
    if "cgroup" in results:
        out.append("\n== larger than RAM: mmreplay sampler in a memory cgroup ==")
        out.append(cgroup_text(results["cgroup"]))
    out.append("\n== targets ==")
    out.append(targets_text(results["targets"]))
    return "\n".join(out)


# ==========================================================================================
def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny N and short windows (~1 minute smoke test)")
    p.add_argument("--atari-n", type=int, default=None, help="Atari transitions (default 100000; quick 5000)")
    p.add_argument("--lowdim-n", type=int, default=None, help="low-dim transitions (default 1000000; quick 50000)")
    p.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                   help="default: all three (none with --cgroup)")
    p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
    p.add_argument("--no-x8-peers", dest="x8_peers", action="store_false",
                   help="atari_x8: run mmreplay only (default: peers too, except with --quick)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    p.add_argument("--cache-mib", type=int, nargs="+", default=None,
                   help="mmreplay decoded-frame cache budget(s) in MiB for the Atari workloads; the first is the "
                   "main one (default: 512 = the library default, and 1024, which holds a whole 100k store; "
                   "quick: 512)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of every child, interleaved (default 2; quick 1); batch rates are the median "
                   "of all rounds' windows")
    p.add_argument("--windows", type=int, default=None, help="timed windows per rate (default 7; quick 5)")
    p.add_argument("--window-s", type=float, default=None, help="seconds per window (default 1.0; quick 0.2)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up seconds before the windows")
    p.add_argument("--warm-max-s", type=float, default=None, help="mmreplay: cap on the cache warm-up")
    p.add_argument("--cold-max-s", type=float, default=None, help="mmreplay: cap on the cold first pass")
    p.add_argument("--cgroup", action="store_true", help="run the larger-than-RAM cgroup test")
    p.add_argument("--per", action="store_true", help="run only the prioritized-replay comparison (mmreplay vs "
                   "cpprb PrioritizedReplayBuffer vs TorchRL PrioritizedSampler; Atari and low-dim)")
    p.add_argument("--cgroup-n", type=int, default=None, help="transitions in the cgroup store (default 1000000)")
    p.add_argument("--cgroup-limit", type=lambda v: int(float(v)), default=2_000_000_000,
                   help="cgroup memory limit, bytes (default 2e9 = 2 GB)")
    p.add_argument("--cgroup-cache-mib", type=int, default=1024)
    p.add_argument("--cgroup-repeats", type=int, default=None, help="runs of each cgroup child, interleaved "
                   "(default 2; quick 1)")
    p.add_argument("--cgroup-cold-max-s", type=float, default=120.0)
    p.add_argument("--reuse-store", action="store_true", help="--cgroup: reuse the 1M store of an earlier run "
                   "(kept with --keep-cgroup-store) instead of rebuilding it (same mmreplay version only!)")
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--keep-cgroup-store", action="store_true", help="keep the 1M store for a later --cgroup run")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--profile-dir", default=None, help="pyinstrument the mmreplay warm windows into this folder")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR)
    p.add_argument("--mmreplay-rev", default=None, help="benchmark mmreplay/ as of this git revision (a "
                   "snapshot via git archive) instead of the working tree, e.g. HEAD")
    p.add_argument("--child-timeout", type=float, default=1800)
    p.add_argument("--quiet-cores", type=float, default=0.3, help="before each child, wait until other processes "
                   "use fewer cores than this (2 s probe) ...")
    p.add_argument("--quiet-max-wait", type=float, default=None, help="... for at most this many seconds "
                   "(default 60; quick 0 = no waiting)")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--report-from", default=None, metavar="JSON", help="re-print the report of an earlier "
                   "--json run (re-aggregating its rounds) without running anything")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    dflt = lambda v, full, quick: v if v is not None else (quick if q else full)
    a.atari_n = dflt(a.atari_n, 100_000, 5_000)
    a.lowdim_n = dflt(a.lowdim_n, 1_000_000, 50_000)
    a.cgroup_n = dflt(a.cgroup_n, 1_000_000, 20_000)
    a.windows = dflt(a.windows, 7, 5)
    a.cache_mib = dflt(a.cache_mib, [512, 1024], [512])
    a.repeats = dflt(a.repeats, 2, 1)
    a.quiet_max_wait = dflt(a.quiet_max_wait, 60.0, 0.0)
    a.cgroup_repeats = dflt(a.cgroup_repeats, 2, 1)
    a.window_s = dflt(a.window_s, 1.0, 0.2)
    a.warmup_s = dflt(a.warmup_s, 1.0, 0.2)
    a.warm_max_s = dflt(a.warm_max_s, 30.0, 3.0)
    a.cold_max_s = dflt(a.cold_max_s, 60.0, 3.0)
    if q:
        a.cgroup_cold_max_s = min(a.cgroup_cold_max_s, 5.0)
        if "--x8-peers" not in (argv or sys.argv):
            a.x8_peers = False
    if a.workloads is None:
        a.workloads = [] if a.cgroup or a.per else list(WORKLOADS)
    if a.windows < 5 and not q:
        p.error("--windows must be >= 5 (medians of at least 5 windows)")
    return a


def git_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30, check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "--short", "HEAD"), "dirty_mmreplay": git("status", "--short", "mmreplay")}


def snapshot_rev(rev: str, workdir: str) -> str:
    """``git archive <rev> mmreplay`` into the workdir (the repository itself is not touched)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = os.path.join(workdir, f"mmreplay_src_{sha}")
    if not os.path.isdir(os.path.join(dest, "mmreplay")):
        os.makedirs(dest, exist_ok=True)
        arch = subprocess.run(["git", "-C", REPO, "archive", sha, "mmreplay"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=arch, check=True)
    return dest


def main(argv=None):
    a = parse_args(argv)
    if a.child:
        return child_main(a.child)
    if a.report_from:
        with open(a.report_from) as f:
            results = json.load(f)
        saved = argparse.Namespace(**{**vars(a), **results["args"]})
        for W in results.get("workloads", {}).values():
            for name, r in list(W["systems"].items()):
                if "runs" in r:
                    W["systems"][name] = aggregate_runs(r["runs"], saved.quiet_cores)
        cg = results.get("cgroup")
        if cg and "runs" in cg:
            for mode, rs in cg["runs"].items():
                if rs:
                    agg = aggregate_runs(rs, saved.quiet_cores)
                    agg.pop("runs", None)
                    cgs = [r["cgroup"] for r in rs if isinstance(r.get("cgroup"), dict)]
                    if cgs:
                        agg["cgroup"] = {**cgs[-1], "max_usage": max(c.get("max_usage", 0) for c in cgs)}
                    cg[mode] = agg
        results["targets"] = evaluate_targets(results, saved)
        print(report(results, saved))
        if a.json and a.json != a.report_from:
            with open(a.json, "w") as f:
                json.dump(results, f, indent=1, default=float)
        return 0
    src_note = "working tree"
    if a.mmreplay_rev:
        os.makedirs(a.workdir, exist_ok=True)
        src = snapshot_rev(a.mmreplay_rev, a.workdir)
        os.environ["MMREPLAY_BENCH_SRC"] = src
        sys.path.insert(0, src)
        src_note = f"git {a.mmreplay_rev} snapshot at {src}"
    import torch

    import mmreplay
    t_start = time.perf_counter()
    results = {"meta": {"host": platform.node() + " " + platform.platform(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                        "python": platform.python_version(), "loadavg_start": os.getloadavg(),
                        "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "mmreplay": mmreplay.__file__, "mmreplay_source": src_note, "git": git_info()},
               "args": {k: v for k, v in vars(a).items() if k != "child"}, "workloads": {}}
    runner = Runner(a)
    for wl in a.workloads:
        results["workloads"][wl] = runner.run_workload(wl)
    if a.cgroup:
        results["cgroup"] = runner.run_cgroup()
    if a.per:
        results["per"] = runner.run_per()
    results["meta"]["loadavg_end"] = os.getloadavg()
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    results["targets"] = evaluate_targets(results, a)
    text = report(results, a)
    print(text, flush=True)
    print(f"\n(total wall time {results['meta']['wall_s'] / 60:.1f} min; load avg at end "
          f"{results['meta']['loadavg_end']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
        print(f"figures written to {a.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
