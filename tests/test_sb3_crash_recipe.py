"""SB3's crash recipe holds (issue 41 item 2): a real DQN trained with ``CheckpointCallback`` (with or without
``save_replay_buffer=True``) and SIGKILLed after a checkpoint resumes from the newest checkpoint with its store
holding every transition up to the checkpoint's step count, and no false "fewer ... steps were lost" warning
(SB3 runs the callbacks, and so saves the checkpoint, before it stores that step's transition).

The store's own commit cadence is set far beyond the run, so only the checkpoint commits it: before the fix,
the store committed nothing (or one step less than the checkpoint) and the resumed model trained from less.
"""

import glob
import json
import os
import subprocess
import sys
import textwrap
import warnings
import zipfile

import gymnasium as gym
import numpy as np
import pytest

pytest.importorskip("stable_baselines3")
from stable_baselines3 import DQN  # noqa: E402

KILL_AT = 250  # steps; checkpoints every 100 steps: the newest is at 200

CHILD = textwrap.dedent("""
    import os, signal, sys
    import gymnasium as gym
    import torch
    from stable_baselines3 import DQN
    from stable_baselines3.common.callbacks import BaseCallback, CheckpointCallback
    from mmreplay.integrations.sb3 import MMReplayBuffer

    torch.set_num_threads(1)
    path, ckpt, save_buffer, kill_at = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])

    class Die(BaseCallback):
        def _on_step(self):
            if self.num_timesteps >= kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no close, no atexit: what a crash leaves
            return True

    # the recipe: rollback_to_checkpoint=True (the store's own commits are pushed past the run here)
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=path, rollback_to_checkpoint=True, commit_every=10**6,
                                          commit_seconds=3600.0),
                learning_starts=50, train_freq=10, batch_size=16, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.learn(10_000, callback=[CheckpointCallback(100, ckpt, save_replay_buffer=save_buffer), Die()])
""")


def run_until_killed(tmp_path, save_buffer: bool) -> tuple[str, str]:
    path, ckpt = str(tmp_path / "run.mmr"), str(tmp_path / "ckpt")
    proc = subprocess.run([sys.executable, "-c", CHILD, path, ckpt, "1" if save_buffer else "0", str(KILL_AT)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == -9, proc.stderr[-3000:]
    return path, ckpt


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("save_buffer", [False, True])
def test_a_killed_dqn_resumes_from_its_newest_checkpoint_with_every_transition_and_no_false_warning(tmp_path,
                                                                                                   save_buffer):
    _, ckpt = run_until_killed(tmp_path, save_buffer)
    newest = os.path.join(ckpt, "rl_model_200_steps.zip")
    assert sorted(glob.glob(os.path.join(ckpt, "rl_model_*_steps.zip"))) == [
        os.path.join(ckpt, "rl_model_100_steps.zip"), newest]
    env = gym.make("CartPole-v1")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = DQN.load(newest, env=env)
        if save_buffer:
            model.load_replay_buffer(os.path.join(ckpt, "rl_model_replay_buffer_200_steps.pkl"))
    said = [str(w.message) for w in caught if "mmreplay" in str(w.message)]
    assert said == [], said
    store = model.replay_buffer.store
    assert model.num_timesteps == 200 and store.num_added == 200 == len(store)
    # every transition is whole: CartPole's episodes chain obs -> next_obs until an end
    b = store.inspect.get(np.arange(200))
    ended = (b.terminated | b.truncated).numpy()
    follows = np.all(b.obs[1:].numpy() == b.next_obs[:-1].numpy(), axis=1)
    assert follows[~ended[:-1]].all()
    # the model is the checkpoint's
    saved = DQN.load(newest)
    for name, value in saved.policy.state_dict().items():
        assert bool((model.policy.state_dict()[name] == value).all()), name
    model.learn(100, reset_num_timesteps=False)
    assert model.num_timesteps == store.num_added == 300
    model.replay_buffer.close()


@pytest.mark.usefixtures("one_torch_thread")
def test_model_save_commits_the_store_and_the_next_add_commits_the_checkpoints_own_step(tmp_path):
    import mmreplay
    from mmreplay.integrations.sb3 import MMReplayBuffer

    path = str(tmp_path / "s.mmr")
    model = DQN("MlpPolicy", gym.make("CartPole-v1"), replay_buffer_class=MMReplayBuffer,
                replay_buffer_kwargs=dict(path=path, commit_every=10**6, commit_seconds=3600.0),
                learning_starts=10**6, policy_kwargs=dict(net_arch=[8]), seed=0)
    model.learn(30)
    with mmreplay.Store.open(path, mode="r") as reader:
        assert reader.num_added == 0  # nothing committed yet (the store's cadence is far away)
    model.save(tmp_path / "m")
    steps = model.num_timesteps
    with mmreplay.Store.open(path, mode="r") as reader:
        assert reader.num_added == steps == model.replay_buffer.store.num_added
    with zipfile.ZipFile(tmp_path / "m.zip") as saved:
        assert "_excluded_save_params" not in json.loads(saved.read("data"))  # the hook is not saved
    model.learn(5, reset_num_timesteps=False)  # its first add commits once more, then the cadence again
    with mmreplay.Store.open(path, mode="r") as reader:
        assert reader.num_added == steps + 1 < model.num_timesteps
    model.replay_buffer.close()
