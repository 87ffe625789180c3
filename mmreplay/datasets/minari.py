"""Minari datasets (HDF5, or arrow where pyarrow is installed) to and from a store.

Invariants:
- The result is what ``minari.load_dataset`` / ``MinariDataset`` read: per episode, ``observations`` with
  ``N + 1`` rows (the last is the final observation), ``actions``, ``rewards``, ``terminations``,
  ``truncations`` with ``N`` rows, and the store's spaces. ``metadata.json`` is made by Minari's own
  ``MinariStorage.new`` / ``update_metadata`` (so ``env_spec`` is Minari's ``EnvSpec.to_json()`` and
  ``recover_environment()`` works when an env is given). Arrow episodes go through Minari's own
  ``ArrowStorage.update_episodes``. HDF5 episodes are written here, in the exact layout of Minari's
  ``HDF5Storage`` (``episode_<i>`` groups with ``id`` / ``total_steps`` attributes, a group per key of a
  Dict space), because Minari's HDF5 writer takes no compression option and holds whole episodes in RAM:
  here each dataset is compressed (``hdf5.py``: gzip by default, lossless) and grows piece by piece.
- Never lossy: Minari >= 0.5.4 JPEG-encodes uint8 "image" Box spaces (2-D/3-D, >= 32x32, bounds 0..255)
  unless asked not to. Export always records ``jpeg_encoding=False`` and refuses, before writing anything,
  when the installed Minari cannot be told so; import refuses a JPEG-encoded dataset with image spaces
  (its frames are not the recorded ones).
- Memory: HDF5 export holds one block of ``block_rows`` steps (an episode's datasets are created at its
  known length and filled block by block). Arrow export buffers whole episodes until
  ``block_rows`` steps are pending (Minari's arrow writer takes whole episodes, so one episode longer than
  that is held alone).
- Atomic (``outputs.staged``): the dataset directory is built beside ``out`` and renamed onto it when
  complete, so a killed export never leaves a directory ``MinariDataset`` opens. Episodes a live writer
  overwrites during the export are left out whole and counted (``notes``, ``skipped_overwritten_episodes``
  in the ``mmreplay`` metadata); the dataset's episodes are numbered without gaps.
- Import checks every dataset of an HDF5 Minari dataset against ``bounds.py`` and each episode against
  ``bounds.MAX_EPISODE_BYTES`` before Minari reads any (its reader loads whole episodes).
- ``env_spec`` is an id, an ``EnvSpec`` or its JSON (``EnvSpec.to_json()``, with ``additional_wrappers``):
  ``recover_environment()`` gives an env whose spaces have the layout of the dataset's. Episodes hold
  single frames, so a frame-stack store's trailing ``FrameStackObservation`` of the same size and padding
  is dropped from the recorded spec (the store's ``frame_stack`` goes into the ``mmreplay`` metadata).
- Placeholders are never written: author, email, code link and algorithm name are recorded only when
  given; the description defaults to naming the source store.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
import re
from collections.abc import Sequence
from typing import Any

import numpy as np

from mmreplay.datasets import bounds, hdf5, sources
from mmreplay.datasets.episodes import as_space_value, iter_pieces, list_episodes
from mmreplay.datasets.outputs import staged
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


def image_spaces_named(observation_space, action_space) -> list[str]:
    """The spaces Minari treats as images, each named for a message: ``observation space Box(...)`` or
    ``observation key 'img' Box(...)``."""
    named = []
    for what, space in (("observation", observation_space), ("action", action_space)):
        for path in image_subspaces(space):
            sub = space
            for key in path.split(".") if path else ():
                sub = sub[key]
            named.append(f"{what} key {path!r} {sub}" if path else f"{what} space {sub}")
    return named


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


def env_spec_of(env):
    """A gymnasium ``EnvSpec`` from an env id (``"CartPole-v1"``, or ``"module:Id"`` for an env that
    importing ``module`` registers), an ``EnvSpec``, its JSON (``EnvSpec.to_json()``: an env with its
    wrappers, ``additional_wrappers``), or an env made with ``gymnasium.make`` (its ``spec``)."""
    import gymnasium as gym
    from gymnasium.envs.registration import EnvSpec

    if env is None or isinstance(env, EnvSpec):
        return env
    if isinstance(env, str) and env.lstrip().startswith("{"):
        return _env_spec_from_json(env)
    if isinstance(env, str):
        module, _, name = env.rpartition(":")
        try:
            if module:  # "module:Id", as gymnasium.make takes it: importing the module registers the env
                importlib.import_module(module)
            return gym.spec(name)
        except ImportError as exc:
            raise ValueError(f"env id {env!r}: cannot import {module!r} ({exc})") from None
        except gym.error.Error as exc:
            raise ValueError(f"env id {env!r} is not registered with gymnasium ({exc}); import the package "
                             "that registers it, or pass an EnvSpec") from None
    spec = getattr(env, "spec", None)
    if isinstance(spec, EnvSpec):
        return spec
    raise TypeError(f"env_spec must be an env id, a gymnasium EnvSpec or an env made by gymnasium.make; "
                    f"got {type(env).__name__} (with spec {spec!r})")


def _env_spec_from_json(text: str):
    from gymnasium.envs.registration import EnvSpec

    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"env spec JSON is not valid JSON ({exc}): expected the text of EnvSpec.to_json()") from None
    if not isinstance(fields, dict) or not {"id", "entry_point"} <= set(fields):
        raise ValueError("env spec JSON must be an object with at least 'id' and 'entry_point' (the text of "
                         f"EnvSpec.to_json()); got {text[:120]!r}")
    try:
        return EnvSpec.from_json(text)
    except Exception as exc:  # noqa: BLE001 - gymnasium raises several types for a malformed spec
        raise ValueError(f"env spec JSON for {fields['id']!r} is not a gymnasium EnvSpec ({type(exc).__name__}: "
                         f"{exc})") from None


def drop_frame_stack_wrapper(spec, frame_stack: int, stack_padding: str) -> tuple[Any, str | None]:
    """The spec without a trailing ``FrameStackObservation`` that the store's frame stack stands for
    (episodes hold single frames), and a note saying so; a stack wrapper that disagrees with the store's
    ``frame_stack`` / padding is refused."""
    import dataclasses

    wrappers = tuple(spec.additional_wrappers or ())
    if frame_stack <= 1 or not wrappers or wrappers[-1].name != "FrameStackObservation":
        return spec, None
    kwargs = dict(wrappers[-1].kwargs or {})
    size, padding = kwargs.get("stack_size"), kwargs.get("padding_type", "reset")
    want = {"first": "reset", "zeros": "zero"}.get(stack_padding)
    if size != frame_stack or padding != want:
        raise ValueError(f"env spec {spec.id!r} ends with FrameStackObservation(stack_size={size!r}, "
                         f"padding_type={padding!r}), the store stacks frame_stack={frame_stack} with "
                         f"stack_padding={stack_padding!r} (FrameStackObservation(stack_size={frame_stack}, "
                         f"padding_type={want!r})): the recovered env would not match the data")
    note = (f"env spec {spec.id!r}: its FrameStackObservation(stack_size={size}) is left out of the recorded "
            "env_spec, as the dataset holds single frames (the mmreplay metadata records frame_stack="
            f"{frame_stack}; wrap the recovered env in FrameStackObservation(env, {size}) to act in it)")
    return dataclasses.replace(spec, additional_wrappers=wrappers[:-1]), note


def check_env_spaces(spec, observation_space, action_space) -> str | None:
    """Make the env once and compare its spaces with the store's: a dataset whose recovered environment
    does not match its data is refused. Returns a note when the env cannot be made here (not checked)."""
    import gymnasium as gym

    try:
        env = gym.make(spec)
    except Exception as exc:  # noqa: BLE001 - any failure to build a foreign env only skips the check
        return f"env {spec.id!r} could not be made here ({type(exc).__name__}: {exc}): its spaces were not checked"
    try:
        for what, env_space, store_space in (("observation", env.observation_space, observation_space),
                                             ("action", env.action_space, action_space)):
            if not _same_layout(env_space, store_space):
                wrappers = [w.name for w in spec.additional_wrappers or ()]
                raise ValueError(f"env {spec.id!r} has {what} space {env_space} (wrappers: {wrappers}), the "
                                 f"store has {store_space}: recover_environment() would give an env that does not "
                                 "match the data. If wrappers made the stored data (e.g. AtariPreprocessing), give the "
                                 "wrapped env's spec: env.spec.to_json() (with its additional_wrappers), or the env")
    finally:
        env.close()
    return None


def _same_layout(a, b) -> bool:
    """Same kind, shape and dtype (bounds may differ: a store made with unbounded Boxes is fine)."""
    from gymnasium import spaces

    if isinstance(a, spaces.Dict) or isinstance(b, spaces.Dict):
        return isinstance(a, spaces.Dict) and isinstance(b, spaces.Dict) and set(a.spaces) == set(b.spaces) and \
            all(_same_layout(a[k], b[k]) for k in a.spaces)
    if isinstance(a, spaces.Discrete) or isinstance(b, spaces.Discrete):
        return isinstance(a, spaces.Discrete) and isinstance(b, spaces.Discrete) and a.n == b.n
    return type(a) is type(b) and a.shape == b.shape and np.dtype(a.dtype) == np.dtype(b.dtype)


def provenance(*, description, author, author_email, code_permalink, algorithm_name, requirements) -> dict:
    """Minari's provenance metadata, only what was given (Minari stores authors and emails as sets)."""
    def as_set(value, name):
        if value is None:
            return None
        values = {value} if isinstance(value, str) else set(value)
        if not all(isinstance(v, str) and v for v in values):
            raise ValueError(f"{name} must be a non-empty string or strings, got {value!r}")
        return values

    meta = {"author": as_set(author, "author"), "author_email": as_set(author_email, "author_email"),
            "code_permalink": code_permalink, "algorithm_name": algorithm_name, "description": description,
            "requirements": list(requirements) if requirements is not None else None}
    for key in ("code_permalink", "algorithm_name", "description"):
        if meta[key] is not None and not isinstance(meta[key], str):
            raise ValueError(f"{key} must be a string, got {meta[key]!r}")
    return {k: v for k, v in meta.items() if v is not None}


