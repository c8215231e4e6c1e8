"""Every environment id this library registers, as data, in one place.

Imported by ``import compaction_gym``; importing it costs only Gymnasium (entry points are strings,
so minigrid and reasoning-gym load on the first ``gym.make``).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym

_BABYAI = "compaction_gym.envs.babyai.env:BabyAITextEnv"
_SYMBOLIC = "compaction_gym.envs.symbolic:BabyAISymbolicEnv"

#: BALROG task name → the id pinned to it.
BABYAI_TASK_IDS: dict[str, str] = {
    "goto": "AttnMatch-BabyAI-GoTo-v0",
    "pickup": "AttnMatch-BabyAI-Pickup-v0",
    "open": "AttnMatch-BabyAI-Open-v0",
    "putnext": "AttnMatch-BabyAI-PutNext-v0",
    "pick_up_seq_go_to": "AttnMatch-BabyAI-PickUpSeqGoTo-v0",
}

ENV_SPECS: tuple[dict[str, Any], ...] = (
    {"id": "AttnMatch-BabyAI-v0", "entry_point": _BABYAI, "kwargs": {}},
    *(
        {"id": env_id, "entry_point": _BABYAI, "kwargs": {"task": task}}
        for task, env_id in BABYAI_TASK_IDS.items()
    ),
    {"id": "AttnMatch-BabyAI-Symbolic-v0", "entry_point": _SYMBOLIC, "kwargs": {}},
    {"id": "AttnMatch-Math-v0", "entry_point": "compaction_gym.envs.math:MathEnv", "kwargs": {}},
    {"id": "AttnMatch-RGMix-v0", "entry_point": "compaction_gym.envs.math:RGMixEnv", "kwargs": {}},
    {"id": "AttnMatch-Recall-v0", "entry_point": "compaction_gym.envs.recall:RecallEnv", "kwargs": {}},
)

#: The ids above, in registration order.
ENV_IDS: tuple[str, ...] = tuple(spec["id"] for spec in ENV_SPECS)


def register_envs() -> None:
    """Register :data:`ENV_SPECS` with Gymnasium (idempotent)."""
    for spec in ENV_SPECS:
        if spec["id"] not in gym.registry:
            gym.register(**spec)


register_envs()
