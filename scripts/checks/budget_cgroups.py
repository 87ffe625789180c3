"""Checks that the default budget (``Settings.cache_bytes`` under a memory limit) keeps readers and writers of
Atari, DMC-like and low-dimensional stores inside 600 MiB, 1 GiB and 2 GiB memory cgroups: no OOM kill, peak RSS.

Issue 40, item 5. Each run is a child process that joins a fresh cgroup v1 memory controller (page cache
charged to it, as ``scripts/benchmarks/cgroup.py`` makes them; needs root) before it imports anything:

- a reader opens a prebuilt store with the default settings and samples ``--batches`` batches (half of them
  batch-32, half batch-256, frame stacks as the store has them, the sampler's default prefetch);
- a writer creates a store with the defaults and extends it until the observations it added are larger than
  the limit (low-dim: 2M transitions, two laps of the default 1M ring), then flushes and closes.

The stores the readers open are built once, outside the cgroups, larger than the limits decoded: 200k Atari
transitions (the fixture's real frames, cycled), 50k DMC-like 3x84x84 RGB transitions (a drifting textured
scene with noise: compresses like real renders, ~3-5x), 1M low-dimensional ones (17 float32). Before each
reader run the store's pages are evicted from the page cache (``posix_fadvise DONTNEED`` on its files, not a
global drop), so the run reads them again into its own cgroup.

A run counts as OOM-killed when it exits by SIGKILL or the cgroup's ``oom_control`` counts a kill.

    python scripts/checks/budget_cgroups.py build [--workdir DIR]
    python scripts/checks/budget_cgroups.py run --runs 2 [--limits 600,1024,2048] [--out results.jsonl]
    python scripts/checks/budget_cgroups.py table results.jsonl [...]  (markdown: limit, workload, role, runs, ...)
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time

MIB = 1 << 20
HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
DEFAULT_WORKDIR = "/tmp/mmreplay_budget_check"
WORKLOADS = {"atari": 200_000, "dmc": 50_000, "lowdim": 1_000_000}
EPISODE = 1000  # steps an episode (truncated), every workload
LOWDIM_OBS = 17  # a MuJoCo-sized observation (HalfCheetah)
BLOCK = 1000  # transitions an extend
LOWDIM_WRITER_ADDS = 2_000_000  # two laps of the default capacity (1M): the whole index ring, wrapped


# -- data --------------------------------------------------------------------------------------------------
def atari_pool():
    import numpy as np
    with np.load(os.path.join(REPO, "mmreplay", "data", "atari_fixture.npz")) as d:
        return np.ascontiguousarray(d["frames"])


def dmc_pool(n: int = 600):
    """``n`` 3x84x84 frames of a drifting textured scene (smooth colour gradients, a moving blob, sparse noise):
    as compressible as rendered frames are, deterministic."""
    import numpy as np
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:84, 0:84].astype(np.float32)
    texture = rng.integers(0, 24, (3, 84, 84)).astype(np.float32)
    frames = np.empty((n, 3, 84, 84), np.uint8)
    for t in range(n):
        cx, cy = 42 + 30 * np.sin(t / 23.0), 42 + 30 * np.cos(t / 31.0)
        blob = 120.0 * np.exp(-((x - cx) ** 2 + (y - cy) ** 2) / 90.0)
        for c in range(3):
            base = 60 + 40 * np.sin((x + 2 * t) / (11.0 + 4 * c)) + 30 * np.cos((y - t) / (17.0 + 3 * c))
            frames[t, c] = np.clip(base + texture[c] + blob * (c + 1) / 3, 0, 255).astype(np.uint8)
        noise = rng.random((84, 84)) < 0.05
        frames[t][:, noise] = rng.integers(0, 256, (3, int(noise.sum())), dtype=np.uint8)
    return frames


def spaces_of(workload: str):
    import numpy as np
    from gymnasium import spaces
    if workload == "atari":
        return spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(18), dict(frame_stack=4, reward_values=(-1, 0, 1))
    if workload == "dmc":
        return spaces.Box(0, 255, (3, 84, 84), np.uint8), spaces.Box(-1, 1, (6,), np.float32), dict(frame_stack=3)
    return spaces.Box(-np.inf, np.inf, (LOWDIM_OBS,), np.float32), spaces.Box(-1, 1, (6,), np.float32), {}


class Source:
    """Transition ``i`` of a workload: obs is pool frame ``i % len(pool)``, next_obs the following one."""

    def __init__(self, workload: str):
        import numpy as np
        self.workload = workload
        if workload == "atari":
            self.pool = atari_pool()
        elif workload == "dmc":
            self.pool = dmc_pool()
        else:
            self.pool = np.random.default_rng(1).standard_normal((4096, LOWDIM_OBS)).astype(np.float32)
        self.obs_nbytes = self.pool[0].nbytes

    def block(self, a: int, b: int) -> tuple:
        import numpy as np
        i = np.arange(a, b)
        n = len(self.pool)
        obs, next_obs = self.pool[i % n], self.pool[(i + 1) % n]
        action = (i % 18) if self.workload == "atari" else ((i[:, None] % 7) / 7.0 * np.ones(6) - 0.5).astype(np.float32)
        reward = ((i % 3) - 1).astype(np.float32)
        return obs, action, reward, next_obs, np.zeros(len(i), bool), i % EPISODE == EPISODE - 1


def fill(store, source: Source, n: int) -> None:
    import numpy as np
    for a in range(0, n, BLOCK):
        b = min(n, a + BLOCK)
        store.extend(*source.block(a, b), streams=np.zeros(b - a, np.int64))


def store_path(workdir: str, workload: str) -> str:
    return os.path.join(workdir, f"store_{workload}")


def build(workdir: str) -> None:
    import mmreplay
    os.makedirs(workdir, exist_ok=True)
    for workload, n in WORKLOADS.items():
        path = store_path(workdir, workload)
        if os.path.exists(os.path.join(path, ".built")):
            continue
        shutil.rmtree(path, ignore_errors=True)
        obs, act, kw = spaces_of(workload)
        t0 = time.time()
        with mmreplay.Store.create(path, obs, act, capacity=n, durable=False, commit_every=10**9,
                                   commit_seconds=1e9, cache_bytes=64 * MIB, **kw) as s:
            fill(s, Source(workload), n)
        size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
        open(os.path.join(path, ".built"), "w").write(json.dumps({"n": n, "bytes": size}))
        print(f"built {workload}: {n:,} transitions, {size / MIB:.0f} MiB on disk, {time.time() - t0:.0f} s",
              flush=True)


# -- the children (run inside the cgroup) ------------------------------------------------------------------
def _status(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child_reader(path: str, batches: int) -> dict:
    rss = {"imported": 0}
    import mmreplay
    import torch  # noqa: F401  (what a trainer has imported before it opens its store)
    rss["imported"] = _status("VmRSS")
    t0 = time.time()
    s = mmreplay.Store.open(path, mode="r")
    rss["opened"] = _status("VmRSS")
    half = max(1, batches // 2)
    first = None
    for size in (32, 256):
        with s.sampler(size, seed=size) as sampler:
            for _ in range(half):
                batch = next(sampler)
                if first is None:
                    first = rss["first_batch"] = _status("VmRSS")
        del batch
    rss["end"] = _status("VmRSS")
    stats = s.inspect.cache_stats()
    out = {"cache_bytes": s.settings.cache_bytes, "rss": rss, "seconds": time.time() - t0,
           "compressed_held": sum(v["compressed"]["bytes"] for v in stats.values() if isinstance(v, dict)
                                  and "compressed" in v)}
    s.close()
    out["peak_rss"] = _status("VmHWM")
    return out


def child_writer(path: str, workload: str, limit: int) -> dict:
    import mmreplay
    import torch  # noqa: F401
    rss = {"imported": _status("VmRSS")}
    t0 = time.time()
    obs, act, kw = spaces_of(workload)
    source = Source(workload)
    n = int(1.1 * limit / source.obs_nbytes) + BLOCK  # observations added: larger than the limit
    if workload == "lowdim":  # 68-byte rows: that would be 10-35M adds; two laps of the default 1M ring do
        n = min(n, LOWDIM_WRITER_ADDS)
    s = mmreplay.Store.create(path, obs, act, **kw)
    rss["created"] = _status("VmRSS")
    fill(s, source, n)
    s.flush()
    cache_bytes = s.settings.cache_bytes
    s.close()
    return {"cache_bytes": cache_bytes, "added": n, "rss": rss, "seconds": time.time() - t0,
            "peak_rss": _status("VmHWM")}


# -- the parent ---------------------------------------------------------------------------------------------
def make_cgroup(limit: int, name: str) -> str:
    sys.path.insert(0, os.path.dirname(HERE))
    from benchmarks.cgroup import make_memory_cgroup
    cg = make_memory_cgroup(limit, name)
    if cg["version"] != 1:
        raise SystemExit(f"expected a cgroup v1 memory controller, got v{cg['version']} at {cg['dir']}")
    return cg["dir"]


def cgroup_figures(d: str) -> dict:
    out = {}
    for key, name in (("max_usage", "memory.max_usage_in_bytes"), ("failcnt", "memory.failcnt")):
        try:
            out[key] = int(open(os.path.join(d, name)).read())
        except (OSError, ValueError):
            pass
    try:
        for line in open(os.path.join(d, "memory.oom_control")):
            k, v = line.split()
            if k == "oom_kill":
                out["oom_kill"] = int(v)
    except (OSError, ValueError):
        pass
    return out


def remove_cgroup(d: str) -> None:
    for _ in range(40):
        try:
            os.rmdir(d)
            return
        except OSError:
            try:
                open(os.path.join(d, "memory.force_empty"), "w").write("0")
            except OSError:
                pass
            time.sleep(0.25)


def evict(path: str) -> None:
    """Drop ``path``'s files from the page cache (only theirs: other work on the machine keeps its pages)."""
    for d, _, files in os.walk(path):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def one_run(workdir: str, limit_mib: int, workload: str, role: str, batches: int, seq: int) -> dict:
    limit = limit_mib * MIB
    cg = make_cgroup(limit, f"mmreplay_budget_{os.getpid()}_{seq}")
    target = store_path(workdir, workload) if role == "reader" else os.path.join(workdir, f"w_{os.getpid()}_{seq}")
    if role == "reader":
        evict(target)
    else:
        shutil.rmtree(target, ignore_errors=True)
    args = [sys.executable, os.path.abspath(__file__), "child", role, target, workload, str(limit), str(batches)]
    procs = os.path.join(cg, "cgroup.procs")

    def join_cgroup():
        with open(procs, "w") as f:
            f.write(str(os.getpid()))

    t0 = time.time()
    p = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, preexec_fn=join_cgroup,
                         cwd=REPO)
    try:
        out, err = p.communicate(timeout=1800)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    figures = cgroup_figures(cg)
    rec = {"limit_mib": limit_mib, "workload": workload, "role": role, "rc": p.returncode,
           "wall_s": round(time.time() - t0, 1), **figures}
    lines = [line for line in out.splitlines() if line.startswith("{")]
    if lines:
        rec.update(json.loads(lines[-1]))
    rec["oom"] = p.returncode == -signal.SIGKILL or figures.get("oom_kill", 0) > 0
    if p.returncode != 0:
        rec["stderr"] = err[-1500:]
    if role == "writer":
        shutil.rmtree(target, ignore_errors=True)
    remove_cgroup(cg)
    return rec


