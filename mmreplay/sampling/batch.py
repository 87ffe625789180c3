"""A sampled batch and how it is assembled from the index ring and the frame ring.

Invariant: ``assemble`` writes transition ``indices[i]`` into row ``i`` of every output buffer —
observation stacks and next-observation stacks rebuilt from frames stored once, packed columns decoded
to their values — and touches nothing else. torch is imported only by the functions that make or move
tensors, so that opening a store without sampling from it (``mmreplay info``) does not load torch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where it is used: a store opened for info, verify or export never loads it

from mmreplay.columns.spec import Schema
from mmreplay.index.ring import TransitionRing
from mmreplay.sampling.nstep import NStepResult
from mmreplay.reading.frames import FrameReader


@dataclass
class Batch:
    """A batch of transitions as torch tensors, row ``i`` of every field being one transition.

    ``obs``/``next_obs`` are ``(batch, *obs_shape)`` or, with ``frame_stack=k > 1``, ``(batch, k,
    *obs_shape)`` stacks (oldest frame first; a dict of them for Dict observation spaces). ``indices``
    are global transition ids, stable across reopen: pass them to ``Sampler.update_priorities`` or
    ``store.inspect.get``. ``weights`` (``Prioritized`` draws) and ``discount`` (``NStep``) are None
    otherwise; with ``NStep``, ``reward`` is the n-step return and ``next_obs`` the observation after the
    window.

    A batch from ``Store.sampler`` lives in reused buffers: on CPU it is valid until the sampler's next
    batch; copy (``.clone()``) what you keep. ``Store.sample`` and ``store.inspect.get`` return fresh tensors.
    ``numpy()`` gives the batch as numpy arrays (copies by default) for numpy and JAX code.
    """

    obs: Any  # torch.Tensor, or dict of them for Dict observation spaces
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: Any
    terminated: torch.Tensor
    truncated: torch.Tensor
    indices: torch.Tensor  # global transition ids (stable across reopen)
    extras: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None  # importance-sampling weights (prioritized sampling)
    discount: torch.Tensor | None = None  # gamma ** m for n-step returns over m steps (NStep draws)

    def to(self, device, non_blocking: bool = False) -> "Batch":
        import torch

        def move(x):
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x
        return Batch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def pin_memory(self) -> "Batch":
        """For ``DataLoader(pin_memory=True)``."""
        import torch

        def pin(x):
            if isinstance(x, dict):
                return {k: pin(v) for k, v in x.items()}
            return x.pin_memory() if isinstance(x, torch.Tensor) else x
        return Batch(**{f.name: pin(getattr(self, f.name)) for f in fields(self)})

    @property
    def dones(self) -> torch.Tensor:
        return self.terminated | self.truncated

    def numpy(self, copy: bool = True) -> dict[str, Any]:
        """The batch as numpy arrays: a dict of this batch's fields (``obs``, ``action``, ``reward``,
        ``next_obs``, ``terminated``, ``truncated``, ``indices``, ``extras``, ``weights``, ``discount``),
        with the same shapes and dtypes; ``obs``/``next_obs`` and ``extras`` are dicts where the batch has
        dicts, and ``weights``/``discount`` None where the batch has None.

        ``copy=True`` (the default): arrays of their own, never changed by the sampler afterwards; keep
        them, or hand them to ``jnp.asarray`` / ``jax.device_put``.
        ``copy=False``: views of the batch's tensors, no copy. They are valid exactly as long as the
        batch: for a batch from ``Store.sampler`` on CPU, until the sampler's next batch, which
        overwrites them in place. Only CPU tensors have views: a batch on an accelerator is refused
        (use ``copy=True``)."""
        return {f.name: as_numpy(getattr(self, f.name), copy) for f in fields(self)}


def as_numpy(value, copy: bool):
    """A tensor (or a dict of them, or None) as numpy: a copy, or with ``copy=False`` a view of the
    tensor's memory (CPU tensors only)."""
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: as_numpy(v, copy) for k, v in value.items()}
    if value.device.type != "cpu":
        if not copy:
            raise ValueError(f"numpy(copy=False): a tensor on {value.device} has no numpy view; expected a "
                             "CPU batch (numpy(copy=True) copies it to host memory)")
        return value.detach().cpu().numpy()  # .cpu() made the copy
    array = value.detach().numpy()
    return array.copy() if copy else array


