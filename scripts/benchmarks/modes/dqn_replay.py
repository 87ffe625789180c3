"""``--dqn-replay``: the DQN Replay Dataset of one game (issue #42), imported and sampled in bounded RAM.

    python scripts/bench.py --dqn-replay --checkpoints 2 [--dqn-rows 1000000] [--json out.json]

1. ``--checkpoints N`` Dopamine checkpoints of ``--dqn-rows`` rows each (the dataset has 50 of 1M), written
   from real Atari frames exactly as Dopamine's ``save`` writes them (``dqn_data``: the atari10m pool's
   episodes, cycled; written once into the workdir and reused, checkpoint by checkpoint).
2. ``mmreplay import --format dqn-replay`` of all N in a child, its progress bar on the terminal
   (``scripts/measure_dqn_replay.measure_import``): wall time, transitions/s, CPU seconds a transition
   (import and encoder child), the process tree's peak RSS and PSS, bytes a transition on disk.
3. Batch-32 sampling, interleaved rounds of two fresh children:
   ``mmreplay`` the imported store in a ``--dqn-limit`` (4 GB) memory cgroup (page cache dropped first and
                charged there), default settings, uniform draws; then ``--dqn-verify-batches`` batches of
                256, every row (obs stack, next stack, action, reward, terminal) checked against the run.
   ``1% loader`` what the offline code bases do (d4rl-atari / d3rlpy, the Decision Transformer's and CQL's
                Atari loaders): ``--dqn-subset`` (500k) rows of the checkpoint arrays in RAM as numpy
                arrays (padding rows included, as Dopamine's arrays hold them), stacks of 4 gathered by
                index (the zero padding rows make episode starts right), torch tensors out; not constrained.

Invariant: every figure comes from a child; the cgroup is removed whatever happens; a wrong row is counted,
never skipped.
"""
from __future__ import annotations

import os
import shutil
import time

import numpy as np

from ..cgroup import make_memory_cgroup, read_cgroup_stats, remove_cgroup
from ..measure import child_setup, drop_caches, log, peak_rss_bytes, rate_windows
from ..runner import aggregate_runs
from ..tables import _f, table
from .base import Mode
from .ltr_checks import warm_up

FULL_RUN = 50  # checkpoints of the dataset, per game and run


