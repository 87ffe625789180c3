"""The ``mmreplay`` command: inspect, verify, plot, benchmark, demo and convert stores from a shell.

    mmreplay --version
    mmreplay info PATH [--json]
    mmreplay verify PATH
    mmreplay plot PATH [--out FILE.png]
    mmreplay bench [--n N]
    mmreplay demo [--out DIR]
    mmreplay export PATH OUT --format minari|d4rl|d3rlpy [--episodes 0:100] [--include-partial]
                    [--compression gzip|lzf|none] [--env-id ID --author NAME --author-email E
                    --code-permalink URL --algorithm-name A --description TEXT --data-format hdf5|arrow]
    mmreplay import SRC PATH --format minari|d4rl|d3rlpy [--capacity N] [--frame-stack K]

One module per subcommand group, each with a ``register(subparsers)`` that adds its parsers:
``inspect`` (info, verify), ``plot``, ``quickbench`` (bench), ``demo``, ``datasets`` (export, import);
``main`` builds the parser and turns errors into exit codes; ``progress`` draws the bars.

Invariants: the CLI sits on top of the library and uses only its public API (``Store`` methods,
``mmreplay.stats``, ``mmreplay.datasets``); nothing in the library imports ``mmreplay.cli``. Results go to
stdout, progress bars (tqdm) and errors to stderr; a usage or input error is one line naming the value
and exit status 2, never a traceback (an internal error keeps its traceback, exit 1); a closed stdout (``| head``) ends the command quietly (141). Every command except
``demo``, ``bench`` and ``import`` only reads the store. Heavy imports (torch, zarr, matplotlib) happen
inside the commands, so ``mmreplay --help`` stays fast, and ``info`` and ``verify`` never import torch
(tests/test_cli_errors.py checks it).
"""

from mmreplay.cli.main import build_parser, main
from mmreplay.cli.progress import Progress

__all__ = ["Progress", "build_parser", "main"]