FLAG_TABLE = np.array([False, True])


def check_host_memory(batch_size: int, row_nbytes: int) -> None:
    """Refuse a batch whose buffers alone would not fit in this machine's memory, before allocating them."""
    need = batch_size * row_nbytes
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if need > have // 2:
        raise ValueError(f"batch_size {batch_size} needs {need / 2**30:.1f} GiB of buffers, more than half of this "
                         f"machine's memory ({have / 2**30:.1f} GiB)")


class BatchBuffers:
    """Preallocated host tensors for one batch of a store with ``schema`` (pinned when asked), with numpy
    views onto them. ``batch()`` wraps them as a ``Batch`` without copying. ``numpy=True``: numpy arrays
    instead of tensors (the batch's fields are then arrays), and torch is not imported (``mmreplay export``)."""

    def __init__(self, schema: Schema, batch_size: int, pin_memory: bool = False, *, weights: bool = False,
                 nstep: bool = False, numpy: bool = False):
        k = schema.frame_stack
        self.schema = schema
        self.batch_size = batch_size
        check_host_memory(batch_size, (2 * k * sum(s.row_nbytes for s in schema.observations)
                                       + sum(8 * max(1, s.row_nbytes) for s in schema.transition_columns) + 32))

        def alloc(shape, dtype):
            if numpy:
                a = np.empty(shape, dtype=dtype)
                return a, a
            import torch

            t = torch.empty(shape, dtype=_torch_dtype(dtype), pin_memory=pin_memory)
            return t, t.numpy()

        self.obs, self.next_obs = {}, {}
        self.stack_words = {}  # name -> (obs, next_obs) as (n * k, words) views for the compiled gather
        for spec in schema.observations:
            shape = (batch_size, k, *spec.shape) if k > 1 else (batch_size, *spec.shape)
            self.obs[spec.name] = alloc(shape, spec.np_dtype)
            self.next_obs[spec.name] = alloc(shape, spec.np_dtype)
            self.stack_words[spec.name] = (FrameReader.stack_words(self.obs[spec.name][1], spec.row_nbytes),
                                           FrameReader.stack_words(self.next_obs[spec.name][1], spec.row_nbytes))
        self.columns = {}
        self.decode_tables = {}  # packed columns: code -> value, in the output's dtype
        for spec in schema.transition_columns:
            dtype = spec.np_dtype
            if spec.name == "action" and spec.shape == () and dtype.kind in "iu":
                dtype = np.dtype(np.int64)  # discrete actions index Q-values: torch wants int64
            if spec.name == "reward" and nstep and dtype.kind != "f":
                dtype = np.dtype(np.float32)  # a discounted sum of integer rewards is not an integer
            self.columns[spec.name] = alloc((batch_size, *spec.shape), dtype)
            if spec.kind == "packed":
                self.decode_tables[spec.name] = np.asarray(spec.values).astype(dtype)
        self.terminated = alloc((batch_size,), np.bool_)
        self.truncated = alloc((batch_size,), np.bool_)
        self.indices = alloc((batch_size,), np.int64)
        self.weights = alloc((batch_size,), np.float32) if weights else None
        self.discount = alloc((batch_size,), np.float32) if nstep else None
        self._fields: dict | None = None  # what batch() wraps, made at its first call

    def rows(self, lo: int, hi: int) -> "BatchBuffers":
        """Buffers for rows ``[lo, hi)`` of these, sharing their memory: a batch drawn into the view lands in
        those rows (how a batch split over several stores is assembled without a copy)."""
        if not 0 <= lo <= hi <= self.batch_size:
            raise ValueError(f"rows [{lo}, {hi}) are not inside a batch of {self.batch_size}")
        view = object.__new__(BatchBuffers)
        view.schema, view.batch_size, view.decode_tables = self.schema, hi - lo, self.decode_tables
        view._fields = None

        def cut(pair):
            return None if pair is None else (pair[0][lo:hi], pair[1][lo:hi])

        view.obs = {k: cut(v) for k, v in self.obs.items()}
        view.next_obs = {k: cut(v) for k, v in self.next_obs.items()}
        view.stack_words = {spec.name: (FrameReader.stack_words(view.obs[spec.name][1], spec.row_nbytes),
                                        FrameReader.stack_words(view.next_obs[spec.name][1], spec.row_nbytes))
                            for spec in self.schema.observations}
        view.columns = {k: cut(v) for k, v in self.columns.items()}
        for name in ("terminated", "truncated", "indices", "weights", "discount"):
            setattr(view, name, cut(getattr(self, name)))
        return view

    def batch(self) -> Batch:
        """A new ``Batch`` of these buffers' tensors (a new object each time: a caller may reassign its
        fields; only the tensors are shared)."""
        if self._fields is None:
            self._fields = self._batch_fields()
        fields_ = self._fields
        return Batch(fields_["obs"], fields_["action"], fields_["reward"], fields_["next_obs"], fields_["terminated"],
                     fields_["truncated"], fields_["indices"], dict(fields_["extras"]), fields_["weights"],
                     fields_["discount"])

    def _batch_fields(self) -> dict:
        obs = {k: t for k, (t, _) in self.obs.items()}
        next_obs = {k: t for k, (t, _) in self.next_obs.items()}
        if not self.schema.dict_obs:
            obs, next_obs = obs["obs"], next_obs["obs"]
        return {"obs": obs, "action": self.columns["action"][0], "reward": self.columns["reward"][0],
                "next_obs": next_obs, "terminated": self.terminated[0], "truncated": self.truncated[0],
                "indices": self.indices[0], "extras": {c.name: self.columns[c.name][0] for c in self.schema.extras},
                "weights": self.weights[0] if self.weights is not None else None,
                "discount": self.discount[0] if self.discount is not None else None}


