"""Every config and sampling field is validated at construction, with an error that names it."""

from __future__ import annotations

import dataclasses
import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError

#: the defects a hostile client found: (config class, field, bad value)
BAD = [
    (SamplingParams, "temperature", float("inf")),
    (SamplingParams, "temperature", float("nan")),
    (SamplingParams, "temperature", 1e400),
    (SamplingParams, "temperature", True),
    (SamplingParams, "seed", "abc"),
    (SamplingParams, "seed", 1.5),
    (SamplingParams, "top_k", 2**70),
    (SamplingParams, "max_new_tokens", 2.5),
    (SamplingParams, "stop_token_ids", "ab"),
    (SamplingParams, "stop_token_ids", [1, -2]),
    (SamplingParams, "stop_token_ids", list(range(5000))),
    (SamplingParams, "ignore_eos", 1),
    (CompactionConfig, "max_kv_len", 64.5),
    (CompactionConfig, "max_kv_len", "64"),
    (CompactionConfig, "ridge", float("nan")),
    (CompactionConfig, "n_probe_queries", 10**12),
    (CompactionConfig, "compact_target_ratio", float("inf")),
    (CompactionConfig, "mode", 3),
    (CompactionConfig, "compute_beta", "yes"),
]


@pytest.mark.parametrize(("cls", "name", "value"), BAD, ids=[f"{c.__name__}.{n}={v!r:.20}" for c, n, v in BAD])
def test_bad_values_are_refused_naming_the_field(cls, name, value):
    kwargs = {name: value}
    if cls is CompactionConfig and name not in ("mode",):
        kwargs["mode"] = "attention_matching"
    with pytest.raises(InvalidArgumentError, match=name):
        cls(**kwargs)


def test_numpy_scalars_and_lists_are_normalised():
    np = pytest.importorskip("numpy")
    params = SamplingParams(temperature=np.float32(0.5), top_k=np.int64(3), stop_token_ids=[np.int64(7)])
    assert params.temperature == 0.5 and type(params.top_k) is int and params.stop_token_ids == (7,)


_ANY = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-5, max_value=2**40), max_size=4),
)


@pytest.mark.parametrize("cls", [SamplingParams, CompactionConfig])
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_value_either_builds_a_valid_config_or_names_the_field(cls, data):
    """Fuzz one field at a time with values of every JSON type: the only failure is an
    InvalidArgumentError that names the field, and what builds holds only finite, in-range values."""
    names = [f.name for f in dataclasses.fields(cls)]
    name = data.draw(st.sampled_from(names))
    value = data.draw(_ANY)
    kwargs = {name: value}
    if cls is CompactionConfig and name != "mode":
        kwargs["mode"] = "attention_matching"
    try:
        built = cls(**kwargs)
    except InvalidArgumentError as exc:
        assert name in str(exc) or "compact_window" in str(exc) or "mode" in str(exc), str(exc)
        return
    for f in dataclasses.fields(cls):
        v = getattr(built, f.name)
        if isinstance(v, float):
            assert math.isfinite(v)
        meta = f.metadata
        if isinstance(v, int | float) and not isinstance(v, bool):
            assert meta.get("ge", v) <= v <= meta.get("le", v)
