"""Sequence sampling: every sampled slice against a brute-force walk of the reference episodes, and the
statistics of slice starts (uniform over steps, over episodes, prioritized)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
from mmreplay.sampling.sequences import episode_table, sequence_priority, validate_sequence
from mmreplay.sampling.strategy import NStep, Prioritized, Sequences, Uniform
from test_per import chi_square
from test_store_semantics import drive


# -- the brute-force reference ------------------------------------------------------------------------
def ref_window(ref, g, seq_len, burn_in, valid):
    """Window of start ``g``: ``burn_in`` steps before it (left-padded with None), then up to ``seq_len``
    steps of its episode, walked one by one in the reference's own episode lists."""
    t = ref.transitions[g]
    ep, pos = t["episode"], t["position"]
    train = ep[pos:pos + seq_len]
    burn = [h if h in valid else None for h in ep[max(0, pos - burn_in):pos]]
    while None in burn:  # a step without its frame stack ends the burn-in there
        burn = burn[burn.index(None) + 1:]
    return [None] * (burn_in - len(burn)) + burn + train + [None] * (seq_len - len(train))


def drawable_starts(ref, valid, seq_len, strict):
    return sorted(g for g in valid if not strict or len(ref_window(ref, g, seq_len, 0, valid)) == seq_len
                  and None not in ref_window(ref, g, seq_len, 0, valid))


def assert_slices_match(batch, ref, seq_len, burn_in, valid):
    B, T = batch.mask.shape
    assert T == burn_in + seq_len and batch.burn_in == burn_in
    for row in range(B):
        start = int(batch.indices[row, burn_in])
        want = ref_window(ref, start, seq_len, burn_in, valid)
        assert batch.indices[row].tolist() == [-1 if h is None else h for h in want], f"window of {start}"
        assert batch.mask[row].tolist() == [h is not None for h in want]
        for j, h in enumerate(want):
            obs = batch.obs[row, j].numpy()
            if h is None:
                assert not obs.any() and int(batch.action[row, j]) == 0 and float(batch.reward[row, j]) == 0
                assert not batch.terminated[row, j] and not batch.truncated[row, j]
                continue
            t = ref.transitions[h]
            np.testing.assert_array_equal(obs, t["obs"], err_msg=f"obs of step {j} ({h}) of window {start}")
            assert int(batch.action[row, j]) == t["action"] and float(batch.reward[row, j]) == t["reward"]
            assert bool(batch.terminated[row, j]) == t["terminated"], f"terminated of {h}"
            assert bool(batch.truncated[row, j]) == t["truncated"], f"truncated of {h}"
        last = [h for h in want if h is not None][-1]
        np.testing.assert_array_equal(batch.next_obs[row].numpy(), ref.transitions[last]["next_obs"],
                                      err_msg=f"next_obs of window {start} (last step {last})")


# -- every slice equals the reference ----------------------------------------------------------------------
@pytest.mark.parametrize("capacity,frame_stack", [(120, 4), (None, 1), (90, 1), (None, 4)])
@pytest.mark.parametrize("strict", [True, False])
def test_slices_match_brute_force(store_path, capacity, frame_stack, strict):
    """Interleaved vector-env streams, terminated and truncated episodes, a ring that wraps mid-episode."""
    rng = np.random.default_rng(11 + frame_stack)
    store, ref = drive(store_path, rng, capacity=capacity, frame_stack=frame_stack, steps=240, p_term=0.04,
                       p_trunc=0.03)
    try:
        valid = set(ref.valid_ids(store.inspect.valid_range()[0]))
        seen_term = seen_trunc = seen_pad = False
        for i, (seq_len, burn_in, sample_from, prioritized) in enumerate(
                [(6, 0, "steps", False), (5, 3, "episodes", False), (4, 2, "steps", True), (1, 0, "steps", False)]):
            drawable = set(drawable_starts(ref, valid, seq_len, strict))
            draw = Sequences(seq_len, burn_in=burn_in, strict=strict, sample_from=sample_from,
                             over=Prioritized() if prioritized else Uniform())
            with store.sampler(16, draw, seed=i, name=f"s{i}") as smp:
                for _ in range(4):
                    batch = next(smp)
                    assert set(batch.start.tolist()) <= drawable
                    assert_slices_match(batch, ref, seq_len, burn_in, valid)
                    seen_term |= bool(batch.terminated.any())
                    seen_trunc |= bool(batch.truncated.any())
                    seen_pad |= bool((~batch.mask).any())
                    if prioritized:
                        assert batch.weights is not None and batch.weights.shape == (16,)
        assert seen_term and seen_trunc and seen_pad  # the walks crossed every kind of episode end
    finally:
        store.close()


