"""Files stay standard zarr v3: plain zarr + numpy, following docs/format.md, read what the store reads."""

import os

import numpy as np
import pytest
import zarr
from gymnasium import spaces

import mmreplay
from mmreplay.index.ring import TransitionRing
from mmreplay.storage.format.layout import frame_layout
from mmreplay.storage.format.sharded import ShardedArray
from test_store_semantics import drive


def read_with_plain_zarr(path, ids):
    """docs/format.md, section "Reading a store without mmreplay", in code: zarr and numpy only."""
    root = zarr.open_group(path, mode="r")
    meta = root.attrs["mmreplay"]
    commit = root["commit"].attrs["mmreplay_commit"]
    schema, k = meta["schema"], meta["schema"]["frame_stack"]
    t = {name: arr[...] for name, arr in root["transitions"].arrays()}
    rows, f_rows, f_head = commit["transition_rows"], commit["frame_rows"], commit["frame_head"]
    unbounded = meta["capacity"] is None

    def slot(g):
        return g if unbounded else g % rows

    def frame_row(u32):
        global_id = f_head - ((f_head - int(u32)) % 2**32)
        return global_id if unbounded else global_id % f_rows

    def packed(name, g, values):
        bits = root[f"transitions/{name}"].attrs["mmreplay"]["packed_bits"]
        pos = slot(g) * bits
        return values[(int(t[name][pos // 8]) >> (pos % 8)) & ((1 << bits) - 1)]

    name = schema["observations"][0]["name"]
    frames = root[f"frames/{name}"][...]  # zarr reads the whole (small) array once: a row at a time costs ~10 ms
    out = []
    for g in ids:
        chain = [g]
        while len(chain) < k and t["prev_delta"][slot(chain[-1])] > 0:
            chain.append(chain[-1] - int(t["prev_delta"][slot(chain[-1])]))
        chain += [chain[-1]] * (k - len(chain))  # pad with the episode's first observation
        obs_rows = [frame_row(t["obs_frame"][slot(c)]) for c in reversed(chain)]
        next_rows = obs_rows[1:] + [frame_row(t["next_frame"][slot(g)])]
        out.append(dict(
            obs=np.stack([frames[r] for r in obs_rows]), next_obs=np.stack([frames[r] for r in next_rows]),
            action=packed("action", g, schema["action"]["values"]),
            reward=packed("reward", g, schema["reward"]["values"]),
            terminated=bool(packed("terminated", g, [False, True])),
            truncated=bool(packed("truncated", g, [False, True]))))
    return out


@pytest.mark.parametrize("capacity", [100, None])
def test_plain_zarr_reader_matches_store(store_path, capacity):
    rng = np.random.default_rng(4)
    store, ref = drive(store_path, rng, capacity=capacity, frame_stack=4, steps=250)
    store.close()
    ids = ref.valid_ids()
    plain = read_with_plain_zarr(store_path, ids)
    with mmreplay.Store.open(store_path, mode="r") as s:
        b = s.inspect.get(ids)
    for row, (g, p) in enumerate(zip(ids, plain)):
        np.testing.assert_array_equal(p["obs"], b.obs[row].numpy(), err_msg=str(g))
        np.testing.assert_array_equal(p["next_obs"], b.next_obs[row].numpy())
        assert p["action"] == int(b.action[row]) and p["reward"] == float(b.reward[row])
        assert p["terminated"] == bool(b.terminated[row]) and p["truncated"] == bool(b.truncated[row])


def test_shard_reader_returns_exactly_what_zarr_returns(store_path):
    space = spaces.Dict({"img": spaces.Box(0, 255, (6, 5), np.uint8), "vec": spaces.Box(-1, 1, (3,))})
    rng = np.random.default_rng(0)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(2), capacity=300, durable=False) as s:
        obs = space.sample()
        for i in range(123):  # leaves most shards, and chunks of the last one, empty
            nxt = space.sample()
            s.add(obs, i % 2, float(rng.standard_normal()), nxt, False, False)
            obs = nxt
    root = zarr.open_group(store_path, mode="r")
    with mmreplay.Store.open(store_path, mode="r") as s:
        geo = s.geometry
        layouts = [frame_layout(spec, geo.frames.rows, geo.frames.shard_rows) for spec in s.schema.observations] + \
            TransitionRing(store_path, s.schema.transition_columns, geo.transitions, capacity=s.capacity).layouts()
    for layout in layouts:
        reader = ShardedArray(store_path, layout, missing_ok=True)  # zarr's reading: no file = fill value
        expected = root[layout.path][...]
        n_chunks = layout.rows // layout.chunk_rows
        for chunk in range(n_chunks):
            out = np.empty((layout.chunk_rows, *layout.row_shape), dtype=layout.np_dtype)
            reader.read_chunk(chunk, out)
            np.testing.assert_array_equal(out, expected[chunk * layout.chunk_rows:(chunk + 1) * layout.chunk_rows],
                                          err_msg=f"{layout.path} chunk {chunk}")


def test_corrupt_chunk_raises_naming_array_shard_and_chunk(store_path):
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(2),
                               capacity=1000) as s:
        for i in range(300):
            s.add(np.full((6, 5), i % 256, np.uint8), 0, 0.0, np.full((6, 5), (i + 1) % 256, np.uint8), False,
                  False)
        geo = s.geometry.frames
        layout = frame_layout(s.schema.observations[0], geo.rows, geo.shard_rows)
    path = layout.shard_file(store_path, 0)
    data = bytearray(open(path, "rb").read())
    data[5] ^= 0xFF  # inside chunk 0
    open(path, "wb").write(bytes(data))
    with mmreplay.Store.open(store_path, mode="r") as s:
        with pytest.raises(mmreplay.CorruptDataError, match=r"array 'frames/obs', shard 0, chunk 0: checksum"):
            s.inspect.get([0])
    os.truncate(path, 100)
    with mmreplay.Store.open(store_path, mode="r") as s:
        with pytest.raises(mmreplay.CorruptDataError, match="shard 0"):
            s.inspect.get([0])


def test_chunk_that_decodes_to_the_wrong_size_is_rejected(store_path):
    from numcodecs import blosc

    from mmreplay.storage.format.shardfile import build_shard, crc32c

    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(2),
                               capacity=1000) as s:
        for i in range(100):
            s.add(np.full((6, 5), i, np.uint8), 0, 0.0, np.full((6, 5), i + 1, np.uint8), False, False)
        geo = s.geometry.frames
        layout = frame_layout(s.schema.observations[0], geo.rows, geo.shard_rows)
    short = blosc.compress(np.zeros(7, np.uint8), b"lz4", 5, 0, 0)  # valid data, checksum right, 7 bytes
    chunk = bytes(short) + crc32c(short)
    raw = build_shard([chunk] * layout.chunks_per_shard)
    open(layout.shard_file(store_path, 0), "wb").write(raw)
    forget_shard_identities(store_path)  # as a store written before them: the decoded size is what is left
    # shard 0 is also the newest: its damage stays local (the store opens), reading the row shows it
    with pytest.raises(mmreplay.CorruptDataError, match=r"'frames/obs', shard 0, chunk \d+: chunk does not decode "
                                                        "to (30|the expected number of) bytes"):
        with mmreplay.Store.open(store_path, mode="r") as s:
            s.inspect.get([3])


def forget_shard_identities(path: str) -> None:
    """Rewrite the commit record without shard identities, as stores written before them have."""
    from mmreplay.storage.durability.commit import read_commit, write_commit

    record = read_commit(path)
    record.pop("shard_ids", None)
    write_commit(path, record)
