"""Named ranges for the PyTorch profiler that cost nothing while no profiler records."""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager

import torch
from torch.profiler import record_function

_NOTHING = contextlib.nullcontext()


def profiler_range(name: str) -> AbstractContextManager:
    """``record_function(name)`` while a profiler records (``torch.profiler``, ``emit_nvtx``, on-demand
    tracing), else a no-op: entering and leaving a ``record_function`` costs ~10 µs of host time
    even unrecorded, and a compaction event or a replay layer passes several on the host's
    critical path (docs/engine.md, "Batched events")."""
    return record_function(name) if torch._C._autograd._profiler_enabled() else _NOTHING
