"""Benchmark modes: each is one module with a ``Mode`` subclass (``modes/base.py``) that owns its flags, runs
its children, and formats and judges its part of the results. ``MODES`` is the registry; its order is the
run, report and targets order.

Adding a mode (e.g. ``--larger-than-ram``) is one new module here plus one entry in ``MODES``:

    class LargerThanRamMode(Mode):
        key = "larger_than_ram"           # results[key]: the mode's part of the JSON
        exclusive = True                  # when asked for, the default workloads are not run
        tasks = {"ltr_sample": task}      # child tasks it adds (name -> fn(spec) -> dict), if any

        def add_arguments(self, p): p.add_argument("--larger-than-ram", action="store_true", help=...)
        def finish_args(self, a, quick, argv): ...      # defaults that depend on --quick
        def requested(self, a): return a.larger_than_ram
        def run(self, runner): ...        # runner.child({"task": ..., ...}, cgroup=cg, label=...) per system
        def report(self, part, results, args): return ["\n== larger than RAM ... ==", table(headers, rows)]
        def targets(self, part, args, add): add("...", value, threshold)
        def reaggregate(self, part, args): ...          # --report-from: recombine saved rounds

Parts to build on: ``cgroup.make_memory_cgroup`` / ``remove_cgroup`` (a child joins it through
``runner.child(spec, cgroup=cg)``), ``tasks_mmreplay`` (``mm_fill`` / ``mm_sample`` tasks: fill a store,
sample it fresh), ``tasks_peers`` (``peer`` task: fill and sample any peer), ``sources`` (inputs),
``runner.aggregate_runs`` (rounds), ``report.table`` / ``_f`` (formatting). A new peer (e.g. a numpy
memmap frame ring) is one module in ``peers/`` plus one entry in ``peers.BUILDERS``.

Invariant: a mode touches only ``results[mode.key]`` and its own flags; every figure it reports comes
from a child process (``Runner.child``), never from the parent.
"""
from __future__ import annotations

from .base import Mode
from .cgroup import CgroupMode
from .dreamer import DreamerMode
from .dqn_replay import DqnReplayMode
from .larger_than_ram import LargerThanRamMode
from .per import PerMode
from .workloads import WorkloadsMode

MODES: list[Mode] = [WorkloadsMode(), PerMode(), CgroupMode(), LargerThanRamMode(), DqnReplayMode(), DreamerMode()]
