"""Hostile dataset trees (issue 40): ``import`` of a dataset whose files are FIFOs, devices, links to
``/dev/zero``, damaged HDF5 or gzip'd ``.npy`` files must never hang, never fill memory, and fail with an
error naming the dataset. Each case is one that ``scripts/checks/fuzz_dataset_tree.py`` found on the code
before ``datasets/sources.py``: a FIFO as a D4RL/d3rlpy file hung h5py's open (and the CLI's own check), a
FIFO as Minari's ``metadata.json`` hung Minari, a link to ``/dev/zero`` there filled memory (MemoryError at
2 GiB), a truncated HDF5 file or a bit flipped in its metadata raised h5py's ``OSError``/``RuntimeError``/
``KeyError`` naming no file, so did Minari (``KeyError``, ``AssertionError``) for a ``metadata.json`` missing
a key (a flipped bit in its name), a damaged gzip stream or ``.npy`` header escaped as ``zlib.error`` or
``tokenize.TokenError``, and Dopamine checkpoint errors named no file. Cases that hung or filled memory
run in a child with a timeout (and an address-space limit), so the suite never hangs.
Also: a short run of the fuzzer."""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from mmreplay.datasets import export_dataset, import_dataset
from mmreplay.datasets.sources import naming
from tests.test_datasets import build_store, make_episodes

