"""SIGKILL torture and concurrent readers, shared by the tests (short) and scripts/torture.py (long).

A writer child appends the deterministic transitions of ``synthetic`` and commits at random points,
printing each committed head; it is killed with SIGKILL at a random instant. The store is then
reopened and every valid transition is checked bit for bit; the next child continues from there.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np

import mmreplay
import synthetic as syn

HERE = os.path.dirname(os.path.abspath(__file__))

WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {here!r})
    import mmreplay, synthetic as syn
    path, seed, capacity = {path!r}, {seed}, {capacity}
    try:
        s = mmreplay.Store.open(path, commit_every=10**9, commit_seconds=1e9, durable={durable})
    except mmreplay.NotAStoreError:
        s = mmreplay.Store.create(path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=capacity,
                                  frame_stack=syn.FRAME_STACK, reward_values=(-1, 0, 1), commit_every=10**9,
                                  commit_seconds=1e9, durable={durable}, frame_codec={frame_codec!r})
    rng = np.random.default_rng(seed)
    g = s.num_added
    print("start", g, flush=True)
    while True:
        for _ in range(int(rng.integers(1, {max_batch}))):
            s.add(*syn.transition(g))
            g += 1
        s.flush()
        print("committed", g, flush=True)
""")


def check_store(path: str, capacity: int, in_flight: int = 0) -> tuple[int, int]:
    """Reopen, check every valid transition bit for bit; returns (head, number checked).

    A crash right after an overwrite commit (written before a shard of the previous lap is replaced)
    finds the oldest transitions that the writes in flight were about to overwrite already given up:
    up to a shard plus ``in_flight`` uncommitted adds. Every other commit keeps exactly ``capacity``."""
    with mmreplay.Store.open(path, mode="r") as s:
        oldest, head = s.valid_range()
        lo = max(0, head - capacity)
        assert lo <= oldest <= lo + s.geometry.transitions.shard_rows + in_flight, (oldest, head)
        ids = [g for g in range(oldest, head) if syn.needs(g) >= oldest]
        assert len(s) == len(ids), (len(s), len(ids))
        for lo in range(0, len(ids), 512):
            syn.check_batch(s.get(ids[lo:lo + 512]))
        return head, len(ids)


def kill_trials(path: str, trials: int, capacity: int = 300, seed: int = 0, max_delay: float = 0.4,
                max_batch: int = 80, log=print) -> list[tuple[int, int]]:
    rng = np.random.default_rng(seed)
    results = []
    last_head = 0
    for trial in range(trials):
        code = WRITER.format(here=HERE, path=path, seed=seed * 1000 + trial, capacity=capacity, max_batch=max_batch,
                             durable=True, frame_codec="lz4hc")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True)
        first = proc.stdout.readline()  # the child is up (imports done): kill it at a random instant now
        assert first.startswith("start"), (first, proc.stderr.read())
        early = []
        if trial % 2:  # every other trial, once it committed (a loaded machine may take longer to get there)
            early.append(proc.stdout.readline())
        time.sleep(float(rng.uniform(0, max_delay)))
        proc.send_signal(signal.SIGKILL)
        out, _ = proc.communicate()
        committed = [int(line.split()[1]) for line in early + out.splitlines() if line.startswith("committed")]
        reported = committed[-1] if committed else int(first.split()[1])
        head, checked = check_store(path, capacity, in_flight=2 * max_batch)
        assert head >= reported >= last_head, (head, reported, last_head)  # nothing committed was lost
        log(f"trial {trial}: killed after commit of {reported}, reopened at {head}, {checked} transitions "
            "checked bit-exact")
        results.append((head, checked))
        last_head = head
    return results


