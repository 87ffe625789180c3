"""The "cpprb" peer: ``cpprb.ReplayBuffer(next_of=("obs",), stack_compress="obs")``, one buffer per env.

Invariant: each cpprb buffer sees the consecutive steps of one episode stream only (its compression
relies on it), with ``on_episode_end()`` at every episode end.
"""
from __future__ import annotations

import numpy as np

from .convert import from_cpprb


class CpprbPeer:
    """One cpprb buffer per env: ``next_of`` and ``stack_compress`` rely on
    consecutive ``add`` calls being consecutive steps of ONE episode stream, so
    interleaving envs in a single buffer would corrupt stacks.  cpprb wants the
    stack axis LAST, so stacks are moved (S,84,84) -> (84,84,S) on add and back
    on sample (copies included in the timings)."""

    name = "cpprb"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 seed=0):
        from cpprb import ReplayBuffer
        self.E, self.S = int(n_envs), int(frame_stack)
        self.C = max(int(capacity) // self.E, 1)
        kw = {}
        if self.S > 1:
            shape = (*obs_shape, self.S)
            kw["stack_compress"] = "obs"
        else:
            shape = tuple(obs_shape)
        env_dict = {"obs": {"shape": shape, "dtype": np.dtype(obs_dtype)},
                    "act": {"dtype": np.int64},
                    "rew": {"dtype": np.float32},
                    "done": {"dtype": np.float32}}
        self.rbs = [ReplayBuffer(self.C, env_dict, next_of=("obs",), **kw)
                    for _ in range(self.E)]
        self.rng = np.random.default_rng(seed)
        np.random.seed(seed)  # cpprb samples with the global numpy RNG

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        if self.S > 1:
            obs = np.moveaxis(obs, 1, -1)
            next_obs = np.moveaxis(next_obs, 1, -1)
        ends = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        for e, rb in enumerate(self.rbs):
            rb.add(obs=obs[e], act=action[e], rew=reward[e], next_obs=next_obs[e],
                   done=float(terminated[e]))
            if ends[e]:
                rb.on_episode_end()

    def __len__(self):
        return sum(rb.get_stored_size() for rb in self.rbs)

    def sample(self, batch_size):
        if self.E == 1:
            s = self.rbs[0].sample(batch_size)
        else:
            sizes = np.array([rb.get_stored_size() for rb in self.rbs], float)
            per = self.rng.multinomial(batch_size, sizes / sizes.sum())
            parts = [rb.sample(int(k)) for rb, k in zip(self.rbs, per) if k > 0]
            s = {key: np.concatenate([p[key] for p in parts]) for key in parts[0]}
        return from_cpprb(s, self.S)

    def close(self):
        self.rbs = None
