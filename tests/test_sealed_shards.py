"""The frame ring's sealed-shard queue (``index/sealed_shards.py``) and the encoder child's side of it
(``index/encoder_pipe.py``) as units, each against its stated invariants, with an in-process stand-in for the
child (the real one is exercised end to end by test_sealed_queue.py and test_exit_commits.py)."""

import threading
import time

import numpy as np
import pytest

from mmreplay.columns.spec import ColumnSpec
from mmreplay.index import encoder_pipe
from mmreplay.index.frame_column import FrameColumn
from mmreplay.index.sealed_shards import SealedShards
from mmreplay.storage.format.shardfile import encode_chunk

CODEC = {"name": "blosc", "cname": "lz4", "clevel": 5}
SHARD_ROWS, CHUNK_ROWS = 8, 2


class Child:
    """Stands in for ``ShardEncoder``: heap buffers, and each job's head chunks encoded as the child encodes
    them (back to back into the output, their sizes the answer), answered once ``released`` (or failing)."""

    def __init__(self, columns, fail: bool = False, delay: float = 0.0):
        self.columns, self.fail, self.delay = columns, fail, delay
        self.released = False
        self.jobs: list[list[dict]] = []
        self.closed = False

    def allocate(self, shape, dtype):
        return np.zeros(shape, dtype)

    def start(self):
        pass

    def close(self):
        self.closed = True

    def submit(self, jobs, arrays, outputs):
        self.jobs.append(jobs)
        sizes = []
        for job, rows, out, col in zip(jobs, arrays, outputs, self.columns.values()):
            chunks = [encode_chunk(col.array.compressor, rows[i * CHUNK_ROWS:(i + 1) * CHUNK_ROWS])
                      for i in range(job["head_chunks"])]
            blob = b"".join(chunks)
            out[:len(blob)] = np.frombuffer(blob, np.uint8)
            sizes.append([len(c) for c in chunks])
        return Answer(self, sizes)


class Answer:
    def __init__(self, child: Child, sizes):
        self.child, self.sizes = child, sizes

    def ready(self):
        return self.child.released

    def result(self):
        time.sleep(self.child.delay)
        if self.child.fail:
            raise OSError(5, "the shard encoder process died")
        return self.sizes


class Files:
    """``install`` and ``record`` for the queue: what was written (by which thread), what was recorded."""

    def __init__(self, fail_shards=()):
        self.installed: dict[tuple[str, int], bytes] = {}
        self.install_threads: set[str] = set()
        self.recorded: list[str] = []
        self.record_threads: set[str] = set()
        self.fail_shards = set(fail_shards)

    def install(self, name, shard, raw):
        self.install_threads.add(threading.current_thread().name)
        if shard in self.fail_shards:
            raise OSError(28, f"no space left writing shard {shard}")
        self.installed[(name, shard)] = bytes(raw)
        return f"{name}/{shard}"

    def record(self, paths):
        self.record_threads.add(threading.current_thread().name)
        self.recorded.extend(paths)


@pytest.fixture
def columns(tmp_path):
    specs = [ColumnSpec("obs", "frame", (6, 7), "uint8", chunk_rows=CHUNK_ROWS, codec=CODEC),
             ColumnSpec("depth", "frame", (3, 3), "uint8", chunk_rows=CHUNK_ROWS, codec=CODEC)]
    return {s.name: FrameColumn(str(tmp_path), s, 4 * SHARD_ROWS, SHARD_ROWS) for s in specs}


def fill(columns, shard: int) -> dict[str, np.ndarray]:
    """The columns' staging rows for shard ``shard``, filled with values of that shard."""
    rng = np.random.default_rng(shard)
    for col in columns.values():
        col.staging[...] = rng.integers(0, 4, col.staging.shape) + shard
    return {name: col.staging for name, col in columns.items()}


def whole(columns, buffers) -> dict[str, bytes]:
    """Each column's shard as one process encodes it (the thread's path)."""
    return {name: bytes(col.array.encode_shard(buffers[name], SHARD_ROWS)) for name, col in columns.items()}


def test_a_thread_writes_sealed_shards_and_the_retiring_thread_records_their_paths(columns):
    files = Files()
    queue = SealedShards(columns, "", SHARD_ROWS, None, files.install, files.record)
    assert queue.pipe is None and queue.max_sealed == 1
    sealed = fill(columns, 0)
    expected = whole(columns, {k: v.copy() for k, v in sealed.items()})
    nxt = queue.seal(0, 0, sealed)
    assert all(nxt[name] is not sealed[name] for name in columns)  # the next shard's rows go elsewhere
    queue.wait_all()
    assert not queue.entries and files.recorded == ["obs/0", "depth/0"]
    assert {files.installed[(name, 0)] for name in columns} == set(expected.values())
    assert files.install_threads and all(t.startswith("mmreplay-writer") for t in files.install_threads)
    assert files.record_threads == {threading.current_thread().name}  # never from the writer thread
    again = queue.seal(1, 1, fill(columns, 1))
    assert all(again[name] is sealed[name] for name in columns)  # retired buffers are the next spares
    queue.close()


