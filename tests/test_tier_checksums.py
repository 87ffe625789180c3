"""A chunk's crc32c is checked once, where its bytes come into the process (issue 38): the compressed tier checks
every chunk of a shard as it installs it (``reading/resident.py``) and its decodes are then told the bytes are
``verified``; a chunk that fails there is not held, and the files path reports it as ``CorruptDataError``
naming it. Other callers of the kernels (file reads, partial reads) still check every decode."""

import os
import struct

import google_crc32c
import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import wait_preloaded
from mmreplay._native import chunk_decode, decode as native, linked, run_decode
from mmreplay._native.codec_kinds import CODEC_TEMPORAL
from mmreplay.codecs import temporal
from mmreplay.errors import CorruptDataError
from mmreplay.storage.format.shardfile import EMPTY, index_nbytes, parse_index
from reference import ReferenceReplay, assert_batch_matches

pytestmark = pytest.mark.skipif(not linked.AVAILABLE, reason="this numcodecs/google-crc32c build exports no C symbols")

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")
LAYOUT2 = {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 2}
RUN = 8
ROWS = 200  # under the capacity: frame row r is ring row r, in chunk r // RUN


@pytest.fixture(scope="module")
def atari_frames():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return data["frames"]


def _with_crc(coded: bytes) -> np.ndarray:
    return np.frombuffer(coded + struct.pack("<I", google_crc32c.value(coded)), dtype=np.uint8).copy()


# -- the kernels ------------------------------------------------------------------------------------------
def test_a_wrong_checksum_decodes_only_when_the_caller_says_the_bytes_were_verified(atari_frames):
    """The trusted path skips the crc (a chunk whose trailing crc is wrong decodes to its frames), the checked
    path refuses the same bytes; ``verify_chunks`` is the check that makes bytes ``verified``."""
    run = atari_frames[:RUN]
    chunk = _with_crc(temporal.encode(run, 3, RUN, 2))
    chunk[-1] ^= 0x01  # the payload intact, its crc wrong
    src, sizes = np.array([chunk.ctypes.data], np.int64), np.array([chunk.size], np.int64)
    assert native.checked_verify_chunks(chunk, np.array([0]), sizes).tolist() == [False]
    chunk[-1] ^= 0x01
    assert native.checked_verify_chunks(chunk, np.array([0]), sizes).tolist() == [True]
    chunk[-1] ^= 0x01

    frames_of = np.array([1, 5, 6], np.int64)
    for verified, expected in ((False, linked.BAD_CHECKSUM), (True, linked.OK)):
        out = np.zeros((3, 84, 84), np.uint8)
        dsts = out.ctypes.data + np.arange(3, dtype=np.int64) * out[0].nbytes
        status = np.zeros(1, np.int8)
        bad = native.checked_decode_frame_groups(src, sizes, np.array([0, 3], np.int64), frames_of, dsts, 84 * 84,
                                                 RUN, status, (out,), verified=verified)
        assert (bad, int(status[0])) == (int(expected != linked.OK), expected)
        if verified:
            np.testing.assert_array_equal(out, run[frames_of])
        else:
            assert not out.any()  # nothing written before the checksum matched

        whole = np.zeros((RUN, 84, 84), np.uint8)
        status = np.zeros(1, np.int8)
        bad = native.checked_decode_chunks(src, sizes, np.array([whole.ctypes.data], np.int64), np.zeros(1, np.int64),
                                           whole.nbytes, CODEC_TEMPORAL, status, (whole,), verified=verified)
        assert int(status[0]) == expected
        assert (whole == run).all() if verified else not whole.any()
    # the kernels' default, which the codec helpers and every other caller get, is to check
    status = np.zeros(1, np.int8)
    assert run_decode.decode_frame_groups(src, sizes, np.array([0, 3], np.int64), frames_of, dsts, 84 * 84, RUN,
                                          status) == 1
    assert chunk_decode.decode_chunks(src, sizes, np.array([whole.ctypes.data], np.int64), np.zeros(1, np.int64),
                                      whole.nbytes, CODEC_TEMPORAL, status) == 1


