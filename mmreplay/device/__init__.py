"""The device decode path (issue 38, "compressed until the consumer"): a batch's frames leave the CPU compressed
and are decoded where the batch is consumed.

One module per step:
- ``staging``: gather the batch's compressed chunk bytes (the writer's RAM, the compressed tier, shard files)
  into one (pinned) staging buffer, each chunk's crc32c and headers checked on the CPU, cut into pieces;
- ``decoders``: one batched decode call per algorithm on the device (nvCOMP on CUDA; a CPU stand-in);
- ``chains``: the temporal codec's delta chains rebuilt with torch ops on the device;
- ``assemble``: stacks, next observations and sequences as one gather over the decoded frame table;
- ``pipeline``: the sampler's side (``decode="auto" | "cpu" | "device"``): draw and stage under the store's
  lock, decode and assemble outside it.

This package sits between ``sampling`` (the sampler selects it) and ``reading`` (whose tiers it reads, never
changes); torch is imported only where tensors are made.
"""

from mmreplay.device.pipeline import DECODE, DevicePath, check_decode

__all__ = ["DECODE", "DevicePath", "check_decode"]
