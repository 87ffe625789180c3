"""Hostile metadata: every field of a store's ``zarr.json`` and commit record set to absurd values, each
store then opened and used. Run as a script (by tests/test_hostile_metadata.py) in a child process with
an address-space limit and a per-case alarm, so that a hang or an unbounded allocation is reported as
such instead of taking the test run down.

    python tests/hostile.py TEMPLATE_STORE WORK_DIR [meta|record]  ->  one JSON line per case: {case, outcome}
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import signal
import sys


sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # this checkout's mmreplay

import mmreplay  # noqa: E402
from mmreplay.sampling.strategy import NStep, Prioritized  # noqa: E402
from mmreplay.storage.durability.commit import CHECKSUM_KEY, COMMIT_KEY, record_checksum  # noqa: E402

NUMBERS = [-1, 0, 7, 2**31, 2**40, 2**64, 1.5, "12", None, True, {}]
META_FIELDS = ["capacity", "transition_rows", "transition_shard_rows", "frame_rows", "frame_shard_rows",
               "format_version"]
RECORD_FIELDS = ["sequence", "head", "oldest", "frame_head", "frame_oldest", "transition_rows", "frame_rows",
                 "max_prev_delta"]
SCHEMA_CASES = [
    (("frame_stack",), [0, -1, 2**31, 10**6, "4"]),
    (("observations", 0, "shape"), [[2**31, 2**31], [-1, 5], [10**5, 10**5], [0], "x", [2**62]]),
    (("observations", 0, "chunk_rows"), [0, -1, 2**30, "x"]),
    (("observations", 0, "dtype"), ["float128", "object", "<U5", "x"]),
    (("observations", 0, "codec"), [{"name": "nope"}, {"name": "blosc", "cname": "x"}, "x", {"name": "zstd",
                                                                                            "level": 10**9}]),
    (("observations", 0, "name"), ["../../x", "", 5]),
    (("action", "bits"), [0, 3, 64, "x"]),
    (("action", "values"), [[], list(range(300)), "x"]),
    (("stack_padding",), ["x", None]),
    (("observations",), [[], "x"]),
]
RECORD_CASES = [
    (("streams",), [[[0, 2**62, 0]], [[2**40, 5, 0]], [[0, 5, 7]], "x", [[0, 5]] * 100000]),
    (("samplers",), [{"../x": {"bit_generator": "PCG64", "state": {"state": 1, "inc": 1}}}, "x"]),
    (("priorities",), [{"..": {"buffer": 0, "max_priority": 1.0, "head": 5}},
                       {"default": {"buffer": 0, "max_priority": 1e39, "head": 5}},
                       {"default": {"buffer": 0, "max_priority": 1.0, "head": 5, "alpha": 1e9}}]),
]


def cases(only: str | None = None):
    for where, path, value in _all_cases():
        if only is None or where == only:
            yield where, path, value


def _all_cases():
    for field in META_FIELDS:
        for value in NUMBERS:
            yield "meta", (field,), value
    for path, values in SCHEMA_CASES:
        for value in values:
            yield "meta", ("schema", *path), value
    for field in RECORD_FIELDS:
        for value in NUMBERS:
            yield "record", (field,), value
    for path, values in RECORD_CASES:
        for value in values:
            yield "record", path, value


def mutate(store: str, where: str, path: tuple, value) -> None:
    file = os.path.join(store, "zarr.json" if where == "meta" else os.path.join("commit", "zarr.json"))
    group = json.load(open(file))
    target = group["attributes"]["mmreplay" if where == "meta" else COMMIT_KEY]
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    if where == "record":  # as an attacker would: with a matching checksum
        group["attributes"][CHECKSUM_KEY] = record_checksum(group["attributes"][COMMIT_KEY])
    with open(file, "w") as f:
        json.dump(group, f)


def use(store: str) -> None:
    """What a user does with a store: every entry point that reads what the metadata says."""
    with mmreplay.Store.open(store, mode="r") as s:
        n = len(s)
        oldest, head = s.inspect.valid_range()
        s.info()
        s.verify()
        if n >= 8:
            s.sample(8, seed=0)
            s.inspect.get([head - 1])
            next(s.sampler(8, NStep(3), seed=0))
            next(s.sampler(8, Prioritized(), seed=0))
    with mmreplay.Store.open(store) as s:
        s.flush()


class Timeout(Exception):
    pass


def main(template: str, work: str, only: str | None = None) -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/status") as f:
        vm = next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmSize"))
    resource.setrlimit(resource.RLIMIT_AS, (vm + (1536 << 20), hard))  # 1.5 GiB more than now, at most

    def alarm(*_):
        raise Timeout()

    signal.signal(signal.SIGALRM, alarm)
    use(template)  # warm: compile and load everything once, outside the limits that matter
    for i, (where, path, value) in enumerate(cases(only)):
        store = os.path.join(work, f"case{i}")
        shutil.copytree(template, store)
        mutate(store, where, path, value)
        signal.alarm(20)
        try:
            use(store)
            outcome = "ok"
        except Timeout:
            outcome = "TIMEOUT"
        except mmreplay.MMReplayError as exc:
            outcome = f"clear:{type(exc).__name__}: {exc}"
        except BaseException as exc:
            outcome = f"BAD:{type(exc).__name__}: {exc}"
        finally:
            signal.alarm(0)
        shutil.rmtree(store, ignore_errors=True)
        print(json.dumps({"case": f"{where}:{'.'.join(map(str, path))}={json.dumps(value)[:60]}",
                          "outcome": outcome[:300]}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:4]))
