"""``mmreplay bench``: a one-minute look at this machine's add and sample rates on real Atari frames, next
to the figures ``scripts/bench.py`` measured for mmreplay and its peers (``docs/performance.md``).

Invariant: the data is real — the Pong and Breakout transitions of the packaged fixture
(``mmreplay/data/atari_fixture.npz``, the same file as ``tests/data/atari_fixture.npz``: 635 transitions,
640 distinct 84x84 gray frames, DQN preprocessing), replayed in order until ``n`` transitions, so frames
compress and episodes end as in a real run. Only mmreplay runs here; the peers' figures are quoted from
the reference run, labelled as such, never presented as measured on this machine.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from importlib import resources
from typing import TYPE_CHECKING

import numpy as np

from mmreplay.cli.progress import Progress

if TYPE_CHECKING:
    from mmreplay.store import Store

#: ``scripts/bench.py`` at git 8a5007c on the 2-core dev VM (docs/performance.md): 100k real Atari
#: transitions, frame stack 4, obs + next_obs as torch tensors, 1 GiB cache, warm; the peers' rates are
#: mmreplay's divided by the ratios in that page's table
REFERENCE = {
    "where": "scripts/bench.py, 100k real Atari transitions, 2-core VM, 1 GiB cache (docs/performance.md)",
    "add_per_s": {"mmreplay": 55_794},
    "bytes_per_transition": {"mmreplay": 476},
    "batch32_per_s": {"mmreplay": 4_361, "numpy ring in RAM": 4_956, "SB3 ReplayBuffer": 2_643, "cpprb": 4_234,
                      "TorchRL LazyMemmap": 1_363},
    "batch256_per_s": {"mmreplay": 1_036, "numpy ring in RAM": 686, "SB3 ReplayBuffer": 433, "cpprb": 632,
                       "TorchRL LazyMemmap": 207},
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="add/sample rates on real Atari frames, next to the reference run of "
                                     "mmreplay and its peers (scripts/bench.py)")
    p.add_argument("--n", type=int, default=20_000, help="transitions (the packaged real Atari fixture, replayed)")
    p.set_defaults(func=cmd_bench)


def cmd_bench(args) -> int:
    if args.n < 256:
        raise ValueError(f"--n {args.n}: expected at least 256 transitions (the largest batch sampled)")
    progress = Progress("adding", unit="transitions")
    try:
        run(n=args.n, batch_sizes=(32, 256), progress=progress)
    finally:
        progress.close()
    return 0


def atari_fixture() -> dict[str, np.ndarray]:
    """The packaged real Atari fixture (plain arrays, loaded without pickle)."""
    with resources.files("mmreplay.data").joinpath("atari_fixture.npz").open("rb") as f:
        with np.load(f, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}


def fill(store: Store, fx: dict, n: int, progress=None) -> None:
    """Add ``n`` transitions: the fixture's, in order, again and again (clipped rewards, as DQN stores them)."""
    frames, m = fx["frames"], len(fx["action"])
    reward = np.sign(fx["reward"]).astype(np.float32)
    for i in range(n):
        t = i % m
        store.add(frames[fx["obs_index"][t]], int(fx["action"][t]), float(reward[t]), frames[fx["next_obs_index"][t]],
                  bool(fx["terminated"][t]), bool(fx["truncated"][t]))
        if progress and (i + 1) % 1000 == 0 or progress and i + 1 == n:
            progress(i + 1, n)


def run(n: int = 20_000, batch_sizes=(32, 256), seconds: float = 2.0, progress=None, out=print) -> dict:
    """Fill a temporary store with ``n`` fixture transitions, sample it warm, print and return the rates."""
    from gymnasium import spaces

    from mmreplay.store import Store

    fx = atari_fixture()
    root = tempfile.mkdtemp(prefix="mmreplay-bench-")
    path = os.path.join(root, "store")
    try:
        store = Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=n,
                             frame_stack=4, reward_values=(-1, 0, 1))
        t0 = time.perf_counter()
        fill(store, fx, n, progress)
        store.close()
        add_rate = n / (time.perf_counter() - t0)
        disk = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)
        out(f"data: {n:,} real Atari transitions (Pong, Breakout; the packaged fixture's 635 replayed), stack 4")
        out(f"reference: {REFERENCE['where']}; peers are not run here (scripts/bench.py runs them)")
        out(f"this machine: {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.1f} (other processes "
            "competing for the CPUs slow every figure below)")
        out(f"add: {add_rate:,.0f} transitions/s, create and close included (reference mmreplay "
            f"{REFERENCE['add_per_s']['mmreplay']:,}/s over 100k), "
            f"{disk / n:.0f} bytes/transition on disk (reference {REFERENCE['bytes_per_transition']['mmreplay']})")
        result = {"n": n, "add_per_s": add_rate, "disk_bytes_per_transition": disk / n, "reference": REFERENCE}
        with Store.open(path, mode="r", cache_bytes=n * 84 * 84 * 2) as store:
            for b in batch_sizes:
                with store.sampler(b, seed=0) as sampler:
                    for _ in range(20):
                        next(sampler)
                    count, t0 = 0, time.perf_counter()
                    while time.perf_counter() - t0 < seconds:
                        next(sampler)
                        count += 1
                rate = count / (time.perf_counter() - t0)
                ref = REFERENCE.get(f"batch{b}_per_s")
                out(f"sample: batch {b}: {rate:,.0f} batches/s (obs + next_obs stacks, warm cache)")
                if ref:
                    out("  reference: " + ", ".join(f"{k} {v:,}/s" for k, v in ref.items()))
                result[f"batch{b}_per_s"] = rate
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)
