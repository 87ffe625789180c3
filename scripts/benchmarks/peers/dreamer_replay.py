"""A DreamerV3-style replay, written from DreamerV3's ``embodied/core/replay.py`` design (Hafner et al. 2023,
"Mastering Diverse Domains through World Models"; ``replay.size: 5e6``, ``batch_size: 16``,
``batch_length: 64``): the reference of the ``dreamer`` benchmark.

- Steps go into *chunks* of ``CHUNK`` consecutive steps of one worker stream, each a dict of numpy arrays
  (``image`` (64, 64, 3) uint8, ``action``, ``reward``, ``is_first``, ``is_last``, ``is_terminal``); a full chunk
  links to its successor (DreamerV3's ``Chunk.succ``).
- Every step that has ``length - 1`` steps after it in its stream is an *item*, a sequence start
  (chunk, index); the ``Uniform`` selector draws an item uniformly.
- A sequence is the ``length`` steps from its start, read from the start's chunk and, where it runs past that
  chunk's end, its successor (concatenated); sequences run across episode boundaries, as DreamerV3's do
  (``is_first`` marks where the world model resets its state).
- A batch stacks ``batch_size`` sequences per key (``np.stack``) and hands them over as tensors.

Everything is held in RAM (500k steps of 64x64 RGB: 6.1 GB of images). Steps here are the benchmark's
dataset (``dreamer_data.DreamerSource``), so a sampled sequence's dataset index is known
(``sample(with_index=True)`` adds it; DreamerV3 has no such key, so the timed batches leave it out).
"""
from __future__ import annotations

import numpy as np
import torch

from ..dreamer_data import DreamerSource

CHUNK = 1024  # DreamerV3's chunksize


class DreamerReplay:
    def __init__(self, capacity: int, length: int = 64, seed: int = 0, fill_step: int = 8192):
        if capacity < length:
            raise ValueError(f"capacity {capacity} holds no sequence of {length} steps")
        self.length = length
        self.rng = np.random.default_rng(seed)
        src = DreamerSource()
        self.chunks: list[dict[str, np.ndarray]] = []
        for lo in range(0, capacity, CHUNK):  # one worker stream, chunk by chunk, as the adds fill them
            i = np.arange(lo, min(capacity, lo + CHUNK))
            self.chunks.append({"image": src.frames(i), "action": src.action(i), "reward": src.reward(i),
                                "is_first": src.is_first(i), "is_last": src.is_last(i),
                                "is_terminal": src.is_terminal(i)})
        self.n_items = capacity - length + 1  # starts with length - 1 steps after them in the stream
        self.capacity = capacity

    def _sequence(self, start: int) -> dict[str, np.ndarray]:
        c, k = divmod(start, CHUNK)
        chunk = self.chunks[c]
        if k + self.length <= len(chunk["reward"]):
            return {key: v[k:k + self.length] for key, v in chunk.items()}  # views: the stack below copies
        rest = self.length - (len(chunk["reward"]) - k)
        succ = self.chunks[c + 1]
        return {key: np.concatenate([v[k:], succ[key][:rest]]) for key, v in chunk.items()}

    def sample(self, batch_size: int, with_index: bool = False) -> dict[str, torch.Tensor]:
        starts = self.rng.integers(0, self.n_items, batch_size)
        seqs = [self._sequence(int(s)) for s in starts]
        out = {key: torch.from_numpy(np.stack([q[key] for q in seqs])) for key in seqs[0]}
        if with_index:
            out["index"] = torch.from_numpy(starts[:, None] + np.arange(self.length))
        return out
