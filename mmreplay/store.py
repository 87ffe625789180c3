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
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import ColumnSpec, Schema, choose_frame_codec, schema_from_spaces
from mmreplay.committing import check_rollback
from mmreplay.errors import FormatError, ReadOnlyError, StoreClosedError
from mmreplay.index.ring import TransitionRing
from mmreplay.inspection import committed_work, first_readable, store_info, verify
from mmreplay.sampling.batch import Batch, BatchBuffers
from mmreplay.sampling.priorities import Priorities
from mmreplay.sampling.sampler import Sampler, check_batch_size_arg
from mmreplay.sampling.strategy import (DEFAULT_NAME, DrawStrategy, Ids, Picked, Prioritized, Transitions,
                                        check_strategy)
from mmreplay.settings import Settings
from mmreplay.state import StoreState
from mmreplay.storage.durability import forking
from mmreplay.storage.durability.commit import FORMAT_VERSION, check_app_meta, read_commit
from mmreplay.storage.files import acquire_writer_lock
from mmreplay.storage.format.layout import StoreGeometry
from mmreplay.storage.durability.meta import (check_open_memory, check_record, plan_geometry, prepare_new_store_dir, read_meta,
                                   validate_capacity)
from mmreplay.writing import Writer


class Store:
    """A replay store on disk: ``Store.create`` makes one, ``Store.open`` reopens it exactly as last committed.

    Add transitions with ``add`` (one env step) or ``extend`` (a vector env's steps); draw training
    batches with ``sampler(batch_size, draw=...)`` (reused buffers, optional prefetch; ``draw`` is a
    strategy: ``Uniform()``, ``Prioritized(...)``, ``NStep(...)``, ``Sequences(...)``) or ``sample``
    (fresh tensors); ``inspect`` holds the reads for tools (``inspect.get(ids)``, ...). One process may
    hold a store open for writing (``mode="a"``); any number may read it (``mode="r"``, then ``refresh()``
    to follow the writer). Everything added is durable after ``flush()``/``close()`` and the automatic
    commits (see ``Settings``); close the store (or use ``with``) when done. ``help(mmreplay.Settings)`` lists the per-session settings.
    """

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, observation_space, action_space, capacity: int | None = 1_000_000, *,
               frame_stack: int = 1, reward_values: Sequence[float] | None = None, frame_codec: Any = "auto",
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
        frame ring, not ``capacity``, the limit on ``len(store)``. ``frame_codec``: ``"lz4hc"`` (each frame
        alone), ``"delta-zstd"`` (runs of frames coded against each other: ~5x smaller, more CPU a sample), a
        codec dict, or ``"auto"`` (default): the temporal codec for colour frames and for stores whose frames,
        coded one by one, would not fit ``cache_bytes`` at this capacity (``columns.spec.choose_frame_codec``);
        the choice is stored, so reopening never changes it. ``settings`` (or its fields as
        keywords: ``cache_bytes=``, ``commit_every=``, ``commit_seconds=``, ``durable=``) are this
        session's choices, not stored.
        """
        path = os.fspath(path)
        settings = Settings.resolve(settings, session)
        validate_capacity(capacity, "capacity")
        if frame_codec == "auto":  # chosen from the frames, the capacity and the budget (choose_frame_codec)
            frames_kept = frame_capacity or (None if capacity is None else capacity + capacity // 8)
            frame_codec = choose_frame_codec(observation_space, frames_kept, settings.cache_bytes)
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
        # The commit group is written by us (atomically), never by zarr: see storage/durability/commit.py.
        store = cls(path, meta, record=None, mode="a", settings=settings)
        state = store._state
        for layout in state.array_layouts():
            layout.create(root)
        state.commit()  # the first record: the arrays exist, nothing is written yet
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
        self._guard = _Guard(self)
        self._view = StoreView(self._state, self.schema, self._guard)
        self._inspector = StoreInspector(self._view, self.frame_stack)
        self._writer = self._new_writer() if mode == "a" else None

    def _new_writer(self) -> Writer:
        return Writer(self._state, self._lock, self.settings)

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
            writer.flush()

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
            n = check_rollback(num_added, *self._state.valid_range())
            open_samplers = self._state.open_sampler_names()
            if open_samplers:
                raise RuntimeError(f"rollback: close the open sampler(s) {open_samplers} first (they hold "
                                   "positions and priorities of the transitions being dropped)")
            self.flush()  # the state before is committed whole: a crash from here on leaves it or the new one
            dropped = self._state.num_added() - n
            if dropped == 0:
                return 0
            with writer.failing_writes():
                self._state.commit_rollback(n)
            self._reload_committed()
            return dropped

    def _reload_committed(self) -> None:
        """Rebuild the state in RAM from the commit record on disk, exactly as ``open`` would."""
        record = read_commit(self.path)
        check_record(record, self._meta, self.path)
        self._state.close_samplers()
        self._state.close()
        try:
            self._state = StoreState(self.path, self._meta, self.schema, record, writable=True,
                                     settings=self.settings)
        except BaseException:  # the commit is on disk; reopening the store continues from it
            self._closed = True
            self._writer.close(self._closed_message())
            raise
        self._view.rebind(self._state)  # the inspector (and anything holding the view) reads the new state
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
    def sampler(self, batch_size: int, draw: DrawStrategy | None = None, *, device=None, prefetch: int | None = None,
                seed: int | None = None, name: str | None = None, pin_memory: bool | None = None,
                decode: str = "auto") -> Sampler:
        """An iterator of batches drawn by ``draw`` in reused buffers (see ``Sampler``): valid until the next
        batch on CPU.

        ``draw`` (``mmreplay.sampling.strategy``): ``Uniform()`` (the default), ``Prioritized(alpha, beta,
        eps)`` (``batch.weights``; ``sampler.update_priorities(batch.indices, td.abs())``),
        ``NStep(n, gamma, over=Uniform() | Prioritized(...))`` (n-step returns, ``batch.discount``) or
        ``Sequences(seq_len, burn_in, strict, sample_from, eta, over=...)`` (``SequenceBatch``es of slices
        of episodes), or a strategy of your own (docs/guide.md). ``device``: batches are copied there (from
        pinned buffers, ``non_blocking``, for CUDA). ``prefetch`` batches are assembled ahead by a background
        thread (default: 2 for an accelerator device, 0 on CPU, where the thread would compete with
        training). ``seed=None`` continues the committed RNG state of sampler ``name`` (default
        ``"default"``, sequences ``"sequence"``; one open sampler per name; a prioritized draw uses the
        priority set of that name, committed with the store). ``pin_memory`` defaults to True for CUDA.
        ``decode``: where frames are decoded, ``"auto"`` / ``"cpu"`` / ``"device"`` (``Sampler``); a device
        path holds up to ``settings.device_cache_bytes`` of compressed chunks on the device."""
        return Sampler(self._view, batch_size, draw, device=device, prefetch=prefetch, seed=seed, name=name,
                       pin_memory=pin_memory, decode=decode, device_cache_bytes=self.settings.device_cache_bytes)

    def sample(self, batch_size: int, draw: DrawStrategy | None = None, *,
               seed: int | np.random.Generator | None = None) -> Batch:
        """One batch drawn by ``draw`` (default ``Uniform()``) into fresh tensors (for training loops use
        ``sampler``); ``seed`` is an int, a ``numpy.random.Generator`` to draw with, or None (the store's
        own RNG)."""
        batch_size = check_batch_size_arg(batch_size)
        draw = check_strategy(draw)
        rng = self._rng if seed is None else np.random.default_rng(seed)
        if isinstance(draw, Transitions):
            with self._guard:  # check before allocating the batch (10**6 Atari stacks: 28 GB)
                self._state.check_batch_size(batch_size)
        draw.validate(self.schema)
        buf = draw.new_buffers(self.schema, batch_size)
        self._view.read(draw, batch_size, rng, buf)
        return buf.batch()

    @property
    def inspect(self) -> "StoreInspector":
        """Reads for tools, tests and other libraries' samplers, not training loops: ``get(ids)``, index-only
        ``draw``, ``read_column``, ``episode_links``, ``valid_range``, ``stream_tail``, ``priorities``,
        ``cache_stats`` (see ``StoreInspector``)."""
        return self._inspector

    @property
    def app_meta(self) -> dict:
        """The application's metadata of the last commit (``flush(app_meta=...)``); ``{}`` if none."""
        with self._lock:
            return json.loads(json.dumps(self._state.committed_record().get("app", {})))

    # -- what is stored ---------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of valid transitions (those a sampler can return)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._state.count_valid()

    @property
    def num_added(self) -> int:
        """Transitions ever added (including those since overwritten)."""
        return self._locked(lambda: self._state.num_added())

    def verify(self, progress=None) -> list[str]:
        """Read back every committed shard: each index and chunk checksum, each decoded size. Returns the
        problems found (empty: the store is intact); ``progress(done, total)`` is called per shard."""
        with self._lock:
            self._check_open()
            st = self._state
            layouts, work = committed_work(self.path, st.committed_record(), st.ring, st.frames)
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

    def _locked(self, read):
        """``read()`` under the lock, on an open store, with nothing pending."""
        with self._guard:
            return read()

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit what was added (writers) and release everything. Also run for a writer that is garbage
        collected or still open when the interpreter exits: a normal exit loses nothing."""
        forking.forget_at_exit(self)
        if self._closed:
            return
        self._state.close_samplers()  # before taking the lock: their threads may be waiting on it
        try:
            if self._writer is not None and self._writer.failed is None:
                self.flush()
        finally:
            self._closed = True
            if self._writer is not None:
                self._writer.close(self._closed_message())
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
            raise StoreClosedError(self._closed_message())

    def _closed_message(self) -> str:
        if self._forked:
            return (f"store {self.path!r} was opened before this process was forked from its parent; open it again "
                    "in the child (Store.open(path, mode='r') to read), or use the 'spawn' or 'forkserver' start "
                    "method")
        return f"store {self.path!r} is closed"

    def _refuse_write(self):
        self._check_open()
        raise ReadOnlyError(f"store {self.path!r} was opened read-only (mode='r')")

    def _after_fork_in_child(self) -> None:
        """See storage/durability/forking.py: the parent's store is not this process's to use, nor its lock to hold."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the parent keeps the lock; it ends with the parent, not with us
            self._lock_fd = None
        self._lock = threading.RLock()  # the parent's may be held by a thread that does not exist here
        self._forked = self._forked or not self._closed
        self._closed = True
        if self._writer is not None:
            self._writer.lock = self._lock
            self._writer.close(self._closed_message())



