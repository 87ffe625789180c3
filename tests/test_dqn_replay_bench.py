"""The ``--dqn-replay`` benchmark's own parts (scripts/benchmarks: dqn_data, modes/dqn_replay) on a small pool of
real Atari frames: its checkpoints hold what Dopamine's add/save rules give for the same run (the fixture's
independent ``DopamineLikeBuffer``), a store imported from them equals the ground truth the benchmark checks
rows against (and a wrong truth is caught), and the 1% loader's rows are the run's. Nothing is timed."""

import gzip
import importlib.util
import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "scripts")]

from benchmarks.dqn_data import DopamineRun  # noqa: E402
from benchmarks.modes import dqn_replay as mode  # noqa: E402

from mmreplay.datasets.dqn_replay import import_dqn_replay  # noqa: E402
from mmreplay.store import Store  # noqa: E402

ROWS = 300
NAMES = ("$store$_observation", "$store$_action", "$store$_reward", "$store$_terminal", "add_count", "invalid_range")


def small_pool():
    """640 real frames as 9 episodes (obs_index: every step its own frame), unclipped rewards."""
    frames = np.load(os.path.join(REPO, "mmreplay", "data", "atari_fixture.npz"))["frames"]
    rng = np.random.default_rng(5)
    starts = np.r_[0, np.sort(rng.choice(np.arange(20, 620, 10), 8, replace=False))]
    return {"frames": frames, "obs_index": np.arange(len(frames)), "action": rng.integers(0, 6, len(frames)),
            "reward": rng.choice([-3.0, 0.0, 0.0, 2.5], len(frames)).astype(np.float32), "episode_start": starts}


