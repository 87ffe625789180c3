"""Real preprocessed Atari frames for mmreplay benchmarks.

``generate_atari_transitions(n, ...)`` returns ``n`` transitions of real
84x84 grayscale Atari observations from seeded uniform-random play
(``ALE/<Game>-v5`` with ``frameskip=1`` + ``gymnasium.wrappers.AtariPreprocessing``,
frame_skip=4, noop_max=30, no life-loss terminals; v5's default sticky actions).

Cost and the pool cache
-----------------------
Emulating is the slow part (on the 2-core dev box a 100k pool of Pong +
Breakout + Seaquest takes ~45 s with 2 worker processes, ~2.2k agent steps/s in
all; Pong alone runs ~2.4k steps/s on one core; so 1M real steps would take
~7-8 min), so the
frames come from a *pool* of ``pool_size`` (default 100k) real transitions that
is generated once and cached on disk as one raw ``.npy`` per array (loaded with
``mmap_mode="r"``) in ``cache_dir`` (default ``/tmp/mmreplay_atari_pool``; a
``meta.json`` records games/seed/pool_size/max_episode_steps, and a mismatch
regenerates the pool).  Generation runs one process per game (at most
``os.cpu_count()`` at a time).

* ``n <= pool_size``: the first ``n`` transitions of the pool.
* ``n > pool_size``: **larger sets reuse real episodes**: the pool's episodes
  are tiled (repeated in the same order) until ``n`` transitions are reached.
  Each frame is real, but the set contains only ``pool_size`` distinct
  transitions, so benchmarks of compressing stores see the repetition only
  across episode boundaries far apart (>= ``pool_size`` transitions).

Pool layout: games are played in separate processes; each game's share
(``pool_size // len(games)``, the remainder to the first) is played as whole
episodes, and the last one is cut at the share and marked ``truncated``, so
every pool episode ends with ``terminated`` or ``truncated``.  Episodes of the
different games are then interleaved round-robin, so any prefix contains all
games.  The slice returned for ``n`` may end inside an episode (its last
transition is then neither terminated nor truncated, like a live episode).

Memory: the result is materialised: ``obs`` and ``next_obs`` are each
``n * 7056`` bytes (1M transitions -> ~7 GB each, ~14 GB together).  To stay
small, use ``iter_atari_transitions(n, chunk)`` (same data in chunks) or
``load_atari_pool()`` (frames stored once plus index arrays).
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
import multiprocessing as mp

import numpy as np

DEFAULT_CACHE_DIR = "/tmp/mmreplay_atari_pool"
DEFAULT_POOL_SIZE = 100_000
_POOL_ARRAYS = ("frames", "obs_index", "next_obs_index", "action", "reward",
                "terminated", "truncated", "env_id", "episode_start")
_VERSION = 1


def _make_env(game, max_episode_steps):
    import gymnasium as gym
    import ale_py
    from gymnasium.wrappers import AtariPreprocessing, TimeLimit
    gym.register_envs(ale_py)
    env = gym.make(f"ALE/{game}-v5", frameskip=1)
    env = AtariPreprocessing(env, noop_max=30, frame_skip=4, screen_size=84,
                             terminal_on_life_loss=False, grayscale_obs=True,
                             scale_obs=False)
    if max_episode_steps is not None:
        # outside the preprocessing: counts agent steps, not emulator frames
        env = TimeLimit(env, max_episode_steps=max_episode_steps)
    return env


def _play_game(game, env_id, n_steps, seed, max_episode_steps, out_dir):
    """Worker: play ``n_steps`` transitions of ``game``; write raw .npy files
    to ``out_dir``; return episode lengths."""
    env = _make_env(game, max_episode_steps)
    env.action_space.seed(seed)
    frames = np.empty((n_steps + n_steps // 2 + 1, 84, 84), np.uint8)  # grown below
    act = np.empty(n_steps, np.int64)
    rew = np.empty(n_steps, np.float32)
    term = np.zeros(n_steps, bool)
    trunc = np.zeros(n_steps, bool)
    oi = np.empty(n_steps, np.int64)
    noi = np.empty(n_steps, np.int64)
    ep_lens = []
    f = 0  # next free frame slot
    t = 0
    ep = 0
    while t < n_steps:
        obs, _ = env.reset(seed=seed + ep)
        if f >= len(frames):
            frames = np.concatenate([frames, np.empty_like(frames[: len(frames) // 2 + 1])])
        frames[f] = obs
        cur = f
        f += 1
        start = t
        while True:
            a = int(env.action_space.sample())
            obs, r, te, tr, _ = env.step(a)
            if f >= len(frames):
                frames = np.concatenate([frames, np.empty_like(frames[: len(frames) // 2 + 1])])
            frames[f] = obs
            oi[t], noi[t], act[t], rew[t] = cur, f, a, r
            term[t] = te
            trunc[t] = tr and not te
            cur = f
            f += 1
            t += 1
            if te or tr:
                break
            if t == n_steps:          # cut the last episode at the share
                trunc[t - 1] = True
                break
        ep_lens.append(t - start)
        ep += 1
    env.close()
    np.save(os.path.join(out_dir, f"g{env_id}_frames.npy"), frames[:f])
    for name, arr in (("obs_index", oi), ("next_obs_index", noi), ("action", act),
                      ("reward", rew), ("terminated", term), ("truncated", trunc)):
        np.save(os.path.join(out_dir, f"g{env_id}_{name}.npy"), arr)
    return ep_lens


def _meta(games, seed, pool_size, max_episode_steps):
    return {"version": _VERSION, "games": list(games), "seed": int(seed),
            "pool_size": int(pool_size), "max_episode_steps": max_episode_steps}


def build_atari_pool(cache_dir=DEFAULT_CACHE_DIR, games=("Pong", "Breakout", "Seaquest"),
                     seed=0, pool_size=DEFAULT_POOL_SIZE, max_episode_steps=None,
                     workers=None, verbose=True):
    """Generate the pool into ``cache_dir`` (replacing it).  Returns seconds taken."""
    games = tuple(games)
    shares = [pool_size // len(games)] * len(games)
    shares[0] += pool_size - sum(shares)
    parent = os.path.dirname(os.path.abspath(cache_dir)) or "."
    os.makedirs(parent, exist_ok=True)
    tmp = tempfile.mkdtemp(prefix=".atari_pool_", dir=parent)
    t0 = time.perf_counter()
    try:
        workers = workers or min(len(games), os.cpu_count() or 1)
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            futs = [ex.submit(_play_game, g, i, shares[i], seed + 100_003 * i,
                              max_episode_steps, tmp) for i, g in enumerate(games)]
            ep_lens = [fu.result() for fu in futs]
        # interleave episodes round-robin across games
        per = []
        for i in range(len(games)):
            d = {k: np.load(os.path.join(tmp, f"g{i}_{k}.npy"), mmap_mode="r")
                 for k in ("frames", "obs_index", "next_obs_index", "action",
                           "reward", "terminated", "truncated")}
            bounds = np.concatenate([[0], np.cumsum(ep_lens[i])])
            per.append((d, bounds))
        order = []
        for k in range(max(len(l) for l in ep_lens)):
            for i in range(len(games)):
                if k < len(ep_lens[i]):
                    order.append((i, k))
        n_frames = sum(len(d["frames"]) for d, _ in per)
        out = {
            "frames": np.lib.format.open_memmap(os.path.join(tmp, "frames.npy"), "w+",
                                                np.uint8, (n_frames, 84, 84)),
        }
        cols = {k: [] for k in ("obs_index", "next_obs_index", "action", "reward",
                                "terminated", "truncated", "env_id", "episode_start")}
        f = 0
        t = 0
        for i, k in order:
            d, b = per[i]
            s, e = b[k], b[k + 1]
            # frames of this episode are contiguous in the worker's array
            fs = int(d["obs_index"][s])
            fe = int(d["next_obs_index"][e - 1]) + 1
            out["frames"][f:f + fe - fs] = d["frames"][fs:fe]
            cols["obs_index"].append(d["obs_index"][s:e] - fs + f)
            cols["next_obs_index"].append(d["next_obs_index"][s:e] - fs + f)
            for c in ("action", "reward", "terminated", "truncated"):
                cols[c].append(np.asarray(d[c][s:e]))
            cols["env_id"].append(np.full(e - s, i, np.int8))
            cols["episode_start"].append(np.array([t], np.int64))
            f += fe - fs
            t += e - s
        out["frames"].flush()
        del out
        for c, parts in cols.items():
            np.save(os.path.join(tmp, c + ".npy"), np.concatenate(parts))
        for i in range(len(games)):
            for name in ("frames", "obs_index", "next_obs_index", "action",
                         "reward", "terminated", "truncated"):
                os.remove(os.path.join(tmp, f"g{i}_{name}.npy"))
        dt = time.perf_counter() - t0
        meta = _meta(games, seed, pool_size, max_episode_steps)
        meta.update(seconds=dt, episodes=len(order), frames=f)
        with open(os.path.join(tmp, "meta.json"), "w") as fh:
            json.dump(meta, fh, indent=1)
        if os.path.isdir(cache_dir):
            shutil.rmtree(cache_dir)
        os.replace(tmp, cache_dir)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if verbose:
        print(f"[atari_frames] built pool of {pool_size} transitions "
              f"({len(order)} episodes, {', '.join(games)}) in {dt:.1f}s "
              f"with {workers} worker(s) -> {cache_dir}")
    return dt


def load_atari_pool(cache_dir=DEFAULT_CACHE_DIR, games=("Pong", "Breakout", "Seaquest"),
                    seed=0, pool_size=DEFAULT_POOL_SIZE, max_episode_steps=None,
                    verbose=True):
    """Return the pool as a dict of read-only memmapped arrays (building it
    first if absent or built with other parameters): ``frames`` (F,84,84)
    uint8, per-transition ``obs_index``/``next_obs_index`` (into frames),
    ``action`` int64, ``reward`` float32 (raw), ``terminated``/``truncated``
    bool, ``env_id`` int8 (index into ``games``), and ``episode_start`` int64
    (first transition of each episode)."""
    want = _meta(games, seed, pool_size, max_episode_steps)
    mp_ = os.path.join(cache_dir, "meta.json")
    ok = False
    if os.path.isfile(mp_):
        with open(mp_) as fh:
            have = json.load(fh)
        ok = all(have.get(k) == v for k, v in want.items()) and all(
            os.path.isfile(os.path.join(cache_dir, a + ".npy")) for a in _POOL_ARRAYS)
    if not ok:
        build_atari_pool(cache_dir, games, seed, pool_size, max_episode_steps,
                         verbose=verbose)
    return {a: np.load(os.path.join(cache_dir, a + ".npy"), mmap_mode="r")
            for a in _POOL_ARRAYS}


def _transition_ids(pool, n):
    """Pool transition index for each of the ``n`` output transitions: the
    pool's episodes in order, tiled as often as needed, cut at ``n``."""
    m = len(pool["action"])
    if n <= m:
        return np.arange(n, dtype=np.int64)
    # the pool ends on an episode end, so tiling whole pools == tiling episodes
    return np.arange(n, dtype=np.int64) % m


