"""Unit tests of the index layer (mmreplay/index/*): the transition ring, the episode streams and the sum
tree, each driven directly, without a Store."""

from types import SimpleNamespace

import numpy as np
import pytest

from mmreplay.columns.encode import ColumnEncoder
from mmreplay.columns.spec import ColumnSpec
from mmreplay.index import ring_scans
from mmreplay.index.ring import TransitionRing, as_transition_ids
from mmreplay.index.streams import Streams
from mmreplay.index.sumtree import SumTree
from mmreplay.storage.format.layout import RingGeometry

ACTION = ColumnSpec.packed("action", (0, 1, 2))
REWARD = ColumnSpec.numeric("reward", (), "float32")


def make_ring(tmp_path, rows=32, shard_rows=8, capacity=24):
    geometry = RingGeometry(rows, shard_rows, capacity is None)
    return TransitionRing(str(tmp_path), [ACTION, REWARD], geometry, capacity=capacity)


def add_episode(ring, length, first_frame, *, frame_head=None):
    """Append one episode of ``length`` transitions whose frames are ``first_frame, first_frame + 1, ...``
    (transition t: obs frame ``first_frame + t``, next frame ``+ 1``). Returns the next free frame id."""
    t = np.arange(length, dtype=np.int64)
    obs = first_frame + t
    index = {"obs_frame": obs.astype(np.uint32), "next_frame": (obs + 1).astype(np.uint32),
             "prev_delta": (t > 0).astype(np.uint32),
             "terminated": (t == length - 1).astype(np.uint8), "truncated": np.zeros(length, np.uint8)}
    codes = {"action": (t % 3).astype(np.uint8), "reward": t.astype(np.float32)}
    ring.append(length, index, codes, obs)
    return first_frame + length + 1


def test_frame_stacks_repeat_the_first_frame_and_never_cross_episodes(tmp_path):
    ring = make_ring(tmp_path)
    head = add_episode(ring, 3, 0)  # frames 0..3
    head = add_episode(ring, 2, head)  # frames 4..6
    obs, nxt, valid = ring.stack_frames(np.arange(5), 3, head)
    assert valid.all()
    np.testing.assert_array_equal(obs, [[0, 0, 0], [0, 0, 1], [0, 1, 2], [4, 4, 4], [4, 4, 5]])
    np.testing.assert_array_equal(nxt, [[0, 0, 1], [0, 1, 2], [1, 2, 3], [4, 4, 5], [4, 5, 6]])
    assert ring.count_valid(3, head) == 5


def test_values_read_back_decoded_at_their_slots(tmp_path):
    ring = make_ring(tmp_path)
    add_episode(ring, 5, 0)
    g = np.array([4, 0, 2])
    np.testing.assert_array_equal(ring.read("action", g), [1, 0, 2])  # codes of 4 % 3, 0, 2
    out = np.empty(3, np.int64)
    ring.read_into("action", ring.slot(g), out, np.array([10, 11, 12]))
    np.testing.assert_array_equal(out, [11, 10, 12])
    np.testing.assert_array_equal(ring.read("reward", g), [4.0, 0.0, 2.0])
    np.testing.assert_array_equal(ring.read("terminated", np.arange(5)), [0, 0, 0, 0, 1])


def test_a_bounded_ring_keeps_capacity_and_gives_up_whole_shards(tmp_path):
    ring = make_ring(tmp_path, rows=32, shard_rows=8, capacity=24)
    frame = 0
    for _ in range(10):
        frame = add_episode(ring, 4, frame)  # 40 transitions into 32 rows
    assert ring.head == 40
    assert ring.oldest == 40 - 24  # capacity: the oldest are given up
    assert ring.slot(np.int64(39)) == 39 % 32
    # transition 16 starts an episode; 17's stack of 2 needs 16 (valid), nothing needs 15
    _, _, valid = ring.stack_frames(np.array([15, 16, 17, 39, 40]), 2, frame)
    np.testing.assert_array_equal(valid, [False, True, True, True, False])
    assert ring.count_valid(2, frame) == 24