def test_zero_stack_padding_within_slices(store_path):
    """``stack_padding="zeros"``: stacks of a window's first steps hold zeros before the episode's first frame."""
    store = mmreplay.Store.create(store_path, spaces.Box(0, 255, (3,), np.uint8), spaces.Discrete(2), capacity=None,
                                  frame_stack=3, stack_padding="zeros", durable=False)
    try:
        for t in range(5):
            store.add(np.full(3, t + 1, np.uint8), 1, 0.5, np.full(3, t + 2, np.uint8), t == 4, False)
        batch = store.sampler(4, Sequences(5), seed=0).sample()
        assert batch.indices.tolist() == [[0, 1, 2, 3, 4]] * 4  # the only 5-step slice
        assert batch.obs[0, 0, :, 0].tolist() == [0, 0, 1] and batch.obs[0, 1, :, 0].tolist() == [0, 1, 2]
        assert batch.obs[0, 4, :, 0].tolist() == [3, 4, 5] and batch.next_obs[0, :, 0].tolist() == [4, 5, 6]
        assert batch.terminated[0].tolist() == [False] * 4 + [True]
    finally:
        store.close()


# -- statistics of slice starts --------------------------------------------------------------------------------
def _start_counts(store, n_batches, name="sequence", **kw):
    with store.sampler(64, Sequences(**kw), seed=3, name=name) as smp:
        return np.concatenate([next(smp).start.numpy().copy() for _ in range(n_batches)])  # buffers are reused


@pytest.mark.parametrize("strict", [True, False])
def test_slice_starts_are_uniform_over_steps_and_over_episodes(store_path, strict):
    rng = np.random.default_rng(2)
    store, ref = drive(store_path, rng, capacity=150, frame_stack=2, steps=200, p_term=0.05, p_trunc=0.02)
    try:
        valid = set(ref.valid_ids(store.inspect.valid_range()[0]))
        drawable = drawable_starts(ref, valid, 4, strict)
        at = {g: i for i, g in enumerate(drawable)}
        # uniform over drawable starts
        starts = _start_counts(store, 60, seq_len=4, strict=strict, name="u")
        counts = np.bincount([at[g] for g in starts.tolist()], minlength=len(drawable)).astype(float)
        expected = np.full(len(drawable), starts.size / len(drawable))
        # df ~ len(drawable)-1 (~100-150): the 1e-6 upper quantile of chi2(150) is about 240
        assert chi_square(counts, expected) < 240
        # over episodes: 1/n_episodes, then uniform over the episode's drawable starts
        episode_of = {g: tuple(ref.transitions[g]["episode"]) for g in drawable}
        per_episode = {}
        for g in drawable:
            per_episode.setdefault(episode_of[g], []).append(g)
        starts = _start_counts(store, 60, seq_len=4, strict=strict, sample_from="episodes", name="e")
        counts = np.bincount([at[g] for g in starts.tolist()], minlength=len(drawable)).astype(float)
        p = np.array([1 / len(per_episode) / len(per_episode[episode_of[g]]) for g in drawable])
        assert chi_square(counts, starts.size * p) < 240
        assert chi_square(counts, expected) > 300  # the test tells the two distributions apart
    finally:
        store.close()


def test_strict_slices_longer_than_most_episodes_fall_back_to_the_exact_table(store_path):
    """Rejection would rarely hit the few long episodes: the exact table draws them, still uniformly."""
    store = mmreplay.Store.create(store_path, spaces.Box(-1, 1, (1,), np.float32), spaces.Discrete(2), capacity=None,
                                  durable=False)
    try:
        obs = np.zeros(1, np.float32)
        lengths = [3] * 300 + [12]  # one episode of 12 steps: starts 0..2 of it fit seq_len=10
        g = 0
        for n in lengths:
            for j in range(n):
                nxt = np.full(1, g + 1, np.float32)
                store.add(obs, 0, 0.0, nxt, j == n - 1, False)
                obs, g = nxt, g + 1
        starts = _start_counts(store, 20, seq_len=10)
        first = 900
        assert set(starts.tolist()) == {first, first + 1, first + 2}
        assert chi_square(np.bincount(starts - first).astype(float), np.full(3, starts.size / 3)) < 30
        with pytest.raises(ValueError, match="no episode in the store holds 13 steps"):
            store.sampler(4, Sequences(13)).sample()
    finally:
        store.close()


