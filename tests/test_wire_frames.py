"""Shard -> learner on the wire as distinct compressed frames (``mmreplay.distributed.learner_wire``), without Ray.

Every round trip is checked against the shard's own batch, bit for bit: real Atari frames, episodes short
enough that stacks start inside them (repeated or zero padding), a ring that wrapped, n-step windows, dict
observations. Hostile payloads are refused naming the field; the bytes a batch costs are measured.
"""

import copy

import numpy as np
import pytest
import torch
from gymnasium import spaces

from mmreplay.cli.quickbench import atari_fixture
from mmreplay.distributed.learner_wire import (FrameLayout, check_frames, decode_frames, encode_frames,
                                               payload_nbytes, rebuild_into, rebuild_torch, zero_padded)
from mmreplay.distributed.sampler import default_wire, slice_part, write_part
from mmreplay.distributed.shard import ReplayShard, batch_to_numpy
from mmreplay.sampling.batch import BatchBuffers
from mmreplay.sampling.strategy import NStep, Uniform
from mmreplay.store import Store

FRAME = spaces.Box(0, 255, (84, 84), np.uint8)


@pytest.fixture(scope="module")
def fixture_frames():
    return atari_fixture()["frames"]


def add_episodes(store, frames, n, *, dict_obs=False, seed=0):
    """``n`` transitions of short episodes (2..9 steps: most stacks reach back over an episode start) made
    of consecutive fixture frames, each episode ending terminated or truncated."""
    rng = np.random.default_rng(seed)
    added, at = 0, 0
    while added < n:
        length = min(int(rng.integers(2, 10)), n - added)
        idx = (at + np.arange(length + 1)) % len(frames)
        at += length + 1
        for t in range(length):
            obs, nxt = frames[idx[t]], frames[idx[t + 1]]
            if dict_obs:
                obs = {"pixels": obs, "pos": np.array([idx[t], t], np.float32)}
                nxt = {"pixels": nxt, "pos": np.array([idx[t + 1], t + 1], np.float32)}
            last = t == length - 1
            trunc = last and bool(rng.random() < 0.3)
            store.add(obs, int(rng.integers(0, 6)), float(rng.integers(-1, 2)), nxt, last and not trunc, trunc)
        added += length


def make_store(path, frames, n, *, capacity=None, frame_stack=4, padding="first", dict_obs=False):
    space = spaces.Dict({"pixels": FRAME, "pos": spaces.Box(-1e6, 1e6, (2,), np.float32)}) if dict_obs else FRAME
    store = Store.create(str(path), space, spaces.Discrete(6), capacity=capacity or n, frame_stack=frame_stack,
                         reward_values=(-1, 0, 1), stack_padding=padding)
    add_episodes(store, frames, n, dict_obs=dict_obs)
    store.flush()
    return store


def draw(store, batch_size, strategy=None, seed=0):
    """One drawn batch as the shard holds it (numpy copies) and the frame ids its stacks were built from."""
    strategy = strategy or Uniform()
    with store.sampler(batch_size, strategy, prefetch=0, seed=seed, name=f"wire{seed}") as smp:
        buf = smp.draw.new_buffers(store.schema, batch_size)
        picked = smp.draw_into(buf)
        local = copy.deepcopy(batch_to_numpy(buf.batch()))
        return local, picked.obs_ids.copy(), picked.next_ids.copy()


def frames_payload(store, local, obs_ids, next_ids):
    return encode_frames(local, obs_ids, next_ids, zero_pad=zero_padded(store.schema), dict_obs=store.schema.dict_obs)


def assert_rebuilt_exactly(store, local, payload):
    """The learner's path (check, decode, rebuild into its buffers) gives the shard's batch bit for bit."""
    decoded = decode_frames(payload, FrameLayout.of(store.schema))
    n = decoded["n"]
    out = BatchBuffers(store.schema, n, weights=local["weights"] is not None)
    write_part(out, slice_part(decoded, 0, n))
    got = batch_to_numpy(out.batch())
    for key in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "indices", "extras"):
        want, have = local[key], got[key]
        if isinstance(want, dict):
            assert want.keys() == have.keys()
            for name in want:
                assert np.array_equal(want[name], have[name]) and want[name].dtype == have[name].dtype, (key, name)
        else:
            assert np.array_equal(want, have) and want.dtype == have.dtype, key
    return decoded


