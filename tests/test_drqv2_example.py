"""examples/drqv2_dmc.py: a tiny run trains from the store, saves, and resumes from its checkpoint even
when a crashed run left the store ahead of it. With dm_control rendering (EGL), on a real task; everywhere,
with a fake renderer in its place: runs SIGKILLed before and after their first checkpoint go on, with or
without ``--resume``, and the docstring's quick check runs updates with the default settings."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")

import mmreplay  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import drqv2_dmc  # noqa: E402

TINY = ["--domain", "cartpole", "--task", "swingup", "--seed-steps", "30", "--update-every", "15",
        "--batch", "32", "--hidden", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def renders():
    pytest.importorskip("dm_control", reason="dm_control is not installed (pip install dm_control)")
    try:
        from dm_control import suite

        suite.load("cartpole", "swingup").physics.render(84, 84, camera_id=0)
    except Exception as exc:  # no EGL (nor MUJOCO_GL=osmesa) on this machine
        pytest.skip(f"dm_control cannot render here with MUJOCO_GL={os.environ['MUJOCO_GL']}: {exc}")


@pytest.mark.usefixtures("renders", "one_torch_thread")
def test_drqv2_example_trains_saves_and_resumes_past_a_crash(tmp_path):
    run_dir = str(tmp_path / "drqv2")
    first = drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "60", *TINY]))
    assert first["step"] == first["num_added"] == first["len"] == 60
    assert set(first["losses"]) == {"critic_loss", "actor_loss", "q"}  # it trained from stacked batches
    path = os.path.join(run_dir, "replay.mmr")
    with mmreplay.Store.open(path) as store:
        assert store.schema.observations[0].shape == (3, 84, 84) and store.frame_stack == 3
        assert store.capacity == 1_000_000 and store.app_meta == {"step": 60}
        batch = store.sample(4, seed=0)
        assert tuple(batch.obs.shape) == (4, 3, 3, 84, 84)
        frame = np.zeros((3, 84, 84), np.uint8)
        for _ in range(7):  # a run that crashed after the checkpoint left these behind
            store.add(frame, np.zeros(1, np.float32), 0.0, frame, False, False)
    again = drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "90", "--resume", *TINY]))
    assert again["step"] == again["num_added"] == 90  # rolled back to 60, then 30 more
    with mmreplay.Store.open(path, mode="r") as store:
        assert len(store) == 90
        assert store.inspect.read_column("action", 60, 67).any(axis=1).all()  # the env's steps, not the left-overs
        assert bool(store.inspect.get(np.arange(60, 67)).obs.any())


# -- with a fake renderer: the checkpoints, whatever kills the run ---------------------------------------

class FakeDMC:
    """``PixelDMC``'s interface without dm_control: ``(3, 84, 84)`` frames that name their episode and
    step, a 1-D action, episodes truncated after 25 steps."""

    def __init__(self, domain, task, seed, repeat=2, size=84):
        self.size, self.action_dim, self.episode, self.t = size, 1, seed * 1000, 0

    def _frame(self):
        frame = np.full((3, self.size, self.size), (self.episode * 7 + self.t) % 251 + 1, np.uint8)
        frame[:, 0, :2] = [self.episode % 256, self.t]
        return frame

    def reset(self):
        self.episode, self.t = self.episode + 1, 0
        return self._frame()

    def step(self, action):
        self.t += 1
        return self._frame(), float(action[0]), False, self.t == 25


FAKE = ["--seed-steps", "30", "--update-every", "15", "--batch", "32", "--hidden", "32", "--threads", "1",
        "--checkpoint-every", "20", "--capacity", "10000"]
CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path[:0] = [sys.argv[1], sys.argv[2]]
    import drqv2_dmc
    from test_drqv2_example import FakeDMC

    kill_at = int(sys.argv[3])

    class Killed(FakeDMC):  # SIGKILLed in its kill_at-th env step: no close, no atexit, as a crash
        steps = 0

        def step(self, action):
            Killed.steps += 1
            if Killed.steps == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return super().step(action)

    drqv2_dmc.PixelDMC = Killed
    drqv2_dmc.run(drqv2_dmc.parse_args(sys.argv[4:]))
""")