h5py = pytest.importorskip("h5py")
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DQN_FIXTURE = os.path.join(REPO, "tests", "data", "dqn_replay")


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A small store exported to each HDF5 format: {format: path}."""
    root = tmp_path_factory.mktemp("hostile_datasets")
    rng = np.random.default_rng(3)
    _, store = build_store(str(root / "src.mmr"), "lowdim", make_episodes("lowdim", rng, 6, max_len=12), rng=rng)
    store.close()
    out = {}
    for fmt in ("d4rl", "d3rlpy"):
        out[fmt] = str(root / f"{fmt}.h5")
        export_dataset(str(root / "src.mmr"), out[fmt], fmt)
    pytest.importorskip("minari")
    out["minari"] = str(root / "ds")
    export_dataset(str(root / "src.mmr"), out["minari"], "minari", compression="none")
    return out


def _import_in_child(src: str, out: str, fmt: str, timeout: float = 120) -> str:
    """``import_dataset`` in a child process (a blocked open would hang this one: h5py opens holding the
    GIL, so no thread of the test could release it); its error message, or a test failure on a hang."""
    code = textwrap.dedent(f"""
        from mmreplay.datasets import import_dataset
        try:
            import_dataset({src!r}, {out!r}, {fmt!r})
        except (OSError, ValueError) as exc:
            print("refused:", type(exc).__name__, exc)
    """)
    try:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                              timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail(f"import of {src!r} hung (a FIFO opened?)")
    assert proc.returncode == 0 and "refused:" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy"])
def test_a_fifo_as_the_hdf5_file_is_refused_not_opened(tmp_path, fmt):
    src = str(tmp_path / "ds.h5")
    os.mkfifo(src)
    said = _import_in_child(src, str(tmp_path / "out.mmr"), fmt)
    assert src in said and "FIFO" in said
    assert not os.path.exists(tmp_path / "out.mmr")


@pytest.mark.parametrize("target", ["/dev/zero", "/dev/urandom"])
def test_an_hdf5_file_linked_to_a_device_is_refused(tmp_path, target):
    src = str(tmp_path / "ds.h5")
    os.symlink(target, src)
    with pytest.raises(ValueError, match=re.escape(f"{src!r} is a character device (a link to {target!r})")):
        import_dataset(src, str(tmp_path / "out.mmr"), "d4rl")


def test_the_cli_refuses_a_fifo_without_opening_it(tmp_path):
    src = str(tmp_path / "ds.h5")
    os.mkfifo(src)
    try:
        proc = subprocess.run([sys.executable, "-m", "mmreplay", "import", src, str(tmp_path / "o.mmr"), "--format",
                               "d4rl"], capture_output=True, text=True, cwd=REPO, timeout=120, check=False)
    except subprocess.TimeoutExpired:
        pytest.fail("mmreplay import hung on a FIFO")
    assert proc.returncode == 2 and "mmreplay import: error:" in proc.stderr and src in proc.stderr, proc.stderr
    assert "FIFO" in proc.stderr


def _copy_minari(exported, tmp_path) -> str:
    dst = str(tmp_path / "ds")
    shutil.copytree(exported["minari"], dst)
    return dst


def test_a_fifo_in_a_minari_dataset_is_refused_not_opened(exported, tmp_path):
    src = _copy_minari(exported, tmp_path)
    meta = os.path.join(src, "data", "metadata.json")
    os.unlink(meta)
    os.mkfifo(meta)
    said = _import_in_child(src, str(tmp_path / "out.mmr"), "minari")
    assert meta in said and "FIFO" in said


def test_a_minari_metadata_linked_to_dev_zero_is_refused_in_bounded_memory(exported, tmp_path):
    """It was read whole by Minari's ``json.load`` until MemoryError; in a child limited to 1 GiB more."""
    src = _copy_minari(exported, tmp_path)
    meta = os.path.join(src, "data", "metadata.json")
    os.unlink(meta)
    os.symlink("/dev/zero", meta)
    child = textwrap.dedent(f"""
        import resource, sys
        with open("/proc/self/status") as f:
            vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize"))
        resource.setrlimit(resource.RLIMIT_AS, (vm + (1 << 30), resource.getrlimit(resource.RLIMIT_AS)[1]))
        from mmreplay.datasets import import_dataset
        try:
            import_dataset({src!r}, {str(tmp_path / "out.mmr")!r}, "minari")
        except (OSError, ValueError) as exc:
            print("refused:", exc)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, cwd=REPO, timeout=300, check=False,
                          env={**os.environ, "MINARI_DATASETS_PATH": str(tmp_path / "root")})
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "refused:" in proc.stdout and meta in proc.stdout and "character device" in proc.stdout, proc.stdout


@pytest.mark.parametrize("key, flipped, said", [
    ("total_episodes", "total_episodeq", "'total_episodes'"),  # Minari raised KeyError('total_episodes')
    ("action_space", "action_spacg", ""),  # Minari's ``assert isinstance(env_spec_str, str)``: AssertionError
])
def test_a_minari_metadata_with_a_flipped_key_is_named(exported, tmp_path, key, flipped, said):
    src = _copy_minari(exported, tmp_path)
    meta = os.path.join(src, "data", "metadata.json")
    with open(meta) as f:
        text = f.read()
    assert f'"{key}"' in text
    with open(meta, "w") as f:
        f.write(text.replace(f'"{key}"', f'"{flipped}"'))
    with pytest.raises(ValueError, match=re.escape(f"minari dataset {src!r} cannot be read: {said}")) as info:
        import_dataset(src, str(tmp_path / "out.mmr"), "minari")
    assert isinstance(info.value.__cause__, (KeyError, AssertionError))


def test_a_big_minari_metadata_file_is_refused(exported, tmp_path, monkeypatch):
    from mmreplay.datasets import sources

    src = _copy_minari(exported, tmp_path)
    monkeypatch.setattr(sources, "MAX_METADATA_BYTES", 64)
    with pytest.raises(ValueError, match=r"metadata.json' holds [\d,]+ bytes, more than the 64"):
        import_dataset(src, str(tmp_path / "out.mmr"), "minari")


@pytest.mark.parametrize("fmt", ["d4rl", "d3rlpy"])
def test_a_truncated_hdf5_file_is_named(exported, tmp_path, fmt):
    src = str(tmp_path / "ds.h5")
    with open(exported[fmt], "rb") as f:
        data = f.read()
    with open(src, "wb") as f:
        f.write(data[: len(data) // 3])
    with pytest.raises(ValueError, match=re.escape(f"{fmt} dataset {src!r} cannot be read: Unable to")):
        import_dataset(src, str(tmp_path / "out.mmr"), fmt)


def test_damaged_hdf5_metadata_is_named_whatever_h5py_raises(tmp_path):
    """A bit flipped in the first bytes of a file: h5py raises OSError, RuntimeError ("bad object header
    version number") or KeyError depending on where; every one must come out naming the file."""
    clean = str(tmp_path / "clean.h5")
    with h5py.File(clean, "w", libver=("v110", "latest")) as f:
        f["observations"] = np.zeros((10, 4), np.float32)
        f["actions"] = np.zeros((10, 2), np.float32)
        f["rewards"] = np.zeros(10, np.float32)
        f["terminals"] = np.zeros(10, bool)
        f["timeouts"] = np.zeros(10, bool)
    with open(clean, "rb") as f:
        raw = f.read()
    src = str(tmp_path / "ds.h5")
    causes = set()
    for at in range(0, min(len(raw), 600), 3):
        damaged = bytearray(raw)
        damaged[at] ^= 0xFF
        with open(src, "wb") as f:
            f.write(damaged)
        out = tmp_path / f"out{at}.mmr"
        try:
            import_dataset(src, str(out), "d4rl", durable=False)
        except (OSError, ValueError) as exc:
            assert src in str(exc), f"byte {at}: {type(exc).__name__}: {exc}"
            causes.add(type(exc.__cause__).__name__)
        shutil.rmtree(out, ignore_errors=True)
    assert {"RuntimeError", "KeyError"} <= causes, causes  # else the case this test is about never happened


def _dqn_copy(tmp_path) -> str:
    dst = str(tmp_path / "dqn")
    shutil.copytree(DQN_FIXTURE, dst)
    return dst


def _rewrite_npy(path: str, header_text: bytes | None = None, rows: int | None = None) -> None:
    """Rewrite a gzip'd ``.npy``: its header bytes replaced, or its rows cut to ``rows``."""
    with gzip.open(path, "rb") as f:
        arr = np.load(io.BytesIO(f.read()), allow_pickle=False)
    raw = io.BytesIO()
    if header_text is not None:
        raw.write(b"\x93NUMPY\x01\x00" + len(header_text).to_bytes(2, "little") + header_text)
    else:
        arr = arr[:rows]
        np.save(raw, arr)
    with gzip.open(path, "wb") as f:
        f.write(raw.getvalue())


def test_a_damaged_npy_header_is_a_clear_error(tmp_path):
    src = _dqn_copy(tmp_path)
    path = os.path.join(src, "$store$_reward_ckpt.0.gz")
    _rewrite_npy(path, header_text=b"{'descr': '<f4', 'fortran_order': False, 'shape': (500,), }\n"[:40] + b"\n")
    with pytest.raises(ValueError, match=re.escape(path) + r".*not a gzip'd .npy array \(TokenError"):
        import_dataset(src, str(tmp_path / "out.mmr"), "dqn-replay")


def test_a_damaged_gzip_stream_in_the_header_is_a_clear_error(tmp_path):
    src = _dqn_copy(tmp_path)
    path = os.path.join(src, "$store$_action_ckpt.0.gz")
    with open(path, "wb") as f:  # a gzip header, then a deflate block of the reserved type 3: zlib.error
        f.write(bytes([0x1F, 0x8B, 8, 0, 0, 0, 0, 0, 0, 255]) + b"\x07" + bytes(64))
    with pytest.raises(ValueError, match=re.escape(path) + r".*not a gzip'd .npy array \(corrupt gzip data: "
                       r"(error|IsalError)"):
        import_dataset(src, str(tmp_path / "out.mmr"), "dqn-replay")


def test_a_dopamine_error_names_the_directory(tmp_path):
    src = _dqn_copy(tmp_path)
    _rewrite_npy(os.path.join(src, "$store$_action_ckpt.0.gz"), rows=100)
    with pytest.raises(ValueError, match=re.escape(f"dqn-replay dataset {src!r} cannot be read: checkpoint 0: "
                                                   "action has 100 rows")):
        import_dataset(src, str(tmp_path / "out.mmr"), "dqn-replay")


def test_naming_leaves_errors_that_name_a_file_and_our_own_alone():
    from mmreplay.errors import CorruptDataError

    with pytest.raises(FileNotFoundError) as info, naming("/d/x.h5", "d4rl"):
        raise FileNotFoundError(2, "No such file", "/elsewhere")
    assert info.value.filename == "/elsewhere"
    with pytest.raises(CorruptDataError, match="^shard 3$"), naming("/d/x.h5", "d4rl"):
        raise CorruptDataError("shard 3")
    with pytest.raises(FileExistsError, match="^cannot import into '/d/o.mmr'$"), naming("/d/x.h5", "d4rl", "/d/o.mmr"):
        raise FileExistsError("cannot import into '/d/o.mmr'")
    with pytest.raises(RuntimeError, match="^ours$"), naming("/d/x.h5", "d4rl"):
        raise RuntimeError("ours")  # not raised inside h5py: a bug of ours, passed on as it is
    with pytest.raises(ValueError, match=r"^d4rl dataset '/d/x.h5' cannot be read: bad$") as info, \
            naming("/d/x.h5", "d4rl"):
        raise ValueError("bad")
    assert str(info.value.__cause__) == "bad"


# -- the fuzzer ------------------------------------------------------------------------------------------
def test_fuzz_dataset_tree_quick(tmp_path):
    script = os.path.join(REPO, "scripts", "checks", "fuzz_dataset_tree.py")
    out = subprocess.run([sys.executable, script, "--trees", "48", "--seed", "5", "--work", str(tmp_path / "w"),
                          "--json", str(tmp_path / "summary.json"), "--quiet"], capture_output=True, text=True,
                         timeout=900, cwd=REPO, check=False)
    with open(tmp_path / "summary.json") as f:
        summary = json.load(f)
    assert out.returncode == 0 and summary["failures"] == [], out.stdout[-3000:] + out.stderr[-2000:]
    assert summary["imports"] == 48 + 12  # the CLI on every 4th tree
    assert set(summary["trees_by_format"]) == {"d4rl", "d3rlpy", "minari", "dqn-replay"}


def test_the_fuzzer_flags_wrong_rows_and_leftover_stores(tmp_path):
    """The worker's check itself: a successful import whose rows differ from the expected digest is BAD."""
    sys.path.insert(0, os.path.join(REPO, "scripts", "checks"))
    import fuzz_dataset_tree as fuzz

    src = _dqn_copy(tmp_path)
    out = str(tmp_path / "o.mmr")
    assert fuzz._import(src, "dqn-replay", out, "api", src, expected=None) == "ok"
    right = fuzz.digest(out)
    assert fuzz._import(src, "dqn-replay", str(tmp_path / "o2.mmr"), "api", src, expected=right) == "ok"
    wrong = fuzz._import(src, "dqn-replay", str(tmp_path / "o3.mmr"), "api", src, expected="0" * 64)
    assert wrong.startswith("BAD:wrong rows"), wrong
