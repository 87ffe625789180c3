"""``Store``: RL transitions on disk in a standard zarr v3 group, sampled in place.

The store composes pieces that each keep their own invariant: the *schema* (what the columns are), the
*frame ring* (observations, each frame stored once, compressed, on disk), the *index ring* (which
transition points at which frames, resident in RAM with every small per-transition column), the
*writer* (validation, pending block), the *commit log* (what survives a crash) and, per sampler name,
a priority set and an RNG state. Why this shape: an Atari DQN buffer is ~99% frames, and a frame
belongs to up to ``2 * frame_stack`` observations; storing it once, compressed, and keeping only ~12
bytes of index per transition in RAM is what turns a 28-56 GB buffer into one that fits anywhere.

Crash contract: ``flush()`` (also run automatically every ``commit_every`` transitions or
``commit_seconds`` seconds, and by ``close()``) makes every transition added so far durable; a crash
loses at most what was added since the last commit. Reopening restores exactly the last commit.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from typing import Any, Mapping, Sequence

import numpy as np

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import ColumnSpec, Schema, schema_from_spaces
from mmreplay.errors import FormatError, ReadOnlyError, StoreClosedError
from mmreplay.index.ring import TransitionRing, as_transition_ids
from mmreplay.inspection import committed_work, store_info, verify
from mmreplay.sampling.batch import Batch, BatchBuffers
from mmreplay.sampling.draw import check_batch_size, draw_uniform
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.sampler import Sampler, check_sampler_args
from mmreplay.sampling.sequence_sampler import DEFAULT_SEQUENCE_NAME, SequenceSampler, check_sequence_args
from mmreplay.sampling.sequences import DEFAULT_ETA, SequenceBuffers, StartDrawer
from mmreplay.settings import Settings
from mmreplay.state import StoreState
from mmreplay.storage import forking
from mmreplay.storage.commit import FORMAT_VERSION, check_app_meta, read_commit
from mmreplay.storage.files import acquire_writer_lock
from mmreplay.storage.layout import StoreGeometry
from mmreplay.storage.meta import (check_open_memory, check_record, plan_geometry, prepare_new_store_dir, read_meta,
                                   validate_capacity)
from mmreplay.writing import Writer


class Store:
    """A replay store on disk: ``Store.create`` makes one, ``Store.open`` reopens it exactly as last committed.

    Add transitions with ``add`` (one env step) or ``extend`` (a vector env's steps); draw training
    batches with ``sampler(...)`` (reused buffers, optional prefetch, prioritized and n-step variants) or
    ``sample``/``get`` (fresh tensors). One process may hold a store open for writing (``mode="a"``); any
    number may read it (``mode="r"``, then ``refresh()`` to follow the writer). Everything added is
    durable after ``flush()``/``close()`` and the automatic commits (see ``Settings``); close the store
    (or use ``with``) when done. ``help(mmreplay.Settings)`` lists the per-session settings.
    """

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, observation_space, action_space, capacity: int | None = 1_000_000, *,
               frame_stack: int = 1, reward_values: Sequence[float] | None = None, frame_codec: Any = "lz4hc",
               extras: Sequence[ColumnSpec] = (), columns: Mapping[str, ColumnSpec] | None = None,
               frame_capacity: int | None = None, stack_padding: str = "first", settings: Settings | None = None,
               **session: Any) -> "Store":
        """Make a new store at ``path`` (which must not exist or be an empty directory).

        ``capacity`` transitions are kept (the oldest are overwritten); ``None`` grows without bound.
        With ``frame_stack=k`` observations come back as stacks of the last ``k`` frames of the episode;
        before the episode's first frame a stack repeats it (``stack_padding="first"``, gymnasium's
        FrameStackObservation) or holds zeros (``"zeros"``, SB3's VecFrameStack).
        ``frame_capacity`` (default ``capacity * 9/8``) bounds the distinct observations kept: each
        episode needs one frame more than it has transitions, so very short episodes may make the
        frame ring, not ``capacity``, the limit on ``len(store)``. ``settings`` (or its fields as
        keywords: ``cache_bytes=``, ``commit_every=``, ``commit_seconds=``, ``durable=``) are this
        session's choices, not stored.
        """
        path = os.fspath(path)
        settings = Settings.resolve(settings, session)
        validate_capacity(capacity, "capacity")
        schema = schema_from_spaces(observation_space, action_space, reward_values=reward_values,
                                    frame_stack=frame_stack, frame_codec=frame_codec, extras=extras, columns=columns,
                                    stack_padding=stack_padding)
        if frame_capacity is not None:
            validate_capacity(frame_capacity, "frame_capacity")
        geometry = plan_geometry(schema, capacity, frame_capacity)
        prepare_new_store_dir(path)
        meta = {"format_version": FORMAT_VERSION, "schema": schema.to_json(), **geometry.to_meta()}
        import zarr

        root = zarr.open_group(path, mode="w", zarr_format=3, attributes={"mmreplay": meta})
        root.create_group("frames")
        root.create_group("transitions")
        # The commit group is written by us (atomically), never by zarr: see storage/commit.py.
        store = cls(path, meta, record=None, mode="a", settings=settings)
        for layout in store._state.ring.layouts() + [c.layout for c in store._state.frames.columns.values()]:
            layout.create(root)
        store._state.log.commit(store._state.record(), [])
        return store

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "a", *, settings: Settings | None = None,
             **session: Any) -> "Store":
        """Open an existing store; ``mode="a"`` continues writing exactly where it was, ``"r"`` reads.
        ``settings`` (or its fields as keywords) as for ``create``."""
        path = os.fspath(path)
        settings = Settings.resolve(settings, session)
        if mode not in ("a", "r"):
            raise ValueError(f"mode must be 'a' (read and append) or 'r' (read only), got {mode!r}")
        meta = read_meta(path)
        record = read_commit(path)
        check_record(record, meta, path)
        check_open_memory(meta, record, path, writable=mode == "a")
        try:
            return cls(path, meta, record=record, mode=mode, settings=settings)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            # The checks above should leave nothing here; if metadata still slips through, say where it is.
            raise FormatError(f"store {path!r}: its metadata is inconsistent ({type(exc).__name__}: {exc})") from exc

    def __init__(self, path: str, meta: dict, *, record: dict | None, mode: str, settings: Settings):
        self.path, self.mode, self.settings, self._meta = path, mode, settings, meta
        self.schema = Schema.from_json(meta["schema"])
        self.capacity: int | None = meta["capacity"]
        self.frame_stack = self.schema.frame_stack
        self._closed, self._forked = True, False  # closed until made; _forked: inherited by a forked child
        self._lock = threading.RLock()  # adds, flushes and batch assembly never interleave
        self._lock_fd = acquire_writer_lock(path) if mode == "a" else None
        try:
            self._state = StoreState(path, meta, self.schema, record, writable=mode == "a", settings=settings)
        except BaseException:  # a store that could not be made holds nothing to commit: just let go
            if self._lock_fd is not None:
                os.close(self._lock_fd)
            raise
        self._closed = False
        forking.register(self)
        if mode == "a":
            forking.close_at_exit(self)
        self._rng = np.random.default_rng()
        self._writer = self._new_writer() if mode == "a" else None

    def _new_writer(self) -> Writer:
        st, settings = self._state, self.settings
        return Writer(self.path, self.schema, st.ring, st.frames, st.reader, st.streams, self._lock,
                      commit_every=settings.commit_every, commit_seconds=settings.commit_seconds,
                      flush=self.flush, check_open=self._check_open)

    # -- writing ----------------------------------------------------------------------------------
    def add(self, obs, action, reward, next_obs, terminated, truncated, *, stream: int = 0,
            extras: Mapping[str, Any] | None = None) -> None:
        """Add one transition of stream ``stream`` (one env of a vector env, or the only env)."""
        (self._writer or self._refuse_write()).add(obs, action, reward, next_obs, terminated, truncated,
                                                   stream=stream, extras=extras)

    def extend(self, obs, action, reward, next_obs, terminated, truncated, *, streams: Sequence[int] | None = None,
               extras: Mapping[str, Any] | None = None) -> None:
        """Add a batch: row ``i`` of each argument is one transition of stream ``streams[i]``
        (default ``range(n)``: a vector env's ``n`` sub-envs, each its own sequence of episodes)."""
        (self._writer or self._refuse_write()).extend(obs, action, reward, next_obs, terminated, truncated,
                                                      streams=streams, extras=extras)

    def flush(self, app_meta: dict | None = None) -> None:
        """Make every transition added so far durable (atomic commit); cheap when nothing changed. With
        ``app_meta`` (a small JSON object, e.g. a training step), commit it atomically with them: it
        replaces what ``app_meta`` held."""
        with self._lock:
            self._check_open()
            writer = self._writer
            if writer is None:
                if app_meta is not None:
                    self._refuse_write()
                return
            if app_meta is not None:
                self._state.app_meta = check_app_meta(app_meta)
            writer.check_writable()
            writer.drain()
            if writer.pending or self._state.changed():
                with writer.failing_writes():
                    self._state.commit()
                writer.committed()

    def _drain(self) -> None:
        if self._writer is not None:
            self._writer.drain()

    def rollback(self, num_added: int) -> int:
        """Drop every transition added after the first ``num_added`` (e.g. back to a training checkpoint's
        step count after a crash); returns how many were dropped. ``num_added`` must lie in
        ``[valid_range()[0], num_added]``: transitions already overwritten cannot come back.

        Crash-safe: what was added is committed first, then one atomic commit record holds the rolled-back
        state, so a crash leaves the state before or after, never a mix. Every stream's episode ends
        there: each stream's next add starts a new one. Priority sets keep the priorities of the
        transitions kept; committed sampler RNG states and ``app_meta`` are kept. Readers of the store
        notice at their next batch or ``refresh()`` and reload. Open samplers must be closed first."""
        with self._lock:
            self._check_open()
            writer = self._writer or self._refuse_write()
            writer.drain()
            n = self._state.check_rollback(num_added)
            open_samplers = sorted(name for name, smp in self._state.samplers.live.items() if not smp.closed)
            if open_samplers:
                raise RuntimeError(f"rollback: close the open sampler(s) {open_samplers} first (they hold "
                                   "positions and priorities of the transitions being dropped)")
            self.flush()  # the state before is committed whole: a crash from here on leaves it or the new one
            dropped = self._state.ring.head - n
            if dropped == 0:
                return 0
            with writer.failing_writes():
                self._state.log.commit(self._state.rollback_record(n), [])
            self._reload_committed()
            return dropped

    def _reload_committed(self) -> None:
        """Rebuild the state in RAM from the commit record on disk, exactly as ``open`` would."""
        record = read_commit(self.path)
        check_record(record, self._meta, self.path)
        self._state.samplers.close_all()
        self._state.close()
        try:
            self._state = StoreState(self.path, self._meta, self.schema, record, writable=True,
                                     settings=self.settings)
        except BaseException:  # the commit is on disk; reopening the store continues from it
            self._closed = True
            self._writer.closed = True
            raise
        self._writer = self._new_writer()

    # -- readers of a store that another process writes -----------------------------------------
    def refresh(self) -> bool:
        """Read-only stores: catch up with the writer's latest commit (True if there was a newer one).
        Cached frames of shards written since are dropped; the rest of the cache stays warm. If loading
        fails (an I/O error, say), the store refuses to sample until a later refresh loads completely."""
        with self._lock:
            self._check_open()
            return self.mode == "r" and self._state.refresh()

    # -- sampling ---------------------------------------------------------------------------------
    def sampler(self, batch_size: int, *, device=None, prefetch: int | None = None, seed: int | None = None,
                name: str | None = None, pin_memory: bool | None = None, prioritized: bool = False,
                alpha: float | None = None, beta: float = 0.4, eps: float | None = None, n_step: int = 1,
                gamma: float | None = None, priority_eps: float | None = None, seq_len: int | None = None,
                burn_in: int | None = None, strict: bool | None = None, sample_from: str | None = None,
                eta: float | None = None) -> Sampler:
        """An iterator of batches in reused buffers (see ``Sampler``): valid until the next batch on CPU.

        ``device``: batches are copied there (from pinned buffers, ``non_blocking``, for CUDA).
        ``prefetch`` batches are assembled ahead by a background thread (default: 2 for an accelerator
        device, 0 on CPU, where the thread would compete with training). ``seed=None`` continues the
        committed RNG state of sampler ``name`` (default ``"default"``; one open sampler per name).
        ``pin_memory`` defaults to True for CUDA.

        Prioritized replay (``prioritized=True``): draws proportionally to ``(priority + eps) ** alpha``
        (``alpha``/``eps`` left out: the committed set's, else 0.6 and 1e-6) and sets ``batch.weights``,
        importance weights ``(P / min P) ** -beta``; report priorities with
        ``sampler.update_priorities(batch.indices, td_errors.abs())``. Committed with the store.
        n-step returns (``n_step=n``, ``gamma``, default 0.99): ``reward`` becomes the discounted sum over
        the episode's next ``m <= n`` steps, ``next_obs`` the observation after them, and ``batch.discount``
        is ``gamma ** m``. ``priority_eps`` is the deprecated spelling of ``eps``.

        Sequences (``seq_len=L``): the same as ``sequence_sampler(batch_size, L, ...)``, a
        ``SequenceSampler`` of slices of episodes (default ``name`` ``"sequence"``); ``burn_in``,
        ``strict``, ``sample_from`` and ``eta`` are its options, refused without ``seq_len``, and
        ``n_step``/``gamma`` are refused with it (a slice holds every step's own reward)."""
        if priority_eps is not None:
            warnings.warn("Store.sampler(priority_eps=...) is deprecated; use eps=...", DeprecationWarning,
                          stacklevel=2)
            eps = priority_eps if eps is None else eps
        options = {"burn_in": burn_in, "strict": strict, "sample_from": sample_from, "eta": eta}
        common = dict(device=device, prefetch=prefetch, seed=seed, pin_memory=pin_memory, prioritized=prioritized,
                      alpha=alpha, beta=beta, eps=eps)
        if seq_len is not None:
            if n_step != 1 or gamma is not None:
                raise ValueError(f"n_step={n_step!r}, gamma={gamma!r} are for transition samplers; a sequence "
                                 f"sampler (seq_len={seq_len!r}) returns every step's own reward: leave them out")
            given = {k: v for k, v in options.items() if v is not None}
            return self.sequence_sampler(batch_size, seq_len, name=DEFAULT_SEQUENCE_NAME if name is None else name,
                                         **common, **given)
        given = sorted(k for k, v in options.items() if v is not None)
        if given:
            what = "is a sequence option" if len(given) == 1 else "are sequence options"
            raise TypeError(f"{', '.join(given)} {what} of Store.sampler: give seq_len= too (slices of episodes), "
                            f"or leave {'it' if len(given) == 1 else 'them'} out")
        name = "default" if name is None else name
        gamma = 0.99 if gamma is None else gamma
        check_sampler_args(self.schema, batch_size, name, beta, n_step, gamma)  # before a priority set is made
        prio = self.priorities(name, alpha=alpha, eps=eps) if prioritized else None
        smp = Sampler(self.schema, self._fill_batch, batch_size, device=device, prefetch=prefetch, seed=seed,
                      name=name, pin_memory=pin_memory, priorities=prio, update=self._update_priorities, beta=beta,
                      n_step=n_step, gamma=gamma, saved_state=self._state.samplers.saved_state(name))
        return self._register(smp)

    def sequence_sampler(self, batch_size: int, seq_len: int, *, burn_in: int = 0, strict: bool = True,
                         sample_from: str = "steps", device=None, prefetch: int | None = None,
                         seed: int | None = None, name: str = DEFAULT_SEQUENCE_NAME, pin_memory: bool | None = None,
                         prioritized: bool = False, alpha: float | None = None, beta: float = 0.4,
                         eps: float | None = None, eta: float = DEFAULT_ETA) -> SequenceSampler:
        """Batches of ``seq_len`` consecutive steps of one episode and stream (``SequenceBatch``): ``obs
        (B, T, ...)``, ``action``, ``reward``, ``terminated``, ``truncated``, ``mask``, ``indices`` ``(B, T)``
        with ``T = burn_in + seq_len``, and ``next_obs`` of each window's last real step.

        ``strict=True`` draws only slices of ``seq_len`` real steps; ``strict=False`` pads past an episode
        end (``mask`` False, zeros). ``burn_in=b`` prepends the ``b`` steps before each slice (left-padded
        near an episode start). ``sample_from="steps"`` draws starts uniformly over steps, ``"episodes"``
        over episodes then steps. ``prioritized=True``: one priority per slice start (``alpha``, ``beta``,
        ``eps`` as for ``sampler``); ``sampler.update_priorities(batch, td_errors)`` mixes max and mean
        with ``eta`` (R2D2: 0.9). ``device``, ``prefetch``, ``seed``, ``pin_memory`` as for ``sampler``; the
        default ``name`` is ``"sequence"`` (one open sampler per name)."""
        # before a priority set is made
        check_sequence_args(self.schema, batch_size, name, beta, seq_len, burn_in, strict, sample_from, prioritized,
                            eta)
        prio = self.priorities(name, alpha=alpha, eps=eps) if prioritized else None
        smp = SequenceSampler(self.schema, self._fill_sequences, batch_size, seq_len, burn_in=burn_in, strict=strict,
                              sample_from=sample_from, device=device, prefetch=prefetch, seed=seed, name=name,
                              pin_memory=pin_memory, priorities=prio, update=self._update_priorities, beta=beta,
                              eta=eta, saved_state=self._state.samplers.saved_state(name))
        return self._register(smp)

    def _register(self, smp: Sampler) -> Sampler:
        """``smp`` is now the open sampler of its name (an error, and ``smp`` closed, if one is open)."""
        with self._lock:
            try:
                self._state.samplers.register(smp)
            except ValueError:
                smp.close()
                raise
        return smp

    def sample(self, batch_size: int, seed: int | None = None, rng: np.random.Generator | None = None, *,
               out: BatchBuffers | None = None) -> Batch:
        """One uniform batch of fresh torch tensors (for training loops use ``sampler``); with ``out`` (a
        ``BatchBuffers(store.schema, batch_size)``) the batch is drawn into those reused buffers."""
        validate_capacity(batch_size, "batch_size")
        if out is not None and out.batch_size != batch_size:
            raise ValueError(f"out holds batches of {out.batch_size}, not batch_size {batch_size}")
        rng = rng if rng is not None else self._rng if seed is None else np.random.default_rng(seed)
        with self._lock:
            self._check_open()
            self._drain()  # check before allocating the batch (10**6 Atari stacks: 28 GB)
            check_batch_size(self._state.ring, self.frame_stack, self._state.frames.head, batch_size)
        buf = out if out is not None else BatchBuffers(self.schema, batch_size)
        self._fill_batch(buf, rng)
        return buf.batch()

    def _fill_batch(self, buf: BatchBuffers, rng: np.random.Generator, *, priorities: Priorities | None = None,
                    beta: float = 0.0, n_step: int = 1, gamma: float = 1.0) -> None:
        """Draw a batch into ``buf`` (see ``sampling.draw.draw_into``); in a reader, draw again if the
        writer overwrote what it read."""
        with self._lock:
            self._check_open()
            self._state.draw(buf, rng, self._drain, priorities=priorities, beta=beta, n_step=n_step, gamma=gamma)

    def _fill_sequences(self, buf: SequenceBuffers, drawer: StartDrawer, rng: np.random.Generator, *,
                        priorities: Priorities | None = None, beta: float = 0.0) -> None:
        """Draw windows with ``drawer`` into ``buf`` (see ``StoreState.draw_sequences``)."""
        with self._lock:
            self._check_open()
            self._state.draw_sequences(buf, drawer, rng, self._drain, priorities=priorities, beta=beta)

    def draw_indices(self, batch_size: int, rng: np.random.Generator | None = None, *,
                     priorities: Priorities | None = None, beta: float = 0.4) -> tuple[np.ndarray, np.ndarray | None]:
        """Transition ids drawn as a sampler draws them, without reading any frame (for samplers of other
        libraries that fetch the data later, with ``get``): ``batch_size`` valid ids uniformly, or
        proportionally to ``priorities`` (a set from ``priorities(name)``) with importance weights for
        ``beta``. Returns ``(ids, weights)`` (weights None when uniform); ``rng`` defaults to the store's."""
        validate_capacity(batch_size, "batch_size")
        rng = self._rng if rng is None else rng
        with self._lock:
            self._check_open()
            self._drain()
            return self._state.draw_indices(batch_size, rng, priorities=priorities, beta=beta)

    def draw_windows(self, drawer: StartDrawer, batch_size: int,
                     rng: np.random.Generator | None = None) -> np.ndarray:
        """Episode slices drawn as a sequence sampler draws them, without reading any frame: ``(batch_size,
        burn_in + seq_len)`` transition ids, ``-1`` where a window is padded. ``drawer`` is a
        ``mmreplay.sampling.sequences.StartDrawer`` (it keeps its episode table between calls); ``rng``
        defaults to the store's."""
        validate_capacity(batch_size, "batch_size")
        rng = self._rng if rng is None else rng
        with self._lock:
            self._check_open()
            self._drain()
            return self._state.draw_windows(drawer, batch_size, rng)

    def get(self, indices, *, out: BatchBuffers | None = None) -> Batch:
        """The transitions with these global ids (must be valid), as a Batch of fresh tensors; with ``out``
        (``BatchBuffers`` of exactly that many rows, e.g. ``numpy=True`` ones) read into those buffers."""
        g = as_transition_ids(indices)
        if out is not None and out.batch_size != g.size:
            raise ValueError(f"get: out holds {out.batch_size} rows, expected {g.size} (one per index)")
        buf = out if out is not None else BatchBuffers(self.schema, g.size)
        with self._lock:
            self._check_open()
            self._drain()
            self._state.gather(g, buf)
        return buf.batch()

    # -- priorities -------------------------------------------------------------------------------
    def priorities(self, name: str = "default", *, alpha: float | None = None, eps: float | None = None) -> Priorities:
        """The priority set ``name`` (loaded from the last commit, or new with every transition at the
        maximum priority), for reading: ``.of(indices)``, ``.total``. A sampler with ``prioritized=True``
        uses the one of its own name. ``alpha`` and ``eps`` change a set's exponents; left out, a committed
        set keeps its own and a new one gets 0.6 and 1e-6."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._state.priorities.get(name, alpha, eps)

    def _update_priorities(self, prio: Priorities, indices, values) -> int:
        with self._lock:
            self._check_open()
            self._drain()
            return prio.update(indices, values)

    @property
    def app_meta(self) -> dict:
        """The application's metadata of the last commit (``flush(app_meta=...)``); ``{}`` if none."""
        with self._lock:
            return json.loads(json.dumps(self._state.log.record.get("app", {})))

    def has_sampler_state(self, name: str) -> bool:
        """Was an RNG state of sampler ``name`` committed (a sampler made with ``seed=None`` continues it)?"""
        return self._state.samplers.saved_state(name) is not None

    # -- what is stored ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of valid transitions (those a sampler can return)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._state.ring.count_valid(self.frame_stack, self._state.frames.head)

    @property
    def num_added(self) -> int:
        """Transitions ever added (including those since overwritten)."""
        return self._locked(lambda: self._state.ring.head)

    @property
    def num_frames(self) -> int:
        """Distinct observations ever stored (each frame once, however many stacks it belongs to)."""
        return self._locked(lambda: self._state.frames.head)

    def valid_range(self) -> tuple[int, int]:
        """``(oldest, head)``: valid global ids lie in this range (a few near ``oldest`` may not be)."""
        return self._locked(lambda: (self._state.ring.oldest, self._state.ring.head))

    def stream_tail(self, stream: int) -> tuple[int, bool] | None:
        """``(id, ended)``: the global id of stream ``stream``'s newest transition still held and whether it
        ended its episode, or None. The stream's next add continues that episode iff it did not end and the
        observation equals that transition's next observation (``get([id]).next_obs``)."""
        def read():
            streams, sid = self._state.streams, int(stream)
            last = streams.last.get(sid, -1)
            return None if last < self._state.ring.oldest else (last, streams.ended.get(sid, True))
        return self._locked(read)

    def read_column(self, name: str, lo: int, hi: int) -> np.ndarray:
        """The stored values of transition column ``name`` (``action``, ``reward``, an extra, or
        ``terminated``/``truncated`` as bools) for transitions ``lo <= g < hi`` (within ``valid_range()``)."""
        specs = {c.name: c for c in self.schema.transition_columns}
        if name not in specs and name not in TransitionRing.FLAG_COLUMNS:
            raise KeyError(f"no transition column {name!r}; columns: {[*specs, *TransitionRing.FLAG_COLUMNS]}")
        codes = self._locked(lambda: self._state.ring.read_range(name, lo, hi, "read_column"))
        return codes.astype(bool) if name not in specs else ColumnEncoder(specs[name]).decode(codes).copy()

    def episode_links(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For transitions ``lo <= g < hi`` (within ``valid_range()``): ``(prev, terminated, truncated)``,
        where ``prev`` is the global id of the previous step of ``g``'s episode (-1 at an episode start;
        it may lie below ``oldest`` where the ring overwrote it) and the flags are bools."""
        return self._locked(lambda: self._state.ring.episode_links(lo, hi))

    def verify(self, progress=None) -> list[str]:
        """Read back every committed shard: each index and chunk checksum, each decoded size. Returns the
        problems found (empty: the store is intact); ``progress(done, total)`` is called per shard."""
        with self._lock:
            self._check_open()
            layouts, work = committed_work(self.path, self._state.log.record, self._state.ring, self._state.frames)
        return verify(self.path, layouts, work, progress)

    def info(self) -> dict:
        """Schema, counts and disk use per column (what ``mmreplay info`` prints)."""
        st = self._state
        return self._locked(lambda: store_info(self.path, self._meta, self.schema, st.ring, st.frames))

    @property
    def geometry(self) -> StoreGeometry:
        """Capacity, and rows and shard rows of the transition and frame rings (an unbounded store's rows
        grow); ``geometry.transitions.slot(ids)`` is where transitions ``ids`` live (e.g. in ``raw``
        priorities)."""
        with self._lock:
            return self._state.geometry()

    @property
    def observation_space(self):
        return self.schema.spaces()[0]

    @property
    def action_space(self):
        return self.schema.spaces()[1]

    def cache_stats(self) -> dict[str, dict]:
        """Per observation key: hits, misses, evictions and bytes of the decoded-frame cache, and under
        ``"compressed"`` the compressed shards held in RAM below it (see docs/guide.md, "Cache budget")."""
        self._check_open()
        return self._state.reader.stats()

    def _locked(self, read):
        """``read()`` under the lock, on an open store, with nothing pending."""
        with self._lock:
            self._check_open()
            self._drain()
            return read()

    # -- deprecated spellings, kept for one release -----------------------------------------------
    def fill_batch(self, buf: BatchBuffers, rng: np.random.Generator, **draw: Any) -> None:
        """Deprecated: use ``sample(batch_size, rng=rng, out=buffers)`` or ``Sampler.sample_into``."""
        _deprecated("Store.fill_batch(...)", "Store.sample(batch_size, rng=rng, out=buffers)")
        self._fill_batch(buf, rng, **draw)

    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Deprecated: transition ids and frame stacks of a uniform draw (use ``sample(...).indices``)."""
        _deprecated("Store.sample_indices(...)", "Store.sample(...).indices")
        st = self._state
        return self._locked(lambda: draw_uniform(st.ring, self.frame_stack, st.frames.head, batch_size, rng))

    def update_priorities(self, indices, priorities, name: str = "default") -> int:
        """Deprecated: use ``sampler.update_priorities(batch.indices, priorities)``, the one way."""
        _deprecated("Store.update_priorities(...)", "Sampler.update_priorities(batch.indices, priorities)")
        prio = self._state.priorities.loaded.get(name)
        if prio is None:
            raise KeyError(f"no prioritized sampler named {name!r} on this store; make one with "
                           f"store.sampler(batch_size, prioritized=True, name={name!r}) first")
        return self._update_priorities(prio, indices, priorities)

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit what was added (writers) and release everything. Also run for a writer that is garbage
        collected or still open when the interpreter exits: a normal exit loses nothing."""
        forking.forget_at_exit(self)
        if self._closed:
            return
        self._state.samplers.close_all()  # before taking the lock: their threads may be waiting on it
        try:
            if self._writer is not None and self._writer.failed is None:
                self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.closed = True
            self._state.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "mode", "r") != "a" or not hasattr(self, "_state"):
            return  # closed, a reader, or its construction failed (nothing was added)
        try:
            self.close()
        except Exception as exc:  # nobody to raise to: say it, at least
            warnings.warn(f"mmreplay: store {self.path!r} could not commit when it was garbage collected: {exc}",
                          RuntimeWarning, stacklevel=1)

    @property
    def closed(self) -> bool:
        """Was the store closed (``close()``, or opened before this process was forked)?"""
        return self._closed

    def __enter__(self) -> "Store":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"{len(self)} transitions"
        cap = "unbounded" if self.capacity is None else f"capacity={self.capacity}"
        return f"<mmreplay.Store {self.path!r} {cap} frame_stack={self.frame_stack} {state}>"

    def _check_open(self) -> None:
        if self._closed:
            if self._forked:
                raise StoreClosedError(f"store {self.path!r} was opened before this process was forked from its "
                                       "parent; open it again in the child (Store.open(path, mode='r') to read), "
                                       "or use the 'spawn' or 'forkserver' start method")
            raise StoreClosedError(f"store {self.path!r} is closed")

    def _refuse_write(self):
        self._check_open()
        raise ReadOnlyError(f"store {self.path!r} was opened read-only (mode='r')")

    def _after_fork_in_child(self) -> None:
        """See storage/forking.py: the parent's store is not this process's to use, nor its lock to hold."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the parent keeps the lock; it ends with the parent, not with us
            self._lock_fd = None
        self._lock = threading.RLock()  # the parent's may be held by a thread that does not exist here
        if self._writer is not None:
            self._writer.lock, self._writer.closed = self._lock, True
        self._forked = self._forked or not self._closed
        self._closed = True


def _deprecated(old: str, new: str) -> None:
    warnings.warn(f"{old} is deprecated and will be removed in the next release; use {new}", DeprecationWarning,
                  stacklevel=3)
