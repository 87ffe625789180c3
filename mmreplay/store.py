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

import contextlib
import fcntl
import json
import os
import threading
import time
import weakref
from typing import Any, Mapping, Sequence

import numpy as np

from mmreplay.columns.encode import ColumnEncoder, cast_exact, encode_flags
from mmreplay.columns.spec import ColumnSpec, Schema, schema_from_spaces
from mmreplay.errors import FormatError, NotAStoreError, ReadOnlyError, StorageError, StoreClosedError
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay.storage.commit import COMMIT_FILE, FORMAT_VERSION, check_version, read_commit, write_commit
from mmreplay.storage.files import fsync_dir, fsync_files
from mmreplay.storage.frame_ring import FrameRing
from mmreplay.storage.pending import PendingBlock

MIB = 1 << 20
DEFAULT_CACHE_BYTES = 512 * MIB
DEFAULT_COMMIT_EVERY = 25_000
DEFAULT_COMMIT_SECONDS = 30.0
FRAME_SHARD_TARGET_BYTES = 8 * MIB
UNBOUNDED_TRANSITION_SHARD = 16384
_FLAG_VALUES = (True, False)  # `x in` this also accepts 0, 1 and numpy bools
_SCALAR_TYPES = (int, float, bool, np.int64, np.int32, np.float32, np.float64, np.uint8, np.int8, np.bool_)


