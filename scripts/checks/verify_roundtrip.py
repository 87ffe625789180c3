"""Issue "core store", done-when checks: write big stores, reopen them in a fresh process, compare
every transition with what was written; report disk and index bytes per transition and the add rate.

    python scripts/checks/verify_roundtrip.py lowdim [--n 1000000]   # CartPole-like: 4 float32, 2 actions
    python scripts/checks/verify_roundtrip.py atari [--n 100000]     # real frames (scripts/atari_frames.py pool)

The writer and the checker are separate processes; the checker rebuilds the expected transitions from
the same deterministic source and compares them with what the reopened store returns (obs stacks,
next-obs stacks, actions, rewards, flags), all of them, in batches.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # scripts/: atari_frames


# -- sources ---------------------------------------------------------------------------------------

def lowdim_source(n: int, seed: int = 0) -> dict:
    """Episodes of random length (CartPole-like dynamics are irrelevant to storage) with a continuing obs."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 500, size=n // 8 + 2)
    ends = np.cumsum(lengths)
    ends = ends[ends < n]
    done = np.zeros(n, dtype=bool)
    done[ends - 1] = True
    truncated = done & (rng.random(n) < 0.3)
    terminated = done & ~truncated
    frames = rng.standard_normal((n + len(ends) + 1, 4)).astype(np.float32)
    # frame ids: each episode has one frame more than transitions
    episode_of = np.concatenate([[0], np.cumsum(done)[:-1]])
    obs_index = np.arange(n) + episode_of
    return {"frames": frames, "obs_index": obs_index, "next_obs_index": obs_index + 1,
            "action": rng.integers(0, 2, n), "reward": np.ones(n, np.float32), "terminated": terminated,
            "truncated": truncated}


def atari_source(n: int) -> dict:
    from atari_frames import load_atari_pool

    pool = load_atari_pool(verbose=False)
    if n > len(pool["action"]):
        raise SystemExit(f"the pool holds {len(pool['action'])} transitions; use --n <= that")
    src = {k: pool[k][:n] for k in ("obs_index", "next_obs_index", "action", "terminated", "truncated")}
    src["reward"] = np.sign(pool["reward"][:n]).astype(np.float32)
    src["frames"] = pool["frames"]
    return src


def make_store(kind: str, path: str, n: int, frame_stack: int):
    import mmreplay
    from gymnasium import spaces

    if kind == "lowdim":
        return mmreplay.Store.create(path, spaces.Box(-np.inf, np.inf, (4,), np.float32), spaces.Discrete(2),
                                     capacity=n)
    return mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(18), capacity=n,
                                 frame_stack=frame_stack, reward_values=(-1, 0, 1))


# -- writer / checker ------------------------------------------------------------------------------

def write(kind: str, path: str, n: int, frame_stack: int) -> dict:
    src = lowdim_source(n) if kind == "lowdim" else atari_source(n)
    frames = src["frames"]
    store = make_store(kind, path, n, frame_stack)
    elapsed = 0.0
    t0 = time.perf_counter()
    if kind == "lowdim":  # 8 envs at a time: 8 interleaved streams, each a contiguous part of the data
        per = n // 8
        for t in range(per):
            rows = np.arange(8) * per + t
            store.extend(frames[src["obs_index"][rows]], src["action"][rows], src["reward"][rows],
                         frames[src["next_obs_index"][rows]], src["terminated"][rows], src["truncated"][rows])
        elapsed = time.perf_counter() - t0
    else:  # single adds, as an env loop does
        oi, ni, a, r = src["obs_index"], src["next_obs_index"], src["action"], src["reward"]
        te, tr = src["terminated"], src["truncated"]
        for lo in range(0, n, 4096):  # copy frames out of the memory map in blocks, outside the timing
            hi = min(n, lo + 4096)
            obs_blk, nxt_blk = np.asarray(frames[oi[lo:hi]]), np.asarray(frames[ni[lo:hi]])
            t_blk = time.perf_counter()  # time the adds, not the copies out of the memory-mapped pool
            for i in range(hi - lo):
                store.add(obs_blk[i], int(a[lo + i]), float(r[lo + i]), nxt_blk[i], bool(te[lo + i]),
                          bool(tr[lo + i]))
            elapsed += time.perf_counter() - t_blk
    t_close = time.perf_counter()
    store.close()
    seconds = elapsed + time.perf_counter() - t_close
    disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    return {"seconds_incl_close": seconds, "adds_per_s": n / seconds, "disk_bytes": disk,
            "disk_bytes_per_transition": disk / n}


