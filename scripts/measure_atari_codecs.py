#!/usr/bin/env python
"""Frame codecs for an Atari store (grey 84x84, frame stack 4): bytes a transition on disk and uniform b32/b256 rates.

    nice -n 10 .venv/bin/python scripts/measure_atari_codecs.py --n 1000000 --rounds 3 [--cgroup 2e9] [--json out]

Issues #38/#42: is ``delta-lz4`` (runs of 32 frames, one LZ4 block) a better codec than ``delta-zstd`` (today's
``"auto"`` choice for 10M Atari) for stores that sample from RAM? Each codec (``--codecs``, default
``delta-zstd,delta-lz4,lz4hc``) gets one store of ``--n`` real Atari transitions (the pool of
``scripts/atari_frames.py``, tiled past its 100k; one stream, ``Store.extend`` in blocks), written in a fresh
child. Then ``--rounds`` rounds, each a fresh child per codec in a rotated order (interleaved, so the machine's
load drifts over all codecs alike): the store opened read-only with default settings, warm-up, b32 then b256
windows (``prefetch=0``, uniform), then ``--verify-batches`` batches of 256 whose every row (obs stack,
next stack, action, reward, terminated, truncated) is compared with the pool (``truth``). ``--cgroup BYTES``
adds the same rounds with each child inside a memory cgroup of that size (page cache already held by other
cgroups is not charged to it: the page cache is not dropped on this shared box).

Figures are medians over rounds of each child's median window; ratios are against ``delta-zstd`` in the same
run. Invariant: every rate comes from a fresh child; a wrong row is counted, never skipped; a cgroup made here
is removed whatever happens.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import shutil
import statistics
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [HERE, os.path.dirname(HERE)]

STACK = 4
RAW_FRAME = 84 * 84


# ----------------------------------------------------------------------------------------------
# the ground truth: transition t of the store is pool transition t % P (atari_frames tiles whole pools)
# ----------------------------------------------------------------------------------------------
class Truth:
    def __init__(self):
        import atari_frames

        pool = atari_frames.load_atari_pool(verbose=False)
        self.frames = pool["frames"]
        self.obs_index = np.asarray(pool["obs_index"], np.int64)
        self.next_index = np.asarray(pool["next_obs_index"], np.int64)
        self.action = np.asarray(pool["action"], np.int64)
        self.reward = np.sign(np.asarray(pool["reward"], np.float32))
        self.terminated = np.asarray(pool["terminated"], bool)
        self.truncated = np.asarray(pool["truncated"], bool)
        self.P = len(self.action)
        starts = np.asarray(pool["episode_start"], np.int64)
        self.start = starts[np.searchsorted(starts, np.arange(self.P), side="right") - 1]

    def rows(self, t: np.ndarray) -> dict:
        """Transitions ``t`` as a store with ``stack_padding="first"`` returns them."""
        p = np.asarray(t, np.int64) % self.P
        start = self.start[p][:, None]
        q = np.maximum(p[:, None] + np.arange(-STACK + 1, 1), start)  # obs stack: pool steps, clamped
        nq = np.maximum(p[:, None] + np.arange(-STACK + 2, 2), start)  # next stack: the last is next_obs(p)
        nidx = np.where(nq <= p[:, None], self.obs_index[np.minimum(nq, self.P - 1)], self.next_index[p][:, None])
        return {"obs": self._frames(self.obs_index[q]), "next_obs": self._frames(nidx), "action": self.action[p],
                "reward": self.reward[p], "terminated": self.terminated[p], "truncated": self.truncated[p]}

    def _frames(self, idx: np.ndarray) -> np.ndarray:
        flat = idx.reshape(-1)
        order = np.argsort(flat, kind="stable")  # the memmap read in ascending order
        out = np.empty((flat.size, *self.frames.shape[1:]), np.uint8)
        out[order] = np.asarray(self.frames[flat[order]])
        return out.reshape(*idx.shape, *self.frames.shape[1:])


def wrong_rows(batch, truth: Truth) -> int:
    exp = truth.rows(batch.indices.numpy())
    ok = np.ones(len(exp["action"]), bool)
    for key in ("obs", "next_obs"):
        ok &= (getattr(batch, key).numpy() == exp[key]).reshape(len(ok), -1).all(axis=1)
    ok &= batch.action.numpy().reshape(-1) == exp["action"]
    ok &= batch.reward.numpy().reshape(-1) == exp["reward"]
    ok &= batch.terminated.numpy().reshape(-1).astype(bool) == exp["terminated"]
    ok &= batch.truncated.numpy().reshape(-1).astype(bool) == exp["truncated"]
    return int((~ok).sum())


# ----------------------------------------------------------------------------------------------
# children
# ----------------------------------------------------------------------------------------------
def codec_config(codec: str):
    """``name`` (a named frame codec) or ``name:key=value,...``: the named codec's dict with those integer
    fields replaced (``delta-lz4:run=8``)."""
    from mmreplay.columns.spec import FRAME_CODECS

    name, _, fields = codec.partition(":")
    if name not in FRAME_CODECS:
        raise ValueError(f"codec {codec!r}: {name!r} is not a named frame codec ({sorted(FRAME_CODECS)})")
    if not fields:
        return name
    out = dict(FRAME_CODECS[name])
    for item in fields.split(";"):
        key, eq, value = item.partition("=")
        if not eq or key not in out or not value.isdigit():
            raise ValueError(f"codec {codec!r}: expected key=integer with a key of {sorted(out)}, got {item!r}")
        out[key] = int(value)
    return out


def child_fill(path: str, n: int, codec: str, block: int) -> dict:
    import atari_frames
    from gymnasium import spaces

    import mmreplay

    t0 = time.perf_counter()
    store = mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(18), capacity=n,
                                  frame_stack=STACK, frame_codec=codec_config(codec), reward_values=(-1, 0, 1))
    for part in atari_frames.iter_atari_transitions(n, chunk=block, verbose=False):
        m = len(part["action"])
        store.extend(part["obs"], part["action"], part["reward"], part["next_obs"], part["terminated"],
                     part["truncated"], streams=np.zeros(m, np.int64))
    stored = len(store)
    store.close()

    def size(p):
        return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(p) for f in fs)

    return {"fill_s": time.perf_counter() - t0, "stored": stored, "frames_bytes": size(os.path.join(path, "frames")),
            "store_bytes": size(path), "load": os.getloadavg()[0]}


def child_sample(path: str, windows: int, window_s: float, warmup_s: float, verify_batches: int,
                 cgroup_procs: str | None) -> dict:
    if cgroup_procs:  # join before anything is imported, so the store's default budget sees the limit
        with open(cgroup_procs, "w") as f:
            f.write(str(os.getpid()))
    from benchmarks.measure import CpuMeter, peak_rss_bytes, rate_windows

    import mmreplay

    meter = CpuMeter()
    t0 = time.perf_counter()
    store = mmreplay.Store.open(path, mode="r")
    out = {"open_s": time.perf_counter() - t0, "stored": len(store), "cache_bytes": store.settings.cache_bytes,
           "load_start": os.getloadavg()[0]}
    for bs in (32, 256):
        smp = store.sampler(bs, prefetch=0, seed=bs, name=f"b{bs}")
        rates = rate_windows(smp.__next__, windows, window_s, warmup_s)
        out[f"b{bs}"], out[f"b{bs}_windows"] = statistics.median(rates), rates
        smp.close()
    truth = Truth()
    smp = store.sampler(256, prefetch=0, seed=777, name="verify")
    out["wrong"] = sum(wrong_rows(next(smp), truth) for _ in range(verify_batches))
    out["verified"] = 256 * verify_batches
    smp.close()
    store.close()
    out["peak_rss"] = peak_rss_bytes()
    out.update(meter.result())
    return out


def in_child(fn, *args):
    with mp.get_context("spawn").Pool(1) as pool:
        return pool.apply(fn, args)


# ----------------------------------------------------------------------------------------------
# parent
# ----------------------------------------------------------------------------------------------
def rounds(codecs, paths, args, cgroup_procs, label) -> dict:
    runs = {c: [] for c in codecs}
    for r in range(args.rounds):
        order = codecs[r % len(codecs):] + codecs[:r % len(codecs)]
        for codec in order:
            res = in_child(child_sample, paths[codec], args.windows, args.window_s, args.warmup_s,
                           args.verify_batches, cgroup_procs)
            runs[codec].append(res)
            print(f"[{label} r{r}] {codec}: b32 {res['b32']:.0f}/s b256 {res['b256']:.1f}/s wrong {res['wrong']} "
                  f"load {res['load_start']:.1f} other cores {res['other_cpu_cores']:.2f} "
                  f"peak RSS {res['peak_rss'] / 2**20:.0f} MiB", flush=True)
    return runs


def summary(codecs, fills, runs, n) -> list[dict]:
    rows = []
    for c in codecs:
        rs = runs[c]
        rows.append({"codec": c, "frames_B": fills[c]["frames_bytes"] / n, "store_B": fills[c]["store_bytes"] / n,
                     "b32": statistics.median(r["b32"] for r in rs), "b256": statistics.median(r["b256"] for r in rs),
                     "wrong": sum(r["wrong"] for r in rs), "verified": sum(r["verified"] for r in rs),
                     "fill_s": fills[c]["fill_s"]})
    return rows


def print_table(rows, title, base="delta-zstd") -> None:
    ref = next((r for r in rows if r["codec"] == base), rows[0])
    print(f"\n{title}; ratios vs {ref['codec']}")
    print(f"{'codec':<11} {'store B/tr':>10} {'x bytes':>7} {'b32/s':>7} {'x b32':>6} {'b256/s':>7} {'x b256':>6} "
          f"{'10M GB':>6} {'50M GB':>6} {'wrong':>11} {'fill s':>6}")
    for r in rows:
        print(f"{r['codec']:<11} {r['store_B']:>10.1f} {r['store_B'] / ref['store_B']:>7.2f} {r['b32']:>7.0f} "
              f"{r['b32'] / ref['b32']:>6.2f} {r['b256']:>7.1f} {r['b256'] / ref['b256']:>6.2f} "
              f"{r['store_B'] * 1e7 / 1e9:>6.2f} {r['store_B'] * 5e7 / 1e9:>6.2f} "
              f"{r['wrong']:>3}/{r['verified']:<7} {r['fill_s']:>6.0f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=1_000_000, help="transitions a store (default 1M)")
    parser.add_argument("--codecs", default="delta-zstd,delta-lz4,lz4hc",
                        help="comma-separated: a named frame codec, or name:key=value;... (delta-lz4:run=8)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--windows", type=int, default=5)
    parser.add_argument("--window-s", type=float, default=1.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--verify-batches", type=int, default=8)
    parser.add_argument("--block", type=int, default=4096, help="transitions an extend() while filling")
    parser.add_argument("--cgroup", type=lambda v: int(float(v)), default=0,
                        help="also run the rounds inside a memory cgroup of this many bytes (0: not)")
    parser.add_argument("--dir", default="/tmp/mmreplay_measure_atari_codecs")
    parser.add_argument("--keep", action="store_true", help="keep and reuse the stores (same --n)")
    parser.add_argument("--json", help="also write every figure here")
    args = parser.parse_args()
    codecs = args.codecs.split(",")
    paths = {c: os.path.join(args.dir, f"{c}_{args.n}") for c in codecs}
    print(f"load at start {os.getloadavg()}", flush=True)
    fills = {}
    for c in codecs:
        rec = os.path.join(paths[c], "measure_fill.json")
        if args.keep and os.path.exists(rec):
            with open(rec) as f:
                fills[c] = json.load(f)
        else:
            shutil.rmtree(paths[c], ignore_errors=True)
            fills[c] = in_child(child_fill, paths[c], args.n, c, args.block)
            if fills[c]["stored"] != args.n:
                raise RuntimeError(f"{c}: store holds {fills[c]['stored']} transitions, expected {args.n}")
            with open(rec, "w") as f:
                json.dump(fills[c], f)
        print(f"[fill] {c}: {json.dumps(fills[c])}", flush=True)
    out = {"n": args.n, "fills": fills, "runs": {}, "summary": {}}
    modes = [("ram", None)]
    cg = None
    try:
        if args.cgroup:
            from benchmarks.cgroup import make_memory_cgroup

            cg = make_memory_cgroup(args.cgroup, f"mmreplay_codecs_{os.getpid()}")
            modes.append((f"cgroup {args.cgroup / 1e9:g} GB", cg["procs"]))
        for label, procs in modes:
            out["runs"][label] = rounds(codecs, paths, args, procs, label)
            out["summary"][label] = summary(codecs, fills, out["runs"][label], args.n)
    finally:
        if cg is not None:
            from benchmarks.cgroup import remove_cgroup

            remove_cgroup(cg)
    for label, rows in out["summary"].items():
        print_table(rows, f"{label}: {args.n:,} Atari transitions (84x84 grey, stack 4), {args.rounds} rounds, "
                          f"raw frame {RAW_FRAME} B")
    print(f"load at end {os.getloadavg()}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    if not args.keep:
        for p in paths.values():
            shutil.rmtree(p, ignore_errors=True)
    wrong = sum(r["wrong"] for rows in out["summary"].values() for r in rows)
    return 0 if wrong == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
