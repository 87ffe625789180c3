"""Decode on the device (issue #38 item 8): ``--larger-than-ram --workload atari10m|dmc --device cuda|cpu``.

    python scripts/bench.py --larger-than-ram --workload dmc --device cuda [--ltr-n 100000] [--json out.json]
    python scripts/bench.py --larger-than-ram --workload atari10m --device cuda
    python scripts/bench.py --larger-than-ram --workload dmc --device cpu --ltr-n 20000 --quick   (a dry run)

For the workload's store (``ltr_big.ensure_store``: built once, reused) and on one machine, each round runs, in
fresh children:

``mmreplay device``  ``store.sampler(B, draw, device=D, decode="device")``: compressed bytes staged on the CPU,
                     decoded on the device (nvCOMP on CUDA; the CPU stand-in decoder on ``--device cpu``);
``mmreplay tier``    the same, with a device-resident tier as big as the store's frames (``device_cache_bytes``,
                     ``device/resident.py``), warmed until full: held chunks cross as offsets, not bytes;
``mmreplay cpu``     the same sampler with ``decode="cpu"``: frames decoded by the CPU, batches copied to ``D``;
``peer``             the same loader as ``--larger-than-ram`` (SB3 holding 100k transitions for atari10m, the
                     DrQ-v2-style loader with 50k for dmc), each batch moved to ``D`` (``.to(D)``).

Per system and batch size: batches/s (the median of ``--windows`` windows, the device synchronised at each window's
end) and **CPU ms a batch**: the CPU time of the child and of its worker processes (the DrQ-v2 loader's) over the
timed batches, divided by their number (prefetch threads included). The ``mmreplay device`` child also compares
``--ltr-verify-batches`` seeded batches field by field with ``decode="cpu"`` (rows different: the done-when's 0).

Invariant: every figure comes from a child; ``--device cuda`` where torch sees no CUDA device, or where nvCOMP
does not import, measures nothing, says which (a probe child, before any store is built) and exits with status 2; ``--device cpu`` runs
the same path on CPU tensors, a check of the logic and of its host cost, not a speed target (no target judged).
The children run unconstrained: the GPU machines' RAM holds either store (docs/performance.md, "The CUDA path").
"""
from __future__ import annotations

import os
import time

import numpy as np

from .measure import child_setup, log, peak_rss_bytes

GAMMA = 0.99
BATCHES = {"atari10m": (32, 256), "dmc": (256,)}
SB3_N = 100_000


# ----------------------------------------------------------------------------------------------
# what a child measures
# ----------------------------------------------------------------------------------------------
def _proc_cpu_s(pid: int | str) -> float:
    with open(f"/proc/{pid}/stat") as f:
        v = f.read().rsplit(")", 1)[1].split()
    return (int(v[11]) + int(v[12])) / os.sysconf("SC_CLK_TCK")  # utime + stime, all its threads


def _children(pid: int) -> list[int]:
    out = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def tree_cpu_s() -> float:
    """CPU seconds of this process (``time.process_time``: every thread) and of its live descendants (a loader's
    worker processes), now."""
    total, todo = time.process_time(), _children(os.getpid())
    while todo:
        pid = todo.pop()
        try:
            total += _proc_cpu_s(pid)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile
        todo += _children(pid)
    return total


def timed(fn, sync, windows: int, window_s: float, warmup_s: float) -> dict:
    """``fn`` (one batch) in ``windows`` windows of at least ``window_s`` s after ``warmup_s`` s; ``sync()`` ends
    each window (the device's queued work counted in it). Batches/s per window, and the CPU ms a batch over all."""
    t_end = time.perf_counter() + warmup_s
    fn()
    while time.perf_counter() < t_end:
        fn()
    sync()
    rates, n, c0 = [], 0, tree_cpu_s()
    for _ in range(windows):
        k, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < window_s:
            fn()
            k += 1
        sync()
        rates.append(k / (time.perf_counter() - t0))
        n += k
    cpu = tree_cpu_s() - c0
    return {"per_s": float(np.median(rates)), "windows": rates, "cpu_ms_per_batch": 1e3 * cpu / max(n, 1),
            "batches": n}


def _device(spec: dict):
    import torch
    return torch.device(spec["device"])


def _sync(device):
    import torch
    if device.type == "cuda":
        return lambda: torch.cuda.synchronize(device)
    return lambda: None


