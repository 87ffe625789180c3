"""The device decode path of a sampler: gather -> one copy -> batched decode -> rebuild chains -> assemble.

A batch is drawn as on the CPU path (the same strategy, RNG stream, columns and race check), except that its
frames are not decoded there: ``DeviceDraw`` runs the strategy's ``assemble`` against a view whose frame reader
only records which frame ids go where (``RecordingFrames``), then stages those frames' compressed bytes
(``device/staging.py``), all under the store's lock, so the reader's overwrite check covers them. Outside the
lock, ``DevicePath.finish`` copies the staging buffer to the device once, decodes it with one batched call per
algorithm (``device/decoders.py``), copies the pieces stored as they are, rebuilds the delta chains
(``device/chains.py``) and gathers the stacks, next observations and sequences into the batch tensors
(``device/assemble.py``): on the CPU into the batch's own host buffers, on CUDA into fresh device tensors.

Invariant: the frames of a batch made this way equal, bit for bit, those the CPU path reads for the same draw
(``tests/test_device_decode.py`` checks every codec and layout), and every stored byte passed its crc32c on the
CPU before it was staged.

``decode`` (a sampler option): ``"cpu"`` the CPU path; ``"device"`` this path (CUDA: nvCOMP, else an error
saying what to install; CPU: the CPU stand-in decoder, for tests); ``"auto"`` (the default) this path when the
sampler's device is CUDA, nvCOMP imports and every observation's codec has a device decoder, else the CPU path.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np

from mmreplay import codecs
from mmreplay.codecs.base import PIECE_COPY, PIECE_NAMES
from mmreplay.device.assemble import gather_rows, padding_positions
from mmreplay.device.chains import rebuild_chains
from mmreplay.device.decoders import make_decoder, nvcomp_available
from mmreplay.device.resident import DeviceTier
from mmreplay.device.staging import Staged, StagingArena, stage

DECODE = ("auto", "cpu", "device")


def check_decode(decode) -> str:
    if decode not in DECODE:
        raise ValueError(f"decode must be one of {DECODE} (where frames are decoded), got {decode!r}")
    return decode


def unsupported_codecs(schema) -> list[str]:
    """The observation keys whose frame codec has no device decoder, as ``key (codec spec)``."""
    bad = []
    for spec in schema.observations:
        codec = codecs.for_config(spec.codec, spec.np_dtype)
        if not codec.device_supported():
            bad.append(f"{spec.name} ({dict(spec.codec)})")
    return bad


class RecordingFrames:
    """A frame reader that decodes nothing: it records each ``gather_stacks`` / ``gather`` / ``gather_sets`` (key,
    frame ids, target buffer) for the device path, and answers everything else from the real reader."""

    def __init__(self, frames):
        self._frames = frames
        self.requests: list[tuple[str, object, np.ndarray]] = []

    @property
    def head(self) -> int:
        return self._frames.head

    def gather_stacks(self, name, obs_ids, next_ids, obs_words, next_words, *, shifted: bool = True) -> None:
        self.requests.append((name, "obs", np.array(obs_ids, dtype=np.int64)))
        self.requests.append((name, "next", np.array(next_ids, dtype=np.int64)))

    def gather(self, name, frame_ids, out) -> None:
        self.requests.append((name, out, np.array(frame_ids, dtype=np.int64)))

    def gather_sets(self, name, sets) -> None:
        """Each ``(frame_ids, out)`` recorded as its own ``gather`` (the device decodes a batch's pieces once)."""
        for frame_ids, out in sets:
            self.gather(name, frame_ids, out)

    def __getattr__(self, attr):
        if attr.startswith(("gather", "read_frame")):  # a frame read it does not record would decode on the CPU
            raise AttributeError(f"RecordingFrames records no {attr!r}: a frame read of the device path must be "
                                 "recorded (add it here), not decoded on the CPU")
        return getattr(self._frames, attr)


@dataclass
class Pending:
    """What a draw staged for the device: the staged bytes and, per output, (key, "obs"/"next", frame ids)."""
    staged: Staged
    requests: list
    mask: np.ndarray | None  # sequences: real steps (padding steps are zeros)


class DeviceDraw:
    """A draw strategy wrapped for the device path: picks exactly as ``draw`` does; its ``assemble`` records and
    stages the frames instead of decoding them (``pending`` holds them until ``DevicePath.finish``)."""

    def __init__(self, draw, pin: bool, path: DevicePath | None = None):
        self.draw = draw
        self.pin = pin
        self.path = path  # whose device tier (if any) the staging consults
        self.pending: Pending | None = None
        # staging buffers reused batch after batch: prefetch's slots plus the one being filled may be in flight
        self.arena = StagingArena(pin, slots=4 if pin else 1)

    @property
    def default_name(self) -> str:
        return self.draw.default_name

    @property
    def redraws(self) -> bool:
        return getattr(self.draw, "redraws", True)

    def bind(self, name):
        return DeviceDraw(self.draw.bind(name), self.pin, self.path)

    def validate(self, schema) -> None:
        self.draw.validate(schema)

    def new_buffers(self, schema, batch_size: int, pin_memory: bool = False):
        return self.draw.new_buffers(schema, batch_size, pin_memory)

    def pick(self, view, size, rng):
        return self.draw.pick(view, size, rng)

    def assemble(self, view, picked, buffers):
        recorder = RecordingFrames(view.frames)
        recording = copy.copy(view)
        recording.frames = recorder
        read = self.draw.assemble(recording, picked, buffers)
        requests = []
        wanted: dict[str, list] = {}
        for name, target, ids in recorder.requests:
            if not isinstance(target, str):
                target = "obs" if target is buffers.obs[name][1] else "next"
            requests.append((name, target, ids))
            wanted.setdefault(name, []).append(ids.reshape(-1))
        staged = stage(view.frames, {name: np.concatenate(parts) for name, parts in wanted.items()}, pin=self.pin,
                       arena=self.arena, tier=None if self.path is None else self.path.tier)
        mask = getattr(buffers, "mask", None)
        self.pending = Pending(staged, requests, None if mask is None else np.array(mask[1]))
        return read


class DevicePath:
    """A sampler's device decode path on ``device`` (a ``torch.device``: CUDA, or the CPU with the stand-in
    decoder) for a store of ``schema``, with a device tier of ``cache_bytes`` (``Settings.device_cache_bytes``;
    0: none), made here, before the first batch: a batch's staging consults it from the first batch on."""

    def __init__(self, device, schema, decoder=None, cache_bytes: int = 0):
        import torch

        self.device = device if device is not None else torch.device("cpu")
        self.schema = schema
        self.decoder = decoder if decoder is not None else make_decoder(self.device)
        self.cuda = self.device.type == "cuda"
        self.zero_pad = schema.stack_padding == "zeros" and schema.frame_stack > 1
        self._decoded = None  # the CPU's reused decode buffer
        # compressed chunks held on the device (``device/resident.py``); never replaced once batches were staged
        self.tier: DeviceTier | None = DeviceTier(self.device, cache_bytes) if cache_bytes else None

    @classmethod
    def select(cls, decode: str, device, schema, cache_bytes: int = 0):
        """The path ``decode`` asks for on ``device`` (None: the CPU path, where ``cache_bytes`` is ignored), or an
        error saying why it cannot be."""
        decode = check_decode(decode)
        if decode == "cpu":
            return None
        cuda = device is not None and device.type == "cuda"
        bad = unsupported_codecs(schema)
        if decode == "auto":
            return cls(device, schema, cache_bytes=cache_bytes) if cuda and not bad and nvcomp_available() else None
        if bad:
            raise ValueError(f"decode='device': no device decoder for the frame codec of {', '.join(bad)}; "
                             "device decoders exist for zstd, blosc (lz4, lz4hc, zstd over bytes), the temporal "
                             "codec and delta-lz4 (decode='cpu' reads any)")
        return cls(device, schema, cache_bytes=cache_bytes)

    def _decode_buffer(self, nbytes: int):
        """On the CPU the decode buffer is reused (its tables are gathered into the batch's own buffers before the
        next batch); on a device each batch has its own (its caching allocator reuses the memory)."""
        import torch

        if self._decoded is None or self._decoded.numel() < nbytes:
            self._decoded = torch.empty(max(nbytes, int(1.25 * (0 if self._decoded is None else
                                                                 self._decoded.numel()))), dtype=torch.uint8)
        return self._decoded[:nbytes]

    def wrap(self, draw) -> DeviceDraw:
        return DeviceDraw(draw, pin=self.cuda, path=self)

    def finish(self, pending: Pending, buffers) -> dict:
        """Decode and assemble a staged batch: ``{key: {"obs": tensor, "next": tensor}}`` on the device (on the
        CPU, the batch's own buffers, filled)."""
        import torch

        staged = pending.staged
        if self.cuda:
            data = staged.pinned.to(self.device, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()  # the staging buffer is handed out again only once this copy has ended
            staged.arena.release(staged.slot, copied)
            out = torch.empty(staged.decoded_nbytes, dtype=torch.uint8, device=self.device)
        else:
            data = torch.from_numpy(staged.host)
            out = self._decode_buffer(staged.decoded_nbytes)
        if staged.uploads:  # queued before the decodes, on the same stream: the pool has them when read
            self.tier.upload(data, staged.uploads)
        pool = self.tier.pool if self.tier is not None else None
        for kind in np.unique(staged.kinds).tolist():
            for source, src_data in ((0, data), (1, pool)):
                sel = (staged.kinds == kind) & (staged.sources == source)
                if not sel.any():
                    continue
                if kind == PIECE_COPY:
                    _copy_pieces(src_data, staged.src[sel], staged.dst[sel], out)
                else:
                    self.decoder.decode(src_data, PIECE_NAMES[kind], staged.src[sel], staged.dst[sel], out)
        tables = {}
        for name, plan in staged.keys.items():
            raw = out[plan.table_at:plan.table_at + (plan.n_rows + 1) * plan.row_nbytes].view(plan.n_rows + 1,
                                                                                               plan.row_nbytes)
            raw[plan.n_rows].zero_()
            rebuild_chains(raw[:plan.n_rows], plan.refs, plan.depth)
            tables[name] = raw.view(_torch_dtype(plan.dtype)).reshape(plan.n_rows + 1, *plan.shape)
        result: dict = {}
        for name, target, ids in pending.requests:
            plan = staged.keys[name]
            rows = plan.row_of[np.searchsorted(plan.ids, ids)]
            zero = padding_positions(ids) if self.zero_pad else np.zeros(ids.shape, dtype=bool)
            if target == "obs" and pending.mask is not None:  # sequences: steps past a window's end are zeros
                step_mask = pending.mask.reshape(pending.mask.shape + (1,) * (ids.ndim - pending.mask.ndim))
                zero |= ~np.broadcast_to(step_mask, ids.shape)
            rows = np.where(zero, plan.n_rows, rows)
            host = (buffers.obs if target == "obs" else buffers.next_obs)[name][0]
            lead = host.shape[:host.dim() - len(plan.shape)]
            rows = rows.reshape(lead)
            if self.cuda:
                result.setdefault(name, {})[target] = gather_rows(tables[name], rows)
            else:
                result.setdefault(name, {})[target] = gather_rows(tables[name], rows, out=host)
        return result


def _copy_pieces(data, src: np.ndarray, dst: np.ndarray, out) -> None:
    """Pieces stored as they are: ``out[dst[i]] = data[src[i]]`` for all ``i``. On the CPU one slice copy a
    piece; on a device one gather per distinct piece length (frames: one), its indices made there (the CPU
    sends only the pieces' starts)."""
    import torch

    if not src.shape[0]:
        return
    if out.device.type == "cpu" and data.device.type == "cpu":
        host_in, host_out = data.numpy(), out.numpy()
        for (s0, s1), (d0, _) in zip(src.tolist(), dst.tolist()):
            host_out[d0:d0 + s1 - s0] = host_in[s0:s1]
        return
    lengths = src[:, 1] - src[:, 0]
    for length in np.unique(lengths).tolist():
        sel = lengths == length
        span = torch.arange(length, device=out.device)
        at = torch.as_tensor(src[sel, 0], device=data.device)[:, None] + span
        to = torch.as_tensor(dst[sel, 0], device=out.device)[:, None] + span
        out[to.reshape(-1)] = data[at.reshape(-1)]


def _torch_dtype(dtype: np.dtype):
    import torch

    return getattr(torch, np.dtype(dtype).name)
