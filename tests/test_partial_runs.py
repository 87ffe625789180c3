"""Partial run reads (``reading/runs.py``, issue 21): a layout-2 run that the disk path read whole once is later
read only in the bytes its wanted frames' chains need. Batches from partial reads equal those of whole-run
reads, of the compressed tier, and the ground truth (episodes starting inside runs, a ring wrapped inside a
run, every frame of every run asked for, keys in the runs' middle); a corrupt byte in a partially read frame
is ``CorruptDataError`` naming the chunk; a stale directory entry costs a whole read, never wrong frames."""

import os

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from conftest import wait_preloaded
from mmreplay.errors import CorruptDataError
from mmreplay.reading import disk
from reference import ReferenceReplay, assert_batch_matches
from test_nstep import assert_nstep_matches

FIXTURE = os.path.join(os.path.dirname(__file__), "data", "atari_fixture.npz")
LAYOUT2 = {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 2}
# layout 3: the same bytes, frames up to one reference from the key LZ4 blocks (a partial read's chain crosses both)
LAYOUT3 = {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 3, "lz4_depth": 1}
CAPACITY = 256
TINY = 1 << 12  # nothing fits: every run comes from its file
LARGE = 1 << 30


@pytest.fixture(scope="module", params=[LAYOUT2, LAYOUT3], ids=["layout2", "layout3"])
def recorded(tmp_path_factory, request):
    """A layout-2 (or -3) store whose 256-row ring wrapped three times and then some (37 rows: the head sits inside
    a run), with episodes of 5 steps (starts fall inside runs of 8), and its reference."""
    with np.load(FIXTURE, allow_pickle=False) as data:
        frames = data["frames"]
    path = str(tmp_path_factory.mktemp("partial") / "store.mmr")
    ref = ReferenceReplay(3, CAPACITY)
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=CAPACITY,
                               frame_stack=3, reward_values=(-1, 0, 1), frame_codec=request.param,
                               durable=False) as s:
        frame = 0
        for t in range(3 * CAPACITY + 37):
            step = t % 5
            if step == 0:
                frame += 1
            obs, nxt = frames[frame % len(frames)], frames[(frame + 1) % len(frames)]
            frame += 1
            row = (obs, t % 6, float(t % 3 - 1), nxt, step == 4 and t % 2 == 0, step == 4 and t % 2 == 1)
            s.add(*row)
            ref.add(0, *row)
    return path, ref


def column(store):
    return store._state.reader.columns["obs"]


def all_batches(store, ref):
    """Every valid transition (every frame of every run, first and last included), in batches of 64."""
    valid = ref.valid_ids(store.inspect.valid_range()[0])
    out = []
    for lo in range(0, len(valid), 64):
        ids = valid[lo:lo + 64]
        batch = store.inspect.get(ids)
        assert_batch_matches(batch, ref, ids)
        out.append((batch.obs.numpy().copy(), batch.next_obs.numpy().copy()))
    return out


def nstep_batches(store, ref, seed=5):
    out = []
    with store.sampler(48, mmreplay.NStep(3, 0.9), seed=seed) as smp:
        for _ in range(4):
            batch = next(smp)
            assert_nstep_matches(batch, ref, 3, 0.9)
            out.append((batch.indices.numpy().copy(), batch.obs.numpy().copy(), batch.next_obs.numpy().copy()))
    return out


def test_the_reader_state_is_reachable(recorded):
    path, _ = recorded
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        assert column(s).runs is not None  # a partial tier of a layout-2 column keeps a run directory
    with mmreplay.Store.open(path, mode="r", cache_bytes=LARGE) as s:
        assert column(s).runs is None  # the whole store in RAM: nothing is read from files


