"""The compiled code's entry points (``mmreplay/_native``): a destination too small for what a kernel
would write, or an index outside its array, is a ``ValueError`` naming the values, raised before anything
is written (numba checks no index and nothing checks a raw address: the kernel would overwrite memory that
belongs to something else); and the C symbols linked into the decoder are checked on a known chunk at
first use."""

import struct

import google_crc32c
import numpy as np
import pytest
from numcodecs import blosc

from mmreplay._native import (cache, decode, draw, gather, helpers, packing, priorities, ring, selftest, sequences,
                              sumtree)
from mmreplay._native.codec_kinds import CODEC_BLOSC, CODEC_TEMPORAL
from mmreplay.index.sumtree import SumTree

pytestmark = pytest.mark.skipif(not decode.AVAILABLE, reason="this numcodecs/google-crc32c build exports no C symbols")

FRAME = 7056  # bytes of an 84x84 frame


def blosc_chunks(n: int):
    """``n`` frames as blosc-lz4 chunks with their crc32c in one buffer: (buffer, src, sizes, frames)."""
    data = (np.arange(n * FRAME, dtype=np.int64) // 97 % 7 * 30).astype(np.uint8).reshape(n, FRAME)
    chunks = []
    for f in data:
        body = bytes(blosc.compress(f, b"lz4", 5, blosc.NOSHUFFLE, 0))
        chunks.append(body + struct.pack("<I", google_crc32c.value(body)))
    buf = np.frombuffer(b"".join(chunks), dtype=np.uint8).copy()
    sizes = np.array([len(c) for c in chunks], dtype=np.int64)
    src = buf.ctypes.data + np.concatenate([[0], np.cumsum(sizes)[:-1]]).astype(np.int64)
    return buf, src, sizes, data


# -- decodes through raw addresses -----------------------------------------------------------------------
def test_a_decode_into_a_buffer_one_frame_short_is_refused_before_any_write():
    buf, src, sizes, data = blosc_chunks(4)
    out = np.zeros((3, FRAME), np.uint8)  # room for 3 frames; the addresses ask for 4
    dst = out.ctypes.data + np.arange(4, dtype=np.int64) * FRAME
    status = np.full(4, -1, np.int8)
    with pytest.raises(ValueError, match=rf"dst\[3\] = {int(dst[3]):#x}: its {FRAME} bytes fall outside"):
        decode.checked_decode_chunks(src, sizes, dst, np.zeros_like(dst), FRAME, CODEC_BLOSC, status, (out,))
    assert not out.any() and (status == -1).all()  # not even the frames that fit were written
    out = np.zeros((4, FRAME), np.uint8)
    dst = out.ctypes.data + np.arange(4, dtype=np.int64) * FRAME
    assert decode.checked_decode_chunks(src, sizes, dst, np.zeros_like(dst), FRAME, CODEC_BLOSC, status,
                                        (out,)) == 0
    np.testing.assert_array_equal(out, data)


def test_a_copy_address_or_a_short_status_is_refused():
    buf, src, sizes, data = blosc_chunks(4)
    out, other = np.zeros((4, FRAME), np.uint8), np.zeros((4, FRAME), np.uint8)
    dst = out.ctypes.data + np.arange(4, dtype=np.int64) * FRAME
    copies = np.array([0, other.ctypes.data, 0, 0], np.int64)  # into an array not named in ``into``
    with pytest.raises(ValueError, match=r"copies\[1\]"):
        decode.checked_decode_chunks(src, sizes, dst, copies, FRAME, CODEC_BLOSC, np.zeros(4, np.int8), (out,))
    with pytest.raises(ValueError, match="status has 3 entries, the kernel writes 4"):
        decode.checked_decode_chunks(src, sizes, dst, np.zeros_like(dst), FRAME, CODEC_BLOSC,
                                     np.zeros(3, np.int8), (out,))
    assert not out.any() and not other.any()


def test_the_codec_helpers_refuse_a_destination_outside_their_buffers(monkeypatch):
    h = helpers.CodecHelpers(2)
    try:
        buf, src, sizes, data = blosc_chunks(40)
        out = np.zeros((39, FRAME), np.uint8)
        dst = out.ctypes.data + np.arange(40, dtype=np.int64) * FRAME
        with pytest.raises(ValueError, match=r"dst\[39\]"):
            h.decode(src, sizes, dst, np.zeros_like(dst), FRAME, CODEC_BLOSC, np.zeros(40, np.int8), (out,))
        assert not out.any()
        slab = np.arange(80, dtype=np.uint64).reshape(10, 8)
        index = np.zeros((4, 5), np.int64)
        index[2, 3] = 10  # one row past the slab
        outs = np.zeros((16, 8), np.uint64), np.zeros((16, 8), np.uint64)
        with pytest.raises(ValueError, match=r"index holds 10 at flat position 13, outside \[0, 10\)"):
            h.gather(slab, index, 4, True, *outs)
        assert not outs[0].any() and not outs[1].any()
    finally:
        h.stop()


def stacks(n=2, k=4):
    obs_ids = np.arange(n * k, dtype=np.int64).reshape(n, k)
    return obs_ids, obs_ids + 1


def test_stack_decodes_need_outputs_that_hold_the_batch():
    buf, src, sizes, data = blosc_chunks(9)
    obs_ids, next_ids = stacks()
    obs_out, next_out = np.zeros((8, FRAME), np.uint8), np.zeros((7, FRAME), np.uint8)  # next: one frame short
    status = np.full(10, -1, np.int8)
    with pytest.raises(ValueError, match=f"next_out holds {7 * FRAME} bytes, 2 stacks of 4 frames of {FRAME} bytes"):
        decode.checked_decode_stacks(obs_ids, next_ids, True, obs_out, next_out, FRAME, 0, src, sizes,
                                     CODEC_BLOSC, status)
    with pytest.raises(ValueError, match="next_out holds"):
        decode.checked_plan_stack_decodes(obs_ids, next_ids, True, obs_out, next_out, FRAME, 0, src, sizes)
    with pytest.raises(ValueError, match="status has 9 entries, the kernel writes 10"):
        decode.checked_decode_stacks(obs_ids, next_ids, True, obs_out, np.zeros((8, FRAME), np.uint8), FRAME, 0,
                                     src, sizes, CODEC_BLOSC, status[:9])
    with pytest.raises(ValueError, match="next_out must be a C-contiguous numpy array"):
        decode.checked_decode_stacks(obs_ids, next_ids, True, obs_out, np.zeros((8, 2 * FRAME), np.uint8)[:, ::2],
                                     FRAME, 0, src, sizes, CODEC_BLOSC, status)
    with pytest.raises(ValueError, match="codec 7 is none of the compiled decoder's"):
        decode.checked_decode_stacks(obs_ids, next_ids, True, obs_out, np.zeros((8, FRAME), np.uint8), FRAME, 0,
                                     src, sizes, 7, status)
    assert not obs_out.any() and (status == -1).all()
    next_out = np.zeros((8, FRAME), np.uint8)
    bad, rows = decode.checked_decode_stacks(obs_ids, next_ids, True, obs_out, next_out, FRAME, 0, src, sizes,
                                             CODEC_BLOSC, status)
    assert bad == 0
    np.testing.assert_array_equal(obs_out, data[obs_ids.reshape(-1)])
    np.testing.assert_array_equal(next_out, data[next_ids.reshape(-1)])


@pytest.mark.parametrize("n_helpers", [0, 2])
def test_a_checked_plan_decodes_alone_or_shared_and_nothing_else_passes_for_one(n_helpers):
    buf, src, sizes, data = blosc_chunks(33)
    obs_ids, next_ids = stacks(n=8)  # 8 stacks of 4 frames and their next stacks: frames 0..32
    obs_out, next_out = np.zeros((32, FRAME), np.uint8), np.zeros((32, FRAME), np.uint8)
    plan = decode.checked_plan_stack_decodes(obs_ids, next_ids, True, obs_out, next_out, FRAME, 0, src, sizes)
    assert plan.absent == 0 and plan.src.size == 40  # 32 obs frames + each next stack's last
    h = helpers.CodecHelpers(n_helpers) if n_helpers else None
    try:
        # a tuple with the plan's fields, but not made by the checked planner (its addresses unchecked)
        forged = tuple(plan)
        with pytest.raises(TypeError, match="StackPlan from checked_plan_stack_decodes expected, got tuple"):
            decode.checked_decode_plan(forged, CODEC_BLOSC, np.zeros(40, np.int8))
        if h is not None:
            with pytest.raises(TypeError, match="got tuple"):
                h.decode_plan(forged, CODEC_BLOSC, np.zeros(40, np.int8))
        with pytest.raises(ValueError, match="status has 39 entries, the kernel writes 40"):
            decode.checked_decode_plan(plan, CODEC_BLOSC, np.zeros(39, np.int8))
        with pytest.raises(ValueError, match="codec 99"):
            decode.checked_decode_plan(plan, 99, np.zeros(40, np.int8))
        assert not obs_out.any() and not next_out.any()
        status = np.full(40, -1, np.int8)
        bad = h.decode_plan(plan, CODEC_BLOSC, status) if h is not None else None
        if bad is None:
            bad = decode.checked_decode_plan(plan, CODEC_BLOSC, status)
        assert bad == 0 and (status == decode.OK).all()
        np.testing.assert_array_equal(obs_out, data[obs_ids.reshape(-1)])
        np.testing.assert_array_equal(next_out, data[next_ids.reshape(-1)])
        sizes_gone = sizes.copy()
        sizes_gone[5] = 0
        src_gone = src.copy()
        src_gone[5] = 0  # frame 5's chunk not held
        held = decode.checked_plan_stack_decodes(obs_ids, next_ids, True, obs_out, next_out, FRAME, 0, src_gone,
                                                 sizes_gone)
        with pytest.raises(ValueError, match="1 frames whose chunk is not held"):
            decode.checked_decode_plan(held, CODEC_BLOSC, status)
    finally:
        if h is not None:
            h.stop()


# -- copies and lookups in the decoded cache ---------------------------------------------------------------
def test_a_gather_checks_its_index_and_outputs():
    slab = np.arange(80, dtype=np.uint64).reshape(10, 8)
    index = np.arange(10, dtype=np.int64).reshape(2, 5)
    small = np.zeros((7, 8), np.uint64)  # 2 stacks of 4 need 8 rows
    with pytest.raises(ValueError, match=r"out_next has shape \(7, 8\), 2 stacks of 4 rows of 8 words need \(8, 8\)"):
        gather.checked_gather_stacks(slab, index, 4, True, np.zeros((8, 8), np.uint64), small)
    index[1, 4] = -1
    with pytest.raises(ValueError, match=r"index holds -1 at flat position 9"):
        gather.checked_gather_stacks(slab, index, 4, True, np.zeros((8, 8), np.uint64), np.zeros((8, 8), np.uint64))
    assert not small.any()


def test_cached_gathers_check_the_ids_against_the_cache_table():
    slot_of = np.arange(4, dtype=np.int32)  # 4 chunks of 2 rows: frame ids 0..7 when unbounded
    last_used = np.zeros(4, np.int64)
    slab = np.arange(64, dtype=np.uint64).reshape(8, 8)
    obs_ids, next_ids = stacks(n=1, k=4)
    next_ids[0, 3] = 8  # past the table
    outs = np.zeros((4, 8), np.uint64), np.zeros((4, 8), np.uint64)
    with pytest.raises(ValueError, match=r"next_ids holds 8 at flat position 3, outside \[0, 8\)"):
        gather.checked_gather_cached(slot_of, last_used, 1, 0, 2, slab, obs_ids, next_ids, True, *outs)
    with pytest.raises(ValueError, match="a ring of 9 rows, but the cache's chunk table covers 8 rows"):
        gather.checked_index_cached(slot_of, last_used, 1, 9, 2, obs_ids, next_ids, True, np.zeros((1, 5), np.int64))
    with pytest.raises(ValueError, match=r"out_obs has shape \(3, 8\)"):
        gather.checked_gather_cached(slot_of, last_used, 1, 8, 2, slab, obs_ids, next_ids, True,
                                     np.zeros((3, 8), np.uint64), outs[1])
    with pytest.raises(ValueError, match=r"a slab of shape \(7, 8\) for 4 slots of 2 rows"):
        gather.checked_gather_cached(slot_of, last_used, 1, 8, 2, slab[:7], obs_ids, next_ids, True, *outs)
    with pytest.raises(ValueError, match="out_obs must be uint64, got int64"):
        gather.checked_gather_cached(slot_of, last_used, 1, 8, 2, slab, obs_ids, next_ids, True,
                                     np.zeros((4, 8), np.int64), outs[1])
    index = np.full((1, 5), -7, np.int64)
    with pytest.raises(ValueError, match=r"next_ids holds 8 at flat position 3, outside \[0, 8\)"):
        gather.checked_index_cached(slot_of, last_used, 1, 0, 2, obs_ids, next_ids, True, index)
    with pytest.raises(ValueError, match=r"index must have shape \(1, 8\), got \(1, 5\)"):
        gather.checked_index_cached(slot_of, last_used, 1, 8, 2, obs_ids, next_ids, False, index)
    assert (index == -7).all()  # refused before any write
    next_ids[0, 3] = 7
    assert gather.checked_index_cached(slot_of, last_used, 1, 0, 2, obs_ids, next_ids, True, index) == 5
    assert (index >= 0).all()
    last_used[:] = 0
    assert not last_used.any() and not outs[0].any()
    assert gather.checked_gather_cached(slot_of, last_used, 1, 0, 2, slab, obs_ids, next_ids, True, *outs) == 5
    np.testing.assert_array_equal(outs[0], slab[obs_ids[0]])  # slot_of maps chunk c to slot c: row = frame id
    np.testing.assert_array_equal(outs[1], slab[next_ids[0]])
    outs[0][:] = outs[1][:] = 0
    last_used[:] = 0
    ids = np.array([0, 5, 16], np.int64)
    with pytest.raises(ValueError, match=r"ids holds 16 at flat position 2, outside \[0, 8\)"):
        cache.lookup_rows(slot_of, last_used, 1, ids, 0, 2, np.empty(3, np.int64), np.empty(3, np.int64))
    with pytest.raises(ValueError, match="slab_rows has 2 entries, the kernel writes 3"):
        cache.lookup_rows(slot_of, last_used, 1, ids, 8, 2, np.empty(2, np.int64), np.empty(3, np.int64))
    assert not last_used.any()


# -- the index: packed columns, sum tree, ring walks, priorities ---------------------------------------------
def test_packed_reads_check_positions_and_outputs():
    buf = np.zeros(4, np.uint8)  # 16 codes of 2 bits
    table = np.arange(4, dtype=np.float32)
    out = np.full(2, -1, np.float32)
    with pytest.raises(ValueError, match=r"positions holds 16 at flat position 1, outside \[0, 16\)"):
        packing.decode_into(buf, 2, np.array([3, 16], np.int64), table, out)
    assert (out == -1).all()  # checked inside the kernel, before its first write
    with pytest.raises(ValueError, match=r"positions holds -1 at flat position 0"):
        packing.decode_into(buf, 2, np.array([-1, 3], np.int64), table, out)
    with pytest.raises(ValueError, match="out has 1 entries, the kernel writes 2"):
        packing.decode_into(buf, 2, np.array([3, 15], np.int64), table, np.zeros(1, np.float32))
    with pytest.raises(ValueError, match=r"positions holds 32 at flat position 0, outside \[0, 32\)"):
        packing.bits_into(buf, buf, np.array([32], np.int64), np.zeros(1, bool), np.zeros(1, bool))
    first, second = np.ones(2, bool), np.ones(2, bool)
    with pytest.raises(ValueError, match=r"positions holds 40 at flat position 1, outside \[0, 32\)"):
        packing.bits_into(buf, buf, np.array([0, 40], np.int64), first, second)
    assert first.all() and second.all()
    with pytest.raises(ValueError, match="out_second has 1 entries, the kernel writes 2"):
        packing.bits_into(buf, buf, np.array([0, 1], np.int64), first, np.ones(1, bool))
    with pytest.raises(ValueError, match="positions must be int64, got int32"):
        packing.decode_into(buf, 2, np.array([0, 1], np.int32), table, out)
    with pytest.raises(ValueError, match="bits must be 1, 2 or 4, got 3"):
        packing.decode_into(buf, 3, np.array([0, 1], np.int64), table, out)
    assert first.all() and second.all() and (out == -1).all()


def test_a_sum_tree_refuses_leaves_outside_it():
    tree = SumTree(100)
    before = tree.sums.copy()
    for leaves in ([3, 100], [-1]):  # past the leaves (the padding, then inner nodes); -1 would be the root
        with pytest.raises(ValueError, match=r"leaves holds -?\d+ at flat position \d, outside \[0, 100\)"):
            tree.update(np.array(leaves), 1.0)
    with pytest.raises(ValueError, match=r"leaves holds 200"):
        tree.update(np.arange(200, 300), 1.0)  # the bulk path (numpy) too
    np.testing.assert_array_equal(tree.sums, before)
    with pytest.raises(ValueError, match="out has 2 entries, the kernel writes 3"):
        sumtree.find(tree.sums, tree.offsets, tree.b, tree.n_leaves, np.zeros(3), np.zeros(2, np.int64))


def test_ring_walks_check_their_outputs():
    column = np.zeros(16, np.uint32)
    g = np.arange(5, dtype=np.int64)
    with pytest.raises(ValueError, match="next_ids has 4 rows for 5 transitions"):
        ring.stack_frames(g, 2, column, column, column, 16, 0, 5, 5, np.zeros((5, 2), np.int64),
                          np.zeros((4, 2), np.int64), np.zeros(5, bool))
    with pytest.raises(ValueError, match="a frame stack of 0 frames"):
        ring.stack_frames(g, 0, column, column, column, 16, 0, 5, 5, np.zeros((5, 0), np.int64),
                          np.zeros((5, 0), np.int64), np.zeros(5, bool))
    flags = np.zeros(2, np.uint8)  # 16 rows of 1-bit flags
    with pytest.raises(ValueError, match=r"out must have shape \(5, 3\), got \(5, 2\)"):
        sequences.walk_forward(g, 3, column, flags, flags, 16, 5, 1, np.zeros((5, 2), np.int64), np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="terminated covers 8 rows of a ring of 16"):
        sequences.walk_forward(g, 3, column, flags[:1], flags, 16, 5, 1, np.zeros((5, 3), np.int64),
                               np.zeros(5, np.int64))
    with pytest.raises(ValueError, match=r"out must have shape \(5, 2\), got \(4, 2\)"):
        sequences.walk_back(g, 2, column, 16, 0, np.zeros((4, 2), np.int64))
    with pytest.raises(ValueError, match="members has 4 entries, the kernel writes 5"):
        sequences.group_by_episode(np.zeros(5, np.int64), np.array([0, 5]), 0, np.zeros(4, np.int64))
    with pytest.raises(ValueError, match=r"episode holds 1 at flat position 4, outside \[0, 1\)"):
        sequences.group_by_episode(np.array([0, 0, 0, 0, 1]), np.array([0, 5]), 0, np.zeros(5, np.int64))
    with pytest.raises(ValueError, match="lowest_read of an empty batch"):
        draw.lowest_read(np.zeros(0, np.int64), np.zeros((0, 4), np.int64), np.zeros((0, 4), np.int64))


def test_priority_kernels_check_their_arrays():
    tree = SumTree(16)
    raw, drawable, ticks = np.zeros(15, np.float32), np.ones(16, bool), np.zeros(2, np.int64)  # raw: one short
    g, p = np.array([3], np.int64), np.array([1.0])
    with pytest.raises(ValueError, match="priority arrays too small for 16 slots: raw 15"):
        priorities.apply_update(g, p, 0, 16, 16, 8, 1, 0.6, 1e-6, raw, ticks, drawable, tree.sums, tree.mins,
                                tree.offsets, tree.b)
    with pytest.raises(ValueError, match="out has 2 entries, the kernel writes 3"):
        priorities.leaf_values(np.zeros(3, np.float32), 0.6, 1e-6, np.zeros(2))
    n, k, column = 4, 2, np.zeros(16, np.uint32)
    outs = [np.zeros(n, np.int64), np.zeros(n, np.int64), np.zeros(n), np.zeros(3), np.zeros((n, k), np.int64),
            np.zeros((n, k), np.int64), np.zeros(n, bool)]
    with pytest.raises(ValueError, match="weights has 3 entries, the kernel writes 4"):
        priorities.draw_batch(tree.sums, tree.offsets, tree.b, tree.n_leaves, np.zeros(n), 16, 0, 16, 1.0, -0.4,
                              column, column, column, 16, k, *outs)
    outs[3] = np.zeros(2 * n)[::2]  # room for 4, but strided
    with pytest.raises(ValueError, match="weights must be C-contiguous"):
        priorities.draw_batch(tree.sums, tree.offsets, tree.b, tree.n_leaves, np.zeros(n), 16, 0, 16, 1.0, -0.4,
                              column, column, column, 16, k, *outs)
    outs[3], outs[5] = np.zeros(n), np.zeros((n, k + 1), np.int64)
    with pytest.raises(ValueError, match=r"next_ids must have shape \('any', 2\), got \(4, 3\)"):
        priorities.draw_batch(tree.sums, tree.offsets, tree.b, tree.n_leaves, np.zeros(n), 16, 0, 16, 1.0, -0.4,
                              column, column, column, 16, k, *outs)
    assert not any(o.any() for o in outs)  # refused before any write


# -- the C symbols: checked on known chunks at first use ---------------------------------------------------
def test_the_linked_symbols_decode_known_chunks_as_numcodecs_does():
    selftest.self_test()  # raises on a mismatch
    selftest.ensure_linked()
    assert selftest._LINK_CHECKED


def test_a_symbol_that_decodes_otherwise_is_named(monkeypatch):
    real = selftest._known_chunks()
    wrong = [(codec, what, chunk, bytes(expected[:-1]) + bytes([expected[-1] ^ 1])) if codec == CODEC_BLOSC
             else (codec, what, chunk, expected) for codec, what, chunk, expected in real]
    monkeypatch.setattr(selftest, "_known_chunks", lambda: wrong)
    with pytest.raises(selftest.LinkError, match="numcodecs.blosc: blosc_decompress_ctx.*gave bytes that differ"):
        selftest.self_test()
    wrong = [(codec, what, chunk, expected) if codec != CODEC_TEMPORAL
             else (codec, what, chunk, expected[::-1]) for codec, what, chunk, expected in real]
    monkeypatch.setattr(selftest, "_known_chunks", lambda: wrong)
    with pytest.raises(selftest.LinkError, match=r"numcodecs.zstd: ZSTD_decompress \(temporal run\)"):
        selftest.self_test()
    wrong = [(codec, what, chunk[:-4] + bytes(4), expected) for codec, what, chunk, expected in real]
    monkeypatch.setattr(selftest, "_known_chunks", lambda: wrong)
    with pytest.raises(selftest.LinkError, match="google_crc32c._crc32c: crc32c_value"):
        selftest.self_test()
    # at first use: a process whose self-test fails refuses to decode rather than return garbage
    monkeypatch.setattr(selftest, "_LINK_CHECKED", False)
    buf, src, sizes, data = blosc_chunks(1)
    out = np.zeros((1, FRAME), np.uint8)
    dst = np.array([out.ctypes.data], np.int64)
    with pytest.raises(selftest.LinkError):
        decode.checked_decode_chunks(src, sizes, dst, np.zeros(1, np.int64), FRAME, CODEC_BLOSC,
                                     np.zeros(1, np.int8), (out,))
    assert not out.any()
    monkeypatch.setattr(selftest, "_known_chunks", lambda: real)
    selftest.ensure_linked()
    assert selftest._LINK_CHECKED  # passed once: not run again


# -- frame decodes (layout-2 runs decoded straight into a batch) ------------------------------------------
def frame_requests(out: np.ndarray, nbytes: int = 16):
    """Requests for 3 runs, 2 frames each, to consecutive ``nbytes`` slots of ``out``: all within bounds."""
    src, sizes = np.zeros(3, np.int64), np.ones(3, np.int64)
    starts = np.array([0, 2, 4, 6], np.int64)
    js = np.array([0, 1, 5, 6, 14, 15], np.int64)
    dsts = out.ctypes.data + np.arange(6, dtype=np.int64) * nbytes
    return src, sizes, starts, js, dsts, nbytes, 16, np.zeros(3, np.int8), (out,)


def test_frame_decode_requests_inside_their_buffers_pass():
    out = np.zeros(6 * 16, np.uint8)
    decode.check_frame_decodes(*frame_requests(out))
    args = list(frame_requests(out))
    args[3] = args[3].astype(np.int32)  # other integer types: the slower checks, which pass too
    decode.check_frame_decodes(*args)


@pytest.mark.parametrize("fault, message", [
    ("js_high", r"js holds 16 at flat position 2, outside \[0, 16\)"),
    ("js_negative", r"js holds -1 at flat position 0"),
    ("dst_past_end", r"dsts\[5\] = .* fall outside the destination buffer"),
    ("dst_before", r"dsts\[0\] = .* fall outside the destination buffer"),
    ("starts_decrease", r"group starts .* do not tile the 6 requests"),
    ("starts_short", r"group starts .* do not tile the 6 requests"),
    ("sizes", r"frame-decode arrays disagree: 3 sources, 2 sizes"),
])
def test_frame_decode_requests_that_would_write_outside_are_named(fault, message):
    out = np.zeros(6 * 16, np.uint8)
    src, sizes, starts, js, dsts, nbytes, run_rows, status, into = frame_requests(out)
    if fault == "js_high":
        js[2] = 16
    elif fault == "js_negative":
        js[0] = -1
    elif fault == "dst_past_end":
        dsts[5] += 1
    elif fault == "dst_before":
        dsts[0] -= 1
    elif fault == "starts_decrease":
        starts[:] = [0, 4, 2, 6]
    elif fault == "starts_short":
        starts[-1] = 5
    elif fault == "sizes":
        sizes = sizes[:2]
    with pytest.raises(ValueError, match=message):
        decode.check_frame_decodes(src, sizes, starts, js, dsts, nbytes, run_rows, status, into)


def test_address_of_is_the_arrays_first_byte_for_every_kind_of_array():
    from mmreplay._native.bounds import address_of
    base = np.zeros((4, 84, 84), np.uint8)
    arrays = [base, base[1:], np.zeros(3, ">i4"), np.zeros(2, dtype=[("a", "<i8"), ("b", "u1")]),
              np.frombuffer(b"abcdef", np.uint8), np.zeros((5, 3), np.float16), np.zeros(0, np.int64)]
    for arr in arrays:
        assert address_of(arr) == arr.ctypes.data, arr.dtype
