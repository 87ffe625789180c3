"""The mmreplay command: info (table and JSON, episodes and returns), verify (intact and corrupt), plot,
bench, progress bars, a closed pipe, clear errors."""

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import frame_shard_file
from mmreplay.cli import main
from mmreplay.sampling.strategy import Prioritized


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
        path = frame_shard_file(s, 0)
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
    from mmreplay.cli.plot import episode_lengths

    with mmreplay.Store.open(small_store, mode="r") as s:
        assert episode_lengths(s).tolist() == [50] * 6


# -- episode statistics: ground truth from the generator, never from the store ----------------------------

def drive_streams(path, n_steps, capacity, seed, reward_values=(-1, 0, 1), streams=3):
    """Random episodes on interleaved streams, one ``add`` per step. Returns the store (open) and each
    episode as (first id, last id, return, length, ended), ids being the global ids the store gives."""
    rng = np.random.default_rng(seed)
    store = mmreplay.Store.create(path, spaces.Box(-1, 1, (2,), np.float32), spaces.Discrete(4), capacity=capacity,
                                  reward_values=reward_values, durable=False)
    open_eps = {}  # stream -> [first, last, return, length, remaining steps]
    episodes = []
    obs = {s: rng.uniform(-1, 1, 2).astype(np.float32) for s in range(streams)}
    for g in range(n_steps):
        s = int(rng.integers(streams))
        ep = open_eps.setdefault(s, [g, g, 0.0, 0, int(rng.integers(1, 40))])
        reward = float(rng.choice(reward_values)) if reward_values else float(rng.standard_normal())
        nxt = rng.uniform(-1, 1, 2).astype(np.float32)
        ep[4] -= 1
        end = ep[4] == 0
        term, trunc = end and rng.random() < 0.5, False
        trunc = end and not term
        store.add(obs[s], int(rng.integers(4)), reward, nxt, term, trunc, stream=s)
        obs[s] = nxt
        ep[1], ep[2], ep[3] = g, ep[2] + np.float32(reward), ep[3] + 1
        if end:
            episodes.append((ep[0], ep[1], ep[2], ep[3], True))
            del open_eps[s]
            obs[s] = rng.uniform(-1, 1, 2).astype(np.float32)
    episodes += [(e[0], e[1], e[2], e[3], False) for e in open_eps.values()]
    return store, episodes


@pytest.mark.parametrize("capacity, reward_values, chunk", [(None, (-1, 0, 1), 7), (300, (-1, 0, 1), 7),
                                                            (300, None, 1 << 18), (300, None, 64)])
def test_episode_stats_match_the_generated_episodes(store_path, capacity, reward_values, chunk):
    from mmreplay.stats import episode_stats

    store, episodes = drive_streams(store_path, 1200, capacity, seed=3, reward_values=reward_values)
    with store:
        store.flush()
        oldest, head = store.inspect.valid_range()
        stats = episode_stats(store, chunk=chunk)
    complete = sorted((e for e in episodes if e[4] and e[0] >= oldest), key=lambda e: e[1])
    assert stats.complete == len(complete) > 5
    np.testing.assert_allclose(stats.returns, [e[2] for e in complete], rtol=1e-5, atol=1e-4)
    assert stats.lengths.tolist() == [e[3] for e in complete]
    assert stats.end_ids.tolist() == [e[1] for e in complete]
    assert stats.cut == sum(1 for e in episodes if e[4] and e[0] < oldest <= e[1])
    assert stats.running == sum(1 for e in episodes if not e[4] and e[1] >= oldest)
    if capacity:
        assert oldest > 0 and stats.cut >= 1
    summary = stats.summary()
    assert summary["return"]["last_100_mean"] == pytest.approx(np.mean([e[2] for e in complete][-100:]))


def test_plot_column_values_match_store_get_across_the_ring(store_path):
    """``plot``'s column reads (``inspect.read_column``, chunked) give what ``get`` gives, across a ring wrap."""
    from mmreplay.cli import plot

    store, _ = drive_streams(store_path, 1000, 300, seed=4)
    with store:
        store.flush()
        oldest, head = store.inspect.valid_range()
        batch = store.inspect.get(np.arange(oldest, head))
        for name, want in (("reward", batch.reward.numpy()), ("action", batch.action.numpy())):
            values, counts = plot.column_values(store, name, exact=True)
            expect_values, expect_counts = np.unique(want, return_counts=True)
            np.testing.assert_array_equal(values.astype(want.dtype), expect_values, err_msg=name)
            np.testing.assert_array_equal(counts, expect_counts, err_msg=name)
            np.testing.assert_array_equal(store.inspect.read_column(name, oldest + 2, head).astype(want.dtype),
                                          want[2:], err_msg=name)


