"""mmreplay: RL replay buffers on disk — compressed, bit-packed, crash-safe, sampled in place.

The public names are loaded on first use (PEP 562), so that light-weight parts of the package (the
shard encoder child process, the format readers) can be imported without torch.
"""

from importlib import import_module

__version__ = "0.1.0"

_EXPORTS = {
    "Store": "mmreplay.store",
    "Settings": "mmreplay.settings",
    "Sampler": "mmreplay.sampling.sampler",
    "ColumnSpec": "mmreplay.columns.spec",
    "Schema": "mmreplay.columns.spec",
    "Batch": "mmreplay.sampling.batch",
    "SequenceBatch": "mmreplay.sampling.sequences",
    "Uniform": "mmreplay.sampling.strategy",
    "Prioritized": "mmreplay.sampling.strategy",
    "NStep": "mmreplay.sampling.strategy",
    "Sequences": "mmreplay.sampling.strategy",
    "DrawStrategy": "mmreplay.sampling.strategy",
    "MMReplayError": "mmreplay.errors",
    "NotAStoreError": "mmreplay.errors",
    "FormatError": "mmreplay.errors",
    "CorruptDataError": "mmreplay.errors",
    "StoreClosedError": "mmreplay.errors",
    "ReadOnlyError": "mmreplay.errors",
    "StorageError": "mmreplay.errors",
}

__all__ = [*_EXPORTS, "__version__"]


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'mmreplay' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(__all__)