@pytest.mark.parametrize("padding", ["first", "zeros"])
def test_frames_round_trip_exactly_with_episode_starts_inside_stacks(tmp_path, fixture_frames, padding):
    store = make_store(tmp_path / "s", fixture_frames, 600, padding=padding)
    local, obs_ids, next_ids = draw(store, 64)
    starts = (obs_ids[:, :-1] == obs_ids[:, 1:]).any(axis=1)
    assert starts.sum() >= 10, "the draw must hold stacks padded at an episode start"
    if padding == "zeros":
        assert (local["obs"].reshape(64, 4, -1).max(axis=2) == 0).any(), "zero padding in the shard's batch"
    payload = frames_payload(store, local, obs_ids, next_ids)
    distinct = np.unique(np.concatenate([obs_ids, next_ids])).size
    assert payload["frames"]["obs"]["rows"] == distinct + (padding == "zeros")  # each frame once (+ one zero)
    decoded = assert_rebuilt_exactly(store, local, payload)
    # the same gather on torch tensors (what a device-side decoder feeds): equal stacks
    table = torch.from_numpy(decoded["frames"]["obs"])
    assert torch.equal(rebuild_torch(table, decoded["obs_index"]), torch.from_numpy(local["obs"]))
    assert torch.equal(rebuild_torch(table, decoded["next_index"]), torch.from_numpy(local["next_obs"]))
    store.close()


def test_frames_round_trip_exactly_after_the_ring_wrapped(tmp_path, fixture_frames):
    store = make_store(tmp_path / "s", fixture_frames, 1500, capacity=400)
    assert store.inspect.valid_range()[0] > 0, "the ring must have wrapped"
    for seed in range(3):
        local, obs_ids, next_ids = draw(store, 48, seed=seed)
        assert_rebuilt_exactly(store, local, frames_payload(store, local, obs_ids, next_ids))
    store.close()


def test_nstep_stacks_round_trip_exactly(tmp_path, fixture_frames):
    store = make_store(tmp_path / "s", fixture_frames, 600)
    local, obs_ids, next_ids = draw(store, 64, NStep(3, 0.9))
    payload = frames_payload(store, local, obs_ids, next_ids)
    decoded = decode_frames(payload, FrameLayout.of(store.schema))
    for field, index in (("obs", "obs_index"), ("next_obs", "next_index")):
        out = np.empty_like(local[field])
        rebuild_into(decoded["frames"]["obs"], decoded[index], out)
        assert np.array_equal(out, local[field]), field
    store.close()


@pytest.mark.parametrize("frame_stack", [1, 3])
def test_dict_observations_round_trip_exactly(tmp_path, fixture_frames, frame_stack):
    store = make_store(tmp_path / "s", fixture_frames, 300, frame_stack=frame_stack, dict_obs=True)
    local, obs_ids, next_ids = draw(store, 32)
    payload = frames_payload(store, local, obs_ids, next_ids)
    assert set(payload["frames"]) == {"pixels", "pos"}
    assert_rebuilt_exactly(store, local, payload)
    store.close()


