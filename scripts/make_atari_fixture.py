#!/usr/bin/env python
"""Record a small, real Atari replay fixture for the mmreplay tests.

Plays Pong and Breakout with a seeded uniform-random policy through
``gymnasium.wrappers.AtariPreprocessing`` (frame_skip=4, 84x84, grayscale,
the usual DQN preprocessing) and writes ``tests/data/atari_fixture.npz``
(``np.savez_compressed``, plain numeric arrays only; loads with
``allow_pickle=False``):

    frames          (F, 84, 84) uint8   every observation, each stored once
    obs_index       (N,) int64          index into ``frames`` of s_t
    next_obs_index  (N,) int64          index into ``frames`` of s_{t+1}
    action          (N,) int64
    reward          (N,) float32        raw, unclipped
    terminated      (N,) bool
    truncated       (N,) bool
    env_id          (N,) int8           0 = Pong, 1 = Breakout

Transitions are in recording order, episode after episode.  Within an episode
``next_obs_index[t] == obs_index[t + 1]``; each episode adds one extra frame
(its reset observation), so ``F == N + number_of_episodes``.  On a truncation
or termination ``next_obs`` is the real final observation (before reset).

Episodes:
  * Pong: wrapped in ``TimeLimit(max_episode_steps=100)`` *outside* the
    preprocessing (so 100 agent steps, not 100 emulator frames); a random Pong
    game never finishes in 100 steps, so these episodes end with
    ``truncated=True``.
  * Breakout: three complete episodes, no time limit; random play loses all
    five lives quickly, so these end with ``terminated=True``.

Usage:  python scripts/make_atari_fixture.py [--out PATH] [--seed 0]
"""
from __future__ import annotations

import argparse
import os
import sys

import numpy as np
import gymnasium as gym
import ale_py
from gymnasium.wrappers import AtariPreprocessing, TimeLimit

gym.register_envs(ale_py)

GAMES = ("Pong", "Breakout")  # env_id 0, 1


def make_env(game: str, max_episode_steps: int | None):
    # frameskip=1 on the ALE env so AtariPreprocessing does the 4x skip
    # (it refuses to wrap an env that already skips frames).
    env = gym.make(f"ALE/{game}-v5", frameskip=1)
    env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                             terminal_on_life_loss=False, grayscale_obs=True,
                             scale_obs=False)
    if max_episode_steps is not None:
        env = TimeLimit(env, max_episode_steps=max_episode_steps)
    return env


def record(game, env_id, *, n_episodes=None, min_transitions=None,
           max_episode_steps=None, seed=0, out=None):
    """Play whole episodes; stop after ``n_episodes`` or once at least
    ``min_transitions`` have been recorded (the last episode is finished)."""
    out = out if out is not None else {k: [] for k in
                                       ("frames", "obs_index", "next_obs_index",
                                        "action", "reward", "terminated",
                                        "truncated", "env_id")}
    env = make_env(game, max_episode_steps)
    env.action_space.seed(seed)
    n_tr, ep = 0, 0
    episodes = []
    while True:
        obs, _ = env.reset(seed=seed + ep)
        cur = len(out["frames"])
        out["frames"].append(obs)
        ep_len, ep_ret = 0, 0.0
        while True:
            a = int(env.action_space.sample())
            obs, r, term, trunc, _ = env.step(a)
            nxt = len(out["frames"])
            out["frames"].append(obs)
            out["obs_index"].append(cur)
            out["next_obs_index"].append(nxt)
            out["action"].append(a)
            out["reward"].append(r)
            out["terminated"].append(bool(term))
            out["truncated"].append(bool(trunc) and not term)
            out["env_id"].append(env_id)
            cur = nxt
            ep_len += 1
            ep_ret += float(r)
            if term or trunc:
                break
        n_tr += ep_len
        ep += 1
        episodes.append((game, ep_len, ep_ret,
                         "terminated" if term else "truncated"))
        if n_episodes is not None and ep >= n_episodes:
            break
        if min_transitions is not None and n_tr >= min_transitions:
            break
    env.close()
    return out, episodes


def main(argv=None):
    here = os.path.dirname(os.path.abspath(__file__))
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=os.path.join(here, "..", "tests", "data",
                                                 "atari_fixture.npz"))
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)

    data, eps_pong = record("Pong", 0, n_episodes=2, max_episode_steps=100,
                            seed=args.seed)
    data, eps_brk = record("Breakout", 1, n_episodes=3,
                           seed=args.seed + 1000, out=data)

    arrays = dict(
        frames=np.stack(data["frames"]).astype(np.uint8),
        obs_index=np.asarray(data["obs_index"], dtype=np.int64),
        next_obs_index=np.asarray(data["next_obs_index"], dtype=np.int64),
        action=np.asarray(data["action"], dtype=np.int64),
        reward=np.asarray(data["reward"], dtype=np.float32),
        terminated=np.asarray(data["terminated"], dtype=bool),
        truncated=np.asarray(data["truncated"], dtype=bool),
        env_id=np.asarray(data["env_id"], dtype=np.int8),
    )
    assert arrays["frames"].shape[1:] == (84, 84)
    out = os.path.abspath(args.out)
    os.makedirs(os.path.dirname(out), exist_ok=True)
    np.savez_compressed(out, **arrays)

    # sanity: loads without pickle, indices consistent
    with np.load(out, allow_pickle=False) as z:
        n = len(z["action"])
        assert all(len(z[k]) == n for k in z.files if k != "frames")
        ends = z["terminated"] | z["truncated"]
        assert np.all(z["next_obs_index"][:-1][~ends[:-1]] == z["obs_index"][1:][~ends[:-1]])
    for g, L, R, how in eps_pong + eps_brk:
        print(f"  {g:9s} len={L:4d} return={R:+6.1f} {how}")
    print(f"wrote {out}: {n} transitions, {len(arrays['frames'])} frames, "
          f"{int(arrays['terminated'].sum())} terminated, "
          f"{int(arrays['truncated'].sum())} truncated, "
          f"{os.path.getsize(out) / 1e6:.2f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
