"""Misplaced, stale and damaged shard files (issue 23, cases 2 and 8): a committed shard whose file is not
the one the commit record expects is a ``CorruptDataError`` naming it, never rows; damage in the partly
filled shard stays local to its chunk. Every row read is checked against ``synthetic.py``'s ground truth."""

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmreplay
import synthetic as syn
from conftest import frame_shard_file
from mmreplay.storage.durability.commit import read_commit, write_commit
from mmreplay.storage.format.shardfile import (CRC_BYTES, ShardTag, crc32c, identity, index_nbytes, tag_nbytes,
                                       tail_nbytes)


def forget_shard_identities(path: str) -> None:
    """The commit record without shard identities, as stores written before them have."""
    record = read_commit(path)
    record.pop("shard_ids", None)
    write_commit(path, record)


def read_every_transition(store) -> tuple[int, list[str]]:
    """Each valid transition read alone: (how many are right, the errors of those that raised). A wrong row
    fails the test at once."""
    oldest, head = store.inspect.valid_range()
    right, errors = 0, []
    for g in range(oldest, head):
        if syn.needs(g) < oldest:
            continue
        try:
            batch = store.inspect.get([g])
        except mmreplay.CorruptDataError as exc:
            errors.append(str(exc))
            continue
        assert syn.wrong_rows(batch) == [], f"transition {g} read wrong"
        right += 1
    return right, errors


