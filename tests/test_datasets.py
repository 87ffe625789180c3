"""Offline-RL datasets: store -> Minari / D4RL / d3rlpy -> store, proven with each format's own loader.

Episodes are generated here (the ground truth), fed to a store as interleaved vector-env streams, and
every check compares against them, never against the exporter's own reading of the store.
"""

from __future__ import annotations

import json
import os
import tracemalloc
import warnings

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.cli import main
from mmreplay.datasets import export_dataset, import_dataset
from mmreplay.datasets.episodes import iter_pieces, list_episodes

h5py = pytest.importorskip("h5py")

KINDS = {
    "lowdim": {"obs_space": spaces.Box(-np.inf, np.inf, (4,), np.float32),
                   "action_space": spaces.Box(-1, 1, (2,), np.float32), "frame_stack": 1, "reward_values": None},
    "image": {"obs_space": spaces.Box(0, 255, (84, 84), np.uint8), "action_space": spaces.Discrete(6),
                  "frame_stack": 4, "reward_values": (-1, 0, 1)},
    "dict": {"obs_space": spaces.Dict({"img": spaces.Box(0, 255, (8, 8), np.uint8),
                                        "vec": spaces.Box(-5, 5, (3,), np.float32)}),
                 "action_space": spaces.Discrete(3), "frame_stack": 2, "reward_values": None},
}


def sample_obs(space, rng, n):
    if isinstance(space, spaces.Dict):
        return {k: sample_obs(s, rng, n) for k, s in space.spaces.items()}
    if space.dtype == np.uint8:
        return rng.integers(0, 256, (n, *space.shape), dtype=np.uint8)
    return rng.standard_normal((n, *space.shape)).astype(space.dtype)


def sample_actions(space, rng, n):
    if isinstance(space, spaces.Discrete):
        return rng.integers(0, space.n, n).astype(np.int64)
    return rng.uniform(-1, 1, (n, *space.shape)).astype(space.dtype)


def take(obs, rows):
    return {k: v[rows] for k, v in obs.items()} if isinstance(obs, dict) else obs[rows]


def make_episodes(kind, rng, n_eps, max_len=25):
    cfg = KINDS[kind]
    eps = []
    for _ in range(n_eps):
        n = int(rng.integers(1, max_len))
        term = np.zeros(n, bool)
        trunc = np.zeros(n, bool)
        (term if rng.random() < 0.5 else trunc)[-1] = True
        rewards = rng.integers(-1, 2, n).astype(np.float32) if cfg["reward_values"] else \
            rng.standard_normal(n).astype(np.float32)
        eps.append({"obs": sample_obs(cfg["obs_space"], rng, n + 1), "actions": sample_actions(cfg["action_space"], rng, n),
                        "rewards": rewards, "term": term, "trunc": trunc})
    return eps


def build_store(path, kind, eps, n_streams=3, capacity=None, rng=None, **kw):
    """Feed ``eps`` to a new store as ``n_streams`` interleaved streams (random subsets per extend).
    Returns the episodes in the order they started (the order exports list them) and the open store."""
    cfg = KINDS[kind]
    rng = rng or np.random.default_rng(0)
    store = mmreplay.Store.create(path, cfg["obs_space"], cfg["action_space"], capacity=capacity,
                                  frame_stack=cfg["frame_stack"], reward_values=cfg["reward_values"], durable=False,
                                  **kw)
    queue = list(eps)
    cursor = {}  # stream -> [episode, step]
    started = []
    while queue or cursor:
        for s in range(n_streams):
            if s not in cursor and queue:
                cursor[s] = [queue.pop(0), 0]
        active = sorted(cursor)
        pick = [s for s in active if rng.random() < 0.7] or active[:1]
        rows = [(s, *cursor[s]) for s in pick]
        obs = [take(e["obs"], t) for _, e, t in rows]
        nxt = [take(e["obs"], t + 1) for _, e, t in rows]
        stack = (lambda xs: {k: np.stack([x[k] for x in xs]) for k in xs[0]}) if kind == "dict" else np.stack
        store.extend(stack(obs), np.stack([e["actions"][t] for _, e, t in rows]),
                     np.array([e["rewards"][t] for _, e, t in rows]), stack(nxt),
                     np.array([e["term"][t] for _, e, t in rows]), np.array([e["trunc"][t] for _, e, t in rows]),
                     streams=pick)
        for s, e, t in rows:
            if t == 0:
                started.append(e)  # exports list episodes by their first step
            cursor[s][1] += 1
            if cursor[s][1] == len(e["rewards"]):
                del cursor[s]
    return started, store


def assert_obs_equal(a, b, msg=""):
    if isinstance(b, dict):
        assert sorted(a) == sorted(b), msg
        for k in b:
            np.testing.assert_array_equal(np.asarray(a[k]), b[k], err_msg=f"{msg}[{k}]")
            assert np.asarray(a[k]).dtype == b[k].dtype, f"{msg}[{k}] dtype"
    else:
        np.testing.assert_array_equal(np.asarray(a), b, err_msg=msg)
        assert np.asarray(a).dtype == b.dtype, f"{msg} dtype {np.asarray(a).dtype} != {b.dtype}"


