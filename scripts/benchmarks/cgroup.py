"""Memory cgroups for the larger-than-RAM tests: make one below our own cgroup (v1 or v2, page cache charged
to it), read its usage figures, remove it.

Invariant: a cgroup made here is a child of the calling process's own cgroup, named by the caller, and is
removed by ``remove_cgroup`` (retried while its last process exits); needs root.
"""
from __future__ import annotations

import os
import time

from .measure import log


def _own_cgroup(controller: str | None) -> str:
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, ctrls, path = line.rstrip("\n").split(":", 2)
            if (controller is None and ctrls == "") or (controller and controller in ctrls.split(",")):
                return path
    return "/"


def make_memory_cgroup(limit_bytes: int, name: str) -> dict:
    """A memory cgroup below our own one: cgroup v1 (``/sys/fs/cgroup/memory``) or v2 (unified, with the
    memory controller).  Page cache is charged to the cgroup in both.  Returns {dir, procs, version}."""
    limit_bytes = int(limit_bytes)
    v2_root = "/sys/fs/cgroup"
    ctl = os.path.join(v2_root, "cgroup.controllers")
    with open(ctl) if os.path.exists(ctl) else open(os.devnull) as f:
        v2_memory = "memory" in f.read().split()
    if v2_memory:
        d = os.path.join(v2_root, _own_cgroup(None).lstrip("/"), name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "memory.max"), "w") as f:
            f.write(str(limit_bytes))
        try:
            with open(os.path.join(d, "memory.swap.max"), "w") as f:
                f.write("0")
        except OSError:
            pass
        return {"dir": d, "procs": os.path.join(d, "cgroup.procs"), "version": 2}
    v1_root = "/sys/fs/cgroup/memory"
    if os.path.isdir(v1_root):
        d = os.path.join(v1_root, _own_cgroup("memory").lstrip("/"), name)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, "memory.limit_in_bytes"), "w") as f:
            f.write(str(limit_bytes))
        sw = os.path.join(d, "memory.memsw.limit_in_bytes")
        if os.path.exists(sw):
            try:
                with open(sw, "w") as f:
                    f.write(str(limit_bytes))
            except OSError:
                pass
        return {"dir": d, "procs": os.path.join(d, "cgroup.procs"), "version": 1}
    raise RuntimeError("no memory cgroup controller found (neither cgroup v2 with 'memory' nor v1 "
                       "/sys/fs/cgroup/memory)")


def read_cgroup_stats(d: str) -> dict:
    out = {}
    for key, fn in (("limit", "memory.limit_in_bytes"), ("max_usage", "memory.max_usage_in_bytes"),
                    ("failcnt", "memory.failcnt"), ("limit", "memory.max"), ("max_usage", "memory.peak")):
        p = os.path.join(d, fn)
        if os.path.exists(p):
            try:
                with open(p) as f:
                    out[key] = int(f.read().split()[0])
            except (OSError, ValueError):
                pass
    p = os.path.join(d, "memory.stat")
    if os.path.exists(p):
        with open(p) as f:
            st = dict(line.split() for line in f if len(line.split()) == 2)
        for k in ("cache", "rss", "file", "anon", "pgmajfault", "total_pgmajfault", "workingset_refault",
                  "workingset_refault_file"):
            if k in st:
                out["stat_" + k] = int(st[k])
    p = os.path.join(d, "memory.events")
    if os.path.exists(p):
        with open(p) as f:
            out["events"] = {a: int(b) for a, b in (line.split() for line in f)}
    return out


def remove_cgroup(cg: dict) -> None:
    d = cg["dir"]
    for _ in range(20):
        try:
            if cg["version"] == 1 and os.path.exists(os.path.join(d, "memory.force_empty")):
                try:
                    with open(os.path.join(d, "memory.force_empty"), "w") as f:
                        f.write("0")
                except OSError:
                    pass
            os.rmdir(d)
            return
        except OSError:
            time.sleep(0.25)
    log(f"[bench] could not remove cgroup {d}")