def killed_run(run_dir: str, kill_at: int, *args: str) -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", CHILD, os.path.join(here, "..", "examples"), here, str(kill_at),
                           "--dir", run_dir, *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-3000:]


@pytest.fixture
def fake_env(monkeypatch):
    monkeypatch.setattr(drqv2_dmc, "PixelDMC", FakeDMC)


@pytest.mark.usefixtures("fake_env", "one_torch_thread")
def test_a_first_run_killed_before_its_first_checkpoint_is_started_over_by_a_rerun(tmp_path):
    run_dir = str(tmp_path / "run")
    killed_run(run_dir, 15, "--steps", "60", *FAKE)
    assert os.path.exists(os.path.join(run_dir, "replay.mmr")) and not os.path.exists(os.path.join(run_dir, "agent.pt"))
    again = drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "60", *FAKE]))  # a plain rerun
    assert again["step"] == again["num_added"] == again["len"] == 60  # started over, not 15 + 60
    assert set(again["losses"]) == {"critic_loss", "actor_loss", "q"}
    os.remove(os.path.join(run_dir, "agent.pt"))  # as if that rerun was killed before its checkpoint too
    with_resume = drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "30", "--resume", *FAKE]))
    assert with_resume["step"] == with_resume["num_added"] == 30  # --resume with nothing to resume: over again


@pytest.mark.usefixtures("fake_env", "one_torch_thread")
def test_a_run_killed_after_a_checkpoint_resumes_from_it(tmp_path):
    run_dir = str(tmp_path / "run")
    path = os.path.join(run_dir, "replay.mmr")
    killed_run(run_dir, 47, "--steps", "60", *FAKE)  # checkpoints at steps 20 and 40, killed in step 47
    with mmreplay.Store.open(path, mode="r") as store:  # the checkpoint committed the store with it
        assert store.num_added >= 40 and store.app_meta == {"step": 40}
        kept = store.inspect.get(np.arange(40))
    with pytest.raises(SystemExit, match="pass --resume"):  # a checkpointed run is never started over by mistake
        drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "90", *FAKE]))
    again = drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", run_dir, "--steps", "90", "--resume", *FAKE]))
    assert again["step"] == again["num_added"] == again["len"] == 90  # 40 from the checkpoint, then 50 more
    with mmreplay.Store.open(path, mode="r") as store:
        same = store.inspect.get(np.arange(40))
        assert all(bool((getattr(same, k) == getattr(kept, k)).all()) for k in ("obs", "next_obs", "action", "reward"))
        assert store.inspect.read_column("action", 40, 90).shape == (50, 1)
    assert not os.path.exists(os.path.join(run_dir, "agent.pt.tmp"))


@pytest.mark.usefixtures("fake_env")
def test_the_docstrings_quick_check_runs_updates_with_the_default_settings(tmp_path, monkeypatch):
    """``--steps 500 --seed-steps 250`` with every other setting at its default updates from the store (the
    updates themselves are counted, not run: batches of 256 through the encoder cost seconds here)."""
    assert "``--steps 500 --seed-steps 250`` checks the whole path" in drqv2_dmc.__doc__
    updates = []
    monkeypatch.setattr(drqv2_dmc.DrQV2, "update", lambda self, batch, std: updates.append(batch.obs.shape) or {})
    args = drqv2_dmc.parse_args(["--dir", str(tmp_path / "quick"), "--steps", "500", "--seed-steps", "250",
                                 "--capacity", "10000"])
    assert drqv2_dmc.run(args)["step"] == 500
    assert len(updates) == 13 and updates[0] == (256, 3, 3, 84, 84)  # steps 260, 280, ..., 500
    updates.clear()
    drqv2_dmc.run(drqv2_dmc.parse_args(["--dir", str(tmp_path / "default"), "--steps", "500", "--capacity", "10000"]))
    assert updates == []  # what the docstring says of --steps 500 with the default --seed-steps 1000