def store_episodes(store):
    """Episodes of a store as ground-truth-shaped dicts, read with Store.get (frames = newest of a stack)."""
    out = []
    k = store.frame_stack
    for span in list_episodes(store).episodes:
        b = store.inspect.get(span.ids)

        def last(x):
            if isinstance(x, dict):
                return {n: last(v) for n, v in x.items()}
            return (x[:, -1] if k > 1 else x).numpy()
        obs, nxt = last(b.obs), last(b.next_obs)
        frames = {n: np.concatenate([obs[n], nxt[n][-1:]]) for n in obs} if isinstance(obs, dict) else \
            np.concatenate([obs, nxt[-1:]])
        out.append({"obs": frames, "actions": b.action.numpy(), "rewards": b.reward.numpy(),
                        "term": b.terminated.numpy(), "trunc": b.truncated.numpy(), "ids": span.ids})
    return out


def assert_episodes_equal(got, expected):
    assert len(got) == len(expected), f"{len(got)} episodes, expected {len(expected)}"
    for i, (g, e) in enumerate(zip(got, expected)):
        assert_obs_equal(g["obs"], e["obs"], f"episode {i} observations")
        np.testing.assert_array_equal(np.asarray(g["actions"]).reshape(e["actions"].shape), e["actions"],
                                      err_msg=f"episode {i} actions")
        np.testing.assert_array_equal(np.asarray(g["rewards"]).reshape(-1), e["rewards"], err_msg=f"episode {i} rewards")
        np.testing.assert_array_equal(np.asarray(g["term"], bool), e["term"], err_msg=f"episode {i} terminations")
        np.testing.assert_array_equal(np.asarray(g["trunc"], bool), e["trunc"], err_msg=f"episode {i} truncations")


