"""The README's main job, small: record, stop, resume in a new process, report (and the Atari variant
where ale-py is installed). The demo is example code, ``examples/demo.py``; ``mmreplay demo`` runs it."""

import os
import subprocess
import sys

import pytest

from mmreplay.cli import demo as cli_demo
from mmreplay.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEMO = os.path.join(REPO, "examples", "demo.py")


def test_demo_trains_stops_resumes_and_reports(tmp_path):
    # phase 1 trains from step 1,000 (LEARNING_STARTS), so both phases sample, and phase 2 resumes the RNG
    out = subprocess.run([sys.executable, DEMO, "--out", str(tmp_path / "demo"), "--steps", "1100",
                          "--resume-steps", "200"], check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert "reopened" in out and "resuming at step 1,100" in out
    assert "1,300 transitions valid" in out and "bytes per transition" in out
    assert (tmp_path / "demo" / "q_weights.npz").exists()


def test_atari_demo_memory_story(tmp_path):
    pytest.importorskip("ale_py")
    pytest.importorskip("cv2")
    out = subprocess.run([sys.executable, DEMO, "--atari", "--out", str(tmp_path / "d"), "--steps", "600",
                          "--updates", "20"],  # the story is the memory report; 20 updates show training runs
                         check=True, capture_output=True, text=True, cwd=tmp_path).stdout
    assert "transitions kept: 1,200" in out and "SB3 ReplayBuffer would hold them" in out
    assert out.count("20 updates in") == 2  # both phases trained from the store


def test_cli_demo_finds_the_example_of_this_clone():
    assert os.path.samefile(cli_demo.find_demo(), DEMO)


def test_cli_demo_runs_the_script_with_its_options_and_passes_its_exit_status(tmp_path, monkeypatch):
    seen = tmp_path / "argv.txt"
    script = tmp_path / "fake_demo.py"
    script.write_text(f"import sys\nopen({str(seen)!r}, 'w').write(' '.join(sys.argv[1:]))\nsys.exit(3)\n")
    monkeypatch.setattr(cli_demo, "find_demo", lambda: str(script))
    assert main(["demo", "--atari", "--out", str(tmp_path / "run")]) == 3
    assert seen.read_text() == f"--out {tmp_path / 'run'} --atari"


def test_cli_demo_without_a_clone_says_how_to_run_it(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(cli_demo, "demo_candidates", lambda: [str(tmp_path / "nowhere" / "demo.py")])
    assert main(["demo"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "python examples/demo.py" in err and "nowhere" in err
