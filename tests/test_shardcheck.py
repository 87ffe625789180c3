"""The compiled whole-file check of the background pass (``_native/shardcheck.py``): it proves the files the
commit expects, and never proves a file that the long check (``ShardedArray.check_file``) refuses."""

import os
import random

import numpy as np
import pytest

import mmreplay
import synthetic as syn
from conftest import wait_preloaded
from mmreplay.storage.format.sharded import ShardedArray
from mmreplay.storage.format.shardfile import TAG_HEAD, tail_nbytes
from mmreplay._native import shardcheck

pytestmark = pytest.mark.skipif(not shardcheck.AVAILABLE, reason="the codecs' C symbols did not link")


@pytest.fixture
def reopened(synthetic_store, store_path):
    """A closed store of several sealed frame shards and a partial one, reopened read-only: its frame array,
    and per sealed shard its file's bytes."""
    s = synthetic_store(capacity=600, n=500)
    s.close()
    with mmreplay.Store.open(store_path, mode="r", preload=False) as r:
        array = r._state.reader.columns["obs"].column.array
        sealed = sorted(array.identities)
        raw = {k: np.fromfile(array.layout.shard_file(array.root, k), np.uint8) for k in sealed}
        yield array, raw


def group(raw: dict) -> tuple[list, np.ndarray, np.ndarray, np.ndarray]:
    shards = sorted(raw)
    sizes = np.array([raw[k].size for k in shards], np.int64)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return shards, np.concatenate([raw[k] for k in shards]), offsets, sizes


def long_check_passes(array: ShardedArray, shard: int, buf: np.ndarray) -> bool:
    try:
        array.check_file(shard, buf)
        return True
    except mmreplay.CorruptDataError:
        return False


def test_the_tag_layout_is_the_one_the_kernel_reads():
    assert TAG_HEAD.format == "<4sIIIQQQ" and TAG_HEAD.size == shardcheck.TAG_HEAD_NBYTES


def test_the_files_the_commit_expects_are_proven(reopened):
    array, raw = reopened
    assert len(raw) >= 3
    shards, buf, offsets, sizes = group(raw)
    assert array.proven_files(shards, buf, offsets, sizes).all()
    # under another shard's number, or with their sizes past the buffer: not proven (and nothing read outside)
    assert not array.proven_files([s + 1 for s in shards], buf, offsets, sizes).any()
    assert not array.proven_files(shards, buf[:-1], offsets, sizes)[-1]
    assert not array.proven_files(shards, buf, offsets - 1, sizes)[0]


def test_the_partial_shard_and_unlisted_files_are_left_to_the_long_check(reopened):
    array, raw = reopened
    partial = array.partial[0]
    path = array.layout.shard_file(array.root, partial)
    data = np.fromfile(path, np.uint8)
    sizes = np.array([data.size], np.int64)
    assert not array.proven_files([partial], data, np.zeros(1, np.int64), sizes)[0]
    assert long_check_passes(array, partial, data)
    shards, buf, offsets, sizes = group(raw)
    listed, array.identities = array.identities, {}
    try:
        assert not array.proven_files(shards, buf, offsets, sizes).any()
    finally:
        array.identities = listed


def test_no_flipped_bit_is_proven_where_the_long_check_refuses(reopened):
    """Single-bit flips anywhere in a file: in its tail (tag, index, their checksums) or a chunk's stored
    checksum it is never proven; elsewhere (a chunk's payload, left to the decoder's checksum) whatever it
    says, the long check agrees."""
    array, raw = reopened
    shards, buf, offsets, sizes = group(raw)
    rng = random.Random(0)
    n = array.layout.chunks_per_shard
    for trial in range(400):
        i = rng.randrange(len(shards))
        tail_start = int(sizes[i]) - tail_nbytes(n)
        at = rng.randrange(tail_start, int(sizes[i])) if trial % 2 else rng.randrange(int(sizes[i]))
        damaged = buf.copy()
        damaged[offsets[i] + at] ^= np.uint8(1 << rng.randrange(8))
        proven = array.proven_files(shards, damaged, offsets, sizes)
        assert proven[np.arange(len(shards)) != i].all()  # the others are untouched
        mine = damaged[offsets[i]:offsets[i] + sizes[i]]
        if at >= tail_start:
            assert not proven[i], f"a flip at tail byte {at - tail_start} was proven"
        if proven[i]:
            assert long_check_passes(array, shards[i], mine), f"byte {at} of shard {shards[i]}"


def test_the_background_pass_holds_proven_files_without_the_long_check(synthetic_store, store_path, monkeypatch):
    s = synthetic_store(capacity=600, n=500)
    s.close()
    calls = []
    real = ShardedArray.check_file
    monkeypatch.setattr(ShardedArray, "check_file", lambda self, shard, buf: calls.append(shard) or
                        real(self, shard, buf))
    with mmreplay.Store.open(store_path, mode="r") as r:
        wait_preloaded(r)
        array = r._state.reader.columns["obs"].column.array
        held = set(r._state.reader.columns["obs"].resident.buffers)
        assert set(array.identities) <= held and not set(calls) & set(array.identities)
        g = np.arange(*r.inspect.valid_range())
        assert syn.wrong_rows(r.inspect.get(g)) == []
    # a sealed shard replaced by another one of the store: not proven, refused by the long check, never held
    victim, other = sorted(array.identities)[:2]
    with open(array.layout.shard_file(array.root, other), "rb") as f:
        replacement = f.read()
    with open(array.layout.shard_file(array.root, victim), "wb") as f:
        f.write(replacement)
    calls.clear()
    with mmreplay.Store.open(store_path, mode="r") as r:
        wait_preloaded(r)
        assert victim in calls and victim not in r._state.reader.columns["obs"].resident.buffers
        with pytest.raises(mmreplay.CorruptDataError, match="not the shard file the last commit expects"):
            r.inspect.get(np.arange(*r.inspect.valid_range()))
    assert os.path.exists(array.layout.shard_file(array.root, victim))
