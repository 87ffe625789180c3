"""Hostile chunk bytes (issue 23, case 3): payloads whose checksum was recomputed after they were cut or
edited, and shard indexes whose entries wrap around 2**64. Every read is the original bytes or a
``CorruptDataError``; never other rows, never a crash."""

import os
import sys

import numpy as np
import pytest
from numcodecs import blosc

import mmreplay
import synthetic as syn
from conftest import frame_shard_file
from mmreplay.storage.format.codecs import Compressor
from mmreplay.storage.format.shardfile import CRC_BYTES, EMPTY, crc32c, decode_chunk, encode_chunk, index_nbytes
from test_shard_identity import forget_shard_identities

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "checks"))
import fuzz_chunks  # noqa: E402

LZ4HC = {"name": "blosc", "cname": "lz4hc", "clevel": 3}


def atari_frame() -> np.ndarray:
    return fuzz_chunks.np.load(os.path.join(os.path.dirname(mmreplay.__file__), "data", "atari_fixture.npz"))[
        "frames"][100:101]


def truncated_claiming_full_size(chunk: bytes) -> bytes:
    """The chunk cut short, its blosc header untouched (it still claims the full size), crc recomputed."""
    body = chunk[:-CRC_BYTES]
    short = body[:len(body) * 2 // 3]
    return short + crc32c(short)



def rows_true_or_refused(store, damaged: str) -> int:
    """Read every valid transition alone: each is its true row, or a ``CorruptDataError`` naming
    ``damaged``; returns how many were refused."""
    oldest, head = store.inspect.valid_range()
    refused = 0
    for g in range(oldest, head):
        if syn.needs(g) < oldest:
            continue
        try:
            batch = store.inspect.get([g])
        except mmreplay.CorruptDataError as exc:
            assert damaged in str(exc)
            refused += 1
            continue
        assert syn.wrong_rows(batch) == [], g
    return refused

def test_a_truncated_blosc_chunk_whose_header_claims_the_full_size_is_refused():
    frame = atari_frame()
    comp = Compressor(LZ4HC, np.uint8)
    raw = truncated_claiming_full_size(encode_chunk(comp, frame))
    out = np.zeros_like(frame)
    with pytest.raises(mmreplay.CorruptDataError, match=r"fuzz: chunk does not decode .*header says the payload"):
        decode_chunk(comp, raw, out, lambda: "fuzz")


@pytest.mark.parametrize("edit", ["version", "flags", "typesize", "blocksize", "bstart"])
def test_blosc_header_fields_are_checked_before_decoding(edit):
    frame = atari_frame()
    comp = Compressor(LZ4HC, np.uint8)
    body = bytearray(encode_chunk(comp, frame)[:-CRC_BYTES])
    if edit == "version":
        body[0] = 9
    elif edit == "flags":
        body[2] |= 0x08
    elif edit == "typesize":
        body[3] = 4
    elif edit == "blocksize":
        body[8:12] = (10**6).to_bytes(4, "little")
    else:
        body[16:20] = (len(body) + 100).to_bytes(4, "little")
    with pytest.raises(mmreplay.CorruptDataError, match="blosc header"):
        decode_chunk(comp, bytes(body) + crc32c(bytes(body)), np.zeros_like(frame), lambda: "chunk")


def test_a_zstd_frame_declaring_another_content_size_is_refused():
    frame = atari_frame()
    comp = Compressor({"name": "zstd", "level": 1}, np.uint8)
    body = bytearray(encode_chunk(comp, frame)[:-CRC_BYTES])
    other = Compressor({"name": "zstd", "level": 1}, np.uint8).encode(np.zeros(10**6, np.uint8))
    with pytest.raises(mmreplay.CorruptDataError, match="zstd frame declares 1000000 bytes"):
        decode_chunk(comp, bytes(other) + crc32c(bytes(other)), np.zeros_like(frame), lambda: "chunk")
    body[4] = 0  # no content size declared
    with pytest.raises(mmreplay.CorruptDataError):
        decode_chunk(comp, bytes(body) + crc32c(bytes(body)), np.zeros_like(frame), lambda: "chunk")


def rewrite_chunk(path: str, n_chunks: int, inner: int, new_chunk: bytes) -> None:
    """Replace chunk ``inner`` of a shard file, moving later chunks and fixing the index and its crc (a
    hostile edit: every checksum is right)."""
    raw = open(path, "rb").read()
    index = np.frombuffer(raw[-index_nbytes(n_chunks):-CRC_BYTES], dtype="<u8").reshape(n_chunks, 2).copy()
    offset, nbytes = (int(v) for v in index[inner])
    data = raw[:offset] + new_chunk + raw[offset + nbytes:len(raw) - index_nbytes(n_chunks)]
    index[inner, 1] = len(new_chunk)
    later = (index[:, 0] != EMPTY) & (index[:, 0] > offset)
    index[later, 0] = (index[later, 0].astype(np.int64) + len(new_chunk) - nbytes).astype(np.uint64)
    index_bytes = index.astype("<u8").tobytes()
    open(path, "wb").write(data + index_bytes + crc32c(index_bytes))


def test_a_truncated_chunk_in_a_store_is_reported_by_verify_and_never_read_as_rows(synthetic_store):
    s = synthetic_store(n=150)
    n = s.geometry.frames.shard_rows
    victim = frame_shard_file(s, 1)
    path = s.path
    s.close()
    raw = open(victim, "rb").read()
    index = np.frombuffer(raw[-index_nbytes(n):-CRC_BYTES], dtype="<u8").reshape(n, 2)
    offset, nbytes = (int(v) for v in index[5])
    rewrite_chunk(victim, n, 5, truncated_claiming_full_size(raw[offset:offset + nbytes]))
    forget_shard_identities(path)  # a store written before identities: the format checks are all there is
    with mmreplay.Store.open(path, mode="r", cache_bytes=1 << 12) as s:
        problems = s.verify()
        assert len(problems) == 1 and "shard 1, chunk 5" in problems[0], problems
        rows_true_or_refused(s, "shard 1, chunk 5")


@pytest.mark.parametrize("entry", [(2**64 - 2**30, 2**30 + 64), (64, 2**64 - 32), (2**64 - 1, 10)])
def test_index_entries_that_wrap_around_2_64_are_refused_on_both_paths(synthetic_store, entry):
    s = synthetic_store(n=150)
    n = s.geometry.frames.shard_rows
    victim = frame_shard_file(s, 1)
    path = s.path
    s.close()
    raw = open(victim, "rb").read()
    index = np.frombuffer(raw[-index_nbytes(n):-CRC_BYTES], dtype="<u8").reshape(n, 2).copy()
    index[3] = entry
    index_bytes = index.tobytes()
    open(victim, "wb").write(raw[:-index_nbytes(n)] + index_bytes + crc32c(index_bytes))
    forget_shard_identities(path)
    # the compressed tier (compiled decodes) holds the store; a tiny budget sends reads to the file path
    for cache_bytes in (1 << 26, 1 << 12):
        with mmreplay.Store.open(path, mode="r", cache_bytes=cache_bytes) as s:
            problems = s.verify()
            assert len(problems) == 1 and "'frames/obs', shard 1" in problems[0], problems
            assert rows_true_or_refused(s, "shard 1")


def test_bounded_fuzz_of_both_read_paths():
    """A few thousand mutated chunks and shard files through both paths, each batch in a child process (a
    crash fails the test): original bytes or CorruptDataError, never other rows. The full run is
    ``python scripts/checks/fuzz_chunks.py``."""
    report = fuzz_chunks.fuzz(chunks=2500, shards=40, seed=7, batch=2500, quiet=True)
    assert not fuzz_chunks.failed(report), report
    for level, n in (("codec", 2500), ("store", 40)):
        for path in ("file", "compiled"):
            counts = report[f"{level}/{path}"]
            assert counts["cases"] == n, counts
    assert report["codec/file"]["refused"] > 2000 and report["store/compiled"]["wrong"] == 0
