"""SIGKILL torture and concurrent readers, shared by the tests (short) and scripts/checks/torture.py (long).

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
        oldest, head = s.inspect.valid_range()
        lo = max(0, head - capacity)
        assert lo <= oldest <= lo + s.geometry.transitions.shard_rows + in_flight, (oldest, head)
        ids = [g for g in range(oldest, head) if syn.needs(g) >= oldest]
        assert len(s) == len(ids), (len(s), len(ids))
        for lo in range(0, len(ids), 512):
            syn.check_batch(s.inspect.get(ids[lo:lo + 512]))
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
    hard = deadline + 10 * {seconds} + 60  # a loaded machine: go on until the writer was seen progressing
    sampler = s.sampler(64, prefetch=0, seed=1)
    while time.monotonic() < deadline or ((batches <= {min_batches} or len(heads) <= 1) and time.monotonic() < hard):
        s.refresh()
        heads.add(s.inspect.valid_range()[1])
        if len(s) < 64:  # the writer's first commits: fewer transitions than a batch
            continue
        try:
            batch = next(sampler)
        except ValueError as exc:  # the sampler's view (refreshed after ours) holds fewer valid rows than a batch
            if "larger than the store" not in str(exc):
                raise
            continue
        except RuntimeError as exc:  # a reader slower than its writer gave up a batch (seen under load 27): a clear
            if "kept overwriting" not in str(exc):  # error, not wrong data; the rows it does return are checked
                raise
            continue
        syn.check_batch(batch)
        batches += 1
    print("ok", batches, len(heads), flush=True)
""")