def task_probe(spec: dict) -> dict:
    """Can the device path run here? (What is missing, in words, when not.)"""
    import torch

    from mmreplay.device.decoders import nvcomp_available
    if spec["device"] == "cpu":
        return {"ok": True, "device_name": "cpu (the CPU stand-in decoder)", "torch": torch.__version__}
    if not torch.cuda.is_available():
        return {"ok": False, "why": f"no CUDA device here (torch {torch.__version__}: torch.cuda.is_available() is "
                "False); --device cpu runs the same path on the CPU with the stand-in decoder"}
    if not nvcomp_available():
        return {"ok": False, "why": "nvCOMP's Python package does not import: pip install 'mmreplay[gpu]' "
                "(nvidia-nvcomp-cu12)"}
    return {"ok": True, "device_name": torch.cuda.get_device_name(0), "torch": torch.__version__}


def batch_fields(batch) -> dict:
    import torch
    out = {}
    for name, value in vars(batch).items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v.cpu().numpy() for k, v in value.items()})
        elif isinstance(value, torch.Tensor):
            out[name] = value.cpu().numpy()
    return out


def rows_differing(store, draw_factory, batch: int, batches: int, device, device_cache_bytes=None) -> dict:
    """Rows of ``decode="device"`` batches (with a device tier of ``device_cache_bytes``, if given) that differ, in any
    field, from ``decode="cpu"`` for the same seed."""
    wrong = rows = 0
    dev_arg = device if device.type == "cuda" else None
    if (store.settings.device_cache_bytes or 0) != (device_cache_bytes or 0):
        raise RuntimeError(f"the store was opened with device_cache_bytes={store.settings.device_cache_bytes}, "
                           f"not {device_cache_bytes}")
    with store.sampler(batch, draw_factory(), seed=99, decode="cpu", name="verify-cpu") as cpu, \
            store.sampler(batch, draw_factory(), seed=99, decode="device", device=dev_arg, name="verify-dev") as dev:
        if dev.decode != "device":
            raise RuntimeError("decode='device' did not take the device path")
        for _ in range(batches):
            want, got = batch_fields(next(cpu)), batch_fields(next(dev))
            bad = np.zeros(batch, dtype=bool) if want.keys() == got.keys() else np.ones(batch, dtype=bool)
            for key in set(want) & set(got):
                if want[key].shape != got[key].shape or want[key].dtype != got[key].dtype:
                    bad[:] = True
                else:
                    bad |= (want[key] != got[key]).reshape(batch, -1).any(axis=1)
            wrong += int(bad.sum())
            rows += batch
    return {"verified": rows, "wrong": wrong}


def task_mmreplay(spec: dict) -> dict:
    """The store sampled with ``decode=spec["decode"]`` to ``spec["device"]``: each batch size timed; the device
    path's child also checks its rows against the CPU path's."""
    child_setup(tune=False)  # glibc's defaults, as users run
    import mmreplay
    device = _device(spec)
    wl = spec["workload"]
    draw = (lambda: mmreplay.NStep(3, GAMMA)) if wl == "dmc" else (lambda: mmreplay.Uniform())
    t0 = time.perf_counter()
    # the device-resident tier (device/resident.py): one a sampler that decodes on the device
    s = mmreplay.Store.open(spec["path"], mode="r", device_cache_bytes=spec.get("device_cache_bytes") or 0)
    res = {"open_s": time.perf_counter() - t0, "stored": len(s), "decode": spec["decode"]}
    dev_arg = device if device.type == "cuda" else None
    smps = {B: s.sampler(B, draw(), seed=B, name=f"b{B}", device=dev_arg, decode=spec["decode"])
            for B in BATCHES[wl]}
    first = smps[BATCHES[wl][0]]
    res["device_path"] = first.decode == "device"
    t_end = time.perf_counter() + spec["warm_max_s"]  # warm: the compressed tier's background pass has ended
    while s.inspect.cache_stats()["obs"].get("compressed", {}).get("loading") and time.perf_counter() < t_end:
        next(first)
    for smp in smps.values():  # warm the device tiers: until full, or a window adds no chunk
        while smp.device_tier is not None and time.perf_counter() < t_end:
            before = smp.device_tier["chunks"]
            for _ in range(20):
                next(smp)
            if smp.device_tier["chunks"] == before:
                break
    res["warm_s"] = time.perf_counter() - t0
    for B, smp in smps.items():
        got = timed(smp.__next__, _sync(device), spec["windows"], spec["window_s"], spec["warmup_s"])
        res[f"b{B}_per_s"], res[f"b{B}_windows"] = got["per_s"], got["windows"]
        res[f"b{B}_cpu_ms"] = got["cpu_ms_per_batch"]
        if smp.device_tier is not None:
            res[f"b{B}_tier"] = smp.device_tier
        if smp._device_draw is not None and smp._device_draw.pending is not None:
            staged = smp._device_draw.pending.staged
            res[f"b{B}_staged_bytes"] = staged.nbytes
            res[f"b{B}_decoded_bytes"] = staged.decoded_nbytes
    for smp in smps.values():
        smp.close()
    if spec["decode"] == "device" and spec.get("verify_batches"):
        res.update(rows_differing(s, draw, BATCHES[wl][-1], spec["verify_batches"], device,
                                  spec.get("device_cache_bytes")))
    res["peak_rss"] = peak_rss_bytes()
    s.close()
    return res


