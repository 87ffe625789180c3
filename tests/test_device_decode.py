"""The device decode path (``mmreplay/device/``, issue 38) on CPU tensors, the CPU batch decoder standing in for
nvCOMP: every batch equals the CPU path's, bit for bit, for every frame codec and layout, and damaged bytes are
refused before they reach a batch."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
import torch
from gymnasium import spaces

import mmreplay
from mmreplay import codecs
from mmreplay.codecs.base import PIECE_COPY, PIECE_LZ4, PIECE_ZSTD
from mmreplay.device.assemble import gather_rows
from mmreplay.device.chains import rebuild_chains
from mmreplay.device.decoders import CpuDecoder
from mmreplay.device.pipeline import DevicePath
from mmreplay.device.staging import chain_depths, stage
from mmreplay.errors import CorruptDataError

FIXTURE = os.path.join(os.path.dirname(mmreplay.__file__), "data", "atari_fixture.npz")
CAPACITY = 256
ADDS = 3 * CAPACITY + 37  # the ring wraps three times; the head sits inside a run
GREY = {
    "lz4hc": "lz4hc",  # blosc lz4hc
    "blosc-lz4": {"name": "blosc", "cname": "lz4", "clevel": 9},
    "blosc-zstd": {"name": "blosc", "cname": "zstd", "clevel": 3},
    "zstd": "zstd",
    "delta-zstd": "delta-zstd",  # temporal, layout 1
    "temporal-2": {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 2},
    "temporal-3": {"name": "temporal", "level": 3, "run": 8, "search": 8, "layout": 3, "lz4_depth": 1},
    "delta-lz4": {"name": "delta-lz4", "level": 9, "run": 8, "search": 8},  # one LZ4 block a run
}
RGB = {
    "lz4hc": "lz4hc",
    "zstd": "zstd",
    "temporal-3-run16": {"name": "temporal", "level": 6, "run": 16, "search": 8, "layout": 3, "lz4_depth": 0},
    "delta-zstd": "delta-zstd",
    "delta-lz4": "delta-lz4",  # runs of 32, the store default for sequences of colour frames
}
DRAWS = {
    "uniform": lambda: mmreplay.Uniform(),
    "nstep": lambda: mmreplay.NStep(3, 0.9),
    "sequences": lambda: mmreplay.Sequences(4, burn_in=2, strict=False),
}


def grey_frames():
    with np.load(FIXTURE, allow_pickle=False) as data:
        return data["frames"][:300]


def rgb_frames(n=300, shape=(20, 24, 3)):
    """Colour frames of noise (poor alone) in which a sprite moves and the light drifts (cheap as differences:
    the temporal codec codes most of them against a neighbour, so the device path rebuilds chains)."""
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, shape, dtype=np.uint8)
    out = np.empty((n, *shape), dtype=np.uint8)
    for i in range(n):
        frame = base + np.uint8(i % 256)  # every byte changes: whole-run zstd finds no repeats, differences do
        y, x = (i * 3) % (shape[0] - 4), (i * 5) % (shape[1] - 4)
        frame[y:y + 4, x:x + 4] = 255
        out[i] = frame
    return out


def fill(store, frames, adds=ADDS, episode=5):
    """Episodes of ``episode`` steps, so that starts fall inside runs of 8 and 16; terminated and truncated
    alternate."""
    frame = 0
    for t in range(adds):
        step = t % episode
        if step == 0:
            frame += 1
        obs, nxt = frames[frame % len(frames)], frames[(frame + 1) % len(frames)]
        frame += 1
        store.add(obs, t % 6, float(t % 3 - 1), nxt, step == episode - 1 and t % 2 == 0,
                  step == episode - 1 and t % 2 == 1)


def make_store(path, frames, codec, padding="first", adds=ADDS, **settings):
    store = mmreplay.Store.create(path, spaces.Box(0, 255, frames.shape[1:], np.uint8), spaces.Discrete(6),
                                  capacity=CAPACITY, frame_stack=3, reward_values=(-1, 0, 1), frame_codec=codec,
                                  stack_padding=padding, durable=False, **settings)
    fill(store, frames, adds)
    return store


def fields(batch) -> dict:
    out = {}
    for name, value in vars(batch).items():
        if isinstance(value, dict):
            out.update({f"{name}.{k}": v.clone() for k, v in value.items()})
        elif isinstance(value, torch.Tensor):
            out[name] = value.clone()
    return out


def assert_same_batches(store, draw, batches=4, batch_size=24, seed=11):
    """The device path's batches equal the CPU path's for the same seed, field by field, bit for bit; returns
    ``(chunks staged, frames rebuilt from a reference)`` (chunks must have been staged: the path was taken)."""
    staged_chunks = chained = 0
    with store.sampler(batch_size, DRAWS[draw](), seed=seed, decode="cpu", name="cpu_path") as cpu, \
            store.sampler(batch_size, DRAWS[draw](), seed=seed, decode="device", name="device_path") as dev:
        assert dev._device_path is not None and isinstance(dev._device_path.decoder, CpuDecoder)
        assert cpu._device_path is None
        for i in range(batches):
            want = fields(next(cpu))
            got = fields(next(dev))
            staged = dev._device_draw.pending.staged
            staged_chunks += staged.chunks
            chained += sum(int((plan.refs >= 0).sum()) for plan in staged.keys.values())
            assert want.keys() == got.keys()
            assert all(want[k].any() for k in want if k.startswith("obs")), "all-zero frames: nothing compared"
            for key in want:
                assert want[key].dtype == got[key].dtype and want[key].shape == got[key].shape, key
                assert torch.equal(want[key], got[key]), f"{draw} batch {i}: field {key} differs"
    assert staged_chunks > 0
    return staged_chunks, chained


# -- the device path equals the CPU path --------------------------------------------------------------------
@pytest.fixture(scope="module", params=sorted(GREY), ids=sorted(GREY))
def grey_store(tmp_path_factory, request):
    path = str(tmp_path_factory.mktemp("grey") / "store.mmr")
    with make_store(path, grey_frames(), GREY[request.param]):
        pass
    return path


@pytest.fixture(scope="module", params=["lz4hc", "delta-zstd", "temporal-3", "delta-lz4"])
def writing_store(tmp_path_factory, request):
    """A store still being written: rows of its staging shard come from the writer's RAM, the rest from files
    or the compressed tier."""
    with make_store(str(tmp_path_factory.mktemp("writing") / "store.mmr"), grey_frames(), GREY[request.param]) as s:
        yield s


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_grey_frames_of_a_store_being_written_equal_the_cpu_path(writing_store, draw):
    assert writing_store._state.frames.ram_shards("obs")
    assert_same_batches(writing_store, draw)


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_grey_frames_from_the_compressed_tier_equal_the_cpu_path(grey_store, draw):
    with mmreplay.Store.open(grey_store, "r") as store:
        _, chained = assert_same_batches(store, draw)
        if store._state.schema.observations[0].codec.get("layout", 1) > 1:  # Atari runs of layout 1: all alone
            assert chained > 0, "no frame of the temporal codec's runs was coded against another: chains untested"


def test_grey_frames_read_from_files_equal_the_cpu_path(grey_store):
    """A budget too small for a compressed tier: every chunk is read from its shard file."""
    with mmreplay.Store.open(grey_store, "r", cache_bytes=1 << 16, preload=False) as store:
        assert store._state.reader.columns["obs"].resident is None or \
            not store._state.reader.columns["obs"].resident.nbytes
        assert_same_batches(store, "nstep", seed=3)


@pytest.fixture(scope="module", params=sorted(RGB))
def rgb_store(tmp_path_factory, request):
    """Reopened to read: every frame comes from the files (the writer's RAM would hand them over as they are)."""
    path = str(tmp_path_factory.mktemp("rgb") / "store.mmr")
    with make_store(path, rgb_frames(), RGB[request.param]):
        pass
    with mmreplay.Store.open(path, "r") as s:
        yield s


@pytest.mark.parametrize("draw", sorted(DRAWS))
def test_rgb_frames_equal_the_cpu_path(rgb_store, draw):
    _, chained = assert_same_batches(rgb_store, draw)
    if rgb_store._state.schema.observations[0].codec["name"] == "temporal":
        assert chained > 0, "no frame of the temporal codec's runs was coded against another: chains untested"


@pytest.mark.parametrize("codec", ["lz4hc", "temporal-2"])
def test_zero_padded_stacks_equal_the_cpu_path(tmp_path, codec):
    """``stack_padding="zeros"``: positions before an episode's first frame are zeros on both paths."""
    with make_store(str(tmp_path / "zeros.mmr"), grey_frames(), GREY[codec], padding="zeros") as store:
        for draw in sorted(DRAWS):
            assert_same_batches(store, draw)


def test_single_frames_and_prioritized_draws_equal_the_cpu_path(tmp_path):
    """``frame_stack=1`` (batches without a stack axis) and prioritized draws (weights), on both paths."""
    frames = rgb_frames()
    with mmreplay.Store.create(str(tmp_path / "k1.mmr"), spaces.Box(0, 255, frames.shape[1:], np.uint8),
                               spaces.Discrete(6), capacity=CAPACITY, frame_stack=1, reward_values=(-1, 0, 1),
                               frame_codec=RGB["temporal-3-run16"], durable=False) as store:
        fill(store, frames)
    with mmreplay.Store.open(str(tmp_path / "k1.mmr"), "r") as store:
        for draw in sorted(DRAWS):
            assert_same_batches(store, draw)
        prioritized = {"per": lambda: mmreplay.Prioritized(),
                       "per-nstep": lambda: mmreplay.NStep(2, 0.5, over=mmreplay.Prioritized())}
        for name, make in prioritized.items():
            DRAWS[name] = make
            try:
                assert_same_batches(store, name)
            finally:
                del DRAWS[name]


def test_dict_observations_share_one_staging_buffer(tmp_path):
    """Two keys (grey and colour, different codecs' chunk sizes) staged in one buffer, each its own table."""
    grey, rgb = grey_frames(), rgb_frames()
    space = spaces.Dict({"pixels": spaces.Box(0, 255, grey.shape[1:], np.uint8),
                         "camera": spaces.Box(0, 255, rgb.shape[1:], np.uint8)})
    with mmreplay.Store.create(str(tmp_path / "dict.mmr"), space, spaces.Discrete(6), capacity=CAPACITY,
                               frame_stack=3, reward_values=(-1, 0, 1), frame_codec="delta-zstd",
                               durable=False) as store:
        frames = [{"pixels": g, "camera": c} for g, c in zip(grey, rgb)]
        fill(store, frames)
        for draw in sorted(DRAWS):
            assert_same_batches(store, draw)
        with store.sampler(8, seed=1, decode="device") as smp:
            next(smp)
            staged = smp._device_draw.pending.staged
            assert set(staged.keys) == {"pixels", "camera"}
            grey_plan, rgb_plan = staged.keys["pixels"], staged.keys["camera"]
            assert rgb_plan.table_at >= grey_plan.table_at + (grey_plan.n_rows + 1) * grey_plan.row_nbytes or \
                grey_plan.table_at >= rgb_plan.table_at + (rgb_plan.n_rows + 1) * rgb_plan.row_nbytes


def test_staging_holds_fewer_bytes_than_the_frames_it_decodes_to(grey_store):
    with mmreplay.Store.open(grey_store, "r") as store:
        with store.sampler(64, mmreplay.NStep(3, 0.9), seed=2, decode="device") as smp:
            next(smp)
            staged = smp._device_draw.pending.staged
            assert staged.nbytes < staged.decoded_nbytes
            assert staged.chunks > 0


# -- what selects the path ------------------------------------------------------------------------------------
def test_auto_and_cpu_keep_the_cpu_path_without_cuda(tmp_path):
    with make_store(str(tmp_path / "s.mmr"), grey_frames(), "lz4hc", adds=64) as store:
        for decode in ("auto", "cpu"):
            with store.sampler(8, decode=decode, name=decode) as smp:
                assert smp._device_path is None
                next(smp)


def test_decode_is_checked(tmp_path):
    with make_store(str(tmp_path / "s.mmr"), grey_frames(), "lz4hc", adds=64) as store:
        with pytest.raises(ValueError, match="decode must be one of"):
            store.sampler(8, decode="gpu")


def test_a_codec_without_a_device_decoder_is_refused_by_name(tmp_path):
    with make_store(str(tmp_path / "s.mmr"), grey_frames(), {"name": "blosc", "cname": "zlib", "clevel": 3},
                    adds=64) as store:
        with pytest.raises(ValueError, match="no device decoder for the frame codec of obs.*zlib"):
            store.sampler(8, decode="device")
        with store.sampler(8, decode="auto") as smp:
            assert smp._device_path is None


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message given where there is no GPU")
def test_cuda_without_nvcomp_says_what_to_install():
    from mmreplay.device.decoders import make_decoder, nvcomp_available

    if nvcomp_available():
        pytest.skip("nvCOMP is installed here")
    with pytest.raises(RuntimeError, match=r"mmreplay\[gpu\]"):
        make_decoder(torch.device("cuda"))


# -- damaged bytes are refused ----------------------------------------------------------------------------------
def damage_one_chunk(store_path, flip_at):
    """Flip one byte of the first chunk of shard 0's file at ``flip_at`` bytes into its body."""
    with mmreplay.Store.open(store_path, "r", preload=False) as store:
        array = store._state.reader.columns["obs"].column.array
        with array.files_held():
            _, index, _ = array.open_shard(0)
        offset, nbytes = int(index[0][0]), int(index[1][0])
        path = array.layout.shard_file(array.root, 0)
    with open(path, "r+b") as f:
        f.seek(offset + min(flip_at, nbytes - 5))
        byte = f.read(1)
        f.seek(offset + min(flip_at, nbytes - 5))
        f.write(bytes([byte[0] ^ 0x5A]))
    return offset, nbytes


@pytest.mark.parametrize("codec", ["lz4hc", "zstd", "delta-zstd", "temporal-3", "delta-lz4"])
def test_a_flipped_byte_is_refused_with_corrupt_data_error(tmp_path, codec):
    path = str(tmp_path / "bad.mmr")
    with make_store(path, grey_frames(), GREY[codec], adds=CAPACITY):
        pass
    damage_one_chunk(path, 20)
    with mmreplay.Store.open(path, "r", cache_bytes=1 << 16, preload=False) as store:
        ids = np.arange(*store.inspect.valid_range())
        with store.sampler(len(ids) // 2, mmreplay.Uniform(), seed=0, decode="device") as smp:
            with pytest.raises(CorruptDataError, match="checksum mismatch"):
                for _ in range(20):  # shard 0's first chunk is drawn within a few batches of half the store
                    next(smp)


def test_staging_refuses_a_header_the_codec_rejects_even_with_a_valid_checksum(tmp_path, monkeypatch):
    """Bytes that passed their checksums (here: edited after the check) but whose zstd header declares another
    size: the codec's header check, on the CPU, refuses them as corrupt, naming the chunk, before any decode."""
    from mmreplay.device import staging

    path = str(tmp_path / "bad.mmr")
    with make_store(path, grey_frames(), "zstd", adds=CAPACITY):
        pass
    checked = staging.checked_copy

    def edited(addrs, sizes, out, at):
        status = checked(addrs, sizes, out, at)
        for start in at.tolist():  # every chunk passed its crc32c; now its header is edited
            assert out[start:start + 4].tobytes() == struct.pack("<I", 0xFD2FB528)
            single = (out[start + 4] >> 5) & 1
            out[start + 5 + (0 if single else 1)] ^= 0x01  # the declared content size, off by one
        return status

    monkeypatch.setattr(staging, "checked_copy", edited)
    with mmreplay.Store.open(path, "r", cache_bytes=1 << 16, preload=False) as store:
        reader = store._state.reader
        oldest = store._state.frames.oldest
        with pytest.raises(CorruptDataError, match=r"shard \d+, chunk \d+: zstd frame declares"):
            stage(reader, {"obs": np.arange(oldest, oldest + 64)})


# -- the pieces, decoders and kernels on their own --------------------------------------------------------------
def test_codec_pieces_describe_their_bytes():
    rng = np.random.default_rng(0)
    frames = np.cumsum(rng.integers(0, 3, (8, 30, 30)), axis=0).astype(np.uint8)
    spec_rows = [("zstd", {"name": "zstd", "level": 3}, 1),
                 ("blosc", {"name": "blosc", "cname": "lz4hc", "clevel": 5}, 1),
                 ("temporal-1", {"name": "temporal", "layout": 1}, 8),
                 ("temporal-3", {"name": "temporal", "layout": 3, "lz4_depth": 1}, 8),
                 ("delta-lz4", {"name": "delta-lz4", "run": 8}, 8)]
    for label, spec, rows in spec_rows:
        codec = codecs.for_config(spec)
        chunk = frames[:rows]
        body = codec.encode_chunk(chunk)
        pieces = codec.device_pieces(body, rows, 900, np.array([rows - 1]))
        assert set(pieces.kinds.tolist()) <= {PIECE_ZSTD, PIECE_LZ4, PIECE_COPY}, label
        assert (pieces.src[:, 0] < pieces.src[:, 1]).all() and pieces.src.max() <= len(body), label
        assert rows - 1 in pieces.rows.tolist(), label
        # run them through the CPU decoder and the chain kernel: the chunk comes back
        out = torch.zeros(rows * 900, dtype=torch.uint8)
        data = torch.from_numpy(np.frombuffer(body, dtype=np.uint8).copy())
        for kind, name in ((PIECE_ZSTD, "zstd"), (PIECE_LZ4, "lz4")):
            sel = pieces.kinds == kind
            CpuDecoder().decode(data, name, pieces.src[sel], pieces.dst[sel], out)
        for s, d in zip(pieces.src[pieces.kinds == PIECE_COPY], pieces.dst[pieces.kinds == PIECE_COPY]):
            out[d[0]:d[1]] = data[s[0]:s[1]]
        table = out.view(rows, 900)  # the table is the chunk: table row r is chunk row r
        refs = np.full(rows, -1)
        refs[pieces.rows] = pieces.refs
        rebuild_chains(table, refs, chain_depths(refs))
        for r in pieces.rows.tolist():
            assert np.array_equal(table[r].numpy(), chunk[r].reshape(-1)), (label, r)


@pytest.mark.parametrize("spec", [{"name": "zstd", "level": 3}, {"name": "blosc", "cname": "lz4hc", "clevel": 3},
                                  {"name": "blosc", "cname": "lz4", "clevel": 9},
                                  {"name": "blosc", "cname": "zstd", "clevel": 3}],
                         ids=lambda s: str(s.get("cname", s["name"])))
def test_the_batched_cut_equals_the_loop_and_takes_no_chunk_one_by_one(spec, monkeypatch):
    """One-frame codecs cut a batch's chunks in a few array operations: the same pieces as ``device_pieces`` chunk
    by chunk, without calling it (frames that compress, and noise that blosc stores as it is)."""
    from mmreplay.codecs.base import FrameCodec

    rng = np.random.default_rng(3)
    frames = [np.cumsum(rng.integers(0, 3, (30, 30)), axis=0).astype(np.uint8) for _ in range(6)]
    frames += [rng.integers(0, 256, (30, 30), dtype=np.uint8) for _ in range(3)]
    codec = codecs.for_config(spec)
    bodies = [codec.encode_chunk(f) for f in frames]
    buf = np.frombuffer(b"".join(bodies), dtype=np.uint8)
    length = np.array([len(b) for b in bodies], dtype=np.int64)
    at = np.r_[0, np.cumsum(length)[:-1]].astype(np.int64)
    wants = [np.zeros(1, dtype=np.int64)] * len(bodies)
    slow, slow_counts = FrameCodec.device_pieces_many(codec, buf, at, length, 1, 900, wants)

    def refuse(*args):
        raise AssertionError("a chunk was cut one by one")

    monkeypatch.setattr(type(codec), "device_pieces", refuse)
    fast, fast_counts = codec.device_pieces_many(buf, at, length, 1, 900, wants)
    assert np.array_equal(slow_counts, fast_counts)
    for a, b in zip(slow, fast):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def coded_runs(codec, rng, n=7):
    """``n`` runs of 8 frames (drifting ones, which code as differences, and every third one noise) coded by
    ``codec`` back to back: ``(buf, at, length)`` as ``device_pieces_many`` takes them."""
    runs = [np.cumsum(rng.integers(0, 3, (8, 30, 30)), axis=0).astype(np.uint8) if i % 3 else
            rng.integers(0, 256, (8, 30, 30), dtype=np.uint8) for i in range(n)]
    bodies = [codec.encode_chunk(run) for run in runs]
    length = np.array([len(b) for b in bodies], dtype=np.int64)
    return np.frombuffer(b"".join(bodies), dtype=np.uint8), np.r_[0, np.cumsum(length)[:-1]].astype(np.int64), length


RUN_SPECS = {"temporal-1": {"name": "temporal", "layout": 1, "run": 8},
             "temporal-2": {"name": "temporal", "layout": 2, "run": 8},
             "temporal-3": {"name": "temporal", "layout": 3, "run": 8, "lz4_depth": 1},
             "delta-lz4": {"name": "delta-lz4", "run": 8}}


@pytest.mark.parametrize("spec", sorted(RUN_SPECS))
def test_the_batched_cut_of_runs_equals_the_loop(spec, monkeypatch):
    """A batch's runs cut in array operations: the loop's pieces (temporal layouts 2 and 3: only the asked rows and
    their chains; delta-lz4: each run's LZ4 block, every row), without cutting any run one by one."""
    from mmreplay.codecs.base import FrameCodec

    rng = np.random.default_rng(4)
    codec = codecs.for_config(RUN_SPECS[spec])
    buf, at, length = coded_runs(codec, rng)
    wants = [np.unique(rng.integers(0, 8, 3)) for _ in at]
    slow, slow_counts = FrameCodec.device_pieces_many(codec, buf, at, length, 8, 900, wants)
    if spec == "delta-lz4":
        assert (slow.refs >= 0).any() and set(slow.kinds.tolist()) == {PIECE_LZ4}

    def refuse(*args):
        raise AssertionError("a run was cut one by one")

    monkeypatch.setattr(type(codec), "device_pieces", refuse)
    fast, fast_counts = codec.device_pieces_many(buf, at, length, 8, 900, wants)
    assert np.array_equal(slow_counts, fast_counts)
    for a, b in zip(slow, fast):
        assert a.dtype == b.dtype and np.array_equal(a, b)


def test_a_batch_holding_a_malformed_delta_lz4_run_is_cut_by_the_loop_which_names_it():
    codec = codecs.for_config(RUN_SPECS["delta-lz4"])
    buf, at, length = coded_runs(codec, np.random.default_rng(5))
    bad = buf.copy()
    bad[at[4] + 12 + 2] = 7  # run 4's frame 2 refers 7 frames back
    with pytest.raises(ValueError, match="before the run starts") as info:
        codec.device_pieces_many(bad, at, length, 8, 900, [np.array([0])] * at.size)
    assert info.value.args[1] == 4


@pytest.mark.parametrize("damage", ["truncated", "no-block", "bad-magic", "frames", "reference-out-of-run"])
def test_malformed_delta_lz4_runs_are_value_errors_naming_what(damage):
    codec = codecs.for_config({"name": "delta-lz4", "run": 8})
    body = bytearray(codec.encode_chunk(np.cumsum(np.ones((8, 30, 30), np.uint8), axis=0, dtype=np.uint8)))
    chunk_rows, match = 8, {"truncated": "shorter than", "no-block": "no LZ4 block", "bad-magic": "expected",
                            "frames": "announces", "reference-out-of-run": "before the run starts"}[damage]
    if damage == "truncated":
        body = body[:10]
    elif damage == "no-block":
        body = body[:12 + 8]
    elif damage == "bad-magic":
        body[:4] = b"MRT1"
    elif damage == "frames":
        chunk_rows = 4  # a run of 8 where the column's chunks hold 4 frames
    else:
        body[12 + 3] = 9
    with pytest.raises(ValueError, match=match):
        codec.device_pieces(bytes(body), chunk_rows, 900 * 8 // chunk_rows, np.array([0]))


def test_layout_3_pieces_are_only_the_chain_from_the_key():
    rng = np.random.default_rng(1)
    frames = np.cumsum(rng.integers(0, 2, (16, 20, 20)), axis=0).astype(np.uint8)
    codec = codecs.for_config({"name": "temporal", "layout": 3, "run": 16, "lz4_depth": 0})
    body = codec.encode_chunk(frames)
    pieces = codec.device_pieces(body, 16, 400, np.array([0]))
    # frame 0 lies 7 references from the key (frame 7): the chain 0..7, no frame after the key
    assert pieces.rows.tolist() == list(range(8))


@pytest.mark.parametrize("damage", ["truncated", "bad-magic", "reference-out-of-run", "blosc-block-size"])
def test_malformed_chunks_are_value_errors_naming_what(damage):
    rng = np.random.default_rng(2)
    frames = np.cumsum(rng.integers(0, 3, (8, 30, 30)), axis=0).astype(np.uint8)
    if damage == "blosc-block-size":
        codec = codecs.for_config({"name": "blosc", "cname": "lz4", "clevel": 5})
        body = bytearray(codec.encode_chunk(frames[:1]))
        start = struct.unpack_from("<i", body, 16)[0]
        struct.pack_into("<i", body, start, 1 << 30)
        with pytest.raises(ValueError, match="compressed size"):
            codec.device_pieces(bytes(body), 1, 900, np.array([0]))
        return
    codec = codecs.for_config({"name": "temporal", "layout": 2})
    body = bytearray(codec.encode_chunk(frames))
    if damage == "truncated":
        body = body[:10]
        match = "shorter than"
    elif damage == "bad-magic":
        body[:4] = b"XXXX"
        match = "expected"
    else:
        body[12 + 7] = 100  # frame 7 refers 100 frames back
        match = "outside the run"
    with pytest.raises(ValueError, match=match):
        codec.device_pieces(bytes(body), 8, 900, np.array([7]))


def test_the_cpu_decoder_refuses_a_piece_that_does_not_decode_to_its_size():
    codec = codecs.for_config({"name": "temporal", "layout": 3, "lz4_depth": 0})
    frames = np.arange(8 * 900, dtype=np.uint32).astype(np.uint8).reshape(8, 900)
    body = codec.encode_chunk(frames)
    pieces = codec.device_pieces(body, 8, 900, np.array([3]))
    sel = pieces.kinds == PIECE_LZ4
    assert sel.any()
    data = np.frombuffer(body, dtype=np.uint8).copy()
    data[pieces.src[sel][0, 0]:pieces.src[sel][0, 1]] = 0xFF  # the LZ4 block is garbage now
    out = torch.zeros(8 * 900, dtype=torch.uint8)
    with pytest.raises(CorruptDataError, match="lz4"):
        CpuDecoder().decode(torch.from_numpy(data), "lz4", pieces.src[sel], pieces.dst[sel], out)


class FakeNvcomp:
    """``nvidia.nvcomp``'s surface that ``NvcompDecoder`` uses, decoding on the CPU (numcodecs / LZ4), so that the
    nvCOMP backend's own code (one ``decode`` call per kind, sizes checked, contiguous copies) runs here."""

    class BitstreamKind:
        RAW = "raw"

    calls: list = []

    @staticmethod
    def as_array(tensor):
        return tensor.numpy()

    class Codec:
        def __init__(self, algorithm, bitstream_kind, device_id, cuda_stream, data_type=None):
            assert bitstream_kind == "raw" and algorithm in ("Zstd", "LZ4")
            self.algorithm = algorithm

        def decode(self, arrays):
            from numcodecs import zstd

            from mmreplay._native import lz4

            FakeNvcomp.calls.append((self.algorithm, len(arrays)))
            out = []
            for a in arrays:
                if self.algorithm == "Zstd":
                    out.append(np.frombuffer(zstd.decompress(a.tobytes()), dtype=np.uint8).copy())
                else:
                    buf = np.empty(1 << 16, dtype=np.uint8)
                    n = lz4.decompress_block(a.tobytes(), buf)
                    out.append(buf[:max(n, 0)].copy())
            return out


def test_the_nvcomp_backend_decodes_a_batch_with_one_call_per_kind(tmp_path, monkeypatch):
    """The nvCOMP decoder's code, nvCOMP's calls answered on the CPU (no GPU here): a batch of layout-3 runs (zstd
    frames and LZ4 blocks) decodes with one call per kind to the CPU path's frames; a piece of the wrong size is
    refused."""
    import sys
    import types

    from mmreplay.device.decoders import NvcompDecoder

    nvidia = types.ModuleType("nvidia")
    nvidia.nvcomp = FakeNvcomp
    monkeypatch.setitem(sys.modules, "nvidia", nvidia)
    monkeypatch.setitem(sys.modules, "nvidia.nvcomp", FakeNvcomp)
    FakeNvcomp.calls = []
    path = str(tmp_path / "s.mmr")
    with make_store(path, rgb_frames(), RGB["temporal-3-run16"]):
        pass
    with mmreplay.Store.open(path, "r") as store:
        with store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="cpu", name="cpu_path") as cpu, \
                store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="device", name="nvcomp_path") as dev:
            dev._device_path.decoder = NvcompDecoder(torch.device("cpu"))
            for _ in range(3):
                want, got = fields(next(cpu)), fields(next(dev))
                assert all(torch.equal(want[k], got[k]) for k in want)
    assert {kind for kind, _ in FakeNvcomp.calls} == {"Zstd", "LZ4"}
    assert len(FakeNvcomp.calls) == 6  # one call per kind a batch, 3 batches
    data = torch.from_numpy(np.frombuffer(codecs.for_config({"name": "zstd"}).encode_chunk(
        np.zeros(100, dtype=np.uint8)), dtype=np.uint8).copy())
    with pytest.raises(CorruptDataError, match="decodes to 100 bytes on the device, expected 99"):
        NvcompDecoder(torch.device("cpu")).decode(data, "zstd", np.array([[0, data.numel()]]), np.array([[0, 99]]),
                                                  torch.empty(99, dtype=torch.uint8))


def test_rebuild_chains_adds_references_depth_by_depth_modulo_256():
    rows = torch.tensor([[200, 1], [100, 2], [100, 3], [7, 7]], dtype=torch.uint8)
    refs = np.array([-1, 0, 1, -1])  # row 1 = row 0 + residual, row 2 = row 1 + residual
    rebuild_chains(rows, refs, chain_depths(refs))
    assert rows.tolist() == [[200, 1], [44, 3], [144, 6], [7, 7]]


def test_chain_depths_refuse_a_cycle():
    with pytest.raises(CorruptDataError, match="cycle"):
        chain_depths(np.array([1, 0, -1]))


def test_gather_rows_is_the_wire_rebuild():
    from mmreplay.distributed.learner_wire import rebuild_torch

    table = torch.arange(5 * 6, dtype=torch.uint8).reshape(5, 2, 3)
    index = np.array([[0, 4, 4], [1, 2, 3]], dtype=np.int32)
    assert torch.equal(gather_rows(table, index), table[torch.as_tensor(index).long()])
    assert torch.equal(rebuild_torch(table, index), gather_rows(table, index))
    out = torch.empty(2, 3, 2, 3, dtype=torch.uint8)
    gather_rows(table, index, out=out)
    assert torch.equal(out, table[torch.as_tensor(index).long()])


def test_device_path_select_rules(tmp_path):
    with make_store(str(tmp_path / "s.mmr"), grey_frames(), "zstd", adds=64) as store:
        schema = store._state.schema
        assert DevicePath.select("cpu", torch.device("cpu"), schema) is None
        assert DevicePath.select("auto", torch.device("cpu"), schema) is None
        assert isinstance(DevicePath.select("device", torch.device("cpu"), schema).decoder, CpuDecoder)


def test_the_staging_arena_reuses_its_buffers_and_waits_for_a_copy_in_flight():
    from mmreplay.device.staging import StagingArena

    class Event:
        waited = 0

        def synchronize(self):
            Event.waited += 1

    arena = StagingArena(pin=False, slots=2)
    a = arena.take()
    first = arena.ensure(a, 100, 0)
    first[:10] = 7
    grown = arena.ensure(a, 1000, 10)  # grows, keeping what the batch staged so far
    assert grown.size >= 1000 and (grown[:10] == 7).all()
    arena.release(a, Event())
    b = arena.take()
    assert b != a and Event.waited == 0  # the other buffer: nothing to wait for
    assert arena.take() == a and Event.waited == 1  # a's copy must have ended before a is handed out again
    assert arena.ensure(a, 500, 0) is grown  # big enough: the same memory, no fresh pages


def test_a_sampler_stages_every_batch_into_the_same_buffer(tmp_path):
    with make_store(str(tmp_path / "s"), rgb_frames(), "delta-zstd") as store, \
            store.sampler(16, mmreplay.NStep(3, 0.9), seed=3, decode="device") as dev:
        bases = set()
        for _ in range(30):
            next(dev)
            bases.add(dev._device_draw.pending.staged.host.__array_interface__["data"][0])
        # 3 buffers in turn, each replaced only when a batch needs more (by a quarter at least). How many times
        # depends on where the batch's chunks are (the writer's RAM or the files: its encoder's timing): a clean
        # clone under load 14 saw 4 buffers in 12 batches. One a batch would be 30.
        assert len(bases) <= 15, len(bases)


@pytest.mark.parametrize("damage", ["intact", "reference-out-of-run", "cycle", "ends-decreasing", "ends-short",
                                    "lz4-first-word", "zstd-declared-size", "frame-count", "row-past-run"])
def test_the_compiled_cut_of_runs_refuses_what_the_loop_refuses(damage):
    """``device_runs_many``'s compiled pass (``_native/device_cut.py``) hands a run with any bad header field back
    to the loop (None), which names it; an intact run is cut."""
    from mmreplay.codecs.temporal_device import device_runs_many

    rng = np.random.default_rng(9)
    frames = np.cumsum(rng.integers(0, 3, (8, 30, 30)), axis=0).astype(np.uint8)
    codec = codecs.for_config({"name": "temporal", "layout": 3, "run": 8, "lz4_depth": 1})
    run = bytearray(codec.encode_chunk(frames))
    h, n = 12, 8
    refs = np.frombuffer(bytes(run[h:h + n]), dtype=np.int8)
    ends = np.frombuffer(bytes(run[h + n:h + 5 * n]), dtype="<u4")
    lo = lambda j: h + 5 * n + (int(ends[j - 1]) if j else 0)
    kinds = [int.from_bytes(run[lo(j):lo(j) + 4], "little") for j in range(n)]
    want = [np.arange(n)]
    if damage == "reference-out-of-run":
        run[h + 0] = 1  # frame 0 refers to frame -1
    elif damage == "cycle":
        chained = [j for j in range(1, n - 1) if refs[j] != 0]
        j = chained[0]
        run[h + j], run[h + j + 1] = (256 - 1), 1  # j -> j + 1 -> j
    elif damage == "ends-decreasing":
        run[h + n + 4:h + n + 8] = (int(ends[0]) - 1).to_bytes(4, "little")
    elif damage == "ends-short":
        run[h + 5 * n - 4:h + 5 * n] = (int(ends[-1]) - 1).to_bytes(4, "little")
    elif damage == "lz4-first-word":
        j = next(j for j in range(n) if kinds[j] == 30 * 30)
        run[lo(j):lo(j) + 4] = (30 * 30 + 1).to_bytes(4, "little")
    elif damage == "zstd-declared-size":
        j = next(j for j in range(n) if kinds[j] == 0xFD2FB528)
        d = run[lo(j) + 4]
        assert d >> 6 == 1 and (d >> 5) & 1  # single segment, 2-byte size: declared - 256 at lo + 5
        run[lo(j) + 5] ^= 1
    elif damage == "frame-count":
        run[4:8] = (n + 1).to_bytes(4, "little")
    elif damage == "row-past-run":
        want = [np.array([n])]
    buf = np.frombuffer(bytes(run), dtype=np.uint8)
    got = device_runs_many(buf, np.array([0]), np.array([len(run)]), n, 30 * 30, want)
    assert (got is not None) == (damage == "intact")


def tier_batches_equal(store, room, batches=12, between=None) -> dict:
    """Batches of the device path with a device tier of ``room`` bytes (the store's ``device_cache_bytes``) equal the
    CPU path's; the tier's stats."""
    with store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="cpu", name="cpu_path") as cpu, \
            store.sampler(24, mmreplay.NStep(3, 0.9), seed=5, decode="device", name="device_path") as dev:
        assert cpu.device_tier is None and dev.device_tier["capacity_bytes"] == room
        for i in range(batches):
            if between is not None:
                between(i)
            want, got = fields(next(cpu)), fields(next(dev))
            for key in want:
                assert torch.equal(want[key], got[key]), f"batch {i}: {key} differs"
        stats = dev.device_tier
    assert stats["bytes"] <= room
    return stats


