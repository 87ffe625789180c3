"""``Store.rollback``: back to a checkpoint's step count, crash-safe, and the SB3 resume that uses it."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import IMG, frame
from mmreplay import Prioritized
from mmreplay.errors import ReadOnlyError
from mmreplay.storage.durability.commit import CommitWatcher
from reference import ReferenceReplay, assert_batch_matches

STREAMS = 2
K = 4  # frame stack


def steps(n: int, seed: int = 0) -> list[tuple]:
    """``n`` transitions of ``STREAMS`` interleaved streams (episodes of 5-40 steps):
    ``(stream, obs, action, reward, next_obs, terminated, truncated)``; frame values name the step."""
    rng = np.random.default_rng(seed)
    out, value, left = [], {s: 1000 * s for s in range(STREAMS)}, {}
    for i in range(n):
        s = i % STREAMS
        if left.get(s, 0) == 0:
            left[s] = int(rng.integers(5, 40))
        left[s] -= 1
        end = left[s] == 0
        out.append((s, frame(value[s]), int(rng.integers(3)), float(rng.integers(-1, 2)), frame(value[s] + 1),
                    end and i % 3 == 0, end and i % 3 != 0))
        value[s] += 3 if end else 1  # an episode's next start is a new frame
    return out


def add_all(store, ref, rows) -> None:
    for s, o, a, r, n, term, trunc in rows:
        store.add(o, a, r, n, term, trunc, stream=s)
        ref.add(s, o, a, r, n, term, trunc)


def check_all(store, ref) -> None:
    """Every valid transition of ``store`` equals ``ref``'s, and ``len`` counts exactly them."""
    oldest, head = store.inspect.valid_range()
    assert head == len(ref.transitions)
    valid = [g for g in ref.valid_ids(oldest) if g < head]
    assert len(store) == len(valid)
    assert_batch_matches(store.inspect.get(valid), ref, valid)


def reference_of(rows, k=K, capacity=200) -> ReferenceReplay:
    ref = ReferenceReplay(k, capacity)
    for s, o, a, r, n, term, trunc in rows:
        ref.add(s, o, a, r, n, term, trunc)
    return ref


def test_rollback_drops_the_newest_transitions_and_keeps_every_other_row(make_store):
    store = make_store(capacity=200, frame_stack=K)
    rows = steps(600)  # the ring wrapped: [oldest, head) is the newest laps' shards
    ref = ReferenceReplay(K, 200)
    add_all(store, ref, rows)
    oldest = store.inspect.valid_range()[0]
    assert store.rollback(560) == 40
    assert store.num_added == 560 and store.inspect.valid_range() == (oldest, 560)
    check_all(store, reference_of(rows[:560]))
    batch = store.sample(128, seed=1)
    assert int(batch.indices.max()) < 560
    assert_batch_matches(batch, ref, batch.indices.tolist())
    assert store.rollback(560) == 0  # already there: nothing changes


def test_rollback_then_add_and_reopen_starts_a_new_episode_per_stream(make_store, store_path):
    store = make_store(capacity=200, frame_stack=K)
    rows = steps(500)
    add_all(store, ReferenceReplay(K, 200), rows)
    cut = 470
    tails = {s: rows[g][4] for g in range(cut) for s in [rows[g][0]]}  # each stream's last next obs kept
    store.rollback(cut)
    assert all(store.inspect.stream_tail(s) is None for s in range(STREAMS))
    ref = reference_of(rows[:cut])
    ref.episodes.clear()  # what the rollback promises: each stream's next add starts an episode
    # each stream continues with its kept tail: without the reset these adds would continue episodes
    more = []
    for i in range(60):
        s = i % STREAMS
        obs = tails[s] if i < STREAMS else more[-STREAMS][4]
        more.append((s, obs, 1, 0.0, frame(200 + i), False, False))
    add_all(store, ref, more)
    check_all(store, ref)
    store.close()
    with mmreplay.Store.open(store_path) as again:
        check_all(again, ref)
        assert again.num_added == cut + 60
        again.add(more[-2][4], 0, 1.0, frame(7), True, False, stream=0)  # continues: the stream is live
        ref.add(0, more[-2][4], 0, 1.0, frame(7), True, False)
        check_all(again, ref)