def test_partial_reads_equal_whole_reads_the_tier_and_the_truth(recorded, monkeypatch):
    path, ref = recorded
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=LARGE) as s:
        wait_preloaded(s)
        in_ram = all_batches(s, ref), nstep_batches(s, ref)
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        column(s).runs = None  # the whole-run disk path
        whole = all_batches(s, ref), nstep_batches(s, ref)
        assert s.inspect.cache_stats()["obs"]["disk"]["partial_chunks"] == 0
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        first = all_batches(s, ref)  # every run read whole once (or in part, when the batch before read it)
        assert s.inspect.cache_stats()["obs"]["runs"]["entries"] >= CAPACITY // 8 - 1
        partial = all_batches(s, ref), nstep_batches(s, ref)
        stats = s.inspect.cache_stats()["obs"]["disk"]
        assert stats["partial_chunks"] > 0 and stats["bytes_skipped"] > 0 and stats["partial_retries"] == 0
    for got in (whole, partial):
        for a, b in zip(got[0], in_ram[0]):
            assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])
        for a, b in zip(got[1], in_ram[1]):
            assert all(np.array_equal(x, y) for x, y in zip(a, b))
    for a, b in zip(first, in_ram[0]):
        assert np.array_equal(a[0], b[0]) and np.array_equal(a[1], b[1])


def gather(store, obs_ids, next_ids=None):
    """Frames ``obs_ids`` (and ``next_ids``: (n, k) frame ids) through the store's frame reader."""
    reader = store._state.reader
    next_ids = obs_ids if next_ids is None else next_ids
    obs = np.zeros((*obs_ids.shape, 84, 84), dtype=np.uint8)
    nxt = np.zeros_like(obs)
    reader.gather_stacks("obs", obs_ids.astype(np.int64), next_ids.astype(np.int64), reader.stack_words(obs, 84 * 84),
                         reader.stack_words(nxt, 84 * 84), shifted=False)
    return obs, nxt


def frame_windows(store):
    """For every frame id held, the 3 frames up to it and the 3 after it (both within what is held): every
    frame of every run, first and last, keys, and windows across the ring's seam (its last row -> row 0)."""
    reader = store._state.reader
    ids = np.arange(reader.oldest + 2, reader.head - 3, dtype=np.int64)
    return ids[:, None] + np.arange(-2, 1), ids[:, None] + np.arange(1, 4)


def test_frame_windows_from_partial_reads_equal_the_tier(recorded, monkeypatch):
    path, _ = recorded
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=LARGE) as s:
        wait_preloaded(s)
        obs_ids, next_ids = frame_windows(s)
        rows = s._state.reader.ring.rows
        assert ((obs_ids[:, 0] % rows) > (next_ids[:, -1] % rows)).any()  # windows across the ring's seam
        want = gather(s, obs_ids, next_ids)
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        for lo in range(0, len(obs_ids), 40):  # runs read whole, then in part by the next batch
            got = gather(s, obs_ids[lo:lo + 40], next_ids[lo:lo + 40])
            assert np.array_equal(got[0], want[0][lo:lo + 40]) and np.array_equal(got[1], want[1][lo:lo + 40])
        for lo in range(0, len(obs_ids), 7):  # every run in the directory: partial reads only
            got = gather(s, obs_ids[lo:lo + 7], next_ids[lo:lo + 7])
            assert np.array_equal(got[0], want[0][lo:lo + 7]) and np.array_equal(got[1], want[1][lo:lo + 7])
        stats = s.inspect.cache_stats()["obs"]["disk"]
        assert stats["partial_chunks"] > len(obs_ids) // 7 and stats["partial_retries"] == 0


