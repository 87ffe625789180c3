"""Imports and exports are atomic and bounded (issue 40, items 4, 6, 7).

- A real ``mmreplay import`` / ``export`` child, SIGKILLed after it wrote (and, for an import, committed)
  part of its output, leaves nothing at the destination that opens as data; the rerun removes the
  leftover, says so, and gives the whole result. On 31f9547's parent a killed import left a store that
  opened (its auto-commit), a killed Minari export a directory MinariDataset opened as 0 episodes, a
  killed d4rl/d3rlpy export its ``.partial`` file for good, and the rerun of an import into an existing
  path was reported as "cannot be read".
- A 46 KB HDF5 file that declares 12 GB of never-written frames is refused before any allocation (it
  was read 4,096 rows a block: 16 GB), as are rows over the bound and contiguous data past the file's end;
  an import of large rows reads byte-bounded blocks.

The child is paused by its own progress callback at a known point (a marker file), so the kill lands
mid-job by construction, not by timing.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

import mmreplay
from mmreplay.datasets import bounds, export_dataset, import_dataset
from tests.test_datasets import assert_episodes_equal, build_store, make_episodes, minari_root  # noqa: F401

h5py = pytest.importorskip("h5py")
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

#: the child: ``mmreplay`` paused (marker written) the first time its progress passes ``pause_at`` rows
#: while rows remain; a store it creates commits what it holds first (as its auto-commit would)
CHILD = textwrap.dedent("""
    import os, sys, time
    from mmreplay.cli.progress import Progress
    from mmreplay.store import Store
    marker, pause_at = sys.argv[1], int(sys.argv[2])
    made = []
    create = Store.create.__func__
    Store.create = classmethod(lambda cls, *a, **k: made.append(create(cls, *a, **k)) or made[-1])
    def progress(self, done, total):
        if done >= pause_at and done < total and not os.path.exists(marker):
            for store in made:
                store.flush()
            open(marker, "w").close()
            time.sleep(600)
    Progress.__call__ = progress
    from mmreplay.cli.main import main
    sys.exit(main(sys.argv[3:]))