def expected_stacks(src: dict, g: np.ndarray, k: int, per: int | None) -> tuple[np.ndarray, np.ndarray]:
    """Frame indices of the obs / next-obs stacks of transitions ``g`` of the stream layout used by
    ``write`` (``per``: transitions per stream for the 8-stream low-dim layout, else one stream)."""
    t = g if per is None else (g % 8) * per + g // 8  # data row of store id g
    done = src["terminated"] | src["truncated"]
    obs_ids = np.empty((g.size, k), dtype=np.int64)
    cur = t.copy()
    obs_ids[:, k - 1] = src["obs_index"][cur]
    for j in range(1, k):
        prev = cur - 1
        stream_start = (prev < 0) if per is None else (prev // per != cur // per) | (prev < 0)
        has_prev = ~stream_start & ~done[np.maximum(prev, 0)]
        cur = np.where(has_prev, prev, cur)
        obs_ids[:, k - 1 - j] = src["obs_index"][cur]
    next_ids = np.concatenate([obs_ids[:, 1:], src["next_obs_index"][t][:, None]], axis=1)
    return obs_ids, next_ids, t


def check(kind: str, path: str, n: int, frame_stack: int) -> dict:
    import mmreplay

    src = lowdim_source(n) if kind == "lowdim" else atari_source(n)
    frames = src["frames"]
    per = n // 8 if kind == "lowdim" else None
    t0 = time.perf_counter()
    with mmreplay.Store.open(path, mode="r") as store:
        assert len(store) == n, (len(store), n)
        info = store.info()
        for lo in range(0, n, 4096):
            g = np.arange(lo, min(n, lo + 4096))
            b = store.inspect.get(g)
            obs_ids, next_ids, t = expected_stacks(src, g, frame_stack, per)
            if frame_stack == 1:
                obs_ids, next_ids = obs_ids[:, 0], next_ids[:, 0]
            np.testing.assert_array_equal(b.obs.numpy(), frames[obs_ids], err_msg=f"obs, transitions {lo}+")
            np.testing.assert_array_equal(b.next_obs.numpy(), frames[next_ids], err_msg=f"next_obs {lo}+")
            np.testing.assert_array_equal(b.action.numpy(), src["action"][t])
            np.testing.assert_array_equal(b.reward.numpy(), src["reward"][t])
            np.testing.assert_array_equal(b.terminated.numpy(), src["terminated"][t])
            np.testing.assert_array_equal(b.truncated.numpy(), src["truncated"][t])
    return {"checked": n, "check_seconds": time.perf_counter() - t0,
            "index_ram_bytes_per_transition": info["index_ram_bytes_per_transition"],
            "store_bytes_per_transition": info["bytes_per_transition"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("kind", choices=("lowdim", "atari"))
    parser.add_argument("--n", type=int)
    parser.add_argument("--path", default=None)
    parser.add_argument("--role", choices=("write", "check"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    n = args.n or (1_000_000 if args.kind == "lowdim" else 100_000)
    k = 1 if args.kind == "lowdim" else 4
    path = args.path or f"/tmp/mmreplay_verify_{args.kind}"
    if args.role:
        result = write(args.kind, path, n, k) if args.role == "write" else check(args.kind, path, n, k)
        print(json.dumps(result))
        return 0
    shutil.rmtree(path, ignore_errors=True)
    base = [sys.executable, __file__, args.kind, "--n", str(n), "--path", path]
    wrote = json.loads(subprocess.run(base + ["--role", "write"], check=True, capture_output=True,
                                      text=True).stdout.splitlines()[-1])
    checked = json.loads(subprocess.run(base + ["--role", "check"], check=True, capture_output=True,
                                        text=True).stdout.splitlines()[-1])
    print(f"{args.kind}: {n:,} transitions written ({wrote['adds_per_s']:,.0f} adds/s incl. close), reopened in a "
          f"fresh process and read back identical ({checked['check_seconds']:.1f}s)")
    print(f"  disk {wrote['disk_bytes'] / 1e6:,.1f} MB = {wrote['disk_bytes_per_transition']:.1f} bytes/transition; "
          f"index RAM {checked['index_ram_bytes_per_transition']:.2f} bytes/transition")
    return 0


if __name__ == "__main__":
    sys.exit(main())
