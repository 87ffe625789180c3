"""The ``delta-lz4`` frame codec (``codecs/delta_lz4.py``, compiled decode ``_native/delta_lz4.py``): round trips on
both paths (whole runs and runs decoded up to a frame), malformed runs refused by both, and a store of 64x64 RGB
frames sampled with ``Sequences`` whose every step equals what was added (with ``is_first``), also where runs are
decoded straight into the batch and where a run on disk is corrupt."""

import os
import struct

import google_crc32c
import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay._native import chunk_decode, linked
from mmreplay._native import decode as native
from mmreplay._native import delta_lz4 as kernel
from mmreplay._native.codec_kinds import CODEC_DELTA_LZ4
from mmreplay.codecs import delta_lz4
from mmreplay.errors import CorruptDataError
from mmreplay.storage.format.codecs import validate_codec

SHAPE = (64, 64, 3)


def moving_frames(n: int, seed: int = 0) -> np.ndarray:
    """``n`` consecutive 64x64 RGB frames: a square moving over a textured background that drifts in light."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 60, SHAPE, dtype=np.uint8)
    frames = np.empty((n, *SHAPE), np.uint8)
    for t in range(n):
        f = base + np.uint8(t % 7)
        y, x = (3 * t) % 56, (5 * t) % 56
        f[y:y + 8, x:x + 8] = (200, 80 + t % 50, 30)
        frames[t] = f
    return frames


def sealed(data: bytes) -> np.ndarray:
    return np.frombuffer(data + struct.pack("<I", google_crc32c.value(data)), np.uint8).copy()


# -- the codec alone --------------------------------------------------------------------------------
@pytest.mark.parametrize("run", [1, 2, 7, 32])
def test_round_trips_bit_exact_on_both_paths(run):
    frames = moving_frames(run)
    coded = delta_lz4.encode_run(frames)
    out = np.zeros_like(frames)
    delta_lz4.decode_run(coded, out)
    assert np.array_equal(out, frames)
    out2 = np.zeros_like(frames)
    assert kernel.checked_decode_run(np.frombuffer(coded, np.uint8), out2) == linked.OK
    assert np.array_equal(out2, frames)


@pytest.mark.parametrize("dtype", [np.uint8, np.int16, np.float32])
def test_any_dtype_round_trips(dtype):
    rng = np.random.default_rng(1)
    frames = (rng.normal(size=(8, 5, 7)) * 100).astype(dtype)
    frames[1:] = frames[:1] + frames[1:] // 50  # close to the first, as consecutive frames are
    out = np.zeros_like(frames)
    delta_lz4.decode_run(delta_lz4.encode_run(frames), out)
    assert np.array_equal(out.view(np.uint8), frames.view(np.uint8))


def test_frames_are_coded_against_an_earlier_frame_and_smaller_than_alone():
    frames = moving_frames(32)
    coded = delta_lz4.encode_run(frames)
    refs = np.frombuffer(coded, np.uint8, count=32, offset=delta_lz4.HEADER.size)
    assert refs[0] == 0 and (refs[1:] > 0).all()
    alone = sum(len(delta_lz4.lz4.compress_hc_block(f.reshape(-1), 9)) for f in frames)
    assert len(coded) < alone / 2


@pytest.mark.parametrize("upto", [1, 5, 31, 32])
def test_compiled_decode_up_to_a_frame_writes_exactly_those_frames(upto):
    frames = moving_frames(32, seed=2)
    coded = np.frombuffer(delta_lz4.encode_run(frames), np.uint8)
    out = np.full_like(frames, 7)
    assert kernel.checked_decode_run(coded, out, upto) == linked.OK
    assert np.array_equal(out[:upto], frames[:upto])
    assert (out[upto:] == 7).all()


def _hostile_variants(coded: bytes):
    """(what, bytes): headers that lie, references out of the run, blocks cut or swapped."""
    n = struct.unpack_from("<I", coded, 4)[0]
    head = delta_lz4.HEADER.size + n
    yield "magic", b"XXXX" + coded[4:]
    yield "more frames", coded[:4] + struct.pack("<I", n + 1) + coded[8:]
    yield "fewer frames", coded[:4] + struct.pack("<I", n - 1) + coded[8:]
    yield "frame bytes", coded[:8] + struct.pack("<I", 12287) + coded[12:]
    bad_ref = bytearray(coded)
    bad_ref[delta_lz4.HEADER.size + 3] = 4  # frame 3 refers 4 back: before the run
    yield "reference before the run", bytes(bad_ref)
    yield "truncated block", coded[:len(coded) - 5]
    yield "header only", coded[:head]
    yield "too short", coded[:7]
    small = delta_lz4.encode_run(moving_frames(n)[:, :, :60])
    yield "block of another size", coded[:head] + small[head:]
    flipped = bytearray(coded)
    flipped[head] ^= 0xF0  # the block's first token: literal and match lengths that no longer fit
    yield "corrupt block token", bytes(flipped)


PREFIX_WELL_FORMED = {"truncated block", "block of another size"}  # their first frames decode as a block's would


def test_malformed_runs_are_refused_by_the_python_path():
    coded = delta_lz4.encode_run(moving_frames(8))
    for what, data in _hostile_variants(coded):
        out = np.zeros((8, *SHAPE), np.uint8)
        with pytest.raises(ValueError):
            delta_lz4.decode_run(data, out)
            pytest.fail(f"{what}: accepted")


@pytest.mark.skipif(not native.AVAILABLE, reason="compiled codec symbols not available")
def test_malformed_runs_are_refused_by_the_compiled_paths():
    frames = moving_frames(8)
    coded = delta_lz4.encode_run(frames)
    for what, data in [("intact", coded)] + list(_hostile_variants(coded)):
        chunk = sealed(data)
        out = np.zeros_like(frames)
        status = np.zeros(1, np.int8)
        bad = chunk_decode.decode_chunks(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                         np.array([out.ctypes.data]), np.zeros(1, np.int64), out.nbytes,
                                         CODEC_DELTA_LZ4, status)
        # the frames of a batch: frames 2 and 5 of the run, up to frame 5 decoded
        dst = np.zeros((2, *SHAPE), np.uint8)
        fstatus = np.zeros(1, np.int8)
        fbad = native.checked_decode_frame_groups(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                                  np.array([0, 2]), np.array([2, 5]),
                                                  dst.ctypes.data + np.array([0, dst[0].nbytes]), dst[0].nbytes, 8,
                                                  fstatus, (dst,))
        # frames 0..2 to consecutive places (a sequence through the run's start): decoded there, no scratch
        seq = np.zeros((3, *SHAPE), np.uint8)
        sstatus = np.zeros(1, np.int8)
        sbad = native.checked_decode_frame_groups(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                                  np.array([0, 3]), np.array([0, 1, 2]),
                                                  seq.ctypes.data + np.arange(3) * seq[0].nbytes, seq[0].nbytes, 8,
                                                  sstatus, (seq,))
        if what == "intact":
            assert bad == 0 and np.array_equal(out, frames)
            assert fbad == 0 and np.array_equal(dst, frames[[2, 5]])
            assert sbad == 0 and np.array_equal(seq, frames[:3])
        elif what in PREFIX_WELL_FORMED:
            # LZ4 decodes a block front to back: a run decoded up to frame 5 checks the block that far. A block
            # damaged only after it (its checksum, resealed here, refuses such a run read from a file) is refused
            # where the whole run is decoded; the cut one still yields the right frames up to where it was cut
            assert bad == 1 and status[0] != native.OK, what
            if what == "truncated block":
                assert fbad == 0 and np.array_equal(dst, frames[[2, 5]])
                assert sbad == 0 and np.array_equal(seq, frames[:3])
        else:
            assert bad == 1 and status[0] != native.OK, what
            assert fbad == 1 and fstatus[0] != native.OK, what
            assert sbad == 1 and sstatus[0] != native.OK, what


def test_a_run_whose_checksum_does_not_match_is_refused_before_decoding():
    frames = moving_frames(8)
    chunk = sealed(delta_lz4.encode_run(frames))
    chunk[20] ^= 1
    out = np.zeros_like(frames)
    status = np.zeros(1, np.int8)
    assert chunk_decode.decode_chunks(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                      np.array([out.ctypes.data]), np.zeros(1, np.int64), out.nbytes,
                                      CODEC_DELTA_LZ4, status) == 1
    assert status[0] == linked.BAD_CHECKSUM and not out.any()


def test_codec_spec_is_validated():
    validate_codec({"name": "delta-lz4", "level": 9, "run": 32, "search": 8})
    for bad, match in (({"run": 24}, "power of two"), ({"run": 256}, "run must be"), ({"level": 0}, "level"),
                       ({"search": -1}, "search"), ({"layout": 3}, "unknown keys"), ({"level": True}, "level")):
        with pytest.raises(ValueError, match=match):
            validate_codec({"name": "delta-lz4", **bad})


def test_run_headers_are_checked_by_the_shared_rules_of_both_run_codecs():
    """``run_spec.parse_run_header`` reads a temporal layout-1 header as ``temporal_format.parse_header`` does, and
    refuses what either codec's own parse refuses, naming the codec."""
    from mmreplay._native import temporal_header
    from mmreplay.codecs import run_spec, temporal, temporal_format
    frames = moving_frames(6)
    coded = temporal.encode_run(frames, search=2)
    mine = run_spec.parse_run_header(coded, frames.nbytes, temporal_header.HEADER, temporal_header.MAGIC,
                                     temporal_header.MAX_RUN, "temporal")
    theirs = temporal_format.parse_header(coded, frames.nbytes)
    assert mine[:2] == theirs[:2] and np.array_equal(mine[2], theirs[2]) and mine[2].any()
    lz4_run = delta_lz4.encode_run(frames)
    with pytest.raises(ValueError, match="delta-lz4 chunk starts with b'MRT1', expected b'MRL1'"):
        delta_lz4.parse_header(coded, frames.nbytes)
    with pytest.raises(ValueError, match="delta-lz4 chunk announces 6 frames of 12288 bytes, expected 12288"):
        delta_lz4.parse_header(lz4_run, 12288)
    bad_ref = bytearray(lz4_run)
    bad_ref[delta_lz4.HEADER.size + 2] = 3
    with pytest.raises(ValueError, match="frame 2 refers 3 frames back"):
        delta_lz4.parse_header(bytes(bad_ref), frames.nbytes)
    with pytest.raises(ValueError, match="at most 100"):
        run_spec.parse_run_header(lz4_run, frames.nbytes, delta_lz4.HEADER, delta_lz4.MAGIC, 255, "x", 100)


