"""The mmreplay command on bad input: one line on stderr naming the value, exit status 2, nothing written
(docs/api.md "Command line"); --version; ``info`` and ``verify`` start without importing torch. Most cases
call ``main`` in this process, as ``python -m mmreplay.cli`` does (a child interpreter costs ~4 s of
imports each); one case of each kind also runs as the real command in a child process, which alone shows
what the interpreter adds (a warning line on stderr, the exit status, the working directory)."""

import contextlib
import io
import json
import os
import subprocess
import sys
from importlib import metadata

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.cli import main
from mmreplay.cli.main import one_line

EPISODES = 6  # complete episodes in small_store


#: the checkout whose mmreplay this test imports: the child imports the same one from any directory
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mmreplay.__file__)))


def child_env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}


def run_cli(*args, cwd=None, child=False) -> subprocess.CompletedProcess:
    """The command's exit status, stdout and stderr: ``main(args)`` here, or with ``child`` (or a ``cwd``)
    ``python -m mmreplay.cli ARGS`` in a child process."""
    if child or cwd is not None:
        return subprocess.run([sys.executable, "-m", "mmreplay.cli", *args], capture_output=True, text=True,
                              timeout=300, cwd=cwd, env=child_env())
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(args))
        except SystemExit as exc:  # argparse's --help and --version
            code = exc.code if isinstance(exc.code, int) else int(exc.code is not None)
    return subprocess.CompletedProcess(["mmreplay", *args], code, out.getvalue(), err.getvalue())


def assert_input_error(proc, command: str, *names: str) -> str:
    """Exit 2, nothing on stdout, one line on stderr, in the command's form, naming ``names``."""
    assert proc.returncode == 2, proc.stderr
    assert proc.stdout == ""
    lines = proc.stderr.splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith(f"{command}: error: "), lines[0]
    for name in names:
        assert name in lines[0], (name, lines[0])
    return lines[0]


# -- import ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy"])
def test_import_of_a_text_file_is_one_line(tmp_path, fmt):
    src = tmp_path / "passwd"
    src.write_text("root:x:0:0:root:/root:/bin/bash\n")
    out = tmp_path / "z.mmr"
    line = assert_input_error(run_cli("import", str(src), str(out), "--format", fmt, child=True), "mmreplay import",
                              str(src))
    assert "not an HDF5 file" in line
    assert not out.exists()


def test_import_of_a_missing_file_or_a_directory(tmp_path):
    out = tmp_path / "z.mmr"
    missing = str(tmp_path / "nope.hdf5")
    line = assert_input_error(run_cli("import", missing, str(out), "--format", "d4rl"), "mmreplay import", missing)
    assert "no such file" in line
    line = assert_input_error(run_cli("import", str(tmp_path), str(out), "--format", "d3rlpy"), "mmreplay import",
                              str(tmp_path))
    assert "is a directory" in line
    assert not out.exists()


def test_import_of_an_hdf5_file_of_another_kind(tmp_path):
    h5py = pytest.importorskip("h5py")
    src = tmp_path / "other.hdf5"
    with h5py.File(src, "w") as f:
        f["something"] = np.arange(3)
    out = tmp_path / "z.mmr"
    assert_input_error(run_cli("import", str(src), str(out), "--format", "d4rl"), "mmreplay import", str(src),
                       "observations")
    assert not out.exists()


@pytest.mark.parametrize("flag, value", [("--capacity", "0"), ("--frame-stack", "-1"), ("--block-rows", "0"),
                                         ("--reward-values", "a,b")])
def test_import_options_out_of_range(tmp_path, flag, value):
    src = tmp_path / "x.hdf5"
    src.write_bytes(b"")
    assert_input_error(run_cli("import", str(src), str(tmp_path / "z.mmr"), "--format", "d4rl", flag, value),
                       "mmreplay import", flag, value)


@pytest.mark.parametrize("damage", ["data file not HDF5", "metadata not JSON"])
def test_import_of_a_damaged_minari_dataset(small_store, tmp_path, damage):
    pytest.importorskip("minari")
    src = tmp_path / "ds"
    proc = run_cli("export", small_store, str(src), "--format", "minari")
    assert proc.returncode == 0, proc.stderr
    victim = src / "data" / ("main_data.hdf5" if damage == "data file not HDF5" else "metadata.json")
    victim.write_text("{garbage")
    line = assert_input_error(run_cli("import", str(src), str(tmp_path / "z.mmr"), "--format", "minari"),
                              "mmreplay import", f"minari dataset {str(src)!r} cannot be read")
    assert ("file signature not found" if damage == "data file not HDF5" else "line 1 column 2") in line