def test_rollback_refuses_values_it_cannot_reach_naming_the_range(make_store, store_path):
    store = make_store(capacity=200, frame_stack=K)
    add_all(store, ReferenceReplay(K, 200), steps(600))
    oldest = store.inspect.valid_range()[0]
    with pytest.raises(ValueError, match=rf"num_added=601\).*\[{oldest}, 600\]"):
        store.rollback(601)
    with pytest.raises(ValueError, match=rf"num_added={oldest - 1}\).*overwritten.*\[{oldest}, 600\]"):
        store.rollback(oldest - 1)
    for bad in (True, 3.0, "5"):
        with pytest.raises(TypeError, match="integer"):
            store.rollback(bad)
    smp = store.sampler(8, seed=0)
    next(smp)
    with pytest.raises(RuntimeError, match="close the open sampler"):
        store.rollback(590)
    smp.close()
    assert store.num_added == 600
    store.close()
    with mmreplay.Store.open(store_path, mode="r") as reader:
        with pytest.raises(ReadOnlyError):
            reader.rollback(590)


def test_priorities_of_kept_transitions_survive_a_rollback_and_a_reopen(make_store, store_path):
    store = make_store(capacity=200, frame_stack=K)
    add_all(store, ReferenceReplay(K, 200), steps(400))
    smp = store.sampler(16, Prioritized(), seed=0)
    batch = next(smp)
    ids = np.unique(batch.indices.numpy())
    values = np.arange(1, ids.size + 1, dtype=np.float32)
    smp.update_priorities(ids, values)
    smp.close()
    cut = int(ids.max())  # drops the newest updated id and everything after it
    store.rollback(cut)
    kept = ids < cut
    np.testing.assert_allclose(store.inspect.priorities().of(ids[kept]), values[kept])
    smp = store.sampler(16, Prioritized(), seed=1)
    assert int(next(smp).indices.max()) < cut
    smp.close()
    store.close()
    with mmreplay.Store.open(store_path) as again:
        np.testing.assert_allclose(again.inspect.priorities().of(ids[kept]), values[kept])
        batch = next(again.sampler(64, Prioritized(), seed=2))
        assert int(batch.indices.max()) < cut


CRASH = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {tests!r})
    import mmreplay
    from mmreplay import store as store_module
    from mmreplay.storage.durability import commit
    where = {where!r}
    real = commit.write_commit
    def write_commit(root, record, durable=True):
        if record["head"] == {cut} and where == "before the record":
            os._exit(9)
        real(root, record, durable=durable)
    commit.write_commit = write_commit
    if where == "after the record":
        store_module.Store._reload_committed = lambda self: os._exit(9)
    from test_rollback import steps
    store = mmreplay.Store.open({path!r})
    for s, o, a, r, n, term, trunc in steps({total})[{start}:]:
        store.add(o, a, r, n, term, trunc, stream=s)
    store.rollback({cut})
    os._exit(0)