def task_peer(spec: dict) -> dict:
    """The workload's peer, each batch moved to the device (``.to(device)``): SB3 100k (atari10m) or the DrQ-v2-style
    loader (dmc, its workers' CPU counted)."""
    child_setup(tune=spec.get("tune_malloc", True))
    import torch
    device = _device(spec)
    res = {}
    if spec["workload"] == "dmc":
        from .peers.drqv2_loader import make_loader
        it = make_loader(spec["n"], 256, spec["workers"], 3, GAMMA)
        next(it)
        fns = {256: lambda: [t.to(device, non_blocking=True) for t in next(it)]}
    else:
        from .tasks_peers import peer_fill
        rb, fill, _, _ = peer_fill({**spec, "system": "sb3", "workload": "atari", "n_envs": 1})
        res["fill"] = {k: v for k, v in fill.items() if isinstance(v, (int, float))}

        def to_device(b):
            return {k: (v.to(device) if isinstance(v, torch.Tensor) else torch.as_tensor(v, device=device))
                    for k, v in rb.sample(b).items()}
        fns = {b: (lambda b=b: to_device(b)) for b in BATCHES["atari10m"]}
    for B, fn in fns.items():
        got = timed(fn, _sync(device), spec["windows"], spec["window_s"], max(spec["warmup_s"], 2.0))
        res[f"b{B}_per_s"], res[f"b{B}_windows"] = got["per_s"], got["windows"]
        res[f"b{B}_cpu_ms"] = got["cpu_ms_per_batch"]
    res["peak_rss"] = peak_rss_bytes()
    return res


TASKS = {"dev_probe": task_probe, "dev_mmreplay": task_mmreplay, "dev_peer": task_peer}


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def run(runner, args) -> dict:
    from .modes.ltr_big import ensure_store
    wl, device = args.ltr_workload, args.device
    out = {"mode": "device", "workload": wl, "device": device}
    if wl not in BATCHES:  # nothing to measure: the run ends here, saying why (exit status 2)
        raise SystemExit(f"bench.py: --device runs --larger-than-ram --workload atari10m or dmc, got --workload {wl}")
    probe = runner.child({"task": "dev_probe", "device": device}, label=f"device/probe {device}", timeout=600)
    out["probe"] = probe
    if not probe.get("ok"):
        why = probe.get("why") or (probe.get("error") or "the probe child failed").strip().splitlines()[-1]
        log(f"bench.py: --device {device}: {why}")
        raise SystemExit(2)
    n = args.ltr_n or {"atari10m": 10_000_000, "dmc": 1_000_000}[wl]
    path, rec = ensure_store(runner, wl, args.frame_codec or "delta-zstd", n)
    if path is None:
        out["error"] = rec.get("error")
        return out
    out.update(n=n, path=path, store=rec)
    base = {"windows": args.windows, "window_s": args.window_s, "warmup_s": args.warmup_s, "workload": wl,
            "device": device, "path": path, "warm_max_s": args.ltr_warm_max_s}
    peer = {"task": "dev_peer", "n": args.ltr_drq_n, "workers": 4} if wl == "dmc" else \
        {"task": "dev_peer", "n": 10_000 if args.quick else SB3_N}
    out["peer_n"] = peer["n"]
    # the tier's room: the store's frames and a margin (1M DMC ~4.4 GB, 10M Atari ~1.1 GB: an 80 GB GPU holds either)
    out["device_cache_bytes"] = int(1.05 * rec.get("frames_bytes", 0)) or None
    runs = {"device": [], "tier": [], "cpu": [], "peer": []}
    for rnd in range(args.ltr_repeats):
        runs["peer"].append(runner.child({**base, **peer}, label=f"device/peer {wl} to {device} r{rnd}",
                                         timeout=args.child_timeout))
        for name, decode in (("device", "device"), ("tier", "device"), ("cpu", "cpu")):
            runs[name].append(runner.child(
                {**base, "task": "dev_mmreplay", "decode": decode,
                 "device_cache_bytes": out["device_cache_bytes"] if name == "tier" else None,
                 "verify_batches": args.ltr_verify_batches if decode == "device" else 0},
                label=f"device/mmreplay {name} {wl} to {device} r{rnd}", timeout=args.child_timeout))
    out["runs"] = runs
    out["summary"] = summarize(runs, wl)
    return out


def _median(rs: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rs if isinstance(r.get(key), (int, float))]
    return float(np.median(vals)) if vals else None


