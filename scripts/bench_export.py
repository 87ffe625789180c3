#!/usr/bin/env python
"""Export size and time against the store's size, per format and compression.

Two stores: an image store (the real Atari fixture's Pong and Breakout frames, 84x84 gray, frame_stack 4,
clipped rewards; replayed ``--repeat`` times so the files are not dominated by fixed overheads) and a
low-dim store (CartPole-v1, uniform random policy, ``--lowdim-steps`` steps). Each is exported to Minari
(HDF5 with gzip / lzf / none, and arrow), D4RL-style HDF5 and d3rlpy HDF5; the table prints bytes on disk,
the ratio to the store's bytes and the export time.

    python scripts/bench_export.py [--repeat 8] [--lowdim-steps 20000]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import tempfile
import time

import numpy as np
from gymnasium import spaces

import mmreplay
from mmreplay.cli.quickbench import atari_fixture, fill
from mmreplay.datasets import export_dataset


def dir_bytes(path: str) -> int:
    if os.path.isfile(path):
        return os.path.getsize(path)
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def image_store(path: str, repeat: int) -> None:
    """The packaged Atari fixture (the same file as tests/data/atari_fixture.npz) added ``repeat`` times."""
    fx = atari_fixture()
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=None,
                               frame_stack=4, reward_values=(-1, 0, 1)) as store:
        fill(store, fx, repeat * len(fx["action"]))


def lowdim_store(path: str, steps: int) -> None:
    import gymnasium as gym

    from mmreplay.integrations.gymnasium import RecordToStore, create_store_for

    env = gym.make("CartPole-v1")
    with create_store_for(env, path, capacity=None) as store:
        rec = RecordToStore(env, store)
        rec.action_space.seed(0)
        rec.reset(seed=0)
        for t in range(steps):
            _, _, term, trunc, _ = rec.step(rec.action_space.sample())
            if (term or trunc) and t < steps - 1:
                rec.reset()
            elif t == steps - 1 and not (term or trunc):
                while not (term or trunc):  # finish the last episode so every step is exported
                    _, _, term, trunc, _ = rec.step(rec.action_space.sample())


CASES = [("minari", {"compression": "gzip"}), ("minari", {"compression": "lzf"}), ("minari", {"compression": "none"}),
         ("minari", {"data_format": "arrow"}), ("d4rl", {"compression": "gzip"}), ("d4rl", {"compression": "none"}),
         ("d3rlpy", {"compression": "gzip"})]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=8, help="times the Atari fixture is replayed (635 steps each)")
    parser.add_argument("--lowdim-steps", type=int, default=20_000)
    args = parser.parse_args(argv)
    root = tempfile.mkdtemp(prefix="mmreplay-bench-export-")
    try:
        for kind, build in (("image", lambda p: image_store(p, args.repeat)),
                            ("lowdim", lambda p: lowdim_store(p, args.lowdim_steps))):
            path = os.path.join(root, kind)
            build(path)
            with mmreplay.Store.open(path, mode="r") as store:
                size, n = dir_bytes(path), len(store)
                print(f"\n{kind} store: {n:,} transitions, {size / 1e6:.2f} MB on disk")
                print(f"  {'format':28s} {'MB':>9s} {'x store':>8s} {'seconds':>8s}")
                for i, (fmt, kw) in enumerate(CASES):
                    out = os.path.join(root, f"{kind}-{i}-v0" if fmt == "minari" else f"{kind}-{i}.h5")
                    t0 = time.perf_counter()
                    export_dataset(store, out, fmt, **kw)
                    dt = time.perf_counter() - t0
                    b = dir_bytes(out)
                    label = f"{fmt} {' '.join(f'{v}' for v in kw.values())}"
                    print(f"  {label:28s} {b / 1e6:9.2f} {b / size:8.1f} {dt:8.2f}")
                    sys.stdout.flush()
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
