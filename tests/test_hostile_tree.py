"""Hostile store trees (issue 40, items 1-3): special files and links where a store has regular files and
directories. Opening, sampling, verifying, appending and the CLI must never hang, never exhaust memory,
never write outside the store, and fail with an error naming the path. Cases that hung or were OOM-killed
before run in a child process with a timeout and an address-space limit, so that the suite never hangs.
Also: ``storage/files.py``'s primitives one by one, the compiled bulk opens, an interrupted ``Store.create``,
and a short run of ``scripts/checks/fuzz_store_tree.py``."""

import json
import os
import shutil
import stat
import subprocess
import sys

import numpy as np
import pytest

import mmreplay
import synthetic as syn
from mmreplay._native import bulk
from mmreplay.errors import UnsafeEntryError
from mmreplay.sampling.strategy import Prioritized
from mmreplay.storage import files

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "scripts", "checks"))
import fuzz_store_tree  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
ROWS = 400


def build(path: str) -> None:
    with mmreplay.Store.create(path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300, frame_stack=3,
                               reward_values=(-1, 0, 1), durable=False) as s:
        for g in range(ROWS):
            s.add(*syn.transition(g))
        next(s.sampler(8, Prioritized(), seed=0))  # a priority set: its files too


@pytest.fixture(scope="module")
def template(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("hostile_tree") / "template")
    build(path)
    return path


def copy(template: str, tmp_path, name: str = "s") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(template, dst, symlinks=True)
    return dst


# the fuzzer's own snapshot (names, types, sizes, bytes and link targets, never following links)
snapshot = fuzz_store_tree.snapshot


def shard_files(store: str, array: str) -> list[str]:
    out = []
    for d, _, names in os.walk(os.path.join(store, array, "c")):
        out += [os.path.join(d, n) for n in names]
    return sorted(out)


def run_child(stores: list[str], ops: str, timeout: int = 240) -> dict:
    """``ops`` (see ``child``) on each store in one child process with an address-space limit; the outcomes.
    A hang fails the test through ``TimeoutExpired``, never the suite."""
    env = {**os.environ, "MALLOC_ARENA_MAX": "2",  # this checkout's mmreplay, whatever is installed
           "PYTHONPATH": os.pathsep.join([REPO] + [p for p in [os.environ.get("PYTHONPATH")] if p])}
    out = subprocess.run([sys.executable, __file__, ops, *stores], capture_output=True, text=True, timeout=timeout,
                         env=env, cwd=REPO)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def assert_clear(outcomes: dict) -> None:
    bad = {k: v for k, v in outcomes.items() if not (v == "ok" or v.startswith("clear:"))}
    assert bad == {}


# -- 1. a FIFO where a shard file should be --------------------------------------------------------------
def test_fifo_shards_never_hang_a_reader_a_writer_or_the_cli(template, tmp_path):
    every = copy(template, tmp_path, "every_frame_shard")
    for path in shard_files(every, "frames/obs"):
        os.unlink(path)
        os.mkfifo(path)
    one = copy(template, tmp_path, "one_transition_shard")
    victim = shard_files(one, "transitions/action")[0]
    os.unlink(victim)
    os.mkfifo(victim)
    outcomes = run_child([every, one], "all")
    assert_clear(outcomes)
    # the shards are named, and verify reports what it found rather than hanging on it
    assert "FIFO" in outcomes[f"{every}:sample"] and "frames/obs" in outcomes[f"{every}:sample"]
    assert outcomes[f"{every}:verify"].startswith("clear:") and "FIFO" in outcomes[f"{every}:verify"]
    assert "FIFO" in outcomes[f"{one}:verify"] and victim in outcomes[f"{one}:verify"]
    assert "FIFO" in outcomes[f"{every}:cli_verify"]