def _episodes_of(store, lengths, first_obs=0):
    """Episodes of ``lengths`` steps whose observation is the step's global index (1-d float)."""
    g = first_obs
    for n in lengths:
        for j in range(n):
            store.add(np.full(1, g, np.float32), 0, 0.0, np.full(1, g + 1, np.float32), j == n - 1, False)
            g += 1
    return g


def test_few_drawable_starts_go_straight_to_the_table_and_back_to_rejection_as_episodes_grow(store_path,
                                                                                           monkeypatch):
    """Rounds of rejection are skipped where the ring holds few drawable starts (they would end at the table
    anyway), and used again once a writer's long episodes make most starts drawable; starts stay exact."""
    from mmreplay.sampling import sequences as seq_mod
    calls = {"walk": 0, "table": 0}
    walk, table = seq_mod.StartDrawer._walk_rows, seq_mod.StartDrawer._from_table
    monkeypatch.setattr(seq_mod.StartDrawer, "_walk_rows",
                        lambda self, *a: (calls.__setitem__("walk", calls["walk"] + 1), walk(self, *a))[1])
    monkeypatch.setattr(seq_mod.StartDrawer, "_from_table",
                        lambda self, *a: (calls.__setitem__("table", calls["table"] + 1), table(self, *a))[1])
    store = mmreplay.Store.create(store_path, spaces.Box(-1, 1, (1,), np.float32), spaces.Discrete(2), capacity=None,
                                  durable=False)
    try:
        end = _episodes_of(store, [3] * 300 + [12])  # 3 drawable starts of 912 for seq_len 10
        with store.sampler(16, Sequences(10), seed=1, prefetch=0) as smp:
            for _ in range(3):
                calls.update(walk=0, table=0)
                assert set(smp.sample().start.tolist()) <= {900, 901, 902}
                assert calls == {"walk": 1, "table": 1}  # no rounds of rejection before the table
            _episodes_of(store, [40] * 100, first_obs=end)  # 3,100 drawable starts of 4,912
            drawable = {900, 901, 902} | {end + 40 * e + j for e in range(100) for j in range(31)}
            for _ in range(3):
                calls.update(walk=0, table=0)
                batch = smp.sample()
                assert set(batch.start.tolist()) <= drawable
                assert calls["table"] == 0 and calls["walk"] >= 1  # rejection again, ended before the table
                assert bool(batch.mask.all())
    finally:
        store.close()


def test_a_sampler_resumed_on_a_store_of_few_drawable_starts_draws_what_one_that_never_stopped_draws(store_path):
    """The choice between rejection and the table depends on the ring alone, not on earlier batches."""
    def build(path):
        store = mmreplay.Store.create(path, spaces.Box(-1, 1, (1,), np.float32), spaces.Discrete(2), capacity=None)
        _episodes_of(store, [3] * 200 + [14, 3, 16] + [3] * 50)
        return store

    store = build(store_path)
    smp = store.sampler(8, Sequences(10), seed=5)
    next(smp)
    store.close()
    store = mmreplay.Store.open(store_path, durable=False)
    try:
        got = next(store.sampler(8, Sequences(10))).start.clone()
    finally:
        store.close()
    store = build(store_path + "2")
    try:
        with store.sampler(8, Sequences(10), seed=5) as again:
            next(again)
            assert torch.equal(next(again).start, got)
    finally:
        store.close()


# -- prioritized slices ---------------------------------------------------------------------------------------
def test_r2d2_priority_mixes_max_and_mean_over_real_steps():
    td = np.array([[1.0, -3.0, 2.0, 100.0], [0.5, 0.5, 0.5, 0.5]])
    mask = np.array([[True, True, True, False], [True, True, True, True]])
    p = sequence_priority(td, mask, eta=0.9)
    assert p == pytest.approx([0.9 * 3 + 0.1 * 2, 0.5])


def test_prioritized_slices_follow_updated_priorities_and_persist(store_path):
    rng = np.random.default_rng(4)
    store, ref = drive(store_path, rng, capacity=None, frame_stack=1, steps=150, p_term=0.03, p_trunc=0.0)
    try:
        with store.sampler(32, Sequences(5, over=Prioritized(alpha=1.0)), seed=0) as smp:
            batch = next(smp)
            td = torch.zeros(32, 5)
            td[0] = torch.tensor([0.0, 4.0, 0.0, 0.0, 0.0])  # R2D2 mix with eta=0.9: 0.9*4 + 0.1*0.8
            assert smp.update_priorities(batch, td) == 32
            favoured = int(batch.start[0])
            with pytest.raises(ValueError, match="give errors for 5"):
                smp.update_priorities(batch, td[:, :3])
            assert smp.update_priorities(batch, td[:, :3], mask=batch.mask[:, :3]) == 32  # any width, with a mask
            # every other drawable start to zero: only the favoured one (and those at 0 priority eps) remain
            _, head = store.inspect.valid_range()
            others = [g for g in range(head) if g != favoured]
            smp.update_priorities(others, np.zeros(len(others)))
            assert set(next(smp).start.tolist()) == {favoured}
        store.close()
        store = mmreplay.Store.open(store_path, durable=False)
        with store.sampler(32, Sequences(5, over=Prioritized())) as smp:
            assert set(next(smp).start.tolist()) == {favoured}  # the priorities came back from the commit
    finally:
        store.close()


