"""The Python code blocks of README.md, docs/quickstart.md and docs/guide.md run as written.

Each document's blocks run in order as one script (later blocks use what earlier ones made, as a reader
following the page would), in a fresh Python process whose working directory is the test's temporary
folder, so every ``runs/...`` path a block writes lands there. A block may name stand-ins for an env it
cannot have here (Atari ROMs, dm_control) in an HTML comment right before it; ``tests/docs_prelude.py``
defines them and runs the blocks. A failing block's traceback names the document and its line; the runner
prints each block's time.
"""

import os
import subprocess
import sys

import pytest

from docs_prelude import STAND_INS, blocks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUNNER = os.path.join(ROOT, "tests", "docs_prelude.py")
DOCUMENTS = ("README.md", "docs/quickstart.md", "docs/guide.md")
# Every fenced block says what it is: Python blocks run here, shell and text blocks do not.
LANGUAGES = {"python", "bash", "text"}


def read(document: str) -> str:
    with open(os.path.join(ROOT, document), encoding="utf-8") as f:
        return f.read()


@pytest.mark.parametrize("document", DOCUMENTS)
def test_every_block_is_labelled_and_every_prelude_exists(document):
    found = blocks(read(document))
    assert any(b.language == "python" for b in found), f"{document}: no Python block found"
    for b in found:
        assert b.language in LANGUAGES, \
            f"{document}:{b.line - 1}: a code block labelled {b.language!r}, expected one of {sorted(LANGUAGES)}"
        unknown = set(b.prelude) - set(STAND_INS)
        assert not unknown, f"{document}:{b.line - 1}: unknown prelude {sorted(unknown)}; known: {sorted(STAND_INS)}"
        assert not b.prelude or b.language == "python", f"{document}:{b.line - 1}: a prelude before a non-Python block"


@pytest.mark.parametrize("document", DOCUMENTS)
def test_python_blocks_run_as_written(document, tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "tests"), os.environ.get("PYTHONPATH", "")]),
           # one torch thread: the blocks' small training steps are 3x faster so on a loaded 2-core runner
           "OMP_NUM_THREADS": "1"}
    # the timeout guards against a hang, it is not a timer: the whole suite takes ~4 min on a quiet 2-core
    # box, and the guide's blocks alone ran past 600 s under load average 11 with nice 19: room for a loaded runner
    done = subprocess.run([sys.executable, RUNNER, os.path.join(ROOT, document)], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=1800)
    assert done.returncode == 0, f"{document}: a block failed\n{done.stdout[-4000:]}\n{done.stderr[-8000:]}"
    expected = sum(b.language == "python" for b in blocks(read(document)))
    assert f"{expected} Python blocks ran" in done.stdout, done.stdout
