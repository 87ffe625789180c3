"""Dopamine replay checkpoints (the DQN Replay Dataset's format) to and from a store.

The reference here is Dopamine's own sampling rules (``OutOfGraphReplayBuffer.is_valid_transition`` and
``sample_transition_batch`` with update_horizon 1), re-implemented on the checkpoint arrays as ``np.load``
reads them; the fixture comes from scripts/make_dqn_replay_fixture.py (tests/data/dqn_replay: two
checkpoints of 500 rows, real Atari frames, saved as Dopamine saves them).
"""

from __future__ import annotations

import gzip
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest

from mmreplay import Uniform
from mmreplay.datasets.dqn_replay import import_dqn_replay
from mmreplay.datasets.dqn_replay_export import export_dqn_replay
from mmreplay.datasets.npy_stream import NpyFormatError
from mmreplay.store import Store

HERE = os.path.dirname(__file__)
FIXTURE = os.path.join(HERE, "data", "dqn_replay")
NAMES = ("$store$_observation", "$store$_action", "$store$_reward", "$store$_terminal", "add_count", "invalid_range")


def _generator():
    spec = importlib.util.spec_from_file_location(
        "make_dqn_replay_fixture", os.path.join(HERE, "..", "scripts", "make_dqn_replay_fixture.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load(directory, n):
    out = {}
    for name in NAMES:
        with gzip.open(os.path.join(directory, f"{name}_ckpt.{n}.gz")) as f:
            out[name.removeprefix("$store$_")] = np.load(f, allow_pickle=False)
    return out


# -- Dopamine's sampling rules, update_horizon = 1 ---------------------------------------------------
def dopamine_valid(ckpt, k=4, h=1):
    """The indices ``sample_index_batch`` can return for this checkpoint."""
    term = ckpt["terminal"]
    cap, count = term.shape[0], int(ckpt["add_count"])
    cursor, full = count % cap, count >= cap
    invalid = {(cursor - h + i) % cap for i in range(k + h)}
    valid = []
    for index in range(cap):
        if not full and (index >= cursor - h or index < k - 1):
            continue
        if index in invalid:
            continue
        if term[[(index - j) % cap for j in range(k - 1, 0, -1)]].any():
            continue
        valid.append(index)
    return valid


def dopamine_transition(ckpt, index, k=4):
    """``sample_transition_batch(indices=[index])``'s state, action, reward, next_state, terminal, with the
    stack axis first (Dopamine moves it last)."""
    cap = ckpt["terminal"].shape[0]
    stack = lambda i: ckpt["observation"][[(i - j) % cap for j in range(k - 1, -1, -1)]]
    return (stack(index), int(ckpt["action"][index]), float(ckpt["reward"][index]), stack((index + 1) % cap),
            bool(ckpt["terminal"][index]))


def run_rows(ckpt):
    """(global run row, physical index) of every row the checkpoint holds, oldest first."""
    cap, count = ckpt["terminal"].shape[0], int(ckpt["add_count"])
    first = max(0, count - cap)
    return [(g, g % cap) for g in range(first, count)]


def store_ids(directory, numbers):
    """Run row -> store transition id: the store holds the run's real (non-padding) rows in order, one
    transition each (the fixture's real frames are never all zero; padding rows are)."""
    rows = {}
    for n in numbers:
        ckpt = load(directory, n)
        for g, p in run_rows(ckpt):
            rows[g] = bool(ckpt["observation"][p].any())
    real = [g for g in sorted(rows) if rows[g]]
    return {g: i for i, g in enumerate(real)}


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    path = tmp_path_factory.mktemp("dqn") / "store"
    summary = import_dqn_replay(FIXTURE, path)
    return path, summary


def test_fixture_is_as_dopamine_saves_it(tmp_path):
    with gzip.open(os.path.join(FIXTURE, "$store$_observation_ckpt.0.gz")) as f:
        assert np.lib.format.read_magic(f) == (1, 0)
    for n in (0, 1):
        ckpt = load(FIXTURE, n)
        assert ckpt["observation"].shape == (500, 84, 84) and ckpt["observation"].dtype == np.uint8
        assert ckpt["action"].dtype == np.int32 and ckpt["reward"].dtype == np.float32
        assert ckpt["terminal"].dtype == np.uint8 and ckpt["add_count"].shape == ()
    assert [int(load(FIXTURE, n)["add_count"]) for n in (0, 1)] == [700, 1200]
    # The committed files are what the generator writes (it is the fixture's only source).
    _generator().make_fixture(tmp_path)
    for n in (0, 1):
        fresh, committed = load(tmp_path, n), load(FIXTURE, n)
        for name in fresh:
            assert np.array_equal(fresh[name], committed[name]), name


def test_every_dopamine_sample_is_the_stores(imported):
    path, summary = imported
    ids = store_ids(FIXTURE, (0, 1))
    with Store.open(path, "r") as store:
        assert store.frame_stack == 4 and store.schema.stack_padding == "zeros"
        assert summary["transitions"] == store.num_added == len(ids) - 1  # the newest row waits (pending)
        assert store.schema.reward.kind == "packed" and store.schema.action.kind == "packed"
        covered = set()
        checked = terminals = 0
        for n in (0, 1):
            ckpt = load(FIXTURE, n)
            by_index = {p: g for g, p in run_rows(ckpt)}
            valid = dopamine_valid(ckpt)
            tid = np.array([ids[by_index[i]] for i in valid])
            batch = store.inspect.get(tid)
            for row, index in enumerate(valid):
                state, action, reward, next_state, terminal = dopamine_transition(ckpt, index)
                assert np.array_equal(batch.obs[row].numpy(), state), (n, index)
                assert np.array_equal(batch.next_obs[row].numpy(), next_state), (n, index)
                assert int(batch.action[row]) == action and float(batch.reward[row]) == reward
                assert bool(batch.terminated[row]) == terminal and not bool(batch.truncated[row])
                terminals += terminal
            covered.update(tid.tolist())
            checked += len(valid)
        assert checked > 900 and terminals >= 10
        # What the store holds beyond Dopamine's samples: the rows its invalid_range leaves out around each
        # checkpoint's cursor (the oldest rows of the first; the boundary between the two, where row 699
        # is the newest of checkpoint 0 and 700-703 the oldest of checkpoint 1).
        extra = sorted(set(range(store.num_added)) - covered)
        by_id = {i: g for g, i in ids.items()}
        assert [by_id[i] for i in extra] == [200, 201, 202, 203, 699, 700, 701, 702, 703]


def test_uniform_samples_come_from_the_checkpoints(imported):
    path, _ = imported
    ids = store_ids(FIXTURE, (0, 1))
    run = {}
    for n in (0, 1):
        ckpt = load(FIXTURE, n)
        for g, p in run_rows(ckpt):
            run[g] = (ckpt["observation"][p], int(ckpt["action"][p]))
    by_id = {i: g for g, i in ids.items()}
    with Store.open(path, "r") as store:
        idx, _ = store.inspect.draw(Uniform(), 256, np.random.default_rng(1))
        batch = store.inspect.get(idx)
        for row, i in enumerate(idx.tolist()):
            g = by_id[i]
            assert np.array_equal(batch.obs[row, -1].numpy(), run[g][0]) and int(batch.action[row]) == run[g][1]


@pytest.mark.parametrize("save_at", [(700, 1200), (300, 800), (700, 1300), (700, 1100)],
                         ids=["contiguous", "unwrapped-first", "gap", "overlap"])
def test_round_trip_gives_back_the_arrays(tmp_path, save_at):
    src = FIXTURE if save_at == (700, 1200) else str(tmp_path / "src")
    if src != FIXTURE:
        _generator().make_fixture(src, save_at=save_at, seed=3)
    import_dqn_replay(src, tmp_path / "store", block_bytes=64 * 7056)  # small blocks: many block edges
    with Store.open(tmp_path / "store", "r") as store:
        summary = export_dqn_replay(store, tmp_path / "out", block_rows=100)
    assert summary["checkpoints"] == [0, 1]
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(src))
    for n in (0, 1):
        a, b = load(src, n), load(tmp_path / "out", n)
        for name in a:
            assert a[name].dtype == b[name].dtype and np.array_equal(a[name], b[name]), (save_at, n, name)


def test_export_of_a_recorded_store_reimports(tmp_path):
    """A store that was not imported: episodes laid out as Dopamine adds them (padding before each)."""
    from gymnasium import spaces

    frames = np.load(os.path.join(HERE, "data", "atari_fixture.npz"))["frames"][:200]
    with Store.create(tmp_path / "rec", spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=None,
                      frame_stack=4, stack_padding="zeros", reward_values=[-1, 0, 1]) as store:
        for lo, hi in ((0, 60), (61, 140), (141, 199)):
            n = hi - lo
            term = np.zeros(n, bool)
            term[-1] = True
            nxt = frames[lo + 1: hi + 1].copy()
            nxt[-1] = 0  # the format keeps no final observation: zero, as an import makes it
            store.extend(frames[lo:hi], np.arange(n) % 6, np.zeros(n, np.float32), nxt, term, np.zeros(n, bool),
                         streams=np.zeros(n, int))
    with Store.open(tmp_path / "rec", "r") as store:
        export_dqn_replay(store, tmp_path / "out", capacity=128)
        count = store.num_added
    assert sorted(int(load(tmp_path / "out", n)["add_count"]) for n in (0, 1)) == [128, count + 9]
    import_dqn_replay(tmp_path / "out", tmp_path / "back")
    with Store.open(tmp_path / "rec", "r") as a, Store.open(tmp_path / "back", "r") as b:
        assert b.num_added == a.num_added
        x, y = a.inspect.get(np.arange(count)), b.inspect.get(np.arange(count))
        for field in ("obs", "next_obs", "action", "reward", "terminated"):
            assert np.array_equal(getattr(x, field).numpy(), getattr(y, field).numpy()), field


def _gz_npy(path, header: dict, body: bytes = b""):
    buf = io.BytesIO()
    np.lib.format.write_array_header_1_0(buf, header)
    with gzip.open(path, "wb") as f:
        f.write(buf.getvalue() + body)


def test_hostile_header_fails_fast(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    obs = src / "$store$_observation_ckpt.1.gz"
    for shape, expect in (((1 << 40, 84, 84), "rows"), ((500, 1 << 20, 1 << 20), "bytes"), ((500, 84), "dimension")):
        _gz_npy(obs, {"descr": "|u1", "fortran_order": False, "shape": shape})
        start = time.monotonic()
        with pytest.raises(NpyFormatError, match=expect) as err:
            import_dqn_replay(src, tmp_path / "store")
        assert "checkpoint 1 observation" in str(err.value) and time.monotonic() - start < 10
        assert not os.path.exists(tmp_path / "store")
    _gz_npy(obs, {"descr": "|O", "fortran_order": False, "shape": (500, 84, 84)})
    with pytest.raises(NpyFormatError, match="dtype"):
        import_dqn_replay(src, tmp_path / "store")
    # a header that declares more rows than the stream holds: named, nothing left behind
    _gz_npy(obs, {"descr": "|u1", "fortran_order": False, "shape": (500, 84, 84)}, b"\1" * (84 * 84 * 10))
    with pytest.raises(NpyFormatError, match="truncated"):
        import_dqn_replay(src, tmp_path / "store")
    assert not os.path.exists(tmp_path / "store")
    assert [p for p in os.listdir(tmp_path) if p.startswith("store")] in ([], [p for p in os.listdir(tmp_path)
                                                                                 if p.startswith("store.importing")])


def test_special_files_are_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    os.unlink(src / "$store$_terminal_ckpt.1.gz")
    os.mkfifo(src / "$store$_terminal_ckpt.1.gz")  # opening it would block forever
    with pytest.raises(NpyFormatError, match="not a regular file"):
        import_dqn_replay(src, tmp_path / "store")


def test_padding_that_is_not_zero_is_refused(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    ckpt = load(src, 0)
    term = np.flatnonzero(ckpt["terminal"])[2]
    ckpt["action"][(term + 2) % 500] = 3  # a padding row with an action: not Dopamine's stack_size-4 padding
    with open(src / "$store$_action_ckpt.0.gz", "wb") as f, gzip.GzipFile(fileobj=f, mode="wb") as out:
        np.save(out, ckpt["action"], allow_pickle=False)
    with pytest.raises(NpyFormatError, match="padding"):
        import_dqn_replay(src, tmp_path / "store")


def test_wrong_frame_stack_is_refused():
    with pytest.raises(ValueError, match="stack_size 4"):
        import_dqn_replay(FIXTURE, "/nonexistent/never-made", frame_stack=3)


KILLER = """
import os, signal, sys
from mmreplay.datasets.dqn_replay import import_dqn_replay
def progress(done, total):
    if done >= int(sys.argv[3]):
        os.kill(os.getpid(), signal.SIGKILL)
import_dqn_replay(sys.argv[1], sys.argv[2], progress=progress, commit_rows=50, block_bytes=40 * 7056)
"""


@pytest.mark.parametrize("kill_at", [330, 501], ids=["mid-checkpoint", "at-checkpoint-end"])
def test_killed_import_resumes_to_the_same_store(tmp_path, kill_at, imported):
    whole = imported[0]  # imported in one go, with the default block size and commit interval
    out = tmp_path / "resumed"
    proc = subprocess.run([sys.executable, "-c", KILLER, FIXTURE, str(out), str(kill_at)], capture_output=True)
    assert proc.returncode == -9, proc.stderr.decode()[-2000:]
    assert not os.path.exists(out)  # nothing opens as data
    left = [p for p in os.listdir(tmp_path) if p.startswith("resumed.importing-")]
    assert len(left) == 1
    with Store.open(tmp_path / left[0], "r") as partial:
        state = partial.app_meta["dqn_replay"]
        assert 0 < partial.num_added == state["transitions"] < 948 and not state["complete"]
        if kill_at == 501:  # killed before checkpoint 1's first commit: its newest row waits in the state
            assert state["checkpoints"][0]["done"] and state["pending"]["global"] == 699
    summary = import_dqn_replay(FIXTURE, out, resume=True, commit_rows=50, block_bytes=40 * 7056)
    assert summary["resumed"] and any("continued" in note for note in summary["notes"])
    assert not [p for p in os.listdir(tmp_path) if ".importing-" in p]
    with Store.open(whole, "r") as a, Store.open(out, "r") as b:
        assert a.num_added == b.num_added == 948
        ids = np.arange(a.num_added)
        x, y = a.inspect.get(ids), b.inspect.get(ids)
        for field in ("obs", "next_obs", "action", "reward", "terminated", "truncated"):
            assert np.array_equal(getattr(x, field).numpy(), getattr(y, field).numpy()), field
        assert a.app_meta["dqn_replay"] == b.app_meta["dqn_replay"]
    with Store.open(out, "r") as b:  # and the export of the resumed store is the source again
        export_dqn_replay(b, tmp_path / "out")
    for n in (0, 1):
        a, b = load(FIXTURE, n), load(tmp_path / "out", n)
        assert all(np.array_equal(a[k], b[k]) for k in a)


def test_resume_without_a_leftover_starts_over(tmp_path):
    summary = import_dqn_replay(FIXTURE, tmp_path / "store", resume=True, checkpoints="1")
    assert not summary["resumed"] and summary["checkpoints"] == [1]


def test_checkpoint_selection():
    from mmreplay.datasets.dopamine_files import parse_checkpoints

    assert parse_checkpoints("0,1,5-7", range(10)) == [0, 1, 5, 6, 7]
    for bad in ("1-0", "a", "1,,2"):
        with pytest.raises(ValueError, match="0,1,5-9"):
            parse_checkpoints(bad, range(10))
    with pytest.raises(FileNotFoundError, match=r"\[3\]"):
        parse_checkpoints("0,3", [0, 1])


def test_dopamine_reads_our_export_and_we_read_its_save(tmp_path):
    """Against Dopamine's own OutOfGraphReplayBuffer, where dopamine-rl (and TensorFlow) install."""
    crb = pytest.importorskip("dopamine.tf.replay_memory.circular_replay_buffer")
    frames = np.load(os.path.join(HERE, "data", "atari_fixture.npz"))["frames"]
    buf = crb.OutOfGraphReplayBuffer((84, 84), 4, 300, 32)
    rng = np.random.default_rng(0)
    for step in range(450):
        buf.add(frames[step % len(frames)], int(rng.integers(6)), float(rng.choice([-1, 0, 1])), int(step % 57 == 56))
    (tmp_path / "dopa").mkdir()
    buf.save(str(tmp_path / "dopa"), 0)
    import_dqn_replay(tmp_path / "dopa", tmp_path / "store")
    with Store.open(tmp_path / "store", "r") as store:
        ids = store_ids(tmp_path / "dopa", (0,))
        ckpt = load(tmp_path / "dopa", 0)
        by_index = {p: g for g, p in run_rows(ckpt)}
        valid = [i for i in range(300) if buf.is_valid_transition(i)]
        batch = buf.sample_transition_batch(len(valid), valid)
        mine = store.inspect.get([ids[by_index[i]] for i in valid])
        assert np.array_equal(np.moveaxis(batch[0], -1, 1), mine.obs.numpy())
        assert np.array_equal(np.moveaxis(batch[3], -1, 1), mine.next_obs.numpy())
        assert np.array_equal(batch[1], mine.action.numpy()) and np.array_equal(batch[2], mine.reward.numpy())
        assert np.array_equal(batch[6].astype(bool), mine.terminated.numpy())
        export_dqn_replay(store, tmp_path / "out")
    back = crb.OutOfGraphReplayBuffer((84, 84), 4, 300, 32)
    back.load(str(tmp_path / "out"), 0)
    for name in ("observation", "action", "reward", "terminal"):
        assert np.array_equal(back._store[name], buf._store[name]), name
    assert int(back.add_count) == int(buf.add_count)


def test_cli_import_and_export(tmp_path):
    def cli(*args):
        return subprocess.run([sys.executable, "-m", "mmreplay.cli", *args], capture_output=True, text=True, timeout=300)

    done = cli("import", "--format", "dqn-replay", FIXTURE, str(tmp_path / "store"), "--checkpoints", "0-1")
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["transitions"] == 948 and summary["checkpoints"] == [0, 1]
    done = cli("export", "--format", "dqn-replay", str(tmp_path / "store"), str(tmp_path / "out"))
    assert done.returncode == 0, done.stderr
    for n in (0, 1):
        a, b = load(FIXTURE, n), load(tmp_path / "out", n)
        assert all(np.array_equal(a[k], b[k]) for k in a)
    done = cli("import", "--format", "d4rl", FIXTURE, str(tmp_path / "again"), "--resume")
    assert done.returncode != 0 and "--resume: for --format dqn-replay only" in done.stderr


def test_corrupt_gzip_is_named(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    path = src / "$store$_reward_ckpt.0.gz"
    data = bytearray(path.read_bytes())
    data[-8] ^= 0xFF  # the gzip trailer's CRC-32: only reading to the stream's end notices
    path.write_bytes(bytes(data))
    with pytest.raises(NpyFormatError, match=r"checkpoint 0 reward .*corrupt gzip"):
        import_dqn_replay(src, tmp_path / "store")
    obs = src / "$store$_observation_ckpt.1.gz"
    _gz_npy(obs, {"descr": "<u2", "fortran_order": False, "shape": (500, 84, 84)})
    with pytest.raises(NpyFormatError, match="uint8"):
        import_dqn_replay(src, tmp_path / "store", checkpoints="1")


def test_fixture_equals_dopamines_own_save(tmp_path):
    """The generator's rules are Dopamine's: the same steps through OutOfGraphReplayBuffer.save give the
    committed fixture's arrays (where dopamine-rl installs; scripts/checks/check_dqn_replay_with_dopamine.sh)."""
    crb = pytest.importorskip("dopamine.tf.replay_memory.circular_replay_buffer")
    gen = _generator()
    frames = np.load(gen.FIXTURE)["frames"]
    buf = crb.OutOfGraphReplayBuffer((84, 84), 4, 500, 32)
    steps = gen.episodes(np.random.default_rng(0), frames)
    for n, target in enumerate((700, 1200)):
        while buf.add_count < target:
            buf.add(*next(steps))
        buf.save(str(tmp_path), n)
    for n in (0, 1):
        ours, dopamine = load(FIXTURE, n), load(tmp_path, n)
        for name in ours:
            assert ours[name].dtype == dopamine[name].dtype and np.array_equal(ours[name], dopamine[name]), name


def test_cli_says_how_to_resume_a_failed_import(tmp_path):
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    ckpt = load(src, 1)
    term = np.flatnonzero(ckpt["terminal"])[3]
    ckpt["action"][(term + 1) % 500] = 2  # checkpoint 1 is refused after checkpoint 0 was imported
    with open(src / "$store$_action_ckpt.1.gz", "wb") as f, gzip.GzipFile(fileobj=f, mode="wb") as out:
        np.save(out, ckpt["action"], allow_pickle=False)
    done = subprocess.run([sys.executable, "-m", "mmreplay.cli", "import", "--format", "dqn-replay", str(src),
                           str(tmp_path / "store")], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2 and "padding" in done.stderr and "--resume" in done.stderr, done.stderr
    assert not os.path.exists(tmp_path / "store")
    assert [p for p in os.listdir(tmp_path) if p.startswith("store.importing-")]  # kept for --resume
