"""``frame_codec="auto"`` (Store.create's default): the codec follows the frames, the capacity and the budget,
and the choice is stored with the store."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.columns.spec import choose_frame_codec

GREY = spaces.Box(0, 255, (84, 84), np.uint8)
RGB_FIRST = spaces.Box(0, 255, (3, 84, 84), np.uint8)
RGB_LAST = spaces.Box(0, 255, (64, 64, 3), np.uint8)
GIB = 1 << 30


def _codec(store) -> str:
    return store.schema.observations[0].codec["name"]


@pytest.mark.parametrize("space", [RGB_FIRST, RGB_LAST], ids=["channel-first", "channel-last"])
def test_colour_frames_get_the_temporal_codec(space):
    assert choose_frame_codec(space, 1000, GIB) == "delta-zstd"


def test_grey_frames_follow_the_budget_at_capacity():
    assert choose_frame_codec(GREY, 1_125_000, GIB) == "lz4hc"       # 1M Atari: ~0.8 GB coded per frame
    assert choose_frame_codec(GREY, 11_250_000, GIB) == "delta-zstd"  # 10M Atari: ~7.9 GB
    assert choose_frame_codec(GREY, 11_250_000, 16 * GIB) == "lz4hc"  # ... unless the budget holds it
    assert choose_frame_codec(GREY, None, GIB) == "lz4hc"             # unbounded: size unknown at creation


def test_small_and_non_image_observations_keep_per_frame_codecs():
    assert choose_frame_codec(spaces.Box(0, 255, (3, 8, 8), np.uint8), 10**6, GIB) == "lz4hc"
    assert choose_frame_codec(spaces.Box(-1, 1, (4,), np.float32), 10**8, GIB) == "lz4hc"
    both = spaces.Dict({"pixels": RGB_FIRST, "state": spaces.Box(-1, 1, (5,), np.float32)})
    assert choose_frame_codec(both, 1000, GIB) == "delta-zstd"


def test_create_uses_the_choice_and_reopen_keeps_it(tmp_path):
    path = tmp_path / "rgb.mmr"
    with mmreplay.Store.create(path, RGB_FIRST, spaces.Discrete(4), capacity=1000) as store:
        assert _codec(store) == "temporal"
    with mmreplay.Store.open(path, mode="r", cache_bytes=GIB * 64) as store:
        assert _codec(store) == "temporal"
    # grey frames: per frame unless this session's budget cannot hold them at this capacity
    with mmreplay.Store.create(tmp_path / "fits.mmr", GREY, spaces.Discrete(4), capacity=100_000) as store:
        assert _codec(store) == "blosc"
    with mmreplay.Store.create(tmp_path / "big.mmr", GREY, spaces.Discrete(4), capacity=100_000,
                               cache_bytes=16 << 20) as store:
        assert _codec(store) == "temporal"


def test_an_explicit_codec_always_wins(tmp_path):
    with mmreplay.Store.create(tmp_path / "a.mmr", RGB_FIRST, spaces.Discrete(4), capacity=1000,
                               frame_codec="lz4hc") as store:
        assert _codec(store) == "blosc"
