"""Import rate, peak RSS and bytes a transition of ``mmreplay import --format dqn-replay`` at small scale.

Writes (once, cached in ``--work``) a Dopamine replay directory of ``--checkpoints`` checkpoints of
``--rows`` rows each, from the real Atari frames of mmreplay/data/atari_fixture.npz
(scripts/make_dqn_replay_fixture.py: Dopamine's add/save rules), then imports it with the CLI in a child
process and reports wall time, transitions/s, the child's peak RSS and the store's bytes a transition.

    python scripts/measure_dqn_replay.py --rows 100000 --checkpoints 2
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(__file__))
from make_dqn_replay_fixture import make_fixture  # noqa: E402


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(root, f)) for root, _, files in os.walk(path) for f in files)


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
    start = time.perf_counter()
    # the import's own rusage (os.wait4): a child forked from this process (which may hold the generated
    # buffer) would otherwise report this process's pages as its peak
    child = subprocess.Popen([sys.executable, "-m", "mmreplay.cli", "import", "--format", "dqn-replay", src, out],
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    stdout, stderr = child.stdout.read(), child.stderr.read()
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status:
        print(stderr, file=sys.stderr)
        return 1
    summary = json.loads(stdout)
    peak = usage.ru_maxrss * 1024
    cpu = usage.ru_utime + usage.ru_stime
    n = summary["transitions"]
    frames = os.path.join(out, "frames")
    report = {"transitions": n, "rows": args.rows * args.checkpoints, "seconds": round(wall, 1),
              "transitions_per_s": round(n / wall), "import_process_cpu_s": round(cpu, 1),
              "peak_rss_mb": round(peak / 2**20),
              "store_bytes_per_transition": round(du(out) / n, 1),
              "frame_bytes_per_transition": round(du(frames) / n, 1) if os.path.isdir(frames) else None,
              "source_gz_bytes_per_row": round(du(src) / (args.rows * args.checkpoints), 1)}
    print(json.dumps(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
