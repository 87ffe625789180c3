"""Benchmark modes: each is one module with a ``Mode`` object that owns its flags, runs its children, and
formats and judges its part of the results. ``MODES`` is the registry (order = run, report and target
order).

Adding a mode (e.g. ``--larger-than-ram``) is one new module plus one line here:

    class LargerThanRam(Mode):
        key = "larger_than_ram"           # results[key]: the mode's JSON part
        exclusive = True                  # when asked for, the default workloads are not run
        tasks = {"ltr_ring": task_ring}   # child tasks it adds (name -> fn(spec) -> dict), if any

        def add_arguments(self, p): p.add_argument("--larger-than-ram", action="store_true", ...)
        def requested(self, a): return a.larger_than_ram
        def run(self, runner): ...        # runner.child(spec, cgroup=..., label=...) per measurement
        def report(self, part, results, args): return ["\n== ... ==", table(...)]
        def targets(self, part, args, add): add("...", value, threshold)

and ``MODES.append(LargerThanRam())`` below. ``benchmarks.cgroup`` makes the memory cgroup,
``benchmarks.sources`` feeds the inputs, ``tasks_mmreplay`` / ``tasks_peers`` fill and sample stores and
peers, ``report.table`` formats.

Invariant: a mode touches only ``results[mode.key]`` and its own flags; every figure it reports comes
from a child process (``Runner.child``), never from the parent.
"""
from __future__ import annotations

from .base import Mode
from .cgroup import CgroupMode
from .per import PerMode
from .workloads import WorkloadsMode

MODES: list[Mode] = [WorkloadsMode(), PerMode(), CgroupMode()]
