"""Import rate, peak RSS and bytes a transition of ``mmreplay import --format dqn-replay`` at small scale.

Writes (once, cached in ``--work``) a Dopamine replay directory of ``--checkpoints`` checkpoints of
``--rows`` rows each, from the real Atari frames of mmreplay/data/atari_fixture.npz
(scripts/make_dqn_replay_fixture.py: Dopamine's add/save rules), then imports it with the CLI in a child
process and reports wall time, transitions/s, the CPU it took (import and encoder child), the process tree's
peak RSS/PSS (sampled every 0.2 s), the sum of each process's own peak RSS (``VmHWM``: no peak missed; not
``ru_maxrss``, which counts the parent's pages at the fork before the child's exec), the store's index bytes
a transition (what grows with the run) and bytes a transition on disk (``measure_import``, which the
``--dqn-replay`` bench uses too).

    python scripts/measure_dqn_replay.py --rows 100000 --checkpoints 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading
import time

sys.path.insert(0, os.path.dirname(__file__))
from make_dqn_replay_fixture import make_fixture  # noqa: E402


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


def _tree(pid: int) -> list[int]:
    """``pid`` and its descendants (the import and its shard encoder child)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            pass
    return out


def high_water_marks(pids, marks: dict) -> None:
    """Each process's own peak RSS so far (``VmHWM``: kept by the kernel, so no peak between two samples is
    missed) into ``marks`` (pid -> bytes). Their sum bounds the tree's peak RSS from above."""
    for p in pids:
        try:
            with open(f"/proc/{p}/status") as f:
                for line in f:
                    if line.startswith("VmHWM:"):
                        marks[p] = max(marks.get(p, 0), int(line.split()[1]) * 1024)
        except OSError:
            pass


def index_bytes_per_transition(path: str) -> float:
    """RAM the store's in-RAM index (``TransitionRing``) takes a transition slot: the part of the import's
    memory that grows with the run (read from the opened store's ring, a measurement script's liberty)."""
    import mmreplay

    with mmreplay.Store.open(path, "r", preload=False) as s:
        ring = s._state.ring
        return ring.nbytes / ring.rows


def tree_memory(pid: int) -> tuple[int, int]:
    """(RSS, PSS) summed over ``pid`` and its descendants, in bytes (PSS splits shared pages, e.g. the staging
    buffers the import and its encoder child share, between them: the memory the import really holds)."""
    rss = pss = 0
    for p in _tree(pid):
        try:
            with open(f"/proc/{p}/smaps_rollup") as f:
                for line in f:
                    if line.startswith("Rss:"):
                        rss += int(line.split()[1]) * 1024
                    elif line.startswith("Pss:"):
                        pss += int(line.split()[1]) * 1024
        except OSError:
            pass
    return rss, pss


def measure_import(src: str, out: str, checkpoints: str | None = None, stream_progress: bool = False) -> dict:
    """``mmreplay import --format dqn-replay src out`` in a child process: wall time, transitions/s, CPU
    seconds of the import and its encoder child (``os.wait4``: the child's own rusage, its reaped children
    included), the process tree's peak RSS and PSS (sampled every 0.2 s) and the store's bytes a transition.
    ``stream_progress``: the CLI's progress bar goes to this process's stderr."""
    cmd = [sys.executable, "-m", "mmreplay.cli", "import", "--format", "dqn-replay", src, out]
    if checkpoints:
        cmd += ["--checkpoints", checkpoints]
    start = time.perf_counter()
    load0 = os.getloadavg()[0]
    child = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=None if stream_progress else subprocess.PIPE,
                             text=True)
    peak = [0, 0]
    marks: dict[int, int] = {}
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            rss, pss = tree_memory(child.pid)
            peak[0], peak[1] = max(peak[0], rss), max(peak[1], pss)
            high_water_marks(_tree(child.pid), marks)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout = child.stdout.read()
    stderr = child.stderr.read() if child.stderr else ""
    _, status, usage = os.wait4(child.pid, 0)
    done.set()
    sampler.join()
    wall = time.perf_counter() - start
    if status:
        raise RuntimeError(f"the import failed (status {status}): {stderr[-3000:]}")
    summary = json.loads(stdout)
    n = summary["transitions"]
    cpu = usage.ru_utime + usage.ru_stime
    frames = os.path.join(out, "frames")
    return {"transitions": n, "seconds": round(wall, 1), "transitions_per_s": round(n / wall),
            "cpu_s": round(cpu, 1), "cpu_us_per_transition": round(cpu / n * 1e6, 1),
            "peak_rss_tree_mb": round(peak[0] / 2**20), "peak_pss_tree_mb": round(peak[1] / 2**20),
            "peak_rss_hwm_sum_mb": round(sum(marks.values()) / 2**20),
            "index_bytes_per_transition": round(index_bytes_per_transition(out), 2),
            "store_bytes": du(out), "store_bytes_per_transition": round(du(out) / n, 1),
            "frame_bytes_per_transition": round(du(frames) / n, 1) if os.path.isdir(frames) else None,
            "loadavg_start": round(load0, 2), "loadavg_end": round(os.getloadavg()[0], 2)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=100_000, help="rows a checkpoint (its capacity)")
    p.add_argument("--checkpoints", type=int, default=2)
    p.add_argument("--work", default="/tmp/mmreplay_dqn_measure")
    args = p.parse_args(argv)
    src = os.path.join(args.work, f"dopamine-{args.rows}x{args.checkpoints}")
    if not os.path.exists(os.path.join(src, f"add_count_ckpt.{args.checkpoints - 1}.gz")):
        start = time.perf_counter()
        shutil.rmtree(src, ignore_errors=True)
        save_at = [args.rows // 10 + args.rows * (i + 1) for i in range(args.checkpoints)]
        make_fixture(src, capacity=args.rows, save_at=save_at)
        print(f"wrote {src} in {time.perf_counter() - start:.1f} s", file=sys.stderr)
    out = os.path.join(args.work, "store")
    shutil.rmtree(out, ignore_errors=True)
    report = {"rows": args.rows * args.checkpoints, **measure_import(src, out),
              "source_gz_bytes_per_row": round(du(src) / (args.rows * args.checkpoints), 1)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
