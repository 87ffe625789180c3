"""The child side of every measurement: ``bench.py --child SPEC`` runs one task in a fresh process and
writes its figures (or the traceback) as JSON to ``spec["out"]``.

Invariant: a task sees only its JSON spec; each child starts with ``tune_malloc()`` and torch's default
thread count, so its peak RSS and rates are that one system's alone. The tasks are the ``tasks`` of the
modes (``benchmarks.modes``), looked up by ``spec["task"]``.
"""
from __future__ import annotations

import json
import traceback

from .measure import CpuMeter, child_setup, log  # noqa: F401  (child_setup: the tasks' first step)


def all_tasks() -> dict:
    from .modes import MODES
    tasks = {}
    for mode in MODES:
        tasks.update(mode.tasks)
    return tasks


def child_main(spec_json: str) -> int:
    spec = json.loads(spec_json)
    try:
        meter = CpuMeter()
        res = all_tasks()[spec["task"]](spec)
        res.update(meter.result())
        import mmreplay
        res["mmreplay_file"] = mmreplay.__file__
        rc = 0
    except Exception:  # noqa: BLE001  (any failure is reported to the parent)
        res = {"error": traceback.format_exc()}
        log(res["error"])
        rc = 1
    with open(spec["out"], "w") as f:
        json.dump(res, f)
    return rc