class DqnReplayMode(Mode):
    key = "dqn_replay"
    exclusive = True

    def add_arguments(self, p) -> None:
        p.add_argument("--dqn-replay", action="store_true", help="the DQN Replay Dataset workload (issue #42)")
        p.add_argument("--checkpoints", type=int, default=None,
                       help="--dqn-replay: Dopamine checkpoints to write and import (the dataset: 50; default 2)")
        p.add_argument("--dqn-rows", type=int, default=None, help="rows a checkpoint (default 1000000; quick 20000)")
        p.add_argument("--dqn-limit", type=lambda v: int(float(v)), default=4_000_000_000,
                       help="memory cgroup of the store's sampling child, bytes (default 4e9)")
        p.add_argument("--dqn-subset", type=int, default=None, help="rows the 1%% loader holds (default 500000; "
                       "quick 20000)")
        p.add_argument("--dqn-repeats", type=int, default=None, help="sampling rounds (default 2; quick 1)")
        p.add_argument("--dqn-gzip-level", type=int, default=6, help="gzip level of the written checkpoints "
                       "(Dopamine's save: 9; default 6, the same format, written 4.5x faster)")
        p.add_argument("--dqn-verify-batches", type=int, default=None, help="batches of 256 checked (default 40)")
        p.add_argument("--dqn-distinct", type=int, default=None, help="write only this many distinct checkpoints; "
                       "the others are hard links of them, each with its own add_count (benchmarks/dqn_linked.py: "
                       "the whole run of 50 from 3 in ~6 min of writing instead of ~100; default: all distinct)")
        p.add_argument("--dqn-warm-s", type=float, default=0.0, help="seconds the store's child samples after "
                       "the warm-up before its windows (a store larger than the cgroup fills its page cache "
                       "and tier for ~30-60 s; default 0)")

    def finish_args(self, a, quick: bool, argv: list[str]) -> None:
        a.checkpoints = a.checkpoints or 2
        a.dqn_rows = a.dqn_rows or (20_000 if quick else 1_000_000)
        a.dqn_subset = a.dqn_subset or (20_000 if quick else 500_000)
        a.dqn_repeats = a.dqn_repeats or (1 if quick else 2)
        a.dqn_verify_batches = a.dqn_verify_batches or (4 if quick else 40)
        if a.dqn_distinct is not None and not 1 <= a.dqn_distinct <= a.checkpoints:
            raise SystemExit(f"--dqn-distinct {a.dqn_distinct}: expected 1..--checkpoints ({a.checkpoints})")
        if a.dqn_distinct == a.checkpoints:
            a.dqn_distinct = None  # all distinct: nothing to link

    def requested(self, a) -> bool:
        return a.dqn_replay

    def run(self, runner) -> dict:
        return run(runner, runner.args)

    def report(self, part: dict, results: dict, args) -> list[str]:
        return [f"\n== dqn-replay: {part['checkpoints']} Dopamine checkpoints of {part['rows']:,} rows ==",
                report(part)]

    def targets(self, part: dict, args, add) -> None:
        imp, s = part.get("import", {}), part.get("summary", {})
        n = imp.get("transitions")
        add(f"dqn-replay import of {n or 0:,}: transitions/s (2 cores, shared)", imp.get("transitions_per_s"),
            10_000, unit="/s")
        # issue #42: <= 1 GB of peak RSS, read as 10^9 bytes (953.7 MiB; the figures are MiB)
        add("dqn-replay import: peak RSS (sum of VmHWM) of the import's processes, MiB",
            imp.get("peak_rss_hwm_sum_mb"), 953.7, unit="MiB", le=True)
        model = memory_model(part)
        if model:
            add(f"dqn-replay import of the whole run (~{model['transitions'] / 1e6:.0f}M): peak RSS, index-only "
                "model (a lower bound), MiB", model["rss_mb"], 953.7, unit="MiB", le=True)
        add("dqn-replay bytes a transition on disk", imp.get("store_bytes_per_transition"), 120, unit="B", le=True)
        add(f"dqn-replay b32 in {part['limit_bytes'] / 1e9:.0f} GB vs the 1% loader in RAM", s.get("b32_ratio"), 1.0)
        add("dqn-replay sampled rows wrong", s.get("wrong"), 0, unit="rows", le=True)

    def reaggregate(self, part: dict, args) -> None:
        part["summary"] = summarize(part["runs"])


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def task_write(spec: dict) -> dict:
    """The checkpoints the import reads: all written, or ``distinct`` written and the rest linked to them."""
    from ..dqn_data import ensure_checkpoints
    from ..dqn_linked import link_checkpoints
    distinct = spec.get("distinct")
    recs = ensure_checkpoints(spec["src"], spec["rows"], distinct or spec["n"], spec["gzip_level"])
    if distinct:
        link_checkpoints(spec["src"], spec["linked"], spec["rows"], distinct, spec["n"])
    return {"checkpoints": recs}


def ground_truth(spec: dict):
    """The run a store imported by ``run`` holds (``DopamineRun``, or ``LinkedRun`` when checkpoints are linked)."""
    from ..dqn_data import DopamineRun
    from ..dqn_linked import LinkedRun
    distinct = spec.get("distinct")
    return LinkedRun(spec["rows"], distinct, spec["n"]) if distinct else DopamineRun(spec["rows"])


def task_import(spec: dict) -> dict:
    from measure_dqn_replay import measure_import  # scripts/, on the path of bench.py
    shutil.rmtree(spec["store"], ignore_errors=True)
    return measure_import(spec["src"], spec["store"], f"0-{spec['n'] - 1}", stream_progress=True)


