"""TorchRL: ``MMReplayStorage``, a ``torchrl.data.Storage`` over an mmreplay store, and native samplers.

``ReplayBuffer(storage=MMReplayStorage(path, ...), sampler=..., batch_size=...)`` keeps a TorchRL
buffer on disk (frames once, compressed; crash-safe commits) and samples TensorDicts with TorchRL's keys:
``observation``, ``action``, ``done`` / ``terminated`` / ``truncated`` (False: a stored step never starts
from a terminal state) and ``("next", "observation" | "reward" | "done" | "terminated" | "truncated")``.

Invariants:
- TorchRL index ``i`` of the storage is the ``i``-th valid transition, oldest first: ``g = oldest + i``
  where ``(oldest, head)`` is the store's valid range when the index is read. So ``len(storage)`` counts
  what can be sampled, ``RandomSampler`` draws uniformly, and ``storage[:]`` lists steps in the order
  they were added. TorchRL's round-robin writer index equals it until the store first overwrites (a
  bounded store after ``capacity`` adds); samplers that key state on written indices (TorchRL's
  ``PrioritizedSampler``) are exact only until then: use ``MMReplayPrioritizedSampler`` (priorities
  keyed by the store's stable ids and committed with it) for long runs.
- TorchRL index ``i`` counts from ``inspect.readable_range()[0]``: every index below ``len(storage)`` is
  one ``get`` accepts (after the ring cut an episode, its first ``frame_stack - 1`` kept steps are held but
  not readable, so they are not counted).
- ``storage[:]`` returns what ``storage[0:len(storage)]`` returns: every key of every transition. Only
  when TorchRL's own samplers call it (``SliceSampler`` finding trajectories) does it return the small
  columns (flags, ``episode``, ``("collector", "traj_ids")``), never every frame.
- Native samplers never fail from a race with a writer in another process: ``sample`` hands the storage
  the exact ids it drew, ``get`` reads those ids, and if the writer overwrote some of them in between it
  draws again (``info`` is updated in place, ``info["index"]`` included), so the rows returned are always
  the rows ``info`` names.
- ``("collector", "traj_ids")`` reads back as written: a store this storage creates has the extra column
  ``collector.traj_ids`` (int64). Rows written without trajectory ids get new ids, one per episode of
  their stream, counted on from the largest id held. A store without that column (made before, or by
  ``Store.create``) reads back its episode numbers there, a bijection onto its episodes.
- ``extend`` keeps episodes intact: rows of one ``("collector", "traj_ids")`` (or of one row of a 2-D
  ``(envs, time)`` batch) form one stream of the store; stream ids are reused once an episode ended.
- ``dumps(path)`` commits the store and writes ``path/mmreplay_storage.json`` (JSON, no pickle);
  ``loads(path)`` reopens the store that file names and checks it holds at least what was committed.

Supported TorchRL: 0.14.x (tested with torchrl 0.14.1, tensordict 0.14.3, torch 2.13 CPU).
TorchRL is imported only here (``pip install 'mmreplay[torchrl]'``).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data.replay_buffers.samplers import Sampler
from torchrl.data.replay_buffers.storages import Storage

try:  # TorchRL picks a ReplayBuffer's default collate_fn by storage class: out-of-core storages get the identity
    from torchrl.data.replay_buffers.storages import StoreStorage as _OutOfCoreStorage
except ImportError:  # TorchRL < 0.14: give ReplayBuffer(..., collate_fn=lambda td: td)
    _OutOfCoreStorage = Storage

from mmreplay.sampling.strategy import Prioritized, Sequences, Uniform
from mmreplay.storage.files import read_regular
from mmreplay.store import Store

UNBOUNDED_MAX_SIZE = 1 << 62  # what an unbounded store tells TorchRL's writer (its cursor is taken mod this)
CHECKPOINT_FILE = "mmreplay_storage.json"
ACTION_ENCODINGS = ("auto", "categorical", "one_hot")
TRAJ_KEY = ("collector", "traj_ids")
TRAJ_COLUMN = "collector.traj_ids"  # the store's extra column holding TRAJ_KEY
OBSERVATION_KEYS = ("observation", "pixels")  # TorchRL's keys for state and pixel observations
RACE_RETRIES = 16  # draws again when a writer in another process overwrote what was drawn, at most this often
TORCHRL_SAMPLERS = "torchrl.data.replay_buffers.samplers"  # the modules whose storage[:] reads get the index view


class MMReplayStorage(_OutOfCoreStorage):
    """A TorchRL storage whose data lives in an mmreplay store at ``path``.

    An existing store is opened; otherwise one is created with ``capacity`` (default ``max_size``; None
    grows without bound) from ``observation_space`` / ``action_space`` (gymnasium spaces) or, if they are
    left out, from the first TensorDict written: its observation's shape and dtype, a one-hot ``action``
    of width n as ``Discrete(n)``, a float ``action`` as an unbounded ``Box`` of its shape and dtype.
    ``observation_key`` (default: whichever of ``"observation"`` / ``"pixels"`` the first TensorDict has)
    names the observation stored. ``action_encoding`` says how actions come back: ``"one_hot"``,
    ``"categorical"`` or ``"auto"`` (as they were last written). Other keywords go to ``Store.create``
    (``frame_stack``, ``cache_bytes``...).
    """

    def __init__(self, path: str | os.PathLike | Store, max_size: int | None = None, *, observation_space=None,
                 action_space=None, action_encoding: str = "auto", observation_key: str | None = None,
                 mode: str = "a", **create_kwargs):
        if action_encoding not in ACTION_ENCODINGS:
            raise ValueError(f"action_encoding must be one of {ACTION_ENCODINGS}, got {action_encoding!r}")
        self.store: Store | None = None
        self._action_space = action_space  # cached: the store rebuilds its spaces from JSON on each access
        self._next_traj: int | None = None  # the next trajectory id given to rows written without one
        self._stream_traj: dict[int, int] = {}  # stream -> its running trajectory id (rows without ids)
        self.path = path.path if isinstance(path, Store) else os.fspath(path)
        self.observation_key = observation_key
        self.action_encoding = action_encoding
        self._written_one_hot: bool | None = None
        self._one_hot_width: int | None = None
        self._create = dict(create_kwargs, observation_space=observation_space, action_space=action_space,
                            capacity=max_size)
        self._open_mode = mode
        if isinstance(path, Store):
            self._set_store(path)
        elif _is_store(self.path):
            self._set_store(Store.open(self.path, mode=mode))
        elif observation_space is not None and action_space is not None:
            self._create_store(observation_space, action_space)
        if self.store is not None and max_size is None:
            max_size = self.store.capacity
        # Storage's own __init__, not the key-value store's: every method that touches data is ours.
        Storage.__init__(self, UNBOUNDED_MAX_SIZE if max_size is None else max_size)
        self._drawn: _Drawn | None = None  # what a native sampler drew, for the next get (see _Drawn)
        self._stream_of: dict[int, int] = {}  # ("collector", "traj_ids") -> stream id of the store
        self._free_streams: list[int] = []
        self._next_stream = 0

    def _create_store(self, observation_space, action_space) -> None:
        from mmreplay.columns.spec import ColumnSpec

        kw = {k: v for k, v in self._create.items() if k not in ("observation_space", "action_space", "capacity")}
        kw.setdefault("capacity", self._create["capacity"])
        kw["extras"] = [*kw.get("extras", ()), ColumnSpec.numeric(TRAJ_COLUMN, (), "int64")]
        self._set_store(Store.create(self.path, observation_space, action_space, **kw))

    def _set_store(self, store: Store) -> None:
        self.store = store
        self._action_space = store.action_space
        self._next_traj = None  # counted on from the store's largest id at the next write

    def _has_traj_column(self) -> bool:
        return any(c.name == TRAJ_COLUMN for c in self.store.schema.extras)

    def _require_store(self) -> Store:
        if self.store is None:
            raise RuntimeError(f"MMReplayStorage {self.path!r}: no store yet (nothing written, and no "
                               "observation_space / action_space given to create one)")
        return self.store

    # -- TorchRL's Storage API ------------------------------------------------------------------------
    @property
    def ndim(self) -> int:
        return 1

    def __len__(self) -> int:
        if self.store is None:
            return 0
        lo, head = self.store.inspect.readable_range()
        return head - lo

    @property
    def _is_full(self) -> bool:
        # Index space never wraps (index i is the i-th valid transition), so no sampler must look for
        # a trajectory split at the writer's cursor.
        return False

    def set(self, cursor, data, *, set_cursor: bool = True) -> None:
        """Append the transitions of ``data`` (a TensorDict of shape (n,) or (envs, time)) to the store; the
        store places them itself (``cursor`` is TorchRL's round-robin index, see the module invariant)."""
        if not isinstance(data, TensorDict) and not hasattr(data, "batch_size"):
            raise TypeError(f"MMReplayStorage stores TensorDicts, got {type(data).__name__}")
        if data.ndim == 0:
            data = data.unsqueeze(0)
        if data.ndim not in (1, 2):
            raise ValueError(f"MMReplayStorage stores TensorDicts of shape (n,) or (envs, time), "
                             f"got {tuple(data.shape)}")
        envs = data.shape[0] if data.ndim == 2 else 1
        if data.ndim == 2:  # (envs, time): add time-major so each env is one stream, steps in order
            data = data.transpose(0, 1).reshape(-1)
        cols = self._columns(data)
        if self.store is None:
            self._create_store(*self._spaces_from(cols))
        traj = data.get(TRAJ_KEY, None)
        traj = None if traj is None else _np(traj).reshape(-1).astype(np.int64)
        ended = cols["terminated"] | cols["truncated"]
        if envs > 1 or traj is None:  # one stream per env (time-major rows), or all rows one stream
            streams = np.tile(np.arange(envs), len(data) // envs)
        else:
            streams = self._streams_of_trajectories(traj, ended)
        extras = {spec.name: _np(data.get(spec.name)) for spec in self.store.schema.extras
                  if spec.name != TRAJ_COLUMN and spec.name in data.keys()}  # read back under the same key
        if self._has_traj_column():
            extras[TRAJ_COLUMN] = traj if traj is not None else self._new_trajectory_ids(streams, ended)
        self.store.extend(cols["obs"], cols["action"], cols["reward"], cols["next_obs"], cols["terminated"],
                          cols["truncated"], streams=streams, extras=extras or None)
        if traj is not None and traj.size and self._has_traj_column():
            self._next_traj = max(self._next_trajectory_id(), int(traj.max()) + 1)
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _columns(self, data) -> dict[str, np.ndarray]:
        key = self.observation_key = self.observation_key or _observation_key(data)
        nxt = data.get("next", None)
        if nxt is None or key not in nxt.keys() or key not in data.keys():
            raise KeyError(f"MMReplayStorage needs {key!r} and ('next', {key!r}) in each TensorDict (TorchRL's "
                           f"collector layout); got keys {sorted(map(str, data.keys(True)))}")
        action = data.get("action")
        one_hot = self._is_one_hot(action)
        self._written_one_hot = one_hot
        if one_hot:
            self._one_hot_width = int(action.shape[-1])
        action = action.argmax(-1) if one_hot else action
        done = nxt.get("done")
        terminated = nxt.get("terminated", done)
        truncated = nxt.get("truncated", None)
        if truncated is None:
            truncated = done & ~terminated if done is not None else torch.zeros_like(terminated)
        return {"obs": _np(data.get(key)), "next_obs": _np(nxt.get(key)), "action": _np(action),
                "reward": _np(nxt.get("reward")).reshape(len(data), *self._reward_shape()),
                "terminated": _np(terminated).reshape(-1).astype(bool),
                "truncated": _np(truncated).reshape(-1).astype(bool)}

    def _is_one_hot(self, action) -> bool:
        """A one-hot action: rows of 0/1 summing to 1, and a Discrete action space of that width (given,
        or still to be made from the data)."""
        if action.ndim != 2 or action.dtype.is_complex:
            return False
        width = self._discrete_width()
        space = self._action_space
        if width is None and space is not None:
            return False  # a Box action space: vectors are vectors
        if width is not None and width != action.shape[-1]:
            return False
        return bool(((action == 0) | (action == 1)).all()) and bool((action.sum(-1) == 1).all())

    def _discrete_width(self) -> int | None:
        space = self._action_space
        return int(space.n) if space is not None and hasattr(space, "n") else None

    def _reward_shape(self) -> tuple:
        return self.store.schema.reward.shape if self.store is not None else ()

    def _spaces_from(self, cols) -> tuple:
        from gymnasium import spaces

        obs_space = self._create.get("observation_space")
        if obs_space is None:
            obs_space = _box_of(cols["obs"], f"observation {self.observation_key!r}", "observation_space")
        action_space = self._create.get("action_space")
        if action_space is None:
            if self._written_one_hot:
                action_space = spaces.Discrete(self._one_hot_width)
            elif cols["action"].dtype.kind == "f":
                action_space = _box_of(cols["action"], "action", "action_space")
            else:
                action = cols["action"]
                raise ValueError(f"MMReplayStorage: cannot infer the action space from {action.dtype} actions of "
                                 f"shape {action.shape[1:]} that are not one-hot (Discrete(n) or MultiDiscrete? n is "
                                 "not in the data): give action_space=, e.g. gymnasium.spaces.Discrete(n)")
        return obs_space, action_space

    def _streams_of_trajectories(self, traj: np.ndarray, ended: np.ndarray) -> np.ndarray:
        """One stream per live trajectory id (a loop over the batch's distinct ids, not its rows);
        trajectories that ended give their stream back, so streams stay few however many episodes."""
        ids, inverse = np.unique(traj, return_inverse=True)
        sids = np.empty(len(ids), dtype=np.int64)
        for k, t in enumerate(ids.tolist()):
            sid = self._stream_of.get(t)
            if sid is None:
                sid = self._free_streams.pop() if self._free_streams else self._new_stream()
                self._stream_of[t] = sid
            sids[k] = sid
        for t in np.unique(traj[ended]).tolist():
            self._free_streams.append(self._stream_of.pop(t))
        return sids[inverse.reshape(-1)]

    def _new_stream(self) -> int:
        self._next_stream += 1
        return self._next_stream - 1

    def _next_trajectory_id(self) -> int:
        if self._next_traj is None:  # first write of this session: count on from the largest id held
            oldest, head = self.store.inspect.valid_range()
            held = self.store.inspect.read_column(TRAJ_COLUMN, oldest, head) if head > oldest else np.zeros(0, np.int64)
            self._next_traj = int(held.max()) + 1 if held.size else 0
        return self._next_traj

    def _new_trajectory_ids(self, streams: np.ndarray, ended: np.ndarray) -> np.ndarray:
        """Trajectory ids for rows written without them: each stream's running episode keeps its id,
        each episode after an end gets a new one (what a collector would have given)."""
        out = np.empty(len(streams), dtype=np.int64)
        nxt = self._next_trajectory_id()
        for sid in np.unique(streams).tolist():
            rows = np.flatnonzero(streams == sid)
            episode = np.cumsum(ended[rows]) - ended[rows]  # 0: the episode running when the batch began
            current = self._stream_traj.get(sid)
            if current is None:
                current, nxt = nxt, nxt + 1
            fresh = nxt + episode - 1  # episodes that begin inside the batch
            out[rows] = np.where(episode == 0, current, fresh)
            nxt += int(episode[-1])
            if ended[rows[-1]]:
                self._stream_traj.pop(sid, None)
            else:
                self._stream_traj[sid] = int(out[rows[-1]])
        self._next_traj = nxt
        return out

    def get(self, index) -> TensorDict:
        store = self._require_store()
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn.names(index):
            return self._get_drawn(store, drawn)
        if isinstance(index, slice) and index == slice(None) and _called_by_torchrl_sampler():
            return self.index_view()
        lo, head = store.inspect.readable_range()
        pos = _positions(index, head - lo)
        try:
            batch = store.inspect.get(lo + pos.reshape(-1))
        except IndexError as exc:
            raise IndexError(f"MMReplayStorage {self.path!r}: a writer in another process overwrote transitions "
                             f"between reading the storage's length and reading them ({exc}); sample with "
                             "MMReplayRandomSampler / MMReplayPrioritizedSampler / MMReplaySliceSampler, which "
                             "draw again instead") from None
        return self._to_tensordict(batch, pos.shape)

    def _pin(self, drawn: "_Drawn") -> torch.Tensor:
        """A native sampler's draw: ``get`` reads exactly these ids next (see the module invariants)."""
        self._drawn = drawn
        return drawn.index

    def _get_drawn(self, store: Store, drawn: "_Drawn") -> TensorDict:
        for _ in range(RACE_RETRIES):
            try:
                return self._to_tensordict(store.inspect.get(drawn.ids), (drawn.ids.size,))
            except IndexError:  # a writer overwrote some since they were drawn: draw again
                drawn = drawn.again()
        raise RuntimeError(f"MMReplayStorage {self.path!r}: a writer overwrote the drawn transitions {RACE_RETRIES} "
                           "times in a row before they could be read (a ring far too small for the writer's pace?)")

    def _to_tensordict(self, batch, shape) -> TensorDict:
        n = batch.action.shape[0]
        action = batch.action
        if self._one_hot_out():
            action = torch.nn.functional.one_hot(action.long(), self._discrete_width()).to(torch.int64)
        term = batch.terminated.reshape(n, 1)
        trunc = batch.truncated.reshape(n, 1)
        reward = batch.reward.reshape(n, *self.store.schema.reward.shape) if self.store.schema.reward.shape \
            else batch.reward.reshape(n, 1)
        false = torch.zeros(n, 1, dtype=torch.bool)
        key = self.observation_key or OBSERVATION_KEYS[0]  # nothing written yet this session, none given
        td = TensorDict({key: batch.obs, "action": action, "done": false, "terminated": false,
                         "truncated": false.clone(),
                         "next": TensorDict({key: batch.next_obs, "reward": reward,
                                             "done": term | trunc, "terminated": term, "truncated": trunc},
                                            batch_size=[n])},
                        batch_size=[n])
        for name, value in batch.extras.items():
            td[TRAJ_KEY if name == TRAJ_COLUMN else name] = value
        return td.reshape(shape) if tuple(shape) != (n,) else td

    def _one_hot_out(self) -> bool:
        if self.action_encoding == "auto":
            return bool(self._written_one_hot) and self._discrete_width() is not None
        return self.action_encoding == "one_hot"

    def index_view(self) -> TensorDict:
        """Every readable transition's small columns, no frames: ``episode`` (numbered by first step),
        ``("collector", "traj_ids")`` and the ``next`` done flags. What TorchRL's samplers get for
        ``storage[:]``."""
        store = self.store
        for attempt in range(RACE_RETRIES):  # a writer in another process may move the range in between
            oldest, head = store.inspect.readable_range()
            try:
                prev, term, trunc = store.inspect.episode_links(oldest, head)
                traj = store.inspect.read_column(TRAJ_COLUMN, oldest, head) if self._has_traj_column() else None
                break
            except IndexError:
                if attempt == RACE_RETRIES - 1:
                    raise
        n = head - oldest
        episode = _episode_numbers(prev, oldest)
        traj = episode if traj is None else traj
        term_t, trunc_t = torch.from_numpy(term).reshape(n, 1), torch.from_numpy(trunc).reshape(n, 1)
        return TensorDict({"episode": torch.from_numpy(episode),
                           "collector": TensorDict({"traj_ids": torch.from_numpy(traj)}, batch_size=[n]),
                           "next": TensorDict({"done": term_t | trunc_t, "terminated": term_t, "truncated": trunc_t},
                                              batch_size=[n])}, batch_size=[n])

    def contains(self, item) -> bool:
        return isinstance(item, (int, np.integer)) and 0 <= int(item) < len(self)

    def _empty(self):
        raise RuntimeError(f"MMReplayStorage {self.path!r}: a store on disk is not emptied by ReplayBuffer.empty(); "
                           "create a new store (or delete its directory) instead")

    def state_dict(self) -> dict[str, Any]:
        store = self._require_store()
        oldest, head = store.inspect.valid_range()
        return {"path": os.path.abspath(store.path), "head": head, "oldest": oldest,
                "one_hot": self._written_one_hot, "observation_key": self.observation_key}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        path = state_dict["path"]
        if self.store is None or os.path.abspath(self.store.path) != path or self.store.closed:
            if self.store is not None and not self.store.closed:
                self.store.close()
            self._set_store(Store.open(path, mode=self._open_mode))
            self.path = path
        if self.store.num_added < state_dict["head"]:
            raise RuntimeError(f"store {path!r} holds {self.store.num_added} transitions, fewer than the "
                               f"{state_dict['head']} of the checkpoint (an older copy of the store?)")
        self._written_one_hot = state_dict.get("one_hot")
        self.observation_key = self.observation_key or state_dict.get("observation_key")

    def dumps(self, path) -> None:
        """Commit the store (its data stays where it is) and write a small JSON pointer to it at ``path``."""
        store = self._require_store()
        store.flush()
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, CHECKPOINT_FILE), "w") as f:
            json.dump(self.state_dict(), f)

    def loads(self, path) -> None:
        # a small JSON file: never a FIFO or /dev/zero (read_regular refuses them, and caps the bytes read)
        self.load_state_dict(json.loads(read_regular(os.path.join(path, CHECKPOINT_FILE), 1 << 24)))
        self._bump_mutation_revision()

    def flush(self) -> None:
        self._require_store().flush()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()

    def __getstate__(self):
        raise TypeError("MMReplayStorage is not pickled (its data is a store on disk): open it again in the other "
                        "process with MMReplayStorage(path, mode='r')")

    def __repr__(self) -> str:
        return f"MMReplayStorage({self.path!r}, max_size={self.max_size}, len={len(self)})"


