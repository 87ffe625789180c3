"""The "torchrl_per" peer: ``TensorDictReplayBuffer(LazyMemmapStorage, PrioritizedSampler(capacity,
alpha=0.6, beta=0.4))``, one storage for all envs (global PER).

Invariant: same layout and ``add_batch`` as the "torchrl" peer; ``sample(B, beta)`` sets the sampler's
``beta`` only when it changes.
"""
from __future__ import annotations

import tempfile

import numpy as np
import torch

from .torchrl_buffer import TorchRLPeer


class TorchRLPERPeer(TorchRLPeer):
    """``TensorDictReplayBuffer(storage=LazyMemmapStorage(capacity),
    sampler=PrioritizedSampler(capacity, alpha=0.6, beta=0.4))``, same layout
    and ``add_batch`` as ``TorchRLPeer`` (one storage for all envs: global PER).
    ``sample(B, beta)`` sets the sampler's ``beta`` when it changes.  The
    sampler draws its masses with numpy's GLOBAL RNG (seeded here).

    Needs the ``torchrl._torchrl`` C++ extension (the segment trees); the
    torchrl 0.8-0.14 wheels on PyPI do not load against torch 2.13.0+cpu
    (undefined symbols), see ``scripts/per_peers_probe.py --rebuild-torchrl-ext``.
    """

    name = "torchrl_per"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 scratch_dir=None, alpha=0.6, beta=0.4, seed=0):
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import PrioritizedSampler
        self.E, self.S = int(n_envs), int(frame_stack)
        self.n_slots = int(capacity)
        sampler = PrioritizedSampler(int(capacity), alpha=alpha, beta=beta)
        self._own_dir = scratch_dir is None
        self.dir = scratch_dir or tempfile.mkdtemp(prefix="mmreplay_torchrl_per_",
                                                    dir="/tmp")
        torch.manual_seed(seed)
        np.random.seed(seed)  # PrioritizedSampler draws with np.random.uniform
        self.sampler = sampler
        self.rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(int(capacity), scratch_dir=self.dir),
            sampler=sampler)

    def sample(self, batch_size, beta=0.4):
        if beta != self.sampler.beta:
            self.sampler.beta = beta
        s = self.rb.sample(batch_size)
        return {"obs": s["obs"], "next_obs": s["next", "obs"],
                "action": s["action"],
                "reward": s["next", "reward"].reshape(-1),
                "done": s["next", "terminated"].reshape(-1).float(),
                "weights": s["priority_weight"].reshape(-1).float(),
                "indices": s["index"].reshape(-1)}

    def update_priorities(self, indices, priorities):
        idx = indices if isinstance(indices, torch.Tensor) else torch.as_tensor(
            np.asarray(indices, np.int64))
        p = priorities if isinstance(priorities, torch.Tensor) else torch.as_tensor(
            np.asarray(priorities, np.float32))
        self.rb.update_priority(idx, p)