def test_committed_priorities_are_the_committed_ones(store_path):
    """``stats.committed_priorities`` reads the last commit's buffers (an update after it does not show) and
    gives transitions added after the set's last commit its ``max_priority``."""
    from mmreplay.stats import committed_priorities

    store, _ = drive_streams(store_path, 700, 300, seed=5)
    with store:
        sampler = store.sampler(16, Prioritized(), seed=0)
        batch = next(sampler)
        ids = np.unique(batch.indices.numpy())
        values = np.arange(1, ids.size + 1, dtype=np.float32) / 4
        sampler.update_priorities(ids, values)
        sampler.close()
        store.flush()
        store.inspect.priorities().update(ids[:1], [100.0])  # not committed
        oldest, head = store.inspect.valid_range()
        p = committed_priorities(store)["default"]
        assert p.size == head - oldest
        np.testing.assert_allclose(p[ids - oldest], values, rtol=1e-6)
    # closing committed the update; reopened, the set is not loaded: its entry keeps the old head
    values[0] = 100.0
    with mmreplay.Store.open(store_path) as store:
        obs = np.zeros((5, 2), np.float32)
        store.extend(obs, np.zeros(5, int), np.zeros(5, np.float32), obs, np.zeros(5, bool), np.zeros(5, bool),
                     streams=np.full(5, 9))
    with mmreplay.Store.open(store_path, mode="r") as store:
        oldest, head = store.inspect.valid_range()
        p = committed_priorities(store)["default"]
        assert p.size == head - oldest
        np.testing.assert_array_equal(p[-5:], 100.0)  # the set's max_priority
        np.testing.assert_allclose(p[ids - oldest], values, rtol=1e-6)


# -- info -------------------------------------------------------------------------------------------------

