"""A normal exit without ``close()`` commits everything, even when that last commit must seal a frame shard
(on the writer thread or with the encoder process), grow an unbounded ring, or create a priority set's
arrays: by then ``concurrent.futures`` refuses new work and zarr's I/O cannot run.

Each test runs a real child interpreter that fills one store of each kind, stopping each where its pending
adds (drained only by the exit commit) fill the staging frame shard, and then leaves: by returning,
``sys.exit``, an exception, a ``KeyboardInterrupt``, or from a thread. The parent reopens every store and
checks every transition and every priority against the ground truth (``exit_truth``)."""

import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import exit_truth as truth
import mmreplay

HERE = os.path.dirname(os.path.abspath(__file__))

LOW_DIM = (6, 5)  # 30-byte frames: always encoded by the writer thread, never by the encoder process
IMAGE = (84, 84)
UPDATED = 150  # a prioritized store's first transitions, whose priorities the child sets

# name: (frame shape, capacity, encoder, prioritized)
STORES = {
    "low-dim": (LOW_DIM, 1000, "thread", False),
    "image, thread encoder": (IMAGE, 1000, "thread", False),
    "image, unbounded, thread encoder": (IMAGE, None, "thread", False),
    "image, unbounded, encoder process": (IMAGE, None, "process", False),
    "prioritized, low-dim": (LOW_DIM, 1000, "thread", True),
    "prioritized, image, encoder process": (IMAGE, 1000, "process", True),
}
# The other ways out run on these two: between them a writer-thread and an encoder-process seal, a ring that
# must grow, and priority arrays to create (every kind runs with the plain return; a child costs ~3 s of
# imports plus ~2 s a store).
HARDEST = ("image, unbounded, thread encoder", "prioritized, image, encoder process")

CHILD = textwrap.dedent("""
    import os, signal, sys, threading
    sys.path.insert(0, {here!r})
    import numpy as np
    import mmreplay, exit_truth as truth

    def seals_at_exit(s, unbounded):
        '''Will the exit commit's drain of the pending adds fill the staging frame shard (and, unbounded,
        enter rows the ring must first grow to)? Each pending transition brings at least one frame.'''
        frames, pending = s._state.frames, s._writer.block.n
        fills = frames.head % frames.shard_rows + pending >= frames.shard_rows
        return fills and (not unbounded or frames.head < frames.rows <= frames.head + pending)

    def make(path, shape, capacity, encoder, prioritized):
        '''A store of this kind (prioritized: its first transitions added and committed, their priorities
        set after that commit, so no commit has written its priority arrays yet); returns what ``fill`` takes.'''
        if encoder == "thread":
            os.environ["MMREPLAY_ENCODER"] = "thread"  # as with a /dev/shm too small for the encoder
        else:
            os.environ.pop("MMREPLAY_ENCODER", None)
        s = mmreplay.Store.create(path, truth.obs_space(shape), truth.ACTION_SPACE, capacity=capacity,
                                  frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1), commit_every=100)
        assert (s._state.frames.sealed.pipe is not None) == (encoder == "process"), path
        g, sampler = 0, None
        if prioritized:
            for g in range({updated}):
                s.add(*truth.transition(shape, g))
            s.flush()
            sampler = s.sampler(8, mmreplay.Prioritized(), name="per")
            ids = np.arange({updated})
            assert sampler.update_priorities(ids, [truth.priority(i) for i in ids]) == {updated}
            g = {updated}
        return path, s, sampler, shape, capacity, g

    def fill(path, s, sampler, shape, capacity, g):
        '''Add to ``s`` until the pending adds, drained only by the exit commit, fill a frame shard.'''
        while not seals_at_exit(s, capacity is None):
            assert g < 20_000, "never stopped where the exit commit seals a shard"
            s.add(*truth.transition(shape, g))
            g += 1
        print("ADDED", path, g, flush=True)

    def main():
        kept = [make(path, *kind) for path, kind in {stores!r}]  # open at exit, never closed
        for store in kept:
            fill(*store)
        {ending}

    def outliving_main():
        '''The stores are made here; a non-daemon thread adds to them only once the main thread finished
        and ``concurrent.futures`` stopped taking work (which it does before joining that thread).'''
        import concurrent.futures.thread as pools, time
        kept = [make(path, *kind) for path, kind in {stores!r}]

        def add_late():
            while not pools._shutdown:
                time.sleep(0.01)
            for store in kept:
                fill(*store)

        threading.Thread(target=add_late).start()

    {run}
""")