def commit_id() -> str:
    try:
        return subprocess.run(["git", "-C", REPO, "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip()
    except OSError:
        return "?"


def run(a) -> None:
    limits = [int(x) for x in a.limits.split(",")]
    cells = [(lim, w, r) for lim in limits for w in a.workloads.split(",") for r in a.roles.split(",")]
    commit, seq = commit_id(), 0
    deadline = time.time() + a.hours * 3600
    with open(a.out, "a") as out:
        for k in range(a.runs):  # round-robin: every cell gets its k-th run before any gets its (k+1)-th
            for lim, w, r in cells:
                if time.time() > deadline:
                    return
                seq += 1
                rec = one_run(a.workdir, lim, w, r, a.batches, seq)
                rec.update(run=k, date=time.strftime("%Y-%m-%d"), commit=commit)
                out.write(json.dumps(rec) + "\n")
                out.flush()
                print(f"{lim} MiB {w} {r} #{k}: rc={rec['rc']} oom={rec['oom']} "
                      f"peak={rec.get('peak_rss', 0) / MIB:.0f} MiB cache={rec.get('cache_bytes', 0) / MIB:.0f} MiB "
                      f"cg_max={rec.get('max_usage', 0) / MIB:.0f} MiB {rec['wall_s']} s", flush=True)


def table(paths: list[str]) -> None:
    rows: dict = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                rec = json.loads(line)
                rows.setdefault((rec["limit_mib"], rec["workload"], rec["role"]), []).append(rec)
    print("| limit | workload | role | runs | OOM kills | other failures | peak RSS median / max (MiB) | "
          "cgroup peak incl. page cache, max (MiB) | default budget (MiB) | date | commit |")
    print("|---:|---|---|---:|---:|---:|---|---:|---:|---|---|")
    for (lim, w, r), recs in sorted(rows.items()):
        peaks = [x["peak_rss"] / MIB for x in recs if "peak_rss" in x]
        budget = sorted({round(x["cache_bytes"] / MIB) for x in recs if "cache_bytes" in x})
        peak = f"{statistics.median(peaks):.0f} / {max(peaks):.0f}" if peaks else "-"
        charged = max((x.get("max_usage", 0) for x in recs), default=0) / MIB
        budget_text = "-" if not budget else str(budget[0]) if len(budget) == 1 else f"{budget[0]}-{budget[-1]}"
        print(f"| {lim} MiB | {w} | {r} | {len(recs)} | {sum(x['oom'] for x in recs)} | "
              f"{sum(1 for x in recs if x['rc'] != 0 and not x['oom'])} | {peak} | {charged:.0f} | "
              f"{budget_text} | {recs[-1]['date']} | "
              f"{', '.join(sorted({x['commit'] for x in recs}))} |")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "child":
        role, path, workload, limit, batches = sys.argv[2:7]
        rec = child_reader(path, int(batches)) if role == "reader" else child_writer(path, workload, int(limit))
        print(json.dumps(rec), flush=True)
        return
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build")
    b.add_argument("--workdir", default=DEFAULT_WORKDIR)
    r = sub.add_parser("run")
    r.add_argument("--workdir", default=DEFAULT_WORKDIR)
    r.add_argument("--runs", type=int, default=20)
    r.add_argument("--limits", default="600,1024,2048")
    r.add_argument("--workloads", default="atari,dmc,lowdim")
    r.add_argument("--roles", default="reader,writer")
    r.add_argument("--batches", type=int, default=300)
    r.add_argument("--hours", type=float, default=24.0)
    r.add_argument("--out", default=os.path.join(DEFAULT_WORKDIR, "results.jsonl"))
    t = sub.add_parser("table")
    t.add_argument("results", nargs="+")
    a = p.parse_args()
    if a.cmd == "build":
        build(a.workdir)
    elif a.cmd == "run":
        run(a)
    else:
        table(a.results)


if __name__ == "__main__":
    main()
