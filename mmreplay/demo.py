"""Deprecated spelling: ``python -m mmreplay.demo`` is now ``python examples/demo.py`` (or ``mmreplay demo``);
the demo is example code and no longer ships inside the package. This forwarder goes in the next release.

Invariant: it runs the same script (``mmreplay.cli.demo.find_demo``) with the same arguments and passes its
exit status, after a DeprecationWarning; without a clone it says how to run the demo (exit status 2).
"""

import subprocess
import sys
import warnings

from mmreplay.cli.demo import find_demo


def main(argv=None) -> int:
    warnings.warn("python -m mmreplay.demo is deprecated: run python examples/demo.py from a clone (or mmreplay "
                  "demo)", DeprecationWarning, stacklevel=1)
    try:
        path = find_demo()
    except FileNotFoundError as exc:
        print(f"python -m mmreplay.demo: error: {exc}", file=sys.stderr)
        return 2
    return subprocess.run([sys.executable, path, *(sys.argv[1:] if argv is None else argv)], check=False).returncode


if __name__ == "__main__":
    sys.exit(main())
