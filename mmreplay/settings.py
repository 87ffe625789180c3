"""``Settings``: what one session of a store chooses, as opposed to what the store *is*.

Invariant: a ``Settings`` is validated when made, is never stored on disk, and the same value may be
passed to ``Store.create`` and ``Store.open``; the schema and ring geometry (what the store is) live in
the store's metadata instead.

Thread and process knobs (``codec_threads``, ``encoder``), ``partial_reads`` and ``device_cache_bytes`` have
environment variables as overrides, for changing a deployed script without editing it. Precedence, highest first: the environment variable when it
is set, then the field (given to ``Settings`` or as a keyword to ``Store.create``/``open``), then the
automatic default. ``Settings.resolve`` (what ``Store.create``/``open`` call) applies the environment, so
``store.settings`` shows the values in effect. Nothing below ``state.py`` reads settings from a process
global: the state passes each mechanism the fields it needs (the shard encoder its ``encoder``, the reader
its ``codec_threads``, with which the first batch decoded makes the process's helper threads).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import os
import warnings
from dataclasses import dataclass, field
from typing import Any

MIB = 1 << 20
DEFAULT_CACHE_BYTES = 1024 * MIB  # without a memory limit
# With a memory limit (the machine's RAM, if that is smaller), the default budget is what the limit leaves
# once the process's own memory is paid for (``budget_under_limit``), and never more than this share of it:
# the rest of a large limit stays for the trainer (its model, its envs), which allocates after the store opens.
LIMIT_SHARE = 0.7
# What a reading process adds to its RSS after the baseline (its RSS as ``Settings`` is made in ``Store.open``,
# mmreplay's lazy imports done) besides the budget and the index ring (which the budget pays for:
# ``FrameReader``). Measured (2026-12-07, 1 MiB budget, 150 batch-32 then 150 batch-256 with the CPU default
# prefetch, peak RSS less baseline less ring): 200k Atari 81 MiB, 50k DMC-like 3x84x84 RGB (frame stack 3)
# 145 MiB, 1M low-dim 57 MiB. What it is: compiled kernels loaded from numba's cache, the codec helper and IO
# threads' stacks and malloc arenas, the batch buffers (DMC batch-256: 2 x 16 MB of stacks) and the decoded slab
# grown to hold one batch's runs of frames (``ChunkCache``). The rest of the allowance is room for about one more
# prefetched RGB batch-256 (an accelerator's sampler prefetches 2). A writer's staging shards (~100 MiB for
# Atari, in /dev/shm) come on top of its RSS, but it holds no decoded batches.
OPEN_ALLOWANCE = 192 * MIB
# Left unplanned under a limit: page cache of the files read (charged to the cgroup; reclaimable, but not at
# once), allocator slack and what the measurements above did not see.
MIN_LIMIT_MARGIN = 32 * MIB
LIMIT_MARGIN_SHARE = 1 / 16
# A limit too small for the rule still gets a working store: this budget (one batch's frames fit, measured
# per batch in ``ChunkCache``), with a warning (once a process) that the limit is likely to be exceeded.
MIN_CACHE_BYTES = 32 * MIB
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_SELF_CGROUP = "/proc/self/cgroup"
MEMINFO = "/proc/meminfo"
PROC_SELF_STATM = "/proc/self/statm"
NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as the largest page-aligned int64
DEFAULT_COMMIT_EVERY = 25_000
DEFAULT_COMMIT_SECONDS = 30.0
CODEC_THREADS_ENV = "MMREPLAY_CODEC_THREADS"
ENCODER_ENV = "MMREPLAY_ENCODER"
PARTIAL_READS_ENV = "MMREPLAY_PARTIAL_READS"
DEVICE_CACHE_BYTES_ENV = "MMREPLAY_DEVICE_CACHE_BYTES"
ENCODERS = ("process", "thread")
DEFAULT_IO_DEPTH = 32
MAX_IO_DEPTH = 1024


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max" (cgroup v2): no limit


def _ancestors(path: str) -> list[str]:
    """``/a/b`` -> ``["a/b", "a", ""]``: a cgroup and the ones above it, relative to the mount."""
    parts = [p for p in path.strip().split("/") if p]
    return ["/".join(parts[:i]) for i in range(len(parts), -1, -1)]


def memory_limit() -> int | None:
    """The memory limit of this process's cgroup, the tightest of its own and its ancestors' (cgroup v2
    ``memory.max``, v1 ``memory/memory.limit_in_bytes``, found from ``/proc/self/cgroup``), or None."""
    try:
        with open(PROC_SELF_CGROUP) as f:
            lines = f.read().splitlines()
    except OSError:
        return None
    candidates = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and controllers == "":  # cgroup v2
            candidates += [os.path.join(CGROUP_ROOT, p, "memory.max") for p in _ancestors(path)]
        elif "memory" in controllers.split(","):  # cgroup v1
            candidates += [os.path.join(CGROUP_ROOT, "memory", p, "memory.limit_in_bytes") for p in _ancestors(path)]
    limits = [v for v in map(_read_int, candidates) if v is not None and 0 < v < NO_LIMIT]
    return min(limits) if limits else None


def _physical_memory() -> int | None:
    try:
        with open(MEMINFO) as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def process_rss() -> int:
    """This process's resident memory now (bytes; 0 where ``/proc`` is missing)."""
    try:
        with open(PROC_SELF_STATM) as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def budget_under_limit(limit: int, baseline: int) -> int:
    """The default budget of a process whose memory is limited to ``limit`` bytes and which holds
    ``baseline`` bytes (its RSS as the store opens): the limit less the baseline, less what opening and the
    first batches add (``OPEN_ALLOWANCE``), less a margin (``LIMIT_MARGIN_SHARE`` of the limit, at least
    ``MIN_LIMIT_MARGIN``); at most ``LIMIT_SHARE`` of the limit. May be below ``MIN_CACHE_BYTES`` (even
    negative): ``default_cache_bytes`` decides what then."""
    margin = max(MIN_LIMIT_MARGIN, int(limit * LIMIT_MARGIN_SHARE))
    return min(int(LIMIT_SHARE * limit), limit - baseline - OPEN_ALLOWANCE - margin)


