"""What the benchmarks measure, in any process: rates over timed windows, RSS, block-device reads, bytes on
disk, the CPU other processes take (the noise on a shared box), and the allocator setting every child uses.

Invariant: no function here imports mmreplay or a peer library, so a measurement never perturbs what it
measures beyond reading ``/proc``; every figure is for the calling process only.
"""
from __future__ import annotations

import os
import sys
import time


def tune_malloc(threshold=1 << 30):
    """glibc only: raise M_MMAP_THRESHOLD and M_TRIM_THRESHOLD so that large,
    short-lived sample batches (a 256 x 4x84x84 uint8 batch is 7 MB) are reused
    from the heap instead of being mmap'ed/trimmed and page-faulted afresh on
    every call.  Out of the box, glibc's dynamic threshold handles ONE such
    array per call but not two (obs + next_obs), which halves batch-256 Atari
    sampling rates for every peer.  Same effect as the environment variables
    MALLOC_MMAP_THRESHOLD_ / MALLOC_TRIM_THRESHOLD_.  Returns True on success."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
        return bool(libc.mallopt(M_MMAP_THRESHOLD, int(threshold))) and bool(
            libc.mallopt(M_TRIM_THRESHOLD, int(threshold)))
    except (OSError, AttributeError):
        return False


def peak_rss_bytes() -> int:
    """This process's peak RSS. VmHWM, not ``getrusage``: ``ru_maxrss`` survives ``execve``, so a child would
    report its parent's peak when that was larger (the runner's, after it wrote a big input)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def cur_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def io_read_bytes() -> int | None:
    """Bytes this process made the kernel read from block devices (page-cache misses)."""
    try:
        with open("/proc/self/io") as f:
            for line in f:
                if line.startswith("read_bytes:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return None


def dir_bytes(path: str) -> int:
    """Allocated bytes (st_blocks) of every file under ``path``."""
    tot = 0
    for root, _, files in os.walk(path):
        for f in files:
            try:
                tot += os.stat(os.path.join(root, f)).st_blocks * 512
            except OSError:
                pass
    return tot


def drop_caches() -> bool:
    """sync + drop the page cache (root only). Returns whether it was dropped."""
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
        return True
    except OSError:
        return False


def rate_windows(fn, n_windows: int, window_s: float, warmup_s: float) -> list[float]:
    """Calls/s of ``fn`` in ``n_windows`` windows of >= ``window_s`` seconds after ``warmup_s`` of calls."""
    t_end = time.perf_counter() + warmup_s
    fn()
    while time.perf_counter() < t_end:
        fn()
    rates = []
    for _ in range(n_windows):
        k, t0 = 0, time.perf_counter()
        while True:
            fn()
            k += 1
            dt = time.perf_counter() - t0
            if dt >= window_s:
                break
        rates.append(k / dt)
    return rates


def time_adds(add, columns, steps: int) -> float:
    """Seconds spent in ``add(obs[i], action[i], reward[i], next_obs[i], terminated[i], truncated[i])`` for
    ``i < steps``, ``columns`` being those six sequences: only the calls are timed, not the input preparation."""
    o, a, r, no, te, tr = columns
    t0 = time.perf_counter()
    for i in range(steps):
        add(o[i], a[i], r[i], no[i], te[i], tr[i])
    return time.perf_counter() - t0


class CpuMeter:
    """How many cores OTHER processes kept busy while we ran (from /proc/stat minus our own CPU time):
    the noise indicator printed next to each result (the machine is shared)."""

    def __init__(self):
        self.t0, self.busy0, self.own0 = time.perf_counter(), self._busy(), self._own()

    @staticmethod
    def _busy() -> int:
        try:
            with open("/proc/stat") as f:
                v = [int(x) for x in f.readline().split()[1:]]
            return v[0] + v[1] + v[2] + v[5] + v[6] + (v[7] if len(v) > 7 else 0)  # not idle, not iowait
        except (OSError, ValueError, IndexError):
            return 0

    @staticmethod
    def _own() -> int:
        try:
            with open("/proc/self/stat") as f:
                v = f.read().rsplit(")", 1)[1].split()
            return int(v[11]) + int(v[12])  # utime + stime, all threads
        except (OSError, ValueError, IndexError):
            return 0

    def result(self) -> dict:
        wall = time.perf_counter() - self.t0
        tck = os.sysconf("SC_CLK_TCK")
        own = (self._own() - self.own0) / tck
        others = max(0.0, (self._busy() - self.busy0) / tck - own)
        return {"own_cpu_cores": own / wall if wall else 0.0, "other_cpu_cores": others / wall if wall else 0.0,
                "loadavg_end": os.getloadavg()[0]}


def log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def child_setup(tune: bool = True):
    """Every child's first step: the allocator setting (``tune=False``: glibc's defaults, as users run) and
    torch's thread count (left at its default)."""
    tuned = tune_malloc() if tune else False
    import torch
    return tuned, torch.get_num_threads()