READER = textwrap.dedent("""
    import sys, time
    sys.path.insert(0, {here!r})
    import mmreplay, synthetic as syn
    s = mmreplay.Store.open({path!r}, mode="r", cache_bytes=1 << 20)
    heads, batches, deadline = set(), 0, time.monotonic() + {seconds}
    sampler = s.sampler(64, prefetch=0, seed=1)
    while time.monotonic() < deadline:
        s.refresh()
        heads.add(s.valid_range()[1])
        if len(s):
            syn.check_batch(next(sampler))
            batches += 1
    print("ok", batches, len(heads), flush=True)
""")


def concurrent_readers(path: str, readers: int = 2, seconds: float = 4.0, capacity: int = 300) -> list[str]:
    """One writer child (committing often, wrapping the ring) and ``readers`` reader children that keep
    refreshing and sampling; every batch a reader gets is checked bit for bit."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(here=HERE, path=path, seed=7, capacity=capacity,
                                                                   max_batch=20, durable=True, frame_codec="lz4hc")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert writer.stdout.readline().startswith("start")
    procs = [subprocess.Popen([sys.executable, "-c", READER.format(here=HERE, path=path, seconds=seconds)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(readers)]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=seconds + 120)
        assert p.returncode == 0, err
        outputs.append(out.strip())
    writer.send_signal(signal.SIGKILL)
    writer.communicate()
    return outputs


RACE_READER = textwrap.dedent("""
    import json, sys, time
    import numpy as np
    sys.path.insert(0, {here!r})
    import mmreplay, synthetic as syn
    while True:
        try:
            s = mmreplay.Store.open({path!r}, mode="r", cache_bytes={cache_bytes})
            break
        except mmreplay.NotAStoreError:
            time.sleep(0.01)
    rng = np.random.default_rng({seed})
    rows = wrong = refused = batches = 0
    examples, heads = [], set()
    sampler = s.sampler({batch}, prefetch=0, seed={seed})
    deadline = time.monotonic() + {seconds}
    while time.monotonic() < deadline:
        s.refresh()
        oldest, head = s.valid_range()
        heads.add(head)
        if len(s) < {batch}:
            continue
        try:
            if batches % 2:
                b = next(sampler)
            else:  # get() of ids valid in this reader's view (the writer may give them up meanwhile)
                ids = [g for g in rng.integers(oldest, head, {batch}).tolist() if syn.needs(g) >= oldest]
                if not ids:
                    continue
                b = s.get(ids)
        except IndexError:
            refused += 1  # the writer overwrote what we asked for: a clear error, not wrong data
            continue
        bad = syn.wrong_rows(b)
        rows += len(b.indices)
        wrong += len(bad)
        examples.extend(bad[: max(0, 5 - len(examples))])
        batches += 1
    print(json.dumps(dict(rows=rows, wrong=wrong, refused=refused, batches=batches, heads=len(heads),
                          examples=examples)), flush=True)
""")


def reader_race(path: str, readers: int = 2, seconds: float = 10.0, capacity: int = 200, batch: int = 64,
                max_commit_batch: int = 30, cache_bytes: int = 1 << 16, frame_codec: str = "lz4hc") -> list[dict]:
    """One writer child on a wrapping ring, committing every 1..``max_commit_batch`` adds, and ``readers``
    reader children refreshing, sampling and ``get``-ing as fast as they can for ``seconds``, each row
    checked against the ground truth. Returns each reader's counts (rows, wrong, refused, ...); a tiny
    cache (``cache_bytes``) keeps the readers going to the files, where the races are."""
    import json

    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(here=HERE, path=path, seed=11, capacity=capacity,
                                                                   max_batch=max_commit_batch, durable=False,
                                                                   frame_codec=frame_codec)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        procs = [subprocess.Popen([sys.executable, "-c", RACE_READER.format(
            here=HERE, path=path, seconds=seconds, seed=100 + i, batch=batch, cache_bytes=cache_bytes)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(readers)]
        results = []
        for p in procs:
            out, err = p.communicate(timeout=seconds + 300)
            assert p.returncode == 0, err[-3000:]
            results.append(json.loads(out.strip().splitlines()[-1]))
    finally:
        writer.kill()
        writer.communicate()
    return results
