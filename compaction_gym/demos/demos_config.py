"""``DemosConfig``: the arguments of ``compaction-gym demos`` (also the keys of its ``--config`` TOML)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass
class DemosConfig:
    """Arguments of ``compaction-gym demos`` (also the keys of its ``--config`` TOML file)."""

    model: str | None = field(
        default=None,
        metadata={"help": "model directory or registered name whose tokenizer/engine records the sessions"},
    )
    output_dir: str = field(default="runs/demos", metadata={"help": "where the demos are written"})
    tasks: list[str] = field(
        default_factory=lambda: ["goto", "pickup", "open", "putnext", "pick_up_seq_go_to"],
        metadata={"help": "BabyAI tasks (one or more: --tasks putnext open)"},
    )
    episodes_per_task: int = field(default=100, metadata={"help": "episodes per task"})
    seed: int = field(default=100_000, metadata={"help": "first train seed; task k uses a block of its own"})
    eval_seed_limit: int = field(
        default=10_000, metadata={"help": "seeds below this are reserved for evaluation"}
    )
    noise: float = field(default=0.0, metadata={"help": "probability of a random movement turn (masked)"})
    noise_seed: int = field(default=0, metadata={"help": "seeds the noise stream"})
    keep_failed: bool = field(default=False, metadata={"help": "also train on episodes that failed"})
    max_turns: int | None = field(
        default=None,
        metadata={"help": "cut every episode after this many turns and keep it (opening-turn demos)"},
    )
    prompt: str = field(default="reasoning", metadata={"help": "agent prompt format"})
    mode: str = field(default="attention_matching", metadata={"help": "compaction mode of the sessions"})
    max_kv_len: int | None = field(default=512, metadata={"help": "KV-budget trigger length"})
    compact_window: int | None = field(default=256, metadata={"help": "tokens compacted per event"})
    ratio: float = field(default=0.25, metadata={"help": "kept fraction of a compacted span"})
    batch: int = field(default=8, metadata={"help": "episodes recorded concurrently"})
    group_size: int = field(default=1, metadata={"help": "episodes merged into one tree (shared prefix)"})
    threads: int | None = field(default=None, metadata={"help": "torch CPU threads (per worker)"})
    workers: int = field(
        default=1, metadata={"help": "processes recording shards in parallel (same episodes for any count)"}
    )
    device: str | None = field(default=None, metadata={"help": "engine device (default: cuda if available)"})
    time_limit_s: float | None = field(
        default=None,
        metadata={
            "help": "stop starting new episodes after this many seconds (manifest records the seeds played)"
        },
    )
    corpus_episodes: int = field(
        default=40, metadata={"help": "with [init]: expert episodes per task for the tokenizer corpus"}
    )
    init: dict[str, Any] = field(
        default_factory=dict,
        metadata={"help": "TOML only: build a fresh base model at --model first (BaseModelConfig fields)"},
    )

    def compaction(self) -> Any:
        """The recording sessions' :class:`~compaction_gym.engine.config.CompactionConfig`."""
        from compaction_gym.engine.config import CompactionConfig

        return CompactionConfig(
            mode=self.mode,
            max_kv_len=self.max_kv_len,
            compact_window=self.compact_window,
            compact_target_ratio=self.ratio,
        )
