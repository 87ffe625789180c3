"""The compressed tier (``reading/resident.py``) against the writer, with the interleavings forced.

- A resumed writer: the background loader listed the shards at open, the writer enters one of them
  again before the loader installs its file (which still holds the previous lap). The loader must not
  install it: every newest row read back is checked against the ground truth.
- A decode paused between reading a held shard's addresses and decoding them, while the writer thread
  replaces that shard: the old copy must stay alive until the decode ends (no spurious checksum error,
  no crash, true rows). Run in a child process: on a broken tier the read touches unmapped memory.
- A hostile shard index whose ``offset + nbytes`` wraps around 2**64 (index checksum valid): refused
  when the shard is loaded, never read out of bounds (the crash check runs in a child process).
"""

import json
import os
import shutil
import struct
import subprocess
import sys
import textwrap
import threading

import google_crc32c
import numpy as np
import pytest

import mmreplay
from mmreplay._native import bulk
from mmreplay._native import decode as native
from mmreplay.reading.resident import ResidentShards
from torture import resume_budget, resume_create, resume_cycle, resume_transition, resume_wrong_rows

pytestmark = pytest.mark.skipif(not native.AVAILABLE, reason="this numcodecs/google-crc32c build exports no C symbols")

HERE = os.path.dirname(os.path.abspath(__file__))
CAPACITY = 1000
WAIT = 120  # seconds: only a broken test waits this long (the events are set within milliseconds)


@pytest.fixture(scope="module")
def wrapped_original(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("wrapped") / "store")
    resume_create(path, CAPACITY)
    return path, resume_budget(path)


@pytest.fixture
def wrapped(wrapped_original, store_path):
    """A store whose frame ring went round 1.5 times (a copy per test), and a budget that holds its
    compressed frames whole with frames decoded straight into batches."""
    original, budget = wrapped_original
    shutil.copytree(original, store_path)
    return store_path, budget


def check_newest(s, n: int = 200) -> int:
    """The newest ``n`` transitions (read back as a restarted training loop does) and a sample: every
    obs and next_obs row against the ground truth. Returns the rows checked."""
    oldest, head = s.inspect.valid_range()
    batches = [s.inspect.get(np.arange(max(oldest + 4, head - n), head)), s.sample(256, seed=3)]
    for b in batches:
        assert resume_wrong_rows(b) == [], "rows differ from the ground truth"
    return sum(len(b.indices) for b in batches)


def add(s, n: int) -> None:
    g = s.num_added
    for i in range(n):
        s.add(*resume_transition(g + i))
    with s._lock:
        s._writer.drain()  # the pending adds into the rings now


