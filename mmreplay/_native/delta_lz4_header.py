"""The header of a ``delta-lz4`` run, shared by its Python encoder (``codecs/delta_lz4.py``) and the compiled
decoder (``_native/delta_lz4.py``).

Invariant: a run starts with ``HEADER`` = (``MAGIC``, run length ``n`` in ``[1, MAX_RUN]``, frame bytes), then
``n`` one-byte references (``refs[i] <= i``), then one LZ4 block (no size prefix) of the run's
``n * frame bytes`` residual bytes; both sides read these names, so they cannot disagree. This module imports
nothing (the shard encoder's child imports the codec without numba).
"""

from __future__ import annotations

import struct

MAGIC = b"MRL1"
HEADER = struct.Struct("<4sII")
MAX_RUN = 255  # references are one byte
LZ4_MAX_BYTES = 0x7E000000  # LZ4_MAX_INPUT_SIZE: a run decodes to at most this many bytes (C int sizes)
