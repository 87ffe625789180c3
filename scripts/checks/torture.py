"""Long torture runs, the same loops the test suite runs briefly:

- SIGKILL: a writer process killed at random instants, the store reopened and checked bit for bit after
  every kill, many times over; then concurrent readers.
- Reader race (``--reader-race``): one writer on a small wrapping ring committing every few dozen adds,
  several reader processes refreshing, sampling and ``get``-ing for a given number of minutes, every row
  checked against the ground truth. Prints rows checked and wrong rows (the target is 0 wrong).
- Resume (``--resume``): a store of image frames whose compressed frames fit the budget, wrapped, then
  over and over: reopened (its background loader in flight), a writer thread adding while reader threads
  read the newest transitions back and sample, every row checked against the ground truth, closed.
  Alternates the thread and the process shard encoder. Prints rows checked and wrong rows; exits 1 if any
  row was wrong.

    python scripts/checks/torture.py [--trials 200] [--capacity 300] [--path /tmp/mmreplay_torture]
    python scripts/checks/torture.py --reader-race --minutes 10 --readers 3
    python scripts/checks/torture.py --resume --minutes 10 [--capacity 2000] [--readers 2]
"""

import argparse
import json
import os
import shutil
import sys
import time

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]  # this checkout's mmreplay, not another one installed

from torture import concurrent_readers, kill_trials, reader_race, resume_trials  # noqa: E402


def _codec_arg(value: str):
    """A frame codec name, or a codec dict given as JSON."""
    return json.loads(value) if value.lstrip().startswith("{") else value


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=None, help="transitions (default 300; --resume: 2000)")
    parser.add_argument("--readers", type=int, default=3, help="concurrent reader processes")
    parser.add_argument("--path", default="/tmp/mmreplay_torture")
    parser.add_argument("--reader-race", action="store_true", help="run the reader race instead of SIGKILLs")
    parser.add_argument("--resume", action="store_true", help="run the resume cycles instead of SIGKILLs")
    parser.add_argument("--minutes", type=float, default=10.0, help="reader race, resume: how long")
    parser.add_argument("--adds", type=int, default=None, help="resume: adds per reopen (default capacity / 4)")
    parser.add_argument("--commit-every", type=int, default=30, help="reader race: commit after 1..N adds")
    parser.add_argument("--frame-codec", default="lz4hc", type=_codec_arg, help="reader race: the writer's "
                        "frame_codec (e.g. delta-zstd: a writer rewriting runs of frames that readers decode), a name "
                        "or a JSON codec dict (e.g. '{\"name\": \"temporal\", \"run\": 8, \"layout\": 2}')")
    parser.add_argument("--cache-bytes", type=int, default=1 << 16, help="reader race: the readers' cache_bytes "
                        "(below the compressed frames, e.g. 2048: runs decode straight into batches)")
    args = parser.parse_args()
    shutil.rmtree(args.path, ignore_errors=True)
    if args.resume:
        return resume(args)
    args.capacity = args.capacity or 300
    if args.reader_race:
        t0 = time.monotonic()
        results = reader_race(args.path, readers=args.readers, seconds=args.minutes * 60, capacity=args.capacity,
                              max_commit_batch=args.commit_every, frame_codec=args.frame_codec,
                              cache_bytes=args.cache_bytes)
        rows, wrong = sum(r["rows"] for r in results), sum(r["wrong"] for r in results)
        for r in results:
            print("reader:", json.dumps(r))
        print(f"reader race: {args.readers} readers, {time.monotonic() - t0:.0f} s, {rows:,} rows checked, "
              f"{wrong} wrong, {sum(r['refused'] for r in results):,} get() calls refused (ids given up)")
        shutil.rmtree(args.path, ignore_errors=True)
        return 1 if wrong else 0
    results = kill_trials(args.path, args.trials, capacity=args.capacity, seed=42, max_delay=1.0)
    print(f"{len(results)} kills, every reopened store checked bit-exact; final head {results[-1][0]:,}")
    shutil.rmtree(args.path, ignore_errors=True)
    for out in concurrent_readers(args.path, readers=args.readers, seconds=20.0, capacity=args.capacity):
        print("reader:", out)
    return 0


def resume(args) -> int:
    t0 = time.monotonic()
    total = resume_trials(args.path, args.minutes * 60, capacity=args.capacity or 2000, readers=args.readers,
                          adds=args.adds)
    print(f"resume: {total['cycles']} reopen cycles, {time.monotonic() - t0:.0f} s, {total['added']:,} transitions "
          f"added, {total['rows']:,} rows checked, {total['wrong']} wrong (first: {total['examples']}), "
          f"{total['refused']:,} reads refused (ids given up)")
    shutil.rmtree(args.path, ignore_errors=True)
    return 1 if total["wrong"] else 0


if __name__ == "__main__":
    sys.exit(main())
