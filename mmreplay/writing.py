"""The write path: validate env steps, gather single adds into blocks, turn blocks into stored rows.

Invariants (see ``Store`` for the whole picture):
- Validation happens before anything is stored: bad input raises ``ValueError`` and changes nothing.
  There is one validation, the column encoders' (``columns/encode.py``), for ``add`` and ``extend`` alike:
  the single-add fast path only takes what their ``scalar_code`` screen says ``encode`` would store.
- A transition continues its stream's episode (its observation is not stored again and its frame stack
  reaches back) iff the stream's episode has not ended and the observation equals, bit for bit, the
  stream's previous next observation; otherwise it starts an episode.
- A block never writes more frames than a quarter frame shard, so it cannot overwrite frames it
  references itself; new frames of a block are: observations that start an episode, then every next
  observation.
- An ``OSError`` while writing leaves the store refusing writes (``StorageError``); the last commit on
  disk is intact.

``Writer`` is composed into a writable ``Store`` (readers have none): it owns the pending block and the
count of transitions since the last commit, and is handed the state it writes to (``WriteTarget``: the
rings, the streams and the commit) and the store's lock. It calls nothing back in ``Store``: the automatic
commit is the state's own ``commit``, and the store tells it when it closes (``close``).
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Mapping, Protocol, Sequence

import numpy as np

from mmreplay.columns.encode import cast_exact, encode_flags, encoders_for
from mmreplay.columns.spec import Schema
from mmreplay.errors import StorageError, StoreClosedError
from mmreplay.index.ring import TransitionRing
from mmreplay.index.streams import Streams
from mmreplay.reading.frames import FrameReader
from mmreplay.settings import Settings
from mmreplay.index.frame_ring import FrameRing
from mmreplay.index.pending import PendingBlock

_FLAG_VALUES = (True, False)  # `x in` this also accepts 0, 1 and numpy bools


class WriteTarget(Protocol):
    """What a writer writes to: a writable store's ``StoreState`` (state.py, a sibling this module does not
    import). Its rings never change while the writer lives (a rollback makes a new state and a new writer)."""

    path: str
    schema: Schema
    ring: TransitionRing
    frames: FrameRing
    reader: FrameReader  # a stream's last next-observation is read back to match a continued episode
    streams: Streams

    def changed(self) -> bool: ...
    def commit(self) -> None: ...


class Writer:
    """``add`` and ``extend`` of a writable store and what they need."""

    def __init__(self, state: WriteTarget, lock: threading.RLock, settings: Settings):
        """Writes to ``state``'s rings and streams under ``lock``; commits ``state`` once
        ``settings.commit_every`` transitions or ``settings.commit_seconds`` seconds have passed since the
        last commit."""
        self.state, self.path, self.schema = state, state.path, state.schema
        schema, ring, frames = state.schema, state.ring, state.frames
        self.ring, self.frames, self.streams, self.reader, self.lock = ring, frames, state.streams, state.reader, lock
        self.commit_every, self.commit_seconds = settings.commit_every, settings.commit_seconds
        self.closed = False  # set by the store's close (the fast path checks it without the lock)
        self.closed_reason = ""  # the store's words for why (``close``)
        self.failed: OSError | None = None
        self.pending = 0  # transitions added since the last commit
        self.last_commit = time.monotonic()
        self.encoders = encoders_for(schema)  # the one validation of every add path (columns/encode.py)
        # A block must not write more frames (at most 2 per transition) than half a frame shard, and stays
        # within one transition shard: then it can never overwrite frames that it references itself.
        self.max_block = max(1, min(ring.shard_rows, frames.shard_rows // 4))
        self.block = PendingBlock(schema, self.max_block)
        self._obs_spec = schema.observations[0]
        self._fast_add = not schema.dict_obs and not schema.extras and all(
            c.shape == () for c in (schema.action, schema.reward))
        # the fast path's screen of a scalar (what encode would store, or None: then encode decides)
        self._action_code = self.encoders["action"].scalar_code
        self._reward_code = self.encoders["reward"].scalar_code

    def close(self, reason: str) -> None:
        """The store closed (or this process was forked from the one that holds it): refuse writes, saying
        ``reason``."""
        self.closed, self.closed_reason = True, reason

    def flush(self) -> None:
        """Commit every transition added so far, and anything else the last commit lacks (caller holds the
        lock); cheap when nothing changed."""
        self.check_writable()
        self.drain()
        if self.pending or self.state.changed():
            self.commit()

    def commit(self) -> None:
        """Commit the state (an ``OSError`` leaves the store refusing writes, see ``failing_writes``)."""
        with self.failing_writes():
            self.state.commit()
        self.pending = 0
        self.last_commit = time.monotonic()

    def check_writable(self) -> None:
        if self.closed:
            raise StoreClosedError(self.closed_reason)
        if self.failed is not None:
            raise StorageError(f"store {self.path!r}: an earlier write failed ({self.failed}); close() and "
                               "reopen the store to continue from its last commit")

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
        action_code = self._action_code(action)
        reward_code = self._reward_code(reward)
        if action_code is None or reward_code is None or type(stream) is not int or not 0 <= stream < 1 << 31 \
                or terminated not in _FLAG_VALUES or truncated not in _FLAG_VALUES or self.closed or self.failed:
            return False
        with self.lock:
            block = self.block
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
                self.drain()
        return True

    def _add_checked(self, obs, action, reward, next_obs, terminated, truncated, stream, extras) -> None:
        if self.schema.dict_obs:
            obs = {k: np.asarray(v)[None] for k, v in _as_mapping(obs, "obs").items()}
            next_obs = {k: np.asarray(v)[None] for k, v in _as_mapping(next_obs, "next_obs").items()}
        else:
            obs, next_obs = np.asarray(obs)[None], np.asarray(next_obs)[None]
        extras = {k: np.asarray(v)[None] for k, v in (extras or {}).items()}
        self._extend(obs, np.asarray(action)[None], np.asarray(reward)[None], next_obs,
                     np.asarray(terminated)[None], np.asarray(truncated)[None], np.array([stream]), extras)

    def drain(self) -> None:
        """Append the pending single adds (caller holds the lock)."""
        block = self.block
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
        self.check_writable()
        n = int(np.asarray(action).shape[0])
        stream_ids = self.streams.validate_ids(stream_ids, n)
        obs = self._encode_obs(obs, n, "obs")
        next_obs = self._encode_obs(next_obs, n, "next_obs")
        codes = {"action": self.encoders["action"].encode(action, n),
                 "reward": self.encoders["reward"].encode(reward, n)}
        extras = dict(extras)
        for spec in self.schema.extras:
            if spec.name not in extras:
                raise ValueError(f"extras: missing value for extra column {spec.name!r}")
            codes[spec.name] = self.encoders[spec.name].encode(extras.pop(spec.name), n)
        if extras:
            raise ValueError(f"extras: unknown column(s) {sorted(extras)}; known extra columns: "
                             f"{[c.name for c in self.schema.extras]}")
        term = encode_flags(terminated, n, "terminated")
        trunc = encode_flags(truncated, n, "truncated")
        with self.lock:
            block = self.block
            if n >= block.capacity // 2:  # big batches are blocks of their own
                self.drain()
                self._append(stream_ids, obs, next_obs, codes, term, trunc, n)
                return
            if block.n + n > block.capacity:
                self.drain()
            block.put(stream_ids, obs, next_obs, codes, term, trunc)
            if block.full:
                self.drain()

    def _append(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        """Store ``n`` validated transitions (a stream may appear several times, in order), in sub-blocks
        small enough that no sub-block can overwrite frames it references itself."""
        with self.failing_writes():
            self._append_blocks(stream_ids, obs, next_obs, codes, term, trunc, n)

    @contextlib.contextmanager
    def failing_writes(self):
        """An OSError while writing (disk full...) leaves RAM ahead of disk: refuse writes from then on;
        the last commit on disk is intact, and reopening continues from it."""
        try:
            yield
        except OSError as exc:
            if isinstance(exc, StorageError):
                raise
            self.failed = exc
            raise StorageError(f"store {self.path!r}: writing failed ({exc}); what was committed is intact on "
                               "disk: close() and reopen the store to continue from its last commit") from exc

    def _append_blocks(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        limit = self.max_block
        for lo in range(0, n, limit):
            part = slice(lo, min(n, lo + limit))
            self._append_block(stream_ids[part], {k: v[part] for k, v in obs.items()},
                               {k: v[part] for k, v in next_obs.items()}, {k: v[part] for k, v in codes.items()},
                               term[part], trunc[part], part.stop - part.start)

    def _append_block(self, stream_ids, obs, next_obs, codes, term, trunc, n) -> None:
        ring, frames = self.ring, self.frames
        g = ring.head + np.arange(n, dtype=np.int64)
        done = (term | trunc).astype(bool)
        cont, pred_row, pred_g = self.streams.resolve(stream_ids, obs, next_obs, done, ring, self.reader)
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
        self.streams.record(stream_ids, g, done, next_obs)
        self.pending += n
        if self.pending >= self.commit_every or time.monotonic() - self.last_commit >= self.commit_seconds:
            self.commit()  # nothing is pending in the block here: drain emptied it before appending

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
                raise ValueError(_stacks_given(f"{what}{key}", arr.shape, n, spec.shape, self.schema.frame_stack)
                                 or f"{what}{key}: expected shape {(n, *spec.shape)} for {n} transition(s), "
                                    f"got {arr.shape}")
            out[spec.name] = cast_exact(arr, spec.np_dtype, f"{what}[{spec.name}]" if self.schema.dict_obs else what)
        return out


def _stacks_given(what: str, shape: tuple[int, ...], n: int, frame: tuple[int, ...], k: int) -> str | None:
    """The error when ``shape`` holds stacks of ``k`` frames where single frames were expected (a stack as a
    new axis ``(n, k, *frame)``, or ``k`` frames' channels concatenated as ``VecFrameStack`` does); None for
    any other mismatch."""
    if k == 1 or len(shape) < 1 or shape[0] != n:
        return None
    if int(np.prod(shape[1:], dtype=np.int64)) != k * int(np.prod(frame, dtype=np.int64)):
        return None
    return (f"{what}: got shape {shape}, {n} stack(s) of {k} frames, but this store (frame_stack={k}) expects single "
            f"frames of shape {frame} and stacks them itself at sample time: pass single frames, the newest frame "
            "of each stack; the store stacks them")


def _as_mapping(obs, what: str) -> Mapping:
    if not isinstance(obs, Mapping):
        raise ValueError(f"{what}: this store has Dict observations; expected a dict, got {type(obs).__name__}")
    return obs


def _fail(message: str):
    raise ValueError(message)
