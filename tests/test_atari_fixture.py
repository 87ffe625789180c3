"""Real Atari frames (a small fixture recorded by scripts/make_atari_fixture.py): round trip, stacks, size."""

import os

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import encoder_children, frame_shard_file
from reference import ReferenceReplay, assert_batch_matches

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")


@pytest.fixture(scope="module")
def fixture():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return {k: data[k] for k in data.files}


def replay(fixture, store, ref):
    frames = fixture["frames"]
    for t in range(len(fixture["action"])):
        obs, nxt = frames[fixture["obs_index"][t]], frames[fixture["next_obs_index"][t]]
        row = (obs, int(fixture["action"][t]), float(np.sign(fixture["reward"][t])), nxt,
               bool(fixture["terminated"][t]), bool(fixture["truncated"][t]))
        store.add(*row)
        ref.add(0, *row)


@pytest.mark.parametrize("codec", ["lz4hc", "lz4", "zstd", "delta-zstd"])
def test_real_frames_round_trip_with_stacks(store_path, fixture, codec):
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    ref = ReferenceReplay(4, 10_000)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=10_000, frame_stack=4,
                               reward_values=(-1, 0, 1), frame_codec=codec) as s:
        replay(fixture, s, ref)
        assert s.inspect.num_frames == len(fixture["frames"])  # every distinct frame stored exactly once
    with mmreplay.Store.open(store_path, mode="r") as s:
        ids = ref.valid_ids()
        assert len(s) == len(ids) == len(fixture["action"])
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        frame_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in
                          os.walk(os.path.join(store_path, "frames")) for f in fs)
    assert frame_bytes / len(ids) < 7056 / 8  # compressed at least 8x


def test_episode_ends_in_the_fixture(fixture):
    # the fixture must exercise both kinds of episode end
    assert fixture["terminated"].any() and fixture["truncated"].any()


@pytest.mark.parametrize("encoder", ["process", "thread"])
def test_shards_sealed_in_the_background_read_back_identical(store_path, fixture, encoder, monkeypatch):
    # capacity 2000 -> 256-frame shards: the fixture fills and seals two of them while adding
    if encoder == "thread":
        monkeypatch.setenv("MMREPLAY_ENCODER", "thread")
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    ref = ReferenceReplay(4, 2000)
    before = set(encoder_children())
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=2000, frame_stack=4,
                               reward_values=(-1, 0, 1)) as s:
        assert bool(set(encoder_children()) - before) == (encoder == "process")
        replay(fixture, s, ref)
        ids = ref.valid_ids()
        assert_batch_matches(s.inspect.get(ids), ref, ids)  # sealed shards are read from RAM or the new file
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        assert s.verify() == []


@pytest.mark.parametrize("child_share", [0.5, 0.85, 1.0])
def test_shards_split_between_child_and_adding_process_read_back_identical(store_path, fixture, child_share,
                                                                            monkeypatch):
    """The encoder child encodes the first part of each sealed shard, the adding process the rest."""
    import mmreplay.index.encoder_pipe as encoder_pipe

    monkeypatch.setattr(encoder_pipe, "INITIAL_CHILD_SHARE", child_share)
    monkeypatch.setattr(encoder_pipe, "SHARE_STEP", 0.0)  # hold the split where the test put it
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    ref = ReferenceReplay(4, 2000)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=2000, frame_stack=4,
                               reward_values=(-1, 0, 1)) as s:
        replay(fixture, s, ref)
    with mmreplay.Store.open(store_path, mode="r") as s:
        ids = ref.valid_ids()
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        assert s.verify() == []


def test_encoder_process_failure_is_a_storage_error(store_path, fixture):
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    s = mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=2000, frame_stack=4,
                              reward_values=(-1, 0, 1))
    os.makedirs(frame_shard_file(s, 0))  # the child cannot rename onto it
    with pytest.raises(mmreplay.StorageError, match="writing failed"):
        replay(fixture, s, ReferenceReplay(4, 2000))
        s.flush()  # a sealed shard may still be queued for the encoder: its failed write shows by the commit
    s.close()
