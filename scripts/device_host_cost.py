#!/usr/bin/env python
"""CPU ms a batch of the device decode path's host side (issue #38 item 1), on this machine's CPU, decode excluded.

    python scripts/device_host_cost.py STORE [--batches 200] [--batch 256] [--nstep 3]

What runs: ``store.sampler(B, NStep(n), decode="device")`` on CPU tensors, every host step as on CUDA (the draw, the
recording of frame ids, the gather of compressed chunks into the staging buffer with their crc32c, the cut into
pieces, the table and index bookkeeping) with the device's own work replaced by nothing: the stand-in decoder
decodes nothing, and the chain rebuild, the row gather and the copy of stored rows are no-ops (on CUDA those are
kernels; their launch cost is measured on a GPU by ``scripts/cuda_check.py``). The figure is the process's CPU time
(``time.process_time``: every thread) over ``--batches`` batches, after the compressed tier's background pass has
ended, and the share of it spent staging (the store's read, under its lock).

Invariant: prints one line of figures; measures only, changes nothing in the store (opened read-only).
"""

from __future__ import annotations

import argparse
import os
import time

import mmreplay
from mmreplay.device import pipeline


class NothingDecoder:
    """A batched decoder that decodes nothing: the host side of the path is what is left to time."""

    name = "nothing"

    def decode(self, staged, kind, src, dst, out) -> None:
        pass


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("store")
    p.add_argument("--batches", type=int, default=200)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--nstep", type=int, default=3)
    p.add_argument("--device-cache-mb", type=float, default=0.0, help="hold up to this many MB of checked chunks in "
                   "a device tier (Settings.device_cache_bytes, device/resident.py; the CPU stands in for the "
                   "device), warmed until full or every chunk is held, before timing")
    a = p.parse_args()
    pipeline.rebuild_chains = lambda *args, **kw: None  # the device's work, not the host's
    pipeline.gather_rows = lambda table, rows, out=None: out
    pipeline._copy_pieces = lambda *args, **kw: None
    store = mmreplay.Store.open(a.store, mode="r", device_cache_bytes=int(a.device_cache_mb * 1e6))
    draw = mmreplay.NStep(a.nstep, 0.99) if a.nstep > 1 else mmreplay.Uniform()
    smp = store.sampler(a.batch, draw, seed=1, decode="device", name="host-cost")
    smp._device_path.decoder = NothingDecoder()  # instrumentation: the device's decode left out of the timing
    for _ in range(30):
        next(smp)
    while store.inspect.cache_stats()["obs"].get("compressed", {}).get("loading"):
        next(smp)
    while smp.device_tier is not None:  # warm: until the tier is full or a window adds no chunk
        before = smp.device_tier["chunks"]
        for _ in range(50):
            next(smp)
        if smp.device_tier["chunks"] == before:
            break
    read, staging = smp._source.read, [0.0]

    def timed_read(*args, **kw):
        c0 = time.thread_time()
        try:
            return read(*args, **kw)
        finally:
            staging[0] += time.thread_time() - c0

    smp._source.read = timed_read
    c0, w0 = time.process_time(), time.perf_counter()
    for _ in range(a.batches):
        next(smp)
    cpu, wall = time.process_time() - c0, time.perf_counter() - w0
    st = smp._device_draw.pending.staged
    print(f"host side: {1e3 * cpu / a.batches:.2f} ms CPU a batch (staging {1e3 * staging[0] / a.batches:.2f}), "
          f"wall {1e3 * wall / a.batches:.2f} ms; a batch: {st.chunks} chunks, {st.src.shape[0]} pieces, "
          f"{st.nbytes / 1e6:.1f} MB staged, {st.decoded_nbytes / 1e6:.1f} MB decoded; load {os.getloadavg()[0]:.1f}"
          + (f"; device tier {smp.device_tier}" if smp.device_tier is not None else ""))
    smp.close()
    store.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