def export_minari(store, out, *, dataset_id: str | None = None, include_partial: bool = False,
                  episodes: Sequence[int] | slice | None = None, data_format: str = "hdf5",
                  compression: str | None = None, env_spec=None, author=None, author_email=None,
                  code_permalink: str | None = None, algorithm_name: str | None = None,
                  description: str | None = None, requirements: Sequence[str] | None = None,
                  block_rows: int = 4096, progress=None) -> dict[str, Any]:
    """Write the store's episodes as a Minari dataset in directory ``out`` (which must not exist).
    ``MinariDataset(out + "/data")`` reads it; so does ``minari.load_dataset(dataset_id)`` when ``out`` is
    ``<minari root>/<dataset_id>``.

    ``env_spec``: the env that made the data (an id such as ``"CartPole-v1"``, an ``EnvSpec`` or an env),
    stored so that ``dataset.recover_environment()`` works; its spaces must match the store's.
    ``author`` / ``author_email`` (a string or several), ``code_permalink``, ``algorithm_name``,
    ``description``, ``requirements`` (pip requirement strings): Minari's provenance metadata.
    ``data_format``: ``"hdf5"`` or ``"arrow"`` (needs pyarrow). ``compression`` (HDF5): ``"gzip"``
    (default), ``"lzf"`` or ``"none"``; Minari's arrow writer has no compression option.
    Returns a summary (episodes, steps, bytes on disk, what was skipped and why)."""
    minari, MinariStorage = _minari()

    out = os.fspath(out)
    dataset_id = dataset_id or default_dataset_id(out)
    if not ID_RE.match(dataset_id):
        raise ValueError(f"Minari dataset id {dataset_id!r} is not of the form '[namespace/]name-v<N>'")
    if data_format not in ("hdf5", "arrow"):
        raise ValueError(f"Minari data_format {data_format!r}: expected 'hdf5' or 'arrow'")
    if data_format == "arrow":
        if compression not in (None, "none"):
            raise ValueError(f"compression {compression!r}: Minari's arrow writer has no compression option; "
                             "use data_format='hdf5' to compress, or compression='none'")
        _require_pyarrow()
    compression = "none" if data_format == "arrow" else hdf5.check_compression(compression)
    if os.path.exists(out):
        raise FileExistsError(f"cannot export to {out!r}: it exists (choose a new dataset directory)")
    obs_space, act_space = store.observation_space, store.action_space
    images = image_spaces_named(obs_space, act_space)
    if images and "jpeg_encoding" not in inspect.signature(MinariStorage.new).parameters:
        raise ValueError(f"the installed Minari {minari.__version__} JPEG-encodes uint8 image spaces "
                         f"({'; '.join(images)}) "
                         "on disk, which is lossy and would corrupt frame stacks; install minari>=0.5.4, "
                         "which can store raw arrays")
    spec = env_spec_of(env_spec)
    listing = list_episodes(store, include_partial=include_partial, select=episodes)
    meta = export_metadata(store, listing)
    given = provenance(description=description or f"exported by mmreplay from {meta['source']}", author=author,
                       author_email=author_email, code_permalink=code_permalink, algorithm_name=algorithm_name,
                       requirements=requirements)
    notes = list(listing.notes)
    if spec is not None:
        spec, note = drop_frame_stack_wrapper(spec, store.frame_stack, store.schema.stack_padding)
        notes += [note] if note else []
        note = check_env_spaces(spec, obs_space, act_space)
        notes += [note] if note else []
    else:
        notes.append("no env spec given (env_spec= / --env-id): the dataset's recover_environment() will fail; "
                     "give the env id, or for a wrapped env its EnvSpec JSON (env.spec.to_json())")
    raw = {"jpeg_encoding": False} if "jpeg_encoding" in inspect.signature(MinariStorage.new).parameters else {}
    with staged(out, "exporting") as staging:
        os.makedirs(staging.path)
        # absolute: Minari's get_size joins a relative data path onto itself (OUT/data/OUT/data/...)
        storage = MinariStorage.new(os.path.join(staging.path, "data"), observation_space=obs_space,
                                    action_space=act_space, env_spec=spec, data_format=data_format, **raw)
        pieces = iter_pieces(store, listing.episodes, block_rows, progress, lost=listing.lost)
        if data_format == "hdf5":
            steps, episodes_written = _write_hdf5_episodes(storage, pieces, listing, store.schema.dict_obs,
                                                           compression)
        else:
            steps, episodes_written = _write_arrow_episodes(storage, pieces, store.schema.dict_obs, block_rows)
        listing.note_lost()
        meta = export_metadata(store, listing)  # at the end: it counts what a live writer overwrote meanwhile
        storage.update_metadata({"dataset_id": dataset_id, "minari_version": minari.__version__, **given,
                                 "mmreplay": json.dumps({**meta, "compression": compression})})
        storage.update_metadata({"total_episodes": episodes_written, "total_steps": steps,
                                 "dataset_size": storage.get_size()})
    return {"format": "minari", "path": out, "dataset_id": dataset_id, "data_format": data_format,
            "compression": compression, "episodes": episodes_written, "steps": steps,
            "bytes": _dir_bytes(out), "env_spec": None if spec is None else spec.id,
            "notes": staging.notes + notes + [n for n in listing.notes if n not in notes]}