def test_info_tells_episodes_returns_padding_and_cache(store_path, capsys):
    store, episodes = drive_streams(store_path, 600, None, seed=6)
    store.close()
    complete = sorted((e for e in episodes if e[4]), key=lambda e: e[1])
    returns = [e[2] for e in complete]
    assert main(["info", store_path]) == 0
    out = capsys.readouterr().out
    assert f"episodes {len(complete)} complete, {sum(not e[4] for e in episodes)} running, 0 cut" in out
    assert f"return mean {np.mean(returns):,.3g}, min {min(returns):,.3g}, max {max(returns):,.3g}" in out
    assert "stack_padding first" in out and "frame memory with the default budget" in out and "decoded frames" in out
    assert main(["info", store_path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["episodes"]["complete"] == len(complete) and info["stack_padding"] == "first"
    assert info["episodes"]["return"]["max"] == pytest.approx(max(returns))
    assert info["cache"]["fraction_of_frames"] == 1.0 and info["prioritized_samplers"] == {}


def test_info_separates_what_a_sampler_holds_from_what_the_caps_allow(tmp_path, capsys):
    # A small image store under the default budget: the caps are far above what there is to hold, and info
    # must not read as if the store needed the caps ("a cache of 1,045 MB of decoded frames").
    from mmreplay.cli.quickbench import atari_fixture, fill

    path = str(tmp_path / "atari")
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=1000,
                               frame_stack=4, reward_values=(-1, 0, 1), durable=False) as s:
        fill(s, atari_fixture(), 300)
    assert main(["info", path, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    cache = info["cache"]
    assert main(["info", path]) == 0
    out = capsys.readouterr().out
    decoded = info["frames"] * 84 * 84  # every frame the store holds, decoded
    assert cache["held_at_most_bytes"] == decoded < cache["capacity_bytes"]
    assert 0 < cache["compressed_held_at_most_bytes"] < cache["compressed_cap_bytes"]
    assert f"decoded cache holds at most {decoded / 1e6:,.2f} MB, all decoded frames " \
           f"(cap {cache['capacity_bytes'] / 1e6:,.2f} MB)" in out
    assert f"compressed frames in RAM: all {cache['compressed_held_at_most_bytes'] / 1e6:,.2f} MB of them (cap " in out
    assert "a cache of" not in out


def _run_cli(*args, **kwargs):
    return subprocess.Popen([sys.executable, "-m", "mmreplay.cli", *args], stderr=subprocess.PIPE, **kwargs)


def test_info_into_a_closed_pipe_ends_quietly(small_store):
    # The reader is gone before the first line: every write fails with EPIPE (deterministic).
    r, w = os.pipe()
    os.close(r)
    proc = _run_cli("info", small_store, stdout=w)
    os.close(w)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 141, err.decode()
    assert b"Traceback" not in err and b"BrokenPipeError" not in err, err.decode()


def test_info_piped_into_head(small_store):
    # What users type: `mmreplay info STORE | head -1` (a real shell pipe). The first line is flushed
    # before the figures are computed, so head has exited by the time the rest is written.
    cmd = f"{sys.executable} -m mmreplay.cli info {small_store} | head -1"
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, timeout=120)
    assert proc.stdout.decode().startswith("store ") and proc.stdout.decode().count("\n") == 1
    assert b"Traceback" not in proc.stderr and b"BrokenPipeError" not in proc.stderr, proc.stderr.decode()


# -- plot, bench, progress --------------------------------------------------------------------------------

def test_plot_panels_for_an_image_store_with_priorities(tmp_path):
    pytest.importorskip("matplotlib")
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from mmreplay.cli.plot import store_figure
    from mmreplay.cli.quickbench import atari_fixture, fill

    path = str(tmp_path / "atari")
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=1000,
                               frame_stack=4, reward_values=(-1, 0, 1), durable=False) as s:
        fill(s, atari_fixture(), 1500)
        sampler = s.sampler(32, Prioritized(), seed=0)
        batch = next(sampler)
        sampler.update_priorities(batch.indices, np.linspace(0.01, 5, 32))
        sampler.close()
    with mmreplay.Store.open(path, mode="r") as s:
        fig = store_figure(s, "atari")
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    assert sum(t.startswith("t=") for t in titles) == 8  # the thumbnail strip
    assert any(t.startswith("return per episode: mean") for t in titles)
    assert any(t.startswith("episode lengths (") for t in titles)
    assert "actions (1,000 transitions)" in titles and "rewards (1,000 transitions)" in titles
    assert "priorities of sampler 'default' (1,000 transitions)" in titles
    logs = [ax.get_yscale() for ax in fig.axes if not ax.get_title().startswith(("t=", "return"))]
    assert logs and set(logs) == {"log"}  # counts on log scales: rare values show


def test_plot_of_a_low_dim_store_shows_observations(store_path):
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from mmreplay.cli.plot import store_figure

    store, _ = drive_streams(store_path, 400, None, seed=7, reward_values=None)
    store.close()
    with mmreplay.Store.open(store_path, mode="r") as s:
        fig = store_figure(s, "lowdim")
    titles = [ax.get_title() for ax in fig.axes]
    plt.close(fig)
    assert not any(t.startswith("t=") for t in titles) and not any("priorities" in t for t in titles)
    assert any(t.startswith("observation 'obs' values") for t in titles)
    assert any(t.startswith("rewards (400 sampled transitions)") for t in titles)


def test_bench_runs_on_real_frames_and_names_its_reference(capsys):
    assert main(["bench", "--n", "1500"]) == 0
    out = capsys.readouterr().out
    assert "real Atari transitions" in out and "transitions/s" in out and "batch 256" in out
    assert "reference:" in out and "SB3 ReplayBuffer" in out and "docs/performance.md" in out


def test_packaged_fixture_is_the_test_fixture():
    import mmreplay.data

    packaged = os.path.join(os.path.dirname(mmreplay.data.__file__), "atari_fixture.npz")
    tests = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")
    assert open(packaged, "rb").read() == open(tests, "rb").read()


def test_progress_bar_is_tqdm_on_a_terminal(monkeypatch):
    from mmreplay.cli import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    monkeypatch.setattr(sys, "stderr", term)
    bar = Progress("verifying", unit="shards")
    for done in (1, 5, 10):
        bar(done, 10)
    assert bar.bar is None  # closed at the last call
    text = term.getvalue()
    assert "verifying" in text and "10/10" in text and "shards" in text


def test_python_dash_m_mmreplay_is_the_command():
    out = subprocess.run([sys.executable, "-m", "mmreplay", "--help"], capture_output=True, text=True, check=True,
                         timeout=120).stdout
    for command in ("info", "verify", "plot", "bench", "demo", "export", "import"):
        assert command in out