# -- native samplers ------------------------------------------------------------------------------------------
class _Drawn:
    """What a native sampler drew: the exact transition ids (flat), the TorchRL index it returned for
    them, its ``info`` dict (updated in place on a redraw, so ``ReplayBuffer``'s ``info["index"]`` follows)
    and how to draw again."""

    def __init__(self, ids: np.ndarray, index: torch.Tensor, info: dict, redraw):
        self.ids, self.index, self.info, self._redraw = ids, index, info, redraw

    def names(self, index) -> bool:
        """Is ``index`` the TorchRL index this draw returned (what ``ReplayBuffer`` passes to ``get``)?"""
        if index is self.index:
            return True
        return isinstance(index, torch.Tensor) and index.shape == self.index.shape and torch.equal(index, self.index)

    def again(self) -> "_Drawn":
        ids, index, info = self._redraw()
        self.info.clear()
        self.info.update(info)
        self.info["index"] = index
        return _Drawn(ids, index, self.info, self._redraw)


class _StoreSampler(Sampler):
    """A TorchRL sampler that draws in the store (its RNG state, JSON, goes with ``dumps``). Subclasses
    give ``_rows`` (how many rows a batch draws) and ``_draw_rows`` (ids per row, with per-row extras) and
    ``_finish`` (flat ids and ``info``); drawing only readable ids and redrawing after a race is shared."""

    def __init__(self, seed: int | None = None):
        self.rng = np.random.default_rng(seed)

    def _store(self, storage) -> Store:
        if not isinstance(storage, MMReplayStorage):
            raise TypeError(f"{type(self).__name__} samples an MMReplayStorage, got {type(storage).__name__}")
        return storage._require_store()

    def sample(self, storage, batch_size: int):
        store = self._store(storage)
        rows = self._rows(batch_size)

        def draw():
            ids, extras, lo = self._draw_readable(store, rows)
            flat, info = self._finish(ids, extras)
            return flat, torch.from_numpy(flat - lo), info

        ids, index, info = draw()
        return storage._pin(_Drawn(ids, index, info, draw)), info

    def _draw_readable(self, store: Store, rows: int):
        """``rows`` rows of ids that ``get`` accepts: the rows holding an id below ``readable_range()[0]``
        (held, but its frame stack is gone) are drawn again."""
        ids, extras = self._draw_rows(store, rows)
        for _ in range(RACE_RETRIES):
            lo, _head = store.inspect.readable_range()
            flat = ids.reshape(rows, -1)
            bad = ((flat >= 0) & (flat < lo)).any(axis=1)
            if not bad.any():
                return ids, extras, lo
            new_ids, new_extras = self._draw_rows(store, int(bad.sum()))
            ids[bad] = new_ids
            for name, values in extras.items():
                values[bad] = new_extras[name]
        raise RuntimeError(f"{type(self).__name__}: {RACE_RETRIES} draws in a row held transitions below the "
                           f"store's readable range (readable_range() = {store.inspect.readable_range()})")

    def _rows(self, batch_size: int) -> int:
        return batch_size

    def _draw_rows(self, store: Store, rows: int) -> tuple[np.ndarray, dict[str, np.ndarray]]:
        raise NotImplementedError

    def _finish(self, ids: np.ndarray, extras: dict[str, np.ndarray]) -> tuple[np.ndarray, dict]:
        return ids.reshape(-1), {}

    def _empty(self):
        pass

    def state_dict(self) -> dict[str, Any]:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.rng.bit_generator.state = state_dict["rng"]

    def dumps(self, path):
        os.makedirs(path, exist_ok=True)
        with open(os.path.join(path, "sampler_state.json"), "w") as f:
            json.dump(self.state_dict(), f)

    def loads(self, path):
        with open(os.path.join(path, "sampler_state.json")) as f:
            self.load_state_dict(json.load(f))


