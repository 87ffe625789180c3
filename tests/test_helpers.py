"""The codec helpers (``_native/helpers.py``): jobs shared with helper threads give exactly what the
caller's thread alone gives, failures included; a caller never waits on a helper that is asleep, busy
elsewhere or absent; and a forked child gets helpers of its own."""

import threading
import time

import numpy as np
import torch
import pytest

import mmreplay
from mmreplay._native import helpers, linked
from mmreplay._native.codec_kinds import CODEC_BLOSC
from mmreplay._native.gather import gather_stacks
from test_reading import atari_like, chunk_bytes, direct_budget, expected_obs, frames  # noqa: F401 (a fixture)
from numcodecs import blosc


@pytest.fixture
def two_helpers(monkeypatch):
    """Two helper threads for this test, whatever the machine's cores; stopped afterwards."""
    h = helpers.CodecHelpers(2)
    monkeypatch.setattr(helpers, "_HELPERS", h)
    yield h
    h.stop()


@pytest.mark.parametrize("dtype", [np.uint64, np.uint8])
@pytest.mark.parametrize("shifted", [True, False])
@pytest.mark.parametrize("n", [1, 7, 33, 300])
def test_a_shared_gather_copies_what_one_thread_copies(two_helpers, dtype, shifted, n):
    rng = np.random.default_rng(n)
    slab = rng.integers(0, 255, (500, 40), dtype=dtype)
    k = 4
    index = rng.integers(0, 500, (n, k + 1 if shifted else 2 * k)).astype(np.int64)
    want = np.empty((n * k, 40), dtype), np.empty((n * k, 40), dtype)
    got = np.zeros_like(want[0]), np.zeros_like(want[1])
    gather_stacks(slab, index, k, shifted, *want)
    assert two_helpers.gather(slab, index, k, shifted, *got)
    np.testing.assert_array_equal(got[0], want[0])
    np.testing.assert_array_equal(got[1], want[1])


@pytest.mark.parametrize("bad", [-1, 500])
def test_a_shared_gather_refuses_an_index_outside_the_slab_and_writes_nothing(two_helpers, bad):
    slab = np.arange(500 * 40, dtype=np.uint64).reshape(500, 40)
    index = np.zeros((33, 5), np.int64)
    index[20, 3] = bad
    out = np.zeros((33 * 4, 40), np.uint64), np.zeros((33 * 4, 40), np.uint64)
    with pytest.raises(ValueError, match=rf"index holds {bad} at flat position 103, outside \[0, 500\)"):
        two_helpers.gather(slab, index, 4, True, *out)
    assert not out[0].any() and not out[1].any()
    index[20, 3] = 499  # and the helpers are free again
    assert two_helpers.gather(slab, index, 4, True, *out) and out[1].any()


def encoded(n: int):
    """``n`` blosc-lz4 frame chunks (with their crc32c) in one buffer: (buffer, src, sizes, frames)."""
    data = frames(n, seed=3)
    codec = blosc.Blosc(cname="lz4", clevel=5, shuffle=blosc.NOSHUFFLE)
    chunks = [chunk_bytes(codec.encode(f.tobytes())) for f in data]
    buf = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    src = buf.ctypes.data + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return buf, src, sizes, data


def test_shared_decodes_land_where_asked_and_a_corrupt_chunk_is_reported(two_helpers):
    n = 200
    buf, src, sizes, data = encoded(n)
    out = np.zeros((n, 84, 84), np.uint8)
    copies_out = np.zeros((n, 84, 84), np.uint8)
    dst = out.ctypes.data + np.arange(n, dtype=np.int64) * out[0].nbytes
    copies = np.where(np.arange(n) % 3 == 0, copies_out.ctypes.data + np.arange(n) * out[0].nbytes, 0).astype(np.int64)
    status = np.full(n, -1, np.int8)
    assert two_helpers.decode(src, sizes, dst, copies, out[0].nbytes, CODEC_BLOSC, status,
                              (out, copies_out)) == 0
    assert (status == linked.OK).all()
    np.testing.assert_array_equal(out, data)
    np.testing.assert_array_equal(copies_out[::3], data[::3])
    # one flipped byte in chunk 150 (a piece that either thread may take): that chunk fails, the rest decode
    buf[src[150] - buf.ctypes.data + 5] ^= 0xFF
    out[:] = 0
    assert two_helpers.decode(src, sizes, dst, copies, out[0].nbytes, CODEC_BLOSC, status,
                              (out, copies_out)) == 1
    assert status[150] == linked.BAD_CHECKSUM and np.count_nonzero(status) == 1
    np.testing.assert_array_equal(np.delete(out, 150, 0), np.delete(data, 150, 0))


