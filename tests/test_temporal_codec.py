"""The temporal frame codec (``frame_codec="delta-zstd"``, ``codecs/temporal.py``): runs of frames coded
against each other. Round trips, refusal of malformed chunks on both read paths, runs that hold episode
starts, ring wraps and interleaved streams, plain zarr reading the arrays, and readers racing a writer."""

import os
import struct

import google_crc32c
import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
import synthetic as syn
from mmreplay.errors import CorruptDataError
from mmreplay._native import chunk_decode, decode as native, run_decode
from mmreplay._native.codec_kinds import CODEC_TEMPORAL
from mmreplay.codecs import temporal
from mmreplay.storage.format.codecs import validate_codec
from reference import ReferenceReplay, assert_batch_matches
from torture import reader_race

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")


@pytest.fixture(scope="module")
def atari_frames():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return data["frames"]


# -- the codec alone --------------------------------------------------------------------------------
@pytest.mark.parametrize("run", [1, 2, 8, 32])
def test_real_frames_round_trip_bit_exact(atari_frames, run):
    for lo in range(0, len(atari_frames) - run + 1, run):
        chunk = atari_frames[lo:lo + run]
        out = np.empty_like(chunk)
        temporal.decode_run(temporal.encode_run(chunk), out)
        assert np.array_equal(out, chunk)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "int32", "float32"])
def test_any_dtype_round_trips(dtype):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 200, (8, 3, 7, 5)).astype(dtype)
    base[1::2] = base[::2]  # repeated frames: deltas of zero
    out = np.empty_like(base)
    temporal.decode_run(temporal.encode_run(base, search=3), out)
    assert out.tobytes() == base.tobytes()


def drifting_frames(n, seed, shape=(3, 24, 20)):
    """Rendered-looking frames: a smooth image whose pixel values drift a little each step (lighting,
    camera), where per-frame coding finds few repeats but differences are small."""
    rng = np.random.default_rng(seed)
    base = rng.integers(0, 256, shape).astype(np.int64)
    return np.stack([(base + t * 3) % 256 for t in range(n)]).astype(np.uint8)


def test_interleaved_streams_are_coded_against_their_own_stream():
    """Two envs' frames alternating (a vector env's ring): the search finds each frame's own predecessor."""
    a, b = drifting_frames(8, 1), drifting_frames(8, 2)
    run = np.stack([x for pair in zip(a, b) for x in pair])
    coded = temporal.encode_run(run, search=2)
    _, _, refs = temporal.parse_header(coded, run.nbytes)
    assert refs[2:].tolist() == [2] * 14  # always its own stream's previous frame
    assert len(coded) * 4 < len(temporal.encode_run(run, search=0))  # vs every frame coded alone
    out = np.empty_like(run)
    temporal.decode_run(coded, out)
    assert np.array_equal(out, run)


def test_the_smaller_coding_of_a_run_is_kept(atari_frames):
    for lo in range(0, 640, 64):
        run = atari_frames[lo:lo + 8]
        assert len(temporal.encode_run(run)) <= len(temporal.encode_run(run, search=0))
    drifting = drifting_frames(8, 3)
    assert len(temporal.encode_run(drifting)) < len(temporal.encode_run(drifting, search=0))


def test_smaller_than_per_frame_coding_on_real_frames(atari_frames):
    from mmreplay.storage.format.codecs import numcodecs_compressor
    per_frame = numcodecs_compressor({"name": "blosc", "cname": "lz4hc", "clevel": 3}, np.uint8)
    runs = [atari_frames[i:i + 8] for i in range(0, 640, 8)]
    temporal_bytes = sum(len(temporal.encode_run(r)) for r in runs)
    lz4hc_bytes = sum(len(per_frame.encode(f)) for f in atari_frames)
    assert temporal_bytes * 3 < lz4hc_bytes


