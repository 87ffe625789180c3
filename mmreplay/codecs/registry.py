"""Frame codecs by name: the ones the package ships, those registered at run time, and plug-ins found
through the ``mmreplay.codecs`` entry-point group.

Invariant: a name maps to one codec class for the life of the process (registering another class under a
taken name is a ``ValueError``), and a name is looked up in the entry points only when it is not registered
already, loading only the entry point of that name. Opening a store thus runs code only from installed
packages (as zarr's own codec entry points do), never from the store.

A plug-in codec is one module: a ``FrameCodec`` subclass and either a ``register(MyCodec)`` call or, so that
every process finds it (the shard encoder's child process among them), an entry point:

    [project.entry-points."mmreplay.codecs"]
    xorzlib = "my_package.xorzlib:XorZlibCodec"
"""

from __future__ import annotations

import threading
from importlib import metadata
from typing import Any, Mapping

import numpy as np

from mmreplay.codecs.base import FrameCodec

ENTRY_POINT_GROUP = "mmreplay.codecs"
BUILTIN_MODULE_PREFIX = "mmreplay.codecs."

_CODECS: dict[str, type[FrameCodec]] = {}
_LOCK = threading.RLock()


def register(codec_class: type[FrameCodec]) -> type[FrameCodec]:
    """Make ``codec_class`` the codec of its ``name`` (idempotent for the same class); returns it, so it
    serves as a class decorator."""
    if not (isinstance(codec_class, type) and issubclass(codec_class, FrameCodec)):
        raise TypeError(f"a FrameCodec subclass expected, got {codec_class!r}")
    name = codec_class.name
    if not isinstance(name, str) or not name:
        raise ValueError(f"codec class {codec_class.__qualname__} has no name (set its 'name' to the spec's name)")
    with _LOCK:
        known = _CODECS.get(name)
        if known is not None and known is not codec_class:
            raise ValueError(f"codec name {name!r} is taken by {known.__module__}.{known.__qualname__}; "
                             f"cannot register {codec_class.__module__}.{codec_class.__qualname__} under it")
        _CODECS[name] = codec_class
    return codec_class


def get(name: str) -> type[FrameCodec]:
    """The codec class named ``name``: registered, else loaded from its entry point, else ``ValueError``."""
    codec_class = _CODECS.get(name)
    if codec_class is not None:
        return codec_class
    with _LOCK:
        if name not in _CODECS and isinstance(name, str):
            point = _entry_point(name)
            if point is not None:
                loaded = point.load()
                if loaded.name != name:
                    raise ValueError(f"entry point {name!r} of group {ENTRY_POINT_GROUP!r} loads {point.value}, "
                                     f"whose codec name is {loaded.name!r}")
                register(loaded)
    codec_class = _CODECS.get(name)
    if codec_class is None:
        raise ValueError(f"codec {name!r} unknown: expected one of {names()} (or a codec registered with "
                         f"mmreplay.codecs.register or an entry point of group {ENTRY_POINT_GROUP!r})")
    return codec_class


def for_config(spec: Any, dtype: Any = np.uint8) -> FrameCodec:
    """The codec a spec (``{"name": ..., **config}``) describes, for chunks of ``dtype``; ``ValueError`` if
    the name is unknown or the configuration invalid."""
    if not isinstance(spec, Mapping) or not isinstance(spec.get("name"), str):
        raise ValueError(f"codec {spec!r} unknown: expected a dict with a 'name', one of {names()}")
    return get(spec["name"])(spec, dtype)


def names() -> list[str]:
    """The registered codec names (entry points not yet loaded are not listed)."""
    return sorted(_CODECS)


def known_to_new_processes(name: str) -> bool:
    """Whether a fresh interpreter finds codec ``name`` by itself: the package's own codecs and plug-ins with
    an entry point do, a class only passed to ``register`` does not (its chunks are then encoded in this
    process, never by the shard encoder's child)."""
    codec_class = _CODECS.get(name)
    if codec_class is not None and codec_class.__module__.startswith(BUILTIN_MODULE_PREFIX):
        return True
    return _entry_point(name) is not None


def _entry_point(name: str):
    for point in metadata.entry_points(group=ENTRY_POINT_GROUP):
        if point.name == name:
            return point
    return None
