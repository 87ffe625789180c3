"""One validation for every add path (issue 23, case 5): ``add``'s fast path refuses what ``extend`` (the
checked path) refuses and stores the same values; values outside the declared space are refused, with the
column, the value and the expected range named, before anything is stored."""

import math
import os
import re
import tempfile

import numpy as np
import pytest
from gymnasium import spaces
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import mmreplay
from mmreplay.columns.encode import ColumnEncoder, declared_bounds
from mmreplay.columns.spaces import space_from_json, space_to_json
from mmreplay.columns.spec import action_column

OBS = spaces.Box(-1.0, 1.0, (3,), np.float32)
O1, O2 = np.zeros(3, np.float32), np.ones(3, np.float32)


def make(tmp_path, action_space, name="s", **kw):
    return mmreplay.Store.create(os.path.join(tmp_path, name), OBS, action_space, capacity=100_000, **kw)


def stored_actions(store):
    return store.inspect.read_column("action", *store.inspect.valid_range()).tolist()


# -- the values of the issue: all were stored (as something else) by add ----------------------------

ISSUE_VALUES = [2.5, 7.9, 19.99, 20.0, np.int64(20), np.float64(2.5), np.float32(7.9), np.float64(19.0 + 0.5),
                -1, np.int8(-1), np.uint64(20), float("nan"), float("inf"), np.float64("-inf")]


@pytest.mark.parametrize("value", ISSUE_VALUES, ids=repr)
@pytest.mark.parametrize("how", ["add", "extend"])
def test_discrete_refuses_values_outside_the_space(tmp_path, value, how):
    s = make(tmp_path, spaces.Discrete(20))
    for a in (0, 19, np.int64(7), 3.0):  # in the space: stored as given
        s.add(O1, a, 0.0, O2, False, False)
    before = stored_actions(s)
    with pytest.raises(ValueError, match=r"column 'action': value .*expected integers in \[0, 19\]") as err:
        if how == "add":
            s.add(O1, value, 0.0, O2, False, False)
        else:
            s.extend(O1[None], np.asarray([value]), [0.0], O2[None], [False], [False])
    shown = float(re.search(r"value (\S+)", str(err.value)).group(1))  # the value given, named
    assert shown == pytest.approx(float(value), rel=1e-6, nan_ok=True)
    assert stored_actions(s) == before == [0, 19, 7, 3]
    s.add(O1, 5, 0.0, O2, False, False)  # the store goes on
    assert stored_actions(s) == [0, 19, 7, 3, 5]
    s.close()


@pytest.mark.parametrize("space,good,bad,expected", [
    (spaces.Discrete(20, start=-5), [-5, 14, np.int16(0)], [15, -6, np.int64(14) + 1, 2.5],
     r"\[-5, 14\]"),
    (spaces.Discrete(300, start=1000), [1000, 1299], [999, 1300, np.uint16(1300)], r"\[1000, 1299\]"),
    (spaces.Discrete(5, start=3), [3, 7, np.int64(5), 5.0], [2, 8, np.float64(3.5), np.int64(8)],
     r"allowed values \[3, 4, 5, 6, 7\]"),  # packed: the values are the space's
])
def test_discrete_with_start(tmp_path, space, good, bad, expected):
    s = make(tmp_path, space)
    for a in good:
        s.add(O1, a, 0.0, O2, False, False)
    before = stored_actions(s)
    assert before == [int(a) for a in good]
    for a in bad:
        with pytest.raises(ValueError, match=rf"column 'action': value .*{expected}"):
            s.add(O1, a, 0.0, O2, False, False)
        with pytest.raises(ValueError, match=expected):
            s.extend(O1[None], [a], [0.0], O2[None], [False], [False])
    assert stored_actions(s) == before
    s.close()