def frame_shards(store) -> int:
    return -(-store.inspect.num_frames // store.geometry.frames.shard_rows)


def test_a_shard_file_replaced_by_another_shard_of_the_store_is_an_error_naming_both(synthetic_store):
    s = synthetic_store(n=150)
    path = s.path
    assert frame_shards(s) >= 4
    victim = frame_shard_file(s, 2)
    shutil.copyfile(frame_shard_file(s, 1), victim)  # a valid shard file: every checksum is right
    s.close()
    for mode in ("r", "a"):
        with mmreplay.Store.open(path, mode=mode) as s:
            right, errors = read_every_transition(s)
            assert right > 50 and errors  # the rest of the store stays readable
            assert all("shard 2" in e and victim in e and "holds shard 1 of this array" in e for e in errors)
            problems = s.verify()
            assert len(problems) == 1 and "shard 2" in problems[0] and "not the shard file" in problems[0]


def test_an_older_copy_of_a_shard_is_an_error_not_zeros(synthetic_store):
    s = synthetic_store(n=20)
    s.flush()
    shard = (s.inspect.num_frames - 1) // s.geometry.frames.shard_rows  # the partly filled shard
    victim = frame_shard_file(s, shard)
    old = open(victim, "rb").read()  # a backup taken now
    for g in range(20, 150):
        s.add(*syn.transition(g))
    path = s.path
    s.close()
    open(victim, "wb").write(old)  # restored over the newer file
    with mmreplay.Store.open(path, mode="r") as s:
        right, errors = read_every_transition(s)
        assert right > 50 and errors
        assert all(f"shard {shard}" in e and "not the shard file" in e for e in errors)
    # Without identities (a store written before them), the old index's empty chunks still refuse the rows
    forget_shard_identities(path)
    with mmreplay.Store.open(path, mode="r") as s:
        right, errors = read_every_transition(s)
        assert right > 50 and errors
        assert all("marks this chunk empty" in e for e in errors)


def test_an_older_copy_of_the_partly_filled_shard_is_an_error(synthetic_store):
    s = synthetic_store(n=100)
    s.flush()
    shard, filled = divmod(s.inspect.num_frames, s.geometry.frames.shard_rows)
    victim = frame_shard_file(s, shard)
    old = open(victim, "rb").read()
    for g in range(100, 102):  # two more frames in the same, still partly filled, shard
        s.add(*syn.transition(g))
    assert s.inspect.num_frames // s.geometry.frames.shard_rows == shard
    path = s.path
    s.close()
    open(victim, "wb").write(old)
    with mmreplay.Store.open(path, mode="r") as s:
        right, errors = read_every_transition(s)
        assert right > 50 and errors
        assert all(f"shard {shard}" in e and "written" in e and "or later" in e for e in errors)


def test_stores_without_identities_open_read_and_gain_them_when_written(synthetic_store):
    s = synthetic_store(n=120)
    path = s.path
    s.close()
    forget_shard_identities(path)
    with mmreplay.Store.open(path, mode="r") as s:
        assert read_every_transition(s) == (read_every_transition(s)[0], [])
    with mmreplay.Store.open(path) as s:
        for g in range(120, 140):
            s.add(*syn.transition(g))
    assert read_commit(path)["shard_ids"]["frames/obs"]["sealed"]  # shards written since are identified
    with mmreplay.Store.open(path, mode="r") as s:
        right, errors = read_every_transition(s)
        assert errors == [] and right > 100


def test_a_resumed_writer_keeps_the_partial_shards_identity_right(synthetic_store):
    s = synthetic_store(n=45)
    path = s.path
    s.close()
    for stop in (70, 71, 130):  # each reopen continues the partly filled shard, rewritten at each commit
        with mmreplay.Store.open(path) as s:
            start = s.num_added
            for g in range(start, stop):
                s.add(*syn.transition(g))
                if g % 7 == 0:
                    s.flush()
    record = read_commit(path)
    with mmreplay.Store.open(path, mode="r") as s:
        right, errors = read_every_transition(s)
        assert errors == [] and right > 100
        files = {("frames/obs", shard): frame_shard_file(s, shard) for shard in range(frame_shards(s))}
    n = s.geometry.frames.shard_rows  # one frame per chunk
    entry = record["shard_ids"]["frames/obs"]
    assert entry["partial"][0] == len(files) - 1  # the newest shard is partly filled
    for (array, shard), file in files.items():
        tail = open(file, "rb").read()[-tail_nbytes(n):]
        if shard == entry["partial"][0]:
            assert ShardTag.decode(tail[:tag_nbytes(n)], n).written_ns == entry["partial"][1]
        else:
            assert entry["sealed"][shard] == identity(tail), (array, shard)


CRASH_CHILD = textwrap.dedent("""
    import os, signal, sys
    sys.path.insert(0, {tests!r})
    import mmreplay, mmreplay.storage.durability.commit, synthetic as syn
    s = mmreplay.Store.open({path!r})
    for g in range(s.num_added, {stop}):
        s.add(*syn.transition(g))
    def die(*a, **k):  # the shard files are rewritten, the commit record never gets written
        os.kill(os.getpid(), signal.SIGKILL)
    mmreplay.storage.durability.commit.write_commit = die
    s.flush()
""")


@pytest.mark.parametrize("stop", [47, 70])  # the partial shard rewritten; sealed and a new partial one
def test_a_crash_after_the_shard_files_before_the_record_reopens_the_last_commit(synthetic_store, stop):
    s = synthetic_store(n=45)
    path = s.path
    s.close()
    code = CRASH_CHILD.format(tests=os.path.dirname(__file__), path=path, stop=stop)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    for mode in ("r", "a"):
        with mmreplay.Store.open(path, mode=mode) as s:
            assert s.num_added == 45
            right, errors = read_every_transition(s)
            assert errors == [] and right > 30
            assert s.verify() == []


def chunk_span(raw: bytes, n_chunks: int, inner: int) -> tuple[int, int]:
    index = np.frombuffer(raw[-index_nbytes(n_chunks):-CRC_BYTES], dtype="<u8").reshape(n_chunks, 2)
    offset, nbytes = (int(v) for v in index[inner])
    return offset, nbytes


@pytest.mark.parametrize("recompute_crc", [False, True])
def test_one_flipped_byte_in_the_partly_filled_shard_stays_local(synthetic_store, recompute_crc):
    s = synthetic_store(n=100)
    rows = s.geometry.frames.shard_rows
    shard, filled = divmod(s.inspect.num_frames, rows)
    assert filled > 3  # the newest shard is partly filled
    victim = frame_shard_file(s, shard)
    path = s.path
    s.close()
    raw = bytearray(open(victim, "rb").read())
    inner = filled // 2  # one frame per chunk: the frame of row shard * rows + inner
    offset, nbytes = chunk_span(raw, rows, inner)
    raw[offset + nbytes // 2] ^= 0x10
    if recompute_crc:  # hostile: the chunk's checksum made right again (its shard's identity tag still knows)
        body = bytes(raw[offset:offset + nbytes - CRC_BYTES])
        raw[offset + nbytes - CRC_BYTES:offset + nbytes] = crc32c(body)
    open(victim, "wb").write(bytes(raw))
    with mmreplay.Store.open(path, mode="r") as s:  # opens
        problems = s.verify()
        assert len(problems) == 1 and f"'frames/obs', shard {shard}, chunk {inner}" in problems[0], problems
        assert s.info()["added"] == 100
        right, errors = read_every_transition(s)
        assert right > 60 and errors  # only transitions whose stacks hold the damaged frame fail
        assert all(f"shard {shard}, chunk {inner}" in e for e in errors)
    with pytest.raises(mmreplay.CorruptDataError, match=rf"shard {shard}.*mode='r'"):
        mmreplay.Store.open(path)  # a writer would rewrite the shard from RAM without the damaged rows


def test_identities_in_the_record_are_validated(synthetic_store):
    s = synthetic_store(n=100)
    path = s.path
    s.close()
    record = read_commit(path)
    record["shard_ids"]["frames/obs"]["sealed"][0] = "x"
    write_commit(path, record)
    with pytest.raises(mmreplay.FormatError, match="shard_ids"):
        mmreplay.Store.open(path, mode="r")


def test_shard_files_still_read_with_plain_zarr(synthetic_store):
    import zarr

    s = synthetic_store(n=60)
    want = np.stack([s.inspect.get([g]).next_obs[0, -1].numpy() for g in range(55, 60)])
    path = s.path
    s.close()
    arr = zarr.open_array(os.path.join(path, "frames", "obs"), mode="r")
    frames = arr[:]  # the identity tag lies where no index entry points
    assert any(np.array_equal(frames[i:i + 5], want) for i in range(len(frames) - 4))