def test_a_shard_samples_frames_that_rebuild_its_stored_transitions(tmp_path, fixture_frames):
    """Through ``ReplayShard.sample`` (what the Ray actor runs): every row equals the stored transition."""
    create = dict(observation_space=FRAME, action_space=spaces.Discrete(6), capacity=1000, frame_stack=4,
                  reward_values=(-1, 0, 1))
    shard = ReplayShard(str(tmp_path / "shard"), create, commit_every=1 << 30, commit_seconds=3600, durable=False)
    add_episodes(shard.store, fixture_frames, 500)
    schema = shard.store.schema
    assert default_wire(schema) == "frames"
    reply = shard.sample(40, wire="frames")
    assert reply["size"] == 500
    decoded = decode_frames(reply["batch"], FrameLayout.of(schema))
    out = BatchBuffers(schema, 40)
    write_part(out, slice_part(decoded, 0, 40))
    got = out.batch()
    want = shard.store.inspect.get(got.indices.numpy())
    for key in ("obs", "next_obs", "action", "reward", "terminated", "truncated"):
        assert torch.equal(getattr(got, key), getattr(want, key)), key
    assert shard.info()["sample_cpu_s"]["wire_encode"] > 0
    with pytest.raises(ValueError, match="wire must be one of"):
        shard.sample(4, wire="jpeg")
    shard.close()


def test_prioritized_rows_come_with_their_weights_and_a_reply_without_them_is_refused(tmp_path, fixture_frames):
    create = dict(observation_space=FRAME, action_space=spaces.Discrete(6), capacity=1000, frame_stack=4,
                  reward_values=(-1, 0, 1))
    shard = ReplayShard(str(tmp_path / "shard"), create, commit_every=1 << 30, commit_seconds=3600, durable=False)
    add_episodes(shard.store, fixture_frames, 300)
    schema = shard.store.schema
    shard.update_priorities(np.arange(0, 300, 7), np.linspace(0.1, 5, 43))
    reply = shard.sample(24, prioritized=True, beta=0.5, wire="frames")["batch"]
    with pytest.raises(ValueError, match=r"'weights': got \[.*\], expected None \(a uniform draw\)"):
        decode_frames(reply, FrameLayout.of(schema))
    decoded = decode_frames(reply, FrameLayout.of(schema, weights=True))
    out = BatchBuffers(schema, 24, weights=True)
    write_part(out, slice_part(decoded, 0, 24))
    got = out.batch()
    assert np.array_equal(got.weights.numpy(), reply["weights"]) and (got.weights.numpy() < 1).any()
    want = shard.store.inspect.get(got.indices.numpy())
    for key in ("obs", "next_obs", "action", "reward"):
        assert torch.equal(getattr(got, key), getattr(want, key)), key
    shard.close()


def test_slices_of_a_reply_share_its_tables_and_rebuild_their_rows(tmp_path, fixture_frames):
    """A reply serving several planned batches is decoded once; each batch's rows rebuild exactly."""
    store = make_store(tmp_path / "s", fixture_frames, 400)
    local, obs_ids, next_ids = draw(store, 60)
    decoded = decode_frames(frames_payload(store, local, obs_ids, next_ids), FrameLayout.of(store.schema))
    for lo, hi in ((0, 25), (25, 60)):
        part = slice_part(decoded, lo, hi)
        assert part["frames"]["obs"] is decoded["frames"]["obs"]
        out = BatchBuffers(store.schema, hi - lo)
        write_part(out, part)
        assert np.array_equal(out.batch().obs.numpy(), local["obs"][lo:hi])
        assert np.array_equal(out.batch().indices.numpy(), local["indices"][lo:hi])
    store.close()


# -- hostile payloads ------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def good(tmp_path_factory, fixture_frames):
    store = make_store(tmp_path_factory.mktemp("hostile") / "s", fixture_frames, 300)
    local, obs_ids, next_ids = draw(store, 16)
    payload = frames_payload(store, local, obs_ids, next_ids)
    layout = FrameLayout.of(store.schema)
    store.close()
    return payload, layout


def _header(size: int) -> np.ndarray:
    return np.frombuffer(int(size).to_bytes(4, "little"), np.uint8)


def _lie_in_header(p):
    """The first chunk claims to hold a gigabyte."""
    t = p["frames"]["obs"]
    t["data"] = np.concatenate([_header(1 << 30), t["data"][4:]])


def _corrupt_block(p):
    """A true header, but the LZ4 block after it is garbage (decodes to the wrong size, or not at all)."""
    t = p["frames"]["obs"]
    size = int(t["sizes"][0])
    data = t["data"].copy()
    data[4:size] = 0xFF
    t["data"] = data


