"""The header of a temporal-codec run, shared by its Python encoder (``storage/temporal.py``) and the
compiled decoder (``_native/decode.py``).

Invariant: a run starts with ``HEADER`` = (``MAGIC``, run length ``n`` in ``[1, MAX_RUN]``, frame bytes),
followed by ``n`` one-byte references (layouts 2 and 3, ``MAGIC2``: signed, then ``n`` uint32 frame ends); both
sides read these names, so they cannot disagree.
"""

from __future__ import annotations

import struct

MAGIC = b"MRT1"
MAGIC2 = b"MRT2"  # layouts 2 and 3: one coded frame per frame, after an int8 reference and a uint32 end per frame
HEADER = struct.Struct("<4sII")
MAX_RUN = 255  # references are one byte; runs are short anyway (a random frame decodes from the run's start)
