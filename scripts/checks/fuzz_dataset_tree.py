"""Checks that ``import`` of hostile dataset trees never hangs, never writes outside its output, stays in
memory, fails clearly, and never makes a store holding data other than the dataset's.

The dataset-tree half of the check ``fuzz_store_tree.py`` makes for store trees (and sharing its helpers).
Each tree is a copy of one small valid dataset of a format ``mmreplay import`` reads -- a D4RL-style HDF5
file, a d3rlpy ReplayBuffer file, a Minari dataset directory (HDF5), a Dopamine replay directory of
``$store$_*_ckpt.N.gz`` files -- with one to three entries replaced: by a FIFO, a link out of the tree (to
a file, to a copy of the entry, to ``/dev/zero`` or ``/dev/urandom``), a link to another entry, a dangling
link, a character device made with ``mknod`` (as root), a directory where a file is (or a file where a
directory is), a file truncated or extended or with bits flipped; or, inside a file, a gzip whose trailer declares another
length, an ``.npy`` header declaring more or fewer rows than the stream holds or a huge shape, an HDF5
dataset replaced by a huge chunked one whose chunks were never written. On each tree a worker process runs
``import_dataset`` (and on every 4th tree the CLI's ``mmreplay import`` too) into a fresh output directory.
A tree fails the check when

- the worker does not answer within ``--timeout`` seconds (a hang: the worker is killed and restarted);
- anything outside the output directory changed: the dataset tree itself, a directory the links point
  into, a sentinel directory and the Minari root (hashed before and after: names, types, bytes, link
  targets), or the work directory's listing;
- the worker's peak RSS during the tree grew more than twice the import's memory budget
  (``bounds.BLOCK_BYTES``, a read block, plus the new store's cache budget) over its RSS before;
- an import raised anything but mmreplay's errors or an ``OSError``/``ValueError`` whose message names
  a path of the tree or of the output;
- an import succeeded but its store holds other rows than the valid dataset gives (every episode's
  observations, next observations, actions, rewards, terminated and truncated flags, hashed; trees with a
  link to another entry of the tree or flipped bits, whose data may really differ, are exempt: HDF5 keeps
  no checksum of raw data), or an import failed and
  left something at its destination that opens as a store.

One long-lived worker (no fork per tree) reads jobs on stdin and answers one JSON line per tree.

    python scripts/checks/fuzz_dataset_tree.py --trees 2000 --seed 1 [--jobs 2] [--work DIR] [--json OUT]

Prints a summary (trees by format, imports, failures, wall time) and exits 1 if any tree failed.
"""

from __future__ import annotations

import contextlib
import gzip
import hashlib
import io
import json
import os
import random
import resource
import shutil
import stat
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from fuzz_store_tree import (  # the store fuzzer's helpers: one way to hash, copy and run)
    REPO,
    Worker,
    _copy_regular,
    _remove,
    _reset_peak,
    _status,
    entries,
    fuzz_arguments,
    fuzz_main,
    make_outside,
    snapshot,
)

CACHE_BUDGET = 32 << 20  # the new store's cache budget (the API import; the CLI's store takes its default)
FORMATS = ["d4rl", "d3rlpy", "minari", "dqn-replay"]
SOURCES = {"d4rl": "ds.h5", "d3rlpy": "ds.h5", "minari": "ds", "dqn-replay": ""}  # what `import` is given
CLI_EVERY = 4
ENTRY_KINDS = ["fifo", "link_out_file", "link_out_copy", "link_in", "dangling", "dev_zero", "dev_urandom", "mknod",
               "swap_type", "truncate", "extend", "flip"]
GZ_KINDS = ["gz_isize", "gz_rows_more", "gz_rows_fewer", "npy_huge"]
H5_KINDS = ["h5_huge_chunked"]
KINDS = ENTRY_KINDS + GZ_KINDS + H5_KINDS
#: mutations after which a successful import may hold other data than the template's (still the dataset's)
CHANGES_DATA = {"link_in", "flip"}