@pytest.fixture
def minari_root(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


# -- the shared episode reader -------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_episodes_follow_links_across_interleaved_streams(tmp_path, kind):
    rng = np.random.default_rng(1)
    eps = make_episodes(kind, rng, 12)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        ids = np.concatenate([e["ids"] for e in store_episodes(store)])
        assert not np.all(np.diff(ids) == 1), "the streams should interleave (else this test proves nothing)"
        assert_episodes_equal(store_episodes(store), started)


def test_pieces_respect_the_block_size(tmp_path):
    rng = np.random.default_rng(2)
    eps = make_episodes("lowdim", rng, 20, max_len=60)
    _started, store = build_store(str(tmp_path / "s"), "lowdim", eps, rng=rng)
    with store:
        listing = list_episodes(store)
        sizes = [len(piece) for piece in iter_pieces(store, listing.episodes, block_rows=16)]
        assert max(sizes) <= 16 and sum(sizes) == sum(len(e["rewards"]) for e in eps)


def test_ring_cut_and_unfinished_episodes_are_skipped_or_exported_on_request(tmp_path):
    rng = np.random.default_rng(3)
    eps = make_episodes("lowdim", rng, 40, max_len=30)
    started, store = build_store(str(tmp_path / "s"), "lowdim", eps, n_streams=2, capacity=200, rng=rng)
    with store:
        # one more stream left running: an unfinished episode at the head
        extra = make_episodes("lowdim", rng, 1, max_len=5)[0]
        n = max(2, len(extra["rewards"]))
        extra["obs"] = np.concatenate([extra["obs"], extra["obs"]])  # enough frames
        store.extend(extra["obs"][:n - 1], np.zeros((n - 1, 2), np.float32), np.zeros(n - 1, np.float32),
                     extra["obs"][1:n], np.zeros(n - 1, bool), np.zeros(n - 1, bool), streams=[9] * (n - 1))
        oldest, _head = store.inspect.valid_range()
        assert oldest > 0
        listing = list_episodes(store)
        assert listing.skipped_cut >= 1 and listing.skipped_unfinished == 1
        assert any("overwrote" in note for note in listing.notes)
        complete = [e for e in started if e is not None]
        got = store_episodes(store)
        # every complete episode kept equals its ground truth (the newest ones: the oldest were overwritten)
        assert_episodes_equal(got, complete[len(complete) - len(got):])
        everything = list_episodes(store, include_partial=True)
        assert len(everything.episodes) == len(listing.episodes) + listing.skipped_cut + listing.skipped_unfinished
        assert everything.episodes[0].cut and everything.episodes[0].ids[0] >= oldest


# -- Minari ----------------------------------------------------------------------------------------------

def minari_episodes(dataset):
    return [{"obs": ep.observations, "actions": ep.actions, "rewards": ep.rewards, "term": ep.terminations,
                 "trunc": ep.truncations} for ep in dataset.iterate_episodes()]


@pytest.mark.parametrize("kind", list(KINDS))
def test_minari_export_reads_back_with_minari_and_round_trips(tmp_path, minari_root, kind):
    minari = pytest.importorskip("minari")
    rng = np.random.default_rng(10)
    eps = make_episodes(kind, rng, 10 if kind == "image" else 25)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        summary = export_dataset(store, minari_root / "mmreplay" / f"{kind}-v0", "minari")
    assert summary["dataset_id"] == f"mmreplay/{kind}-v0" and summary["episodes"] == len(eps)
    for dataset in (minari.load_dataset(f"mmreplay/{kind}-v0"),
                    minari.MinariDataset(str(minari_root / "mmreplay" / f"{kind}-v0" / "data"))):
        assert dataset.observation_space == KINDS[kind]["obs_space"]
        assert dataset.action_space == KINDS[kind]["action_space"]
        assert dataset.total_episodes == len(eps) and dataset.total_steps == sum(len(e["rewards"]) for e in eps)
        assert_episodes_equal(minari_episodes(dataset), started)
    if kind == "image":  # Minari would JPEG-encode this space by default: it must be stored raw
        meta = json.loads((minari_root / "mmreplay" / "image-v0" / "data" / "metadata.json").read_text())
        assert meta["jpeg_encoding"] is False
    result = import_dataset(f"mmreplay/{kind}-v0", tmp_path / "back", "minari")
    assert result["episodes"] == len(eps)
    with mmreplay.Store.open(tmp_path / "back", mode="r") as back:
        assert back.frame_stack == KINDS[kind]["frame_stack"]  # restored from the export's metadata
        assert back.observation_space == KINDS[kind]["obs_space"]
        assert_episodes_equal(store_episodes(back), started)
        assert len(back) == sum(len(e["rewards"]) for e in eps)


def test_minari_refuses_lossy_jpeg_paths(tmp_path, minari_root, monkeypatch):
    minari = pytest.importorskip("minari")
    from minari.data_collector import EpisodeBuffer
    from minari.dataset.minari_storage import MinariStorage

    rng = np.random.default_rng(11)
    eps = make_episodes("image", rng, 3)
    _, store = build_store(str(tmp_path / "s"), "image", eps, rng=rng)
    # An installed Minari that cannot be told to store raw arrays: refused before anything is written.
    original = MinariStorage.new.__func__

    def new_without_flag(cls, data_path, observation_space=None, action_space=None, env_spec=None,
                         data_format="hdf5"):
        return original(cls, data_path, observation_space, action_space, env_spec, data_format)
    with monkeypatch.context() as patch:
        patch.setattr(MinariStorage, "new", classmethod(new_without_flag))
        with store, pytest.raises(ValueError, match="JPEG-encodes uint8 image spaces.*lossy"):
            export_dataset(store, minari_root / "lossy-v0", "minari")
    assert not (minari_root / "lossy-v0").exists()
    # A dataset Minari wrote JPEG-encoded (its default) is refused on import.
    buffers = [EpisodeBuffer(observations=e["obs"], actions=e["actions"], rewards=e["rewards"],
                             terminations=e["term"], truncations=e["trunc"]) for e in eps]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's "author is None" reminders
        minari.create_dataset_from_buffers("jpeg-v0", buffers, observation_space=KINDS["image"]["obs_space"],
                                           action_space=KINDS["image"]["action_space"], data_format="hdf5")
    with pytest.raises(ValueError, match="JPEG-encoded"):
        import_dataset("jpeg-v0", tmp_path / "never", "minari")
    assert not (tmp_path / "never").exists()


def test_minari_selected_episodes(tmp_path, minari_root):
    minari = pytest.importorskip("minari")
    rng = np.random.default_rng(12)
    eps = make_episodes("lowdim", rng, 15)
    started, store = build_store(str(tmp_path / "s"), "lowdim", eps, rng=rng)
    with store:
        export_dataset(store, minari_root / "sel-v0", "minari", episodes=[2, 5, 7])
        export_dataset(store, minari_root / "head-v1", "minari", episodes=slice(0, 4))
    assert_episodes_equal(minari_episodes(minari.load_dataset("sel-v0")), [started[i] for i in (2, 5, 7)])
    assert_episodes_equal(minari_episodes(minari.load_dataset("head-v1")), started[:4])


def cartpole_store(path, n_episodes, seed=0):
    """A store recorded from CartPole-v1 with a fixed policy; returns the ground-truth episodes too."""
    import gymnasium as gym

    from mmreplay.integrations.gymnasium import RecordToStore, create_store_for

    env = gym.make("CartPole-v1")
    store = create_store_for(env, path, capacity=None, durable=False)
    rec = RecordToStore(env, store)
    eps = []
    obs, _ = rec.reset(seed=seed)
    for _ in range(n_episodes):
        ep = {"obs": [obs], "actions": [], "rewards": [], "term": [], "trunc": []}
        while True:
            action = int(obs[2] > 0)
            obs, reward, term, trunc, _ = rec.step(action)
            for k, v in (("obs", obs), ("actions", action), ("rewards", reward), ("term", term), ("trunc", trunc)):
                ep[k].append(v)
            if term or trunc:
                break
        eps.append({"obs": np.array(ep["obs"], np.float32), "actions": np.array(ep["actions"], np.int64),
                    "rewards": np.array(ep["rewards"], np.float32), "term": np.array(ep["term"]),
                    "trunc": np.array(ep["trunc"])})
        obs, _ = rec.reset()
    return eps, store


def test_minari_env_spec_recovers_the_environment_and_provenance_is_recorded(tmp_path, minari_root):
    minari = pytest.importorskip("minari")
    eps, store = cartpole_store(str(tmp_path / "s"), 4)
    with store:
        export_dataset(store, minari_root / "cp" / "random-v0", "minari", env_spec="CartPole-v1",
                       author=["Ada Lovelace", "Alan Turing"], author_email="ada@example.org",
                       code_permalink="https://example.org/repo/commit/abc123", algorithm_name="sign-of-angle",
                       description="CartPole, fixed policy", requirements=["gymnasium>=1.0"])
        export_dataset(store, minari_root / "cp" / "bare-v0", "minari")
    dataset = minari.load_dataset("cp/random-v0")
    assert dataset.env_spec.id == "CartPole-v1"
    env = dataset.recover_environment()
    assert env.spec.id == "CartPole-v1" and env.observation_space == dataset.observation_space
    env.reset(seed=0)
    env.close()
    assert dataset.recover_environment(eval_env=True).spec.id == "CartPole-v1"
    meta = dataset.storage.metadata
    assert meta["author"] == {"Ada Lovelace", "Alan Turing"} and meta["author_email"] == {"ada@example.org"}
    assert meta["code_permalink"] == "https://example.org/repo/commit/abc123"
    assert meta["algorithm_name"] == "sign-of-angle" and meta["description"] == "CartPole, fixed policy"
    assert meta["requirements"] == ["gymnasium>=1.0"]
    assert_episodes_equal(minari_episodes(dataset), eps)
    # Without the options: no placeholders, and no env to recover (Minari says so).
    bare = minari.load_dataset("cp/bare-v0")
    assert not {"author", "author_email", "code_permalink", "algorithm_name"} & set(bare.storage.metadata)
    with pytest.raises(ValueError, match="env_spec is None"):
        bare.recover_environment()


def test_minari_env_spec_must_match_the_store(tmp_path, minari_root):
    pytest.importorskip("minari")
    _, store = cartpole_store(str(tmp_path / "s"), 2)
    with store:
        with pytest.raises(ValueError, match="env 'Pendulum-v1' has observation space .* the store has"):
            export_dataset(store, minari_root / "wrong-v0", "minari", env_spec="Pendulum-v1")
        with pytest.raises(ValueError, match="env id 'NoSuchEnv-v9' is not registered"):
            export_dataset(store, minari_root / "wrong-v0", "minari", env_spec="NoSuchEnv-v9")
        with pytest.raises(ValueError, match="env id 'no_such_module:X-v0': cannot import 'no_such_module'"):
            export_dataset(store, minari_root / "wrong-v0", "minari", env_spec="no_such_module:X-v0")
        with pytest.raises(ValueError, match="author must be a non-empty string"):
            export_dataset(store, minari_root / "wrong-v0", "minari", author=[""])
    assert not (minari_root / "wrong-v0").exists()


def h5_filters(path):
    """{dataset name: its compression filter (None: uncompressed)} of every dataset in an HDF5 file."""
    found = {}
    with h5py.File(path, "r") as f:
        f.visititems(lambda name, obj: found.__setitem__(name, obj.compression)
                     if isinstance(obj, h5py.Dataset) and obj.ndim >= 1 and obj.size > 1 and obj.dtype.kind not in "OSU"
                     else None)
    return found


@pytest.mark.parametrize("fmt", ["minari", "d4rl", "d3rlpy"])
def test_hdf5_exports_are_compressed_losslessly(tmp_path, minari_root, fmt):
    if fmt == "minari":
        pytest.importorskip("minari")
    rng = np.random.default_rng(60)
    eps = make_episodes("image", rng, 6, max_len=40)
    for e in eps:  # frames with few distinct values, like real screens: something to compress
        e["obs"] //= 64
        e["obs"][:, 42:] = 0
    started, store = build_store(str(tmp_path / "s"), "image", eps, rng=rng)
    sizes = {}
    with store:
        for compression in ("gzip", "lzf", "none"):
            out = minari_root / f"{compression}-v0" if fmt == "minari" else tmp_path / f"{compression}.h5"
            summary = export_dataset(store, out, fmt, compression=compression)
            assert summary["compression"] == compression
            sizes[compression] = summary["bytes"]
            h5 = out / "data" / "main_data.hdf5" if fmt == "minari" else out
            filters = h5_filters(h5)
            assert filters and set(filters.values()) == {None if compression == "none" else compression}, filters
            import_dataset(out, tmp_path / f"back-{compression}", fmt)
            with mmreplay.Store.open(tmp_path / f"back-{compression}", mode="r") as back:
                assert_episodes_equal(store_episodes(back), started)
        assert export_dataset(store, tmp_path / "default.h5" if fmt != "minari" else minari_root / "default-v0",
                              fmt)["compression"] == "gzip"
        with pytest.raises(ValueError, match=r"unknown HDF5 compression 'zstd': expected one of \['gzip', 'lzf'"):
            export_dataset(store, tmp_path / "bad.h5" if fmt != "minari" else minari_root / "bad-v0", fmt,
                           compression="zstd")
    assert sizes["gzip"] < sizes["none"] / 3 and sizes["lzf"] < sizes["none"] / 2, sizes


@pytest.mark.parametrize("kind", list(KINDS))
def test_minari_arrow_format_round_trips(tmp_path, minari_root, kind):
    minari = pytest.importorskip("minari")
    pytest.importorskip("pyarrow")
    rng = np.random.default_rng(61)
    eps = make_episodes(kind, rng, 6 if kind == "image" else 12)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        summary = export_dataset(store, minari_root / f"arrow-{kind}-v0", "minari", data_format="arrow",
                                 block_rows=32)
        with pytest.raises(ValueError, match="arrow writer has no compression option"):
            export_dataset(store, minari_root / "never-v0", "minari", data_format="arrow", compression="gzip")
    assert summary["data_format"] == "arrow" and summary["episodes"] == len(eps)
    meta = json.loads((minari_root / f"arrow-{kind}-v0" / "data" / "metadata.json").read_text())
    assert meta["data_format"] == "arrow" and meta["jpeg_encoding"] is False
    for dataset in (minari.load_dataset(f"arrow-{kind}-v0"),
                    minari.MinariDataset(str(minari_root / f"arrow-{kind}-v0" / "data"))):
        assert dataset.observation_space == KINDS[kind]["obs_space"]
        assert dataset.total_steps == sum(len(e["rewards"]) for e in eps)
        assert_episodes_equal(minari_episodes(dataset), started)
    import_dataset(f"arrow-{kind}-v0", tmp_path / "back", "minari")
    with mmreplay.Store.open(tmp_path / "back", mode="r") as back:
        assert_episodes_equal(store_episodes(back), started)


def test_collect_minari_records_an_env_into_a_dataset(tmp_path, minari_root):
    minari = pytest.importorskip("minari")
    from mmreplay.datasets import collect_minari

    truth, ref = cartpole_store(str(tmp_path / "truth"), 3, seed=7)  # the same env, seed and policy by hand
    ref.close()
    summary = collect_minari("CartPole-v1", minari_root / "col" / "cp-v0", episodes=3, seed=7,
                             policy=lambda obs: int(obs[2] > 0), author="Ada", store=tmp_path / "kept")
    assert summary["episodes"] == 3 and summary["env_spec"] == "CartPole-v1"
    dataset = minari.load_dataset("col/cp-v0")
    assert_episodes_equal(minari_episodes(dataset), truth)
    assert dataset.recover_environment().spec.id == "CartPole-v1"
    assert dataset.storage.metadata["author"] == {"Ada"}
    assert "CartPole-v1" in dataset.storage.metadata["description"]
    with mmreplay.Store.open(summary["store"], mode="r") as kept:  # the store it recorded through is kept
        assert len(kept) == sum(len(e["rewards"]) for e in truth)
    # steps=: whole episodes until the budget; a temporary store is removed
    summary = collect_minari("CartPole-v1", minari_root / "col" / "cp-v1", steps=30, seed=1)
    assert summary["steps"] >= 30 and summary["store"] is None
    assert minari.load_dataset("col/cp-v1").total_steps == summary["steps"]
    with pytest.raises(ValueError, match="exactly one of episodes= and steps="):
        collect_minari("CartPole-v1", minari_root / "col" / "cp-v2")


# -- D4RL-style flat HDF5 ------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", ["lowdim", "image"])
def test_d4rl_export_matches_qlearning_semantics_and_round_trips(tmp_path, kind):
    from mmreplay.datasets.d4rl import qlearning_dataset

    rng = np.random.default_rng(20)
    eps = make_episodes(kind, rng, 10 if kind == "image" else 30)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        export_dataset(store, tmp_path / "d.hdf5", "d4rl", block_rows=37)
    rows = [{"obs": e["obs"][t], "next": e["obs"][t + 1], "a": e["actions"][t], "r": e["rewards"][t], "te": e["term"][t],
                 "tr": e["trunc"][t]} for e in started for t in range(len(e["rewards"]))]
    with h5py.File(tmp_path / "d.hdf5", "r") as f:
        np.testing.assert_array_equal(f["observations"][()], np.stack([r["obs"] for r in rows]))
        np.testing.assert_array_equal(f["next_observations"][()], np.stack([r["next"] for r in rows]))
        np.testing.assert_array_equal(f["actions"][()], np.stack([r["a"] for r in rows]))
        np.testing.assert_array_equal(f["rewards"][()], np.array([r["r"] for r in rows]))
        np.testing.assert_array_equal(f["terminals"][()], np.array([r["te"] for r in rows]))
        np.testing.assert_array_equal(f["timeouts"][()], np.array([r["tr"] for r in rows]))
        assert f["observations"].dtype == KINDS[kind]["obs_space"].dtype
        q = qlearning_dataset(f)
    # qlearning_dataset: timeout rows and the last row dropped; next obs = observations[i + 1], which is the
    # true next observation for every kept non-terminal row.
    kept = [i for i in range(len(rows) - 1) if not rows[i]["tr"]]
    assert len(q["observations"]) == len(kept)
    for j, i in enumerate(kept):
        np.testing.assert_array_equal(q["observations"][j], rows[i]["obs"])
        if not rows[i]["te"]:
            np.testing.assert_array_equal(q["next_observations"][j], rows[i]["next"])
    import_dataset(tmp_path / "d.hdf5", tmp_path / "back", "d4rl", block_rows=29)
    with mmreplay.Store.open(tmp_path / "back", mode="r") as back:
        assert back.frame_stack == KINDS[kind]["frame_stack"] and back.action_space == KINDS[kind]["action_space"]
        assert_episodes_equal(store_episodes(back), started)


def write_foreign_d4rl(path, eps, with_next):
    """A file as D4RL ships them: no mmreplay metadata; optionally without next_observations."""
    obs = np.concatenate([e["obs"][:-1] for e in eps])
    with h5py.File(path, "w") as f:
        f["observations"] = obs
        if with_next:
            f["next_observations"] = np.concatenate([e["obs"][1:] for e in eps])
        f["actions"] = np.concatenate([e["actions"] for e in eps])
        f["rewards"] = np.concatenate([e["rewards"] for e in eps])
        f["terminals"] = np.concatenate([e["term"] for e in eps])
        f["timeouts"] = np.concatenate([e["trunc"] for e in eps])


def test_d4rl_import_of_foreign_files(tmp_path):
    rng = np.random.default_rng(21)
    eps = make_episodes("lowdim", rng, 30)
    write_foreign_d4rl(tmp_path / "full.hdf5", eps, with_next=True)
    import_dataset(tmp_path / "full.hdf5", tmp_path / "a", "d4rl", block_rows=16)
    with mmreplay.Store.open(tmp_path / "a", mode="r") as a:
        assert isinstance(a.action_space, spaces.Box) and a.action_space.shape == (2,)
        assert_episodes_equal(store_episodes(a), eps)
    # Without next_observations: exactly qlearning_dataset's transitions; the step before a dropped timeout
    # row ends its episode, truncated.
    write_foreign_d4rl(tmp_path / "old.hdf5", eps, with_next=False)
    import_dataset(tmp_path / "old.hdf5", tmp_path / "b", "d4rl", block_rows=16)
    expected = []
    for i, e in enumerate(eps):
        n = len(e["rewards"])
        keep = n - 1 if e["trunc"][-1] or i == len(eps) - 1 else n
        if keep == 0:
            continue
        nxt_final = e["obs"][keep] if keep < n else eps[i + 1]["obs"][0]  # D4RL: observations[i + 1]
        frames = np.concatenate([e["obs"][:keep], nxt_final[None]])
        term, trunc = e["term"][:keep].copy(), np.zeros(keep, bool)
        if e["trunc"][-1]:
            trunc[-1] = True
        expected.append({"obs": frames, "actions": e["actions"][:keep], "rewards": e["rewards"][:keep], "term": term,
                             "trunc": trunc})
    with mmreplay.Store.open(tmp_path / "b", mode="r") as b:
        if not eps[-1]["trunc"][-1]:  # the file's last row was dropped: that episode is now unfinished
            expected[-1]["trunc"][-1] = False
            last = list_episodes(b, include_partial=True).episodes[-1]
            assert not last.ended
        assert_episodes_equal(store_episodes(b), [e for e in expected if e["term"][-1] or e["trunc"][-1]])


def test_d4rl_refuses_dict_observations_and_bad_files(tmp_path):
    rng = np.random.default_rng(22)
    _, store = build_store(str(tmp_path / "s"), "dict", make_episodes("dict", rng, 3), rng=rng)
    with store, pytest.raises(ValueError, match=r"Dict observations \(keys \['img', 'vec'\]\)"):
        export_dataset(store, tmp_path / "d.hdf5", "d4rl")
    assert not (tmp_path / "d.hdf5").exists()
    with h5py.File(tmp_path / "bad.hdf5", "w") as f:
        f["observations"] = np.zeros((5, 4), np.float32)
        f["rewards"] = np.zeros(5, np.float32)
    with pytest.raises(ValueError, match=r"missing dataset\(s\) \['actions', 'terminals'\]"):
        import_dataset(tmp_path / "bad.hdf5", tmp_path / "never", "d4rl")
    with h5py.File(tmp_path / "short.hdf5", "w") as f:
        f["observations"] = np.zeros((5, 4), np.float32)
        f["actions"] = np.zeros((4, 2), np.float32)
        f["rewards"] = np.zeros(5, np.float32)
        f["terminals"] = np.zeros(5, bool)
    with pytest.raises(ValueError, match="'actions' has 4 rows, 'observations' has 5"):
        import_dataset(tmp_path / "short.hdf5", tmp_path / "never", "d4rl")
    write_foreign_d4rl(tmp_path / "good.hdf5", make_episodes("lowdim", rng, 3), with_next=True)
    with pytest.raises(ValueError, match=r"observations have shape \(4,\) per row.*expects \(3,\)"):
        import_dataset(tmp_path / "good.hdf5", tmp_path / "never", "d4rl",
                       observation_space=spaces.Box(-1, 1, (3,), np.float32))
    assert not (tmp_path / "never").exists()


# -- d3rlpy --------------------------------------------------------------------------------------------

@pytest.mark.parametrize("kind", list(KINDS))
def test_d3rlpy_round_trip(tmp_path, kind):
    rng = np.random.default_rng(30)
    eps = make_episodes(kind, rng, 10 if kind == "image" else 25)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        export_dataset(store, tmp_path / "d.h5", "d3rlpy", block_rows=7)
    with h5py.File(tmp_path / "d.h5", "r") as f:  # the layout d3rlpy's io.py reads
        assert [c.decode() for c in f["columns"][()]] == ["observations", "actions", "rewards", "terminated"]
        assert int(f["num_episodes"][()]) == len(eps) and f["version"][()] == b"2.1"
    import_dataset(tmp_path / "d.h5", tmp_path / "back", "d3rlpy", block_rows=5)
    with mmreplay.Store.open(tmp_path / "back", mode="r") as back:
        assert back.observation_space == KINDS[kind]["obs_space"]
        assert_episodes_equal(store_episodes(back), started)


@pytest.mark.parametrize("kind", ["lowdim", "dict"])
def test_d3rlpy_loads_the_export(tmp_path, kind):
    pytest.importorskip("d3rlpy")
    from d3rlpy.dataset import InfiniteBuffer, ReplayBuffer

    rng = np.random.default_rng(31)
    eps = make_episodes(kind, rng, 20)
    started, store = build_store(str(tmp_path / "s"), kind, eps, rng=rng)
    with store:
        export_dataset(store, tmp_path / "d.h5", "d3rlpy")
    with open(tmp_path / "d.h5", "rb") as fh:
        rb = ReplayBuffer.load(fh, InfiniteBuffer())
    assert len(rb.episodes) == len(eps)
    assert rb.transition_count == sum(len(e["rewards"]) for e in eps)  # every stored transition, no more
    keys = ["img", "vec"] if kind == "dict" else None
    for ep, e in zip(rb.episodes, started):
        n = len(e["rewards"])
        assert ep.terminated == bool(e["term"][-1])
        obs = dict(zip(keys, ep.observations)) if keys else ep.observations
        frames = {k: v[:n] for k, v in e["obs"].items()} if keys else e["obs"][:n]
        assert_obs_equal({k: v[:n] for k, v in obs.items()} if keys else obs[:n], frames)
        np.testing.assert_array_equal(ep.actions[:n].reshape(e["actions"].shape), e["actions"])
        np.testing.assert_array_equal(ep.rewards[:n, 0], e["rewards"])
        # the last transition's next observation, as d3rlpy's picker builds it
        last = rb.transition_picker(ep, n - 1)
        if e["trunc"][-1]:
            final = [e["obs"][k][n] for k in keys] if keys else e["obs"][n]
            if keys:
                for a, b in zip(last.next_observation, final):
                    np.testing.assert_array_equal(a, b)
            else:
                np.testing.assert_array_equal(last.next_observation, final)
        assert last.terminal == float(e["term"][-1])


def test_d3rlpy_foreign_file(tmp_path):
    """A file d3rlpy itself dumped (no mmreplay metadata): discrete actions inferred, terminal next obs zeros."""
    pytest.importorskip("d3rlpy")
    from d3rlpy.dataset import InfiniteBuffer, ReplayBuffer
    from d3rlpy.dataset.components import Episode

    rng = np.random.default_rng(32)
    eps = []
    for i in range(6):
        m = int(rng.integers(2, 12))
        eps.append(Episode(observations=rng.standard_normal((m, 3)).astype(np.float32),
                           actions=rng.integers(0, 4, (m, 1)), rewards=rng.standard_normal((m, 1)).astype(np.float32),
                           terminated=bool(i % 2)))
    rb = ReplayBuffer(InfiniteBuffer(), episodes=eps)
    with open(tmp_path / "f.h5", "w+b") as fh:
        rb.dump(fh)
    import_dataset(tmp_path / "f.h5", tmp_path / "s", "d3rlpy")
    with mmreplay.Store.open(tmp_path / "s", mode="r") as s:
        assert s.action_space == spaces.Discrete(4)
        got = store_episodes(s)
    assert len(got) == len(eps) and sum(len(g["rewards"]) for g in got) == rb.transition_count
    for g, e in zip(got, eps):
        m = e.observations.shape[0]
        n = m if e.terminated else m - 1
        np.testing.assert_array_equal(g["obs"][:n], e.observations[:n])
        np.testing.assert_array_equal(g["obs"][n], np.zeros(3) if e.terminated else e.observations[m - 1])
        np.testing.assert_array_equal(g["actions"], e.actions[:n, 0])
        assert g["term"][-1] == e.terminated and g["trunc"][-1] == (not e.terminated)


# -- common: bad input, boundedness, CLI -----------------------------------------------------------------

def test_bad_input_is_refused_without_touching_anything(tmp_path, minari_root):
    rng = np.random.default_rng(40)
    _, store = build_store(str(tmp_path / "s"), "lowdim", make_episodes("lowdim", rng, 4), rng=rng)
    with store:
        with pytest.raises(ValueError, match=r"unknown dataset format 'rlds': expected one of \['minari', 'd4rl', "):
            export_dataset(store, tmp_path / "x", "rlds")
        (tmp_path / "exists.h5").write_bytes(b"keep")
        for fmt in ("d4rl", "d3rlpy"):
            with pytest.raises(FileExistsError, match="exists"):
                export_dataset(store, tmp_path / "exists.h5", fmt)
        assert (tmp_path / "exists.h5").read_bytes() == b"keep"
        with pytest.raises(IndexError, match="episode 9 does not exist: the store has 4"):
            export_dataset(store, tmp_path / "e.h5", "d4rl", episodes=[0, 9])
        export_dataset(store, tmp_path / "ok.h5", "d4rl")
    # importing over an existing store never touches it
    before = sorted(os.listdir(tmp_path / "s"))
    with pytest.raises(FileExistsError, match="imports always create a new store"):
        import_dataset(tmp_path / "ok.h5", tmp_path / "s", "d4rl")
    assert sorted(os.listdir(tmp_path / "s")) == before
    with mmreplay.Store.open(tmp_path / "s", mode="r") as s:
        assert len(s) > 0
    with pytest.raises(ValueError, match="is not a d3rlpy ReplayBuffer file: missing"):
        import_dataset(tmp_path / "ok.h5", tmp_path / "n", "d3rlpy")
    with pytest.raises(FileNotFoundError, match="no such directory"):
        import_dataset(str(tmp_path / "nothing here"), tmp_path / "n", "minari")


def _traced_peak(fn):
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_memory_is_bounded_by_the_block_not_the_dataset(tmp_path):
    """tracemalloc peaks of export and import: a third of a dataset costs as much as all of it, and an
    export of 60 MB of observations peaks at a small fraction of that."""
    space = spaces.Box(-np.inf, np.inf, (256,), np.float32)  # 1 KiB observations
    n, episode = 30_000, 500
    with mmreplay.Store.create(tmp_path / "s", space, spaces.Discrete(4), capacity=None, durable=False) as store:
        rng = np.random.default_rng(41)
        trunc = np.zeros(n, bool)
        trunc[episode - 1::episode] = True
        nxt = rng.standard_normal(256).astype(np.float32)
        for lo in range(0, n, 2000):  # one stream, episodes of 500 steps
            frames = np.concatenate([nxt[None], rng.standard_normal((2000, 256)).astype(np.float32)])
            nxt = frames[-1]
            store.extend(frames[:-1], np.zeros(2000, np.int64), np.zeros(2000, np.float32), frames[1:],
                         np.zeros(2000, bool), trunc[lo:lo + 2000], streams=np.zeros(2000, np.int64))
        data_bytes = 2 * n * 1024  # observations + next observations
        store.inspect.get(np.arange(4))  # numba's one-time imports (~16 MB of Python objects) come before the measure
        full = _traced_peak(lambda: export_dataset(store, tmp_path / "all.hdf5", "d4rl", block_rows=512))
        third = _traced_peak(lambda: export_dataset(store, tmp_path / "third.hdf5", "d4rl", block_rows=512,
                                                    episodes=slice(0, n // episode // 3)))
    assert full < data_bytes / 8, (full, data_bytes)
    assert full < 1.25 * third + (1 << 20), (full, third)
    peaks = {}
    for name in ("all", "third"):
        peaks[name] = _traced_peak(lambda name=name: import_dataset(tmp_path / f"{name}.hdf5",
                                                                    tmp_path / f"back-{name}", "d4rl", block_rows=512))
    assert peaks["all"] < 1.25 * peaks["third"] + (1 << 20), peaks
    with mmreplay.Store.open(tmp_path / "back-all", mode="r") as back:
        assert len(back) == n


def test_cli_export_and_import(tmp_path, minari_root, capsys):
    rng = np.random.default_rng(50)
    eps = make_episodes("image", rng, 6)
    started, store = build_store(str(tmp_path / "s"), "image", eps, rng=rng)
    store.close()
    for fmt, out in (("minari", minari_root / "cli-v0"), ("d4rl", tmp_path / "d.hdf5"), ("d3rlpy", tmp_path / "d.h5")):
        if fmt == "minari":
            pytest.importorskip("minari")
        assert main(["export", str(tmp_path / "s"), str(out), "--format", fmt]) == 0
        summary = json.loads(capsys.readouterr().out)
        assert summary["episodes"] == len(eps)
        assert main(["import", str(out), str(tmp_path / f"back-{fmt}"), "--format", fmt]) == 0
        assert json.loads(capsys.readouterr().out)["steps"] == sum(len(e["rewards"]) for e in eps)
        with mmreplay.Store.open(tmp_path / f"back-{fmt}", mode="r") as back:
            assert_episodes_equal(store_episodes(back), started)
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "d.hdf5"), "--format", "d4rl"]) == 2
    assert "exists" in capsys.readouterr().err
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "x"), "--format", "d4rl", "--episodes", "a:b"]) == 2
    assert "--episodes 'a:b'" in capsys.readouterr().err


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy"])
def test_hdf5_exports_create_missing_folders(tmp_path, fmt):
    rng = np.random.default_rng(31)
    eps = make_episodes("lowdim", rng, 4)
    started, store = build_store(str(tmp_path / "s"), "lowdim", eps, rng=rng)
    out = tmp_path / "new" / "folder" / "d.h5"
    with store:
        export_dataset(store, out, fmt)
    import_dataset(out, tmp_path / "back", fmt)
    with mmreplay.Store.open(tmp_path / "back", mode="r") as back:
        assert_episodes_equal(store_episodes(back), started)


