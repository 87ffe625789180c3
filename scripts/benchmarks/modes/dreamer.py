"""The ``dreamer`` workload (issue #42): DreamerV3's replay, sequences of 64 steps in batches of 16, of 64x64 RGB
frames of real DMC renders (``dreamer_data``), a store in a memory cgroup against a DreamerV3-style replay
holding what fits its RAM.

    python scripts/bench.py --dreamer [--dreamer-n 1000000] [--dreamer-peer-n 500000] [--dreamer-limit 8e9]
                            [--dreamer-codec auto|delta-zstd|JSON spec] [--json out.json]

``mmreplay``  (in the cgroup, default settings) ``Store.open`` of the ``--dreamer-n`` store (page cache dropped
              first), ``store.sampler(16, Sequences(64))``: the first ``--dreamer-cold-s`` seconds after
              open, one rate a second; warm windows once the compressed tier's background pass has ended;
              then ``--dreamer-verify-batches`` batches checked step by step against the real frames, actions,
              rewards and episode ends (a wrong frame is one whose pixels differ anywhere).
``peer``      (not constrained) ``peers/dreamer_replay``: chunks of 1,024 steps in RAM, uniform over sequence
              starts, 16 sequences stacked per key; its batches checked the same way.

``--device cuda`` (issue #42's GPU target, through issue #38's device decode path): the store's sampler delivers
batches on the device (``decode="device"``: compressed runs staged and decoded there by nvCOMP, ``mmreplay[gpu]``),
and the peer's batches are moved there (``.to(device)``); every batch ends with a device synchronise, on both
sides. ``--device cpu`` runs the same path with the CPU stand-in decoder (a dry run, not a figure).

Invariant: every figure comes from a fresh child, the rounds interleaved (peer, store, peer, store, ...); the
cgroup is removed whatever happens; the store is built once (``dreamer_data.build``) and reused while it
carries its build record. Rates are medians of all rounds' windows; the ratio compares them within one run.
"""
from __future__ import annotations

import time

import numpy as np

from ..dreamer_data import EPISODE, FRAME_BYTES, DreamerSource, build, store_path
from ..ltr_data import built
from ..measure import child_setup, log, peak_rss_bytes, rate_windows
from .base import Mode
from .cgroup_rounds import (
    CpuMeter,
    close_store,
    faster_allocator,
    fmt,
    interleaved_rounds,
    open_cold,
    target_lines,
    wait_background_pass,
)
from .ltr_checks import per_second, warm_up

BATCH, LENGTH = 16, 64


def wrong_steps(src: DreamerSource, index: np.ndarray, image, action, reward, first=None, terminal=None,
                last=None) -> tuple[int, int]:
    """(wrong frames, wrong steps) of a batch of sequences whose dataset steps are ``index`` (B, T): a frame
    is wrong if any pixel differs; a step if its frame, action, reward or a given flag differs."""
    frames_ok = np.all((np.asarray(image) == src.frames(index)).reshape(index.size, -1), axis=1)
    ok = frames_ok & np.all(np.asarray(action).reshape(index.size, -1) == src.action(index.reshape(-1)), axis=1) \
        & (np.asarray(reward).reshape(-1) == src.reward(index.reshape(-1)))
    for got, truth in ((first, src.is_first), (terminal, src.is_terminal), (last, src.is_last)):
        if got is not None:
            ok &= np.asarray(got).reshape(-1) == truth(index.reshape(-1))
    return int((~frames_ok).sum()), int((~ok).sum())


def on_device(device: str | None) -> dict:
    """The sampler's keywords for ``--device``: batches on that device, decoded there (none: the CPU path)."""
    return {"device": device, "decode": "device"} if device else {}


def synced(fn, device: str | None):
    """``fn`` followed by a synchronise of ``device`` when it is a CUDA device (its queued work counted)."""
    if not device or not device.startswith("cuda"):
        return fn
    import torch

    def call():
        out = fn()
        torch.cuda.synchronize()
        return out
    return call


