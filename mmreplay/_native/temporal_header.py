"""The header of a temporal-codec run, shared by its Python encoder (``storage/temporal.py``) and the
compiled decoder (``_native/decode.py``).

Invariant: a run starts with ``HEADER`` = (``MAGIC``, run length ``n`` in ``[1, MAX_RUN]``, frame bytes),
followed by ``n`` one-byte references; both sides read these names, so they cannot disagree.
"""

from __future__ import annotations

import struct

MAGIC = b"MRT1"
HEADER = struct.Struct("<4sII")
MAX_RUN = 255  # references are one byte; runs are short anyway (a random frame decodes from the run's start)
