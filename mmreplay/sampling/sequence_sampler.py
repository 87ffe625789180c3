"""SequenceSampler: batches of episode slices (``sampling/sequences.py``) with the ``Sampler``'s lifecycle.

Invariants (those of ``Sampler``, whose iteration, prefetch thread, reused slots, CUDA event, close and
saved RNG state this class shares; it changes only the buffers of a batch and how a batch is drawn):
- Batches come out in the order the RNG drew them; ``state`` is the RNG state after the last batch
  handed out, committed with the store under the sampler's ``name`` (default ``"sequence"``, so a
  transition sampler's ``"default"`` state and priorities are never mixed with a sequence sampler's).
- Host buffers are reused: a CPU batch is valid until the next ``next()`` call.
- Prioritized: one priority per slice *start* (the priority set ``name``, persisted with the store);
  ``update_priorities(batch, td_errors)`` turns per-step errors into R2D2's max/mean mix.

Nothing here knows the ``Store``: it is given the schema, a ``fill`` that draws one batch under the
store's lock, and (prioritized) the priority set with its ``update``.
"""

from __future__ import annotations

from typing import Callable

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.sampler import Sampler, UpdateFn, check_sampler_args
from mmreplay.sampling.sequences import (DEFAULT_ETA, SequenceBatch, SequenceBuffers, SequenceSpec, StartDrawer,
                                         sequence_priority, validate_sequence)

DEFAULT_SEQUENCE_NAME = "sequence"

# fill(buffers, drawer, rng, *, priorities, beta): draw windows with drawer into buffers (the store's, locked)
SequenceFillFn = Callable[..., None]


def check_sequence_args(schema: Schema, batch_size, name, beta, seq_len, burn_in, strict, sample_from,
                        prioritized: bool, eta) -> tuple[SequenceSpec, float]:
    """Refuse bad sequence sampler arguments before anything is made for the sampler; returns the checked
    ``(spec, eta)``."""
    check_sampler_args(schema, batch_size, name, beta, 1, 1.0)
    spec = validate_sequence(seq_len, burn_in, strict, sample_from)
    if prioritized and sample_from != "steps":
        raise ValueError(f"prioritized slices are drawn by priority, not {sample_from!r}; leave sample_from "
                         "at 'steps' with prioritized=True")
    if not 0.0 <= float(eta) <= 1.0:
        raise ValueError(f"eta (R2D2's max/mean mix) must lie in [0, 1], got {eta!r}")
    return spec, float(eta)


class SequenceSampler(Sampler):
    """An iterator of ``SequenceBatch``es (make it with ``Store.sampler(B, seq_len=L)`` or
    ``Store.sequence_sampler``). What users must know is ``Sampler``'s (reused buffers, ``seed`` and
    resume, prefetch, close), plus: ``update_priorities(batch, td_errors)`` for prioritized slices."""

    def __init__(self, schema: Schema, fill: SequenceFillFn, batch_size: int, seq_len: int, *, burn_in: int = 0,
                 strict: bool = True, sample_from: str = "steps", device=None, prefetch: int | None = None,
                 seed: int | None = None, name: str = DEFAULT_SEQUENCE_NAME, pin_memory: bool | None = None,
                 priorities: Priorities | None = None, update: UpdateFn | None = None, beta: float = 0.4,
                 eta: float = DEFAULT_ETA, saved_state: dict | None = None):
        """Slices of ``seq_len`` steps after ``burn_in`` steps of context from the store whose columns
        ``schema`` describes; ``fill(buffers, drawer, rng, priorities=, beta=)`` draws one batch under the
        store's lock; ``priorities`` (with ``update``) make it prioritized; ``saved_state`` is the committed
        RNG state of ``name`` (continued when ``seed`` is None)."""
        self.spec, self.eta = check_sequence_args(schema, batch_size, name, beta, seq_len, burn_in, strict,
                                                  sample_from, priorities is not None, eta)
        self.drawer = StartDrawer(self.spec, schema.frame_stack)  # keeps its episode table between batches
        super().__init__(schema, fill, batch_size, device=device, prefetch=prefetch, seed=seed, name=name,
                         pin_memory=pin_memory, priorities=priorities, update=update, beta=beta, n_step=1,
                         gamma=1.0, saved_state=saved_state)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def burn_in(self) -> int:
        return self.spec.burn_in

    # -- Sampler's hooks --------------------------------------------------------------------------
    def _new_buffers(self, pin_memory: bool) -> SequenceBuffers:
        return SequenceBuffers(self.schema, self.batch_size, self.spec, pin_memory=pin_memory,
                               weights=self.priorities is not None)

    def _draw_into(self, buffers: SequenceBuffers) -> None:
        self._fill_fn(buffers, self.drawer, self.rng, priorities=self.priorities, beta=self._beta)

    def sample(self) -> SequenceBatch:
        """The next batch of slices."""
        return super().sample()

    def update_priorities(self, indices, priorities=None, mask=None) -> int:
        """New priorities for sampled slices. Either ``update_priorities(batch, td_errors)`` with per-step
        errors ``(B, seq_len)`` (or ``(B, burn_in + seq_len)``; burn-in steps are left out; or any width
        with a ``mask`` of the same shape): each slice's priority is R2D2's
        ``eta * max|td| + (1 - eta) * mean|td|`` over its real (masked) steps; or
        ``update_priorities(batch.start, p)`` with one priority per slice. Returns how many were updated."""
        if self.priorities is None:
            raise RuntimeError("this sampler is uniform; make it with prioritized=True to update priorities")
        if isinstance(indices, SequenceBatch):
            td, m = self._errors_and_mask(indices, priorities, mask)
            return super().update_priorities(indices.start.cpu(), sequence_priority(td, m, self.eta))
        return super().update_priorities(indices, priorities)

    def _errors_and_mask(self, batch: SequenceBatch, td_errors, mask) -> tuple[np.ndarray, np.ndarray]:
        td = td_errors.detach().cpu().numpy() if hasattr(td_errors, "detach") else np.asarray(td_errors)
        n = batch.mask.shape[0]
        if td.ndim != 2 or td.shape[0] != n:
            raise ValueError(f"td_errors must be shaped (batch, steps) with batch {n}, got {td.shape}")
        full = batch.mask.cpu().numpy()
        if mask is not None:
            m = mask.detach().cpu().numpy() if hasattr(mask, "detach") else np.asarray(mask)
            if m.shape != td.shape:
                raise ValueError(f"mask shape {m.shape} does not match td_errors shape {td.shape}")
            return td, m.astype(bool)
        if td.shape[1] == self.spec.width:
            return td[:, self.burn_in:], full[:, self.burn_in:]
        if td.shape[1] == self.seq_len:
            return td, full[:, self.burn_in:]
        raise ValueError(f"td_errors has {td.shape[1]} steps: give errors for {self.seq_len} (or burn_in + seq_len "
                         f"= {self.spec.width}) steps, or a mask= of the same shape")

