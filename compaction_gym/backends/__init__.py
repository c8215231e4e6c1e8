"""Backends behind the session API: the :class:`Backend` protocol agents talk to, the in-process
:class:`LocalBackend` (the embedded engine) and :class:`ScriptedBackend` (model-free, for tests).
The HTTP client, :class:`~compaction_gym.servers.HTTPBackend`, lives with the server it talks to."""

from compaction_gym.backends.local import LocalBackend
from compaction_gym.backends.protocol import Backend
from compaction_gym.backends.scripted import ScriptedBackend

__all__ = ["Backend", "LocalBackend", "ScriptedBackend"]
