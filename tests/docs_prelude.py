"""Runs the Python code blocks of a Markdown document as written, in order, as one script, and holds the
small stand-ins they may name.

Invariant: a block's code is executed exactly as it stands in the document. The only code a block does not
show is what an HTML comment right before it names, ``<!-- prelude: make_pong, make_atari -->``: each name is
one of ``STAND_INS`` below (a function that makes an env of fake frames with the shapes and spaces of the
real one), put into the script's namespace before the block runs. Blocks that need Atari ROMs, dm_control
or a GPU run on these, so the test extra needs none of them.

    python tests/docs_prelude.py README.md      # runs README.md's blocks in the current directory
"""

from __future__ import annotations

import re
import sys
import time
from dataclasses import dataclass

import gymnasium as gym
import numpy as np
from gymnasium import spaces

FENCE = re.compile(r"^```(\S*)\s*$")
PRELUDE = re.compile(r"^<!--\s*prelude:\s*(.*?)\s*-->\s*$")


# -- stand-in environments --------------------------------------------------------------------------------
class MovingSquare(gym.Env):
    """Frames of one bright square moving over a dark background (compressible, like a game screen), with
    the observation and action spaces of the env it stands in for. An episode terminates with probability
    ``end_prob`` a step (after ``min_steps``) or is truncated at ``max_steps``, as a time limit does."""

    metadata = {"render_modes": []}

    def __init__(self, shape, action_space, *, channel_axis: int | None, reward_values=None,
                 min_steps: int = 100, max_steps: int = 400, end_prob: float = 0.01):
        self.observation_space = spaces.Box(0, 255, shape, np.uint8)
        self.action_space = action_space
        self.channel_axis = channel_axis
        self.reward_values = reward_values
        self.min_steps, self.max_steps, self.end_prob = min_steps, max_steps, end_prob
        self.t = 0

    def _frame(self) -> np.ndarray:
        shape = self.observation_space.shape
        y_axis = 1 if self.channel_axis == 0 else 0  # (C, H, W) or (H, W[, C])
        h, w = shape[y_axis], shape[y_axis + 1]
        y, x = (self.t * 3 + self.y0) % (h - 8), (self.t * 5 + self.x0) % (w - 8)
        frame = np.full(shape, 30, np.uint8)
        square = [slice(None)] * len(shape)
        square[y_axis], square[y_axis + 1] = slice(y, y + 8), slice(x, x + 8)
        frame[tuple(square)] = 220
        return frame

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.t = 0
        self.y0, self.x0 = (int(v) for v in self.np_random.integers(0, 60, 2))
        return self._frame(), {}

    def step(self, action):
        self.t += 1
        if self.reward_values is not None:
            reward = float(self.np_random.choice(self.reward_values, p=[0.05, 0.9, 0.05]))
        else:
            reward = float(self.np_random.random())
        terminated = self.t >= self.min_steps and bool(self.np_random.random() < self.end_prob)
        truncated = not terminated and self.t >= self.max_steps
        return self._frame(), reward, terminated, truncated, {}


def make_pong() -> gym.Env:
    """Pong as gymnasium's ``AtariPreprocessing(gym.make("ALE/Pong-v5", frameskip=1))`` gives it: (84, 84)
    grey frames, 6 actions, rewards -1, 0, 1."""
    return MovingSquare((84, 84), spaces.Discrete(6), channel_axis=None, reward_values=(-1.0, 0.0, 1.0))


def make_atari(n_envs: int = 4):
    """SB3's ``make_atari_env("PongNoFrameskip-v4", n_envs=n_envs)``: a VecEnv of (84, 84, 1) grey frames."""
    from stable_baselines3.common.env_util import make_vec_env

    def one():
        return MovingSquare((84, 84, 1), spaces.Discrete(6), channel_axis=-1, reward_values=(-1.0, 0.0, 1.0))

    return make_vec_env(one, n_envs=n_envs, seed=0)


def make_walker(shape=(3, 84, 84)) -> gym.Env:
    """dm_control's walker-walk rendered to ``shape`` uint8 frames (channel-first (3, H, W) or channel-last
    (H, W, 3)) with an action repeat of 2: 6 actions in [-1, 1], rewards in [0, 1], 500 steps then truncated."""
    channel_axis = 0 if shape[0] == 3 else -1
    return MovingSquare(tuple(shape), spaces.Box(-1.0, 1.0, (6,), np.float32), channel_axis=channel_axis,
                        min_steps=500, max_steps=500, end_prob=0.0)


def make_rgb_env() -> gym.Env:
    """An env of (84, 84, 3) uint8 colour frames with 6 discrete actions (e.g. an Atari game in colour)."""
    return MovingSquare((84, 84, 3), spaces.Discrete(6), channel_axis=-1, reward_values=(-1.0, 0.0, 1.0))


def make_rgb_control_env() -> gym.Env:
    """An env of (64, 64, 3) uint8 colour frames with 6 continuous actions in [-1, 1]."""
    return MovingSquare((64, 64, 3), spaces.Box(-1.0, 1.0, (6,), np.float32), channel_axis=-1)


STAND_INS = {f.__name__: f for f in (make_pong, make_atari, make_walker, make_rgb_env, make_rgb_control_env)}


# -- extracting and running the blocks ---------------------------------------------------------------------
@dataclass
class Block:
    language: str
    line: int  # 1-based line of the block's first code line in the document
    code: str
    prelude: list[str]


def blocks(text: str) -> list[Block]:
    """Every fenced block of a Markdown text, with the prelude names of the HTML comment right before it."""
    lines = text.splitlines()
    found: list[Block] = []
    i = 0
    while i < len(lines):
        opening = FENCE.match(lines[i])
        if not opening:
            i += 1
            continue
        end = next((j for j in range(i + 1, len(lines)) if lines[j].rstrip() == "```"), None)
        if end is None:
            raise ValueError(f"line {i + 1}: a code block that is never closed")
        before = lines[i - 1] if i > 0 else ""
        named = PRELUDE.match(before)
        prelude = [n.strip() for n in named.group(1).split(",") if n.strip()] if named else []
        found.append(Block(opening.group(1), i + 2, "\n".join(lines[i + 1:end]) + "\n", prelude))
        i = end + 1
    return found


def run_document(path: str) -> int:
    """Execute ``path``'s Python blocks in order in one namespace; the number of blocks run."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    namespace: dict = {"__name__": "__main__"}
    ran = 0
    for block in blocks(text):
        if block.language != "python":
            continue
        for name in block.prelude:
            if name not in STAND_INS:
                raise KeyError(f"{path}:{block.line - 1}: prelude {name!r} is not one of {sorted(STAND_INS)}")
            namespace[name] = STAND_INS[name]
        # padded so that a traceback names the document's own line numbers
        code = compile("\n" * (block.line - 1) + block.code, path, "exec")
        started = time.perf_counter(), time.process_time()
        exec(code, namespace)
        ran += 1
        print(f"{path}:{block.line}: {time.perf_counter() - started[0]:.1f} s wall, "
              f"{time.process_time() - started[1]:.1f} s CPU", file=sys.stderr)
    return ran


if __name__ == "__main__":
    count = run_document(sys.argv[1])
    print(f"{sys.argv[1]}: {count} Python blocks ran")