def test_a_stack_reaching_below_oldest_is_invalid(tmp_path):
    ring = make_ring(tmp_path, rows=32, shard_rows=8, capacity=24)
    add_episode(ring, 30, 0)  # one long episode: oldest = 6
    assert ring.oldest == 6
    _, _, valid = ring.stack_frames(np.array([6, 7, 8, 29]), 3, 31)
    np.testing.assert_array_equal(valid, [False, False, True, True])
    assert ring.count_valid(3, 31) == 24 - 2


def test_advancing_past_frames_drops_every_shard_that_needs_them(tmp_path):
    ring = make_ring(tmp_path, rows=32, shard_rows=8, capacity=24)
    add_episode(ring, 20, 0)  # transition g uses frames g and g + 1
    ring.advance_past_frames(5)  # shard 0 (transitions 0..7) needs frames 0..7: given up as a whole
    assert ring.oldest == 8
    ring.advance_past_frames(8)  # shard 1 needs frames from 8 on: kept
    assert ring.oldest == 8


def test_an_unbounded_ring_grows_and_keeps_its_rows(tmp_path):
    ring = make_ring(tmp_path, rows=8, shard_rows=8, capacity=None)
    grown = []
    ring.on_grow = grown.append
    add_episode(ring, 30, 0)
    assert ring.rows >= 30 and grown and grown[-1] == ring.rows
    assert ring.oldest == 0
    np.testing.assert_array_equal(ring.read("reward", np.arange(30)), np.arange(30))


def test_transition_ids_must_be_integers():
    np.testing.assert_array_equal(as_transition_ids([[1, 2], [3, 4]]), [1, 2, 3, 4])
    with pytest.raises(TypeError, match="integer transition ids"):
        as_transition_ids([1.0, 2.5])


# -- streams ----------------------------------------------------------------------------------------
OBS = [ColumnSpec.numeric("obs", (2,), "float32")]


def block(values):
    return {"obs": np.asarray(values, np.float32).reshape(-1, 2)}


def test_stream_ids_are_checked():
    with pytest.raises(ValueError, match="expected 2 integer stream ids"):
        Streams.validate_ids([0.5, 1], 2)
    with pytest.raises(ValueError, match="must lie in"):
        Streams.validate_ids([-1, 0], 2)


def test_a_row_continues_its_stream_iff_obs_equals_the_last_next_obs_and_no_episode_ended():
    streams = Streams(OBS)
    ring = SimpleNamespace(oldest=0)
    ids = np.array([0, 1, 0, 0, 1])
    obs = block([[0, 0], [9, 9], [1, 1], [5, 5], [8, 8]])
    nxt = block([[1, 1], [8, 8], [2, 2], [6, 6], [7, 7]])
    done = np.array([False, True, False, False, False])
    cont, pred_row, pred_g = streams.resolve(ids, obs, nxt, done, ring, None)
    # row 2 continues row 0 (obs == its next obs); row 3 does not (5 != 2); row 4's predecessor ended
    np.testing.assert_array_equal(cont, [False, False, True, False, False])
    np.testing.assert_array_equal(pred_row, [-1, -1, 0, 2, 1])
    np.testing.assert_array_equal(pred_g, [-1, -1, -1, -1, -1])

    streams.record(ids, np.arange(100, 105), done, nxt)
    assert streams.to_json() == [[0, 103, 0], [1, 104, 0]]
    cont, pred_row, pred_g = streams.resolve(np.array([0, 1]), block([[6, 6], [0, 0]]), block([[7, 7], [1, 1]]),
                                             np.array([False, False]), ring, None)
    np.testing.assert_array_equal(cont, [True, False])  # stream 0 goes on from transition 103
    np.testing.assert_array_equal(pred_g, [103, -1])


def test_a_stream_whose_last_transition_was_given_up_starts_an_episode():
    streams = Streams(OBS)
    streams.record(np.array([0]), np.array([10]), np.array([False]), block([[3, 3]]))
    cont, _, pred_g = streams.resolve(np.array([0]), block([[3, 3]]), block([[4, 4]]), np.array([False]),
                                      SimpleNamespace(oldest=11), None)
    assert not cont[0] and pred_g[0] == -1


def test_streams_round_trip_through_json():
    streams = Streams(OBS)
    streams.record(np.array([3, 1]), np.array([7, 8]), np.array([True, False]), block([[0, 0], [1, 1]]))
    again = Streams(OBS)
    again.restore(streams.to_json())
    assert again.last == streams.last and again.ended == streams.ended