def _require_pyarrow() -> None:
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise ImportError("Minari's arrow data format needs pyarrow; pip install 'mmreplay[minari]' or "
                          "pyarrow, or export with data_format='hdf5'") from None


def _dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(path) for f in fs)


def _write_hdf5_episodes(storage, pieces, listing, dict_obs: bool, compression: str) -> int:
    """Episodes in Minari's ``HDF5Storage`` layout (see the module invariants), streamed piece by piece
    into datasets created at the episode's known size."""
    h5py = hdf5.h5py_module()
    steps = 0
    i = 0  # the dataset's episode number: episodes a writer overwrote during the export leave no gap
    path = os.path.join(os.fspath(storage.data_path), "main_data.hdf5")
    with h5py.File(path, "a", track_order=True, libver=hdf5.LIBVER) as f:
        cols: dict[str, Any] = {}
        at = 0
        for piece in pieces:
            if piece.lost:  # overwritten part way: what was written of it goes
                steps -= at
                del f[f"episode_{i}"]
                continue
            if piece.start:
                n = len(listing.episodes[piece.episode])
                group = f.create_group(f"episode_{i}")
                group.attrs["id"] = i
                group.attrs["total_steps"] = n
                obs_group = group.create_group("observations") if dict_obs else group
                cols = {f"obs/{k}": hdf5.fixed(obs_group, k if dict_obs else "observations", n + 1, v.shape[1:],
                                               v.dtype, compression) for k, v in piece.obs.items()}
                for name, v in (("actions", piece.action), ("rewards", piece.reward),
                                ("terminations", piece.terminated), ("truncations", piece.truncated)):
                    cols[name] = hdf5.fixed(group, name, n, v.shape[1:], v.dtype, compression)
                at = 0
            m = len(piece)
            for k, v in piece.obs.items():
                cols[f"obs/{k}"][at:at + m] = v
            for name, v in (("actions", piece.action), ("rewards", piece.reward),
                            ("terminations", piece.terminated), ("truncations", piece.truncated)):
                cols[name][at:at + m] = v
            at += m
            steps += m
            if piece.end:
                for k, v in piece.next_obs.items():
                    cols[f"obs/{k}"][at] = v[-1]  # the final observation: row N
                i += 1
    return steps, i


