"""What an open or create refuses before it allocates or deletes anything (issue 23, "Also"): metadata whose
observation shape was edited (the writer sized its staging blocks from it: gigabytes before an error), and
the leftovers of a create killed at its first file (open said not-a-store, create said exists)."""

import json
import os
import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.errors import FormatError, NotAStoreError

ATARI = spaces.Box(0, 255, (84, 84), np.uint8)


def _frames(n, seed=0):
    return np.random.default_rng(seed).integers(0, 255, (n + 1, 84, 84), dtype=np.uint8)


@pytest.fixture
def atari_store(tmp_path):
    path = str(tmp_path / "s")
    frames = _frames(40)
    with mmreplay.Store.create(path, ATARI, spaces.Discrete(4), capacity=2000) as s:
        for t in range(40):
            s.add(frames[t], t % 4, 0.0, frames[t + 1], False, False)
    return path, frames


def _edit_schema(path, **changes):
    with open(os.path.join(path, "zarr.json")) as f:
        meta = json.load(f)
    meta["attributes"]["mmreplay"]["schema"]["observations"][0].update(changes)
    with open(os.path.join(path, "zarr.json"), "w") as f:
        json.dump(meta, f)


@pytest.mark.parametrize("changes,message", [
    (dict(shape=[84, 84000]), r"a frame shard of \d+ rows of 7,056,000 bytes \(observations \[\[84, 84000\]\]\)"),
    (dict(shape=[84, 8400]), r"observation 'obs' has rows of shape \[84, 8400\] \(uint8\), but its array .* holds "
                             r"rows of shape \[84, 84\] \(uint8\)"),
    (dict(dtype="float64"), r"rows of shape \[84, 84\] \(float64\), but its array .*\[84, 84\] \(uint8\)"),
])
@pytest.mark.parametrize("mode", ["a", "r"])
def test_an_edited_observation_shape_is_refused_before_staging_is_allocated(atari_store, monkeypatch, changes,
                                                                             message, mode):
    import mmreplay.index.frame_column as frame_column

    path, frames = atari_store
    original = open(os.path.join(path, "zarr.json")).read()
    _edit_schema(path, **changes)

    def allocating(*args, **kwargs):
        raise AssertionError("a frame column (and its staging block) was made from the edited schema")

    with monkeypatch.context() as m:
        m.setattr(frame_column.FrameColumn, "__init__", allocating)
        with pytest.raises(FormatError, match=message):
            mmreplay.Store.open(path, mode)
    with open(os.path.join(path, "zarr.json"), "w") as f:  # the store itself is untouched
        f.write(original)
    with mmreplay.Store.open(path, mode) as s:
        batch = s.inspect.get(np.arange(*s.inspect.valid_range()))
        assert np.array_equal(batch.obs.numpy(), frames[:40]) and np.array_equal(batch.next_obs.numpy(), frames[1:])


def test_an_edit_of_both_the_schema_and_the_array_is_refused_by_size(atari_store):
    path, _ = atari_store
    _edit_schema(path, shape=[84, 84000])
    array_json = os.path.join(path, "frames", "obs", "zarr.json")
    with open(array_json) as f:
        array = json.load(f)
    array["shape"][2] = 84000
    with open(array_json, "w") as f:
        json.dump(array, f)
    with pytest.raises(FormatError, match=r"takes 1,806,336,000 bytes; a store made by mmreplay has at most"):
        mmreplay.Store.open(path, "a")


KILLED_CREATE = textwrap.dedent("""
    import os, pathlib, signal, sys
    import numpy as np
    from gymnasium import spaces
    import mmreplay

    replace = pathlib.Path.replace
    def die_at_the_first_zarr_json(self, target):
        if pathlib.Path(target).name == "zarr.json":
            os.kill(os.getpid(), signal.SIGKILL)  # as a kill at that instant: zarr's temporary file stays
        return replace(self, target)
    pathlib.Path.replace = die_at_the_first_zarr_json
    mmreplay.Store.create(sys.argv[1], spaces.Box(0, 1, (3,), np.float32), spaces.Discrete(2), capacity=100)
""")


def _killed_create(path):
    run = subprocess.run([sys.executable, "-c", KILLED_CREATE, path], cwd=os.path.dirname(os.path.dirname(__file__)),
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == -signal.SIGKILL, run.stderr
    left = os.listdir(path)
    assert len(left) == 1 and left[0].startswith("zarr.") and left[0].endswith(".partial"), left
    return left[0]


def test_a_create_killed_at_its_first_file_is_named_and_started_over(tmp_path):
    path = str(tmp_path / "s")
    partial = _killed_create(path)
    with pytest.raises(NotAStoreError, match=rf"creation of a store there was interrupted .*{partial}.*nothing was "
                                             r"stored: Store.create on this path starts over"):
        mmreplay.Store.open(path)
    obs = np.array([0.5, 0.25, 1.0], np.float32)
    with mmreplay.Store.create(path, spaces.Box(0, 1, (3,), np.float32), spaces.Discrete(2), capacity=100) as s:
        s.add(obs, 1, 1.0, obs / 2, True, False)
    assert partial not in os.listdir(path)
    with mmreplay.Store.open(path, "r") as s:
        batch = s.inspect.get([0])
        assert batch.action.tolist() == [1] and np.array_equal(batch.next_obs.numpy()[0], obs / 2)


def test_leftovers_beside_anything_else_are_not_deleted(tmp_path):
    path = str(tmp_path / "s")
    partial = _killed_create(path)
    with open(os.path.join(path, "notes.txt"), "w") as f:
        f.write("mine")
    with pytest.raises(FileExistsError, match="exists and is not an empty directory"):
        mmreplay.Store.create(path, spaces.Box(0, 1, (3,), np.float32), spaces.Discrete(2), capacity=100)
    with pytest.raises(NotAStoreError, match="not an mmreplay store"):
        mmreplay.Store.open(path)
    assert sorted(os.listdir(path)) == sorted([partial, "notes.txt"])