# -- sum tree ---------------------------------------------------------------------------------------
def test_find_returns_the_leaf_whose_interval_holds_u():
    tree = SumTree(5, branching=2)
    tree.update(np.arange(5), [1.0, 0.0, 3.0, 0.5, 0.0])
    assert tree.total == 4.5
    np.testing.assert_array_equal(tree.find([0.0, 0.99, 1.0, 3.99, 4.0, 4.49]), [0, 0, 2, 2, 3, 3])
    assert tree.min_positive == 0.5  # zeros are not drawable, so not the minimum


def test_updates_recompute_from_children_so_nothing_drifts():
    rng = np.random.default_rng(0)
    tree = SumTree(1000)
    for _ in range(200):
        leaves = rng.integers(0, 1000, 64)
        tree.update(leaves, rng.random(64) * 1e6)
    assert tree.total == pytest.approx(tree.leaves.sum(), rel=1e-12)
    tree.update(np.arange(1000), 0.0)
    assert tree.total == 0.0 and tree.min_positive == np.inf  # exactly: no residue of earlier sums


def test_repeated_leaves_take_the_last_value_and_set_all_replaces_everything():
    tree = SumTree(10)
    tree.update(np.array([3, 3, 3]), [1.0, 2.0, 7.0])
    assert tree.leaves[3] == 7.0 and tree.total == 7.0
    tree.set_all(np.arange(10, dtype=float))
    assert tree.total == 45.0 and tree.min_positive == 1.0


def test_a_tree_needs_leaves_and_branches():
    with pytest.raises(ValueError, match="at least one leaf"):
        SumTree(0)
    with pytest.raises(ValueError, match="branching"):
        SumTree(4, branching=1)


def test_decoding_a_packed_column_maps_codes_back_to_values():
    enc = ColumnEncoder(ColumnSpec.packed("reward", (-1.0, 0.0, 1.0)))
    codes = enc.encode(np.array([1.0, -1.0, 0.0]), 3)
    np.testing.assert_array_equal(enc.decode(codes), [1.0, -1.0, 0.0])


@pytest.mark.parametrize("capacity", [None, 1000])
def test_count_valid_in_numpy_equals_the_compiled_walk(tmp_path, capacity):
    """``count_valid(compiled=False)`` (what ``mmreplay info`` uses: no kernel) counts exactly the transitions
    ``stack_frames`` calls valid, over interleaved streams (long links), a wrapped ring and every oldest."""
    rng = np.random.default_rng(0)
    rows = 1024 if capacity else 512
    ring = TransitionRing(str(tmp_path), [], RingGeometry(rows, 64, capacity is None), capacity=capacity)
    head = 1500 if capacity else 500
    g = np.arange(head, dtype=np.int64)
    # links to the previous step of one of 5 interleaved streams, episode starts (0) now and then
    delta = np.where(rng.random(head) < 0.05, 0, rng.integers(1, 40, head)).astype(np.uint32)
    delta[g < delta] = 0
    ring.arrays["prev_delta"][ring.slot(g[max(0, head - rows):])] = delta[max(0, head - rows):]
    ring.head, ring.max_prev_delta = head, int(delta.max())
    checked = 0
    for oldest in range(max(0, head - (capacity or head)), head, 7):
        ring.oldest = oldest
        for k in (1, 2, 4, 9):
            ring._valid_count_cache = None
            compiled = ring.count_valid(k, 0)
            ring._valid_count_cache = None
            assert ring.count_valid(k, 0, compiled=False) == compiled, (oldest, k)
            _, _, valid = ring.stack_frames(np.arange(oldest, head), k, 0)
            assert compiled == int(valid.sum())
            checked += compiled < head - oldest
    assert checked > 50  # most cases had stacks cut at oldest: the walk was exercised, not only the trivial count