def assemble(ring: TransitionRing, frames: FrameReader, g: np.ndarray, obs_ids: np.ndarray, next_ids: np.ndarray,
             buf: BatchBuffers, *, weights: np.ndarray | None = None, nstep: NStepResult | None = None) -> None:
    """Fill ``buf`` with transitions ``g`` of ``ring`` whose frame stacks in ``frames`` are ``obs_ids`` /
    ``next_ids`` (n, k); with ``nstep``, reward, flags and discount come from the n-step windows
    (``next_ids`` are then the stacks after each window's last transition)."""
    zero_pad = buf.schema.stack_padding == "zeros" and buf.schema.frame_stack > 1
    for name, (_, obs_a) in buf.obs.items():
        next_a = buf.next_obs[name][1]
        frames.gather_stacks(name, obs_ids, next_ids, *buf.stack_words[name], shifted=nstep is None)
        if zero_pad:
            # Within an episode every position of a stack has its own frame; a frame id equal to the next
            # position's is padding before the episode's first frame.
            for out, ids in ((obs_a, obs_ids), (next_a, next_ids)):
                pad = np.zeros(ids.shape, dtype=bool)
                pad[:, :-1] = ids[:, :-1] == ids[:, 1:]
                if pad.any():
                    out[pad] = 0
    slots = ring.slot(g)
    for name, (_, out) in buf.columns.items():
        ring.read_into(name, slots, out, buf.decode_tables.get(name))
    if nstep is None:
        ring.read_flags_into(slots, buf.terminated[1], buf.truncated[1])
    else:
        buf.columns["reward"][1][...] = nstep.reward
        buf.terminated[1][...] = nstep.terminated
        buf.truncated[1][...] = nstep.truncated
        buf.discount[1][...] = nstep.discount
    if weights is not None:
        buf.weights[1][...] = weights
    buf.indices[1][...] = g


_TORCH_DTYPE_NAMES = ("bool", "uint8", "int8", "int16", "int32", "int64", "float16", "float32", "float64", "uint16",
                      "uint32", "uint64")


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    import torch

    name = np.dtype(dtype).name
    if name not in _TORCH_DTYPE_NAMES:
        raise TypeError(f"dtype {dtype} has no torch equivalent")
    return getattr(torch, name)