""")


def run_cli(*args, cwd=None):
    return subprocess.run([sys.executable, "-m", "mmreplay", *args], capture_output=True, text=True,
                          cwd=cwd or ROOT, timeout=300)


def kill_mid_job(tmp_path, pause_at: int, *args) -> None:
    """Run ``mmreplay args`` in a child, wait until it paused mid-job, SIGKILL it."""
    marker = tmp_path / "paused"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(marker), str(pause_at), *args], cwd=ROOT,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 240
        while not marker.exists():
            if child.poll() is not None:
                out, err = child.communicate()
                pytest.fail(f"the child ended ({child.returncode}) before it paused:\n{out}\n{err}")
            if time.monotonic() > deadline:
                pytest.fail("the child never paused")
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
    finally:
        child.kill()
        child.wait()
    marker.unlink()


def opens_as_data(fmt: str, path) -> bool:
    """Does a reader of ``fmt`` open ``path`` as a dataset or store (of any size)?"""
    path = str(path)
    if not os.path.exists(path):
        return False
    try:
        if fmt == "store":
            with mmreplay.Store.open(path, mode="r"):
                return True
        if fmt == "minari":
            from minari import MinariDataset
            MinariDataset(os.path.join(path, "data"))
            return True
        with h5py.File(path, "r"):
            return True
    except Exception:  # noqa: BLE001 - any refusal is "does not open"
        return False


@pytest.fixture
def source(tmp_path):
    rng = np.random.default_rng(5)
    eps = make_episodes("lowdim", rng, 24, max_len=30)
    started, store = build_store(str(tmp_path / "src.mmr"), "lowdim", eps, rng=rng)
    store.close()
    return started, str(tmp_path / "src.mmr")


@pytest.mark.parametrize("fmt", ["d4rl"])  # every format imports through the one EpisodeWriter path
def test_a_killed_import_leaves_nothing_that_opens_and_the_rerun_cleans_up(tmp_path, minari_root, source, fmt):  # noqa: F811
    if fmt == "minari":
        pytest.importorskip("minari")
    started, src_store = source
    dataset = str(tmp_path / ("ds" if fmt == "minari" else "ds.h5"))
    export_dataset(src_store, dataset, fmt)
    path = tmp_path / "imported.mmr"
    block = [] if fmt == "minari" else ["--block-rows", "8"]
    kill_mid_job(tmp_path, 100, "import", dataset, str(path), "--format", fmt, *block)
    assert not opens_as_data("store", path), "a killed import left a store that opens"
    left = [p for p in os.listdir(tmp_path) if p.startswith("imported.mmr.importing-")]
    assert left, "the killed import wrote beside its destination"
    # it had committed something: the old behaviour (a store at PATH) would have opened with rows
    with mmreplay.Store.open(tmp_path / left[0], mode="r") as partial:
        assert 0 < len(partial) < sum(len(e["rewards"]) for e in started)
    proc = run_cli("import", dataset, str(path), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    assert "cannot be read" not in proc.stderr
    assert f"removed {str(tmp_path / left[0])!r}" in proc.stderr and "starts over" in proc.stderr
    assert not [p for p in os.listdir(tmp_path) if ".importing-" in p]
    with mmreplay.Store.open(path, mode="r") as s:
        assert len(s) == sum(len(e["rewards"]) for e in started)


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy", "minari"])
def test_a_killed_export_leaves_nothing_that_opens_and_the_rerun_cleans_up(tmp_path, minari_root, source, fmt):  # noqa: F811
    if fmt == "minari":
        pytest.importorskip("minari")
    started, src_store = source
    out = tmp_path / "exports" / ("ds-v0" if fmt == "minari" else "ds.h5")
    kill_mid_job(tmp_path, 1, "export", src_store, str(out), "--format", fmt, "--block-rows", "16")
    assert not opens_as_data(fmt, out), "a killed export left a dataset that opens"
    left = sorted(os.listdir(out.parent))
    assert left and all(".exporting-" in p for p in left), left
    proc = run_cli("export", src_store, str(out), "--format", fmt)
    assert proc.returncode == 0, proc.stderr
    assert "removed" in proc.stderr and "interrupted" in proc.stderr
    assert os.listdir(out.parent) == [out.name], "the rerun left leftovers beside the export"
    back = tmp_path / "back.mmr"
    import_dataset(out, back, fmt)
    with mmreplay.Store.open(back, mode="r") as s:
        assert len(s) == sum(len(e["rewards"]) for e in started)


def test_a_running_jobs_sibling_is_left_alone(tmp_path):
    """Only leftovers whose process is gone are removed: a live job's sibling is named, not deleted."""
    from mmreplay.datasets.outputs import clean_leftovers

    dest = tmp_path / "out.h5"
    mine = tmp_path / f"out.h5.exporting-{os.getppid()}-abcd"  # the parent (pytest's launcher) still runs
    gone = tmp_path / "out.h5.exporting-999999999-abcd"
    unrelated = tmp_path / "out.h5.backup"
    for p in (mine, gone, unrelated):
        p.write_bytes(b"x")
    notes = clean_leftovers(dest)
    assert mine.exists() and unrelated.exists() and not gone.exists()
    assert any("still runs" in n for n in notes) and any("is gone" in n for n in notes)


def test_rerun_into_an_existing_store_names_the_real_cause(tmp_path, source):
    """An import into a path that holds a store is refused as existing, not as unreadable data."""
    _, src_store = source
    dataset = str(tmp_path / "ds.h5")
    export_dataset(src_store, dataset, "d4rl")
    proc = run_cli("import", dataset, src_store, "--format", "d4rl")
    assert proc.returncode == 2
    assert "exists" in proc.stderr and "cannot be read" not in proc.stderr, proc.stderr


# -- bounded reads -------------------------------------------------------------------------------------------

def write_d4rl(path, obs_ds, n):
    with h5py.File(path, "w") as f:
        obs_ds(f)
        f["actions"] = np.zeros((n, 1), np.float32)
        f["rewards"] = np.zeros(n, np.float32)
        f["terminals"] = np.zeros(n, bool)
        f["timeouts"] = np.zeros(n, bool)


