"""``compaction-gym serve``: the session API over HTTP (the app, its engine worker, metrics) and
:class:`HTTPBackend`, its client, a :class:`~compaction_gym.backends.Backend` for agents.

Names are imported on first use, so ``import compaction_gym.servers`` needs neither httpx, pydantic
nor FastAPI.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY: dict[str, str] = {
    "HTTPBackend": "compaction_gym.servers.http_backend",
    "ServerArgs": "compaction_gym.servers.args",
    "ServerError": "compaction_gym.servers.errors",
    "create_app": "compaction_gym.servers.app",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'compaction_gym.servers' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
