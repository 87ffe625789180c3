"""Draw strategies: what one batch draws from the index ring, and how it is assembled into buffers.

A strategy is the one thing that changes between kinds of sampling; the store's race-checked read
(``StoreState.read``), ``Sampler`` (reused buffers, prefetch, saved RNG state), ``Store.sample``, the
inspection draws and every integration are the same for all of them. The protocol (``DrawStrategy``):

- ``pick(view, size, rng) -> Picked``: what to draw, reading only the index in RAM (ids or windows,
  importance weights, the frame ids the rows will need); the only method that consumes ``rng``.
- ``assemble(view, picked, buffers) -> (ids, obs_ids, next_ids)``: read the picked rows into buffers
  from ``new_buffers``, returning every transition and frame id read (what a reader checks against the
  writer's newest commit afterwards).
- ``bind(name)``: a private copy for the sampler ``name`` (a ``Prioritized`` left unnamed draws by the
  priority set of its sampler's name); ``validate(schema)``: refuse a store it cannot draw from.

Invariants:
- Options are checked when a strategy is made (errors name the value and what was expected), the store
  schema once by ``validate``; nothing is checked again per batch.
- The seeded streams are those of the samplers before strategies: ``Uniform`` is ``draw_uniform``,
  ``Prioritized`` is ``Priorities.draw``, ``Sequences`` is ``StartDrawer.draw``, each fed the same RNG.
- ``pick`` and ``assemble`` run under the store's lock with nothing pending: the view does not change
  between them (a reader's refresh happens only between attempts, and the attempt picks again).

Nothing here knows the ``Store``: strategies see a ``DrawView`` (the ring, the frame reader, the schema
and the priority sets).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from typing import Any, Callable, Protocol, runtime_checkable

import numpy as np

from mmreplay.columns.spec import Schema
from mmreplay.index.ring import TransitionRing, as_transition_ids
from mmreplay.reading.frames import FrameReader
from mmreplay.sampling.batch import BatchBuffers, assemble
from mmreplay.sampling.draw import check_batch_size, draw_uniform
from mmreplay.sampling.nstep import NStepResult, check_nstep, nstep_returns
from mmreplay.sampling.priorities import Priorities, check_exponent, check_name
from mmreplay.sampling.registry import PrioritySets
from mmreplay.sampling.sequences import (DEFAULT_ETA, SequenceBatch, SequenceBuffers, StartDrawer, assemble_sequences,
                                         sequence_priority, validate_sequence)

DEFAULT_NAME = "default"
DEFAULT_SEQUENCE_NAME = "sequence"  # a sequence sampler's RNG state and priorities never mix with a transition one's


@dataclass
class Picked:
    """What ``pick`` drew: ``ids`` (``(B,)`` transition ids, or ``(B, T)`` windows with ``-1`` padding),
    importance ``weights`` (prioritized draws), and for transitions the obs / next-obs frame stacks
    ``(B, k)`` (``next_ids`` after the n-step window when ``nstep`` is set)."""

    ids: np.ndarray
    weights: np.ndarray | None = None
    obs_ids: np.ndarray | None = None
    next_ids: np.ndarray | None = None
    nstep: NStepResult | None = None


class DrawView:
    """What a strategy reads, under the store's lock: the index ring, the frame reader, the schema and the
    priority sets of one state (a reader's refresh makes a new view)."""

    def __init__(self, ring: TransitionRing, frames: FrameReader, schema: Schema, priority_sets: PrioritySets,
                 decode_reward: Callable[[np.ndarray], np.ndarray]):
        self.ring, self.frames, self.schema = ring, frames, schema
        self.priority_sets, self.decode_reward = priority_sets, decode_reward

    @property
    def oldest(self) -> int:
        """The oldest transition id held (valid ids lie in ``[oldest, head)`` and need their frame stack)."""
        return self.ring.oldest

    @property
    def head(self) -> int:
        """One past the newest transition id."""
        return self.ring.head

    @property
    def frame_stack(self) -> int:
        return self.schema.frame_stack

    def stacks(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``(obs_ids, next_ids, valid)``: the frame stacks of transitions ``ids`` and which are valid."""
        return self.ring.stack_frames(ids, self.frame_stack, self.frames.head)

    def uniform(self, size: int, rng: np.random.Generator, lo: int | None = None) -> Picked:
        """``size`` valid transitions drawn uniformly from ``[lo, head)`` (default ``[oldest, head)``)."""
        return Picked(*_uniform_ids(self, size, rng, lo))

    def priorities(self, prioritized: "Prioritized") -> Priorities:
        """The priority set ``prioritized`` draws by (made on first use; its exponents applied)."""
        return self.priority_sets.get(prioritized.set_name, prioritized.alpha, prioritized.eps)


def _uniform_ids(view: DrawView, size: int, rng: np.random.Generator, lo: int | None):
    if lo is None:
        g, obs_ids, next_ids = draw_uniform(view.ring, view.frame_stack, view.frames.head, size, rng)
        return g, None, obs_ids, next_ids
    check_batch_size(view.ring, view.frame_stack, view.frames.head, size)
    lo = min(max(int(lo), view.oldest), view.head - 1)
    g = rng.integers(lo, view.head, size=size)
    obs_ids, next_ids, valid = view.stacks(g)
    for _ in range(1000):  # rejection keeps the draw uniform over the valid ones in [lo, head)
        if valid.all():
            return g, None, obs_ids, next_ids
        bad = np.flatnonzero(~valid)
        g[bad] = rng.integers(lo, view.head, size=bad.size)
        obs_ids[bad], next_ids[bad], valid[bad] = view.stacks(g[bad])
    raise ValueError(f"no valid transitions in [{lo}, {view.head}) to draw from (their frame stacks are gone)")


@runtime_checkable
class DrawStrategy(Protocol):
    """The protocol of a draw strategy (see the module docstring)."""

    default_name: str

    def bind(self, name: str) -> "DrawStrategy": ...

    def validate(self, schema: Schema) -> None: ...

    def new_buffers(self, schema: Schema, batch_size: int, pin_memory: bool = False) -> Any: ...

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked: ...

    def assemble(self, view: DrawView, picked: Picked, buffers: Any) -> tuple[np.ndarray, np.ndarray, np.ndarray]: ...


class Transitions:
    """Base of the strategies that draw single transitions into ``BatchBuffers``: subclass it and write
    ``pick`` (e.g. with ``view.uniform(size, rng, lo=...)``); buffers, assembly, ``bind`` come from here."""

    default_name = DEFAULT_NAME
    redraws = True  # a reader that lost a race picks again (False: the ids are the caller's, fixed)

    @property
    def prioritized(self) -> "Prioritized | None":
        """The prioritized draw underneath (None: this strategy keeps no priorities)."""
        return None

    def bind(self, name: str) -> "Transitions":
        return copy.copy(self)

    def validate(self, schema: Schema) -> None:
        pass

    def new_buffers(self, schema: Schema, batch_size: int, pin_memory: bool = False) -> BatchBuffers:
        return BatchBuffers(schema, batch_size, pin_memory=pin_memory, weights=self.prioritized is not None)

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked:
        raise NotImplementedError

    def assemble(self, view: DrawView, picked: Picked, buffers: BatchBuffers):
        assemble(view.ring, view.frames, picked.ids, picked.obs_ids, picked.next_ids, buffers,
                 weights=picked.weights, nstep=picked.nstep)
        return picked.ids, picked.obs_ids, picked.next_ids

    def priority_update(self, indices, priorities, mask=None) -> tuple[Any, Any]:
        """``(ids, priorities)`` to set from what a training step reports (transitions: as given)."""
        if mask is not None:
            raise TypeError("mask= is for sequence samplers (per-step errors of windows)")
        return indices, priorities


class Uniform(Transitions):
    """Every valid transition equally likely (drawn with replacement)."""

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked:
        return view.uniform(size, rng)

    def __repr__(self) -> str:
        return "Uniform()"


class Prioritized(Transitions):
    """Proportional prioritized replay: transition ``i`` drawn with probability ``(p_i + eps) ** alpha``
    over the total, with importance weights ``(P / min P) ** -beta`` in ``batch.weights``. ``alpha``/``eps``
    left out: the committed set's, else 0.6 and 1e-6. The set is ``name``'s (default: the sampler's name;
    outside a sampler, ``"default"``), committed with the store; report priorities with
    ``sampler.update_priorities(batch.indices, td.abs())``."""

    def __init__(self, alpha: float | None = None, beta: float = 0.4, eps: float | None = None, *,
                 name: str | None = None):
        self.alpha = None if alpha is None else check_exponent(alpha, "alpha")
        self.eps = None if eps is None else check_exponent(eps, "eps")
        self.beta = check_exponent(beta, "beta")
        self.name = None if name is None else check_name(name)
        self.set_name = DEFAULT_NAME if name is None else self.name  # a sampler binds it to its own name

    @property
    def prioritized(self) -> "Prioritized":
        return self

    def bind(self, name: str) -> "Prioritized":
        bound = copy.copy(self)
        bound.set_name = check_name(name) if self.name is None else self.name
        return bound

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked:
        g, obs_ids, next_ids, weights = view.priorities(self).draw(size, rng, self.beta)
        return Picked(g, weights, obs_ids, next_ids)

    def __repr__(self) -> str:
        return f"Prioritized(alpha={self.alpha}, beta={self.beta}, eps={self.eps}, name={self.name!r})"


class NStep(Transitions):
    """n-step returns over ``over``'s draw (``Uniform()`` or ``Prioritized(...)``): ``reward`` is the
    discounted sum over the episode's next ``m <= n`` steps, ``next_obs`` the observation after them,
    ``batch.discount`` is ``gamma ** m`` (see ``sampling/nstep.py``)."""

    def __init__(self, n: int, gamma: float = 0.99, *, over: Transitions | None = None):
        self.n, self.gamma = check_nstep(n, gamma)
        over = Uniform() if over is None else over
        if not isinstance(over, Transitions) or isinstance(over, NStep):
            raise TypeError(f"NStep(over=...) takes Uniform() or Prioritized(...) (a transition draw), got {over!r}")
        self.over = over

    @property
    def prioritized(self) -> "Prioritized | None":
        return self.over.prioritized

    def bind(self, name: str) -> "NStep":
        bound = copy.copy(self)
        bound.over = self.over.bind(name)
        return bound

    def validate(self, schema: Schema) -> None:
        if schema.reward.shape != ():
            raise ValueError(f"n-step returns need a scalar reward column, this store's has shape "
                             f"{schema.reward.shape}")
        self.over.validate(schema)

    def new_buffers(self, schema: Schema, batch_size: int, pin_memory: bool = False) -> BatchBuffers:
        return BatchBuffers(schema, batch_size, pin_memory=pin_memory, weights=self.prioritized is not None,
                            nstep=True)

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked:
        picked = self.over.pick(view, size, rng)
        picked.nstep = nstep_returns(view.ring, view.decode_reward, picked.ids, self.n, self.gamma)
        picked.next_ids = view.stacks(picked.nstep.last)[1]
        return picked

    def __repr__(self) -> str:
        return f"NStep({self.n}, {self.gamma}, over={self.over!r})"


class Ids(Transitions):
    """The transitions with these ids (which must be valid): what ``store.inspect.get`` reads. A reader
    that lost a race to the writer reads them again from the newer commit (or finds them gone)."""

    redraws = False

    def __init__(self, ids):
        self.ids = as_transition_ids(ids)

    def pick(self, view: DrawView, size: int, rng: np.random.Generator | None) -> Picked:
        obs_ids, next_ids, valid = view.stacks(self.ids)
        if not valid.all():
            bad = self.ids[~valid]
            held = bad[(bad >= view.oldest) & (bad < view.head)]
            raise IndexError(f"transition ids {bad[:8].tolist()} are not valid: ids must lie in valid_range() "
                             f"[{view.oldest}, {view.head})" + (
                                 f", and {held[:8].tolist()} do, but their frame stack of {view.frame_stack} "
                                 "reaches frames the ring overwrote (the first steps kept of an episode it cut); "
                                 "inspect.readable_range() gives the ids get accepts" if held.size else ""))
        return Picked(self.ids, None, obs_ids, next_ids)


class Sequences:
    """Slices of ``seq_len`` consecutive steps of one episode and stream (``SequenceBatch``), after
    ``burn_in`` steps of context. ``strict=True`` draws only full slices, ``False`` pads past an episode
    end (``mask`` False). ``sample_from="steps"`` draws starts uniformly over steps, ``"episodes"`` over
    episodes then steps. ``over=Prioritized(...)``: one priority per slice start, and
    ``sampler.update_priorities(batch, td_errors)`` mixes max and mean |TD| with ``eta`` (R2D2: 0.9)."""

    default_name = DEFAULT_SEQUENCE_NAME
    redraws = True

    def __init__(self, seq_len: int, burn_in: int = 0, strict: bool = True, sample_from: str = "steps",
                 eta: float = DEFAULT_ETA, *, over: Uniform | Prioritized | None = None):
        self.spec = validate_sequence(seq_len, burn_in, strict, sample_from)
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0.0 <= float(eta) <= 1.0:
            raise ValueError(f"eta (R2D2's max/mean mix) must lie in [0, 1], got {eta!r}")
        self.eta = float(eta)
        over = Uniform() if over is None else over
        if type(over) not in (Uniform, Prioritized):
            raise TypeError(f"Sequences(over=...) takes Uniform() or Prioritized(...), got {over!r}")
        if isinstance(over, Prioritized) and sample_from != "steps":
            raise ValueError(f"prioritized slices are drawn by priority, not {sample_from!r}; leave sample_from "
                             "at 'steps' with over=Prioritized(...)")
        self.over = over
        self._drawer: StartDrawer | None = None  # made by bind: it keeps its episode table between batches

    @property
    def seq_len(self) -> int:
        return self.spec.seq_len

    @property
    def burn_in(self) -> int:
        return self.spec.burn_in

    @property
    def prioritized(self) -> Prioritized | None:
        return self.over.prioritized

    def bind(self, name: str) -> "Sequences":
        bound = copy.copy(self)
        bound.over = self.over.bind(name)
        bound._drawer = None
        return bound

    def validate(self, schema: Schema) -> None:
        pass

    def new_buffers(self, schema: Schema, batch_size: int, pin_memory: bool = False) -> SequenceBuffers:
        return SequenceBuffers(schema, batch_size, self.spec, pin_memory=pin_memory,
                               weights=self.prioritized is not None)

    def pick(self, view: DrawView, size: int, rng: np.random.Generator) -> Picked:
        if self._drawer is None:
            self._drawer = StartDrawer(self.spec, view.frame_stack)
        prio = self.prioritized
        priorities = None if prio is None else view.priorities(prio)
        ids, weights = self._drawer.draw(view.ring, view.frames.head, size, rng, priorities,
                                         0.0 if prio is None else prio.beta)
        return Picked(ids, weights)

    def assemble(self, view: DrawView, picked: Picked, buffers: SequenceBuffers):
        return assemble_sequences(view.ring, view.frames, view.schema, picked.ids, buffers, picked.weights)

    def priority_update(self, indices, priorities=None, mask=None) -> tuple[Any, Any]:
        """``(batch, td_errors)`` with per-step errors ``(B, seq_len)`` (or ``(B, burn_in + seq_len)``; the
        burn-in is left out; or any width with a ``mask`` of its shape): each slice's priority is R2D2's
        ``eta * max|td| + (1 - eta) * mean|td|`` over its real steps. Or ``(batch.start, p)``: as given."""
        if not isinstance(indices, SequenceBatch):
            return indices, priorities
        td, m = self._errors_and_mask(indices, priorities, mask)
        return indices.start.cpu(), sequence_priority(td, m, self.eta)

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

    def __repr__(self) -> str:
        s = self.spec
        return (f"Sequences({s.seq_len}, burn_in={s.burn_in}, strict={s.strict}, sample_from={s.sample_from!r}, "
                f"eta={self.eta}, over={self.over!r})")


def check_strategy(draw: Any) -> DrawStrategy:
    """``draw`` if it is a draw strategy (``Uniform()`` when None), else an error saying what is expected."""
    if draw is None:
        return Uniform()
    if isinstance(draw, type) or not isinstance(draw, DrawStrategy):
        raise TypeError(f"draw must be a draw strategy such as Uniform(), Prioritized(...), NStep(n, gamma) or "
                        f"Sequences(seq_len) (see mmreplay.sampling.strategy), got {draw!r}")
    return draw
