"""Minari exports of wrapped envs (issue 24, item 6): ``env_spec`` / ``--env-id`` take gymnasium's EnvSpec JSON
with ``additional_wrappers``, so ``recover_environment()`` rebuilds an AtariPreprocessing env whose spaces equal
the dataset's (a frame-stack store's FrameStackObservation is left out: the dataset holds single frames);
errors name the spaces; a JPEG-encoded dataset is refused with a message that names the real problem."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.cli import main
from mmreplay.datasets import export_dataset, import_dataset

pytest.importorskip("h5py")
minari = pytest.importorskip("minari")
STEPS, EPISODE_LEN = 300, 120  # a few hundred Atari steps, episodes truncated here so that several end


@pytest.fixture
def minari_root(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


@pytest.fixture(scope="module")
def breakout():
    """``(wrapped env spec JSON, episodes)``: AtariPreprocessing + FrameStackObservation(4) on Breakout, and
    ``STEPS`` steps of single preprocessed frames recorded from it (the ground truth)."""
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    import ale_py
    import gymnasium as gym
    from gymnasium.wrappers import AtariPreprocessing, FrameStackObservation

    gym.register_envs(ale_py)
    env = AtariPreprocessing(gym.make("ALE/Breakout-v5", frameskip=1))
    spec_json = FrameStackObservation(env, 4).spec.to_json()
    rng = np.random.default_rng(0)
    episodes, obs = [], env.reset(seed=0)[0]
    ep = {"obs": [obs], "actions": [], "rewards": [], "term": [], "trunc": []}
    for _ in range(STEPS):
        action = int(rng.integers(0, env.action_space.n))
        obs, reward, term, trunc, _ = env.step(action)
        trunc = trunc or len(ep["actions"]) + 1 == EPISODE_LEN
        for key, value in (("obs", obs), ("actions", action), ("rewards", reward), ("term", term), ("trunc", trunc)):
            ep[key].append(value)
        if term or trunc:
            episodes.append({k: np.array(v) for k, v in ep.items()})
            obs = env.reset()[0]
            ep = {"obs": [obs], "actions": [], "rewards": [], "term": [], "trunc": []}
    env.close()
    return spec_json, episodes


def frame_stack_store(path, episodes, observation_space):
    store = mmreplay.Store.create(path, observation_space, spaces.Discrete(4), capacity=None, frame_stack=4,
                                  durable=False)
    for e in episodes:
        store.extend(e["obs"][:-1], e["actions"], e["rewards"].astype(np.float32), e["obs"][1:], e["term"],
                     e["trunc"], streams=np.zeros(len(e["actions"]), np.int64))
    return store


def test_wrapped_atari_spec_json_recovers_the_env_of_the_dataset(tmp_path, minari_root, breakout, capsys):
    """The help text's own form is refused with the spaces named; the wrapped env's EnvSpec JSON (a file
    on the CLI, inline text through the API) is recorded, and recover_environment() rebuilds the env."""
    spec_json, episodes = breakout
    frame = spaces.Box(0, 255, (84, 84), np.uint8)
    store = frame_stack_store(str(tmp_path / "s"), episodes, frame)
    with store:
        with pytest.raises(ValueError, match=r"env 'ALE/Breakout-v5' has observation space Box\(0, 255, "
                                             r"\(210, 160, 3\), uint8\) \(wrappers: \[\]\), the store has Box\(0, 255, "
                                             r"\(84, 84\), uint8\).*env.spec.to_json\(\)"):
            export_dataset(store, minari_root / "atari" / "plain-v0", "minari", env_spec="ale_py:ALE/Breakout-v5")
        summary = export_dataset(store, minari_root / "atari" / "api-v0", "minari", env_spec=spec_json)
    assert any("FrameStackObservation(stack_size=4) is left out" in n for n in summary["notes"])
    spec_file = tmp_path / "breakout_spec.json"
    spec_file.write_text(spec_json)
    assert main(["export", str(tmp_path / "s"), str(minari_root / "atari" / "cli-v0"), "--format", "minari",
                 "--env-id", str(spec_file)]) == 0
    assert "FrameStackObservation(stack_size=4) is left out" in capsys.readouterr().err
    for dataset_id in ("atari/api-v0", "atari/cli-v0"):
        dataset = minari.load_dataset(dataset_id)
        env = dataset.recover_environment()
        try:
            assert env.observation_space == dataset.observation_space == frame
            assert env.action_space == dataset.action_space == spaces.Discrete(4)
            assert [w.name for w in env.spec.additional_wrappers] == ["AtariPreprocessing"]
            assert env.reset(seed=1)[0].shape == (84, 84)
        finally:
            env.close()
        got = list(dataset.iterate_episodes())
        assert len(got) == len(episodes)
        for ep, want in zip(got, episodes, strict=True):
            np.testing.assert_array_equal(ep.observations, want["obs"])
            np.testing.assert_array_equal(ep.actions, want["actions"])
            np.testing.assert_array_equal(ep.truncations, want["trunc"])
        assert json.loads(dataset.storage.metadata["mmreplay"])["frame_stack"] == 4


def test_frame_stack_wrapper_that_disagrees_with_the_store_is_refused(tmp_path, minari_root, breakout):
    spec_json, episodes = breakout
    other = json.loads(spec_json)
    other["additional_wrappers"][-1]["kwargs"]["stack_size"] = 3
    with frame_stack_store(str(tmp_path / "s"), episodes[:1], spaces.Box(0, 255, (84, 84), np.uint8)) as store:
        with pytest.raises(ValueError, match=r"FrameStackObservation\(stack_size=3, padding_type='reset'\), the "
                                             r"store stacks frame_stack=4"):
            export_dataset(store, minari_root / "bad-v0", "minari", env_spec=json.dumps(other))
    assert not (minari_root / "bad-v0").exists()


def test_env_spec_json_errors_and_the_missing_env_note(tmp_path, minari_root):
    rng = np.random.default_rng(0)
    store = mmreplay.Store.create(str(tmp_path / "s"), spaces.Box(-5, 5, (4,), np.float32), spaces.Discrete(2),
                                  capacity=None, durable=False)
    obs = rng.standard_normal((11, 4)).astype(np.float32)
    done = np.zeros(10, bool)
    done[-1] = True
    store.extend(obs[:-1], rng.integers(0, 2, 10), np.ones(10, np.float32), obs[1:], done, np.zeros(10, bool),
                 streams=np.zeros(10, np.int64))
    with store:
        with pytest.raises(ValueError, match="env spec JSON is not valid JSON"):
            export_dataset(store, minari_root / "x-v0", "minari", env_spec="{not json")
        with pytest.raises(ValueError, match="at least 'id' and 'entry_point'"):
            export_dataset(store, minari_root / "x-v0", "minari", env_spec='{"id": "CartPole-v1"}')
        summary = export_dataset(store, minari_root / "bare-v0", "minari")
        assert any("no env spec given" in n and "recover_environment() will fail" in n for n in summary["notes"])
        import gymnasium as gym
        summary = export_dataset(store, minari_root / "cp-v0", "minari",
                                 env_spec=gym.spec("CartPole-v1").to_json())
    assert summary["env_spec"] == "CartPole-v1"
    assert minari.load_dataset("cp-v0").recover_environment().spec.id == "CartPole-v1"
    assert main(["export", str(tmp_path / "s"), str(minari_root / "y-v0"), "--format", "minari", "--env-id",
                 str(tmp_path / "missing.json")]) == 2


def test_jpeg_dataset_refusal_names_the_space_and_the_cause(tmp_path, minari_root):
    from minari.data_collector import EpisodeBuffer

    rng = np.random.default_rng(1)
    frames = rng.integers(0, 256, (6, 84, 84), dtype=np.uint8)
    buffers = [EpisodeBuffer(observations=frames, actions=np.zeros(5, np.int64), rewards=np.zeros(5),
                             terminations=np.eye(5, dtype=bool)[-1], truncations=np.zeros(5, bool))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Minari's "author is None" reminders
        minari.create_dataset_from_buffers("jpeg-v0", buffers, observation_space=spaces.Box(0, 255, (84, 84), np.uint8),
                                           action_space=spaces.Discrete(3), data_format="hdf5")
    with pytest.raises(ValueError) as err:
        import_dataset("jpeg-v0", tmp_path / "never", "minari")
    message = str(err.value)
    assert "observation space Box(0, 255, (84, 84), uint8) are stored JPEG-encoded" in message
    assert "jpeg_encoding=True" in message and "DataCollector(env, jpeg_encoding=False)" in message
    assert "['']" not in message
    assert not (tmp_path / "never").exists()
