"""The sources of a column's frames, one module a tier, below the router (``reading/frames.py``: ``FrameReader``):

- ``decoded.py`` (``DecodedCacheSource``): decoded chunks in the cache slab (``reading/cache.py``); a hit is a copy.
- ``compressed.py`` (``CompressedTierSource``): whole shard files held in RAM (``reading/resident.py``), decoded by
  compiled code straight into a batch or into cache slots.
- ``writer_ram.py`` (``WriterRamSource``): rows of the staging and sealed shards, still in the writer's RAM.
- ``files.py`` (``FileSource``): chunks read from their shard files (``reading/disk.py``), runs of frames read in
  part (``reading/runs.py``), partial reads that fail read again whole.

Invariant: a source reads only its own tier and writes only the places it is given (batch addresses, cache slots);
which source serves which frame is the router's choice, never a source's. Each source that holds compressed bytes
hands them out as they are (``compressed_chunks``: for a device decode, #38); the decoded cache and the writer's RAM
hold no compressed bytes.
"""
