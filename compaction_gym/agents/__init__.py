"""LLM agents that hold a compacted KV session per episode, their trajectories, and evaluation."""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "CompactionAgent": "compaction_gym.agents.agent",
    "act_batch": "compaction_gym.agents.agent",
    "ChatFormat": "compaction_gym.agents.chat",
    "PROMPT_FORMATS": "compaction_gym.agents.prompts",
    "PromptFormat": "compaction_gym.agents.prompts",
    "get_prompt_format": "compaction_gym.agents.prompts",
    "run_episode": "compaction_gym.agents.rollout",
    "run_episodes": "compaction_gym.agents.rollout",
    "Trajectory": "compaction_gym.agents.trajectory",
    "Turn": "compaction_gym.agents.trajectory",
    "read_jsonl": "compaction_gym.agents.trajectory",
    "write_jsonl": "compaction_gym.agents.trajectory",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
