"""Larger than RAM: a 1M-transition Atari store sampled inside a 2 GB memory cgroup, against SB3 holding
100k transitions in RAM and a numpy memmap frame ring in the same cgroup, all in one run.

    python scripts/bench.py --larger-than-ram [--ltr-n 1000000] [--ltr-limit 2e9] [--frame-codec C] [--json out.json]

This is ``--workload atari1m`` (the default); ``--workload atari10m|dmc`` (issue #21) is ``ltr_big``.

Invariant: every figure comes from a child process; the cgroup is removed whatever happens.

What each child measures (every child a fresh process; the page cache is dropped before the cgroup ones):

``mmreplay``  (in the cgroup, default settings) ``Store.open`` of the 1M store, then batch-32 for the first
              ``--ltr-cold-s`` seconds after open (a resumed run: page cache cold), one rate per second;
              then warm windows of batch 32 and 256; the decoded frames/s during those windows; the
              codec's own single-core rate on the same chunks (compiled decode, checksum included) times
              the cores; sampled transitions checked against the real frames; peak RSS and the cgroup's
              peak usage.
``memmap``    (in the cgroup) what users do without us: every frame once in a raw ``np.memmap`` file (the
              1M store's frames, ~7.9 GB), stacks gathered with fancy indexing; the same cold and warm rates.
``sb3``       (not constrained) SB3's ``ReplayBuffer(optimize_memory_usage=True)`` holding 100k transitions
              of the same frames as FrameStack stacks: batch 32 and 256.
``mmreplay 100k`` (not constrained, default settings) a 100k store: batch 32 and 256.

Rates are medians of windows; ratios compare children of the same run.
"""

from __future__ import annotations

import json
import os
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from ..cgroup import make_memory_cgroup, read_cgroup_stats, remove_cgroup
from ..measure import child_setup, dir_bytes, drop_caches, io_read_bytes, log, peak_rss_bytes, rate_windows
from ..sources import AtariSource
from ..tasks_peers import task_peer
from .ltr_big import TASKS as BIG_TASKS, report as big_report, run as run_big_workload, targets as big_targets
from .ltr_checks import ground_truth, per_second, verify_batches, warm_up  # noqa: F401
from .base import Mode
from .. import device_bench

STACK = 4


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def codec_rate(path: str, n_shards: int = 40, frame_bytes: int = 84 * 84) -> tuple[float, float]:
    """Frames/s of the codec alone on this store's chunks held in RAM (the compiled decode: checksum and
    blosc/lz4, into a small buffer), on one thread and on every core at once; chunks of ``n_shards`` shard
    files read whole."""
    import glob
    from mmreplay._native import chunk_decode as native
    from mmreplay.storage.format.shardfile import EMPTY, index_nbytes, parse_index
    with open(os.path.join(path, "frames", "obs", "zarr.json")) as f:  # plain zarr v3 metadata
        meta = json.load(f)
    per = meta["chunk_grid"]["configuration"]["chunk_shape"][0] // \
        meta["codecs"][0]["configuration"]["chunk_shape"][0]
    files = sorted(glob.glob(os.path.join(path, "frames", "obs", "c", "*", "0", "0")))[:n_shards]
    bufs, src, size = [], [], []
    for f in files:
        raw = np.fromfile(f, dtype=np.uint8)
        index = parse_index(raw[raw.size - index_nbytes(per):].tobytes(), per, f)
        used = index[:, 0] != EMPTY
        bufs.append(raw)
        src.append(raw.ctypes.data + index[used, 0].astype(np.int64))
        size.append(index[used, 1].astype(np.int64))
    src, size = np.concatenate(src), np.concatenate(size)

    def decode_batches(seed: int, batches: int) -> list[float]:
        """Seconds of each of ``batches`` decodes of 256 random chunks."""
        rng = np.random.default_rng(seed)
        out = np.empty((256, frame_bytes), np.uint8)
        dst = out.ctypes.data + np.arange(256, dtype=np.int64) * frame_bytes
        status = np.empty(256, np.int8)
        times = []
        for _ in range(batches):
            pick = rng.integers(0, src.size, 256)
            t0 = time.perf_counter()
            native.decode_chunks(src[pick], size[pick], dst, np.zeros_like(dst), frame_bytes, native.CODEC_BLOSC,
                                 status)
            times.append(time.perf_counter() - t0)
        assert (status == 0).all()
        return times

    one = 256 / float(np.median(decode_batches(0, 100)))
    cores = os.cpu_count() or 1
    with ThreadPoolExecutor(cores) as pool:  # the same decodes on every core at once: what the box can do
        pool.submit(lambda: None).result()
        t0 = time.perf_counter()
        list(pool.map(lambda seed: decode_batches(seed, 400), range(cores)))
        every_core = cores * 400 * 256 / (time.perf_counter() - t0)
    return one, every_core