class MMReplayRandomSampler(_StoreSampler):
    """Uniform over readable transitions, drawn by the store (never an id whose frame stack is gone)."""

    def _draw_rows(self, store, rows):
        g, _ = store.inspect.draw(Uniform(), rows, self.rng)
        return g, {}


class MMReplayPrioritizedSampler(_StoreSampler):
    """Proportional prioritized replay in the store: priorities keyed by the store's transition ids,
    committed with it (``dumps`` / ``flush``) and reopened exactly. ``info["priority_weight"]`` holds the
    importance weights; give new priorities with ``rb.update_priority(sample["index"], td_error)``."""

    def __init__(self, alpha: float = 0.6, beta: float = 0.4, eps: float = 1e-6, name: str = "torchrl",
                 seed: int | None = None):
        super().__init__(seed)
        self.alpha, self.beta, self.eps, self.name = alpha, beta, eps, name
        self._held: tuple[Store, Any] | None = None  # (store, its sampler ``name``): the set is updated through it

    def _prioritized(self, store: Store):
        """The store's prioritized sampler ``name`` (made once per store, as a distributed shard does): the
        one way to update the set's priorities; its set (``alpha``, ``eps``) is what ``sample`` draws by."""
        held = self._held
        if held is None or held[0] is not store or held[1].closed:
            if held is not None and held[0] is not store:
                held[1].close()  # the storage reopened its store: the old store's sampler goes with it
            smp = store.sampler(1, self._draw(), name=self.name, prefetch=0)
            self._held = held = (store, smp)
        return held[1]

    def _draw(self) -> Prioritized:
        """The draw by the set ``name``, with the exponents assigned now (a set takes them when they change)."""
        return Prioritized(self.alpha, self.beta, self.eps, name=self.name)

    def _draw_rows(self, store, rows):
        self._prioritized(store)
        g, w = store.inspect.draw(self._draw(), rows, self.rng)
        return g, {"priority_weight": w}

    def _finish(self, ids, extras):
        return ids.reshape(-1), {"priority_weight": torch.from_numpy(extras["priority_weight"])}

    def update_priority(self, index, priority, *, storage=None) -> None:
        if storage is None:
            raise ValueError("MMReplayPrioritizedSampler.update_priority needs the storage (ReplayBuffer passes it)")
        store = self._store(storage)
        smp = self._prioritized(store)
        lo, _ = store.inspect.readable_range()
        pos = np.asarray(index.detach().cpu() if hasattr(index, "detach") else index, dtype=np.int64).reshape(-1)
        p = np.asarray(priority.detach().cpu() if hasattr(priority, "detach") else priority, dtype=np.float64)
        smp.update_priorities(lo + pos, p.reshape(-1))