class _Guard:
    """``with guard as drain:`` holds the store's lock on an open store with nothing pending (what every
    read takes); ``drain`` is for reads that drain again per attempt. A plain class, not a generator-based
    context manager: it is entered once per batch."""

    __slots__ = ("_store",)

    def __init__(self, store: Store):
        self._store = store

    def __enter__(self) -> Callable[[], None]:
        store = self._store
        store._lock.acquire()
        try:
            store._check_open()
            store._drain()
        except BaseException:
            store._lock.release()
            raise
        return store._drain

    def __exit__(self, *exc) -> None:
        self._store._lock.release()


class StoreView:
    """The narrow view of a store that its samplers hold (``sampling.sampler.SamplerSource``): the one
    race-checked read, the priority sets and the sampler registry, each under the store's guard (its
    lock, open, nothing pending). It gives no way to write, commit or close the store."""

    def __init__(self, state: StoreState, schema: Schema, guard: _Guard):
        self._state, self.schema, self._guard = state, schema, guard

    def rebind(self, state: StoreState) -> None:
        """Read ``state`` from now on (``Store.rollback`` rebuilds the state from its commit)."""
        self._state = state

    def read(self, draw: DrawStrategy, size: int, rng: np.random.Generator | None, buffers: Any = None) -> Picked:
        """``StoreState.read`` under the guard."""
        with self._guard as drain:
            return self._state.read(draw, size, rng, drain, buffers)

    def priorities(self, prioritized: Prioritized) -> Priorities:
        with self._guard:
            return self._state.priority_set(prioritized.set_name, prioritized.alpha, prioritized.eps)

    def update_priorities(self, prioritized: Prioritized, indices, values) -> int:
        with self._guard:
            return self._state.priority_set(prioritized.set_name).update(indices, values)

    def saved_state(self, name: str) -> dict | None:
        return self._state.saved_sampler_state(name)

    def register(self, sampler: Sampler) -> None:
        with self._guard:
            self._state.register_sampler(sampler)

    def locked(self, read: Callable[[StoreState], Any]) -> Any:
        """``read(state)`` under the guard (for ``StoreInspector``)."""
        with self._guard:
            return read(self._state)