# -- the scans at open (index/ring_scans.py: shard_min_frames, live_max_prev_delta, frame_span) -----------
def scan_reference(ring, frame_head):
    """What the scans must find, by gathering every live transition at once (the old way)."""
    g = np.arange(ring.oldest, ring.head, dtype=np.int64)
    slots = ring.slot(g)
    obs = ring.frame_globals(ring.arrays["obs_frame"][slots], frame_head)
    nxt = ring.frame_globals(ring.arrays["next_frame"][slots], frame_head)
    mins = np.full(ring.shard_min_frame.size, np.iinfo(np.int64).max, dtype=np.int64)
    np.minimum.at(mins, ring.file_shard_array(g // ring.shard_rows), obs)
    return mins, int(ring.arrays["prev_delta"][slots].max()), (int(min(obs.min(), nxt.min())),
                                                                 int(max(obs.max(), nxt.max())))


@pytest.mark.parametrize("block", [5, 8, 1 << 20])
def test_the_scans_at_open_agree_with_a_full_gather_across_the_wrap(tmp_path, monkeypatch, block):
    """Runs of slots (``slot_runs``) cut at the ring's end and every ``SCAN_BLOCK``, shards cut mid-run."""
    monkeypatch.setattr(ring_scans, "SCAN_BLOCK", block)
    ring = make_ring(tmp_path, rows=32, shard_rows=8, capacity=24)
    frame = 0
    for length in (3, 7, 1, 9, 4, 6, 2, 5):  # 37 transitions: the ring wrapped, oldest mid-shard
        frame = add_episode(ring, length, frame)
    assert ring.oldest > 0 and ring.slot(np.int64(ring.head - 1)) < ring.slot(np.int64(ring.oldest))
    mins, max_delta, span = scan_reference(ring, frame)
    np.testing.assert_array_equal(ring_scans.shard_min_frames(ring, frame), mins)
    assert ring_scans.live_max_prev_delta(ring) == max_delta
    assert ring_scans.frame_span(ring, frame) == span


def test_load_rebuilds_from_the_links_on_disk_what_a_record_does_not_say(tmp_path):
    """A ring loaded from its files (``TransitionRing.load``) holds the longest *live* episode link and every
    shard's minimum obs frame as the scans find them in what it read, not what the writer once held."""
    ring = make_ring(tmp_path, rows=32, shard_rows=8, capacity=24)
    g = np.arange(40, dtype=np.int64)
    delta = np.where(g < 12, 2, 1).astype(np.uint32)  # two interleaved streams, then one
    delta[[0, 1, 12]] = 0  # episode starts
    obs = (3 * g + 7).astype(np.uint32)
    index = {"obs_frame": obs, "next_frame": obs + 1, "prev_delta": delta,
             "terminated": np.zeros(40, np.uint8), "truncated": np.zeros(40, np.uint8)}
    ring.append(40, index, {"action": (g % 3).astype(np.uint8), "reward": g.astype(np.float32)}, obs.astype(np.int64))
    ring.flush()
    frame = int(obs.max()) + 2
    assert ring.oldest == 16 and ring.max_prev_delta == 2  # the links of 2 were all overwritten
    loaded = TransitionRing(str(tmp_path), [ACTION, REWARD], RingGeometry(32, 8, False), capacity=24,
                            head=ring.head, oldest=ring.oldest)
    loaded.load(ring.head, frame)
    mins, max_delta, _ = scan_reference(ring, frame)
    assert loaded.max_prev_delta == max_delta == 1
    np.testing.assert_array_equal(loaded.shard_min_frame, mins)
    assert sorted(loaded.shard_min_frame.tolist()) == [3 * 16 + 7, 3 * 24 + 7, 3 * 32 + 7, ring_scans.NO_FRAME]
    live = np.arange(ring.oldest, ring.head)
    np.testing.assert_array_equal(loaded.read("reward", live), live.astype(np.float32))


def test_the_scans_at_open_hold_no_copy_of_the_ring(tmp_path, monkeypatch):
    """Their temporaries stay within a block: gathering the live transitions by an index array took several
    int64 copies of the ring (~320 MB more peak RSS for 10M transitions, before any frame was read)."""
    import tracemalloc
    monkeypatch.setattr(ring_scans, "SCAN_BLOCK", 1 << 12)
    rows = 1 << 17
    ring = make_ring(tmp_path, rows=rows, shard_rows=1 << 10, capacity=rows)
    frame = add_episode(ring, rows, 0)
    tracemalloc.start()
    try:
        ring_scans.shard_min_frames(ring, frame)
        ring_scans.live_max_prev_delta(ring)
        ring_scans.frame_span(ring, frame)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < rows * 8 // 4, f"scans at open allocated {peak} bytes at their peak for {rows} transitions"
