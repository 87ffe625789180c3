"""Readers never return a row that is not the committed row, whatever the writer does meanwhile.

The interleavings are forced deterministically: the writer (a second ``Store`` in this process) commits,
wraps its ring and replaces shard files at the exact instants a reader is between two steps of a refresh
or a batch. Every row a reader returns is checked against the ground truth of ``synthetic``.
"""

import numpy as np
import pytest

import mmreplay
import mmreplay.checked_reads as reads_module
import synthetic as syn
from torture import reader_race
from mmreplay.sampling.strategy import Prioritized, Sequences

CAPACITY = 200


@pytest.fixture
def writer(synthetic_store):
    w = synthetic_store(CAPACITY, commit_every=10**9, commit_seconds=1e9)
    w.next_g = 0

    def add(n):
        for _ in range(n):
            w.add(*syn.transition(w.next_g))
            w.next_g += 1
        w.flush()

    w.add_and_commit = add
    return w


def check_everything(reader) -> int:
    """Every valid id of the reader's view, through get() and through sample(); returns rows checked."""
    oldest, head = reader.inspect.valid_range()
    ids = [g for g in range(oldest, head) if syn.needs(g) >= oldest]
    checked = 0
    for lo in range(0, len(ids), 64):
        try:
            batch = reader.inspect.get(ids[lo:lo + 64])
        except IndexError:
            continue  # given up by the writer meanwhile: refused, not wrong
        assert syn.wrong_rows(batch) == []
        checked += len(batch.indices)
    for _ in range(20):
        batch = reader.sample(32)
        assert syn.wrong_rows(batch) == []
        checked += 32
    return checked


def wrong_steps(batch) -> list[int]:
    """The ids of every unmasked step of a ``SequenceBatch`` whose stack or scalars differ from the truth."""
    wrong = []
    for b, t in zip(*np.nonzero(batch.mask.numpy())):
        g = int(batch.indices[b, t])
        if not (np.array_equal(batch.obs[b, t].numpy(), syn.expected_stack(g)[0])
                and int(batch.action[b, t]) == syn.action(g) and float(batch.reward[b, t]) == syn.reward(g)):
            wrong.append(g)
    return wrong


def after_first_call(monkeypatch, name, action):
    """Make ``mmreplay.checked_reads.<name>`` (what a reader's refresh calls) run ``action`` once, right after
    its first call returns."""
    real = getattr(reads_module, name)
    done = []

    def wrapped(*args, **kwargs):
        result = real(*args, **kwargs)
        if not done:
            done.append(True)
            action()
        return result

    monkeypatch.setattr(reads_module, name, wrapped)


def test_refresh_loading_files_a_later_commit_replaced(writer, store_path, monkeypatch):
    writer.add_and_commit(300)
    reader = mmreplay.Store.open(store_path, mode="r")
    writer.add_and_commit(120)
    # The reader reads commit N, then the writer wraps its ring (replacing index and frame shards) before
    # the reader loads the files that commit N names.
    after_first_call(monkeypatch, "read_commit", lambda: writer.add_and_commit(150))
    reader.refresh()
    monkeypatch.undo()
    assert check_everything(reader) > 0
    reader.refresh()
    assert reader.inspect.valid_range() == writer.inspect.valid_range()
    assert check_everything(reader) > 0
    reader.close()


def test_writer_overwrites_between_batches(writer, store_path):
    """A newer commit seen after one batch still bounds every later batch of the same reader state."""
    writer.add_and_commit(300)
    reader = mmreplay.Store.open(store_path, mode="r", cache_bytes=1 << 12)  # tiny cache: reads go to files
    for _ in range(6):
        writer.add_and_commit(25)  # gives up and replaces what the reader's (older) view holds
        oldest, head = reader.inspect.valid_range()
        newest = [g for g in range(head - 8, head) if syn.needs(g) >= oldest]
        try:  # sees the newer commit; its rows are still valid (or refused if given up: not wrong)
            assert syn.wrong_rows(reader.inspect.get(newest)) == []
        except IndexError:
            pass
        for _ in range(10):  # draws over the reader's older view: given-up rows must not come back
            assert syn.wrong_rows(reader.sample(32)) == []
    reader.refresh()
    assert check_everything(reader) > 0
    reader.close()


def test_reader_race_processes(store_path):
    """Real processes: a writer committing every few adds on a wrapping ring, two readers checking rows."""
    results = reader_race(store_path, readers=2, capacity=CAPACITY, min_rows=2000)  # counted, not timed
    for r in results:
        assert r["wrong"] == 0, f"wrong rows, e.g. {r['examples']}: {r}"
        assert not r["guard_hit"] and r["rows"] >= 2000 and r["heads"] >= 3, r


@pytest.mark.parametrize("how", ["uniform", "prioritized", "sequences"])
def test_reader_overtaken_during_every_read_still_gets_true_rows(writer, store_path, monkeypatch, how):
    """A writer that gives up the reader's oldest shard during *every* read (a reader far slower than its
    writer): the reader's retries leave the oldest rows out and converge on rows that outlive the read,
    instead of failing the same race until it gives up. Every row returned is the committed one."""
    writer.add_and_commit(400)
    reader = mmreplay.Store.open(store_path, mode="r", cache_bytes=1 << 12)
    shard = reader.geometry.transitions.shard_rows
    overtaken = []
    real = reads_module.CheckedReads.still_valid

    def overtake_then_check(self, *read):
        writer.add_and_commit(shard)  # the reader's oldest shard is replaced while it reads
        overtaken.append(True)
        return real(self, *read)

    monkeypatch.setattr(reads_module.CheckedReads, "still_valid", overtake_then_check)
    for _ in range(5):
        if how == "uniform":
            batch = reader.sample(32)
        elif how == "prioritized":
            batch = reader.sampler(32, Prioritized(), prefetch=0, seed=3).sample()
        else:
            batch = reader.sampler(24, Sequences(4), prefetch=0, seed=3).sample()
        assert wrong_steps(batch) == [] if how == "sequences" else syn.wrong_rows(batch) == []
    assert len(overtaken) > 5  # the writer did overtake reads
    monkeypatch.undo()
    reader.refresh()
    assert check_everything(reader) > 0
    reader.close()
