"""A normal exit without ``close()`` commits everything, even when that last commit must seal a frame shard
(on the writer thread or the encoder process), grow an unbounded ring, or create a priority set's arrays.

Each case runs a real child interpreter that adds transitions, stops where the pending adds (drained only by
the exit commit) cross a frame shard, and leaves by returning, ``sys.exit``, an exception, a
``KeyboardInterrupt``, or from a thread. The parent reopens the store and checks every transition and every
priority against the ground truth (``exit_truth``)."""

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

LOW_DIM = (6, 5)  # 30-byte frames: encoded inline / by the writer thread, never by the encoder process
IMAGE = (84, 84)

CHILD = textwrap.dedent("""
    import os, sys, threading
    sys.path.insert(0, {here!r})
    import numpy as np
    import mmreplay, exit_truth as truth

    SHAPE, CAPACITY = {shape!r}, {capacity!r}

    def seals_at_exit(s):
        '''Will the exit commit's drain of the pending adds fill the staging frame shard (and, unbounded,
        enter rows the ring must first grow to)? Each pending transition brings at least one frame.'''
        frames, pending = s._state.frames, s._writer.block.n
        fills = frames.head % frames.shard_rows + pending >= frames.shard_rows
        if CAPACITY is None:
            return fills and frames.head < frames.rows <= frames.head + pending
        return fills

    def main():
        s = mmreplay.Store.create({path!r}, truth.obs_space(SHAPE), truth.ACTION_SPACE, capacity=CAPACITY,
                                  frame_stack=truth.FRAME_STACK, reward_values=(-1, 0, 1), commit_every=100)
        assert (s._state.frames._encoder is not None) == {process_encoder!r}
        g = 0
        if {prioritized!r}:
            for g in range({updated}):
                s.add(*truth.transition(SHAPE, g))
            s.flush()  # the priority set is made after the last commit: its arrays do not exist yet
            sampler = s.sampler(8, prioritized=True, name="per")
            ids = np.arange({updated})
            assert sampler.update_priorities(ids, [truth.priority(i) for i in ids]) == {updated}
            g = {updated}
        while not seals_at_exit(s):
            assert g < {limit}, "never stopped where the exit commit seals a shard"
            s.add(*truth.transition(SHAPE, g))
            g += 1
        print("ADDED", g, flush=True)
        {ending}

    {run}
""")

ENDINGS = {
    "return": ("pass", 0),
    "sys.exit": ("sys.exit(0)", 0),
    "exception": ("raise RuntimeError('the training loop failed')", 1),
    "KeyboardInterrupt": ("raise KeyboardInterrupt", -signal.SIGINT),
}


def run_child(path, *, shape, capacity=1000, encoder="process", prioritized=False, updated=150, ending="return",
              in_thread=False):
    """Run the child; returns how many transitions it added."""
    code = CHILD.format(here=HERE, path=path, shape=shape, capacity=capacity,
                        process_encoder=encoder == "process" and shape == IMAGE, prioritized=prioritized,
                        updated=updated, limit=20_000, ending=ENDINGS[ending][0],
                        run="t = threading.Thread(target=main); t.start(); t.join()" if in_thread else "main()")
    env = {**os.environ}
    if encoder == "thread":
        env["MMREPLAY_ENCODER"] = "thread"
    else:
        env.pop("MMREPLAY_ENCODER", None)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == ENDINGS[ending][1], out.stderr[-3000:]
    assert "could not commit" not in out.stderr, out.stderr[-3000:]
    added = [int(line.split()[1]) for line in out.stdout.splitlines() if line.startswith("ADDED")]
    assert added, out.stdout + out.stderr[-3000:]
    return added[0]


def check_store(path, shape, added, *, prioritized=False, updated=150):
    """Every transition of ``[0, added)`` and (prioritized) every priority equals the ground truth."""
    with mmreplay.Store.open(path, mode="r") as s:
        assert s.valid_range() == (0, added)
        ids = list(range(added))
        for lo in range(0, added, 256):
            assert truth.wrong_rows(shape, s.get(ids[lo:lo + 256])) == []
        if prioritized:
            given = np.array([truth.priority(g) for g in range(updated)], dtype=np.float32)
            later = np.float32(max(1.0, float(given.max())))  # added after the update: the maximum so far
            want = np.concatenate([given, np.full(added - updated, later, dtype=np.float32)])
            np.testing.assert_array_equal(s.priorities("per").of(ids), want)


CASES = {
    "low-dim": dict(shape=LOW_DIM, encoder="thread"),
    "image, thread encoder": dict(shape=IMAGE, encoder="thread"),
    "image, unbounded, thread encoder": dict(shape=IMAGE, encoder="thread", capacity=None),
    "image, unbounded, encoder process": dict(shape=IMAGE, encoder="process", capacity=None),
    "prioritized, low-dim": dict(shape=LOW_DIM, encoder="thread", prioritized=True),
    "prioritized, image, encoder process": dict(shape=IMAGE, encoder="process", prioritized=True),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_normal_exit_commits_the_last_adds(store_path, case):
    kw = CASES[case]
    added = run_child(store_path, **kw)
    check_store(store_path, kw["shape"], added, prioritized=kw.get("prioritized", False))


@pytest.mark.parametrize("ending", ["sys.exit", "exception", "KeyboardInterrupt"])
def test_every_way_out_of_main_commits(store_path, ending):
    added = run_child(store_path, shape=IMAGE, encoder="thread", prioritized=True, ending=ending)
    check_store(store_path, IMAGE, added, prioritized=True)


def test_a_store_written_by_another_thread_commits_at_exit(store_path):
    added = run_child(store_path, shape=LOW_DIM, encoder="thread", prioritized=True, in_thread=True)
    check_store(store_path, LOW_DIM, added, prioritized=True)
