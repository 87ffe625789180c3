"""Sampler: random valid transitions (uniform or prioritized, optionally with n-step returns), decoded
into reused (pinned) buffers, prefetched.

Invariants:
- Batches come out in the order the RNG drew them, so ``seed`` alone fixes the sequence (one producer
  thread; the store's lock keeps adds out while a batch is assembled, so a batch never mixes states).
- ``state`` is the RNG state after the last batch handed to the caller (not after the prefetched ones);
  the store persists it at each commit, so a reopened store's sampler continues the same sequence.
- Host buffers are reused: a CPU batch is valid until the next ``next()`` call (copy it to keep it);
  with a CUDA ``device`` the batch lives on the device and the host buffer is reused only after the
  asynchronous copy finished (a CUDA event guards it).
"""

from __future__ import annotations

import queue
import threading
from typing import Any, Callable

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.sampling.batch import Batch, BatchBuffers
from mmreplay.sampling.nstep import check_nstep
from mmreplay.sampling.priorities import Priorities, check_exponent, check_name
from mmreplay.storage import forking
from mmreplay.storage.meta import validate_capacity

DEFAULT_ACCELERATOR_PREFETCH = 2

# fill(buffers, rng, *, priorities, beta, n_step, gamma): draw one batch into buffers (the store's, locked)
FillFn = Callable[..., None]
# update(priorities_set, indices, values) -> how many were updated (the store's, locked)
UpdateFn = Callable[[Priorities, Any, Any], int]


def check_sampler_args(schema: Schema, batch_size, name, beta, n_step, gamma) -> tuple[int, float]:
    """Refuse bad sampler arguments before anything is made for the sampler; returns ``(n_step, gamma)``."""
    validate_capacity(batch_size, "batch_size")
    check_name(name)
    n_step, gamma = check_nstep(n_step, gamma)
    if n_step > 1 and schema.reward.shape != ():
        raise ValueError(f"n-step returns need a scalar reward column, this store's has shape {schema.reward.shape}")
    check_exponent(beta, "beta")
    return n_step, gamma


class _Slot:
    def __init__(self, buffers: BatchBuffers):
        self.buffers = buffers
        self.state_after: dict | None = None
        self.copied: Any = None  # CUDA event recorded after the device copy