@pytest.mark.parametrize("pause", ["before-reading", "after-reading"])
def test_the_loader_never_installs_a_shard_the_resumed_writer_entered(wrapped, monkeypatch, pause):
    """The loader is held at the shard the writer will enter next (before it reads the file, or after it
    read it and before it installs it); the writer enters that shard and adds rows; then the loader goes on.
    (Before this fix the first window gave stale rows; the second was already refused, and stays so.)"""
    path, budget = wrapped
    held, go = threading.Event(), threading.Event()
    target = {}

    def in_loader() -> bool:
        return threading.current_thread().name.startswith("mmreplay-preload")  # the pass or its readers

    def hold_if(hit: bool) -> None:
        if in_loader() and hit:
            held.set()
            assert go.wait(WAIT)

    # The loader reads groups of files through ``bulk`` (``read_many``, on its reader threads), or one file
    # at a time (``load``) where that is not available: both are held.
    if pause == "before-reading":
        real_load, real_read_many = ResidentShards.load, ResidentShards.read_many

        def load(self, shard, *args, **kw):
            hold_if(shard == target.get("shard"))
            return real_load(self, shard, *args, **kw)

        def read_many(self, opened, *args, **kw):
            hold_if(target.get("shard") in opened.shards)
            return real_read_many(self, opened, *args, **kw)

        monkeypatch.setattr(ResidentShards, "load", load)
        monkeypatch.setattr(ResidentShards, "read_many", read_many)
    else:
        real_preadv, real_read_files = os.preadv, bulk.read_files

        def is_target(fd) -> bool:
            return fd >= 0 and os.readlink(f"/proc/self/fd/{fd}") == target.get("path")

        def preadv(fd, buffers, offset):
            got = real_preadv(fd, buffers, offset)
            hold_if(is_target(fd))
            return got

        def read_files(fds, *args):
            got = real_read_files(fds, *args)
            hold_if(any(is_target(int(fd)) for fd in fds))  # read, not yet installed (nor closed)
            return got

        monkeypatch.setattr(os, "preadv", preadv)
        monkeypatch.setattr(bulk, "read_files", read_files)
    # Which shard the writer enters next is known once the store is open: the loader is held at start-up
    # (it lists the shards, then waits here) until it is named.
    from mmreplay.reading.preload import BackgroundPass
    real_preload = BackgroundPass._run
    named = threading.Event()

    def preload(self, *args):
        assert named.wait(WAIT)
        return real_preload(self, *args)

    monkeypatch.setattr(BackgroundPass, "_run", preload)
    with mmreplay.Store.open(path, cache_bytes=budget, durable=False) as s:
        ring, reader = s._state.frames, s._state.reader
        assert reader.columns["obs"].direct and reader.columns["obs"].resident is not None
        target["shard"] = ring.file_shard(ring.staging_shard + 1)
        target["path"] = os.path.realpath(ring.columns["obs"].layout.shard_file(path, target["shard"]))
        named.set()
        assert held.wait(WAIT), "the loader never reached the shard the writer enters next"
        while ring.file_shard(ring.staging_shard) != target["shard"]:
            add(s, 1)
        add(s, ring.shard_rows // 2)  # rows of the new lap, in RAM, in the shard the loader is about to install
        go.set()
        reader.background.join()
        check_newest(s)
        add(s, ring.shard_rows)  # the writer leaves the shard: it is written and installed
        check_newest(s)


def test_a_resumed_writer_reads_back_true_rows(wrapped):
    """The issue's scenario, unforced: reopen, add and read at once while the loader runs, a few times."""
    path, budget = wrapped
    for cycle in range(3):
        counts = resume_cycle(path, budget, adds=300, readers=2, seed=cycle)
        assert counts["rows"] > 0 and counts["wrong"] == 0, counts


WINDOW = textwrap.dedent("""
    import json, os, sys, threading
    os.environ["MMREPLAY_ENCODER"] = "thread"  # the writer thread installs the shards it writes
    os.environ["MMREPLAY_CODEC_THREADS"] = "0"  # a batch's decodes in one compiled call (_decode_stacks_checked)
    sys.path.insert(0, {here!r})
    import numpy as np
    import mmreplay
    from mmreplay._native import chunk_decode, decode as native, stack_plan
    from mmreplay.reading.frames import FrameReader
    from torture import resume_transition, resume_wrong_rows
    WAIT = 60
    path, budget = {path!r}, {budget}
    s = mmreplay.Store.open(path, cache_bytes=budget, durable=False)
    ring, reader = s._state.frames, s._state.reader
    reader.background.join()
    col = reader.columns["obs"]
    res = col.resident
    assert col.direct and res is not None
    g = s.num_added

    def add(n):
        global g
        for _ in range(n):
            s.add(*resume_transition(g))
            g += 1
        with s._lock:
            s._writer.drain()  # into the frame ring now (a full staging shard is sealed here, not waited for)

    # The writer goes into a fresh shard and flushes half of it; that copy is held in the tier (loaded from
    # its file, in pages of its own: freeing them unmaps them).
    start = ring.staging_shard
    while ring.staging_shard == start:
        add(1)
    add(ring.shard_rows // 2)
    s.flush()
    shard = ring.file_shard(ring.staging_shard)
    res.drop([shard])
    assert res.load(shard, col.tier.capacity_bytes)
    newest = np.arange(s.num_added - 20, s.num_added)  # their frames all lie in the flushed rows

    # The writer thread is held before it tells the reader it wrote the sealed shard.
    writer_held, writer_go, writer_done = threading.Event(), threading.Event(), threading.Event()
    real_written = FrameReader.shard_written

    def shard_written(self, name, shard_, raw):
        if threading.current_thread().name.startswith("mmreplay-writer") and shard_ == shard:
            writer_held.set()
            assert writer_go.wait(WAIT)
            try:
                return real_written(self, name, shard_, raw)
            finally:
                writer_done.set()
        return real_written(self, name, shard_, raw)

    FrameReader.shard_written = shard_written

    # A decode held after it read the held chunks' addresses, before it reads their bytes.
    decode_held, decode_go = threading.Event(), threading.Event()
    real_decode_stacks = native._decode_stacks_checked

    def decode_stacks(obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, addr, size, codec, status,
                      verified):
        rows, src, sizes, dst, copies, absent = stack_plan.plan_stack_decodes(
            obs_ids, next_ids, shifted, obs_out, next_out, nbytes, ring_rows, addr, size)
        if absent:
            return -1, rows
        decode_held.set()
        assert decode_go.wait(WAIT)
        return chunk_decode.decode_chunks(src, sizes, dst, copies, nbytes, codec, status[:src.size], verified), rows

    # Someone waiting for the tier while the decode holds it (the writer thread, if the tier makes it wait).
    blocked = threading.Event()

    class Watched:
        def __init__(self, lock):
            self.lock = lock
        def acquire(self, blocking=True, timeout=-1):
            if self.lock.acquire(False):
                return True
            blocked.set()
            return self.lock.acquire(blocking, timeout)
        def release(self):
            self.lock.release()
        def __enter__(self):
            return self.acquire()
        def __exit__(self, *exc):
            self.release()

    res._lock = Watched(res._lock)
    add(ring.shard_rows - ring.head % ring.shard_rows)  # the shard fills: sealed, written by the writer thread
    assert writer_held.wait(WAIT)
    native._decode_stacks_checked = decode_stacks
    result = {{}}

    def read():
        try:
            result["wrong"] = resume_wrong_rows(s.inspect.get(newest))
        except BaseException as exc:
            result["error"] = f"{{type(exc).__name__}}: {{exc}}"

    t = threading.Thread(target=read)
    t.start()
    assert decode_held.wait(WAIT), "the batch was not decoded from the tier"
    writer_go.set()  # the writer thread replaces the held copy now (or waits for the decode to end)
    either = threading.Event()
    threading.Thread(target=lambda: (writer_done.wait(WAIT), either.set()), daemon=True).start()
    threading.Thread(target=lambda: (blocked.wait(WAIT), either.set()), daemon=True).start()
    assert either.wait(WAIT)
    decode_go.set()
    t.join()
    native._decode_stacks_checked = real_decode_stacks
    assert writer_done.wait(WAIT)
    result["after"] = resume_wrong_rows(s.inspect.get(newest))
    result["waited"] = blocked.is_set()
    s.close()
    print(json.dumps(result), flush=True)
""")


def test_a_decode_keeps_the_shard_copy_it_reads_while_the_writer_thread_replaces_it(wrapped):
    path, budget = wrapped
    proc = subprocess.run([sys.executable, "-c", WINDOW.format(here=HERE, path=path, budget=budget)],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}: {proc.stderr[-3000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert "error" not in result and result["wrong"] == [] and result["after"] == [], result
    assert result["waited"]  # the writer thread's install waited for the decode


# -- hostile shard indexes ----------------------------------------------------------------------------------

def hostile(raw: bytes, n_chunks: int, entry: tuple[int, int], inner: int = 0) -> bytes:
    """``raw`` with chunk ``inner``'s index entry replaced by ``entry``, the index checksum made valid."""
    body_end = len(raw) - 4
    index = np.frombuffer(raw[body_end - n_chunks * 16:body_end], dtype="<u8").reshape(n_chunks, 2).copy()
    index[inner] = entry
    index_bytes = index.tobytes()
    return raw[:body_end - n_chunks * 16] + index_bytes + struct.pack("<I", google_crc32c.value(index_bytes))


WRAPPING = [(2**64 - 16, 32), (2**64 - 2**30, 2**30 + 32), (8, 2**64 - 8), (2**63, 2**63 + 16)]


@pytest.mark.parametrize("entry", WRAPPING + [(0, 10**9), (10**9, 0)], ids=lambda e: f"{e[0]}+{e[1]}")
def test_a_hostile_index_is_refused_by_the_tier(wrapped, entry):
    path, _ = wrapped
    with mmreplay.Store.open(path, mode="r", cache_bytes=1 << 20) as s:
        layout = s._state.frames.columns["obs"].layout
    file = layout.shard_file(path, 1)
    raw = open(file, "rb").read()
    with open(file, "wb") as f:
        f.write(hostile(raw, layout.chunks_per_shard, entry, inner=3))
    res = ResidentShards(path, layout, layout.rows)
    with pytest.raises(mmreplay.CorruptDataError, match=r"shard 1: index entry of chunk 3 .*points past"):
        res._parse(1, np.frombuffer(open(file, "rb").read(), dtype=np.uint8))
    assert not res.load(1, budget=1 << 30)
    assert res.nbytes == 0 and not res.chunk_addr.any()
    assert res.load(2, budget=1 << 30)  # the other shards are fine


HOSTILE_READ = textwrap.dedent("""
    import sys
    sys.path.insert(0, {here!r})
    import numpy as np
    import mmreplay
    for path in sys.argv[1:]:
        print("reading", path, flush=True)  # the last line names the store if this process dies
        with mmreplay.Store.open(path, mode="r", cache_bytes={budget}) as s:
            s._state.reader.background.join()
            oldest, head = s.inspect.valid_range()
            try:
                s.inspect.get(np.arange(oldest + 4, head))
            except Exception as exc:
                print("refused:", type(exc).__name__, exc, flush=True)
            else:
                print("read", flush=True)
""")


def test_reading_stores_with_hostile_indexes_raises_and_never_crashes(wrapped, tmp_path):
    """One store per wrapping entry, chunk 5 of every sealed shard; read whole in a child process."""
    path, budget = wrapped
    with mmreplay.Store.open(path, mode="r", cache_bytes=1 << 20) as s:
        layout = s._state.frames.columns["obs"].layout
        staging = s._state.frames.file_shard(s._state.frames.staging_shard)
    stores = []
    for k, entry in enumerate(WRAPPING):
        copy = str(tmp_path / f"hostile{k}")
        shutil.copytree(path, copy)
        for shard in range(layout.rows // layout.shard_rows):
            if shard == staging:
                continue  # read at open, by the file path (its own overflow check is not this module's)
            file = layout.shard_file(copy, shard)
            raw = open(file, "rb").read()
            with open(file, "wb") as f:
                f.write(hostile(raw, layout.chunks_per_shard, entry, inner=5))
        stores.append(copy)
    proc = subprocess.run([sys.executable, "-c", HOSTILE_READ.format(here=HERE, budget=budget), *stores],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"the reading process died (exit {proc.returncode}): {proc.stdout[-500:]}"
    outcomes = [line for line in proc.stdout.splitlines() if not line.startswith("reading")]
    assert len(outcomes) == len(WRAPPING) and all(o.startswith("refused:") for o in outcomes), proc.stdout
