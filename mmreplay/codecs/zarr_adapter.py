"""A zarr v3 codec for a frame codec that zarr does not know: the same bytes, so ``zarr.open_array`` reads
(and writes) arrays of plug-in codecs wherever the codec is registered.

Invariant: the zarr codec of a ``FrameCodec`` named ``n`` is registered with zarr as ``mmreplay.n`` and
stores the codec's configuration (its spec without the name) as its zarr configuration; decoding a chunk
through it calls the frame codec's own ``decode_chunk`` (its checks included) with the chunk's shape and dtype.
zarr is imported on first use only.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field, replace

import numpy as np

ZARR_PREFIX = "mmreplay."
_CLASSES: dict[str, type] = {}
_LOCK = threading.Lock()


def zarr_codec_for(codec):
    """The zarr codec writing the bytes of ``codec`` (a ``FrameCodec``; not imported: ``codecs/base.py`` imports
    this module) with its configuration."""
    return zarr_codec_class(type(codec))(config=codec.config)


def zarr_codec_class(codec_class: type) -> type:
    """The zarr ``BytesBytesCodec`` class of ``codec_class`` (made and registered with zarr once)."""
    with _LOCK:
        made = _CLASSES.get(codec_class.name)
        if made is None:
            from zarr.registry import register_codec

            made = _CLASSES[codec_class.name] = _make_class(codec_class)
            register_codec(ZARR_PREFIX + codec_class.name, made)
    return made


def _make_class(codec_class: type) -> type:
    from zarr.abc.codec import BytesBytesCodec

    zarr_name = ZARR_PREFIX + codec_class.name

    @dataclass(frozen=True)
    class FrameCodecForZarr(BytesBytesCodec):
        """zarr v3 codec of a mmreplay frame codec (its configuration is the frame codec's spec less its name)."""

        is_fixed_size = False
        config: dict = field(default_factory=dict)

        @classmethod
        def from_dict(cls, data):
            if not isinstance(data, dict) or data.get("name") != zarr_name:
                raise ValueError(f"{zarr_name}: codec metadata {data!r} names another codec")
            config = dict(data.get("configuration") or {})
            codec_class.validate({"name": codec_class.name, **config})
            return cls(config=config)

        def to_dict(self):
            return {"name": zarr_name, "configuration": dict(self.config)}

        def __hash__(self):
            return hash((zarr_name, repr(sorted(self.config.items()))))

        def evolve_from_array_spec(self, array_spec):
            return replace(self)

        def _frame_codec(self, chunk_spec):
            return codec_class({"name": codec_class.name, **self.config}, chunk_spec.dtype.to_native_dtype())

        async def _decode_single(self, chunk_bytes, chunk_spec):
            codec = self._frame_codec(chunk_spec)
            out = np.empty(chunk_spec.shape, dtype=codec.dtype)
            codec.decode_chunk(chunk_bytes.as_numpy_array(), out)
            return chunk_spec.prototype.buffer.from_bytes(out.tobytes())

        async def _encode_single(self, chunk_bytes, chunk_spec):
            codec = self._frame_codec(chunk_spec)
            chunk = chunk_bytes.as_numpy_array().view(codec.dtype).reshape(chunk_spec.shape)
            return chunk_spec.prototype.buffer.from_bytes(codec.encode_chunk(chunk))

        def compute_encoded_size(self, input_byte_length: int, chunk_spec) -> int:
            raise NotImplementedError

    FrameCodecForZarr.__name__ = FrameCodecForZarr.__qualname__ = f"{codec_class.__name__}ForZarr"
    return FrameCodecForZarr
