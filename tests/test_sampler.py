"""The prefetching sampler: valid batches, determinism, reused buffers, RNG state that survives reopen."""

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
from reference import assert_batch_matches
from test_store_semantics import drive


@pytest.fixture
def driven(store_path):
    rng = np.random.default_rng(21)
    store, ref = drive(store_path, rng, capacity=150, frame_stack=4, steps=200)
    yield store, ref
    store.close()


@pytest.mark.parametrize("prefetch", [0, 1, 3])
def test_batches_are_valid_and_deterministic(driven, prefetch):
    store, ref = driven
    valid = set(ref.valid_ids())
    with store.sampler(64, prefetch=prefetch, seed=7) as a, store.sampler(64, prefetch=0, seed=7, name="b") as b:
        for _ in range(5):
            x = next(a)
            assert set(x.indices.tolist()) <= valid
            assert_batch_matches(x, ref, x.indices.tolist())
            y = next(b)
            assert x.indices.tolist() == y.indices.tolist() and bool((x.obs == y.obs).all())


def test_same_seed_same_batches_as_store_sample(driven):
    store, _ = driven
    with store.sampler(32, seed=3, prefetch=2) as s:
        first = next(s).indices.clone()
    assert first.tolist() == store.sample(32, seed=3).indices.tolist()


def test_buffers_are_reused_and_typed(driven):
    store, _ = driven
    with store.sampler(16, seed=1, prefetch=1) as s:
        b1 = next(s)
        ptr = b1.obs.data_ptr()
        seen = {next(s).obs.data_ptr() for _ in range(6)}
        assert ptr in seen  # a ring of prefetch + 2 buffer sets
        b = next(s)
        assert b.obs.dtype == torch.uint8 and b.obs.shape == (16, 4, 6, 5)
        assert b.action.dtype == torch.int64 and b.reward.dtype == torch.float32
        assert b.terminated.dtype == torch.bool and b.indices.dtype == torch.int64


def test_cpu_device_and_pin_flag_on_a_machine_without_cuda(driven):
    store, _ = driven
    with store.sampler(8, device="cpu", seed=0) as s:
        assert next(s).obs.device.type == "cpu"
    if not torch.cuda.is_available():
        with pytest.raises(RuntimeError):  # pinning needs an accelerator; the default never asks for it
            store.sampler(8, pin_memory=True)


def test_sampler_state_persists_and_resumes(store_path):
    rng = np.random.default_rng(5)
    store, _ = drive(store_path, rng, capacity=150, frame_stack=2, steps=150)
    s = store.sampler(16, seed=11, prefetch=2)
    for _ in range(3):
        next(s)
    store.flush()
    # what the original sampler yields next, from a copy of its committed state
    probe = np.random.Generator(np.random.PCG64())
    probe.bit_generator.state = s.state
    expected = [store.sample(16, seed=probe).indices.tolist() for _ in range(2)]
    store.close()
    with mmreplay.Store.open(store_path) as again:
        resumed = again.sampler(16, prefetch=1)  # no seed: continue the committed sequence
        assert [next(resumed).indices.tolist() for _ in range(2)] == expected


def test_producer_errors_reach_the_consumer(store_path):
    with mmreplay.Store.create(store_path, spaces.Box(0, 1, (3,)), spaces.Discrete(2), capacity=10) as s:
        sampler = s.sampler(4, prefetch=2)
        with pytest.raises(ValueError, match="empty store"):
            next(sampler)


def test_closing_the_store_stops_its_samplers(driven):
    store, _ = driven
    s = store.sampler(8, prefetch=2, seed=0)
    next(s)
    store.close()
    with pytest.raises(RuntimeError, match="closed"):
        next(s)


def test_draws_into_row_views_land_in_their_rows_only(driven):
    """``BatchBuffers.rows``: parts of one batch drawn into views of it (how a batch split over shards is
    assembled) land in their own rows and leave the others alone."""
    from mmreplay.sampling.batch import BatchBuffers

    store, ref = driven
    buf = BatchBuffers(store.schema, 24)
    buf.obs["obs"][1][...] = 77  # a value no stored frame has
    with store.sampler(1, seed=4, prefetch=0, name="parts") as smp:
        smp.sample_into(buf.rows(0, 10))
        smp.sample_into(buf.rows(16, 24))
    whole = buf.batch()
    drawn = whole.indices[:10].tolist() + whole.indices[16:].tolist()
    assert_batch_matches(store.inspect.get(drawn), ref, drawn)
    for field in ("obs", "next_obs", "action", "reward", "terminated", "indices"):
        got = getattr(whole, field)
        assert torch.equal(torch.cat([got[:10], got[16:]]), getattr(store.inspect.get(drawn), field))
    assert bool((whole.obs[10:16] == 77).all())  # rows no part was drawn into are untouched
    with pytest.raises(ValueError, match="rows"):
        buf.rows(20, 30)
