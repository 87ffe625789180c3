"""Larger than RAM for real (issue #21): ``--larger-than-ram --workload atari10m|dmc``.

    python scripts/bench.py --larger-than-ram --workload atari10m [--ltr-cache-mib 1335] [--json out.json]
    python scripts/bench.py --larger-than-ram --workload dmc [--ltr-cache-mib M] [--json out.json]

``atari10m``  10M real Atari transitions (the 100k pool tiled, one stream, frame stack 4; ``ltr_data``) in a
              2 GB memory cgroup, against SB3 holding 100k of them in RAM (the faster of its two allocator
              settings): cold batch-32 over the first ``--ltr-cold-s`` after open, warm batch 32 and 256.
``dmc``       1M transitions of real DMC frames (3x84x84 RGB, frame stack 3, episodes of 500 steps) in a
              4 GB cgroup, batch 256 with n-step 3 (gamma 0.99), against a DrQ-v2-style loader
              (``peers/drqv2_loader``: 4 DataLoader workers holding 50k stacked transitions in RAM),
              unconstrained (the faster of its two allocator settings).

Both also run: the same mmreplay child with the frames forced not to fit (``--ltr-disk-cache-mib``, below the
compressed store), whose reads issued per second are set against the device's own random 4 KiB reads/s at
queue depth 1 and 32 from the store's shard files (``device_reads``, ``O_DIRECT``).

Invariant: every figure comes from a fresh child; the page cache is dropped before each cgroup child; every
row the verification draws (40 batches of 256 by default, from each mmreplay child, disk path included) is
checked against the real frames, rebuilt from the pools (``ltr_data``); the cgroup is removed whatever
happens. The stores are built once (``ltr_data.build``, or here when missing) and reused while they carry
their build record.
"""
from __future__ import annotations

import os
import time

import numpy as np

from ..device_reads import task_device_reads
from ..ltr_data import DmcSource, build, built, store_path
from ..measure import child_setup, log, peak_rss_bytes, rate_windows
from ..runner import MiB
from .cgroup_rounds import (
    close_store,
    faster_allocator,
    fmt,
    interleaved_rounds,
    open_cold,
    target_lines,
    wait_background_pass,
)
from .ltr_checks import per_second, verify_batches, warm_up

LIMITS = {"atari10m": 2_000_000_000, "dmc": 4_000_000_000}
N_STEP = {"atari10m": 1, "dmc": 3}
GAMMA = 0.99
# the big store's frame_codec when --frame-codec is not given: dmc measures the library's default ("auto", issue
# #38: the 1M DMC targets hold "with default settings"); atari10m keeps the named codec (what "auto" picks there too)
DEFAULT_CODEC = {"atari10m": "delta-zstd", "dmc": "auto"}
DMC_RAW_FRAME = 3 * 84 * 84


# ----------------------------------------------------------------------------------------------
# what a child reads of the store and the process
# ----------------------------------------------------------------------------------------------
def disk_counters(stats: dict) -> tuple[int | None, int | None]:
    """(reads issued, bytes read) summed over every ``"disk"`` entry of ``store.inspect.cache_stats()``, wherever the
    disk path puts it (top level or per column); (None, None) before the disk path reports them."""
    reads, nbytes, found = 0, 0, False

    def walk(d):
        nonlocal reads, nbytes, found
        for k, v in d.items():
            if not isinstance(v, dict):
                continue
            if k == "disk":
                found = True
                reads += int(next((v[x] for x in ("reads", "reads_issued", "issued") if x in v), 0))
                nbytes += int(next((v[x] for x in ("bytes_read", "read_bytes", "bytes") if x in v), 0))
            else:
                walk(v)
    walk(stats)
    return (reads, nbytes) if found else (None, None)


def proc_io() -> dict:
    """This process's read syscalls and block-device bytes (all threads), from ``/proc/self/io``."""
    try:
        with open("/proc/self/io") as f:
            return {k: int(v) for k, v in (line.split(": ") for line in f)}
    except (OSError, ValueError):
        return {}


