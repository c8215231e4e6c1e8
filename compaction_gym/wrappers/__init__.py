"""Gymnasium wrappers that put an LLM agent (``LLMAgentWrapper``) or the expert teacher
(``ExpertDemoWrapper``) in the loop."""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "LLMAgentWrapper": "compaction_gym.wrappers.llm_agent",
    "ExpertDemoWrapper": "compaction_gym.wrappers.expert_demos",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