def import_budget() -> int:
    from mmreplay.datasets import bounds

    return bounds.BLOCK_BYTES + CACHE_BUDGET


# -- the worker ---------------------------------------------------------------------------------------
def worker_main() -> int:
    """Read {"src", "fmt", "out", "tree"} lines, answer {"ops": {name: outcome}, "rss_growth": bytes}."""
    proto = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # stray prints (the CLI's, h5py's) must not corrupt the protocol
    sys.path[:0] = [REPO]
    import mmreplay  # noqa: F401
    from mmreplay.datasets import import_dataset  # noqa: F401

    def answer(doc):
        proto.write(json.dumps(doc) + "\n")
        proto.flush()

    setup = json.loads(sys.stdin.readline())
    warm = tempfile.mkdtemp(prefix="fuzz-dataset-warm-")
    digests = {}
    try:  # import every template twice (API and CLI) outside the measured trees: imports, the reference rows
        for fmt, template in setup["templates"].items():
            src = os.path.join(template, SOURCES[fmt]) if SOURCES[fmt] else template
            for how in ("api", "cli"):
                out = os.path.join(warm, f"{fmt}-{how}")
                outcome = _import(src, fmt, out, how, tree=template, expected=None)
                if not outcome.startswith("ok"):
                    raise RuntimeError(f"the valid {fmt} template did not import ({how}): {outcome}")
                digests.setdefault(fmt, digest(out))
                if digest(out) != digests[fmt]:
                    raise RuntimeError(f"the {fmt} template imports to other rows through the CLI than the API")
    finally:
        shutil.rmtree(warm, ignore_errors=True)
    _soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    resource.setrlimit(resource.RLIMIT_AS, (_status("VmSize") + (2 << 30), hard))  # an unbounded read dies here
    answer({"ready": os.getpid(), "digests": digests})
    for line in sys.stdin:
        job = json.loads(line)
        before = _status("VmRSS")
        _reset_peak()
        expected = None if job.get("changes_data") else digests[job["fmt"]]
        ops = {"import": _import(job["src"], job["fmt"], os.path.join(job["out"], "api.mmr"), "api", job["tree"],
                                 expected)}
        if job.get("cli"):
            ops["cli_import"] = _import(job["src"], job["fmt"], os.path.join(job["out"], "cli.mmr"), "cli",
                                        job["tree"], expected)
        answer({"ops": ops, "rss_growth": _status("VmHWM") - before})
    return 0


def _import(src: str, fmt: str, out: str, how: str, tree: str, expected: str | None) -> str:
    """Run one import; the outcome: "ok", "clear:..." (a refusal that names its cause) or "BAD:..."."""
    outcome = _run_api(src, fmt, out, tree) if how == "api" else _run_cli(src, fmt, out, tree)
    if outcome == "ok":
        try:
            got = digest(out)
        except BaseException as exc:  # noqa: BLE001
            return f"BAD:the imported store does not read back: {type(exc).__name__}: {exc}"[:600]
        if expected is not None and got != expected:
            return "BAD:wrong rows: the imported store holds other rows than the dataset"
        return "ok"
    if _opens_as_store(out):
        return f"BAD:a failed import left a store that opens at {out!r} ({outcome[:300]})"
    return outcome


def _run_api(src: str, fmt: str, out: str, tree: str) -> str:
    import mmreplay
    from mmreplay.datasets import import_dataset

    try:
        import_dataset(src, out, fmt, cache_bytes=CACHE_BUDGET, durable=False)
        return "ok"
    except mmreplay.MMReplayError as exc:
        return f"clear:{type(exc).__name__}: {exc}"[:400]
    except (OSError, ValueError) as exc:
        text = f"{exc} {getattr(exc, 'filename', '') or ''}"
        kind = "clear" if tree in text or os.path.dirname(out) in text else "BAD:unnamed"
        return f"{kind}:{type(exc).__name__}: {text}"[:400]
    except BaseException as exc:  # noqa: BLE001 - what the fuzzer is looking for
        import traceback

        return f"BAD:{type(exc).__name__}: {exc} | {traceback.format_exc()[-800:]}"[:1200]


