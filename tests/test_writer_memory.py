"""A writer's memory stays bounded by what it holds, not by what it wrote: the shard indexes of the files it
installs are not kept (``ShardedArray.install_shard``). Kept, they cost ~2 B a frame and, allocated between
the installing thread's transient encoding buffers, pinned ~13 B a frame more of freed heap (the dqn-replay
import of 50M transitions, issue #42). A shard read after its install still reads the data written, its
index read from the file and checked against the identity the install recorded."""

import numpy as np
import pytest
import zarr

from mmreplay.errors import CorruptDataError
from mmreplay.storage.format.layout import ArrayLayout
from mmreplay.storage.format.sharded import ShardedArray

CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}


def _array(tmp_path) -> tuple[ArrayLayout, ShardedArray]:
    lay = ArrayLayout("frames/obs", 64, (3, 5), "uint8", 4, 16, CODEC)
    root = zarr.open_group(str(tmp_path), mode="w")
    root.create_group("frames")
    lay.create(root)
    return lay, ShardedArray(str(tmp_path), lay)


def test_installed_shards_leave_no_index_behind_and_read_back_equal(tmp_path):
    _, arr = _array(tmp_path)
    data = np.random.default_rng(1).integers(0, 255, (64, 3, 5), dtype=np.uint8)
    for shard in range(4):
        arr.write_shard(shard, data[shard * 16:(shard + 1) * 16], 16)
    assert arr._indexes == {} and arr._chunk_crcs == {}  # nothing per shard written but its identity
    assert sorted(arr.identities) == [0, 1, 2, 3]
    out = np.empty((4, 3, 5), np.uint8)
    for chunk in range(16):
        arr.read_chunk(chunk, out)
        np.testing.assert_array_equal(out, data[chunk * 4:(chunk + 1) * 4])
    assert sorted(arr._indexes) == [0, 1, 2, 3]  # a read keeps what it read (the reading cache)
    arr.write_shard(2, data[:16], 16)  # rewritten: the index read before is stale and dropped
    assert 2 not in arr._indexes
    arr.read_chunk(8, out)
    np.testing.assert_array_equal(out, data[:4])


def test_a_file_replaced_after_its_install_is_refused_when_read(tmp_path):
    lay, arr = _array(tmp_path)
    arr.write_shard(0, np.ones((16, 3, 5), np.uint8), 16)
    other = tmp_path / "other"
    _, elsewhere = _array(other)
    elsewhere.write_shard(0, np.full((16, 3, 5), 7, np.uint8), 16)  # a well-formed file of another identity
    with open(lay.shard_file(str(other), 0), "rb") as src, open(lay.shard_file(str(tmp_path), 0), "wb") as dst:
        dst.write(src.read())
    with pytest.raises(CorruptDataError, match="shard 0"):
        arr.read_chunk(0, np.empty((4, 3, 5), np.uint8))
