"""The wire format and the ledger, without Ray: exact round trips and crash-safe bookkeeping."""

import numpy as np
import pytest

from mmreplay.distributed.sampler import global_weights
from mmreplay.distributed.ledger import clients_at, make_entry, read_ledger, write_ledger
from mmreplay.distributed.wire import BatchBuilder, decode_batch, encode_batch, payload_nbytes, rows_of


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


def _builder_payload(r, parts, capacity, compress=None, reuse=None):
    """Rows ``r`` added to one BatchBuilder in ``parts`` (slices or row numbers), then decoded."""
    builder = BatchBuilder(capacity, compress)
    rows = rows_of(r["streams"], r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"], r["truncated"],
                   {"x": r["x"]})
    for part in parts:
        builder.add(rows, part)
    payload = builder.payload()
    return payload, decode_batch(payload, reuse)


def _expect_rows(back, r, idx):
    for key in ("streams", "obs", "next_obs", "terminated", "truncated", "action", "reward"):
        assert np.array_equal(back[key], r[key][idx]), key
        assert key == "streams" or back[key].dtype == r[key].dtype
    assert np.array_equal(back["extras"]["x"], r["x"][idx])


@pytest.mark.parametrize("compress", [None, "lz4"])
def test_builder_fed_in_parts_is_exact_and_sends_each_continued_observation_once(compress):
    rng = np.random.default_rng(3)
    r = chain(30, 4, rng)
    n = r["streams"].size
    r.update(action=rng.integers(0, 4, n), reward=rng.random(n).astype(np.float32), x=np.arange(n))
    whole, back = _builder_payload(r, [None], n, compress)
    # slices and row numbers (what a client routing streams to shards passes), across several adds
    mine = np.flatnonzero(np.isin(r["streams"], [1, 3]))
    parts = [mine[:7], mine[7:8], mine[8:40], mine[40:]]
    part_payload, part_back = _builder_payload(r, parts, mine.size, compress)
    _expect_rows(back, r, np.arange(n))
    _expect_rows(part_back, r, mine)
    # a stream that goes on across adds is not sent again: one first observation per stream, then one
    # per new episode, exactly as in one add
    ends = r["terminated"] | r["truncated"]
    assert int((whole["obs_src"] < 0).sum()) == 4 + int(ends[:-4].sum())
    last_of = {s: np.flatnonzero(r["streams"][mine] == s)[-1] for s in (1, 3)}
    mine_ends = ends[mine]
    assert int((part_payload["obs_src"] < 0).sum()) == 2 + int(mine_ends.sum()) - sum(
        int(mine_ends[i]) for i in last_of.values())


def test_builder_compares_bytes_so_a_signed_zero_or_a_dtype_change_is_sent_as_given():
    # -0.0 == 0.0 as numbers; sending row 0's next observation in place of row 1's observation would flip a bit
    obs = np.array([[1.0], [0.0], [np.nan]], np.float32)
    nxt = np.array([[-0.0], [np.nan], [2.0]], np.float32)
    payload = encode_batch([0, 0, 0], obs, [0, 1, 2], [0, 0, 0], nxt, [False] * 3, [False] * 3)
    assert payload["obs_src"].tolist() == [-1, -1, 1]  # NaN bytes equal: continued
    back = decode_batch(payload)
    assert back["obs"].tobytes() == obs.tobytes() and back["next_obs"].tobytes() == nxt.tobytes()
    # obs and next obs of different dtypes: nothing is taken from next_obs, each keeps its dtype
    o16, n32 = np.array([[1], [2]], np.int16), np.array([[2], [3]], np.int32)
    back = decode_batch(encode_batch([0, 0], o16, [0, 0], [0, 0], n32, [False] * 2, [False] * 2))
    assert back["obs"].dtype == np.int16 and back["next_obs"].dtype == np.int32
    assert np.array_equal(back["obs"], o16) and np.array_equal(back["next_obs"], n32)


