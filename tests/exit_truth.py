"""Ground truth for the exit tests: transition ``g`` of a store whose frames are shaped ``shape`` is a
function of ``(shape, g)`` alone, so the parent that reopens a store a child left without ``close()``
checks every row bit for bit (frame stacks of 2, episodes of 37 or fewer steps)."""

import numpy as np
from gymnasium import spaces

ACTION_SPACE = spaces.Discrete(4)
FRAME_STACK = 2


def obs_space(shape) -> spaces.Box:
    return spaces.Box(0, 255, tuple(shape), np.uint8)


def _frame(shape, kind: int, g: int) -> np.ndarray:
    return np.random.default_rng([kind, g]).integers(0, 256, tuple(shape), dtype=np.uint8)


def terminated(g: int) -> bool:
    return g % 37 == 36


def truncated(g: int) -> bool:
    return g % 23 == 22


def episode_start(g: int) -> bool:
    return g == 0 or terminated(g - 1) or truncated(g - 1)


def obs(shape, g: int) -> np.ndarray:
    return _frame(shape, 1, g) if episode_start(g) else _frame(shape, 2, g - 1)


def next_obs(shape, g: int) -> np.ndarray:
    return _frame(shape, 2, g)


def action(g: int) -> int:
    return g % 4


def reward(g: int) -> float:
    return float(g % 3 - 1)


def transition(shape, g: int):
    return obs(shape, g), action(g), reward(g), next_obs(shape, g), terminated(g), truncated(g)


def priority(g: int) -> float:
    """The priority the child gives transition ``g`` (when it updates it)."""
    return 0.25 + (g * 7919 % 1000) / 100.0


def wrong_rows(shape, batch) -> list[int]:
    """Ids of the rows of ``batch`` that differ from the ground truth (empty: all right)."""
    bad = []
    for row, g in enumerate(batch.indices.tolist()):
        prev = g if episode_start(g) else g - 1
        want_obs = np.stack([obs(shape, prev), obs(shape, g)])
        want_next = np.stack([obs(shape, g), next_obs(shape, g)])
        ok = np.array_equal(batch.obs[row].numpy(), want_obs) and \
            np.array_equal(batch.next_obs[row].numpy(), want_next) and \
            int(batch.action[row]) == action(g) and float(batch.reward[row]) == reward(g) and \
            bool(batch.terminated[row]) == terminated(g) and bool(batch.truncated[row]) == truncated(g)
        if not ok:
            bad.append(g)
    return bad