class MMReplaySliceSampler(_StoreSampler):
    """Slices of ``slice_len`` consecutive steps of one episode and stream (``num_slices`` of them, or
    ``batch_size // slice_len``), walked in the store's episode links, so vector-env streams may
    interleave. ``strict_length=False`` pads short slices by repeating their last step and marks the
    padding False in ``info["mask"]``. The index is flat, slice after slice, as TorchRL's SliceSampler's."""

    def __init__(self, *, slice_len: int | None = None, num_slices: int | None = None, strict_length: bool = True,
                 sample_from: str = "episodes", seed: int | None = None):
        super().__init__(seed)
        if (slice_len is None) == (num_slices is None):
            raise ValueError(f"give exactly one of slice_len and num_slices, got slice_len={slice_len!r}, "
                             f"num_slices={num_slices!r}")
        self.slice_len, self.num_slices = slice_len, num_slices
        self.strict_length, self.sample_from = strict_length, sample_from
        Sequences(slice_len or 1, strict=strict_length, sample_from=sample_from)  # bad options fail here
        self._draws: dict[int, Sequences] = {}
        self._seq_len = 0

    def _rows(self, batch_size: int) -> int:
        if self.slice_len is not None:
            seq_len, n = self.slice_len, batch_size // self.slice_len
        else:
            seq_len, n = batch_size // self.num_slices, self.num_slices
        if n < 1 or seq_len < 1 or n * seq_len != batch_size:
            raise ValueError(f"batch_size {batch_size} must be a multiple of slice_len/num_slices "
                             f"(slice_len={self.slice_len}, num_slices={self.num_slices})")
        self._seq_len = seq_len
        return n

    def _draw_rows(self, store, rows):
        seq_len = self._seq_len
        draw = self._draws.get(seq_len)
        if draw is None:  # kept: its episode table is reused while the store is unchanged
            draw = self._draws[seq_len] = Sequences(seq_len, strict=self.strict_length, sample_from=self.sample_from)
        ids, _ = store.inspect.draw(draw, rows, self.rng)
        return ids, {}

    def _finish(self, ids, extras):
        mask = ids >= 0
        last = np.maximum.accumulate(np.where(mask, ids, -1), axis=1)  # padding repeats the last real step
        return last.reshape(-1), {"mask": torch.from_numpy(mask.reshape(-1))}


