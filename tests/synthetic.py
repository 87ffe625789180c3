"""A deterministic single-stream transition source: transition ``g``'s content is a function of ``g``
alone, so a process that reopens a store after a crash (or a concurrent reader) can check every
transition it finds bit for bit, without talking to the writer."""

from functools import lru_cache

import numpy as np
from gymnasium import spaces

SHAPE = (6, 5)
OBS_SPACE = spaces.Box(0, 255, SHAPE, np.uint8)
ACTION_SPACE = spaces.Discrete(4)
FRAME_STACK = 3


@lru_cache(maxsize=1 << 15)  # readers checking millions of rows see the same recent frames again and again
def _frame(kind: int, g: int) -> np.ndarray:
    return np.random.default_rng([kind, g]).integers(0, 256, SHAPE, dtype=np.uint8)


def terminated(g: int) -> bool:
    return g % 37 == 36


def truncated(g: int) -> bool:
    return g % 53 == 52


def episode_start(g: int) -> bool:
    return g == 0 or terminated(g - 1) or truncated(g - 1)


def obs(g: int) -> np.ndarray:
    return _frame(1, g) if episode_start(g) else _frame(2, g - 1)


def next_obs(g: int) -> np.ndarray:
    return _frame(2, g)


def action(g: int) -> int:
    return g % 4


def reward(g: int) -> float:
    return float(g % 3 - 1)


def transition(g: int):
    return obs(g), action(g), reward(g), next_obs(g), terminated(g), truncated(g)


def expected_stack(g: int, k: int = FRAME_STACK):
    frames = [obs(g)]
    cur = g
    while len(frames) < k:
        if not episode_start(cur):
            cur -= 1
        frames.insert(0, obs(cur))
    return np.stack(frames), np.stack(frames[1:] + [next_obs(g)])


def needs(g: int, k: int = FRAME_STACK) -> int:
    """Oldest transition the stack of ``g`` reads."""
    cur = g
    for _ in range(k - 1):
        if episode_start(cur):
            break
        cur -= 1
    return cur


def check_batch(batch) -> None:
    for row, g in enumerate(batch.indices.tolist()):
        want_obs, want_next = expected_stack(g)
        np.testing.assert_array_equal(batch.obs[row].numpy(), want_obs, err_msg=f"obs of transition {g}")
        np.testing.assert_array_equal(batch.next_obs[row].numpy(), want_next, err_msg=f"next_obs of {g}")
        assert int(batch.action[row]) == action(g) and float(batch.reward[row]) == reward(g), g
        assert bool(batch.terminated[row]) == terminated(g) and bool(batch.truncated[row]) == truncated(g), g


def wrong_rows(batch) -> list[str]:
    """Every row of ``batch`` that differs from the ground truth, described (empty: all rows are right).
    Compares whole arrays first, so a correct batch costs one stack of cached frames per row."""
    ids = batch.indices.tolist()
    stacks = [expected_stack(g) for g in ids]
    want_obs = np.stack([o for o, _ in stacks])
    want_next = np.stack([n for _, n in stacks])
    got_obs, got_next = batch.obs.numpy(), batch.next_obs.numpy()
    scalars_ok = (batch.action.numpy() == np.array([action(g) for g in ids])) & \
        (batch.reward.numpy() == np.array([reward(g) for g in ids])) & \
        (batch.terminated.numpy() == np.array([terminated(g) for g in ids])) & \
        (batch.truncated.numpy() == np.array([truncated(g) for g in ids]))
    rows_ok = scalars_ok & (got_obs == want_obs).reshape(len(ids), -1).all(axis=1) & \
        (got_next == want_next).reshape(len(ids), -1).all(axis=1)
    return [f"transition {ids[i]} (row {i})" for i in np.flatnonzero(~rows_ok)]
