"""Unit tests of storage/durability/commit.py (the record, ``CommitLog``, ``CommitWatcher``), of the ring geometry in
storage/format/layout.py and of ``Settings``, each driven directly, without a Store."""

import json
import os

import pytest

from mmreplay.errors import CorruptDataError, FormatError, NotAStoreError
from mmreplay.settings import Settings
from mmreplay.storage.durability.commit import (COMMIT_FILE, FORMAT_VERSION, CommitLog, CommitWatcher, read_commit,
                                     write_commit)
from mmreplay.storage.format.layout import RingGeometry, StoreGeometry


def record(**fields):
    base = {"format_version": FORMAT_VERSION, "sequence": 1, "head": 100, "oldest": 20, "frame_head": 130,
            "frame_oldest": 25, "transition_rows": 128, "frame_rows": 256, "max_prev_delta": 1,
            "streams": [[0, 99, 0]], "samplers": {}, "priorities": {}}
    return {**base, **fields}


def test_a_record_reads_back_exactly(tmp_path):
    write_commit(str(tmp_path), record(), durable=True)
    assert read_commit(str(tmp_path)) == record()


def test_an_edited_record_fails_its_checksum(tmp_path):
    write_commit(str(tmp_path), record())
    path = tmp_path / COMMIT_FILE
    group = json.loads(path.read_text())
    group["attributes"]["mmreplay_commit"]["head"] = 101
    path.write_text(json.dumps(group))
    with pytest.raises(CorruptDataError, match="checksum mismatch"):
        read_commit(str(tmp_path))


@pytest.mark.parametrize("bad, message", [
    ({"oldest": 101}, "lies after head"),
    ({"head": -1}, "non-negative integer"),
    ({"format_version": FORMAT_VERSION + 1}, "newer than this mmreplay"),
    ({"transition_rows": 4}, "outside"),
    ({"streams": [[0, 1]]}, "streams"),
])
def test_a_malformed_record_is_a_format_error(tmp_path, bad, message):
    write_commit(str(tmp_path), record(**bad))
    with pytest.raises(FormatError, match=message):
        read_commit(str(tmp_path))


def test_no_record_is_no_store(tmp_path):
    with pytest.raises(NotAStoreError, match="not an mmreplay store"):
        read_commit(str(tmp_path))


def data_files(tmp_path, n):
    paths = []
    for i in range(n):
        path = tmp_path / "data" / f"shard{i}"
        path.parent.mkdir(exist_ok=True)
        path.write_bytes(b"x")
        paths.append(str(path))
    return paths


def test_the_log_commits_the_next_sequence_after_its_files(tmp_path):
    root = str(tmp_path)
    log = CommitLog(root, record(sequence=4), durable=True)
    written = data_files(tmp_path, 2)
    log.commit(record(head=110, sequence=0), written)
    assert written == []  # handed over: fsynced, then forgotten
    assert log.sequence == 5 and read_commit(root) == log.record == record(head=110, sequence=5)


def test_a_commit_whose_files_cannot_be_synced_leaves_the_last_record(tmp_path):
    root = str(tmp_path)
    log = CommitLog(root, record(sequence=4), durable=True)
    log.commit(record(), [])
    with pytest.raises(FileNotFoundError):
        log.commit(record(head=120), [str(tmp_path / "never-written")])
    assert read_commit(root)["sequence"] == 5 and read_commit(root)["head"] == 100


def test_giving_up_commits_only_when_the_record_still_covers_what_is_overwritten(tmp_path):
    root = str(tmp_path)
    log = CommitLog(root, record(sequence=1), durable=False)
    taken = []

    def written():
        taken.append(True)
        return []

    log.give_up_below(20, 25, written)  # the record already starts there: nothing to do
    assert log.sequence == 1 and not taken and not os.path.exists(tmp_path / COMMIT_FILE)
    log.give_up_below(60, 400, written)  # frame_oldest is clamped to the record's frame_head
    assert taken and log.sequence == 2
    on_disk = read_commit(root)
    assert (on_disk["oldest"], on_disk["frame_oldest"], on_disk["head"]) == (60, 130, 100)


def test_the_watcher_trusts_rows_only_above_every_oldest_seen(tmp_path):
    root = str(tmp_path)
    write_commit(root, record(sequence=1, oldest=20, frame_oldest=25))
    watcher = CommitWatcher(root)
    assert watcher.newest()["sequence"] == 1
    assert watcher.still_valid(20, 25)
    write_commit(root, record(sequence=2, oldest=50, frame_oldest=25))  # the writer gave up [20, 50)
    assert not watcher.still_valid(49, 25)
    assert watcher.still_valid(50, 25)
    write_commit(root, record(sequence=3, oldest=30, frame_oldest=25))  # the floor never goes back down
    assert not watcher.still_valid(40, 25)
    watcher.newest()  # after a reload the newest record alone bounds what is read
    assert watcher.still_valid(40, 25)


