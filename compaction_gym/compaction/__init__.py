"""The compaction algorithms (docs/compaction.md): pure, batched tensor functions, no model or engine state.

Every function takes tensors batched over a leading ``B`` = layers × KV heads and runs all rows
in one call. See ``docs/compaction.md`` for the math, shapes and modes.
"""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "apply_event": "compaction_gym.compaction.apply",
    "fit_beta": "compaction_gym.compaction.beta",
    "nnls": "compaction_gym.compaction.beta",
    "CompactionResult": "compaction_gym.compaction.api",
    "compact": "compaction_gym.compaction.api",
    "CompactionEvent": "compaction_gym.compaction.events",
    "COMPACTION_MODES": "compaction_gym.compaction.modes",
    "COMPACTION_REVISION": "compaction_gym.compaction.revisions",
    "REVISIONS": "compaction_gym.compaction.revisions",
    "QUERY_MODES": "compaction_gym.compaction.modes",
    "target_size": "compaction_gym.compaction.modes",
    "event_probes": "compaction_gym.compaction.probes",
    "gqa_probes": "compaction_gym.compaction.probes",
    "key_probe_rows": "compaction_gym.compaction.probes",
    "random_probes": "compaction_gym.compaction.probes",
    "RowMap": "compaction_gym.compaction.rowmap",
    "Segment": "compaction_gym.compaction.rowmap",
    "select_keys": "compaction_gym.compaction.scoring",
    "fit_values": "compaction_gym.compaction.values",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
