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
   Through the actors, a shard sends its rows as distinct LZ4 frames (``wire="frames"``, the default from
   other nodes) and as decoded stacks (``remote_stacks``, the default on one node); bytes per learner batch
   for both;
4. TorchRL ``RayReplayBuffer`` (``LazyTensorStorage`` in the Ray actor's RAM) with the same transitions
   (obs and next_obs frames, no stacking: TorchRL stores both) from the same number of actors: ingest
   transitions/s and sample batches/s (``pip install torchrl``; measured here with torchrl 0.14.1). If
   torchrl cannot be imported, the output says so and nothing is reported for it.

With ``--repeat R`` the reference and every config run R times in turn (one Ray session) and the report
gives each figure's median, and the median of its ratio to the reference measured in the same round. Each
run also reports the CPU time every process spent per transition (Linux ``/proc``): the env actors, the
shard actors, the shards' encoder processes and Ray's own processes (raylet, GCS), next to the reference
process and its encoder; that is the input of the scaling model in docs/distributed.md.

``--baseline DIR`` runs every config a second time with the shard and env actors importing the mmreplay
package in ``DIR`` (an earlier revision): before and after in the same rounds, against the same reference.

Before the rounds (``--wire-batches N``, default 20; ``--wire-only`` to stop there, no Ray): the learner wire
without Ray, on a store of one actor's transitions: bytes of a batch of 32 and of 256 sent as decoded stacks
and as distinct LZ4 frames (``learner_wire.payload_nbytes``), the shard's CPU to draw the batch and to encode
its frames, the learner's CPU to check and decode them, and the rows rebuilt wrong (medians over N batches).

Run: ``python scripts/bench_distributed.py [--configs 1x1,2x1,2x2,4x2] [--codecs none,lz4] [--repeat 3]
[--baseline DIR] [--json out.json]``. Each actor is its own process; on a small box the figures are bounded by its cores.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURE = os.path.join(HERE, "..", "tests", "data", "atari_fixture.npz")
ENVS = 4
CLOCK_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def process_table() -> dict[int, tuple[str, int, float]]:
    """{pid: (name, parent pid, CPU seconds so far)} of every process (Linux /proc; empty elsewhere)."""
    out = {}
    if not os.path.isdir("/proc"):
        return out
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                raw = f.read()
        except OSError:  # ended meanwhile
            continue
        name = raw[raw.index("(") + 1:raw.rindex(")")]
        fields = raw[raw.rindex(")") + 2:].split()
        out[int(entry)] = (name, int(fields[1]), (int(fields[11]) + int(fields[12])) / CLOCK_TICKS)
    return out


def descendants(table: dict, root: int) -> list[int]:
    """``root`` and every process below it."""
    children: dict[int, list[int]] = {}
    for pid, (_, ppid, _) in table.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo.extend(children.get(pid, []))
    return out


def encoder_children(table: dict, pid: int) -> list[int]:
    """The store encoder processes (``python -m mmreplay.storage.format.encoder``) started by ``pid``."""
    out = []
    for child, (_, ppid, _) in table.items():
        if ppid == pid:
            try:
                with open(f"/proc/{child}/cmdline", "rb") as f:
                    if b"mmreplay.storage.format.encoder" in f.read():
                        out.append(child)
            except OSError:
                pass
    return out


class CpuMeter:
    """CPU seconds spent by groups of processes between construction and ``stop()``: ``roles`` maps a role
    to its pids; with ``rest_under``, every other process below that pid (Ray's raylet, GCS, idle workers
    under the driver) counts as ``"ray_system"``."""

    def __init__(self, roles: dict[str, list[int]], rest_under: int | None = None):
        table = process_table()
        self.role_of: dict[int, str] = {}
        if rest_under is not None:
            for pid in descendants(table, rest_under):
                self.role_of[pid] = "ray_system"
        for role, pids in roles.items():
            for pid in pids:
                self.role_of[pid] = role
        self.roles = sorted(set(self.role_of.values()))
        self._start = self._now()

    def _now(self) -> dict[int, float]:
        table = process_table()
        return {pid: table[pid][2] for pid in self.role_of if pid in table}

    def stop(self) -> dict[str, float]:
        end = self._now()
        out = dict.fromkeys(self.roles, 0.0)
        for pid, cpu in end.items():
            out[self.role_of[pid]] += cpu - self._start.get(pid, 0.0)
        return out


def us_per_transition(cpu: dict[str, float], n: int) -> dict[str, float]:
    out = {role: round(seconds / n * 1e6, 2) for role, seconds in cpu.items()}
    out["total"] = round(sum(cpu.values()) / n * 1e6, 2)
    return out


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
    shutil.rmtree(os.path.join(root, "ref"), ignore_errors=True)  # the previous round's
    store = mmreplay.Store.create(os.path.join(root, "ref"), obs_space, act_space, **store_kwargs(args.capacity))
    for lo in range(0, args.warmup, args.batch):  # encoder process, compiled kernels, first shard files
        s = slice(lo, lo + args.batch)
        store.extend(rows["obs"][s], rows["action"][s], rows["reward"][s], rows["next_obs"][s],
                     rows["terminated"][s], rows["truncated"][s], streams=rows["streams"][s])
    store.flush()
    me = os.getpid()
    meter = CpuMeter({"reference": [me], "reference_encoder": encoder_children(process_table(), me)})
    t0 = time.perf_counter()
    for lo in range(args.warmup, args.transitions, args.batch):
        s = slice(lo, lo + args.batch)
        store.extend(rows["obs"][s], rows["action"][s], rows["reward"][s], rows["next_obs"][s],
                     rows["terminated"][s], rows["truncated"][s], streams=rows["streams"][s])
    store.flush()
    dt = time.perf_counter() - t0
    cpu = meter.stop()
    out = {"extend_per_s": (args.transitions - args.warmup) / dt,
           "cpu_us_per_transition": us_per_transition(cpu, args.transitions - args.warmup)}
    if args.sample_seconds > 0:
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
        def __init__(self, actor, n, episode, prefix, num_shards, batch, compress, warmup, client_kwargs):
            from mmreplay.distributed import ReplayShards

            self.rows = make_rows(actor, n, episode)
            self.client = ReplayShards.connect(num_shards, prefix=prefix).client(actor, compress=compress,
                                                                                 **client_kwargs)
            self.batch, self.warmup = batch, warmup

        def pid(self):
            return os.getpid()

        def code(self):
            import mmreplay

            return os.path.dirname(os.path.dirname(os.path.abspath(mmreplay.__file__)))

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


def client_kwargs(args, client_batch: int = 0) -> dict:
    """ShardClient arguments given on the command line (the rest keep the client's defaults)."""
    out = {}
    if client_batch:
        out["batch_size"] = client_batch
    if args.max_inflight:
        out["max_inflight"] = args.max_inflight
    return out


def bench_mmreplay(args, ray, root, actors: int, shards_n: int, compress, sample: bool, tag: str = "",
                   client_batch: int = 0, code: str | None = None) -> dict:
    """One config; with ``code`` (a directory holding another ``mmreplay`` package) the shard and env actors
    import that version instead (same Ray session, same reference: a before/after in one run)."""
    from mmreplay.distributed import ReplayShards

    obs_space, act_space = spaces()
    prefix = f"bench-{actors}x{shards_n}-{compress}-{client_batch}{tag}{'-baseline' if code else ''}"
    options = {"num_cpus": 0}
    if code:
        options["runtime_env"] = {"env_vars": {"PYTHONPATH": code}}
    shards = ReplayShards.create(os.path.join(root, prefix), shards_n, obs_space, act_space, prefix=prefix,
                                 commit_every=args.commit_every, durable=True, actor_options=options,
                                 **store_kwargs(args.capacity))
    cls = env_actor_class(ray).options(**options)
    env_actors = [cls.remote(a, args.transitions, args.episode, prefix, shards_n, args.batch, compress, args.warmup,
                             client_kwargs(args, client_batch)) for a in range(actors)]
    imported = ray.get(env_actors[0].code.remote())
    if code and imported != code:  # a worker's sys.path starts with the driver's working directory
        raise RuntimeError(f"the baseline's actors imported mmreplay from {imported!r}, not {code!r}: run the "
                           "script from a directory that holds no mmreplay package")
    primed_stats = ray.get([a.prime.remote() for a in env_actors])
    primed = sum(s["added"] for s in primed_stats)
    primed_bytes = sum(s["bytes_sent"] for s in primed_stats)
    infos = shards.info()
    shard_pids = [info["pid"] for info in infos]
    table = process_table()
    meter = CpuMeter({"env_actors": ray.get([a.pid.remote() for a in env_actors]), "shards": shard_pids,
                      "shard_encoders": [c for pid in shard_pids for c in encoder_children(table, pid)],
                      "driver": [os.getpid()]}, rest_under=os.getpid())
    t0 = time.perf_counter()
    stats = ray.get([a.run.remote() for a in env_actors])
    dt = time.perf_counter() - t0
    cpu = meter.stop()
    infos_after = shards.info()
    total = sum(s["added"] for s in stats) - primed
    # the threads doing the work, by step (the rest of each process's CPU: Ray's threads and task dispatch)
    steps = {f"env_{k}": sum(s["cpu_s"][k] - p["cpu_s"][k] for s, p in zip(stats, primed_stats))
             for k in stats[0].get("cpu_s", {})}  # (a baseline without these counters has none)
    steps.update({f"shard_{k}": sum(b["ingest_cpu_s"][k] - a["ingest_cpu_s"][k] for a, b in zip(infos, infos_after))
                  for k in infos[0].get("ingest_cpu_s", {})})
    out = {"actors": actors, "shards": shards_n, "compress": compress, "transitions": total, "code": code,
           "client": client_kwargs(args, client_batch), "ingest_per_s": total / dt, "ingest_per_s_per_shard": total / dt / shards_n,
           "wire_bytes_per_transition": (sum(s["bytes_sent"] for s in stats) - primed_bytes) / total,
           "calls_per_1000_transitions": 1000 * (sum(s["batches"] for s in stats) - sum(
               s["batches"] for s in primed_stats)) / total,
           "dropped": sum(s["dropped"] for s in stats), "cpu_us_per_transition": us_per_transition(cpu, total),
           "steps_cpu_us_per_transition": {k: round(v / total * 1e6, 2) for k, v in steps.items()}}
    if sample and args.sample_seconds > 0:
        out.update(bench_learner(args, root, shards, actors, prefix))
    for a in env_actors:
        ray.kill(a)
    shards.close()
    shutil.rmtree(os.path.join(root, prefix), ignore_errors=True)
    return out


def bench_learner(args, root, shards, actors: int, prefix: str) -> dict:
    """Learner batches/s from the shards, read in place (``local``) and through their actors with prefetch
    (``remote``), next to one store holding the same transitions read by its ``Store.sampler``
    (``one_store``: what issue #14's "within 10% of a single local store" compares with), in alternating
    rounds so that the box's drift falls on all three."""
    import mmreplay

    obs_space, act_space = spaces()
    path = os.path.join(root, f"{prefix}-one-store")
    union = mmreplay.Store.create(path, obs_space, act_space, **store_kwargs(args.capacity))
    for a in range(actors):  # the same rows the env actors sent, each env its own stream
        rows = make_rows(a, args.transitions, args.episode)
        for lo in range(0, rows["action"].size, args.batch):
            sl = slice(lo, lo + args.batch)
            union.extend(rows["obs"][sl], rows["action"][sl], rows["reward"][sl], rows["next_obs"][sl],
                         rows["terminated"][sl], rows["truncated"][sl], streams=a * ENVS + rows["streams"][sl])
    union.flush()
    samplers = {"local": shards.sampler(args.sample_batch, local=True, prefetch=0),
                "remote": shards.sampler(args.sample_batch, local=False, prefetch=2, wire="frames"),
                "remote_stacks": shards.sampler(args.sample_batch, local=False, prefetch=2, wire="stacks",
                                                name="learner-stacks"),
                "one_store": union.sampler(args.sample_batch)}
    rates: dict = {k: [] for k in samplers}
    for _ in range(3):
        for k, smp in samplers.items():
            rates[k].append(rate(smp.sample, args.sample_seconds / 3))
    out = {f"{k}_batches_per_s": statistics.median(v) for k, v in rates.items()}
    for k in ("remote", "remote_stacks"):  # bytes the shards sent per batch (replies counted as they are used)
        out[f"{k}_wire_bytes_per_batch"] = samplers[k].stats["wire_bytes"] / max(1, samplers[k].stats["batches"])
    for smp in samplers.values():
        smp.close()
    union.close()
    shutil.rmtree(path, ignore_errors=True)
    out["local_vs_one_store"] = out["local_batches_per_s"] / out["one_store_batches_per_s"]
    return out


def bench_wire(args, root, batch_sizes=(32, 256)) -> dict:
    """The learner wire without Ray: per batch size, the median bytes of a drawn batch as decoded stacks and as
    distinct LZ4 frames, the CPU (ms, this thread) to draw it, encode its frames and check + decode them, the
    distinct frames it holds, and the rows the rebuild got wrong (summed)."""
    import mmreplay
    from mmreplay.distributed.learner_wire import (FrameLayout, decode_frames, encode_frames, payload_nbytes,
                                                   zero_padded)
    from mmreplay.distributed.sampler import slice_part, write_part
    from mmreplay.distributed.shard import batch_to_numpy
    from mmreplay.sampling.batch import BatchBuffers

    rows = make_rows(0, args.transitions, args.episode)
    obs_space, act_space = spaces()
    path = os.path.join(root, "wire")
    store = mmreplay.Store.create(path, obs_space, act_space, **store_kwargs(args.capacity))
    for lo in range(0, rows["action"].size, args.batch):
        sl = slice(lo, lo + args.batch)
        store.extend(rows["obs"][sl], rows["action"][sl], rows["reward"][sl], rows["next_obs"][sl],
                     rows["terminated"][sl], rows["truncated"][sl], streams=rows["streams"][sl])
    store.flush()
    layout, out = FrameLayout.of(store.schema), {}
    for b in batch_sizes:
        smp = store.sampler(b, prefetch=0, seed=b, name=f"wire-{b}")
        buf, rebuilt, reuse = BatchBuffers(store.schema, b), BatchBuffers(store.schema, b), {}
        runs: dict = {k: [] for k in ("stacks_bytes", "frames_bytes", "draw_ms", "encode_ms", "decode_ms",
                                      "distinct_frames")}
        wrong = 0
        for _ in range(args.wire_batches + 1):  # the first batch warms the caches and kernels: not counted
            t0 = time.thread_time()
            picked = smp.draw_into(buf)
            t1 = time.thread_time()
            local = batch_to_numpy(buf.batch())
            payload = encode_frames(local, picked.obs_ids, picked.next_ids, zero_pad=zero_padded(store.schema),
                                    dict_obs=False)
            t2 = time.thread_time()
            decoded = decode_frames(payload, layout, reuse)
            t3 = time.thread_time()
            write_part(rebuilt, slice_part(decoded, 0, b))
            for k, v in (("stacks_bytes", payload_nbytes(local)), ("frames_bytes", payload_nbytes(payload)),
                         ("draw_ms", 1e3 * (t1 - t0)), ("encode_ms", 1e3 * (t2 - t1)), ("decode_ms", 1e3 * (t3 - t2)),
                         ("distinct_frames", payload["frames"]["obs"]["rows"])):
                runs[k].append(v)
            wrong += int((~((rebuilt.obs["obs"][1] == local["obs"]).reshape(b, -1).all(axis=1)
                            & (rebuilt.next_obs["obs"][1] == local["next_obs"]).reshape(b, -1).all(axis=1))).sum())
        smp.close()
        r = {k: statistics.median(v[1:]) for k, v in runs.items()}
        r["ratio"] = r["stacks_bytes"] / r["frames_bytes"]
        r["wrong_rows"] = wrong
        out[b] = r
        print(f"learner wire, batch {b}: {r['stacks_bytes']:,.0f} B as stacks, {r['frames_bytes']:,.0f} B as frames "
              f"({r['distinct_frames']:.0f} distinct of {b * 8} stack positions) = {r['ratio']:.1f}x fewer; shard "
              f"CPU {r['draw_ms']:.2f} ms draw + {r['encode_ms']:.2f} ms encode, learner {r['decode_ms']:.2f} ms "
              f"check + decode; {wrong} wrong rows", flush=True)
    store.close()
    shutil.rmtree(path, ignore_errors=True)
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

        def pid(self):
            return os.getpid()

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
        meter = CpuMeter({"env_actors": ray.get([a.pid.remote() for a in env_actors]), "driver": [os.getpid()]},
                         rest_under=os.getpid())  # the buffer's actor counts as ray_system here
        t0 = time.perf_counter()
        total = sum(ray.get([a.run.remote(args.warmup) for a in env_actors]))
        dt = time.perf_counter() - t0
        out = {"actors": actors, "transitions": total, "ingest_per_s": total / dt,
               "cpu_us_per_transition": us_per_transition(meter.stop(), total)}
        if args.sample_seconds > 0:
            out["sample_batches_per_s"] = rate(rb.sample, args.sample_seconds)
        for a in env_actors:
            ray.kill(a)
        return out
    finally:
        rb.shutdown()


def cpu_line(cpu: dict) -> str:
    return ", ".join(f"{role} {us:.1f}" for role, us in cpu.items()) + " us CPU/transition"


def label_of(r: dict) -> str:
    batch = r["client"].get("batch_size")
    return f"{r['actors']}x{r['shards']} compress={r['compress']}" + (f" batch={batch}" if batch else "") + (
        " [baseline]" if r.get("code") else "")


def run_round(args, ray, root, configs, codecs, k: int) -> dict:
    """The reference, then every config and codec, then TorchRL: one round, ratios against its reference."""
    out: dict = {"reference": bench_reference(args, root)}
    ref = out["reference"]
    print(f"[round {k}] reference: one process Store.extend {ref['extend_per_s']:,.0f} transitions/s "
          f"({cpu_line(ref['cpu_us_per_transition'])})" + (
              f"; one local store: sample({args.sample_batch}) {ref['sample_batches_per_s']:,.0f}/s, sampler "
              f"{ref['sampler_batches_per_s']:,.0f}/s" if "sample_batches_per_s" in ref else ""), flush=True)
    out["mmreplay"] = []
    codes = [None] + ([os.path.abspath(args.baseline)] if args.baseline else [])
    for (a, s), compress, client_batch, code in itertools.product(configs, codecs, args.client_batch, codes):
        r = bench_mmreplay(args, ray, root, a, s, compress, sample=compress == codecs[0] and code is None, tag=f"-r{k}",
                           client_batch=client_batch, code=code)
        r["ratio"] = r["ingest_per_s_per_shard"] / ref["extend_per_s"]
        out["mmreplay"].append(r)
        extra = "".join(f", {key.split('_batches')[0].replace('_', ' ')} {r[key]:,.0f} batches/s" for key in
                        ("local_batches_per_s", "one_store_batches_per_s", "remote_batches_per_s",
                         "remote_stacks_batches_per_s") if key in r)
        if "local_vs_one_store" in r:
            extra += f" (local = {r['local_vs_one_store']:.2f}x one store holding the same)"
        print(f"[round {k}] mmreplay {label_of(r)}: ingest {r['ingest_per_s']:,.0f} transitions/s "
              f"({r['ingest_per_s_per_shard']:,.0f}/shard = {r['ratio']:.2f}x one store), "
              f"{r['wire_bytes_per_transition']:,.0f} B/transition on the wire{extra}; "
              f"{cpu_line(r['cpu_us_per_transition'])}; of which {cpu_line(r['steps_cpu_us_per_transition'])}",
              flush=True)
    out["torchrl"] = []
    if not args.no_torchrl:
        for a in sorted({a for a, _ in configs}):
            r = bench_torchrl(args, ray, a)
            out["torchrl"].append(r)
            if "error" in r:
                print(f"TorchRL RayReplayBuffer: not measured: {r['error']}", flush=True)
                break
            r["ratio"] = r["ingest_per_s"] / ref["extend_per_s"]
            print(f"[round {k}] TorchRL RayReplayBuffer {a} actors: ingest {r['ingest_per_s']:,.0f} transitions/s "
                  f"({r['ratio']:.2f}x one store)" + (f", sample({args.sample_batch}) {r['sample_batches_per_s']:,.0f} "
                                                     "batches/s" if "sample_batches_per_s" in r else "") +
                  f"; {cpu_line(r['cpu_us_per_transition'])}", flush=True)
    return out


def summarize(rounds: list[dict]) -> dict:
    """Median over rounds of each run's rate, its ratio to its round's reference and its CPU per role."""
    def med(values):
        return statistics.median(values) if values else None

    def cpu_median(runs, key="cpu_us_per_transition"):
        roles = sorted({role for r in runs for role in r.get(key, {})})
        return {role: round(med([r[key].get(role, 0.0) for r in runs]), 2) for role in roles}

    refs = [r["reference"] for r in rounds]
    out = {"reference": {"extend_per_s": med([r["extend_per_s"] for r in refs]), "cpu_us_per_transition": cpu_median(refs)}}
    groups: dict[str, list] = {}
    for rnd in rounds:
        for r in rnd["mmreplay"]:
            groups.setdefault(f"mmreplay {label_of(r)}", []).append(r)
        for r in rnd["torchrl"]:
            if "error" not in r:
                groups.setdefault(f"torchrl {r['actors']} actors", []).append(r)
    for label, runs in groups.items():
        out[label] = {"ingest_per_s": med([r["ingest_per_s"] for r in runs]),
                      "ingest_per_s_per_shard": med([r.get("ingest_per_s_per_shard", r["ingest_per_s"]) for r in runs]),
                      "ratio": med([r["ratio"] for r in runs]), "cpu_us_per_transition": cpu_median(runs),
                      "steps_cpu_us_per_transition": cpu_median(runs, "steps_cpu_us_per_transition"),
                      "rounds": len(runs)}
        for key in ("local_batches_per_s", "one_store_batches_per_s", "remote_batches_per_s", "local_vs_one_store",
                    "remote_stacks_batches_per_s", "remote_wire_bytes_per_batch", "remote_stacks_wire_bytes_per_batch"):
            if any(key in r for r in runs):
                out[label][key] = med([r[key] for r in runs if key in r])
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="1x1,2x1,2x2,4x2", help="AxS: env actors x shards, comma separated")
    p.add_argument("--codecs", default="none,lz4", help="wire codecs to run every config with (none, lz4)")
    p.add_argument("--repeat", type=int, default=1, help="rounds (reference and every config each round)")
    p.add_argument("--transitions", type=int, default=8192, help="transitions per env actor")
    p.add_argument("--warmup", type=int, default=1024, help="of which the first ones are not timed")
    p.add_argument("--batch", type=int, default=256, help="rows per extend call (the reference's and the actors')")
    p.add_argument("--client-batch", type=lambda v: [int(x) for x in v.split(",")], default=[0],
                   help="ShardClient batch_size(s), comma separated (default: the client's)")
    p.add_argument("--max-inflight", type=int, default=0, help="ShardClient max_inflight (default: the client's)")
    p.add_argument("--episode", type=int, default=200)
    p.add_argument("--capacity", type=int, default=100_000)
    p.add_argument("--commit-every", type=int, default=25_000,
                   help="shards' commit_every (default: Store's default, the reference's cadence)")
    p.add_argument("--sample-batch", type=int, default=32)
    p.add_argument("--sample-seconds", type=float, default=4.0, help="0: ingest only")
    p.add_argument("--no-torchrl", action="store_true")
    p.add_argument("--baseline", help="a directory holding another mmreplay package (e.g. `git archive REV mmreplay "
                                      "| tar -x -C DIR`): every config also runs with its actors on that code")
    p.add_argument("--wire-batches", type=int, default=20, help="batches per size for the learner wire figures (0: skip)")
    p.add_argument("--wire-only", action="store_true", help="only the learner wire figures (no Ray)")
    p.add_argument("--json", help="write the figures here")
    args = p.parse_args(argv)
    configs = [tuple(int(x) for x in c.split("x")) for c in args.configs.split(",")]
    codecs = [None if c == "none" else c for c in args.codecs.split(",")]
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    # Ray lowers its workers' priority by 15 (nice) by default. On a box shared with other jobs that starves the
    # env and shard actors, not the reference (this process): run every process at this process's priority.
    os.environ.setdefault("RAY_worker_niceness", "0")
    import ray

    root = tempfile.mkdtemp(prefix="mmreplay_bench_dist_")
    results: dict = {"cpus": os.cpu_count(), "transitions_per_actor": args.transitions, "args": vars(args),
                     "rounds": []}
    if args.wire_batches > 0 or args.wire_only:
        args.wire_batches = max(1, args.wire_batches)
        results["learner_wire"] = bench_wire(args, root)
    if args.wire_only:
        shutil.rmtree(root, ignore_errors=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
        return 0
    try:
        ray.init(num_cpus=max(8, 2 * os.cpu_count()), include_dashboard=False, log_to_driver=False,
                 configure_logging=False)
        ray.cloudpickle.register_pickle_by_value(sys.modules[__name__])
        for k in range(args.repeat):
            results["rounds"].append(run_round(args, ray, root, configs, codecs, k))
    finally:
        shutil.rmtree(root, ignore_errors=True)
        if ray.is_initialized():
            ray.shutdown()
    results["median"] = summarize(results["rounds"])
    print(f"== median of {args.repeat} round(s); ratio = per shard / the same round's one-process Store.extend")
    for label, r in results["median"].items():
        rate_s = r.get("extend_per_s", r.get("ingest_per_s"))
        ratio = f" per shard {r['ingest_per_s_per_shard']:,.0f}/s = {r['ratio']:.2f}x" if "ratio" in r else ""
        steps = f"; of which {cpu_line(r['steps_cpu_us_per_transition'])}" if r.get("steps_cpu_us_per_transition") else ""
        print(f"{label:32s} {rate_s:>9,.0f}/s{ratio}; {cpu_line(r['cpu_us_per_transition'])}{steps}")
        if "local_vs_one_store" in r:
            print(f"{'':32s} learner batch-{args.sample_batch}/s: local shards {r['local_batches_per_s']:,.0f}, one store "
                  f"holding the same {r['one_store_batches_per_s']:,.0f} (local = {r['local_vs_one_store']:.2f}x), "
                  f"through the actors {r['remote_batches_per_s']:,.0f} as frames "
                  f"({r['remote_wire_bytes_per_batch']:,.0f} B a batch), {r['remote_stacks_batches_per_s']:,.0f} as "
                  f"stacks ({r['remote_stacks_wire_bytes_per_batch']:,.0f} B)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
