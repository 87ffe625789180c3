#!/usr/bin/env python
"""What bounds mmreplay's sampling rate, and what would move it: the evidence behind docs/performance.md.

Works on a store that ``scripts/bench.py --keep-stores`` left behind (e.g.
``/tmp/mmreplay_bench/store_atari_100000``, ``/tmp/mmreplay_bench/store_lowdim_1000000``).  Nothing in
``mmreplay/`` is edited: the variants are module attributes patched at run time in a fresh child process.

    python scripts/bench_whatif.py profile  --store S [--cache-mib 512] [--batch 256]   # py-spy, warm loop only
    python scripts/bench_whatif.py variants --store S [--cache-mib 512 1024] [--rounds 2]
    python scripts/bench_whatif.py gather                                               # np.take vs index_select

The ``decode`` subcommand (cost of one cache miss: ``read_chunk`` inline against a thread pool) was removed
when the codec helpers had replaced the pool it measured: it read the store's private arrays. Its figures
in docs/performance.md came from this script as of commit 0e26cf5 (``git archive 0e26cf5 scripts``).

Add ``--mmreplay-rev SHA`` to use the same git snapshot as bench.py (it reuses bench.py's snapshot folder).
Measurement helpers come from ``scripts/benchmarks/`` (``measure``, ``tasks_mmreplay.warm_up``, ``runner``).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import Counter

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
if os.environ.get("MMREPLAY_BENCH_SRC"):
    sys.path.insert(0, os.environ["MMREPLAY_BENCH_SRC"])
for _p in (HERE, REPO):
    if _p not in sys.path:
        sys.path.append(_p)

import numpy as np

VARIANTS = {
    "stock": "the library as it is",
    "serial-decode": "SHARED_MIN_DECODES (older: PARALLEL_MIN_DECODES, PARALLEL_MIN_CHUNKS) = inf: misses decoded "
                     "on one thread",
    "serial-gather": "SHARED_MIN_STACKS (older: PARALLEL_GATHER_BYTES) = inf: the slab -> batch copy inline",
    "serial-all": "both of the above: no thread hand-offs at all",
    "torch-1-thread": "torch.set_num_threads(1)",
    "gc-freeze": "gc.freeze() after opening (the collector skips everything allocated so far)",
    "no-reader-check": "CheckedReads.still_valid -> True: no per-batch check of the commit record (reader mode)",
}


def _tuning_modules():
    """The modules that hold the read path's thread thresholds, in this tree or an older snapshot."""
    import importlib
    mods = []
    for name in ("mmreplay.reading.frames", "mmreplay.index.frame_ring"):
        try:
            mods.append(importlib.import_module(name))
        except ImportError:
            pass
    return mods


def _patch(variant: str) -> None:
    names = {"serial-decode": ("PARALLEL_MIN_CHUNKS", "PARALLEL_MIN_DECODES", "SHARED_MIN_DECODES"),
             "serial-gather": ("PARALLEL_GATHER_ROWS", "PARALLEL_GATHER_BYTES", "SHARED_MIN_STACKS")}  # renamed
    for part, attrs in names.items():
        if variant in (part, "serial-all"):
            for mod in _tuning_modules():
                for name in attrs:
                    if hasattr(mod, name):
                        setattr(mod, name, 1 << 60)
    if variant == "no-reader-check":
        import mmreplay.checked_reads as cr
        cr.CheckedReads.still_valid = lambda self, *read: True
    if variant == "torch-1-thread":
        import torch
        torch.set_num_threads(1)


def _warm(smp, store, max_s=30.0, window_s=1.0):
    """Sample until the cache hit rate is stable (as bench.py warms up), at most ``max_s``."""
    from benchmarks.tasks_mmreplay import warm_up
    return warm_up(smp, store, window_s, 0.0, max_s)


def _measured_phase(smp, windows, window_s):
    """The profiled region (its name marks the stacks to keep)."""
    rates = []
    for _ in range(windows):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window_s:
            next(smp)
            k += 1
        rates.append(k / (time.perf_counter() - t0))
    return rates