ENDINGS = {  # the last line of main, and the child's exit status
    "return": ("pass", 0),
    "sys.exit": ("sys.exit(0)", 0),
    "exception": ("raise RuntimeError('the training loop failed')", 1),
    # a Ctrl-C at the terminal: SIGINT to the whole foreground process group (the child leads its own). Not
    # signal.pause(): the kernel may hand the signal to another thread after the main thread entered pause(),
    # which would then sleep on; a short sleep lets the main thread run the handler
    "KeyboardInterrupt": ("os.killpg(0, signal.SIGINT)\n    while True: __import__('time').sleep(0.05)",
                          -signal.SIGINT),
}


THREADS = {  # how the child runs main
    "main thread": "main()",
    "another thread": "t = threading.Thread(target=main); t.start(); t.join()",
    "a thread outliving the main thread": "outliving_main()",
}


def run_child(tmp_path, ending="return", threads="main thread", kinds=tuple(STORES)) -> dict:
    """Run the child on one store of each of ``kinds``; returns {kind: how many transitions it added}."""
    paths = {name: str(tmp_path / f"store{i}") for i, name in enumerate(kinds)}
    code = CHILD.format(here=HERE, updated=UPDATED, ending=ENDINGS[ending][0],
                        stores=[(paths[name], STORES[name]) for name in kinds],
                        run=THREADS[threads])
    # a child that outlives 560 s prints every thread's stack and exits, so a hang fails with where it hung. Ctrl-C
    # raises KeyboardInterrupt as at a terminal even where this suite was started in the background of a script
    # (bash makes SIGINT ignored there, children inherit that, and Python then installs no handler: the child
    # of the KeyboardInterrupt case would wait for ever, as it did in three clean clones run with nohup ... &)
    code = ("import faulthandler, signal; faulthandler.dump_traceback_later(560, exit=True); "
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n" + code)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600,
                         start_new_session=True)
    assert out.returncode == ENDINGS[ending][1], out.stderr[-3000:]
    added = {}
    for line in out.stdout.splitlines():
        if line.startswith("ADDED "):
            _, path, n = line.split()
            added[path] = int(n)
    assert len(added) == len(kinds), out.stdout + out.stderr[-3000:]
    return {name: (path, added[path]) for name, path in paths.items()}, out.stderr


def wrong(path, shape, added, prioritized) -> list[str]:
    """What differs from the ground truth in the store at ``path``: transitions [0, added) and, prioritized,
    their priorities (the first ``UPDATED`` as set, the later ones at the largest priority given before)."""
    with mmreplay.Store.open(path, mode="r") as s:
        if s.inspect.valid_range() != (0, added):
            return [f"valid range {s.inspect.valid_range()}, expected (0, {added})"]
        ids = list(range(added))
        bad = [f"transition {g}" for lo in range(0, added, 256)
               for g in truth.wrong_rows(shape, s.inspect.get(ids[lo:lo + 256]))]
        if prioritized:
            given = np.array([truth.priority(g) for g in range(UPDATED)], dtype=np.float32)
            later = np.float32(max(1.0, float(given.max())))
            want = np.concatenate([given, np.full(added - UPDATED, later, dtype=np.float32)])
            got = s.inspect.priorities("per").of(ids)
            bad += [f"priority of {g}: {got[g]}, expected {want[g]}" for g in np.flatnonzero(got != want)]
        return bad


def check_every_store(stores: dict, stderr: str, tracebacks: int = 0) -> None:
    """Every store holds everything the child added, and the child had nothing to complain about."""
    problems = {}
    for name, (path, added) in stores.items():
        shape, _, _, prioritized = STORES[name]
        found = wrong(path, shape, added, prioritized)
        if found:
            problems[name] = found[:5] + ([f"... {len(found)} in all"] if len(found) > 5 else [])
    assert problems == {}, stderr[-3000:]
    assert "Warning" not in stderr and stderr.count("Traceback") == tracebacks, stderr[-3000:]


@pytest.mark.parametrize("ending", list(ENDINGS))
def test_every_way_out_of_main_commits_every_store(tmp_path, ending):
    kinds = tuple(STORES) if ending == "return" else HARDEST
    check_every_store(*run_child(tmp_path, ending, kinds=kinds), tracebacks=int(ENDINGS[ending][1] != 0))


@pytest.mark.parametrize("threads", ["another thread", "a thread outliving the main thread"])
def test_stores_written_by_other_threads_commit_at_exit(tmp_path, threads):
    check_every_store(*run_child(tmp_path, threads=threads, kinds=HARDEST))


