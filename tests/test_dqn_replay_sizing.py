"""The dqn-replay import's memory and CPU choices: the store sized from the checkpoints (never grown by
doubling, nothing dropped), the default frame codec (no reference search, the same chunk format) and the two
inflaters (ISA-L when installed, the standard library's zlib otherwise) reading the same rows and naming the
same damage."""

from __future__ import annotations

import gzip
import os
import shutil
import zlib

import numpy as np
import pytest

from mmreplay.codecs import temporal
from mmreplay.datasets import npy_stream
from mmreplay.datasets.dopamine_files import (
    checkpoint_files,
    iter_frame_blocks,
    read_checkpoint,
)
from mmreplay.datasets.dqn_replay import DQN_FRAME_CODEC, import_dqn_replay
from mmreplay.datasets.npy_stream import NpyFormatError
from mmreplay.store import Store

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "dqn_replay")


def _rows(numbers):
    files = checkpoint_files(FIXTURE)
    return sum(read_checkpoint(n, files[n]).rows for n in numbers)


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    path = tmp_path_factory.mktemp("dqn_sizing") / "store"
    return path, import_dqn_replay(FIXTURE, path)


def test_the_store_is_sized_from_the_checkpoints(imported):
    path, summary = imported
    with Store.open(path, "r") as store:
        assert store.capacity == _rows([0, 1])  # allocated once: no doubling of the index
        assert store.inspect.valid_range() == (0, summary["transitions"])
        assert len(store) == summary["transitions"]
        codec = store.schema.observations[0].codec
        assert codec["search"] == 0 and codec["run"] == DQN_FRAME_CODEC["run"]


def test_capacity_none_is_unbounded_and_bad_values_are_named(tmp_path):
    summary = import_dqn_replay(FIXTURE, tmp_path / "unbounded", capacity=None, checkpoints="0")
    with Store.open(tmp_path / "unbounded", "r") as store:
        assert store.capacity is None and len(store) == summary["transitions"]
    with pytest.raises(ValueError, match=r"capacity 'all'.*'rows'"):
        import_dqn_replay(FIXTURE, tmp_path / "bad", capacity="all")


def test_a_ring_that_wraps_is_caught(tmp_path):
    """Were the frame ring sized too small (here on purpose), frames and the transitions needing them would be
    dropped: the import says so instead of leaving a store that silently lacks rows."""
    with pytest.raises(RuntimeError, match=r"holds transitions [1-9]\d*\.\.\d+, the import wrote 0\.\.\d+"):
        import_dqn_replay(FIXTURE, tmp_path / "small", checkpoints="0", frame_capacity=64)


def test_cli_sizes_from_the_checkpoints(tmp_path):
    from mmreplay.cli.main import main

    assert main(["import", "--format", "dqn-replay", FIXTURE, str(tmp_path / "cli"), "--checkpoints", "1"]) == 0
    with Store.open(tmp_path / "cli", "r") as store:
        assert store.capacity == _rows([1])


def test_search_zero_codes_the_run_alone_and_decodes_exactly():
    rng = np.random.default_rng(3)
    frames = rng.integers(0, 4, (8, 84, 84), dtype=np.uint8)
    data = temporal.encode_run(frames, search=0)
    n, nbytes, refs = temporal.parse_header(memoryview(data), frames.nbytes)
    assert (n, nbytes) == (8, 84 * 84) and not refs.any()
    assert np.array_equal(temporal.decode_run(data, np.empty_like(frames)), frames)
    assert len(temporal.encode_run(frames, search=8)) <= len(data)  # the search only ever picks the smaller


def _frames_read():
    files = checkpoint_files(FIXTURE)
    out = []
    for n in sorted(files):
        ckpt = read_checkpoint(n, files[n])
        buf = np.empty((64, *ckpt.frame_shape), np.uint8)
        out += [frames.copy() for _, frames in iter_frame_blocks(ckpt, 0, buf)]
    return np.concatenate(out)


@pytest.fixture
def stdlib_inflate(monkeypatch):
    monkeypatch.setattr(npy_stream, "_inflating", gzip)
    monkeypatch.setattr(npy_stream, "_IsalError", zlib.error)


def test_both_inflaters_read_the_same_rows(stdlib_inflate, monkeypatch):
    plain = _frames_read()
    monkeypatch.undo()
    assert np.array_equal(_frames_read(), plain)


@pytest.mark.parametrize("inflater", ["default", "stdlib"])
def test_damage_is_named_by_either_inflater(tmp_path, request, inflater):
    if inflater == "stdlib":
        request.getfixturevalue("stdlib_inflate")
    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    obs = src / "$store$_observation_ckpt.0.gz"
    data = bytearray(obs.read_bytes())
    data[-8] ^= 0xFF  # the trailer's CRC-32
    obs.write_bytes(bytes(data))
    with pytest.raises(NpyFormatError, match=r"checkpoint 0 observation .*corrupt gzip"):
        import_dqn_replay(src, tmp_path / "store", checkpoints="0")
    obs.write_bytes(bytes(data[: len(data) // 2]))  # truncated inside the frames
    with pytest.raises(NpyFormatError, match=r"checkpoint 0 observation .*(truncated|corrupt gzip)"):
        import_dqn_replay(src, tmp_path / "store2", checkpoints="0")


def test_the_import_holds_no_reading_budget_nor_an_encoder_child(tmp_path, monkeypatch):
    """A writer's reading budget holds the shards it wrote (~100 bytes a transition) until it is full: 1 GiB by
    default without a memory limit, beyond the 1 GB the whole dataset's import may take. Its encoder child
    would add a second interpreter and its shared staging queue."""
    from mmreplay.datasets import dqn_replay

    budgets = []
    create = Store.create.__func__

    def spy(cls, *args, **kwargs):
        store = create(cls, *args, **kwargs)
        budgets.append((store.settings.cache_bytes, store.settings.encoder))
        return store

    monkeypatch.setattr(Store, "create", classmethod(spy))
    import_dqn_replay(FIXTURE, tmp_path / "store", checkpoints="0")
    assert budgets == [(dqn_replay.IMPORT_CACHE_BYTES, "thread")]  # no encoder child: no second interpreter


def test_each_commit_hands_free_heap_pages_back(tmp_path, monkeypatch):
    from mmreplay.datasets import dqn_replay

    calls = []
    monkeypatch.setattr(dqn_replay, "release_free_heap", lambda: calls.append(1))
    import_dqn_replay(FIXTURE, tmp_path / "store", checkpoints="0", commit_rows=100, block_bytes=64 * 84 * 84)
    assert len(calls) >= 4  # the first commit, every 100 rows (~480 transitions), the checkpoint's end, the last
    monkeypatch.undo()
    dqn_replay.release_free_heap()  # glibc here: the real call runs (a no-op elsewhere)
