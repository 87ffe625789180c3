"""``MMReplayStorage``: a ``torchrl.data.Storage`` whose data is an mmreplay store on disk.

Invariants:
- TorchRL index ``i`` of the storage is the ``i``-th readable transition, oldest first: ``g = lo + i`` where
  ``(lo, head)`` is the store's ``inspect.readable_range()`` when the index is read. So ``len(storage)``
  counts what can be sampled and every index below it is one ``get`` accepts (after the ring cut an
  episode, its first ``frame_stack - 1`` kept steps are held but not readable, so they are not counted),
  ``RandomSampler`` draws uniformly, and ``storage[:]`` lists steps in the order they were added. TorchRL's
  round-robin writer index equals it until the store first overwrites (a bounded store after ``capacity``
  adds); samplers that key state on written indices (TorchRL's ``PrioritizedSampler``) are exact only
  until then.
- ``storage[:]`` returns what ``storage[0:len(storage)]`` returns: every key of every transition. Only
  when TorchRL's own samplers call it (``SliceSampler`` finding trajectories) does it return the small
  columns (``index_view``), never every frame.
- A native sampler's draw is pinned (``Drawn``): the next ``get`` of the index it returned reads exactly the
  ids drawn, and if a writer in another process overwrote some of them in between it draws again (``info``
  updated in place, ``info["index"]`` included), so the rows returned are always the rows ``info`` names.
- ``dumps(path)`` commits the store and writes ``path/mmreplay_storage.json`` (JSON, no pickle);
  ``loads(path)`` reopens the store that file names and checks it holds at least what was committed.
"""

from __future__ import annotations

import json
import os
from typing import Any

import numpy as np
import torch
from tensordict import TensorDict
from torchrl.data.replay_buffers.storages import Storage

try:  # TorchRL picks a ReplayBuffer's default collate_fn by storage class: out-of-core storages get the identity
    from torchrl.data.replay_buffers.storages import StoreStorage as _OutOfCoreStorage
except ImportError:  # TorchRL < 0.14: give ReplayBuffer(..., collate_fn=lambda td: td)
    _OutOfCoreStorage = Storage

from mmreplay.integrations.torchrl_rows import (
    OBSERVATION_KEYS,
    RACE_RETRIES,
    TRAJ_COLUMN,
    TRAJ_KEY,
    Trajectories,
    as_numpy,
    called_by_torchrl_sampler,
    columns,
    discrete_width,
    index_view_of,
    observation_key_of,
    positions,
    spaces_from,
    to_tensordict,
)
from mmreplay.storage.files import read_regular
from mmreplay.store import Store