def _run_cli(src: str, fmt: str, out: str, tree: str) -> str:
    from mmreplay.cli.main import main

    stdout, stderr = io.StringIO(), io.StringIO()
    try:
        with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
            rc = main(["import", src, out, "--format", fmt])
    except SystemExit as exc:
        rc = exc.code
    except BaseException as exc:  # noqa: BLE001
        import traceback

        return f"BAD:{type(exc).__name__}: {exc} | {traceback.format_exc()[-800:]}"[:1200]
    err = stderr.getvalue().strip()
    if rc == 0:
        return "ok"
    last = err.splitlines()[-1] if err else ""
    if rc == 2 and "error:" in last and (tree in last or os.path.dirname(out) in last):
        return f"clear:rc2: {last[-300:]}"
    return f"BAD:rc{rc}: {err[-400:]}"


def _opens_as_store(path: str) -> bool:
    import mmreplay

    if not os.path.lexists(path):
        return False
    try:
        with mmreplay.Store.open(path, mode="r"):
            return True
    except Exception:  # noqa: BLE001 - any refusal is "does not open"
        return False


def digest(path: str) -> str:
    """A hash of every episode of the store at ``path``: its steps' observations, next observations,
    actions, rewards and flags, in order, and the number of transitions."""
    import mmreplay
    from mmreplay.datasets.episodes import iter_pieces, list_episodes

    h = hashlib.sha256()
    with mmreplay.Store.open(path, mode="r", cache_bytes=CACHE_BUDGET) as s:
        h.update(f"{len(s)}".encode())
        listing = list_episodes(s, include_partial=True)
        for piece in iter_pieces(s, listing.episodes, 4096):
            h.update(f"|{piece.episode}|{int(piece.start)}{int(piece.end)}".encode())
            for k in sorted(piece.obs):
                h.update(piece.obs[k].tobytes())
                h.update(piece.next_obs[k].tobytes())
            for a in (piece.action, piece.reward, piece.terminated, piece.truncated):
                h.update(str(a.dtype).encode())
                h.update(a.tobytes())
    return h.hexdigest()


# -- templates --------------------------------------------------------------------------------------------
def build_templates(root: str) -> dict[str, str]:
    """One small valid dataset of each format under ``root/<format>``; returns {format: directory}."""
    sys.path[:0] = [REPO]
    import numpy as np
    from gymnasium import spaces

    import mmreplay
    from mmreplay.datasets import export_dataset

    rng = np.random.default_rng(7)
    store_path = os.path.join(root, "source.mmr")
    with mmreplay.Store.create(store_path, spaces.Box(-10, 10, (5,), np.float32), spaces.Discrete(4),
                               reward_values=(-1, 0, 1), durable=False, cache_bytes=CACHE_BUDGET) as s:
        for e in range(8):
            n = int(rng.integers(2, 20))
            obs = rng.uniform(-10, 10, (n + 1, 5)).astype(np.float32)
            term = np.zeros(n, bool)
            trunc = np.zeros(n, bool)
            (term if e % 2 else trunc)[-1] = True
            s.extend(obs[:-1], rng.integers(0, 4, n), rng.integers(-1, 2, n).astype(np.float32), obs[1:], term,
                     trunc)
    out = {}
    for fmt, kwargs in (("d4rl", {"compression": "gzip"}), ("d3rlpy", {"compression": "none"}),
                        ("minari", {"compression": "none"})):
        os.makedirs(os.path.join(root, fmt), exist_ok=True)
        export_dataset(store_path, os.path.join(root, fmt, SOURCES[fmt]), fmt, **kwargs)
        out[fmt] = os.path.join(root, fmt)
    out["dqn-replay"] = os.path.join(root, "dqn-replay")
    shutil.copytree(os.path.join(REPO, "tests", "data", "dqn_replay"), out["dqn-replay"])
    return out