@pytest.mark.parametrize("space,good,bad", [
    (spaces.MultiDiscrete([3, 5]), [[0, 4], [2, 0]], [([3, 0], "(0,)", "[0, 2]"), ([0, 5], "(1,)", "[0, 4]")]),
    (spaces.MultiDiscrete([3, 5], start=[-1, 10]), [[-1, 14], [1, 10]],
     [([2, 10], "(0,)", "[-1, 1]"), ([0, 9], "(1,)", "[10, 14]"), ([0, 15], "(1,)", "[10, 14]")]),
    (spaces.MultiBinary(3), [[0, 1, 1], [True, False, True]], [([0, 2, 0], "(1,)", "[0, 1]"),
                                                             ([1, 1, 7], "(2,)", "[0, 1]")]),
])
def test_multi_discrete_and_binary(tmp_path, space, good, bad):
    s = make(tmp_path, space)
    s.extend(np.stack([O1] * len(good)), np.asarray(good), np.zeros(len(good)), np.stack([O2] * len(good)),
             np.zeros(len(good), bool), np.zeros(len(good), bool))
    before = stored_actions(s)
    assert before == np.asarray(good).astype(int).tolist()
    for a, element, expected in bad:
        message = rf"column 'action': value -?\d+ at element {re.escape(element)} is out of range: expected " \
                  rf"integers in {re.escape(expected)}"
        with pytest.raises(ValueError, match=message):
            s.extend(np.stack([O1, O1]), np.asarray([good[0], a]), [0.0, 0.0], np.stack([O2, O2]), [False] * 2,
                     [False] * 2)
        with pytest.raises(ValueError, match=message):
            s.add(O1, np.asarray(a), 0.0, O2, False, False)
    with pytest.raises(ValueError, match=r"column 'action': value -1000000 does not fit dtype .*expected integers"):
        s.add(O1, np.asarray([-10 ** 6] + good[0][1:]), 0.0, O2, False, False)
    assert stored_actions(s) == before
    s.close()


def test_multi_discrete_start_survives_the_store(tmp_path):
    space = spaces.MultiDiscrete([3, 5], start=[-1, 300])
    assert space_from_json(space_to_json(space)) == space
    assert action_column(space).dtype == "int16"  # before: uint8 from nvec alone, too small for 304
    s = make(tmp_path, space)
    s.add(O1, np.array([-1, 304]), 0.0, O2, False, False)
    s.close()
    with mmreplay.Store.open(os.path.join(tmp_path, "s")) as s:
        assert s.action_space == space
        assert stored_actions(s) == [[-1, 304]]


def test_float_values_that_would_overflow_the_dtype_are_refused(tmp_path):
    s = make(tmp_path, spaces.Box(-1.0, 1.0, (), np.float32))
    s.add(O1, 0.5, 1e38, O2, False, False)
    for reward in (1e39, np.float64(-1e300), np.float64(3.5e38)):
        with pytest.raises(ValueError, match=r"column 'reward': value .* is out of range for dtype float32"):
            s.add(O1, 0.5, reward, O2, False, False)
    s.add(O1, 0.5, float("inf"), O2, False, False)  # inf and nan are values of their own, kept as given
    assert s.inspect.read_column("reward", *s.inspect.valid_range()).tolist() == [np.float32(1e38), math.inf]
    s.close()


def test_box_bounds_are_not_enforced():
    """Box bounds are a hint (exploration noise, unclipped actions): only the dtype decides."""
    spec = action_column(spaces.Box(0, 3, (2,), np.int16))
    assert declared_bounds(spec, space_to_json(spaces.Box(0, 3, (2,), np.int16))) is None


# -- property: the fast path and the checked path agree -----------------------------------------------

CONFIGS = {  # name: (action space, reward values, which column varies)
    "discrete20": (spaces.Discrete(20), None, "action"),
    "discrete40_start-10": (spaces.Discrete(40, start=-10), None, "action"),
    "discrete5_start3_packed": (spaces.Discrete(5, start=3), None, "action"),
    "box_int16": (spaces.Box(-100, 100, (), np.int16), None, "action"),
    "box_uint8": (spaces.Box(0, 9, (), np.uint8), None, "action"),
    "box_float32": (spaces.Box(-1.0, 1.0, (), np.float32), None, "action"),
    "box_float64": (spaces.Box(-1.0, 1.0, (), np.float64), None, "action"),
    "reward_float32": (spaces.Discrete(4), None, "reward"),
    "reward_packed": (spaces.Discrete(4), (-1, 0, 1), "reward"),
    "reward_packed_fractions": (spaces.Discrete(4), (-0.5, 0.1, 2.25), "reward"),
}
GOOD_OTHER = {"action": {"discrete5_start3_packed": 3}, "reward": 0.0}
CONVERTERS = [int, float, bool, np.bool_, np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32,
              np.uint64, np.float16, np.float32, np.float64]


def _convert(pair):
    value, kind = pair
    try:
        with np.errstate(all="ignore"):
            out = kind(value)
        if kind not in (bool, np.bool_) and isinstance(value, float) and math.isfinite(value) and \
                kind not in (float, np.float16, np.float32, np.float64) and out != value:
            return None  # np.int8(2.5) truncates: the value is the truncated one, already covered
        return out
    except (OverflowError, ValueError, TypeError):
        return None