class DiskMeter:
    """Reads/s over an interval: the store's own count (``cache_stats()``'s disk entry) and the kernel's
    (read syscalls, bytes from the device)."""

    def __init__(self, store):
        self.store, self.t0 = store, time.perf_counter()
        self.st0, self.io0 = disk_counters(store.inspect.cache_stats()), proc_io()

    def result(self) -> dict:
        dt = time.perf_counter() - self.t0
        st1, io1 = disk_counters(self.store.inspect.cache_stats()), proc_io()
        per_s = lambda a, b: None if a is None or b is None else (b - a) / dt  # noqa: E731
        return {"store_reads_per_s": per_s(self.st0[0], st1[0]), "store_read_bytes_per_s": per_s(self.st0[1], st1[1]),
                "syscr_per_s": per_s(self.io0.get("syscr"), io1.get("syscr")),
                "device_read_bytes_per_s": per_s(self.io0.get("read_bytes"), io1.get("read_bytes"))}


def effective_budget(settings, stats: dict) -> int | None:
    """The frame budget the store works to: ``Settings.cache_bytes``, or what its tiers were sized to when
    that is more (a default that follows the cgroup's limit may be resolved when the store opens)."""
    tiers = 0

    def walk(d):
        nonlocal tiers
        for k, v in d.items():
            if isinstance(v, dict):
                walk(v)
            elif k == "capacity_bytes" and isinstance(v, (int, float)):
                tiers += int(v)
    walk(stats)
    given = getattr(settings, "cache_bytes", None)
    return max(given or 0, tiers) or None


def verify_dmc(store, n_batches: int, batch: int = 256) -> dict:
    """n-step batches (obs and next-obs stacks, discounted reward sums, discounts) against the real frames."""
    src, wrong, checked = DmcSource(), 0, 0
    import mmreplay
    smp = store.sampler(batch, mmreplay.NStep(N_STEP["dmc"], GAMMA), seed=777, name="verify")
    for _ in range(n_batches):
        b = next(smp)
        g = b.indices.numpy()
        obs, nxt, ret, disc = src.nstep(g, N_STEP["dmc"], GAMMA)
        ok = np.all((b.obs.numpy() == obs).reshape(len(g), -1), axis=1) & \
            np.all((b.next_obs.numpy() == nxt).reshape(len(g), -1), axis=1) & \
            np.isclose(b.reward.numpy(), ret, rtol=1e-5, atol=1e-5) & np.isclose(b.discount.numpy(), disc)
        wrong += int((~ok).sum())
        checked += len(g)
    smp.close()
    return {"verified": checked, "wrong": wrong}


def memory_now() -> dict:
    """This process's memory now (MB): RSS and its peak (``/proc/self/status``), and anonymous / file-backed
    RSS (``smaps_rollup``)."""
    out = {}
    try:
        with open("/proc/self/status") as f:
            for line in f:
                key = line.split(":")[0]
                if key in ("VmRSS", "VmHWM", "RssAnon", "RssFile", "Threads"):
                    v = int(line.split()[1])
                    out[key] = v if key == "Threads" else round(v / 1024, 1)
    except OSError:
        pass
    return out


