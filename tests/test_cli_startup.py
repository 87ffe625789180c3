"""``mmreplay info``, ``verify`` and ``export`` start without importing torch (issue 24, item 8): each runs
as the real command in a child process, which then lists the torch modules it loaded. Export reads frames
into numpy buffers (``BatchBuffers(numpy=True)``): checked here row by row against ``Store.get``'s tensors."""

import json
import os
import subprocess
import sys

import h5py
import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.sampling.batch import BatchBuffers

SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(mmreplay.__file__)))


def run_and_list_torch(*commands: list[str]) -> list[int]:
    """Run each command line through ``mmreplay.cli.main`` in one fresh interpreter; return their exit codes,
    asserting that no torch module was imported."""
    script = ("import contextlib, io, json, sys\n"
              "from mmreplay.cli import main\n"
              "codes = []\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              f"    for argv in {list(commands)!r}:\n"
              "        codes.append(main(argv))\n"
              "print(json.dumps([codes, sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.'))]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    codes, torch_modules = json.loads(proc.stdout.splitlines()[-1])
    assert torch_modules == []
    return codes


def test_export_does_not_import_torch(small_store, tmp_path):
    d4rl, d3rlpy = str(tmp_path / "out.hdf5"), str(tmp_path / "out_d3rlpy.hdf5")
    codes = run_and_list_torch(["export", small_store, d4rl, "--format", "d4rl"],
                               ["export", small_store, d3rlpy, "--format", "d3rlpy"])
    assert codes == [0, 0]
    # what the torch-free read wrote: every step's frame is the one the store was given (frame i % 256)
    with h5py.File(d4rl, "r") as f:
        obs, next_obs = f["observations"][:], f["next_observations"][:]
    assert obs.shape == (300, 6, 5)
    np.testing.assert_array_equal(obs[:, 0, 0], np.arange(300) % 256)
    np.testing.assert_array_equal(next_obs[:, 0, 0], (np.arange(300) + 1) % 256)
    assert (obs == obs[:, :1, :1]).all() and (next_obs == next_obs[:, :1, :1]).all()


def test_info_verify_and_export_together_do_not_import_torch(small_store, tmp_path):
    codes = run_and_list_torch(["info", small_store], ["info", small_store, "--json"], ["verify", small_store],
                               ["export", small_store, str(tmp_path / "out.hdf5"), "--format", "d4rl"])
    assert codes == [0, 0, 0, 0]


@pytest.mark.parametrize("padding", ["first", "zeros"])
def test_numpy_buffers_read_what_tensor_buffers_read(tmp_path, padding):
    """``store.inspect.get(ids, out=BatchBuffers(..., numpy=True))`` gives, field by field, what ``inspect.get`` gives
    as tensors: frame stacks (zero padding before an episode's first frame included), actions, rewards, flags."""
    with mmreplay.Store.create(str(tmp_path / "s"), spaces.Box(0, 255, (4, 3), np.uint8), spaces.Discrete(5),
                               capacity=400, frame_stack=3, stack_padding=padding) as s:
        for i in range(250):
            s.add(np.full((4, 3), i % 256, np.uint8), i % 5, float(i), np.full((4, 3), (i + 1) % 256, np.uint8),
                  i % 40 == 39, i % 90 == 89)
        ids = np.arange(*s.inspect.valid_range())
        want = s.inspect.get(ids)
        got = s.inspect.get(ids, out=BatchBuffers(s.schema, ids.size, numpy=True))
        with pytest.raises(ValueError, match="out holds 3 rows, expected"):
            s.inspect.get(ids, out=BatchBuffers(s.schema, 3, numpy=True))
    for name in ("obs", "next_obs", "action", "reward", "terminated", "truncated", "indices"):
        value = getattr(got, name)
        assert isinstance(value, np.ndarray), name
        np.testing.assert_array_equal(value, getattr(want, name).numpy(), err_msg=name)
    if padding == "zeros":
        assert (got.obs[:, 0] == 0).any()  # stacks at episode starts were padded, in the numpy buffers too


#: what numba loads at a process's first kernel call (its typing and lowering registries, ~0.5 s), never
#: on ``import numba``: a run that lists none of them called no compiled kernel
NUMBA_COMPILER_MODULES = ("numba.np.arraymath", "numba.np.npyimpl", "numba.core.typing.arraydecl")


def heavy_modules_loaded_by(argv: list[str]) -> list[str]:
    """Run ``mmreplay.cli.main(argv)`` in a fresh interpreter (exit code 0 asserted); the heavy modules it
    loaded: torch, zarr and numba's compiler."""
    script = ("import contextlib, io, json, sys\n"
              "from mmreplay.cli import main\n"
              "with contextlib.redirect_stdout(io.StringIO()):\n"
              f"    code = main({argv!r})\n"
              "heavy = [m for m in sys.modules if m.split('.')[0] in ('torch', 'zarr') "
              f"or m in {NUMBA_COMPILER_MODULES!r}]\n"
              "print(json.dumps([code, sorted(heavy)]))\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [SOURCE_ROOT, os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr
    code, heavy = json.loads(proc.stdout.splitlines()[-1])
    assert code == 0
    return heavy


def test_info_loads_neither_zarr_nor_torch_nor_numbas_compiler(tmp_path):
    """``mmreplay info`` on a frame-stacked store that wrapped (its valid count walks stacks at the ring's
    oldest end) reads the index in numpy: no compiled kernel runs, zarr is not imported (no prioritized
    sampler committed: nothing for zarr to read), nor torch."""
    path = str(tmp_path / "s")
    with mmreplay.Store.create(path, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(3), capacity=256,
                               frame_stack=4, reward_values=(-1, 0, 1)) as s:
        for i in range(700):
            s.add(np.full((6, 5), i % 256, np.uint8), i % 3, 0, np.full((6, 5), (i + 1) % 256, np.uint8),
                  i % 37 == 36, False)
    assert heavy_modules_loaded_by(["info", path]) == []
    assert heavy_modules_loaded_by(["info", path, "--json"]) == []
