"""Distributed ingest and learner sampling on this machine: mmreplay.distributed vs TorchRL's RayReplayBuffer.

What it measures (real 84x84 Atari frames from tests/data/atari_fixture.npz, replayed in episodes of
``--episode`` steps, 4 envs per env actor, frame_stack 4 in mmreplay's stores):

1. the reference: one process calling ``Store.extend`` with batches of ``--batch`` rows (transitions/s);
2. ingest through Ray, for each ``AxS`` config (A env actors, S shards): every actor sends
   ``--transitions`` transitions through a ``ShardClient`` and ends with a committing ``flush``; rate =
   all transitions / wall time from the first add to the last commit; bytes on the wire per transition,
   raw and with ``compress="lz4"``;
3. the learner: batches of ``--sample-batch`` per second from the same shards, read in place
   (``local=True``) and through the actors with prefetch (``local=False``), next to one local store read
   with ``Store.sample`` and with its ``Store.sampler``;
4. TorchRL ``RayReplayBuffer`` (``LazyTensorStorage`` in the Ray actor's RAM) with the same transitions
   (obs and next_obs frames, no stacking: TorchRL stores both) from the same number of actors: ingest
   transitions/s and sample batches/s (``pip install torchrl``; measured here with torchrl 0.14.1). If
   torchrl cannot be imported, the output says so and nothing is reported for it.

Run: ``python scripts/bench_distributed.py [--configs 1x1,2x1,2x2,4x2] [--json out.json]``.
Each actor is its own process; on a small box the figures are bounded by its cores (see docs/distributed.md).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "tests", "data", "atari_fixture.npz")
ENVS = 4


def make_rows(actor: int, n: int, episode: int) -> dict:
    """``n`` transitions of ``ENVS`` interleaved envs (row ``i`` is env ``i % ENVS``) on real frames; each env
    walks the frame pool from its own offset, episodes of ``episode`` steps end with ``terminated``."""
    frames = np.load(FIXTURE)["frames"]
    steps = n // ENVS
    env_ids = np.tile(np.arange(ENVS), steps)
    t = np.repeat(np.arange(steps), ENVS)
    start = (actor * 97 + env_ids * 151) % (len(frames) - 1)
    j = (start + t + t // episode) % (len(frames) - 1)  # a new episode skips a frame: its obs is new
    end = (t % episode) == episode - 1
    rng = np.random.default_rng(actor)
    return {"streams": env_ids, "obs": frames[j], "next_obs": frames[j + 1], "action": rng.integers(0, 6, j.size),
            "reward": rng.integers(-1, 2, j.size).astype(np.float32), "terminated": end,
            "truncated": np.zeros(j.size, bool)}


def spaces():
    from gymnasium import spaces as sp

    return sp.Box(0, 255, (84, 84), np.uint8), sp.Discrete(6)


def store_kwargs(capacity: int) -> dict:
    return dict(capacity=capacity, frame_stack=4, reward_values=(-1, 0, 1))


def bench_reference(args, root) -> dict:
    import mmreplay

    rows = make_rows(0, args.transitions, args.episode)
    obs_space, act_space = spaces()
    store = mmreplay.Store.create(os.path.join(root, "ref"), obs_space, act_space, **store_kwargs(args.capacity))
    for lo in range(0, args.warmup, args.batch):  # encoder process, compiled kernels, first shard files
        s = slice(lo, lo + args.batch)
        store.extend(rows["obs"][s], rows["action"][s], rows["reward"][s], rows["next_obs"][s],
                     rows["terminated"][s], rows["truncated"][s], streams=rows["streams"][s])
    store.flush()
    t0 = time.perf_counter()
    for lo in range(args.warmup, args.transitions, args.batch):
        s = slice(lo, lo + args.batch)
        store.extend(rows["obs"][s], rows["action"][s], rows["reward"][s], rows["next_obs"][s],
                     rows["terminated"][s], rows["truncated"][s], streams=rows["streams"][s])
    store.flush()
    dt = time.perf_counter() - t0
    out = {"extend_per_s": (args.transitions - args.warmup) / dt}
    for label, fn in (("sample", lambda: store.sample(args.sample_batch)),
                      ("sampler", iter(store.sampler(args.sample_batch)).__next__)):
        out[f"{label}_batches_per_s"] = rate(fn, args.sample_seconds)
    store.close()
    return out


def rate(fn, seconds: float) -> float:
    fn()
    k, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        fn()
        k += 1
    return k / (time.perf_counter() - t0)


def env_actor_class(ray):
    @ray.remote(num_cpus=0)
    class MMEnvActor:
        def __init__(self, actor, n, episode, prefix, num_shards, batch, compress, warmup):
            from mmreplay.distributed import ReplayShards

            self.rows = make_rows(actor, n, episode)
            self.client = ReplayShards.connect(num_shards, prefix=prefix).client(actor, batch_size=batch,
                                                                                 compress=compress)
            self.batch, self.warmup = batch, warmup

        def ready(self):
            return True

        def prime(self):
            """The first ``warmup`` rows, committed: shard stores past their first files, not timed."""
            self._send(0, self.warmup)
            return self.client.flush(commit=True)

        def run(self):
            self._send(self.warmup, self.rows["action"].size)
            return self.client.flush(commit=True)

        def _send(self, start, stop):
            r, b = self.rows, self.batch
            for lo in range(start, stop, b):
                s = slice(lo, lo + b)
                self.client.extend(r["obs"][s], r["action"][s], r["reward"][s], r["next_obs"][s], r["terminated"][s],
                                   r["truncated"][s], streams=r["streams"][s])

    return MMEnvActor


def bench_mmreplay(args, ray, root, actors: int, shards_n: int, compress, sample: bool) -> dict:
    from mmreplay.distributed import ReplayShards

    obs_space, act_space = spaces()
    prefix = f"bench-{actors}x{shards_n}-{compress}"
    shards = ReplayShards.create(os.path.join(root, prefix), shards_n, obs_space, act_space, prefix=prefix,
                                 commit_every=args.commit_every, durable=True, actor_options={"num_cpus": 0},
                                 **store_kwargs(args.capacity))
    cls = env_actor_class(ray)
    env_actors = [cls.remote(a, args.transitions, args.episode, prefix, shards_n, args.batch, compress, args.warmup)
                  for a in range(actors)]
    primed_stats = ray.get([a.prime.remote() for a in env_actors])
    primed = sum(s["added"] for s in primed_stats)
    primed_bytes = sum(s["bytes_sent"] for s in primed_stats)
    t0 = time.perf_counter()
    stats = ray.get([a.run.remote() for a in env_actors])
    dt = time.perf_counter() - t0
    total = sum(s["added"] for s in stats) - primed
    out = {"actors": actors, "shards": shards_n, "compress": compress, "transitions": total,
           "ingest_per_s": total / dt, "ingest_per_s_per_shard": total / dt / shards_n,
           "wire_bytes_per_transition": (sum(s["bytes_sent"] for s in stats) - primed_bytes) / total,
           "dropped": sum(s["dropped"] for s in stats)}
    if sample:
        for local in (True, False):
            smp = shards.sampler(args.sample_batch, local=local, prefetch=0 if local else 2)
            out[f"{'local' if local else 'remote'}_batches_per_s"] = rate(smp.sample, args.sample_seconds)
            smp.close()
    for a in env_actors:
        ray.kill(a)
    shards.close()
    return out


def bench_torchrl(args, ray, actors: int) -> dict:
    try:
        import torch
        from functools import partial
        from tensordict import TensorDict
        from torchrl.data import LazyTensorStorage
        from torchrl.data.replay_buffers.ray_buffer import RayReplayBuffer
    except Exception as exc:  # noqa: BLE001
        return {"error": f"torchrl cannot be imported here: {exc!r}"}

    @ray.remote(num_cpus=0)
    class TRLEnvActor:
        def __init__(self, actor, n, episode, client, batch):
            self.rows = make_rows(actor, n, episode)
            self.client, self.batch = client, batch

        def ready(self):
            return True

        def prime(self, warmup):
            return self._send(0, warmup)

        def run(self, warmup):
            return self._send(warmup, self.rows["action"].size)

        def _send(self, start, stop):
            r, b = self.rows, self.batch
            for lo in range(start, stop, b):
                s = slice(lo, lo + b)
                n = r["action"][s].size
                self.client.extend(TensorDict({
                    "observation": torch.from_numpy(r["obs"][s]), "action": torch.from_numpy(r["action"][s]),
                    "next": {"observation": torch.from_numpy(r["next_obs"][s]),
                             "reward": torch.from_numpy(r["reward"][s]),
                             "terminated": torch.from_numpy(r["terminated"][s])}}, batch_size=[n]))
            return stop - start

    rb = RayReplayBuffer(storage=partial(LazyTensorStorage, args.capacity), batch_size=args.sample_batch,
                         remote_config={"num_cpus": 0})
    try:
        env_actors = [TRLEnvActor.remote(a, args.transitions, args.episode, rb.client(), args.batch)
                      for a in range(actors)]
        ray.get([a.prime.remote(args.warmup) for a in env_actors])
        t0 = time.perf_counter()
        total = sum(ray.get([a.run.remote(args.warmup) for a in env_actors]))
        dt = time.perf_counter() - t0
        out = {"actors": actors, "transitions": total, "ingest_per_s": total / dt,
               "sample_batches_per_s": rate(rb.sample, args.sample_seconds)}
        for a in env_actors:
            ray.kill(a)
        return out
    finally:
        rb.shutdown()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1x1,2x1,2x2,4x2", help="AxS: env actors x shards, comma separated")
    p.add_argument("--transitions", type=int, default=8192, help="transitions per env actor")
    p.add_argument("--warmup", type=int, default=1024, help="of which the first ones are not timed")
    p.add_argument("--batch", type=int, default=256, help="rows per extend / per client batch")
    p.add_argument("--episode", type=int, default=200)
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--commit-every", type=int, default=5000)
    p.add_argument("--sample-batch", type=int, default=32)
    p.add_argument("--sample-seconds", type=float, default=4.0)
    p.add_argument("--no-torchrl", action="store_true")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    import ray

    root = tempfile.mkdtemp(prefix="mmreplay_bench_dist_")
    results: dict = {"cpus": os.cpu_count(), "transitions_per_actor": args.transitions, "batch": args.batch}
    try:
        results["reference"] = bench_reference(args, root)
        print(f"reference: one process Store.extend {results['reference']['extend_per_s']:,.0f} transitions/s; "
              f"one local store: sample({args.sample_batch}) {results['reference']['sample_batches_per_s']:,.0f}/s, "
              f"sampler {results['reference']['sampler_batches_per_s']:,.0f}/s", flush=True)
        ray.init(num_cpus=max(8, 2 * os.cpu_count()), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        results["mmreplay"] = []
        for a, s in configs:
            for compress in (None, "lz4") if (a, s) == configs[-1] else (None,):
                r = bench_mmreplay(args, ray, root, a, s, compress, sample=compress is None)
                results["mmreplay"].append(r)
                extra = "".join(f", {k.split('_')[0]} {r[k]:,.0f} batches/s" for k in
                                ("local_batches_per_s", "remote_batches_per_s") if k in r)
                print(f"mmreplay {a}x{s} compress={compress}: ingest {r['ingest_per_s']:,.0f} transitions/s "
                      f"({r['ingest_per_s_per_shard']:,.0f}/shard = "
                      f"{r['ingest_per_s_per_shard'] / results['reference']['extend_per_s']:.2f}x one store), "
                      f"{r['wire_bytes_per_transition']:,.0f} B/transition on the wire{extra}", flush=True)
        results["torchrl"] = []
        if not args.no_torchrl:
            for a in sorted({a for a, _ in configs}):
                r = bench_torchrl(args, ray, a)
                results["torchrl"].append(r)
                if "error" in r:
                    print(f"TorchRL RayReplayBuffer: not measured: {r['error']}", flush=True)
                    break
                print(f"TorchRL RayReplayBuffer {a} actors: ingest {r['ingest_per_s']:,.0f} transitions/s, "
                      f"sample({args.sample_batch}) {r['sample_batches_per_s']:,.0f} batches/s", flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
