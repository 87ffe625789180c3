"""The peers' self-test and quick benchmark (``python scripts/peers.py``): every peer of ``benchmarks.peers``
filled with a synthetic episodic stream, overwritten once, sampled, and its stacks checked.

Invariant: each (peer, config) runs in a fresh spawned process, so allocator state and RSS baselines are
that peer's alone; the figures are a smoke test of the adapters, not the benchmark (``scripts/bench.py``).
"""
from __future__ import annotations

import argparse
import itertools
import multiprocessing as mp
import time
from concurrent.futures import ProcessPoolExecutor

import numpy as np
import torch

from . import peers
from .measure import rate_windows, tune_malloc
from .sources import synthetic_stream


def _add_range(rb, data, a, b):
    for i in range(a, b):
        rb.add_batch(data["obs"][i], data["action"][i], data["reward"][i],
                     data["next_obs"][i], data["terminated"][i],
                     data["truncated"][i])


def _bench_one(kind, n, n_envs, atari, malloc_tune=True, threads=1, chunks=5,
               sample_repeats=7, sample_seconds=0.25):
    """One peer, one config; meant to run in a fresh process (allocator and
    RSS baselines are then not polluted by earlier peers)."""
    import logging

    import psutil
    if malloc_tune:
        tune_malloc()
    torch.set_num_threads(threads)
    if kind.startswith("torchrl"):
        import torchrl  # noqa: F401  (its import sets its own log level, which we lower)
        logging.getLogger("torchrl").setLevel(logging.WARNING)
    if atari:
        shape, dtype, S, nA = (84, 84), np.uint8, 4, 6
    else:
        shape, dtype, S, nA = (4,), np.float32, 1, 2
    steps = n // n_envs
    data = synthetic_stream(steps, n_envs, shape, dtype, S, n_actions=nA)
    proc = psutil.Process()
    rss0 = proc.memory_info().rss
    rb = peers.make(kind, steps * n_envs, shape, dtype, n_envs, S, n_actions=nA)
    t0 = time.perf_counter()
    _add_range(rb, data, 0, steps)              # lap 1: first fill
    fill = steps * n_envs / (time.perf_counter() - t0)
    rss1 = proc.memory_info().rss
    add_rates = []                              # lap 2: overwrite, steady state
    bounds = np.linspace(0, steps, chunks + 1).astype(int)
    for a, b in itertools.pairwise(bounds):
        t0 = time.perf_counter()
        _add_range(rb, data, a, b)
        add_rates.append((b - a) * n_envs / (time.perf_counter() - t0))
    res = {"peer": kind, "stored": len(rb), "fill/s": fill,
           "add/s": float(np.median(add_rates)), "rss_MB": (rss1 - rss0) / 2 ** 20}
    if kind == "torchrl":
        res["disk_MB"] = rb.disk_bytes() / 2 ** 20
    for B in (32, 256):  # one warm-up call, then the windows
        rates = rate_windows(lambda B=B: rb.sample(B), sample_repeats, sample_seconds, 0.0)
        res[f"b{B}/s"] = float(np.median(rates))
    res["stack_err"] = peers.check_peer(rb, S)
    rb.close()
    return res


def _print_table(rows, title):
    cols = ["peer", "stored", "fill/s", "add/s", "b32/s", "b256/s", "rss_MB",
            "disk_MB", "stack_err"]
    print(f"\n{title}")
    print(" ".join(f"{c:>10s}" for c in cols))
    for r in rows:
        cells = []
        for c in cols:
            v = r.get(c, "")
            if isinstance(v, float):
                v = f"{v:.3f}" if c == "stack_err" else f"{v:,.0f}"
            cells.append(f"{v!s:>10s}")
        print(" ".join(cells), flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description="Self-test / quick benchmark of the peers.")
    p.add_argument("--n", type=int, default=20_000, help="transitions (= capacity)")
    p.add_argument("--n-envs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--peers", nargs="+", default=list(peers.KINDS))
    p.add_argument("--threads", type=int, default=1,
                   help="torch.set_num_threads in each run (default 1)")
    p.add_argument("--no-malloc-tune", action="store_true",
                   help="skip tune_malloc() (glibc defaults; see its docstring)")
    p.add_argument("--no-lowdim", action="store_true")
    a = p.parse_args(argv)
    print(f"torch {torch.__version__}, threads={a.threads}, malloc_tune="
          f"{not a.no_malloc_tune}, n={a.n} transitions = capacity; "
          f"one fresh process per peer and config")
    ctx = mp.get_context("spawn")
    for E in a.n_envs:
        for atari in ((True,) if a.no_lowdim else (True, False)):
            rows = []
            for k in a.peers:
                with ProcessPoolExecutor(1, mp_context=ctx) as ex:
                    rows.append(ex.submit(_bench_one, k, a.n, E, atari,
                                          not a.no_malloc_tune, a.threads).result())
            _print_table(rows, ("Atari-shaped: 4x84x84 uint8 stacks" if atari
                                else "Low-dim: obs (4,) float32") + f", n_envs={E}")
    print("\nfill/s = transitions/s while first filling the empty buffer; add/s = "
          "transitions/s overwriting a full one (median of 5 chunks); b32/s, b256/s "
          "= sampled batches/s (median of 7 x 0.25 s); rss_MB = RSS growth while "
          "filling (torchrl: its memmap pages); disk_MB = torchrl scratch files; "
          "stack_err = fraction of a 256-sample where next_obs[:, :-1] != obs[:, 1:] "
          "(SB3 > 0 is expected: episode ends)")


if __name__ == "__main__":
    main()
