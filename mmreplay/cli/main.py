"""The ``mmreplay`` entry point: builds the parser from each subcommand module's ``register`` and turns
errors into exit codes.

Invariant: a usage or input error is one line on stderr and exit status 2, never a traceback: argparse's
own errors included (no usage dump), and every error the library raises for a bad input (its own
``MMReplayError`` types, ``ValueError``, ``OSError`` of a missing, unreadable or
not-a-dataset file, a missing optional dependency). Anything else is a bug of ours and keeps its
traceback (exit status 1). A closed stdout (``| head``) ends the command quietly with 141, as a process
killed by SIGPIPE does. Importing this module imports neither torch nor zarr: each command imports what
it needs when it runs, so that ``info``, ``verify`` and ``export`` start without torch.
"""

from __future__ import annotations

import argparse
import os
import sys

from mmreplay.cli import datasets, demo, info, plot, quickbench
from mmreplay.errors import MMReplayError

#: subcommand modules, in the order ``mmreplay --help`` lists them
COMMANDS = (info, plot, quickbench, demo, datasets)

#: what the library raises for a bad input (a path, a file, a value), reported as one line and exit 2
INPUT_ERRORS = (MMReplayError, OSError, ValueError, ImportError)


class UsageError(Exception):
    """A command line argparse refused (unknown option, missing or invalid argument)."""


class OneLineParser(argparse.ArgumentParser):
    """An ``ArgumentParser`` whose errors are one line naming the command (``mmreplay export: error: ...``)
    instead of a usage dump; ``--help`` still prints the full usage."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: error: {message} (see {self.prog} --help)")


def package_version() -> str:
    """The installed distribution's version, else the package's ``__version__`` (a source checkout)."""
    from importlib import metadata

    try:
        return metadata.version("mmreplay")
    except metadata.PackageNotFoundError:
        import mmreplay

        return getattr(mmreplay, "__version__", "unknown")


class _VersionAction(argparse.Action):
    """``--version``: the version is looked up only when asked for (importlib.metadata is not free)."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        print(f"mmreplay {package_version()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineParser(prog="mmreplay", description="RL replay stores on disk.")
    parser.add_argument("--version", action=_VersionAction, help="print the installed version and exit")
    sub = parser.add_subparsers(dest="command", required=True, parser_class=OneLineParser)
    for module in COMMANDS:
        module.register(sub)
    return parser


def main(argv=None) -> int:
    try:
        args = build_parser().parse_args(argv)
    except UsageError as exc:
        print(exc, file=sys.stderr)
        return 2
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
    except INPUT_ERRORS as exc:
        print(f"mmreplay {args.command}: error: {one_line(exc)}", file=sys.stderr)
        return 2


def one_line(exc: BaseException) -> str:
    """The error's message on one line; an ``OSError`` names its file when its message does not (h5py's
    "Unable to synchronously open file (file signature not found)" does not)."""
    if isinstance(exc, OSError) and exc.strerror and exc.filename is not None:
        text = f"{exc.filename!r}: {exc.strerror}"  # "[Errno 2] No such file or directory: 'x'" reads worse
    else:
        text = str(exc) or type(exc).__name__
    text = " ".join([text, *getattr(exc, "__notes__", ())])  # e.g. how to resume an interrupted import
    return " ".join(text.split())


if __name__ == "__main__":
    sys.exit(main())