# -- lifecycle: resume, readers, prefetch, errors ---------------------------------------------------------------------
def test_sequence_sampler_resumes_its_random_sequence_after_reopen(store_path):
    rng = np.random.default_rng(6)
    store, _ = drive(store_path, rng, capacity=100, frame_stack=4, steps=120)
    smp = store.sampler(8, Sequences(4), seed=5)
    next(smp)
    store.close()
    store = mmreplay.Store.open(store_path, durable=False)
    resumed = store.sampler(8, Sequences(4))
    got = next(resumed).indices.clone()
    store.close()
    rng = np.random.default_rng(6)
    store, _ = drive(store_path + "2", rng, capacity=100, frame_stack=4, steps=120)
    try:
        with store.sampler(8, Sequences(4), seed=5) as again:
            next(again)
            assert torch.equal(next(again).indices, got)
    finally:
        store.close()


def test_reader_and_prefetch_sample_the_same_slices(store_path):
    rng = np.random.default_rng(8)
    store, ref = drive(store_path, rng, capacity=None, frame_stack=4, steps=150)
    store.flush()
    reader = mmreplay.Store.open(store_path, mode="r")
    try:
        valid = set(ref.valid_ids(0))
        with reader.sampler(8, Sequences(6, burn_in=2, strict=False), seed=1, prefetch=2) as fetched, \
                store.sampler(8, Sequences(6, burn_in=2, strict=False), seed=1) as direct:
            for _ in range(3):
                a, b = next(fetched), next(direct)
                assert torch.equal(a.indices, b.indices) and torch.equal(a.obs, b.obs)
                assert_slices_match(a, ref, 6, 2, valid)
    finally:
        reader.close()
        store.close()


def test_bad_sequence_arguments_are_named():
    with pytest.raises(ValueError, match="seq_len must be an integer >= 1, got 0"):
        validate_sequence(0)
    with pytest.raises(ValueError, match="burn_in must be an integer >= 0, got -1"):
        validate_sequence(4, -1)
    with pytest.raises(ValueError, match="sample_from must be one of"):
        validate_sequence(4, sample_from="trajectories")
    with pytest.raises(ValueError, match="strict must be True"):
        validate_sequence(4, strict="yes")


def _links_of(store):
    """What ``episode_table`` reads of an index ring (its bounds and each slot's episode link), rebuilt from
    the store's public ``episode_links``."""
    oldest, head = store.inspect.valid_range()
    geometry = store.geometry.transitions
    prev, _, _ = store.inspect.episode_links(oldest, head)
    g = np.arange(oldest, head, dtype=np.int64)
    delta = np.zeros(geometry.rows, dtype=np.int64)
    delta[geometry.slot(g)] = np.where(prev >= 0, g - prev, 0)
    return SimpleNamespace(head=head, oldest=oldest, rows=geometry.rows,
                           capacity=None if geometry.unbounded else store.capacity, arrays={"prev_delta": delta})


def test_episode_table_counts_cut_episodes_from_their_first_full_stack(store_path):
    rng = np.random.default_rng(9)
    store, ref = drive(store_path, rng, capacity=80, frame_stack=3, steps=120)
    try:
        table = episode_table(_links_of(store), 3)
        valid = set(ref.valid_ids(store.inspect.valid_range()[0]))
        spec = validate_sequence(1, strict=False)
        starts = {int(table.members[table.offsets[e] + table.first[e] + p])
                  for e, n in enumerate(table.drawable(spec)) for p in range(n)}
        assert starts == valid
    finally:
        store.close()


