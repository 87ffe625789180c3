"""Minari datasets (HDF5, or arrow where pyarrow is installed) to and from a store.

Invariants:
- Export writes through Minari's own storage writer (``MinariStorage.new`` + ``update_episodes``), so the
  result is what ``minari.load_dataset`` / ``MinariDataset`` read: per episode, ``observations`` with
  ``N + 1`` rows (the last is the final observation), ``actions``, ``rewards``, ``terminations``,
  ``truncations`` with ``N`` rows, and the store's spaces.
- Never lossy: Minari >= 0.5.4 JPEG-encodes uint8 "image" Box spaces (2-D/3-D, >= 32x32, bounds 0..255)
  unless asked not to. Export always passes ``jpeg_encoding=False`` and refuses, before writing anything,
  when the installed Minari cannot be told so; import refuses a JPEG-encoded dataset with image spaces
  (its frames are not the recorded ones).
- Memory: episodes are buffered until ``block_rows`` steps are pending (Minari writes whole episodes, so
  one episode longer than that is held alone).
"""

from __future__ import annotations

import inspect
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmreplay.datasets.episodes import as_space_value, iter_pieces, list_episodes
from mmreplay.datasets.importing import (
    EpisodeWriter,
    check_obs_shape,
    export_metadata,
    parse_metadata,
    store_options,
)

ID_RE = re.compile(r"^([-_\w][-_\w/]*[-_\w]+/)?[-_.\w]+-v\d+$")


def _minari():
    try:
        import minari
        from minari.dataset.minari_storage import MinariStorage
    except ImportError as exc:
        raise ImportError(f"Minari export/import needs minari and h5py ({exc}); pip install 'mmreplay[minari]'") \
            from None
    return minari, MinariStorage


def image_subspaces(space) -> list[str]:
    """Keys of the subspaces Minari treats as images (and JPEG-encodes unless told not to)."""
    from gymnasium import spaces

    if isinstance(space, spaces.Dict):
        return [f"{k}.{s}" if s else k for k, sub in space.spaces.items() for s in image_subspaces(sub)]
    if isinstance(space, spaces.Box) and len(space.shape) in (2, 3) and space.shape[0] >= 32 and \
            space.shape[1] >= 32 and space.dtype == np.uint8 and np.all(space.low == 0) and np.all(space.high == 255):
        return [""]
    return []


def default_dataset_id(out: str) -> str:
    root = _minari_root()
    rel = os.path.relpath(os.path.abspath(out), root)
    if not rel.startswith("..") and ID_RE.match(rel):
        return rel
    name = re.sub(r"[^-_.\w]", "_", os.path.basename(os.path.abspath(out)))
    return name if ID_RE.match(name) else f"{name}-v0"


def _minari_root() -> str:
    return os.environ.get("MINARI_DATASETS_PATH") or os.path.join(os.path.expanduser("~"), ".minari", "datasets")