def _hostile_variants(coded: bytes):
    """(what, bytes): headers that lie, references out of the run, payloads cut or swapped."""
    n = struct.unpack_from("<I", coded, 4)[0]
    body = bytearray(coded)
    yield "magic", b"XXXX" + coded[4:]
    yield "more frames", coded[:4] + struct.pack("<I", n + 1) + coded[8:]
    yield "fewer frames", coded[:4] + struct.pack("<I", n - 1) + coded[8:]
    yield "frame bytes", coded[:8] + struct.pack("<I", 7055) + coded[12:]
    bad_ref = bytearray(body)
    bad_ref[temporal.HEADER.size + 3] = 4  # frame 3 refers 4 back: before the run
    yield "reference before the run", bytes(bad_ref)
    yield "truncated payload", coded[:len(coded) - 5]
    yield "header only", coded[:temporal.header_nbytes(n)]
    yield "too short", coded[:7]
    small = temporal.encode_run(np.zeros((n, 84, 83), np.uint8))
    yield "payload of another size", coded[:temporal.header_nbytes(n)] + small[temporal.header_nbytes(n):]


def test_malformed_chunks_are_refused_by_the_python_path(atari_frames):
    coded = temporal.encode_run(atari_frames[:8])
    for what, data in _hostile_variants(coded):
        out = np.zeros((8, 84, 84), np.uint8)
        with pytest.raises(ValueError):
            temporal.decode_run(data, out)
            pytest.fail(f"{what}: accepted")


@pytest.mark.skipif(not native.AVAILABLE, reason="compiled codec symbols not available")
def test_malformed_chunks_are_refused_by_the_compiled_path(atari_frames):
    coded = temporal.encode_run(atari_frames[:8])
    cases = [("intact", coded)] + list(_hostile_variants(coded))
    for what, data in cases:
        chunk = np.frombuffer(data + struct.pack("<I", google_crc32c.value(data)), np.uint8).copy()
        out = np.zeros((8, 84, 84), np.uint8)
        status = np.zeros(1, np.int8)
        bad = chunk_decode.decode_chunks(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                         np.array([out.ctypes.data]), np.zeros(1, np.int64), out.nbytes,
                                         CODEC_TEMPORAL, status)
        if what == "intact":
            assert bad == 0 and np.array_equal(out, atari_frames[:8])
        else:
            assert bad == 1 and status[0] != native.OK, what


# -- layout 2: a zstd frame per frame, chains from the run's middle ---------------------------------------
LAYOUT2 = {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 2}


@pytest.mark.parametrize("run", [1, 2, 8, 16])
def test_layout2_real_frames_round_trip_bit_exact(atari_frames, run):
    for lo in range(0, 320 - run + 1, run):
        chunk = atari_frames[lo:lo + run]
        coded = temporal.encode_frames_run(chunk)
        assert coded[:4] == temporal.MAGIC2
        out = np.empty_like(chunk)
        temporal.decode_run(coded, out)
        assert np.array_equal(out, chunk)


@pytest.mark.parametrize("dtype", ["uint8", "uint16", "float32"])
def test_layout2_any_dtype_round_trips(dtype):
    rng = np.random.default_rng(0)
    base = rng.integers(0, 200, (8, 3, 7, 5)).astype(dtype)
    base[1::2] = base[::2]
    out = np.empty_like(base)
    temporal.decode_run(temporal.encode_frames_run(base, search=3), out)
    assert out.tobytes() == base.tobytes()


def test_layout2_chains_run_outward_from_the_middle():
    """Drifting frames: every frame is coded against its neighbour on the key's side, so frame ``i``'s chain
    is ``|i - key|`` long (a random frame decodes with at most half the run, not all of it)."""
    run = drifting_frames(16, 4)
    n, _, refs, _ = temporal.parse_header2(temporal.encode_frames_run(run), run.nbytes)
    key = temporal.key_position(n)
    assert key == 7 and refs[key] == 0
    assert refs.tolist() == [-1] * 7 + [0] + [1] * 8
    assert temporal.chain_depths(refs).tolist() == [abs(i - key) for i in range(16)]