def _write_arrow_episodes(storage, pieces, dict_obs: bool, block_rows: int) -> int:
    """Whole episodes through Minari's own arrow writer, ``block_rows`` steps at a time."""
    from minari.data_collector import EpisodeBuffer

    pending: list = []
    pending_rows = steps = episodes = 0
    cur: dict[str, list] = {}
    for piece in pieces:
        if piece.lost:  # overwritten part way: its buffered steps go
            steps -= sum(len(a) for a in cur.get("action", []))
            cur = {}
            continue
        if piece.start:
            cur = {"obs": [], "action": [], "reward": [], "term": [], "trunc": []}
        cur["obs"].append(piece.obs)
        cur["action"].append(piece.action)
        cur["reward"].append(piece.reward)
        cur["term"].append(piece.terminated)
        cur["trunc"].append(piece.truncated)
        steps += len(piece)
        if piece.end:
            frames = {k: np.concatenate([o[k] for o in cur["obs"]] + [piece.next_obs[k][-1:]]) for k in piece.obs}
            pending.append(EpisodeBuffer(
                observations=as_space_value(frames, dict_obs), actions=np.concatenate(cur["action"]),
                rewards=np.concatenate(cur["reward"]), terminations=np.concatenate(cur["term"]),
                truncations=np.concatenate(cur["trunc"])))
            pending_rows += frames[next(iter(frames))].shape[0]
            episodes += 1
            cur = {}
            if pending_rows >= block_rows:
                storage.update_episodes(pending)
                pending, pending_rows = [], 0
    if pending:
        storage.update_episodes(pending)
    return steps, episodes


