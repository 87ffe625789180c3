"""The wire format and the ledger, without Ray: exact round trips and crash-safe bookkeeping."""

import numpy as np
import pytest

from mmreplay.distributed.sampler import global_weights
from mmreplay.distributed.ledger import clients_at, make_entry, read_ledger, write_ledger
from mmreplay.distributed.wire import decode_batch, encode_batch, payload_nbytes


def chain(n_steps, streams, rng, done_every=5):
    """Rows of ``streams`` interleaved envs whose observations chain inside each episode."""
    rows = {k: [] for k in ("streams", "obs", "next_obs", "terminated", "truncated")}
    last = {s: rng.integers(0, 255, (4, 3), dtype=np.uint8) for s in range(streams)}
    for t in range(n_steps):
        for s in range(streams):
            nxt = rng.integers(0, 255, (4, 3), dtype=np.uint8)
            done = (t + s) % done_every == done_every - 1
            rows["streams"].append(s)
            rows["obs"].append(last[s])
            rows["next_obs"].append(nxt)
            rows["terminated"].append(done)
            rows["truncated"].append(False)
            last[s] = rng.integers(0, 255, (4, 3), dtype=np.uint8) if done else nxt
    return {k: np.array(v) for k, v in rows.items()}


@pytest.mark.parametrize("compress", [None, "lz4"])
def test_round_trip_is_exact_and_continued_observations_are_sent_once(compress):
    rng = np.random.default_rng(0)
    r = chain(20, 3, rng)
    n = r["streams"].size
    action, reward = rng.integers(0, 4, n), rng.random(n).astype(np.float32)
    payload = encode_batch(r["streams"], r["obs"], action, reward, r["next_obs"], r["terminated"], r["truncated"],
                           {"x": np.arange(n)}, compress=compress)
    back = decode_batch(payload)
    for key in ("streams", "obs", "next_obs", "terminated", "truncated"):
        assert np.array_equal(back[key], r[key])
        assert back[key].dtype == r[key].dtype or key == "streams"
    assert np.array_equal(back["action"], action) and np.array_equal(back["reward"], reward)
    assert np.array_equal(back["extras"]["x"], np.arange(n))
    sent = int((payload["obs_src"] < 0).sum())
    # one first observation per stream, then one per new episode
    assert sent == 3 + int(r["terminated"][:-3].sum())
    if compress is None:
        assert payload["obs"]["obs"].nbytes == sent * r["obs"][0].nbytes
        frames = r["obs"].nbytes + r["next_obs"].nbytes
        assert payload_nbytes(payload) == frames - (n - sent) * r["obs"][0].nbytes + sum(
            payload[k].nbytes for k in ("streams", "obs_src", "action", "reward", "terminated", "truncated")) + \
            payload["extras"]["x"].nbytes


def test_dict_observations_and_a_shifted_observation_are_sent_as_given():
    rng = np.random.default_rng(1)
    a, b, c = (rng.integers(0, 9, (2,), dtype=np.uint8) for _ in range(3))
    obs = {"img": np.stack([a, c]), "v": np.array([[1.0], [2.0]], np.float32)}
    nxt = {"img": np.stack([b, a]), "v": np.array([[2.0], [3.0]], np.float32)}
    payload = encode_batch([0, 0], obs, [0, 1], [0, 0], nxt, [False, False], [False, False])
    assert payload["obs_src"].tolist() == [-1, -1]  # row 1's image differs from row 0's next image
    back = decode_batch(payload)
    assert all(np.array_equal(back["obs"][k], obs[k]) for k in obs)


def test_encode_rejects_mismatched_rows():
    with pytest.raises(ValueError, match="terminated has 1 rows, expected 2"):
        encode_batch([0, 1], np.zeros((2, 3)), [0, 0], [0, 0], np.zeros((2, 3)), [False], [False, False])
    with pytest.raises(ValueError, match="compress must be one of"):
        encode_batch([0], np.zeros((1, 3)), [0], [0], np.zeros((1, 3)), [False], [False], compress="zip")


def test_ledger_keeps_the_entry_of_the_committed_head_across_a_crash(tmp_path):
    d = str(tmp_path)
    assert clients_at(read_ledger(d), 0, d) == {}
    entries = write_ledger(d, None, 0, {}, durable=False)
    entries = write_ledger(d, entries[-1], 10, {1: 3, 2: 5}, durable=False)
    # the store committed head 10; then a crash after the ledger entry for 25 was written but before the store
    write_ledger(d, entries[-1], 25, {1: 4, 2: 9}, durable=False)
    assert clients_at(read_ledger(d), 10, d) == {1: 3, 2: 5}
    assert clients_at(read_ledger(d), 25, d) == {1: 4, 2: 9}
    # the reopened shard rewrites the ledger from the committed entry: the stale one is gone
    write_ledger(d, None, 10, {1: 3, 2: 5}, durable=False)
    write_ledger(d, make_entry(10, {1: 3, 2: 5}), 30, {1: 6, 2: 5}, durable=False)
    assert [e["head"] for e in read_ledger(d)] == [10, 30]
    with pytest.raises(ValueError, match="no entry for the store's committed head 25"):
        clients_at(read_ledger(d), 25, d)


def test_cross_shard_weights_equal_those_of_one_store_holding_every_shard():
    rng = np.random.default_rng(2)
    beta = 0.4
    leaves = [rng.uniform(0.5, 3.0, 50), rng.uniform(0.1, 9.0, 70), rng.uniform(2.0, 4.0, 30)]
    shard_min = np.array([x.min() for x in leaves] + [np.inf])  # a 4th, empty shard (no leaf yet)
    shard = rng.integers(0, 3, 40)
    rows = np.array([rng.integers(0, leaves[s].size) for s in shard])
    p = np.array([leaves[s][r] for s, r in zip(shard, rows)])
    own = (p / shard_min[shard]) ** -beta  # what each shard returns
    expected = (p / np.concatenate(leaves).min()) ** -beta
    got = global_weights(own, shard, shard_min, beta)
    assert np.allclose(got, expected, rtol=1e-6)
    assert got.max() <= 1.0 + 1e-6
