"""``--cgroup``: larger than RAM. A 1M-transition Atari store on disk, sampled by a child in a memory cgroup
smaller than the uncompressed buffer (page cache charged to it), against the same child unconstrained.

Invariant: both children open the same store fresh (page cache dropped first when allowed) and do the same
cold pass and warm windows; the cgroup is removed whatever happens.
"""
from __future__ import annotations

import json
import os
import shutil

from ..cgroup import make_memory_cgroup, remove_cgroup
from ..measure import dir_bytes, log
from ..tables import _f, md_table, table
from ..runner import MiB, aggregate_runs
from ..sources import FRAME_BYTES
from .base import Mode


class CgroupMode(Mode):
    key = "cgroup"
    exclusive = True

    def add_arguments(self, p) -> None:
        p.add_argument("--cgroup", action="store_true", help="run the larger-than-RAM cgroup test")
        p.add_argument("--cgroup-n", type=int, default=None, help="transitions in the cgroup store (default 1000000)")
        p.add_argument("--cgroup-limit", type=lambda v: int(float(v)), default=2_000_000_000,
                       help="cgroup memory limit, bytes (default 2e9 = 2 GB)")
        p.add_argument("--cgroup-cache-mib", type=int, default=1024)
        p.add_argument("--cgroup-repeats", type=int, default=None, help="runs of each cgroup child, interleaved "
                       "(default 2; quick 1)")
        p.add_argument("--cgroup-cold-max-s", type=float, default=120.0)
        p.add_argument("--reuse-store", action="store_true", help="--cgroup: reuse the 1M store of an earlier run "
                       "(kept with --keep-cgroup-store) instead of rebuilding it (same mmreplay version only!)")
        p.add_argument("--keep-cgroup-store", action="store_true", help="keep the 1M store for a later --cgroup run")

    def finish_args(self, a, quick: bool, argv: list[str]) -> None:
        if a.cgroup_n is None:
            a.cgroup_n = 20_000 if quick else 1_000_000
        if a.cgroup_repeats is None:
            a.cgroup_repeats = 1 if quick else 2
        if quick:
            a.cgroup_cold_max_s = min(a.cgroup_cold_max_s, 5.0)

    def requested(self, a) -> bool:
        return a.cgroup

    def run(self, runner) -> dict:
        return run_cgroup(runner)

    def report(self, part: dict, results: dict, args) -> list[str]:
        return ["\n== larger than RAM: mmreplay sampler in a memory cgroup ==", cgroup_text(part)]

    def targets(self, cg: dict, args, add) -> None:
        c, u = cg.get("constrained", {}), cg.get("unconstrained", {})
        for B in sorted(args.batch_sizes, reverse=True):
            a_, b_ = c.get(f"b{B}_per_s"), u.get(f"b{B}_per_s")
            add(f"cgroup {cg['n']:,} ({cg['limit_bytes'] / 1e9:.1f} GB limit): warm batch-{B} >= 80% of "
                f"unconstrained", a_ / b_ if a_ and b_ else None, 0.8)

    def reaggregate(self, cg: dict, args) -> None:
        if "runs" not in cg:
            return
        for mode, rs in cg["runs"].items():
            if rs:
                agg = aggregate_runs(rs, args.quiet_cores)
                agg.pop("runs", None)
                cgs = [r["cgroup"] for r in rs if isinstance(r.get("cgroup"), dict)]
                if cgs:
                    agg["cgroup"] = {**cgs[-1], "max_usage": max(c.get("max_usage", 0) for c in cgs)}
                cg[mode] = agg


def run_cgroup(runner) -> dict:
    a = runner.args
    n = a.cgroup_n
    path = os.path.join(runner.workdir, f"store_cgroup_atari_{n}")
    marker = os.path.join(path, ".bench_complete.json")
    base = {"workload": "atari", "n": n, "n_envs": 1, "batch_sizes": list(a.batch_sizes), "data": None,
            **runner.rate_spec()}
    out = {"n": n, "limit_bytes": a.cgroup_limit, "cache_bytes": a.cgroup_cache_mib * MiB,
           "uncompressed_frame_bytes": n * FRAME_BYTES, "uncompressed_stacked_bytes": 2 * 4 * n * FRAME_BYTES}
    if os.path.exists(marker) and a.reuse_store:
        with open(marker) as f:
            out["fill"] = json.load(f)
        out["fill"]["reused"] = True
        log(f"[bench] cgroup: reusing the store at {path}")
    else:
        fill = runner.child({**base, "task": "mm_fill", "path": path}, label=f"cgroup/mmreplay fill {n}",
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
                r = runner.child(spec, cgroup=cg if mode == "constrained" else None,
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