def test_builder_refuses_rows_of_other_dtypes_and_recycles_its_arrays():
    rng = np.random.default_rng(4)
    r = chain(4, 2, rng)
    n = r["streams"].size
    r.update(action=np.zeros(n, np.int64), reward=np.zeros(n, np.float32), x=np.arange(n))
    rows = rows_of(r["streams"], r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"], r["truncated"],
                   {"x": r["x"]})
    builder = BatchBuilder(2 * n)
    builder.add(rows)
    other = rows_of(r["streams"], r["obs"], r["action"], r["reward"].astype(np.float64), r["next_obs"],
                    r["terminated"], r["truncated"], {"x": r["x"]})
    assert builder.accepts(rows) and not builder.accepts(other)
    with pytest.raises(ValueError, match="differ from the batch's first rows"):
        builder.add(other)
    with pytest.raises(ValueError, match=f"{2 * n} rows do not fit, {n} of {2 * n} left"):
        builder.add(rows_of(*(np.concatenate([v, v, v]) for v in (r["streams"], r["obs"], r["action"], r["reward"],
                                                                     r["next_obs"], r["terminated"], r["truncated"])))
                    , np.arange(2 * n))
    first = builder.payload()
    again = builder.recycled()
    assert again.n == 0 and again.accepts(rows)
    again.add(rows)
    assert np.shares_memory(again.payload()["next_obs"]["obs"], first["next_obs"]["obs"])  # no fresh arrays
    with pytest.raises(RuntimeError, match="payload was taken"):
        builder.add(rows)


