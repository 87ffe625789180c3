"""Sequences: slices of ``L`` consecutive steps of one episode and stream (R2D2, Dreamer, Decision
Transformer), rebuilt at sample time from the index ring's backward episode links.

Invariants (``window`` of a slice start ``s``, every id a global transition id):
- ``window[0] = s`` and ``window[j] = succ(window[j-1])`` (the next step of the same episode and stream)
  while ``window[j-1]`` neither terminated nor truncated its episode and its successor has been added;
  the rest of the window is padding (id ``-1``, ``mask`` False, every value zero).
- A start is *drawable* iff its own frame stack is valid (``TransitionRing.stack_frames``) and, with
  ``strict=True``, its window has ``L`` real steps. Later steps of a window never need more than the
  start's stack does, so every real step of a drawable window is valid.
- With ``burn_in = b`` a window is ``b + L`` steps: the ``b`` steps before ``s`` in its episode, right
  aligned; where the episode started later, or a step's stack reaches below ``oldest``, the burn-in is
  padded on the left. Starts are drawn over the ``L`` training steps only, never over the burn-in.
- ``next_obs`` is the next observation (stack) of the last real step: the final observation of a
  terminated or truncated episode, the bootstrap observation of a window cut at ``L``.

Nothing here knows the ``Store``: the functions take the index ring, the frame reader and the schema.
Frames are read only through ``FrameReader.gather``; the caller holds the store's lock.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    import torch  # imported where tensors are made or moved: opening a store does not load torch

from mmreplay.sampling.batch import FLAG_TABLE, _torch_dtype, as_numpy, check_host_memory
from mmreplay.reading.frames import FrameReader
from mmreplay._native import sequences as kernels

SAMPLE_FROM = ("steps", "episodes")
DEFAULT_ETA = 0.9  # R2D2's mix of max and mean |TD| over a sequence
REJECTION_ROUNDS = 32  # uniform draws before falling back to the exact table of drawable starts
# Below this share of drawable starts (estimated from PROBE_DRAWS draws on the side), a batch goes straight
# to the exact table: with 32 rows and 32 rounds of rejection, nine batches in ten would end there anyway,
# after rounds of walks that cost more than the table (low-dim CartPole, seq_len 80: ~60% of a batch). Not
# higher: under a writer the table is built again for each batch (one pass over the ring).
MIN_ACCEPTANCE = 0.08
PROBE_DRAWS = 64


@dataclass(frozen=True)
class SequenceSpec:
    """What a sequence sampler returns: ``seq_len`` training steps after ``burn_in`` steps of context."""
    seq_len: int
    burn_in: int = 0
    strict: bool = True
    sample_from: str = "steps"

    @property
    def width(self) -> int:
        return self.burn_in + self.seq_len


def validate_sequence(seq_len, burn_in=0, strict=True, sample_from="steps") -> SequenceSpec:
    """A checked ``SequenceSpec``; errors name the bad value and what was expected."""
    for what, value, least in (("seq_len", seq_len, 1), ("burn_in", burn_in, 0)):
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
            raise ValueError(f"{what} must be an integer >= {least}, got {value!r}")
    if not isinstance(strict, bool):
        raise ValueError(f"strict must be True (only full slices) or False (pad at episode ends), got {strict!r}")
    if sample_from not in SAMPLE_FROM:
        raise ValueError(f"sample_from must be one of {SAMPLE_FROM} (uniform over slice starts, or over episodes "
                         f"then over starts within one), got {sample_from!r}")
    return SequenceSpec(int(seq_len), int(burn_in), strict, sample_from)


# -- windows ------------------------------------------------------------------------------------------
def walk_windows(ring, starts: np.ndarray, seq_len: int, out: np.ndarray) -> np.ndarray:
    """``out[i]`` = the window of ``starts[i]`` (``seq_len`` ids, ``-1`` past its end); returns the number
    of real steps of each."""
    starts = np.ascontiguousarray(starts, dtype=np.int64)
    lengths = np.empty(starts.size, dtype=np.int64)
    kernels.walk_forward(starts, seq_len, ring.arrays["prev_delta"], ring.arrays["terminated"],
                         ring.arrays["truncated"], 0 if ring.capacity is None else ring.rows, ring.head,
                         max(1, ring.max_prev_delta), out, lengths)
    return lengths


def walk_burn_in(ring, starts: np.ndarray, burn_in: int, frame_stack: int, frame_head: int, out: np.ndarray) -> None:
    """``out[i]`` = the ``burn_in`` steps before ``starts[i]`` in its episode (right aligned, ``-1`` where
    there are fewer that are valid)."""
    kernels.walk_back(np.ascontiguousarray(starts, dtype=np.int64), burn_in, ring.arrays["prev_delta"],
                      0 if ring.capacity is None else ring.rows, ring.oldest, out)
    real = out >= 0
    if frame_stack > 1 and real.any():
        # A burn-in step whose stack reaches below ``oldest`` is not a valid step: pad it and all before it.
        _, _, ok = ring.stack_frames(out[real], frame_stack, frame_head)
        bad = np.zeros(out.shape, dtype=bool)
        bad[real] = ~ok
        cut = np.where(bad.any(axis=1), out.shape[1] - np.argmax(bad[:, ::-1], axis=1), 0)
        out[np.arange(out.shape[1]) < cut[:, None]] = -1


# -- the exact table of drawable starts ------------------------------------------------------------------
@dataclass
class EpisodeTable:
    """Episodes among transitions ``[oldest, head)``: ``members[offsets[e]:offsets[e+1]]`` are episode
    ``e``'s steps in order; ``first`` is the first position whose frame stack is valid (0 for an episode
    that starts in the ring; ``k - 1`` for one the ring cut)."""
    key: tuple
    members: np.ndarray
    offsets: np.ndarray
    first: np.ndarray

    @property
    def lengths(self) -> np.ndarray:
        return np.diff(self.offsets)

    def drawable(self, spec: SequenceSpec) -> np.ndarray:
        """Number of drawable starts of each episode."""
        last = self.lengths - (spec.seq_len if spec.strict else 1)  # last drawable position
        return np.maximum(0, last - self.first + 1)


def episode_table(ring, frame_stack: int, cached: EpisodeTable | None = None) -> EpisodeTable:
    """The episodes of the ring now (one compiled pass; reused while the ring is unchanged)."""
    key = (ring.head, ring.oldest, ring.rows)
    if cached is not None and cached.key == key:
        return cached
    n = ring.head - ring.oldest
    episode = np.empty(n, dtype=np.int64)
    first = np.empty(n, dtype=np.int64)
    n_eps = kernels.label_episodes(ring.oldest, n, ring.arrays["prev_delta"],
                                   0 if ring.capacity is None else ring.rows, frame_stack, episode, first)
    counts = np.bincount(episode, minlength=n_eps)
    offsets = np.zeros(n_eps + 1, dtype=np.int64)
    np.cumsum(counts, out=offsets[1:])
    members = np.empty(n, dtype=np.int64)
    kernels.group_by_episode(episode, offsets, ring.oldest, members)
    return EpisodeTable(key, members, offsets, first[:n_eps])


def draw_from_table(table: EpisodeTable, spec: SequenceSpec, size: int, rng: np.random.Generator) -> np.ndarray:
    """``size`` drawable starts: uniform over all of them (``"steps"``) or over episodes that have one,
    then uniform within the episode (``"episodes"``, TorchRL's SliceSampler)."""
    counts = table.drawable(spec)
    total = int(counts.sum())
    if total == 0:
        what = f"{spec.seq_len} steps" if spec.strict else "one valid step"
        raise ValueError(f"no slice can be drawn: no episode in the store holds {what} yet "
                         f"({table.lengths.size} episodes, longest {int(table.lengths.max(initial=0))} steps; "
                         "use strict=False to pad short episodes)")
    if spec.sample_from == "episodes":
        eligible = np.flatnonzero(counts)
        ep = eligible[rng.integers(0, eligible.size, size=size)]
        pos = (rng.random(size) * counts[ep]).astype(np.int64)
    else:
        cum = np.cumsum(counts)
        k = rng.integers(0, total, size=size)
        ep = np.searchsorted(cum, k, side="right")
        pos = k - (cum[ep] - counts[ep])
    return table.members[table.offsets[ep] + table.first[ep] + pos]


# -- drawing starts -------------------------------------------------------------------------------------
class StartDrawer:
    """Draws slice starts and their windows: uniform over steps (rejection from ``[oldest, head)``, exact
    table after ``REJECTION_ROUNDS``), uniform over episodes (the table), or prioritized (a priority set
    with one value per slice start; strict windows that do not fit are drawn again)."""

    def __init__(self, spec: SequenceSpec, frame_stack: int):
        self.spec = spec
        self.k = frame_stack
        self._table: EpisodeTable | None = None
        self._share: tuple[tuple, float] | None = None  # (ring bounds, share of drawable starts there)

    def draw(self, ring, frame_head: int, batch_size: int, rng: np.random.Generator, priorities=None,
             beta: float = 0.0) -> tuple[np.ndarray, np.ndarray | None]:
        """``(window ids (B, burn_in + seq_len), weights or None)``."""
        spec = self.spec
        ids = np.empty((batch_size, spec.width), dtype=np.int64)
        train = ids[:, spec.burn_in:]
        weights = None
        if priorities is not None:
            starts, weights = self._prioritized(ring, batch_size, rng, priorities, beta, train)
        elif spec.sample_from == "episodes":
            starts = self._from_table(ring, batch_size, rng)
            walk_windows(ring, starts, spec.seq_len, train)
        else:
            starts = self._uniform(ring, frame_head, batch_size, rng, train)
        if spec.burn_in:
            walk_burn_in(ring, starts, spec.burn_in, self.k, frame_head, ids[:, :spec.burn_in])
        return ids, weights

    def _from_table(self, ring, size: int, rng) -> np.ndarray:
        self._table = episode_table(ring, self.k, self._table)
        return draw_from_table(self._table, self.spec, size, rng)

    def _fits(self, lengths: np.ndarray) -> np.ndarray:
        return lengths == self.spec.seq_len if self.spec.strict else np.ones(lengths.size, dtype=bool)

    def _uniform(self, ring, frame_head: int, size: int, rng, train: np.ndarray) -> np.ndarray:
        span = ring.head - ring.oldest
        if span <= 0:
            raise ValueError("cannot sample from an empty store (no valid transitions yet)")
        if self._drawable_share(ring, frame_head, span) < MIN_ACCEPTANCE:
            # Both ways are exactly uniform over drawable starts, and which one a batch takes depends on the
            # ring alone (not on earlier batches: a sampler resumed after reopen draws what one that never
            # stopped draws).
            starts = self._from_table(ring, size, rng)
            self._walk_rows(ring, starts, np.arange(size), train)
            return starts
        starts = ring.oldest + rng.integers(0, span, size=size)
        todo = np.arange(size)
        for _ in range(REJECTION_ROUNDS):  # rejection keeps the draw uniform over drawable starts
            _, _, ok = ring.stack_frames(starts[todo], self.k, frame_head)
            lengths = self._walk_rows(ring, starts, todo, train)
            todo = todo[~(ok & self._fits(lengths))]
            if todo.size == 0:
                return starts
            starts[todo] = ring.oldest + rng.integers(0, span, size=todo.size)
        # Few drawable starts (short episodes for a long strict slice): draw the rest exactly.
        starts[todo] = self._from_table(ring, todo.size, rng)
        self._walk_rows(ring, starts, todo, train)
        return starts

    def _drawable_share(self, ring, frame_head: int, span: int) -> float:
        """The share of drawable starts among ``[oldest, head)``, estimated from ``PROBE_DRAWS`` uniform
        draws of a generator seeded by the ring's bounds (so the estimate is a function of the ring, and
        the batches' own draws are untouched); kept until the ring changes."""
        key = (ring.head, ring.oldest, ring.rows)
        if self._share is not None and self._share[0] == key:
            return self._share[1]
        if not self.spec.strict:
            share = 1.0  # every start with a valid stack is drawable (all but a few near ``oldest``): no probe
        else:
            probe = ring.oldest + np.random.default_rng((ring.head, ring.oldest)).integers(0, span, size=PROBE_DRAWS)
            _, _, ok = ring.stack_frames(probe, self.k, frame_head)
            lengths = walk_windows(ring, probe, self.spec.seq_len,
                                   np.empty((PROBE_DRAWS, self.spec.seq_len), dtype=np.int64))
            share = np.count_nonzero(ok & self._fits(lengths)) / PROBE_DRAWS
        self._share = (key, share)
        return share

    def _walk_rows(self, ring, starts: np.ndarray, rows: np.ndarray, train: np.ndarray) -> np.ndarray:
        """Windows of ``starts[rows]`` into ``train[rows]`` (fancy indexing copies: walk, then write)."""
        part = np.empty((rows.size, self.spec.seq_len), dtype=np.int64)
        lengths = walk_windows(ring, starts[rows], self.spec.seq_len, part)
        train[rows] = part
        return lengths

    def _prioritized(self, ring, size: int, rng, priorities, beta: float, train: np.ndarray):
        starts = np.empty(size, dtype=np.int64)
        weights = np.empty(size, dtype=np.float32)
        todo = np.arange(size)
        for _ in range(REJECTION_ROUNDS * 4):
            g, _, _, w = priorities.draw(todo.size, rng, beta)  # valid stacks only; its buffers are reused
            starts[todo], weights[todo] = g, w
            lengths = self._walk_rows(ring, starts, todo, train)
            todo = todo[~self._fits(lengths)]
            if todo.size == 0:
                return starts, weights
        raise ValueError(f"prioritized strict slices: after {REJECTION_ROUNDS * 4} rounds of draws some starts "
                         f"still had no {self.spec.seq_len}-step window; too few long episodes for seq_len="
                         f"{self.spec.seq_len} (use strict=False, or a shorter seq_len)")


def sequence_priority(td_errors, mask=None, eta: float = DEFAULT_ETA) -> np.ndarray:
    """R2D2's priority of a sequence: ``eta * max_t |td_t| + (1 - eta) * mean_t |td_t|`` over its real
    steps (``mask``), from errors shaped ``(B, T)``."""
    td = np.abs(_as_numpy(td_errors).astype(np.float64))
    if td.ndim != 2:
        raise ValueError(f"td_errors must be shaped (batch, steps), got shape {td.shape}")
    m = np.ones(td.shape, dtype=bool) if mask is None else _as_numpy(mask).astype(bool)
    if m.shape != td.shape:
        raise ValueError(f"mask shape {m.shape} does not match td_errors shape {td.shape}")
    if not 0.0 <= eta <= 1.0:
        raise ValueError(f"eta must lie in [0, 1], got {eta!r}")
    n = np.maximum(m.sum(axis=1), 1)
    masked = np.where(m, td, 0.0)
    return eta * masked.max(axis=1) + (1.0 - eta) * masked.sum(axis=1) / n


def _as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


# -- batches ----------------------------------------------------------------------------------------------
@dataclass
class SequenceBatch:
    """``B`` windows of ``T = burn_in + seq_len`` steps. ``obs`` is ``(B, T, ...)`` (frame stacks within
    each step); ``action``, ``reward``, ``terminated``, ``truncated``, ``mask``, ``indices`` are
    ``(B, T)``; ``next_obs`` ``(B, ...)`` is the next observation of each window's last real step.
    ``is_first`` ``(B, T)`` is True at an episode's first step (DreamerV3's ``is_first``: where a world
    model starts its recurrent state afresh). Padding (``mask`` False) is zero; ``indices`` there is ``-1``.
    ``start`` = ``indices[:, burn_in]``."""
    obs: Any
    action: torch.Tensor
    reward: torch.Tensor
    next_obs: Any
    terminated: torch.Tensor
    truncated: torch.Tensor
    mask: torch.Tensor
    indices: torch.Tensor
    burn_in: int = 0
    extras: dict = field(default_factory=dict)
    weights: torch.Tensor | None = None
    is_first: torch.Tensor | None = None

    @property
    def start(self) -> torch.Tensor:
        return self.indices[:, self.burn_in]

    @property
    def dones(self) -> torch.Tensor:
        return self.terminated | self.truncated

    def to(self, device, non_blocking: bool = False) -> "SequenceBatch":
        import torch

        def move(x):
            if isinstance(x, dict):
                return {k: move(v) for k, v in x.items()}
            return x.to(device, non_blocking=non_blocking) if isinstance(x, torch.Tensor) else x
        return SequenceBatch(**{f.name: move(getattr(self, f.name)) for f in fields(self)})

    def numpy(self, copy: bool = True) -> dict[str, Any]:
        """The windows as numpy arrays, a dict of this batch's fields (``burn_in`` stays an int); copies by
        default, or with ``copy=False`` views valid until the sequence sampler's next batch, CPU only
        (as ``Batch.numpy``)."""
        return {f.name: getattr(self, f.name) if f.name == "burn_in" else as_numpy(getattr(self, f.name), copy)
                for f in fields(self)}


class SequenceBuffers:
    """Preallocated host tensors for one sequence batch (pinned when asked), with numpy views."""

    def __init__(self, schema, batch_size: int, spec: SequenceSpec, pin_memory: bool = False, *,
                 weights: bool = False):
        import torch

        k, T = schema.frame_stack, spec.width
        self.batch_size, self.spec = batch_size, spec
        check_host_memory(batch_size, T * (k * sum(s.row_nbytes for s in schema.observations)
                                           + sum(8 * max(1, s.row_nbytes) for s in schema.transition_columns) + 32))

        def alloc(shape, dtype):
            t = torch.empty(shape, dtype=dtype, pin_memory=pin_memory)
            return t, t.numpy()

        stack = (k,) if k > 1 else ()
        self.obs = {s.name: alloc((batch_size, T, *stack, *s.shape), _torch_dtype(s.np_dtype))
                    for s in schema.observations}
        self.next_obs = {s.name: alloc((batch_size, *stack, *s.shape), _torch_dtype(s.np_dtype))
                         for s in schema.observations}
        self.columns, self.decode_tables = {}, {}
        for s in schema.transition_columns:
            dtype = s.np_dtype
            if s.name == "action" and s.shape == () and dtype.kind in "iu":
                dtype = np.dtype(np.int64)  # discrete actions index Q-values: torch wants int64
            self.columns[s.name] = alloc((batch_size, T, *s.shape), _torch_dtype(dtype))
            if s.kind == "packed":
                self.decode_tables[s.name] = np.asarray(s.values).astype(dtype)
        self.terminated = alloc((batch_size, T), torch.bool)
        self.truncated = alloc((batch_size, T), torch.bool)
        self.mask = alloc((batch_size, T), torch.bool)
        self.is_first = alloc((batch_size, T), torch.bool)
        self.indices = alloc((batch_size, T), torch.int64)
        self.weights = alloc((batch_size,), torch.float32) if weights else None
        self.dict_obs = schema.dict_obs
        self.extra_names = [c.name for c in schema.extras]

    def batch(self) -> SequenceBatch:
        obs = {k: t for k, (t, _) in self.obs.items()}
        next_obs = {k: t for k, (t, _) in self.next_obs.items()}
        if not self.dict_obs:
            obs, next_obs = obs["obs"], next_obs["obs"]
        return SequenceBatch(obs, self.columns["action"][0], self.columns["reward"][0], next_obs,
                             self.terminated[0], self.truncated[0], self.mask[0], self.indices[0], self.spec.burn_in,
                             {n: self.columns[n][0] for n in self.extra_names},
                             self.weights[0] if self.weights is not None else None, self.is_first[0])


def assemble_sequences(ring, frames: FrameReader, schema, ids: np.ndarray, buf: SequenceBuffers,
                       weights: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Fill ``buf`` with windows ``ids`` (B, T; ``-1`` = padding), frames read through ``frames``. Returns
    what was read (real ids, their frame ids, the next-obs frame ids) for a reader's check that the writer
    did not overwrite it."""
    k = schema.frame_stack
    B, T = ids.shape
    mask = ids >= 0
    # Padding reads a real step of its own window (each has one: the start), then is zeroed.
    anchor = ids[:, buf.spec.burn_in]
    filled = np.where(mask, ids, anchor[:, None]).reshape(-1)
    obs_ids, _, _ = ring.stack_frames(filled, k, frames.head)
    last = ids[np.arange(B), T - 1 - np.argmax(mask[:, ::-1], axis=1)]
    _, next_ids, _ = ring.stack_frames(last, k, frames.head)
    zero_pad = schema.stack_padding == "zeros" and k > 1
    for name, (_, obs_np) in buf.obs.items():
        next_np = buf.next_obs[name][1]
        # one gather for both: the next observation's frames mostly lie in the window's last run, decoded once
        frames.gather_sets(name, ((obs_ids.reshape(B, T, k) if k > 1 else obs_ids.reshape(B, T), obs_np),
                                  (next_ids if k > 1 else next_ids[:, 0], next_np)))
        if zero_pad:  # a frame id equal to the next position's is padding before the episode's first frame
            for out, fid in ((obs_np.reshape(B * T, k, -1), obs_ids), (next_np.reshape(B, k, -1), next_ids)):
                pad = np.zeros(fid.shape, dtype=bool)
                pad[:, :-1] = fid[:, :-1] == fid[:, 1:]
                out[pad] = 0
    slots = ring.slot(filled)
    for name, (_, out) in buf.columns.items():
        ring.read_into(name, slots, out.reshape(B * T, *out.shape[2:]), buf.decode_tables.get(name))
    ring.read_into("terminated", slots, buf.terminated[1].reshape(-1), FLAG_TABLE)
    ring.read_into("truncated", slots, buf.truncated[1].reshape(-1), FLAG_TABLE)
    np.equal(ring.arrays["prev_delta"][slots], 0, out=buf.is_first[1].reshape(-1))  # no earlier step: a first
    if not mask.all():
        pad = ~mask
        for _, out in buf.obs.values():
            out[pad] = 0
        for _, out in buf.columns.values():
            out[pad] = 0
        buf.terminated[1][pad] = False
        buf.truncated[1][pad] = False
        buf.is_first[1][pad] = False
    buf.mask[1][...] = mask
    buf.indices[1][...] = ids
    if weights is not None:
        buf.weights[1][...] = weights
    return ids[mask], obs_ids[mask.reshape(-1)], next_ids
