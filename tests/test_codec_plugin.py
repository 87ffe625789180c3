"""A frame codec from outside the package: one module and its registration, no edit of mmreplay (issue 39).

A toy codec (bytes XOR a key, then zlib) is written into ``tmp_path`` and registered two ways: by a
``mmreplay.codecs.register`` call (chunks are then encoded in the writer's process: a new process would not
know the codec), and through an entry point of the ``mmreplay.codecs`` group in a fake installed
distribution (found by name when the store is created and reopened, and by the shard encoder's child). Each
store is filled, closed, reopened, and every transition read and sampled equals ground truth; plain zarr
reads the frames through the zarr codec made for the plug-in."""

import importlib.util
import sys
import textwrap
import warnings

import numpy as np
import pytest
from gymnasium import spaces

import mmreplay
from mmreplay import codecs
from mmreplay.codecs import registry
from reference import ReferenceReplay, assert_batch_matches

PLUGIN = '''
"""A toy frame codec: every byte XOR ``KEY``, then zlib."""
import zlib

import numpy as np

from mmreplay.codecs import FrameCodec

KEY = 0x5A


class XorZlibCodec(FrameCodec):
    name = "{name}"

    @classmethod
    def validate(cls, spec):
        super().validate(spec)
        level = spec.get("level", 6)
        if not isinstance(level, int) or not 0 <= level <= 9:
            raise ValueError(f"{{cls.name}} codec {{dict(spec)}} invalid: level must be an integer in 0..9")
        return spec

    def encode_chunk(self, chunk):
        raw = np.ascontiguousarray(chunk).reshape(-1).view(np.uint8) ^ KEY
        return zlib.compress(raw.tobytes(), self.spec.get("level", 6))

    def decode_chunk(self, data, out):
        try:
            raw = zlib.decompress(bytes(data))
        except zlib.error as exc:
            raise ValueError(f"{{self.name}} chunk: {{exc}}") from None
        if len(raw) != out.nbytes:
            raise ValueError(f"{{self.name}} chunk holds {{len(raw)}} bytes, expected {{out.nbytes}}")
        out.reshape(-1).view(np.uint8)[:] = np.frombuffer(raw, dtype=np.uint8) ^ KEY
        return out
'''

SHAPE = (32, 32)  # 1 KiB frames: image rows, which a writer hands to its encoder child when it can


@pytest.fixture(autouse=True)
def fresh_registry(monkeypatch):
    """Codecs registered by a test are forgotten after it (the registry is process-wide)."""
    monkeypatch.setattr(registry, "_CODECS", dict(registry._CODECS))


def write_plugin(folder, module: str, name: str) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"{module}.py").write_text(PLUGIN.format(name=name))


def import_from(folder, module: str):
    spec = importlib.util.spec_from_file_location(module, folder / f"{module}.py")
    loaded = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(loaded)
    return loaded


def frames(n: int) -> np.ndarray:
    rng = np.random.default_rng(7)
    base = rng.integers(0, 256, SHAPE, dtype=np.uint8)
    return np.stack([np.roll(base, t, axis=1) ^ np.uint8(t % 251) for t in range(n)])


def round_trip(path, codec: dict) -> None:
    """Fill a store using ``codec``, close, reopen read-only: every transition and a sampled batch equal
    ground truth, and plain zarr reads the frames."""
    import zarr

    pixels, capacity = frames(400), 256
    ref = ReferenceReplay(4, capacity)
    space = spaces.Box(0, 255, SHAPE, np.uint8)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with mmreplay.Store.create(path, space, spaces.Discrete(3), capacity=capacity, frame_stack=4,
                                   reward_values=(-1, 0, 1), frame_codec=codec, durable=False) as s:
            for t in range(330):  # the ring wraps: shards are rewritten
                end = t % 17 == 16
                row = (pixels[t], t % 3, float(t % 3 - 1), pixels[t + 1], end, False)
                s.add(*row)
                ref.add(0, *row)
    # an encoder child that does not know the codec fails its jobs, and the writer encodes them after a warning
    assert not [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    ids = ref.valid_ids()
    with mmreplay.Store.open(path, mode="r") as s:
        assert_batch_matches(s.inspect.get(ids), ref, ids)
        batch = s.sample(64, seed=3)
        assert_batch_matches(batch, ref, batch.indices.tolist())
    array = zarr.open_group(path, mode="r")["frames/obs"]
    assert array.metadata.codecs[0].codecs[1].to_dict() == {
        "name": f"mmreplay.{codec['name']}", "configuration": {k: v for k, v in codec.items() if k != "name"}}
    written = {pixels[t].tobytes() for t in range(331)}
    stored = array[:]
    found = sum(row.tobytes() in written for row in stored)
    assert found >= capacity and found + sum(not row.any() for row in stored) == stored.shape[0]  # frames or unwritten

def test_a_codec_registered_by_a_call_round_trips_a_store(tmp_path):
    write_plugin(tmp_path / "plugin", "xorzlib_codec", "xorzlib")
    plugin = import_from(tmp_path / "plugin", "xorzlib_codec")
    with pytest.raises(ValueError, match="xorzlib"):  # unknown until registered
        codecs.get("xorzlib")
    codecs.register(plugin.XorZlibCodec)
    assert codecs.get("xorzlib") is plugin.XorZlibCodec
    assert not codecs.known_to_new_processes("xorzlib")  # so the writer encodes its shards itself
    codec = codecs.for_config({"name": "xorzlib", "level": 3})
    assert codec.kernel_kind is None and not codec.decodes_partial_runs and codec.device_decoder is None
    round_trip(str(tmp_path / "store"), {"name": "xorzlib", "level": 3})


def test_a_codec_found_through_its_entry_point_round_trips_a_store(tmp_path, monkeypatch):
    site = tmp_path / "site"
    write_plugin(site, "xorzlib_ep_codec", "xorzlib-ep")
    dist = site / "xorzlib_ep-0.1.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: xorzlib-ep\nVersion: 0.1\n")
    (dist / "entry_points.txt").write_text(textwrap.dedent(f"""\
        [{codecs.ENTRY_POINT_GROUP}]
        xorzlib-ep = xorzlib_ep_codec:XorZlibCodec
        """))
    monkeypatch.syspath_prepend(str(site))  # installed for this process ...
    monkeypatch.setenv("PYTHONPATH", str(site))  # ... and for the processes it starts (the shard encoder)
    monkeypatch.delitem(sys.modules, "xorzlib_ep_codec", raising=False)
    assert codecs.known_to_new_processes("xorzlib-ep")
    assert codecs.get("xorzlib-ep").__module__ == "xorzlib_ep_codec"  # loaded by name from its entry point
    round_trip(str(tmp_path / "store"), {"name": "xorzlib-ep", "level": 1})


def test_a_taken_name_or_a_bad_config_is_refused(tmp_path):
    write_plugin(tmp_path / "plugin", "taken_codec", "zstd")
    plugin = import_from(tmp_path / "plugin", "taken_codec")
    with pytest.raises(ValueError, match="'zstd' is taken"):
        codecs.register(plugin.XorZlibCodec)
    write_plugin(tmp_path / "plugin", "xorzlib_bad", "xorzlib-bad")
    codecs.register(import_from(tmp_path / "plugin", "xorzlib_bad").XorZlibCodec)
    with pytest.raises(ValueError, match="level must be an integer in 0..9"):
        mmreplay.Store.create(str(tmp_path / "store"), spaces.Box(0, 255, SHAPE, np.uint8), spaces.Discrete(3),
                              capacity=64, frame_stack=4, frame_codec={"name": "xorzlib-bad", "level": 12})
