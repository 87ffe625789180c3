"""Writing episodes from a dataset into a new store: the one write path every importer uses.

Invariants:
- Atomic: the store is built in a sibling of the destination (``outputs.staged``: ``<path>.importing-
  <pid>-<token>``) and renamed onto ``path`` only once it is complete and committed. An import that fails
  removes its sibling; one that is killed leaves it, and the next import into the same ``path`` removes it
  and says so (imports restart from the beginning), unless the format is resumable (``dqn_replay.py``:
  ``EpisodeWriter(..., resumable=True)`` keeps the sibling when it fails, ``resume=True`` reopens the
  newest one left and continues in it, renamed to this process's sibling). So ``path``
  never holds a partial store that ``Store.open`` would open as data, whatever happens to the process.
- The store is created only after the source's spaces and first episode were read and checked, at a path
  that must not exist yet (or be an empty directory); nothing existing is touched.
- Each episode is written in order with ``Store.extend``, in pieces of any size: a piece continues its
  episode because its first observation equals the previous piece's last next observation, bit for bit
  (the store's own linking rule). An episode that ends without terminated/truncated (unfinished) moves the
  writer to a fresh stream, so the next episode can never be linked onto it by accident.
- Values are checked by the store (shape, dtype, range) before anything of a piece is stored; the
  source's arrays are checked against ``bounds.py`` before they are read, and read in byte-bounded blocks.

How a format uses it (a new import format gets atomicity and leftover cleaning for free)::

    with EpisodeWriter(path, observation_space, action_space, store_options(meta, store_kwargs),
                       progress, total_steps) as writer:
        for each episode, in order, in blocks of ``bounds.block_rows_for(row_bytes, block_rows)`` rows:
            writer.write(obs, action, reward, next_obs, terminated, truncated, end=last_block_of_episode)
    return {"format": ..., **writer.summary()}

Everything the format reads happens inside the ``with`` block; the rename happens when it ends without
an exception. ``writer.notes`` says what leftovers of killed imports were removed.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from mmreplay.columns.spaces import space_from_json, space_to_json
from mmreplay.datasets.outputs import remove, staged
from mmreplay.storage.durability.commit import COMMIT_FILE

ProgressFn = Callable[[int, int], None]

#: keys of the ``mmreplay`` metadata an export writes and an import uses as ``Store.create`` defaults
STORE_KEYS = ("frame_stack", "stack_padding", "reward_values")


def export_metadata(store, listing) -> dict[str, Any]:
    """What an export records about its store (JSON): spaces, the store options an import restores, and
    what was left out (written when the export is done: ``skipped_overwritten_episodes`` counts the
    episodes a writer overwrote while they were read)."""
    reward = store.schema.reward
    return {"format": "mmreplay-export", "version": 1, "source": os.path.abspath(store.path),
            "observation_space": space_to_json(store.observation_space),
            "action_space": space_to_json(store.action_space),
            "frame_stack": store.frame_stack, "stack_padding": store.schema.stack_padding,
            "reward_values": list(reward.values) if reward.kind == "packed" else None,
            "episodes": len(listing.exported), "steps": listing.exported_steps,
            "skipped_cut_episodes": listing.skipped_cut, "skipped_unfinished_episodes": listing.skipped_unfinished,
            "skipped_overwritten_episodes": len(listing.lost)}


def parse_metadata(text) -> dict[str, Any]:
    if text is None:
        return {}
    if isinstance(text, bytes):
        text = text.decode()
    meta = json.loads(text) if isinstance(text, str) else dict(text)
    return meta if meta.get("format") == "mmreplay-export" else {}


def store_options(meta: Mapping[str, Any], overrides: Mapping[str, Any]) -> dict[str, Any]:
    """``Store.create`` keyword arguments: the exported store's options, then the caller's."""
    opts = {k: meta[k] for k in STORE_KEYS if meta.get(k) is not None}
    opts.update({k: v for k, v in overrides.items() if v is not None})
    opts.setdefault("capacity", None)
    return opts


def spaces_from_metadata(meta: Mapping[str, Any]):
    if "observation_space" in meta and "action_space" in meta:
        return space_from_json(meta["observation_space"]), space_from_json(meta["action_space"])
    return None, None


class EpisodeWriter:
    """Creates the store lazily (in the staging sibling) and appends episodes piece by piece. Used as a
    context manager: the store is closed (committed) and renamed onto ``path`` when the block ends, and
    removed if the block raises (see the module invariants)."""

    def __init__(self, path, observation_space, action_space, store_kwargs: Mapping[str, Any],
                 progress: ProgressFn | None = None, total_steps: int | None = None, *, resume: bool = False,
                 resumable: bool = False):
        if os.path.exists(path) and (not os.path.isdir(path) or os.listdir(path)):
            raise FileExistsError(f"cannot import into {os.fspath(path)!r}: it exists and is not an empty "
                                  "directory (imports always create a new store)")
        self.path = os.fspath(path)
        self._spaces = (observation_space, action_space)
        self._store_kwargs = dict(store_kwargs)
        self._staging = None
        self.store = None
        self.notes: list[str] = []
        self.dict_obs = hasattr(observation_space, "spaces") and isinstance(observation_space.spaces, dict)
        self.keys = list(observation_space.spaces) if self.dict_obs else ["obs"]
        self.stream = 0
        self.episodes = 0
        self.steps = 0
        self.progress = progress
        self.total = total_steps
        self._resume = (resume, resumable)  # a resumable format (dqn_replay.py) keeps its sibling when it fails

    @property
    def resumed(self) -> bool:
        """The store is the one a killed import of ``path`` left, reopened to continue (``resume=True``)."""
        return bool(self._staging and self._staging.resumed)

    def open(self):
        if self.store is None:
            from mmreplay.store import Store

            if self._staging is None:
                raise RuntimeError("EpisodeWriter: use it as a context manager (with EpisodeWriter(...) as w)")
            if self.resumed:
                from mmreplay.settings import Settings

                session = {k: v for k, v in self._store_kwargs.items() if k in Settings.__dataclass_fields__}
                self.store = Store.open(self._staging.path, "a", **session)
            else:
                self.store = Store.create(self._staging.path, *self._spaces, **self._store_kwargs)
        return self.store

    def write(self, obs, action, reward, next_obs, terminated, truncated, *, end: bool) -> None:
        """Append ``n`` consecutive steps of the current episode (``obs``/``next_obs``: arrays, or dicts of
        arrays for Dict spaces); ``end``: this piece holds the episode's last step."""
        n = int(np.asarray(action).shape[0])
        if n:
            store = self.open()
            store.extend(obs, action, reward, next_obs, terminated, truncated, streams=np.full(n, self.stream))
            self.steps += n
            if self.progress:
                self.progress(self.steps, max(self.total or 0, self.steps))
        if end:
            self.episodes += 1
            if n == 0 or not (bool(np.asarray(terminated)[-1]) or bool(np.asarray(truncated)[-1])):
                self.stream += 1  # unfinished: never let the next episode continue it

    def close(self):
        store = self.open()  # an empty dataset still makes an (empty) store
        store.close()
        return store

    def summary(self) -> dict[str, Any]:
        """What every import reports: the new store's path, episodes and steps, and notes."""
        return {"path": self.path, "episodes": self.episodes, "steps": self.steps, "notes": list(self.notes)}

    def __enter__(self) -> "EpisodeWriter":
        resume, resumable = self._resume
        self._guard = staged(self.path, "importing", resume=resume, keep_on_failure=resumable)
        self._staging = self._guard.__enter__()
        self.notes = list(self._staging.notes)
        adopted = self._staging.resumed
        if adopted and not os.path.isfile(os.path.join(self._staging.path, COMMIT_FILE)):
            # killed before its store's first commit (inside Store.create): nothing to continue, start over
            remove(self._staging.path)
            self._staging.resumed = None
            self.notes = [n for n in self.notes if adopted not in n]
            self.notes.append(f"{adopted!r}, left by an interrupted import, held no committed store yet: "
                              "this run starts over")
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.close()
            elif self.store is not None:
                self.store.close()  # released before its files go
        except BaseException:
            self._guard.__exit__(*sys.exc_info())
            raise
        self._guard.__exit__(*exc)


def obs_rows(obs, lo: int, hi: int):
    return {k: v[lo:hi] for k, v in obs.items()} if isinstance(obs, dict) else obs[lo:hi]


def check_obs_shape(obs, space, what: str, rows: int) -> None:
    """Raise naming the key and both shapes when a dataset's observations do not fit the store's space."""
    if isinstance(obs, dict):
        names = sorted(space.spaces) if hasattr(space, "spaces") and isinstance(space.spaces, dict) else None
        if names is None or sorted(obs) != names:
            raise ValueError(f"{what}: observation keys {sorted(obs)} do not match the observation space "
                             f"{names if names is not None else space}")
        for k in names:
            check_obs_shape(obs[k], space.spaces[k], f"{what}[{k!r}]", rows)
        return
    arr = np.asarray(obs) if not hasattr(obs, "shape") else obs
    expected = (rows, *space.shape)
    if tuple(arr.shape) != expected:
        raise ValueError(f"{what}: expected shape {expected} (observation space {space}), got {tuple(arr.shape)}")
