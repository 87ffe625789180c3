"""Issue #22: one sampling interface. Draw strategies (``mmreplay.sampling.strategy``) say what a batch is;
the store, its one race-checked read and the sampler are the same for all of them, a user's own included.

The seeded draws pinned here were computed on the flag-based samplers these strategies replace (commit
0e26cf5: ``sampler(8, seed=7)``, ``sampler(8, prioritized=True, ...)``, ``sampler(8, n_step=3, ...)``,
``sampler(4, seq_len=5, burn_in=2, ...)``, ``sample(6, seed=11)``): the streams are unchanged."""

import inspect
import pathlib

import numpy as np
import pytest
import torch

import mmreplay
import synthetic as syn
from mmreplay import NStep, Prioritized, Sequences, Store
from mmreplay.integrations.torch_data import StoreDataset
from mmreplay.sampling.strategy import Transitions


@pytest.fixture
def store500(synthetic_store):
    return synthetic_store(capacity=300, n=500)


class Recent(Transitions):
    """The guide's example: uniform over the newest ``fraction`` of the valid transitions."""

    def __init__(self, fraction: float):
        self.fraction = fraction
        self.picks = 0

    def pick(self, view, size, rng):
        self.picks += 1
        lo = view.head - max(size, int(self.fraction * (view.head - view.oldest)))
        return view.uniform(size, rng, lo=lo)


def test_seeded_streams_are_those_of_the_flag_based_samplers(store500):
    s = store500
    assert s.sampler(8, seed=7, prefetch=0).sample().indices.tolist() == [483, 387, 405, 469, 373, 432, 450, 267]
    per = s.sampler(8, Prioritized(), seed=7, prefetch=0, name="p")
    first = per.sample().indices.clone()
    per.update_priorities(first, np.arange(8) + 1.0)
    assert first.tolist() == [407, 454, 487, 206, 246, 304, 309, 377]
    assert per.sample().indices.tolist() == [414, 440, 472, 209, 246, 291, 328, 369]
    weights = [round(float(w), 5) for w in per.sample().weights]
    assert weights == [1.0, 1.0, 1.0, 1.0, 0.67959, 1.0, 1.0, 1.0]
    nstep = s.sampler(8, NStep(3, 0.9), seed=3, prefetch=0, name="n").sample()
    assert nstep.indices.tolist() == [443, 225, 253, 271, 254, 440, 460, 374]
    seq = s.sampler(4, Sequences(5, burn_in=2), seed=5, prefetch=0).sample()
    assert seq.indices[:, 2].tolist() == [401, 340, 206, 354]
    episodes = s.sampler(4, Sequences(5, sample_from="episodes"), seed=5, prefetch=0, name="se").sample()
    assert episodes.indices[:, 0].tolist() == [387, 428, 202, 430]
    assert s.sample(6, seed=11).indices.tolist() == [240, 238, 439, 349, 377, 380]


def test_a_users_own_strategy_gets_the_whole_sampler(store500, store_path):
    """The guide's ``Recent``: only the newest 10% drawn, every row the stored one, in a sampler (resumed
    from its committed RNG state), in ``Store.sample`` and in a reader."""
    s = store500
    lo_newest = 500 - int(0.1 * len(s))
    with s.sampler(16, Recent(0.1), seed=0, prefetch=1, name="recent") as smp:
        for _ in range(5):  # each batch checked before the next: its buffers are reused (prefetch refills them)
            b = next(smp)
            assert syn.wrong_rows(b) == [] and b.indices.min() >= lo_newest - 16
        assert b.weights is None and b.discount is None
    one = s.sample(8, Recent(0.1), seed=1)
    assert syn.wrong_rows(one) == [] and one.indices.min() >= lo_newest - 16
    s.flush()
    with Store.open(store_path, mode="r") as reader:
        assert syn.wrong_rows(reader.sample(32, Recent(0.1), seed=2)) == []
    with pytest.raises(NotImplementedError):
        s.sample(4, Transitions())  # pick is what a strategy must say


def test_a_reader_that_lost_the_race_picks_again_and_fixed_ids_give_up_nothing(store500, store_path, monkeypatch):
    """The one race-checked read (``CheckedReads.read``): when the check says the writer overwrote what was
    read, the strategy picks again (and gives up a margin of the oldest rows); fixed ids (``inspect.get``)
    are read again as they are, the view's ``oldest`` untouched."""
    store500.flush()
    with Store.open(store_path, mode="r") as reader:
        reads = reader._state.reads
        real = reads.still_valid
        lost = {"left": 1}

        def still_valid(*read):
            if lost["left"]:
                lost["left"] -= 1
                return False  # as if the writer had overwritten this batch meanwhile
            return real(*read)
        monkeypatch.setattr(reads, "still_valid", still_valid)
        recent = Recent(0.5)
        batch = reader.sample(16, recent, seed=0)
        assert recent.picks == 2 and syn.wrong_rows(batch) == []
        oldest_before = reader.inspect.valid_range()[0]
        lost["left"] = 1
        ids = np.arange(oldest_before + 10, oldest_before + 30)
        got = reader.inspect.get(ids)
        assert got.indices.tolist() == ids.tolist() and syn.wrong_rows(got) == []
        assert reader.inspect.valid_range()[0] == oldest_before  # nothing given up for fixed ids
        lost["left"] = 10**6  # a writer that always wins: the reader gives up with a clear error
        with pytest.raises(RuntimeError, match="kept overwriting what this reader sampled"):
            reader.sample(8, seed=0)