""")


@pytest.mark.parametrize("where", ["before the record", "after the record"])
def test_a_crash_during_rollback_leaves_the_old_or_the_new_state(make_store, store_path, where):
    store = make_store(capacity=200, frame_stack=K)
    rows = steps(400)
    add_all(store, ReferenceReplay(K, 200), rows[:300])
    store.close()
    code = CRASH.format(tests=os.path.dirname(__file__), where=where, cut=350, path=store_path, total=400,
                        start=300)
    rc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert rc.returncode == 9, rc.stderr
    with mmreplay.Store.open(store_path) as again:
        # the 100 adds were committed by the rollback's first step: either all 400 or the 350 kept
        assert again.num_added == (400 if where == "before the record" else 350)
        check_all(again, reference_of(rows[:again.num_added]))


def test_a_reader_never_mixes_the_histories_before_and_after_a_rollback(make_store, store_path):
    store = make_store(capacity=200, frame_stack=K)
    rows = steps(400)
    add_all(store, ReferenceReplay(K, 200), rows)
    store.flush()
    reader = mmreplay.Store.open(store_path, mode="r")
    try:
        watcher = CommitWatcher(store_path)
        watcher.newest()
        newest_frame = store.inspect.num_frames - 1
        assert watcher.still_valid(390, newest_frame)
        store.rollback(360)
        ref = reference_of(rows[:360])
        ref.episodes.clear()
        replaced = [(s, frame(90 + i), 2, 1.0, frame(91 + i), False, False) for i, (s, *_) in enumerate(rows[360:])]
        add_all(store, ref, replaced)  # ids 360..399 again, other data
        store.flush()
        assert not watcher.still_valid(390, newest_frame)  # nothing read before the rollback is trusted
        watcher.close()
        # the reader loaded the old history; a get of the rewritten ids reloads and returns the new one
        ids = list(range(370, 400))
        assert_batch_matches(reader.inspect.get(ids), ref, ids)
        reader.refresh()
        check_all(reader, ref)
    finally:
        reader.close()


def test_a_rollback_while_a_reader_loads_a_commit_leaves_it_holding_nothing_until_it_reloads(make_store,
                                                                                              store_path):
    store = make_store(capacity=200, frame_stack=K)
    rows = steps(400)
    add_all(store, ReferenceReplay(K, 200), rows[:380])
    store.flush()
    reader = mmreplay.Store.open(store_path, mode="r")
    add_all(store, ReferenceReplay(K, 200), rows[380:])
    store.flush()  # the commit the reader will load
    ref = reference_of(rows[:350])
    ref.episodes.clear()
    replaced = [(s, frame(90 + i), 2, 1.0, frame(91 + i), False, False) for i, (s, *_) in enumerate(rows[350:])]
    state = reader._state
    load_files = state.reload

    def rolled_back_meanwhile(record, **how):  # the writer rolls back and rewrites while the reader reads files
        load_files(record, **how)
        state.reload = load_files
        store.rollback(350)
        add_all(store, ref, replaced)
        store.flush()

    state.reload = rolled_back_meanwhile
    try:
        assert reader.refresh()
        oldest, head = reader.inspect.valid_range()
        assert oldest == head  # what it loaded may mix two histories: it holds nothing
        ids = list(range(360, 400))
        assert_batch_matches(reader.inspect.get(ids), ref, ids)  # the next read loads the new history
        check_all(reader, ref)
    finally:
        reader.close()


sb3 = pytest.importorskip("stable_baselines3")


def _dqn(env, path, **buffer_kw):
    from stable_baselines3 import DQN
    from mmreplay.integrations.sb3 import MMReplayBuffer

    return DQN("MlpPolicy", env, replay_buffer_class=MMReplayBuffer,
               replay_buffer_kwargs=dict(path=path, **buffer_kw), learning_starts=50, train_freq=50,
               gradient_steps=1, batch_size=32, policy_kwargs=dict(net_arch=[16]), seed=0)


@pytest.mark.usefixtures("one_torch_thread")
@pytest.mark.parametrize("roll_back", [True, False])
def test_sb3_resume_from_a_checkpoint_matches_its_step_count(tmp_path, roll_back):
    import gymnasium as gym
    from stable_baselines3 import DQN

    path, env = str(tmp_path / "run.mmr"), gym.make("CartPole-v1")
    model = _dqn(env, path, rollback_to_checkpoint=roll_back)
    model.learn(200)
    model.save(tmp_path / "ckpt")  # the checkpoint: 200 steps
    kept = model.replay_buffer.store.inspect.get(np.arange(200))
    model.learn(150, reset_num_timesteps=False)  # then the run goes on and dies at 350
    model.replay_buffer.close()
    assert mmreplay.Store.open(path, mode="r").num_added == 350

    if roll_back:
        again = DQN.load(tmp_path / "ckpt", env=env)
    else:
        with pytest.warns(RuntimeWarning, match="150 more than the model's num_timesteps=200"):
            again = DQN.load(tmp_path / "ckpt", env=env)
    store = again.replay_buffer.store
    assert again.num_timesteps == 200
    assert store.num_added == (200 if roll_back else 350)
    if not roll_back:
        from mmreplay.integrations.sb3 import rollback_to_checkpoint
        assert rollback_to_checkpoint(again) == 150
    again.learn(100, reset_num_timesteps=False)
    assert again.num_timesteps == store.num_added == len(store) == 300
    same = store.inspect.get(np.arange(200))
    for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated"):
        assert bool((getattr(same, name) == getattr(kept, name)).all()), name
    again.replay_buffer.close()
