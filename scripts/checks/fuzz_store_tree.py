"""Checks that hostile store trees never hang, never write outside the store, stay in memory, and fail clearly.

Each tree is a copy of one small valid store with one to three entries replaced: by a FIFO, a symbolic
link out of the store (to a file, or to a copy of the entry itself, so that reads through it would even
succeed), a link to another entry of the store, a dangling link, a link to ``/dev/zero`` or ``/dev/urandom``,
a character device made with ``mknod`` (as root), a directory where a file is (or a file where a directory
is), a file truncated or extended (its size lies), or a link planted at the temporary name an older
``atomic_write`` used. On each tree a worker process runs what a user runs: open and sample (every returned
row compared with the ground truth), ``inspect.get``, ``verify()``, ``info()``, an append with a flush, and
the CLI's ``mmreplay info`` and ``mmreplay verify``. A tree fails the check when

- the worker does not answer within ``--timeout`` seconds (a hang: the worker is killed and restarted);
- anything outside the tree changed: a directory the links point into and a sentinel directory are hashed
  before and after (names, types, bytes, link targets);
- the worker's peak RSS during the tree grew more than twice the store's cache budget over its RSS before;
- an operation raised anything but mmreplay's errors, or an ``OSError``/``ValueError`` whose message names a
  path of the tree, or returned a row that differs from the ground truth.

Fast by design: one long-lived worker (no fork per tree) reads tree paths on stdin and answers one JSON line
per tree; trees are made and checked by this process while the worker runs.

    python scripts/checks/fuzz_store_tree.py --trees 10000 --seed 1 [--jobs 2] [--work DIR] [--json OUT]

Prints a summary (trees, operations, failures by kind, wall time) and exits 1 if any tree failed.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import os
import random
import resource
import select
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BUDGET = 32 << 20  # the store's cache budget in the worker: RSS may grow at most twice this during a tree
TEMPLATE_ROWS = 400
CLI_EVERY = 4  # the CLI's info and verify repeat what the API ran: on every 4th tree (each opens the store again)
APPEND_ROWS = 70  # past a transition shard (64 rows at capacity 300): the append writes shard files
KINDS = ["fifo", "link_out_file", "link_out_copy", "link_in", "dangling", "dev_zero", "dev_urandom", "mknod",
         "swap_type", "truncate", "extend", "tmp_link"]
KEY_ENTRIES = ["zarr.json", "commit", "commit/zarr.json", "frames", "frames/obs", "frames/obs/zarr.json",
               "frames/obs/c", "transitions"]


# -- the worker ---------------------------------------------------------------------------------------
def worker_main() -> int:
    """Read {"tree": path} lines, answer {"ops": {name: outcome}, "rss_growth": bytes} lines."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (the CLI's, zarr's) must not corrupt the protocol
    sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
    import mmreplay  # noqa: F401  (warm: imports, numba kernels)

    def answer(doc):
        proto.write(json.dumps(doc) + "\n")
        proto.flush()

    template = sys.stdin.readline().strip()
    warm = tempfile.mkdtemp(prefix="fuzz-warm-")
    try:  # compile and import everything once, outside the measured trees, on a copy (the append changes it)
        for k in range(2):
            shutil.copytree(template, os.path.join(warm, str(k)), symlinks=True)
            run_tree(os.path.join(warm, str(k)))
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + (2 << 30), hard))  # an unbounded read dies here
    answer({"ready": os.getpid()})
    for line in sys.stdin:
        job = json.loads(line)
        before = _status("VmRSS")
        _reset_peak()
        ops = run_tree(job["tree"], cli=job.get("cli", True))
        answer({"ops": ops, "rss_growth": _status("VmHWM") - before})
    return 0


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(field + ":"))


def _reset_peak() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:  # "5": reset this process's peak RSS (VmHWM)
            f.write("5")
    except OSError:
        pass


class WrongRows(Exception):
    pass


