"""The default budget under a memory limit leaves room for the process itself (issue 40, item 5): the limit
less the process's RSS when the store opens, less what opening and the first batches add, less a margin, at
most ``LIMIT_SHARE`` of the limit; a limit too small for that gets a small working budget and one warning.
The budget pays for everything the store holds for reading, its index ring included."""

import os
import subprocess
import sys
import warnings

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay import settings
from mmreplay.settings import (
    LIMIT_SHARE,
    MIB,
    MIN_CACHE_BYTES,
    MIN_LIMIT_MARGIN,
    OPEN_ALLOWANCE,
    Settings,
    budget_under_limit,
)

GIB = 1 << 30


@pytest.fixture
def limited(monkeypatch):
    """``limited(limit, rss)``: this process seems to run under ``limit`` bytes holding ``rss`` bytes."""
    def make(limit, rss, ram=64 * GIB):
        monkeypatch.setattr(settings, "memory_limit", lambda: limit)
        monkeypatch.setattr(settings, "_physical_memory", lambda: ram)
        monkeypatch.setattr(settings, "process_rss", lambda: rss)
        monkeypatch.setattr(settings, "_warned_small_limit", False)
    return make


@pytest.mark.parametrize("limit, rss, expected", [
    # 1 GiB, 300 MiB held: 1024 - 300 - 192 (opening, first batches) - 64 (1/16 of the limit) MiB
    (GIB, 300 * MIB, GIB - 300 * MIB - OPEN_ALLOWANCE - GIB // 16),
    # 600 MiB, 220 MiB held (imports, torch)
    (600 * MIB, 220 * MIB, 600 * MIB - 220 * MIB - OPEN_ALLOWANCE - 600 * MIB // 16),
    # 480 MiB, 100 MiB held: the margin is its 32 MiB floor
    (480 * MIB, 100 * MIB, 480 * MIB - 100 * MIB - OPEN_ALLOWANCE - MIN_LIMIT_MARGIN),
    # 16 GiB: never more than 70% of the limit (the trainer allocates after the store opens)
    (16 * GIB, 300 * MIB, int(LIMIT_SHARE * 16 * GIB)),
])
def test_the_default_budget_is_the_limit_less_the_process_and_a_margin(limited, limit, rss, expected):
    limited(limit, rss)
    assert budget_under_limit(limit, rss) == expected
    assert Settings().cache_bytes == expected
    assert Settings(cache_bytes=12345).cache_bytes == 12345  # an explicit value always wins


def test_the_machine_ram_binds_when_it_is_below_the_limit(limited):
    limited(64 * GIB, 200 * MIB, ram=2 * GIB)
    assert Settings().cache_bytes == budget_under_limit(2 * GIB, 200 * MIB)


def test_no_limit_is_one_gib(limited):
    limited(None, 5 * GIB)
    assert Settings().cache_bytes == 1024 * MIB


def test_a_limit_too_small_gets_a_small_budget_and_one_warning(limited):
    limited(400 * MIB, 250 * MIB)
    with pytest.warns(RuntimeWarning, match=r"memory limit of 400 MiB .* 250 MiB .* cache_bytes=32 MiB"):
        assert Settings().cache_bytes == MIN_CACHE_BYTES
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # once a process
        assert Settings().cache_bytes == MIN_CACHE_BYTES


def test_the_rss_baseline_is_this_process(limited):
    assert settings.process_rss() > 10 * MIB  # the interpreter, numpy, torch: far from 0
    with open("/proc/self/status") as f:
        rss = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))
    assert abs(settings.process_rss() - rss) < 64 * MIB


def test_the_budget_pays_for_the_index_ring(store_path):
    """Low-dim rows: the index ring is most of what the store holds. The tiers are planned from what the
    budget leaves after it, so ring + tiers stay within ``cache_bytes``."""
    budget = 12 * MIB
    obs = spaces.Box(-1, 1, (17,), np.float32)
    with mmreplay.Store.create(store_path, obs, spaces.Box(-1, 1, (6,), np.float32), capacity=100_000,
                               durable=False, cache_bytes=budget) as s:
        rng = np.random.default_rng(0)
        for lo in range(0, 60_000, 10_000):
            o = rng.standard_normal((10_000, 17)).astype(np.float32)
            s.extend(o, np.zeros((10_000, 6), np.float32), np.zeros(10_000, np.float32), o,
                     np.zeros(10_000, bool), np.arange(10_000) % 1000 == 999, streams=np.zeros(10_000, np.int64))
        s.flush()
        s.sample(256)
        reader, ring = s._state.reader, s._state.ring
        assert ring.nbytes > MIB  # the index is a real share of the budget here
        assert reader.plan.resident_bytes + reader.plan.decoded_bytes + ring.nbytes <= budget
        held = sum(c["compressed"]["capacity_bytes"] + c["capacity_bytes"] for c in s.inspect.cache_stats().values())
        assert held + ring.nbytes <= budget


CGROUP_V1 = "/sys/fs/cgroup/memory"


def _own_v1_memory_cgroup() -> str | None:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            if "memory" in controllers.split(","):
                return os.path.join(CGROUP_V1, path.lstrip("/"))
    return None


CHILD = """
import json, mmreplay, torch
from mmreplay import settings
print(json.dumps({"limit": settings.memory_limit(), "rss": settings.process_rss(),
                  "cache_bytes": mmreplay.Settings().cache_bytes}))
"""


@pytest.mark.skipif(os.geteuid() != 0 or not os.path.isdir(CGROUP_V1), reason="needs root and a cgroup v1 memory controller")
def test_a_child_in_a_real_cgroup_budgets_below_its_limit(tmp_path):
    """A child that joins a real 1 GiB memory cgroup sees the limit and its own RSS (imports, torch), and
    budgets what is left."""
    parent = _own_v1_memory_cgroup()
    if parent is None or not os.access(parent, os.W_OK):
        pytest.skip("no writable memory cgroup of our own")
    cg = os.path.join(parent, f"mmreplay_test_budget_{os.getpid()}")
    os.makedirs(cg)
    try:
        with open(os.path.join(cg, "memory.limit_in_bytes"), "w") as f:
            f.write(str(GIB))

        def join():
            with open(os.path.join(cg, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))

        out = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=120,
                             preexec_fn=join)
        assert out.returncode == 0, out.stderr[-2000:]
        import json
        got = json.loads(out.stdout.strip().splitlines()[-1])
        assert got["limit"] == GIB and got["rss"] > 50 * MIB
        assert got["cache_bytes"] == budget_under_limit(GIB, got["rss"]) or \
            abs(got["cache_bytes"] - budget_under_limit(GIB, got["rss"])) < 8 * MIB  # RSS read twice
        assert got["cache_bytes"] + got["rss"] + OPEN_ALLOWANCE < GIB
    finally:
        os.rmdir(cg)
