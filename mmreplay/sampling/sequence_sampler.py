"""SequenceSampler: batches of episode slices (``sampling/sequences.py``) with the ``Sampler``'s lifecycle.

Invariants (those of ``Sampler``, which this class shares its iteration, prefetch thread and close with):
- Batches come out in the order the RNG drew them; ``state`` is the RNG state after the last batch
  handed out, committed with the store under the sampler's ``name`` (default ``"sequence"``, so a
  transition sampler's ``"default"`` state and priorities are never mixed with a sequence sampler's).
- Host buffers are reused: a CPU batch is valid until the next ``next()`` call.
- Prioritized: one priority per slice *start* (the priority set ``name``, persisted with the store);
  ``update_priorities(batch, td_errors)`` turns per-step errors into R2D2's max/mean mix.
"""

from __future__ import annotations

import queue
import threading
from typing import TYPE_CHECKING

import numpy as np
import torch

from mmreplay.sampling.sampler import DEFAULT_ACCELERATOR_PREFETCH, Sampler, _Slot
from mmreplay.sampling.sequences import (DEFAULT_ETA, SequenceBatch, SequenceBuffers, StartDrawer, sequence_priority,
                                         validate_sequence)
from mmreplay.storage import forking

if TYPE_CHECKING:  # pragma: no cover
    from mmreplay.store import Store


class SequenceSampler(Sampler):
    def __init__(self, store: "Store", batch_size: int, seq_len: int, *, burn_in: int = 0, strict: bool = True,
                 sample_from: str = "steps", device=None, prefetch: int | None = None, seed: int | None = None,
                 name: str = "sequence", pin_memory: bool | None = None, prioritized: bool = False,
                 alpha: float | None = None, beta: float = 0.4, priority_eps: float | None = None,
                 eta: float = DEFAULT_ETA):
        from mmreplay.sampling.priorities import check_exponent, check_name
        from mmreplay.storage.meta import validate_capacity

        validate_capacity(batch_size, "batch_size")
        check_name(name)
        self.spec = validate_sequence(seq_len, burn_in, strict, sample_from)
        if prioritized and sample_from != "steps":
            raise ValueError(f"prioritized slices are drawn by priority, not {sample_from!r}; leave sample_from "
                             "at 'steps' with prioritized=True")
        if not 0.0 <= float(eta) <= 1.0:
            raise ValueError(f"eta (R2D2's max/mean mix) must lie in [0, 1], got {eta!r}")
        self.eta = float(eta)
        self._beta = check_exponent(beta, "beta")
        self.n_step, self.gamma = 1, 1.0
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
        if prefetch is None:  # as Sampler: a producer thread pays only when training runs on an accelerator
            prefetch = DEFAULT_ACCELERATOR_PREFETCH if device is not None and torch.device(device).type != "cpu" \
                else 0
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        self.store = store
        self.batch_size = int(batch_size)
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        self.name = name
        self.priorities = store.priorities(name, alpha=alpha, eps=priority_eps) if prioritized else None
        self.drawer = StartDrawer(self.spec, store.frame_stack)
        self.rng = np.random.Generator(np.random.PCG64(seed))
        saved = store._saved_sampler_state(name)
        if seed is None and saved is not None:
            self.rng.bit_generator.state = saved  # continue the sequence the store was committed with
        self.state = self.rng.bit_generator.state
        cuda = self.device is not None and self.device.type == "cuda"
        pin = cuda if pin_memory is None else bool(pin_memory)
        self._slots = [_Slot(SequenceBuffers(store.schema, self.batch_size, self.spec, pin_memory=pin,
                                             weights=prioritized))
                       for _ in range(prefetch + 2 if prefetch else 1)]
        self._cuda = cuda
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._held = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        for slot in self._slots:
            self._free.put(slot)
        store._register_sampler(self)
        forking.register(self)

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def burn_in(self) -> int:
        return self.spec.burn_in

    def sample(self) -> SequenceBatch:
        """The next batch of slices."""
        return super().sample()

    def _fill(self, slot: _Slot) -> None:
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous device copy from these host buffers is done
            slot.copied = None
        self.store.fill_sequence_batch(slot.buffers, self.drawer, self.rng, priorities=self.priorities,
                                       beta=self._beta)
        slot.state_after = self.rng.bit_generator.state

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
            return self.store.update_priorities(indices.start.cpu(), sequence_priority(td, m, self.eta),
                                                name=self.name)
        return self.store.update_priorities(indices, priorities, name=self.name)

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
