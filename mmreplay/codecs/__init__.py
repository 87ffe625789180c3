"""Frame codecs: one module a codec, behind a registry that says what each can do.

Invariant: every codec a store names is found here by its name (``get``, ``for_config``), the package's own
(``blosc``, ``zstd``, ``temporal``, ``delta-lz4``: imported below, so they are registered whenever the package is), plug-ins
registered with ``register`` or through the ``mmreplay.codecs`` entry-point group. Readers and writers ask
the codec's capabilities (``FrameCodec``: ``kernel_kind``, ``decodes_frames_of_runs``, ``decodes_partial_runs``,
``device_decoder``) when a column is set up; nothing outside this folder branches on a codec's name.

This package imports numpy and numcodecs, never numba or zarr at import (the shard encoder's child imports it).
"""

from mmreplay.codecs.base import FrameCodec
from mmreplay.codecs.registry import ENTRY_POINT_GROUP, for_config, get, known_to_new_processes, names, register
from mmreplay.codecs import blosc, delta_lz4, temporal, zstd  # noqa: F401  (registers the package's codecs)

__all__ = ["ENTRY_POINT_GROUP", "FrameCodec", "for_config", "get", "known_to_new_processes", "names", "register"]
