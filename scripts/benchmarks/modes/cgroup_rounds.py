"""What the workloads that sample a store inside a memory cgroup against a peer in RAM share (``ltr_big``'s
atari10m and dmc, ``dreamer``): the store child's opening and closing steps, the interleaved rounds of fresh
children, the peer's faster allocator setting, and the report's number format and target rows.

Invariant: ``interleaved_rounds`` removes the cgroup it made whatever happens, and runs each round's children
in the order peer (tuned malloc), peer (glibc's defaults), then the round's store children; ``open_cold`` drops
the page cache before it opens the store; ``close_store`` records the peak RSS before the verification (which
loads its ground truth) and after it, and the cgroup's counters last, then closes the store.
"""
from __future__ import annotations

import os
import time
from collections.abc import Callable

from ..cgroup import make_memory_cgroup, read_cgroup_stats, remove_cgroup
from ..measure import drop_caches, peak_rss_bytes


def open_cold(path: str, **session):
    """(store, result so far, open time): the page cache dropped, then ``Store.open`` read-only."""
    import mmreplay
    res = {"page_cache_dropped": drop_caches()}
    t0 = time.perf_counter()
    store = mmreplay.Store.open(path, mode="r", **session)
    res["open_s"] = time.perf_counter() - t0
    res["stored"] = len(store)
    return store, res, t0


def wait_background_pass(store, draw: Callable[[], object], t_end: float) -> None:
    """Sample (``draw``) until the compressed tier's background pass has ended, or ``t_end``."""
    while store.inspect.cache_stats()["obs"].get("compressed", {}).get("loading") and time.perf_counter() < t_end:
        draw()


def close_store(store, res: dict, spec: dict, verify: Callable[[], dict],
                after_peak: Callable[[], None] | None = None) -> dict:
    """The cache's figures, the peak RSS while sampling, the verification's counts (``verify``), the peak RSS
    with it, ``after_peak()`` (figures that would raise the peak), the cgroup's counters (when the child ran in
    one); then the store closed. Returns ``res``."""
    res["cache_stats"] = store.inspect.cache_stats()
    res["peak_rss_sampling"] = peak_rss_bytes()  # before the verification loads its ground truth
    res.update(verify())
    res["peak_rss"] = peak_rss_bytes()
    if after_peak is not None:
        after_peak()
    if spec.get("cgroup_dir"):
        res["cgroup"] = read_cgroup_stats(spec["cgroup_dir"])
    store.close()
    return res


def interleaved_rounds(runner, repeats: int, limit: int, cgroup_name: str, peer: dict, peer_label: str,
                       store_round: Callable[[str, int], dict], timeout: float) -> dict:
    """``repeats`` rounds of fresh children inside one memory cgroup of ``limit`` bytes: the peer (``peer``, its
    child spec) with a raised mmap threshold (``runs["peer"]``) and with glibc's defaults
    (``runs["peer_default_malloc"]``), then ``store_round(cgroup, round)``, which runs the round's store children
    and returns them by kind (appended to ``runs``)."""
    runs: dict[str, list] = {"peer": [], "peer_default_malloc": []}
    cg = make_memory_cgroup(limit, f"{cgroup_name}_{os.getpid()}")
    try:
        for rnd in range(repeats):
            for tune in (True, False):  # the peer's reference: the faster of its two allocator settings
                runs["peer" if tune else "peer_default_malloc"].append(runner.child(
                    {**peer, "tune_malloc": tune}, timeout=timeout,
                    label=f"{peer_label} r{rnd} ({'tuned' if tune else 'default'} malloc)"))
            for kind, result in store_round(cg, rnd).items():
                runs.setdefault(kind, []).append(result)
    finally:
        remove_cgroup(cg)
    return runs


def faster_allocator(summary: dict, keys: tuple[str, ...], companions: dict[str, str] | None = None) -> dict:
    """Fold ``summary["peer_default_malloc"]`` into ``summary["peer"]``: per rate in ``keys`` the faster of the two
    settings, both kept under ``by_allocator``; each ``companions`` key (e.g. CPU ms a batch) taken from the setting
    whose rate (its value in ``companions``) counts. Returns the peer's summary."""
    other, peer = summary.pop("peer_default_malloc"), summary["peer"]
    peer["by_allocator"] = {}
    for k in keys:
        peer["by_allocator"][k] = {"tuned": peer[k], "default": other[k]}
        vals = [v for v in (peer[k], other[k]) if v is not None]
        peer[k] = max(vals) if vals else None
    for k, rate in (companions or {}).items():
        both = peer["by_allocator"][rate]
        if both["tuned"] is None or (both["default"] is not None and both["default"] > both["tuned"]):
            peer[k] = other[k]
    return peer


class CpuMeter:
    """``fn`` counted: CPU time of this process (all its threads: prefetch, codec helpers) a call, over the calls
    made through the meter since it was made (robust to a loaded machine, where rates swing with the share of the
    cores a child gets)."""

    def __init__(self, fn: Callable[[], object]):
        self.fn, self.calls, self.c0 = fn, 0, time.process_time()

    def __call__(self):
        self.calls += 1
        return self.fn()

    def ms_a_call(self) -> float | None:
        return (time.process_time() - self.c0) / self.calls * 1e3 if self.calls else None


def fmt(v: float | None, k: float = 1.0) -> str:
    """A figure for the report: ``v / k``, no decimals from 100 up, one below; ``-`` when missing."""
    return "-" if v is None else f"{v / k:,.0f}" if v / k >= 100 else f"{v / k:,.1f}"


def target_lines(rows: list[tuple[str, float | None, float, bool]]) -> list[str]:
    """The report's targets table: (name, value, threshold, lower-is-better) rows, each PASS, FAIL or ``-``."""
    lines = ["", "| target | measured | wanted | |", "|---|---|---|---|"]
    for name, v, t, le in rows:
        ok = None if v is None else (v <= t if le else v >= t)
        lines.append(f"| {name} | {'-' if v is None else f'{v:,.2f}'} | {'<=' if le else '>='} {t} | "
                     f"{'-' if ok is None else ('PASS' if ok else 'FAIL')} |")
    return lines
