"""``mmreplay demo``: runs the README's demo, ``examples/demo.py`` of a clone of the repository.

The demo is example code (a DQN training loop), not library code, so it is not installed with the
package; this command finds it next to the package of an editable install from a clone (``pip install
-e .``), or under the current directory.

Invariant: the demo runs in its own interpreter process (it restarts itself once to show a resume from
disk), and its exit status is this command's; when no demo script is found, the error says where it
looked and how to run the demo.
"""

from __future__ import annotations

import os
import subprocess
import sys

DEMO = os.path.join("examples", "demo.py")


def register(sub) -> None:
    p = sub.add_parser("demo", help="train a DQN on CartPole into a store, stop, resume, report "
                                    "(runs examples/demo.py of a clone)")
    p.add_argument("--out", default="demo_out")
    p.add_argument("--atari", action="store_true", help="the Atari variant (needs the 'atari' extra)")
    p.set_defaults(func=cmd_demo)


def demo_candidates() -> list[str]:
    """Where the demo may be: beside the package of an editable install, then under the current directory."""
    import mmreplay

    repo = os.path.dirname(os.path.dirname(os.path.abspath(mmreplay.__file__)))
    return [os.path.join(repo, DEMO), os.path.abspath(DEMO)]


def find_demo() -> str:
    candidates = demo_candidates()
    for path in candidates:
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        f"the demo is an example script, not part of the installed package, and none was found (looked for "
        f"{' and '.join(dict.fromkeys(candidates))}); from a clone of the mmreplay repository run "
        f"'python {DEMO}' (after pip install -e \".[demo]\")")


def cmd_demo(args) -> int:
    cmd = [sys.executable, find_demo(), "--out", args.out] + (["--atari"] if args.atari else [])
    return subprocess.run(cmd, check=False).returncode