# -- helpers -----------------------------------------------------------------------------------------------
def _called_by_torchrl_sampler(depth: int = 4) -> bool:
    """Is ``storage[:]`` being read by one of TorchRL's samplers (``SliceSampler`` finding trajectories)?
    They read only flags and trajectory ids from it: they get those without decoding every frame, while
    ``storage[:]`` anywhere else returns every key (a dump must not silently lose columns)."""
    frame = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return False
        if frame.f_globals.get("__name__", "").startswith(TORCHRL_SAMPLERS):
            return True
        frame = frame.f_back
    return False


def _is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "zarr.json"))


def _observation_key(data) -> str:
    """The observation key of a collector's TensorDict when none was given: the one of TorchRL's keys it has."""
    present = [k for k in OBSERVATION_KEYS if k in data.keys()]
    if len(present) > 1:
        raise ValueError(f"MMReplayStorage: both of {OBSERVATION_KEYS} are in the TensorDict: give "
                         "observation_key= to say which one to store")
    return present[0] if present else OBSERVATION_KEYS[0]  # none: the caller's KeyError names what is missing


def _box_of(values: np.ndarray, what: str, argument: str):
    """An unbounded Box of the rows' shape and dtype (uint8: 0..255, other integers: their dtype's range)."""
    from gymnasium import spaces

    kind = values.dtype.kind
    if kind not in "fiu":
        raise ValueError(f"MMReplayStorage: cannot infer a space for the {what} of dtype {values.dtype} and shape "
                         f"{values.shape[1:]}: give {argument}= (a gymnasium space)")
    if kind == "f":
        return spaces.Box(-np.inf, np.inf, values.shape[1:], values.dtype)
    info = np.iinfo(values.dtype)
    return spaces.Box(info.min, info.max, values.shape[1:], values.dtype)


def _np(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


def _positions(index, n: int) -> np.ndarray:
    """TorchRL's index (int, slice, sequence, tensor) as positions ``0 <= p < n``."""
    if isinstance(index, slice):
        return np.arange(n, dtype=np.int64)[index]
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    pos = np.asarray(_np(index), dtype=np.int64)
    if pos.size and (pos.min() < -n or pos.max() >= n):
        raise IndexError(f"index out of range for MMReplayStorage of length {n}: "
                         f"{pos[(pos < -n) | (pos >= n)][:8].tolist()}")
    return np.where(pos < 0, pos + n, pos)


def _episode_numbers(prev: np.ndarray, oldest: int) -> np.ndarray:
    """Episode number of each step (numbered by first step) from ``prev`` links (global ids, -1 at a start)."""
    n = prev.size
    root = np.where(prev < oldest, np.arange(n), prev - oldest)
    while True:  # pointer jumping: each round halves the distance to the episode's first step
        nxt = root[root]
        if np.array_equal(nxt, root):
            break
        root = nxt
    _, number = np.unique(root, return_inverse=True)  # first steps in order of their ids
    return number.astype(np.int64)