class Sampler:
    """An iterator of training batches from one store (make it with ``Store.sampler``).

    What users must know:
    - Batches live in reused buffers: on CPU a batch is valid until the next ``next()``; ``.clone()``
      what you keep. With a CUDA ``device`` each batch is a device copy and stays valid.
    - ``seed`` fixes the sequence; with ``seed=None`` a reopened store's sampler of the same ``name``
      continues the committed RNG state (the state after the last batch handed out, not after prefetched
      ones). One open sampler per name and store.
    - Prioritized samplers draw proportionally to ``(priority + eps) ** alpha`` and set
      ``batch.weights``; report new priorities with ``update_priorities(batch.indices, td.abs())``:
      the one way to update them. They are committed with the store.
    - Close it (or use ``with``) to stop its prefetch thread; closing the store closes it too.
    """

    def __init__(self, schema: Schema, fill: FillFn, batch_size: int, *, device=None, prefetch: int | None = None,
                 seed: int | None = None, name: str = "default", pin_memory: bool | None = None,
                 priorities: Priorities | None = None, update: UpdateFn | None = None, beta: float = 0.4,
                 n_step: int = 1, gamma: float = 0.99, saved_state: dict | None = None):
        """A sampler over the store whose columns ``schema`` describes; ``fill`` draws one batch into
        buffers under the store's lock; ``priorities`` (with ``update``) make it prioritized; ``saved_state``
        is the committed RNG state of ``name`` (continued when ``seed`` is None)."""
        import torch  # here, not at module level: a store opened without sampling never loads torch

        self.n_step, self.gamma = check_sampler_args(schema, batch_size, name, beta, n_step, gamma)
        self._beta = float(beta)
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
        if prefetch is None:
            # Measured on a 2-core CPU box: a producer thread competes with the training step for the GIL
            # and the cores (97 vs 66 DQN steps/s), so it pays only when the step runs on an accelerator.
            prefetch = DEFAULT_ACCELERATOR_PREFETCH if device is not None and torch.device(device).type != "cpu" \
                else 0
        if not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        self.schema = schema
        self._fill_fn = fill
        self._update_fn = update
        self.batch_size = int(batch_size)
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        self.name = name
        self.priorities = priorities
        self.rng = np.random.Generator(np.random.PCG64(seed))
        if seed is None and saved_state is not None:
            self.rng.bit_generator.state = saved_state  # continue the sequence the store was committed with
        # The RNG state after the last batch handed out. Without prefetch that is the RNG's own state, read
        # when asked (copying it costs ~2 us a batch); with prefetch the RNG runs ahead, so each slot keeps it.
        self._state: dict | None = self.rng.bit_generator.state if prefetch else None
        cuda = self.device is not None and self.device.type == "cuda"
        pin = cuda if pin_memory is None else bool(pin_memory)
        n_slots = prefetch + 2 if prefetch else 1
        self._slots = [_Slot(self._new_buffers(pin)) for _ in range(n_slots)]
        self._cuda = cuda
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._held: _Slot | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.closed = False
        for slot in self._slots:
            self._free.put(slot)
        forking.register(self)

    # -- what a subclass changes (SequenceSampler): the buffers of one batch and how a batch is drawn ----
    def _new_buffers(self, pin_memory: bool) -> BatchBuffers:
        """Host buffers for one batch of ``batch_size`` (one per slot, reused)."""
        return BatchBuffers(self.schema, self.batch_size, pin_memory=pin_memory, weights=self.priorities is not None,
                            nstep=self.n_step > 1)

    def _draw_into(self, buffers) -> None:
        """Draw the next batch of this sampler's sequence into ``buffers`` (advances ``rng``)."""
        self._fill_fn(buffers, self.rng, priorities=self.priorities, beta=self._beta, n_step=self.n_step,
                      gamma=self.gamma)

    @property
    def beta(self) -> float:
        """Importance-sampling exponent (anneal it by assigning; prefetched batches keep the old one)."""
        return self._beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._beta = check_exponent(value, "beta")

    def update_priorities(self, indices, priorities) -> int:
        """Set the priorities (e.g. ``|TD error|``) of transitions this sampler returned (``batch.indices``).
        New transitions enter at the largest priority given so far. Returns how many were updated
        (transitions overwritten since they were sampled are skipped)."""
        if self.priorities is None:
            raise RuntimeError("this sampler is uniform; make it with prioritized=True to update priorities")
        return self._update_fn(self.priorities, indices, priorities)

    # -- iteration --------------------------------------------------------------------------------
    def __iter__(self) -> "Sampler":
        return self

    def __next__(self) -> Batch:
        return self.sample()

    def sample(self) -> Batch:
        """The next batch."""
        if self.closed:
            raise RuntimeError("sampler is closed")
        if self.prefetch == 0:  # one slot, filled in this thread: no queues
            slot = self._slots[0]
            self._fill(slot, keep_state=False)
        else:
            if self._held is not None:
                self._free.put(self._held)
                self._held = None
            self._ensure_thread()
            slot = self._ready.get()
            if isinstance(slot, BaseException):
                self.close()
                raise slot
        self._held = slot
        self._state = slot.state_after
        batch = slot.buffers.batch()
        if self.device is not None and self.device.type != "cpu":
            batch = batch.to(self.device, non_blocking=self._cuda)
            if self._cuda:
                import torch

                slot.copied = torch.cuda.Event()
                slot.copied.record()
        return batch

    @property
    def state(self) -> dict:
        """The RNG state after the last batch handed out (what the store commits for this sampler's name)."""
        return self.rng.bit_generator.state if self._state is None else self._state

    def _fill(self, slot: _Slot, keep_state: bool = True) -> None:
        if slot.copied is not None:
            slot.copied.synchronize()  # the previous device copy from these host buffers is done
            slot.copied = None
        self._draw_into(slot.buffers)
        slot.state_after = self.rng.bit_generator.state if keep_state else None

    def sample_into(self, buffers: BatchBuffers) -> Batch:
        """Draw the next batch of this sampler's sequence into caller-owned ``buffers`` (a ``BatchBuffers``
        of any batch size, e.g. a distributed shard's part of a batch) and return it (no prefetch)."""
        self.draw_into(buffers)
        return buffers.batch()

    def draw_into(self, buffers: BatchBuffers) -> None:
        """``sample_into`` without making the ``Batch`` (for callers that assemble their own from several
        parts)."""
        if self.closed:
            raise RuntimeError("sampler is closed")
        if self.prefetch:
            raise RuntimeError("sample_into draws in the caller's thread: make the sampler with prefetch=0")
        self._draw_into(buffers)
        self._state = None  # no batch drawn ahead: the RNG's own state

    def _ensure_thread(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._produce, name="mmreplay-prefetch", daemon=True)
            self._thread.start()

    def _produce(self) -> None:
        while not self._stop.is_set():
            slot = self._free.get()
            if slot is None:
                return
            try:
                self._fill(slot)
            except BaseException as exc:  # handed to the consumer, which re-raises it
                self._ready.put(exc)
                return
            self._ready.put(slot)

    # -- lifecycle --------------------------------------------------------------------------------
    def _after_fork_in_child(self) -> None:
        """A forked child has no prefetch thread, and the queues' locks may be held: never touch them."""
        self.closed = True

    def close(self) -> None:
        """Stop the prefetch thread (batches already handed out stay valid until their buffers are reused)."""
        if self.closed:
            return
        self.closed = True
        self._stop.set()
        self._free.put(None)
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=10)

    def __enter__(self) -> "Sampler":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass
