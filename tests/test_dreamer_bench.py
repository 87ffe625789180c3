"""The issue #42 ``dreamer`` benchmark's own parts (scripts/benchmarks: dreamer_data, run_memo, modes/dreamer,
modes/cgroup_rounds) on a tiny synthetic frame pool: a build that reuses coded runs writes what a plain build
writes, the memo reuses a run only for equal bytes, a store's sequences match the dataset, and the report of a
saved run. Nothing is timed."""

import os
import sys

import numpy as np
import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [os.path.join(REPO, "scripts")]

from benchmarks import dreamer_data, run_memo  # noqa: E402
from benchmarks.modes import cgroup_rounds, dreamer  # noqa: E402

from mmreplay.codecs import registry  # noqa: E402
from mmreplay.codecs.delta_lz4 import DeltaLz4FrameCodec, encode_run  # noqa: E402


@pytest.fixture
def fake_pool(monkeypatch):
    """4 tasks x 500 smooth 64x64x3 frames (a drifting gradient: runs code as differences) instead of the DMC pool."""
    t = np.arange(2000)[:, None, None, None]
    y, x, c = np.meshgrid(np.arange(64), np.arange(64), np.arange(3), indexing="ij")
    pool = ((x * 3 + y * 2 + c * 40 + t * 5 + (t // 500) * 60) % 256).astype(np.uint8)
    monkeypatch.setattr(dreamer_data, "load_pool", lambda *a, **k: pool)
    return pool


def frame_chunks(path: str) -> list[bytes]:
    """Every frame shard file's bytes up to its shard index (the index, its checksum and the store's tag after it
    differ between two stores of the same frames)."""
    import mmreplay
    s = mmreplay.Store.open(path, mode="r")
    s.close()
    root = os.path.join(path, "frames")
    out = []
    for d, _, files in sorted(os.walk(root)):
        for f in sorted(files):
            if f.endswith(".json"):
                continue
            data = open(os.path.join(d, f), "rb").read()
            out.append(data[:len(data) - 1024] if len(data) > 1024 else data)
    return out


def test_a_build_reusing_runs_writes_the_frames_a_plain_build_writes(tmp_path, fake_pool):
    codec = '{"name": "delta-lz4", "run": 16}'
    plain = dreamer_data.build(str(tmp_path / "plain"), 3000, codec, reuse_runs=False)
    memo = dreamer_data.build(str(tmp_path / "memo"), 3000, codec, reuse_runs=True)
    assert memo["reused_runs"] > 0 and memo["coded_runs"] > 0  # the pool repeats: runs were reused
    assert plain["frames_bytes"] == memo["frames_bytes"]
    assert frame_chunks(str(tmp_path / "plain")) == frame_chunks(str(tmp_path / "memo"))
    assert DeltaLz4FrameCodec.encode_chunk is not None and "encode_chunk" in DeltaLz4FrameCodec.__dict__
    assert DeltaLz4FrameCodec.__dict__["encode_chunk"].__qualname__ == "DeltaLz4FrameCodec.encode_chunk"  # restored


def test_the_memo_reuses_a_run_only_for_the_same_bytes_and_settings(fake_pool):
    run = np.ascontiguousarray(fake_pool[:16])
    codec = registry.for_config({"name": "delta-lz4", "run": 16, "level": 9, "search": 8})
    other = registry.for_config({"name": "delta-lz4", "run": 16, "level": 4, "search": 8})
    with run_memo.reuse_coded_runs(DeltaLz4FrameCodec) as memo:
        first = codec.encode_chunk(run)
        assert codec.encode_chunk(run.copy()) == first and memo.hits == 1
        changed = run.copy()
        changed[15, 63, 63, 2] ^= 1  # one bit of the last frame
        assert codec.encode_chunk(changed) != first and memo.hits == 1
        assert other.encode_chunk(run) == encode_run(run, 4, 8) and memo.hits == 1  # another level: coded anew
        assert memo.stats()["coded_runs"] == 3 and first == encode_run(run, 9, 8)
    assert codec.encode_chunk(changed) == DeltaLz4FrameCodec(codec.spec).encode_chunk(changed)


def test_the_memo_stops_keeping_runs_past_its_bytes(fake_pool):
    codec = registry.for_config({"name": "delta-lz4", "run": 16})
    runs = [np.ascontiguousarray(fake_pool[i:i + 16]) for i in (0, 16)]
    with run_memo.reuse_coded_runs(DeltaLz4FrameCodec, max_bytes=runs[0].nbytes) as memo:
        for r in runs + runs:
            codec.encode_chunk(r)
        assert memo.stats() == {"reused_runs": 1, "coded_runs": 3, "memo_bytes": runs[0].nbytes}


def test_sequences_of_a_built_store_match_the_dataset(tmp_path, fake_pool):
    import mmreplay
    path = str(tmp_path / "s")
    dreamer_data.build(path, 3000, '{"name": "delta-lz4", "run": 16}')
    s = mmreplay.Store.open(path, mode="r")
    try:
        got = dreamer.verify_store(s, 4)
        assert got == {"verified_steps": 4 * 16 * 64, "wrong_frames": 0, "wrong_steps": 0}
        src = dreamer_data.DreamerSource()
        idx = np.arange(64)[None] + np.array([[100], [1500]])
        frames = src.frames(idx).copy()
        frames[1, 3, 0, 0, 0] ^= 1
        wf, ws = dreamer.wrong_steps(src, idx, frames, src.action(idx), src.reward(idx))
        assert (wf, ws) == (1, 1)  # the check compares something
    finally:
        s.close()


def test_device_batches_of_a_built_store_match_the_dataset(tmp_path, fake_pool):
    """``--device``: the store's batches come through the device decode path (the CPU stand-in decoder here), its
    delta-lz4 runs decoded as one LZ4 block each and rebuilt there, and match the dataset step by step."""
    import mmreplay
    path = str(tmp_path / "s")
    dreamer_data.build(path, 3000, '{"name": "delta-lz4", "run": 16}')
    with mmreplay.Store.open(path, mode="r") as s:
        with s.sampler(16, mmreplay.Sequences(64), **dreamer.on_device("cpu")) as smp:
            assert smp.decode == "device"
        got = dreamer.verify_store(s, 4, device="cpu")
    assert got == {"verified_steps": 4 * 16 * 64, "wrong_frames": 0, "wrong_steps": 0}
    assert dreamer.on_device(None) == {} and dreamer.synced(len, None) is len


def _summary(**kw):
    base = {"per_s": None, "round_medians": [], "cold_per_s": None, "peak_rss": None, "peak_rss_sampling": None,
            "cgroup_max_usage": None, "cpu_ms_a_batch": None, "verified_steps": 0, "wrong_frames": 0,
            "wrong_steps": 0, "errors": []}
    return {**base, **kw}


def test_summary_takes_the_faster_allocator_and_its_cpu_time():
    runs = {"mmreplay": [{"windows": [30.0, 40.0], "per_s": 35.0, "cpu_ms_a_batch": 9.0, "verified_steps": 1024}],
            "peer": [{"windows": [100.0], "per_s": 100.0, "cpu_ms_a_batch": 3.0, "verified_steps": 1024}],
            "peer_default_malloc": [{"windows": [120.0], "per_s": 120.0, "cpu_ms_a_batch": 2.5,
                                     "verified_steps": 1024, "wrong_frames": 1}]}
    s = dreamer.summarize(runs)
    assert s["peer"]["per_s"] == 120.0 and s["peer"]["cpu_ms_a_batch"] == 2.5
    assert s["peer"]["by_allocator"]["per_s"] == {"tuned": 100.0, "default": 120.0}
    assert s["peer"]["wrong_frames"] == 1 and s["peer"]["verified_steps"] == 2048
    assert s["mmreplay"]["per_s"] == 35.0 and s["mmreplay"]["cpu_ms_a_batch"] == 9.0


def test_report_of_a_saved_run():
    part = {"n": 5_000_000, "peer_n": 500_000, "limit_bytes": 8e9, "path": "/tmp/x",
            "store": {"codec": "delta-lz4", "codec_spec": {"name": "delta-lz4", "run": 16}, "store_bytes": 14.4e9,
                      "bytes_per_step": 2880.0, "frames_smaller_than_raw": 4.27, "add_per_s": 5000.0},
            "summary": {"mmreplay": _summary(per_s=60.0, cold_per_s=20.0, round_medians=[59.0, 61.0],
                                             cpu_ms_a_batch=6.1, verified_steps=40960),
                        "peer": _summary(per_s=100.0, round_medians=[100.0], cpu_ms_a_batch=2.9,
                                         by_allocator={"per_s": {"tuned": 100.0, "default": 90.0}})}}
    out = dreamer.report(part)
    assert "| mmreplay, cgroup | 5,000,000 | 20.0 | 60.0 | 59.0, 61.0 | 6.1 |" in out
    assert "| dreamer 5,000,000 in 8 GB, Sequences(64) b16 vs DreamerV3-style replay 500,000 in RAM | 0.60 | " \
           ">= 0.5 | PASS |" in out
    assert "(tuned 100, glibc default 90.0)" in out
    # a run with --device cuda: issue #42's GPU target (>= 1.0x), named as such
    out = dreamer.report({**part, "device": "cuda"})
    assert "| dreamer 5,000,000 in 8 GB, to cuda, decoded there, Sequences(64) b16 vs DreamerV3-style replay " \
           "500,000 in RAM | 0.60 | >= 1.0 | FAIL |" in out
    assert "batches on cuda" in out


def test_shared_report_helpers():
    assert cgroup_rounds.fmt(None) == "-" and cgroup_rounds.fmt(1234.0) == "1,234" and cgroup_rounds.fmt(2.0e6, 1e6) == "2.0"
    lines = cgroup_rounds.target_lines([("a", 0.4, 0.5, False), ("b", 0, 0, True), ("c", None, 1, False)])
    assert lines[3:] == ["| a | 0.40 | >= 0.5 | FAIL |", "| b | 0.00 | <= 0 | PASS |", "| c | - | >= 1 | - |"]
    calls = []
    meter = cgroup_rounds.CpuMeter(lambda: calls.append(1))
    assert meter.ms_a_call() is None
    meter()
    meter()
    assert meter.calls == 2 and len(calls) == 2 and meter.ms_a_call() >= 0
