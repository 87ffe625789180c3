"""Compile (or load from numba's cache) the kernels that the suite's stores use, once, before the test
workers start: ``python tests/warm_kernels.py``, run by ``conftest.pytest_configure`` in pytest-xdist's
controller.

Why: on a fresh checkout numba's cache is empty, and every worker, and every child process a test starts
before the cache is written, would compile the same kernels again, each on a core the other tests need
(a cold suite took 765 s against 429 s warm on the 2-core box). Compiled here once, they are read from the
cache by every later process (~1.5 s). Kernels for types not met here still compile lazily, where first
used: this only moves work, it changes no behaviour.
"""

import os
import sys
import tempfile
import time

import numpy as np
from gymnasium import spaces

import mmreplay
from mmreplay import NStep, Prioritized, Sequences, Uniform

STEPS = 700  # past one shard and one commit of a small ring: the writer's RAM, the files and a wrap


def _record(store, frame_of, n: int, episode: int) -> None:
    previous = frame_of(0)
    for t in range(n):
        following = frame_of(t + 1)
        done = t % episode == episode - 1
        store.add(previous, store.action_space.sample(), float(t % 3 - 1), following, done and t % 2 == 0,
                  done and t % 2 == 1)
        previous = frame_of(t + 2) if done else following


def _sample_every_way(store) -> None:
    draws = (Uniform(), Prioritized(), NStep(3, 0.99, over=Prioritized()), Sequences(12, burn_in=4),
             Sequences(12, over=Prioritized()))
    for draw in draws:
        with store.sampler(16, draw, seed=0) as sampler:
            for _ in range(3):  # the later batches find frames in the decoded cache
                batch = next(sampler)
                if draw.prioritized is not None:
                    sampler.update_priorities(batch.indices, np.ones(batch.indices.shape))
    newest = store.inspect.valid_range()[1]
    store.inspect.get(np.arange(newest - 40, newest))


def _images(root: str, shape, codec, **session) -> None:
    """Frames of ``shape``: rows a multiple of 8 bytes are copied as uint64 words (84x84), others as bytes."""
    rng = np.random.default_rng(0)
    pool = rng.integers(0, 256, (64, *shape), dtype=np.uint8)
    pool[1::2] = pool[::2]  # runs of alike frames, as real ones
    path = os.path.join(root, f"{shape}-{codec}-{bool(session)}")
    with mmreplay.Store.create(path, spaces.Box(0, 255, shape, np.uint8), spaces.Discrete(4), capacity=512,
                               frame_stack=4 if len(shape) == 2 else 3, reward_values=(-1, 0, 1),
                               frame_codec=codec, durable=False, **session) as store:
        _record(store, lambda t: pool[t % 64], STEPS, 13)
        _sample_every_way(store)
    with mmreplay.Store.open(path, mode="r", **session) as store:
        _sample_every_way(store)


def _low_dim(root: str) -> None:
    space = spaces.Box(-1, 1, (11,), np.float32)
    with mmreplay.Store.create(os.path.join(root, "low"), space, spaces.Box(-1, 1, (3,), np.float32),
                               capacity=512, durable=False) as store:
        _record(store, lambda t: np.full(11, t % 7 / 7, np.float32), STEPS, 17)
        _sample_every_way(store)


def main() -> None:
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="mmreplay-warm-") as root:
        _images(root, (6, 5), "lz4hc")  # the tests' small frames
        for codec in ("lz4hc", "delta-zstd"):
            _images(root, (84, 84), codec)
        _images(root, (84, 84), "delta-zstd", cache_bytes=24 << 10)  # runs decoded straight into batches
        _images(root, (84, 84, 3), "delta-zstd")
        _low_dim(root)
    print(f"mmreplay kernels ready in {time.monotonic() - started:.1f} s", file=sys.stderr)


if __name__ == "__main__":
    main()
