"""The public API of issues #13 and #22: session settings, a sampler's draw strategy, one way to update
priorities, one open sampler per name, read accessors (``store.inspect``), reused-buffer draws."""

import warnings

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import IMG, frame
from mmreplay.sampling.batch import BatchBuffers
from mmreplay.sampling.strategy import Prioritized


def filled(make_store, n=60, **kw):
    s = make_store(**kw)
    for i in range(n):
        s.add(frame(i), i % 3, (-1, 0, 1)[i % 3], frame(i + 1), i % 20 == 19, False)
    return s


def test_settings_are_shared_by_create_and_open_and_old_keywords_still_work(store_path):
    settings = mmreplay.Settings(cache_bytes=1 << 20, commit_every=7, durable=False)
    with mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=100, settings=settings) as s:
        assert s.settings == settings
    with mmreplay.Store.open(store_path, settings=settings, commit_every=9) as s:
        assert s.settings == mmreplay.Settings(cache_bytes=1 << 20, commit_every=9, durable=False)
    with mmreplay.Store.open(store_path, durable=False, commit_seconds=5) as s:
        assert (s.settings.durable, s.settings.commit_seconds) == (False, 5.0)
    with pytest.raises(TypeError, match="unexpected keyword"):
        mmreplay.Store.open(store_path, cache=1)


def test_a_writer_commits_on_its_own_after_commit_every(make_store, store_path):
    s = make_store(capacity=100, commit_every=5)
    frames = np.stack([frame(i) for i in range(7)])
    s.extend(frames[:3], [0] * 3, [0] * 3, frames[1:4], [False] * 3, [False] * 3, streams=[0] * 3)
    with mmreplay.Store.open(store_path, mode="r") as reader:
        assert reader.num_added == 0  # 3 < commit_every: nothing committed yet
    s.extend(frames[3:6], [0] * 3, [0] * 3, frames[4:7], [False] * 3, [False] * 3, streams=[0] * 3)
    with mmreplay.Store.open(store_path, mode="r") as reader:  # 6 >= commit_every: committed on its own
        assert reader.num_added == 6


def test_a_second_open_sampler_of_one_name_is_an_error(make_store):
    s = filled(make_store)
    first = s.sampler(8, seed=0)
    with pytest.raises(ValueError, match="sampler named 'default' is already open"):
        s.sampler(8, seed=1)
    assert next(first).obs.shape[0] == 8  # the first one still works
    other = s.sampler(8, seed=1, name="other")
    first.close()
    again = s.sampler(8, seed=2)  # closed: its name is free again
    assert not again.closed and not other.closed


def test_eps_given_to_prioritized_is_the_sets_eps(make_store):
    s = filled(make_store)
    smp = s.sampler(8, Prioritized(alpha=1.0, eps=0.5))
    assert smp.priorities.eps == 0.5
    smp.close()
    smp = s.sampler(8, Prioritized(alpha=1.0, eps=0.25))
    assert s.inspect.priorities().eps == 0.25


def test_priorities_are_updated_through_the_sampler_and_read_through_the_set(make_store):
    s = filled(make_store)
    smp = s.sampler(8, Prioritized(alpha=1.0, eps=0.0), seed=0)
    lo, hi = s.inspect.valid_range()
    ids = np.arange(lo, hi)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the one way warns about nothing
        assert smp.update_priorities(ids, np.full(ids.size, 2.0)) == ids.size
    assert smp.update_priorities([lo + 3], [6.0]) == 1
    prio = s.inspect.priorities()
    np.testing.assert_array_equal(prio.of([lo, lo + 3]), [2.0, 6.0])
    drawable = s.geometry.transitions.slot(ids)
    assert prio.total == pytest.approx(prio.tree.leaves[drawable].sum())
    with pytest.raises(IndexError, match="valid range"):
        prio.of([hi])
    assert smp.update_priorities([lo], [1.0]) == 1
    assert prio.of([lo])[0] == 1.0


