"""The parent process of a benchmark run: fresh children per measurement, rounds aggregated from the quiet
ones, the mmreplay source (working tree or a git snapshot).

Invariants: every measurement runs in a new interpreter (``scripts/bench.py --child``), never in the
parent; a child that fails or is killed yields ``{"error": ...}``, never a missing row; interference only
ever slows a run down, so the figures come from the rounds that other processes disturbed least.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

from .measure import CpuMeter, log

SCRIPTS = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPO = os.path.dirname(SCRIPTS)
#: the command line entry that children are started with (``--child SPEC``)
ENTRY = os.path.join(SCRIPTS, "bench.py")
MiB = 1 << 20
DEFAULT_WORKDIR = "/tmp/mmreplay_bench"


class Runner:
    """The parent side: runs each measurement as a fresh child (optionally in a cgroup), after waiting for a
    quiet machine, and collects its JSON figures."""

    def __init__(self, args):
        self.args = args
        self.workdir = args.workdir
        os.makedirs(self.workdir, exist_ok=True)

    def child(self, spec: dict, cgroup: dict | None = None, timeout: float = 3600, label: str = "",
              wrap: list[str] | None = None) -> dict:
        fd, out = tempfile.mkstemp(prefix="child_", suffix=".json", dir=self.workdir)
        os.close(fd)
        spec = {**spec, "out": out, "workdir": self.workdir}
        if cgroup:
            spec["cgroup_dir"] = cgroup["dir"]
            for fn in ("memory.max_usage_in_bytes", "memory.failcnt"):  # v1: per-child peak and failures
                try:
                    with open(os.path.join(cgroup["dir"], fn), "w") as f:
                        f.write("0")
                except OSError:
                    pass
        cmd = (wrap or []) + [sys.executable, ENTRY, "--child", json.dumps(spec)]
        if cgroup:  # the shell joins the cgroup, then execs the child: everything it maps is charged there
            cmd = ["sh", "-c", f'echo $$ > {cgroup["procs"]} && exec "$@"', "sh"] + cmd
        quiet = self.wait_quiet(label)
        log(f"[bench] {label} ...")
        t0 = time.perf_counter()
        try:
            p = subprocess.run(cmd, timeout=timeout, check=False)
            rc = p.returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        wall = time.perf_counter() - t0
        try:
            with open(out) as f:
                res = json.load(f)
        except (OSError, ValueError):
            res = {}
        os.remove(out)
        if rc != 0 and "error" not in res:
            res["error"] = f"child exited with {rc} (killed? OOM?)"
        res["child_wall_s"] = wall
        res["other_cpu_before_start"] = quiet
        log(f"[bench] {label} done in {wall:.1f}s" + (f"  ERROR: {res['error'].strip().splitlines()[-1]}"
                                                       if "error" in res else ""))
        return res

    def wait_quiet(self, label: str) -> float | None:
        """Shared machine: before a child starts, wait (at most --quiet-max-wait s) until other processes
        used < --quiet-cores cores over a 2 s probe.  Returns the last probe's figure."""
        a = self.args
        if a.quiet_max_wait <= 0:
            return None
        t_end = time.perf_counter() + a.quiet_max_wait
        waited = False
        while True:
            m = CpuMeter()
            time.sleep(2.0)
            other = m.result()["other_cpu_cores"]
            if other < a.quiet_cores or time.perf_counter() >= t_end:
                if waited:
                    log(f"[bench] {label}: other processes now use {other:.2f} cores"
                        + ("" if other < a.quiet_cores else " (gave up waiting)"))
                return other
            if not waited:
                log(f"[bench] {label}: other processes use {other:.2f} cores; waiting for quiet "
                    f"(< {a.quiet_cores}, at most {a.quiet_max_wait:.0f}s)")
                waited = True

    # -- workloads ---------------------------------------------------------------------------
    def rate_spec(self):
        a = self.args
        return {"windows": a.windows, "window_s": a.window_s, "warmup_s": a.warmup_s, "warm_max_s": a.warm_max_s,
                "cold_max_s": a.cold_max_s}


QUIET_CORES = 0.3


def aggregate_runs(runs: list[dict], quiet_cores: float = QUIET_CORES) -> dict:
    """Combine one system's rounds.  Interference on this shared box only ever slows a run down, and can
    make it bimodal (see docs/performance.md: torch's OpenMP copies collapse when another process takes a
    core), so the figures come from the QUIET rounds: those whose children saw other processes use less
    than ``quiet_cores`` cores (if none, the quietest round).  Over those: batch rates = median of all their
    timed windows, other figures = median over rounds, peak RSS = max.  Every round stays under "runs"."""
    ok = [r for r in runs if "error" not in r and "skipped" not in r]
    if not ok:
        return runs[0] if len(runs) == 1 else {**runs[0], "runs": runs}
    if len(runs) == 1:
        return {**runs[0], "rounds_used": [1]}
    noise = [r.get("other_cpu_cores") or 0.0 for r in ok]
    use = [r for r, x in zip(ok, noise) if x < quiet_cores] or [ok[int(np.argmin(noise))]]
    out = {"runs": runs, "rounds_used": [i + 1 for i, r in enumerate(runs) if any(r is u for u in use)]}
    for k in [k for k, v in use[0].items() if not isinstance(v, dict)]:
        vals = [r.get(k) for r in use]
        if k.endswith("_windows"):
            out[k] = [x for v in vals if v for x in v]
        elif all(isinstance(v, bool) for v in vals):
            out[k] = all(vals)
        elif all(isinstance(v, (int, float)) for v in vals):
            out[k] = max(vals) if k.startswith("peak_rss") or k == "other_cpu_cores" else float(np.median(vals))
        else:
            out[k] = vals[0]
    for k in list(out):
        if k.endswith("_windows") and out[k]:
            out[k[: -len("_windows")] + "_per_s"] = float(np.median(out[k]))
    out["peak_rss"] = max(r.get("peak_rss", 0) for r in ok)  # memory is not noise: the max over every round
    if any("error" in r for r in runs):
        out["error_rounds"] = [r["error"] for r in runs if "error" in r]
    return out


def git_info() -> dict:
    def git(*args):
        try:
            return subprocess.run(["git", "-C", REPO, *args], capture_output=True, text=True, timeout=30,
                                  check=False).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return ""
    return {"head": git("rev-parse", "--short", "HEAD"), "dirty_mmreplay": git("status", "--short", "mmreplay")}


def snapshot_rev(rev: str, workdir: str) -> str:
    """``git archive <rev> mmreplay`` into the workdir (the repository itself is not touched)."""
    sha = subprocess.run(["git", "-C", REPO, "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    dest = os.path.join(workdir, f"mmreplay_src_{sha}")
    if not os.path.isdir(os.path.join(dest, "mmreplay")):
        os.makedirs(dest, exist_ok=True)
        arch = subprocess.run(["git", "-C", REPO, "archive", sha, "mmreplay"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", dest], input=arch, check=True)
    return dest
