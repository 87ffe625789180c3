#!/usr/bin/env python
"""Two versions of mmreplay sampled the same way, interleaved: does a change regress the sampling rates?

    python scripts/bench_ab.py --old 0e26cf5 [--new HEAD|worktree] [--rounds 3] [--workloads dmc ...]
                               [--n dmc=20000] [--json out.json]

Each version is ``git archive``d into the workdir (the working tree is used for ``--new worktree``, the
default). Every version builds its own stores once per workload, with its own code (bench.py's fill task):
100k and 1M real Atari transitions (stack 4, the library's default codec and budget) and 1M CartPole
transitions (8 envs), and 100k transitions of real DMC colour frames (84x84x3, stack 3, DrQ-v2's shape; the
pool of ``ltr_data.DmcSource``, episodes of 500 steps) coded with ``frame_codec="delta-zstd"`` on both sides
(what ``"auto"`` picks for colour frames now; c33ed75 has it too, both mapping it to ``DELTA_ZSTD_LARGE``
for frames this large), so that the comparison is of the read path, not of a codec choice; the store (~4 KB
a frame) is held in RAM by the default 1 GiB budget. Then each round runs, for every workload, one fresh child per version (the order
alternates between rounds), which opens its store, waits for the background pass that fills the
compressed tier, and times, in windows after a warm-up:

- uniform batch 32 and 256 (Atari 1M: the budget the library picks by default);
- prioritized (alpha 0.6, beta 0.4) batch 32 with a priority update after each batch (not DMC);
- n-step 3 (gamma 0.99) batch 32 (Atari) or 256 (low-dim, DMC: DrQ-v2's batch);
- sequences of 80 steps, batch 32 (not DMC).

Before a mode is timed its first batch (seed 1, before any priority update) is digested (indices, obs,
next_obs, reward): the two versions' digests must be equal (same seeded stream, same rows; the report says
where not), and on DMC that batch's frame stacks and n-step returns are checked against the frame pool. Each mode's CPU
time a batch (every thread of the child) is reported beside its rate: on a loaded box it moves less.

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
    "dmc": ("dmc", 100_000, 1),
}
DMC_CODEC = "delta-zstd"  # both versions: colour frames >= LARGE_FRAME_BYTES -> DELTA_ZSTD_LARGE


def modes(workload: str) -> list[tuple[str, dict]]:
    """(label, draw) pairs timed for ``workload``; ``draw`` is version-neutral and made in the child."""
    if workload == "dmc":
        return [("uniform b32", {"kind": "uniform", "B": 32}), ("uniform b256", {"kind": "uniform", "B": 256}),
                ("n-step 3 b256", {"kind": "nstep", "B": 256})]
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


def digest(batch) -> str:
    """sha1 of a batch's indices, obs, next_obs and reward (the fields both APIs' batches have)."""
    import hashlib

    import numpy as np
    h = hashlib.sha1()
    for name in ("indices", "obs", "next_obs", "reward"):
        x = getattr(batch, name)
        h.update(name.encode())
        h.update(np.ascontiguousarray(x.numpy() if hasattr(x, "numpy") else x).tobytes())
    return h.hexdigest()[:16]


def check_dmc(batch, d: dict, src) -> None:
    """``batch`` (a DMC draw ``d``) against the frame pool: obs/next_obs stacks, and the n-step return and
    discount; raises naming the first row that differs."""
    import numpy as np
    i = batch.indices.numpy().astype(np.int64)
    if d["kind"] == "nstep":
        obs, nxt, ret, disc = src.nstep(i, 3, 0.99)
        got = {"reward": batch.reward.numpy(), "discount": batch.discount.numpy()}
        for name, want in (("reward", ret), ("discount", disc)):
            bad = np.flatnonzero(~np.isclose(got[name], want, rtol=1e-4, atol=1e-5))
            if bad.size:
                raise AssertionError(f"dmc {d}: {name} of index {i[bad[0]]} is {got[name][bad[0]]}, expected "
                                     f"{want[bad[0]]}")
    else:
        obs, nxt = src.stacks(i, 0), src.stacks(i, 1)
    for name, want in (("obs", obs), ("next_obs", nxt)):
        bad = np.flatnonzero((getattr(batch, name).numpy() != want).reshape(len(i), -1).any(axis=1))
        if bad.size:
            raise AssertionError(f"dmc {d}: {name} of index {i[bad[0]]} differs from the frame pool's stack")


def child_fill(spec: dict) -> dict:
    """Create and fill a store with this version's code: single ``add`` calls for Atari (as an env loop
    gives them), ``extend`` of 8 rows for low-dim."""
    sys.path.insert(0, spec["src"])
    sys.path.insert(1, HERE)
    import numpy as np
    from gymnasium import spaces

    import mmreplay as mm
    from benchmarks.measure import dir_bytes
    from benchmarks.sources import ATARI_ACTIONS, add_atari_transitions
    assert mm.__file__.startswith(spec["src"]), (mm.__file__, spec["src"])
    n, path = spec["n"], spec["path"]
    if spec["workload"] == "dmc":  # one stream, an episode an ``extend`` (the pool's frames, ~4 KB coded)
        from benchmarks.ltr_data import DMC_EPISODE, DMC_STACK, DmcSource, dmc_spaces
        src = DmcSource()
        store = mm.Store.create(path, *dmc_spaces(), capacity=n, frame_stack=DMC_STACK, frame_codec=DMC_CODEC)
        for a in range(0, n, DMC_EPISODE):
            d = src.chunk(a, min(n, a + DMC_EPISODE))
            store.extend(d["obs"], d["action"], d["reward"], d["next_obs"], d["terminated"], d["truncated"],
                         streams=np.zeros(len(d["reward"]), np.int64))
    elif spec["workload"] == "lowdim":
        data = np.load(spec["data"])
        store = mm.Store.create(path, spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2),
                                capacity=n)
        cols = [data[k] for k in ("obs", "action", "reward", "next_obs", "terminated", "truncated")]
        for t in range(cols[0].shape[0]):
            store.extend(*(c[t] for c in cols))
    else:
        store = mm.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(ATARI_ACTIONS),
                                capacity=n, frame_stack=4, reward_values=(-1, 0, 1))
        add_atari_transitions(store, n)
    store.close()
    with open(os.path.join(path, "zarr.json")) as f:  # the frame codec the store was created with
        codec = json.load(f)["attributes"]["mmreplay"]["schema"]["observations"][0]["codec"]
    return {"disk_bytes": dir_bytes(path), "codec": codec}


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
    src = None
    if spec["workload"] == "dmc":
        from benchmarks.ltr_data import DmcSource
        src = DmcSource()
    with mm.Store.open(spec["path"], mode="r") as store:
        out["fill_s"] = wait_for_tier(store)
        for i, (label, d) in enumerate(modes(spec["workload"])):
            smp = make_sampler(store, mm, d, name=f"ab{i}")
            first = smp.sample()
            out[label + " digest"] = digest(first)
            if src is not None:
                check_dmc(first, d, src)
            if d["kind"] == "per":
                def step(smp=smp):
                    b = smp.sample()
                    smp.update_priorities(b.indices, torch.rand(len(b.indices)) + 0.01)
            else:
                step = smp.sample
            calls = [0]

            def counted(step=step, calls=calls):
                step()
                calls[0] += 1
            cpu0 = time.process_time()  # every thread of this child: less swayed by the box's load than rates
            rates = rate_windows(counted, spec["windows"], spec["window_s"], spec["warmup_s"])
            out[label + " cpu_ms"] = (time.process_time() - cpu0) * 1e3 / calls[0]
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


def build(version: str, src: str, workload: str, workdir: str, n: int | None = None) -> str:
    """The store of ``workload`` (``n`` transitions, default its size) built by ``version``'s own code, kept
    between runs of this script under a name of the source's revision and ``n``."""
    wl, default_n, envs = WORKLOADS[workload]
    n = n or default_n
    path = os.path.join(workdir, f"store_{version}_{os.path.basename(src)}_{workload}_{n}")
    if os.path.exists(os.path.join(path, ".ab_built")):
        return path
    spec = {"task": "fill", "src": src, "n": n, "workload": wl, "path": path}
    if wl == "lowdim":
        sys.path.insert(0, HERE)
        from benchmarks.sources import make_lowdim_data
        spec["data"] = make_lowdim_data(workdir, n, envs)
    t0 = time.perf_counter()
    res = run_child([os.path.abspath(__file__), "--child"], spec, src, timeout=3600)
    print(f"[ab] built {workload} ({n:,}) with {version} in {time.perf_counter() - t0:.0f} s "
          f"({res['disk_bytes'] / n:.0f} B/transition" + (f", codec {res['codec']}" if res.get("codec") else "")
          + ")", flush=True)
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
    p.add_argument("--n", nargs="+", default=[], metavar="WORKLOAD=N",
                   help="transitions of a workload's stores instead of its default (dmc=20000 for a quick try)")
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
    sizes = {}
    for item in a.n:
        w, _, k = item.partition("=")
        if w not in WORKLOADS or not k.isdigit() or int(k) < 1000:
            p.error(f"--n {item!r}: expected WORKLOAD=N with WORKLOAD one of {sorted(WORKLOADS)} and N >= 1000")
        sizes[w] = int(k)
    os.makedirs(a.workdir, exist_ok=True)
    versions = {"old": source(a.old, a.workdir), "new": source(a.new, a.workdir)}
    stores = {(v, w): build(v, versions[v], w, a.workdir, sizes.get(w)) for w in a.workloads for v in versions}
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
                    f"{k} {x:,.0f}" for k, x in res.items() if isinstance(x, float) and not k.endswith("cpu_ms"))
                    + "; CPU ms " + ", ".join(f"{res[lb + ' cpu_ms']:.2f}" for lb, _ in modes(w)), flush=True)
    import numpy as np
    lines = [f"# bench_ab: old={a.old} new={a.new}, {a.rounds} rounds, load avg {os.getloadavg()[0]:.1f}",
             "", ("| workload | rate (batches/s) | old | new | new/old | rounds new/old: median (min-max) "
                  "| CPU ms a batch old / new (new/old) | same rows |"), "|---|---|---:|---:|---:|---|---|---|"]
    summary = {}
    for w in a.workloads:
        for label, _ in modes(w):
            med = {v: float(np.median([x for res in runs[(v, w)] for x in res[label + " windows"]]))
                   for v in versions}
            # the spread: each round's new/old of its medians (the two children of a round ran back to back)
            per_round = [n[label] / o[label] for o, n in zip(runs[("old", w)], runs[("new", w)])]
            cpu = {v: float(np.median([res[label + " cpu_ms"] for res in runs[(v, w)]])) for v in versions}
            same = {res[label + " digest"] for v in versions for res in runs[(v, w)]}
            summary[f"{w} {label}"] = dict(med, ratio=med["new"] / med["old"], rounds=per_round, cpu_ms=cpu,
                                           same_rows=len(same) == 1)
            lines.append(f"| {w} | {label} | {med['old']:,.0f} | {med['new']:,.0f} | "
                         f"{med['new'] / med['old']:.2f}x | {np.median(per_round):.2f} "
                         f"({min(per_round):.2f}-{max(per_round):.2f}) | {cpu['old']:.2f} / {cpu['new']:.2f} "
                         f"({cpu['new'] / cpu['old']:.2f}x) | {'yes' if len(same) == 1 else 'NO'} |")
    print("\n".join(lines))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "args": vars(a)}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
