"""The integer kinds by which the compiled decoders (``chunk_decode.py``, ``helpers.py``) tell frame codecs apart.

Invariant: each kind names one chunk format the kernels decode; the mapping from a codec's name to its kind
lives in that codec's module (``mmreplay/codecs/``: its ``kernel_kind``), never here. This module imports
nothing, so a codec module reads its kind without loading numba (the shard encoder's child imports codecs).
"""

CODEC_BLOSC, CODEC_ZSTD, CODEC_TEMPORAL, CODEC_DELTA_LZ4 = 0, 1, 2, 3
CODECS = (CODEC_BLOSC, CODEC_ZSTD, CODEC_TEMPORAL, CODEC_DELTA_LZ4)