class Store:
    """A replay store on disk. Create with ``Store.create``, reopen with ``Store.open``."""

    # -- construction -----------------------------------------------------------------------------
    @classmethod
    def create(cls, path: str | os.PathLike, observation_space, action_space, capacity: int | None = 1_000_000, *,
               frame_stack: int = 1, reward_values: Sequence[float] | None = None, frame_codec: Any = "lz4",
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
            raise FileExistsError(f"cannot create a store at {path!r}: it exists and is not an empty directory "
                                  "(use Store.open to continue an existing store)")
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
        return cls(path, meta, record=record, mode=mode, cache_bytes=cache_bytes, commit_every=commit_every,
                   commit_seconds=commit_seconds, durable=durable)

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
        self._lock_fd = self._acquire_writer_lock() if mode == "a" else None
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
        if record is not None:
            self._restore(record)
        self._durable_state = {**self._state_record(), "sequence": self._sequence}
        self._commit_stat = _stat_key(path) if mode == "r" else None
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
        Cached frames of shards written since are dropped; the rest of the cache stays warm."""
        with self._lock:
            self._check_open()
            if self.mode != "r":
                return False
            record = read_commit(self.path)
            self._commit_stat = _stat_key(self.path)
            if record["sequence"] == self._durable_state["sequence"]:
                return False
            old = self._durable_state
            for disk in self._ring.disk.values():
                disk.close()
            self._ring = TransitionRing(self.path, self.schema.transition_columns, record["transition_rows"],
                                        self._meta["transition_shard_rows"], capacity=self.capacity,
                                        head=record["head"], oldest=record["oldest"])
            self._frames.catch_up(old["frame_head"], record["frame_head"], record["frame_oldest"],
                                  record["frame_rows"])
            self._streams = Streams(self.schema.observations)
            self._restore(record)
            self._sequence = record["sequence"]
            self._durable_state = record
            return True

    def _batch_still_valid(self, g: np.ndarray, obs_ids: np.ndarray) -> bool:
        """Read-only stores: did the writer give up (and maybe overwrite) anything this batch read?
        The writer commits the new ``oldest`` before it replaces a shard, so checking the newest record
        after reading catches every overwritten row. One ``stat`` when nothing was committed since."""
        if self.mode != "r":
            return True
        key = _stat_key(self.path)
        if key == self._commit_stat:
            return True
        record = read_commit(self.path)
        self._commit_stat = key
        return int(g.min()) >= record["oldest"] and int(obs_ids.min()) >= record["frame_oldest"]

    def _register_sampler(self, sampler) -> None:
        with self._lock:
            old = self._samplers.get(sampler.name)
            if old is not None and old is not sampler:
                old.close()  # one live sampler per name: its state is what gets committed
            self._samplers[sampler.name] = sampler

    def _saved_sampler_state(self, name: str) -> dict | None:
        return self._sampler_states.get(name)

    def _restore(self, record: dict) -> None:
        self._ring.max_prev_delta = record["max_prev_delta"]
        self._ring.load(record["head"])
        self._ring.rebuild_shard_min_frame(record["frame_head"])
        self._frames.load_staging()
        self._streams.restore(record["streams"])

    # -- writing ----------------------------------------------------------------------------------
    def add(self, obs, action, reward, next_obs, terminated, truncated, *, stream: int = 0,
            extras: Mapping[str, Any] | None = None) -> None:
        """Add one transition of stream ``stream`` (one env of a vector env, or the only env)."""
        if not (self._fast_add and extras is None and self._add_fast(obs, action, reward, next_obs, terminated,
                                                                     truncated, stream)):
            self._add_checked(obs, action, reward, next_obs, terminated, truncated, stream, extras)

    def _add_fast(self, obs, action, reward, next_obs, terminated, truncated, stream) -> bool:
        """The common case (one array observation, scalar values already right): validate and copy into the
        pending block in a few microseconds. Returns False, having stored nothing, for anything else."""
        spec = self._obs_spec
        if type(obs) is not np.ndarray or type(next_obs) is not np.ndarray or obs.shape != spec.shape \
                or next_obs.shape != spec.shape or obs.dtype != spec.np_dtype or next_obs.dtype != spec.np_dtype:
            return False
        action_code = self._scalar_code("action", action)
        reward_code = self._scalar_code("reward", reward)
        if action_code is None or reward_code is None or type(stream) is not int or not 0 <= stream < 1 << 31 \
                or terminated not in _FLAG_VALUES or truncated not in _FLAG_VALUES or self._closed or self._failed \
                or self.mode != "a":
            return False
        with self._lock:
            block = self._block
            row = block.n
            block.obs["obs"][row] = obs
            block.next_obs["obs"][row] = next_obs
            block.codes["action"][row] = action_code
            block.codes["reward"][row] = reward_code
            block.terminated[row] = terminated
            block.truncated[row] = truncated
            block.streams[row] = stream
            block.n = row + 1
            if block.full:
                self._drain()
        return True

    def _scalar_code(self, name: str, value):
        """What column ``name`` stores for a scalar ``value``, or None if the slow path must decide."""
        if type(value) not in _SCALAR_TYPES:
            return None
        encoder = self._encoders[name]
        if encoder.spec.kind == "packed":
            return encoder.code_of.get(value)
        if encoder.dtype.kind == "f":
            return value if value == value else None  # NaN: let the checked path decide
        lo, hi = encoder.int_range
        return value if type(value) is not float and lo <= value <= hi else None

    def _add_checked(self, obs, action, reward, next_obs, terminated, truncated, stream, extras) -> None:
        if self.schema.dict_obs:
            obs = {k: np.asarray(v)[None] for k, v in _as_mapping(obs, "obs").items()}
            next_obs = {k: np.asarray(v)[None] for k, v in _as_mapping(next_obs, "next_obs").items()}
        else:
            obs, next_obs = np.asarray(obs)[None], np.asarray(next_obs)[None]
        extras = {k: np.asarray(v)[None] for k, v in (extras or {}).items()}
        self._extend(obs, np.asarray(action)[None], np.asarray(reward)[None], next_obs,
                     np.asarray(terminated)[None], np.asarray(truncated)[None], np.array([stream]), extras)

    def _drain(self) -> None:
        """Append the pending single adds (caller holds the lock)."""
        block = self._block
        if block is not None and block.n:
            rows = block.rows()
            block.n = 0
            self._append(*rows)

    def extend(self, obs, action, reward, next_obs, terminated, truncated, *, streams: Sequence[int] | None = None,
               extras: Mapping[str, Any] | None = None) -> None:
        """Add a batch: row ``i`` of each argument is one transition of stream ``streams[i]``
        (default ``range(n)``: a vector env's ``n`` sub-envs, each its own sequence of episodes)."""
        action = np.asarray(action)
        n = action.shape[0] if action.ndim else _fail(f"extend: action must have a leading batch axis, "
                                                      f"got shape {action.shape}")
        ids = np.arange(n) if streams is None else np.asarray(streams)
        self._extend(obs, action, reward, next_obs, terminated, truncated, ids, extras or {})

    def _extend(self, obs, action, reward, next_obs, terminated, truncated, stream_ids, extras) -> None:
        self._check_writable()
        n = int(np.asarray(action).shape[0])
        stream_ids = self._streams.validate_ids(stream_ids, n)
        obs = self._encode_obs(obs, n, "obs")
        next_obs = self._encode_obs(next_obs, n, "next_obs")
        codes = {"action": self._encoders["action"].encode(action, n),
                 "reward": self._encoders["reward"].encode(reward, n)}
        extras = dict(extras)
        for spec in self.schema.extras:
            if spec.name not in extras:
                raise ValueError(f"extras: missing value for extra column {spec.name!r}")
            codes[spec.name] = self._encoders[spec.name].encode(extras.pop(spec.name), n)
        if extras:
            raise ValueError(f"extras: unknown column(s) {sorted(extras)}; known extra columns: "
                             f"{[c.name for c in self.schema.extras]}")
        term = encode_flags(terminated, n, "terminated")
        trunc = encode_flags(truncated, n, "truncated")
        with self._lock:
            block = self._block
            if n >= block.capacity // 2:  # big batches are blocks of their own
                self._drain()
                self._append(stream_ids, obs, next_obs, codes, term, trunc, n)
                return
            if block.n + n > block.capacity:
                self._drain()
            block.put(stream_ids, obs, next_obs, codes, term, trunc)
            if block.full:
                self._drain()

    def _append(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        """Store ``n`` validated transitions (a stream may appear several times, in order), in sub-blocks
        small enough that no sub-block can overwrite frames it references itself."""
        with self._failing_writes():
            self._append_blocks(stream_ids, obs, next_obs, codes, term, trunc, n)

    @contextlib.contextmanager
    def _failing_writes(self):
        """An OSError while writing (disk full...) leaves RAM ahead of disk: refuse writes from then on;
        the last commit on disk is intact, and reopening continues from it."""
        try:
            yield
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            self._failed = exc
            raise StorageError(f"store {self.path!r}: writing failed ({exc}); what was committed is intact on "
                               "disk: close() and reopen the store to continue from its last commit") from exc

    def _append_blocks(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        limit = self._max_block
        for lo in range(0, n, limit):
            part = slice(lo, min(n, lo + limit))
            self._append_block(stream_ids[part], {k: v[part] for k, v in obs.items()},
                               {k: v[part] for k, v in next_obs.items()}, {k: v[part] for k, v in codes.items()},
                               term[part], trunc[part], part.stop - part.start)

    def _append_block(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        ring, frames = self._ring, self._frames
        g = ring.head + np.arange(n, dtype=np.int64)
        done = (term | trunc).astype(bool)
        cont, pred_row, pred_g = self._streams.resolve(stream_ids, obs, next_obs, done, ring, frames)
        in_block = pred_row >= 0
        pred_frame = np.zeros(n, dtype=np.int64)  # global id of the frame the observation continues
        earlier = cont & ~in_block
        if earlier.any():
            pred_frame[earlier] = TransitionRing.frame_globals(ring.read("next_frame", pred_g[earlier]), frames.head)
        # A continued observation whose frame is old (a stream idle for half a frame ring) is stored again,
        # so the ring never has to give up new transitions for one old frame; the stack link is kept.
        stale = earlier & (pred_frame < frames.head - frames.rows // 2) if not frames.unbounded else \
            np.zeros(n, dtype=bool)
        store_obs = ~cont | stale
        n_obs = int(np.count_nonzero(store_obs))
        first_obs = frames.append({k: v[store_obs] for k, v in obs.items()}) if n_obs else frames.head
        next_frame = frames.append(next_obs) + np.arange(n, dtype=np.int64)
        obs_frame = np.where(in_block, next_frame[pred_row], pred_frame)
        obs_frame[store_obs] = first_obs + np.arange(n_obs, dtype=np.int64)
        prev_delta = np.where(cont, g - np.where(in_block, g[pred_row], pred_g), 0)
        if prev_delta.max(initial=0) >= 1 << 32:
            raise OverflowError("a stream was idle for more than 2**32 transitions; start a new episode")
        index = {"obs_frame": (obs_frame & 0xFFFFFFFF).astype(np.uint32),
                 "next_frame": (next_frame & 0xFFFFFFFF).astype(np.uint32),
                 "prev_delta": prev_delta.astype(np.uint32), "terminated": term, "truncated": trunc}
        ring.append(n, index, codes, obs_frame)
        ring.advance_past_frames(frames.oldest)  # no-op unless this block's frames wrapped the frame ring
        self._streams.record(stream_ids, g, done, next_obs)
        self._pending += n
        if self._pending >= self.commit_every or time.monotonic() - self._last_commit >= self.commit_seconds:
            self.flush()

    def _encode_obs(self, obs, n: int, what: str) -> dict[str, np.ndarray]:
        specs = self.schema.observations
        if self.schema.dict_obs:
            obs = _as_mapping(obs, what)
            if set(obs) != {s.name for s in specs}:
                raise ValueError(f"{what}: expected keys {sorted(s.name for s in specs)}, got {sorted(obs)}")
        else:
            obs = {"obs": obs}
        out = {}
        for spec in specs:
            arr = np.asarray(obs[spec.name])
            if arr.shape != (n, *spec.shape):
                key = f"[{spec.name!r}]" if self.schema.dict_obs else ""
                raise ValueError(f"{what}{key}: expected shape {(n, *spec.shape)} for {n} transition(s), "
                                 f"got {arr.shape}")
            out[spec.name] = cast_exact(arr, spec.np_dtype, f"{what}[{spec.name}]" if self.schema.dict_obs else what)
        return out

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
                    not self._sampler_state_changed():
                return
            with self._failing_writes():
                self._frames.flush()
                self._ring.flush()
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

    def _sync_written(self) -> None:
        written = self._frames.written + self._ring.written
        if self.durable and written:
            fsync_files(written)
            dirs = {os.path.dirname(p) for p in written}
            for d in sorted(dirs | {os.path.dirname(d) for d in dirs}):
                fsync_dir(d)
        self._frames.written.clear()
        self._ring.written.clear()

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
                "samplers": {**self._sampler_states, **{n: smp.state for n, smp in list(self._samplers.items())}}}

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
            self._drain()
            return self._ring.count_valid(self.frame_stack, self._frames.head)

    @property
    def num_added(self) -> int:
        """Transitions ever added (including those since overwritten)."""
        with self._lock:
            self._drain()
            return self._ring.head

    @property
    def num_frames(self) -> int:
        """Distinct observations ever stored (each frame once, however many stacks it belongs to)."""
        with self._lock:
            self._drain()
            return self._frames.head

    def sample_indices(self, batch_size: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``batch_size`` valid transition ids drawn uniformly, with their obs / next-obs frame stacks.
        Caller holds the lock."""
        self._drain()
        ring = self._ring
        n_valid = ring.count_valid(self.frame_stack, self._frames.head)
        if n_valid == 0:
            raise ValueError("cannot sample from an empty store (no valid transitions yet)")
        if batch_size > n_valid:
            raise ValueError(f"batch_size {batch_size} is larger than the store ({n_valid} valid transitions); "
                             "wait until it holds at least one batch")
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
        buf = BatchBuffers(self, batch_size)
        self.fill_batch(buf, rng)
        return buf.batch(self)

    def fill_batch(self, buf, rng: np.random.Generator) -> None:
        """Draw a uniform batch into ``buf``; in a reader, redo it if the writer overwrote what it read."""
        from mmreplay.sampling.batch import assemble

        with self._lock:
            self._check_open()
            for _ in range(10):
                g, obs_ids, next_ids = self.sample_indices(buf.batch_size, rng)
                assemble(self, g, obs_ids, next_ids, buf)
                if self._batch_still_valid(g, obs_ids):
                    return
                self.refresh()
            raise RuntimeError(f"store {self.path!r}: the writer kept overwriting what this reader sampled")

    def sampler(self, batch_size: int, *, device=None, prefetch: int | None = None, seed: int | None = None,
                **kwargs):
        """An iterator of uniform batches in reused buffers (pinned, with ``non_blocking`` copies, for a CUDA
        ``device``). ``prefetch`` batches are assembled ahead by a background thread (default: 2 for an
        accelerator device, 0 on CPU, where the thread would compete with training). With ``seed=None`` a
        reopened store's sampler of the same ``name`` continues its committed random sequence."""
        from mmreplay.sampling.sampler import Sampler

        return Sampler(self, batch_size, device=device, prefetch=prefetch, seed=seed, **kwargs)

    def get(self, indices) -> "Any":
        """The transitions with these global ids (must be valid), as a Batch."""
        from mmreplay.sampling.batch import BatchBuffers, assemble

        g = np.asarray(indices, dtype=np.int64).reshape(-1)
        buf = BatchBuffers(self, g.size)
        with self._lock:
            self._check_open()
            self._drain()
            for _ in range(2):
                obs_ids, next_ids, valid = self._ring.stack_frames(g, self.frame_stack, self._frames.head)
                if not valid.all():
                    raise IndexError(f"transition ids {g[~valid][:8].tolist()} are not valid (valid ids lie in "
                                     f"[{self._ring.oldest}, {self._ring.head}) and need their frame stack)")
                assemble(self, g, obs_ids, next_ids, buf)
                if self._batch_still_valid(g, obs_ids):
                    break
                self.refresh()  # then re-check validity against the newer commit
        return buf.batch(self)

    def valid_range(self) -> tuple[int, int]:
        """``(oldest, head)``: valid global ids lie in this range (a few near ``oldest`` may not be)."""
        with self._lock:
            self._drain()
            return self._ring.oldest, self._ring.head

    def verify(self, progress=None) -> list[str]:
        """Read back every committed shard: each index and chunk checksum, each decoded size. Returns the
        problems found (empty: the store is intact); ``progress(done, total)`` is called per shard."""
        with self._lock:
            self._check_open()
            record = self._durable_state
            work = []
            for arrays, lo, hi, rows, shard_rows, unbounded in (
                    (self._ring.disk.values(), record["oldest"], record["head"], record["transition_rows"],
                     self._ring.shard_rows, self.capacity is None),
                    ([c.array for c in self._frames.columns.values()], record["frame_oldest"], record["frame_head"],
                     record["frame_rows"], self._frames.shard_rows, self.capacity is None)):
                shards = committed_shards(lo, hi, rows, shard_rows, unbounded)
                work += [(array, shard) for array in arrays for shard in shards]
        problems = []
        for i, (array, shard) in enumerate(work):
            problems += array.verify_shard(shard)
            if progress:
                progress(i + 1, len(work))
        return problems

    def info(self) -> dict:
        """Schema, counts and disk use per column (what ``mmreplay info`` prints)."""
        with self._lock:
            self._drain()
            oldest, head = self._ring.oldest, self._ring.head
            g = np.arange(oldest, head, dtype=np.int64)
            starts = int(np.count_nonzero(self._ring.read("prev_delta", g) == 0)) if g.size else 0
            n_frames = self._frames.head - self._frames.oldest
            columns = []
            for spec in self.schema.observations:
                columns.append(_column_info(self.path, f"frames/{spec.name}", spec, n_frames, spec.row_nbytes))
            for spec in self.schema.transition_columns:
                columns.append(_column_info(self.path, f"transitions/{spec.name}", spec, head - oldest,
                                            spec.row_nbytes))
            for name in TransitionRing.INDEX_COLUMNS + TransitionRing.FLAG_COLUMNS:
                spec = ColumnSpec.numeric(name, (), "uint32") if name in TransitionRing.INDEX_COLUMNS else \
                    ColumnSpec.packed(name, (False, True), dtype="bool")
                columns.append(_column_info(self.path, f"transitions/{name}", spec, head - oldest, spec.row_nbytes))
            disk = _dir_bytes(self.path)
            return {
                "path": self.path, "format_version": self._meta["format_version"], "capacity": self.capacity,
                "frame_stack": self.frame_stack, "transitions": self._ring.count_valid(self.frame_stack,
                                                                                     self._frames.head),
                "added": head, "oldest": oldest, "episodes_started": starts, "frames": n_frames,
                "disk_bytes": disk, "bytes_per_transition": disk / max(1, head - oldest),
                "index_ram_bytes_per_transition": self._ring.index_nbytes_per_row(),
                "observation_space": self.schema.observation_space, "action_space": self.schema.action_space,
                "columns": columns,
            }

    @property
    def observation_space(self):
        return self.schema.spaces()[0]

    @property
    def action_space(self):
        return self.schema.spaces()[1]

    def cache_stats(self) -> dict[str, dict]:
        return {name: col.cache.stats.as_dict() for name, col in self._frames.columns.items()}

    # -- lifecycle --------------------------------------------------------------------------------
    def close(self) -> None:
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
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None

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
            raise StoreClosedError(f"store {self.path!r} is closed")

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


# -- helpers ---------------------------------------------------------------------------------------

def validate_capacity(value, name: str) -> int | None:
    if value is None and name in ("capacity", "frame_capacity"):
        return None
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
        raise ValueError(f"{name} must be a positive integer{' or None' if name == 'capacity' else ''}, "
                         f"got {value!r}")
    return int(value)


def plan_geometry(schema: Schema, capacity: int | None, frame_capacity: int | None) -> dict:
    """Shard and ring sizes. Each ring has one shard more than it needs so that giving up the shard being
    overwritten never drops a transition within ``capacity``."""
    row_bytes = sum(max(1, s.row_nbytes) for s in schema.observations)
    if capacity is None:
        t_shard = UNBOUNDED_TRANSITION_SHARD
        f_shard = _pow2_clamp(FRAME_SHARD_TARGET_BYTES // row_bytes, 64, 65536)
        return {"capacity": None, "transition_rows": t_shard, "transition_shard_rows": t_shard,
                "frame_rows": f_shard, "frame_shard_rows": f_shard}
    t_shard = _pow2_clamp(capacity // 16, 64, 65536)
    frames = frame_capacity or capacity + capacity // 8 + 64
    f_shard = _pow2_clamp(min(FRAME_SHARD_TARGET_BYTES // row_bytes, frames // 8), 8, 65536)
    f_shard = max(f_shard, max(s.chunk_rows for s in schema.observations))
    return {"capacity": capacity, "transition_rows": _round_up(capacity, t_shard) + t_shard,
            "transition_shard_rows": t_shard, "frame_rows": _round_up(frames, f_shard) + f_shard,
            "frame_shard_rows": f_shard}


def read_meta(path: str) -> dict:
    zarr_json = os.path.join(path, "zarr.json")
    if not os.path.isdir(path):
        raise NotAStoreError(f"no store at {path!r}: not a directory")
    try:
        with open(zarr_json, "rb") as f:
            group = json.loads(f.read(1 << 24))
    except FileNotFoundError:
        raise NotAStoreError(f"{path!r} is not an mmreplay store (no zarr.json)") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise FormatError(f"{zarr_json}: not valid JSON ({exc})") from None
    meta = group.get("attributes", {}).get("mmreplay") if isinstance(group, dict) else None
    if not isinstance(meta, dict):
        raise NotAStoreError(f"{path!r} is a zarr group but not an mmreplay store (no 'mmreplay' attributes)")
    check_version(meta.get("format_version"), zarr_json)
    try:
        Schema.from_json(meta.get("schema"))
    except (ValueError, TypeError) as exc:
        raise FormatError(f"{zarr_json}: invalid schema: {exc}") from None
    cap = meta.get("capacity")
    if cap is not None and (not isinstance(cap, int) or cap < 1):
        raise FormatError(f"{zarr_json}: capacity must be a positive integer or null, got {cap!r}")
    for name in ("transition_rows", "transition_shard_rows", "frame_rows", "frame_shard_rows"):
        v = meta.get(name)
        if not isinstance(v, int) or isinstance(v, bool) or not 8 <= v <= 1 << 40:
            raise FormatError(f"{zarr_json}: {name} must be an integer in [8, 2**40], got {v!r}")
    if meta["transition_shard_rows"] % 8 or meta["transition_rows"] % meta["transition_shard_rows"] \
            or meta["frame_rows"] % meta["frame_shard_rows"]:
        raise FormatError(f"{zarr_json}: ring rows must be multiples of their shard rows (and of 8)")
    return meta


def committed_shards(lo: int, hi: int, rows: int, shard_rows: int, unbounded: bool) -> list[int]:
    """File shards holding rows of global ids [lo, hi)."""
    if hi <= lo:
        return []
    first, last = lo // shard_rows, (hi - 1) // shard_rows
    n_files = rows // shard_rows
    shards = range(first, last + 1)
    return sorted({s if unbounded else s % n_files for s in shards})


def _stat_key(path: str) -> tuple:
    st = os.stat(os.path.join(path, COMMIT_FILE))
    return st.st_ino, st.st_mtime_ns, st.st_size


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _column_info(root: str, rel: str, spec: ColumnSpec, n_rows: int, row_nbytes: int) -> dict:
    disk = _dir_bytes(os.path.join(root, rel))
    raw = n_rows * (spec.bits / 8 if spec.kind == "packed" else max(1, row_nbytes))
    logical = n_rows * max(1, spec.np_dtype.itemsize * int(np.prod(spec.shape, dtype=np.int64)))
    return {"array": rel, "kind": spec.kind, "dtype": spec.dtype, "shape": list(spec.shape),
            "bits": spec.bits or None, "rows": n_rows, "disk_bytes": disk,
            "compression_ratio": (logical / disk) if disk else None, "stored_bytes_uncompressed": int(raw)}


def _pow2_clamp(value: int, lo: int, hi: int) -> int:
    value = max(lo, min(hi, int(value)))
    return 1 << (value.bit_length() - 1)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def _as_mapping(obs, what: str) -> Mapping:
    if not isinstance(obs, Mapping):
        raise ValueError(f"{what}: this store has Dict observations; expected a dict, got {type(obs).__name__}")
    return obs


def _fail(message: str):
    raise ValueError(message)
