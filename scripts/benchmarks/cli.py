"""The ``scripts/bench.py`` command line: the common flags, each mode's flags, and the run (or ``--child``
task, or ``--report-from`` re-print).

Invariant: the results JSON is ``{"meta", "args", "workloads", <mode keys>..., "targets"}``; the text report
is ``report.report(results, args)`` of exactly that JSON, so a saved run re-prints identically.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time

from .child import child_main
from .modes import MODES
from .report import evaluate_targets, report
from .runner import DEFAULT_WORKDIR, Runner, git_info, snapshot_rev

#: the first paragraph of ``scripts/bench.py --help``
DESCRIPTION = "mmreplay against peer replay buffers, in one run, on the same inputs."


def parse_args(argv=None, doc: str = DESCRIPTION):
    p = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny N and short windows (~1 minute smoke test)")
    p.add_argument("--atari-n", type=int, default=None, help="Atari transitions (default 100000; quick 5000)")
    p.add_argument("--lowdim-n", type=int, default=None, help="low-dim transitions (default 1000000; quick 50000)")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    p.add_argument("--cache-mib", type=int, nargs="+", default=None,
                   help="mmreplay decoded-frame cache budget(s) in MiB for the Atari workloads; the first is the "
                   "main one (default: 512 = the library default, and 1024, which holds a whole 100k store; "
                   "quick: 512)")
    p.add_argument("--repeats", type=int, default=None,
                   help="rounds of every child, interleaved (default 2; quick 1); batch rates are the median "
                   "of all rounds' windows")
    p.add_argument("--windows", type=int, default=None, help="timed windows per rate (default 7; quick 5)")
    p.add_argument("--window-s", type=float, default=None, help="seconds per window (default 1.0; quick 0.2)")
    p.add_argument("--warmup-s", type=float, default=None, help="warm-up seconds before the windows")
    p.add_argument("--warm-max-s", type=float, default=None, help="mmreplay: cap on the cache warm-up")
    p.add_argument("--cold-max-s", type=float, default=None, help="mmreplay: cap on the cold first pass")
    for mode in MODES:
        mode.add_arguments(p)
    p.add_argument("--keep-stores", action="store_true")
    p.add_argument("--no-drop-caches", action="store_true")
    p.add_argument("--workdir", default=DEFAULT_WORKDIR)
    p.add_argument("--mmreplay-rev", default=None, help="benchmark mmreplay/ as of this git revision (a "
                   "snapshot via git archive) instead of the working tree, e.g. HEAD")
    p.add_argument("--child-timeout", type=float, default=1800)
    p.add_argument("--quiet-cores", type=float, default=0.3, help="before each child, wait until other processes "
                   "use fewer cores than this (2 s probe) ...")
    p.add_argument("--quiet-max-wait", type=float, default=None, help="... for at most this many seconds "
                   "(default 60; quick 0 = no waiting)")
    p.add_argument("--json", default=None, help="write every figure to this JSON file")
    p.add_argument("--report-from", default=None, metavar="JSON", help="re-print the report of an earlier "
                   "--json run (re-aggregating its rounds) without running anything")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    q = a.quick
    dflt = lambda v, full, quick: v if v is not None else (quick if q else full)  # noqa: E731
    a.atari_n = dflt(a.atari_n, 100_000, 5_000)
    a.lowdim_n = dflt(a.lowdim_n, 1_000_000, 50_000)
    a.windows = dflt(a.windows, 7, 5)
    a.cache_mib = dflt(a.cache_mib, [512, 1024], [512])
    a.repeats = dflt(a.repeats, 2, 1)
    a.quiet_max_wait = dflt(a.quiet_max_wait, 60.0, 0.0)
    a.window_s = dflt(a.window_s, 1.0, 0.2)
    a.warmup_s = dflt(a.warmup_s, 1.0, 0.2)
    a.warm_max_s = dflt(a.warm_max_s, 30.0, 3.0)
    a.cold_max_s = dflt(a.cold_max_s, 60.0, 3.0)
    for mode in MODES:
        mode.finish_args(a, q, argv or sys.argv)
    if a.workloads is None:  # the default workloads, unless a mode that replaces them was asked for
        a.workloads = [] if any(m.exclusive and m.requested(a) for m in MODES) else ["atari", "atari_x8", "lowdim"]
    if a.windows < 5 and not q:
        p.error("--windows must be >= 5 (medians of at least 5 windows)")
    return a


def report_from(a) -> int:
    """Re-print an earlier run's report from its JSON, its rounds re-aggregated with its own arguments."""
    with open(a.report_from) as f:
        results = json.load(f)
    saved = argparse.Namespace(**{**vars(a), **results["args"]})
    for mode in MODES:
        if mode.key in results:
            mode.reaggregate(results[mode.key], saved)
    results["targets"] = evaluate_targets(results, saved)
    print(report(results, saved))
    if a.json and a.json != a.report_from:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
    return 0


def main(argv=None, doc: str = DESCRIPTION):
    a = parse_args(argv, doc)
    if a.child:
        return child_main(a.child)
    if a.report_from:
        return report_from(a)
    src_note = "working tree"
    if a.mmreplay_rev:
        os.makedirs(a.workdir, exist_ok=True)
        src = snapshot_rev(a.mmreplay_rev, a.workdir)
        os.environ["MMREPLAY_BENCH_SRC"] = src
        sys.path.insert(0, src)
        src_note = f"git {a.mmreplay_rev} snapshot at {src}"
    import torch

    import mmreplay
    t_start = time.perf_counter()
    results = {"meta": {"host": platform.node() + " " + platform.platform(), "cpus": os.cpu_count(),
                        "torch": torch.__version__, "torch_threads": torch.get_num_threads(),
                        "python": platform.python_version(), "loadavg_start": os.getloadavg(),
                        "argv": sys.argv, "started": time.strftime("%Y-%m-%d %H:%M:%S"),
                        "mmreplay": mmreplay.__file__, "mmreplay_source": src_note, "git": git_info()},
               "args": {k: v for k, v in vars(a).items() if k != "child"}, "workloads": {}}
    runner = Runner(a)
    for mode in MODES:
        if mode.requested(a):
            results[mode.key] = mode.run(runner)
    results["meta"]["loadavg_end"] = os.getloadavg()
    results["meta"]["wall_s"] = time.perf_counter() - t_start
    results["targets"] = evaluate_targets(results, a)
    text = report(results, a)
    print(text, flush=True)
    print(f"\n(total wall time {results['meta']['wall_s'] / 60:.1f} min; load avg at end "
          f"{results['meta']['loadavg_end']})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(results, f, indent=1, default=float)
        print(f"figures written to {a.json}")
    return 0
