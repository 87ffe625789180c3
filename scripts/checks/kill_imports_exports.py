"""SIGKILL ``mmreplay import`` / ``mmreplay export`` at random moments; nothing half-written may open as data.

For each trial: a job (export of a store to Minari, D4RL-style HDF5, d3rlpy or Dopamine checkpoints, or
an import of one of them into a new store) runs as a real ``python -m mmreplay`` child and is SIGKILLed
after a random delay drawn over its measured duration. Then:

- the destination either does not exist, or opens with its reader (``Store.open``,
  ``minari.MinariDataset``, ``h5py``) and holds the complete result (the counts of an uninterrupted run);
  anything else that opens is a failure ("opened as data");
- the same command, rerun without a kill, succeeds, holds the complete result, and leaves no sibling
  (``<out>.importing-*`` / ``<out>.exporting-*``) behind (a resumable import is rerun with ``--resume``).

Kills that land after the child already finished are counted apart and do not count towards ``--kills``;
``kills_with_partial_output`` counts the kills after which a sibling held part of the output (the job
had started writing).
Prints one JSON line: kills mid-job per job, outputs that opened as data (must be 0), reruns that failed
(must be 0). Exit status 1 when either is not 0.

    python scripts/checks/kill_imports_exports.py --kills 50 --seed 0
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

FORMATS = ("minari", "d4rl", "d3rlpy", "dqn-replay")
#: rows of one Dopamine checkpoint (its default, 1M, makes each export write ~7 GB of arrays)
DQN_CHECKPOINT_ROWS = 2000


def make_source(work: str, steps: int, seed: int) -> str:
    """An Atari-like store (84x84 uint8 frames, frame_stack 4, Discrete(6), clipped rewards) of ``steps``
    transitions in episodes of 100-400 steps, one stream (what every format, Dopamine's included, holds)."""
    from gymnasium import spaces

    import mmreplay

    rng = np.random.default_rng(seed)
    path = os.path.join(work, "source.mmr")
    store = mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=None,
                                  frame_stack=4, reward_values=(-1, 0, 1), durable=False)
    base = rng.integers(0, 256, (84, 84), dtype=np.uint8)
    done = 0
    with store:
        while done < steps:
            n = int(min(steps - done, rng.integers(100, 400)))
            # frames that compress like Atari's: a fixed background with a moving block
            obs = np.repeat(base[None], n + 1, axis=0)
            for t in range(n + 1):
                y, x = (t * 3) % 70, (t * 5) % 70
                obs[t, y:y + 12, x:x + 12] = 255 - t % 200
            term = np.zeros(n, bool)
            term[-1] = True
            store.extend(obs[:-1], rng.integers(0, 6, n), rng.integers(-1, 2, n).astype(np.float32), obs[1:], term,
                         np.zeros(n, bool))
            done += n
    return path


def jobs(work: str, source: str) -> dict[str, dict]:
    """Every job: its command, its destination and the reader kind that checks it."""
    out = {}
    for fmt in FORMATS:
        dataset = os.path.join(work, "datasets", {"minari": "ds-v0", "dqn-replay": "dqn"}.get(fmt, f"ds-{fmt}.h5"))
        dest = os.path.join(work, "out", f"export-{fmt}" + ("" if fmt in ("minari", "dqn-replay") else ".h5"))
        rows = ["--checkpoint-rows", str(DQN_CHECKPOINT_ROWS)] if fmt == "dqn-replay" else []
        out[f"export {fmt}"] = {"argv": ["export", source, dest, "--format", fmt, *rows], "dest": dest, "kind": fmt}
        store = os.path.join(work, "out", f"import-{fmt}.mmr")
        out[f"import {fmt}"] = {"argv": ["import", dataset, store, "--format", fmt], "dest": store, "kind": "store",
                                "dataset": dataset, "fmt": fmt, "resume": fmt == "dqn-replay"}
    return out


def run(argv: list[str], env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "mmreplay", *argv], capture_output=True, text=True, cwd=ROOT,
                          env=env, timeout=900)


