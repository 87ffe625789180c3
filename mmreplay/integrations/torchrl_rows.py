"""TorchRL TensorDicts as store rows and back: the keys, the action encoding, trajectory ids and streams.

Invariants:
- A collector's TensorDict of ``n`` steps is ``n`` store rows: ``observation`` (or ``pixels``, or the key
  given) and ``("next", key)`` are the two observations, a one-hot ``action`` (0/1 rows summing to 1 of a
  ``Discrete`` width) is stored as its index, ``("next", "terminated" | "truncated")`` as the two flags
  (``truncated`` = ``done & ~terminated`` when it is missing). Read back, a row is a TensorDict with
  TorchRL's keys: ``done`` / ``terminated`` / ``truncated`` False (a stored step never starts from a
  terminal state), the flags, reward and next observation under ``next``, one-hot actions again when
  ``action_encoding`` says so.
- ``Trajectories``: rows of one ``("collector", "traj_ids")`` form one stream of the store, and a stream is
  given back once its trajectory ended, so streams stay few however many episodes; rows written without ids
  get new ids, one per episode of their stream, counted on from the largest id the store holds.
- ``index_view_of`` numbers episodes by their first step (a bijection onto the store's readable episodes) and
  never decodes a frame.
"""

from __future__ import annotations

import sys

import numpy as np
import torch
from gymnasium import spaces
from tensordict import TensorDict

from mmreplay.store import Store

TRAJ_KEY = ("collector", "traj_ids")
TRAJ_COLUMN = "collector.traj_ids"  # the store's extra column holding TRAJ_KEY
OBSERVATION_KEYS = ("observation", "pixels")  # TorchRL's keys for state and pixel observations
RACE_RETRIES = 16  # draws again when a writer in another process overwrote what was drawn, at most this often
TORCHRL_SAMPLERS = "torchrl.data.replay_buffers.samplers"  # the modules whose storage[:] reads get the index view


# -- writing: a TensorDict's columns ------------------------------------------------------------------------
def columns(data, key: str, action_space, reward_shape: tuple) -> tuple[dict[str, np.ndarray], int | None]:
    """The store columns of the collector TensorDict ``data`` (shape ``(n,)``), and the width of its
    ``action`` if that was one-hot (then stored as its index), else None."""
    nxt = data.get("next", None)
    if nxt is None or key not in nxt.keys() or key not in data.keys():
        raise KeyError(f"MMReplayStorage needs {key!r} and ('next', {key!r}) in each TensorDict (TorchRL's "
                       f"collector layout); got keys {sorted(map(str, data.keys(True)))}")
    action = data.get("action")
    one_hot = is_one_hot(action, action_space)
    width = int(action.shape[-1]) if one_hot else None
    action = action.argmax(-1) if one_hot else action
    done = nxt.get("done")
    terminated = nxt.get("terminated", done)
    truncated = nxt.get("truncated", None)
    if truncated is None:
        truncated = done & ~terminated if done is not None else torch.zeros_like(terminated)
    return {"obs": as_numpy(data.get(key)), "next_obs": as_numpy(nxt.get(key)), "action": as_numpy(action),
            "reward": as_numpy(nxt.get("reward")).reshape(len(data), *reward_shape),
            "terminated": as_numpy(terminated).reshape(-1).astype(bool),
            "truncated": as_numpy(truncated).reshape(-1).astype(bool)}, width


def is_one_hot(action, action_space) -> bool:
    """A one-hot action: rows of 0/1 summing to 1, and a Discrete action space of that width (given,
    or still to be made from the data)."""
    if action.ndim != 2 or action.dtype.is_complex:
        return False
    width = discrete_width(action_space)
    if width is None and action_space is not None:
        return False  # a Box action space: vectors are vectors
    if width is not None and width != action.shape[-1]:
        return False
    return bool(((action == 0) | (action == 1)).all()) and bool((action.sum(-1) == 1).all())


def discrete_width(space) -> int | None:
    return int(space.n) if space is not None and hasattr(space, "n") else None


def spaces_from(cols: dict[str, np.ndarray], observation_space, action_space, key: str | None,
                one_hot_width: int | None) -> tuple:
    """The spaces of a store made from the first columns written: those given, else inferred (a one-hot
    action of width n: ``Discrete(n)``; float actions: an unbounded ``Box``)."""
    if observation_space is None:
        observation_space = _box_of(cols["obs"], f"observation {key!r}", "observation_space")
    if action_space is None:
        if one_hot_width is not None:
            action_space = spaces.Discrete(one_hot_width)
        elif cols["action"].dtype.kind == "f":
            action_space = _box_of(cols["action"], "action", "action_space")
        else:
            action = cols["action"]
            raise ValueError(f"MMReplayStorage: cannot infer the action space from {action.dtype} actions of "
                             f"shape {action.shape[1:]} that are not one-hot (Discrete(n) or MultiDiscrete? n is "
                             "not in the data): give action_space=, e.g. gymnasium.spaces.Discrete(n)")
    return observation_space, action_space


