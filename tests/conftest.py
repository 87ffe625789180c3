import os
import sys

import numpy as np
import pytest
from gymnasium import spaces

sys.path.insert(0, os.path.dirname(__file__))

import mmreplay  # noqa: E402

IMG = spaces.Box(0, 255, (6, 5), np.uint8)


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def make_store(store_path):
    """Create a small image store (6x5 uint8 frames, 3 actions, clipped rewards)."""
    opened = []

    def make(capacity=200, frame_stack=4, obs_space=IMG, action_space=spaces.Discrete(3), **kw):
        kw.setdefault("reward_values", (-1, 0, 1))
        s = mmreplay.Store.create(store_path, obs_space, action_space, capacity=capacity, frame_stack=frame_stack,
                                  durable=False, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def record_random_steps(env, store, steps: int, seed: int = 0) -> None:
    """``steps`` random-action steps of ``env`` recorded into ``store`` (episodes reset as they end)."""
    from mmreplay.integrations.gymnasium import RecordToStore

    rec = RecordToStore(env, store)
    rec.reset(seed=seed)
    for _ in range(steps):
        _, _, terminated, truncated, _ = rec.step(env.action_space.sample())
        if terminated or truncated:
            rec.reset()
