"""The README's main job, small: record, stop, resume in a new process, report (and the Atari variant
where ale-py is installed)."""

import subprocess
import sys

import pytest


def test_demo_trains_stops_resumes_and_reports(tmp_path):
    out = subprocess.run([sys.executable, "-m", "mmreplay.demo", "--out", str(tmp_path / "demo"), "--steps",
                          "1500", "--resume-steps", "1500"], check=True, capture_output=True, text=True).stdout
    assert "reopened" in out and "resuming at step 1,500" in out
    assert "3,000 transitions valid" in out and "bytes per transition" in out
    assert (tmp_path / "demo" / "q_weights.npz").exists()


def test_atari_demo_memory_story(tmp_path):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    out = subprocess.run([sys.executable, "-m", "mmreplay.demo", "--atari", "--out", str(tmp_path / "d"),
                          "--steps", "600"], check=True, capture_output=True, text=True).stdout
    assert "transitions kept: 1,200" in out and "SB3 ReplayBuffer would hold them" in out