# -- mutations --------------------------------------------------------------------------------------------
def _own_copy(path: str) -> None:
    """Give ``path`` its own inode before changing it in place (trees are hard-linked to the template)."""
    shutil.copy2(path, path + ".own")
    os.replace(path + ".own", path)


def _is_gz(path: str) -> bool:
    return path.endswith(".gz") and os.path.isfile(path) and not os.path.islink(path)


def _is_h5(path: str) -> bool:
    return path.endswith((".h5", ".hdf5")) and os.path.isfile(path) and not os.path.islink(path)


def mutate_content(tree: str, rel: str, kind: str, rng: random.Random) -> str:
    path = os.path.join(tree, rel)
    _own_copy(path)
    if kind == "gz_isize":  # the gzip trailer's length (ISIZE) lies; the CRC and the data are intact
        with open(path, "r+b") as f:
            f.seek(-4, os.SEEK_END)
            size = int.from_bytes(f.read(4), "little")
            f.seek(-4, os.SEEK_END)
            f.write(((size + rng.randrange(1, 1 << 20)) % (1 << 32)).to_bytes(4, "little"))
        return f"{kind}:{rel}"
    if kind in ("gz_rows_more", "gz_rows_fewer", "npy_huge"):
        import numpy as np

        with gzip.open(path, "rb") as f:
            arr = np.load(io.BytesIO(f.read()), allow_pickle=False)
        shape = list(arr.shape) or [1]
        if kind == "gz_rows_more":
            shape[0] += rng.choice([1, 2, 100, 1 << 20])
        elif kind == "gz_rows_fewer":
            shape[0] = max(0, shape[0] - rng.choice([1, 2, shape[0]]))
        else:
            shape = rng.choice([[1 << 24, *shape[1:]], [1 << 40, *shape[1:]], [shape[0], 1 << 16, 1 << 16],
                                [(1 << 24) - 1, 1024], [shape[0], *([2] * 30)]])
        header = {"descr": np.lib.format.dtype_to_descr(arr.dtype), "fortran_order": False, "shape": tuple(shape)}
        raw = io.BytesIO()
        np.lib.format.write_array_header_1_0(raw, header)
        raw.write(arr.tobytes())
        with gzip.open(path, "wb") as f:
            f.write(raw.getvalue())
        return f"{kind}:{rel}:{tuple(shape)[:4]}"
    if kind == "h5_huge_chunked":  # a dataset declaring a huge shape whose chunks were (mostly) never written
        import h5py
        import numpy as np

        with h5py.File(path, "a") as f:
            names = []
            f.visititems(lambda name, obj: names.append(name) if isinstance(obj, h5py.Dataset) and obj.ndim >= 1
                         else None)
            if not names:
                return f"{kind}:{rel}:no dataset"
            name = rng.choice(names)
            old = f[name]
            row, dtype = old.shape[1:], old.dtype
            data = old[: min(2, old.shape[0])]
            del f[name]
            rows = rng.choice([3000, 1 << 20, 1 << 30, 1 << 36])
            ds = f.create_dataset(name, (rows, *row), dtype, chunks=(1, *row), maxshape=(None, *row))
            if rng.random() < 0.5 and data.shape[0]:
                ds[: data.shape[0]] = data  # a few chunks written, the rest never
        return f"{kind}:{rel}:{name}:{rows}"
    raise ValueError(kind)