def decoded(store) -> int:
    st = store.inspect.cache_stats()["obs"]
    return st["compressed"]["hits"] + st["compressed"]["misses"]


def task_mmreplay(spec: dict) -> dict:
    child_setup(tune=False)  # glibc's defaults, as users run
    import mmreplay
    res = {"page_cache_dropped": drop_caches() if spec.get("cold") else False}
    io0 = io_read_bytes()
    t0 = time.perf_counter()
    s = mmreplay.Store.open(spec["path"], mode="r")  # default settings
    res["open_s"] = time.perf_counter() - t0
    res["stored"] = len(s)
    smp32 = s.sampler(32, seed=1, name="b32")
    if spec.get("cold"):
        res["cold_b32_per_second"] = per_second(smp32.__next__, spec["cold_s"])
        res["cold_b32_per_s"] = float(np.mean(res["cold_b32_per_second"]))
        res["cold_disk_read_bytes"] = (io_read_bytes() or 0) - (io0 or 0)
    # warm: once every shard the tier will hold is in RAM (the preloader's pass) and the hit rate settled
    t_end = time.perf_counter() + spec["warm_max_s"]
    while s.inspect.cache_stats()["obs"]["compressed"]["loading"] and time.perf_counter() < t_end:
        next(smp32)
    res["warm_hit_rate"] = warm_up(s, smp32, spec["window_s"], spec["warm_max_s"])
    smp256 = s.sampler(256, seed=2, name="b256")
    for B, smp in ((32, smp32), (256, smp256)):
        d0, t0 = decoded(s), time.perf_counter()
        rates = rate_windows(smp.__next__, spec["windows"], spec["window_s"], 0.5)
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
        res[f"b{B}_decoded_frames_per_s"] = (decoded(s) - d0) / (time.perf_counter() - t0)
    if spec.get("frame_codec") in (None, "lz4", "lz4hc"):  # the codec-alone probe decodes blosc chunks only
        res["codec_frames_per_s_one_core"], res["codec_frames_per_s_all_cores"] = codec_rate(spec["path"])
    res["cores"] = os.cpu_count()
    res["cache_stats"] = s.inspect.cache_stats()
    res.update(verify_batches(s, spec["verify_batches"]))
    res["peak_rss"] = peak_rss_bytes()
    if spec.get("cgroup_dir"):
        res["cgroup"] = read_cgroup_stats(spec["cgroup_dir"])
    s.close()
    return res


def task_memmap(spec: dict) -> dict:
    """A raw frame file sampled as users do without a library: fancy indexing of a memmap."""
    child_setup(tune=False)  # glibc's defaults, as users run
    import torch
    res = {"page_cache_dropped": drop_caches()}
    meta = np.load(spec["index"])
    frames = np.memmap(spec["frames"], dtype=np.uint8, mode="r").reshape(-1, 84, 84)
    obs_rows, next_rows = meta["obs_rows"], meta["next_rows"]
    rng = np.random.default_rng(0)

    def sample(B):
        i = rng.integers(0, obs_rows.shape[0], B)
        return torch.from_numpy(frames[obs_rows[i]]), torch.from_numpy(frames[next_rows[i]])

    res["cold_b32_per_second"] = per_second(lambda: sample(32), spec["cold_s"])
    res["cold_b32_per_s"] = float(np.mean(res["cold_b32_per_second"]))
    for B in (32, 256):
        rates = rate_windows(lambda: sample(B), spec["windows"], spec["window_s"], 0.5)
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
    res["peak_rss"] = peak_rss_bytes()
    if spec.get("cgroup_dir"):
        res["cgroup"] = read_cgroup_stats(spec["cgroup_dir"])
    return res