class StoreInspector:
    """``store.inspect``: reads for tools, tests and other libraries' samplers (which fetch rows later),
    not for training loops. Every read takes the store's lock on an open store with nothing pending."""

    def __init__(self, view: StoreView, frame_stack: int):
        self._view, self._k = view, frame_stack

    def get(self, indices, *, out: BatchBuffers | None = None) -> Batch:
        """The transitions with these global ids (must be valid), as a Batch of fresh tensors; with ``out``
        (``BatchBuffers`` of exactly that many rows, e.g. ``numpy=True`` ones) read into those buffers."""
        ids = Ids(indices)
        if out is not None and out.batch_size != ids.ids.size:
            raise ValueError(f"get: out holds {out.batch_size} rows, expected {ids.ids.size} (one per index)")
        buf = out if out is not None else ids.new_buffers(self._view.schema, ids.ids.size)
        self._view.read(ids, ids.ids.size, None, buf)
        return buf.batch()

    def draw(self, draw: DrawStrategy, size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray | None]:
        """Ids drawn as a sampler with ``draw`` draws them, without reading any frame: ``(ids, weights)``
        as fresh arrays, ``ids`` ``(size,)`` transition ids (``(size, burn_in + seq_len)`` windows with
        ``-1`` padding for ``Sequences``), ``weights`` None unless prioritized. A ``Prioritized`` without a
        ``name`` draws by the set ``"default"``; a strategy object keeps its state (a ``Sequences``' episode
        table) between calls."""
        draw = check_strategy(draw)
        size = check_batch_size_arg(size)

        def pick(state: StoreState) -> tuple[np.ndarray, np.ndarray | None]:
            if isinstance(draw, Transitions):
                state.check_batch_size(size)
            picked = state.read(draw, size, rng, lambda: None)
            weights = None if picked.weights is None else picked.weights.astype(np.float32)
            return picked.ids.copy(), weights  # a priority set's draw buffers are reused
        return self._view.locked(pick)

    def valid_range(self) -> tuple[int, int]:
        """``(oldest, head)``: the ids the store holds. ``get`` also needs an id's frame stack: after the
        ring cut an episode, its first ``frame_stack - 1`` kept steps near ``oldest`` are held but not
        readable. ``readable_range()`` gives the ids ``get`` accepts."""
        return self._view.locked(lambda st: st.valid_range())

    def readable_range(self) -> tuple[int, int]:
        """``(lo, head)``: every id in this range is one ``get`` accepts (at this commit); ``lo`` is
        ``valid_range()[0]`` unless the ring cut an episode whose frame stacks reach overwritten frames."""
        return self._view.locked(lambda st: (first_readable(st.ring, self._k, st.num_frames()), st.num_added()))

    @property
    def num_frames(self) -> int:
        """Distinct observations ever stored (each frame once, however many stacks it belongs to)."""
        return self._view.locked(lambda st: st.num_frames())

    def read_column(self, name: str, lo: int, hi: int) -> np.ndarray:
        """The stored values of transition column ``name`` (``action``, ``reward``, an extra, or
        ``terminated``/``truncated`` as bools) for transitions ``lo <= g < hi`` (within ``valid_range()``)."""
        specs = {c.name: c for c in self._view.schema.transition_columns}
        if name not in specs and name not in TransitionRing.FLAG_COLUMNS:
            raise KeyError(f"no transition column {name!r}; columns: {[*specs, *TransitionRing.FLAG_COLUMNS]}")
        codes = self._view.locked(lambda st: st.read_range(name, lo, hi, "read_column"))
        return codes.astype(bool) if name not in specs else ColumnEncoder(specs[name]).decode(codes).copy()

    def episode_links(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For transitions ``lo <= g < hi`` (within ``valid_range()``): ``(prev, terminated, truncated)``,
        where ``prev`` is the global id of the previous step of ``g``'s episode (-1 at an episode start;
        it may lie below ``oldest`` where the ring overwrote it) and the flags are bools."""
        return self._view.locked(lambda st: st.episode_links(lo, hi))

    def stream_tail(self, stream: int) -> tuple[int, bool] | None:
        """``(id, ended)``: the global id of stream ``stream``'s newest transition still held and whether it
        ended its episode, or None. The stream's next add continues that episode iff it did not end and the
        observation equals that transition's next observation (``get([id]).next_obs``)."""
        return self._view.locked(lambda st: st.stream_tail(stream))

    def priorities(self, name: str = DEFAULT_NAME, *, alpha: float | None = None,
                   eps: float | None = None) -> Priorities:
        """The priority set ``name`` (loaded from the last commit, or new with every transition at the
        maximum priority), for reading: ``.of(indices)``, ``.total``. A sampler with ``Prioritized`` uses
        the one of its own name. ``alpha`` and ``eps`` change a set's exponents; left out, a committed set
        keeps its own and a new one gets 0.6 and 1e-6."""
        return self._view.locked(lambda st: st.priority_set(name, alpha, eps))

    def has_sampler_state(self, name: str) -> bool:
        """Was an RNG state of sampler ``name`` committed (a sampler made with ``seed=None`` continues it)?"""
        return self._view.saved_state(name) is not None

    def cache_stats(self) -> dict[str, dict]:
        """Per observation key: hits, misses, evictions and bytes of the decoded-frame cache, and under
        ``"compressed"`` the compressed shards held in RAM below it (see docs/guide.md, "Cache budget")."""
        return self._view.locked(lambda st: st.cache_stats())
