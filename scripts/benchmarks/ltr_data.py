"""The datasets of the larger-than-RAM workloads (issue #21) and their ground truth: 10M real Atari transitions
(the cached 100k-transition pool tiled, one stream, as ``mm_fill`` builds the 1M store) and 1M transitions of
real DMC frames (the cached pool of 4 tasks x 500 RGB frames cycled over episodes of 500 steps).

Invariant: the store's transition ``i`` (its index, the store never wraps) is dataset transition ``i``, and
every frame, reward and action of it can be rebuilt from ``i`` and the pools alone, so each sampled row is
checked against the real frames.

    python -m benchmarks.ltr_data atari10m|dmc [--n N] [--codec auto|delta-zstd|JSON spec]   (from scripts/; builds the store)
"""
from __future__ import annotations

import json
import os
import time

import numpy as np

from .measure import dir_bytes, log

DMC_EPISODE = 500          # steps an episode (the DMC suite's 1000 at action repeat 2)
DMC_STACK = 3
DMC_ACTION_DIM = 6
BUILD_MARKER = ".bench_complete.json"
WORKLOADS = {"atari10m": 10_000_000, "dmc": 1_000_000}


def frame_codec(codec: str):
    """The ``frame_codec`` to create with: a name (``delta-zstd``; ``auto``: the library's default), or a JSON codec spec
    (``'{"name": "temporal", "layout": 3, "lz4_depth": 1, "level": 12, "run": 16, "search": 8}'``)."""
    return json.loads(codec) if codec.lstrip().startswith("{") else codec


def codec_label(codec: str) -> str:
    """A file-name-safe label of ``codec``: the name itself, or a spec's settings (``temporal-layout3-lz4_depth1...``)."""
    spec = frame_codec(codec)
    if isinstance(spec, str):
        return spec
    return "-".join([str(spec.get("name", "codec"))] + [f"{k}{v}" for k, v in sorted(spec.items()) if k != "name"])


def store_path(workdir: str, workload: str, codec: str, n: int | None = None) -> str:
    n = WORKLOADS[workload] if n is None else n
    name = {"atari10m": "atari10m", "dmc": "dmc1m"}[workload] if n == WORKLOADS[workload] else f"{workload}_{n}"
    return os.path.join(workdir, f"store_{name}_{codec_label(codec)}")


