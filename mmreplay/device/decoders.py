"""Decode: one batched call per algorithm, from the staged bytes on the device into the decode buffer there.

Invariant: ``decode(staged, kind, src, dst, out)`` writes piece ``i`` (``staged[src[i, 0]:src[i, 1]]``, of
algorithm ``kind``: ``"zstd"`` frames or raw ``"lz4"`` blocks) into ``out[dst[i, 0]:dst[i, 1]]`` and nothing
else, or raises ``CorruptDataError`` naming the first piece that does not decode to exactly its size (the
headers were checked on the CPU when the pieces were cut; a decoder still refuses a size it did not expect).

Two decoders:
- ``NvcompDecoder``: nvCOMP's batched decoders on a CUDA device (``from nvidia import nvcomp``, the
  ``mmreplay[gpu]`` extra), zstd and LZ4 in their raw bitstreams (standard zstd frames; LZ4 blocks without a
  header), on the torch stream current when it is made;
- ``CpuDecoder``: the same contract on the CPU (numcodecs' zstd, LZ4's ``LZ4_decompress_safe``), standing in for
  nvCOMP where there is no GPU: the tests run the whole device path with it on CPU tensors.
"""

from __future__ import annotations

import numpy as np

from mmreplay.errors import CorruptDataError

KINDS = ("zstd", "lz4")


def nvcomp_available() -> bool:
    """Whether nvCOMP's Python package imports (the ``mmreplay[gpu]`` extra)."""
    try:
        from nvidia import nvcomp  # noqa: F401
    except Exception:  # noqa: BLE001 - a missing package, or one whose CUDA libraries do not load
        return False
    return True


class CpuDecoder:
    """Batched decodes on the CPU: the stand-in for nvCOMP (module docstring). Tensors on another device are
    brought to the CPU and the result copied back (tests only; the CPU path proper is ``reading/frames.py``)."""

    name = "cpu"

    def decode(self, staged, kind: str, src: np.ndarray, dst: np.ndarray, out) -> None:
        from numcodecs import zstd

        from mmreplay._native import lz4

        if kind not in KINDS:
            raise ValueError(f"decoder kind {kind!r} unknown, expected one of {KINDS}")
        on_cpu = out.device.type == "cpu"
        data = staged.cpu().numpy() if staged.device.type != "cpu" else staged.numpy()
        target = out.numpy() if on_cpu else np.empty(out.numel(), dtype=np.uint8)
        for i, ((s0, s1), (d0, d1)) in enumerate(zip(src.tolist(), dst.tolist())):
            piece, into = data[s0:s1], target[d0:d1]
            if kind == "zstd":
                try:  # the frame's header declared d1 - d0 bytes (checked when cut); zstd holds it to that
                    zstd.decompress(piece, into)
                    got = d1 - d0
                except RuntimeError as exc:
                    raise CorruptDataError(f"piece {i} (zstd, {s1 - s0} bytes): {exc}") from None
            else:
                got = lz4.decompress_block(piece, into)
            if got != d1 - d0:
                raise CorruptDataError(f"piece {i} ({kind}, {s1 - s0} bytes) decodes to {got} bytes, expected "
                                       f"{d1 - d0}")
        if not on_cpu:
            import torch

            out.copy_(torch.from_numpy(target))


class NvcompDecoder:
    """nvCOMP's batched decoders on ``device`` (a CUDA ``torch.device``): one ``Codec.decode`` call per kind."""

    name = "nvcomp"

    def __init__(self, device):
        import torch
        from nvidia import nvcomp

        self._nvcomp = nvcomp
        self.device = device
        cuda = device.type == "cuda"
        index = device.index if device.index is not None else (torch.cuda.current_device() if cuda else 0)
        stream = torch.cuda.current_stream(index).cuda_stream if cuda else 0  # the stream torch's ops run on
        raw = nvcomp.BitstreamKind.RAW
        self._codecs = {"zstd": nvcomp.Codec(algorithm="Zstd", bitstream_kind=raw, device_id=index, cuda_stream=stream),
                        "lz4": nvcomp.Codec(algorithm="LZ4", bitstream_kind=raw, device_id=index, cuda_stream=stream,
                                            data_type="|u1")}

    def decode(self, staged, kind: str, src: np.ndarray, dst: np.ndarray, out) -> None:
        import torch

        if kind not in self._codecs:
            raise ValueError(f"decoder kind {kind!r} unknown, expected one of {KINDS}")
        if not src.shape[0]:
            return
        pieces = [self._nvcomp.as_array(staged[s0:s1]) for s0, s1 in src.tolist()]
        decoded = [torch.as_tensor(piece, device=out.device).reshape(-1).view(torch.uint8)
                   for piece in self._codecs[kind].decode(pieces)]
        want = (dst[:, 1] - dst[:, 0]).tolist()
        for i, (got, n) in enumerate(zip(decoded, want)):
            if got.numel() != n:
                raise CorruptDataError(f"piece {i} ({kind}, {int(src[i, 1] - src[i, 0])} bytes) decodes to "
                                       f"{got.numel()} bytes on the device, expected {n}")
        # pieces whose destinations follow one another (a batch's table rows mostly do) land with one copy
        breaks = np.flatnonzero(dst[1:, 0] != dst[:-1, 1]) + 1
        for a, b in zip(np.r_[0, breaks].tolist(), np.r_[breaks, len(decoded)].tolist()):
            out[int(dst[a, 0]):int(dst[b - 1, 1])].copy_(torch.cat(decoded[a:b]) if b - a > 1 else decoded[a])


def make_decoder(device):
    """The decoder for a batch on ``device``: nvCOMP on CUDA, the CPU stand-in on the CPU; ``RuntimeError``
    saying what to install when CUDA is asked for without nvCOMP."""
    if device is not None and device.type == "cuda":
        if not nvcomp_available():
            raise RuntimeError("decode='device' on a CUDA device needs nvCOMP's Python package: pip install "
                               "'mmreplay[gpu]' (nvidia-nvcomp-cu12), or decode='cpu'")
        return NvcompDecoder(device)
    if device is None or device.type == "cpu":
        return CpuDecoder()
    raise ValueError(f"decode='device' runs on a CUDA device or, standing in, on the CPU; got device {device}")