def open_minari(src):
    """A ``MinariDataset`` from a dataset directory, its ``data`` directory, or a dataset id."""
    minari, _ = _minari()
    from minari import MinariDataset

    src = os.fspath(src)
    if os.path.isdir(src):
        # Minari opens and loads whatever the directory holds: a FIFO would block it, /dev/zero fill memory
        sources.check_tree(src, "Minari dataset", small_files=("metadata.json",))
        data = os.path.join(src, "data") if os.path.isdir(os.path.join(src, "data")) else src
        if not os.path.exists(os.path.join(data, "metadata.json")):
            raise ValueError(f"{src!r} is not a Minari dataset (no metadata.json in {data!r})")
        return MinariDataset(data)
    if ID_RE.match(src):
        local = os.path.join(_minari_root(), src)
        if os.path.isdir(local):
            sources.check_tree(local, "Minari dataset", small_files=("metadata.json",))
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
    images = image_spaces_named(obs_space, act_space)
    if images and meta.get("jpeg_encoding", True) and getattr(storage, "jpeg_encoding", False):
        raise ValueError(f"Minari dataset {src!r} was written with jpeg_encoding=True (the default of Minari's "
                         f"DataCollector and create_dataset_from_buffers), so its {'; '.join(images)} are stored "
                         "JPEG-encoded (lossy): they are not the frames the env gave. Refusing to import "
                         "them as recorded data; collect again with DataCollector(env, jpeg_encoding=False) "
                         "(Minari >= 0.5.4) for a lossless dataset")
    _check_hdf5_episodes(storage, src)
    opts = store_options(parse_metadata(meta.get("mmreplay")), store_kwargs)
    with EpisodeWriter(path, obs_space, act_space, opts, progress, dataset.total_steps) as writer:
        for ep in dataset.iterate_episodes():
            n = len(ep.rewards)
            check_obs_shape(ep.observations, obs_space, f"episode {ep.id} observations", n + 1)
            obs = ep.observations
            o = {k: v[:-1] for k, v in obs.items()} if isinstance(obs, dict) else obs[:-1]
            nx = {k: v[1:] for k, v in obs.items()} if isinstance(obs, dict) else obs[1:]
            writer.write(o, np.asarray(ep.actions), np.asarray(ep.rewards), nx, np.asarray(ep.terminations, bool),
                         np.asarray(ep.truncations, bool), end=True)
    return {"format": "minari", **writer.summary()}