def child(spec: dict) -> dict:
    from benchmarks.measure import tune_malloc
    tune_malloc()
    import gc

    import torch  # noqa: F401

    import mmreplay
    _patch(spec["variant"])
    s = mmreplay.Store.open(spec["store"], mode="r", cache_bytes=spec["cache_mib"] << 20)
    if spec["variant"] == "gc-freeze":
        gc.freeze()
    out = {"variant": spec["variant"], "cache_mib": spec["cache_mib"], "mmreplay": mmreplay.__file__}
    batches = sorted(spec["batches"], reverse=True)
    smp = s.sampler(batches[0], prefetch=0, seed=0)
    out["warm_hit_rate"] = _warm(smp, s, spec.get("warm_max_s", 30.0))
    for B in batches:
        if smp.batch_size != B:
            smp = s.sampler(B, prefetch=0, seed=1)
            for _ in range(20):
                next(smp)
        st0 = s.inspect.cache_stats()
        rates = _measured_phase(smp, spec["windows"], spec["window_s"])
        st1 = s.inspect.cache_stats()
        h = sum(st1[c]["hits"] - st0[c]["hits"] for c in st1)
        m = sum(st1[c]["misses"] - st0[c]["misses"] for c in st1)
        out[f"b{B}"] = float(np.median(rates))
        out[f"b{B}_windows"] = rates
        out[f"b{B}_misses_per_batch"] = m / max(1, sum(int(r * spec["window_s"]) for r in rates))
        out[f"b{B}_hit_rate"] = h / (h + m) if h + m else 1.0
    s.close()
    return out


def run_child(spec: dict, wrap=None) -> dict:
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    cmd = (wrap or []) + [sys.executable, os.path.abspath(__file__), "_child", json.dumps({**spec, "out": path})]
    subprocess.run(cmd, check=False)
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {"error": "child failed"}
    finally:
        os.remove(path)


def other_cpu_probe(seconds=2.0) -> float:
    from benchmarks.measure import CpuMeter
    m = CpuMeter()
    time.sleep(seconds)
    return m.result()["other_cpu_cores"]


# --------------------------------------------------------------------------------------------------
def cmd_variants(a) -> None:
    rows = []
    res: dict = {}
    for rnd in range(a.rounds):
        for cache in a.cache_mib:
            for v in a.variants:
                other = other_cpu_probe()
                r = run_child({"variant": v, "store": a.store, "cache_mib": cache, "batches": a.batch,
                               "windows": a.windows, "window_s": a.window_s})
                r["other_cpu_before"] = other
                res.setdefault((cache, v), []).append(r)
                print(f"round {rnd + 1} cache {cache} MiB {v:15s}: " + ", ".join(
                    f"b{B} {r.get(f'b{B}', float('nan')):8.1f}/s (hit {100 * r.get(f'b{B}_hit_rate', 0):.1f}%)"
                    for B in a.batch) + f"  [other CPU before: {other:.2f}]", flush=True)
    print(f"\nwarm batches/s, median of all windows over {a.rounds} round(s) (store {a.store}):")
    hdr = ["cache MiB", "variant"] + [f"b{B}/s" for B in a.batch] + [f"vs stock b{B}" for B in a.batch] + \
          [f"misses/batch b{B}" for B in a.batch]
    stock = {}
    for (cache, v), rs in res.items():
        med = {B: float(np.median([x for r in rs for x in r.get(f"b{B}_windows", [])] or [np.nan])) for B in a.batch}
        if v == "stock":
            stock[cache] = med
        rows.append((cache, v, med, {B: np.median([r.get(f"b{B}_misses_per_batch", np.nan) for r in rs])
                                     for B in a.batch}))
    print(" | ".join(hdr))
    for cache, v, med, miss in rows:
        st = stock.get(cache, {})
        print(" | ".join([str(cache), v] + [f"{med[B]:,.1f}" for B in a.batch]
                         + [f"{med[B] / st[B]:.2f}x" if st.get(B) else "-" for B in a.batch]
                         + [f"{miss[B]:.0f}" for B in a.batch]))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({f"{c}_{v}": rs for (c, v), rs in res.items()}, f, indent=1)