def run_tree(tree: str, cli: bool = True) -> dict[str, str]:
    ops = {}
    ops["read"] = _outcome(tree, lambda: _read_ops(tree))
    ops["append"] = _outcome(tree, lambda: _append_ops(tree))
    for command in ("info", "verify") if cli else ():
        ops[f"cli_{command}"] = _cli(tree, command)
    return ops


def _read_ops(tree: str) -> None:
    import mmreplay
    import synthetic as syn

    with mmreplay.Store.open(tree, mode="r", cache_bytes=BUDGET) as s:
        n = len(s)
        s.info()
        if n:
            _check_batch(s.sample(min(8, n), seed=0), syn)
            _, head = s.inspect.valid_range()
            _check_batch(s.inspect.get([head - 1]), syn)
        s.verify()


def _append_ops(tree: str) -> None:
    import mmreplay
    import synthetic as syn

    with mmreplay.Store.open(tree, mode="a", cache_bytes=BUDGET, durable=False) as s:  # fsyncs: not the point
        _, head = s.inspect.valid_range()
        for g in range(head, head + APPEND_ROWS):
            s.add(*syn.transition(g))
        s.flush()


def _check_batch(batch, syn) -> None:
    """Every row returned must be the ground truth of its id (synthetic.py: a function of the id alone)."""
    for i, g in enumerate(batch.indices.tolist()):
        obs, next_obs = syn.expected_stack(int(g))
        if not ((batch.obs[i].numpy() == obs).all() and (batch.next_obs[i].numpy() == next_obs).all()
                and int(batch.action[i]) == syn.action(int(g)) and float(batch.reward[i]) == syn.reward(int(g))):
            raise WrongRows(f"row of transition {int(g)} differs from the ground truth")


def _outcome(tree: str, op) -> str:
    import mmreplay

    try:
        op()
        return "ok"
    except WrongRows as exc:
        return f"BAD:wrong rows: {exc}"
    except mmreplay.MMReplayError as exc:
        return f"clear:{type(exc).__name__}: {exc}"[:400]
    except (OSError, ValueError) as exc:
        text = f"{exc} {getattr(exc, 'filename', '') or ''}"
        kind = "clear" if tree in text else "BAD:unnamed"
        return f"{kind}:{type(exc).__name__}: {text}"[:400]
    except BaseException as exc:  # noqa: BLE001 - what the fuzzer is looking for
        import traceback

        return f"BAD:{type(exc).__name__}: {exc} | {traceback.format_exc()[-600:]}"[:1000]


def _cli(tree: str, command: str) -> str:
    from mmreplay.cli.main import main

    out, err = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = main([command, tree])
    except SystemExit as exc:
        rc = exc.code
    except BaseException as exc:  # noqa: BLE001
        import traceback

        return f"BAD:{type(exc).__name__}: {exc} | {traceback.format_exc()[-600:]}"[:1000]
    if rc == 0 or (command == "verify" and rc == 1):
        return "ok" if rc == 0 else f"clear:problems: {out.getvalue()[-200:]}"
    if rc == 2 and "error:" in err.getvalue():
        return f"clear:rc2: {err.getvalue().strip()[-300:]}"
    return f"BAD:rc{rc}: {err.getvalue()[-300:]}"


# -- trees ----------------------------------------------------------------------------------------------
def build_template(path: str) -> None:
    sys.path[:0] = [os.path.join(REPO, "tests"), REPO]
    import mmreplay
    import synthetic as syn
    from mmreplay.sampling.strategy import Prioritized

    with mmreplay.Store.create(path, syn.OBS_SPACE, syn.ACTION_SPACE, capacity=300, frame_stack=3,
                               reward_values=(-1, 0, 1), durable=False, cache_bytes=BUDGET) as s:
        for g in range(TEMPLATE_ROWS):
            s.add(*syn.transition(g))
        next(s.sampler(8, Prioritized(), seed=0))  # a priority set: its files are entries too
        s.flush()


def entries(root: str) -> list[str]:
    out = []
    for d, dirs, files in os.walk(root):
        for name in dirs + files:
            out.append(os.path.relpath(os.path.join(d, name), root))
    return sorted(out)