def test_cli_export_options(tmp_path, minari_root, capsys):
    minari = pytest.importorskip("minari")
    pytest.importorskip("pyarrow")
    _, store = cartpole_store(str(tmp_path / "s"), 3)
    store.close()
    assert main(["export", str(tmp_path / "s"), str(minari_root / "cli" / "cp-v0"), "--format", "minari",
                 "--env-id", "CartPole-v1", "--author", "Ada", "--author", "Alan", "--author-email", "ada@example.org",
                 "--code-permalink", "https://example.org/c/1", "--algorithm-name", "sign-of-angle",
                 "--description", "three episodes", "--compression", "lzf"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["compression"] == "lzf" and summary["env_spec"] == "CartPole-v1"
    dataset = minari.load_dataset("cli/cp-v0")
    meta = dataset.storage.metadata
    assert meta["author"] == {"Ada", "Alan"} and meta["author_email"] == {"ada@example.org"}
    assert (meta["code_permalink"], meta["algorithm_name"], meta["description"]) == \
        ("https://example.org/c/1", "sign-of-angle", "three episodes")
    assert dataset.recover_environment().spec.id == "CartPole-v1"
    assert set(h5_filters(minari_root / "cli" / "cp-v0" / "data" / "main_data.hdf5").values()) == {"lzf"}
    assert main(["export", str(tmp_path / "s"), str(minari_root / "cli" / "cp-v1"), "--format", "minari",
                 "--data-format", "arrow"]) == 0
    assert json.loads(capsys.readouterr().out)["data_format"] == "arrow"
    assert minari.load_dataset("cli/cp-v1").total_episodes == 3
    assert main(["export", str(tmp_path / "s"), str(tmp_path / "x.h5"), "--format", "d4rl", "--env-id",
                 "CartPole-v1", "--author", "Ada"]) == 2
    assert "--env-id, --author apply to --format minari only" in capsys.readouterr().err
    assert not (tmp_path / "x.h5").exists()
