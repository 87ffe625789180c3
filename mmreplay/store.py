"""``Store``: RL transitions on disk in a standard zarr v3 group, sampled in place.

The store composes four pieces, each with its own invariant: the *schema* (what the columns are), the
*frame ring* (observations, each frame stored once, compressed, on disk), the *index ring* (which
transition points at which frames, resident in RAM with every small per-transition column) and the
*commit record* (what survives a crash). Why this shape: an Atari DQN buffer is ~99% frames, and a
frame belongs to up to ``2 * frame_stack`` observations; storing it once, compressed, and keeping only
~12 bytes of index per transition in RAM is what turns a 28-56 GB buffer into one that fits anywhere.

Crash contract: ``flush()`` (also run automatically every ``commit_every`` transitions or
``commit_seconds`` seconds, and by ``close()``) makes every transition added so far durable; a crash
loses at most what was added since the last commit. Reopening restores exactly the last commit.
"""

from __future__ import annotations

import atexit
import fcntl
import os
import threading
import time
import warnings
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import ColumnSpec, Schema, schema_from_spaces
from mmreplay.errors import FormatError, NotAStoreError, ReadOnlyError, StorageError, StoreClosedError
from mmreplay.index.ring import TransitionRing, as_transition_ids
from mmreplay.index.streams import Streams
from mmreplay.sampling.batch import assemble
from mmreplay.sampling.nstep import nstep_returns
from mmreplay.storage import forking
from mmreplay.storage.commit import (COMMIT_FILE, FORMAT_VERSION, parse_commit, read_commit, read_commit_bytes,
                                     write_commit)
from mmreplay.storage.files import fsync_dir, fsync_files
from mmreplay.storage.frame_ring import FrameRing
from mmreplay.storage.meta import (check_open_memory, check_record, plan_geometry, read_meta,  # noqa: F401
                                   validate_capacity)
from mmreplay.storage.pending import PendingBlock
from mmreplay.writing import WritePath

MIB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MIB
DEFAULT_COMMIT_EVERY = 25_000
DEFAULT_COMMIT_SECONDS = 30.0