def mutate(tree: str, rel: str, kind: str, outside: str, rng: random.Random, worker_pids: list[int]) -> str:
    """Apply one hostile change to entry ``rel`` of ``tree``; returns what was done (for the report)."""
    path = os.path.join(tree, rel)
    if not os.path.lexists(path):
        return f"{kind}:{rel}:gone"
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    if kind == "truncate" or kind == "extend":
        if is_dir or not os.path.isfile(path) or os.path.islink(path):
            kind = "fifo"
        else:
            size = os.path.getsize(path)
            shutil.copy2(path, path + ".own")  # not the template's inode (the tree is hard-linked to it)
            os.replace(path + ".own", path)
            with open(path, "r+b") as f:
                if kind == "truncate":
                    f.truncate(rng.randrange(size) if size else 0)
                else:
                    f.seek(0, os.SEEK_END)
                    f.write(rng.randbytes(rng.choice([1, 16, 4096, 65536])))
            return f"{kind}:{rel}"
    if kind == "tmp_link":
        target = os.path.join(outside, "files", "victim")
        for pid in worker_pids:
            with contextlib.suppress(OSError):
                os.symlink(target, f"{path}.tmp-{pid}")
        return f"{kind}:{rel}"
    if kind == "link_out_copy":
        mirror = os.path.join(outside, "mirror", f"{rng.getrandbits(48):012x}")
        os.makedirs(os.path.dirname(mirror), exist_ok=True)
        if is_dir:  # links copied as links (never followed: a loop), FIFOs and devices skipped
            shutil.copytree(path, mirror, symlinks=True, copy_function=_copy_regular)
        else:
            _copy_regular(path, mirror)
    _remove(path, is_dir)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "link_out_file":
        os.symlink(os.path.join(outside, "files", rng.choice(["victim", "other"])), path)
    elif kind == "link_out_copy":
        os.symlink(mirror, path)
    elif kind == "link_in":
        others = [e for e in entries(tree) if e != rel and not e.startswith(rel + os.sep)]
        os.symlink(os.path.relpath(os.path.join(tree, rng.choice(others)), os.path.dirname(path)), path)
    elif kind == "dangling":
        os.symlink(os.path.join(outside, "nothing-here", "x"), path)
    elif kind == "dev_zero":
        os.symlink("/dev/zero", path)
    elif kind == "dev_urandom":
        os.symlink("/dev/urandom", path)
    elif kind == "mknod":
        try:
            os.mknod(path, stat.S_IFCHR | 0o600, os.makedev(1, rng.choice([3, 5, 9])))  # null, zero, urandom
        except (PermissionError, AttributeError):
            os.symlink("/dev/zero", path)
            kind = "dev_zero"
    elif kind == "swap_type":
        if is_dir:
            with open(path, "wb") as f:
                f.write(b"{}")
        else:
            os.makedirs(os.path.join(path, "inner"))
    return f"{kind}:{rel}"


def _copy_regular(src: str, dst: str) -> None:
    """A copy of a regular file; of anything else (a FIFO or device planted earlier), an empty file."""
    if stat.S_ISREG(os.lstat(src).st_mode):
        shutil.copy2(src, dst)
    else:
        open(dst, "wb").close()


def _remove(path: str, is_dir: bool) -> None:
    if is_dir:
        shutil.rmtree(path)
    else:
        os.unlink(path)


def snapshot(*roots: str) -> str:
    """A hash of every name, type, size, content and link target under ``roots`` (never following links)."""
    h = hashlib.sha256()
    for root in roots:
        for d, dirs, files in os.walk(root):
            dirs.sort()
            for name in sorted(dirs + files):
                p = os.path.join(d, name)
                st = os.lstat(p)
                h.update(f"{os.path.relpath(p, root)}|{stat.S_IFMT(st.st_mode)}|{st.st_size}".encode())
                if stat.S_ISLNK(st.st_mode):
                    h.update(os.readlink(p).encode())
                elif stat.S_ISREG(st.st_mode):
                    with open(p, "rb") as f:
                        h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