def test_spec_settings_are_checked_by_the_shared_rules():
    from mmreplay.codecs import run_spec
    run_spec.check_settings("c", {"name": "c", "run": 16}, [("run", 16, 1, 64)], known=("run",))
    for spec, checks, match in (({"run": 12}, [("run", 12, 1, 64)], "run must be a power of two .* got 12"),
                                ({"lvl": 1}, [], r"unknown keys \['lvl'\] \(expected run\)"),
                                ({"run": 2.0}, [("run", 2.0, 1, 64)], "run must be an integer in 1..64, got 2.0")):
        with pytest.raises(ValueError, match=match):
            run_spec.check_settings("c", {"name": "c", **spec}, checks, known=("run",))


# -- a store of colour frames sampled as sequences ---------------------------------------------------------
def record(path, episodes, *, streams=1, **create_kw):
    """Episodes of ``moving_frames`` (lengths ``episodes``; the ``i``-th ends terminated when ``i % 3 == 2``,
    else truncated), the streams' steps interleaved; returns per global id its (obs, action, reward, next_obs,
    terminated, truncated, is_first, stream)."""
    rows, queues = [], [[] for _ in range(streams)]
    for e, length in enumerate(episodes):
        frames = moving_frames(length + 1, seed=e)
        for t in range(length):
            last = t == length - 1
            queues[e % streams].append((frames[t], np.full(2, e + t / 1000, np.float32), float(t % 5), frames[t + 1],
                                        last and e % 3 == 2, last and e % 3 != 2, t == 0, e % streams))
    while any(queues):
        for q in queues:
            if q:
                rows.append(q.pop(0))
    store = mmreplay.Store.create(path, spaces.Box(0, 255, SHAPE, np.uint8), spaces.Box(-1, 1e3, (2,), np.float32),
                                  capacity=len(rows) + 64, durable=False, **create_kw)
    for o, a, r, no, te, tr, _, sid in rows:
        store.add(o, a, r, no, te, tr, stream=sid)
    store.close()
    return rows