class Store(WritePath):
    """A replay store on disk. Create with ``Store.create``, reopen with ``Store.open``."""

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, observation_space, action_space, capacity: int | None = 1_000_000, *,
               frame_stack: int = 1, reward_values: Sequence[float] | None = None, frame_codec: Any = "lz4hc",
               extras: Sequence[ColumnSpec] = (), columns: Mapping[str, ColumnSpec] | None = None,
               frame_capacity: int | None = None, cache_bytes: int = DEFAULT_CACHE_BYTES,
               commit_every: int = DEFAULT_COMMIT_EVERY, commit_seconds: float = DEFAULT_COMMIT_SECONDS,
               durable: bool = True, stack_padding: str = "first") -> "Store":
        """Make a new store at ``path`` (which must not exist or be an empty directory).

        ``capacity`` transitions are kept (the oldest are overwritten); ``None`` grows without bound.
        With ``frame_stack=k`` observations come back as stacks of the last ``k`` frames of the episode;
        before the episode's first frame a stack repeats it (``stack_padding="first"``, gymnasium's
        FrameStackObservation) or holds zeros (``"zeros"``, SB3's VecFrameStack).
        ``frame_capacity`` (default ``capacity * 9/8``) bounds the distinct observations kept: each
        episode needs one frame more than it has transitions, so very short episodes may make the
        frame ring, not ``capacity``, the limit on ``len(store)``.
        """
        path = os.fspath(path)
        validate_capacity(capacity, "capacity")
        schema = schema_from_spaces(observation_space, action_space, reward_values=reward_values,
                                    frame_stack=frame_stack, frame_codec=frame_codec, extras=extras, columns=columns,
                                    stack_padding=stack_padding)
        if frame_capacity is not None:
            validate_capacity(frame_capacity, "frame_capacity")
        geometry = plan_geometry(schema, capacity, frame_capacity)
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            if not _never_committed(path):
                raise FileExistsError(f"cannot create a store at {path!r}: it exists and is not an empty directory "
                                      "(use Store.open to continue an existing store)")
            _remove_contents(path)  # a create that crashed before its first commit: nothing was ever stored
        os.makedirs(path, exist_ok=True)
        meta = {"format_version": FORMAT_VERSION, "schema": schema.to_json(), **geometry}
        import zarr

        root = zarr.open_group(path, mode="w", zarr_format=3, attributes={"mmreplay": meta})
        root.create_group("frames")
        root.create_group("transitions")
        # The commit group is written by us (atomically), never by zarr: see storage/commit.py.
        store = cls(path, meta, record=None, mode="a", cache_bytes=cache_bytes, commit_every=commit_every,
                    commit_seconds=commit_seconds, durable=durable)
        for layout in store._ring.layouts() + [c.layout for c in store._frames.columns.values()]:
            layout.create(root)
        store._commit_record(store._state_record())
        return store

    @classmethod
    def open(cls, path: str | os.PathLike, mode: str = "a", *, cache_bytes: int = DEFAULT_CACHE_BYTES,
             commit_every: int = DEFAULT_COMMIT_EVERY, commit_seconds: float = DEFAULT_COMMIT_SECONDS,
             durable: bool = True) -> "Store":
        """Open an existing store; ``mode="a"`` continues writing exactly where it was, ``"r"`` reads."""
        path = os.fspath(path)
        if mode not in ("a", "r"):
            raise ValueError(f"mode must be 'a' (read and append) or 'r' (read only), got {mode!r}")
        meta = read_meta(path)
        record = read_commit(path)
        check_record(record, meta, path)
        check_open_memory(meta, record, path, writable=mode == "a")
        try:
            return cls(path, meta, record=record, mode=mode, cache_bytes=cache_bytes, commit_every=commit_every,
                       commit_seconds=commit_seconds, durable=durable)
        except (ValueError, TypeError, KeyError, IndexError, OverflowError) as exc:
            # The checks above should leave nothing here; if metadata still slips through, say where it is.
            raise FormatError(f"store {path!r}: its metadata is inconsistent ({type(exc).__name__}: {exc})") from exc

    def __init__(self, path: str, meta: dict, *, record: dict | None, mode: str, cache_bytes: int,
                 commit_every: int, commit_seconds: float, durable: bool):
        self.path = path
        self.mode = mode
        self._meta = meta
        self.schema = Schema.from_json(meta["schema"])
        self.capacity: int | None = meta["capacity"]
        self.frame_stack = self.schema.frame_stack
        self.commit_every = validate_capacity(commit_every, "commit_every")
        self.commit_seconds = float(commit_seconds)
        self.durable = durable
        self._closed = False
        self._failed: OSError | None = None
        self._lock = threading.RLock()  # adds, flushes and batch assembly never interleave
        self._forked = False  # this object was inherited by a forked child: unusable there
        self._lock_fd = self._acquire_writer_lock() if mode == "a" else None
        forking.register(self)
        if mode == "a":
            _open_writers.add(self)
        unbounded = self.capacity is None
        rec = record or {}
        self._ring = TransitionRing(path, self.schema.transition_columns,
                                    rec.get("transition_rows", meta["transition_rows"]),
                                    meta["transition_shard_rows"], capacity=self.capacity,
                                    head=rec.get("head", 0), oldest=rec.get("oldest", 0))
        self._frames = FrameRing(path, self.schema.observations, rec.get("frame_rows", meta["frame_rows"]),
                                 meta["frame_shard_rows"], unbounded=unbounded, cache_bytes=cache_bytes,
                                 head=rec.get("frame_head", 0), oldest=rec.get("frame_oldest", 0),
                                 writable=mode == "a")
        self._encoders = {c.name: ColumnEncoder(c) for c in self.schema.transition_columns}
        self._streams = Streams(self.schema.observations)
        self._sequence = rec.get("sequence", 0)
        self._samplers: weakref.WeakValueDictionary = weakref.WeakValueDictionary()
        self._sampler_states: dict[str, dict] = dict(rec.get("samplers", {}))
        self._priorities: dict[str, Any] = {}  # name -> sampling.priorities.Priorities, loaded on first use
        self._priority_entries: dict[str, dict] = dict(rec.get("priorities", {}))  # committed, maybe not loaded
        self._priority_written: list[str] = []
        if record is not None:
            self._restore(record)
        self._durable_state = {**self._state_record(), "sequence": self._sequence}
        self._seen_commit: bytes | None = None  # readers: the commit file's bytes when last looked at
        self._reader_floor = (0, 0)  # readers: (oldest, frame_oldest) of the newest commit seen
        self._needs_reload = False  # readers: a refresh broke off; the next sample or get loads again
        if mode == "r":
            self._bound_by_newest_commit()
        if record is not None:
            self._check_frame_links(record)
        self._frames.before_overwrite = self._before_overwrite
        self._ring.before_overwrite = self._before_overwrite
        self._frames.on_invalidate = self._ring.advance_past_frames
        self._frames.on_grow = lambda rows: self._resize_arrays([c.layout for c in self._frames.columns.values()],
                                                                rows)
        self._ring.on_grow = lambda rows: self._resize_arrays(self._ring.layouts(), rows)
        self._pending = 0
        self._last_commit = time.monotonic()
        self._rng = np.random.default_rng()
        # A block must not write more frames (at most 2 per transition) than half a frame shard, and stays
        # within one transition shard: then it can never overwrite frames that it references itself.
        self._max_block = max(1, min(self._ring.shard_rows, self._frames.shard_rows // 4))
        self._block = PendingBlock(self.schema, self._max_block) if mode == "a" else None
        self._obs_spec = self.schema.observations[0]
        self._fast_add = mode == "a" and not self.schema.dict_obs and not self.schema.extras and all(
            c.shape == () for c in (self.schema.action, self.schema.reward))

    # -- readers of a store that another process writes -----------------------------------------
    def refresh(self) -> bool:
        """Read-only stores: catch up with the writer's latest commit (True if there was a newer one).
        Cached frames of shards written since are dropped; the rest of the cache stays warm. If loading
        fails (an I/O error, say), the store refuses to sample until a later refresh loads completely."""
        with self._lock:
            self._check_open()
            if self.mode != "r":
                return False
            record = read_commit(self.path)
            check_record(record, self._meta, self.path)
            reload = self._needs_reload
            if record["sequence"] == self._durable_state["sequence"] and not reload:
                return False
            self._needs_reload = True  # until this load completes: a half-loaded state is never sampled
            old_frame_head = self._durable_state["frame_head"]
            if reload:  # an earlier load broke off somewhere: trust no cached frame
                self._frames.drop_cached()
                old_frame_head = record["frame_head"]
            for disk in self._ring.disk.values():
                disk.close()
            self._ring = TransitionRing(self.path, self.schema.transition_columns, record["transition_rows"],
                                        self._meta["transition_shard_rows"], capacity=self.capacity,
                                        head=record["head"], oldest=record["oldest"])
            self._frames.catch_up(old_frame_head, record["frame_head"], record["frame_oldest"],
                                  record["frame_rows"])
            self._streams = Streams(self.schema.observations)
            self._restore(record)
            self._sequence = record["sequence"]
            self._durable_state = record
            # sets and samplers made from now on start from this commit (live ones keep their own state)
            self._priority_entries = dict(record.get("priorities", {}))
            self._sampler_states = dict(record.get("samplers", {}))
            self._bound_by_newest_commit()
            self._check_frame_links(record)
            self._needs_reload = False
            return True

    # Why readers are safe: the writer commits a larger ``oldest`` (``frame_oldest``) *before* it replaces the
    # files of what it gives up. So a row read at any instant is the committed row if it is not below the
    # ``oldest`` of a commit record read after the read. The index is read once per refresh (checked by
    # ``_bound_by_newest_commit``); frames are read per batch (checked by ``_batch_still_valid``).

    def _bound_by_newest_commit(self) -> None:
        """Readers, right after loading a commit's files: a later commit may have replaced some of them
        meanwhile. Narrow the valid range to the newest record, read after loading."""
        raw = read_commit_bytes(self.path)
        record = parse_commit(raw, os.path.join(self.path, COMMIT_FILE))
        self._seen_commit = raw
        self._reader_floor = (record["oldest"], record["frame_oldest"])
        ring, frames = self._ring, self._frames
        ring.oldest = min(max(ring.oldest, record["oldest"]), ring.head)
        frames.oldest = min(max(frames.oldest, record["frame_oldest"]), frames.head)
        ring.advance_past_frames(frames.oldest)

    def _batch_still_valid(self, g: np.ndarray, obs_ids: np.ndarray, next_ids: np.ndarray) -> bool:
        """Read-only stores: is every transition and frame this batch read above the ``oldest`` of every
        commit seen so far (the newest read now, after the batch)? The floor only rises until the next
        refresh: a commit seen after one batch still bounds the batches after it. Equal file bytes mean no
        new commit (the record's sequence grows with each), so the common case is one small read."""
        if self.mode != "r":
            return True
        raw = read_commit_bytes(self.path)
        if raw != self._seen_commit:
            record = parse_commit(raw, os.path.join(self.path, COMMIT_FILE))
            self._seen_commit = raw
            self._reader_floor = (max(self._reader_floor[0], record["oldest"]),
                                  max(self._reader_floor[1], record["frame_oldest"]))
        oldest, frame_oldest = self._reader_floor
        return int(g.min()) >= oldest and min(int(obs_ids.min()), int(next_ids.min())) >= frame_oldest

    def _register_sampler(self, sampler) -> None:
        with self._lock:
            old = self._samplers.get(sampler.name)
            if old is not None and old is not sampler:
                old.close()  # one live sampler per name: its state is what gets committed
            self._samplers[sampler.name] = sampler

    def _saved_sampler_state(self, name: str) -> dict | None:
        return self._sampler_states.get(name)

    def _check_frame_links(self, record: dict) -> None:
        """Every frame a valid transition refers to must lie in the record's frame range (what the record
        says and what the index holds must be one state). Readers call it once their valid range is
        bounded by the newest commit: rows below it may already belong to the writer's next lap."""
        lo, hi = self._ring.frame_span(record["frame_head"])
        if lo < record["frame_oldest"] or hi >= record["frame_head"]:
            raise FormatError(f"store {self.path!r}: its transitions refer to frames [{lo}, {hi}] but the commit "
                              f"record keeps frames [{record['frame_oldest']}, {record['frame_head']}) (an edited "
                              "or mismatched commit record)")

    def _restore(self, record: dict) -> None:
        self._ring.load(record["head"])
        # The episode links in RAM, not the record, say how far back a link reaches (what n-step and
        # stack-validity scans need): exact, and immune to an edited record.
        self._ring.max_prev_delta = self._ring.live_max_prev_delta()
        self._ring.rebuild_shard_min_frame(record["frame_head"])
        self._frames.load_staging()
        self._streams.restore(record["streams"])

    # -- commits ----------------------------------------------------------------------------------
    def flush(self) -> None:
        """Make every transition added so far durable (atomic commit); cheap when nothing changed."""
        with self._lock:
            self._check_open()
            if self.mode == "r":
                return
            if self._failed is not None:
                self._check_writable()
            self._drain()
            if self._pending == 0 and not self._frames.dirty and not self._ring.dirty and \
                    not self._sampler_state_changed() and not any(p.changed() for p in self._priorities.values()):
                return
            with self._failing_writes():
                self._frames.flush()
                self._ring.flush()
                self._write_priorities()
                self._sync_written()
                self._commit_record(self._state_record())
            self._pending = 0
            self._last_commit = time.monotonic()

    def _sampler_state_changed(self) -> bool:
        committed = self._durable_state.get("samplers", {})
        return any(committed.get(n) != smp.state for n, smp in list(self._samplers.items()))

    def _before_overwrite(self) -> None:
        """A shard file of the previous lap is about to be replaced: the durable commit must already
        have given up what it held, or a crash now would leave a commit pointing at new data."""
        durable = self._durable_state
        oldest = min(self._ring.oldest, durable["head"])
        frame_oldest = min(self._frames.oldest, durable["frame_head"])
        if durable["oldest"] >= oldest and durable["frame_oldest"] >= frame_oldest:
            return
        self._sync_written()  # files written so far are part of neither commit, but flush them anyway
        self._commit_record({**durable, "oldest": max(durable["oldest"], oldest),
                             "frame_oldest": max(durable["frame_oldest"], frame_oldest)})

    def _write_priorities(self) -> None:
        """Each loaded priority set writes its other buffer; the commit record then names it."""
        for name, prio in self._priorities.items():
            entry, files = prio.write()
            self._priority_entries[name] = entry
            self._priority_written.extend(files)

    def _ensure_priority_arrays(self, name: str, rows: int, shard_rows: int) -> None:
        """Zarr metadata for a priority set's two buffers (created once, grown with an unbounded ring)."""
        from mmreplay.sampling.priorities import PRIORITIES_GROUP, buffer_layout

        layouts = [buffer_layout(name, b, rows, shard_rows) for b in (0, 1)]
        missing = [lay for lay in layouts if not os.path.exists(os.path.join(self.path, lay.path, "zarr.json"))]
        if missing:
            import zarr

            root = zarr.open_group(self.path, mode="r+", zarr_format=3)
            root.require_group(PRIORITIES_GROUP).require_group(name)
            for layout in missing:
                layout.create(root)
                self._priority_written.append(os.path.join(self.path, layout.path, "zarr.json"))
        self._resize_arrays(layouts, rows)

    def _sync_written(self) -> None:
        written = self._frames.written + self._ring.written + self._priority_written
        if self.durable and written:
            fsync_files(written)
            dirs = {os.path.dirname(p) for p in written}
            for d in sorted(dirs | {os.path.dirname(d) for d in dirs}):
                fsync_dir(d)
        self._frames.written.clear()
        self._ring.written.clear()
        self._priority_written.clear()

    def _commit_record(self, record: dict) -> None:
        self._sequence += 1
        record = {**record, "sequence": self._sequence}
        write_commit(self.path, record, durable=self.durable)
        self._durable_state = record

    def _state_record(self) -> dict:
        return {"format_version": FORMAT_VERSION, "sequence": self._sequence, "head": self._ring.head,
                "oldest": self._ring.oldest, "frame_head": self._frames.head, "frame_oldest": self._frames.oldest,
                "transition_rows": self._ring.rows, "frame_rows": self._frames.rows,
                "max_prev_delta": self._ring.max_prev_delta, "streams": self._streams.to_json(),
                "samplers": {**self._sampler_states, **{n: smp.state for n, smp in list(self._samplers.items())}},
                "priorities": dict(self._priority_entries)}

    def _resize_arrays(self, layouts, rows: int) -> None:
        """Unbounded stores: make the zarr metadata cover ``rows`` (amortised: rows double)."""
        import zarr

        for layout in layouts:
            arr = zarr.open_array(store=self.path, path=layout.path, mode="r+")
            bits = (layout.attributes or {}).get("mmreplay", {}).get("packed_bits")
            new_len = rows * bits // 8 if bits else rows
            if new_len > arr.shape[0]:
                arr.resize((new_len, *arr.shape[1:]))

    # -- reading ----------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of valid transitions (those a sampler can return)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._ring.count_valid(self.frame_stack, self._frames.head)

    @property
    def num_added(self) -> int:
        """Transitions ever added (including those since overwritten)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._ring.head

    @property
    def num_frames(self) -> int:
        """Distinct observations ever stored (each frame once, however many stacks it belongs to)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._frames.head

    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``batch_size`` valid transition ids drawn uniformly, with their obs / next-obs frame stacks.
        Caller holds the lock."""
        self._check_batch_size(batch_size)
        ring = self._ring
        span = ring.head - ring.oldest
        g = ring.oldest + rng.integers(0, span, size=batch_size)
        obs_ids, next_ids, valid = ring.stack_frames(g, self.frame_stack, self._frames.head)
        for _ in range(1000):  # rejection keeps the draw uniform over valid transitions
            if valid.all():
                return g, obs_ids, next_ids
            bad = np.flatnonzero(~valid)
            g[bad] = ring.oldest + rng.integers(0, span, size=bad.size)
            o, nx, v = ring.stack_frames(g[bad], self.frame_stack, self._frames.head)
            obs_ids[bad], next_ids[bad], valid[bad] = o, nx, v
        raise RuntimeError("could not draw valid transitions (index inconsistent?)")

    def sample(self, batch_size: int, seed: int | None = None, rng: np.random.Generator | None = None):
        """One uniform batch of fresh torch tensors (for training loops use ``sampler``)."""
        from mmreplay.sampling.batch import BatchBuffers

        validate_capacity(batch_size, "batch_size")
        rng = rng if rng is not None else self._rng if seed is None else np.random.default_rng(seed)
        with self._lock:
            self._check_open()
            self._check_batch_size(batch_size)  # before allocating the batch (10**6 Atari stacks: 28 GB)
        buf = BatchBuffers(self, batch_size)
        self.fill_batch(buf, rng)
        return buf.batch(self)

    def _check_batch_size(self, batch_size: int) -> int:
        """The number of valid transitions, if a batch of ``batch_size`` can be drawn from them."""
        self._drain()
        n_valid = self._ring.count_valid(self.frame_stack, self._frames.head)
        if n_valid == 0:
            raise ValueError("cannot sample from an empty store (no valid transitions yet)")
        if batch_size > n_valid:
            raise ValueError(f"batch_size {batch_size} is larger than the store ({n_valid} valid transitions); "
                             "wait until it holds at least one batch")
        return n_valid

    def fill_batch(self, buf, rng: np.random.Generator, *, priorities=None, beta: float = 0.0, n_step: int = 1,
                   gamma: float = 1.0) -> None:
        """Draw a batch into ``buf``: uniform, or proportional to ``priorities`` (with importance weights for
        ``beta``); with ``n_step > 1`` rewards are n-step returns. In a reader, redo it if the writer
        overwrote what it read."""
        with self._lock:
            self._check_open()
            if self._needs_reload:
                self.refresh()
            for _ in range(10):
                weights = nstep = None
                if priorities is None:
                    g, obs_ids, next_ids = self.sample_indices(buf.batch_size, rng)
                else:
                    self._drain()
                    g, obs_ids, next_ids, weights = priorities.draw(buf.batch_size, rng, beta)
                if n_step > 1:
                    nstep = nstep_returns(self._ring, self._encoders["reward"].decode, g, n_step, gamma)
                    next_ids = self._ring.stack_frames(nstep.last, self.frame_stack, self._frames.head)[1]
                assemble(self, g, obs_ids, next_ids, buf, weights=weights, nstep=nstep)
                if self._batch_still_valid(g, obs_ids, next_ids):
                    return
                self.refresh()
            raise RuntimeError(f"store {self.path!r}: the writer kept overwriting what this reader sampled")

    def priorities(self, name: str = "default", *, alpha: float | None = None, eps: float | None = None):
        """The priority set ``name`` (loaded from the last commit, or new with every transition at the
        maximum priority); a sampler with ``prioritized=True`` uses the one of its own name. ``alpha`` and
        ``eps`` change a set's exponents; left out, a committed set keeps its own and a new one gets 0.6
        and 1e-6."""
        from mmreplay.sampling.priorities import DEFAULT_ALPHA, DEFAULT_PRIORITY_EPS, Priorities, check_name

        with self._lock:
            self._check_open()
            self._drain()
            prio = self._priorities.get(check_name(name))
            if prio is None:
                entry = self._priority_entries.get(name)
                saved = entry or {}
                alpha = saved.get("alpha", DEFAULT_ALPHA) if alpha is None else alpha
                eps = saved.get("eps", DEFAULT_PRIORITY_EPS) if eps is None else eps
                prio = Priorities(self, name, alpha=alpha, eps=eps, entry=entry)
                self._priorities[name] = prio
            elif alpha is not None or eps is not None:
                prio.set_alpha(prio.alpha if alpha is None else alpha, prio.eps if eps is None else eps)
            return prio

    def update_priorities(self, indices, priorities, name: str = "default") -> int:
        """Set the priorities (e.g. ``|TD error|``) of sampled transitions ``indices`` (``Batch.indices``)
        for the prioritized sampler ``name``. Transitions overwritten since they were sampled are skipped;
        returns how many were updated. Persisted at the next commit (in a read-only store: in RAM only)."""
        with self._lock:
            self._check_open()
            prio = self._priorities.get(name)
            if prio is None:
                raise KeyError(f"no prioritized sampler named {name!r} on this store; make one with "
                               f"store.sampler(batch_size, prioritized=True, name={name!r}) first")
            self._drain()
            return prio.update(indices, priorities)

    def sampler(self, batch_size: int, *, device=None, prefetch: int | None = None, seed: int | None = None,
                **kwargs):
        """An iterator of batches in reused buffers (pinned, with ``non_blocking`` copies, for a CUDA
        ``device``). ``prefetch`` batches are assembled ahead by a background thread (default: 2 for an
        accelerator device, 0 on CPU, where the thread would compete with training). With ``seed=None`` a
        reopened store's sampler of the same ``name`` continues its committed random sequence.

        ``prioritized=True`` draws proportionally to ``(priority + priority_eps) ** alpha`` and adds
        ``batch.weights`` (importance weights for ``beta``); give new priorities with
        ``sampler.update_priorities(batch.indices, td_errors.abs())``. They are committed with the store.
        ``n_step=n, gamma=g`` turns ``reward`` into n-step returns, ``next_obs`` into the observation after
        the window and adds ``batch.discount`` (``g ** m`` for a window of m steps)."""
        if kwargs.get("seq_len") is not None:  # slices of episodes: see sequence_sampler
            return self.sequence_sampler(batch_size, device=device, prefetch=prefetch, seed=seed, **kwargs)
        from mmreplay.sampling.sampler import Sampler

        return Sampler(self, batch_size, device=device, prefetch=prefetch, seed=seed, **kwargs)

    # -- sequences (issue 15): slices of episodes ---------------------------------------------------
    def sequence_sampler(self, batch_size: int, seq_len: int, **kwargs):
        """Batches of ``seq_len`` consecutive steps of one episode and stream (``store.sampler(B,
        seq_len=L)`` returns the same): ``obs (B, T, ...)``, ``action``, ``reward``, ``terminated``,
        ``truncated``, ``mask``, ``indices`` ``(B, T)`` with ``T = burn_in + seq_len``, and ``next_obs`` of
        each window's last real step. ``strict=True`` draws only slices of ``seq_len`` real steps;
        ``strict=False`` pads past an episode end (``mask`` False, zeros). ``burn_in=b`` prepends the ``b``
        steps before each slice (left-padded near an episode start). ``sample_from="steps"`` draws starts
        uniformly over steps, ``"episodes"`` over episodes then steps. ``prioritized=True``: one priority
        per slice start, ``sampler.update_priorities(batch, td_errors)`` mixes max and mean with ``eta``
        (R2D2: 0.9). Other keywords as ``sampler``; the default ``name`` is ``"sequence"``."""
        from mmreplay.sampling.sequence_sampler import SequenceSampler

        return SequenceSampler(self, batch_size, seq_len, **kwargs)

    def fill_sequence_batch(self, buf, drawer, rng: np.random.Generator, *, priorities=None,
                            beta: float = 0.0) -> None:
        """Draw windows with ``drawer`` (``sampling.sequences.StartDrawer``) into ``buf``; in a reader,
        redo it if the writer overwrote what it read."""
        from mmreplay.sampling.sequences import assemble_sequences

        with self._lock:
            self._check_open()
            if self._needs_reload:
                self.refresh()
            for _ in range(10):
                self._drain()
                ids, weights = drawer.draw(self._ring, self._frames.head, buf.batch_size, rng, priorities, beta)
                g, obs_ids, next_ids = assemble_sequences(self._ring, self._frames, self.schema, ids, buf, weights)
                if self._batch_still_valid(g, obs_ids, next_ids):
                    return
                self.refresh()
            raise RuntimeError(f"store {self.path!r}: the writer kept overwriting what this reader sampled")

    def get(self, indices) -> "Any":
        """The transitions with these global ids (must be valid), as a Batch."""
        from mmreplay.sampling.batch import BatchBuffers, assemble

        g = as_transition_ids(indices)
        buf = BatchBuffers(self, g.size)
        with self._lock:
            self._check_open()
            if self._needs_reload:
                self.refresh()
            self._drain()
            for _ in range(2):
                obs_ids, next_ids, valid = self._ring.stack_frames(g, self.frame_stack, self._frames.head)
                if not valid.all():
                    raise IndexError(f"transition ids {g[~valid][:8].tolist()} are not valid (valid ids lie in "
                                     f"[{self._ring.oldest}, {self._ring.head}) and need their frame stack)")
                assemble(self, g, obs_ids, next_ids, buf)
                if self._batch_still_valid(g, obs_ids, next_ids):
                    break
                self.refresh()  # then re-check validity against the newer commit
        return buf.batch(self)

    def episode_links(self, lo: int, hi: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """For transitions ``lo <= g < hi`` (within ``valid_range()``): ``(prev, terminated, truncated)``,
        where ``prev`` is the global id of the previous step of ``g``'s episode (-1 at an episode start;
        it may lie below ``oldest`` where the ring overwrote it) and the flags are bools."""
        with self._lock:
            self._check_open()
            self._drain()
            ring = self._ring
            if not ring.oldest <= lo <= hi <= ring.head:
                raise IndexError(f"episode_links({lo}, {hi}): the range must lie within the valid range "
                                 f"[{ring.oldest}, {ring.head})")
            g = np.arange(lo, hi, dtype=np.int64)
            delta = ring.read("prev_delta", g).astype(np.int64)
            terminated = ring.read("terminated", g).astype(bool)
            truncated = ring.read("truncated", g).astype(bool)
        return np.where(delta > 0, g - delta, -1), terminated, truncated

    def valid_range(self) -> tuple[int, int]:
        """``(oldest, head)``: valid global ids lie in this range (a few near ``oldest`` may not be)."""
        with self._lock:
            self._check_open()
            self._drain()
            return self._ring.oldest, self._ring.head

    def verify(self, progress=None) -> list[str]:
        """Read back every committed shard: each index and chunk checksum, each decoded size. Returns the
        problems found (empty: the store is intact); ``progress(done, total)`` is called per shard."""
        from mmreplay.inspection import verify_store

        return verify_store(self, progress)

    def info(self) -> dict:
        """Schema, counts and disk use per column (what ``mmreplay info`` prints)."""
        from mmreplay.inspection import store_info

        return store_info(self)

    @property
    def observation_space(self):
        return self.schema.spaces()[0]

    @property
    def action_space(self):
        return self.schema.spaces()[1]

    def cache_stats(self) -> dict[str, dict]:
        """Per observation key: hits, misses, evictions and bytes of the decoded-frame cache."""
        self._check_open()
        return {name: col.cache.stats.as_dict() for name, col in self._frames.columns.items()}

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
        """Commit what was added (writers) and release everything. Also run for a writer that is garbage
        collected or still open when the interpreter exits: a normal exit loses nothing."""
        _open_writers.discard(self)
        if self._closed:
            return
        for sampler in list(self._samplers.values()):  # before taking the lock: they may be waiting on it
            self._sampler_states[sampler.name] = sampler.state
            sampler.close()
        try:
            if self.mode == "a" and self._failed is None:
                self.flush()
        finally:
            self._closed = True
            self._frames.close()
            for disk in self._ring.disk.values():
                disk.close()
            for prio in self._priorities.values():
                prio.close()
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

    def __del__(self) -> None:
        if getattr(self, "_closed", True) or getattr(self, "mode", "r") != "a":
            return
        try:
            self.close()
        except Exception as exc:  # nobody to raise to: say it, at least
            warnings.warn(f"mmreplay: store {self.path!r} could not commit when it was garbage collected: {exc}",
                          RuntimeWarning, stacklevel=1)

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

    def _after_fork_in_child(self) -> None:
        """See storage/forking.py: the parent's store is not this process's to use, nor its lock to hold."""
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # the parent keeps the lock; it ends with the parent, not with us
            self._lock_fd = None
        self._lock = threading.RLock()  # the parent's may be held by a thread that does not exist here
        self._forked = self._forked or not self._closed
        self._closed = True

    def _check_writable(self) -> None:
        self._check_open()
        if self._failed is not None:
            raise StorageError(f"store {self.path!r}: an earlier write failed ({self._failed}); close() and "
                               "reopen the store to continue from its last commit")
        if self.mode != "a":
            raise ReadOnlyError(f"store {self.path!r} was opened read-only (mode='r')")

    def _acquire_writer_lock(self) -> int:
        # flock on the directory itself: no extra file in the zarr hierarchy, released if the process dies.
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise RuntimeError(f"store {self.path!r} is already open for writing by another process or Store "
                               "object; open it with mode='r' to read, or close the writer first") from None
        return fd


_open_writers: "weakref.WeakSet[Store]" = weakref.WeakSet()


@atexit.register
def _commit_open_writers() -> None:
    """At interpreter exit, commit every writer still open (a script that never called close())."""
    for store in list(_open_writers):
        try:
            store.close()
        except Exception as exc:
            warnings.warn(f"mmreplay: store {store.path!r} could not commit at exit: {exc}", RuntimeWarning,
                          stacklevel=1)


def _never_committed(path: str) -> bool:
    """Is ``path`` what a ``Store.create`` that died before its first commit leaves: the root group of an
    mmreplay store (and arrays), but no commit record? Such a directory holds no transition."""
    try:
        read_meta(path)
    except (NotAStoreError, FormatError):
        return False
    return not os.path.exists(os.path.join(path, COMMIT_FILE))


def _remove_contents(path: str) -> None:
    import shutil

    for entry in os.listdir(path):
        full = os.path.join(path, entry)
        if os.path.isdir(full) and not os.path.islink(full):
            shutil.rmtree(full)
        else:
            os.unlink(full)