def make_outside(work: str) -> str:
    outside = os.path.join(work, "outside")
    shutil.rmtree(outside, ignore_errors=True)
    os.makedirs(os.path.join(outside, "files"))
    for name in ("victim", "other"):
        with open(os.path.join(outside, "files", name), "w") as f:
            f.write(f"{name}: must never change\n")
    return outside


# -- the parent -------------------------------------------------------------------------------------------
class Worker:
    def __init__(self, template: str, log, script: str = os.path.abspath(__file__), env: dict | None = None):
        """A worker running ``script --worker``, given ``template`` (its first stdin line); extra ``env``."""
        env = {**os.environ, "MALLOC_ARENA_MAX": "2", "PYTHONPATH": REPO, **(env or {})}
        self.proc = subprocess.Popen([sys.executable, script, "--worker"], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=log, env=env, text=True)
        self.proc.stdin.write(template + "\n")
        self.proc.stdin.flush()
        ready = self._read(600)
        if ready is None or "ready" not in ready:
            raise RuntimeError(f"the worker did not start: {ready}")

    @property
    def pid(self) -> int:
        return self.proc.pid

    def run(self, tree: str, timeout: float):
        self.proc.stdin.write(json.dumps({"tree": tree}) + "\n")
        self.proc.stdin.flush()
        return self._read(timeout)

    def _read(self, timeout: float):
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            return None
        line = self.proc.stdout.readline()
        return json.loads(line) if line else {"died": self.proc.poll()}

    def kill(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.kill()
        self.proc.wait()


def plan(rng: random.Random, names: list[str]) -> list[tuple[str, str]]:
    count = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    chosen = []
    for _ in range(count):
        pool = KEY_ENTRIES if rng.random() < 0.3 else names
        chosen.append((rng.choice(pool), rng.choice(KINDS)))
    return chosen


def fuzz(trees: int, seed: int, work: str, timeout: float, jobs: int, progress: bool, checkpoint=None) -> dict:
    start = time.time()
    template = os.path.join(work, "template")
    build_template(template)
    names = entries(template)
    template_hash = snapshot(template)
    sentinel = os.path.join(work, "sentinel")
    os.makedirs(sentinel, exist_ok=True)
    with open(os.path.join(sentinel, "keep"), "w") as f:
        f.write("untouched\n")
    outside = make_outside(work)
    log = open(os.path.join(work, "worker.log"), "a")
    workers = [Worker(template, log) for _ in range(jobs)]
    failures, ops, restarts, kinds_seen = [], 0, 0, {}
    for i in range(0, trees, jobs):
        batch = []
        for j, worker in enumerate(workers):
            n = i + j
            if n >= trees:
                break
            rng = random.Random(seed * 1_000_003 + n)
            tree = os.path.join(work, f"tree{n}")
            # hard links: cheap, and safe because mmreplay (and zarr) replace files, never write them in place;
            # the in-place mutations below copy their file first, and the template is checked at the end
            shutil.copytree(template, tree, symlinks=True, copy_function=os.link)
            try:
                done = [mutate(tree, rel, kind, outside, rng, [w.pid for w in workers]) for rel, kind in plan(rng, names)]
            except (OSError, shutil.Error) as exc:  # the harness's own trouble: say so, go on with the tree as is
                done = [f"harness:{type(exc).__name__}: {str(exc)[:200]}"]
            for d in done:
                kinds_seen[d.split(":")[0]] = kinds_seen.get(d.split(":")[0], 0) + 1
            batch.append((n, tree, done, worker))
        before = snapshot(outside, sentinel)
        for n, tree, done, worker in batch:
            worker.proc.stdin.write(json.dumps({"tree": tree, "cli": n % CLI_EVERY == 0}) + "\n")
            worker.proc.stdin.flush()
        for k, (n, tree, done, worker) in enumerate(batch):
            reply = worker._read(timeout)
            problems = []
            if reply is None or "died" in reply:
                problems.append("HANG" if reply is None else f"worker died ({reply['died']})")
                worker.kill()
                workers[workers.index(worker)] = Worker(template, log)
                restarts += 1
            else:
                ops += len(reply["ops"])
                problems += [f"{op}: {o}" for op, o in reply["ops"].items() if o.startswith("BAD")]
                if reply["rss_growth"] > 2 * BUDGET:
                    problems.append(f"RSS grew {reply['rss_growth'] >> 20} MiB during the tree (budget "
                                    f"{BUDGET >> 20} MiB)")
            if problems:
                failures.append({"tree": n, "mutations": done, "problems": problems})
        if snapshot(outside, sentinel) != before:
            failures.append({"tree": [n for n, *_ in batch], "mutations": [d for _, _, d, _ in batch],
                             "problems": ["something outside the store changed"]})
        for n, tree, done, worker in batch:
            shutil.rmtree(tree, ignore_errors=True)
        shutil.rmtree(os.path.join(outside, "mirror"), ignore_errors=True)
        if failures and snapshot(outside, sentinel) != before:
            outside = make_outside(work)
        if (i // jobs) % 100 == 0:
            if progress:
                print(f"{i + len(batch)} trees, {ops} ops, {len(failures)} failures, {time.time() - start:.0f} s",
                      file=sys.stderr, flush=True)
            if checkpoint is not None:  # the summary so far, should the run be stopped before its end
                checkpoint({"trees_done": i + len(batch), "ops": ops, "failures": failures,
                            "wall_s": round(time.time() - start, 1), "complete": False})
    for worker in workers:
        worker.proc.stdin.close()
        worker.proc.wait(timeout=60)
    if snapshot(template) != template_hash:
        failures.append({"tree": None, "mutations": [], "problems": ["the template changed: a file was written in "
                                                                      "place through a hard-linked tree"]})
    return {"trees": trees, "complete": True, "ops": ops, "failures": failures, "worker_restarts": restarts,
            "mutations": kinds_seen, "seed": seed, "wall_s": round(time.time() - start, 1),
            "budget_bytes": BUDGET, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


def fuzz_arguments(description: str, trees: int) -> argparse.ArgumentParser:
    """The command line both tree fuzzers take (this one and ``fuzz_dataset_tree.py``)."""
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--trees", type=int, default=trees)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--jobs", type=int, default=1, help="worker processes (trees checked at once)")
    p.add_argument("--timeout", type=float, default=60.0, help="seconds a tree may take before it counts as a hang")
    p.add_argument("--work", help="directory for the trees (default: a new temporary one, removed after)")
    p.add_argument("--json", help="write the summary here too")
    p.add_argument("--quiet", action="store_true")
    return p


def fuzz_main(args, fuzz_trees, prefix: str) -> int:
    """Run ``fuzz_trees(trees, seed, work, timeout, jobs, progress, checkpoint)`` as the command line asks: in
    ``--work`` or a temporary directory (removed after), the summary checkpointed to ``--json``.partial as trees
    finish and written to ``--json`` at the end; prints it and up to 20 failures. Exit status 1 on a failure."""
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    work = args.work or tempfile.mkdtemp(prefix=prefix)
    os.makedirs(work, exist_ok=True)
    try:
        def checkpoint(partial):
            with open(args.json + ".partial", "w") as f:
                json.dump({**partial, "seed": args.seed}, f)

        summary = fuzz_trees(args.trees, args.seed, work, args.timeout, args.jobs, not args.quiet,
                             checkpoint if args.json else None)
    finally:
        if not args.work:
            shutil.rmtree(work, ignore_errors=True)
    if args.json:
        with open(args.json, "w") as f:
            f.write(json.dumps(summary, indent=1) + "\n")
    print(json.dumps({k: v for k, v in summary.items() if k != "failures"}))
    for failure in summary["failures"][:20]:
        print(json.dumps(failure)[:2000])
    return 1 if summary["failures"] else 0


def main(argv=None) -> int:
    args = fuzz_arguments(__doc__.splitlines()[0], trees=200).parse_args(argv)
    if args.worker:
        return worker_main()
    return fuzz_main(args, fuzz, "fuzz-store-tree-")


if __name__ == "__main__":
    sys.exit(main())