def test_verify_chunks_refuses_chunks_outside_its_buffer():
    buf = np.zeros(64, np.uint8)
    with pytest.raises(ValueError, match="outside the 64-byte buffer"):
        native.checked_verify_chunks(buf, np.array([60]), np.array([8]))
    with pytest.raises(ValueError, match="outside"):
        native.checked_verify_chunks(buf, np.array([-1]), np.array([4]))
    # too short to hold a checksum: not sound (never an out-of-bounds read)
    assert native.checked_verify_chunks(buf, np.array([0, 10]), np.array([3, 0])).tolist() == [False, False]


# -- the tier ---------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def recorded(tmp_path_factory, atari_frames):
    """A layout-2 store of ``ROWS`` transitions (episodes of 25 steps) and its reference."""
    path = str(tmp_path_factory.mktemp("tiercrc") / "store.mmr")
    ref = ReferenceReplay(3, 256)
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=256,
                               frame_stack=3, reward_values=(-1, 0, 1), frame_codec=LAYOUT2, durable=False) as s:
        frame = 0
        for t in range(ROWS):
            if t % 25 == 0:
                frame += 1
            obs, nxt = atari_frames[frame % len(atari_frames)], atari_frames[(frame + 1) % len(atari_frames)]
            frame += 1
            row = (obs, t % 6, float(t % 3 - 1), nxt, t % 25 == 24, False)
            s.add(*row)
            ref.add(0, *row)
    return path, ref


def _column(store):
    return store._state.reader.columns["obs"]


def _budget(path: str, direct: bool) -> int:
    """A budget that holds the whole store in the compressed tier, with a decoded cache the tier's decodes fill
    (``decode_into_slots``), or without one: frames decoded straight into batches (``decode_runs``)."""
    root = os.path.join(path, "frames", "obs")
    files = sum(os.path.getsize(os.path.join(d, f)) for d, _, names in os.walk(root) for f in names)
    return 4 * files if direct else 1 << 30


def _chunk_span(path: str, per: int, inner: int) -> tuple[int, int]:
    """Offset and size of chunk ``inner`` in the shard file at ``path`` (its index)."""
    with open(path, "rb") as f:
        raw = f.read()
    index = parse_index(raw[-index_nbytes(per):], per, path)
    assert index[inner, 0] != EMPTY
    return int(index[inner, 0]), int(index[inner, 1])


def _every_transition(store, ref):
    """Each valid transition alone: ``(id, None)`` if it equals the reference, ``(id, error)`` if it raised."""
    out = []
    for i in ref.valid_ids(store.inspect.valid_range()[0]):
        try:
            batch = store.inspect.get([i])
        except CorruptDataError as exc:
            out.append((i, str(exc)))
            continue
        assert_batch_matches(batch, ref, [i])
        out.append((i, None))
    return out


