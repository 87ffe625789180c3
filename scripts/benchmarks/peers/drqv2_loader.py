"""A DrQ-v2-style replay loader, written from the paper's description (Yarats et al. 2021, "Mastering Visual
Continuous Control: Improved Data-Augmented Reinforcement Learning", section 3 and appendix; its
``replay_buffer.py`` design): the reference of the DMC larger-than-RAM benchmark.

- Episodes of *stacked* observations (the environment's FrameStack wrapper concatenates the last 3 RGB frames
  by channel: 9x84x84 uint8) are held in RAM by the ``DataLoader`` workers: an ``IterableDataset`` whose
  every worker keeps its own episodes (``capacity / num_workers`` transitions each).
- A sample: an episode uniformly, then a step uniformly, then the n-step return
  ``sum_k gamma^k r_{t+k}`` (k < n), the discount ``gamma^n`` and the observation n steps later.
- Batches come from the ``DataLoader``'s own batching (default collate) of ``batch_size`` samples.

Episodes here are the benchmark's DMC dataset (``ltr_data.DmcSource``): worker ``w`` of ``W`` holds dataset
episodes ``w, w + W, ...``; so a sample's dataset index is known and rows can be checked
(``with_index=True`` adds it as a sixth item; DrQ-v2 has no such field, so the timed loader leaves it out).

Invariant: observation ``t`` of an episode is the stack of frames ``t-2..t`` (padded with the first frame),
observation ``t + 1`` is step ``t``'s next observation, so an episode of L steps holds L + 1 observations.
"""
from __future__ import annotations

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from ..ltr_data import DMC_EPISODE, DMC_STACK, DmcSource


class DrQv2Episodes(IterableDataset):
    def __init__(self, capacity: int, num_workers: int, nstep: int = 3, gamma: float = 0.99,
                 with_index: bool = False):
        self.capacity, self.num_workers, self.nstep, self.gamma = capacity, num_workers, nstep, gamma
        self.with_index = with_index

    def _load(self, worker: int, workers: int) -> list[dict]:
        """This worker's episodes, as the env handed them: (L + 1) stacked observations, L actions/rewards."""
        src = DmcSource()
        n_episodes = self.capacity // DMC_EPISODE
        episodes = []
        for e in range(worker, n_episodes, workers):
            i = e * DMC_EPISODE + np.arange(DMC_EPISODE)
            steps = np.concatenate([i, i[-1:]])
            offset = np.zeros(DMC_EPISODE + 1, np.int64)
            offset[-1] = 1  # the last observation is the last step's next observation
            obs = src.stacks(steps, offset).reshape(DMC_EPISODE + 1, DMC_STACK * 3, 84, 84)
            episodes.append({"first": int(i[0]), "observation": obs, "action": src.action(i),
                             "reward": src.reward(i)})
        return episodes

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info is not None else (0, 1)
        episodes = self._load(worker, workers)
        rng = np.random.default_rng(None if info is None else info.seed % (1 << 32))
        n, gamma = self.nstep, self.gamma
        while True:
            ep = episodes[rng.integers(len(episodes))]
            t = int(rng.integers(0, DMC_EPISODE - n + 1))  # DrQ-v2: a step with n steps after it
            reward = np.float32(0.0)
            for k in range(n):
                reward += np.float32(gamma ** k) * ep["reward"][t + k]
            item = (ep["observation"][t], ep["action"][t], reward, np.float32(gamma ** n), ep["observation"][t + n])
            yield item + (ep["first"] + t,) if self.with_index else item


def make_loader(capacity: int = 50_000, batch_size: int = 256, num_workers: int = 4, nstep: int = 3,
                gamma: float = 0.99, with_index: bool = False):
    """An endless iterator of DrQ-v2 batches (obs, action, reward, discount, next_obs[, index]) as tensors."""
    if capacity // DMC_EPISODE < max(1, num_workers):
        raise ValueError(f"capacity {capacity} holds fewer {DMC_EPISODE}-step episodes than the {num_workers} "
                         "workers: every worker needs one at least")
    ds = DrQv2Episodes(capacity, num_workers, nstep, gamma, with_index)
    loader = DataLoader(ds, batch_size=batch_size, num_workers=num_workers, pin_memory=torch.cuda.is_available(),
                        persistent_workers=num_workers > 0)
    return iter(loader)