HOSTILE = {
    "index out of range": (lambda p: p["obs_index"].__setitem__((0, 0), p["frames"]["obs"]["rows"]),
                           r"'obs_index': rows from \d+ to \d+, expected rows of its frame table"),
    "negative index": (lambda p: p["next_index"].__setitem__((3, 1), -1), r"'next_index': rows from -1"),
    "index of another shape": (lambda p: p.__setitem__("obs_index", p["obs_index"][:, :2].copy()),
                               r"'obs_index': expected an integer array of shape \(16, 4\)"),
    "rows beyond the stack positions": (lambda p: p["frames"]["obs"].__setitem__("rows", 10 ** 9),
                                        r"'frames\[obs\]': 'rows' is 1000000000, expected an integer in \[0, 128\]"),
    "sizes not adding up": (lambda p: p["frames"]["obs"]["sizes"].__setitem__(0, p["frames"]["obs"]["sizes"][0] + 1),
                            r"'frames\[obs\]': 'sizes' .* adding up to the \d+ bytes of 'data'"),
    "lying chunk header": (_lie_in_header, r"'frames\[obs\]': chunk 0 of \d+ bytes holds 1073741824 bytes"),
    "frames of another shape": (lambda p: p["frames"]["obs"].__setitem__("shape", [84, 85]),
                                r"'frames\[obs\]': frames of shape \[84, 85\], this store's are \[84, 84\]"),
    "frames of another dtype": (lambda p: p["frames"]["obs"].__setitem__("dtype", "<f8"),
                                r"'frames\[obs\]': frames of dtype '<f8'"),
    "unknown field": (lambda p: p.__setitem__("pickle", b"\x80"), r"unknown \['pickle'\]"),
    "unknown extra column": (lambda p: p["extras"].__setitem__("x", p["reward"]),
                             r"'extras': got \['x'\], this store's extra columns are \[\]"),
    "weights of a uniform draw": (lambda p: p.__setitem__("weights", np.ones(16, np.float32)),
                                  r"'weights': got \[1.0, .*expected None"),
    "column of other length": (lambda p: p.__setitem__("reward", p["reward"][:3]),
                               r"'reward': expected 16 rows \(the batch's 'n'\), got shape \(3,\)"),
    "corrupt LZ4 block": (_corrupt_block, r"'frames\[obs\]': chunk 0 does not decode to its rows"),
}


@pytest.mark.parametrize("kind", list(HOSTILE))
def test_hostile_payloads_are_refused_naming_the_field(good, kind):
    payload, layout = good
    bad = copy.deepcopy(payload)
    spoil, message = HOSTILE[kind]
    spoil(bad)
    with pytest.raises(ValueError, match=message):
        decode_frames(bad, layout)
    check_frames(payload, layout)  # the good one still passes (the spoiling worked on a copy)


# -- bytes on the wire -----------------------------------------------------------------------------------
@pytest.mark.parametrize("batch_size", [32, 256])
def test_an_atari_batch_costs_at_least_5x_fewer_bytes_as_frames(tmp_path, batch_size):
    """Real Atari frames replayed in their recorded episodes, frame_stack=4 (the issue's target: >= 5x)."""
    from mmreplay.cli.quickbench import fill

    fx = atari_fixture()
    store = Store.create(str(tmp_path / "s"), FRAME, spaces.Discrete(6), capacity=3000, frame_stack=4,
                         reward_values=(-1, 0, 1))
    fill(store, fx, 3000)
    store.flush()
    local, obs_ids, next_ids = draw(store, batch_size)
    payload = frames_payload(store, local, obs_ids, next_ids)
    stacks, frames = payload_nbytes(local), payload_nbytes(payload)
    assert stacks >= batch_size * 2 * 4 * 84 * 84
    assert stacks / frames >= 5, f"{stacks} B as stacks, {frames} B as frames: {stacks / frames:.1f}x"
    assert_rebuilt_exactly(store, local, payload)
    store.close()