def task_sb3(spec: dict) -> dict:
    return task_peer({**spec, "system": "sb3", "workload": "atari", "n_envs": 1, "batch_sizes": [32, 256]})


def task_mm_100k(spec: dict) -> dict:
    child_setup(tune=False)  # glibc's defaults, as users run
    import mmreplay
    s = mmreplay.Store.open(spec["path"], mode="r")  # default settings
    res = {}
    for B in (32, 256):
        smp = s.sampler(B, seed=B, name=f"b{B}")
        res[f"b{B}_hit_rate"] = warm_up(s, smp, spec["window_s"], spec["warm_max_s"])
        rates = rate_windows(smp.__next__, spec["windows"], spec["window_s"], 0.5)
        res[f"b{B}_per_s"] = float(np.median(rates))
        res[f"b{B}_windows"] = rates
    res["cache_stats"] = s.inspect.cache_stats()
    res["peak_rss"] = peak_rss_bytes()
    s.close()
    return res




# ----------------------------------------------------------------------------------------------
# inputs
# ----------------------------------------------------------------------------------------------
def write_memmap_ring(workdir: str, n: int) -> dict:
    """The 1M store's frames once each, as the pool's frames tiled (dataset transition i is pool
    transition i % P), and per transition the rows of its obs and next_obs stacks."""
    import atari_frames
    frames_path, index_path = os.path.join(workdir, f"memmap_frames_{n}.u8"), os.path.join(workdir,
                                                                                           f"memmap_index_{n}.npz")
    pool = atari_frames.load_atari_pool(verbose=False)
    F, P = pool["frames"].shape[0], len(pool["action"])
    tiles = -(-n // P)
    if not (os.path.exists(frames_path) and os.path.getsize(frames_path) == tiles * F * 84 * 84):
        log(f"[ltr] writing the memmap frame ring ({tiles * F * 84 * 84 / 1e9:.1f} GB)")
        with open(frames_path + ".tmp", "wb") as f:
            for _ in range(tiles):
                for lo in range(0, F, 20000):
                    f.write(np.ascontiguousarray(pool["frames"][lo:lo + 20000]).tobytes())
        os.replace(frames_path + ".tmp", frames_path)
    src = AtariSource()
    i = np.arange(n)
    p, tile = i % P, i // P
    stack = np.maximum(src.ep_start[p][:, None], p[:, None] + np.arange(-(STACK - 1), 1))
    obs_rows = src.oi[stack] + (tile * F)[:, None]
    next_rows = np.concatenate([obs_rows[:, 1:], (src.ni[p] + tile * F)[:, None]], axis=1)
    np.savez(index_path, obs_rows=obs_rows.astype(np.int64), next_rows=next_rows.astype(np.int64))
    return {"frames": frames_path, "index": index_path, "bytes": os.path.getsize(frames_path)}


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def run(runner, args) -> dict:
    if args.ltr_workload != "atari1m":
        return run_big_workload(runner, args)
    n, wd = args.ltr_n or 1_000_000, runner.workdir
    codec = args.frame_codec
    base = {"windows": args.windows, "window_s": args.window_s, "warmup_s": max(args.warmup_s, 1.0),
            "cold_s": args.ltr_cold_s, "warm_max_s": 120.0, "verify_batches": args.ltr_verify_batches}
    out = {"n": n, "limit_bytes": args.ltr_limit or 2_000_000_000, "frame_codec": codec}
    small = 10_000 if args.quick else 100_000  # SB3's in-RAM buffer and mmreplay's default-budget store
    stores = {}
    for size in (n, small):
        path = os.path.join(wd, f"store_cgroup_atari_{size}" + (f"_{codec}" if codec and size == n else ""))
        if not (args.reuse_store and os.path.exists(os.path.join(path, "zarr.json"))):
            fill = runner.child({"task": "mm_fill", "workload": "atari", "n": size, "n_envs": 1, "path": path,
                                 "frame_codec": codec if size == n else None},
                                label=f"ltr/mmreplay fill {size:,}", timeout=args.child_timeout)
            if "error" in fill:
                return {"error": fill["error"]}
        stores[size] = path
    ring = write_memmap_ring(wd, n)
    out["memmap_bytes"] = ring["bytes"]
    out["store_bytes"] = dir_bytes(stores[n])
    cg = make_memory_cgroup(out["limit_bytes"], f"mmreplay_ltr_{os.getpid()}")
    runs = {"mmreplay": [], "memmap": [], "sb3": [], "sb3_default_malloc": [], "mm_100k": []}
    try:
        for rnd in range(args.ltr_repeats):
            for tune in (True, False):  # SB3's reference: the faster of the two allocator settings
                runs["sb3" if tune else "sb3_default_malloc"].append(runner.child(
                    {**base, "task": "ltr_sb3", "n": small, "tune_malloc": tune}, timeout=args.child_timeout,
                    label=f"ltr/sb3 {small:,} r{rnd} ({'tuned' if tune else 'default'} malloc)"))
            runs["mmreplay"].append(runner.child({**base, "task": "ltr_mmreplay", "path": stores[n], "cold": True,
                                                  "frame_codec": codec},
                                                 cgroup=cg, label=f"ltr/mmreplay {n:,} in cgroup r{rnd}",
                                                 timeout=args.child_timeout))
            runs["mm_100k"].append(runner.child({**base, "task": "ltr_mm_100k", "path": stores[small]},
                                                label=f"ltr/mmreplay {small:,} r{rnd}", timeout=args.child_timeout))
            if rnd == 0 or not args.ltr_memmap_once:
                runs["memmap"].append(runner.child({**base, "task": "ltr_memmap", **ring}, cgroup=cg,
                                                   label=f"ltr/memmap ring in cgroup r{rnd}",
                                                   timeout=args.child_timeout))
    finally:
        remove_cgroup(cg)
    out["runs"] = runs
    out["summary"] = summarize(runs)
    return out


def _median(runs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in runs if isinstance(r.get(key), (int, float))]
    return float(np.median(vals)) if vals else None


def summarize(runs: dict) -> dict:
    keys = ("b32_per_s", "b256_per_s", "cold_b32_per_s", "peak_rss", "b32_decoded_frames_per_s",
            "b256_decoded_frames_per_s", "codec_frames_per_s_one_core", "codec_frames_per_s_all_cores", "open_s")
    summary = {name: {k: _median(rs, k) for k in keys} for name, rs in runs.items()}
    # the peer at its best: per rate, the faster of its allocator settings (tuned / glibc default)
    other = summary.pop("sb3_default_malloc", None)
    if other:
        for k in ("b32_per_s", "b256_per_s"):
            summary["sb3"][k] = max(v for v in (summary["sb3"][k], other[k], 0.0) if v is not None) or None
    mm = runs["mmreplay"]
    summary["mmreplay"]["wrong"] = sum(r.get("wrong", 0) for r in mm)
    summary["mmreplay"]["verified"] = sum(r.get("verified", 0) for r in mm)
    summary["mmreplay"]["cgroup_max_usage"] = max((r.get("cgroup", {}).get("max_usage", 0) for r in mm), default=None)
    summary["mmreplay"]["cores"] = next((r["cores"] for r in mm if "cores" in r), None)
    return summary


def targets(summary: dict, budget: int) -> list[tuple[str, float | None, float, bool | None]]:
    mm, sb3, small = summary["mmreplay"], summary["sb3"], summary["mm_100k"]

    def ratio(a, b):
        return a / b if a and b else None

    rows = []
    for B in (32, 256):
        rows.append((f"1M in the cgroup, warm batch-{B} vs SB3 100k in RAM", ratio(mm[f"b{B}_per_s"], sb3[f"b{B}_per_s"]), 1.0))
    rows.append(("1M in the cgroup, first 10 s after open (cold) batch-32 vs SB3 warm", ratio(mm["cold_b32_per_s"],
                                                                                             sb3["b32_per_s"]), 0.5))
    codec = (mm["codec_frames_per_s_one_core"] or 0) * (mm["cores"] or 1)
    rows.append(("decoded frames/s (batch-256 windows) vs codec one core x cores",
                 ratio(mm["b256_decoded_frames_per_s"], codec), 0.5))
    for B in (32, 256):
        rows.append((f"100k default budget, batch-{B} vs SB3", ratio(small[f"b{B}_per_s"], sb3[f"b{B}_per_s"]), 1.5))
    rows.append(("peak RSS - budget (MB, <= 350)", (mm["peak_rss"] - budget) / 1e6 if mm["peak_rss"] else None, 350))
    return [(name, v, t, None if v is None else (v <= t if "RSS" in name else v >= t)) for name, v, t in rows]


def report(out: dict, budget: int) -> str:
    if "error" in out:
        return f"larger-than-RAM benchmark failed: {out['error']}"
    s = out["summary"]
    lines = [f"== Larger than RAM: {out['n']:,} Atari transitions (store {out['store_bytes'] / 1e6:,.0f} MB on disk, "
             f"memmap ring {out['memmap_bytes'] / 1e9:.1f} GB) in a {out['limit_bytes'] / 1e9:.1f} GB cgroup ==",
             "| system | where | cold b32/s (first 10 s) | warm b32/s | warm b256/s | peak RSS MB |",
             "|---|---|---|---|---|---|"]
    big = f"{out['n'] // 1000:,}k, cgroup"
    where = {"mmreplay": big, "memmap": big, "sb3": "100k, RAM", "mm_100k": "100k, RAM"}
    for name in ("mmreplay", "memmap", "sb3", "mm_100k"):
        r = s[name]
        f = lambda v: "-" if v is None else f"{v:,.0f}"  # noqa: E731
        lines.append(f"| {name} | {where[name]} | {f(r['cold_b32_per_s'])} | {f(r['b32_per_s'])} | "
                     f"{f(r['b256_per_s'])} | {f(r['peak_rss'] / 1e6 if r['peak_rss'] else None)} |")
    mm = s["mmreplay"]
    lines.append(f"decoded frames/s: b32 {mm['b32_decoded_frames_per_s'] or 0:,.0f}, b256 "
                 f"{mm['b256_decoded_frames_per_s'] or 0:,.0f}; codec alone: one core {mm['codec_frames_per_s_one_core'] or 0:,.0f}, "
                 f"{mm['cores']} cores at once {mm['codec_frames_per_s_all_cores'] or 0:,.0f}; open {mm['open_s'] or 0:.2f} s; cgroup max usage "
                 f"{(mm['cgroup_max_usage'] or 0) / 1e6:,.0f} MB; sampled transitions checked: {mm['verified']:,}, "
                 f"wrong: {mm['wrong']}")
    if mm["b256_decoded_frames_per_s"] and mm["codec_frames_per_s_all_cores"]:
        lines.append(f"batch-256 decodes at {mm['b256_decoded_frames_per_s'] / mm['codec_frames_per_s_one_core']:.2f}x "
                     f"the codec's one-core rate and {mm['b256_decoded_frames_per_s'] / mm['codec_frames_per_s_all_cores']:.2f}x "
                     f"its rate on all cores at once")
    lines += ["", "| target | measured | wanted | |", "|---|---|---|---|"]
    for name, v, t, ok in targets(s, budget):
        lines.append(f"| {name} | {'-' if v is None else f'{v:.2f}'} | {t} | "
                     f"{'-' if ok is None else ('PASS' if ok else 'FAIL')} |")
    return "\n".join(lines)




class LargerThanRamMode(Mode):
    key = "larger_than_ram"
    exclusive = True
    tasks = {"ltr_mmreplay": task_mmreplay, "ltr_memmap": task_memmap, "ltr_sb3": task_sb3,
             "ltr_mm_100k": task_mm_100k, **BIG_TASKS, **device_bench.TASKS}

    def add_arguments(self, p) -> None:
        p.add_argument("--larger-than-ram", action="store_true",
                       help="only the larger-than-RAM benchmark: a 1M Atari store in a 2 GB cgroup vs SB3 100k in "
                            "RAM and a numpy memmap frame ring in the same cgroup (issue #11)")
        p.add_argument("--workload", dest="ltr_workload", choices=("atari1m", "atari10m", "dmc"), default="atari1m",
                       help="--larger-than-ram: atari1m (issue #11; default), atari10m (10M Atari in 2 GB vs SB3 "
                       "100k) or dmc (1M DMC RGB in 4 GB, batch 256 n-step 3, vs a DrQ-v2-style loader); issue #21")
        p.add_argument("--frame-codec", default=None, help="--larger-than-ram: the big store's frame_codec, a name or (atari10m, dmc) a JSON "
                       "codec spec (default: the library's for atari1m and dmc, delta-zstd for atari10m)")
        p.add_argument("--ltr-n", type=int, default=None, help="transitions of the big store (default 1000000; "
                       "atari10m 10000000)")
        p.add_argument("--ltr-limit", type=lambda v: int(float(v)), default=None,
                       help="the cgroup's memory limit, bytes (default 2e9; dmc 4e9)")
        p.add_argument("--ltr-cache-mib", type=int, default=None, help="atari10m/dmc: cache_bytes (MiB) the cgroup "
                       "child passes, as a user would (default: none passed, the library's default)")
        p.add_argument("--ltr-disk-cache-mib", type=int, default=256, help="atari10m/dmc: cache_bytes (MiB) of the "
                       "extra child whose frames are forced not to fit (below the compressed store; 0: no such child)")
        p.add_argument("--ltr-device-s", type=float, default=5.0, help="seconds of random reads per queue depth")
        p.add_argument("--ltr-drq-n", type=int, default=50_000, help="dmc: transitions the DrQ-v2 loader holds")
        p.add_argument("--ltr-warm-max-s", type=float, default=120.0, help="atari10m/dmc: cap on the warm-up")
        p.add_argument("--ltr-cold-s", type=float, default=10.0, help="seconds after open counted as cold")
        p.add_argument("--ltr-repeats", type=int, default=None, help="rounds of the children (default 2; quick 1)")
        p.add_argument("--ltr-verify-batches", type=int, default=40, help="batches of 256 checked against the frames")
        p.add_argument("--ltr-memmap-once", action="store_true", help="run the (slow) memmap ring child once only")
        p.add_argument("--device", choices=("cuda", "cpu"), default=None, help="--larger-than-ram --workload "
                       "atari10m|dmc, or --dreamer: decode on this device instead (issue #38; "
                       "benchmarks/device_bench.py, modes/dreamer.py; cpu: a dry run of the same path on the CPU "
                       "stand-in decoder)")

    def finish_args(self, a, quick: bool, argv: list[str]) -> None:
        if a.ltr_n is None and a.ltr_workload == "atari1m":
            a.ltr_n = 50_000 if quick else 1_000_000
        if a.ltr_repeats is None:
            a.ltr_repeats = 1 if quick else 2

    def requested(self, a) -> bool:
        return a.larger_than_ram

    def run(self, runner) -> dict:
        if runner.args.device:
            return device_bench.run(runner, runner.args)
        return run(runner, runner.args)

    def report(self, part: dict, results: dict, args) -> list[str]:
        if part.get("mode") == "device":
            return ["\n" + device_bench.report(part)]
        if part.get("workload") in ("atari10m", "dmc"):
            return ["\n" + big_report(part)]
        from mmreplay.settings import DEFAULT_CACHE_BYTES
        return ["\n" + report(part, DEFAULT_CACHE_BYTES)]

    def targets(self, part: dict, args, add) -> None:
        if "summary" not in part:
            return
        if part.get("mode") == "device":
            for name, value, threshold, le in device_bench.targets(part):
                add(name, value, threshold, unit="x" if " vs " in name else "", le=le)
            return
        if part.get("workload") in ("atari10m", "dmc"):
            for name, value, threshold, le in big_targets(part):
                add(name, value, threshold, unit="x" if " vs " in name or "smaller" in name else "", le=le)
            return
        from mmreplay.settings import DEFAULT_CACHE_BYTES
        for name, value, threshold, _ in targets(part["summary"], DEFAULT_CACHE_BYTES):
            add(name, value, threshold, unit="MB" if "RSS" in name else "x", le="RSS" in name)
