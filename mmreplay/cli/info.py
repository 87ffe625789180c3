"""``mmreplay info`` and ``mmreplay verify``: what a store holds, and whether its committed data is intact.

Invariant: both only read the store (opened with ``mode="r"``), through ``Store.info``, ``Store.verify``,
``Store.inspect.cache_stats`` and ``mmreplay.stats``; ``verify`` exits 1 when it finds a problem, 0 otherwise.
"""

from __future__ import annotations

import json

import numpy as np

from mmreplay.cli.progress import Progress


def register(sub) -> None:
    p = sub.add_parser("info", help="episodes and returns, counts, stack padding, cache fit, disk use per column")
    p.add_argument("path")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_info)
    p = sub.add_parser("verify", help="check every committed chunk's checksum and size")
    p.add_argument("path")
    p.set_defaults(func=cmd_verify)


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def info_figures(store) -> dict:
    """``store.info()`` plus what a user asks first: episodes and returns, stack padding, cache fit."""
    from mmreplay.stats import committed_priorities, episode_stats

    info = store.info()
    frame_bytes = sum(int(np.prod(s.shape, dtype=np.int64)) * s.np_dtype.itemsize for s in store.schema.observations)
    cache = store.inspect.cache_stats()
    cache_capacity = sum(c["capacity_bytes"] for c in cache.values())
    decoded = info["frames"] * frame_bytes
    compressed_frames = sum(c["disk_bytes"] for c in info["columns"] if c["array"].startswith("frames/"))
    info["stack_padding"] = store.schema.stack_padding
    info["decoded_frame_bytes"] = decoded
    compressed = [c["compressed"] for c in cache.values()]
    compressed_cap = sum(c["capacity_bytes"] for c in compressed)
    direct = any(c["direct"] for c in compressed)
    # Caps are what the budget allows, not what a sampler takes: a cache never holds more than there is
    # to hold (the frames), so "held" is the smaller of the two, what a user must have RAM for.
    info["cache"] = {"capacity_bytes": cache_capacity,
                     "held_at_most_bytes": 0 if direct else min(cache_capacity, decoded),
                     "fraction_of_frames": min(1.0, cache_capacity / decoded) if decoded else 1.0,
                     "compressed_in_ram_bytes": compressed_cap,  # (the cap; kept under its old name)
                     "compressed_cap_bytes": compressed_cap,
                     "compressed_held_at_most_bytes": min(compressed_cap, compressed_frames),
                     "decoded_into_batches": direct}
    info["episodes"] = episode_stats(store).summary()
    info["prioritized_samplers"] = {name: {"transitions": int(p.size), "min": float(p.min()) if p.size else None,
                                           "max": float(p.max()) if p.size else None}
                                    for name, p in committed_priorities(store).items()}
    return info


def cmd_info(args) -> int:
    from mmreplay.settings import Settings
    from mmreplay.store import Store

    with Store.open(args.path, mode="r", settings=Settings(preload=False)) as store:
        if args.json:
            print(json.dumps(info_figures(store), indent=2))
            return 0
        print(f"store {store.path}", flush=True)  # at once: the figures below read the whole index
        info = info_figures(store)
    _print_info(info)
    return 0


def _print_info(info: dict) -> None:
    cap = "unbounded" if info["capacity"] is None else f"{info['capacity']:,}"
    print(f"  format {info['format_version']}, capacity {cap}, frame_stack {info['frame_stack']}, "
          f"stack_padding {info['stack_padding']}")
    print(f"  transitions {info['transitions']:,} valid, {info['added']:,} added, {info['frames']:,} frames")
    ep = info["episodes"]
    print(f"  episodes {ep['complete']:,} complete, {ep['running']:,} running, {ep['cut']:,} cut by the ring "
          "(start overwritten)")
    if ep["return"]:
        r, n = ep["return"], ep["length"]
        print(f"  return mean {r['mean']:,.3g}, min {r['min']:,.3g}, max {r['max']:,.3g}, "
              f"last {r['last']} mean {r['last_100_mean']:,.3g}")
        print(f"  length mean {n['mean']:,.1f}, min {n['min']:,}, max {n['max']:,}")
    print(f"  disk {_mb(info['disk_bytes'])}, {info['bytes_per_transition']:.1f} bytes per transition; "
          f"decoded frames {_mb(info['decoded_frame_bytes'])}; index RAM "
          f"{info['index_ram_bytes_per_transition']:.2f} bytes per transition")
    print(f"  frame memory with the default budget (Store.open(cache_bytes=...)): {_frame_memory(info['cache'])}")
    for name, p in info["prioritized_samplers"].items():
        print(f"  prioritized sampler {name!r}: priorities for {p['transitions']:,} transitions, "
              f"min {p['min']:.3g}, max {p['max']:.3g}")
    print(f"\n  {'array':28s} {'kind':8s} {'dtype':8s} {'shape':12s} {'bits':>4s} {'rows':>12s} "
          f"{'disk MB':>10s} {'ratio':>7s}")
    for c in info["columns"]:
        ratio = f"{c['compression_ratio']:.1f}x" if c["compression_ratio"] else "-"
        print(f"  {c['array']:28s} {c['kind']:8s} {c['dtype']:8s} {str(tuple(c['shape'])):12s} "
              f"{c['bits'] or '':>4} {c['rows']:>12,} {c['disk_bytes'] / 1e6:>10.3f} {ratio:>7s}")


def _frame_memory(c: dict) -> str:
    """What a sampler holds in RAM at most, then the caps that bound it (caps read as needs otherwise)."""
    if c["compressed_cap_bytes"]:
        held = _mb(c["compressed_held_at_most_bytes"])
        tier = (f"compressed frames in RAM: all {held} of them" if c["compressed_held_at_most_bytes"] <
                c["compressed_cap_bytes"] else f"compressed frames in RAM: {held}, as many as the cap allows")
        tier += f" (cap {_mb(c['compressed_cap_bytes'])})"
    else:
        tier = "compressed frames read from the files (no RAM for them)"
    if c["decoded_into_batches"]:
        decoded = "frames decoded straight into batches (a decoded cache would hold too few)"
    else:
        share = "all decoded frames" if c["fraction_of_frames"] >= 1 else \
            f"{c['fraction_of_frames']:.0%} of the decoded frames"
        decoded = (f"decoded cache holds at most {_mb(c['held_at_most_bytes'])}, {share} "
                   f"(cap {_mb(c['capacity_bytes'])})")
    return f"{tier}; {decoded}"


def cmd_verify(args) -> int:
    from mmreplay.settings import Settings
    from mmreplay.store import Store

    with Store.open(args.path, mode="r", settings=Settings(preload=False)) as store:
        problems = store.verify(progress=Progress("verifying", unit="shards"))
    for p in problems:
        print(f"BAD: {p}")
    print("store is intact" if not problems else f"{len(problems)} problem(s) found")
    return 0 if not problems else 1
