"""Offline-RL datasets: export a store to Minari, D4RL-style HDF5, d3rlpy or Dopamine's replay checkpoints
(the DQN Replay Dataset: ``dqn_replay.py``, ``dqn_replay_export.py``), and import them back.

Every exporter reads episodes through ``episodes.py`` (episode links, single frames, bounded blocks);
every importer writes through ``importing.py`` (a new store, episodes in order, bounded blocks);
``collect.py`` records an env straight to a Minari dataset through a store. Each
format module states what its format can and cannot hold. Optional dependencies (minari, h5py) are
imported only when a format needs them.
"""

from __future__ import annotations

import os
from typing import Any

FORMATS = ("minari", "d4rl", "d3rlpy", "dqn-replay")


def _check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"unknown dataset format {fmt!r}: expected one of {list(FORMATS)}")
    return fmt


def export_dataset(store, out, format: str, **kwargs) -> dict[str, Any]:
    """Export ``store`` (a Store, or the path of one, opened read-only) to ``out`` in ``format``.
    Keyword arguments go to ``export_minari`` / ``export_d4rl`` / ``export_d3rlpy``."""
    _check_format(format)
    if isinstance(store, (str, os.PathLike)):
        from mmreplay.store import Store

        with Store.open(store, mode="r") as opened:
            return export_dataset(opened, out, format, **kwargs)
    if format == "minari":
        from mmreplay.datasets.minari import export_minari
        return export_minari(store, out, **kwargs)
    if format == "d4rl":
        from mmreplay.datasets.d4rl import export_d4rl
        return export_d4rl(store, out, **kwargs)
    if format == "dqn-replay":
        from mmreplay.datasets.dqn_replay_export import export_dqn_replay
        return export_dqn_replay(store, out, **kwargs)
    from mmreplay.datasets.d3rlpy import export_d3rlpy
    return export_d3rlpy(store, out, **kwargs)


def collect_minari(env, out, **kwargs) -> dict[str, Any]:
    """Record ``env`` into a store and export it as a Minari dataset (``mmreplay.datasets.collect``)."""
    from mmreplay.datasets.collect import collect_minari as collect

    return collect(env, out, **kwargs)


def import_dqn_replay(src, path, **kwargs) -> dict[str, Any]:
    """A new store from a Dopamine replay directory (the DQN Replay Dataset), streamed, resumable
    (``mmreplay.datasets.dqn_replay.import_dqn_replay``: ``checkpoints="0,1,5-9"``, ``resume=True``...)."""
    from mmreplay.datasets.dqn_replay import import_dqn_replay as run
    from mmreplay.datasets.sources import naming

    with naming(src, "dqn-replay", path):
        return run(src, path, **kwargs)


def import_dataset(src, path, format: str, **kwargs) -> dict[str, Any]:
    """Make a new store at ``path`` from the dataset ``src`` in ``format``. Keyword arguments go to the
    format's importer and on to ``Store.create`` (``capacity``, ``frame_stack``, ``reward_values``...)."""
    _check_format(format)
    if format == "dqn-replay":
        return import_dqn_replay(src, path, **kwargs)
    from mmreplay.datasets.sources import naming

    with naming(src, format, path):  # an error that names no file is said to be about ``src``
        return _import(src, path, format, **kwargs)


def _import(src, path, format: str, **kwargs) -> dict[str, Any]:
    if format == "minari":
        from mmreplay.datasets.minari import import_minari
        return import_minari(src, path, **kwargs)
    if format == "d4rl":
        from mmreplay.datasets.d4rl import import_d4rl
        return import_d4rl(src, path, **kwargs)
    from mmreplay.datasets.d3rlpy import import_d3rlpy
    return import_d3rlpy(src, path, **kwargs)