def test_layout2_an_episode_start_inside_the_run_is_coded_alone():
    """A frame unlike every frame it may reference (another episode's) costs less coded alone: it is."""
    gradient = np.add.outer(np.arange(24), np.arange(20))[None] * np.ones((3, 1, 1), np.int64)
    a = np.stack([(gradient + t) % 256 for t in range(5)]).astype(np.uint8)  # smooth: small coded alone
    b = drifting_frames(11, 2)  # noise
    run = np.concatenate([a, b])
    _, _, refs, _ = temporal.parse_header2(temporal.encode_frames_run(run), run.nbytes)
    # frames 0..4 lie before the key (7): frame 4, a's last, may only reference b's frames
    assert refs[4] == 0 and refs[:4].tolist() == [-1] * 4 and refs[8:].tolist() == [1] * 8
    out = np.empty_like(run)
    temporal.decode_run(temporal.encode_frames_run(run), out)
    assert np.array_equal(out, run)


def _with_crc(data: bytes) -> np.ndarray:
    return np.frombuffer(data + struct.pack("<I", google_crc32c.value(data)), np.uint8).copy()


@pytest.mark.skipif(not native.AVAILABLE, reason="compiled codec symbols not available")
@pytest.mark.parametrize("layout", [1, 2, 3])
def test_compiled_partial_decode_writes_exactly_the_frames_asked_for(atari_frames, layout):
    """``decode_frame_groups``: frames of several runs, some asked for twice, each to its own address."""
    runs = [atari_frames[i:i + 16] for i in range(0, 160, 16)]
    coded = [_with_crc(temporal.encode(r, 3, 8, layout)) for r in runs]
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 160, 300)
    ids[::7] = ids[1::7][:ids[::7].size]  # duplicates
    out = np.zeros((ids.size, 84, 84), np.uint8)
    dsts = out.ctypes.data + np.arange(ids.size, dtype=np.int64) * out[0].nbytes
    chunks, starts, js, gdsts, order = run_decode.group_frame_requests(ids.astype(np.int64), dsts, 0, 16)
    assert np.array_equal(ids[order] // 16, np.repeat(chunks, np.diff(starts)))
    status = np.zeros(chunks.size, np.int8)
    bad = run_decode.decode_frame_groups(np.array([coded[c].ctypes.data for c in chunks]),
                                         np.array([coded[c].size for c in chunks]), starts, js, gdsts, 84 * 84, 16,
                                         status)
    assert bad == 0 and (status == native.OK).all()
    assert np.array_equal(out, atari_frames[ids])


def _hostile_layout2(coded: bytes):
    n = struct.unpack_from("<I", coded, 4)[0]
    h = temporal.HEADER.size
    yield "magic", b"MRT9" + coded[4:]
    yield "more frames", coded[:4] + struct.pack("<I", n + 1) + coded[8:]
    yield "frame bytes", coded[:8] + struct.pack("<I", 7055) + coded[12:]
    body = bytearray(coded)
    body[h + 6] = 7  # frame 6 refers to frame -1
    yield "reference before the run", bytes(body)
    body = bytearray(coded)
    body[h + 1] = 0xFF  # frame 1 refers to frame 2, which refers to 3 ... : ok; make 3 refer back to 1
    body[h + 3] = 2
    body[h + 2] = 0xFF
    yield "cycle", bytes(body)
    ends = np.frombuffer(coded, "<u4", n, h + n).copy()
    swapped = ends.copy()
    swapped[2], swapped[3] = ends[3], ends[2]
    yield "ends decrease", coded[:h + n] + swapped.tobytes() + coded[h + 5 * n:]
    shorter = ends.copy()
    shorter[-1] -= 1
    yield "ends short of the payload", coded[:h + n] + shorter.tobytes() + coded[h + 5 * n:]
    yield "truncated payload", coded[:len(coded) - 5]
    yield "header only", coded[:temporal.header2_nbytes(n)]
    small = temporal.encode_frames_run(np.zeros((n, 84, 83), np.uint8))
    yield "frames of another size", coded[:h] + small[h:]


def test_layout2_malformed_chunks_are_refused_by_the_python_path(atari_frames):
    coded = temporal.encode_frames_run(atari_frames[:8])
    for what, data in _hostile_layout2(coded):
        out = np.zeros((8, 84, 84), np.uint8)
        with pytest.raises(ValueError):
            temporal.decode_run(data, out)
            pytest.fail(f"{what}: accepted")


@pytest.mark.skipif(not native.AVAILABLE, reason="compiled codec symbols not available")
def test_layout2_malformed_chunks_are_refused_by_the_compiled_paths(atari_frames):
    coded = temporal.encode_frames_run(atari_frames[:8])
    for what, data in [("intact", coded)] + list(_hostile_layout2(coded)):
        chunk = _with_crc(data)
        out = np.zeros((8, 84, 84), np.uint8)
        status = np.zeros(1, np.int8)
        whole = chunk_decode.decode_chunks(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                           np.array([out.ctypes.data]), np.zeros(1, np.int64), out.nbytes,
                                           CODEC_TEMPORAL, status)
        part = np.zeros((3, 84, 84), np.uint8)
        dsts = part.ctypes.data + np.arange(3, dtype=np.int64) * part[0].nbytes
        partial = run_decode.decode_frame_groups(np.array([chunk.ctypes.data]), np.array([chunk.size]),
                                                 np.array([0, 3]), np.array([0, 6, 7]), dsts, 84 * 84, 8, status)
        if what == "intact":
            assert whole == 0 and np.array_equal(out, atari_frames[:8])
            assert partial == 0 and np.array_equal(part, atari_frames[[0, 6, 7]])
        else:
            assert whole == 1 and partial == 1 and status[0] != native.OK, what


# -- layout 3: layout 2 whose frames nearest the key are LZ4 blocks (~3x faster to decode) ---------------------
LAYOUT3 = {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 3, "lz4_depth": 1}


def _frame_parts(coded: bytes, nbytes: int) -> tuple[np.ndarray, list[bytes]]:
    n, _, refs, ends = temporal.parse_header2(coded, nbytes)
    payload = coded[temporal.header2_nbytes(n):]
    return refs, [payload[(ends[i - 1] if i else 0):ends[i]] for i in range(n)]


def _assemble(n: int, frame_nbytes: int, refs: np.ndarray, parts: list[bytes]) -> bytes:
    ends = np.cumsum([len(p) for p in parts]).astype("<u4")
    return b"".join([temporal.HEADER.pack(temporal.MAGIC2, n, frame_nbytes), refs.astype(np.int8).tobytes(),
                     ends.tobytes(), *parts])


def _is_lz4(part: bytes, frame_nbytes: int) -> bool:
    return struct.unpack_from("<I", part)[0] == frame_nbytes


@pytest.mark.parametrize("lz4_depth", [0, 1, 3, 64])
def test_layout3_codes_frames_near_the_key_as_lz4_and_round_trips(atari_frames, lz4_depth):
    """Exactly the frames within ``lz4_depth`` references of a frame coded alone are LZ4 blocks; every run
    decodes bit for bit through Python and through the compiled kernel (every frame, and a few alone)."""
    for lo in range(0, 320, 16):
        chunk = atari_frames[lo:lo + 16]
        coded = temporal.encode(chunk, 3, 8, 3, lz4_depth)
        refs, parts = _frame_parts(coded, chunk.nbytes)
        depths = temporal.chain_depths(refs)
        assert [_is_lz4(p, 84 * 84) for p in parts] == (depths <= lz4_depth).tolist()
        out = np.empty_like(chunk)
        temporal.decode_run(coded, out)
        assert np.array_equal(out, chunk)
        if native.AVAILABLE:
            sealed = _with_crc(coded)
            for js in (np.arange(16), np.array([15, 0, 9])):
                got = np.zeros((js.size, 84, 84), np.uint8)
                status = np.zeros(1, np.int8)
                bad = run_decode.decode_frame_groups(np.array([sealed.ctypes.data]), np.array([sealed.size]),
                                                     np.array([0, js.size]), js.astype(np.int64),
                                                     got.ctypes.data + np.arange(js.size, dtype=np.int64) * 7056,
                                                     84 * 84, 16, status)
                assert bad == 0 and np.array_equal(got, chunk[js])


def test_layout3_colour_and_wide_dtypes_round_trip():
    rng = np.random.default_rng(1)
    for frames in (drifting_frames(16, 4, (3, 84, 84)), rng.integers(0, 900, (8, 2, 9, 5)).astype("uint16")):
        out = np.empty_like(frames)
        temporal.decode_run(temporal.encode(frames, 3, 8, 3, 2), out)
        assert out.tobytes() == frames.tobytes()


def _hostile_lz4_frames(coded: bytes, nbytes: int):
    """A layout-3 run with its LZ4 key edited (the checksum is resealed by the caller: what a bad write or a
    hostile file would hold)."""
    refs, parts = _frame_parts(coded, nbytes)
    key = int(np.flatnonzero(refs == 0)[0])
    n, fb = len(parts), nbytes // len(parts)
    assert _is_lz4(parts[key], fb)

    def edited(part):
        return _assemble(n, fb, refs, parts[:key] + [part] + parts[key + 1:])

    block = parts[key]
    yield "size word one more", edited(struct.pack("<I", fb + 1) + block[4:])
    yield "size word one less", edited(struct.pack("<I", fb - 1) + block[4:])
    yield "block truncated", edited(block[:-3])
    yield "block cut to its size word", edited(block[:4])
    yield "block of noise", edited(block[:4] + bytes(np.random.default_rng(0).integers(0, 256, 200, np.uint8)))
    yield "block with a trailing byte", edited(block + b"\x00")
    yield "a block too short to hold a size", edited(block[:3])


def test_layout3_malformed_lz4_frames_are_refused_by_both_paths(atari_frames):
    chunk = atari_frames[:8]
    coded = temporal.encode(chunk, 3, 8, 3, 0)
    for what, data in _hostile_lz4_frames(coded, chunk.nbytes):
        with pytest.raises(ValueError):
            temporal.decode_run(data, np.zeros_like(chunk))
            pytest.fail(f"{what}: accepted by the Python path")
        if not native.AVAILABLE:
            continue
        sealed = _with_crc(data)
        out = np.zeros_like(chunk)
        status = np.zeros(1, np.int8)
        whole = chunk_decode.decode_chunks(np.array([sealed.ctypes.data]), np.array([sealed.size]),
                                           np.array([out.ctypes.data]), np.zeros(1, np.int64), out.nbytes,
                                           CODEC_TEMPORAL, status)
        assert whole == 1 and status[0] != native.OK, what


def test_codec_spec_is_validated():
    for bad in ({"name": "temporal", "run": 6}, {"name": "temporal", "run": 0}, {"name": "temporal", "level": 40},
                {"name": "temporal", "layout": 4}, {"name": "temporal", "layout": 2, "run": 128},
                {"name": "temporal", "layout": 2, "lz4_depth": 0}, {"name": "temporal", "layout": 3, "lz4_depth": -1},
                {"name": "temporal", "layout": 3, "lz4_depth": 1.5},
                {"name": "temporal", "search": -1}, {"name": "temporal", "run": 512}, {"name": "temporal", "run": 8.0}):
        with pytest.raises(ValueError, match="temporal codec"):
            validate_codec(bad)


# -- through a store --------------------------------------------------------------------------------
def _record(store, ref, fixture_frames, n, episode_len):
    """``n`` transitions of real frames in episodes of ``episode_len`` steps (starts fall inside runs)."""
    frame = 0
    for t in range(n):
        step = t % episode_len
        if step == 0:
            frame += 1  # a new episode: a fresh first frame
        obs, nxt = fixture_frames[frame % 640], fixture_frames[(frame + 1) % 640]
        frame += 1
        end = step == episode_len - 1
        row = (obs, t % 6, float(t % 3 - 1), nxt, end and t % 2 == 0, end and t % 2 == 1)
        store.add(*row)
        ref.add(0, *row)


LAYOUT1 = {"name": "temporal", "level": 3, "run": 8, "search": 8}


@pytest.mark.parametrize("codec", ["delta-zstd", LAYOUT1, LAYOUT2, LAYOUT3],
                         ids=["named", "layout1", "layout2", "layout3"])
@pytest.mark.parametrize("episode_len", [3, 5, 13])
@pytest.mark.parametrize("cache_bytes", [None, 24 << 10], ids=["default", "direct"])
def test_runs_holding_episode_starts_and_ring_wraps_read_back_exactly(store_path, atari_frames, episode_len, codec,
                                                                      cache_bytes):
    """``direct``: a budget below the compressed frames, so runs decode straight into batches (only the frames
    asked for: ``_decode_runs_into_batch``) from the compressed tier, the files and the writer's RAM."""
    if codec == "delta-zstd" and cache_bytes:
        pytest.skip("the named codec is layout 1 for gray frames: covered by layout1")
    capacity = 256  # the ring wraps three times while recording
    ref = ReferenceReplay(4, capacity)
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    session = {"cache_bytes": cache_bytes} if cache_bytes else {}
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=capacity, frame_stack=4,
                               reward_values=(-1, 0, 1), frame_codec=codec, durable=False, **session) as s:
        _record(s, ref, atari_frames, 3 * capacity + 37, episode_len)
        ids = ref.valid_ids()[-capacity // 2:]
        assert_batch_matches(s.inspect.get(ids), ref, ids)  # partly from the writer's RAM
        for _ in range(3):
            batch = s.sample(32)
            assert_batch_matches(batch, ref, batch.indices.tolist())
    with mmreplay.Store.open(store_path, mode="r", **session) as s:
        ids = [g for g in ref.valid_ids() if g >= s.inspect.valid_range()[0]]
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        assert s.verify() == []
        for _ in range(5):
            batch = s.sample(32)
            assert_batch_matches(batch, ref, batch.indices.tolist())
        assert s.inspect.cache_stats()["obs"]["compressed"]["direct"] == bool(cache_bytes)


def test_compiled_and_python_paths_give_identical_batches(store_path, atari_frames, monkeypatch):
    ref = ReferenceReplay(4, 512)
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=512, frame_stack=4,
                               reward_values=(-1, 0, 1), frame_codec="delta-zstd", durable=False) as s:
        _record(s, ref, atari_frames, 600, 7)
    ids = [g for g in ref.valid_ids() if g >= 600 - 500]
    with mmreplay.Store.open(store_path, mode="r") as s:
        compiled = s.inspect.get(ids)
    monkeypatch.setattr(native, "AVAILABLE", False)
    with mmreplay.Store.open(store_path, mode="r", cache_bytes=1 << 20) as s:  # small: decodes from the files
        python = s.inspect.get(ids)
    assert np.array_equal(compiled.obs.numpy(), python.obs.numpy())
    assert np.array_equal(compiled.next_obs.numpy(), python.next_obs.numpy())
    assert_batch_matches(python, ref, ids)


