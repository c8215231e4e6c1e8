"""Environments: BabyAI as text (BALROG-compatible) single-step text math, and multi-turn recall.

``import compaction_gym`` registers the ids (see :mod:`compaction_gym.envs.registration`) without
importing minigrid or reasoning-gym; the names below load their module on first access.
"""

from __future__ import annotations

from compaction_gym.lazy import lazy_exports

_LAZY = {
    "BabyAITextEnv": "compaction_gym.envs.babyai.env",
    "BabyAISymbolicEnv": "compaction_gym.envs.symbolic",
    "MixedTrainLocal": "compaction_gym.envs.babyai.levels",
    "describe": "compaction_gym.envs.babyai.text",
    "expert_action": "compaction_gym.envs.babyai.expert",
    "parse_action": "compaction_gym.envs.babyai.actions",
    "MathEnv": "compaction_gym.envs.math",
    "RGMixEnv": "compaction_gym.envs.math",
    "RecallEnv": "compaction_gym.envs.recall",
    "ENV_IDS": "compaction_gym.envs.registration",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