def _gather(pool, ids, clip_reward=True):
    r = np.asarray(pool["reward"][ids], np.float32)
    return {
        "obs": pool["frames"][np.asarray(pool["obs_index"][ids])],
        "next_obs": pool["frames"][np.asarray(pool["next_obs_index"][ids])],
        "action": np.asarray(pool["action"][ids], np.int64),
        "reward": np.sign(r).astype(np.float32) if clip_reward else r,
        "terminated": np.asarray(pool["terminated"][ids], bool),
        "truncated": np.asarray(pool["truncated"][ids], bool),
        "env_id": np.asarray(pool["env_id"][ids], np.int8),
    }


def generate_atari_transitions(n, games=("Pong", "Breakout", "Seaquest"), seed=0,
                               max_episode_steps=None, *, cache_dir=DEFAULT_CACHE_DIR,
                               pool_size=DEFAULT_POOL_SIZE, clip_reward=True,
                               verbose=True):
    """Return ``n`` real Atari transitions as a dict of numpy arrays:

    ``obs``, ``next_obs`` (n,84,84) uint8; ``action`` int64; ``reward``
    float32 clipped to its sign (-1, 0, 1) unless ``clip_reward=False``;
    ``terminated``, ``truncated`` bool; ``env_id`` int8 (index into ``games``).

    Transitions are consecutive within episodes (``next_obs[t]`` equals
    ``obs[t+1]`` unless ``t`` ends an episode).  For ``n > pool_size`` real
    episodes are reused (tiled); see the module docstring.
    """
    pool = load_atari_pool(cache_dir, games, seed, pool_size, max_episode_steps,
                           verbose=verbose)
    return _gather(pool, _transition_ids(pool, int(n)), clip_reward)


