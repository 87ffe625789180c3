"""Dopamine checkpoint files read ahead by a thread (``dopamine_files.read_ahead_blocks``): the same blocks, in
the same order, as the plain streamed read, for wrapped and unwrapped checkpoints and any start row; a caller
that stops early or a reader that fails leaves no thread behind.
"""

from __future__ import annotations

import gzip
import os
import shutil
import threading

import numpy as np
import pytest

from mmreplay.datasets.dopamine_files import (
    _narrow_actions,
    _open_column,
    checkpoint_files,
    iter_frame_blocks,
    read_ahead_blocks,
    read_checkpoint,
    read_small_columns,
)
from mmreplay.datasets.npy_stream import NpyFormatError

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "dqn_replay")


def checkpoints(directory=FIXTURE):
    files = checkpoint_files(directory)
    return [read_checkpoint(n, files[n]) for n in sorted(files)]


def readers_alive() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith("mmreplay-dqn-read")]


def plain(ckpt, start, rows):
    out = np.empty((rows, *ckpt.frame_shape), np.uint8)
    return [(lo, frames.copy()) for lo, frames in iter_frame_blocks(ckpt, start, out)]


@pytest.mark.parametrize("rows", [7, 64, 1000])
def test_read_ahead_gives_the_plain_blocks(rows):
    ckpts = checkpoints()
    assert any(len(c.segments) == 2 for c in ckpts), "the fixture has a wrapped checkpoint"
    for ckpt in ckpts:
        for start in (0, 1, 5, ckpt.rows // 2, ckpt.rows - 1):
            buffers = [np.full((rows + 2, *ckpt.frame_shape), 255, np.uint8) for _ in range(2)]
            got = []
            for lo, frames, buffer in read_ahead_blocks(ckpt, start, buffers, slice(1, -1)):
                assert any(buffer is b for b in buffers)
                assert np.shares_memory(frames, buffer[1:-1])
                assert (buffer[0] == 255).all() and (buffer[-1] == 255).all()  # only buffer[inner] is read into
                got.append((lo, frames.copy()))
            want = plain(ckpt, start, rows)
            assert [lo for lo, _ in got] == [lo for lo, _ in want]
            assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(got, want))
            assert got[0][0] == start and got[-1][0] + len(got[-1][1]) == ckpt.rows
    assert not readers_alive()


def test_caller_that_stops_early_ends_the_thread():
    ckpt = checkpoints()[-1]
    buffers = [np.empty((10, *ckpt.frame_shape), np.uint8) for _ in range(2)]
    blocks = read_ahead_blocks(ckpt, 0, buffers)
    next(blocks)
    blocks.close()
    assert not readers_alive()


def test_reader_error_is_raised_in_the_caller(tmp_path):
    src = tmp_path / "ckpt"
    shutil.copytree(FIXTURE, src)
    name = src / "$store$_observation_ckpt.1.gz"
    raw = gzip.decompress(name.read_bytes())
    name.write_bytes(gzip.compress(raw[: len(raw) // 2]))  # declares all its rows, holds half
    ckpt = checkpoints(src)[-1]
    buffers = [np.empty((16, *ckpt.frame_shape), np.uint8) for _ in range(2)]
    with pytest.raises(NpyFormatError, match="truncated"):
        for _ in read_ahead_blocks(ckpt, 0, buffers):
            pass
    assert not readers_alive()


def test_a_block_is_inflated_a_bounded_piece_at_a_time(tmp_path, monkeypatch):
    """gzip's ``readinto`` inflates into a temporary of the size asked: a block read in one call would be held
    twice (``npy_stream.READ_BYTES``). The rows read are the rows written, across the pieces' seams."""
    from mmreplay.datasets import npy_stream

    monkeypatch.setattr(npy_stream, "READ_BYTES", 1000)  # not a multiple of a row (84 * 84 = 7056 bytes)
    frames = np.random.default_rng(3).integers(0, 255, (40, 84, 84), dtype=np.uint8)
    path = str(tmp_path / "obs.gz")
    with npy_stream.NpyWriter(path, frames.shape, np.uint8) as w:
        w.write_rows(frames)
    asked = []
    with npy_stream.NpyReader(path, what="frames", kinds="u", row_ndim=2) as r:
        inner = r._file

        class Recording:
            def readinto(self, view):
                asked.append(len(view))
                return inner.readinto(view)

        r._file = Recording()
        out = np.empty((40, 84, 84), np.uint8)
        r.read_rows(out[:25])
        r.read_rows(out[25:])
        r._file = inner
    np.testing.assert_array_equal(out, frames)
    assert max(asked) == 1000 and len(asked) >= 40 * 84 * 84 // 1000


def test_small_columns_are_held_compact_and_exact():
    """A checkpoint's action/reward/terminal columns are held for all of its rows beside the store's index (issue
    #42): Atari's actions in one byte, the reward as float32, terminal as bool, at most 6 bytes a row (int64
    actions took 13), and the values are the files' own."""
    for ckpt in checkpoints():
        cols = read_small_columns(ckpt)
        raw = {}
        for name in ("action", "reward", "terminal"):
            with _open_column(ckpt.files, name, ckpt.number) as r:
                raw[name] = ckpt.in_order(r.read_all())
        assert cols.action.dtype == np.uint8 and cols.reward.dtype == np.float32 and cols.terminal.dtype == bool
        assert cols.action.nbytes + cols.reward.nbytes + cols.terminal.nbytes <= 6 * ckpt.rows
        np.testing.assert_array_equal(cols.action, raw["action"])
        np.testing.assert_array_equal(cols.reward, raw["reward"].astype(np.float32))
        np.testing.assert_array_equal(cols.terminal, raw["terminal"] != 0)


@pytest.mark.parametrize("top, dtype", [(0, np.uint8), (255, np.uint8), (256, np.uint16), (70_000, np.uint32),
                                        (2**33, np.int64)])
def test_actions_keep_their_values_in_the_narrowest_type(top, dtype):
    action = np.array([0, 1, top, 3], np.int64)
    got = _narrow_actions(action)
    assert got.dtype == dtype
    assert got.tolist() == action.tolist()
    assert _narrow_actions(np.zeros(0, np.int32)).size == 0


def test_the_import_reads_ahead_into_two_small_blocks(tmp_path, monkeypatch):
    """The read-ahead buffers are held for the whole import: two of ``BLOCK_BYTES`` (+ 2 frames), 2 MiB each
    (8 MiB blocks cost 12 MB more of a 50M import's peak RSS, issue #42)."""
    from mmreplay.datasets import dqn_replay

    seen = []
    real = dqn_replay.read_ahead_blocks

    def spy(ckpt, start, buffers, inner):
        seen.append([b.nbytes for b in buffers])
        return real(ckpt, start, buffers, inner)

    monkeypatch.setattr(dqn_replay, "read_ahead_blocks", spy)
    dqn_replay.import_dqn_replay(FIXTURE, tmp_path / "store", checkpoints="0")
    frame = 84 * 84
    assert seen and all(len(b) == dqn_replay.READ_AHEAD_BUFFERS == 2 for b in seen)
    assert max(max(b) for b in seen) <= (2 << 20) + 2 * frame
