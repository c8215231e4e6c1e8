"""``profiling.profiler_range``: a named range while a profiler records, nothing otherwise."""

from __future__ import annotations

import contextlib

import torch
from torch.profiler import ProfilerActivity, profile

from compaction_gym.engine.profiling import profiler_range


def test_no_range_without_a_profiler():
    assert isinstance(profiler_range("compaction.test"), contextlib.nullcontext)


def test_the_range_is_recorded_under_a_profiler():
    with profile(activities=[ProfilerActivity.CPU]) as prof, profiler_range("compaction.test"):
        torch.ones(3).sum()
    assert "compaction.test" in {e.name for e in prof.events()}