def iter_atari_transitions(n, chunk=10_000, games=("Pong", "Breakout", "Seaquest"),
                           seed=0, max_episode_steps=None, *,
                           cache_dir=DEFAULT_CACHE_DIR, pool_size=DEFAULT_POOL_SIZE,
                           clip_reward=True, verbose=True):
    """Yield the same ``n`` transitions as ``generate_atari_transitions`` in
    dicts of at most ``chunk`` transitions (bounded memory for large ``n``)."""
    pool = load_atari_pool(cache_dir, games, seed, pool_size, max_episode_steps,
                           verbose=verbose)
    ids = _transition_ids(pool, int(n))
    for s in range(0, len(ids), chunk):
        yield _gather(pool, ids[s:s + chunk], clip_reward)


if __name__ == "__main__":
    import argparse
    p = argparse.ArgumentParser(description="Build/inspect the Atari frame pool.")
    p.add_argument("--cache-dir", default=DEFAULT_CACHE_DIR)
    p.add_argument("--pool-size", type=int, default=DEFAULT_POOL_SIZE)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rebuild", action="store_true")
    a = p.parse_args()
    if a.rebuild:
        build_atari_pool(a.cache_dir, seed=a.seed, pool_size=a.pool_size)
    pool = load_atari_pool(a.cache_dir, seed=a.seed, pool_size=a.pool_size)
    with open(os.path.join(a.cache_dir, "meta.json")) as fh:
        print(json.load(fh))
    print({k: (v.shape, str(v.dtype)) for k, v in pool.items()})
    print("terminated", int(pool["terminated"].sum()),
          "truncated", int(pool["truncated"].sum()),
          "rewards", np.unique(pool["reward"], return_counts=True))
