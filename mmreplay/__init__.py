"""mmreplay: RL replay buffers on disk — compressed, bit-packed, crash-safe, sampled in place."""

from mmreplay.columns.spec import ColumnSpec, Schema
from mmreplay.errors import (CorruptDataError, FormatError, MMReplayError, NotAStoreError, ReadOnlyError,
                             StorageError, StoreClosedError)
from mmreplay.sampling.batch import Batch
from mmreplay.store import Store

__version__ = "0.1.0"

__all__ = ["Store", "ColumnSpec", "Schema", "Batch", "MMReplayError", "NotAStoreError", "FormatError",
           "CorruptDataError", "StoreClosedError", "ReadOnlyError", "StorageError", "__version__"]