UNBOUNDED_MAX_SIZE = 1 << 62  # what an unbounded store tells TorchRL's writer (its cursor is taken mod this)
CHECKPOINT_FILE = "mmreplay_storage.json"
ACTION_ENCODINGS = ("auto", "categorical", "one_hot")


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
        self._trajectories = Trajectories()  # streams of trajectories, ids of rows written without them
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
        elif is_store(self.path):
            self._set_store(Store.open(self.path, mode=mode))
        elif observation_space is not None and action_space is not None:
            self._create_store(observation_space, action_space)
        if self.store is not None and max_size is None:
            max_size = self.store.capacity
        # Storage's own __init__, not the key-value store's: every method that touches data is ours.
        Storage.__init__(self, UNBOUNDED_MAX_SIZE if max_size is None else max_size)
        self._drawn: Drawn | None = None  # what a native sampler drew, for the next get (see Drawn)

    def _create_store(self, observation_space, action_space) -> None:
        from mmreplay.columns.spec import ColumnSpec

        kw = {k: v for k, v in self._create.items() if k not in ("observation_space", "action_space", "capacity")}
        kw.setdefault("capacity", self._create["capacity"])
        kw["extras"] = [*kw.get("extras", ()), ColumnSpec.numeric(TRAJ_COLUMN, (), "int64")]
        self._set_store(Store.create(self.path, observation_space, action_space, **kw))

    def _set_store(self, store: Store) -> None:
        self.store = store
        self._action_space = store.action_space
        self._trajectories.next_id = None  # counted on from the store's largest id at the next write

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
            self._create_store(*spaces_from(cols, self._create.get("observation_space"),
                                            self._create.get("action_space"), self.observation_key,
                                            self._one_hot_width if self._written_one_hot else None))
        traj = data.get(TRAJ_KEY, None)
        traj = None if traj is None else as_numpy(traj).reshape(-1).astype(np.int64)
        ended = cols["terminated"] | cols["truncated"]
        if envs > 1 or traj is None:  # one stream per env (time-major rows), or all rows one stream
            streams = np.tile(np.arange(envs), len(data) // envs)
        else:
            streams = self._trajectories.streams(traj, ended)
        extras = {spec.name: as_numpy(data.get(spec.name)) for spec in self.store.schema.extras
                  if spec.name != TRAJ_COLUMN and spec.name in data.keys()}  # read back under the same key
        if self._has_traj_column():
            extras[TRAJ_COLUMN] = traj if traj is not None else self._trajectories.new_ids(streams, ended, self.store)
        self.store.extend(cols["obs"], cols["action"], cols["reward"], cols["next_obs"], cols["terminated"],
                          cols["truncated"], streams=streams, extras=extras or None)
        if traj is not None and traj.size and self._has_traj_column():
            self._trajectories.written(traj, self.store)
        if set_cursor:
            self._set_last_cursor(cursor)
        self._bump_mutation_revision()

    def _columns(self, data) -> dict[str, np.ndarray]:
        key = self.observation_key = self.observation_key or observation_key_of(data)
        reward_shape = self.store.schema.reward.shape if self.store is not None else ()
        cols, width = columns(data, key, self._action_space, reward_shape)
        self._written_one_hot = width is not None
        if width is not None:
            self._one_hot_width = width
        return cols

    def get(self, index) -> TensorDict:
        store = self._require_store()
        drawn, self._drawn = self._drawn, None
        if drawn is not None and drawn.names(index):
            return self._get_drawn(store, drawn)
        if isinstance(index, slice) and index == slice(None) and called_by_torchrl_sampler():
            return self.index_view()
        lo, head = store.inspect.readable_range()
        pos = positions(index, head - lo)
        try:
            batch = store.inspect.get(lo + pos.reshape(-1))
        except IndexError as exc:
            raise IndexError(f"MMReplayStorage {self.path!r}: a writer in another process overwrote transitions "
                             f"between reading the storage's length and reading them ({exc}); sample with "
                             "MMReplayRandomSampler / MMReplayPrioritizedSampler / MMReplaySliceSampler, which "
                             "draw again instead") from None
        return self._to_tensordict(batch, pos.shape)

    def _pin(self, drawn: Drawn) -> torch.Tensor:
        """A native sampler's draw: ``get`` reads exactly these ids next (see the module invariants)."""
        self._drawn = drawn
        return drawn.index

    def _get_drawn(self, store: Store, drawn: Drawn) -> TensorDict:
        for _ in range(RACE_RETRIES):
            try:
                return self._to_tensordict(store.inspect.get(drawn.ids), (drawn.ids.size,))
            except IndexError:  # a writer overwrote some since they were drawn: draw again
                drawn = drawn.again()
        raise RuntimeError(f"MMReplayStorage {self.path!r}: a writer overwrote the drawn transitions {RACE_RETRIES} "
                           "times in a row before they could be read (a ring far too small for the writer's pace?)")

    def _to_tensordict(self, batch, shape) -> TensorDict:
        key = self.observation_key or OBSERVATION_KEYS[0]  # nothing written yet this session, none given
        if self.action_encoding == "auto":
            one_hot = bool(self._written_one_hot) and discrete_width(self._action_space) is not None
        else:
            one_hot = self.action_encoding == "one_hot"
        return to_tensordict(batch, shape, key, self.store.schema.reward.shape, one_hot,
                             discrete_width(self._action_space))

    def index_view(self) -> TensorDict:
        """Every readable transition's small columns, no frames: ``episode`` (numbered by first step),
        ``("collector", "traj_ids")`` and the ``next`` done flags. What TorchRL's samplers get for
        ``storage[:]``."""
        return index_view_of(self.store, self._has_traj_column())

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


class Drawn:
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

    def again(self) -> Drawn:
        ids, index, info = self._redraw()
        self.info.clear()
        self.info.update(info)
        self.info["index"] = index
        return Drawn(ids, index, self.info, self._redraw)


def is_store(path: str) -> bool:
    return os.path.isfile(os.path.join(path, "zarr.json"))