def test_decode_into_reused_arrays_gives_the_same_rows():
    rng = np.random.default_rng(5)
    r = chain(10, 2, rng)
    n = r["streams"].size
    r.update(action=rng.integers(0, 4, n), reward=rng.random(n).astype(np.float32), x=np.arange(n))
    reuse: dict = {}
    for compress in (None, "lz4", "lz4"):
        _, first = _builder_payload(r, [None], n, compress, reuse)
        _expect_rows(first, r, np.arange(n))
    _, small = _builder_payload(r, [np.arange(n // 2)], n, "lz4", reuse)  # fewer rows: a view of the same arrays
    _expect_rows(small, r, np.arange(n // 2))
    assert np.shares_memory(small["obs"], first["obs"]) and np.shares_memory(small["next_obs"], first["next_obs"])


@pytest.mark.parametrize("compress", [None, "lz4"])
def test_an_empty_batch_round_trips(compress):
    obs = np.zeros((0, 3), np.uint8)
    payload = encode_batch(np.zeros(0, int), obs, np.zeros(0), np.zeros(0), obs, np.zeros(0, bool), np.zeros(0, bool),
                           compress=compress)
    back = decode_batch(payload, {})
    assert payload["n"] == 0 and back["obs"].shape == (0, 3) and back["next_obs"].dtype == np.uint8


# -- malformed batches (issue 23, case 6): refused whole, naming the field, before anything is stored --------

def _good_batch(seed, compress):
    """Rows of 3 interleaved envs (continued observations travel as ``obs_src``) and their payload."""
    rng = np.random.default_rng(seed)
    r = chain(4, 3, rng)
    n = r["streams"].size
    r.update(action=rng.integers(0, 4, n), reward=rng.random(n).astype(np.float32))
    payload = encode_batch(r["streams"], r["obs"], r["action"], r["reward"], r["next_obs"], r["terminated"],
                           r["truncated"], compress=compress)
    return r, payload


def _copy(payload):
    out = {k: (dict(v) if isinstance(v, dict) else v.copy() if isinstance(v, np.ndarray) else v)
           for k, v in payload.items()}
    for k in ("obs", "next_obs"):
        out[k] = {key: dict(v) if isinstance(v, dict) else v.copy() for key, v in out[k].items()}
    return out


def _continued_row(p, after=0):
    return int(np.flatnonzero(p["obs_src"] >= 0)[after])


def _set_src(row_of, value_of):
    def mutate(p):
        i = row_of(p)
        p["obs_src"][i] = value_of(p, i)
    return mutate


def _one_obs_for_several_rows(p):
    # every row says "sent", but one observation travels: it used to be broadcast over all of them
    p["obs_src"][:] = -1
    p["obs"]["obs"] = p["obs"]["obs"][:1] if isinstance(p["obs"]["obs"], np.ndarray) else _lz4(p["obs"]["obs"], 1)


def _lz4(packed, rows):
    from numcodecs import LZ4
    arr = np.empty(packed["shape"], np.dtype(packed["dtype"]))
    LZ4().decode(packed["lz4"], out=arr)
    return {"lz4": LZ4().encode(np.ascontiguousarray(arr[:rows])), "shape": [rows, *packed["shape"][1:]],
            "dtype": packed["dtype"]}


def _declare_more_rows(p, patch_header=False, rows=None):
    packed = p["next_obs"]["obs"]
    shape = [rows or 2 * packed["shape"][0], *packed["shape"][1:]]
    data = bytearray(packed["lz4"])
    if patch_header:  # a header that agrees with the lie: the data still decodes to fewer bytes
        data[:4] = int(np.prod(shape) * np.dtype(packed["dtype"]).itemsize).to_bytes(4, "little")
    p["next_obs"]["obs"] = {"lz4": bytes(data), "shape": shape, "dtype": packed["dtype"]}
    p["n"], n = shape[0], shape[0]  # every other count agrees with the declared shape
    for k in ("streams", "obs_src", "action", "reward", "terminated", "truncated"):
        p[k] = np.resize(p[k], n)
    p["obs_src"][packed["shape"][0]:] = np.arange(packed["shape"][0], n) - 1  # continued: no more sent


MALFORMED = {  # kind: (payloads it applies to: "plain", "lz4" or both (None), mutation, message naming the field)
    "source 999": (None, _set_src(_continued_row, lambda p, i: 999), r"'obs_src': rows \[\d+\] .* rows \[999\]"),
    "source -7": (None, _set_src(_continued_row, lambda p, i: -7), r"'obs_src': rows \[\d+\] .* rows \[-7\]"),
    "source a later row": (None, _set_src(lambda p: 0, lambda p, i: 5), r"'obs_src': rows \[0\] .* rows \[5\]"),
    "source its own row": (None, _set_src(_continued_row, lambda p, i: i), r"'obs_src'.* an earlier row"),
    "one observation for several rows": (None, _one_obs_for_several_rows,
                                         r"observations 'obs': next_obs has shape \(12, 4, 3\) and obs \(1, 4, 3\)"),
    "lz4 shape beyond its data": ("lz4", _declare_more_rows,
                                  r"'next_obs\[obs\]': declares shape \[24, 4, 3\] uint8 \(288 bytes\), but .* "
                                  r"hold 144 bytes"),
    "lz4 header lies too": ("lz4", lambda p: _declare_more_rows(p, True),
                            r"'next_obs\[obs\]': its LZ4 data does not decode to the 288 bytes"),
    "lz4 size beyond any lz4 ratio": ("lz4", lambda p: _declare_more_rows(p, True, rows=1 << 20),
                                      r"'next_obs\[obs\]': declares shape \[1048576, 4, 3\]"),
    "lz4 dtype not a number": ("lz4", lambda p: p["next_obs"]["obs"].update(dtype="|O"),
                               r"'next_obs\[obs\]': declared dtype object"),
    "lz4 extra key": ("lz4", lambda p: p["next_obs"]["obs"].update(extra=1), r"'next_obs\[obs\]': expected an array"),
    "missing field": (None, lambda p: p.pop("reward"), r"batch fields: missing \['reward'\], unknown \[\]"),
    "extra field": (None, lambda p: p.update(evil=np.zeros(1)), r"missing \[\], unknown \['evil'\]"),
    "count beyond the rows": (None, lambda p: p.update(n=p["n"] + 1), r"'streams': expected 13 rows"),
    "a column short of a row": (None, lambda p: p.update(action=p["action"][:-1]), r"'action': expected 12 rows"),
    "float streams": (None, lambda p: p.update(streams=p["streams"] + 0.5), r"'streams': expected a numpy array"),
    "object column": (None, lambda p: p.update(reward=p["reward"].astype(object)), r"'reward': .* dtype object"),
    "obs keys differ": (None, lambda p: p["obs"].update(other=p["obs"]["obs"]), r"'obs' and 'next_obs'"),
    "obs of another dtype taken from next_obs": ("plain",
                                                 lambda p: p["obs"].update(obs=p["obs"]["obs"].astype(np.int16)),
                                                 r"observations 'obs': obs \(int16\) taken from next_obs \(uint8\)"),
    "n a bool": (None, lambda p: p.update(n=True), r"'n': expected a row count"),
}
KINDS = [(kind, compress) for kind, (only, _, _) in MALFORMED.items()
         for compress in {"plain": [None], "lz4": ["lz4"], None: [None, "lz4"]}[only]]


def _malformed(kind, compress, seed=7):
    r, payload = _good_batch(seed, compress)
    bad = _copy(payload)
    MALFORMED[kind][1](bad)
    return bad


@pytest.mark.parametrize("kind,compress", KINDS)
def test_decode_refuses_a_malformed_batch_naming_the_field(kind, compress):
    bad = _malformed(kind, compress)
    reuse: dict = {}
    with pytest.raises(ValueError, match=MALFORMED[kind][2]):
        decode_batch(bad, reuse)
    if "beyond any" in kind:
        assert reuse == {}  # refused before the declared 12 MiB were allocated


def test_decode_refuses_observations_the_store_does_not_take():
    from mmreplay.distributed.wire import ObsLayout

    _, payload = _good_batch(8, "lz4")
    decode_batch(payload, expect=ObsLayout(False, {"obs": (4, 3)}))
    with pytest.raises(ValueError, match=r"observations 'obs': rows of shape \(4, 3\), this store takes \(3, 4\)"):
        decode_batch(payload, expect=ObsLayout(False, {"obs": (3, 4)}))
    with pytest.raises(ValueError, match=r"got keys \['obs'\] \(dict_obs=False\), this store takes \['img'\]"):
        decode_batch(payload, expect=ObsLayout(True, {"img": (4, 3)}))


def test_a_shard_stores_nothing_of_a_malformed_batch(tmp_path):
    """Through the shard's ingest path (what the Ray actor runs): each malformed batch raises to the client,
    uses up its sequence number, and leaves every stored row as it was; good batches around them land."""
    from gymnasium import spaces

    from mmreplay.distributed.shard import ReplayShard

    create = dict(observation_space=spaces.Box(0, 255, (4, 3), np.uint8), action_space=spaces.Discrete(4),
                  capacity=10_000)
    shard = ReplayShard(str(tmp_path / "shard"), create, commit_every=1 << 30, commit_seconds=3600, durable=False)
    truth = []  # rows in the order they must be stored

    def apply_good(seq, compress):
        r, payload = _good_batch(100 + seq, compress)
        assert shard.extend(0, seq, payload)["status"] == "ok"
        truth.append(r)

    def check_store():
        want = {k: np.concatenate([r[k] for r in truth]) for k in ("obs", "next_obs", "action", "reward")}
        store = shard.store
        assert store.num_added == want["action"].size
        got = store.inspect.get(np.arange(*store.inspect.valid_range()))
        for k in want:
            assert np.array_equal(getattr(got, k).numpy(), want[k]), k

    seq = 1
    apply_good(seq, None)
    for kind, compress in KINDS:
        seq += 1
        bad = _malformed(kind, compress, seed=seq)
        with pytest.raises(ValueError, match=MALFORMED[kind][2]):
            shard.extend(0, seq, bad)
        assert shard.applied[0] == seq  # used up: the client's next batch follows without a gap
        check_store()
    seq += 1
    apply_good(seq, "lz4")
    shard.commit()
    check_store()
    shard.close()
