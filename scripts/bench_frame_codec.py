#!/usr/bin/env python
"""Frame codecs side by side on real frames: bytes on disk, add rate, decode rate and sampling rate.

    python scripts/bench_frame_codec.py --workload atari --n 100000      # real Atari (scripts/atari_frames.py)
    python scripts/bench_frame_codec.py --workload dmc --n 50000         # real DMC RGB (scripts/dmc_frames.py)

Each codec (``--codecs``, default ``lz4hc`` — today's default — and ``delta-zstd``) records the same ``n``
transitions into a new store in a FRESH child process (add/s includes ``close()``), then a second fresh
child reopens it with default settings and measures: batch-32 and batch-256 rates (medians of windows
after a warm-up), and the compiled decode rate of the store's chunks on one core (frames/s). Every child
returns the same fixed set of transitions through ``get``; the parent checks that all codecs returned
identical bytes (a codec that loses a bit fails the run). Ratios are against the first codec, same run.

Atari: 84x84 gray, frame stack 4, one stream. DMC: 3x84x84 RGB (channel first), frame stack 3, n-step
irrelevant here (the store's frames are what is measured), episodes of 250 steps cycled over the pool's
four tasks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]


def transitions(workload: str, n: int, chunk: int = 2048):
    """``n`` transitions in chunks: dicts of obs, action, reward, next_obs, terminated, truncated."""
    if workload == "atari":
        import atari_frames

        for part in atari_frames.iter_atari_transitions(n, chunk=chunk, verbose=False):
            yield part
        return
    import dmc_frames

    pool = dmc_frames.load_dmc_pool()
    episodes = list(dmc_frames.episode_frames(pool, pool.shape[0] // len(dmc_frames.TASKS)))
    done, e = 0, 0
    while done < n:
        ep = episodes[e % len(episodes)]
        e += 1
        m = min(len(ep) - 1, n - done)
        last = np.zeros(m, bool)
        last[-1] = m == len(ep) - 1
        yield dict(obs=ep[:m], next_obs=ep[1:m + 1], action=np.zeros(m, np.int64),
                   reward=np.zeros(m, np.float32), terminated=np.zeros(m, bool), truncated=last)
        done += m


def spaces_for(workload: str):
    from gymnasium import spaces

    shape, stack = ((84, 84), 4) if workload == "atari" else ((3, 84, 84), 3)
    action = spaces.Discrete(18) if workload == "atari" else spaces.Box(-1, 1, (1,), np.float32)
    return spaces.Box(0, 255, shape, np.uint8), action, stack


def child_fill(path: str, workload: str, n: int, codec: str) -> dict:
    import mmreplay

    obs_space, action_space, stack = spaces_for(workload)
    kw = dict(reward_values=(-1, 0, 1)) if workload == "atari" else {}
    t0 = time.perf_counter()
    store = mmreplay.Store.create(path, obs_space, action_space, capacity=n, frame_stack=stack, frame_codec=codec,
                                  **kw)
    t_add = 0.0
    for part in transitions(workload, n):
        rows = len(part["action"])
        actions = part["action"] if workload == "atari" else np.zeros((rows, 1), np.float32)
        a0 = time.perf_counter()
        for i in range(rows):
            store.add(part["obs"][i], actions[i], float(part["reward"][i]), part["next_obs"][i],
                      bool(part["terminated"][i]), bool(part["truncated"][i]))
        t_add += time.perf_counter() - a0
    a0 = time.perf_counter()
    store.close()
    t_add += time.perf_counter() - a0
    frames = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(os.path.join(path, "frames"))
                 for f in fs)
    total = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
    return dict(add_per_s=n / t_add, frames_bytes=frames, store_bytes=total, fill_s=time.perf_counter() - t0)


def child_sample(path: str, windows: int, window_s: float, check_ids: list[int]) -> dict:
    import mmreplay
    from mmreplay._native import chunk_decode as native

    store = mmreplay.Store.open(path, mode="r")
    out = {}
    for batch_size in (32, 256):
        sampler = store.sampler(batch_size, prefetch=False, seed=1, name=f"bench{batch_size}")
        it = iter(sampler)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < 2 * window_s:  # warm-up: the decoded cache fills
            next(it)
        rates = []
        for _ in range(windows):
            k, w0 = 0, time.perf_counter()
            while time.perf_counter() - w0 < window_s:
                next(it)
                k += 1
            rates.append(k / (time.perf_counter() - w0))
        out[f"b{batch_size}"] = statistics.median(rates)
    batch = store.inspect.get(check_ids)
    digest = [int(np.frombuffer(t.numpy().tobytes(), np.uint8).astype(np.uint64).sum())
              for t in (batch.obs, batch.next_obs)]
    out["digest"] = digest
    out["decode_frames_per_s"] = decode_rate(path, native)
    store.close()
    return out


def decode_rate(path: str, native) -> float:
    """Compiled decodes of the first shard file's chunks on one core (frames/s, checksum included)."""
    import zarr

    from mmreplay.storage.format.shardfile import index_nbytes, parse_index

    arr = zarr.open_array(os.path.join(path, "frames", "obs"), mode="r")
    inner = arr.metadata.codecs[0]
    rows_per_chunk = inner.chunk_shape[0]
    n_chunks = arr.metadata.chunk_grid.chunk_shape[0] // rows_per_chunk
    spec = {"name": "temporal"} if inner.codecs[1].to_dict()["name"] == "mmreplay.temporal" else \
        {"name": inner.codecs[1].to_dict()["name"]}
    raw = np.fromfile(os.path.join(path, "frames", "obs", "c", "0", *["0"] * (arr.ndim - 1)), np.uint8)
    index = parse_index(raw[raw.size - index_nbytes(n_chunks):].tobytes(), n_chunks, "bench")
    used = index[:, 0] != np.uint64(2**64 - 1)
    src = (raw.ctypes.data + index[used, 0].astype(np.int64))
    sizes = index[used, 1].astype(np.int64)
    nbytes = rows_per_chunk * int(np.prod(arr.shape[1:]))
    dst = np.empty((src.size, nbytes), np.uint8)
    dst_addrs = dst.ctypes.data + nbytes * np.arange(src.size, dtype=np.int64)
    status = np.zeros(src.size, np.int8)
    from mmreplay import codecs

    codec = codecs.for_config(spec).kernel_kind
    best = 0.0
    for _ in range(5):
        t0 = time.perf_counter()
        bad = native.decode_chunks(src, sizes, dst_addrs, np.zeros(src.size, np.int64), nbytes, codec, status)
        best = max(best, src.size * rows_per_chunk / (time.perf_counter() - t0))
        assert bad == 0
    return best


