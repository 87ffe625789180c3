"""The "torchrl" peer: ``TensorDictReplayBuffer(LazyMemmapStorage(scratch dir), sampler=RandomSampler())``,
the usual TorchRL layout (obs and ("next", "obs") full stacks, no deduplication).

Invariant: the memmap scratch directory is the peer's storage; ``disk_bytes`` is what it allocated, and
``close`` removes it when the peer made it.
"""
from __future__ import annotations

import shutil
import tempfile

import numpy as np
import torch

from ..measure import dir_bytes


class TorchRLPeer:
    name = "torchrl"

    def __init__(self, capacity, obs_shape, obs_dtype, n_envs=1, frame_stack=1,
                 scratch_dir=None, seed=0):
        from torchrl.data import LazyMemmapStorage, TensorDictReplayBuffer
        from torchrl.data.replay_buffers.samplers import RandomSampler
        self.E, self.S = int(n_envs), int(frame_stack)
        self._own_dir = scratch_dir is None
        self.dir = scratch_dir or tempfile.mkdtemp(prefix="mmreplay_torchrl_",
                                                    dir="/tmp")
        torch.manual_seed(seed)  # RandomSampler uses torch's global RNG
        self.rb = TensorDictReplayBuffer(
            storage=LazyMemmapStorage(int(capacity), scratch_dir=self.dir),
            sampler=RandomSampler())

    def add_batch(self, obs, action, reward, next_obs, terminated, truncated):
        from tensordict import TensorDict
        E = self.E
        term = torch.from_numpy(np.asarray(terminated, bool)).reshape(E, 1)
        trunc = torch.from_numpy(np.asarray(truncated, bool)).reshape(E, 1)
        td = TensorDict({
            "obs": torch.from_numpy(np.ascontiguousarray(obs)),
            "action": torch.from_numpy(np.asarray(action, np.int64)),
            "next": TensorDict({
                "obs": torch.from_numpy(np.ascontiguousarray(next_obs)),
                "reward": torch.from_numpy(np.asarray(reward, np.float32)).reshape(E, 1),
                "terminated": term, "truncated": trunc, "done": term | trunc,
            }, batch_size=[E]),
        }, batch_size=[E])
        self.rb.extend(td)

    def __len__(self):
        return len(self.rb)

    def sample(self, batch_size):
        s = self.rb.sample(batch_size)
        return {"obs": s["obs"], "next_obs": s["next", "obs"],
                "action": s["action"],
                "reward": s["next", "reward"].reshape(-1),
                "done": s["next", "terminated"].reshape(-1).float()}

    def disk_bytes(self):
        return dir_bytes(self.dir)

    def close(self):
        self.rb = None
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)
