"""Batch.numpy / SequenceBatch.numpy: numpy output with explicit ownership. Copies (the default) keep
their values after the sampler's next batch; views (copy=False) are the batch's own buffers, overwritten
by the next batch, as documented. Every row is checked against ``Store.get`` (fresh tensors)."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
from mmreplay.columns.spec import ColumnSpec
from mmreplay.sampling.strategy import NStep, Prioritized, Sequences

FIELDS = ("obs", "action", "reward", "next_obs", "terminated", "truncated", "indices", "extras", "weights",
          "discount")


def _fill(store, n=200):
    for i in range(n):
        obs = np.full(store.schema.observations[0].shape, i % 251, np.uint8)
        store.add(obs, i % 3, float(i % 7), np.full_like(obs, (i + 1) % 251), i % 40 == 39, False,
                  extras={"step": np.int32(i)})


@pytest.fixture
def store(store_path):
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (4, 3), np.uint8), spaces.Discrete(3), capacity=None,
                               frame_stack=2, extras=[ColumnSpec("step", "numeric", (), "int32")]) as s:
        _fill(s)
        yield s


def _tensor_as_numpy(value):
    if value is None:
        return None
    if isinstance(value, dict):
        return {k: _tensor_as_numpy(v) for k, v in value.items()}
    return value.numpy()


def _assert_same(arrays, expected, path=""):
    """``arrays`` (from Batch.numpy) equal ``expected`` (tensors), with the same dtypes and shapes."""
    if expected is None:
        assert arrays is None, path
        return
    if isinstance(expected, dict):
        assert isinstance(arrays, dict) and arrays.keys() == expected.keys(), path
        for k in expected:
            _assert_same(arrays[k], expected[k], f"{path}.{k}")
        return
    assert isinstance(arrays, np.ndarray), path
    truth = expected.numpy()
    assert arrays.dtype == truth.dtype and arrays.shape == truth.shape, path
    np.testing.assert_array_equal(arrays, truth, err_msg=path)


def _snapshot(arrays):
    if isinstance(arrays, dict):
        return {k: _snapshot(v) for k, v in arrays.items()}
    return None if arrays is None else arrays.copy()


def test_copies_keep_their_values_after_the_next_batch(store):
    smp = store.sampler(32, seed=0)
    first = next(smp)
    copied = first.numpy()
    assert tuple(copied) == FIELDS
    truth = store.inspect.get(first.indices.numpy().copy())  # fresh tensors of the same transitions
    for name in FIELDS:
        _assert_same(copied[name], getattr(truth, name), name)
    kept = _snapshot(copied)
    second = next(smp)
    assert not np.array_equal(second.indices.numpy(), kept["indices"])  # the buffers did change
    for name in FIELDS:
        _assert_same(copied[name], getattr(truth, name), name)  # ... the copies did not
        if kept[name] is not None and not isinstance(kept[name], dict):
            np.testing.assert_array_equal(copied[name], kept[name])


def test_views_are_the_batch_buffers_and_change_at_the_next_batch(store):
    smp = store.sampler(32, seed=1)
    first = next(smp)
    views = first.numpy(copy=False)
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "indices"):
        assert np.shares_memory(views[name], getattr(first, name).numpy()), name
    assert np.shares_memory(views["extras"]["step"], first.extras["step"].numpy())
    second = next(smp)
    # valid until the next batch: the views now hold the second batch, row for row
    truth = store.inspect.get(second.indices.numpy().copy())
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "indices", "extras"):
        _assert_same(views[name], getattr(truth, name), name)


def test_a_copy_owns_its_memory(store):
    batch = next(store.sampler(16, seed=2))
    copied = batch.numpy(copy=True)
    for name in ("obs", "action", "reward", "next_obs", "terminated", "truncated", "indices"):
        assert not np.shares_memory(copied[name], getattr(batch, name).numpy()), name


def test_weights_and_discount_where_the_sampler_makes_them(store):
    batch = next(store.sampler(16, NStep(3, 0.9, over=Prioritized()), seed=3))
    arrays = batch.numpy()
    _assert_same(arrays["weights"], batch.weights, "weights")
    _assert_same(arrays["discount"], batch.discount, "discount")
    assert arrays["weights"].dtype == np.float32 and arrays["discount"].shape == (16,)


def test_dict_observations(store_path):
    space = spaces.Dict({"img": spaces.Box(0, 255, (3, 2), np.uint8), "vec": spaces.Box(-1, 1, (2,), np.float32)})
    with mmreplay.Store.create(store_path, space, spaces.Discrete(2), capacity=100) as s:
        for i in range(50):
            obs = {"img": np.full((3, 2), i, np.uint8), "vec": np.full(2, i / 100, np.float32)}
            nxt = {"img": np.full((3, 2), i + 1, np.uint8), "vec": np.full(2, (i + 1) / 100, np.float32)}
            s.add(obs, i % 2, 1.0, nxt, i % 10 == 9, False)
        batch = next(s.sampler(8, seed=0))
        arrays = batch.numpy()
        assert set(arrays["obs"]) == {"img", "vec"}
        truth = s.inspect.get(batch.indices.numpy().copy())
        _assert_same(arrays["obs"], truth.obs, "obs")
        _assert_same(arrays["next_obs"], truth.next_obs, "next_obs")
        np.testing.assert_array_equal(arrays["obs"]["img"][:, 0, 0], arrays["indices"])  # frame value = step


def test_sequence_batch_numpy(store):
    smp = store.sampler(4, Sequences(5), seed=0)
    first = next(smp)
    copied, views = first.numpy(), first.numpy(copy=False)
    assert copied["burn_in"] == 0 and copied["mask"].shape == (4, 5)
    kept_indices = copied["indices"].copy()
    for name in ("obs", "action", "reward", "terminated", "truncated", "mask", "indices"):
        _assert_same(copied[name], getattr(first, name), name)
        assert np.shares_memory(views[name], getattr(first, name).numpy()), name
    second = next(smp)
    np.testing.assert_array_equal(copied["indices"], kept_indices)
    np.testing.assert_array_equal(views["indices"], second.indices.numpy())


def test_views_of_a_batch_off_the_cpu_are_refused(store):
    batch = store.inspect.get([5, 6]).to("meta")  # a device tensor without memory on the host (no GPU needed)
    with pytest.raises(ValueError, match="copy=False.*meta"):
        batch.numpy(copy=False)