def observation_key_of(data) -> str:
    """The observation key of a collector's TensorDict when none was given: the one of TorchRL's keys it has."""
    present = [k for k in OBSERVATION_KEYS if k in data.keys()]
    if len(present) > 1:
        raise ValueError(f"MMReplayStorage: both of {OBSERVATION_KEYS} are in the TensorDict: give "
                         "observation_key= to say which one to store")
    return present[0] if present else OBSERVATION_KEYS[0]  # none: the caller's KeyError names what is missing


def _box_of(values: np.ndarray, what: str, argument: str):
    """An unbounded Box of the rows' shape and dtype (uint8: 0..255, other integers: their dtype's range)."""
    kind = values.dtype.kind
    if kind not in "fiu":
        raise ValueError(f"MMReplayStorage: cannot infer a space for the {what} of dtype {values.dtype} and shape "
                         f"{values.shape[1:]}: give {argument}= (a gymnasium space)")
    if kind == "f":
        return spaces.Box(-np.inf, np.inf, values.shape[1:], values.dtype)
    info = np.iinfo(values.dtype)
    return spaces.Box(info.min, info.max, values.shape[1:], values.dtype)


def as_numpy(x) -> np.ndarray:
    return x.detach().cpu().numpy() if hasattr(x, "detach") else np.asarray(x)


class Trajectories:
    """Which stream of the store each trajectory's rows go to, and the ids of rows written without one
    (see the module invariants)."""

    def __init__(self):
        self.next_id: int | None = None  # the next trajectory id given to rows written without one
        self._stream_traj: dict[int, int] = {}  # stream -> its running trajectory id (rows without ids)
        self._stream_of: dict[int, int] = {}  # ("collector", "traj_ids") -> stream id of the store
        self._free_streams: list[int] = []
        self._next_stream = 0

    def streams(self, traj: np.ndarray, ended: np.ndarray) -> np.ndarray:
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

    def written(self, traj: np.ndarray, store: Store) -> None:
        """Rows with ids ``traj`` were written: new ids count on from above them."""
        self.next_id = max(self._next_id(store), int(traj.max()) + 1)

    def _next_id(self, store: Store) -> int:
        if self.next_id is None:  # first write of this session: count on from the largest id held
            oldest, head = store.inspect.valid_range()
            held = store.inspect.read_column(TRAJ_COLUMN, oldest, head) if head > oldest else np.zeros(0, np.int64)
            self.next_id = int(held.max()) + 1 if held.size else 0
        return self.next_id

    def new_ids(self, streams: np.ndarray, ended: np.ndarray, store: Store) -> np.ndarray:
        """Trajectory ids for rows written without them: each stream's running episode keeps its id,
        each episode after an end gets a new one (what a collector would have given)."""
        out = np.empty(len(streams), dtype=np.int64)
        nxt = self._next_id(store)
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
        self.next_id = nxt
        return out


# -- reading: store batches as TensorDicts --------------------------------------------------------------------
def to_tensordict(batch, shape, key: str, reward_shape: tuple, one_hot: bool, width: int | None) -> TensorDict:
    """A store ``Batch`` as a TensorDict of ``shape`` with TorchRL's keys (``key``: the observation's);
    actions one-hot (of ``width``) with ``one_hot``."""
    n = batch.action.shape[0]
    action = batch.action
    if one_hot:
        action = torch.nn.functional.one_hot(action.long(), width).to(torch.int64)
    term = batch.terminated.reshape(n, 1)
    trunc = batch.truncated.reshape(n, 1)
    reward = batch.reward.reshape(n, *reward_shape) if reward_shape else batch.reward.reshape(n, 1)
    false = torch.zeros(n, 1, dtype=torch.bool)
    td = TensorDict({key: batch.obs, "action": action, "done": false, "terminated": false,
                     "truncated": false.clone(),
                     "next": TensorDict({key: batch.next_obs, "reward": reward,
                                         "done": term | trunc, "terminated": term, "truncated": trunc},
                                        batch_size=[n])},
                    batch_size=[n])
    for name, value in batch.extras.items():
        td[TRAJ_KEY if name == TRAJ_COLUMN else name] = value
    return td.reshape(shape) if tuple(shape) != (n,) else td


def index_view_of(store: Store, has_traj_column: bool) -> TensorDict:
    """Every readable transition's small columns, no frames: ``episode`` (numbered by first step),
    ``("collector", "traj_ids")`` and the ``next`` done flags."""
    for attempt in range(RACE_RETRIES):  # a writer in another process may move the range in between
        oldest, head = store.inspect.readable_range()
        try:
            prev, term, trunc = store.inspect.episode_links(oldest, head)
            traj = store.inspect.read_column(TRAJ_COLUMN, oldest, head) if has_traj_column else None
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


def called_by_torchrl_sampler(depth: int = 4) -> bool:
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


def positions(index, n: int) -> np.ndarray:
    """TorchRL's index (int, slice, sequence, tensor) as positions ``0 <= p < n``."""
    if isinstance(index, slice):
        return np.arange(n, dtype=np.int64)[index]
    if isinstance(index, tuple) and len(index) == 1:
        index = index[0]
    pos = np.asarray(as_numpy(index), dtype=np.int64)
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