def store_held(store) -> dict:
    """What the store itself holds (MB), from its public reports: the compressed tier, the decoded landing area
    (its slab, allocated whole), the run directory and the index ring (bytes a row times its capacity)."""
    columns = [v for v in store.inspect.cache_stats().values() if isinstance(v, dict)]
    info = store.info()
    out = {"tier": sum(v["compressed"]["bytes"] for v in columns if v.get("compressed")),
           "decoded": sum(v["capacity_bytes"] for v in columns),
           "runs": sum(v["runs"]["nbytes"] for v in columns if v.get("runs")),
           "ring_arrays": info["index_ram_bytes_per_transition"] * info["capacity"]}
    return {k: round(v / 1e6, 1) for k, v in out.items()}


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def task_mmreplay(spec: dict) -> dict:
    """Open the store fresh (page cache dropped), cold rate per second, warm windows of batch 32 and 256 with
    the workload's n-step, reads issued, every verified row checked."""
    child_setup(tune=False)  # glibc's defaults, as users run
    import mmreplay
    wl, n_step = spec["workload"], N_STEP[spec["workload"]]
    imported = memory_now()
    session = {"cache_bytes": spec["cache_bytes"]} if spec.get("cache_bytes") else {}
    s, res, t0 = open_cold(spec["path"], **session)
    mem = res["memory"] = {"imported": imported, "opened": memory_now()}
    draw = mmreplay.NStep(n_step, GAMMA) if n_step > 1 else mmreplay.Uniform()
    smps = {B: s.sampler(B, draw, seed=B, name=f"b{B}") for B in (32, 256)}
    mem["samplers"] = memory_now()
    cold_b = 32 if wl == "atari10m" else 256
    if spec.get("cold_s"):
        meter = DiskMeter(s)
        res[f"cold_b{cold_b}_per_second"] = per_second(smps[cold_b].__next__, spec["cold_s"])
        res[f"cold_b{cold_b}_per_s"] = float(np.mean(res[f"cold_b{cold_b}_per_second"]))
        res["cold_disk"] = meter.result()
    t_end = time.perf_counter() + spec["warm_max_s"]
    wait_background_pass(s, smps[cold_b].__next__, t_end)
    # The background pass may end before the tier is full (it stops on a failed mapping under the cgroup's
    # pressure); batches then load the rest a shard at a time. Warm means full: sample until it is.
    # Full: at 98% of its capacity, or no longer growing (a store smaller than the tier's room: 10M Atari's
    # 1.0 GB of frames in a 1.13 GB tier).
    tier = lambda: s.inspect.cache_stats()["obs"].get("compressed", {})  # noqa: E731
    res["tier_at_pass_end"] = before = tier().get("bytes", 0)
    while before < 0.98 * tier().get("capacity_bytes", 0) and time.perf_counter() < t_end:
        for _ in range(50):
            next(smps[cold_b])
        if tier().get("bytes", 0) == before:
            break
        before = tier().get("bytes", 0)
    res["tier_filled_s"] = time.perf_counter() - t0
    mem["filled"] = memory_now()
    res["warm_hit_rate"] = warm_up(s, smps[cold_b], spec["window_s"], spec["warm_max_s"])
    mem["warm"] = memory_now()
    for B, smp in smps.items():
        meter = DiskMeter(s)
        rates = rate_windows(smp.__next__, spec["windows"], spec["window_s"], 0.5)
        res[f"b{B}_per_s"], res[f"b{B}_windows"] = float(np.median(rates)), rates
        res[f"b{B}_disk"] = meter.result()
        mem[f"b{B}_windows"] = memory_now()
    for smp in smps.values():
        smp.close()

    def verify() -> dict:
        res["budget"] = effective_budget(s.settings, res["cache_stats"])
        got = verify_batches(s, spec["verify_batches"]) if wl == "atari10m" else verify_dmc(s, spec["verify_batches"])
        mem["verified"] = memory_now()
        return got

    def held() -> None:  # after the peaks: store.info() counts the ring's rows in numpy (~190 MB at 10M for a moment)
        try:
            res["store_held_mb"] = store_held(s)
        except Exception as exc:  # a figure, not a result: never the run's failure
            res["store_held_mb"] = {"error": repr(exc)}

    return close_store(s, res, spec, verify, held)


def task_drqv2(spec: dict) -> dict:
    """The DrQ-v2-style loader (4 workers, 50k transitions in RAM): batch-256 n-step-3 windows. Its workers
    inherit the allocator setting (``tune_malloc``: raised mmap threshold, or glibc's defaults)."""
    child_setup(tune=spec.get("tune_malloc", False))
    from ..peers.drqv2_loader import make_loader
    t0 = time.perf_counter()
    it = make_loader(spec["n"], 256, spec["workers"], N_STEP["dmc"], GAMMA)
    next(it)  # the workers have loaded their episodes
    res = {"load_s": time.perf_counter() - t0}
    rates = rate_windows(it.__next__, spec["windows"], spec["window_s"], max(spec["warmup_s"], 2.0))
    res["b256_per_s"], res["b256_windows"] = float(np.median(rates)), rates
    res["peak_rss"] = peak_rss_bytes()  # the parent's; the workers hold the episodes
    res["workers_rss"] = children_rss()
    return res