_warned_small_limit = False


def default_cache_bytes() -> int:
    """Under a memory limit (the machine's RAM if that is smaller): ``budget_under_limit`` of it with this
    process's RSS now as the baseline, at least ``MIN_CACHE_BYTES`` (a limit too small for that warns, once a
    process, and the store still works); without one, ``DEFAULT_CACHE_BYTES``."""
    limit = memory_limit()
    if limit is None:
        return DEFAULT_CACHE_BYTES
    ram = _physical_memory()
    limit = limit if ram is None else min(limit, ram)
    baseline = process_rss()
    budget = budget_under_limit(limit, baseline)
    if budget >= MIN_CACHE_BYTES:
        return budget
    global _warned_small_limit
    if not _warned_small_limit:
        _warned_small_limit = True
        warnings.warn(f"mmreplay: a memory limit of {limit / MIB:.0f} MiB leaves too little for a frame budget once "
                      f"this process's {baseline / MIB:.0f} MiB and ~{OPEN_ALLOWANCE / MIB:.0f} MiB for reading are "
                      f"paid for; using cache_bytes={MIN_CACHE_BYTES / MIB:.0f} MiB, and the process may still "
                      "exceed the limit (pass cache_bytes= to choose, or raise the limit)", RuntimeWarning,
                      stacklevel=2)
    return MIN_CACHE_BYTES