_BASE = st.one_of(st.integers(-25, 45), st.integers(-2 ** 70, 2 ** 70), st.sampled_from([-1, 0, 1, 0.1, 2.25, -0.5]),
                  st.floats(-50, 50).map(lambda x: round(x * 2) / 2), st.floats(allow_nan=True, allow_infinity=True),
                  st.floats(width=32), st.sampled_from([3.4e38, 3.5e38, 2.0 ** 24 + 1, 2.0 ** 60 + 2.0 ** 36 + 1]))
VALUES = st.tuples(_BASE, st.sampled_from(CONVERTERS)).map(_convert).filter(lambda v: v is not None)
VALUES = st.one_of(VALUES, st.sampled_from([2 ** 60 + 2 ** 36 + 1, 2 ** 25 + 1, -(2 ** 53) - 1]))


@pytest.fixture(scope="module")
def store_pairs():
    """Per config, a store written by ``add`` (fast path where it applies) and one by ``extend``."""
    root = tempfile.mkdtemp(prefix="mmreplay-addval-")
    pairs = {}
    for name, (space, reward_values, _) in CONFIGS.items():
        pairs[name] = tuple(mmreplay.Store.create(os.path.join(root, f"{name}-{how}"), OBS, space, capacity=100_000,
                                                  reward_values=reward_values, commit_every=1 << 30,
                                                  commit_seconds=1e9, durable=False) for how in ("add", "extend"))
    yield pairs
    for pair in pairs.values():
        for s in pair:
            s.close()


def _outcome(fn):
    try:
        fn()
        return None
    except ValueError as exc:
        return str(exc)


@pytest.mark.parametrize("config", list(CONFIGS))
@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(value=VALUES)
def test_fast_and_checked_paths_agree(store_pairs, config, value):
    fast_store, checked_store = store_pairs[config]
    varies = CONFIGS[config][2]
    other = GOOD_OTHER[varies] if varies == "reward" else GOOD_OTHER["action"].get(config, 1)
    action, reward = (value, other) if varies == "action" else (other, value)
    heads = fast_store.num_added, checked_store.num_added
    # the screen in front of encode, alone: whatever it lets through, encode stores the same
    encoder = fast_store._writer.encoders[varies]
    screened = encoder.scalar_code(value)
    if screened is not None:
        block = np.empty(1, np.uint8 if encoder.spec.kind == "packed" else encoder.dtype)
        block[0] = screened
        assert block.tobytes() == encoder.encode(np.asarray(value)[None], 1).tobytes()
    # the two paths through the store
    fast_error = _outcome(lambda: fast_store.add(O1, action, reward, O2, False, False))
    checked_error = _outcome(lambda: checked_store.extend(O1[None], np.asarray(action)[None],
                                                          np.asarray(reward)[None], O2[None], [False], [False]))
    assert (fast_error is None) == (checked_error is None), (fast_error, checked_error)
    if fast_error is not None:
        assert f"column '{varies}'" in fast_error
        assert (fast_store.num_added, checked_store.num_added) == heads  # nothing stored
        return
    got_fast = fast_store.inspect.read_column(varies, heads[0], heads[0] + 1)
    got_checked = checked_store.inspect.read_column(varies, heads[1], heads[1] + 1)
    assert got_fast.dtype == got_checked.dtype and got_fast.tobytes() == got_checked.tobytes(), (value, got_fast,
                                                                                                 got_checked)
    if encoder.spec.kind == "numeric" and encoder.dtype.kind in "iu":  # integers: exactly the value given
        assert int(got_fast[0]) == value


def test_the_fast_path_is_taken_for_ordinary_values(tmp_path, monkeypatch):
    """The agreement above is only worth something if ``add`` really takes the fast path for the common
    values (else it would compare the checked path with itself)."""
    s = make(tmp_path, spaces.Discrete(20), reward_values=(-1, 0, 1))
    calls = []
    monkeypatch.setattr(s._writer, "_add_checked", lambda *a: calls.append(a))
    for action, reward in ((3, 1), (np.int64(19), np.float32(-1.0)), (np.uint8(0), 0.0), (True, np.int64(1))):
        s.add(O1, action, reward, O2, False, False)
    assert calls == []
    for action in (np.int64(20), 2.5, np.float64(3.0)):
        s.add(O1, action, 0, O2, False, False)
    assert len(calls) == 3  # left to the checked path (which refuses 20 and 2.5, stores 3)
    s.close()


def test_encoder_without_space_keeps_the_dtype_range():
    enc = ColumnEncoder(mmreplay.ColumnSpec.numeric("lives", (), "int8"))
    assert enc.int_range == (-128, 127) and enc.scalar_code(np.int64(127)) == 127 and enc.scalar_code(128) is None
    with pytest.raises(ValueError, match=r"column 'lives': value 128 does not fit dtype int8"):
        enc.encode(np.array([128]), 1)
