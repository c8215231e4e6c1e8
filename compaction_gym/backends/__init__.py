"""Backends behind the session API: the :class:`Backend` protocol agents talk to (and
:class:`ContinuousBackend`, those that batch continuously), the in-process
:class:`LocalBackend` (the embedded engine), :class:`ScriptedBackend` (model-free, for tests) and
:class:`VLLMBackend` (the embedded engine inside vLLM's workers, docs/vllm.md).
The HTTP client, :class:`~compaction_gym.servers.HTTPBackend`, lives with the server it talks to."""

from compaction_gym.lazy import lazy_exports

_EXPORTS: dict[str, str] = {
    "LocalBackend": "compaction_gym.backends.local",
    "Backend": "compaction_gym.backends.protocol",
    "ContinuousBackend": "compaction_gym.backends.protocol",
    "ScriptedBackend": "compaction_gym.backends.scripted",
    "VLLMBackend": "compaction_gym.backends.vllm_backend",
}

__all__ = sorted(_EXPORTS)
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