def verify_store(store, n_batches: int, device: str | None = None) -> dict:
    """Sequences(64) batches against the dataset: every step's frame, action, reward and flags, the windows
    within one episode, and each window's ``next_obs`` (the frame after its last step); with ``device``, the
    batches of the device path, brought back to the host to be compared."""
    import mmreplay
    src, frames, steps, checked = DreamerSource(), 0, 0, 0
    smp = store.sampler(BATCH, mmreplay.Sequences(LENGTH), seed=777, name="verify", **on_device(device))

    def host(t):
        return t.cpu().numpy()
    for _ in range(n_batches):
        b = next(smp)
        idx = host(b.indices)
        if not host(b.mask).all():
            raise AssertionError("strict Sequences(64) returned padding")
        first = getattr(b, "is_first", None)
        wf, ws = wrong_steps(src, idx, host(b.obs), host(b.action), host(b.reward),
                             None if first is None else host(first), host(b.terminated),
                             host(b.terminated | b.truncated))
        same_episode = (idx // EPISODE == idx[:, :1] // EPISODE).all(axis=1)
        nxt_ok = np.all((host(b.next_obs) == src.frames(idx[:, -1], 1)).reshape(BATCH, -1), axis=1)
        frames += wf + int((~nxt_ok).sum())
        steps += ws + int((~same_episode).sum()) * LENGTH
        checked += idx.size
    smp.close()
    return {"verified_steps": checked, "wrong_frames": frames, "wrong_steps": steps}


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def task_store(spec: dict) -> dict:
    child_setup(tune=False)  # glibc's defaults, as users run
    import mmreplay
    s, res, t0 = open_cold(spec["path"])  # default settings
    device = spec.get("device")
    smp = s.sampler(BATCH, mmreplay.Sequences(LENGTH), seed=1, name="b16", **on_device(device))
    res["decode"] = smp.decode
    batch = synced(smp.__next__, device)
    if spec.get("cold_s"):
        res["cold_per_second"] = per_second(batch, spec["cold_s"])
        res["cold_per_s"] = float(np.mean(res["cold_per_second"]))
    # warm: once the compressed tier's background pass has ended, and the decoded cache's hit rate is stable (a
    # store whose frames fit the budget decoded fills it)
    wait_background_pass(s, batch, time.perf_counter() + spec["warm_max_s"])
    res["warm_hit_rate"] = warm_up(s, smp, spec["window_s"], spec["warm_max_s"])
    res["warm_after_s"] = time.perf_counter() - t0
    meter = CpuMeter(batch)
    rates = rate_windows(meter, spec["windows"], spec["window_s"], spec["warmup_s"])
    res["cpu_ms_a_batch"] = meter.ms_a_call()
    res["per_s"], res["windows"] = float(np.median(rates)), rates
    smp.close()
    return close_store(s, res, spec, lambda: verify_store(s, spec["verify_batches"], device))


def task_peer(spec: dict) -> dict:
    child_setup(tune=spec.get("tune_malloc", False))
    from ..peers.dreamer_replay import DreamerReplay
    t0 = time.perf_counter()
    rb = DreamerReplay(spec["n"], LENGTH)
    res = {"load_s": time.perf_counter() - t0}
    device = spec.get("device")

    def batch():
        return rb.sample(BATCH)
    if device:
        import torch
        dev = torch.device(device)
        meter = CpuMeter(synced(lambda: {k: v.to(dev, non_blocking=True) for k, v in batch().items()}, device))
    else:
        meter = CpuMeter(batch)
    rates = rate_windows(meter, spec["windows"], spec["window_s"], spec["warmup_s"])
    res["cpu_ms_a_batch"] = meter.ms_a_call()
    res["per_s"], res["windows"] = float(np.median(rates)), rates
    res["peak_rss"] = peak_rss_bytes()
    src, frames, steps = DreamerSource(), 0, 0
    for _ in range(spec["verify_batches"]):
        b = rb.sample(BATCH, with_index=True)
        wf, ws = wrong_steps(src, b["index"].numpy(), b["image"].numpy(), b["action"].numpy(), b["reward"].numpy(),
                             b["is_first"].numpy(), b["is_terminal"].numpy(), b["is_last"].numpy())
        frames, steps = frames + wf, steps + ws
    res.update({"verified_steps": spec["verify_batches"] * BATCH * LENGTH, "wrong_frames": frames,
                "wrong_steps": steps})
    return res


def task_build(spec: dict) -> dict:
    return build(spec["path"], spec["n"], spec["codec"])


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def run(runner, a) -> dict:
    n, codec = a.dreamer_n, a.dreamer_codec
    path = store_path(runner.workdir, n, codec)
    rec = built(path)
    if rec is None:
        est = n * FRAME_BYTES / 4.5
        log(f"[dreamer] building {path} ({n:,} steps, ~{est / 1e9:.1f} GB at 4.5x)")
        rec = runner.child({"task": "dreamer_build", "path": path, "n": n, "codec": codec},
                           label=f"dreamer/build {n:,}", timeout=6 * 3600)
        if "error" in rec:
            return {"error": rec["error"]}
    base = {"windows": a.windows, "window_s": a.window_s, "warmup_s": max(a.warmup_s, 1.0),
            "verify_batches": a.dreamer_verify_batches, "device": a.device}
    out = {"n": n, "peer_n": a.dreamer_peer_n, "limit_bytes": a.dreamer_limit, "path": path, "store": rec,
           "device": a.device}

    def store_round(cg: str, rnd: int) -> dict:
        return {"mmreplay": runner.child(
            {**base, "task": "dreamer_store", "path": path, "cold_s": a.dreamer_cold_s, "warm_max_s": 600.0},
            cgroup=cg, label=f"dreamer/mmreplay {n:,} in cgroup r{rnd}", timeout=a.child_timeout)}

    runs = {"mmreplay": [], **interleaved_rounds(runner, a.dreamer_repeats, a.dreamer_limit, "mmreplay_dreamer",
                                                 {**base, "task": "dreamer_peer", "n": a.dreamer_peer_n},
                                                 f"dreamer/peer {a.dreamer_peer_n:,}", store_round, a.child_timeout)}
    out["runs"] = runs
    out["summary"] = summarize(runs)
    return out


def summarize(runs: dict) -> dict:
    s = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        windows = [w for r in ok for w in r.get("windows", [])]
        s[name] = {"per_s": float(np.median(windows)) if windows else None,
                   "round_medians": [r.get("per_s") for r in ok],
                   "cold_per_s": float(np.median([r["cold_per_s"] for r in ok if "cold_per_s" in r]))
                   if any("cold_per_s" in r for r in ok) else None,
                   "peak_rss": max((r.get("peak_rss", 0) for r in ok), default=None),
                   "peak_rss_sampling": max((r.get("peak_rss_sampling", 0) for r in ok), default=None) or None,
                   "cgroup_max_usage": max((r.get("cgroup", {}).get("max_usage", 0) for r in ok), default=None),
                   "cpu_ms_a_batch": float(np.median([r["cpu_ms_a_batch"] for r in ok if r.get("cpu_ms_a_batch")]))
                   if any(r.get("cpu_ms_a_batch") for r in ok) else None,
                   "verified_steps": sum(r.get("verified_steps", 0) for r in ok),
                   "wrong_frames": sum(r.get("wrong_frames", 0) for r in ok),
                   "wrong_steps": sum(r.get("wrong_steps", 0) for r in ok),
                   "errors": [r["error"].strip().splitlines()[-1] for r in rs if "error" in r]}
    other = s["peer_default_malloc"]
    peer = faster_allocator(s, ("per_s",), {"cpu_ms_a_batch": "per_s"})
    peer["wrong_frames"] += other["wrong_frames"]
    peer["wrong_steps"] += other["wrong_steps"]
    peer["verified_steps"] += other["verified_steps"]
    return s


def targets(out: dict) -> list[tuple[str, float | None, float, bool]]:
    """(name, value, threshold, lower-is-better) per Done-when line of issue #42's dreamer workload."""
    s, rec = out["summary"], out["store"]
    mm, peer = s["mmreplay"], s["peer"]
    ratio = mm["per_s"] / peer["per_s"] if mm["per_s"] and peer["per_s"] else None
    device = out.get("device")
    on = f" to {device}, decoded there," if device else ""
    return [(f"dreamer {out['n']:,} in {out['limit_bytes'] / 1e9:.0f} GB,{on} Sequences(64) b16 vs DreamerV3-style "
             f"replay {out['peer_n']:,} in RAM", ratio, 1.0 if device == "cuda" else 0.5, False),
            ("dreamer frames smaller than raw", rec.get("frames_smaller_than_raw"), 4.5, False),
            (f"dreamer wrong frames (of {mm['verified_steps']:,} steps checked)", mm["wrong_frames"], 0, True)]


def report(out: dict) -> str:
    if "summary" not in out:
        return f"dreamer benchmark failed: {out.get('error')}"
    s, rec = out["summary"], out["store"]
    f = fmt
    lines = [f"== dreamer: {out['n']:,} steps of 64x64 RGB ({rec['codec']} = {rec.get('codec_spec')}, "
             f"{rec['store_bytes'] / 1e6:,.0f} MB on disk, {rec['bytes_per_step']:,.0f} B/step, frames "
             f"{rec['frames_smaller_than_raw']:.2f}x smaller than raw, built at {rec['add_per_s']:,.0f} steps/s) in a "
             f"{out['limit_bytes'] / 1e9:.1f} GB cgroup, Sequences(64) batch 16"
             + (f", batches on {out['device']} (the store's decoded there; the peer's moved)" if out.get("device")
                else "") + " ==",
             "| system | steps held | cold b/s (first s after open) | warm b/s (median) | round medians | CPU ms a batch "
             "| peak RSS MB | wrong frames / steps checked |", "|---|---|---|---|---|---|---|---|"]
    for name, label, held in (("mmreplay", "mmreplay, cgroup", out["n"]), ("peer", "DreamerV3-style replay, RAM",
                                                                          out["peer_n"])):
        r = s[name]
        lines.append(f"| {label} | {held:,} | {f(r['cold_per_s'])} | {f(r['per_s'])} | "
                     f"{', '.join(f(v) for v in r['round_medians'])} | {f(r['cpu_ms_a_batch'])} | "
                     f"{f(r['peak_rss'], 1e6)} | "
                     f"{r['wrong_frames']} / {r['verified_steps']:,} |" + (f" errors: {r['errors']}" if r["errors"] else ""))
    by = s["peer"]["by_allocator"]
    lines.append(f"peer: the faster of its two allocator settings counts (tuned {f(by['per_s']['tuned'])}, glibc "
                 f"default {f(by['per_s']['default'])}); mmreplay cgroup max usage "
                 f"{f(s['mmreplay']['cgroup_max_usage'], 1e6)} MB")
    lines += target_lines(targets(out))
    return "\n".join(lines)


class DreamerMode(Mode):
    key = "dreamer"
    exclusive = True
    tasks = {"dreamer_store": task_store, "dreamer_peer": task_peer, "dreamer_build": task_build}

    def add_arguments(self, p) -> None:
        p.add_argument("--dreamer", action="store_true", help="only the dreamer workload (issue #42): Sequences(64) "
                       "b16 of 64x64 RGB from a store in a memory cgroup vs a DreamerV3-style replay in RAM")
        p.add_argument("--dreamer-n", type=int, default=None, help="steps in the store (default 1000000; quick 20000)")
        p.add_argument("--dreamer-peer-n", type=int, default=None, help="steps the DreamerV3-style replay holds "
                       "(default 500000; quick 20000)")
        p.add_argument("--dreamer-limit", type=lambda v: int(float(v)), default=8_000_000_000,
                       help="the store child's cgroup memory limit, bytes (default 8e9)")
        p.add_argument("--dreamer-codec", default="auto", help="the store's frame_codec: auto (the library's default), "
                       "a name, or a JSON codec spec")
        p.add_argument("--dreamer-repeats", type=int, default=None, help="interleaved rounds (default 2; quick 1)")
        p.add_argument("--dreamer-cold-s", type=float, default=5.0, help="seconds after open counted as cold")
        p.add_argument("--dreamer-verify-batches", type=int, default=20, help="batches checked against the frames, "
                       "per child")

    def finish_args(self, a, quick: bool, argv: list[str]) -> None:
        if a.dreamer_n is None:
            a.dreamer_n = 20_000 if quick else 1_000_000
        if a.dreamer_peer_n is None:
            a.dreamer_peer_n = 20_000 if quick else 500_000
        if a.dreamer_repeats is None:
            a.dreamer_repeats = 1 if quick else 2

    def requested(self, a) -> bool:
        return a.dreamer

    def run(self, runner) -> dict:
        return run(runner, runner.args)

    def report(self, part: dict, results: dict, args) -> list[str]:
        return ["\n" + report(part)]

    def targets(self, part: dict, args, add) -> None:
        if "summary" not in part:
            return
        for name, value, threshold, le in targets(part):
            add(name, value, threshold, unit="" if "wrong" in name else "x", le=le)

    def reaggregate(self, part: dict, args) -> None:
        if "runs" in part:
            part["summary"] = summarize(part["runs"])