def mutate(tree: str, rel: str, kind: str, outside: str, rng: random.Random) -> str:
    """Apply one hostile change to entry ``rel`` of ``tree`` (a content change needs a file of its type:
    another entry of that type is taken, or the change falls back to a truncation)."""
    if kind in GZ_KINDS or kind in H5_KINDS:
        fits = _is_gz if kind in GZ_KINDS else _is_h5
        if not fits(os.path.join(tree, rel)):
            pool = [e for e in entries(tree) if fits(os.path.join(tree, e))]
            if not pool:  # no file of that type in this format: another change of the file's size
                kind = rng.choice(["truncate", "extend"])
            else:
                rel = rng.choice(pool)
        if kind not in ("truncate", "extend"):
            return mutate_content(tree, rel, kind, rng)
    path = os.path.join(tree, rel)
    if not os.path.lexists(path):
        return f"{kind}:{rel}:gone"
    is_dir = os.path.isdir(path) and not os.path.islink(path)
    if kind in ("truncate", "extend", "flip"):
        if is_dir or not os.path.isfile(path) or os.path.islink(path):
            kind = "fifo"
        else:
            _own_copy(path)
            size = os.path.getsize(path)
            with open(path, "r+b") as f:
                if kind == "flip":  # damaged bytes: HDF5 metadata, a gzip stream (raw HDF5 data has no checksum)
                    for _ in range(rng.choice([1, 1, 2, 8])):
                        at = rng.randrange(max(1, size))
                        f.seek(at)
                        byte = f.read(1) or b"\0"
                        f.seek(at)
                        f.write(bytes([byte[0] ^ (1 << rng.randrange(8))]))
                elif kind == "truncate":
                    f.truncate(rng.randrange(size) if size else 0)
                else:
                    f.seek(0, os.SEEK_END)
                    # random bytes, or zeros (gzip takes trailing zeros for padding: the data must then be whole)
                    f.write(rng.randbytes(rng.choice([1, 16, 4096, 65536])) if rng.random() < 0.7 else
                            bytes(rng.choice([1, 512, 8192])))
            return f"{kind}:{rel}"
    if kind == "link_in":
        others = [e for e in entries(tree) if e != rel and not e.startswith(rel + os.sep)
                  and not rel.startswith(e + os.sep)]
        if not others:
            kind = "link_out_copy"
    if kind == "link_out_copy":
        mirror = os.path.join(outside, "mirror", f"{rng.getrandbits(48):012x}")
        os.makedirs(os.path.dirname(mirror), exist_ok=True)
        if is_dir:
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


def plan(rng: random.Random, names: list[str]) -> list[tuple[str, str]]:
    count = rng.choices([1, 2, 3], weights=[6, 3, 1])[0]
    return [(rng.choice(names), rng.choice(KINDS)) for _ in range(count)]


