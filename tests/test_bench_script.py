"""scripts/bench.py (the thin entry of the scripts/benchmarks package): its flags, and a saved run's report
re-printed from JSON with every mode's section and targets. Nothing is measured here."""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCH = os.path.join(REPO, "scripts", "bench.py")


def _bench(*args):
    return subprocess.run([sys.executable, BENCH, *args], capture_output=True, text=True, timeout=300,
                          check=True).stdout


def _system(b32, b256, **extra):
    return {"stored": 1000, "add_per_s": 5000.0, "b32_per_s": b32, "b256_per_s": b256, "b32_windows": [b32] * 5,
            "b256_windows": [b256] * 5, "peak_rss": 300 << 20, "store_bytes": 50_000, "other_cpu_cores": 0.1,
            **extra}


def test_help_lists_every_modes_flags():
    out = _bench("--help")
    for flag in ("--quick", "--workloads", "--systems", "--per", "--cgroup", "--cgroup-limit", "--report-from",
                 "--json", "--mmreplay-rev"):
        assert flag in out


def test_report_from_a_saved_run(tmp_path):
    mm = _system(300.0, 60.0, cache_bytes=512 << 20, disk_bytes=40_000, b32_hit_rate=1.0, b256_hit_rate=0.9,
                 verify_fraction_ok=1.0)
    run = {"meta": {"host": "box", "cpus": 2, "torch": "2.13.0", "torch_threads": 2, "loadavg_start": [1, 1, 1],
                    "mmreplay": "mmreplay/__init__.py", "mmreplay_source": "working tree", "git": {"head": "abc"}},
           "args": {"batch_sizes": [32, 256], "windows": 5, "window_s": 0.2, "repeats": 2, "quiet_cores": 0.3},
           "workloads": {"lowdim": {"n": 1000, "n_envs": 8, "cache_bytes": 512 << 20, "systems": {
               "mmreplay": {"runs": [mm, {**mm, "other_cpu_cores": 1.5, "b256_windows": [1.0] * 5}]},
               "sb3": {"runs": [_system(200.0, 40.0), _system(200.0, 40.0)]},
               "torchrl": {"skipped": "not installed"}}}},
           "per": {"lowdim": {"n": 1000, "n_envs": 8, "cache_bytes": 512 << 20, "systems": {
               "mmreplay": _system(100.0, 20.0), "cpprb_per": _system(150.0, 10.0),
               "torchrl_per": {"error": "Traceback\nImportError: no torchrl"}}}}}
    path = tmp_path / "run.json"
    path.write_text(json.dumps(run))
    out = _bench("--report-from", str(path), "--json", str(tmp_path / "again.json"))
    assert "== Low-dim CartPole" in out and "== every round" in out and "== prioritized replay, Low-dim" in out
    assert "skipped: not installed" in out and "error: ImportError: no torchrl" in out
    # the noisy round (other processes on 1.5 cores) is left out: b256 is the quiet round's 60/s, 1.5x SB3's 40
    assert "Low-dim 1,000: batch-256 rate >= 1x SB3 (warm) |    1.50x | >= 1.00x |   PASS" in out
    assert "PER lowdim 1,000: batch-32 steps/s >= 1x the faster peer |    0.67x | >= 1.00x |   FAIL" in out
    again = json.loads((tmp_path / "again.json").read_text())
    assert [t["pass"] for t in again["targets"]] == [True, False, True]
