"""``Settings.device_cache_bytes`` (issue #38): the public knob of the device-resident compressed tier
(``device/resident.py``). Validated like the other settings, overridden by ``MMREPLAY_DEVICE_CACHE_BYTES``, it sizes
the tier of every sampler that decodes on the device when the sampler is made (before its first batch), and is
ignored by a sampler that decodes on the CPU. The CPU stands in for the device (CPU tensors, the CPU decoder)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from test_device_decode import fields, grey_frames, make_store

import mmreplay
from mmreplay.device.resident import DeviceTier
from mmreplay.settings import DEVICE_CACHE_BYTES_ENV, Settings

ROOM = 3_000_000  # more than the test store's compressed frames: every chunk read is held


@pytest.fixture(autouse=True)
def no_override(monkeypatch):
    monkeypatch.delenv(DEVICE_CACHE_BYTES_ENV, raising=False)


@pytest.fixture(scope="module")
def store_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tier") / "s")
    make_store(path, grey_frames(), "zstd").close()
    return path


def test_the_default_is_no_device_tier_and_a_count_of_bytes_is_kept_as_an_int():
    assert Settings().device_cache_bytes == 0
    got = Settings(device_cache_bytes=np.int64(1 << 20)).device_cache_bytes
    assert got == 1 << 20 and type(got) is int


@pytest.mark.parametrize("bad", [-1, True, 1.5, "1000", None])
def test_device_cache_bytes_must_be_a_count_of_bytes(bad):
    with pytest.raises(ValueError, match=f"device_cache_bytes must be a number of bytes >= 0 .*got {bad!r}"):
        Settings(device_cache_bytes=bad)


def test_a_bad_value_given_as_a_keyword_is_refused_at_open(store_path):
    with pytest.raises(ValueError, match="device_cache_bytes must be .* got -5"):
        mmreplay.Store.open(store_path, mode="r", device_cache_bytes=-5)


@pytest.mark.parametrize("bad", ["1G", "-1", "", "2.5"])
def test_a_bad_environment_value_names_the_variable(monkeypatch, bad):
    monkeypatch.setenv(DEVICE_CACHE_BYTES_ENV, bad)
    with pytest.raises(ValueError, match=f"{DEVICE_CACHE_BYTES_ENV} must be a number of bytes .*got {bad!r}"):
        Settings(device_cache_bytes=5).with_environment()


def test_the_setting_sizes_the_tier_when_the_sampler_is_made(store_path):
    with mmreplay.Store.open(store_path, mode="r", device_cache_bytes=ROOM) as store:
        assert store.settings.device_cache_bytes == ROOM
        with store.sampler(32, seed=2, decode="device") as dev:
            assert dev.decode == "device"
            # before any batch: the pool is there, whole, and empty
            assert dev.device_tier == {"capacity_bytes": ROOM, "bytes": 0, "hits": 0, "misses": 0, "chunks": 0}
            assert dev._device_path.tier.pool.numel() == ROOM
            next(dev)
            first = dev._device_draw.pending.staged.nbytes
            after_one = dev.device_tier
            assert after_one["chunks"] > 0 and 0 < after_one["bytes"] <= ROOM  # the first batch filled it
            for _ in range(30):
                next(dev)
            assert dev.device_tier["hits"] > 0
            assert dev._device_draw.pending.staged.nbytes < first / 4  # held chunks are not staged again


def test_the_environment_wins_over_the_field_and_reaches_the_tier(monkeypatch, store_path):
    monkeypatch.setenv(DEVICE_CACHE_BYTES_ENV, str(ROOM + 1))
    with mmreplay.Store.open(store_path, mode="r", device_cache_bytes=7) as store, \
            store.sampler(8, seed=0, decode="device") as dev:
        assert store.settings.device_cache_bytes == ROOM + 1
        assert dev.device_tier["capacity_bytes"] == ROOM + 1
    monkeypatch.setenv(DEVICE_CACHE_BYTES_ENV, "0")  # 0 turns a tier the script asks for off
    with mmreplay.Store.open(store_path, mode="r", device_cache_bytes=ROOM) as store, \
            store.sampler(8, seed=0, decode="device") as dev:
        assert dev.decode == "device" and dev.device_tier is None and dev._device_path.tier is None


def test_a_sampler_decoding_on_the_cpu_ignores_it(store_path):
    with mmreplay.Store.open(store_path, mode="r", device_cache_bytes=ROOM) as store:
        for decode in ("cpu", "auto"):  # auto on a CPU device: the CPU path
            with store.sampler(8, seed=0, decode=decode, name=decode) as smp:
                assert smp.decode == "cpu" and smp.device_tier is None and smp._device_path is None
                next(smp)


def test_rows_with_the_tier_equal_the_cpu_path(store_path):
    """With the setting on, a sampler's batches equal the CPU path's bit for bit, the later ones served mostly from
    the tier; a tier too small for the frames gives the same rows (the rest staged)."""
    for room in (ROOM, 8_000):
        with mmreplay.Store.open(store_path, mode="r", device_cache_bytes=room) as store, \
                store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="cpu", name="cpu_path") as cpu, \
                store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="device", name="device_path") as dev:
            for i in range(10):
                want, got = fields(next(cpu)), fields(next(dev))
                assert want.keys() == got.keys()
                for key in want:
                    assert torch.equal(want[key], got[key]), f"room {room}, batch {i}: {key} differs"
            stats = dev.device_tier
        assert stats["capacity_bytes"] == room and stats["hits"] > 0 and stats["bytes"] <= room
        if room < ROOM:
            assert stats["misses"] > stats["chunks"]  # full: the rest was staged batch by batch


def test_a_tier_the_device_cannot_hold_is_an_error_naming_the_setting(monkeypatch):
    empty = torch.empty

    def no_room(*shape, **kw):
        if shape and shape[0] == 10**12:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 931.32 GiB")
        return empty(*shape, **kw)

    monkeypatch.setattr(torch, "empty", no_room)
    with pytest.raises(RuntimeError, match=r"device_cache_bytes=1,000,000,000,000: cpu cannot hold .* smaller"):
        DeviceTier(torch.device("cpu"), 10**12)
    assert DeviceTier(torch.device("cpu"), 1000).pool.numel() == 1000