def test_the_old_spellings_are_gone(make_store):
    s = filled(make_store)
    for old in ("fill_batch", "sample_indices", "update_priorities", "sequence_sampler", "draw_indices", "get"):
        assert not hasattr(s, old), old
    with pytest.raises(TypeError, match="unexpected keyword argument 'prioritized'"):
        s.sampler(4, prioritized=True)
    with pytest.raises(TypeError, match="draw must be a draw strategy"):
        s.sampler(4, Prioritized)  # the class, not a strategy


def test_sample_into_reused_buffers_follows_the_samplers_sequence(make_store):
    s = filled(make_store)
    with s.sampler(6, seed=3) as a:
        expected = [next(a).indices.clone() for _ in range(2)]
    buf = BatchBuffers(s.schema, 6)
    with s.sampler(6, seed=3, name="b") as b:
        got = [b.sample_into(buf).indices.clone() for _ in range(2)]
        assert b.sample_into(buf).obs.data_ptr() == buf.obs["obs"][0].data_ptr()  # no copy: the same buffer
    assert all(bool((x == y).all()) for x, y in zip(expected, got))
    np.testing.assert_array_equal(s.sample(6, seed=np.random.default_rng(1)).indices.numpy(),
                                  s.sample(6, seed=1).indices.numpy())  # a Generator or its seed: one stream


def test_read_column_returns_stored_values(make_store):
    s = filled(make_store)
    lo, hi = s.inspect.valid_range()
    g = np.arange(lo, hi)
    np.testing.assert_array_equal(s.inspect.read_column("action", lo, hi), g % 3)
    np.testing.assert_array_equal(s.inspect.read_column("reward", lo, hi), np.array([-1, 0, 1])[g % 3])
    np.testing.assert_array_equal(s.inspect.read_column("terminated", lo, hi), g % 20 == 19)
    with pytest.raises(KeyError, match="no transition column 'lives'"):
        s.inspect.read_column("lives", lo, hi)
    with pytest.raises(IndexError, match="valid range"):
        s.inspect.read_column("action", lo, hi + 1)


def test_has_sampler_state_says_whether_a_seedless_sampler_continues(make_store, store_path):
    s = filled(make_store)
    assert not s.inspect.has_sampler_state("default")
    with s.sampler(4, seed=0) as smp:
        next(smp)
    s.close()
    with mmreplay.Store.open(store_path, mode="r") as again:
        assert again.inspect.has_sampler_state("default") and not again.inspect.has_sampler_state("other")


def test_public_classes_are_exported():
    assert mmreplay.Sampler.__module__ == "mmreplay.sampling.sampler"
    assert "reused" in mmreplay.Sampler.__doc__ and "reused" in mmreplay.Batch.__doc__


def test_app_meta_is_committed_atomically_with_the_transitions(make_store, store_path):
    s = filled(make_store)
    s.flush(app_meta={"step": 60, "run": "a"})
    with mmreplay.Store.open(store_path, mode="r") as reader:
        assert reader.app_meta == {"step": 60, "run": "a"}
        s.flush(app_meta={"step": 61})  # nothing else changed: still a commit
        assert reader.refresh() and reader.app_meta == {"step": 61}
        with pytest.raises(mmreplay.ReadOnlyError):
            reader.flush(app_meta={"step": 0})
    with pytest.raises(ValueError, match="plain JSON"):
        s.flush(app_meta={"x": float("nan")})
    s.close()
    with mmreplay.Store.open(store_path) as again:
        assert again.app_meta == {"step": 61}


def test_a_store_that_could_not_be_opened_leaves_nothing_to_commit(make_store, store_path):
    import gc

    s = filled(make_store)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="already open for writing"):
            mmreplay.Store.open(store_path)
        gc.collect()
    assert not [w for w in caught if "could not commit" in str(w.message)]
    s.close()
    with mmreplay.Store.open(store_path) as again:  # the refused open held no lock
        assert again.num_added == 60
