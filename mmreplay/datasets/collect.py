"""Record an env straight to a Minari dataset through a store: the mmreplay counterpart of Minari's
``DataCollector`` + ``create_dataset_from_collector_env``.

Invariant: the data takes the one path every recording takes (``RecordToStore`` -> ``Store.add``, every
frame stored once, compressed, committed) and the one path every export takes (``export_minari``), so a
collected dataset is exactly what exporting that store gives; the env's ``spec`` goes into the dataset
so ``recover_environment()`` works. Only whole episodes are collected (the run stops at an episode end).
What Minari's collector also keeps and this one does not: per-step ``infos`` and per-episode seeds.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from typing import Any


def collect_minari(env, out, *, episodes: int | None = None, steps: int | None = None,
                   policy: Callable[[Any], Any] | None = None, seed: int | None = None, store=None,
                   store_kwargs: Mapping[str, Any] | None = None, **export_kwargs) -> dict[str, Any]:
    """Run ``policy`` (default: the action space's ``sample``) in ``env`` (an env or an env id) for
    ``episodes`` episodes, or until at least ``steps`` steps have been taken and the episode running then
    has ended, recording into a store, then export the store as the Minari dataset ``out``.

    ``store``: ``None`` records into a temporary store that is deleted after the export; a path creates
    (and keeps) a store there. ``store_kwargs`` go to ``Store.create`` (``frame_stack``, ``reward_values``
    ...; ``capacity`` defaults to unbounded so no episode is cut). ``export_kwargs`` go to
    ``export_minari`` (``dataset_id``, ``author``, ``compression``...); ``env_spec`` defaults to the env's
    spec. Returns the export's summary plus ``store`` (the kept store's path, or None)."""
    import gymnasium as gym

    from mmreplay.datasets.minari import export_minari
    from mmreplay.integrations.gymnasium import RecordToStore, create_store_for

    if (episodes is None) == (steps is None):
        raise ValueError(f"pass exactly one of episodes= and steps= (got episodes={episodes!r}, steps={steps!r})")
    if (episodes if episodes is not None else steps) < 1:
        raise ValueError(f"episodes/steps must be >= 1, got episodes={episodes!r}, steps={steps!r}")
    if os.path.exists(os.fspath(out)):
        raise FileExistsError(f"cannot collect into {os.fspath(out)!r}: it exists (choose a new dataset directory)")
    made = isinstance(env, str)
    env = gym.make(env) if made else env
    tmp = tempfile.mkdtemp(prefix="mmreplay-collect-") if store is None else None
    path = os.path.join(tmp, "store") if tmp else os.fspath(store)
    try:
        with create_store_for(env, path, **{"capacity": None, **(store_kwargs or {})}) as recording:
            _run(RecordToStore(env, recording), policy, episodes, steps, seed)
            export_kwargs.setdefault("env_spec", env.spec)
            name = env.spec.id if env.spec is not None else type(env.unwrapped).__name__
            export_kwargs.setdefault("description", f"recorded by mmreplay.datasets.collect_minari from {name} "
                                     f"({'random actions' if policy is None else 'a given policy'}, seed {seed})")
            summary = export_minari(recording, out, **export_kwargs)
    finally:
        if made:
            env.close()
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    return {**summary, "store": None if tmp else path}


def _run(env, policy, episodes: int | None, steps: int | None, seed: int | None) -> None:
    """Whole episodes until the budget is reached (seeded once: the env's RNG carries on across resets)."""
    if policy is None:
        env.action_space.seed(seed)
        policy = lambda _obs: env.action_space.sample()  # noqa: E731
    done_episodes = done_steps = 0
    obs, _ = env.reset(seed=seed)
    while True:
        obs, _, terminated, truncated, _ = env.step(policy(obs))
        done_steps += 1
        if terminated or truncated:
            done_episodes += 1
            if (episodes is not None and done_episodes >= episodes) or (steps is not None and done_steps >= steps):
                return
            obs, _ = env.reset()