def fixture_module():
    spec = importlib.util.spec_from_file_location("make_dqn_replay_fixture",
                                                  os.path.join(REPO, "scripts", "make_dqn_replay_fixture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(directory, n):
    out = {}
    for name in NAMES:
        with gzip.open(os.path.join(directory, f"{name}_ckpt.{n}.gz")) as f:
            out[name] = np.load(f, allow_pickle=False)
    return out


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    src = str(tmp_path_factory.mktemp("dopamine"))
    run = DopamineRun(ROWS, small_pool())
    for i in range(3):
        run.write_checkpoint(src, i)
    return run, src


def test_checkpoints_are_what_dopamines_rules_save(written, tmp_path):
    run, src = written
    pool = small_pool()
    buf = fixture_module().DopamineLikeBuffer(ROWS)
    ends = set((np.r_[pool["episode_start"][1:], len(pool["action"])] - 1).tolist())
    step = 0
    for i in range(3):
        while buf.add_count < run.add_count(i):
            j = step % len(pool["action"])
            buf.add(pool["frames"][j], pool["action"][j], np.clip(pool["reward"][j], -1, 1), int(j in ends))
            step += 1
        assert buf.add_count == run.add_count(i)
        buf.save(str(tmp_path), i)
        ours, theirs = load(src, i), load(str(tmp_path), i)
        for name in NAMES:
            assert ours[name].dtype == theirs[name].dtype and ours[name].shape == theirs[name].shape, name
            assert np.array_equal(ours[name], theirs[name]), (i, name)
        assert ours["add_count"] % ROWS != 0  # wrapped in its files, as a long run's checkpoints are


def test_imported_store_is_the_ground_truth(written, tmp_path, monkeypatch):
    run, src = written
    import_dqn_replay(src, tmp_path / "store")
    with Store.open(str(tmp_path / "store"), mode="r") as store:
        assert mode.verify_store(store, run, 8, batch=128) == {"verified": 1024, "wrong": 0}
        first = run.first_row(0)
        monkeypatch.setattr(run, "first_row", lambda i: first + 1)  # truth shifted by one row: caught
        assert mode.verify_store(store, run, 2, batch=128)["wrong"] > 0


def test_a_linked_run_imports_as_its_own_checkpoints_and_is_its_ground_truth(written, tmp_path, monkeypatch):
    """``--dqn-distinct``: 5 checkpoints from the 2 written (links), each imported as its own; every sampled row and
    every stack across a join equal the linked run's truth, and a truth one transition off is caught."""
    from benchmarks.dqn_linked import LinkedRun, link_checkpoints
    run, src = written
    linked = str(tmp_path / "linked")
    link_checkpoints(src, linked, ROWS, 2, 5)
    link_checkpoints(src, linked, ROWS, 2, 5)  # again (a rerun of the bench): kept
    assert os.path.samefile(os.path.join(linked, "$store$_observation_ckpt.4.gz"),
                            os.path.join(src, "$store$_observation_ckpt.0.gz"))
    assert int(load(linked, 4)["add_count"]) == run.add_count(4) != int(load(src, 0)["add_count"])
    truth = LinkedRun(ROWS, 2, 5, small_pool())
    import_dqn_replay(linked, tmp_path / "store")
    with Store.open(str(tmp_path / "store"), mode="r") as store:
        assert store.num_added == truth.starts[-1] - 1  # the last row waits for its next observation
        assert mode.verify_store(store, truth, 8, batch=128) == {"verified": 1024, "wrong": 0}
        joins = truth.checkpoint_starts()[:, None] + np.arange(-6, 6)
        assert mode.verify_rows(store, truth, joins) == {"joins_checked": 48, "joins_wrong": 0}
        monkeypatch.setattr(truth, "starts", truth.starts + 1)  # each checkpoint's rows one transition late
        assert mode.verify_rows(store, truth, joins)["joins_wrong"] > 0


def test_subset_loader_rows_are_the_runs(written):
    run, _ = written
    data = run.subset(500)
    draw, valid = mode.subset_sampler(data, batch=64)
    assert 0 < valid < 500
    g0 = run.first_row(0)
    for _ in range(5):
        obs, action, reward, nxt, terminal, rows = next(draw)
        g = g0 + rows
        assert (run.steps(g) >= 0).all()  # never a padding row
        assert np.array_equal(obs.numpy(), run.frames_of(g[:, None] + np.arange(-3, 1), g0))
        assert np.array_equal(nxt.numpy(), run.frames_of(g[:, None] + np.arange(-2, 2), g0))
        cols = run.columns(g)
        assert np.array_equal(action.numpy(), cols["action"]) and np.array_equal(reward.numpy(), cols["reward"])
        assert np.array_equal(terminal.numpy(), cols["terminal"].astype(bool))


def test_measure_import_reports_the_cli_import(tmp_path):
    from measure_dqn_replay import measure_import
    fixture = os.path.join(REPO, "tests", "data", "dqn_replay")
    rep = measure_import(fixture, str(tmp_path / "store"), "0-1")
    with Store.open(str(tmp_path / "store"), mode="r") as store:
        assert rep["transitions"] == store.num_added > 0
    assert rep["peak_pss_tree_mb"] > 50 and rep["peak_rss_tree_mb"] >= rep["peak_pss_tree_mb"]  # a Python with numpy
    assert rep["cpu_s"] > 0 and rep["store_bytes"] > 0
    # each process's own peak: at least what any one sample of the tree saw of it, never a fork's inherited pages
    assert rep["peak_rss_hwm_sum_mb"] >= 50 and 12 <= rep["index_bytes_per_transition"] <= 16
    with pytest.raises(RuntimeError, match="import failed"):
        measure_import(fixture, str(tmp_path / "store"), "0-1")  # the output exists: the CLI refuses


def test_memory_model_adds_the_index_of_the_rest_of_the_run():
    from benchmarks.modes.dqn_replay import memory_model, report
    part = {"checkpoints": 2, "rows": 1_000_000, "limit_bytes": 4e9, "subset": 500_000, "import": {
        "transitions": 2_000_000, "index_bytes_per_transition": 13.5, "peak_rss_hwm_sum_mb": 400,
        "peak_pss_tree_mb": 300, "seconds": 100, "transitions_per_s": 20_000, "store_bytes_per_transition": 100}}
    model = memory_model(part)
    assert model["transitions"] == 50_000_000
    assert model["rss_mb"] == round(400 + 13.5 * 48_000_000 / 2**20) and model["pss_mb"] == model["rss_mb"] - 100
    assert f"at least: peak RSS ~{model['rss_mb']} MB" in report(part)
    assert memory_model({"checkpoints": 2, "import": {"transitions": 5}}) is None  # an older record: no model