def concurrent_readers(path: str, readers: int = 2, seconds: float = 4.0, capacity: int = 300,
                       min_batches: int = 0) -> list[str]:
    """One writer child (committing often, wrapping the ring) and ``readers`` reader children that keep
    refreshing and sampling; every batch a reader gets is checked bit for bit. Each reader runs for
    ``seconds``, and on a slow (loaded) machine on until it read ``min_batches`` and saw two heads."""
    writer = subprocess.Popen([sys.executable, "-c", WRITER.format(here=HERE, path=path, seed=7, capacity=capacity,
                                                                   max_batch=20, durable=True, frame_codec="lz4hc")],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert writer.stdout.readline().startswith("start")
    procs = [subprocess.Popen([sys.executable, "-c", READER.format(here=HERE, path=path, seconds=seconds,
                                                                    min_batches=min_batches)],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(readers)]
    outputs = []
    for p in procs:
        out, err = p.communicate(timeout=11 * seconds + 200)
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
    s = mmreplay.Store.open({path!r}, mode="r", cache_bytes={cache_bytes})  # the writer made it before we started
    rng = np.random.default_rng({seed})
    rows = wrong = refused = overtaken = batches = 0
    examples, heads = [], set()
    sampler = s.sampler({batch}, prefetch=0, seed={seed})
    # Counted, not timed: on until {min_rows} rows were checked across three heads (and, for the long runs of
    # scripts/checks/torture.py, {seconds} s). The guard only ends a reader that makes no progress (a hang).
    start = time.monotonic()
    guard_hit = False
    while rows < {min_rows} or len(heads) < 3 or time.monotonic() < start + {seconds}:
        if time.monotonic() > start + {seconds} + {guard}:
            guard_hit = True
            break
        s.refresh()
        oldest, head = s.inspect.valid_range()
        heads.add(head)
        if len(s) < {batch}:
            continue
        how = "sample" if batches % 2 else "get"
        try:
            if how == "sample":
                b = next(sampler)
            else:  # get() of ids valid in this reader's view (the writer may give them up meanwhile)
                ids = [g for g in rng.integers(oldest, head, {batch}).tolist() if syn.needs(g) >= oldest]
                if not ids:
                    continue
                b = s.inspect.get(ids)
        except IndexError:
            refused += 1  # the writer overwrote what we asked for: a clear error, not wrong data
            continue
        except ValueError as exc:  # the sampler's view (refreshed after ours) holds fewer valid rows than a batch
            if "larger than the store" not in str(exc):
                raise
            continue
        except RuntimeError as exc:
            if "kept overwriting" not in str(exc):
                raise
            overtaken += 1  # a reader slower than its writer (a loaded machine) gave up a batch: not wrong data
            continue
        bad = syn.wrong_rows(b)
        rows += len(b.indices)
        wrong += len(bad)
        examples.extend(f"{{how}} of view [{{oldest}}, {{head}}): {{row}}" for row in bad[: max(0, 5 - len(examples))])
        batches += 1
    disk = s.inspect.cache_stats()["obs"]["disk"]
    print(json.dumps(dict(rows=rows, wrong=wrong, refused=refused, overtaken=overtaken, batches=batches,
                          heads=len(heads), guard_hit=guard_hit, seconds=round(time.monotonic() - start, 1),
                          examples=examples, file_reads=disk["reads"], partial_chunks=disk.get("partial_chunks"),
                          partial_retries=disk.get("partial_retries"))), flush=True)
""")

RACE_GUARD_SECONDS = 900  # a reader with no progress for this long has hung: far beyond any loaded machine


def reader_race(path: str, readers: int = 2, seconds: float = 0.0, capacity: int = 200, batch: int = 64,
                max_commit_batch: int = 30, cache_bytes: int = 1 << 16, frame_codec: str = "lz4hc",
                min_rows: int = 0) -> list[dict]:
    """One writer child on a wrapping ring, committing every 1..``max_commit_batch`` adds, and ``readers``
    reader children refreshing, sampling and ``get``-ing as fast as they can, each row checked against the
    ground truth, until each checked ``min_rows`` rows and saw three heads (and ran ``seconds``: the long
    runs of scripts/checks/torture.py). Counted, never timed: a loaded machine takes longer, it does not fail.
    Returns each reader's counts (rows, wrong, refused, overtaken, guard_hit, examples of wrong rows...); a
    tiny cache (``cache_bytes``) keeps the readers going to the files, where the races are."""
    import json
    import tempfile

    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        writer = subprocess.Popen([sys.executable, "-c", WRITER.format(
            here=HERE, path=path, seed=11, capacity=capacity, max_batch=max_commit_batch, durable=False,
            frame_codec=frame_codec)], stdout=out, stderr=err, text=True)
        try:
            _wait_for_start(writer, out, err)
            procs = [subprocess.Popen([sys.executable, "-c", RACE_READER.format(
                here=HERE, path=path, seconds=seconds, seed=100 + i, batch=batch, cache_bytes=cache_bytes,
                min_rows=min_rows, guard=RACE_GUARD_SECONDS)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(readers)]
            results = []
            for p in procs:
                stdout, stderr = p.communicate(timeout=seconds + RACE_GUARD_SECONDS + 300)
                assert p.returncode == 0, f"reader exited with {p.returncode}:\n{stderr[-3000:]}"
                results.append(json.loads(stdout.strip().splitlines()[-1]))
            assert writer.poll() is None, f"the writer died: {_tail(err)}"
        finally:
            writer.kill()
            writer.wait()
    return results


def _tail(f, n: int = 3000) -> str:
    f.seek(0)
    return f.read()[-n:]


def _wait_for_start(writer: subprocess.Popen, out, err, timeout: float = RACE_GUARD_SECONDS) -> None:
    """Until the writer child made (or opened) the store and said so; readers open it only then."""
    deadline = time.monotonic() + timeout
    while True:
        out.seek(0)
        if out.readline().startswith("start"):
            return
        assert writer.poll() is None, f"the writer died before it started: {_tail(err)}"
        assert time.monotonic() < deadline, "the writer did not start"
        time.sleep(0.05)


# -- resume: a wrapped store reopened, added to and sampled at once, the background loader in flight ------------

RESUME_SHAPE = (32, 32)  # an image (one frame a chunk: the compressed tier decodes straight into batches)
RESUME_STACK = 4
RESUME_EPISODE = 100  # transition g ends an episode when g % 100 == 99


def resume_frames(ids) -> np.ndarray:
    """Frame ``f`` of the resume stores, for every id in ``ids``: runs of 8 pixels of one of four gray
    levels (compresses ~5x, like Atari frames), a function of ``f`` alone. Vectorized: checking millions
    of rows must not cost more than reading them."""
    ids = np.asarray(ids, dtype=np.uint64).reshape(-1)
    pos = np.arange(RESUME_SHAPE[0] * RESUME_SHAPE[1] // 8, dtype=np.uint64)
    with np.errstate(over="ignore"):
        h = ids[:, None] * np.uint64(0x9E3779B97F4A7C15) + (pos + np.uint64(1)) * np.uint64(0xBF58476D1CE4E5B9)
        h ^= h >> np.uint64(31)
        h *= np.uint64(0x94D049BB133111EB)
        h ^= h >> np.uint64(29)
    levels = ((h & np.uint64(3)) * np.uint64(60)).astype(np.uint8).reshape(-1, RESUME_SHAPE[0], RESUME_SHAPE[1] // 8)
    return np.repeat(levels, 8, axis=2)


def resume_transition(g: int):
    """Transition ``g``: obs is frame ``g``, next_obs frame ``g + 1``, episodes of ``RESUME_EPISODE``."""
    pair = resume_frames([g, g + 1])
    return pair[0], g % 4, float(g % 3 - 1), pair[1], g % RESUME_EPISODE == RESUME_EPISODE - 1, False


def resume_expected(ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The true obs and next_obs stacks of transitions ``ids``: frames ``g-3..g`` (not before the episode's
    first), and the same shifted by one with frame ``g + 1`` last."""
    ids = np.asarray(ids, dtype=np.int64)
    start = ids - ids % RESUME_EPISODE
    stack = np.maximum(ids[:, None] + np.arange(1 - RESUME_STACK, 1)[None, :], start[:, None])
    frame_ids = np.concatenate([stack, ids[:, None] + 1], axis=1)
    frames = resume_frames(frame_ids).reshape(len(ids), RESUME_STACK + 1, *RESUME_SHAPE)
    return frames[:, :RESUME_STACK], frames[:, 1:]


def resume_wrong_rows(batch) -> list[int]:
    """Transitions of ``batch`` whose obs, next_obs, action or reward differ from the ground truth."""
    ids = batch.indices.numpy().astype(np.int64)
    want_obs, want_next = resume_expected(ids)
    n = len(ids)
    ok = (batch.obs.numpy() == want_obs).reshape(n, -1).all(axis=1)
    ok &= (batch.next_obs.numpy() == want_next).reshape(n, -1).all(axis=1)
    ok &= batch.action.numpy().reshape(n) == ids % 4
    ok &= batch.reward.numpy().reshape(n) == (ids % 3 - 1)
    return ids[~ok].tolist()


def resume_create(path: str, capacity: int, laps: float = 1.5, **kw) -> int:
    """A resume store whose frame ring went round ``laps`` times; returns the transitions added."""
    from gymnasium import spaces
    with mmreplay.Store.create(path, spaces.Box(0, 255, RESUME_SHAPE, np.uint8), spaces.Discrete(4),
                               capacity=capacity, frame_stack=RESUME_STACK, durable=False, **kw) as s:
        frame_rows = s.geometry.frames.rows
        n = int(frame_rows * laps)
        for g in range(n):
            s.add(*resume_transition(g))
        return n


def resume_budget(path: str) -> int:
    """A budget whose compressed share holds the whole frame ring (measured from its files) but whose
    decoded share holds few frames: frames are then decoded from the compressed tier straight into
    batches, the path a stale shard in that tier would corrupt."""
    from mmreplay.reading.tiers import MAX_RESIDENT_SHARE
    with mmreplay.Store.open(path, mode="r", cache_bytes=1 << 30) as s:
        need = s.inspect.cache_stats()["obs"]["compressed"]["capacity_bytes"]
    return int(need / MAX_RESIDENT_SHARE) + 64


def resume_cycle(path: str, budget: int, adds: int, readers: int = 2, batch: int = 256, seed: int = 0) -> dict:
    """Reopen the store (its background loader starts), then at once: a writer thread adds ``adds``
    transitions while ``readers`` threads read the newest transitions back and sample, every row checked.
    Returns counts: rows, wrong, refused (ids given up between ``valid_range`` and ``get``), examples."""
    import threading

    counts = {"rows": 0, "wrong": 0, "refused": 0, "examples": []}
    lock = threading.Lock()
    done = threading.Event()
    errors: list[BaseException] = []
    with mmreplay.Store.open(path, cache_bytes=budget, commit_every=10**9, commit_seconds=1e9, durable=False) as s:
        first = s.num_added

        def write():
            try:
                for g in range(first, first + adds):
                    s.add(*resume_transition(g))
            except BaseException as exc:  # reported by the caller
                errors.append(exc)
            finally:
                done.set()

        def read(i: int):
            rng = np.random.default_rng([seed, i])
            try:
                while True:
                    finished = done.is_set()  # one more round after the writer stopped
                    oldest, head = s.inspect.valid_range()
                    newest = np.arange(max(oldest + RESUME_STACK, head - batch), head)
                    try:
                        got = [s.inspect.get(newest)] if newest.size else []
                        if head - oldest >= batch:
                            got.append(s.sample(batch, seed=int(rng.integers(1 << 31))))
                    except IndexError:  # the writer gave those ids up meanwhile: refused, not wrong
                        with lock:
                            counts["refused"] += 1
                        continue
                    for b in got:
                        bad = resume_wrong_rows(b)
                        with lock:
                            counts["rows"] += len(b.indices)
                            counts["wrong"] += len(bad)
                            counts["examples"] += bad[:max(0, 5 - len(counts["examples"]))]
                    if finished:
                        return
            except BaseException as exc:
                errors.append(exc)

        threads = [threading.Thread(target=write)] + [threading.Thread(target=read, args=(i,)) for i in range(readers)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    if errors:
        raise errors[0]
    return counts


def resume_trials(path: str, seconds: float, capacity: int = 2000, readers: int = 2, adds: int | None = None,
                  log=print) -> dict:
    """``resume_cycle`` over and over for ``seconds`` on one store (created wrapped), alternating the thread
    and the process shard encoder. Returns the summed counts and the number of cycles."""
    import time

    n = resume_create(path, capacity)
    budget = resume_budget(path)
    total = {"rows": 0, "wrong": 0, "refused": 0, "examples": [], "cycles": 0, "added": n}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        thread_encoder = total["cycles"] % 2 == 0
        previous = os.environ.get("MMREPLAY_ENCODER")
        os.environ["MMREPLAY_ENCODER"] = "thread" if thread_encoder else "process"
        try:
            c = resume_cycle(path, budget, adds or capacity // 4, readers=readers, seed=total["cycles"])
        finally:
            if previous is None:
                os.environ.pop("MMREPLAY_ENCODER")
            else:
                os.environ["MMREPLAY_ENCODER"] = previous
        total["cycles"] += 1
        total["added"] += adds or capacity // 4
        for key in ("rows", "wrong", "refused"):
            total[key] += c[key]
        total["examples"] += c["examples"][:max(0, 5 - len(total["examples"]))]
        log(f"cycle {total['cycles']} ({'thread' if thread_encoder else 'process'} encoder): {c['rows']:,} rows "
            f"checked, {c['wrong']} wrong, {c['refused']} refused")
    return total