def test_the_interface_is_small(store500):
    public = [m for m in dir(Store) if not m.startswith("_")]
    assert len(public) <= 19, public  # one left for Store.rollback (issue #22, a parallel change)
    params = inspect.signature(Store.sampler).parameters
    # 9: ``decode`` (where frames are decoded, issue #38) joined device/prefetch/seed/name/pin_memory
    assert len(params) <= 9 and list(params)[:3] == ["self", "batch_size", "draw"], list(params)
    smp = store500.sampler(4, seed=0)
    held = list(vars(smp).values())
    assert not any(isinstance(v, Store) or isinstance(getattr(v, "__self__", None), Store) for v in held)
    assert type(smp._source).__name__ == "StoreView" and not hasattr(smp._source, "add")


def test_no_deprecation_shims_remain_in_the_package():
    root = pathlib.Path(mmreplay.__file__).parent
    shims = [str(p.relative_to(root)) for p in root.rglob("*.py") if "DeprecationWarning" in p.read_text()]
    assert shims == []
    assert not (root / "demo.py").exists()


def test_strategies_check_their_options_when_made():
    with pytest.raises(ValueError, match="alpha must be a finite number >= 0, got -1"):
        Prioritized(alpha=-1)
    with pytest.raises(ValueError, match=r"gamma must be a number in \[0, 1\], got 2"):
        NStep(3, 2)
    with pytest.raises(TypeError, match=r"NStep\(over=...\) takes Uniform\(\) or Prioritized"):
        NStep(3, over=NStep(2))
    with pytest.raises(ValueError, match="burn_in must be an integer >= 0, got -1"):
        Sequences(4, burn_in=-1)
    assert repr(NStep(3, 0.9, over=Prioritized(beta=0.5))).startswith("NStep(3, 0.9, over=Prioritized(")


def test_a_sampler_binds_its_own_copy_of_the_strategy(store500):
    """Two samplers given one ``Prioritized`` keep their own ``beta`` and the set of their own name."""
    draw = Prioritized(beta=0.4)
    a = store500.sampler(8, draw, seed=0, name="a")
    b = store500.sampler(8, NStep(2, 0.9, over=draw), seed=0, name="b")
    a.beta = 0.9
    assert (a.beta, b.beta, draw.beta) == (0.9, 0.4, 0.4)
    assert a.priorities.name == "a" and b.priorities.name == "b"
    batch = next(b)
    assert b.update_priorities(batch.indices, torch.ones(8)) == 8
    assert float(store500.inspect.priorities("b").of(batch.indices[:1])[0]) == 1.0
    one = store500.sample(8, Prioritized(), seed=0)  # outside a sampler: the set "default"
    assert one.weights is not None and syn.wrong_rows(one) == []
    assert store500.inspect.draw(Prioritized(), 8, np.random.default_rng(0))[0].tolist() == one.indices.tolist()


def nstep_wrong(batch, n: int, gamma: float) -> list[int]:
    """Rows of an n-step batch of the synthetic single stream that differ from the ground truth."""
    bad = []
    for row, g in enumerate(batch.indices.tolist()):
        ret, m = 0.0, 0
        while m < n and g + m < 500:
            ret += gamma ** m * syn.reward(g + m)
            m += 1
            if syn.terminated(g + m - 1) or syn.truncated(g + m - 1):
                break
        ok = np.array_equal(batch.obs[row].numpy(), syn.expected_stack(g)[0]) and \
            np.array_equal(batch.next_obs[row].numpy(), syn.expected_stack(g + m - 1)[1]) and \
            abs(float(batch.reward[row]) - ret) < 1e-5 and abs(float(batch.discount[row]) - gamma ** m) < 1e-6
        if not ok:
            bad.append(g)
    return bad


def test_store_dataset_draws_by_a_strategy(store500, store_path):
    store500.flush()
    ds = StoreDataset(store_path, batch_size=16, num_batches=2, seed=0, draw=NStep(3, 0.9))
    batches = list(torch.utils.data.DataLoader(ds, batch_size=None))
    assert len(batches) == 2 and all(nstep_wrong(b, 3, 0.9) == [] for b in batches)
    rows = list(StoreDataset(store_path, num_samples=5, seed=0, draw=NStep(3, 0.9)))
    assert len(rows) == 5 and "discount" in rows[0]
    with pytest.raises(ValueError, match="does not draw single transitions: give batch_size="):
        StoreDataset(store_path, draw=Sequences(4))
