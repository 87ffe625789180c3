"""The temporal codec's reference search (``choose_references``), one pass per distance, against the rule it
implements written frame by frame: each frame takes, of the ``search`` frames before it, the one whose
signed-byte differences (on the strided sample) are smallest in magnitude, the nearest on a tie; its residual
is its bytes minus that frame's, modulo 256. The chosen references are part of the stored bytes, so a faster
search must choose exactly the same ones.
"""

from __future__ import annotations

import os

import numpy as np
import pytest

from mmreplay.codecs.temporal import SAMPLED_BYTES, choose_references, decode_run, encode_run

FIXTURE = os.path.join(os.path.dirname(__file__), "..", "mmreplay", "data", "atari_fixture.npz")


def references_frame_by_frame(frames: np.ndarray, search: int) -> tuple[np.ndarray, np.ndarray]:
    n = frames.shape[0]
    step = max(1, frames.shape[1] // SAMPLED_BYTES)
    sample = frames[:, ::step].astype(np.int64)
    refs = np.zeros(n, dtype=np.uint8)
    residuals = frames.copy()
    for i in range(1, n):
        best, best_cost = 0, None
        for d in range(1, min(i, search) + 1):
            signed = (sample[i] - sample[i - d] + 128) % 256 - 128
            cost = int(np.abs(signed).sum())
            if best_cost is None or cost < best_cost:
                best, best_cost = d, cost
        refs[i] = best
        if best:
            residuals[i] = frames[i] - frames[i - best]
    return refs, residuals


def runs():
    rng = np.random.default_rng(7)
    atari = np.load(FIXTURE)["frames"].reshape(-1, 84 * 84)
    out = [atari[i:i + 8] for i in range(0, 320, 8)]  # real consecutive frames
    out += [atari[rng.integers(0, len(atari), 8)] for _ in range(10)]  # unrelated frames: references vary
    out += [rng.integers(0, 256, (n, 700), dtype=np.uint8) for n in (1, 2, 3, 8, 16, 64)]  # -128 differences
    extremes = np.zeros((6, 2048), np.uint8)
    extremes[1::2] = 128  # every difference is -128 or +128: the magnitudes must read 128
    out.append(extremes)
    out.append(np.repeat(atari[:1], 8, axis=0))  # identical frames: every tie goes to the nearest
    drift = atari[:1].astype(np.int64) + np.arange(8)[:, None] * np.array([1, -1] * (84 * 42))
    out.append((drift % 256).astype(np.uint8))  # small signed differences that wrap
    return out


@pytest.mark.parametrize("search", [0, 1, 2, 3, 8, 16])
def test_same_references_and_residuals_as_frame_by_frame(search):
    for frames in runs():
        refs, residuals = choose_references(frames, search)
        want_refs, want_residuals = references_frame_by_frame(frames, search)
        assert refs.dtype == np.uint8 and refs.tolist() == want_refs.tolist(), (frames.shape, search)
        assert np.array_equal(residuals, want_residuals), (frames.shape, search)


def test_ties_go_to_the_nearest_frame():
    frame = np.arange(1000, dtype=np.uint8)
    refs, residuals = choose_references(np.stack([frame] * 5), 8)
    assert refs.tolist() == [0, 1, 1, 1, 1]
    assert not residuals[1:].any()


def test_runs_round_trip_through_the_search():
    for frames in runs():
        data = encode_run(frames)
        out = np.empty_like(frames)
        decode_run(data, out)
        assert np.array_equal(out, frames)
