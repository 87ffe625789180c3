"""The device's own limit: random reads per second from a store's own shard files, at queue depth 1 and 32
(threads, each one ``preadv`` in flight), so the store's disk path can be judged against what the disk can do:
4 KiB reads, and reads of the store's own mean read size (issue #38 judges the forced-to-disk path by bytes/s
against the device's at that size, depth 32, probed in the same run), rounded up to the device's direct-I/O
unit (its logical block, 512 B here: 9.2 KiB is read as 9.5 KiB, not 12).

Invariant: no read is served from the page cache: the files are opened ``O_DIRECT`` where the filesystem
allows (aligned buffers and offsets), otherwise the page cache is dropped first and every file is
``posix_fadvise(DONTNEED)``-ed before each depth (then ``"direct": False`` says that repeats may hit).
"""
from __future__ import annotations

import glob
import mmap
import os
import threading
import time

import numpy as np

from .measure import drop_caches

BLOCK = 4096
SECTOR = 512  # the smallest logical block a device has: direct reads of it work where the device allows


def shard_files(store_path: str, column: str = "obs") -> list[str]:
    files = [f for f in glob.glob(os.path.join(store_path, "frames", column, "c", "**"), recursive=True)
             if os.path.isfile(f) and os.path.getsize(f) >= BLOCK]
    if not files:
        raise FileNotFoundError(f"no shard files of at least {BLOCK} bytes under {store_path!r}/frames/{column}/c")
    return sorted(files)


def _open_all(files: list[str]) -> tuple[list[int], bool]:
    """File descriptors of ``files`` and whether they bypass the page cache (``O_DIRECT``)."""
    direct = getattr(os, "O_DIRECT", 0)
    fds: list[int] = []
    if direct:
        try:
            fds = [os.open(f, os.O_RDONLY | direct) for f in files]
            os.preadv(fds[0], [mmap.mmap(-1, BLOCK)], 0)  # open() may accept O_DIRECT that reads refuse
            return fds, True
        except OSError:
            for fd in fds:
                os.close(fd)
    return [os.open(f, os.O_RDONLY) for f in files], False


def aligned_size(nbytes: float, unit: int = BLOCK) -> int:
    """``nbytes`` rounded up to whole ``unit``s (at least one)."""
    return max(1, -(-int(np.ceil(nbytes)) // unit)) * unit


def direct_unit(fd: int) -> int:
    """The size and alignment ``O_DIRECT`` reads of ``fd`` need: a sector where the device's logical block is
    512 B, else 4 KiB."""
    try:
        os.preadv(fd, [mmap.mmap(-1, BLOCK)], SECTOR)  # 4 KiB at a sector's offset: refused unless 512 B works
        return SECTOR
    except OSError:
        return BLOCK


def random_reads(files: list[str], depth: int, seconds: float, seed: int = 0, read_bytes: float = BLOCK) -> dict:
    """Reads/s and bytes/s of ``depth`` threads each reading ``read_bytes`` (rounded up to the direct-I/O unit)
    at random offsets (multiples of that unit; of 4 KiB for whole 4 KiB blocks) for ``seconds``."""
    if not read_bytes > 0:
        raise ValueError(f"read_bytes {read_bytes}: expected a positive size")
    fds, direct = _open_all(files)
    try:
        if not direct:
            drop_caches()
            for fd in fds:
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        unit = direct_unit(fds[0]) if direct else SECTOR
        read_bytes = aligned_size(read_bytes, unit)
        unit = BLOCK if read_bytes % BLOCK == 0 else unit  # whole blocks at block offsets, as 4 KiB probes always were
        # start units a whole read fits after (files shorter than a read are never picked)
        blocks = np.array([max(0, (os.fstat(fd).st_size - read_bytes) // unit + 1) for fd in fds], np.int64)
        if not blocks.sum():
            raise ValueError(f"no shard file holds a read of {read_bytes} bytes")
        cum = np.cumsum(blocks)
        counts = [0] * depth
        stop = threading.Event()

        def reader(k: int) -> None:
            rng = np.random.default_rng(seed * 1000 + k)
            buf = mmap.mmap(-1, read_bytes)  # page aligned, as O_DIRECT needs
            picks = rng.integers(0, int(cum[-1]), 1 << 16)
            j = 0
            while not stop.is_set():
                g = int(picks[j & 0xFFFF])
                f = int(np.searchsorted(cum, g, side="right"))
                blk = g - (int(cum[f - 1]) if f else 0)
                os.preadv(fds[f], [buf], blk * unit)
                counts[k] += 1
                j += 1

        threads = [threading.Thread(target=reader, args=(k,), daemon=True) for k in range(depth)]
        t0 = time.perf_counter()
        for t in threads:
            t.start()
        time.sleep(seconds)
        stop.set()
        for t in threads:
            t.join()
        dt = time.perf_counter() - t0
    finally:
        for fd in fds:
            os.close(fd)
    return {"depth": depth, "reads": sum(counts), "reads_per_s": sum(counts) / dt,
            "bytes_per_s": sum(counts) * read_bytes / dt, "read_bytes": read_bytes, "direct": direct}


def task_device_reads(spec: dict) -> dict:
    """Child task: 4 KiB reads at depth 1 and 32 (``spec["depths"]``) on the store's frame shards,
    ``spec["seconds"]`` each; with ``spec["read_bytes"]`` (the store's mean read), reads of that size (rounded up
    to the direct-I/O unit) at depth 32 as well (``sized_*``)."""
    files = shard_files(spec["path"])
    res = {"files": len(files), "bytes": int(sum(os.path.getsize(f) for f in files))}
    for depth in spec.get("depths", (1, 32)):
        r = random_reads(files, depth, spec["seconds"])
        res[f"qd{depth}_reads_per_s"] = r["reads_per_s"]
        res["direct"] = r["direct"]
    if spec.get("read_bytes"):
        r = random_reads(files, 32, spec["seconds"], read_bytes=spec["read_bytes"])
        res.update(sized_read_bytes=r["read_bytes"], sized_qd32_reads_per_s=r["reads_per_s"],
                   sized_qd32_bytes_per_s=r["bytes_per_s"])
    return res
