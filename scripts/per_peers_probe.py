#!/usr/bin/env python
"""Rates of the PER peers (``scripts/benchmarks/peers/``: ``cpprb_per``, ``torchrl_per``).

    python scripts/per_peers_probe.py                  # low-dim 1M + Atari 100k (n_envs 1 and 8)
    python scripts/per_peers_probe.py --quick          # tiny smoke run
    python scripts/per_peers_probe.py --check-torchrl-ext
    python scripts/per_peers_probe.py --rebuild-torchrl-ext

Workloads: ``lowdim`` = ``synthetic_stream`` obs (4,) float32, 2 actions, 1M transitions added 8 envs
at a time (``make_lowdim(kind, N, 8)``); ``atari`` = ``synthetic_stream`` 84x84 uint8 noise frames,
frame stack 4, 100k transitions, ``n_envs`` 1 and 8 (stacks generated per chunk of steps, untimed; a
chunk ends every env's episode with a truncation).  Capacity = N.

Each (peer, workload) runs in a FRESH process (``measure.tune_malloc()``, torch threads left at their
default, as ``scripts/bench.py`` does), after waiting for a quiet machine (1-min load < ``--max-load``).

* ``add/s``: transitions/s while filling the empty buffer (only ``add_batch`` calls are timed).
* ``step/s``: one PER training step = ``out = sample(B)`` + ``update_priorities(out["indices"],
  random priorities)``; median of ``--windows`` windows of ``--window-s`` s after ``--warmup-s``.
* ``smp/s``: ``sample(B)`` alone, same method (for reference).
* ``others``: cores other processes kept busy during the step/s windows (/proc/stat minus our CPU
  time; max over B): the noise indicator (the machine is shared).
* ``check``: ``peers.check_per_peer`` after the timings (weights in (0,1], indices valid, an update
  moves the distribution), ``stack_err``: ``peers.check_peer``.

TorchRL's ``PrioritizedSampler`` needs ``torchrl._torchrl`` (C++ segment trees).  No torchrl wheel on
PyPI (0.8.1 ... 0.14.1) loads against torch 2.13.0+cpu: 0.14.x fails with an undefined
``torch::autograd::_wrap_outputs(...)`` symbol, 0.8-0.13 with ``torch::autograd::deleteNode(Node*)``.
The wheel ships its C++ sources (``torchrl/csrc``), so ``--rebuild-torchrl-ext`` recompiles the CPU
extension against the installed torch (``torch.utils.cpp_extension``, g++, ~1 min on 2 cores) and
installs it over the wheel's ``.so`` (the original is kept as ``_torchrl.so.orig-wheel``).

Measured (2026-12-02, this 2-core shared VM, torch 2.13.0+cpu, torchrl 0.14.1 + rebuilt extension,
cpprb 11.0.0, torch threads 2, medians of 5 x 1 s).  Rows marked * ran while another engineer's
``bench.py`` kept ~1 core busy ("others" ~1.0): upper-bound noise, rerun them quietly.

    peer         workload     N     add/s    step/s B32  step/s B256  (sample-only B32 / B256)
    cpprb_per    lowdim E=8   1M    500,362     18,578     3,639*     (27,452 / 5,382*)
    torchrl_per  lowdim E=8   1M     27,579      3,624     2,064      ( 5,231 / 3,079)
    cpprb_per    atari  E=1   100k   18,851      3,222       532      ( 3,698 /   546)
    torchrl_per  atari  E=1   100k    1,560      1,011       190      ( 1,137 /   196)
    cpprb_per    atari  E=8   100k   19,726*     1,535*      305*     ( 1,901*/   327*)
    torchrl_per  atari  E=8   100k      650*        75*       60*     (    77*/    60*)
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from benchmarks import peers  # noqa: E402  (after the path set-up above)
from benchmarks.measure import CpuMeter, rate_windows, time_adds, tune_malloc  # noqa: E402  (as bench.py measures)
from benchmarks.sources import synthetic_stream  # noqa: E402


# --------------------------------------------------------------------------
# torchrl C++ extension
# --------------------------------------------------------------------------
def torchrl_ext_status() -> str:
    """'ok' or the error text of importing ``torchrl._torchrl``."""
    import torch  # noqa: F401  (the extension links against libtorch)
    try:
        from torchrl import _torchrl
        _torchrl.SumSegmentTreeFp32(4)
        return "ok"
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"


def rebuild_torchrl_ext(build_dir="/tmp/mmreplay_torchrl_ext_build") -> str:
    """Recompile ``torchrl/csrc`` (CPU segment trees + safetanh) against the installed torch and
    install the result over ``torchrl/_torchrl*.so``.  Returns the installed path."""
    import glob
    import importlib.util
    import shutil
    import subprocess
    import sysconfig
    spec = importlib.util.find_spec("torchrl")
    pkg = os.path.dirname(spec.origin)
    src = os.path.join(pkg, "csrc")
    if not os.path.isfile(os.path.join(src, "pybind.cpp")):
        raise SystemExit(f"no C++ sources in {src}")
    shutil.rmtree(build_dir, ignore_errors=True)
    shutil.copytree(src, os.path.join(build_dir, "csrc"))
    with open(os.path.join(build_dir, "setup.py"), "w") as f:
        f.write("from setuptools import setup\n"
                "from torch.utils.cpp_extension import BuildExtension, CppExtension\n"
                "setup(name='torchrl_ext', ext_modules=[CppExtension('torchrl._torchrl', "
                "['csrc/pybind.cpp', 'csrc/utils.cpp'], extra_compile_args=['-O3'])], "
                "cmdclass={'build_ext': BuildExtension})\n")
    env = dict(os.environ, MAX_JOBS=str(os.cpu_count() or 1))
    subprocess.run([sys.executable, "setup.py", "build_ext", "--build-lib", "out"],
                   cwd=build_dir, env=env, check=True, stdout=subprocess.DEVNULL)
    built = glob.glob(os.path.join(build_dir, "out", "torchrl", "_torchrl*.so"))[0]
    subprocess.run(["strip", "--strip-debug", built], check=False)
    dest = os.path.join(pkg, "_torchrl" + sysconfig.get_config_var("EXT_SUFFIX"))
    if os.path.exists(dest) and not os.path.exists(os.path.join(pkg, "_torchrl.so.orig-wheel")):
        shutil.copy2(dest, os.path.join(pkg, "_torchrl.so.orig-wheel"))
    shutil.copy2(built, dest + ".tmp")
    os.replace(dest + ".tmp", dest)
    return dest


# --------------------------------------------------------------------------
# one run (fresh process)
# --------------------------------------------------------------------------
def others_cores(fn):
    """Run ``fn()``; return (its result, cores that OTHER processes kept busy meanwhile)."""
    meter = CpuMeter()
    out = fn()
    return out, meter.result()["other_cpu_cores"]


def run_one(spec: dict) -> dict:
    import logging

    tuned = tune_malloc()
    import torch
    kind, wl, n, E = spec["peer"], spec["workload"], spec["n"], spec["n_envs"]
    if kind.startswith("torchrl"):
        import torchrl  # noqa: F401
        logging.getLogger("torchrl").setLevel(logging.WARNING)
    if wl == "lowdim":
        shape, dtype, S, nA = (4,), np.float32, 1, 2
    else:
        shape, dtype, S, nA = (84, 84), np.uint8, 4, 6
    steps = n // E
    rb = (peers.make_lowdim(kind, steps * E, E) if wl == "lowdim"
          else peers.make(kind, steps * E, shape, dtype, E, S, n_actions=nA))
    chunk = steps if wl == "lowdim" else max(1, 4096 // E)
    t_add, done, c = 0.0, 0, 0
    while done < steps:
        k = min(chunk, steps - done)
        d = synthetic_stream(k, E, shape, dtype, S, n_actions=nA, seed=1000 + c)
        d["truncated"][-1] |= ~d["terminated"][-1]        # chunk boundary = episode end
        o, a, r, no, te, tr = (d[x] for x in ("obs", "action", "reward", "next_obs",
                                              "terminated", "truncated"))
        t_add += time_adds(rb.add_batch, (o, a, r, no, te, tr), k)
        done += k
        c += 1
        del d, o, no
    res = {"peer": kind, "workload": wl, "n_envs": E, "stored": len(rb),
           "add_per_s": steps * E / t_add, "malloc_tuned": tuned,
           "torch_threads": torch.get_num_threads()}
    rng = np.random.default_rng(0)
    for B in spec["batch_sizes"]:
        def step(B=B):
            out = rb.sample(B)
            rb.update_priorities(out["indices"], rng.random(B) * 2.0)
        w, busy = others_cores(lambda step=step: rate_windows(
            step, spec["windows"], spec["window_s"], spec["warmup_s"]))
        res[f"step{B}_per_s"], res[f"step{B}_windows"] = float(np.median(w)), w
        res[f"step{B}_others_cores"] = busy
        w = rate_windows(lambda B=B: rb.sample(B), spec["windows"], spec["window_s"],
                         spec["warmup_s"])
        res[f"sample{B}_per_s"], res[f"sample{B}_windows"] = float(np.median(w)), w
    res["stack_err"] = peers.check_peer(rb, S) if S > 1 else 0.0
    res["check"] = peers.check_per_peer(rb)
    rb.close()
    return res


def wait_quiet(max_load, max_wait_s=180):
    t0 = time.time()
    while os.getloadavg()[0] > max_load and time.time() - t0 < max_wait_s:
        time.sleep(5)
    return os.getloadavg()[0]


def main(argv=None):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--peers", nargs="+", default=["cpprb_per", "torchrl_per"])
    p.add_argument("--lowdim-n", type=int, default=1_000_000)
    p.add_argument("--atari-n", type=int, default=100_000)
    p.add_argument("--atari-envs", type=int, nargs="+", default=[1, 8])
    p.add_argument("--no-lowdim", action="store_true")
    p.add_argument("--no-atari", action="store_true")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[32, 256])
    p.add_argument("--windows", type=int, default=5)
    p.add_argument("--window-s", type=float, default=1.0)
    p.add_argument("--warmup-s", type=float, default=1.0)
    p.add_argument("--max-load", type=float, default=0.7,
                   help="wait (up to 3 min) for the 1-min load average to drop below this")
    p.add_argument("--quick", action="store_true", help="tiny N, 2 short windows")
    p.add_argument("--json", help="also dump every figure here")
    p.add_argument("--check-torchrl-ext", action="store_true")
    p.add_argument("--rebuild-torchrl-ext", action="store_true")
    a = p.parse_args(argv)
    if a.check_torchrl_ext or a.rebuild_torchrl_ext:
        if a.rebuild_torchrl_ext:
            print("installed", rebuild_torchrl_ext())
        print("torchrl._torchrl:", torchrl_ext_status())
        return
    if a.quick:
        a.lowdim_n, a.atari_n, a.windows, a.window_s, a.warmup_s = 16_000, 4_000, 2, 0.2, 0.1
    import torch
    import torchrl
    print(f"torch {torch.__version__}, torchrl {torchrl.__version__}, "
          f"torchrl._torchrl: {torchrl_ext_status()}, {os.cpu_count()} CPUs")
    cfgs = [] if a.no_lowdim else [("lowdim", a.lowdim_n, 8)]
    if not a.no_atari:
        cfgs += [("atari", a.atari_n, E) for E in a.atari_envs]
    ctx = mp.get_context("spawn")
    rows = []
    for wl, n, E in cfgs:
        for kind in a.peers:
            load = wait_quiet(a.max_load)
            spec = {"peer": kind, "workload": wl, "n": n, "n_envs": E,
                    "batch_sizes": a.batch_sizes, "windows": a.windows,
                    "window_s": a.window_s, "warmup_s": a.warmup_s}
            with ProcessPoolExecutor(1, mp_context=ctx) as ex:
                r = ex.submit(run_one, spec).result()
            r["load_before"] = load
            r["load_after"] = os.getloadavg()[0]
            rows.append(r)
            cells = [f"{kind:>12s}", f"{wl:>6s}", f"E={E}", f"N={r['stored']:,}",
                     f"add/s {r['add_per_s']:>9,.0f}"]
            for B in a.batch_sizes:
                cells.append(f"B{B} step/s {r[f'step{B}_per_s']:>7,.0f} "
                             f"(smp/s {r[f'sample{B}_per_s']:>7,.0f})")
            oc = max(r[f"step{B}_others_cores"] for B in a.batch_sizes)
            cells.append(f"check {'ok' if r['check']['ok'] else r['check']} "
                         f"stack_err {r['stack_err']:.3f} others {oc:.2f} cores")
            print("  ".join(cells), flush=True)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
