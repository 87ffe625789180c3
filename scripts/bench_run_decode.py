#!/usr/bin/env python
"""CPU a sample of decoding temporal runs, the bound of 10M Atari and 1M DMC sampling (issue #38 item 5).

    python scripts/bench_run_decode.py kernels [--atari] [--dmc 12,16,3,0 12,16,3,3 ...]
    python scripts/bench_run_decode.py store --old 8d293fe [--n 200000] [--rounds 3]

``kernels``: the compiled decode alone (``_native/run_decode.decode_frame_groups``, one thread, CPU time),
on real frames coded in memory: Atari (``--atari-pool``, built by ``scripts/atari_frames.py``) as ``delta-zstd`` runs of 8
(layout 1), each sample a stack of 4 and its next frame; DMC (``scripts/dmc_frames.py``'s pool) as layout-3
runs given as ``level,run,layout,lz4_depth``, each sample 6 consecutive frames (stack 3 + n-step 3). Prints
bytes a frame, ms a batch-256 and us a sample; the last batch is checked against the frames.

``store``: a ``delta-zstd`` Atari store of ``--n`` real transitions (built once in ``--workdir``), opened by
two versions of mmreplay in turn (``--old`` is ``git archive``d as ``bench_ab.py`` does; the new one is this
checkout) with a 256 MiB budget, so that runs decode straight into batches as at 10M; each round times
uniform b32 and b256 (CPU ms a batch: every thread of the child) and digests 10 seeded batches, which must
be equal between the versions.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)


def coded_runs(frames, encode, run):
    """``frames`` cut into runs, each coded and followed by its crc32c as a store's chunk: (buffer, offsets, sizes)."""
    import google_crc32c
    import numpy as np
    chunks = []
    for s in range(0, frames.shape[0] - frames.shape[0] % run, run):
        b = encode(np.ascontiguousarray(frames[s:s + run]))
        chunks.append(b + google_crc32c.value(b).to_bytes(4, "little"))
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    return np.frombuffer(b"".join(chunks), np.uint8).copy(), np.concatenate([[0], np.cumsum(sizes)]), sizes


def time_windows(frames, coded, run, offsets_in_window, B=256, batches=60, warmup=5):
    """CPU seconds a batch of ``B`` windows (frame ``t + offsets_in_window``) decoded with ``decode_frame_groups``."""
    import numpy as np
    from mmreplay._native.run_decode import decode_frame_groups, group_frame_requests
    buf, offs, sizes = coded
    fb = frames[0].nbytes
    nf = sizes.size * run
    w = np.asarray(offsets_in_window)
    out = np.empty((B * w.size, fb), np.uint8)
    rng = np.random.default_rng(0)
    t0 = 0.0
    for it in range(batches + warmup):
        if it == warmup:
            t0 = time.process_time()
        t = rng.integers(-w.min(), nf - w.max(), B)
        ids = (t[:, None] + w[None, :]).reshape(-1).astype(np.int64)
        dsts = out.ctypes.data + np.arange(ids.size, dtype=np.int64) * fb
        chunks, starts, js, d2, _ = group_frame_requests(ids, dsts, 0, run)
        status = np.empty(chunks.size, np.int8)
        bad = decode_frame_groups(buf.ctypes.data + offs[chunks], sizes[chunks], starts, js, d2, fb, run, status)
        if bad:
            raise RuntimeError(f"{bad} runs failed to decode: statuses {sorted(set(status.tolist()))}")
    cpu = (time.process_time() - t0) / batches
    if not np.array_equal(out, frames.reshape(frames.shape[0], -1)[ids]):
        raise AssertionError("decoded frames differ from the frames coded")
    return cpu