@pytest.mark.parametrize("codec", ["delta-zstd", LAYOUT3], ids=["layout1", "layout3"])
def test_plain_zarr_reads_the_frames(store_path, atari_frames, codec):
    import zarr

    space = spaces.Box(0, 255, (84, 84), np.uint8)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=512, frame_stack=4,
                               reward_values=(-1, 0, 1), frame_codec=codec) as s:
        for t in range(300):
            s.add(atari_frames[t], t % 6, 0.0, atari_frames[t + 1], False, False)
    frames = zarr.open_group(store_path, mode="r")["frames/obs"]
    assert frames.metadata.codecs[0].codecs[1].to_dict()["name"] == temporal.CODEC_NAME
    assert np.array_equal(frames[:301], atari_frames[:301])


def test_a_corrupt_run_is_an_error_naming_the_chunk(store_path, atari_frames):
    space = spaces.Box(0, 255, (84, 84), np.uint8)
    with mmreplay.Store.create(store_path, space, spaces.Discrete(6), capacity=512, frame_stack=4,
                               reward_values=(-1, 0, 1), frame_codec="delta-zstd") as s:
        for t in range(300):
            s.add(atari_frames[t], t % 6, 0.0, atari_frames[t + 1], False, False)
    shard = os.path.join(store_path, "frames", "obs", "c", "0", "0", "0")
    raw = bytearray(open(shard, "rb").read())
    raw[40] ^= 0xFF  # inside the first run's zstd payload; its crc32c no longer matches
    open(shard, "wb").write(bytes(raw))
    with mmreplay.Store.open(store_path, mode="r") as s:
        problems = s.verify()
        assert problems and "chunk 0" in problems[0]
        with pytest.raises(CorruptDataError, match="chunk 0"):
            s.inspect.get([1])
        assert np.array_equal(s.inspect.get([100]).obs.numpy()[0, -1], atari_frames[100])  # the rest stays readable