@pytest.mark.parametrize("case, expect", [
    ("never written chunks", r"only 0 of its 3,000 chunks were ever written"),
    ("row too large", r"one row is 402,653,184 bytes, more than the 268,435,456"),
    ("contiguous never written", r"declares 12,582,912,000 bytes but the file holds 0"),
])
def test_a_small_file_declaring_huge_datasets_is_refused_before_allocating(tmp_path, case, expect):
    src = tmp_path / "hostile.h5"
    if case == "never written chunks":  # the file: 46 KB declaring (3000, 2048, 2048) uint8
        write_d4rl(src, lambda f: f.create_dataset("observations", (3000, 2048, 2048), np.uint8,
                                                   chunks=(1, 2048, 2048)), 3000)
    elif case == "row too large":
        write_d4rl(src, lambda f: f.create_dataset("observations", (2, 3, 8192, 16384), np.uint8,
                                                   chunks=(1, 1, 1024, 1024)), 2)
    else:
        write_d4rl(src, lambda f: f.create_dataset("observations", (3000, 2048, 2048), np.uint8), 3000)
    assert os.path.getsize(src) < 200_000
    # the child may not allocate even one old-style block: 1 GiB of address space beyond what it maps
    limit = "import resource; resource.setrlimit(resource.RLIMIT_DATA, (3 << 30, 3 << 30));"
    proc = subprocess.run([sys.executable, "-c", limit + "import sys; from mmreplay.cli.main import main; "
                           "sys.exit(main(sys.argv[1:]))", "import", str(src), str(tmp_path / "x.mmr"),
                           "--format", "d4rl"], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "'observations'" in proc.stderr and "(3000, 2048, 2048)" in proc.stderr or case == "row too large"
    import re
    assert re.search(expect, proc.stderr), proc.stderr[-2000:]
    assert not os.path.exists(tmp_path / "x.mmr") and not [p for p in os.listdir(tmp_path) if "importing" in p]


def test_large_rows_are_read_in_byte_bounded_blocks(tmp_path, monkeypatch):
    """Rows of 64 KB with a 1 MB budget: 16 rows a block, whatever --block-rows says."""
    from mmreplay.datasets import importing

    n, shape = 100, (128, 128, 4)
    rng = np.random.default_rng(1)
    obs = rng.integers(0, 256, (n + 1, *shape), dtype=np.uint8)
    src = tmp_path / "big.h5"
    with h5py.File(src, "w") as f:
        f["observations"] = obs[:-1]
        f["next_observations"] = obs[1:]
        f["actions"] = rng.uniform(-1, 1, (n, 2)).astype(np.float32)
        f["rewards"] = np.zeros(n, np.float32)
        f["terminals"] = np.arange(n) == n - 1
        f["timeouts"] = np.zeros(n, bool)
    monkeypatch.setattr(bounds, "BLOCK_BYTES", 1 << 20)
    monkeypatch.setattr(bounds.block_rows_for, "__defaults__", (None, 1 << 20))
    sizes = []
    real = importing.EpisodeWriter.write

    def write(self, o, *args, **kwargs):
        sizes.append(o.shape[0])
        return real(self, o, *args, **kwargs)
    monkeypatch.setattr(importing.EpisodeWriter, "write", write)
    summary = import_dataset(src, tmp_path / "big.mmr", "d4rl", block_rows=4096)
    assert summary["steps"] == n
    row = 2 * int(np.prod(shape)) + 8 + 4 + 1 + 1
    assert max(sizes) == (1 << 20) // row == 7, sizes
    with mmreplay.Store.open(tmp_path / "big.mmr", mode="r") as s:
        np.testing.assert_array_equal(s.inspect.get([n - 1]).next_obs[0].numpy(), obs[-1])


def test_bounds_of_a_numpy_header():
    """``check_array`` serves any reader that knows shape, dtype and stored bytes (a .npy header)."""
    assert bounds.check_array("x.npy", (10, 84, 84), np.uint8, stored_bytes=70_560) == 7056
    with pytest.raises(ValueError, match=r"x.npy of shape \(10, 84, 84\) and dtype uint8: declares 70,560 bytes "
                                         r"but the file holds 100"):
        bounds.check_array("x.npy", (10, 84, 84), np.uint8, stored_bytes=100)
    with pytest.raises(ValueError, match="expected a bool, integer or float dtype"):
        bounds.check_array("x.npy", (10,), object)
    with pytest.raises(ValueError, match="more than the 1,099,511,627,776"):
        bounds.check_array("x.npy", (1 << 41,), np.uint8)


def test_resuming_a_sibling_killed_before_its_first_commit_starts_over(tmp_path):
    """A resumable import (``--resume``) killed inside ``Store.create`` left a sibling with no commit
    record: the rerun starts over in it instead of failing to open it (found by
    scripts/checks/kill_imports_exports.py)."""
    from gymnasium import spaces

    from mmreplay.datasets.importing import EpisodeWriter

    path = tmp_path / "r.mmr"
    left = tmp_path / "r.mmr.importing-999999999-abcd"
    left.mkdir()
    (left / "zarr.json").write_text("{}")  # the root group written, no commit record yet
    obs = np.arange(9, dtype=np.float32).reshape(3, 3)
    with EpisodeWriter(path, spaces.Box(-np.inf, np.inf, (3,), np.float32), spaces.Discrete(2), {"capacity": None},
                       resume=True, resumable=True) as writer:
        assert not writer.resumed
        writer.write(obs[:-1], np.array([0, 1]), np.zeros(2, np.float32), obs[1:], np.array([False, True]),
                     np.zeros(2, bool), end=True)
    assert any("held no committed store yet" in n for n in writer.notes), writer.notes
    assert not left.exists()
    with mmreplay.Store.open(path, mode="r") as s:
        assert len(s) == 2
