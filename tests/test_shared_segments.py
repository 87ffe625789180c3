"""A SIGKILLed writer leaves no shared memory behind and no "leaked shared_memory" warning (issue 41, item 8):
the encoder's staging segments are never registered with Python's resource tracker; the encoder child removes
them when its parent dies, and the next writer of the store removes those of a dead process whose child died
too (``storage/format/shared_segments.py``)."""

import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

import mmreplay
from mmreplay.storage.format import shared_segments

pytestmark = pytest.mark.skipif(not os.path.isdir(shared_segments.SHM_DIR), reason="needs /dev/shm (Linux)")

WRITER = """
import sys, numpy as np, mmreplay
from gymnasium import spaces
s = mmreplay.Store.create(sys.argv[1], spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=2000,
                          frame_stack=4, encoder="process", durable=False)
for t in range(700):  # past a shard: the child encoded one, more segments exist
    s.add(np.full((84, 84), t % 256, np.uint8), t % 6, 0.0, np.full((84, 84), (t + 1) % 256, np.uint8), False, False)
s.flush()
print(s._state.frames.sealed.pipe.encoder._proc.pid, flush=True)
sys.stdin.read()  # until killed
"""


def segments_of(store: str) -> list[str]:
    head = shared_segments.segment_prefix(store, 0)[:-2]
    return [n for n in os.listdir(shared_segments.SHM_DIR) if n.startswith(head)]


def killed_writer(store: str, kill_encoder_too: bool) -> str:
    """Run a writer child of ``store``, SIGKILL it (and its encoder child), return its stderr to the end."""
    proc = subprocess.Popen([sys.executable, "-c", WRITER, store], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    line = proc.stdout.readline()
    assert line.strip().isdigit(), proc.communicate(timeout=60)
    encoder_pid = int(line)
    assert segments_of(store)  # the staging buffers exist while it runs
    if kill_encoder_too:
        os.kill(encoder_pid, signal.SIGKILL)
    proc.send_signal(signal.SIGKILL)
    _, err = proc.communicate(timeout=60)  # to its end: what a resource tracker left running would print
    deadline = time.monotonic() + 30
    while not kill_encoder_too and segments_of(store) and time.monotonic() < deadline:
        time.sleep(0.05)  # the encoder child sees its stdin close and removes them
    return err


def test_a_killed_writer_leaves_no_segment_and_no_warning(tmp_path):
    store = str(tmp_path / "store")
    err = killed_writer(store, kill_encoder_too=False)
    assert "leaked shared_memory" not in err and "resource_tracker" not in err, err[-2000:]
    assert segments_of(store) == []


@pytest.mark.parametrize("mode", ["a", "r"])
def test_the_next_open_removes_what_a_killed_writer_and_its_child_left(tmp_path, mode):
    store = str(tmp_path / "store")
    err = killed_writer(store, kill_encoder_too=True)
    assert "leaked shared_memory" not in err, err[-2000:]
    left = segments_of(store)
    assert left  # nobody could remove them: the writer and its child both died
    with mmreplay.Store.open(store, mode=mode, encoder="process") as s:  # the next writer, or a reader
        assert not set(left) & set(segments_of(store))
        if mode == "a":
            s.add(np.zeros((84, 84), np.uint8), 0, 0.0, np.zeros((84, 84), np.uint8), False, False)
    assert segments_of(store) == []  # and a writer's own go at close


def test_segments_of_a_live_process_are_never_removed(tmp_path):
    """Another live process's segments of the same store (a pid that exists) stay."""
    store = str(tmp_path / "store")
    live = shared_segments.Segment(shared_segments.segment_prefix(store, os.getppid()) + "x_1", 4096, create=True)
    dead_pid = 2 ** 22 + 12345  # above pid_max's default: no such process
    dead = shared_segments.Segment(shared_segments.segment_prefix(store, dead_pid) + "x_1", 4096, create=True)
    try:
        assert shared_segments.remove_orphans(store) == 1
        assert segments_of(store) == [live.name]
    finally:
        for seg in (live, dead):
            seg.close()
            seg.unlink()
