#!/usr/bin/env python
"""Two versions of mmreplay sampled the same way, interleaved: does a change regress the sampling rates?

    python scripts/bench_ab.py --old 0e26cf5 [--new HEAD|worktree] [--rounds 3] [--json out.json]

Each version is ``git archive``d into the workdir (the working tree is used for ``--new worktree``, the
default). Every version builds its own stores once per workload, with its own code (bench.py's fill task):
100k and 1M real Atari transitions (stack 4, the library's default codec and budget) and 1M CartPole
transitions (8 envs). Then each round runs, for every workload, one fresh child per version (the order
alternates between rounds), which opens its store, waits for the background pass that fills the
compressed tier, and times, in windows after a warm-up:

- uniform batch 32 and 256 (Atari 1M: the budget the library picks by default);
- prioritized (alpha 0.6, beta 0.4) batch 32 with a priority update after each batch;
- n-step 3 (gamma 0.99) batch 32 (Atari) or 256 (low-dim);
- sequences of 80 steps, batch 32.

The old sampling API (keyword flags, ``sequence_sampler``) and the new one (draw strategies) are both
understood. Reported: each rate's median over the rounds' windows per version, and new/old. This box is
shared and noisy: the interleaving puts both versions under the same load; read ratios, not absolutes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)

WORKLOADS = {  # name: (bench.py workload, transitions, n_envs)
    "atari100k": ("atari", 100_000, 1),
    "atari1m": ("atari", 1_000_000, 1),
    "lowdim1m": ("lowdim", 1_000_000, 8),
}


def modes(workload: str) -> list[tuple[str, dict]]:
    """(label, draw) pairs timed for ``workload``; ``draw`` is version-neutral and made in the child."""
    big = 256 if workload == "lowdim1m" else 32
    out = [("uniform b32", {"kind": "uniform", "B": 32}), ("uniform b256", {"kind": "uniform", "B": 256})]
    if workload != "atari1m":
        out += [(f"PER b{big}", {"kind": "per", "B": big}), (f"n-step 3 b{big}", {"kind": "nstep", "B": big}),
                ("sequences 80 b32", {"kind": "seq", "B": 32})]
    return out


# -- the child ---------------------------------------------------------------------------------------
def make_sampler(store, mm, d: dict, name: str):
    """The sampler of ``d`` in whichever API this mmreplay has."""
    B, kind = d["B"], d["kind"]
    if hasattr(mm, "Uniform"):  # draw strategies
        draw = {"uniform": None, "per": mm.Prioritized(alpha=0.6, beta=0.4),
                "nstep": mm.NStep(3, 0.99), "seq": mm.Sequences(80)}[kind]
        return store.sampler(B, draw, seed=1, prefetch=0, name=name)
    if kind == "seq":
        return store.sequence_sampler(B, 80, seed=1, prefetch=0, name=name)
    flags = {"uniform": {}, "per": {"prioritized": True, "alpha": 0.6, "beta": 0.4},
             "nstep": {"n_step": 3, "gamma": 0.99}}[kind]
    return store.sampler(B, seed=1, prefetch=0, name=name, **flags)


def wait_for_tier(store, limit_s: float = 120.0) -> float:
    """Seconds until the background pass that fills the compressed tier after open has ended (either
    version's API): the rates then time sampling, not the fill (which ``bench.py --larger-than-ram``'s first
    10 s measure). A 1M Atari store's 480 MB took ~3-5 s here, inside the first mode's windows otherwise."""
    stats = getattr(store, "cache_stats", None) or store.inspect.cache_stats
    t0 = time.perf_counter()
    while any(c.get("compressed", {}).get("loading") for c in stats().values()):
        if time.perf_counter() - t0 > limit_s:
            break
        time.sleep(0.05)
    return time.perf_counter() - t0


def child_fill(spec: dict) -> dict:
    """Create and fill a store with this version's code: single ``add`` calls for Atari (as an env loop
    gives them), ``extend`` of 8 rows for low-dim."""
    sys.path.insert(0, spec["src"])
    sys.path.insert(1, HERE)
    import numpy as np
    from gymnasium import spaces

    import mmreplay as mm
    from benchmarks.measure import dir_bytes
    from benchmarks.sources import ATARI_ACTIONS, AtariSource, atari_chunks
    assert mm.__file__.startswith(spec["src"]), (mm.__file__, spec["src"])
    n, path = spec["n"], spec["path"]
    if spec["workload"] == "lowdim":
        data = np.load(spec["data"])
        store = mm.Store.create(path, spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2),
                                capacity=n)
        cols = [data[k] for k in ("obs", "action", "reward", "next_obs", "terminated", "truncated")]
        for t in range(cols[0].shape[0]):
            store.extend(*(c[t] for c in cols))
    else:
        store = mm.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(ATARI_ACTIONS),
                                capacity=n, frame_stack=4, reward_values=(-1, 0, 1))
        for steps, d in atari_chunks(AtariSource(), n, 1, stacks=False):
            o, no = d["obs"][:, 0], d["next_obs"][:, 0]
            a, r = d["action"][:, 0].tolist(), d["reward"][:, 0].tolist()
            te, tr = d["terminated"][:, 0].tolist(), d["truncated"][:, 0].tolist()
            for t in range(steps):
                store.add(o[t], a[t], r[t], no[t], te[t], tr[t])
    store.close()
    return {"disk_bytes": dir_bytes(path)}


def child(spec: dict) -> dict:
    sys.path.insert(0, spec["src"])
    sys.path.insert(1, HERE)
    import numpy as np
    import torch

    import mmreplay as mm
    from benchmarks.measure import rate_windows, tune_malloc
    tune_malloc()
    assert mm.__file__.startswith(spec["src"]), (mm.__file__, spec["src"])
    out = {"mmreplay": mm.__file__}
    with mm.Store.open(spec["path"], mode="r") as store:
        out["fill_s"] = wait_for_tier(store)
        for i, (label, d) in enumerate(modes(spec["workload"])):
            smp = make_sampler(store, mm, d, name=f"ab{i}")
            if d["kind"] == "per":
                def step(smp=smp):
                    b = smp.sample()
                    smp.update_priorities(b.indices, torch.rand(len(b.indices)) + 0.01)
            else:
                step = smp.sample
            rates = rate_windows(step, spec["windows"], spec["window_s"], spec["warmup_s"])
            out[label] = float(np.median(rates))
            out[label + " windows"] = rates
            smp.close()
    return out


# -- the parent --------------------------------------------------------------------------------------
def source(rev: str, workdir: str) -> str:
    """A folder holding ``mmreplay/`` as of ``rev`` (``worktree``: this checkout itself)."""
    if rev == "worktree":
        return REPO
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = os.path.join(workdir, f"src_{sha}")
    if not os.path.isdir(os.path.join(dest, "mmreplay")):
        os.makedirs(dest, exist_ok=True)
        arch = subprocess.run(["git", "-C", REPO, "archive", sha, "mmreplay"], capture_output=True, check=True)
        subprocess.run(["tar", "-x", "-C", dest], input=arch.stdout, check=True)
    return dest


def run_child(args: list[str], spec: dict, env_src: str, timeout: float) -> dict:
    with tempfile.NamedTemporaryFile("r", suffix=".json", delete=False) as f:
        spec = dict(spec, out=f.name)
    env = dict(os.environ, MMREPLAY_BENCH_SRC=env_src, PYTHONPATH=env_src)
    subprocess.run([sys.executable, *args, json.dumps(spec)], env=env, check=True, timeout=timeout, cwd=HERE)
    with open(spec["out"]) as f:
        res = json.load(f)
    os.unlink(spec["out"])
    if "error" in res:
        raise RuntimeError(res["error"])
    return res


def build(version: str, src: str, workload: str, workdir: str) -> str:
    """The store of ``workload`` built by ``version``'s own code (kept between runs of this script)."""
    wl, n, envs = WORKLOADS[workload]
    path = os.path.join(workdir, f"store_{version}_{workload}")
    if os.path.exists(os.path.join(path, ".ab_built")):
        return path
    spec = {"task": "fill", "src": src, "n": n, "workload": wl, "path": path}
    if wl == "lowdim":
        sys.path.insert(0, HERE)
        from benchmarks.sources import make_lowdim_data
        spec["data"] = make_lowdim_data(workdir, n, envs)
    t0 = time.perf_counter()
    res = run_child([os.path.abspath(__file__), "--child"], spec, src, timeout=3600)
    print(f"[ab] built {workload} with {version} in {time.perf_counter() - t0:.0f} s "
          f"({res['disk_bytes'] / n:.0f} B/transition)", flush=True)
    open(os.path.join(path, ".ab_built"), "w").close()
    return path


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--old", help="the baseline git revision (required)")
    p.add_argument("--new", default="worktree")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window-s", type=float, default=1.0)
    p.add_argument("--warmup-s", type=float, default=2.0)
    p.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=list(WORKLOADS))
    p.add_argument("--workdir", default="/tmp/mmreplay_ab")
    p.add_argument("--json", default=None)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        spec = json.loads(a.child)
        res = child_fill(spec) if spec.get("task") == "fill" else child(spec)
        with open(spec["out"], "w") as f:
            json.dump(res, f)
        return 0
    if not a.old:
        p.error("--old REV is required")
    os.makedirs(a.workdir, exist_ok=True)
    versions = {"old": source(a.old, a.workdir), "new": source(a.new, a.workdir)}
    stores = {(v, w): build(v, versions[v], w, a.workdir) for w in a.workloads for v in versions}
    for (v, w), path in stores.items():  # numba compiles each version's kernels once: not in a timed round
        run_child([os.path.abspath(__file__), "--child"], {"src": versions[v], "path": path, "workload": w,
                  "windows": 1, "window_s": 0.05, "warmup_s": 0.05}, versions[v], timeout=1800)
    runs: dict = {}
    for r in range(a.rounds):
        order = ["old", "new"] if r % 2 == 0 else ["new", "old"]
        for w in a.workloads:
            for v in order:
                spec = {"src": versions[v], "path": stores[(v, w)], "workload": w, "windows": a.windows,
                        "window_s": a.window_s, "warmup_s": a.warmup_s}
                res = run_child([os.path.abspath(__file__), "--child"], spec, versions[v], timeout=1800)
                runs.setdefault((v, w), []).append(res)
                print(f"[ab] round {r + 1} {w} {v}: " + ", ".join(
                    f"{k} {x:,.0f}" for k, x in res.items() if isinstance(x, float)), flush=True)
    import numpy as np
    lines = [f"# bench_ab: old={a.old} new={a.new}, {a.rounds} rounds, load avg {os.getloadavg()[0]:.1f}",
             "", "| workload | rate (batches/s) | old | new | new/old |", "|---|---|---:|---:|---:|"]
    summary = {}
    for w in a.workloads:
        for label, _ in modes(w):
            med = {v: float(np.median([x for res in runs[(v, w)] for x in res[label + " windows"]]))
                   for v in versions}
            summary[f"{w} {label}"] = dict(med, ratio=med["new"] / med["old"])
            lines.append(f"| {w} | {label} | {med['old']:,.0f} | {med['new']:,.0f} | "
                         f"{med['new'] / med['old']:.2f}x |")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
