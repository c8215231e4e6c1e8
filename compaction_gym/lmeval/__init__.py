"""Language-model evaluation under compacted KV caches: ``compaction-gym eval-lm`` (docs/eval-lm.md)."""

from compaction_gym.lmeval.mixer import MIXERS, BackoffNgramMixer, MixerConfig, mix_stream
from compaction_gym.lmeval.scoring import (
    Cell,
    CellResult,
    bits_per_byte,
    default_score_after,
    make_cells,
    mix_result,
    piece_bytes,
    score_cells,
    summary,
)
from compaction_gym.lmeval.text import BUILTIN_TEXTS, load_text, pydoc_text

__all__ = [
    "BUILTIN_TEXTS",
    "MIXERS",
    "BackoffNgramMixer",
    "MixerConfig",
    "mix_result",
    "mix_stream",
    "Cell",
    "CellResult",
    "bits_per_byte",
    "default_score_after",
    "load_text",
    "make_cells",
    "piece_bytes",
    "pydoc_text",
    "score_cells",
    "summary",
]