def aggregate_raw(path: str, marker: str, top: int) -> str:
    self_c: Counter = Counter()
    incl: Counter = Counter()
    tot = 0
    with open(path) as f:
        for line in f:
            stack, n = line.rstrip("\n").rsplit(" ", 1)
            frames = stack.split(";")
            idx = [i for i, fr in enumerate(frames) if marker in fr]
            if not idx:
                continue
            n = int(n)
            frames = frames[idx[0] + 1:]
            tot += n
            if frames:
                self_c[frames[-1]] += n
            for fr in set(frames):
                incl[fr] += n
    out = [f"{tot} samples in {marker}", "", "inclusive (function and what it calls):"]
    out += [f"{100 * n / tot:5.1f}%  {fr[:150]}" for fr, n in incl.most_common(top)]
    out += ["", "self (innermost frame):"]
    out += [f"{100 * n / tot:5.1f}%  {fr[:150]}" for fr, n in self_c.most_common(top // 2)]
    return "\n".join(out)


def cmd_profile(a) -> None:
    os.makedirs(a.out_dir, exist_ok=True)
    for cache in a.cache_mib:
        raw = os.path.join(a.out_dir, f"profile_{os.path.basename(a.store.rstrip('/'))}_{cache}MiB_{a.variant}.raw")
        wrap = ["py-spy", "record", "--native", "--rate", str(a.rate), "--format", "raw", "--output", raw, "--"]
        r = run_child({"variant": a.variant, "store": a.store, "cache_mib": cache, "batches": a.batch,
                       "windows": a.windows, "window_s": a.window_s}, wrap=wrap)
        print(f"cache {cache} MiB, variant {a.variant}: " + ", ".join(
            f"b{B} {r.get(f'b{B}', float('nan')):.1f}/s under py-spy (hit {100 * r.get(f'b{B}_hit_rate', 0):.1f}%)"
            for B in a.batch))
        text = aggregate_raw(raw, "_measured_phase", a.top)
        with open(raw[:-4] + ".txt", "w") as f:
            f.write(text + "\n")
        print(text)
        print(f"(raw stacks: {raw}; summary: {raw[:-4]}.txt)\n")


def cmd_gather(a) -> None:
    """Slab -> batch copy: torch.index_select (OpenMP, default threads) vs np.take, quiet and with one busy
    process competing for the 2 cores (each in a fresh child)."""
    code = r'''
import sys, time, numpy as np, torch
sys.path.insert(0, %r); from benchmarks.measure import tune_malloc; tune_malloc()
slab = np.random.default_rng(0).integers(0, 255, (100000, 84, 84), np.uint8); ts = torch.from_numpy(slab)
out = torch.empty((1024, 84, 84), dtype=torch.uint8); rng = np.random.default_rng(1)
def isel():
    torch.index_select(ts, 0, torch.from_numpy(rng.integers(0, 100000, 1024)), out=out)
def take():
    np.take(slab, rng.integers(0, 100000, 1024), axis=0, out=out.numpy())
for name, f in (("torch.index_select (%%d threads)" %% torch.get_num_threads(), isel), ("np.take", take)):
    for _ in range(50): f()
    rs = []
    for w in range(5):
        k = 0; t0 = time.perf_counter()
        while time.perf_counter() - t0 < 0.5: f(); k += 1
        rs.append(k / (time.perf_counter() - t0))
    print("   %%-32s %%8.0f copies/s of 1024 frames (= one b256 obs+next_obs)" %% (name, np.median(rs)), flush=True)
''' % HERE  # noqa: UP031  (the code string contains %-formatting of its own)
    print("quiet:")
    subprocess.run([sys.executable, "-c", code], check=False)
    busy = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        time.sleep(0.5)
        print("one busy-looping process competing:")
        subprocess.run([sys.executable, "-c", code], check=False)
    finally:
        busy.kill()
        busy.wait()


def main(argv=None):
    if len(sys.argv) > 2 and sys.argv[1] == "_child":
        spec = json.loads(sys.argv[2])
        try:
            res = child(spec)
        except Exception as exc:  # noqa: BLE001
            import traceback
            traceback.print_exc()
            res = {"error": repr(exc)}
        with open(spec["out"], "w") as f:
            json.dump(res, f)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("command", choices=("variants", "profile", "gather"))
    p.add_argument("--store", default="/tmp/mmreplay_bench/store_atari_100000")
    p.add_argument("--cache-mib", type=int, nargs="+", default=[512])
    p.add_argument("--batch", type=int, nargs="+", default=[256, 32])
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--variant", default="stock", choices=list(VARIANTS), help="profile: which variant")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window-s", type=float, default=1.0)
    p.add_argument("--rate", type=int, default=250, help="py-spy samples/s")
    p.add_argument("--top", type=int, default=40)
    p.add_argument("--out-dir", default="/tmp/mmreplay_bench/profiles")
    p.add_argument("--mmreplay-rev", default=None)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.mmreplay_rev:
        from benchmarks.runner import snapshot_rev
        src = snapshot_rev(a.mmreplay_rev, "/tmp/mmreplay_bench")
        os.environ["MMREPLAY_BENCH_SRC"] = src
        sys.path.insert(0, src)
    print(f"[whatif] mmreplay from {os.environ.get('MMREPLAY_BENCH_SRC') or 'the working tree'}", flush=True)
    {"variants": cmd_variants, "profile": cmd_profile, "gather": cmd_gather}[a.command](a)
    return 0


if __name__ == "__main__":
    sys.exit(main())