def measure(path: str, kind: str) -> dict | None:
    """What ``path`` holds, read by the reader of ``kind``; None when it does not exist or does not open."""
    if not os.path.exists(path):
        return None
    try:
        if kind == "store":
            import mmreplay

            with mmreplay.Store.open(path, mode="r") as s:
                return {"transitions": s.num_added}
        if kind == "minari":
            from minari import MinariDataset

            ds = MinariDataset(os.path.join(path, "data"))
            return {"episodes": ds.total_episodes, "steps": ds.total_steps}
        if kind == "dqn-replay":
            files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*")))
            return {"files": files} if files else None
        import h5py

        with h5py.File(path, "r") as f:
            if kind == "d4rl":
                return {"rows": int(f["rewards"].shape[0])}
            return {"episodes": int(f["num_episodes"][()])}
    except Exception:  # noqa: BLE001 - any refusal means "does not open"
        return None


def siblings(dest: str) -> list[str]:
    return glob.glob(glob.escape(dest) + ".importing-*") + glob.glob(glob.escape(dest) + ".exporting-*")


def clear(dest: str) -> None:
    for p in [dest, *siblings(dest)]:
        if os.path.isdir(p):
            shutil.rmtree(p)
        elif os.path.lexists(p):
            os.unlink(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--kills", type=int, default=50, help="SIGKILLs that land mid-job")
    ap.add_argument("--steps", type=int, default=6000, help="transitions of the source store")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--formats", default=",".join(FORMATS))
    ap.add_argument("--work", help="working directory (default: a temporary one, removed at the end)")
    args = ap.parse_args()
    rng = np.random.default_rng(args.seed)
    work = args.work or tempfile.mkdtemp(prefix="mmreplay-kills-")
    env = {**os.environ, "MINARI_DATASETS_PATH": os.path.join(work, "minari-root")}
    os.environ["MINARI_DATASETS_PATH"] = env["MINARI_DATASETS_PATH"]
    formats = args.formats.split(",")
    try:
        source = make_source(work, args.steps, args.seed)
        all_jobs = {k: v for k, v in jobs(work, source).items() if k.split()[1] in formats}
        # uninterrupted runs: the datasets the imports read, each job's full result and duration
        for fmt in formats:
            job = all_jobs[f"export {fmt}"]
            proc = run(["export", source, all_jobs[f"import {fmt}"]["dataset"], *job["argv"][3:]], env)
            if proc.returncode:
                raise SystemExit(f"making the {fmt} dataset failed:\n{proc.stderr}")
        for name, job in all_jobs.items():
            t0 = time.monotonic()
            proc = run(job["argv"], env)
            job["seconds"] = time.monotonic() - t0
            if proc.returncode:
                raise SystemExit(f"{name} failed without a kill:\n{proc.stderr}")
            job["complete"] = measure(job["dest"], job["kind"])
            clear(job["dest"])
        report = {"kills": {}, "kills_with_partial_output": 0, "finished_before_kill": 0, "opened_as_data": [],
                  "opened_complete": 0,
                  "reruns_failed": [], "leftovers_after_rerun": [],
                  "seconds": {k: round(v["seconds"], 2) for k, v in all_jobs.items()}}
        names = sorted(all_jobs)
        kills = 0
        while kills < args.kills:
            name = names[int(rng.integers(len(names)))]
            job = all_jobs[name]
            # most of a short job is the interpreter starting: aim at the part that writes
            delay = float(rng.uniform(0.3, 1.0)) * job["seconds"]
            child = subprocess.Popen([sys.executable, "-m", "mmreplay", *job["argv"]], cwd=ROOT, env=env,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(delay)
            if child.poll() is not None:
                report["finished_before_kill"] += 1
            else:
                child.send_signal(signal.SIGKILL)
                kills += 1
                report["kills"][name] = report["kills"].get(name, 0) + 1
            child.wait()
            if siblings(job["dest"]):
                report["kills_with_partial_output"] += 1
            held = measure(job["dest"], job["kind"])
            if held is not None:
                if held == job["complete"]:
                    report["opened_complete"] += 1
                else:
                    report["opened_as_data"].append({"job": name, "delay": round(delay, 3), "held": held})
            argv = job["argv"] + (["--resume"] if job.get("resume") and siblings(job["dest"]) else [])
            if held is None:
                proc = run(argv, env)
                if proc.returncode or measure(job["dest"], job["kind"]) != job["complete"]:
                    report["reruns_failed"].append({"job": name, "stderr": proc.stderr[-400:]})
            if siblings(job["dest"]):
                report["leftovers_after_rerun"].append({"job": name, "left": siblings(job["dest"])})
            clear(job["dest"])
        print(json.dumps(report))
        bad = report["opened_as_data"] or report["reruns_failed"] or report["leftovers_after_rerun"]
        return 1 if bad else 0
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
