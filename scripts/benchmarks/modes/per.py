"""``--per``: prioritized replay, mmreplay against cpprb's ``PrioritizedReplayBuffer`` and TorchRL's
``PrioritizedSampler``, on Atari (one env) and low-dim (8 envs); the figure is learner steps/s, one step =
``sample(B)`` with IS weights (beta 0.4) + ``update_priorities`` of the batch.

Invariant: every system does the same learner step on the same inputs, each in its own fresh child.
"""
from __future__ import annotations

import os
import shutil

import numpy as np

from ..measure import peak_rss_bytes, rate_windows
from ..tables import _f, md_table, table
from ..runner import MiB, aggregate_runs
from ..sources import make_lowdim_data
from ..tasks_mmreplay import task_mm_fill
from ..tasks_peers import peer_fill
from .base import Mode
from .workloads import TITLES
from mmreplay.sampling.strategy import Prioritized

PER_SYSTEMS = ("mmreplay", "cpprb_per", "torchrl_per")


def task_per(spec: dict) -> dict:
    """Prioritized replay, one system: fill, then time the learner's step, ``sample(B)`` (with IS
    weights, beta 0.4) + ``update_priorities(indices, new priorities)``, for each batch size."""
    rng = np.random.default_rng(0)
    if spec["system"] == "mmreplay":
        import mmreplay
        res = task_mm_fill(spec)
        store = mmreplay.Store.open(spec["path"], mode="r", cache_bytes=spec["cache_bytes"])
        close = store.close
        samplers = {B: store.sampler(B, Prioritized(alpha=0.6, beta=0.4), seed=B, prefetch=0, name=f"b{B}")
                    for B in spec["batch_sizes"]}

        def step(B):
            smp = samplers[B]
            batch = next(smp)
            smp.update_priorities(batch.indices, rng.random(B) + 1e-3)
    else:
        rb, res, scratch, _ = peer_fill(spec)

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


class PerMode(Mode):
    key = "per"
    exclusive = True
    tasks = {"per": task_per}

    def add_arguments(self, p) -> None:
        p.add_argument("--per", action="store_true", help="run only the prioritized-replay comparison (mmreplay vs "
                       "cpprb PrioritizedReplayBuffer vs TorchRL PrioritizedSampler; Atari and low-dim)")

    def requested(self, a) -> bool:
        return a.per

    def run(self, runner) -> dict:
        return run_per(runner)

    def report(self, part: dict, results: dict, args) -> list[str]:
        out = []
        for name, per in part.items():
            out.append(f"\n== prioritized replay, {TITLES[name].split(':')[0].split(' (')[0]}: N = {per['n']:,}, "
                       f"n_envs = {per['n_envs']}; learner steps/s = sample(B, beta=0.4) + update_priorities(B) ==")
            out.append(per_table(per, args.batch_sizes))
        return out

    def targets(self, part: dict, args, add) -> None:
        for wl, per in part.items():
            systems = per["systems"]
            for B in args.batch_sizes:
                mine = systems.get("mmreplay", {}).get(f"b{B}_per_s")
                peer_rates = [systems.get(k, {}).get(f"b{B}_per_s") for k in PER_SYSTEMS[1:]]
                best = max((r for r in peer_rates if r), default=None)
                add(f"PER {wl} {per['n']:,}: batch-{B} steps/s >= 1x the faster peer",
                    mine / best if mine and best else None, 1.0)


def run_per(runner) -> dict:
    """Prioritized replay: for Atari (single env) and low-dim (8 envs), each system in its own child,
    rounds interleaved; the figure is learner steps/s (sample + update_priorities)."""
    a = runner.args
    out = {}
    for wl in ("atari", "lowdim"):
        if wl == "lowdim":
            n, E, data = a.lowdim_n, 8, make_lowdim_data(runner.workdir, a.lowdim_n, 8)
        else:
            n, E, data = a.atari_n, 1, None
        n = (n // E) * E
        base = {"task": "per", "workload": wl, "n": n, "n_envs": E, "batch_sizes": list(a.batch_sizes),
                "data": data, "path": os.path.join(runner.workdir, f"store_per_{wl}_{n}"),
                "cache_bytes": a.cache_mib[-1] * MiB, **runner.rate_spec()}
        runs: dict[str, list] = {}
        for rnd in range(a.repeats):
            for system in PER_SYSTEMS:
                runs.setdefault(system, []).append(runner.child(
                    {**base, "system": system},
                    label=f"per/{wl}/{system} (round {rnd + 1}/{a.repeats})", timeout=a.child_timeout))
        if not a.keep_stores:
            shutil.rmtree(base["path"], ignore_errors=True)
        out[wl] = {"n": n, "n_envs": E, "cache_bytes": base["cache_bytes"],
                   "systems": {k: aggregate_runs(v, a.quiet_cores) for k, v in runs.items()}}
    return out


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
