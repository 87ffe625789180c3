#!/usr/bin/env bash
# Runs tests/test_dqn_replay.py's check against Dopamine's own OutOfGraphReplayBuffer (save/load and
# sample_transition_batch) without installing TensorFlow: dopamine-rl's wheel (--no-deps), gin-config and
# absl-py go into a scratch directory, and a stand-in `tensorflow` module provides the three names that
# dopamine/tf/replay_memory/circular_replay_buffer.py uses (tf.io.gfile.exists/GFile/remove on local files,
# tf.errors.NotFoundError). Nothing is installed into the venv.
#   scripts/checks/check_dqn_replay_with_dopamine.sh [python]   (default .venv/bin/python)
set -euo pipefail
PY=${1:-.venv/bin/python}
WORK=$(mktemp -d)
trap 'rm -rf "$WORK"' EXIT
"$PY" -m pip download -q --no-deps -d "$WORK/wheels" dopamine-rl
"$PY" -m pip install -q --no-deps --target "$WORK/site" "$WORK"/wheels/dopamine_rl-*.whl
"$PY" -m pip install -q --target "$WORK/site" gin-config absl-py
mkdir -p "$WORK/tfstub/tensorflow"
cat > "$WORK/tfstub/tensorflow/__init__.py" <<'PY'
"""Stand-in for the tf.io.gfile / tf.errors names Dopamine's OutOfGraphReplayBuffer uses (local files)."""
import os
import types


class NotFoundError(Exception):
    def __init__(self, node_def=None, op=None, message=""):
        super().__init__(message)


errors = types.SimpleNamespace(NotFoundError=NotFoundError)
io = types.SimpleNamespace(gfile=types.SimpleNamespace(exists=os.path.exists, GFile=open, remove=os.remove))
PY
PYTHONPATH="$WORK/tfstub:$WORK/site" "$PY" -m pytest -q -rs tests/test_dqn_replay.py -k dopamine
