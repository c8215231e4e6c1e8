"""``compaction-gym serve``: the session API over HTTP (the app, its engine worker, metrics) and
:class:`HTTPBackend`, its client, a :class:`~compaction_gym.backends.Backend` for agents.

Names are imported on first use, so ``import compaction_gym.servers`` needs neither httpx, pydantic
nor FastAPI.
"""

from __future__ import annotations

from compaction_gym.lazy import lazy_exports

_LAZY: dict[str, str] = {
    "HTTPBackend": "compaction_gym.servers.http_backend",
    "ServerArgs": "compaction_gym.servers.args",
    "ServerError": "compaction_gym.servers.errors",
    "create_app": "compaction_gym.servers.app",
}

__all__ = sorted(_LAZY)
__getattr__, __dir__ = lazy_exports(__name__, _LAZY)
