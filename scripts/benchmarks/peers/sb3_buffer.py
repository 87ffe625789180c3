"""The "sb3" peer: ``stable_baselines3.common.buffers.ReplayBuffer(optimize_memory_usage=True,
handle_timeout_termination=False)``, one full stack per transition, next_obs the next slot.

Invariant: ``done = terminated | truncated`` (what SB3's own algorithms give this buffer): its memory
optimisation cannot keep a truncated episode's final observation.
"""
from __future__ import annotations

import numpy as np


class SB3Peer:
    name = "sb3"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 n_actions=6, seed=0):
        from gymnasium import spaces
        from stable_baselines3.common.buffers import ReplayBuffer
        self.E, self.S = int(n_envs), int(frame_stack)
        shape = (self.S, *obs_shape) if self.S > 1 else tuple(obs_shape)
        dt = np.dtype(obs_dtype)
        if dt == np.uint8:
            space = spaces.Box(0, 255, shape, np.uint8)
        else:
            space = spaces.Box(-np.inf, np.inf, shape, dt)
        np.random.seed(seed)  # SB3 samples with the global numpy RNG
        # SB3 divides buffer_size by n_envs itself
        self.rb = ReplayBuffer(int(capacity), space, spaces.Discrete(n_actions),
                               device="cpu", n_envs=self.E,
                               optimize_memory_usage=True,
                               handle_timeout_termination=False)
        self._infos = [{} for _ in range(self.E)]

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        done = np.asarray(terminated, bool) | np.asarray(truncated, bool)
        self.rb.add(obs, next_obs, np.asarray(action), np.asarray(reward, np.float32),
                    done.astype(np.float32), self._infos)

    def __len__(self):
        return self.rb.size() * self.E

    def sample(self, batch_size):
        s = self.rb.sample(batch_size)
        return {"obs": s.observations, "next_obs": s.next_observations,
                "action": s.actions.reshape(-1), "reward": s.rewards.reshape(-1),
                "done": s.dones.reshape(-1)}

    def nbytes(self):
        rb = self.rb
        return sum(a.nbytes for a in (rb.observations, rb.actions, rb.rewards,
                                      rb.dones, rb.timeouts))

    def close(self):
        self.rb = None