def test_a_partial_read_is_only_the_chain_from_the_key(recorded, monkeypatch):
    """The last frames of a run need the frames from the key (the middle) to them: not the header, the frames
    before the key or the checksum."""
    path, _ = recorded
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        reader = s._state.reader
        f = reader.oldest + 8 - reader.oldest % 8 + 7  # the last frame of the first whole run held
        ids = np.array([[f - 2, f - 1, f]])
        want = gather(s, ids)  # read whole: the entry is made
        runs = column(s).runs
        chunk = (f % reader.ring.rows) // 8
        assert runs.n[chunk] == 8
        before = dict(s.inspect.cache_stats()["obs"]["disk"])
        got = gather(s, ids)
        after = s.inspect.cache_stats()["obs"]["disk"]
        assert np.array_equal(got[0], want[0])
        assert after["partial_chunks"] == before["partial_chunks"] + 1 and after["reads"] == before["reads"] + 1
        bounds, whole = runs.bounds[chunk].astype(np.int64), int(runs.size[chunk])
        assert after["bytes_skipped"] - before["bytes_skipped"] == bounds[3] + (whole - bounds[8])  # key: frame 3
        assert after["bytes_read"] - before["bytes_read"] == bounds[8] - bounds[3]


def _corrupt(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def test_a_corrupt_byte_in_a_partially_read_frame_is_an_error(tmp_path, recorded, monkeypatch):
    import shutil

    src, _ = recorded
    path = str(tmp_path / "copy.mmr")
    shutil.copytree(src, path)
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        reader = s._state.reader
        f = reader.oldest + 8 - reader.oldest % 8 + 6  # frame 6 of the first whole run held
        ids = np.array([[f - 2, f - 1, f]])
        gather(s, ids)
        runs, array = column(s).runs, column(s).column.array
        chunk = (f % reader.ring.rows) // 8
        shard, inner = divmod(chunk, array.layout.chunks_per_shard)
        a, b = int(runs.bounds[chunk, 6]), int(runs.bounds[chunk, 7])
        _corrupt(array.layout.shard_file(array.root, shard), int(runs.offset[chunk]) + (a + b) // 2)
        with pytest.raises(CorruptDataError, match=f"shard {shard}, chunk {inner}: checksum mismatch"):
            gather(s, ids)
        # the frame's checksum failed, the whole run was read again and its chunk checksum failed too
        assert s.inspect.cache_stats()["obs"]["disk"]["partial_retries"] == 1
        with pytest.raises(CorruptDataError, match=f"chunk {inner}"):
            gather(s, ids)  # no entry was made from the bad run: read whole, refused again
        assert gather(s, ids - 8)[0].any()  # the run before stays readable


def test_a_stale_directory_entry_costs_a_whole_read_not_wrong_frames(recorded, monkeypatch):
    path, _ = recorded
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        reader = s._state.reader
        f = reader.oldest + 8 - reader.oldest % 8 + 6
        ids = np.array([[f - 2, f - 1, f]])
        want = gather(s, ids)
        chunk = (f % reader.ring.rows) // 8
        column(s).runs.fcrc[chunk, 6] ^= 1  # the entry no longer describes the bytes (a file replaced in place)
        assert np.array_equal(gather(s, ids)[0], want[0])
        stats = s.inspect.cache_stats()["obs"]["disk"]
        assert stats["partial_retries"] == 1
        before = stats["partial_chunks"]
        assert np.array_equal(gather(s, ids)[0], want[0])  # the entry was made again from the whole read
        stats = s.inspect.cache_stats()["obs"]["disk"]
        assert stats["partial_retries"] == 1 and stats["partial_chunks"] == before + 1


def test_a_writer_rewriting_runs_reads_the_new_bytes(store_path, monkeypatch):
    """A writer with a tiny budget: runs read from files (entries made), then rewritten as the ring wraps;
    every batch still equals the truth (entries of rewritten rows are dropped, or fail their checksums)."""
    with np.load(FIXTURE, allow_pickle=False) as data:
        frames = data["frames"]
    monkeypatch.setattr(disk, "_cached_first", False)
    ref = ReferenceReplay(3, 128)
    with mmreplay.Store.create(store_path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=128,
                               frame_stack=3, reward_values=(-1, 0, 1), frame_codec=LAYOUT2, durable=False,
                               cache_bytes=TINY) as s:
        for t in range(128 * 4):
            obs, nxt = frames[(3 * t) % len(frames)], frames[(3 * t + 1) % len(frames)]
            row = (obs, t % 6, 0.0, nxt, False, t % 11 == 10)
            s.add(*row)
            ref.add(0, *row)
            if t % 40 == 39:
                s.flush()
                for _ in range(2):
                    batch = s.sample(32)
                    assert_batch_matches(batch, ref, batch.indices.tolist())
        assert s.inspect.cache_stats()["obs"]["disk"]["partial_chunks"] > 0


def test_partial_reads_is_a_session_setting_with_an_environment_override(recorded, monkeypatch):
    path, _ = recorded
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY, partial_reads=False) as s:
        assert column(s).runs is None and s.settings.partial_reads is False
    monkeypatch.setenv("MMREPLAY_PARTIAL_READS", "0")
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        assert column(s).runs is None
    monkeypatch.setenv("MMREPLAY_PARTIAL_READS", "yes")
    with pytest.raises(ValueError, match="MMREPLAY_PARTIAL_READS must be 0 or 1"):
        mmreplay.Store.open(path, mode="r")
    with pytest.raises(ValueError, match="partial_reads must be True or False"):
        mmreplay.Settings(partial_reads=1)


def test_the_partial_kernels_refuse_rows_and_frames_outside_the_directory():
    from mmreplay._native import runs as kernels
    from mmreplay.reading.runs import RunDirectory

    d = RunDirectory(4, 8)
    out = np.zeros((2, 16), dtype=np.uint8)
    src = np.array([out.ctypes.data], dtype=np.int64)  # never read: every call below is refused first
    starts, js = np.array([0, 1], dtype=np.int64), np.array([0], dtype=np.int64)
    dsts = np.array([out.ctypes.data], dtype=np.int64)
    status = np.zeros(1, dtype=np.int8)
    one = np.zeros(1, dtype=np.int64)
    directory = (d.n, d.refs, d.bounds, d.fcrc)
    with pytest.raises(ValueError, match="rows"):  # row 4 of 4
        kernels.checked_decode_partial_groups(src, one, one, one + 4, starts, js, dsts, 16, 8, directory, status,
                                              (out,))
    with pytest.raises(ValueError, match="outside runs of 8"):
        kernels.checked_decode_partial_groups(src, one, one + 8, one, starts, js, dsts, 16, 8, directory, status,
                                              (out,))
    with pytest.raises(ValueError, match="dsts"):  # a destination without 16 bytes of room in ``out``
        kernels.checked_decode_partial_groups(src, one, one, one, starts, js, dsts + 30, 16, 8, directory, status,
                                              (out,))
    with pytest.raises(ValueError, match="inside the buffer"):
        kernels.checked_index_runs(src + 8, one + 40, one, out, *directory)
    assert not out.any() and d.entries == 0


def test_a_binding_budget_pays_for_the_run_directory_and_the_index(recorded):
    from mmreplay.reading.tiers import PARTIAL_RESIDENT_SHARE

    path, _ = recorded
    on_disk = sum(os.path.getsize(os.path.join(root, f)) for root, _, files in
                  os.walk(os.path.join(path, "frames")) for f in files)
    budget = on_disk // 2
    with mmreplay.Store.open(path, mode="r", cache_bytes=budget) as s:
        stats = s.inspect.cache_stats()["obs"]
        index = s._state.ring.nbytes
        assert index > 0 and stats["runs"]["nbytes"] > 0 and stats["compressed"]["capacity_bytes"] > 0
        plan = s._state.reader.plan
        assert stats["compressed"]["capacity_bytes"] + stats["runs"]["nbytes"] <= plan.resident_bytes
        assert plan.resident_bytes <= PARTIAL_RESIDENT_SHARE * budget
        assert plan.resident_bytes + plan.decoded_bytes + index <= budget  # the budget pays for the index too


def _frames_bytes(path):
    root = os.path.join(path, "frames", "obs")
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, files in os.walk(root) for f in files)