def test_a_caller_finds_helpers_asleep_and_the_job_still_completes(two_helpers):
    slab = np.arange(1000 * 8, dtype=np.uint64).reshape(1000, 8)
    index = np.arange(100 * 5, dtype=np.int64).reshape(100, 5)
    out = np.empty((400, 8), np.uint64), np.empty((400, 8), np.uint64)
    deadline = time.monotonic() + 5
    while not all(two_helpers.ctrl[helpers.SLEEPING + i] for i in range(2)):  # idle: they go to sleep
        assert time.monotonic() < deadline, "helpers never went to sleep"
        time.sleep(0.01)
    for _ in range(50):
        assert two_helpers.gather(slab, index, 4, True, *out)
        np.testing.assert_array_equal(out[0], slab[index[:, :4].reshape(-1)])
        np.testing.assert_array_equal(out[1], slab[index[:, 1:].reshape(-1)])
        time.sleep(0.002)  # longer than their spin: each job may find them asleep, or waking


def test_threads_that_sample_at_once_all_get_true_rows(atari_like, two_helpers):
    """Three samplers in three threads, decoding straight into batches or copying from the decoded cache:
    one job at a time goes to the helpers, the others are done by their callers alone."""
    path, data = atari_like
    budgets = [direct_budget(path), 1 << 30, direct_budget(path)]
    errors = []

    def sample(seed):
        try:
            with mmreplay.Store.open(path, mode="r", cache_bytes=budgets[seed]) as s:
                smp = s.sampler(64, seed=seed, prefetch=0)
                for _ in range(40):
                    b = smp.sample()
                    np.testing.assert_array_equal(b.obs.numpy(), expected_obs(data, b.indices.numpy()))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=sample, args=(i,)) for i in range(3)]
    [t.start() for t in threads]
    [t.join() for t in threads]
    assert not errors, errors[0]


def test_the_number_of_helpers_is_checked(monkeypatch):
    monkeypatch.setenv(helpers.ENV, "two")
    with pytest.raises(ValueError, match="MMREPLAY_CODEC_THREADS.*'two'"):
        helpers.helper_count()
    monkeypatch.setenv(helpers.ENV, "-1")
    with pytest.raises(ValueError, match=">= 0, got -1"):
        helpers.helper_count()
    monkeypatch.setenv(helpers.ENV, "0")
    assert helpers.helper_count() == 0
    monkeypatch.setattr(helpers, "_HELPERS", None)
    assert helpers.codec_helpers() is None  # off: every job is done by its caller


class HelperCount(torch.utils.data.Dataset):
    def __len__(self):
        return 1

    def __getitem__(self, i):
        return helpers.helper_count()


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # fork with threads
def test_dataloader_workers_share_the_cores_without_helpers(monkeypatch):
    monkeypatch.delenv(helpers.ENV, raising=False)
    loader = torch.utils.data.DataLoader(HelperCount(), batch_size=None, num_workers=1, multiprocessing_context="fork",
                                         timeout=60)
    assert list(loader) == [0]


def test_arrays_a_helper_could_not_rebuild_are_left_to_the_caller(two_helpers):
    slab = np.zeros((10, 8), np.uint64)
    index = np.zeros((4, 5), np.int64)
    out = np.zeros((16, 8), np.uint64)
    assert not two_helpers.gather(slab[:, ::2], index, 4, True, out[:, :4], out[:, :4])  # strided rows
    assert not two_helpers.gather(slab.astype(np.int32), index, 4, True, out, out)  # a dtype not copied
    assert not two_helpers.gather(slab, index, 3, True, out, out)  # an index that is not of stacks of 3
    a = np.zeros(40, np.int64)
    room = np.zeros((20, 8), np.uint8)
    dst = room.ctypes.data + np.arange(20, dtype=np.int64) * 8
    assert two_helpers.decode(a[::2], a[:20], dst, a[:20], 8, 0, np.zeros(20, np.int8), (room,)) is None
    assert two_helpers.decode(a[:20], a[:20], dst, a[:20], 8, 0, np.zeros(20, np.int32), (room,)) is None
    with pytest.raises(ValueError, match="disagree in length: 20 sources, 19 sizes"):  # a caller's bug
        two_helpers.decode(a[:20], a[:19], dst, a[:20], 8, 0, np.zeros(20, np.int8), (room,))
    assert two_helpers.gather(slab, index, 4, True, out, out)  # and a plain job still runs
