"""The storage layer's public surface: what ``sampling/`` and ``distributed/`` may use of ``storage/``.

Invariant: this module defines nothing; it re-exports the few names of the storage layer that the layers
above ``state.py`` need, so that those layers depend on this one module, never on how ``storage/`` is cut
into modules (import-linter's ``storage-internals`` contract in pyproject.toml enforces it). What a priority
set persists is not here: ``state.py`` hands each set its files (``sampling.priorities.PriorityPersistence``).

- The commit record's rules that a priority set checks before anything changes: ``valid_name`` (sampler and
  priority-set names, which name directories) and ``check_leaf_range`` (priorities whose leaves overflow).
- Files beside a store written atomically and read without following planted links: ``atomic_write``,
  ``fsync_dir``, ``read_regular``; ``COMMIT_FILE``, whose presence says a store was committed at least once.
- ``register_for_fork``: objects whose ``_after_fork_in_child()`` runs in a forked child (``storage/durability/forking.py``).
"""

from mmreplay.storage.durability.commit import COMMIT_FILE, check_leaf_range, valid_name
from mmreplay.storage.files import atomic_write, fsync_dir, read_regular
from mmreplay.storage.durability.forking import register as register_for_fork

__all__ = ["COMMIT_FILE", "atomic_write", "check_leaf_range", "fsync_dir", "read_regular", "register_for_fork",
           "valid_name"]