def check_batch(b, rows) -> int:
    """Every real step of every window against ``rows``; the window's steps consecutive steps of one stream and
    episode; ``is_first`` where an episode starts. Returns the steps checked."""
    ids, mask = b.indices.numpy(), b.mask.numpy()
    checked = 0
    for i in range(ids.shape[0]):
        real = ids[i][mask[i]]
        for j, g in enumerate(real):
            o, a, r, _, te, tr, first, sid = rows[g]
            assert np.array_equal(b.obs[i, j].numpy(), o), f"obs of step {g}"
            assert np.array_equal(b.action[i, j].numpy(), a) and float(b.reward[i, j]) == r
            assert bool(b.terminated[i, j]) == te and bool(b.truncated[i, j]) == tr
            assert bool(b.is_first[i, j]) == first, f"is_first of step {g}"
            if j:
                assert rows[real[j - 1]][7] == sid and not first and np.array_equal(rows[real[j - 1]][3], o)
            checked += 1
        assert np.array_equal(b.next_obs[i].numpy(), rows[real[-1]][3])
        assert not b.is_first.numpy()[i][~mask[i]].any()
    return checked


@pytest.mark.parametrize("streams", [1, 2])
@pytest.mark.parametrize("cache_bytes", [4 << 20, 256 << 20], ids=["runs-into-batch", "decoded-cache"])
def test_sequences_of_a_delta_lz4_store_equal_what_was_added(store_path, streams, cache_bytes):
    rows = record(store_path, [150, 90, 200, 40, 130], streams=streams, frame_codec="delta-lz4")
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=cache_bytes) as s:
        assert s.schema.observations[0].codec["name"] == "delta-lz4"
        checked = 0
        for seq, strict in ((64, True), (16, False)):
            with s.sampler(16, mmreplay.Sequences(seq, strict=strict), seed=seq) as smp:
                for _ in range(6):
                    checked += check_batch(next(smp), rows)
        stats = s.inspect.cache_stats()["obs"]
        if native.AVAILABLE:
            direct = cache_bytes == 4 << 20
            assert stats["compressed"]["compiled"] and stats["compressed"]["direct"] == direct
            if direct:  # each run decoded once straight into the batches: the 4 MB decoded cache never churned
                assert stats["evictions"] == 0 and stats["compressed"]["hits"] > 0
    assert checked > 6 * 16 * (64 + 8)