# ----------------------------------------------------------------------------------------------
# DMC: transition i -> pool frames
# ----------------------------------------------------------------------------------------------
class DmcSource:
    """Episode ``e`` is task ``e % 4`` started at frame ``((e // 4) * 100) % 500`` of that task's 500 pool
    frames and cycling through them: step ``s``'s obs is task frame ``(start + s) % 500``, its next obs frame
    ``s + 1``. Rewards and actions are functions of ``i`` (so n-step sums can be rebuilt)."""

    def __init__(self, pool: np.ndarray | None = None):
        if pool is None:
            import dmc_frames
            pool = np.ascontiguousarray(dmc_frames.load_dmc_pool())  # 42 MB, in RAM
        self.pool = pool
        self.per_task = pool.shape[0] // 4

    def frame_ids(self, i: np.ndarray, step_offset: np.ndarray | int = 0) -> np.ndarray:
        """Pool rows of step ``(i % 500) + step_offset`` of transition ``i``'s episode."""
        e, s = np.asarray(i) // DMC_EPISODE, np.asarray(i) % DMC_EPISODE + step_offset
        start = ((e // 4) * 100) % self.per_task
        return (e % 4) * self.per_task + (start + s) % self.per_task

    @staticmethod
    def reward(i: np.ndarray) -> np.ndarray:
        return ((np.asarray(i, np.int64) * 7919) % 1000 / 1000.0).astype(np.float32)

    @staticmethod
    def action(i: np.ndarray) -> np.ndarray:
        i = np.asarray(i, np.int64)[:, None]
        return (((i * 31 + np.arange(DMC_ACTION_DIM)) % 200) / 100.0 - 1.0).astype(np.float32)

    def chunk(self, a: int, b: int) -> dict:
        i = np.arange(a, b)
        last = i % DMC_EPISODE == DMC_EPISODE - 1
        return {"obs": self.pool[self.frame_ids(i)], "next_obs": self.pool[self.frame_ids(i, 1)],
                "action": self.action(i), "reward": self.reward(i), "terminated": np.zeros(len(i), bool),
                "truncated": last}

    def stacks(self, i: np.ndarray, step_offset: np.ndarray) -> np.ndarray:
        """(len(i), 3, 3, 84, 84): the frame stacks ending at step ``i % 500 + step_offset`` of the episode,
        oldest first, padded with the episode's first frame."""
        s = (np.asarray(i) % DMC_EPISODE + step_offset)[:, None] + np.arange(-(DMC_STACK - 1), 1)
        s = np.maximum(s, 0) - (np.asarray(i) % DMC_EPISODE)[:, None]
        return self.pool[self.frame_ids(np.asarray(i)[:, None], s)]

    def nstep(self, i: np.ndarray, n: int, gamma: float) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Expected (obs stacks, next-obs stacks after m <= n steps, discounted reward sum, gamma ** m), as
        n-step returns truncated at the episode end (truncation: the last step's next obs)."""
        i = np.asarray(i, np.int64)
        m = np.minimum(n, DMC_EPISODE - i % DMC_EPISODE)
        ret = np.zeros(len(i), np.float64)
        for k in range(n):
            ret += np.where(k < m, gamma ** k * self.reward(i + k).astype(np.float64), 0.0)
        return self.stacks(i, 0), self.stacks(i, m), ret, gamma ** m


def dmc_spaces():
    from gymnasium import spaces
    return (spaces.Box(0, 255, (3, 84, 84), np.uint8),
            spaces.Box(-1.0, 1.0, (DMC_ACTION_DIM,), np.float32))


# ----------------------------------------------------------------------------------------------
# builds
# ----------------------------------------------------------------------------------------------
def chunks(workload: str, n: int, step: int):
    if workload == "dmc":
        src = DmcSource()
        for a in range(0, n, step):
            yield src.chunk(a, min(n, a + step))
        return
    from .sources import AtariSource
    src = AtariSource()
    for a in range(0, n, step):
        d = src.get(a, min(n, a + step), stacks=False)
        yield d


def build(workload: str, path: str, n: int, codec: str, step: int = 4096) -> dict:
    """Create the store at ``path`` and fill it with ``extend`` of ``step`` transitions of one stream (the
    encoder process compresses beside the adds); write the build's figures to ``BUILD_MARKER`` last, so a
    store without it is an unfinished build."""
    import shutil
    import mmreplay
    from .tasks_mmreplay import mm_spaces
    if os.path.exists(path):
        shutil.rmtree(path)
    if workload == "dmc":
        obs_space, act_space = dmc_spaces()
        kw = dict(frame_stack=DMC_STACK)
    else:
        obs_space, act_space, stack, rv = mm_spaces("atari")
        kw = dict(frame_stack=stack, reward_values=rv)
    t0 = time.perf_counter()
    s = mmreplay.Store.create(path, obs_space, act_space, capacity=n, frame_codec=frame_codec(codec), durable=False,
                              commit_every=1_000_000, commit_seconds=600.0, **kw)
    added, last = 0, time.perf_counter()
    for d in chunks(workload, n, step):
        k = len(d["reward"])
        s.extend(d["obs"], d["action"], d["reward"], d["next_obs"], d["terminated"], d["truncated"],
                 streams=np.zeros(k, np.int64))
        added += k
        if time.perf_counter() - last > 60:
            last = time.perf_counter()
            el = last - t0
            log(f"[ltr build {workload}] {added:,}/{n:,} in {el:.0f} s ({added / el:,.0f}/s, "
                f"~{(n - added) / (added / el) / 60:.0f} min left)")
    s.close()
    build_s = time.perf_counter() - t0
    s = mmreplay.Store.open(path, mode="r")
    stored = len(s)
    stored_codec = {c.name: dict(c.codec) for c in s.schema.observations}  # what the store recorded ("auto" resolved)
    s.close()
    disk = dir_bytes(path)
    frames = dir_bytes(os.path.join(path, "frames"))
    out = {"workload": workload, "n": n, "stored": stored, "codec": codec, "stored_codec": stored_codec,
           "build_s": build_s,
           "add_per_s": added / build_s, "store_bytes": disk, "frames_bytes": frames,
           "bytes_per_transition": disk / max(1, stored), "frame_bytes_per_transition": frames / max(1, stored)}
    with open(os.path.join(path, BUILD_MARKER), "w") as f:
        json.dump(out, f)
    return out


def built(path: str) -> dict | None:
    """The build record of a finished store at ``path``, or None."""
    try:
        with open(os.path.join(path, BUILD_MARKER)) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="build a larger-than-RAM benchmark store")
    p.add_argument("workload", choices=sorted(WORKLOADS))
    p.add_argument("--n", type=int, default=None)
    p.add_argument("--codec", default="delta-zstd")
    p.add_argument("--workdir", default="/tmp/mmreplay_bench")
    p.add_argument("--path", default=None)
    a = p.parse_args()
    n = a.n or WORKLOADS[a.workload]
    print(json.dumps(build(a.workload, a.path or store_path(a.workdir, a.workload, a.codec, n), n, a.codec)))
