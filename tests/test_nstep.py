"""n-step returns at sample time: every field against a brute-force walk of the reference episodes."""

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from test_store_semantics import drive
from mmreplay.sampling.strategy import NStep, Prioritized, Uniform


def assert_nstep_matches(batch, ref, n, gamma, dict_keys=None):
    for row, g in enumerate(batch.indices.tolist()):
        want = ref.nstep(g, n, gamma)
        t = ref.transitions[g]
        np.testing.assert_array_equal(batch.obs[row].numpy(), t["obs"], err_msg=f"obs of {g}")
        np.testing.assert_array_equal(batch.next_obs[row].numpy(), want["next_obs"], err_msg=f"next_obs of {g}")
        assert int(batch.action[row]) == t["action"]
        assert float(batch.reward[row]) == pytest.approx(want["reward"], rel=1e-6, abs=1e-6), f"return of {g}"
        assert float(batch.discount[row]) == pytest.approx(want["discount"], rel=1e-6), f"discount of {g}"
        assert bool(batch.terminated[row]) == want["terminated"], f"terminated of {g}"
        assert bool(batch.truncated[row]) == want["truncated"], f"truncated of {g}"


@pytest.mark.parametrize("prioritized", [False, True])
@pytest.mark.parametrize("capacity,frame_stack", [(120, 4), (None, 2), (80, 1)])
def test_nstep_matches_brute_force(store_path, prioritized, capacity, frame_stack):
    """Interleaved vector-env streams with terminations, truncations and a ring that wraps mid-episode."""
    rng = np.random.default_rng(5)
    store, ref = drive(store_path, rng, capacity=capacity, frame_stack=frame_stack, steps=260, p_term=0.06,
                       p_trunc=0.04)
    try:
        valid = set(ref.valid_ids(store.inspect.valid_range()[0]))
        over = Prioritized() if prioritized else Uniform()
        for n, gamma in ((3, 0.9), (5, 0.5), (1, 0.99)):  # NStep(1, gamma): one-step targets, discount gamma
            with store.sampler(48, NStep(n, gamma, over=over), seed=n, name=f"n{n}") as smp:
                for _ in range(6):
                    batch = next(smp)
                    assert set(batch.indices.tolist()) <= valid
                    assert_nstep_matches(batch, ref, n, gamma)
            with store.sampler(48, over, seed=n, name="one") as smp:  # without NStep: no discount
                assert next(smp).discount is None
    finally:
        store.close()


def test_windows_cut_at_head_bootstrap_from_the_latest_observation(store_path):
    """One stream, no episode end: the newest transitions have fewer than n successors so far."""
    store = mmreplay.Store.create(store_path, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2),
                                  capacity=None, durable=False)
    obs = np.zeros(2, np.float32)
    for t in range(10):
        nxt = np.full(2, t + 1, np.float32) / 100
        store.add(obs, 0, 1.0, nxt, False, False)
        obs = nxt
    try:
        with store.sampler(10, NStep(4, 0.5), seed=0) as smp:
            batch = next(smp)
        for row, g in enumerate(batch.indices.tolist()):
            m = min(4, 10 - g)
            assert float(batch.reward[row]) == pytest.approx(sum(0.5 ** j for j in range(m)))
            assert float(batch.discount[row]) == pytest.approx(0.5 ** m)
            np.testing.assert_allclose(batch.next_obs[row].numpy(), np.full(2, g + m, np.float32) / 100)
            assert not batch.terminated[row] and not batch.truncated[row]
    finally:
        store.close()


def test_integer_rewards_become_float_returns(store_path):
    store = mmreplay.Store.create(store_path, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(2),
                                  capacity=100, durable=False,
                                  columns={"reward": mmreplay.ColumnSpec.numeric("reward", (), "int16")})
    obs = np.zeros(2, np.float32)
    store.extend(np.stack([obs] * 5), [0] * 5, [3] * 5, np.stack([obs] * 5), [False] * 5, [False] * 5,
                 streams=[0, 1, 2, 3, 4])
    try:
        batch = store.sampler(4, NStep(2, 0.5), seed=0).sample()
        assert batch.reward.dtype.is_floating_point
        assert batch.reward.tolist() == [3.0] * 4  # every stream has one transition only
    finally:
        store.close()


@pytest.mark.parametrize("kw,match", [
    (dict(n=0), "n_step must be an integer >= 1"),
    (dict(n=2.5), "n_step must be an integer >= 1"),
    (dict(n=3, gamma=1.5), r"gamma must be a number in \[0, 1\]"),
    (dict(n=3, gamma="0.9"), r"gamma must be a number in \[0, 1\]"),
])
def test_bad_nstep_arguments(kw, match):
    with pytest.raises(ValueError, match=match):
        NStep(**kw)