def test_wait_all_finishes_every_shard_and_raises_the_first_error(columns):
    files = Files(fail_shards={0})
    queue = SealedShards(columns, "", SHARD_ROWS, None, files.install, files.record)
    queue.seal(0, 0, {k: v.copy() for k, v in fill(columns, 0).items()})
    queue.seal(1, 1, {k: v.copy() for k, v in fill(columns, 1).items()})
    with pytest.raises(OSError, match="writing shard 0"):
        queue.wait_all()
    assert not queue.entries and ("obs", 1) in files.installed and files.recorded == ["obs/1", "depth/1"]
    queue.close()


def test_a_shard_split_between_the_child_and_here_is_the_shard_encoded_whole(columns):
    files = Files()
    child = Child(columns)
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    assert queue.pipe is not None and queue.max_sealed > 1 and len(queue.spares) == 1
    sealed = fill(columns, 0)
    expected = whole(columns, {k: v.copy() for k, v in sealed.items()})
    queue.seal(0, 0, sealed)
    queue.pump()  # handed to the child, whose answer is held
    assert len(child.jobs) == 1 and [job["head_chunks"] for job in child.jobs[0]] == [3, 3]  # 0.85 of 4 chunks
    queue.pump()
    assert len(queue.entries) == 1 and not files.installed  # not answered: nothing finished
    child.released = True
    queue.pump()  # answered: finished here (tail encoded here, head from the child's output)
    assert not queue.entries and {name: files.installed[(name, 0)] for name in columns} == expected
    queue.close()
    assert child.closed and all(col.staging is None for col in columns.values())


def test_the_child_takes_at_most_child_jobs_and_the_newest_is_encoded_here_when_one_must_go(columns, monkeypatch):
    monkeypatch.setattr(encoder_pipe, "_shared_memory_to_spare", lambda nbytes, path="/dev/shm": True)
    files = Files()
    child = Child(columns)
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    expected = {}
    for shard in range(3):
        buffers = {k: v.copy() for k, v in fill(columns, shard).items()}
        expected[shard] = whole(columns, buffers)
        queue.seal(shard, shard, buffers)
        queue.pump()
    assert len(child.jobs) == encoder_pipe.CHILD_JOBS == 2 and len(queue.entries) == 3
    queue.make_room(lap_behind=-1)  # room while fewer than max_sealed: nothing retired
    assert len(queue.entries) == 3
    queue.max_sealed = 3
    queue.make_room(lap_behind=-1)  # full: the one the child did not take is encoded here, at once
    assert [e.shard for e in queue.entries] == [0, 1] and files.installed[("obs", 2)] == expected[2]["obs"]
    child.released = True
    queue.wait_all()
    assert all(files.installed[(name, s)] == expected[s][name] for s in range(3) for name in columns)


def test_a_shard_a_lap_behind_is_written_before_the_writer_enters_its_file(columns):
    files = Files()
    child = Child(columns)
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    for shard in range(2):
        queue.seal(shard, shard, {k: v.copy() for k, v in fill(columns, shard).items()})
        queue.pump()
    child.released = True
    queue.make_room(lap_behind=0)  # shard 0 shares its file with the shard entered next
    assert [e.shard for e in queue.entries] == [1] and ("obs", 0) in files.installed
    queue.close()


def test_a_failed_child_part_is_encoded_here(columns):
    files = Files()
    child = Child(columns, fail=True)
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    sealed = {k: v.copy() for k, v in fill(columns, 0).items()}
    expected = whole(columns, sealed)
    queue.seal(0, 0, sealed)
    queue.pump()
    with pytest.warns(RuntimeWarning, match="shard encoder process failed"):
        queue.wait_all()
    assert {name: files.installed[(name, 0)] for name in columns} == expected
    assert queue.pipe.can_take()  # the job's output is free again
    queue.close()


def test_waiting_for_the_child_moves_chunks_here_down_to_the_minimum(columns):
    files = Files()
    child = Child(columns, delay=0.02)
    child.released = True
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    shares = []
    for shard in range(10):
        queue.seal(shard, shard % 4, {k: v.copy() for k, v in fill(columns, shard).items()})
        queue.pump()
        queue.wait_all()
        shares.append(queue.pipe.child_share)
    assert shares[0] < encoder_pipe.INITIAL_CHILD_SHARE and shares[-1] == encoder_pipe.MIN_CHILD_SHARE
    assert shares == sorted(shares, reverse=True)
    queue.close()


def test_short_shared_memory_caps_the_queue_at_what_is_sealed(columns, monkeypatch):
    monkeypatch.setattr(encoder_pipe, "_shared_memory_to_spare", lambda nbytes, path="/dev/shm": False)
    files = Files()
    child = Child(columns)
    queue = SealedShards(columns, "/store", SHARD_ROWS, child, files.install, files.record)
    queue.seal(0, 0, fill(columns, 0))  # takes the one spare allocated at start
    queue.pump()
    child.released = True
    queue.make_room(lap_behind=-1)  # no spare and none may be allocated: the queue shrinks to what is sealed
    assert queue.max_sealed == 1 and not queue.entries
    queue.close()
