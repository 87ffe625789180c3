"""D4RL-style flat HDF5 (``observations``, ``actions``, ``rewards``, ``terminals``, ``timeouts``,
``next_observations``) to and from a store.

Invariants:
- One row per step, episodes one after another, each in step order. ``terminals`` = terminated,
  ``timeouts`` = truncated; ``next_observations[i]`` is the step's true next observation (for the last
  step of an episode: its final observation). So ``observations[i + 1] == next_observations[i]``
  within an episode, and D4RL's ``qlearning_dataset`` (next obs = ``observations[i + 1]``, timeout rows
  and the file's last row dropped) gives the store's transitions minus exactly the rows it drops.
- Import with ``next_observations``: every row is a transition, lossless. Without it (original D4RL
  files), rows are read as ``qlearning_dataset`` reads them: next obs = ``observations[i + 1]``; a
  ``timeouts`` row has no known next observation and is dropped, and the step before it becomes the
  episode's last, marked truncated; the file's last row is dropped unless it has a next observation.
- Streaming: rows are written ``block_rows`` at a time (datasets are chunked and resizable) and read in
  blocks of at most ``block_rows`` rows and ``bounds.BLOCK_BYTES`` bytes, after every dataset was checked
  against ``bounds.py`` (a file that declares more than it holds is refused before any allocation).
- Atomic (``outputs.staged``): the file is written beside ``out`` and renamed onto it when complete.
  Exporting a store that a writer is overwriting exports the episodes that survive the export, whole, and
  says how many were overwritten meanwhile (summary ``notes`` and the file's ``mmreplay`` metadata).
- Compressed losslessly by default (gzip + shuffle; ``compression="lzf"`` or ``"none"``: ``hdf5.py``).
- Dict observations have no flat form here: refused, naming the keys.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmreplay.datasets import bounds, hdf5, sources
from mmreplay.datasets.episodes import iter_pieces, list_episodes
from mmreplay.datasets.outputs import staged
from mmreplay.datasets.importing import (
    EpisodeWriter,
    export_metadata,
    parse_metadata,
    spaces_from_metadata,
    store_options,
)

KEYS = ("observations", "actions", "rewards", "terminals", "timeouts")


def _h5py():
    try:
        import h5py
    except ImportError:
        raise ImportError("D4RL/d3rlpy HDF5 export/import needs h5py; pip install 'mmreplay[d4rl]'") from None
    return h5py


def export_d4rl(store, out, *, include_partial: bool = False, episodes: Sequence[int] | slice | None = None,
                block_rows: int = 4096, progress=None, compression: str | None = None) -> dict[str, Any]:
    """Write the store's episodes to the flat HDF5 file ``out`` (which must not exist). ``compression``:
    ``"gzip"`` (default), ``"lzf"`` or ``"none"``."""
    h5py = _h5py()
    compression = hdf5.check_compression(compression)
    out = os.fspath(out)
    if store.schema.dict_obs:
        raise ValueError(f"D4RL-style files hold one observation array; this store has Dict observations "
                         f"(keys {[s.name for s in store.schema.observations]}): export it as minari or d3rlpy")
    if os.path.exists(out):
        raise FileExistsError(f"cannot export to {out!r}: the file exists")
    listing = list_episodes(store, include_partial=include_partial, select=episodes)
    obs_shape = store.observation_space.shape
    obs_dtype = np.dtype(store.observation_space.dtype)
    act_shape, act_dtype = store.action_space.shape, np.dtype(store.action_space.dtype)
    with staged(out, "exporting") as staging, h5py.File(staging.path, "w", libver=hdf5.LIBVER) as f:
        def column(name, shape, dtype):
            return hdf5.resizable(f, name, shape, dtype, max(1, min(block_rows, listing.steps)), compression)
        cols = {"observations": column("observations", obs_shape, obs_dtype),
                "next_observations": column("next_observations", obs_shape, obs_dtype),
                "actions": column("actions", act_shape, act_dtype),
                "rewards": column("rewards", (), np.float32),
                "terminals": column("terminals", (), np.bool_), "timeouts": column("timeouts", (), np.bool_)}
        episode_start = 0  # rows before the current episode: an episode the writer overwrote is cut back to it
        for piece in iter_pieces(store, listing.episodes, block_rows, progress, lost=listing.lost):
            if piece.lost:
                for col in cols.values():
                    col.resize(episode_start, axis=0)
                continue
            if piece.start:
                episode_start = cols["actions"].shape[0]
            timeouts = piece.truncated.copy()
            if piece.end and not (piece.terminated[-1] or piece.truncated[-1]):
                timeouts[-1] = True  # an unfinished episode (include_partial): the only way to end it here
            for name, values in (("observations", piece.obs["obs"]), ("next_observations", piece.next_obs["obs"]),
                                 ("actions", piece.action), ("rewards", piece.reward),
                                 ("terminals", piece.terminated), ("timeouts", timeouts)):
                hdf5.append(cols[name], values)
        listing.note_lost()
        f.attrs["mmreplay"] = json.dumps(export_metadata(store, listing))  # at the end: what was overwritten
    return {"format": "d4rl", "path": out, "episodes": len(listing.exported), "steps": listing.exported_steps,
            "compression": compression, "bytes": os.path.getsize(out), "notes": staging.notes + listing.notes}


def infer_spaces(f, meta):
    """The store spaces for a D4RL file: from an mmreplay export's metadata, else from the arrays
    (uint8 observations: Box(0, 255); float: unbounded Box; integer scalar actions: Discrete(max + 1))."""
    from gymnasium import spaces

    obs_space, act_space = spaces_from_metadata(meta)
    if obs_space is not None:
        return obs_space, act_space
    obs = f["observations"]
    if obs.dtype == np.uint8:
        obs_space = spaces.Box(0, 255, obs.shape[1:], np.uint8)
    else:
        obs_space = spaces.Box(-np.inf, np.inf, obs.shape[1:], obs.dtype)
    act = f["actions"]
    if act.dtype.kind in "iu" and act.shape[1:] in ((), (1,)):
        step = bounds.block_rows_for(bounds.row_nbytes(act.shape[1:], act.dtype))
        hi = max((int(np.max(act[i:i + step])) for i in range(0, act.shape[0], step)), default=0)
        act_space = spaces.Discrete(hi + 1)
    else:
        act_space = spaces.Box(-np.inf, np.inf, act.shape[1:], act.dtype)
    return obs_space, act_space


def import_d4rl(src, path, *, observation_space=None, action_space=None, block_rows: int = 4096, progress=None,
                **store_kwargs) -> dict[str, Any]:
    """A new store at ``path`` from the D4RL-style file ``src`` (see the module invariants)."""
    h5py = _h5py()
    src = os.fspath(src)
    sources.regular_file(src, "D4RL-style dataset")  # a FIFO would block the open, /dev/zero never end
    with h5py.File(src, "r") as f:
        missing = [k for k in KEYS if k not in f and k != "timeouts"]
        if missing:
            raise ValueError(f"{src!r} is not a D4RL-style file: missing dataset(s) {missing} (expected "
                             f"{list(KEYS)} and optionally 'next_observations'; found {sorted(f.keys())})")
        row_bytes = _check_datasets(f, src)
        n = f["observations"].shape[0]
        for k in ("actions", "rewards", "terminals", "timeouts", "next_observations"):
            if k in f and f[k].shape[0] != n:
                raise ValueError(f"{src!r}: {k!r} has {f[k].shape[0]} rows, 'observations' has {n}")
        meta = parse_metadata(f.attrs.get("mmreplay"))
        obs_space, act_space = infer_spaces(f, meta)
        obs_space, act_space = observation_space or obs_space, action_space or act_space
        if tuple(f["observations"].shape[1:]) != tuple(obs_space.shape):
            raise ValueError(f"{src!r}: observations have shape {f['observations'].shape[1:]} per row, the "
                             f"observation space {obs_space} expects {obs_space.shape}")
        has_next = "next_observations" in f
        block = bounds.block_rows_for(row_bytes, block_rows)
        with EpisodeWriter(path, obs_space, act_space, store_options(meta, store_kwargs), progress, n) as writer:
            _import_rows(f, n, has_next, writer, block, squeeze_action=act_space.shape == ())
    return {"format": "d4rl", **writer.summary(), "next_observations": has_next}


def _check_datasets(f, src: str) -> int:
    """Check every column of the file against ``bounds.py`` before reading any: the bytes of one row of
    all of them together (what a read block holds per row)."""
    total = 0
    for k in (*KEYS, "next_observations"):
        if k in f:
            if not hasattr(f[k], "shape"):
                raise ValueError(f"{src!r}: {k!r} is a group, expected a dataset")
            total += bounds.check_hdf5_dataset(f[k], f"{src!r}: {k!r}")
    return total


def _import_rows(f, n: int, has_next: bool, writer: EpisodeWriter, block_rows: int, squeeze_action: bool) -> None:
    timeouts_ds = f.get("timeouts")
    for lo in range(0, n, block_rows):
        hi = min(n, lo + block_rows)
        ahead = min(n, hi + 1)  # one row of look-ahead: the next observation of the block's last row
        obs = f["observations"][lo:ahead]
        act = f["actions"][lo:hi]
        if squeeze_action and act.ndim == 2 and act.shape[1] == 1:
            act = act[:, 0]
        rew = np.asarray(f["rewards"][lo:hi], dtype=np.float32).reshape(-1)
        term = np.asarray(f["terminals"][lo:hi]).reshape(-1).astype(bool)
        timeout = np.asarray(timeouts_ds[lo:ahead]).reshape(-1).astype(bool) if timeouts_ds is not None else \
            np.zeros(ahead - lo, bool)
        trunc = timeout[: hi - lo].copy()
        if has_next:
            nxt = f["next_observations"][lo:hi]
            keep = np.ones(hi - lo, bool)
        else:
            nxt = obs[1:]
            keep = ~trunc  # qlearning_dataset: a timeout row's next observation is unknown: dropped
            if hi == n:
                keep[-1] = False  # the file's last row has no next observation either
                nxt = np.concatenate([nxt, obs[-1:]])
            # The step before a dropped timeout row becomes its episode's last step: truncated.
            before = np.flatnonzero(timeout[1:])
            before = before[before < hi - lo]
            before = before[~(term[before] | trunc[before])]
            trunc[before] = True
        _write_episodes(writer, obs[: hi - lo][keep], act[keep], rew[keep], nxt[keep], term[keep], trunc[keep],
                        last_block=hi == n)


def _write_episodes(writer, obs, act, rew, nxt, term, trunc, *, last_block: bool) -> None:
    """Rows of one or more consecutive episodes: split after each terminated/truncated row. The rows after
    the last end continue in the next block (or, in the last block, form an unfinished episode)."""
    ends = (np.flatnonzero(term | trunc) + 1).tolist()
    lo = 0
    for hi in ends:
        writer.write(obs[lo:hi], act[lo:hi], rew[lo:hi], nxt[lo:hi], term[lo:hi], trunc[lo:hi], end=True)
        lo = hi
    rest = obs.shape[0]
    if rest > lo:
        writer.write(obs[lo:], act[lo:], rew[lo:], nxt[lo:], term[lo:], trunc[lo:], end=last_block)


def qlearning_dataset(f) -> dict[str, np.ndarray]:
    """D4RL's ``qlearning_dataset(env, dataset, terminate_on_end=False)`` on an open file, as d4rl 1.1
    implements it (with a ``timeouts`` field): for ``i`` in ``range(N - 1)``, skip the row if it is a
    timeout, else emit ``(observations[i], actions[i], rewards[i], observations[i + 1], terminals[i])``.
    Whole-file, for checks and small files only."""
    obs = f["observations"][()]
    act, rew = f["actions"][()], f["rewards"][()]
    term, timeouts = f["terminals"][()].astype(bool), f["timeouts"][()].astype(bool)
    rows = np.flatnonzero(~timeouts[:-1])
    return {"observations": obs[rows], "actions": act[rows], "next_observations": obs[rows + 1],
            "rewards": rew[rows], "terminals": term[rows]}
