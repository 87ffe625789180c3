"""examples/drqv2_dmc.py: a tiny run trains from the store, saves, and resumes from its checkpoint even
when a crashed run left the store ahead of it."""

import os
import sys

import numpy as np
import pytest

os.environ.setdefault("MUJOCO_GL", "egl")
pytest.importorskip("dm_control", reason="dm_control is not installed (pip install dm_control)")

import mmreplay  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))
import drqv2_dmc  # noqa: E402

TINY = ["--domain", "cartpole", "--task", "swingup", "--seed-steps", "30", "--update-every", "15",
        "--batch", "32", "--hidden", "32", "--threads", "1"]


@pytest.fixture(scope="module")
def renders():
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
