"""The thread and process knobs are ``Settings`` fields (``codec_threads``, ``encoder``), validated like the
others, with their environment variables as overrides: environment, then field, then the automatic default."""

import dataclasses
import time

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import encoder_children, frame
from mmreplay._native import helpers
from mmreplay.settings import CODEC_THREADS_ENV, ENCODER_ENV, Settings
from mmreplay.storage.format.encoder import MIN_ROW_BYTES, ShardEncoder

ATARI = spaces.Box(0, 255, (84, 84), np.uint8)  # rows big enough for the encoder child


@pytest.fixture(autouse=True)
def no_overrides(monkeypatch):
    """Each test starts with no override in the environment."""
    monkeypatch.delenv(CODEC_THREADS_ENV, raising=False)
    monkeypatch.delenv(ENCODER_ENV, raising=False)


def test_defaults_are_automatic_threads_and_the_encoder_process():
    s = Settings()
    assert (s.codec_threads, s.encoder) == (None, "process")
    assert Settings(codec_threads=np.int64(3)).codec_threads == 3 and type(Settings(codec_threads=3).codec_threads) is int
    assert Settings(codec_threads=0, encoder="thread").encoder == "thread"


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_codec_threads_must_be_none_or_a_count(bad):
    with pytest.raises(ValueError, match=f"codec_threads must be None .* got {bad!r}"):
        Settings(codec_threads=bad)


def test_the_encoder_is_a_process_or_a_thread():
    with pytest.raises(ValueError, match="encoder must be one of .*'process', 'thread'.* got 'fork'"):
        Settings(encoder="fork")


def test_the_environment_overrides_the_field(monkeypatch):
    chosen = Settings(codec_threads=3, encoder="process")
    assert chosen.with_environment() == chosen
    monkeypatch.setenv(CODEC_THREADS_ENV, "1")
    monkeypatch.setenv(ENCODER_ENV, "thread")
    assert chosen.with_environment() == dataclasses.replace(chosen, codec_threads=1, encoder="thread")
    assert Settings.resolve(chosen, {"codec_threads": 5}).codec_threads == 1  # over keywords too


@pytest.mark.parametrize("name, value, message", [
    (CODEC_THREADS_ENV, "two", "MMREPLAY_CODEC_THREADS must be a number of threads .*'two'"),
    (CODEC_THREADS_ENV, "-2", "MMREPLAY_CODEC_THREADS must be >= 0, got -2"),
    (ENCODER_ENV, "fork", "MMREPLAY_ENCODER must be one of .* got 'fork'")])
def test_a_bad_override_names_its_variable(monkeypatch, name, value, message):
    monkeypatch.setenv(name, value)
    with pytest.raises(ValueError, match=message):
        Settings().with_environment()
    with pytest.raises(ValueError, match=message):
        Settings.resolve(None, {})  # what Store.create/open call: refused when the session opens


def test_the_codec_helpers_count_comes_from_the_session_settings(monkeypatch):
    monkeypatch.setattr(helpers, "_in_dataloader_worker", lambda: False)
    automatic = helpers.helper_count()  # no session yet: the defaults (one fewer than the cores, at most 7)
    assert 0 <= automatic <= 7
    session = Settings.resolve(None, {"codec_threads": 2})  # as Store.open(path, codec_threads=2)
    assert helpers.helper_count(session.codec_threads) == 2
    assert helpers.helper_count(Settings.resolve(Settings(codec_threads=100), {}).codec_threads) == helpers.MAX_HELPERS
    monkeypatch.setenv(CODEC_THREADS_ENV, "0")
    assert helpers.helper_count(session.codec_threads) == 0  # the environment wins over the session's field
    assert Settings.resolve(None, {"codec_threads": 2}).codec_threads == 0


def test_a_store_passes_its_session_codec_threads_to_the_reader(tmp_path):
    import mmreplay
    from gymnasium import spaces

    with mmreplay.Store.create(tmp_path / "s.mmr", spaces.Box(0, 255, (8, 8), "uint8"), spaces.Discrete(2),
                               capacity=100, codec_threads=3) as store:
        assert store._state.reader.codec_threads == 3  # what the first decoded batch makes the helpers with


def test_the_encoder_field_chooses_where_shards_are_compressed(tmp_path, monkeypatch):
    assert 84 * 84 >= MIN_ROW_BYTES
    assert ShardEncoder.for_rows(84 * 84, encoder="thread") is None  # the session's field, passed down
    before = set(encoder_children())
    with mmreplay.Store.create(str(tmp_path / "thread"), ATARI, spaces.Discrete(2), capacity=64,
                               encoder="thread") as s:
        assert s.settings.encoder == "thread"
        assert set(encoder_children()) == before  # no child: the writer thread encodes
        _add_and_check(s)
    with mmreplay.Store.create(str(tmp_path / "process"), ATARI, spaces.Discrete(2), capacity=64) as s:
        assert s.settings.encoder == "process"
        assert set(encoder_children()) - before  # the default: a child process encodes
        _add_and_check(s)
    monkeypatch.setenv(ENCODER_ENV, "thread")
    with mmreplay.Store.create(str(tmp_path / "env"), ATARI, spaces.Discrete(2), capacity=64,
                               encoder="process") as s:
        assert s.settings.encoder == "thread"  # the environment wins over the keyword
        assert set(encoder_children()) == before


def _add_and_check(store) -> None:
    """Enough adds to seal shards, then every stored observation read back."""
    obs = [np.full((84, 84), i % 251, np.uint8) for i in range(41)]
    for i in range(40):
        store.add(obs[i], 0, 0.0, obs[i + 1], False, False)
    store.flush()
    got = store.inspect.get(np.arange(40))
    np.testing.assert_array_equal(got.obs.numpy(), np.stack(obs[:40]))
    np.testing.assert_array_equal(got.next_obs.numpy(), np.stack(obs[1:41]))


@pytest.mark.parametrize("bad", [0, 1, "no", None])
def test_preload_must_be_a_bool(bad):
    with pytest.raises(ValueError, match=f"preload must be True or False, got {bad!r}"):
        Settings(preload=bad)


def big(i: int) -> np.ndarray:
    """An 84x84 frame named by ``i``: its first row holds ``i``'s bytes, the rest ``i % 251``."""
    f = np.full((84, 84), i % 251, np.uint8)
    f[0, :8] = np.frombuffer(np.int64(i).tobytes(), np.uint8)
    return f


def test_preload_false_reads_no_shard_until_a_batch_needs_it(tmp_path):
    """``preload=False`` (what ``mmreplay info`` opens with): no background pass at open; the tier is then
    filled by the reads that batches make, and every row read is the frame that was added."""
    path = str(tmp_path / "s")
    with mmreplay.Store.create(path, ATARI, spaces.Discrete(4), capacity=4096) as s:
        for i in range(3000):
            s.add(big(i), i % 4, 0.0, big(i + 1), i % 500 == 499, False)
    with mmreplay.Store.open(path, mode="r", settings=Settings(preload=False)) as s:
        time.sleep(0.5)  # a pass started at open would have loaded these few small shards by now
        stats = s.inspect.cache_stats()["obs"]["compressed"]
        assert not stats["loading"] and stats["bytes"] == 0, stats
        got = s.inspect.get(np.arange(0, 3000, 7))
        want = np.stack([big(i) for i in range(0, 3000, 7)])
        assert (got.obs.numpy() == want).all()
    with mmreplay.Store.open(path, mode="r") as s:  # the default: the pass runs at open
        from conftest import wait_preloaded
        wait_preloaded(s)
        assert s.inspect.cache_stats()["obs"]["compressed"]["bytes"] > 0