FORK_CHILD = textwrap.dedent("""
    import os, sys
    sys.path.insert(0, {here!r})
    import mmreplay, exit_truth as truth

    SHAPE = {shape!r}
    s = mmreplay.Store.create({path!r}, truth.obs_space(SHAPE), truth.ACTION_SPACE, capacity=1000,
                              frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1))
    for g in range(300):
        s.add(*truth.transition(SHAPE, g))  # pending, not committed: the forked child inherits them
    go, wait = os.pipe()
    pid = os.fork()
    if pid == 0:  # a worker forked from the training script: it ends with a normal exit of its own
        os.read(go, 1)
        try:
            s.add(*truth.transition(SHAPE, 300))
        except mmreplay.StoreClosedError:
            sys.exit(0)  # atexit runs here: it must not commit the parent's store
        sys.exit(3)
    for g in range(300, 500):
        s.add(*truth.transition(SHAPE, g))
    s.flush()  # committed: 500 transitions; nothing is pending after this
    os.write(wait, b"x")
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, status
    {ending}
""")


@pytest.mark.parametrize("shape", [LOW_DIM, IMAGE])
def test_a_forked_child_that_exits_never_commits_its_parents_store(store_path, shape):
    """The child holds the parent's 300 uncommitted transitions and state; if its exit committed them, the
    store would say 300 where the parent committed 500 (and its staging shard file would be the child's)."""
    code = FORK_CHILD.format(here=HERE, path=store_path, shape=shape, ending="pass  # no close()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert wrong(store_path, shape, 500, False) == []
    assert "Warning" not in out.stderr, out.stderr[-3000:]


def test_sys_exit_inside_a_with_block_commits(store_path):
    code = CHILD.format(here=HERE, updated=UPDATED, ending="", stores=[], run=textwrap.dedent(f"""
        store = make({store_path!r}, {IMAGE!r}, 1000, "thread", True)
        fill(*store)
        with store[1]:
            sys.exit(0)"""))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    added = int(out.stdout.split()[-1])
    assert wrong(store_path, IMAGE, added, True) == []


def add_until(store, shape, g, done) -> int:
    while not done():
        store.add(*truth.transition(shape, g))
        g += 1
    return g


def test_a_shard_whose_encoder_process_died_is_encoded_here(store_path, monkeypatch):
    """The encoder child dies (SIGKILL, an OOM kill) with a sealed shard's job in flight: the shard is
    encoded from the sealed buffers instead, so the next commit (here, close) loses nothing."""
    monkeypatch.delenv("MMREPLAY_ENCODER", raising=False)
    s = mmreplay.Store.create(store_path, truth.obs_space(IMAGE), truth.ACTION_SPACE, capacity=1000,
                              frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1))
    frames = s._state.frames
    child = frames.sealed.pipe.encoder._proc
    os.kill(child.pid, signal.SIGSTOP)  # it takes the job but never answers
    g = add_until(s, IMAGE, 0, lambda: bool(frames.sealed.entries))  # a shard sealed: its job in the pipe
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    g = add_until(s, IMAGE, g, lambda: s._writer.block.n == 5)
    with pytest.warns(RuntimeWarning, match="shard encoder process failed"):
        s.close()
    assert wrong(store_path, IMAGE, g, False) == []


def test_a_ctrl_c_at_the_terminal_does_not_reach_the_encoder_process(store_path, monkeypatch):
    """SIGINT goes to the terminal's foreground process group; the encoder runs in a session of its own."""
    monkeypatch.delenv("MMREPLAY_ENCODER", raising=False)
    with mmreplay.Store.create(store_path, truth.obs_space(IMAGE), truth.ACTION_SPACE, capacity=1000,
                               frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1)) as s:
        child = s._state.frames.sealed.pipe.encoder._proc
        assert os.getpgid(child.pid) != os.getpgid(0) and os.getsid(child.pid) == child.pid


def test_zarr_reads_an_unbounded_store_whose_metadata_was_grown_without_zarr(store_path):
    import zarr

    shape = (84, 84)
    with mmreplay.Store.create(store_path, truth.obs_space(shape), truth.ACTION_SPACE, capacity=None,
                               frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1)) as s:
        first_rows = s.geometry.frames.rows
        g = add_until(s, shape, 0, lambda: s._state.frames.head > first_rows)  # grew at least once
        rows, head = s.geometry.frames.rows, s._state.frames.head
    assert rows > first_rows
    with mmreplay.Store.open(store_path, mode="r") as s:
        assert s.inspect.valid_range() == (0, g) and truth.wrong_rows(shape, s.inspect.get(range(g - 64, g))) == []
    frames = zarr.open_array(store=store_path, path="frames/obs", mode="r")
    assert frames.shape == (rows, *shape)
    np.testing.assert_array_equal(frames[head - 1], truth.next_obs(shape, g - 1))  # the newest frame, by zarr
