"""The compaction modes and what each needs (see ``docs/compaction.md``): one list for the
algorithms, the engine and replay."""

from __future__ import annotations

import math

#: Modes :func:`~compaction_gym.compaction.api` accepts (the config's ``none`` means "never compact").
COMPACTION_MODES: tuple[str, ...] = (
    "attention_matching",
    "markovian",
    "h2o",
    "snapkv",
    "streaming",
    "random",
    "tova",
    "knorm",
)

#: Modes whose selection reads attention from probe queries.
QUERY_MODES: frozenset[str] = frozenset({"attention_matching", "h2o", "snapkv", "tova"})

#: Modes whose scores read each probe's cache row: h2o/snapkv's causal mask (a probe sees the keys
#: up to its row, as kvpress computes them) and tova's "last query" (the probe at the largest row).
POSITION_MODES: frozenset[str] = frozenset({"h2o", "snapkv", "tova"})

#: Modes that need probes even when the kept indices are given (C2 is refitted from them).
REFIT_MODES: frozenset[str] = frozenset({"attention_matching"})

#: Probe sources: recorded post-RoPE queries (``suffix``), cache keys, seeded N(0, I) vectors, the
#: queries of the span's tokens re-read after a "repeat the previous text" prompt (``repeat``, the
#: Attention Matching paper's repeat-prefill), or both query kinds together (``suffix+repeat``).
PROBE_SOURCES: tuple[str, ...] = ("suffix", "keys", "random", "repeat", "suffix+repeat")

#: Sources that read the session's recorded suffix queries.
SUFFIX_SOURCES: frozenset[str] = frozenset({"suffix", "suffix+repeat"})

#: Sources whose queries come from a scratch forward of the event's ``probe_tokens`` over the cache.
REPEAT_SOURCES: frozenset[str] = frozenset({"repeat", "suffix+repeat"})


def target_size(mode: str, n: int, ratio: float) -> int:
    """Rows kept from a span of ``n`` rows: ``0`` for markovian, else ``max(1, floor(n · ratio))``."""
    return 0 if mode == "markovian" else max(1, math.floor(n * ratio))


def replay_needs_probes(mode: str, refit_values: bool = True) -> bool:
    """Whether replaying an event with recorded indices needs its probes (C2 is refitted from them)."""
    return mode in REFIT_MODES and refit_values