# -- the parent -------------------------------------------------------------------------------------------
def fuzz(trees: int, seed: int, work: str, timeout: float, jobs: int, progress: bool, checkpoint=None) -> dict:
    start = time.time()
    templates = build_templates(os.path.join(work, "templates"))
    names = {fmt: entries(t) for fmt, t in templates.items()}
    template_hash = snapshot(*templates.values())
    sentinel = os.path.join(work, "sentinel")
    os.makedirs(sentinel, exist_ok=True)
    with open(os.path.join(sentinel, "keep"), "w") as f:
        f.write("untouched\n")
    minari_root = os.path.join(work, "minari-root")
    os.makedirs(minari_root, exist_ok=True)
    outside = make_outside(work)
    log = open(os.path.join(work, "worker.log"), "a")  # noqa: SIM115 - the workers' stderr, for the whole run
    env = {"MINARI_DATASETS_PATH": minari_root}
    setup = json.dumps({"templates": templates})

    def start_worker():
        return Worker(setup, log, script=os.path.abspath(__file__), env=env)

    workers = [start_worker() for _ in range(jobs)]
    failures, ops, restarts, kinds_seen, by_format, outcomes = [], 0, 0, {}, {}, {"ok": 0, "clear": 0}
    for i in range(0, trees, jobs):
        batch = []
        for j, worker in enumerate(workers):
            n = i + j
            if n >= trees:
                break
            rng = random.Random(seed * 1_000_003 + n)
            fmt = rng.choice(FORMATS)
            by_format[fmt] = by_format.get(fmt, 0) + 1
            tree = os.path.join(work, f"tree{n}")
            out = os.path.join(work, f"out{n}")
            shutil.copytree(templates[fmt], tree, symlinks=True, copy_function=os.link)
            os.makedirs(out)
            try:
                done = [mutate(tree, rel, kind, outside, rng) for rel, kind in plan(rng, names[fmt])]
            except Exception as exc:  # noqa: BLE001 - the harness's own trouble (a gzip an earlier change broke
                # cannot be rewritten): say so, go on with the tree as it is
                done = [f"harness:{type(exc).__name__}: {str(exc)[:200]}"]
            for d in done:
                kinds_seen[d.split(":")[0]] = kinds_seen.get(d.split(":")[0], 0) + 1
            job = {"src": os.path.join(tree, SOURCES[fmt]) if SOURCES[fmt] else tree, "fmt": fmt, "out": out, "tree": tree,
                   "cli": n % CLI_EVERY == 0, "changes_data": any(d.split(":")[0] in CHANGES_DATA for d in done)}
            batch.append((n, tree, out, done, worker, job))
        listing = sorted(os.listdir(work))
        before = snapshot(outside, sentinel, minari_root, *[b[1] for b in batch])
        for *_, worker, job in batch:
            worker.proc.stdin.write(json.dumps(job) + "\n")
            worker.proc.stdin.flush()
        for n, tree, out, done, worker, job in batch:
            reply = worker._read(timeout)
            problems = []
            if reply is None or "died" in reply:
                problems.append("HANG" if reply is None else f"worker died ({reply['died']})")
                worker.kill()
                workers[workers.index(worker)] = start_worker()
                restarts += 1
            else:
                ops += len(reply["ops"])
                for o in reply["ops"].values():
                    outcomes[o.split(":")[0]] = outcomes.get(o.split(":")[0], 0) + 1
                problems += [f"{op}: {o}" for op, o in reply["ops"].items() if o.startswith("BAD")]
                if reply["rss_growth"] > 2 * import_budget_bytes:
                    problems.append(f"RSS grew {reply['rss_growth'] >> 20} MiB during the tree (budget "
                                    f"{import_budget_bytes >> 20} MiB)")
            if problems:
                failures.append({"tree": n, "format": job["fmt"], "mutations": done, "problems": problems})
        changed = snapshot(outside, sentinel, minari_root, *[b[1] for b in batch]) != before
        if changed or sorted(os.listdir(work)) != listing:
            failures.append({"tree": [b[0] for b in batch], "format": [b[5]["fmt"] for b in batch],
                             "mutations": [b[3] for b in batch],
                             "problems": ["something outside the import's output changed"]})
        for n, tree, out, *_ in batch:
            shutil.rmtree(tree, ignore_errors=True)
            shutil.rmtree(out, ignore_errors=True)
        shutil.rmtree(os.path.join(outside, "mirror"), ignore_errors=True)
        if changed:
            outside = make_outside(work)
        if (i // jobs) % 50 == 0:
            if progress:
                print(f"{i + len(batch)} trees, {ops} imports, {len(failures)} failures, {time.time() - start:.0f} s",
                      file=sys.stderr, flush=True)
            if checkpoint is not None:
                checkpoint({"trees_done": i + len(batch), "ops": ops, "failures": failures,
                            "wall_s": round(time.time() - start, 1), "complete": False})
    for worker in workers:
        worker.proc.stdin.close()
        worker.proc.wait(timeout=60)
    if snapshot(*templates.values()) != template_hash:
        failures.append({"tree": None, "mutations": [], "problems": [
            "a template changed: a file was written in place through a hard-linked tree"]})
    return {"trees": trees, "complete": True, "trees_by_format": by_format, "imports": ops, "outcomes": outcomes,
            "failures": failures, "worker_restarts": restarts, "mutations": kinds_seen, "seed": seed,
            "wall_s": round(time.time() - start, 1), "import_budget_bytes": import_budget_bytes,
            "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}


import_budget_bytes = 0


def main(argv=None) -> int:
    global import_budget_bytes
    args = fuzz_arguments(__doc__.splitlines()[0], trees=100).parse_args(argv)
    if args.worker:
        return worker_main()
    sys.path[:0] = [REPO]
    import_budget_bytes = import_budget()
    return fuzz_main(args, fuzz, "fuzz-dataset-tree-")


if __name__ == "__main__":
    sys.exit(main())