# -- 2. special files as metadata ------------------------------------------------------------------------
SPECIAL = {
    "commit_dev_zero": ("commit/zarr.json", "/dev/zero"),
    "commit_dev_urandom": ("commit/zarr.json", "/dev/urandom"),
    "commit_fifo": ("commit/zarr.json", None),
    "root_fifo": ("zarr.json", None),
    "root_dev_zero": ("zarr.json", "/dev/zero"),
    "array_fifo": ("frames/obs/zarr.json", None),
    "array_dev_urandom": ("transitions/action/zarr.json", "/dev/urandom"),
    "priorities_fifo": ("priorities/default/0/zarr.json", None),
    "priority_shard_dev_zero": ("priorities/default/0/c/3", "/dev/zero"),
}


def test_special_files_as_metadata_fail_fast_in_bounded_memory(template, tmp_path):
    stores = []
    for name, (rel, target) in SPECIAL.items():
        store = copy(template, tmp_path, name)
        path = os.path.join(store, rel)
        os.unlink(path)
        if target is None:
            os.mkfifo(path)
        else:
            os.symlink(target, path)
        stores.append(store)
    outcomes = run_child(stores, "open")
    assert_clear(outcomes)
    for name, (rel, _) in SPECIAL.items():
        if rel.startswith(("zarr.json", "commit", "frames")):  # read at every open: refused, naming the file
            assert outcomes[f"{tmp_path / name}:open_r"].startswith("clear:")
            assert os.path.join(str(tmp_path / name), rel) in outcomes[f"{tmp_path / name}:open_r"]


# -- 3. appending never writes outside the store -----------------------------------------------------------
def test_a_link_planted_at_the_temp_name_is_never_written_through(template, tmp_path):
    store = copy(template, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "victim").write_text("must not change")
    # the name the old atomic_write used: f"{path}.tmp-{pid}", opened O_CREAT|O_TRUNC (it followed this link)
    os.symlink(outside / "victim", os.path.join(store, "commit", f"zarr.json.tmp-{os.getpid()}"))
    before = snapshot(str(outside))
    with mmreplay.Store.open(store) as s:
        for g in range(ROWS, ROWS + 100):
            s.add(*syn.transition(g))
        s.flush()
    assert snapshot(str(outside)) == before
    assert stat.S_ISREG(os.lstat(os.path.join(store, "commit", "zarr.json")).st_mode)
    with mmreplay.Store.open(store, mode="r") as s:
        assert s.inspect.valid_range()[1] == ROWS + 100


