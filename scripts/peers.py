#!/usr/bin/env python
"""Self-test and quick benchmark of the peer replay buffers (``scripts/benchmarks/peers/``): each peer
filled with a synthetic episodic stream, overwritten, sampled, its stacks checked, in a fresh process.

    python scripts/peers.py [--n 20000] [--n-envs 1 8] [--peers numpy sb3 cpprb torchrl] [--no-lowdim]
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from benchmarks.selftest import main  # noqa: E402  (after the path set-up above)

if __name__ == "__main__":
    main()