def test_the_watcher_reads_the_record_only_when_a_commit_replaced_it(tmp_path, monkeypatch):
    """It holds the file it read open: the same inode at the path means no commit since (one stat per
    batch); every commit (a new file renamed over the old) is noticed, even many in a row."""
    from mmreplay.storage.durability import commit

    reads = []
    real = commit.open_commit
    monkeypatch.setattr(commit, "open_commit", lambda root: reads.append(root) or real(root))
    root = str(tmp_path)
    write_commit(root, record(sequence=1, oldest=0, frame_oldest=0), durable=False)
    watcher = CommitWatcher(root)
    watcher.newest()
    for _ in range(50):
        assert watcher.still_valid(0, 0)
    assert len(reads) == 1  # nothing committed: no read at all
    for seq in range(2, 40):  # fast commits (freed inodes get reused by later files)
        write_commit(root, record(sequence=seq, oldest=seq, frame_oldest=0), durable=False)
        assert not watcher.still_valid(seq - 1, 0) and watcher.still_valid(seq, 0)
    assert len(reads) == 39
    watcher.close()
    assert watcher.still_valid(39, 0) and len(reads) == 40  # closed: it reads again, then holds the new one


def test_ring_geometry_maps_ids_to_rows_and_file_shards():
    ring = RingGeometry(32, 8)
    assert ring.slot(35) == 3 and ring.file_shard(5) == 1 and ring.n_shards == 4
    assert ring.shards_holding(30, 42) == [0, 1, 3]  # rows 30, 31 | 32..39 -> shard 0 | 40, 41 -> 1
    assert ring.shards_holding(5, 5) == []
    grown = RingGeometry(64, 8, unbounded=True)
    assert grown.slot(35) == 35 and grown.shards_holding(30, 42) == [3, 4, 5]
    with pytest.raises(ValueError, match="multiple of its shard rows"):
        RingGeometry(30, 8)


def test_store_geometry_round_trips_through_metadata_and_records():
    geo = StoreGeometry(1000, RingGeometry(1088, 64), RingGeometry(1280, 128))
    meta = geo.to_meta()
    assert StoreGeometry.from_meta(meta) == geo
    unbounded = StoreGeometry.from_meta({**meta, "capacity": None}, {"transition_rows": 2176, "frame_rows": 2560})
    assert unbounded.transitions == RingGeometry(2176, 64, True) and unbounded.frames.rows == 2560


def test_settings_are_checked_and_resolved_from_keywords():
    assert Settings.resolve(None, {}) == Settings()
    s = Settings.resolve(Settings(durable=False), {"commit_every": 10})
    assert (s.durable, s.commit_every, s.commit_seconds) == (False, 10, 30.0)
    with pytest.raises(ValueError, match="commit_every must be a positive integer, got 0"):
        Settings(commit_every=0)
    with pytest.raises(ValueError, match="durable must be True or False, got 'yes'"):
        Settings(durable="yes")
    with pytest.raises(TypeError, match=r"unexpected keyword argument\(s\) \['cache'\]"):
        Settings.resolve(None, {"cache": 1})


def test_a_grown_unbounded_ring_is_durable_before_the_commit_that_names_it(tmp_path, monkeypatch):
    """The zarr.json an unbounded ring grows is fsynced (file and directory) before the commit record that
    covers the new rows is written: after a power loss the record never names rows the arrays lack."""
    import gymnasium as gym
    import numpy as np

    import mmreplay
    from mmreplay.storage import files

    events = []
    real_fsync = os.fsync

    def fsync(fd):
        events.append(("fsync", os.readlink(f"/proc/self/fd/{fd}")))
        return real_fsync(fd)
    real_write = files.atomic_write

    def atomic_write(path, data, **kw):
        events.append(("write", path))
        return real_write(path, data, **kw)
    monkeypatch.setattr(files.os, "fsync", fsync)
    monkeypatch.setattr("mmreplay.storage.durability.commit.atomic_write", atomic_write)
    store = mmreplay.Store.create(tmp_path / "s", gym.spaces.Box(0, 255, (4, 4), np.uint8), gym.spaces.Discrete(2),
                                  capacity=None)
    with store:
        frame = np.zeros((4, 4), np.uint8)
        for i in range(5000):
            store.add(frame, 0, 0.0, frame, False, False)
        events.clear()
        for i in range(60_000):  # past the first ring size: the arrays grow
            store.add(frame, 0, 0.0, frame, False, False)
        store.flush()
    grown = [i for i, (kind, p) in enumerate(events) if kind == "fsync" and "zarr.json.tmp" in p
             and os.sep + "commit" + os.sep not in p]
    dirs_synced = [i for i, (kind, p) in enumerate(events) if kind == "fsync" and os.path.isdir(p)]
    commits = [i for i, (kind, p) in enumerate(events) if kind == "write" and p.endswith(os.path.join("commit", "zarr.json"))]
    assert grown and commits, events[:20]
    assert grown[0] < commits[-1] and any(grown[0] < d < commits[-1] for d in dirs_synced)