def _check_hdf5_episodes(storage, src) -> None:
    """Every dataset of an HDF5 Minari dataset checked against ``bounds.py`` before Minari reads any, and
    each episode's bytes against ``bounds.MAX_EPISODE_BYTES`` (Minari's reader loads whole episodes).
    Arrow datasets are read by pyarrow, which checks its own buffers."""
    path = os.path.join(os.fspath(storage.data_path), "main_data.hdf5")
    if not os.path.isfile(path):
        return
    h5py = hdf5.h5py_module()
    with h5py.File(path, "r") as f:
        for name, episode in f.items():
            total = 0

            def check(_key, obj, name=name):
                nonlocal total
                if isinstance(obj, h5py.Dataset):
                    bounds.check_hdf5_dataset(obj, f"Minari dataset {os.fspath(src)!r}: episode {name!r}")
                    total += int(np.prod(obj.shape, dtype=object)) * obj.dtype.itemsize if obj.shape else 0
            if isinstance(episode, h5py.Dataset):
                check(name, episode)
            else:
                episode.visititems(check)
            if total > bounds.MAX_EPISODE_BYTES:
                raise ValueError(f"Minari dataset {os.fspath(src)!r}: episode {name!r} holds {total:,} bytes, more "
                                 f"than the {bounds.MAX_EPISODE_BYTES:,} an import accepts (Minari's reader loads "
                                 "an episode whole)")
