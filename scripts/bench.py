#!/usr/bin/env python
"""mmreplay against peer replay buffers, in one run, on the same inputs.

    python scripts/bench.py --quick                 # ~1 min smoke test (tiny N, few windows)
    python scripts/bench.py                         # Atari 100k (+ 8-stream run) and low-dim 1M, ~20 min
    python scripts/bench.py --atari-n 1000000       # Atari 1M (peers that cannot fit are skipped)
    python scripts/bench.py --cgroup                # only the "larger than RAM" test (1M Atari store)
    python scripts/bench.py --json out.json         # also dump every figure

Workloads
---------
``atari``     real preprocessed Atari frames (``scripts/atari_frames.py`` pool: Pong, Breakout, Seaquest,
              uniform-random play; tiled beyond the 100k pool), frame stack 4, capacity = N, n_envs = 1.
              mmreplay gets single 84x84 frames through ``Store.add``; the peers get 4x84x84 stacks
              (what ``FrameStackObservation`` hands them) through ``add_batch``.
``atari_x8``  the same N transitions as 8 streams (stream k = the k-th contiguous eighth of the data, so
              its episodes continue): mmreplay ``Store.extend`` with 8 rows, peers ``n_envs=8``.
``lowdim``    CartPole-v1 (4 float32 obs, 2 actions, uniform-random play, 8 envs), 1M transitions, added 8
              at a time (mmreplay ``extend`` with 8 streams, peers ``n_envs=8``).
``cgroup``    (``--cgroup``) a 1M-transition Atari store on disk, sampled by a child in a memory cgroup
              smaller than the uncompressed buffer, against the same child unconstrained.
``larger-than-ram`` (``--larger-than-ram [--workload atari1m|atari10m|dmc]``) 1M Atari in 2 GB vs SB3 100k in
              RAM; 10M Atari in 2 GB vs SB3; 1M DMC RGB in 4 GB vs a DrQ-v2-style loader, each beside the
              disk's own random-read limit (``modes/larger_than_ram.py``, ``modes/ltr_big.py``).
``dreamer``   (``--dreamer [--dreamer-n 1000000]``) DreamerV3's replay: Sequences(64) batch 16 of 64x64 RGB DMC
              frames, a store in an 8 GB cgroup vs a DreamerV3-style replay holding 500k steps in RAM
              (``modes/dreamer.py``).

Method
------
Every system runs in a FRESH child process (``measure.tune_malloc()`` in each, torch threads left at their
default), so its peak RSS (``ru_maxrss``) is that system alone.  Input preparation (reading frames from
the pool, building stacks) is done per chunk of ~512 transitions and is not timed; only the add calls are.

* add/s:  transitions per second while filling the empty buffer (mmreplay: including the final
  ``close()``, which commits and fsyncs; the store is ``durable=True``, the default).
* b32/s, b256/s:  batches per second, the MEDIAN of ``--windows`` timed windows of ``--window-s``
  seconds each, after a warm-up.  A batch has obs and next_obs (B,4,84,84) uint8 torch tensors (or
  (B,4) float32), action, reward, done/terminated.
* mmreplay is sampled from a store opened FRESH from disk in a new child (the page cache dropped first,
  ``echo 3 > /proc/sys/vm/drop_caches``, when we may): "cold" = batches/s over the first pass
  (ceil(N/B) batches, capped at ``--cold-max-s``) with an empty decoded-frame cache; "warm" = the steady
  rate after a warm-up that runs until the cache hit rate is stable.  The cache budget is printed.
* peak RSS: ``ru_maxrss`` of the child (for mmreplay the max over its fill child and sampling children).
* store B/tr: bytes the buffer's storage takes per stored transition: the store directory on disk
  (mmreplay), the memmap scratch directory (TorchRL), the RSS growth over the fill (in-RAM peers).

The machine is shared and noisy: rates are medians of several windows, and ratios within one run are
more meaningful than absolute figures.

Code
----
This file is the entry only; the benchmark is the package ``scripts/benchmarks/``: ``measure`` (rate
windows, RSS, IO, CPU noise), ``sources`` (Atari pool, CartPole, synthetic streams), ``peers/`` (one module
per peer), ``cgroup``, ``tasks_mmreplay`` / ``tasks_peers`` (what a child does), ``runner`` (children,
rounds), ``report`` (tables, targets), ``modes/`` (workloads, ``--per``, ``--cgroup``: a new mode is one
module there plus one line in ``modes/__init__.py``, see its docstring), ``cli`` (the flags).
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(HERE)
for _p in (HERE, REPO):  # benchmarks/ and atari_frames.py beside this file; mmreplay/ of this checkout
    if _p not in sys.path:
        sys.path.insert(0, _p)

if os.environ.get("MMREPLAY_BENCH_SRC"):  # --mmreplay-rev: benchmark a snapshot, not the working tree
    sys.path.insert(0, os.environ["MMREPLAY_BENCH_SRC"])

from benchmarks.cli import main  # noqa: E402  (after the path set-up above)

if __name__ == "__main__":
    sys.exit(main())
