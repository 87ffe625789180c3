"""The package's layers are a fact the build checks: import-linter's contracts in pyproject.toml hold
(function-local imports included), and ``Store`` is composed, not mixed together."""

import pathlib
import subprocess
import sys

import pytest

import mmreplay
from mmreplay.store import Store

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_import_contracts_hold():
    pytest.importorskip("importlinter")
    # lint-imports itself, as CI would run it (in a child: it configures import-linter process-wide)
    run = subprocess.run([sys.executable, "-c", "import sys; from importlinter.cli import lint_imports; "
                          "sys.exit(lint_imports(no_cache=True, no_logo=True))"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"import-linter found a broken contract:\n{run.stdout}\n{run.stderr}"
    assert "2 kept, 0 broken" in run.stdout


def test_store_is_composed_not_mixed_in():
    assert Store.__mro__ == (Store, object)  # help(Store) shows no WritePath base


def test_public_names_resolve_and_are_documented():
    for name in mmreplay.__all__:
        value = getattr(mmreplay, name)
        if isinstance(value, type):
            assert value.__doc__ and value.__doc__.strip(), f"mmreplay.{name} has no docstring"
