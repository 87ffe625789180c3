"""storage/durability/priority_files.py on its own: the double buffer a commit writes, what is durable when, reading
back (damaged, missing, half-written files), and the read ``mmreplay info`` uses."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import mmreplay
from mmreplay.errors import CorruptDataError, FormatError
from mmreplay.sampling.strategy import Prioritized
from mmreplay.storage.format.layout import RingGeometry, priority_layout
from mmreplay.storage.durability.priority_files import PriorityFiles, make_entry, read_committed, slot_ranges

ROWS, SHARD = 64, 16  # four file shards


@pytest.fixture
def root(tmp_path):
    import zarr

    path = str(tmp_path / "store")
    zarr.open_group(path, mode="w", zarr_format=3)  # the store's root group: the set's arrays go below it
    return path


def new_files(root, rows=ROWS, unbounded=False) -> PriorityFiles:
    files = PriorityFiles(root, "per", RingGeometry(rows, SHARD, unbounded))
    files.make_files()
    return files


def shard_path(root, buffer, shard, rows=ROWS) -> str:
    return priority_layout("per", buffer, rows, SHARD).shard_file(root, shard)


def committed(files: PriorityFiles, raw: np.ndarray) -> int:
    """A commit: the buffer it writes is the one the record names from now on."""
    files.flush(raw)
    return files.buffer


def reopen(root, buffer, live=np.arange(ROWS), rows=ROWS) -> np.ndarray:
    files = PriorityFiles(root, "per", RingGeometry(rows, SHARD))
    try:
        return files.load(buffer, live)
    finally:
        files.close()


def test_a_commit_writes_the_other_buffer_and_only_what_it_lacks(root):
    files = new_files(root)
    raw = np.arange(ROWS, dtype=np.float32)
    files.mark(np.arange(ROWS))
    first = [p for p in files.flush(raw) if not p.endswith("zarr.json")]  # and the metadata made before
    assert files.buffer == 0 and sorted(first) == sorted(shard_path(root, 0, s) for s in range(4))
    raw[20] = 7.0
    files.mark(np.array([20]))  # shard 1 changed
    # buffer 1 was never written: every shard; then buffer 0 lacks only shard 1
    assert sorted(files.flush(raw)) == sorted(shard_path(root, 1, s) for s in range(4)) and files.buffer == 1
    assert not files.stale()
    assert files.flush(raw) == [shard_path(root, 0, 1)] and files.buffer == 0
    assert files.flush(raw) == [] and files.buffer == 1  # nothing lacking in either buffer now
    np.testing.assert_array_equal(reopen(root, 0), raw)
    np.testing.assert_array_equal(reopen(root, 1), raw)
    files.close()


def test_every_commit_reopens_exactly_its_values(root):
    """Random updates over many commits: the buffer each commit names holds exactly the values at that
    commit (the stale-shard bookkeeping of both buffers never skips a shard)."""
    files = new_files(root)
    rng = np.random.default_rng(0)
    raw = np.zeros(ROWS, np.float32)
    for step in range(30):
        slots = rng.choice(ROWS, size=int(rng.integers(1, 6)), replace=False)
        raw[slots] = rng.random(slots.size).astype(np.float32) + step
        files.mark(slots)
        buffer = committed(files, raw)
        np.testing.assert_array_equal(reopen(root, buffer), raw, err_msg=f"commit {step}")
    files.close()


def test_an_update_not_committed_is_not_seen_after_reopen(root):
    files = new_files(root)
    raw = np.full(ROWS, 0.5, np.float32)
    files.mark(np.arange(ROWS))
    named = committed(files, raw)  # the record names this buffer
    at_commit = raw.copy()
    raw[3], raw[40] = 9.0, 8.0
    files.mark(np.array([3, 40]))
    files.flush(raw)  # the next commit's buffer is written; a crash before its record leaves `named` current
    np.testing.assert_array_equal(reopen(root, named), at_commit)
    np.testing.assert_array_equal(reopen(root, files.buffer), raw)  # had the record been written: the update
    files.close()


def test_a_reopened_set_rewrites_the_other_buffer_whole(root):
    """After ``load`` only the loaded buffer is known complete: a half-written file of the other one (a
    crash mid-commit, or a leftover from anywhere) is never read and the next commit replaces it."""
    files = new_files(root)
    raw = np.linspace(0, 3, ROWS).astype(np.float32)
    files.mark(np.arange(ROWS))
    named = committed(files, raw)
    files.close()
    other = shard_path(root, 1 - named, 2)
    os.makedirs(os.path.dirname(other), exist_ok=True)
    with open(other, "wb") as f:
        f.write(b"\x00half a shard")  # torn: no index
    files = PriorityFiles(root, "per", RingGeometry(ROWS, SHARD))
    np.testing.assert_array_equal(files.load(named, np.arange(ROWS)), raw)  # never touched the torn file
    written = files.flush(raw)
    assert sorted(written) == sorted(shard_path(root, 1 - named, s) for s in range(4))
    np.testing.assert_array_equal(reopen(root, 1 - named), raw)
    files.close()


def test_a_damaged_committed_buffer_is_refused(root):
    files = new_files(root)
    raw = np.ones(ROWS, np.float32)
    files.mark(np.arange(ROWS))
    named = committed(files, raw)
    files.close()
    path = shard_path(root, named, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)  # a torn file under the shard's own name
    with pytest.raises(CorruptDataError, match="priorities/per"):
        reopen(root, named)


def test_a_missing_shard_is_refused_only_where_it_holds_live_rows(root):
    files = new_files(root)
    raw = np.ones(ROWS, np.float32)
    named = committed(files, raw)
    files.close()
    os.remove(shard_path(root, named, 2))  # deleted, or never written (zarr reads it as its fill value)
    got = reopen(root, named, live=np.arange(SHARD))  # shard 2 holds no live rows: zeros
    np.testing.assert_array_equal(got, np.r_[np.ones(2 * SHARD), np.zeros(SHARD), np.ones(SHARD)])
    with pytest.raises(CorruptDataError, match=r"is missing, but the last commit says it holds priorities"):
        reopen(root, named, live=np.arange(2 * SHARD, 2 * SHARD + 3))


def test_stored_values_that_are_no_priorities_are_refused(root):
    files = new_files(root)
    raw = np.ones(ROWS, np.float32)
    raw[5] = np.nan
    files.mark(np.arange(ROWS))
    named = committed(files, raw)
    files.close()
    with pytest.raises(FormatError, match=rf"1 stored priorities are not finite and >= 0 .* buffer {named} is"):
        reopen(root, named)


def test_an_unbounded_ring_that_grew_rewrites_both_buffers(root):
    files = new_files(root, rows=32, unbounded=True)
    raw = np.arange(32, dtype=np.float32)
    files.mark(np.arange(32))
    committed(files, raw)
    committed(files, raw)
    files.grow(64)
    files.make_files()
    raw = np.r_[raw, np.full(32, 5.0, np.float32)]
    assert len(files.flush(raw)) == 4 and len(files.flush(raw)) == 4  # every shard of each grown buffer
    for buffer in (0, 1):
        np.testing.assert_array_equal(reopen(root, buffer, rows=64), raw)
    files.close()


def test_flush_refuses_values_of_another_shape(root):
    files = new_files(root)
    with pytest.raises(ValueError, match=r"expected 64 float32 values .* got float64 \(64,\)"):
        files.flush(np.zeros(ROWS))
    files.close()


def test_read_committed_follows_the_ring_and_fills_in_max_priority(root):
    """Ids in order across the ring's wrap; transitions past the set's entry head get its max_priority."""
    files = new_files(root)
    raw = np.arange(ROWS, dtype=np.float32)
    files.mark(np.arange(ROWS))
    named = committed(files, raw)
    files.close()
    oldest, seen, head = 100, 150, 160  # ids 100..163 live in slots 36..63, 0..35
    record = {"oldest": oldest, "head": head, "transition_rows": ROWS,
              "priorities": {"per": make_entry(named, 99.0, seen, 0.6, 1e-6)}}
    got = read_committed(root, record, RingGeometry(ROWS, SHARD))["per"]
    ids = np.arange(oldest, seen)
    np.testing.assert_array_equal(got, np.r_[raw[ids % ROWS], np.full(head - seen, 99.0, np.float32)])
    assert slot_ranges(RingGeometry(ROWS, SHARD), oldest, head) == [(36, 64), (0, 32)]
    assert slot_ranges(RingGeometry(ROWS, SHARD, True), 5, 9) == [(5, 9)]


# -- through a store: what a crash keeps -------------------------------------------------------------
CHILD = textwrap.dedent("""
    import os, sys
    import numpy as np
    sys.path.insert(0, {tests!r})
    import mmreplay
    from test_per import lowdim_store
    store = lowdim_store({path!r}, 100, capacity=64)
    smp = store.sampler(8, mmreplay.Prioritized(), seed=0)
    smp.update_priorities(np.arange(36, 100), np.arange(64) / 8)
    store.flush()  # committed
    np.save({saved!r}, store.inspect.priorities().raw)
    smp.update_priorities(np.arange(36, 100), np.full(64, 42.0))  # never committed
    os._exit(0)  # a crash: no close, no commit at exit
""")


def test_a_store_reopens_its_committed_priorities_not_later_updates(store_path, tmp_path):
    saved = str(tmp_path / "raw.npy")
    code = CHILD.format(tests=os.path.dirname(__file__), path=store_path, saved=saved)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    with mmreplay.Store.open(store_path, mode="r") as store:
        prio = store.inspect.priorities()
        slots = store.geometry.transitions.slot(np.arange(36, 100))
        np.testing.assert_array_equal(prio.raw[slots], np.load(saved)[slots])
        np.testing.assert_allclose(prio.of(np.arange(36, 100)), np.arange(64) / 8, rtol=1e-6)
        assert prio.max_priority == pytest.approx(63 / 8)
        assert store.sampler(8, Prioritized()).priorities is prio