@dataclass(frozen=True)
class Settings:
    """Per-session settings of a ``Store`` (``Store.create(..., settings=)`` / ``Store.open(..., settings=)``).

    - ``cache_bytes``: RAM the store holds for reading, per process: its index ring, then compressed
      shards held whole (all of them when they fit) and decoded frames (an LRU cache of chunks), split
      between the two by ``reading.tiers.plan_tiers`` (and the run directory of ``partial_reads``). Default:
      when the process runs under a memory limit (its cgroup's ``memory.max``, cgroup v2, or
      ``memory.limit_in_bytes``, v1, or an ancestor's, the tightest; the machine's RAM if smaller), the
      limit less the process's RSS when the store opens, less 192 MiB for what opening and the first
      batches add (compiled kernels, threads, batch buffers), less a margin of 1/16 of the limit (at least
      32 MiB), and at most 70% of the limit (``budget_under_limit``); at least 32 MiB (a limit too small
      for that warns once). Without a limit: 1 GiB. A value passed explicitly always wins. Several
      processes in one cgroup that each open stores (DataLoader workers) should pass it.
    - ``commit_every`` / ``commit_seconds``: a writer commits on its own after this many transitions or
      seconds since the last commit. A crash loses at most what was added since the last commit (call
      ``flush()`` to commit now; ``close()`` always commits).
    - ``durable``: fsync data and commit record on every commit. ``False`` is faster and still atomic
      against a process crash, but a power loss may lose or tear recent commits.
    - ``io_depth``: frames that RAM does not hold are read from their files with up to this many reads in
      flight (one thread each; ``reading/disk.py``). An SSD or a virtio disk serves several times more
      random reads per second at depth 32 than at depth 1; 1 reads one chunk after another.
    - ``codec_threads``: helper threads that share a batch's frame decodes and copies with the sampling
      thread, one set per process (``_native/helpers.py``); ``None`` (default): one fewer than the cores the
      process may use, none in a DataLoader worker; ``0`` turns them off. Overridden by
      ``MMREPLAY_CODEC_THREADS``. Per process: the first batch decoded makes them, with the value in effect then.
    - ``encoder``: where a writer compresses its image shards: ``"process"`` (default: a child process, so
      compression runs beside the adds) or ``"thread"`` (the store's writer thread; e.g. when /dev/shm is too
      small for the shared buffers). Overridden by ``MMREPLAY_ENCODER``.
    - ``partial_reads``: a run of frames (the temporal codec, layouts 2 and 3) that the disk path read whole once is
      later read only in the bytes the frames a batch needs take, each checked against a crc32c kept in RAM
      (``reading/runs.py``; ~170 bytes a run of 16, counted against ``cache_bytes``). ``False``: every miss
      reads its whole run. Overridden by ``MMREPLAY_PARTIAL_READS`` (``0`` or ``1``).
    - ``preload``: at open, a background pass reads the compressed shards the RAM tier holds (default).
      ``False`` leaves them to be read as batches need them: for a process that reads no frames, or few
      (``mmreplay info``, ``verify``), which would otherwise pay for reading the tier and then wait for it.
    - ``device_cache_bytes``: device memory that each sampler decoding on the device (``decode="device"``, or
      ``"auto"`` on CUDA with nvCOMP) holds checked compressed chunks in (``device/resident.py``): a batch then
      stages and copies only the chunks that pool lacks. Allocated whole when the sampler is made; filled as
      batches read chunks, never evicted (once full, the rest is staged batch by batch). Not counted in
      ``cache_bytes``; ignored by samplers that decode on the CPU. ``0`` (default): none, since device memory is
      the model's and a pool the store's frames do not fill is wasted; where the compressed frames fit beside
      the model, pass about their size on disk (``mmreplay info``). Overridden by
      ``MMREPLAY_DEVICE_CACHE_BYTES`` (a number of bytes).

    An environment variable, when set, wins over the field (see the module docstring).
    """

    cache_bytes: int = field(default_factory=default_cache_bytes)
    commit_every: int = DEFAULT_COMMIT_EVERY
    commit_seconds: float = DEFAULT_COMMIT_SECONDS
    durable: bool = True
    codec_threads: int | None = None
    encoder: str = "process"
    io_depth: int = DEFAULT_IO_DEPTH
    preload: bool = True
    partial_reads: bool = True
    device_cache_bytes: int = 0

    def __post_init__(self) -> None:
        for name in ("cache_bytes", "commit_every"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
            object.__setattr__(self, name, int(value))
        seconds = self.commit_seconds
        if isinstance(seconds, bool) or not isinstance(seconds, numbers.Real) or math.isnan(seconds):
            raise ValueError(f"commit_seconds must be a number of seconds, got {seconds!r}")
        object.__setattr__(self, "commit_seconds", float(seconds))
        if self.durable not in (True, False):
            raise ValueError(f"durable must be True or False, got {self.durable!r}")
        object.__setattr__(self, "durable", bool(self.durable))
        if not isinstance(self.preload, bool):
            raise ValueError(f"preload must be True or False, got {self.preload!r}")
        if not isinstance(self.partial_reads, bool):
            raise ValueError(f"partial_reads must be True or False, got {self.partial_reads!r}")
        object.__setattr__(self, "preload", bool(self.preload))
        depth = self.io_depth
        if isinstance(depth, bool) or not isinstance(depth, numbers.Integral) or not 1 <= depth <= MAX_IO_DEPTH:
            raise ValueError(f"io_depth must be an integer from 1 to {MAX_IO_DEPTH} (reads in flight), got {depth!r}")
        object.__setattr__(self, "io_depth", int(depth))
        threads = self.codec_threads
        if threads is not None:
            if isinstance(threads, bool) or not isinstance(threads, numbers.Integral) or threads < 0:
                raise ValueError(f"codec_threads must be None (automatic) or a number of threads >= 0, got {threads!r}")
            object.__setattr__(self, "codec_threads", int(threads))
        if self.encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {self.encoder!r}")
        object.__setattr__(self, "device_cache_bytes", check_device_cache_bytes(self.device_cache_bytes))

    def with_environment(self) -> "Settings":
        """These settings with the environment's overrides applied (``MMREPLAY_CODEC_THREADS``,
        ``MMREPLAY_ENCODER``, ``MMREPLAY_PARTIAL_READS``, ``MMREPLAY_DEVICE_CACHE_BYTES``); a value there that is
        not valid is a ``ValueError`` naming the variable."""
        overrides: dict[str, Any] = {}
        threads = codec_threads_override()
        if threads is not None:
            overrides["codec_threads"] = threads
        encoder = os.environ.get(ENCODER_ENV)
        if encoder is not None:
            if encoder not in ENCODERS:
                raise ValueError(f"{ENCODER_ENV} must be one of {ENCODERS}, got {encoder!r}")
            overrides["encoder"] = encoder
        partial = os.environ.get(PARTIAL_READS_ENV)
        if partial is not None:
            if partial not in ("0", "1"):
                raise ValueError(f"{PARTIAL_READS_ENV} must be 0 or 1, got {partial!r}")
            overrides["partial_reads"] = partial == "1"
        device = os.environ.get(DEVICE_CACHE_BYTES_ENV)
        if device is not None:
            try:
                nbytes = int(device)
            except ValueError:
                nbytes = -1
            if nbytes < 0:
                raise ValueError(f"{DEVICE_CACHE_BYTES_ENV} must be a number of bytes >= 0 (0: no device tier), "
                                 f"got {device!r}")
            overrides["device_cache_bytes"] = nbytes
        return dataclasses.replace(self, **overrides) if overrides else self

    @classmethod
    def resolve(cls, settings: "Settings | None", overrides: dict[str, Any]) -> "Settings":
        """``settings`` (default: the defaults) with the keyword arguments ``overrides`` (the old spelling,
        ``Store.open(path, cache_bytes=...)``) and then the environment's overrides applied; an unknown
        keyword is a ``TypeError``."""
        base = settings if settings is not None else cls()
        if not isinstance(base, cls):
            raise TypeError(f"settings must be an mmreplay.Settings, got {type(base).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(overrides) - known)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) {unknown}; session settings are {sorted(known)}")
        return (dataclasses.replace(base, **overrides) if overrides else base).with_environment()


def check_device_cache_bytes(value) -> int:
    """``value`` as an int, if it is a number of bytes >= 0 (``Settings.device_cache_bytes``)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or value < 0:
        raise ValueError(f"device_cache_bytes must be a number of bytes >= 0 (0: no device tier), got {value!r}")
    return int(value)


def codec_threads_override() -> int | None:
    """``MMREPLAY_CODEC_THREADS`` as a number of helper threads, None when it is not set; a value that is not
    a number >= 0 is a ``ValueError`` naming the variable."""
    threads = os.environ.get(CODEC_THREADS_ENV)
    if threads is None:
        return None
    try:
        count = int(threads)
    except ValueError:
        raise ValueError(f"{CODEC_THREADS_ENV} must be a number of threads (0 turns the helpers off), "
                         f"got {threads!r}") from None
    if count < 0:
        raise ValueError(f"{CODEC_THREADS_ENV} must be >= 0, got {count}")
    return count
