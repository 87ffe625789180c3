"""Bad input gets a clear error naming the value and the expectation, and changes nothing stored."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import IMG, frame


@pytest.fixture
def filled(make_store):
    s = make_store(frame_stack=2, extras=[mmreplay.ColumnSpec.numeric("lives", (), "int8")])
    for i in range(10):
        s.add(frame(i), i % 3, 1, frame(i + 1), False, False, extras={"lives": 3})
    return s


def snapshot(s):
    ids = list(range(*s.inspect.valid_range()))
    b = s.inspect.get(ids[1:])
    return s.inspect.valid_range(), len(s), s.inspect.num_frames, b.obs.clone(), b.action.clone(), b.reward.clone()


def assert_unchanged(s, before):
    after = snapshot(s)
    assert after[:3] == before[:3]
    for x, y in zip(after[3:], before[3:]):
        assert bool((x == y).all())


GOOD = dict(obs=frame(10), action=1, reward=0, next_obs=frame(11), terminated=False, truncated=False)


@pytest.mark.parametrize("field,value,message", [
    ("obs", np.zeros((6, 6), np.uint8), r"obs: expected shape \(1, 6, 5\)"),
    ("next_obs", np.zeros((6, 5), np.float32) + 0.5, "does not fit dtype uint8"),
    ("obs", np.full((6, 5), 300), "value 300 does not fit dtype uint8"),
    ("obs", np.full((6, 5), -1), "does not fit dtype uint8"),
    ("obs", "pixels", "expected shape"),
    ("obs", np.full((6, 5), "x"), "expected numbers of dtype uint8"),
    ("action", 3, r"column 'action': value 3.0 is not one of the allowed values \[0, 1, 2\]"),
    ("action", -1, "is not one of the allowed values"),
    ("action", 1.5, "is not one of the allowed values"),
    ("action", np.nan, "nan is not one of the allowed values"),
    ("reward", 0.5, r"column 'reward': value 0.5 is not one of the allowed values \[-1.0, 0.0, 1.0\]"),
    ("reward", np.nan, "nan is not one of"),
    ("terminated", 2, "terminated: expected booleans"),
    ("truncated", "yes", "truncated"),
    ("action", [1, 2], r"column 'action': expected shape \(1,\)"),
])
def test_bad_values_rejected_before_anything_is_written(filled, field, value, message):
    before = snapshot(filled)
    args = dict(GOOD, **{field: value})
    with pytest.raises(ValueError, match=message):
        filled.add(**args, extras={"lives": 3})
    assert_unchanged(filled, before)
    filled.add(**GOOD, extras={"lives": 3})  # the store still works after the error


def test_bad_extras(filled):
    before = snapshot(filled)
    with pytest.raises(ValueError, match="missing value for extra column 'lives'"):
        filled.add(**GOOD)
    with pytest.raises(ValueError, match=r"unknown column\(s\) \['bogus'\]"):
        filled.add(**GOOD, extras={"lives": 1, "bogus": 2})
    with pytest.raises(ValueError, match="value 1000 does not fit dtype int8"):
        filled.add(**GOOD, extras={"lives": 1000})
    assert_unchanged(filled, before)


def test_bad_extend_batches(filled):
    before = snapshot(filled)
    two = np.stack([frame(1), frame(2)])
    with pytest.raises(ValueError, match=r"obs: expected shape \(3, 6, 5\)"):
        filled.extend(two, [0, 1, 2], [0, 0, 0], two, [False] * 3, [False] * 3, extras={"lives": [1, 1, 1]})
    with pytest.raises(ValueError, match=r"ids must lie in \[0, 2147483647\], got \[-1, 0\]"):
        filled.extend(two, [0, 1], [0, 0], two, [False, False], [False, False], streams=[-1, 0],
                      extras={"lives": [1, 1]})
    with pytest.raises(ValueError, match="leading batch axis"):
        filled.extend(frame(1), 0, 0, frame(2), False, False, extras={"lives": 1})
    assert_unchanged(filled, before)


@pytest.mark.parametrize("capacity", [0, -5, 2.5, True, "big"])
def test_bad_capacity(store_path, capacity):
    with pytest.raises(ValueError, match="capacity must be a positive integer"):
        mmreplay.Store.create(store_path, IMG, spaces.Discrete(2), capacity=capacity)


def test_bad_sampling_requests(make_store):
    s = make_store()
    with pytest.raises(ValueError, match="empty store"):
        s.sample(4)
    s.add(frame(0), 0, 0, frame(1), False, False)
    for size in (0, -1, 1.5):
        with pytest.raises(ValueError, match="batch_size must be a positive integer"):
            s.sample(size)
    with pytest.raises(IndexError, match=r"transition ids \[5\] are not valid"):
        s.inspect.get([5])


def test_closed_and_read_only_stores(make_store, store_path):
    s = make_store()
    s.add(frame(0), 0, 0, frame(1), False, False)
    s.close()
    with pytest.raises(mmreplay.StoreClosedError, match="is closed"):
        s.add(frame(1), 0, 0, frame(2), False, False)
    with pytest.raises(mmreplay.StoreClosedError):
        s.sample(1)
    with mmreplay.Store.open(store_path, mode="r") as r:
        with pytest.raises(mmreplay.ReadOnlyError, match="read-only"):
            r.add(frame(1), 0, 0, frame(2), False, False)
        assert len(r) == 1
    with pytest.raises(ValueError, match="mode must be"):
        mmreplay.Store.open(store_path, mode="w")


def test_unsupported_spaces_named(store_path):
    with pytest.raises(TypeError, match="unsupported observation space"):
        mmreplay.Store.create(store_path, spaces.Text(5), spaces.Discrete(2))
    with pytest.raises(TypeError, match="unsupported action space"):
        mmreplay.Store.create(store_path, IMG, spaces.Text(5))


def test_batch_larger_than_store(make_store):
    s = make_store()
    for i in range(5):
        s.add(frame(i), 0, 0, frame(i + 1), False, False)
    with pytest.raises(ValueError, match="batch_size 6 is larger than the store"):
        s.sample(6)
    with pytest.raises(ValueError, match="larger than the store"):
        next(s.sampler(6))
    assert s.sample(5).obs.shape[0] == 5