@pytest.mark.parametrize("direct", [True, False], ids=["into-batches", "into-decoded-cache"])
def test_a_chunk_damaged_in_its_file_is_not_held_and_reads_as_an_error_naming_it(tmp_path, recorded, direct):
    import shutil

    src, ref = recorded
    path = str(tmp_path / "copy.mmr")
    shutil.copytree(src, path)
    with mmreplay.Store.open(path, mode="r") as s:
        array = _column(s).column.array
        per = array.layout.chunks_per_shard
    shard, inner = 0, 2
    shard_file = array.layout.shard_file(path, shard)
    offset, size = _chunk_span(shard_file, per, inner)
    with open(shard_file, "r+b") as f:  # one byte of the run's payload (its header and crc intact)
        f.seek(offset + size // 2)
        byte = f.read(1)
        f.seek(offset + size // 2)
        f.write(bytes([byte[0] ^ 0x5A]))

    with mmreplay.Store.open(path, mode="r", cache_bytes=_budget(path, direct)) as s:
        wait_preloaded(s)
        res = _column(s).resident
        assert _column(s).direct == direct
        assert shard in res.buffers  # the shard is held ...
        lo = shard * per
        addr = res.chunk_addr[lo:lo + per]
        assert addr[inner] == 0 and res.chunk_size[lo + inner] == 0  # ... but not its damaged chunk
        assert (np.delete(addr, inner) != 0).all()  # the others held (or marked empty)
        assert res.bad_chunks == 1
        loads = res.loads
        outcome = _every_transition(s, ref)
        failed = [(i, msg) for i, msg in outcome if msg is not None]
        assert failed, "no transition read the damaged chunk"
        for _, msg in failed:
            assert f"shard {shard}, chunk {inner}" in msg and "checksum mismatch" in msg, msg
        # only transitions with a frame in the chunk's 8 rows (stack 3, next obs: at most 8 + 3 of them)
        assert len(failed) <= RUN + 3 and len(outcome) - len(failed) > 150  # every other one equals the truth
        assert res.loads == loads  # the held shard is not read again for its damaged chunk
        assert s.inspect.cache_stats()["obs"]["compressed"]["hits"] > 0


@pytest.mark.parametrize("helpers", ["0", "1"], ids=["alone", "with-a-helper"])
@pytest.mark.parametrize("direct", [True, False], ids=["into-batches", "into-decoded-cache"])
def test_tier_decodes_do_not_check_held_chunks_again(recorded, monkeypatch, direct, helpers):
    """A held chunk's trailing crc made wrong in the tier's copy after it was checked at install: the tier's
    decodes (one compiled call, or shared with a codec helper) still read its frames, as the decoded cache's
    frames are trusted; the checked path refuses the same bytes."""
    path, ref = recorded
    monkeypatch.setenv("MMREPLAY_CODEC_THREADS", helpers)
    with mmreplay.Store.open(path, mode="r", cache_bytes=_budget(path, direct)) as s:
        wait_preloaded(s)
        col = _column(s)
        assert col.direct == direct
        res = col.resident
        chunk = 5
        assert res.chunk_addr[chunk] > 0 and res.bad_chunks == 0
        with res.reading():
            addr, size = int(res.chunk_addr[chunk]), int(res.chunk_size[chunk])
            shard = chunk // res.per_shard
            buf = res.buffers[shard]
            at = addr - buf.ctypes.data + size - 1
            buf[at] ^= 0x01  # the last byte of its checksum
        # with a helper: runs enough to share the call (``SHARED_MIN_RUNS``), the damaged one among them
        ids = list(range(chunk * RUN + 2, (chunk + (1 if helpers == "0" else 6)) * RUN - 1))
        before = col.tier.hits
        batch = s.inspect.get(ids)
        assert_batch_matches(batch, ref, ids)
        assert col.tier.hits > before  # decoded from the tier's (now mis-summed) bytes
        with res.reading():
            out = np.zeros((RUN, 84, 84), np.uint8)
            dsts = out.ctypes.data + np.arange(RUN, dtype=np.int64) * out[0].nbytes
            status = np.zeros(1, np.int8)
            bad = native.checked_decode_frame_groups(np.array([addr], np.int64), np.array([size], np.int64),
                                                     np.array([0, RUN], np.int64), np.arange(RUN, dtype=np.int64),
                                                     dsts, 84 * 84, RUN, status, (out,))
            assert bad == 1 and status[0] == linked.BAD_CHECKSUM
            buf[at] ^= 0x01


def test_the_writers_own_bytes_are_checked_as_the_tier_installs_them(tmp_path, atari_frames):
    """``install`` (the bytes the writer just wrote): a chunk whose crc does not match is not held."""
    from mmreplay.reading.resident import ResidentShards
    from mmreplay.storage.format.layout import ArrayLayout
    from mmreplay.storage.format.shardfile import build_shard

    lay = ArrayLayout("frames/obs", 64, (84, 84), "uint8", RUN, 32, LAYOUT2)
    per = lay.chunks_per_shard
    chunks = [_with_crc(temporal.encode(atari_frames[i * RUN:(i + 1) * RUN], 3, RUN, 2)).tobytes()
              for i in range(per)]
    raw = bytearray(build_shard(chunks))
    bad_at = sum(len(c) for c in chunks[:1]) + len(chunks[1]) // 2  # inside chunk 1
    raw[bad_at] ^= 0x5A
    res = ResidentShards(str(tmp_path), lay, 64 // RUN)
    assert res.install(0, bytes(raw))
    assert res.chunk_addr[1] == 0 and (np.delete(res.chunk_addr[:per], 1) > 0).all() and res.bad_chunks == 1