def children_rss() -> int:
    """Summed RSS of this process's children (the loader's workers)."""
    total = 0
    try:
        with open(f"/proc/{os.getpid()}/task/{os.getpid()}/children") as f:
            pids = f.read().split()
    except OSError:
        return 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/statm") as f:
                total += int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
        except OSError:
            pass
    return total


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def ensure_store(runner, wl: str, codec: str, n: int) -> tuple[str, dict] | tuple[None, dict]:
    path = store_path(runner.workdir, wl, codec, n)
    rec = built(path)
    if rec is None:
        log(f"[ltr] building {path} (no build record there)")
        rec = runner.child({"task": "ltrb_build", "workload": wl, "path": path, "n": n, "codec": codec},
                           label=f"ltr/build {wl} {n:,}", timeout=4 * 3600)
        if "error" in rec:
            return None, rec
    return path, rec


def run(runner, args) -> dict:
    wl = args.ltr_workload
    n = args.ltr_n or {"atari10m": 10_000_000, "dmc": 1_000_000}[wl]
    codec = args.frame_codec or DEFAULT_CODEC[wl]
    limit = args.ltr_limit or LIMITS[wl]
    path, rec = ensure_store(runner, wl, codec, n)
    if path is None:
        return {"workload": wl, "error": rec["error"]}
    out = {"workload": wl, "n": n, "limit_bytes": limit, "path": path, "store": rec,
           "cache_bytes": args.ltr_cache_mib * MiB if args.ltr_cache_mib else None,
           "disk_cache_bytes": args.ltr_disk_cache_mib * MiB if args.ltr_disk_cache_mib else None}
    base = {"windows": args.windows, "window_s": args.window_s, "warmup_s": args.warmup_s, "workload": wl,
            "warm_max_s": args.ltr_warm_max_s, "verify_batches": args.ltr_verify_batches, "path": path}
    sb3_n = 10_000 if args.quick else 100_000
    peer, peer_name = ({"task": "ltr_sb3", "n": sb3_n}, f"sb3 {sb3_n:,}") if wl == "atari10m" else \
        ({"task": "ltrb_drqv2", "n": args.ltr_drq_n, "workers": 4}, "drqv2 loader")

    def store_round(cg: str, rnd: int) -> dict:
        got = {"mmreplay": runner.child(
            {**base, "task": "ltrb_mmreplay", "cold_s": args.ltr_cold_s, "cache_bytes": out["cache_bytes"]},
            cgroup=cg, label=f"ltr/mmreplay {wl} in cgroup r{rnd}", timeout=args.child_timeout)}
        if out["disk_cache_bytes"]:
            got["disk"] = runner.child(
                {**base, "task": "ltrb_mmreplay", "cold_s": 0, "cache_bytes": out["disk_cache_bytes"]},
                cgroup=cg, label=f"ltr/mmreplay {wl} forced to disk r{rnd}", timeout=args.child_timeout)
        read_bytes = mean_read_of(got["disk"].get("b256_disk")) if "disk" in got else None
        got["device"] = runner.child({"task": "ltrb_device", "path": path, "seconds": args.ltr_device_s,
                                      "read_bytes": read_bytes}, label=f"ltr/device reads r{rnd}",
                                     timeout=args.child_timeout)
        return got

    runs = {"mmreplay": [], "disk": [], "device": [],
            **interleaved_rounds(runner, args.ltr_repeats, limit, "mmreplay_ltr", {**base, **peer}, f"ltr/{peer_name}",
                                 store_round, args.child_timeout)}
    out["machine"] = runner.child({"task": "ltrb_machine", "workload": wl}, label="ltr/machine calibration",
                                  timeout=args.child_timeout)
    out["runs"] = runs
    out["summary"] = summarize(runs, wl)
    return out