def test_dict_observations_and_extras_come_per_step(store_path):
    obs_space = spaces.Dict({"pos": spaces.Box(-9, 9, (2,), np.float32), "img": spaces.Box(0, 255, (2, 2), np.uint8)})
    store = mmreplay.Store.create(store_path, obs_space, spaces.Discrete(3), capacity=64, durable=False,
                                  extras=[mmreplay.ColumnSpec.numeric("lives", (), "int8")])
    try:
        def o(t):
            return {"pos": np.full(2, t, np.float32), "img": np.full((2, 2), t, np.uint8)}
        for t in range(100):  # one episode of 100 steps in a ring of 64: wrapped
            store.add(o(t), t % 3, 1.0, o(t + 1), False, t == 99, extras={"lives": t % 5})
        batch = store.sampler(8, Sequences(6), seed=0).sample()
        for row in range(8):
            ids = batch.indices[row].numpy()
            assert (np.diff(ids) == 1).all() and ids[0] >= store.inspect.valid_range()[0]
            np.testing.assert_array_equal(batch.obs["pos"][row, :, 0].numpy(), ids.astype(np.float32))
            np.testing.assert_array_equal(batch.obs["img"][row, :, 1, 1].numpy(), ids.astype(np.uint8))
            np.testing.assert_array_equal(batch.extras["lives"][row].numpy(), ids % 5)
            assert float(batch.next_obs["pos"][row, 0]) == ids[-1] + 1
    finally:
        store.close()


def test_prioritized_slice_starts_are_proportional_among_drawable_starts(store_path):
    """Random priorities on every transition: strict starts come with probability p_i / sum over the
    drawable ones (starts whose window cannot hold L steps are drawn again, never returned)."""
    rng = np.random.default_rng(12)
    store, ref = drive(store_path, rng, capacity=None, frame_stack=1, steps=120, p_term=0.06, p_trunc=0.02)
    try:
        valid = set(ref.valid_ids(0))
        drawable = drawable_starts(ref, valid, 4, True)
        _, head = store.inspect.valid_range()
        p = rng.uniform(0.1, 1.0, head)
        with store.sampler(64, Sequences(4, over=Prioritized(alpha=1.0)), seed=0) as smp:
            smp.update_priorities(np.arange(head), p)
            starts = np.concatenate([next(smp).start.numpy().copy() for _ in range(60)])
        at = {g: i for i, g in enumerate(drawable)}
        assert set(starts.tolist()) <= set(drawable)
        counts = np.bincount([at[g] for g in starts.tolist()], minlength=len(drawable)).astype(float)
        want = p[drawable] / p[drawable].sum() * starts.size
        assert chi_square(counts, want) < 240  # df ~ len(drawable) - 1 (< 150)
        assert chi_square(counts, np.full(len(drawable), starts.size / len(drawable))) > 300
    finally:
        store.close()


def test_sequence_options_are_checked_once_and_public_draws_match_the_samplers(store_path):
    """Sequence options are checked when the strategy is made; one open sampler per name; the index-only
    draws (``store.inspect.draw``, what TorchRL's samplers use) draw what the samplers draw from the same
    RNG state."""
    rng = np.random.default_rng(13)
    store, _ = drive(store_path, rng, capacity=None, frame_stack=2, steps=100, p_term=0.05, p_trunc=0.0)
    try:
        with pytest.raises(ValueError, match="eta .* must lie in \\[0, 1\\], got 2"):
            Sequences(3, eta=2)
        with pytest.raises(ValueError, match="seq_len must be an integer >= 1, got 0"):
            Sequences(0)
        with pytest.raises(ValueError, match="prioritized slices are drawn by priority, not 'episodes'"):
            Sequences(3, sample_from="episodes", over=Prioritized())
        with pytest.raises(TypeError, match="Sequences\\(over=...\\) takes Uniform\\(\\) or Prioritized"):
            Sequences(3, over=NStep(3))
        smp = store.sampler(4, Sequences(3, burn_in=1), seed=7)
        assert isinstance(smp, mmreplay.Sampler) and smp.name == "sequence"
        with pytest.raises(ValueError, match="a sampler named 'sequence' is already open"):
            store.sampler(4, Sequences(3))
        batch = next(smp)
        windows, weights = store.inspect.draw(Sequences(3, burn_in=1), 4, np.random.Generator(np.random.PCG64(7)))
        assert weights is None and windows.tolist() == batch.indices.tolist()
        smp.close()
        store.sampler(4, Sequences(3)).close()  # the name is free again
        ids, weights = store.inspect.draw(Uniform(), 8, np.random.default_rng(1))
        assert weights is None and ids.tolist() == store.sample(8, seed=np.random.default_rng(1)).indices.tolist()
        one_shot = store.sample(4, Sequences(3, burn_in=1), seed=np.random.Generator(np.random.PCG64(7)))
        assert one_shot.indices.tolist() == batch.indices.tolist()  # Store.sample takes any strategy
        assert not store.closed
    finally:
        store.close()
    assert store.closed