def summarize(runs: dict, wl: str) -> dict:
    s = {}
    for name, rs in runs.items():
        ok = [r for r in rs if "error" not in r]
        s[name] = {k: _median(ok, k) for B in BATCHES[wl] for k in (f"b{B}_per_s", f"b{B}_cpu_ms",
                                                                   f"b{B}_staged_bytes", f"b{B}_decoded_bytes")}
        s[name]["errors"] = [r["error"].strip().splitlines()[-1] for r in rs if "error" in r]
        s[name]["verified"] = sum(r.get("verified", 0) for r in ok)
        s[name]["wrong"] = sum(r.get("wrong", 0) for r in ok)
        s[name]["device_path"] = all(r.get("device_path", name == "peer") for r in ok) if ok else None
    return s


def targets(out: dict) -> list[tuple[str, float | None, float, bool]]:
    """(name, value, threshold, lower-is-better): issue #38's GPU done-when lines; on a CPU dry run only the rows
    different from the CPU path (the rates of CPU tensors are no target)."""
    if "summary" not in out:
        return []
    s, wl = out["summary"], out["workload"]
    ratio = lambda a, b: a / b if a and b else None
    dev, peer = s["device"], s["peer"]
    label = "DrQ-v2 loader" if wl == "dmc" else "SB3 100k"
    rows = []
    if out["device"] == "cuda":
        for name, how in (("device", "staged"), ("tier", "held on the device")):
            rows.append((f"{wl} b256 to cuda, decode on the device ({how}) vs the {label} moved to cuda",
                         ratio(s[name]["b256_per_s"], peer["b256_per_s"]), 3.0, False))
            if wl == "dmc":
                rows.append((f"dmc b256 n-step 3 to cuda ({how}): CPU ms a batch", s[name]["b256_cpu_ms"], 2.0, True))
    checked = dev["verified"] + s["tier"]["verified"]
    rows.append((f"{wl} decode on {out['device']}: rows different from the CPU path (of {checked:,})",
                 dev["wrong"] + s["tier"]["wrong"], 0, True))
    return rows


def report(out: dict) -> str:
    if "summary" not in out:
        return f"decode on the device ({out.get('workload')}, --device {out.get('device')}): {out.get('error')}"
    s, wl = out["summary"], out["workload"]
    f = lambda v, k=1.0: "-" if v is None else f"{v / k:,.0f}" if v / k >= 100 else f"{v / k:,.2f}"
    probe = out.get("probe", {})
    peer_n = out.get("peer_n") or 0
    peer = f"SB3 {peer_n:,}, RAM" if wl == "atari10m" else f"DrQ-v2 loader {peer_n:,}, RAM (4 workers)"
    lines = [f"== Decode on the device: {wl}, {out['n']:,} transitions ({out['store'].get('codec')}) to "
             f"{out['device']} ({probe.get('device_name')}, torch {probe.get('torch')})"
             + (" -- a dry run on CPU tensors: the logic and its host cost, no target ==" if out["device"] == "cpu"
                else " ==")]
    head = "| system | " + " | ".join(f"b{B}/s | CPU ms a b{B}" for B in BATCHES[wl]) + " | staged MB a batch |"
    lines += [head, "|" + "---|" * (2 + 2 * len(BATCHES[wl]))]
    names = (("device", "mmreplay, decode on the device"),
             ("tier", f"mmreplay, decode on the device, {f(out.get('device_cache_bytes') or 0, 1e9)} GB tier there"),
             ("cpu", "mmreplay, decode on the CPU, copied"), ("peer", f"{peer}, copied"))
    for name, label in names:
        r = s[name]
        cells = " | ".join(f"{f(r[f'b{B}_per_s'])} | {f(r[f'b{B}_cpu_ms'])}" for B in BATCHES[wl])
        staged = r.get(f"b{BATCHES[wl][-1]}_staged_bytes")
        lines.append(f"| {label} | {cells} | {f(staged, 1e6)} |" + (f" errors: {r['errors']}" if r["errors"] else ""))
    dev = {k: s["device"][k] + s["tier"][k] for k in ("verified", "wrong")}
    lines.append(f"device path taken: {s['device']['device_path'] and s['tier']['device_path']}; rows compared with "
                 f"decode='cpu' (staged and tier): {dev['verified']:,}, different: {dev['wrong']}; CPU ms a batch = the child's CPU time (every thread, and the loader's "
                 "worker processes) over the timed batches")
    rows = targets(out)
    if rows:
        lines += ["", "| target | measured | wanted | |", "|---|---|---|---|"]
        for name, v, t, le in rows:
            ok = None if v is None else (v <= t if le else v >= t)
            lines.append(f"| {name} | {'-' if v is None else f'{v:,.2f}'} | {'<=' if le else '>='} {t} | "
                         f"{'-' if ok is None else ('PASS' if ok else 'FAIL')} |")
    return "\n".join(lines)
