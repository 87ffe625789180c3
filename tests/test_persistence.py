"""Reopen = exact state: after close (or in a fresh process) the store continues where it was."""

import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.storage.durability.commit import record_checksum
from conftest import IMG, frame
from test_store_semantics import check_against_reference, drive


def test_reopen_restores_cursor_episodes_and_continues_the_open_episode(store_path):
    with mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=50, frame_stack=4,
                               reward_values=(-1, 0, 1)) as s:
        for i in range(70):  # wrapped once, an episode open at close
            s.add(frame(i), 0, 0, frame(i + 1), False, False)
        before = s.inspect.get(list(range(23, 70)))
        state = (s.inspect.valid_range(), len(s), s.inspect.num_frames)
    with mmreplay.Store.open(store_path) as s:
        assert (s.inspect.valid_range(), len(s), s.inspect.num_frames) == state
        after = s.inspect.get(list(range(23, 70)))
        assert bool((after.obs == before.obs).all()) and bool((after.next_obs == before.next_obs).all())
        s.add(frame(70), 1, 1, frame(71), False, False)  # continues the same episode: its stack reaches back
        b = s.inspect.get([70])
        assert b.obs[0, :, 0, 0].tolist() == [67, 68, 69, 70]
        assert s.inspect.num_frames == state[2] + 1  # frame 70 was not stored again


def test_unflushed_tail_is_lost_on_crash_but_nothing_committed(store_path):
    code = textwrap.dedent(f"""
        import numpy as np, os, mmreplay
        from gymnasium import spaces
        s = mmreplay.Store.create({store_path!r}, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(3),
                                  capacity=100, frame_stack=2, commit_every=1_000_000)
        f = lambda v: np.full((6, 5), v, dtype=np.uint8)
        for i in range(30):
            s.add(f(i), 0, 0, f(i + 1), False, False)
        s.flush()
        for i in range(30, 45):
            s.add(f(i), 0, 0, f(i + 1), False, False)
        os._exit(0)  # no close(): like a crash after the commit
    """)
    subprocess.run([sys.executable, "-c", code], check=True)
    with mmreplay.Store.open(store_path) as s:
        assert s.inspect.valid_range() == (0, 30) and len(s) == 30
        assert s.inspect.get([29]).next_obs[0, :, 0, 0].tolist() == [29, 30]
        s.add(frame(30), 0, 0, frame(31), False, False)  # the open episode continues across the crash
        assert s.inspect.get([30]).obs[0, :, 0, 0].tolist() == [29, 30]


def test_fresh_process_reads_back_identical(store_path):
    rng = np.random.default_rng(11)
    store, ref = drive(store_path, rng, capacity=200, frame_stack=4, steps=300)
    store.close()
    ids = ref.valid_ids()
    expected = {g: ref.transitions[g]["obs"].tolist() for g in ids}
    code = textwrap.dedent(f"""
        import json, mmreplay
        with mmreplay.Store.open({store_path!r}, mode="r") as s:
            b = s.inspect.get({ids!r})
            print(json.dumps({{"len": len(s), "obs": b.obs.tolist()}}))
    """)
    out = json.loads(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True,
                                    text=True).stdout)
    assert out["len"] == len(ids)
    assert out["obs"] == [expected[g] for g in ids]


def test_second_writer_is_refused_reader_allowed(store_path):
    s = mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10)
    with pytest.raises(RuntimeError, match="already open for writing"):
        mmreplay.Store.open(store_path)
    code = f"import mmreplay; mmreplay.Store.open({store_path!r})"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode != 0 and "already open for writing" in proc.stderr
    with mmreplay.Store.open(store_path, mode="r") as r:
        assert len(r) == 0
    s.close()
    mmreplay.Store.open(store_path).close()  # free again once the writer closed


def test_writer_killed_does_not_leave_store_locked(store_path):
    mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10).close()
    code = f"import mmreplay, os, signal; s = mmreplay.Store.open({store_path!r}); os.kill(os.getpid(), 9)"
    subprocess.run([sys.executable, "-c", code])
    mmreplay.Store.open(store_path).close()


def test_create_refuses_existing_paths(store_path, tmp_path):
    mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10).close()
    with pytest.raises(FileExistsError, match="use Store.open"):
        mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10)


def test_not_a_store_and_newer_versions_are_clear_errors(tmp_path, store_path):
    with pytest.raises(mmreplay.NotAStoreError, match="not a directory"):
        mmreplay.Store.open(str(tmp_path / "missing"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(mmreplay.NotAStoreError, match="no zarr.json"):
        mmreplay.Store.open(str(tmp_path / "empty"))
    import zarr
    zarr.open_group(str(tmp_path / "plain"), mode="w")
    with pytest.raises(mmreplay.NotAStoreError, match="not an mmreplay store"):
        mmreplay.Store.open(str(tmp_path / "plain"))

    mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10).close()
    meta_path = os.path.join(store_path, "zarr.json")
    original = json.load(open(meta_path))
    newer = json.loads(json.dumps(original))
    newer["attributes"]["mmreplay"]["format_version"] = 99
    json.dump(newer, open(meta_path, "w"))
    with pytest.raises(mmreplay.FormatError, match="format version 99 is newer"):
        mmreplay.Store.open(store_path)
    hostile = json.loads(json.dumps(original))
    hostile["attributes"]["mmreplay"]["schema"]["observations"][0]["name"] = "../../etc"
    json.dump(hostile, open(meta_path, "w"))
    with pytest.raises(mmreplay.FormatError, match="invalid column name"):
        mmreplay.Store.open(store_path)
    absurd = json.loads(json.dumps(original))
    absurd["attributes"]["mmreplay"]["frame_rows"] = 1 << 60
    json.dump(absurd, open(meta_path, "w"))
    with pytest.raises(mmreplay.FormatError, match="frame_rows"):
        mmreplay.Store.open(store_path)


def test_broken_commit_record_is_rejected(store_path):
    mmreplay.Store.create(store_path, IMG, spaces.Discrete(3), capacity=10).close()
    path = os.path.join(store_path, "commit", "zarr.json")
    record = json.load(open(path))
    record["attributes"]["mmreplay_commit"]["head"] = "many"
    json.dump(record, open(path, "w"))
    with pytest.raises(mmreplay.CorruptDataError, match="checksum"):  # an edit without the checksum
        mmreplay.Store.open(store_path)
    record["attributes"]["mmreplay_commit_crc32c"] = record_checksum(record["attributes"]["mmreplay_commit"])
    json.dump(record, open(path, "w"))
    with pytest.raises(mmreplay.FormatError, match="'head' must be a non-negative integer"):
        mmreplay.Store.open(store_path)
    open(path, "w").write("{not json")
    with pytest.raises(mmreplay.FormatError, match="not valid JSON"):
        mmreplay.Store.open(store_path)


def test_unbounded_store_grows_and_reopens(store_path):
    rng = np.random.default_rng(3)
    store, ref = drive(store_path, rng, capacity=None, frame_stack=2, steps=12000, n_streams=2)
    store.close()
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert s.geometry.transitions.rows > 16384  # grew past the first shard
        check_against_reference(s, ref)