def test_is_first_marks_the_steps_dreamer_resets_at(store_path):
    rows = record(store_path, [70, 70, 70], frame_codec="delta-lz4")
    with mmreplay.Store.open(store_path, mode="r") as s, s.sampler(64, mmreplay.Sequences(8), seed=3) as smp:
        b = next(smp)
    first = b.is_first.numpy()
    assert first.shape == (64, 8) and first[:, 1:].sum() == 0  # a strict window lies in one episode
    starts = b.indices.numpy()[:, 0]
    assert np.array_equal(first[:, 0], np.array([rows[g][6] for g in starts]))
    assert first[:, 0].any() and not first[:, 0].all()
    check_batch(b, rows)


def test_a_corrupt_run_on_disk_is_an_error_naming_the_chunk(store_path):
    rows = record(store_path, [100], frame_codec="delta-lz4")
    shard = os.path.join(store_path, "frames", "obs", "c", "0", "0", "0", "0")
    with open(shard, "rb") as f:
        raw = bytearray(f.read())
    raw[60] ^= 0xFF  # inside the first run's LZ4 block; its crc32c no longer matches
    with open(shard, "wb") as f:
        f.write(bytes(raw))
    with mmreplay.Store.open(store_path, mode="r") as s:
        problems = s.verify()
        assert problems and "chunk 0" in problems[0]
        with pytest.raises(CorruptDataError, match="chunk 0"):
            s.inspect.get([1])
        assert np.array_equal(s.inspect.get([50]).obs.numpy()[0], rows[50][0])  # the other runs stay readable