@pytest.mark.parametrize("codec", ["lz4hc", "delta-zstd", "temporal-3", "rgb-temporal-3-run16", "rgb-delta-lz4"])
@pytest.mark.parametrize("room", [1 << 30, 6_000])
def test_a_device_tier_serves_held_chunks_equal_to_the_cpu_path(tmp_path, codec, room):
    """Chunks held by the device-resident tier (``device_cache_bytes``; the CPU stands in for the device) give the CPU
    path's batches bit for bit, whole or with a pool too small for all (the rest staged as before)."""
    rgb = codec.startswith("rgb-")
    frames = rgb_frames() if rgb else grey_frames()
    make_store(str(tmp_path / "s"), frames, (RGB if rgb else GREY)[codec.removeprefix("rgb-")]).close()
    with mmreplay.Store.open(str(tmp_path / "s"), mode="r", device_cache_bytes=room) as store:
        stats = tier_batches_equal(store, room)
    assert stats["hits"] > 0 and stats["chunks"] > 0
    if room < 1 << 30:
        assert stats["misses"] > stats["chunks"]  # full: the rest was staged batch by batch


@pytest.mark.parametrize("codec", ["lz4hc"])  # one-frame blosc chunks: some stored while written
def test_a_device_tier_never_serves_a_chunk_of_the_previous_lap(tmp_path, codec):
    """While the store is written and its ring wraps, a rewritten chunk has a new first frame id: its old entry is
    never served (rows equal the CPU path's across the laps)."""
    frames = grey_frames()
    with make_store(str(tmp_path / "s"), frames, GREY[codec], device_cache_bytes=1 << 30) as store:
        def more(i):
            if i % 4 == 3:
                fill(store, frames[i:], adds=CAPACITY // 2)

        stats = tier_batches_equal(store, 1 << 30, batches=16, between=more)
    assert stats["chunks"] > 0


def test_held_chunks_are_not_staged_again(tmp_path):
    make_store(str(tmp_path / "s"), grey_frames(), "zstd").close()
    with mmreplay.Store.open(str(tmp_path / "s"), mode="r", device_cache_bytes=1 << 30) as store, \
            store.sampler(32, seed=2, decode="device") as dev:
        next(dev)
        first = dev._device_draw.pending.staged.nbytes
        later = []
        for _ in range(40):
            next(dev)
            later.append(dev._device_draw.pending.staged.nbytes)
        assert first > 0 and min(later) < first / 4  # most chunks held on the device: few bytes cross


def test_the_device_copy_of_ranges_equals_the_slice_copies():
    """The tier's upload on a device (``copy_ranges_indexed``: indices made there) writes what slice copies write."""
    from mmreplay.device.resident import copy_ranges, copy_ranges_indexed

    rng = np.random.default_rng(3)
    data = torch.from_numpy(rng.integers(0, 256, 5000, dtype=np.uint8))
    length = np.array([7, 300, 1, 64], dtype=np.int64)
    src = np.array([10, 400, 4000, 2000], dtype=np.int64)
    dst = np.array([0, 7, 500, 307], dtype=np.int64)
    a, b = torch.zeros(1000, dtype=torch.uint8), torch.zeros(1000, dtype=torch.uint8)
    copy_ranges(data, src, length, a, dst)
    copy_ranges_indexed(data, src, length, b, dst)
    assert torch.equal(a, b) and int(a[7:307].ne(data[400:700]).sum()) == 0