def test_symlinked_shard_directories_are_refused_not_written_through(template, tmp_path):
    store = copy(template, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    planted = 0
    c = os.path.join(store, "frames", "obs", "c")
    links = [os.path.join(c, k) for k in os.listdir(c)]  # every frame shard's directory (the ring wraps)
    links += [os.path.join(store, "transitions", name, "c") for name in ("action", "reward")]
    for link in links:
        target = outside / os.path.relpath(link, store).replace("/", "_")
        shutil.move(link, target)  # readers still find the files through the link: only writes differ
        os.symlink(target, link)
        planted += 1
    assert planted > 5
    before = snapshot(str(outside))
    with pytest.raises(mmreplay.errors.StorageError, match="is a symbolic link, expected a directory"):
        with mmreplay.Store.open(store) as s:
            for g in range(ROWS, ROWS + 2000):
                s.add(*syn.transition(g))
            s.flush()
    assert snapshot(str(outside)) == before  # nothing created or changed outside
    with mmreplay.Store.open(store, mode="r") as s:  # the last commit is intact
        assert len(s) > 0
        s.sample(8, seed=0)


def test_a_shard_file_linked_out_of_the_store_is_not_replaced_or_read(template, tmp_path):
    store = copy(template, tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    path = shard_files(store, "transitions/action")[-1]
    shutil.copy(path, outside / "copy")
    os.unlink(path)
    os.symlink(outside / "copy", path)
    before = snapshot(str(outside))
    with pytest.raises(mmreplay.MMReplayError, match="is a symbolic link"):
        with mmreplay.Store.open(store) as s:
            for g in range(ROWS, ROWS + 1000):
                s.add(*syn.transition(g))
            s.flush()
    assert snapshot(str(outside)) == before


# -- the primitives --------------------------------------------------------------------------------------
def test_open_regular_refuses_links_fifos_devices_and_directories(tmp_path):
    (tmp_path / "file").write_bytes(b"x" * 10)
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.mkfifo(tmp_path / "fifo")
    os.symlink("/dev/zero", tmp_path / "zero")
    (tmp_path / "dir").mkdir()
    assert files.read_regular(str(tmp_path / "file"), 10) == b"x" * 10
    for name, words in (("link", "symbolic link"), ("fifo", "FIFO"), ("zero", "symbolic link"), ("dir", "directory")):
        with pytest.raises(UnsafeEntryError, match=f"{tmp_path / name} is a {words}"):
            files.read_regular(str(tmp_path / name), 10)
    with pytest.raises(UnsafeEntryError, match="is a character device"):
        files.read_regular("/dev/zero", 10)
    with pytest.raises(mmreplay.FormatError, match="more than 9 bytes"):
        files.read_regular(str(tmp_path / "file"), 9)  # the cap is on bytes read, not on st_size


def test_atomic_write_stays_inside_its_root(tmp_path):
    root, outside = tmp_path / "root", tmp_path / "outside"
    root.mkdir()
    outside.mkdir()
    files.atomic_write(str(root / "a" / "b" / "f"), b"new", root=str(root))  # directories made inside
    assert (root / "a" / "b" / "f").read_bytes() == b"new"
    os.symlink(outside, root / "linked")
    with pytest.raises(UnsafeEntryError, match="linked is a symbolic link, expected a directory"):
        files.atomic_write(str(root / "linked" / "f"), b"x", root=str(root))
    (outside / "target").write_bytes(b"old")
    os.symlink(outside / "target", root / "a" / "link")
    with pytest.raises(UnsafeEntryError, match="is a symbolic link, expected a regular file"):
        files.atomic_write(str(root / "a" / "link"), b"x", root=str(root))
    assert (outside / "target").read_bytes() == b"old" and os.listdir(outside) == ["target"]
    assert sorted(os.listdir(root / "a")) == ["b", "link"]  # no temp file left behind
    with pytest.raises(ValueError, match="not inside the store"):
        files.atomic_write(str(tmp_path / "elsewhere"), b"x", root=str(root))


def test_bulk_opens_only_regular_files(tmp_path):
    if not bulk.AVAILABLE:
        pytest.skip("no compiled bulk reads on this platform")
    (tmp_path / "file").write_bytes(b"hello")
    os.mkfifo(tmp_path / "fifo")
    os.symlink(tmp_path / "file", tmp_path / "link")
    os.symlink("/dev/zero", tmp_path / "zero")
    paths = [str(tmp_path / n) for n in ("file", "fifo", "link", "zero")] + ["/dev/zero", str(tmp_path)]
    for direct in (False, True):
        unblock = _fifo_unblocker(str(tmp_path / "fifo"))  # a regression hangs in open(2): end it, and fail
        fds, sizes, _ = bulk.open_files(paths, direct=direct)
        unblock.join()
        try:
            assert sizes.tolist() == [5, -1, -1, -1, -1, -1] and (fds[1:] == -1).all()
            if not direct:  # (a direct read needs an aligned buffer: the opens are what is tested here)
                buf = np.zeros(8192, dtype=np.uint8)
                got = bulk.read_files(fds, sizes, buf, np.zeros(len(paths), np.int64), fds >= 0)
                assert got[0] == 5 and bytes(buf[:5]) == b"hello"
        finally:
            bulk.close_files(fds)


def _fifo_unblocker(path: str, seconds: float = 2.0):
    """A thread that opens FIFO ``path`` for writing once something waits to read it (or gives up after
    ``seconds``): a reader blocked in ``open`` then returns instead of hanging the test run."""
    import threading
    import time

    def run():
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK))  # ENXIO until a reader waits
                return
            except OSError:
                time.sleep(0.05)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


