"""The header of a temporal-codec run, shared by its Python encoder (``codecs/temporal.py``) and the
compiled decoder (``_native/run_decode.py``).

Invariant: a run starts with ``HEADER`` = (``MAGIC``, run length ``n`` in ``[1, MAX_RUN]``, frame bytes),
followed by ``n`` one-byte references (layouts 2 and 3, ``MAGIC2``: signed, then ``n`` uint32 frame ends); both
sides read these names, so they cannot disagree.
"""

from __future__ import annotations

import struct

MAGIC = b"MRT1"
MAGIC2 = b"MRT2"  # layouts 2 and 3: one coded frame per frame, after an int8 reference and a uint32 end per frame
HEADER = struct.Struct("<4sII")
# Layout 3 tells a frame's codec by its first little-endian word: zstd's frame magic, or the frame's size
# before an LZ4 block, which LZ4's C int arguments bound.
ZSTD_MAGIC = 0xFD2FB528
LZ4_MAX_BYTES = 0x7E000000  # LZ4_MAX_INPUT_SIZE: larger frames stay zstd
MAX_RUN = 255  # references are one byte; runs are short anyway (a random frame decodes from the run's start)
