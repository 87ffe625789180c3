"""Sequence batches: mmreplay's ``store.sampler(B, Sequences(L))`` against TorchRL's ``SliceSampler`` over
``LazyTensorStorage`` (RAM) and ``LazyMemmapStorage`` (disk), same data, same run.

Workloads (issue 15):
- ``lowdim``: obs 4 float32, B=32 slices of L=80 steps;
- ``atari``: real 84x84 frames (``mmreplay/data/atari_fixture.npz``, 640 frames, tiled), frame stack 4,
  B=16 slices of L=32 steps.
Episodes of 150-600 steps, one stream, all ending (terminated or truncated). TorchRL holds per step the
stacked observation, action, reward and flags, and an ``episode`` id (its SliceSampler's ``traj_key``;
``cache_values=True``: the data is static). That is its smallest layout for sequences: no per-step next
observation, which TorchRL's collectors would also store. Both sides draw an episode uniformly, then a
start within it (``sample_from="episodes"``), strict slices, and return torch tensors.

mmreplay first samples until its cache stops missing (every frame decoded once; TorchRL's storages hold
decoded data from the start). Each rate is the median of ``--windows`` windows of ``--window`` seconds
after a warm-up (batches/s); ratios are mmreplay / TorchRL. The machine is shared: the other processes'
CPU use is printed with the results. RSS: growth of this process while mmreplay samples, next to the
store's cache budget.

    python scripts/bench_sequences.py --lowdim-steps 200000 --atari-steps 20000
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
from benchmarks.measure import CpuMeter, cur_rss_bytes, rate_windows  # noqa: E402

from gymnasium import spaces  # noqa: E402

import mmreplay  # noqa: E402
from mmreplay.sampling.strategy import Sequences

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "mmreplay", "data", "atari_fixture.npz")


def episodes(n: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Episode id, terminated, truncated per step for ``n`` steps of episodes of 150-600 steps."""
    lengths = []
    while sum(lengths) < n:
        lengths.append(int(rng.integers(150, 601)))
    lengths[-1] -= sum(lengths) - n
    ep = np.repeat(np.arange(len(lengths)), lengths)
    end = np.zeros(n, bool)
    end[np.cumsum(lengths) - 1] = True
    trunc = end & (rng.random(n) < 0.3)
    return ep, end & ~trunc, trunc


def make_data(kind: str, n: int, seed: int = 0) -> dict:
    rng = np.random.default_rng(seed)
    ep, term, trunc = episodes(n, rng)
    if kind == "lowdim":
        frames = rng.standard_normal((n + ep.max() + 1, 4)).astype(np.float32)
    else:
        real = np.load(FIXTURE)["frames"]
        frames = real[np.arange(n + ep.max() + 1) % real.shape[0]]
    # observation of step t is frame[t + episode(t)]; its next observation frame[t + episode(t) + 1]
    f = np.arange(n) + ep
    return {"frames": frames, "obs": f, "next": f + 1, "episode": ep, "terminated": term, "truncated": trunc,
            "action": rng.integers(0, 4, n), "reward": rng.standard_normal(n).astype(np.float32)}


def fill_store(path: str, kind: str, d: dict, k: int, cache_bytes: int) -> "mmreplay.Store":
    shape = d["frames"].shape[1:]
    obs_space = spaces.Box(-np.inf, np.inf, shape, np.float32) if kind == "lowdim" else \
        spaces.Box(0, 255, shape, np.uint8)
    n = d["obs"].size
    store = mmreplay.Store.create(path, obs_space, spaces.Discrete(4), capacity=n, frame_stack=k,
                                  cache_bytes=cache_bytes, durable=False)
    for lo in range(0, n, 2048):
        s = slice(lo, min(n, lo + 2048))
        store.extend(d["frames"][d["obs"][s]], d["action"][s], d["reward"][s], d["frames"][d["next"][s]],
                     d["terminated"][s], d["truncated"][s], streams=np.zeros(s.stop - s.start, np.int64))
    store.flush()
    return store


def stacked(d: dict, k: int) -> np.ndarray:
    """Per step the stack of its last ``k`` frames within the episode (first frame repeated before it)."""
    n = d["obs"].size
    start = np.zeros(n, np.int64)
    first = np.r_[0, np.flatnonzero(np.diff(d["episode"])) + 1]
    start[first] = first
    start = np.maximum.accumulate(start)  # each step's episode start
    ids = d["obs"][:, None] + np.arange(-k + 1, 1)
    ids = np.maximum(ids, d["obs"][start][:, None])
    out = d["frames"][ids]
    return out if k > 1 else out[:, 0]


def torchrl_buffer(kind_storage: str, d: dict, k: int, B: int, L: int, workdir: str):
    from tensordict import TensorDict
    from torchrl.data import LazyMemmapStorage, LazyTensorStorage, TensorDictReplayBuffer
    from torchrl.data.replay_buffers.samplers import SliceSampler

    n = d["obs"].size
    storage = LazyTensorStorage(n) if kind_storage == "tensor" else \
        LazyMemmapStorage(n, scratch_dir=os.path.join(workdir, "memmap"))
    sampler = SliceSampler(num_slices=B, traj_key="episode", strict_length=True, cache_values=True)
    rb = TensorDictReplayBuffer(storage=storage, sampler=sampler, batch_size=B * L)
    chunk = 4096
    for lo in range(0, n, chunk):
        s = slice(lo, min(n, lo + chunk))
        m = s.stop - s.start
        sub = {key: v[s] for key, v in d.items() if key not in ("frames",)}
        obs = stacked({**sub, "frames": d["frames"], "obs": d["obs"][s], "episode": d["episode"][s]}, k)
        def flag(x, m=m):
            return torch.as_tensor(x).reshape(m, 1)
        rb.extend(TensorDict({"observation": torch.as_tensor(obs), "action": torch.as_tensor(sub["action"]),
                              "episode": torch.as_tensor(sub["episode"]),
                              "next": TensorDict({"reward": flag(sub["reward"]), "terminated": flag(sub["terminated"]),
                                                  "truncated": flag(sub["truncated"]),
                                                  "done": flag(sub["terminated"] | sub["truncated"])}, [m])}, [m]))
    return rb


