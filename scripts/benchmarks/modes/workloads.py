"""The default mode: the workloads ``atari``, ``atari_x8`` and ``lowdim``, mmreplay against the peers, each
system filled and sampled in fresh children, rounds interleaved.

    atari     real Atari frames, frame stack 4, n_envs = 1 (mmreplay ``add``, peers ``add_batch`` of stacks)
    atari_x8  the same transitions as 8 streams (mmreplay ``extend`` of 8 rows, peers n_envs = 8)
    lowdim    CartPole-v1, 4 float32 obs, 8 envs per add

Invariant: every system gets the same inputs (``benchmarks.sources``); mmreplay is sampled from a store
opened fresh from disk in a new child (cold first pass, then warm windows), a peer in the child that
filled it; a peer that cannot fit on this box is skipped with the reason, never run into swap.
"""
from __future__ import annotations

import os
import shutil

from ..measure import log
from ..tables import _f, md_table, table
from ..runner import MiB, aggregate_runs
from ..sources import FRAME_BYTES, make_lowdim_data
from ..tasks_mmreplay import task_mm_fill, task_mm_sample
from ..tasks_peers import task_peer
from .base import Mode

PEERS = ("numpy", "sb3", "cpprb", "torchrl")
SYSTEMS = ("mmreplay",) + PEERS
WORKLOADS = ("atari", "atari_x8", "lowdim")
TITLES = {"atari": "Atari (real frames, stack 4, n_envs=1: mmreplay add(), peers add_batch of stacks)",
          "atari_x8": "Atari, 8 streams (mmreplay extend(8 rows), peers n_envs=8)",
          "lowdim": "Low-dim CartPole (4 float32 obs, 2 actions, 8 envs per add)"}


class WorkloadsMode(Mode):
    key = "workloads"
    tasks = {"peer": task_peer, "mm_fill": task_mm_fill, "mm_sample": task_mm_sample}

    def add_arguments(self, p) -> None:
        p.add_argument("--workloads", nargs="+", default=None, choices=WORKLOADS,
                       help="default: all three (none with --cgroup or --per)")
        p.add_argument("--systems", nargs="+", default=list(SYSTEMS), choices=SYSTEMS)
        p.add_argument("--no-x8-peers", dest="x8_peers", action="store_false",
                       help="atari_x8: run mmreplay only (default: peers too, except with --quick)")
        p.add_argument("--profile-dir", default=None, help="pyinstrument the mmreplay warm windows into this folder")

    def finish_args(self, a, quick: bool, argv: list[str]) -> None:
        if quick and "--x8-peers" not in argv:
            a.x8_peers = False

    def requested(self, a) -> bool:
        return bool(a.workloads)

    def run(self, runner) -> dict:
        return {wl: run_workload(runner, wl) for wl in runner.args.workloads}

    def report(self, part: dict, results: dict, args) -> list[str]:
        out = []
        for name, wl in part.items():
            out.append(f"\n== {TITLES[name]}: N = {wl['n']:,} transitions, capacity N, mmreplay cache budget "
                       f"{wl['cache_bytes'] / MiB:,.0f} MiB ==")
            out.append(workload_tables(name, wl, args.batch_sizes))
        if part and args.repeats > 1:
            out.append("\n== every round (figures above use the 'used' ones) ==")
            out.append(rounds_table(results, args.batch_sizes))
        return out

    def targets(self, W: dict, args, add) -> None:
        at = W.get("atari")
        if at:
            sb3 = at["systems"].get("sb3", {})
            for name, mm in at["systems"].items():
                if not name.startswith("mmreplay"):
                    continue
                cb = f"cache {mm.get('cache_bytes', 0) / MiB:.0f} MiB"
                for B in (32, 256):
                    a_, b_ = mm.get(f"b{B}_per_s"), sb3.get(f"b{B}_per_s")
                    add(f"Atari {at['n']:,}, {cb}: batch-{B} rate >= 1.5x SB3 (warm)",
                        a_ / b_ if a_ and b_ else None, 1.5)
                if mm.get("peak_rss"):
                    lim = 400e6 + mm["cache_bytes"]
                    add(f"Atari {at['n']:,}, {cb}: peak RSS <= 400 MB + cache = {lim / MiB:,.0f} MiB",
                        mm["peak_rss"] / MiB, lim / MiB, "MiB", le=True)
        ld = W.get("lowdim")
        if ld:
            mm, sb3 = ld["systems"].get("mmreplay", {}), ld["systems"].get("sb3", {})
            a_, b_ = mm.get("b256_per_s"), sb3.get("b256_per_s")
            add(f"Low-dim {ld['n']:,}: batch-256 rate >= 1x SB3 (warm)", a_ / b_ if a_ and b_ else None, 1.0)

    def reaggregate(self, part: dict, args) -> None:
        for W in part.values():
            for name, r in list(W["systems"].items()):
                if "runs" in r:
                    W["systems"][name] = aggregate_runs(r["runs"], args.quiet_cores)