def in_child(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", choices=("atari", "dmc"), default="atari")
    parser.add_argument("--n", type=int, default=100_000)
    parser.add_argument("--codecs", default="lz4hc,delta-zstd")
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=2.0)
    parser.add_argument("--dir", default="/tmp/mmreplay_bench_codec")
    parser.add_argument("--json", help="also write the figures here")
    args = parser.parse_args()
    raw_frame = 7056 if args.workload == "atari" else 3 * 84 * 84
    check_ids = sorted(np.random.default_rng(0).choice(np.arange(args.n // 2, args.n - 1), 512, replace=False)
                       .tolist())
    results = {}
    for codec in args.codecs.split(","):
        path = os.path.join(args.dir, codec)
        shutil.rmtree(path, ignore_errors=True)
        fill = in_child(child_fill, path, args.workload, args.n, codec)
        print(codec, "filled", json.dumps(fill), flush=True)
        sample = in_child(child_sample, path, args.windows, args.window_s, check_ids)
        results[codec] = {**fill, **sample}
        shutil.rmtree(path, ignore_errors=True)
        print(codec, json.dumps({k: v for k, v in results[codec].items() if k != "digest"}), flush=True)
    first = next(iter(results.values()))
    identical = all(r["digest"] == first["digest"] for r in results.values())
    print(f"\n{args.workload}, {args.n:,} transitions, raw frame {raw_frame} B; ratios vs {next(iter(results))}")
    print(f"{'codec':<12} {'frames B/tr':>11} {'store B/tr':>10} {'x raw':>6} {'x first':>7} {'add/s':>8} "
          f"{'b32/s':>7} {'b256/s':>7} {'decode fr/s':>11}")
    for codec, r in results.items():
        fb = r["frames_bytes"] / args.n
        print(f"{codec:<12} {fb:>11.0f} {r['store_bytes'] / args.n:>10.0f} {raw_frame / fb:>6.1f} "
              f"{first['frames_bytes'] / r['frames_bytes']:>7.2f} {r['add_per_s']:>8.0f} {r['b32']:>7.0f} "
              f"{r['b256']:>7.0f} {r['decode_frames_per_s']:>11.0f}")
    print("the same 512 transitions read back from every store:", "identical" if identical else "DIFFERENT")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