def kernels(args) -> None:
    import numpy as np
    sys.path.insert(0, REPO)
    from mmreplay.codecs import temporal
    if args.atari:
        frames = np.ascontiguousarray(np.load(os.path.join(args.atari_pool, "frames.npy"), mmap_mode="r")[:40_000])
        coded = coded_runs(frames, lambda c: temporal.encode(c, 3, 8, 1), 8)
        cpu = time_windows(frames, coded, 8, np.arange(-3, 2))
        print(f"atari delta-zstd (layout 1, run 8): {coded[0].nbytes / (coded[2].size * 8):.1f} B a frame, "
              f"{cpu * 1e3:.2f} ms a batch-256, {cpu / 256 * 1e6:.1f} us a sample", flush=True)
    if args.dmc:
        pool = np.load(os.path.join(args.dmc_pool, "frames.npy"))
        per = pool.shape[0] // 4  # four tasks' streams, each cycled from two starts
        stream = np.concatenate([pool[t * per:(t + 1) * per][np.r_[o:per, 0:o]] for o in (0, per // 5)
                                 for t in range(4)])
        for item in args.dmc:
            level, run, layout, depth = map(int, item.split(","))
            coded = coded_runs(stream, lambda c: temporal.encode(c, level, 8, layout, depth), run)
            cpu = time_windows(stream, coded, run, np.arange(-2, 4))
            raw = coded[2].size * run * stream[0].nbytes
            print(f"dmc level {level} run {run} layout {layout} lz4_depth {depth}: {raw / coded[0].nbytes:.2f}x "
                  f"smaller than raw, {cpu * 1e3:.2f} ms a batch-256, {cpu / 256 * 1e6:.1f} us a sample", flush=True)


# -- store: two versions on one delta-zstd Atari store -------------------------------------------------
def child(spec: dict) -> dict:
    sys.path.insert(0, spec["src"])
    sys.path.insert(1, HERE)
    import numpy as np
    import mmreplay as mm
    assert mm.__file__.startswith(spec["src"]), (mm.__file__, spec["src"])
    path, out = spec["path"], {}
    if not os.path.exists(os.path.join(path, ".built")):
        from gymnasium import spaces
        from benchmarks.sources import ATARI_ACTIONS, add_atari_transitions
        store = mm.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(ATARI_ACTIONS),
                                capacity=spec["n"], frame_stack=4, reward_values=(-1, 0, 1), frame_codec="delta-zstd")
        add_atari_transitions(store, spec["n"])
        store.close()
        open(os.path.join(path, ".built"), "w").close()
    with mm.Store.open(path, mode="r", cache_bytes=256 << 20) as store:
        t0 = time.time()
        while any(c["compressed"]["loading"] for c in store.inspect.cache_stats().values()) and time.time() - t0 < 120:
            time.sleep(0.05)
        for B in (32, 256):
            smp = store.sampler(B, None, seed=1, prefetch=0, name=f"b{B}")
            h = hashlib.sha256()
            for _ in range(10):
                b = smp.sample()
                for t in (b.indices, b.obs, b.next_obs, b.reward):
                    h.update(t.numpy().tobytes())
            out[f"b{B} digest"] = h.hexdigest()
            n, c0, w0 = 0, time.process_time(), time.time()
            while time.time() - w0 < spec["seconds"]:
                smp.sample()
                n += 1
            out[f"b{B} cpu_ms"] = (time.process_time() - c0) * 1e3 / n
            smp.close()
    return out


def store_ab(args) -> None:
    import statistics
    sys.path.insert(0, HERE)
    from bench_ab import source
    os.makedirs(args.workdir, exist_ok=True)
    srcs = {"old": source(args.old, args.workdir), "new": REPO}
    path = os.path.join(args.workdir, f"atari_delta_zstd_{args.n}")
    res = {"old": [], "new": []}
    for r in range(args.rounds):
        for v in (("old", "new") if r % 2 == 0 else ("new", "old")):
            spec = {"src": srcs[v], "path": path, "n": args.n, "seconds": args.seconds}
            env = dict(os.environ, PYTHONPATH=srcs[v])
            got = subprocess.run([sys.executable, os.path.abspath(__file__), "child", json.dumps(spec)], env=env,
                                 check=True, capture_output=True, text=True, cwd=HERE).stdout.strip().splitlines()[-1]
            res[v].append(json.loads(got))
            print(f"[store] round {r + 1} {v}: " + ", ".join(f"{k} {v2:.3f}" for k, v2 in res[v][-1].items()
                                                             if k.endswith("cpu_ms")), flush=True)
    print(f"load average {os.getloadavg()[0]:.1f}")
    for B in (32, 256):
        o = statistics.median(x[f"b{B} cpu_ms"] for x in res["old"])
        n = statistics.median(x[f"b{B} cpu_ms"] for x in res["new"])
        same = len({x[f"b{B} digest"] for x in res["old"] + res["new"]}) == 1
        print(f"uniform b{B}: CPU ms a batch old {o:.3f} / new {n:.3f} ({n / o:.2f}x), same seeded rows: {same}")


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "child":
        print(json.dumps(child(json.loads(sys.argv[2]))))
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("kernels")
    k.add_argument("--atari", action="store_true")
    k.add_argument("--atari-pool", default="/tmp/mmreplay_atari_pool")
    k.add_argument("--dmc", nargs="*", default=[], metavar="LEVEL,RUN,LAYOUT,LZ4_DEPTH")
    k.add_argument("--dmc-pool", default="/tmp/mmreplay_dmc_pool")
    s = sub.add_parser("store")
    s.add_argument("--old", required=True)
    s.add_argument("--n", type=int, default=200_000)
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--seconds", type=float, default=4.0)
    s.add_argument("--workdir", default="/tmp/mmreplay_ab")
    args = p.parse_args()
    kernels(args) if args.cmd == "kernels" else store_ab(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
