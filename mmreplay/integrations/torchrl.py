"""TorchRL: ``MMReplayStorage``, a ``torchrl.data.Storage`` over an mmreplay store, and native samplers.

``ReplayBuffer(storage=MMReplayStorage(path, ...), sampler=..., batch_size=...)`` keeps a TorchRL
buffer on disk (frames once, compressed; crash-safe commits) and samples TensorDicts with TorchRL's keys:
``observation``, ``action``, ``done`` / ``terminated`` / ``truncated`` (False: a stored step never starts
from a terminal state) and ``("next", "observation" | "reward" | "done" | "terminated" | "truncated")``.

Invariants:
- TorchRL index ``i`` of the storage is the ``i``-th valid transition, oldest first: ``g = oldest + i``
  where ``(oldest, head)`` is the store's valid range when the index is read. So ``len(storage)`` counts
  what can be sampled, ``RandomSampler`` draws uniformly, and ``storage[:]`` lists steps in the order
  they were added. TorchRL's round-robin writer index equals it until the store first overwrites (a
  bounded store after ``capacity`` adds); samplers that key state on written indices (TorchRL's
  ``PrioritizedSampler``) are exact only until then: use ``MMReplayPrioritizedSampler`` (priorities
  keyed by the store's stable ids and committed with it) for long runs.
- TorchRL index ``i`` counts from ``inspect.readable_range()[0]``: every index below ``len(storage)`` is
  one ``get`` accepts (after the ring cut an episode, its first ``frame_stack - 1`` kept steps are held but
  not readable, so they are not counted).
- ``storage[:]`` returns what ``storage[0:len(storage)]`` returns: every key of every transition. Only
  when TorchRL's own samplers call it (``SliceSampler`` finding trajectories) does it return the small
  columns (flags, ``episode``, ``("collector", "traj_ids")``), never every frame.
- Native samplers never fail from a race with a writer in another process: ``sample`` hands the storage
  the exact ids it drew, ``get`` reads those ids, and if the writer overwrote some of them in between it
  draws again (``info`` is updated in place, ``info["index"]`` included), so the rows returned are always
  the rows ``info`` names.
- ``("collector", "traj_ids")`` reads back as written: a store this storage creates has the extra column
  ``collector.traj_ids`` (int64). Rows written without trajectory ids get new ids, one per episode of
  their stream, counted on from the largest id held. A store without that column (made before, or by
  ``Store.create``) reads back its episode numbers there, a bijection onto its episodes.
- ``extend`` keeps episodes intact: rows of one ``("collector", "traj_ids")`` (or of one row of a 2-D
  ``(envs, time)`` batch) form one stream of the store; stream ids are reused once an episode ended.
- ``dumps(path)`` commits the store and writes ``path/mmreplay_storage.json`` (JSON, no pickle);
  ``loads(path)`` reopens the store that file names and checks it holds at least what was committed.

Supported TorchRL: 0.14.x (tested with torchrl 0.14.1, tensordict 0.14.3, torch 2.13 CPU).
TorchRL is imported only here (``pip install 'mmreplay[torchrl]'``).

The pieces, one job a module: ``torchrl_storage`` (the storage: TorchRL's index over the store's readable
range, ``dumps`` / ``loads``), ``torchrl_samplers`` (the native samplers), ``torchrl_rows`` (TensorDicts as
store rows and back: keys, action encoding, trajectory ids and streams); this module: the public names.
"""

from mmreplay.integrations.torchrl_rows import (  # noqa: F401  (the public names of the TorchRL integration)
    OBSERVATION_KEYS,
    RACE_RETRIES,
    TORCHRL_SAMPLERS,
    TRAJ_COLUMN,
    TRAJ_KEY,
)
from mmreplay.integrations.torchrl_samplers import (  # noqa: F401
    MMReplayPrioritizedSampler,
    MMReplayRandomSampler,
    MMReplaySliceSampler,
)
from mmreplay.integrations.torchrl_storage import (  # noqa: F401
    ACTION_ENCODINGS,
    CHECKPOINT_FILE,
    UNBOUNDED_MAX_SIZE,
    MMReplayStorage,
)