@pytest.mark.parametrize("codec", ["delta-zstd", LAYOUT2], ids=["layout1", "layout2"])
def test_readers_racing_a_writer_that_rewrites_runs(tmp_path, codec):
    """The writer commits every 1..30 adds on a 200-row ring (runs of 8 rewritten as it wraps), readers with
    a tiny cache check every row they get against the ground truth (synthetic 6x5 frames do not compress, so
    the readers decode whole runs through the decoded cache; the direct path is covered above with real frames).
    Each reader goes on until it checked 1,500 rows (counted, not timed: a loaded machine takes longer)."""
    results = reader_race(str(tmp_path / "race"), readers=2, frame_codec=codec, min_rows=1500)
    assert [r["wrong"] for r in results] == [0, 0], f"wrong rows, e.g. {[r['examples'] for r in results]}: {results}"
    assert not any(r["guard_hit"] for r in results) and all(r["rows"] >= 1500 for r in results), results


def test_synthetic_store_with_temporal_frames_checks_out(synthetic_store):
    s = synthetic_store(capacity=300, n=700, frame_codec="delta-zstd")
    for _ in range(10):
        syn.check_batch(s.sample(64))


def test_colour_frames_get_longer_runs(store_path):
    """Named "delta-zstd": runs of 8 for 84x84 gray frames, 16 (a stronger level, layout 3 with LZ4 up to
    3 references from the key) for 3x84x84 RGB."""
    rgb = spaces.Box(0, 255, (3, 84, 84), np.uint8)
    with mmreplay.Store.create(store_path, rgb, spaces.Discrete(2), capacity=256, frame_stack=3,
                               frame_codec="delta-zstd") as s:
        frames = drifting_frames(40, 5, (3, 84, 84))
        for t in range(39):
            s.add(frames[t], t % 2, 0.0, frames[t + 1], False, t == 38)
        batch = s.inspect.get(list(range(2, 39)))
        for i, g in enumerate(range(2, 39)):
            assert np.array_equal(batch.obs[i].numpy(), frames[g - 2:g + 1])
    meta = mmreplay.Store.open(store_path, mode="r")
    try:
        spec = meta.schema.observations[0]
        assert spec.chunk_rows == 16 and spec.codec["level"] == 12 and spec.codec["layout"] == 3
        assert spec.codec["lz4_depth"] == 3  # the 3 frames each side of the key are LZ4 (columns/spec.py)
    finally:
        meta.close()