def export_minari(store, out, *, dataset_id: str | None = None, include_partial: bool = False,
                  episodes: Sequence[int] | slice | None = None, data_format: str = "hdf5",
                  block_rows: int = 4096, progress=None, description: str | None = None) -> dict[str, Any]:
    """Write the store's episodes as a Minari dataset in directory ``out`` (which must not exist).
    ``MinariDataset(out + "/data")`` reads it; so does ``minari.load_dataset(dataset_id)`` when ``out`` is
    ``<minari root>/<dataset_id>``. Returns a summary (episodes, steps, what was skipped and why)."""
    minari, MinariStorage = _minari()
    from minari.data_collector import EpisodeBuffer

    out = os.fspath(out)
    dataset_id = dataset_id or default_dataset_id(out)
    if not ID_RE.match(dataset_id):
        raise ValueError(f"Minari dataset id {dataset_id!r} is not of the form '[namespace/]name-v<N>'")
    if os.path.exists(out):
        raise FileExistsError(f"cannot export to {out!r}: it exists (choose a new dataset directory)")
    obs_space, act_space = store.observation_space, store.action_space
    images = image_subspaces(obs_space) + image_subspaces(act_space)
    if images and "jpeg_encoding" not in inspect.signature(MinariStorage.new).parameters:
        raise ValueError(f"the installed Minari {minari.__version__} JPEG-encodes uint8 image spaces ({images}) "
                         "on disk, which is lossy and would corrupt frame stacks; install minari>=0.5.4, "
                         "which can store raw arrays")
    listing = list_episodes(store, include_partial=include_partial, select=episodes)
    dict_obs = store.schema.dict_obs
    os.makedirs(out)
    kwargs = {"jpeg_encoding": False} if "jpeg_encoding" in inspect.signature(MinariStorage.new).parameters else {}
    storage = MinariStorage.new(os.path.join(out, "data"), observation_space=obs_space, action_space=act_space,
                                data_format=data_format, **kwargs)
    meta = export_metadata(store, listing)
    storage.update_metadata({"dataset_id": dataset_id, "minari_version": minari.__version__,
                             "description": description or f"exported by mmreplay from {meta['source']}",
                             "algorithm_name": "mmreplay-export", "mmreplay": json.dumps(meta)})
    pending: list = []
    pending_rows = 0
    cur: dict[str, list] = {}
    for piece in iter_pieces(store, listing.episodes, block_rows, progress):
        if piece.start:
            cur = {"obs": [], "action": [], "reward": [], "term": [], "trunc": []}
        cur["obs"].append(piece.obs)
        cur["action"].append(piece.action)
        cur["reward"].append(piece.reward)
        cur["term"].append(piece.terminated)
        cur["trunc"].append(piece.truncated)
        if piece.end:
            frames = {k: np.concatenate([o[k] for o in cur["obs"]] + [piece.next_obs[k][-1:]]) for k in piece.obs}
            pending.append(EpisodeBuffer(
                observations=as_space_value(frames, dict_obs), actions=np.concatenate(cur["action"]),
                rewards=np.concatenate(cur["reward"]), terminations=np.concatenate(cur["term"]),
                truncations=np.concatenate(cur["trunc"])))
            pending_rows += frames[next(iter(frames))].shape[0]
            cur = {}
            if pending_rows >= block_rows:
                storage.update_episodes(pending)
                pending, pending_rows = [], 0
    storage.update_episodes(pending)
    return {"format": "minari", "path": out, "dataset_id": dataset_id, "episodes": len(listing.episodes),
            "steps": listing.steps, "notes": listing.notes}


def open_minari(src):
    """A ``MinariDataset`` from a dataset directory, its ``data`` directory, or a dataset id."""
    minari, _ = _minari()
    from minari import MinariDataset

    src = os.fspath(src)
    if os.path.isdir(src):
        data = os.path.join(src, "data") if os.path.isdir(os.path.join(src, "data")) else src
        if not os.path.exists(os.path.join(data, "metadata.json")):
            raise ValueError(f"{src!r} is not a Minari dataset (no metadata.json in {data!r})")
        return MinariDataset(data)
    if ID_RE.match(src):
        return minari.load_dataset(src)
    raise FileNotFoundError(f"Minari dataset {src!r}: no such directory, and not a dataset id of the form "
                            "'[namespace/]name-v<N>'")


def import_minari(src, path, *, progress=None, **store_kwargs) -> dict[str, Any]:
    """A new store at ``path`` holding every episode of the Minari dataset ``src`` (directory or id), in
    order. ``store_kwargs`` go to ``Store.create`` (defaults: unbounded, and the frame stack / reward values
    recorded by an mmreplay export)."""
    dataset = open_minari(src)
    storage = dataset.storage
    meta = storage.metadata
    obs_space, act_space = dataset.observation_space, dataset.action_space
    images = image_subspaces(obs_space) + image_subspaces(act_space)
    if images and meta.get("jpeg_encoding", True) and getattr(storage, "jpeg_encoding", False):
        raise ValueError(f"Minari dataset {src!r} stores its image spaces {images} JPEG-encoded (lossy): its frames "
                         "are not the recorded ones; refusing to import them as if they were")
    opts = store_options(parse_metadata(meta.get("mmreplay")), store_kwargs)
    writer = EpisodeWriter(path, obs_space, act_space, opts, progress, dataset.total_steps)
    try:
        for ep in dataset.iterate_episodes():
            n = len(ep.rewards)
            check_obs_shape(ep.observations, obs_space, f"episode {ep.id} observations", n + 1)
            obs = ep.observations
            o = {k: v[:-1] for k, v in obs.items()} if isinstance(obs, dict) else obs[:-1]
            nx = {k: v[1:] for k, v in obs.items()} if isinstance(obs, dict) else obs[1:]
            writer.write(o, np.asarray(ep.actions), np.asarray(ep.rewards), nx, np.asarray(ep.terminations, bool),
                         np.asarray(ep.truncations, bool), end=True)
    finally:
        store = writer.close()
    return {"format": "minari", "path": store.path, "episodes": writer.episodes, "steps": writer.steps}
