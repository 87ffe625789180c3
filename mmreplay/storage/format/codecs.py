"""The storage layer's view of frame codecs: a codec spec (JSON) mapped to the codec that encodes and decodes
shard chunks (``mmreplay/codecs/``) and to the zarr v3 codec of the same bytes in the array's metadata.

Invariant: for a spec ``s`` and dtype ``d``, bytes written by ``numcodecs_compressor(s, d)`` decode with the
zarr codec ``zarr_compressor(s, d)`` and vice versa; a spec the registry does not know, or whose
configuration its codec refuses, is a ``ValueError`` before anything is written. Which codecs exist, and what
each checks before handing bytes to its library, is the codec's module (``mmreplay/codecs/<name>.py``).
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from mmreplay import codecs
from mmreplay.codecs import FrameCodec


def validate_codec(spec: Any) -> Mapping[str, Any]:
    """``spec`` if a registered codec accepts it, else ``ValueError`` naming it."""
    codecs.for_config(spec)
    return spec


def Compressor(spec: Mapping[str, Any], dtype: np.dtype) -> FrameCodec:  # noqa: N802 (the name callers know)
    """The codec of ``spec`` for chunks of ``dtype``: ``encode(chunk) -> bytes``, ``decode(bytes, out)``."""
    return codecs.for_config(spec, dtype)


def numcodecs_compressor(spec: Mapping[str, Any], dtype: np.dtype) -> FrameCodec:
    return codecs.for_config(spec, dtype)


def zarr_compressor(spec: Mapping[str, Any], dtype: np.dtype):
    """The zarr v3 codec writing the same bytes as ``numcodecs_compressor(spec, dtype)``."""
    return codecs.for_config(spec, dtype).zarr_codec()
