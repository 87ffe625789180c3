"""Formatting of benchmark results: numbers, plain-text and markdown tables, the targets table, and the
whole report (the run's header, then each mode's sections in ``MODES`` order, then the targets).

Invariant: the report is a pure function of the results JSON and the arguments, so ``--report-from``
re-prints an earlier run exactly.
"""
from __future__ import annotations

from .tables import MiB, _f, md_table, table  # noqa: F401  (re-exported for the modes' older imports)


def targets_text(targets, md=False) -> str:
    rows = []
    for x in targets:
        v = x["value"]
        vs = "-" if v is None else (f"{v:.2f}x" if x["unit"] == "x" else f"{v:,.0f} {x['unit']}")
        th = f"{'<=' if x.get('le', 'RSS' in x['target']) else '>='} " + (f"{x['threshold']:.2f}x" if x["unit"] == "x"
                                                             else f"{x['threshold']:,.0f} {x['unit']}")
        rows.append([x["target"], vs, th, {True: "PASS", False: "FAIL", None: "n/a"}[x["pass"]]])
    return (md_table if md else table)(["target", "measured", "needed", "result"], rows)


def evaluate_targets(results: dict, args) -> list[dict]:
    """Each mode's pass/fail targets on its part of ``results``, in ``MODES`` order."""
    from .modes import MODES
    t = []

    def add(name, value, threshold, unit="x", le=False):
        ok = None if value is None else (value <= threshold if le else value >= threshold)
        t.append({"target": name, "value": value, "threshold": threshold, "unit": unit, "pass": ok, "le": le})

    for mode in MODES:
        part = results.get(mode.key)
        if part:
            mode.targets(part, args, add)
    return t


def report(results: dict, args) -> str:
    from .modes import MODES
    out = []
    meta = results["meta"]
    out.append(f"mmreplay benchmark  ({meta['host']}; {meta['cpus']} CPUs; torch {meta['torch']} "
               f"({meta['torch_threads']} threads, default); tune_malloc in every child; load avg at start "
               f"{meta['loadavg_start']})")
    g = meta.get("git", {})
    out.append(f"mmreplay: {meta.get('mmreplay_source')} ({meta.get('mmreplay')}); repo HEAD {g.get('head')}"
               + (", mmreplay/ has uncommitted changes" if g.get("dirty_mmreplay") and
                  meta.get("mmreplay_source") == "working tree" else ""))
    out.append(f"rates: median of {args.windows} windows x {args.window_s}s after warm-up per child; "
               f"{args.repeats} interleaved round(s) of fresh children per system, figures from the quiet rounds "
               f"(other processes < {args.quiet_cores} cores; else the quietest round), peak RSS the max over all; "
               "the machine is shared and noisy, so compare ratios within this run rather than absolute numbers")
    for mode in MODES:
        if mode.key in results:
            out += mode.report(results[mode.key], results, args)
    out.append("\n== targets ==")
    out.append(targets_text(results["targets"]))
    return "\n".join(out)