def test_a_failed_tier_decode_waits_for_the_file_reads_beside_it(recorded, monkeypatch):
    """A batch whose runs lie partly in the tier and partly in files reads the files on the file-reads thread
    while it decodes the tier's: when that decode fails, the batch raises its error only after the reads
    ended, and the next batches are true."""
    from mmreplay.reading.decoding import Decoder

    path, ref = recorded
    monkeypatch.setattr(disk, "_cached_first", False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=_frames_bytes(path) // 2) as s:
        wait_preloaded(s)
        held = int(np.count_nonzero(column(s).resident.chunk_addr > 0))
        assert 0 < held < CAPACITY // 8, held  # some runs held, some read from their files
        real, calls = Decoder.decode_run_groups, []

        def failing(self, *args, **kwargs):
            calls.append(self)
            if len(calls) == 1:
                raise CorruptDataError("injected: the tier's decode failed")
            return real(self, *args, **kwargs)

        monkeypatch.setattr(Decoder, "decode_run_groups", failing)
        reads = s.inspect.cache_stats()["obs"]["disk"]["reads"]
        with pytest.raises(CorruptDataError, match="injected"):
            s.inspect.get(ref.valid_ids(s.inspect.valid_range()[0]))
        assert s.inspect.cache_stats()["obs"]["disk"]["reads"] > reads  # the files were read beside it
        all_batches(s, ref)
        nstep_batches(s, ref)


def test_a_forked_child_reads_runs_from_files_with_its_own_thread(recorded):
    """A child forked while the parent's file-reads, IO and codec-helper threads exist (none of them is in the
    child) reads runs from their files through a store it opens itself: true rows, no hang."""
    import time

    path, ref = recorded
    with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as s:
        all_batches(s, ref)  # the parent's file-reads and IO threads exist now
        pid = os.fork()
        if pid == 0:  # pragma: no cover (the child)
            code = 1
            try:  # the parent's store refuses a forked child (StoreClosedError): the child opens its own
                with mmreplay.Store.open(path, mode="r", cache_bytes=TINY) as mine:
                    all_batches(mine, ref)
                    nstep_batches(mine, ref)
                code = 0
            except BaseException:
                import traceback
                traceback.print_exc()
            finally:
                os._exit(code)
        deadline = time.monotonic() + 120
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung reading runs from their files")
            time.sleep(0.05)
        assert os.waitstatus_to_exitcode(status) == 0
        all_batches(s, ref)


@pytest.mark.parametrize("layout", [1, 2])
def test_only_runs_that_can_be_read_in_part_pay_for_a_directory(tmp_path, layout):
    """A partial tier of layout-1 runs (one zstd frame a run: always read whole) keeps no run directory, so the whole
    share planned for the tier holds runs; layout 2 keeps one, paid from that share."""
    with np.load(FIXTURE, allow_pickle=False) as data:
        frames = data["frames"]
    spec = {**LAYOUT2, "layout": layout}
    path = str(tmp_path / "s.mmr")
    with mmreplay.Store.create(path, spaces.Box(0, 255, (84, 84), np.uint8), spaces.Discrete(6), capacity=CAPACITY,
                               frame_stack=3, reward_values=(-1, 0, 1), frame_codec=spec, durable=False) as s:
        for t in range(CAPACITY + 37):
            s.add(frames[t % len(frames)], t % 6, 0.0, frames[(t + 1) % len(frames)], False, False)
    with mmreplay.Store.open(path, mode="r", cache_bytes=_frames_bytes(path) // 2) as s:
        stats, plan = s.inspect.cache_stats()["obs"], s._state.reader.plan
        assert 0 < plan.resident_bytes < _frames_bytes(path)  # a partial tier: some runs come from the files
        if layout == 1:
            assert stats["runs"] is None and column(s).runs is None
            assert stats["compressed"]["capacity_bytes"] == plan.resident_bytes
        else:
            assert stats["runs"]["nbytes"] > 0
            assert stats["compressed"]["capacity_bytes"] == plan.resident_bytes - stats["runs"]["nbytes"]
