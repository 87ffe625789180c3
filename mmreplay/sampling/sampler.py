"""Sampler: batches of one draw strategy (``sampling/strategy.py``), decoded into reused (pinned) buffers,
prefetched.

Invariants:
- Batches come out in the order the RNG drew them, so ``seed`` alone fixes the sequence (one producer
  thread; the store's lock keeps adds out while a batch is assembled, so a batch never mixes states).
- ``state`` is the RNG state after the last batch handed to the caller (not after the prefetched ones);
  the store persists it at each commit, so a reopened store's sampler continues the same sequence.
- Host buffers are reused: a CPU batch is valid until the next ``next()`` call (copy it to keep it);
  with a CUDA ``device`` the batch lives on the device and the host buffer is reused only after the
  asynchronous copy finished (a CUDA event guards it).

Nothing here knows the ``Store``: a sampler is given a ``SamplerSource`` (the store's narrow view: one
race-checked read, its priority sets, the committed RNG states) and a strategy; arguments are checked
here, once, before anything is made for the sampler.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
from typing import Any, Protocol

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.device.pipeline import DevicePath
from mmreplay.sampling.batch import Batch
from mmreplay.sampling.priorities import Priorities, check_exponent, check_name
from mmreplay.sampling.strategy import DrawStrategy, Picked, Prioritized, check_strategy
from mmreplay.settings import check_device_cache_bytes
from mmreplay.storage.public import register_for_fork

DEFAULT_ACCELERATOR_PREFETCH = 2


class SamplerSource(Protocol):
    """What a sampler needs of its store (``Store``'s ``StoreView``), each call under the store's lock."""

    schema: Schema

    def read(self, draw: DrawStrategy, size: int, rng: np.random.Generator | None, buffers: Any = None) -> Picked:
        """One race-checked draw of ``size`` rows by ``draw``, assembled into ``buffers`` (None: ids only)."""

    def priorities(self, prioritized: Prioritized) -> Priorities:
        """The priority set ``prioritized`` draws by (made, with its exponents, on first use)."""

    def update_priorities(self, prioritized: Prioritized, indices, values) -> int:
        """Set priorities of the set ``prioritized`` draws by; returns how many were updated."""

    def saved_state(self, name: str) -> dict | None:
        """The committed RNG state of sampler ``name``."""

    def register(self, sampler: "Sampler") -> None:
        """``sampler`` is now the open sampler of its name (ValueError if another one is open)."""


def check_batch_size_arg(batch_size) -> int:
    """``batch_size`` as an int, if it is a positive integer."""
    if isinstance(batch_size, bool) or not isinstance(batch_size, (int, np.integer)) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive integer, got {batch_size!r}")
    return int(batch_size)


class _Slot:
    """One batch's buffers in the prefetch ring, with the RNG state after its draw (committed as the
    sampler's state once the batch is handed out) and, on CUDA, the event that says its device copy is
    done: a slot is refilled only after its batch was handed out and that copy finished."""

    def __init__(self, buffers):
        self.buffers = buffers
        self.state_after: dict | None = None
        self.copied: Any = None  # CUDA event recorded after the device copy
        self.frames: dict | None = None  # the device path's decoded frames on CUDA (``DevicePath.finish``)


class Sampler:
    """An iterator of training batches from one store (make it with ``Store.sampler``).

    What users must know:
    - Batches live in reused buffers: on CPU a batch is valid until the next ``next()``; ``.clone()``
      what you keep. With a CUDA ``device`` each batch is a device copy and stays valid.
    - ``seed`` fixes the sequence; with ``seed=None`` a reopened store's sampler of the same ``name``
      continues the committed RNG state (the state after the last batch handed out, not after prefetched
      ones). One open sampler per name and store.
    - ``draw`` says what a batch is (``Uniform()``, ``Prioritized(...)``, ``NStep(n, gamma, over=...)``,
      ``Sequences(seq_len, ...)`` or your own strategy). Prioritized draws set ``batch.weights``; report
      new priorities with ``update_priorities(batch.indices, td.abs())`` (sequences:
      ``update_priorities(batch, td_errors)``): the one way to update them. They are committed with the store.
    - ``decode`` says where frames are decoded (``mmreplay/device/``): ``"auto"`` (the default) on the device
      when it is CUDA, nvCOMP is installed (``mmreplay[gpu]``) and every frame codec has a device decoder, else
      on the CPU; ``"cpu"`` always on the CPU; ``"device"`` on the device or an error saying why not (on a CPU
      device, a CPU decoder stands in for nvCOMP). ``sample_into`` / ``draw_into`` always decode on the CPU.
      ``sampler.decode`` says which was taken (``"cpu"`` or ``"device"``). A device path holds compressed chunks
      in ``device_cache_bytes`` of device memory (the store's ``Settings``; made with the sampler; stats:
      ``device_tier``).
    - Close it (or use ``with``) to stop its prefetch thread; closing the store closes it too.
    """

    def __init__(self, source: SamplerSource, batch_size: int, draw: DrawStrategy | None = None, *, device=None,
                 prefetch: int | None = None, seed: int | None = None, name: str | None = None,
                 pin_memory: bool | None = None, decode: str = "auto", device_cache_bytes: int = 0):
        """A sampler of ``batch_size`` rows drawn by ``draw`` (default ``Uniform()``) from ``source``;
        ``name`` defaults to the strategy's (``"default"``, sequences ``"sequence"``). ``device_cache_bytes``
        (``Store.sampler`` passes its ``Settings``'): the device tier of a device decode path (ignored without
        one)."""
        import torch  # here, not at module level: a store opened without sampling never loads torch

        self.batch_size = check_batch_size_arg(batch_size)
        device_cache_bytes = check_device_cache_bytes(device_cache_bytes)
        draw = check_strategy(draw)
        self.name = check_name(draw.default_name if name is None else name)
        draw.validate(source.schema)
        if device is not None and torch.device(device).type == "cuda" and not torch.cuda.is_available():
            raise RuntimeError(f"device {device!r} asked for, but torch sees no CUDA device")
        if prefetch is None:
            # Measured on a 2-core CPU box: a producer thread competes with the training step for the GIL
            # and the cores (97 vs 66 DQN steps/s), so it pays only when the step runs on an accelerator.
            prefetch = DEFAULT_ACCELERATOR_PREFETCH if device is not None and torch.device(device).type != "cpu" \
                else 0
        if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
            raise ValueError(f"prefetch must be a non-negative integer, got {prefetch!r}")
        self.draw = draw.bind(self.name)  # this sampler's own copy (its beta, its episode table)
        self._source = source
        self.schema = source.schema
        self.device = torch.device(device) if device is not None else None
        self.prefetch = prefetch
        prio = getattr(self.draw, "prioritized", None)
        self.priorities = None if prio is None else source.priorities(prio)  # made before the first batch
        self.rng = np.random.Generator(np.random.PCG64(seed))
        saved_state = source.saved_state(self.name)
        if seed is None and saved_state is not None:
            self.rng.bit_generator.state = saved_state  # continue the sequence the store was committed with
        # The RNG state after the last batch handed out. Without prefetch that is the RNG's own state, read
        # when asked (copying it costs ~2 us a batch); with prefetch the RNG runs ahead, so each slot keeps it.
        self._state: dict | None = self.rng.bit_generator.state if prefetch else None
        cuda = self.device is not None and self.device.type == "cuda"
        pin = cuda if pin_memory is None else bool(pin_memory)
        n_slots = prefetch + 2 if prefetch else 1
        self._slots = [_Slot(self.draw.new_buffers(self.schema, self.batch_size, pin)) for _ in range(n_slots)]
        self._cuda = cuda
        self._device_path = DevicePath.select(decode, self.device, self.schema, device_cache_bytes)
        self.decode = "cpu" if self._device_path is None else "device"  # the path taken (``decode="auto"``)
        self._device_draw = None if self._device_path is None else self._device_path.wrap(self.draw)
        self._free: queue.Queue = queue.Queue()
        self._ready: queue.Queue = queue.Queue()
        self._held: _Slot | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self.closed = False
        for slot in self._slots:
            self._free.put(slot)
        register_for_fork(self)
        try:
            source.register(self)
        except ValueError:
            self.close()
            raise

    def _draw_into(self, buffers) -> Picked:
        """Draw the next batch of this sampler's sequence into ``buffers`` (advances ``rng``)."""
        return self._source.read(self.draw, buffers.batch_size, self.rng, buffers)

    @property
    def device_tier(self) -> dict | None:
        """The device-resident tier's figures (``capacity_bytes``, ``bytes`` reserved, ``chunks`` held, chunk
        ``hits`` and ``misses``), or None where there is none (``decode`` is ``"cpu"``, or
        ``device_cache_bytes`` is 0)."""
        tier = None if self._device_path is None else self._device_path.tier
        return None if tier is None else tier.stats()

    @property
    def beta(self) -> float:
        """Importance-sampling exponent of a prioritized draw (anneal it by assigning; prefetched batches
        keep the old one)."""
        return self._prioritized().beta

    @beta.setter
    def beta(self, value: float) -> None:
        self._prioritized().beta = check_exponent(value, "beta")

    def _prioritized(self) -> Prioritized:
        prio = getattr(self.draw, "prioritized", None)
        if prio is None:
            raise RuntimeError(f"this sampler draws {self.draw!r}, not by priority; make it with "
                               "draw=Prioritized(...) (or over=Prioritized(...)) to use priorities")
        return prio

    def update_priorities(self, indices, priorities=None, mask=None) -> int:
        """Set the priorities (e.g. ``|TD error|``) of transitions this sampler returned (``batch.indices``;
        a sequence sampler also takes ``(batch, td_errors)``, see ``Sequences.priority_update``). New
        transitions enter at the largest priority given so far. Returns how many were updated
        (transitions overwritten since they were sampled are skipped)."""
        prio = self._prioritized()
        update = getattr(self.draw, "priority_update", None)
        ids, values = (indices, priorities) if update is None else update(indices, priorities, mask)
        return self._source.update_priorities(prio, ids, values)

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
        if slot.frames is not None:  # decoded on the device: the frames are there already
            pick = (lambda part: {k: v[part] for k, v in slot.frames.items()}) if self.schema.dict_obs else \
                (lambda part: slot.frames["obs"][part])
            batch = dataclasses.replace(batch, obs=pick("obs"), next_obs=pick("next"))
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
        if self._device_draw is None:
            self._draw_into(slot.buffers)
        else:  # frames staged under the store's lock, decoded on the device outside it
            self._source.read(self._device_draw, slot.buffers.batch_size, self.rng, slot.buffers)
            frames = self._device_path.finish(self._device_draw.pending, slot.buffers)
            slot.frames = frames if self._cuda else None  # on the CPU they were written into the buffers
        slot.state_after = self.rng.bit_generator.state if keep_state else None

    def sample_into(self, buffers) -> Batch:
        """Draw the next batch of this sampler's sequence into caller-owned ``buffers`` (from the strategy's
        ``new_buffers``, of any batch size, e.g. a distributed shard's part of a batch) and return it (no
        prefetch)."""
        self.draw_into(buffers)
        return buffers.batch()

    def draw_into(self, buffers) -> Picked:
        """``sample_into`` without making the ``Batch`` (for callers that assemble their own from several
        parts). Returns what was drawn: the transition ids and, for transitions, the frame ids of each
        row's obs / next-obs stack (``Picked.obs_ids`` / ``next_ids``, ``(B, k)``: a shard sends each
        distinct frame once by them). Its arrays may be reused by the next draw."""
        if self.closed:
            raise RuntimeError("sampler is closed")
        if self.prefetch:
            raise RuntimeError("sample_into draws in the caller's thread: make the sampler with prefetch=0")
        picked = self._draw_into(buffers)
        self._state = None  # no batch drawn ahead: the RNG's own state
        return picked

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