def test_minari_export_to_a_relative_directory(small_store, tmp_path):
    """``OUT`` relative to the working directory (it came out as OUT/data/OUT/data/main_data.hdf5)."""
    pytest.importorskip("minari")
    proc = run_cli("export", small_store, "rel", "--format", "minari", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["episodes"] == EPISODES
    assert (tmp_path / "rel" / "data" / "main_data.hdf5").is_file()


def test_bench_with_too_few_transitions():
    assert_input_error(run_cli("bench", "--n", "10"), "mmreplay bench", "--n 10")


# -- export --episodes --------------------------------------------------------------------------------
@pytest.mark.parametrize("episodes, says", [
    ("5:2", "start < stop"),       # reversed: wrote 0 episodes without a word
    ("2:2", "start < stop"),       # empty
    ("=-3:", "non-negative"),      # negative (argparse takes "-3:" for an option, so the = form)
    ("=-1", "non-negative"),
    ("1.5:3", "non-negative integers"),
    ("0:6:0", "step > 0"),
    ("0:7", "6 exportable"),       # beyond the store
    ("6:", "6 exportable"),
    ("2,100", "6 exportable"),
])
def test_bad_episode_ranges_are_refused_before_writing(small_store, tmp_path, episodes, says):
    out = tmp_path / "o.hdf5"
    flag = f"--episodes{episodes}" if episodes.startswith("=") else None
    args = [flag] if flag else ["--episodes", episodes]
    line = assert_input_error(run_cli("export", small_store, str(out), "--format", "d4rl", *args,
                                      child=episodes == "5:2"),
                              "mmreplay export", f"--episodes {episodes.lstrip('=')!r}")
    assert says in line
    assert not out.exists()


def test_a_good_range_exports_exactly_those_episodes(small_store, tmp_path):
    h5py = pytest.importorskip("h5py")
    out = tmp_path / "o.hdf5"
    proc = run_cli("export", small_store, str(out), "--format", "d4rl", "--episodes", "1:6:2")
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["episodes"] == 3
    with h5py.File(out, "r") as f:
        first = f["observations"][:, 0, 0]
    # episodes 1, 3, 5 of 50 steps each: steps 50..99, 150..199, 250..299
    np.testing.assert_array_equal(first, np.concatenate([np.arange(50, 100), np.arange(150, 200),
                                                         np.arange(250, 300)]) % 256)
    proc = run_cli("export", small_store, str(tmp_path / "all.hdf5"), "--format", "d4rl", "--episodes", f"0:{EPISODES}")
    assert proc.returncode == 0 and json.loads(proc.stdout)["episodes"] == EPISODES


# -- usage errors, not-a-store paths ------------------------------------------------------------------
@pytest.mark.parametrize("args, command, name", [
    (["export", "S", "o.hdf5", "--format", "nope"], "mmreplay export", "'nope'"),
    (["export", "S", "o.hdf5"], "mmreplay export", "--format"),
    (["export", "S", "o.hdf5", "--format", "d4rl", "--bogus"], "mmreplay", "--bogus"),
    (["info"], "mmreplay info", "path"),
    (["nosuchcommand"], "mmreplay", "'nosuchcommand'"),
    ([], "mmreplay", "command"),
])
def test_usage_errors_are_one_line(small_store, args, command, name):
    args = [small_store if a == "S" else a for a in args]
    assert_input_error(run_cli(*args, child=not args), command, name)


@pytest.mark.parametrize("command", ["info", "verify"])
@pytest.mark.parametrize("what", ["missing", "file", "empty dir", "garbage metadata"])
def test_not_a_store(tmp_path, small_store, command, what):
    path = tmp_path / "x"
    if what == "file":
        path.write_text("hello")
    elif what == "empty dir":
        path.mkdir()
    elif what == "garbage metadata":
        path = small_store
        with open(os.path.join(path, "zarr.json"), "w") as f:
            f.write("{not json")
    assert_input_error(run_cli(command, str(path), child=what == "garbage metadata"), f"mmreplay {command}",
                       str(path))


def test_oserror_names_its_file():
    err = PermissionError(13, "Permission denied", "/data/x.hdf5")
    assert one_line(err) == "'/data/x.hdf5': Permission denied"
    assert one_line(OSError("Unable to open file\n(file signature not found)")) == \
        "Unable to open file (file signature not found)"


def test_an_internal_error_is_not_an_input_error(small_store, monkeypatch):
    """A bug of ours keeps its traceback (not exit 2, which would blame the user's input)."""
    from mmreplay.store import Store

    def broken(self):
        raise RuntimeError("a bug")

    monkeypatch.setattr(Store, "info", broken)
    with pytest.raises(RuntimeError, match="a bug"):
        main(["info", small_store])


# -- --version, startup without torch -----------------------------------------------------------------
def test_version():
    proc = run_cli("--version", child=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"mmreplay {metadata.version('mmreplay')}"


def test_info_and_verify_do_not_import_torch(small_store):
    script = ("import contextlib, io, json, sys\n"
              "from mmreplay.cli import main\n"
              "codes = []\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              f"    codes.append(main(['info', {small_store!r}]))\n"
              f"    codes.append(main(['info', {small_store!r}, '--json']))\n"
              f"    codes.append(main(['verify', {small_store!r}]))\n"
              "print(json.dumps([codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))]))\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300,
                          env=child_env())
    assert proc.returncode == 0, proc.stderr
    codes, torch_modules = json.loads(proc.stdout.splitlines()[-1])
    assert codes == [0, 0, 0]
    assert torch_modules == []


def test_public_names_still_import():
    """``import mmreplay`` stays lazy and every public name still resolves."""
    proc = subprocess.run([sys.executable, "-c", "import sys, mmreplay; print('torch' in sys.modules); "
                           "[getattr(mmreplay, n) for n in mmreplay.__all__]; print(mmreplay.Batch.numpy.__name__)"],
                          capture_output=True, text=True, timeout=300, env=child_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["False", "numpy"]