# -- Store.create interrupted ---------------------------------------------------------------------------
def test_an_interrupted_create_is_named_and_created_over(tmp_path):
    path = tmp_path / "s"
    path.mkdir()  # what a create killed right after making its directory leaves
    with pytest.raises(mmreplay.NotAStoreError, match="empty directory.*Store.create interrupted.*starts over"):
        mmreplay.Store.open(str(path))
    with mmreplay.Store.create(str(path), syn.OBS_SPACE, syn.ACTION_SPACE, capacity=100, durable=False) as s:
        s.add(*syn.transition(0))
    os.unlink(path / "commit" / "zarr.json")  # killed before its first commit: the metadata but no record
    with pytest.raises(mmreplay.NotAStoreError, match="never completely created"):
        mmreplay.Store.open(str(path))
    mmreplay.Store.create(str(path), syn.OBS_SPACE, syn.ACTION_SPACE, capacity=100, durable=False).close()


# -- the fuzzer ------------------------------------------------------------------------------------------
def test_fuzz_store_tree_quick(tmp_path):
    script = os.path.join(REPO, "scripts", "checks", "fuzz_store_tree.py")
    out = subprocess.run([sys.executable, script, "--trees", "40", "--seed", "7", "--work", str(tmp_path / "w"),
                          "--json", str(tmp_path / "summary.json"), "--quiet"], capture_output=True, text=True,
                         timeout=600, cwd=REPO)
    summary = json.load(open(tmp_path / "summary.json"))
    assert out.returncode == 0 and summary["failures"] == [], out.stdout[-3000:] + out.stderr[-2000:]
    assert summary["trees"] == 40 and summary["ops"] == 40 * 2 + 10 * 2  # the CLI on every 4th tree


# -- the child process -----------------------------------------------------------------------------------
def _child(ops: str, stores: list[str]) -> dict:
    import resource

    sys.path[:0] = [HERE, REPO]
    from mmreplay.cli.main import main as cli

    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))

    def outcome(fn):
        try:
            fn()
            return "ok"
        except mmreplay.MMReplayError as exc:
            return f"clear:{type(exc).__name__}: {exc}"
        except (OSError, ValueError) as exc:
            return f"{'clear' if store in str(exc) else 'BAD'}:{type(exc).__name__}: {exc}"
        except BaseException as exc:  # noqa: BLE001 - MemoryError, a bare error: what the test is about
            return f"BAD:{type(exc).__name__}: {exc}"

    def sample():
        with mmreplay.Store.open(store, mode="r") as s:
            s.sample(64, seed=0)
            s.sample(64, seed=1)

    def get():
        with mmreplay.Store.open(store, mode="r") as s:
            s.inspect.get(list(range(*s.inspect.readable_range())))

    def verify():
        with mmreplay.Store.open(store, mode="r") as s:
            problems = s.verify()
        if problems:
            raise mmreplay.errors.CorruptDataError("; ".join(problems))

    def append():
        with mmreplay.Store.open(store) as s:
            head = s.inspect.valid_range()[1]
            for g in range(head, head + 200):
                s.add(*syn.transition(g))
            s.flush()

    def run_cli(command):
        import contextlib
        import io

        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli([command, store])
        if rc == 0:
            return
        if rc in (1, 2) and ("error:" in err.getvalue() or "FIFO" in out.getvalue()):
            raise mmreplay.errors.FormatError(f"rc {rc}: {err.getvalue()} {out.getvalue()}")
        raise RuntimeError(f"rc {rc}: {err.getvalue()} {out.getvalue()}")

    results = {}
    for store in stores:
        if ops == "all":
            todo = {"sample": sample, "get": get, "verify": verify, "append": append,
                    "cli_verify": lambda: run_cli("verify"), "cli_info": lambda: run_cli("info")}
        else:
            todo = {"open_r": lambda: mmreplay.Store.open(store, mode="r").close(),
                    "open_a": lambda: mmreplay.Store.open(store).close(), "cli_info": lambda: run_cli("info")}
        for name, fn in todo.items():
            results[f"{store}:{name}"] = outcome(fn)[:2000]
    return results


if __name__ == "__main__":
    print(json.dumps(_child(sys.argv[1], sys.argv[2:])))
