"""The ``mmreplay`` entry point: builds the parser from each subcommand module's ``register`` and turns
errors into exit codes.

Invariant: a usage or input error is one line on stderr and exit status 2, never a traceback; a closed
stdout (``| head``) ends the command quietly with 141, as a process killed by SIGPIPE does.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmreplay.cli import datasets, demo, info, plot, quickbench
from mmreplay.errors import MMReplayError

#: subcommand modules, in the order ``mmreplay --help`` lists them
COMMANDS = (info, plot, quickbench, demo, datasets)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mmreplay", description="RL replay stores on disk.")
    sub = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, not at interpreter exit, so that a closed pipe is caught below
        return code
    except BrokenPipeError:
        # The reader went away (``mmreplay info STORE | head -1``): not an error of ours. Point stdout at
        # /dev/null so the interpreter's final flush does not raise again, and exit as a SIGPIPE'd
        # process does (128 + 13), like ``yes | head``.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 141
    except (MMReplayError, FileExistsError, FileNotFoundError, ValueError, ImportError) as exc:
        print(f"mmreplay {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
