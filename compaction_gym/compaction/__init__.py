"""The compaction algorithms (docs/compaction.md): pure, batched tensor functions, no model or engine state.

Every function takes tensors batched over a leading ``B`` = layers × KV heads and runs all rows
in one call. See ``docs/compaction.md`` for the math, shapes and modes.
"""

from compaction_gym.compaction.apply import apply_event
from compaction_gym.compaction.beta import fit_beta, nnls
from compaction_gym.compaction.compact import CompactionResult, compact
from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.compaction.modes import COMPACTION_MODES, QUERY_MODES, target_size
from compaction_gym.compaction.probes import event_probes, gqa_probes, key_probe_rows, random_probes
from compaction_gym.compaction.rowmap import RowMap, Segment
from compaction_gym.compaction.scoring import select_keys
from compaction_gym.compaction.values import fit_values

__all__ = [
    "COMPACTION_MODES",
    "QUERY_MODES",
    "CompactionEvent",
    "CompactionResult",
    "RowMap",
    "Segment",
    "apply_event",
    "compact",
    "event_probes",
    "fit_beta",
    "fit_values",
    "gqa_probes",
    "key_probe_rows",
    "nnls",
    "random_probes",
    "select_keys",
    "target_size",
]