def run_workload(runner, wl: str) -> dict:
    a = runner.args
    if wl == "lowdim":
        n, E = a.lowdim_n, 8
        data = make_lowdim_data(runner.workdir, n, E)
        caches = [a.cache_mib[0] * MiB]  # the decoded low-dim store is a few MiB: one budget is enough
    else:
        n, E = a.atari_n, (8 if wl == "atari_x8" else 1)
        data = None
        caches = [m * MiB for m in a.cache_mib]
    n = (n // E) * E
    Bs = list(a.batch_sizes)
    base = {"workload": wl, "n": n, "n_envs": E, "batch_sizes": Bs, "data": data, **runner.rate_spec()}
    out = {"n": n, "n_envs": E, "cache_bytes": caches[0], "cache_budgets": caches, "rounds": a.repeats,
           "systems": {}}
    systems = [s for s in a.systems if not (wl == "atari_x8" and s != "mmreplay" and not a.x8_peers)]
    runs: dict[str, list] = {}
    for rnd in range(a.repeats):  # rounds interleave the systems, so a burst of load hits one run only
        for system in systems:
            if system == "mmreplay":
                for name, r in run_mmreplay(runner, wl, base, caches, rnd).items():
                    runs.setdefault(name, []).append(r)
                continue
            skip = peer_skip_reason(runner, system, wl, n)
            if skip:
                if rnd == 0:
                    log(f"[bench] {wl}/{system}: skipped ({skip})")
                runs[system] = [{"skipped": skip}]
                continue
            runs.setdefault(system, []).append(runner.child(
                {**base, "task": "peer", "system": system},
                label=f"{wl}/{system} fill+sample (round {rnd + 1}/{a.repeats})", timeout=a.child_timeout))
    for name, rs in runs.items():
        out["systems"][name] = aggregate_runs(rs, a.quiet_cores)
    return out


def run_mmreplay(runner, wl: str, base: dict, caches: list[int], rnd: int) -> dict:
    """One fill child, then sampling children (each opens the store fresh): per cache budget a
    'cold first pass of the largest batch + warm windows' child, and (first budget only, not in
    --quick) a cold-first-pass child for each smaller batch size."""
    a = runner.args
    tag = f"(round {rnd + 1}/{a.repeats})"
    path = os.path.join(runner.workdir, f"store_{wl}_{base['n']}")
    fill = runner.child({**base, "task": "mm_fill", "path": path}, label=f"{wl}/mmreplay fill {tag}",
                      timeout=a.child_timeout)
    Bs = sorted(base["batch_sizes"])
    Bmax = Bs[-1]
    out = {}
    if "error" in fill:
        return {"mmreplay": {"error": fill["error"], "fill": fill}}
    for ci, cache in enumerate(caches):
        name = "mmreplay" if ci == 0 else f"mmreplay@{cache // MiB}MiB"
        sample_base = {**base, "task": "mm_sample", "path": path, "cache_bytes": cache,
                       "drop_caches": not a.no_drop_caches}
        res = {"fill": fill}
        children = [fill]
        if ci == 0 and not a.quick:   # cold first pass of each smaller batch size in its own fresh child
            for B in Bs[:-1]:
                c = runner.child({**sample_base, "cold_batch": B, "warm": False},
                               label=f"{wl}/mmreplay cold b{B}, cache {cache // MiB} MiB {tag}",
                               timeout=a.child_timeout)
                res[f"cold_b{B}"] = c
                children.append(c)
        prof = None
        if a.profile_dir:
            os.makedirs(a.profile_dir, exist_ok=True)
            prof = os.path.join(a.profile_dir, f"{wl}_{name.replace('@', '_')}_r{rnd + 1}")
        w = runner.child({**sample_base, "cold_batch": Bmax, "warm": True, "verify": True, "profile": prof},
                       label=f"{wl}/mmreplay cold b{Bmax} + warm, cache {cache // MiB} MiB {tag}",
                       timeout=a.child_timeout)
        res["sample"] = w
        children.append(w)
        errs = [c["error"] for c in children if "error" in c]
        if errs:
            res["error"] = errs[0]
        # flat figures for the tables
        res.update({"stored": w.get("stored", fill.get("stored")), "add_per_s": fill.get("add_per_s"),
                    "disk_bytes": fill.get("disk_bytes"), "store_bytes": fill.get("store_bytes"),
                    "peak_rss": max(c.get("peak_rss", 0) for c in children),
                    "peak_rss_fill": fill.get("peak_rss"),
                    "peak_rss_sample": max(c.get("peak_rss", 0) for c in children[1:]),
                    "cache_bytes": cache, "stack_err": 0.0 if w.get("stack_overlap_ok", True) else 1.0,
                    "verify_fraction_ok": w.get("verify_fraction_ok"),
                    "other_cpu_cores": max((c.get("other_cpu_cores", 0) for c in children), default=None)})
        for B in Bs:
            res[f"b{B}_per_s"] = w.get(f"b{B}_per_s")
            res[f"b{B}_windows"] = w.get(f"b{B}_windows")
            res[f"b{B}_hit_rate"] = w.get(f"b{B}_hit_rate")
            src = w if B == Bmax else res.get(f"cold_b{B}", {})
            res[f"cold_b{B}_per_s"] = src.get(f"cold_b{B}_per_s")
            res[f"cold_b{B}_full_pass"] = src.get(f"cold_b{B}_full_pass")
        out[name] = res
    if not a.keep_stores:
        shutil.rmtree(path, ignore_errors=True)
    return out


def peer_skip_reason(runner, system: str, wl: str, n: int) -> str | None:
    """Skip peers that cannot hold ``n`` Atari transitions on this box (e.g. --atari-n 1000000)."""
    if wl == "lowdim":
        return None
    import psutil
    avail = psutil.virtual_memory().available
    disk = shutil.disk_usage(runner.workdir).free
    need_ram = {"numpy": 1.15 * n * FRAME_BYTES, "sb3": 4.0 * n * FRAME_BYTES,
                "cpprb": 2.3 * n * FRAME_BYTES, "torchrl": 0}[system]
    need_disk = 8.0 * n * FRAME_BYTES if system == "torchrl" else 0
    if need_ram > 0.8 * avail:
        return f"needs ~{need_ram / 1e9:.0f} GB RAM, {avail / 1e9:.0f} GB available"
    if need_disk > 0.8 * disk:
        return f"needs ~{need_disk / 1e9:.0f} GB disk, {disk / 1e9:.0f} GB free"
    if system == "torchrl" and n > 300_000:
        return f"its 2 x 4x84x84 memmap is {need_disk / 1e9:.0f} GB of dirty page cache on a {avail / 1e9:.0f} " \
               "GB box (thrashes; use --atari-n <= 300000)"
    return None


def rounds_table(results: dict, Bs, md=False) -> str:
    """Every round of every system: the raw material behind the quiet-round selection."""
    T = md_table if md else table
    rows = []
    for wl, W in results.get("workloads", {}).items():
        for name, r in W["systems"].items():
            for i, x in enumerate(r.get("runs", [r])):
                if "skipped" in x:
                    continue
                rows.append([wl, name, i + 1, "yes" if i + 1 in r.get("rounds_used", [i + 1]) else "no",
                             f"{x.get('other_cpu_cores', 0):.2f}"]
                            + [_f(x.get(f"b{B}_per_s")) for B in sorted(Bs)] + [_f(x.get("add_per_s"))])
    return T(["workload", "system", "round", "used", "other CPU"] + [f"b{B}/s" for B in sorted(Bs)] + ["add/s"],
             rows)


def workload_tables(name: str, wl: dict, Bs, md=False) -> str:
    T = md_table if md else table
    sysd = wl["systems"]
    n = wl["n"]
    Bs = sorted(Bs)
    headers = ["system", "stored", "add/s"] + [f"b{B}/s" for B in Bs] + [f"b{B}/s cold" for B in Bs] + \
        ["peak RSS MiB", "disk MiB", "store B/tr", "stack_err", "other CPU", "note"]
    rows = []
    for sname, r in sysd.items():
        if "skipped" in r:
            rows.append([sname] + ["-"] * (len(headers) - 2) + [f"skipped: {r['skipped']}"])
            continue
        if "error" in r and r.get("add_per_s") is None:
            rows.append([sname] + ["-"] * (len(headers) - 2) + ["ERROR: " + r["error"].strip().splitlines()[-1]])
            continue
        note = ""
        if sname == "mmreplay":
            hits = ", ".join(f"b{B} hit {_f(r.get(f'b{B}_hit_rate'), 'pct')}" for B in Bs
                             if r.get(f"b{B}_hit_rate") is not None)
            note = f"cache {r['cache_bytes'] / MiB:.0f} MiB; {hits}; verify {_f(r.get('verify_fraction_ok'), 'pct')}"
            part = [f"b{B}" for B in Bs if r.get(f"cold_b{B}_full_pass") is False]
            if part:
                note += f"; cold pass capped ({', '.join(part)})"
        stored = int(r["stored"]) if r.get("stored") is not None else None
        rows.append([sname, f"{stored:,}" if stored is not None else "-", _f(r.get("add_per_s"))]
                    + [_f(r.get(f"b{B}_per_s")) for B in Bs]
                    + [_f(r.get(f"cold_b{B}_per_s")) for B in Bs]
                    + [_f(r.get("peak_rss"), "mib"), _f(r.get("disk_bytes"), "mib") if r.get("disk_bytes") else "-",
                       _f(r["store_bytes"] / max(1, stored or n), "bpt") if r.get("store_bytes") is not None else "-",
                       f"{r.get('stack_err', 0):.3f}",
                       f"{r['other_cpu_cores']:.2f}" if r.get("other_cpu_cores") is not None else "-", note])
    out = [T(headers, rows)]
    out.append("(other CPU = cores kept busy by OTHER processes while the child ran: the noise level; "
               f"this box has {os.cpu_count()} cores)")
    mms = [(k, r) for k, r in sysd.items() if k.startswith("mmreplay") and r.get("add_per_s") is not None]
    peers_ = [(k, r) for k, r in sysd.items() if not k.startswith("mmreplay") and "skipped" not in r
              and r.get("add_per_s") is not None]
    if mms and peers_:
        rh = ["ratio", "add/s"] + [f"b{B}/s" for B in Bs] + [f"b{B}/s cold" for B in Bs] + \
             ["peak RSS", "store B/tr"]

        def ratio(a, b):
            return "-" if not a or not b else _f(a / b, "x")
        rr = []
        for mname, mm in mms:
            for sname, r in peers_:
                rr.append([f"{mname} / {sname}", ratio(mm.get("add_per_s"), r.get("add_per_s"))]
                          + [ratio(mm.get(f"b{B}_per_s"), r.get(f"b{B}_per_s")) for B in Bs]
                          + [ratio(mm.get(f"cold_b{B}_per_s"), r.get(f"b{B}_per_s")) for B in Bs]
                          + [ratio(mm.get("peak_rss"), r.get("peak_rss")),
                             ratio(mm.get("store_bytes"), r.get("store_bytes"))])
        out.append("\n" + T(rh, rr))
        out.append("(rates: > 1x = mmreplay faster; peak RSS and store B/tr: < 1x = mmreplay smaller; 'cold' = "
                   "mmreplay's first pass from a freshly opened store vs the peer's steady rate; mmreplay@X = "
                   "the same store sampled with an X cache budget)")
    return "\n".join(out)