def task_store(spec: dict) -> dict:
    """The imported store in the cgroup: warm batch-32 windows (default settings), then every verified row."""
    child_setup(tune=False)
    import mmreplay

    res = {"page_cache_dropped": drop_caches()}
    t0 = time.perf_counter()
    s = mmreplay.Store.open(spec["path"], mode="r")
    res["open_s"], res["stored"] = time.perf_counter() - t0, len(s)
    smp = s.sampler(32, seed=32, name="b32")
    res["warm_hit_rate"] = warm_up(s, smp, spec["window_s"], spec["warm_max_s"])
    if spec.get("warm_s"):  # a store larger than the cgroup: its page cache and tier fill meanwhile
        res["warm_rates"] = rate_windows(smp.__next__, max(1, int(spec["warm_s"] // 10)), 10.0, 0.0)
    rates = rate_windows(smp.__next__, spec["windows"], spec["window_s"], 0.5)
    res["b32_per_s"], res["b32_windows"] = float(np.median(rates)), rates
    smp.close()
    res["peak_rss_sampling"] = peak_rss_bytes()
    run = ground_truth(spec)
    res.update(verify_store(s, run, spec["verify_batches"]))
    if hasattr(run, "checkpoint_starts"):  # linked: every transition whose stacks cross a checkpoint's join
        res.update(verify_rows(s, run, run.checkpoint_starts()[:, None] + np.arange(-6, 6)))
    res["peak_rss"] = peak_rss_bytes()
    if spec.get("cgroup_dir"):
        res["cgroup"] = read_cgroup_stats(spec["cgroup_dir"])
    s.close()
    return res


def verify_store(store, run, batches: int, batch: int = 256) -> dict:
    """Sampled rows (obs stack, next stack, action, reward, terminal) against the run (``DopamineRun.truth``)."""
    wrong, checked, smp = 0, 0, store.sampler(batch, seed=777, name="verify")
    for _ in range(batches):
        b = next(smp)
        ok = rows_equal(b, run.truth(b.indices.numpy()))
        wrong += int((~ok).sum())
        checked += len(ok)
    smp.close()
    return {"verified": checked, "wrong": wrong}


def verify_rows(store, run, t: np.ndarray) -> dict:
    """Transitions ``t`` (those stored), read by id and compared with the run, as ``verify_store`` does."""
    t = np.unique(t[(t >= 0) & (t < store.num_added)])
    wrong = 0
    for lo in range(0, t.size, 256):
        ids = t[lo:lo + 256]
        wrong += int((~rows_equal(store.inspect.get(ids), run.truth(ids))).sum())
    return {"joins_checked": int(t.size), "joins_wrong": wrong}


def rows_equal(b, exp: dict) -> np.ndarray:
    """Per row of batch ``b``: obs stack, next stack, action, reward and terminal all equal to ``exp``'s."""
    ok = np.ones(len(exp["action"]), bool)
    for key, got in (("obs", b.obs), ("next_obs", b.next_obs)):
        ok &= (got.numpy() == exp[key]).reshape(len(ok), -1).all(axis=1)
    ok &= (b.action.numpy().reshape(-1) == exp["action"]) & (b.reward.numpy().reshape(-1) == exp["reward"])
    return ok & (b.terminated.numpy().reshape(-1).astype(bool) == exp["terminal"])


def subset_sampler(data: dict, seed: int = 32, batch: int = 32):
    """The 1% loader's draw: ``next()`` gives obs stacks, action, reward, next stacks, terminal (torch) and the
    subset rows drawn. Uniform over Dopamine's ``is_valid_transition`` (update horizon 1): no terminal in a
    stack before its last row (which leaves out the padding rows after each terminal), a next row held."""
    import torch

    from ..dqn_data import STACK
    obs, action, reward, terminal = data["observation"], data["action"], data["reward"], data["terminal"]
    n = len(action)
    ended = np.convolve(terminal.astype(np.int64), np.ones(STACK - 1, np.int64))[:n]  # terminals in rows i-2..i
    valid = np.arange(STACK - 1, n - 1)
    valid = valid[ended[valid - 1] == 0]
    rng = np.random.default_rng(seed)
    back, ahead = np.arange(-STACK + 1, 1), np.arange(-STACK + 2, 2)

    def draw():
        while True:
            i = valid[rng.integers(0, valid.size, batch)]
            yield (torch.from_numpy(obs[i[:, None] + back]), torch.from_numpy(action[i].astype(np.int64)),
                   torch.from_numpy(reward[i]), torch.from_numpy(obs[i[:, None] + ahead]),
                   torch.from_numpy(terminal[i].astype(bool)), i)

    return draw(), int(valid.size)


def task_subset_loader(spec: dict) -> dict:
    """The 1% loader: the subset's arrays in RAM, stacks of 4 gathered by index (padding rows are zero frames,
    so episode starts need no mask), torch tensors (``subset_sampler``)."""
    child_setup(tune=spec.get("tune_malloc", True))
    from ..dqn_data import DopamineRun
    t0 = time.perf_counter()
    data = DopamineRun(spec["rows"]).subset(spec["n"])
    draw, valid = subset_sampler(data)
    res = {"load_s": time.perf_counter() - t0, "rows": spec["n"], "transitions": valid}
    rates = rate_windows(draw.__next__, spec["windows"], spec["window_s"], max(spec["warmup_s"], 1.0))
    res["b32_per_s"], res["b32_windows"] = float(np.median(rates)), rates
    res["peak_rss"] = peak_rss_bytes()
    return res


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def run(runner, a) -> dict:
    src = os.path.join(runner.workdir, f"dqn_replay_dopamine_{a.dqn_rows}")
    out = {"checkpoints": a.checkpoints, "rows": a.dqn_rows, "limit_bytes": a.dqn_limit, "subset": a.dqn_subset,
           "source": src}
    linked = f"{src}_linked{a.dqn_distinct}x{a.checkpoints}" if a.dqn_distinct else None
    out["distinct"] = a.dqn_distinct
    written = runner.child({"task": "dqn_write", "src": src, "rows": a.dqn_rows, "n": a.checkpoints,
                            "gzip_level": a.dqn_gzip_level, "distinct": a.dqn_distinct, "linked": linked},
                           label=f"dqn-replay/write {a.checkpoints} checkpoints", timeout=24 * 3600)
    if "error" in written:
        return {**out, "error": written["error"]}
    out["written"] = written
    store = os.path.join(runner.workdir, f"dqn_replay_store_{a.dqn_rows}x{a.checkpoints}")
    out["import"] = runner.child({"task": "dqn_import", "src": linked or src, "store": store, "n": a.checkpoints},
                                 label=f"dqn-replay/import {a.checkpoints} checkpoints", timeout=24 * 3600)
    if "error" in out["import"]:
        return out
    imp = out["import"]
    log(f"[dqn-replay] imported {imp['transitions']:,} transitions: {imp['transitions_per_s']:,}/s, "
        f"{imp['cpu_us_per_transition']} us CPU each, peak PSS {imp['peak_pss_tree_mb']} MB, "
        f"{imp['store_bytes_per_transition']} B each")
    base = {"rows": a.dqn_rows, "windows": a.windows, "window_s": a.window_s, "warmup_s": a.warmup_s,
            "warm_max_s": a.warm_max_s, "n": a.checkpoints, "distinct": a.dqn_distinct, "warm_s": a.dqn_warm_s}
    runs = {"mmreplay": [], "loader": []}
    cg = make_memory_cgroup(a.dqn_limit, f"mmreplay_dqn_{os.getpid()}")
    try:
        for rnd in range(a.dqn_repeats):
            runs["loader"].append(runner.child({**base, "task": "dqn_loader", "n": a.dqn_subset, "distinct": None},
                                               label=f"dqn-replay/1% loader {a.dqn_subset:,} r{rnd}",
                                               timeout=a.child_timeout))
            runs["mmreplay"].append(runner.child({**base, "task": "dqn_store", "path": store,
                                                  "verify_batches": a.dqn_verify_batches},
                                                 cgroup=cg, label=f"dqn-replay/mmreplay in cgroup r{rnd}",
                                                 timeout=a.child_timeout))
    finally:
        remove_cgroup(cg)
    out["runs"] = runs
    out["summary"] = summarize(runs)
    if not a.keep_stores:
        shutil.rmtree(store, ignore_errors=True)
    return out


def summarize(runs: dict) -> dict:
    mm, peer = aggregate_runs(runs["mmreplay"]), aggregate_runs(runs["loader"])
    ok = [r for r in runs["mmreplay"] if "error" not in r]
    out = {"mmreplay": mm, "loader": peer,
           "wrong": sum(r.get("wrong", 0) + r.get("joins_wrong", 0) for r in ok) if ok else None,
           "verified": sum(r.get("verified", 0) + r.get("joins_checked", 0) for r in ok)}
    a, b = mm.get("b32_per_s"), peer.get("b32_per_s")
    out["b32_ratio"] = a / b if a and b else None
    return out


def memory_model(part: dict) -> dict | None:
    """A lower bound of the import's peak memory for the whole run (``FULL_RUN`` checkpoints of this size): this
    import's peak plus the index's measured bytes a transition for the rest of the run (the store is sized
    from the checkpoints' rows, so the index never doubles). Not the whole growth: over the whole 50M run
    (docs/datasets.md, `5603d00`) the import's RSS grew ~14.3 B a transition, ~0.8 B more than the index."""
    imp = part.get("import", {})
    n, per = imp.get("transitions"), imp.get("index_bytes_per_transition")
    if not n or per is None or "peak_rss_hwm_sum_mb" not in imp:
        return None
    full = FULL_RUN * n / part["checkpoints"]
    more = per * (full - n) / 2**20
    return {"transitions": full, "index_bytes_per_transition": per,
            "rss_mb": round(imp["peak_rss_hwm_sum_mb"] + more), "pss_mb": round(imp["peak_pss_tree_mb"] + more)}


def report(part: dict) -> str:
    if "error" in part:
        return f"error: {part['error'].strip().splitlines()[-1]}"
    imp, s = part.get("import", {}), part.get("summary", {})
    lines = [table(["transitions", "seconds", "transitions/s", "CPU us each", "peak RSS tree MB",
                    "peak PSS tree MB", "sum of VmHWM MB", "index B each", "B each on disk", "load avg"],
                   [[f"{imp.get('transitions', 0):,}", imp.get("seconds"), _f(imp.get("transitions_per_s")),
                     imp.get("cpu_us_per_transition"), imp.get("peak_rss_tree_mb"), imp.get("peak_pss_tree_mb"),
                     imp.get("peak_rss_hwm_sum_mb"), imp.get("index_bytes_per_transition"),
                     imp.get("store_bytes_per_transition"),
                     f"{imp.get('loadavg_start') or 0:.1f}-{imp.get('loadavg_end') or 0:.1f}"]])]
    if "error" in imp:
        return lines[0] + f"\nimport error: {imp['error'].strip().splitlines()[-1]}"
    model = memory_model(part)
    if model:
        lines.append(f"memory of the whole run (~{model['transitions'] / 1e6:.1f}M), at least: peak RSS ~{model['rss_mb']} "
                     f"MB (sum of VmHWM), PSS ~{model['pss_mb']} MB: this import's peak plus "
                     f"{model['index_bytes_per_transition']} B of index a transition for the rest (a lower bound)")
    rows = []
    for name, key in ((f"mmreplay, {part['limit_bytes'] / 1e9:.0f} GB cgroup", "mmreplay"),
                      (f"1% loader {part['subset']:,} in RAM", "loader")):
        r = s.get(key, {})
        rows.append([name, _f(r.get("b32_per_s")), _f(r.get("peak_rss"), "mib"),
                     _f(r.get("other_cpu_cores"), "rate") if r.get("other_cpu_cores") is not None else "-"])
    lines += ["", table(["system", "b32/s", "peak RSS MiB", "other CPU"], rows),
              f"b32 ratio {_f(s.get('b32_ratio'), 'x')}; rows verified {s.get('verified', 0):,}, "
              f"wrong {s.get('wrong')}"]
    n = imp.get("transitions") or 0
    if n and imp.get("seconds"):
        per = imp["store_bytes_per_transition"]
        full = FULL_RUN * part["rows"] * n / (part["checkpoints"] * part["rows"])
        lines.append(f"the whole run ({FULL_RUN} checkpoints, ~{full / 1e6:.0f}M transitions) at this rate: "
                     f"~{full / imp['transitions_per_s'] / 60:.0f} min of import, ~{full * per / 1e9:.1f} GB of store")
    return "\n".join(lines)


TASKS = {"dqn_write": task_write, "dqn_import": task_import, "dqn_store": task_store,
         "dqn_loader": task_subset_loader}
DqnReplayMode.tasks = TASKS
