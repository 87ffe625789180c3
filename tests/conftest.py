"""Fixtures and helpers shared by the test files (import helpers with ``from conftest import ...``)."""

import glob
import hashlib
import os
import subprocess
import sys
import time

import numpy as np
import pytest
from gymnasium import spaces

sys.path.insert(0, os.path.dirname(__file__))

import mmreplay  # noqa: E402
import synthetic as syn  # noqa: E402
from mmreplay.storage.format.layout import frame_layout  # noqa: E402

IMG = spaces.Box(0, 255, (6, 5), np.uint8)


def frame(v) -> np.ndarray:
    """A 6x5 frame of ``IMG`` whose every pixel is ``v`` (mod 256): its value names it."""
    return np.full((6, 5), v % 256, np.uint8)


def frame_shard_file(store, shard: int = 0, name: str = "obs") -> str:
    """The file of frame shard ``shard`` of observation ``name`` (zarr's default chunk key encoding)."""
    spec = next(s for s in store.schema.observations if s.name == name)
    frames = store.geometry.frames
    return frame_layout(spec, frames.rows, frames.shard_rows).shard_file(store.path, shard)


def encoder_children() -> list[int]:
    """Pids of this process's live shard-encoder children (``python -m mmreplay.storage.format.encoder``)."""
    pids = []
    for children in glob.glob(f"/proc/{os.getpid()}/task/*/children"):
        with open(children) as f:
            pids += [int(p) for p in f.read().split()]
    found = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                if b"mmreplay.storage.format.encoder" in f.read():
                    found.append(pid)
        except OSError:
            pass  # exited meanwhile
    return found



def wait_preloaded(store, timeout: float = 60.0) -> None:
    """Until the background pass that fills the compressed tier has ended (while it runs, misses read
    their chunks from the files)."""
    deadline = time.monotonic() + timeout
    while any(c["compressed"]["loading"] for c in store.inspect.cache_stats().values()):
        assert time.monotonic() < deadline, "the background pass did not end"
        time.sleep(0.01)


def pytest_configure(config):
    """In pytest-xdist's controller, before its workers start: the kernels compiled once (``warm_kernels.py``)
    rather than by every worker and child at once."""
    if hasattr(config, "workerinput") or not getattr(config.option, "numprocesses", None):
        return
    marker = _kernels_marker()
    if os.path.exists(marker):
        return  # compiled for these sources already: the workers read them from numba's cache
    # two at once, one core each: with the codec helpers (their job loop) and without (the direct calls)
    script = os.path.join(os.path.dirname(__file__), "warm_kernels.py")
    warming = [subprocess.Popen([sys.executable, script], env=env)
               for env in (os.environ, {**os.environ, "MMREPLAY_CODEC_THREADS": "0"})]
    if [p.wait() for p in warming] == [0, 0]:
        try:
            open(marker, "w").close()
        except OSError:
            pass  # a read-only install: warm again next time (numba then caches elsewhere)


def _kernels_marker() -> str:
    """A file next to numba's cache of the package whose name changes with any source of the package, the
    Python and the numba it was compiled for."""
    import numba

    root = os.path.dirname(mmreplay.__file__)
    digest = hashlib.sha256(f"{sys.version}|{numba.__version__}".encode())
    for folder, dirs, files in sorted(os.walk(root)):
        dirs.sort()
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(folder, name), "rb") as f:
                    digest.update(name.encode() + f.read())
    return os.path.join(root, "_native", "__pycache__", f"warm-kernels-{digest.hexdigest()[:16]}")


@pytest.fixture(scope="session", autouse=True)
def sb3_logs_in_the_session_tmp(tmp_path_factory):
    """Stable-Baselines3 makes an empty ``SB3-<time>`` folder in the system temp folder for each model's
    logger unless ``SB3_LOGDIR`` names one: keep them with the session's files (children inherit it)."""
    previous = os.environ.get("SB3_LOGDIR")
    os.environ["SB3_LOGDIR"] = str(tmp_path_factory.mktemp("sb3_logs"))
    yield
    if previous is None:
        os.environ.pop("SB3_LOGDIR", None)
    else:
        os.environ["SB3_LOGDIR"] = previous


@pytest.fixture
def store_path(tmp_path):
    return str(tmp_path / "store")


@pytest.fixture
def make_store(store_path):
    """Create a small image store (6x5 uint8 frames, 3 actions, clipped rewards)."""
    opened = []

    def make(capacity=200, frame_stack=4, obs_space=IMG, action_space=spaces.Discrete(3), **kw):
        kw.setdefault("reward_values", (-1, 0, 1))
        s = mmreplay.Store.create(store_path, obs_space, action_space, capacity=capacity, frame_stack=frame_stack,
                                  durable=False, **kw)
        opened.append(s)
        return s

    yield make
    for s in opened:
        s.close()


def record_random_steps(env, store, steps: int, seed: int = 0) -> None:
    """``steps`` random-action steps of ``env`` recorded into ``store`` (episodes reset as they end)."""
    from mmreplay.integrations.gymnasium import RecordToStore

    rec = RecordToStore(env, store)
    rec.reset(seed=seed)
    for _ in range(steps):
        _, _, terminated, truncated, _ = rec.step(env.action_space.sample())
        if terminated or truncated:
            rec.reset()


@pytest.fixture
def synthetic_store(store_path):
    """Make a store of ``synthetic.py``'s transitions (``n`` of them added), closed after the test."""
    opened = []

    def make(capacity=300, n=0, frame_stack=syn.FRAME_STACK, **kw):
        kw.setdefault("durable", False)
        s = mmreplay.Store.create(store_path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=capacity,
                                  frame_stack=frame_stack, reward_values=(-1, 0, 1), **kw)
        opened.append(s)
        for g in range(n):
            s.add(*syn.transition(g))
        return s

    yield make
    for s in opened:
        s.close()


@pytest.fixture
def one_torch_thread():
    """Small networks on a shared 2-core box: more torch threads only contend (SAC here: 218 s vs 13 s)."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture
def small_store(store_path):
    """A closed 300-transition store of 6x5 frames (frame stack 2), 6 complete episodes: for the CLI tests."""
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(3), capacity=500,
                               frame_stack=2, reward_values=(-1, 0, 1)) as s:
        for i in range(300):
            s.add(np.full((6, 5), i % 256, np.uint8), i % 3, 0, np.full((6, 5), (i + 1) % 256, np.uint8),
                  i % 50 == 49, False)
    return store_path