def _median(rs: list[dict], key: str, sub: str | None = None) -> float | None:
    vals = [(r.get(key) or {}).get(sub) if sub else r.get(key) for r in rs if "error" not in r]
    vals = [v for v in vals if isinstance(v, (int, float))]
    return float(np.median(vals)) if vals else None


def summarize(runs: dict, wl: str) -> dict:
    keys = ("b32_per_s", "b256_per_s", "cold_b32_per_s", "cold_b256_per_s", "open_s", "budget", "warm_hit_rate",
            "qd1_reads_per_s", "qd32_reads_per_s", "sized_read_bytes", "sized_qd32_bytes_per_s", "load_s",
            "workers_rss")
    s = {name: {k: _median(rs, k) for k in keys} for name, rs in runs.items()}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        s[name]["errors"] = [r["error"].strip().splitlines()[-1] for r in rs if "error" in r]
        s[name]["peak_rss"] = max((r.get("peak_rss", 0) for r in ok), default=None)
        # the peak before the verification loads its ground truth (a 42 MB frame pool and comparison arrays)
        s[name]["peak_rss_sampling"] = max((r.get("peak_rss_sampling", 0) for r in ok), default=None) or None
        s[name]["wrong"] = sum(r.get("wrong", 0) for r in ok)
        s[name]["verified"] = sum(r.get("verified", 0) for r in ok)
        s[name]["cgroup_max_usage"] = max((r.get("cgroup", {}).get("max_usage", 0) for r in ok), default=None)
        s[name]["direct"] = all(r.get("direct", False) for r in ok) if name == "device" else None
        for B in (32, 256):
            for k in ("store_reads_per_s", "syscr_per_s", "device_read_bytes_per_s"):
                s[name][f"b{B}_{k}"] = _median(rs, f"b{B}_disk", k)
    faster_allocator(s, ("b32_per_s", "b256_per_s"))
    return s


def targets(out: dict) -> list[tuple[str, float | None, float, bool]]:
    """(name, value, threshold, lower-is-better) per Done-when line of issues #21 and #38 (#38's where it decided)."""
    s, wl, rec = out["summary"], out["workload"], out["store"]
    mm, peer, disk, dev = s["mmreplay"], s["peer"], s["disk"], s["device"]
    ratio = lambda a, b: a / b if a and b else None  # noqa: E731
    rows = []
    if wl == "atari10m":
        rows.append(("atari10m bytes per transition on disk", rec.get("bytes_per_transition"), 150, True))
        for B in (32, 256):  # issue #38: >= 1.5x SB3 from RAM at b32 and b256, default settings (#21 asked 0.5x)
            rows.append((f"atari10m in 2 GB, warm batch-{B} vs SB3 100k in RAM",
                         ratio(mm[f"b{B}_per_s"], peer[f"b{B}_per_s"]), 1.5, False))
        rows.append(("atari10m in 2 GB, first 10 s after open batch-32 vs SB3", ratio(mm["cold_b32_per_s"],
                                                                                     peer["b32_per_s"]), 0.25, False))
    else:
        raw = DMC_RAW_FRAME * rec["n"] * (1 + 1 / 500)  # distinct frames: one more than steps an episode
        # issue #38 accepts >= 4.5x for lossless colour frames bought back as speed (the default lz4_depth 3: 4.65x)
        rows.append(("dmc frames smaller than raw", ratio(raw, rec.get("frames_bytes")), 4.5, False))
        # issue #38 decided the DMC target of #21: >= 0.75x the loader, judged in one run on the bench's machine
        rows.append(("dmc in 4 GB, batch-256 n-step-3 vs DrQ-v2 loader 50k in RAM",
                     ratio(mm["b256_per_s"], peer["b256_per_s"]), 0.75, False))
    budget = out["cache_bytes"] or mm["budget"]
    peak = mm.get("peak_rss_sampling") or mm["peak_rss"]  # sampling, not the verification's ground truth
    rows.append((f"{wl} peak RSS - budget (MB, while sampling)", (peak - budget) / 1e6 if peak and budget
                 else None, 350, True))
    # issue #38: judged by bytes, against the device's bytes/s at depth 32 with reads of the store's own mean size
    rows.append((f"{wl} forced to disk: bytes/s vs the device's at depth 32, reads of the store's size",
                 ratio(disk["b256_device_read_bytes_per_s"], dev["sized_qd32_bytes_per_s"]), 0.5, False))
    rows.append((f"{wl} wrong rows (of {mm['verified'] + disk['verified']:,} checked)", mm["wrong"] + disk["wrong"],
                 0, True))
    return rows