def warm_cache(store, B: int, L: int, least_s: float, most_s: float = 60.0) -> float:
    """Sample until a window of ``least_s`` seconds adds no cache miss (every frame decoded once), as
    TorchRL's storages hold decoded data from the start. Returns the seconds it took."""
    smp = store.sampler(B, Sequences(L), seed=1)
    t0 = time.perf_counter()
    misses = -1
    while time.perf_counter() - t0 < most_s:
        now = sum(c["misses"] for c in store.inspect.cache_stats().values())
        if now == misses:
            break
        misses = now
        rate_windows(smp.sample, 1, least_s, 0.0)
    smp.close()
    return time.perf_counter() - t0


def via_torchrl(store, B: int, L: int, args) -> float:
    """The same slices through TorchRL's ReplayBuffer: MMReplayStorage + MMReplaySliceSampler (flat
    TensorDicts of B*L steps with per-step next observations, as TorchRL's SliceSampler returns)."""
    from torchrl.data import TensorDictReplayBuffer

    from mmreplay.integrations.torchrl import MMReplaySliceSampler, MMReplayStorage

    rb = TensorDictReplayBuffer(storage=MMReplayStorage(store), sampler=MMReplaySliceSampler(num_slices=B, seed=0),
                                batch_size=B * L)
    return statistics.median(rate_windows(rb.sample, args.windows, args.window, args.warmup))


def run(kind: str, n: int, B: int, L: int, k: int, args, workdir: str) -> dict:
    d = make_data(kind, n)
    out = {"workload": kind, "steps": n, "B": B, "L": L, "frame_stack": k}
    store = fill_store(os.path.join(workdir, f"{kind}.mmr"), kind, d, k, args.cache_mb << 20)
    out["warmup_s"] = warm_cache(store, B, L, args.warmup)
    meter = CpuMeter()
    rss0 = cur_rss_bytes()
    for mode in ("episodes", "steps"):
        smp = store.sampler(B, Sequences(L, sample_from=mode), seed=0)
        rates = rate_windows(smp.sample, args.windows, args.window, args.warmup)
        out[f"mmreplay_{mode}"] = statistics.median(rates)
        smp.close()
    out["mmreplay_rss_growth_mb"] = (cur_rss_bytes() - rss0) / 2**20
    out["cache_budget_mb"] = args.cache_mb
    out["mmreplay_cpu"] = meter.result()
    out["mmreplay_via_torchrl_rb"] = via_torchrl(store, B, L, args)
    store.close()
    for backend in ("tensor", "memmap"):
        rb = torchrl_buffer(backend, d, k, B, L, workdir)
        meter = CpuMeter()
        rates = rate_windows(rb.sample, args.windows, args.window, args.warmup)
        out[f"torchrl_{backend}"] = statistics.median(rates)
        out[f"torchrl_{backend}_cpu"] = meter.result()
        del rb
        shutil.rmtree(os.path.join(workdir, "memmap"), ignore_errors=True)
    out["ratio_vs_tensor"] = out["mmreplay_episodes"] / out["torchrl_tensor"]
    out["ratio_vs_memmap"] = out["mmreplay_episodes"] / out["torchrl_memmap"]
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lowdim-steps", type=int, default=200_000)
    p.add_argument("--atari-steps", type=int, default=20_000)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window", type=float, default=1.0)
    p.add_argument("--warmup", type=float, default=1.0)
    p.add_argument("--cache-mb", type=int, default=512)
    p.add_argument("--only", choices=("lowdim", "atari"))
    args = p.parse_args(argv)
    torch.set_num_threads(2)
    workdir = tempfile.mkdtemp(prefix="bench_seq_")
    try:
        results = []
        if args.only in (None, "lowdim"):
            results.append(run("lowdim", args.lowdim_steps, 32, 80, 1, args, workdir))
        if args.only in (None, "atari"):
            results.append(run("atari", args.atari_steps, 16, 32, 4, args, workdir))
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    for r in results:
        print(f"{r['workload']}: {r['steps']} steps, B={r['B']} L={r['L']} stack {r['frame_stack']}  batches/s: "
              f"mmreplay {r['mmreplay_episodes']:.0f} (steps mode {r['mmreplay_steps']:.0f}; through TorchRL's "
              f"ReplayBuffer with MMReplayStorage {r['mmreplay_via_torchrl_rb']:.0f}), TorchRL SliceSampler "
              f"LazyTensorStorage {r['torchrl_tensor']:.0f}, LazyMemmapStorage {r['torchrl_memmap']:.0f}; ratios "
              f"{r['ratio_vs_tensor']:.2f}x / {r['ratio_vs_memmap']:.2f}x; RSS growth while sampling "
              f"{r['mmreplay_rss_growth_mb']:.0f} MB (cache budget {r['cache_budget_mb']} MB); other processes "
              f"{r['mmreplay_cpu']['other_cpu_cores']:.1f} cores")
    print(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
