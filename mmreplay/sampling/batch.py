"""A sampled batch and how it is assembled from the index ring and the frame ring.

Invariant: ``assemble`` writes transition ``indices[i]`` into row ``i`` of every output buffer —
observation stacks and next-observation stacks rebuilt from frames stored once, packed columns decoded
to their values — and touches nothing else.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from mmreplay.reading.frames import FrameReader

if TYPE_CHECKING:  # pragma: no cover
    from mmreplay.sampling.nstep import NStepResult
    from mmreplay.store import Store


@dataclass
class Batch:
    obs: Any  # torch.Tensor, or dict of them for Dict observation spaces
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: Any
    terminated: torch.Tensor
    truncated: torch.Tensor
    indices: torch.Tensor  # global transition ids (stable across reopen)
    extras: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None  # importance-sampling weights (prioritized sampling)
    discount: torch.Tensor | None = None  # gamma ** m for n-step returns over m steps (n_step > 1)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        def move(x):
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x
        return Batch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def pin_memory(self) -> "Batch":
        """For ``DataLoader(pin_memory=True)``."""
        def pin(x):
            if isinstance(x, dict):
                return {k: pin(v) for k, v in x.items()}
            return x.pin_memory() if isinstance(x, torch.Tensor) else x
        return Batch(**{f.name: pin(getattr(self, f.name)) for f in fields(self)})

    @property
    def dones(self) -> torch.Tensor:
        return self.terminated | self.truncated


FLAG_TABLE = np.array([False, True])


def check_host_memory(batch_size: int, row_nbytes: int) -> None:
    """Refuse a batch whose buffers alone would not fit in this machine's memory, before allocating them."""
    need = batch_size * row_nbytes
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 2:
        raise ValueError(f"batch_size {batch_size} needs {need / 2**30:.1f} GiB of buffers, more than half of this "
                         f"machine's memory ({have / 2**30:.1f} GiB)")


class BatchBuffers:
    """Preallocated host tensors for one batch (pinned when asked), with numpy views onto them."""

    def __init__(self, store: "Store", batch_size: int, pin_memory: bool = False, *, weights: bool = False,
                 nstep: bool = False):
        k = store.frame_stack
        self.batch_size = batch_size
        check_host_memory(batch_size, (2 * k * sum(s.row_nbytes for s in store.schema.observations)
                                       + sum(8 * max(1, s.row_nbytes) for s in store.schema.transition_columns) + 32))

        def alloc(shape, dtype):
            t = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
            return t, t.numpy()

        self.obs, self.next_obs = {}, {}
        self.stack_words = {}  # name -> (obs, next_obs) as (n * k, words) views for the compiled gather
        for spec in store.schema.observations:
            shape = (batch_size, k, *spec.shape) if k > 1 else (batch_size, *spec.shape)
            self.obs[spec.name] = alloc(shape, _torch_dtype(spec.np_dtype))
            self.next_obs[spec.name] = alloc(shape, _torch_dtype(spec.np_dtype))
            self.stack_words[spec.name] = (FrameReader.stack_words(self.obs[spec.name][1], spec.row_nbytes),
                                           FrameReader.stack_words(self.next_obs[spec.name][1], spec.row_nbytes))
        self.columns = {}
        self.decode_tables = {}  # packed columns: code -> value, in the output's dtype
        for spec in store.schema.transition_columns:
            dtype = spec.np_dtype
            if spec.name == "action" and spec.shape == () and dtype.kind in "iu":
                dtype = np.dtype(np.int64)  # discrete actions index Q-values: torch wants int64
            if spec.name == "reward" and nstep and dtype.kind != "f":
                dtype = np.dtype(np.float32)  # a discounted sum of integer rewards is not an integer
            self.columns[spec.name] = alloc((batch_size, *spec.shape), _torch_dtype(dtype))
            if spec.kind == "packed":
                self.decode_tables[spec.name] = np.asarray(spec.values).astype(dtype)
        self.terminated = alloc((batch_size,), torch.bool)
        self.truncated = alloc((batch_size,), torch.bool)
        self.indices = alloc((batch_size,), torch.int64)
        self.weights = alloc((batch_size,), torch.float32) if weights else None
        self.discount = alloc((batch_size,), torch.float32) if nstep else None

    def batch(self, store: "Store") -> Batch:
        obs = {k: t for k, (t, _) in self.obs.items()}
        next_obs = {k: t for k, (t, _) in self.next_obs.items()}
        if not store.schema.dict_obs:
            obs, next_obs = obs["obs"], next_obs["obs"]
        extras = {c.name: self.columns[c.name][0] for c in store.schema.extras}
        return Batch(obs, self.columns["action"][0], self.columns["reward"][0], next_obs, self.terminated[0],
                     self.truncated[0], self.indices[0], extras,
                     weights=self.weights[0] if self.weights is not None else None,
                     discount=self.discount[0] if self.discount is not None else None)


def assemble(store: "Store", g: np.ndarray, obs_ids: np.ndarray, next_ids: np.ndarray, buf: BatchBuffers, *,
             weights: np.ndarray | None = None, nstep: "NStepResult | None" = None) -> None:
    """Fill ``buf`` with transitions ``g`` whose frame stacks are ``obs_ids`` / ``next_ids`` (n, k); with
    ``nstep``, reward, flags and discount come from the n-step windows (``next_ids`` are then the stacks
    after each window's last transition)."""
    frames = store._reader
    zero_pad = store.schema.stack_padding == "zeros" and store.frame_stack > 1
    for name, (obs_t, _) in buf.obs.items():
        next_t = buf.next_obs[name][0]
        frames.gather_stacks(name, obs_ids, next_ids, *buf.stack_words[name], shifted=nstep is None)
        if zero_pad:
            # Within an episode every position of a stack has its own frame; a frame id equal to the next
            # position's is padding before the episode's first frame.
            for out, ids in ((obs_t, obs_ids), (next_t, next_ids)):
                pad = np.zeros(ids.shape, dtype=bool)
                pad[:, :-1] = ids[:, :-1] == ids[:, 1:]
                if pad.any():
                    out[torch.from_numpy(pad)] = 0
    ring = store._ring
    slots = ring.slot(g)
    for name, (_, out) in buf.columns.items():
        ring.read_into(name, slots, out, buf.decode_tables.get(name))
    if nstep is None:
        ring.read_into("terminated", slots, buf.terminated[1], FLAG_TABLE)
        ring.read_into("truncated", slots, buf.truncated[1], FLAG_TABLE)
    else:
        buf.columns["reward"][1][...] = nstep.reward
        buf.terminated[1][...] = nstep.terminated
        buf.truncated[1][...] = nstep.truncated
        buf.discount[1][...] = nstep.discount
    if weights is not None:
        buf.weights[1][...] = weights
    buf.indices[1][...] = g


_TORCH_DTYPES = {np.dtype(k): v for k, v in {
    "bool": torch.bool, "uint8": torch.uint8, "int8": torch.int8, "int16": torch.int16, "int32": torch.int32,
    "int64": torch.int64, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64,
    "uint16": torch.uint16, "uint32": torch.uint32, "uint64": torch.uint64}.items()}


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    try:
        return _TORCH_DTYPES[np.dtype(dtype)]
    except KeyError:
        raise TypeError(f"dtype {dtype} has no torch equivalent") from None
