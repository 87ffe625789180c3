"""d3rlpy ``ReplayBuffer`` HDF5 files (``ReplayBuffer.dump`` / ``ReplayBuffer.load``, dataset version 2.1)
to and from a store, written and read with h5py (d3rlpy itself is only needed to load them into d3rlpy).

Invariants:
- Layout as d3rlpy's ``dataset/io.py`` writes it: ``columns`` = [observations, actions, rewards,
  terminated], ``num_episodes``, ``version`` = "2.1", and per episode ``i``: ``observations_i`` (``M``
  rows; Dict observations as a tuple ``observations_i_j``, one per key in the store's key order),
  ``actions_i`` (``(M, 1)`` for a scalar action), ``rewards_i`` (``(M, 1)`` float32), ``terminated_i``.
- d3rlpy semantics: a terminated episode of ``M`` rows has ``M`` transitions (the last one's next
  observation is zeros in d3rlpy); any other episode has ``M - 1`` (the last row only supplies the next
  observation). So export writes a terminated episode of ``N`` steps as ``N`` rows, and a truncated one
  as ``N + 1`` rows whose last row is the final observation with a zero action and reward (ignored by
  d3rlpy's transition pickers). The final observation of a terminated episode has no place in d3rlpy's
  columns: it goes to ``mmreplay_final_observation_i`` (ignored by d3rlpy), and import reads it back, so
  a round trip is exact; a foreign file's terminal next observation is zeros, as d3rlpy uses.
- Streaming: each episode's datasets are resizable and written ``block_rows`` at a time; import checks
  every dataset against ``bounds.py`` first, then reads at most ``block_rows`` rows and
  ``bounds.BLOCK_BYTES`` bytes at a time.
- Atomic (``outputs.staged``): the file is written beside ``out`` and renamed onto it when complete.
  Episodes a live writer overwrites during the export are left out whole, and counted (``notes``,
  metadata ``skipped_overwritten_episodes``); the file's episodes are numbered without gaps.
- Compressed losslessly by default (gzip + shuffle; ``compression="lzf"`` or ``"none"``: ``hdf5.py``).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmreplay.datasets import bounds, hdf5, sources
from mmreplay.datasets.d4rl import _h5py
from mmreplay.datasets.episodes import iter_pieces, list_episodes
from mmreplay.datasets.outputs import staged
from mmreplay.datasets.importing import (
    EpisodeWriter,
    export_metadata,
    parse_metadata,
    spaces_from_metadata,
    store_options,
)

VERSION = "2.1"
COLUMNS = ["observations", "actions", "rewards", "terminated"]


def export_d3rlpy(store, out, *, include_partial: bool = False, episodes: Sequence[int] | slice | None = None,
                  block_rows: int = 4096, progress=None, compression: str | None = None) -> dict[str, Any]:
    """Write the store's episodes to ``out`` (must not exist) in d3rlpy's ReplayBuffer HDF5 layout.
    ``compression``: ``"gzip"`` (default), ``"lzf"`` or ``"none"``."""
    h5py = _h5py()
    compression = hdf5.check_compression(compression)
    out = os.fspath(out)
    if os.path.exists(out):
        raise FileExistsError(f"cannot export to {out!r}: the file exists")
    listing = list_episodes(store, include_partial=include_partial, select=episodes)
    keys = [s.name for s in store.schema.observations]
    dict_obs = store.schema.dict_obs
    obs_specs = {s.name: (tuple(s.shape), s.np_dtype) for s in store.schema.observations}
    act_shape = store.action_space.shape or (1,)
    act_dtype = np.dtype(store.action_space.dtype)
    with staged(out, "exporting") as staging, h5py.File(staging.path, "w", libver=hdf5.LIBVER) as f:
        f.create_dataset("columns", data=COLUMNS)
        f.create_dataset("version", data=VERSION)
        cols: dict[str, Any] = {}
        i = 0  # the file's episode number: episodes a writer overwrote during the export leave no gap

        def grow(name, values):
            hdf5.append(cols[name], values)

        for piece in iter_pieces(store, listing.episodes, block_rows, progress, lost=listing.lost):
            if piece.lost:  # overwritten part way: what was written of it goes
                for name in list(f):
                    if re.fullmatch(rf"(observations|actions|rewards)_{i}(_\d+)?", name):
                        del f[name]
                continue
            if piece.start:
                cols = {}
                cap = max(1, min(block_rows, len(listing.episodes[piece.episode]) + 1))  # steps + final obs
                for j, k in enumerate(keys):
                    name = f"observations_{i}_{j}" if dict_obs else f"observations_{i}"
                    shape, dtype = obs_specs[k]
                    cols[k] = hdf5.resizable(f, name, shape, dtype, cap, compression)
                cols["actions"] = hdf5.resizable(f, f"actions_{i}", act_shape, act_dtype, cap, compression)
                cols["rewards"] = hdf5.resizable(f, f"rewards_{i}", (1,), np.float32, cap, compression)
            for k in keys:
                grow(k, piece.obs[k])
            grow("actions", piece.action.reshape(len(piece), *act_shape))
            grow("rewards", piece.reward.astype(np.float32).reshape(-1, 1))
            if piece.end:
                terminated = bool(piece.terminated[-1])
                if terminated:
                    for j, k in enumerate(keys):
                        name = f"mmreplay_final_observation_{i}_{j}" if dict_obs else f"mmreplay_final_observation_{i}"
                        f.create_dataset(name, data=piece.next_obs[k][-1], **hdf5.filters(compression))
                else:  # the final observation as one more row: d3rlpy's next observation of the last step
                    for k in keys:
                        grow(k, piece.next_obs[k][-1:])
                    grow("actions", np.zeros((1, *act_shape), act_dtype))
                    grow("rewards", np.zeros((1, 1), np.float32))
                f.create_dataset(f"terminated_{i}", data=np.bool_(terminated))
                i += 1
        f.create_dataset("num_episodes", data=i)
        listing.note_lost()
        f.attrs["mmreplay"] = json.dumps({**export_metadata(store, listing), "observation_keys": keys})
    return {"format": "d3rlpy", "path": out, "episodes": len(listing.exported), "steps": listing.exported_steps,
            "compression": compression, "bytes": os.path.getsize(out), "notes": staging.notes + listing.notes}


def _episode_obs(f, i: int, keys: list[str] | None):
    """The observation dataset(s) of episode ``i``: one dataset, or a dict key -> dataset (tuple obs)."""
    if f"observations_{i}" in f:
        return f[f"observations_{i}"]
    parts = []
    while f"observations_{i}_{len(parts)}" in f:
        parts.append(f[f"observations_{i}_{len(parts)}"])
    if not parts:
        raise ValueError(f"episode {i}: no 'observations_{i}' dataset (nor tuple parts 'observations_{i}_0'...)")
    names = keys or [f"obs_{j}" for j in range(len(parts))]
    if len(names) != len(parts):
        raise ValueError(f"episode {i}: {len(parts)} observation parts, but the metadata names {len(names)} keys")
    return dict(zip(names, parts))


def infer_spaces(f, keys):
    from gymnasium import spaces

    def box(ds):
        if ds.dtype == np.uint8:
            return spaces.Box(0, 255, ds.shape[1:], np.uint8)
        return spaces.Box(-np.inf, np.inf, ds.shape[1:], ds.dtype)

    n = int(f["num_episodes"][()])
    if n == 0:
        raise ValueError("a d3rlpy file without episodes has no shapes to infer the spaces from; pass "
                         "observation_space and action_space")
    obs = _episode_obs(f, 0, keys)
    obs_space = spaces.Dict({k: box(v) for k, v in obs.items()}) if isinstance(obs, dict) else box(obs)
    act = f["actions_0"]
    if act.dtype.kind in "iu" and act.shape[1:] in ((), (1,)):
        hi = max(_max_in_blocks(f[f"actions_{i}"]) for i in range(n))
        act_space = spaces.Discrete(hi + 1)
    else:
        act_space = spaces.Box(-np.inf, np.inf, act.shape[1:], act.dtype)
    return obs_space, act_space


def _max_in_blocks(ds) -> int:
    step = bounds.block_rows_for(bounds.row_nbytes(ds.shape[1:], ds.dtype))
    return max((int(np.max(ds[lo:lo + step])) for lo in range(0, ds.shape[0], step) if lo < ds.shape[0]), default=0)


def _check_datasets(f, src: str, n_eps: int) -> None:
    """Every episode dataset checked against ``bounds.py`` before any is read."""
    if n_eps < 0 or n_eps > bounds.MAX_ROWS:
        raise ValueError(f"{src!r}: num_episodes {n_eps} is out of range (0 to {bounds.MAX_ROWS:,})")
    for name in f:
        if name in ("columns", "version", "num_episodes"):
            continue
        if not hasattr(f[name], "shape"):
            raise ValueError(f"{src!r}: {name!r} is a group, expected a dataset")
        bounds.check_hdf5_dataset(f[name], f"{src!r}: {name!r}")


def import_d3rlpy(src, path, *, observation_space=None, action_space=None, block_rows: int = 4096, progress=None,
                  **store_kwargs) -> dict[str, Any]:
    """A new store at ``path`` from a d3rlpy ReplayBuffer HDF5 file (see the module invariants)."""
    h5py = _h5py()
    src = os.fspath(src)
    sources.regular_file(src, "d3rlpy dataset")  # a FIFO would block the open, /dev/zero never end
    with h5py.File(src, "r") as f:
        missing = [k for k in ("columns", "num_episodes", "version") if k not in f]
        if missing:
            raise ValueError(f"{src!r} is not a d3rlpy ReplayBuffer file: missing {missing} (found "
                             f"{sorted(f.keys())[:10]})")
        version = f["version"][()]
        version = version.decode() if isinstance(version, bytes) else str(version)
        if version != VERSION:
            raise ValueError(f"{src!r}: d3rlpy dataset version {version!r}, expected {VERSION!r}")
        meta = parse_metadata(f.attrs.get("mmreplay"))
        keys = meta.get("observation_keys") if meta.get("observation_keys") != ["obs"] else None
        n_eps = int(f["num_episodes"][()])
        _check_datasets(f, src, n_eps)
        obs_space, act_space = spaces_from_metadata(meta)
        if observation_space is None or action_space is None:
            inferred = (obs_space, act_space) if obs_space is not None else infer_spaces(f, keys)
            observation_space = observation_space or inferred[0]
            action_space = action_space or inferred[1]
        total = sum(int(f[f"rewards_{i}"].shape[0]) for i in range(n_eps))
        with EpisodeWriter(path, observation_space, action_space, store_options(meta, store_kwargs), progress,
                           total) as writer:
            for i in range(n_eps):
                _import_episode(f, i, keys, writer, observation_space, action_space, block_rows)
    return {"format": "d3rlpy", **writer.summary()}


def _import_episode(f, i, keys, writer, obs_space, act_space, block_rows) -> None:
    obs = _episode_obs(f, i, keys)
    first = next(iter(obs.values())) if isinstance(obs, dict) else obs
    m = first.shape[0]
    for name in (f"actions_{i}", f"rewards_{i}", f"terminated_{i}"):
        if name not in f:
            raise ValueError(f"d3rlpy file: episode {i} has no {name!r} dataset")
    if f[f"actions_{i}"].shape[0] != m or f[f"rewards_{i}"].shape[0] != m:
        raise ValueError(f"d3rlpy file: episode {i} has {m} observation rows but {f[f'actions_{i}'].shape[0]} "
                         f"actions and {f[f'rewards_{i}'].shape[0]} rewards")
    row_bytes = sum(bounds.row_nbytes(ds.shape[1:], ds.dtype) for ds in
                    (obs.values() if isinstance(obs, dict) else [obs])) * 2  # observations and next observations
    row_bytes += sum(bounds.row_nbytes(f[name].shape[1:], f[name].dtype) for name in (f"actions_{i}", f"rewards_{i}"))
    block_rows = bounds.block_rows_for(row_bytes, block_rows)
    spaces_by_key = obs_space.spaces if isinstance(obs, dict) else {None: obs_space}
    for k, ds in (obs.items() if isinstance(obs, dict) else [(None, obs)]):
        if k not in spaces_by_key or tuple(ds.shape[1:]) != tuple(spaces_by_key[k].shape):
            want = spaces_by_key.get(k)
            raise ValueError(f"d3rlpy file: episode {i} observations{'' if k is None else f'[{k!r}]'} have shape "
                             f"{ds.shape[1:]} per row, the observation space expects "
                             f"{None if want is None else want.shape}")
    terminated = bool(f[f"terminated_{i}"][()])
    steps = m if terminated else m - 1  # d3rlpy: a non-terminal last row only supplies the next observation
    if steps <= 0:
        return  # a single observation without a transition: nothing to store
    final = None
    if terminated:
        if isinstance(obs, dict):
            names = [f"mmreplay_final_observation_{i}_{j}" for j in range(len(obs))]
            final = {k: f[nm][()][None] if nm in f else np.zeros((1, *ds.shape[1:]), ds.dtype)
                     for (k, ds), nm in zip(obs.items(), names)}
        else:
            nm = f"mmreplay_final_observation_{i}"
            final = f[nm][()][None] if nm in f else np.zeros((1, *obs.shape[1:]), obs.dtype)

    def rows(lo, hi):
        return {k: v[lo:hi] for k, v in obs.items()} if isinstance(obs, dict) else obs[lo:hi]

    for lo in range(0, steps, block_rows):
        hi = min(steps, lo + block_rows)
        o = rows(lo, min(m, hi + 1))
        if hi + 1 <= m:
            cur = {k: v[: hi - lo] for k, v in o.items()} if isinstance(o, dict) else o[: hi - lo]
            nxt = {k: v[1:] for k, v in o.items()} if isinstance(o, dict) else o[1:]
        else:  # a terminated episode's last step: its next observation is the stored final one (or zeros)
            cur = o
            if isinstance(o, dict):
                nxt = {k: np.concatenate([v[1:], final[k]]) for k, v in o.items()}
            else:
                nxt = np.concatenate([o[1:], final])
        act = f[f"actions_{i}"][lo:hi]
        if act_space.shape == () and act.ndim == 2 and act.shape[1] == 1:
            act = act[:, 0]
        rew = np.asarray(f[f"rewards_{i}"][lo:hi], dtype=np.float32).reshape(-1)
        end = hi == steps
        term = np.zeros(hi - lo, bool)
        trunc = np.zeros(hi - lo, bool)
        if end:
            term[-1] = terminated
            trunc[-1] = not terminated
        writer.write(cur, act, rew, nxt, term, trunc, end=end)
