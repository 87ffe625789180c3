"""Write a tiny Dopamine replay directory (the DQN Replay Dataset's format) from real Atari frames.

A stand-in for Dopamine's ``OutOfGraphReplayBuffer`` (dopamine/tf/replay_memory/circular_replay_buffer.py),
written from its documented rules, not from mmreplay: a circular buffer of ``capacity`` rows; before each
episode ``stack_size - 1`` all-zero padding rows; row ``g`` of the run at ``g % capacity``; ``save`` writes
each array with ``np.save(..., allow_pickle=False)`` into ``gzip.GzipFile(fileobj=f, mode="wb")`` as
``$store$_<name>_ckpt.<N>.gz``, plus ``add_count`` and ``invalid_range``. (Dopamine 3+ also pickles its
``episode_end_indices`` set; the DQN Replay Dataset has no such file, and mmreplay never reads a pickle.)
Frames come from mmreplay/data/atari_fixture.npz (Pong, Breakout, Seaquest, 84x84 grey).

    python scripts/make_dqn_replay_fixture.py tests/data/dqn_replay
"""

from __future__ import annotations

import argparse
import gzip
import os
import sys

import numpy as np

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "mmreplay", "data", "atari_fixture.npz")


class DopamineLikeBuffer:
    """Dopamine's add/save rules for the default element types (observation uint8, action int32, reward
    float32, terminal uint8)."""

    def __init__(self, capacity: int, frame_shape=(84, 84), stack_size: int = 4, update_horizon: int = 1):
        self.capacity, self.stack_size, self.update_horizon = capacity, stack_size, update_horizon
        self.store = {"observation": np.zeros((capacity, *frame_shape), np.uint8),
                      "action": np.zeros(capacity, np.int32), "reward": np.zeros(capacity, np.float32),
                      "terminal": np.zeros(capacity, np.uint8)}
        self.add_count = 0
        self.episode_start = True

    def cursor(self) -> int:
        return self.add_count % self.capacity

    def _put(self, observation, action, reward, terminal) -> None:
        c = self.cursor()
        for name, value in (("observation", observation), ("action", action), ("reward", reward),
                            ("terminal", terminal)):
            self.store[name][c] = value
        self.add_count += 1

    def add(self, observation, action, reward, terminal) -> None:
        if self.episode_start:
            for _ in range(self.stack_size - 1):
                self._put(0, 0, 0, 0)
            self.episode_start = False
        self._put(observation, action, reward, terminal)
        if terminal:
            self.episode_start = True

    def invalid_range(self) -> np.ndarray:
        c, h = self.cursor(), self.update_horizon
        return np.array([(c - h + i) % self.capacity for i in range(self.stack_size + h)])

    def save(self, directory: str, iteration: int) -> None:
        arrays = {f"$store${'_'}{name}": a for name, a in self.store.items()}
        arrays["add_count"] = np.array(self.add_count)
        arrays["invalid_range"] = self.invalid_range()
        for name, array in arrays.items():
            with open(os.path.join(directory, f"{name}_ckpt.{iteration}.gz"), "wb") as f, \
                    gzip.GzipFile(fileobj=f, mode="wb") as out:
                np.save(out, array, allow_pickle=False)


def episodes(rng: np.random.Generator, frames: np.ndarray, lengths=(20, 120), num_actions: int = 6):
    """Endless episodes: consecutive real frames (cycling through the fixture), random actions, clipped
    rewards (-1, 0, 1), terminal on the last step."""
    at = 0
    while True:
        n = int(rng.integers(*lengths))
        for t in range(n):
            reward = rng.choice([-1.0, 0.0, 1.0], p=[0.05, 0.9, 0.05])
            yield frames[at % len(frames)], int(rng.integers(num_actions)), reward, int(t == n - 1)
            at += 1


def make_fixture(directory: str, *, capacity: int = 500, save_at=(700, 1200), seed: int = 0,
                 stack_size: int = 4, frames: np.ndarray | None = None) -> dict[int, int]:
    """Run the buffer and save checkpoint ``i`` when ``add_count`` reaches ``save_at[i]`` (padding rows
    count, as in Dopamine). Returns {checkpoint: add_count}."""
    if frames is None:
        frames = np.load(FIXTURE)["frames"]
    os.makedirs(directory, exist_ok=True)
    rng = np.random.default_rng(seed)
    buf = DopamineLikeBuffer(capacity, frames.shape[1:], stack_size)
    saved = {}
    steps = episodes(rng, frames)
    for i, target in enumerate(save_at):
        while buf.add_count < target:
            buf.add(*next(steps))
        buf.save(directory, i)
        saved[i] = buf.add_count
    return saved


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out", help="directory to write (created)")
    p.add_argument("--capacity", type=int, default=500)
    p.add_argument("--save-at", default="700,1200", help="add_count at which each checkpoint is saved")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    saved = make_fixture(args.out, capacity=args.capacity, save_at=[int(x) for x in args.save_at.split(",")],
                         seed=args.seed)
    print(f"wrote checkpoints {saved} (add_count each) to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
