"""Native TorchRL samplers of an ``MMReplayStorage``: uniform, prioritized and slices, drawn by the store.

Invariants:
- A sampler draws only ids that ``get`` accepts (rows holding an id below ``inspect.readable_range()[0]``,
  held but with their frame stack gone, are drawn again) and pins its draw in the storage (``Drawn``), so
  the rows ``ReplayBuffer`` returns are the rows ``info`` names, also after a writer in another process
  overwrote some in between (then drawn again).
- Its RNG state, and nothing else of it, is saved with ``dumps`` (JSON); ``MMReplayPrioritizedSampler``'s
  priorities are keyed by the store's stable transition ids and committed with the store (``dumps`` /
  ``flush``), so they stay exact after the ring overwrites and after a reopen.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from torchrl.data.replay_buffers.samplers import Sampler

from mmreplay.integrations.torchrl_rows import RACE_RETRIES
from mmreplay.integrations.torchrl_storage import Drawn, MMReplayStorage
from mmreplay.sampling.strategy import Prioritized, Sequences, Uniform
from mmreplay.store import Store


class StoreSampler(Sampler):
    """A TorchRL sampler that draws in the store (its RNG state, JSON, goes with ``dumps``). Subclasses
    give ``_rows`` (how many rows a batch draws) and ``_draw_rows`` (ids per row, with per-row extras) and
    ``_finish`` (flat ids and ``info``); drawing only readable ids and redrawing after a race is shared."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def _store(self, storage) -> Store:
        if not isinstance(storage, MMReplayStorage):
            raise TypeError(f"{type(self).__name__} samples an MMReplayStorage, got {type(storage).__name__}")
        return storage._require_store()

    def sample(self, storage, batch_size: int):
        store = self._store(storage)
        rows = self._rows(batch_size)

        def draw():
            ids, extras, lo = self._draw_readable(store, rows)
            flat, info = self._finish(ids, extras)
            return flat, torch.from_numpy(flat - lo), info

        ids, index, info = draw()
        return storage._pin(Drawn(ids, index, info, draw)), info

    def _draw_readable(self, store: Store, rows: int):
        """``rows`` rows of ids that ``get`` accepts: the rows holding an id below ``readable_range()[0]``
        (held, but its frame stack is gone) are drawn again."""
        ids, extras = self._draw_rows(store, rows)
        for _ in range(RACE_RETRIES):
            lo, _head = store.inspect.readable_range()
            flat = ids.reshape(rows, -1)
            bad = ((flat >= 0) & (flat < lo)).any(axis=1)
            if not bad.any():
                return ids, extras, lo
            new_ids, new_extras = self._draw_rows(store, int(bad.sum()))
            ids[bad] = new_ids
            for name, values in extras.items():
                values[bad] = new_extras[name]
        raise RuntimeError(f"{type(self).__name__}: {RACE_RETRIES} draws in a row held transitions below the "
                           f"store's readable range (readable_range() = {store.inspect.readable_range()})")

    def _rows(self, batch_size: int) -> int:
        return batch_size

    def _draw_rows(self, store: Store, rows: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        raise NotImplementedError

    def _finish(self, ids: np.ndarray, extras: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        return ids.reshape(-1), {}

    def _empty(self):
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state_dict["rng"]

    def dumps(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sampler_state.json"), "w") as f:
            json.dump(self.state_dict(), f)

    def loads(self, path):
        with open(os.path.join(path, "sampler_state.json")) as f:
            self.load_state_dict(json.load(f))


class MMReplayRandomSampler(StoreSampler):
    """Uniform over readable transitions, drawn by the store (never an id whose frame stack is gone)."""

    def _draw_rows(self, store, rows):
        g, _ = store.inspect.draw(Uniform(), rows, self.rng)
        return g, {}


class MMReplayPrioritizedSampler(StoreSampler):
    """Proportional prioritized replay in the store: priorities keyed by the store's transition ids,
    committed with it (``dumps`` / ``flush``) and reopened exactly. ``info["priority_weight"]`` holds the
    importance weights; give new priorities with ``rb.update_priority(sample["index"], td_error)``."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, name: str = "torchrl",
                 seed: int | None = None):
        super().__init__(seed)
        self.alpha, self.beta, self.eps, self.name = alpha, beta, eps, name
        self._held: tuple[Store, Any] | None = None  # (store, its sampler ``name``): the set is updated through it

    def _prioritized(self, store: Store):
        """The store's prioritized sampler ``name`` (made once per store, as a distributed shard does): the
        one way to update the set's priorities; its set (``alpha``, ``eps``) is what ``sample`` draws by."""
        held = self._held
        if held is None or held[0] is not store or held[1].closed:
            if held is not None and held[0] is not store:
                held[1].close()  # the storage reopened its store: the old store's sampler goes with it
            smp = store.sampler(1, self._draw(), name=self.name, prefetch=0)
            self._held = held = (store, smp)
        return held[1]

    def _draw(self) -> Prioritized:
        """The draw by the set ``name``, with the exponents assigned now (a set takes them when they change)."""
        return Prioritized(self.alpha, self.beta, self.eps, name=self.name)

    def _draw_rows(self, store, rows):
        self._prioritized(store)
        g, w = store.inspect.draw(self._draw(), rows, self.rng)
        return g, {"priority_weight": w}

    def _finish(self, ids, extras):
        return ids.reshape(-1), {"priority_weight": torch.from_numpy(extras["priority_weight"])}

    def update_priority(self, index, priority, *, storage=None) -> None:
        if storage is None:
            raise ValueError("MMReplayPrioritizedSampler.update_priority needs the storage (ReplayBuffer passes it)")
        store = self._store(storage)
        smp = self._prioritized(store)
        lo, _ = store.inspect.readable_range()
        pos = np.asarray(index.detach().cpu() if hasattr(index, "detach") else index, dtype=np.int64).reshape(-1)
        p = np.asarray(priority.detach().cpu() if hasattr(priority, "detach") else priority, dtype=np.float64)
        smp.update_priorities(lo + pos, p.reshape(-1))


class MMReplaySliceSampler(StoreSampler):
    """Slices of ``slice_len`` consecutive steps of one episode and stream (``num_slices`` of them, or
    ``batch_size // slice_len``), walked in the store's episode links, so vector-env streams may
    interleave. ``strict_length=False`` pads short slices by repeating their last step and marks the
    padding False in ``info["mask"]``. The index is flat, slice after slice, as TorchRL's SliceSampler's."""

    def __init__(self, *, slice_len: int | None = None, num_slices: int | None = None, strict_length: bool = True,
                 sample_from: str = "episodes", seed: int | None = None):
        super().__init__(seed)
        if (slice_len is None) == (num_slices is None):
            raise ValueError(f"give exactly one of slice_len and num_slices, got slice_len={slice_len!r}, "
                             f"num_slices={num_slices!r}")
        self.slice_len, self.num_slices = slice_len, num_slices
        self.strict_length, self.sample_from = strict_length, sample_from
        Sequences(slice_len or 1, strict=strict_length, sample_from=sample_from)  # bad options fail here
        self._draws: dict[int, Sequences] = {}
        self._seq_len = 0

    def _rows(self, batch_size: int) -> int:
        if self.slice_len is not None:
            seq_len, n = self.slice_len, batch_size // self.slice_len
        else:
            seq_len, n = batch_size // self.num_slices, self.num_slices
        if n < 1 or seq_len < 1 or n * seq_len != batch_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of slice_len/num_slices "
                             f"(slice_len={self.slice_len}, num_slices={self.num_slices})")
        self._seq_len = seq_len
        return n

    def _draw_rows(self, store, rows):
        seq_len = self._seq_len
        draw = self._draws.get(seq_len)
        if draw is None:  # kept: its episode table is reused while the store is unchanged
            draw = self._draws[seq_len] = Sequences(seq_len, strict=self.strict_length, sample_from=self.sample_from)
        ids, _ = store.inspect.draw(draw, rows, self.rng)
        return ids, {}

    def _finish(self, ids, extras):
        mask = ids >= 0
        last = np.maximum.accumulate(np.where(mask, ids, -1), axis=1)  # padding repeats the last real step
        return last.reshape(-1), {"mask": torch.from_numpy(mask.reshape(-1))}
