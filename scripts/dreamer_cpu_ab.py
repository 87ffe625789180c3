#!/usr/bin/env python
"""CPU ms a batch of ``Sequences(64)`` b16 from small ``delta-lz4`` stores of the ``dreamer`` dataset held in RAM
(decoded cache off, so every batch decodes its runs), one run length a store, against the DreamerV3-style
replay holding the same steps, each in a fresh child, the rounds interleaved (issue #42).

    python scripts/dreamer_cpu_ab.py [--n 40000] [--runs 32,16,8] [--rounds 2] [--seconds 6]

Invariant: every figure is one child's (its process CPU time, all threads, over its timed batches; its rate over
the same seconds); the stores are built once (``benchmarks.dreamer_data.build``, runs reused by content) under
``--workdir`` and reused while they carry their build record; a child's batches are checked against the dataset
before it is timed (a wrong frame fails the run).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)


def child(kind: str, arg: str, n: int, seconds: float) -> dict:
    """One measurement in this process: ``kind`` "store" (``arg`` its path) or "peer"."""
    if kind == "store":
        from benchmarks.modes.dreamer import verify_store

        import mmreplay
        s = mmreplay.Store.open(arg, mode="r", cache_bytes=200_000_000)  # the decoded cache off: batches decode
        checked = verify_store(s, 2)
        if checked["wrong_frames"] or checked["wrong_steps"]:
            raise SystemExit(f"wrong rows: {checked}")
        smp = s.sampler(16, mmreplay.Sequences(64), seed=1)
        draw = smp.__next__
    else:
        from benchmarks.peers.dreamer_replay import DreamerReplay
        rb = DreamerReplay(n, 64)
        draw = lambda: rb.sample(16)
    t_end = time.perf_counter() + 2.0
    while time.perf_counter() < t_end:
        draw()
    c0, t0, k = time.process_time(), time.perf_counter(), 0
    while time.perf_counter() - t0 < seconds:
        draw()
        k += 1
    dt, dc = time.perf_counter() - t0, time.process_time() - c0
    return {"per_s": k / dt, "cpu_ms_a_batch": dc / k * 1e3, "batches": k, "load": os.getloadavg()[0]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=40_000)
    p.add_argument("--runs", default="32,16,8", help="delta-lz4 run lengths, one store each")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--seconds", type=float, default=6.0)
    p.add_argument("--workdir", default="/tmp/mmreplay_bench")
    p.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(child(a.child[0], a.child[1], a.n, a.seconds)))
        return
    from benchmarks.dreamer_data import build, store_path
    from benchmarks.ltr_data import built
    systems = []
    for run in (int(r) for r in a.runs.split(",")):
        codec = json.dumps({"name": "delta-lz4", "run": run})
        path = store_path(a.workdir, a.n, codec)
        if built(path) is None:
            build(path, a.n, codec)
        systems.append((f"delta-lz4 run {run}", "store", path))
    systems.append((f"DreamerV3-style replay {a.n:,}", "peer", "-"))
    results: dict[str, list] = {name: [] for name, _, _ in systems}
    for rnd in range(a.rounds):
        for name, kind, arg in systems:
            out = subprocess.run([sys.executable, __file__, "--n", str(a.n), "--seconds", str(a.seconds),
                                  "--child", kind, arg], capture_output=True, text=True, check=True)
            r = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(r)
            print(f"r{rnd} {name}: {r['per_s']:.1f} batches/s, CPU {r['cpu_ms_a_batch']:.2f} ms a batch "
                  f"(load {r['load']:.1f})", flush=True)
    print("\n| system | CPU ms a batch (rounds) | batches/s (rounds) |\n|---|---:|---:|")
    for name, rs in results.items():
        cpu = " / ".join(f"{r['cpu_ms_a_batch']:.2f}" for r in rs)
        rate = " / ".join(f"{r['per_s']:.0f}" for r in rs)
        print(f"| {name} | {cpu} | {rate} |")


if __name__ == "__main__":
    main()
