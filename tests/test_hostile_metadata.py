"""Hostile metadata (tests/hostile.py): every field of zarr.json and of the commit record (with a matching
checksum, as an attacker would write it) set to absurd values. Each case must open and work, or raise one
of mmreplay's errors naming the file, within bounded time and memory: never a hang, a MemoryError or a
bare ValueError."""

import json
import os
import subprocess
import sys

import pytest

import mmreplay
import synthetic as syn
from mmreplay.sampling.strategy import Prioritized

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.mark.parametrize("capacity", [300, None])
def test_every_hostile_field_gives_a_clear_error_or_a_working_store(tmp_path, capacity):
    template = str(tmp_path / "template")
    with mmreplay.Store.create(template, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=capacity, frame_stack=3,
                               reward_values=(-1, 0, 1), durable=False) as s:
        for g in range(400):
            s.add(*syn.transition(g))
        next(s.sampler(8, Prioritized()))
    work = tmp_path / "work"
    work.mkdir()
    only = [] if capacity else ["record"]  # an unbounded store: the record's ring sizes are what differs
    # hostile.py bounds the address space (RLIMIT_AS). glibc reserves 64 MiB of it per malloc arena, one per
    # thread that allocates (up to 8 a core), reserved rather than used; with the threads of the previous case's
    # store still ending on a loaded machine, a case's new thread found no room ("can't start new thread",
    # ~1 run in 5 under two busy cores, before and after 2026-12-06's disk-path change). Two arenas keep the
    # bound about memory the cases use.
    env = {**os.environ, "MALLOC_ARENA_MAX": "2"}
    out = subprocess.run([sys.executable, os.path.join(HERE, "hostile.py"), template, str(work), *only],
                         capture_output=True, text=True, timeout=900, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    results = [json.loads(line) for line in out.stdout.splitlines()]
    assert len(results) > (150 if capacity else 80)
    bad = [r for r in results if not (r["outcome"] == "ok" or r["outcome"].startswith("clear:"))]
    assert bad == []
    clear = [r["outcome"] for r in results if r["outcome"].startswith("clear:")]
    # each names what is wrong: the file, the array, or the store
    assert [o for o in clear if not ("zarr.json" in o or "array '" in o or str(work) in o)] == []
