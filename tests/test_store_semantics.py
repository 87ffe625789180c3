"""The store against a brute-force reference model, and the boundary cases one by one."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import IMG
from reference import ReferenceReplay, assert_batch_matches


def random_frame(rng):
    return rng.integers(0, 256, (6, 5), dtype=np.uint8)


def drive(store_path, rng, *, capacity, frame_stack, steps, n_streams=3, reopen_prob=0.0, p_term=0.03,
          p_trunc=0.02, **create_kw):
    """Random vector-env traffic (random subsets of streams per call, single adds too) into a store and the
    reference, with optional close/reopen in between. Returns the open store and the reference."""
    store = mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=capacity, frame_stack=frame_stack,
                                  reward_values=(-1, 0, 1), durable=False, **create_kw)
    ref = ReferenceReplay(frame_stack, capacity)
    current = {i: random_frame(rng) for i in range(n_streams)}
    for _ in range(steps):
        streams = sorted(rng.choice(n_streams, size=rng.integers(1, n_streams + 1), replace=False).tolist())
        rows = []
        for sid in streams:
            nxt = random_frame(rng)
            term = bool(rng.random() < p_term)
            trunc = bool(not term and rng.random() < p_trunc)
            row = (sid, current[sid], int(rng.integers(0, 3)), float(rng.integers(-1, 2)), nxt, term, trunc)
            rows.append(row)
            ref.add(*row)
            current[sid] = random_frame(rng) if (term or trunc) else nxt
        if len(rows) == 1 and rng.random() < 0.5:
            sid, o, a, r, nx, te, tr = rows[0]
            store.add(o, a, r, nx, te, tr, stream=sid)
        else:
            cols = list(zip(*rows))
            store.extend(np.stack(cols[1]), cols[2], cols[3], np.stack(cols[4]), cols[5], cols[6], streams=cols[0])
        if rng.random() < reopen_prob:
            store.close()
            store = mmreplay.Store.open(store_path, durable=False)
    return store, ref


def check_against_reference(store, ref, exact_oldest=True):
    oldest, head = store.inspect.valid_range()
    assert head == len(ref.transitions)
    if exact_oldest:
        assert oldest == ref.oldest
    else:  # the frame ring, not capacity, was the limit: the store gave up more old transitions
        assert oldest >= ref.oldest
    ids = ref.valid_ids(oldest)
    assert len(store) == len(ids)
    assert_batch_matches(store.inspect.get(ids), ref, ids)


@pytest.mark.parametrize("frame_stack", [1, 2, 4])
@pytest.mark.parametrize("capacity", [64, 300, None])
def test_random_vector_traffic_matches_reference(store_path, frame_stack, capacity):
    rng = np.random.default_rng(frame_stack * 1000 + (capacity or 7))
    store, ref = drive(store_path, rng, capacity=capacity, frame_stack=frame_stack, steps=700, reopen_prob=0.01)
    check_against_reference(store, ref)
    store.close()
    with mmreplay.Store.open(store_path, mode="r") as again:
        check_against_reference(again, ref)


@pytest.mark.parametrize("frame_capacity", [None, 400])
def test_very_short_episodes_and_long_stacks(store_path, frame_capacity):
    # Episodes of ~2 steps need ~2 frames per transition: with the default frame capacity (capacity * 9/8)
    # the frame ring is the limit and old transitions go early; with room for the frames, capacity is.
    rng = np.random.default_rng(5)
    store, ref = drive(store_path, rng, capacity=150, frame_stack=8, steps=600, p_term=0.3, p_trunc=0.2,
                       frame_capacity=frame_capacity)
    check_against_reference(store, ref, exact_oldest=frame_capacity is not None)
    assert len(store) >= (140 if frame_capacity else 50)
    store.close()


def test_samples_are_valid_transitions(store_path):
    rng = np.random.default_rng(1)
    store, ref = drive(store_path, rng, capacity=100, frame_stack=4, steps=400)
    batch = store.sample(64, seed=3)
    valid = set(ref.valid_ids())
    assert set(batch.indices.tolist()) <= valid
    assert_batch_matches(batch, ref, batch.indices.tolist())
    again = store.sample(64, seed=3)
    assert torch_equal(batch.obs, again.obs) and batch.indices.tolist() == again.indices.tolist()
    store.close()


def torch_equal(a, b):
    return bool((a == b).all())


# -- boundary cases, one by one -------------------------------------------------------------------

def frames(n, start=0):
    return [np.full((6, 5), start + i, dtype=np.uint8) for i in range(n)]


def test_stack_padding_repeats_first_frame_of_episode(make_store):
    s = make_store(frame_stack=4)
    f = frames(4)
    s.add(f[0], 0, 0, f[1], False, False)
    s.add(f[1], 1, 1, f[2], False, False)
    b = s.inspect.get([0, 1])
    assert b.obs[0, :, 0, 0].tolist() == [0, 0, 0, 0]
    assert b.next_obs[0, :, 0, 0].tolist() == [0, 0, 0, 1]
    assert b.obs[1, :, 0, 0].tolist() == [0, 0, 0, 1]
    assert b.next_obs[1, :, 0, 0].tolist() == [0, 0, 1, 2]


def test_stacks_never_cross_episode_start_and_terminal_flags_kept(make_store):
    s = make_store(frame_stack=3)
    f = frames(10)
    s.add(f[0], 0, 1, f[1], False, False)
    s.add(f[1], 0, 1, f[2], True, False)  # terminated
    s.add(f[5], 2, -1, f[6], False, False)  # new episode after reset
    b = s.inspect.get([1, 2])
    assert b.terminated.tolist() == [True, False] and b.truncated.tolist() == [False, False]
    assert b.obs[1, :, 0, 0].tolist() == [5, 5, 5]
    assert b.next_obs[1, :, 0, 0].tolist() == [5, 5, 6]


def test_truncated_episode_keeps_final_observation(make_store):
    s = make_store(frame_stack=1)
    f = frames(5)
    s.add(f[0], 0, 0, f[1], False, False)
    s.add(f[1], 0, 0, f[2], False, True)  # time limit: f[2] is needed for bootstrapping
    s.add(f[2], 0, 0, f[3], False, False)  # even a reset that returns the same frame starts a new episode
    b = s.inspect.get([1, 2])
    assert b.truncated.tolist() == [True, False]
    assert b.next_obs[0, 0, 0] == 2 and b.obs[1, 0, 0] == 2


def test_obs_that_does_not_continue_previous_next_obs_starts_an_episode(make_store):
    s = make_store(frame_stack=2)
    f = frames(10)
    s.add(f[0], 0, 0, f[1], False, False)
    s.add(f[7], 0, 0, f[8], False, False)  # the env was reset without a done flag
    b = s.inspect.get([1])
    assert b.obs[0, :, 0, 0].tolist() == [7, 7]


def test_ring_wraps_in_the_middle_of_an_episode(make_store):
    s = make_store(capacity=64, frame_stack=4)
    f = frames(250)
    for i in range(200):  # one long episode, wrapping the ring several times
        s.add(f[i], i % 3, 0, f[i + 1], False, False)
    oldest, head = s.inspect.valid_range()
    assert (oldest, head, len(s)) == (136, 200, 61)  # the first 3 kept lack their stack's predecessors
    b = s.inspect.get([139, 199])
    assert b.obs[0, :, 0, 0].tolist() == [136, 137, 138, 139]
    assert b.next_obs[1, :, 0, 0].tolist() == [197, 198, 199, 200]
    with pytest.raises(IndexError, match="not valid"):
        s.inspect.get([137])


def test_vector_env_streams_interleave_without_mixing(make_store):
    s = make_store(frame_stack=3)
    a, b = frames(10, 0), frames(10, 100)
    for t in range(4):
        s.extend(np.stack([a[t], b[t]]), [0, 1], [0, 0], np.stack([a[t + 1], b[t + 1]]), [False, False],
                 [False, False])
    batch = s.inspect.get([6, 7])  # step 3 of stream 0 and of stream 1
    assert batch.obs[0, :, 0, 0].tolist() == [1, 2, 3]
    assert batch.obs[1, :, 0, 0].tolist() == [101, 102, 103]
    assert batch.next_obs[1, :, 0, 0].tolist() == [102, 103, 104]


def test_frames_are_stored_once(make_store):
    s = make_store(capacity=1000, frame_stack=4)
    f = frames(101)
    for i in range(100):
        s.add(f[i], 0, 0, f[i + 1], i == 99, False)
    assert s.inspect.num_frames == 101  # 100 next observations + the first observation


def test_dict_observations_and_extras(store_path):
    space = spaces.Dict({"pixels": spaces.Box(0, 255, (4, 4, 3), np.uint8), "state": spaces.Box(-1, 1, (3,))})
    extras = [mmreplay.ColumnSpec.numeric("lives", (), "int8")]
    rng = np.random.default_rng(0)
    ref = ReferenceReplay(2, 100, dict_keys=["pixels", "state"])
    with mmreplay.Store.create(store_path, space, spaces.Box(-1, 1, (2,)), capacity=100, frame_stack=2,
                               extras=extras, durable=False) as s:
        obs = space.sample()
        for i in range(150):
            nxt = {"pixels": rng.integers(0, 256, (4, 4, 3), dtype=np.uint8),
                   "state": rng.random(3, dtype=np.float32)}
            act = rng.random(2, dtype=np.float32)
            done = i % 17 == 16
            s.add(obs, act, 0.5, nxt, done, False, extras={"lives": i % 5})
            ref.add(0, obs, act, 0.5, nxt, done, False, extras={"lives": i % 5})
            obs = space.sample() if done else nxt
        ids = ref.valid_ids()
        assert len(s) == len(ids)
        assert_batch_matches(s.inspect.get(ids), ref, ids, dict_keys=["pixels", "state"])


def test_low_dim_float_observations(store_path):
    rng = np.random.default_rng(2)
    space = spaces.Box(-np.inf, np.inf, (4,), np.float32)
    ref = ReferenceReplay(1, None)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(2), capacity=None, durable=False) as s:
        obs = rng.standard_normal(4).astype(np.float32)
        for i in range(3000):
            nxt = rng.standard_normal(4).astype(np.float32)
            done = rng.random() < 0.05
            s.add(obs, i % 2, 1.0, nxt, done, False)
            ref.add(0, obs, i % 2, 1.0, nxt, done, False)
            obs = rng.standard_normal(4).astype(np.float32) if done else nxt
        ids = ref.valid_ids()
        assert_batch_matches(s.inspect.get(ids), ref, ids)
    with mmreplay.Store.open(store_path) as s:
        assert_batch_matches(s.inspect.get(ids), ref, ids)


def test_many_single_adds_without_reads_wrap_rings_correctly(store_path):
    # Regression: pending single adds are appended in blocks; a block longer than the ring once
    # overwrote frames it referenced itself.
    rng = np.random.default_rng(9)
    ref = ReferenceReplay(4, 16)
    with mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=16, frame_stack=4,
                               reward_values=(-1, 0, 1), durable=False) as s:
        obs = random_frame(rng)
        for i in range(500):
            nxt = random_frame(rng)
            done = bool(rng.random() < 0.1)
            s.add(obs, i % 3, 0, nxt, done, False)
            ref.add(0, obs, i % 3, 0, nxt, done, False)
            obs = random_frame(rng) if done else nxt
        check_against_reference(s, ref)


def test_repeated_streams_in_one_extend_are_sequential(make_store):
    s = make_store(frame_stack=3)
    f = frames(10)
    s.extend(np.stack(f[0:3]), [0, 1, 2], [0, 0, 0], np.stack(f[1:4]), [False] * 3, [False] * 3, streams=[5, 5, 5])
    assert s.inspect.num_frames == 4
    assert s.inspect.get([2]).obs[0, :, 0, 0].tolist() == [0, 1, 2]


def test_zero_padding_like_vecframestack(make_store):
    s = make_store(frame_stack=4, stack_padding="zeros")
    f = frames(8, 1)
    s.add(f[0], 0, 0, f[1], False, False)
    s.add(f[1], 0, 0, f[2], False, False)
    b = s.inspect.get([0, 1])
    assert b.obs[0, :, 0, 0].tolist() == [0, 0, 0, 1]
    assert b.next_obs[0, :, 0, 0].tolist() == [0, 0, 1, 2]
    assert b.obs[1, :, 0, 0].tolist() == [0, 0, 1, 2]
    with pytest.raises(ValueError, match="stack_padding must be"):
        mmreplay.Store.create(str(s.path) + "2", IMG, spaces.Discrete(3), stack_padding="ones")


def test_dict_observation_with_a_scalar_key_continues_episodes(store_path):
    """A scalar-shaped key (a Discrete part of a Dict space) across several extends of one stream."""
    space = spaces.Dict({"image": spaces.Box(0, 255, (4, 4), np.uint8), "mode": spaces.Box(0, 9, (), np.int64)})
    with mmreplay.Store.create(store_path, space, spaces.Discrete(2), capacity=100, frame_stack=2,
                               durable=False) as s:
        for t in range(5):
            obs = {"image": np.full((1, 4, 4), t, np.uint8), "mode": np.array([t])}
            nxt = {"image": np.full((1, 4, 4), t + 1, np.uint8), "mode": np.array([t + 1])}
            s.extend(obs, [0], [0.0], nxt, [False], [False])
            s.flush()  # each extend its own block: the stream's last next observation is kept between them
        b = s.inspect.get([3, 4])
        assert s.inspect.num_frames == 6  # each observation stored once: the episode continued across extends
    assert b.obs["mode"].tolist() == [[2, 3], [3, 4]] and b.next_obs["mode"].tolist() == [[3, 4], [4, 5]]