def mean_read(r: dict) -> float | None:
    """Bytes per read syscall at batch 256 (device bytes / syscalls) of a summary: the store reads whole chunks,
    not 4 KiB."""
    return mean_read_of({"device_read_bytes_per_s": r["b256_device_read_bytes_per_s"],
                         "syscr_per_s": r["b256_syscr_per_s"]})


def mean_read_of(disk: dict | None) -> float | None:
    """The same, from one forced-to-disk child's batch-256 figures (what the round's device probe reads)."""
    if not disk:
        return None
    b, n = disk.get("device_read_bytes_per_s"), disk.get("syscr_per_s")
    return b / n if b is not None and n else None


def report(out: dict) -> str:
    if "summary" not in out:
        return f"larger-than-RAM {out.get('workload')} benchmark failed: {out.get('error')}"
    s, rec, wl = out["summary"], out["store"], out["workload"]
    f = fmt
    peer = "SB3 100k, RAM" if wl == "atari10m" else "DrQ-v2 loader 50k, RAM (4 workers)"
    nstep = f", n-step {N_STEP[wl]}" if N_STEP[wl] > 1 else ""
    codec = rec["codec"] + (f" = {rec['stored_codec']}" if rec.get("stored_codec") else "")
    lines = [f"== Larger than RAM: {wl}, {out['n']:,} transitions ({codec}, {rec['store_bytes'] / 1e6:,.0f} MB "
             f"on disk, {rec['bytes_per_transition']:,.0f} B/transition, built in {rec['build_s'] / 60:.0f} min) in a "
             f"{out['limit_bytes'] / 1e9:.1f} GB cgroup{nstep} ==",
             "| system | budget MB | cold b32/s | cold b256/s | warm b32/s | warm b256/s | reads/s b256 (store / "
             "syscalls) | device MB/s b256 | peak RSS MB |", "|---|---|---|---|---|---|---|---|---|"]
    for name, label in (("mmreplay", "mmreplay, cgroup"), ("disk", "mmreplay forced to disk, cgroup"),
                        ("peer", peer)):
        r = s[name]
        budget = {"mmreplay": out["cache_bytes"] or r["budget"], "disk": out["disk_cache_bytes"]}.get(name)
        rss = r["peak_rss"] if name != "peer" or wl == "atari10m" else (r["peak_rss"] or 0) + (r["workers_rss"] or 0)
        lines.append(f"| {label} | {f(budget, 1e6)} | {f(r['cold_b32_per_s'])} | {f(r['cold_b256_per_s'])} | "
                     f"{f(r['b32_per_s'])} | {f(r['b256_per_s'])} | {f(r['b256_store_reads_per_s'])} / "
                     f"{f(r['b256_syscr_per_s'])} | {f(r['b256_device_read_bytes_per_s'], 1e6)} | {f(rss, 1e6)} |"
                     + (f" errors: {r['errors']}" if r["errors"] else ""))
    key = "b32_per_s" if wl == "atari10m" else "b256_per_s"
    both = s["peer"].get("by_allocator", {}).get(key, {})
    lines.append(f"{peer}: the faster of its two allocator settings counts ({key[:-6]}/s: mmap threshold raised "
                 f"{f(both.get('tuned'))}, glibc's defaults {f(both.get('default'))})")
    dev = s["device"]
    how = "O_DIRECT" if dev["direct"] else "page cache dropped, fadvise DONTNEED"
    lines.append(f"device, random 4 KiB reads/s from the store's shards ({how}): depth 1 {f(dev['qd1_reads_per_s'])}, depth 32 "
                 f"{f(dev['qd32_reads_per_s'])} ({f((dev['qd32_reads_per_s'] or 0) * 4096, 1e6)} MB/s); the forced child's "
                 f"reads average {f(mean_read(s['disk']), 1024)} KiB; the device at depth 32 in reads of "
                 f"{f(dev['sized_read_bytes'], 1024)} KiB: {f(dev['sized_qd32_bytes_per_s'], 1e6)} MB/s; cgroup max usage {f(s['mmreplay']['cgroup_max_usage'], 1e6)} MB; "
                 f"warm hit rate {s['mmreplay']['warm_hit_rate'] or 0:.3f}; mmreplay peak RSS while sampling "
                 f"{f(s['mmreplay'].get('peak_rss_sampling'), 1e6)} MB, with the verification {f(s['mmreplay']['peak_rss'], 1e6)} MB; rows checked "
                 f"{s['mmreplay']['verified'] + s['disk']['verified']:,}, wrong {s['mmreplay']['wrong'] + s['disk']['wrong']}")
    m = out.get("machine") or {}
    if "zstd_residual_us" in m:
        lines.append(f"this machine, one core, a {m['frame_bytes']:,}-byte frame of the workload: zstd-12 residual "
                     f"decode {m['zstd_residual_us']:.1f} us, LZ4 frame decode {m['lz4_frame_us']:.1f} us; copy "
                     f"{m['copy_gb_s']:.1f} GB/s; Python loop {m['python_loop_ns']:.0f} ns a step (the store's rate "
                     "follows the decodes, the peer's mostly the copies)")
    lines += target_lines(targets(out))
    return "\n".join(lines)


