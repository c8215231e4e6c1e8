"""The embedded inference engine: slot KV cache, β attention hook, persistent compacted sessions.

Files, the nano-vllm way: :mod:`~compaction_gym.engine.engine` (public API),
:mod:`~compaction_gym.engine.scheduler` (sessions and the batched step loop),
:mod:`~compaction_gym.engine.slot_cache` (K/V/β storage), :mod:`~compaction_gym.engine.model_runner`
(batched forwards), :mod:`~compaction_gym.engine.attention` (the registered attention function),
:mod:`~compaction_gym.engine.context` (per-forward metadata), :mod:`~compaction_gym.engine.sampler`,
:mod:`~compaction_gym.engine.compactor` (triggers and events), :mod:`~compaction_gym.engine.session`.
"""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CompactionConfig": "compaction_gym.engine.config",
    "SamplingParams": "compaction_gym.engine.config",
    "Engine": "compaction_gym.engine.engine",
    "SessionView": "compaction_gym.engine.session",
    "CreateRequest": "compaction_gym.engine.types",
    "StepRequest": "compaction_gym.engine.types",
    "StepResult": "compaction_gym.engine.types",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
