"""Long SIGKILL torture: a writer process killed at random instants, the store reopened and checked bit for
bit after every kill, many times over (the test suite runs a few trials of the same loop).

    python scripts/torture.py [--trials 200] [--capacity 300] [--path /tmp/mmreplay_torture]
"""

import argparse
import os
import shutil
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))

from torture import concurrent_readers, kill_trials  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--trials", type=int, default=200)
    parser.add_argument("--capacity", type=int, default=300)
    parser.add_argument("--readers", type=int, default=3, help="then run this many concurrent readers")
    parser.add_argument("--path", default="/tmp/mmreplay_torture")
    args = parser.parse_args()
    shutil.rmtree(args.path, ignore_errors=True)
    results = kill_trials(args.path, args.trials, capacity=args.capacity, seed=42, max_delay=1.0)
    print(f"{len(results)} kills, every reopened store checked bit-exact; final head {results[-1][0]:,}")
    shutil.rmtree(args.path, ignore_errors=True)
    for out in concurrent_readers(args.path, readers=args.readers, seconds=20.0, capacity=args.capacity):
        print("reader:", out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