def workload_frames(wl: str, k: int) -> np.ndarray:
    """``k`` consecutive real frames of the workload (one stream)."""
    if wl == "dmc":
        return np.ascontiguousarray(DmcSource().pool[:k])
    from ..sources import AtariSource
    return AtariSource().read_frames(0, k)


def task_machine(spec: dict) -> dict:
    """What this machine's cores do per frame of the workload, one core, best of 5 passes: a residual (the
    byte difference from the previous frame) decoded by zstd level 12, a frame decoded by LZ4 (numcodecs);
    a copy's bandwidth and a Python loop's step. The store's rate follows the decodes, the DrQ-v2 loader's
    and SB3's mostly the copies: between two VMs of this project's kind, the 1M DMC store's in-RAM rate moved
    1.7-2.3x and the loader's did not, which moved the ratio as much (docs/performance.md)."""
    from numcodecs import LZ4, Zstd
    frames = workload_frames(spec["workload"], 101)
    residuals = [(frames[i] - frames[i - 1]).tobytes() for i in range(1, len(frames))]  # uint8: modulo 256
    zstd, lz4 = Zstd(level=12), LZ4()
    coded = {"zstd_residual": (zstd, [zstd.encode(r) for r in residuals]),
             "lz4_frame": (lz4, [lz4.encode(f.tobytes()) for f in frames])}
    out = {}
    for name, (codec, items) in coded.items():
        best = min(_seconds(lambda: [codec.decode(c) for c in items]) for _ in range(5))
        out[f"{name}_us"] = best / len(items) * 1e6
        out[f"{name}_bytes"] = float(np.mean([len(c) for c in items]))
    src = np.ones(64 << 20, np.uint8)
    dst = np.empty_like(src)
    out["copy_gb_s"] = src.nbytes / min(_seconds(lambda: np.copyto(dst, src)) for _ in range(5)) / 1e9
    n = 2_000_000
    out["python_loop_ns"] = min(_seconds(lambda: sum(range(n))) for _ in range(3)) / n * 1e9
    out["frame_bytes"] = int(frames[0].nbytes)
    return out


def _seconds(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def task_build(spec: dict) -> dict:
    return build(spec["workload"], spec["path"], spec["n"], spec["codec"])


TASKS = {"ltrb_mmreplay": task_mmreplay, "ltrb_drqv2": task_drqv2, "ltrb_device": task_device_reads,
         "ltrb_build": task_build, "ltrb_machine": task_machine}
