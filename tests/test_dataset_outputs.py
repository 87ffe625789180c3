"""Exports and imports never leave partial output, relative paths work, and selections are never clipped.

Each test fails on 0e26cf5: a relative Minari export wrote ``OUT/data/OUT/data`` and raised after
writing, a failed export or import left its partial dataset or store behind, and ``episodes=slice(...)``
past the store's episodes was clipped without a word.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

import mmreplay
from mmreplay.datasets import export_dataset, import_dataset
from mmreplay.datasets import episodes as episodes_mod
from tests.test_datasets import assert_episodes_equal, build_store, make_episodes, minari_episodes, minari_root  # noqa: F401

h5py = pytest.importorskip("h5py")


@pytest.fixture
def lowdim(tmp_path):
    rng = np.random.default_rng(3)
    started, store = build_store(str(tmp_path / "s"), "lowdim", make_episodes("lowdim", rng, 6), rng=rng)
    with store:
        yield started, store


def test_minari_export_to_a_relative_directory(tmp_path, monkeypatch, minari_root, lowdim):  # noqa: F811
    minari = pytest.importorskip("minari")
    started, store = lowdim
    monkeypatch.chdir(tmp_path)
    summary = export_dataset(store, os.path.join("out", "rel-v0"), "minari")
    assert summary["episodes"] == len(started)
    assert sorted(os.listdir(tmp_path / "out" / "rel-v0" / "data")) == ["main_data.hdf5", "metadata.json"]
    dataset = minari.MinariDataset(str(tmp_path / "out" / "rel-v0" / "data"))
    assert_episodes_equal(minari_episodes(dataset), started)


class Boom(RuntimeError):
    pass


def failing_pieces(real, after: int):
    """``iter_pieces`` that raises after ``after`` pieces: a failure midway through writing."""
    def pieces(*args, **kwargs):
        for i, piece in enumerate(real(*args, **kwargs)):
            if i == after:
                raise Boom("disk gone")
            yield piece
    return pieces


@pytest.mark.parametrize("fmt", ["minari", "d4rl", "d3rlpy"])
def test_a_failed_export_leaves_nothing(tmp_path, monkeypatch, minari_root, lowdim, fmt):  # noqa: F811
    if fmt == "minari":
        pytest.importorskip("minari")
    _, store = lowdim
    module = {"minari": "mmreplay.datasets.minari", "d4rl": "mmreplay.datasets.d4rl",
              "d3rlpy": "mmreplay.datasets.d3rlpy"}[fmt]
    monkeypatch.setattr(f"{module}.iter_pieces", failing_pieces(episodes_mod.iter_pieces, 1))
    out = tmp_path / "exports" / ("ds-v0" if fmt == "minari" else "ds.h5")
    with pytest.raises(Boom):
        export_dataset(store, out, fmt, block_rows=8)
    assert not out.exists() and not (out.parent / (out.name + ".partial")).exists()
    monkeypatch.undo()
    export_dataset(store, out, fmt)  # the same path works once the fault is gone
    assert out.exists()


@pytest.mark.parametrize("into_empty_dir", [False, True])
def test_a_failed_import_leaves_no_store(tmp_path, monkeypatch, lowdim, into_empty_dir):
    started, store = lowdim
    export_dataset(store, tmp_path / "ds.h5", "d4rl")
    path = tmp_path / "imported"
    if into_empty_dir:
        path.mkdir()
    from mmreplay.datasets import importing
    real_write = importing.EpisodeWriter.write
    calls = []

    def write(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise Boom("dataset unreadable halfway")
        return real_write(self, *args, **kwargs)
    monkeypatch.setattr(importing.EpisodeWriter, "write", write)
    with pytest.raises(Boom):
        import_dataset(tmp_path / "ds.h5", path, "d4rl", block_rows=4)
    assert len(calls) == 2  # the store existed and held rows when the import failed
    assert (path.exists() and os.listdir(path) == []) if into_empty_dir else not path.exists()
    monkeypatch.undo()
    import_dataset(tmp_path / "ds.h5", path, "d4rl")  # a retry is not refused as "exists"
    with mmreplay.Store.open(path, mode="r") as s:
        assert len(s) == sum(len(e["rewards"]) for e in started)


@pytest.mark.parametrize("select, error", [
    (slice(2, 40), r"stop 40 is past the store's 6 exportable episode\(s\) \(positions 0 to 5\)"),
    (slice(9, None), r"start 9 is past the store's 6"),
    (slice(5, 2), r"selects no episode of the store's 6"),
    (slice(None, None, -1), r"expected a step > 0"),
])
def test_slices_past_the_episodes_are_refused_not_clipped(tmp_path, lowdim, select, error):
    _, store = lowdim
    with pytest.raises((IndexError, ValueError), match=error):
        export_dataset(store, tmp_path / "e.h5", "d4rl", episodes=select)
    assert not (tmp_path / "e.h5").exists()
    export_dataset(store, tmp_path / "ok.h5", "d4rl", episodes=slice(1, 6))
    export_dataset(store, tmp_path / "neg.h5", "d4rl", episodes=slice(-2, None))
