"""The mmreplay command: info (table and JSON), verify (intact and corrupt), clear errors."""

import json
import os

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay.cli import main


@pytest.fixture
def small_store(store_path):
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (6, 5), np.uint8), spaces.Discrete(3), capacity=500,
                               frame_stack=2, reward_values=(-1, 0, 1)) as s:
        for i in range(300):
            s.add(np.full((6, 5), i % 256, np.uint8), i % 3, 0, np.full((6, 5), (i + 1) % 256, np.uint8),
                  i % 50 == 49, False)
    return store_path


def test_info_json(small_store, capsys):
    assert main(["info", small_store, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["transitions"] == 300 and info["episodes_started"] == 6 and info["frames"] == 306
    assert info["index_ram_bytes_per_transition"] <= 16
    arrays = {c["array"]: c for c in info["columns"]}
    assert arrays["transitions/action"]["bits"] == 2 and arrays["frames/obs"]["rows"] == 306


def test_info_table(small_store, capsys):
    assert main(["info", small_store]) == 0
    out = capsys.readouterr().out
    assert "300 valid" in out and "frames/obs" in out and "bytes per transition" in out


def test_verify_intact_then_corrupt(small_store, capsys):
    assert main(["verify", small_store]) == 0
    assert "intact" in capsys.readouterr().out
    with mmreplay.Store.open(small_store, mode="r") as s:
        path = s._frames.columns["obs"].layout.shard_file(small_store, 0)
    data = bytearray(open(path, "rb").read())
    data[len(data) // 3] ^= 0x55
    open(path, "wb").write(bytes(data))
    assert main(["verify", small_store]) == 1
    out = capsys.readouterr().out
    assert "BAD: array 'frames/obs', shard 0, chunk" in out and "problem(s) found" in out


def test_errors_are_one_line(tmp_path, capsys):
    assert main(["info", str(tmp_path / "nope")]) == 2
    assert "not a directory" in capsys.readouterr().err
    os.makedirs(tmp_path / "empty")
    assert main(["verify", str(tmp_path / "empty")]) == 2


def test_plot_writes_a_png(small_store, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    out = str(tmp_path / "plot.png")
    assert main(["plot", small_store, "--out", out]) == 0
    assert open(out, "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_episode_lengths(small_store):
    from mmreplay.plot import episode_lengths

    with mmreplay.Store.open(small_store, mode="r") as s:
        assert episode_lengths(s).tolist() == [50] * 6


def test_bench_runs(capsys):
    assert main(["bench", "--n", "2000"]) == 0
    out = capsys.readouterr().out
    assert "transitions/s" in out and "batch 256" in out
