"""CompactionEvent serialisation."""

from __future__ import annotations

import base64
import json
import struct

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import given, settings

from compaction_gym.compaction import CompactionEvent, compact
from compaction_gym.compaction.events import EVENT_FORMAT_VERSION
from compaction_gym.errors import InvalidArgumentError


def _event(indices: torch.Tensor, **overrides) -> CompactionEvent:
    fields = dict(
        index=2,
        trigger="kv_budget",
        mode="attention_matching",
        span=(16, 48),
        logical_span=(16, 80),
        indices=indices,
        target=indices.shape[-1],
        probe_source="random",
        probe_logical_range=None,
        probe_seed=1234,
        compute_beta=True,
        kv_len_before=96,
        kv_len_after=72,
        logical_len=120,
        position_offset=48,
        timings={"compact": 0.0125, "total": 0.02},
    )
    fields.update(overrides)
    return CompactionEvent(**fields)


@pytest.mark.parametrize("target", [0, 1, 9])
def test_round_trip_through_json(target):
    g = torch.Generator().manual_seed(target)
    indices = torch.stack([torch.randperm(32, generator=g)[:target].sort().values + 16 for _ in range(12)])
    event = _event(indices.reshape(3, 4, target))
    text = json.dumps(event.to_dict())
    back = CompactionEvent.from_dict(json.loads(text))
    assert back == event
    assert back.indices.dtype == torch.int64 and torch.equal(back.indices, event.indices)
    assert back.span == (16, 48) and back.probe_seed == 1234 and back.timings == event.timings
    assert CompactionEvent.from_json(event.to_json()) == event
    encoded = json.loads(text)["indices"]
    assert encoded["shape"] == [3, 4, target] and encoded["dtype"] == "int32"
    assert len(base64.b64decode(encoded["data"])) == 4 * 12 * target  # raw int32, not nested lists


def test_round_trip_keeps_tuples_and_optional_fields():
    event = _event(torch.zeros(1, 1, 1, dtype=torch.int32), probe_logical_range=(0, 0), probe_seed=None)
    back = CompactionEvent.from_json(event.to_json())
    assert back.probe_logical_range == (0, 0) and back.probe_seed is None
    assert back.indices.dtype == torch.int64


def test_forced_indices_replay_a_recorded_event():
    layers, heads, d = 2, 3, 8
    g = torch.Generator().manual_seed(0)
    keys, values, queries = (torch.randn(layers * heads, 40, d, generator=g) for _ in range(3))
    scored = compact(keys, values, queries, (4, 36), 6)
    event = _event(scored.indices.reshape(layers, heads, 6), span=(4, 36))
    replay = CompactionEvent.from_json(event.to_json())
    again = compact(keys, values, queries, (4, 36), 6, forced_indices=replay.forced_indices())
    assert torch.equal(again.values, scored.values)


@pytest.mark.parametrize(
    ("overrides", "name"),
    [
        ({"indices": torch.zeros(4, 2, dtype=torch.long)}, "indices"),
        ({"indices": torch.zeros(1, 4, 2)}, "indices"),
        ({"target": 3}, "target"),
    ],
)
def test_bad_event_fields(overrides, name):
    with pytest.raises(InvalidArgumentError, match=name):
        _event(overrides.pop("indices", torch.zeros(1, 4, 2, dtype=torch.long)), **overrides)


def test_corrupt_dicts_raise():
    d = _event(torch.arange(6).reshape(1, 2, 3)).to_dict()
    bad = dict(d, indices=dict(d["indices"], data="!!notbase64"))
    with pytest.raises(InvalidArgumentError, match="indices"):
        CompactionEvent.from_dict(bad)
    bad = dict(d, indices=dict(d["indices"], shape=[1, 2, 4]))
    with pytest.raises(InvalidArgumentError, match="indices"):
        CompactionEvent.from_dict(bad)
    bad = dict(d, indices=dict(d["indices"], dtype="float32"))
    with pytest.raises(InvalidArgumentError, match="dtype"):
        CompactionEvent.from_dict(bad)
    with pytest.raises(InvalidArgumentError, match="kv_len_after"):
        CompactionEvent.from_dict({k: v for k, v in d.items() if k != "kv_len_after"})
    with pytest.raises(InvalidArgumentError, match="int32"):
        _event(torch.full((1, 1, 1), 2**40)).to_dict()


# ------------------------------------------------------------------ format version 2: probe_rows, beta
def _v2_event(seed: int, target: int) -> CompactionEvent:
    g = torch.Generator().manual_seed(seed)
    indices = torch.stack([torch.randperm(32, generator=g)[:target].sort().values + 16 for _ in range(12)])
    beta = torch.randn(3, 4, target, generator=g, dtype=torch.float64) * 5
    return _event(indices.reshape(3, 4, target), beta=beta, probe_source="keys", probe_seed=None,
                  probe_logical_range=(100, 116), probe_rows=(80, 96))  # fmt: skip


@settings(max_examples=25, deadline=None, derandomize=True)
@given(seed=st.integers(0, 2**31 - 1), target=st.integers(1, 9))
def test_v2_round_trip_is_lossless(seed, target):
    event = _v2_event(seed, target)
    assert event.beta.dtype == torch.float32  # recorded as the cache stores it
    d = json.loads(event.to_json())
    assert d["version"] == EVENT_FORMAT_VERSION == 3
    assert d["probe_rows"] == [80, 96] and d["beta"]["dtype"] == "float32"
    assert d["probe_tokens"] is None and d["refit_values"] is True
    raw = base64.b64decode(d["beta"]["data"])
    assert len(raw) == 4 * 12 * target
    # little-endian float32, C order: an independent decode with struct
    floats = struct.unpack(f"<{12 * target}f", raw)
    assert torch.equal(torch.tensor(floats, dtype=torch.float32).reshape(3, 4, target), event.beta)
    back = CompactionEvent.from_dict(d)
    assert back == event and back.probe_rows == (80, 96)
    assert torch.equal(back.beta, event.beta) and back.beta.dtype == torch.float32
    assert torch.equal(back.recorded_beta(), event.beta.reshape(12, target))


def test_version_1_dicts_still_load():
    """A record written before format 2 (no version, probe_rows or beta) loads with those unset."""
    event = _v2_event(0, 4)
    old = {k: v for k, v in event.to_dict().items() if k not in ("version", "probe_rows", "beta")}
    back = CompactionEvent.from_dict(json.loads(json.dumps(old)))
    assert back.beta is None and back.probe_rows is None and back.recorded_beta() is None
    assert torch.equal(back.indices, event.indices) and back.probe_logical_range == (100, 116)
    assert back.to_dict()["version"] == 3  # re-saved in the current format
    assert CompactionEvent.from_dict(dict(old, version=1)) == back


def test_version_3_fields_round_trip_and_default():
    """Format 3 adds ``probe_tokens`` (repeat probes) and ``refit_values``; older records refit C2."""
    event = _v2_event(1, 3)
    new = CompactionEvent(**{**event.__dict__, "probe_source": "repeat", "probe_tokens": [5, 6, 7], "refit_values": False})
    d = json.loads(new.to_json())
    assert d["probe_tokens"] == [5, 6, 7] and d["refit_values"] is False
    back = CompactionEvent.from_dict(d)
    assert back == new and back.probe_tokens == (5, 6, 7) and back.refit_values is False
    v2 = {k: v for k, v in event.to_dict().items() if k not in ("probe_tokens", "refit_values")}
    old = CompactionEvent.from_dict(dict(v2, version=2))
    assert old.probe_tokens is None and old.refit_values is True
    with pytest.raises(InvalidArgumentError, match="refit_values"):
        CompactionEvent(**{**event.__dict__, "refit_values": "no"})


def test_v2_bad_fields_raise():
    event = _v2_event(1, 3)
    d = event.to_dict()
    for version in (0, 4, "2", True):
        with pytest.raises(InvalidArgumentError, match="version"):
            CompactionEvent.from_dict(dict(d, version=version))
    with pytest.raises(InvalidArgumentError, match="beta"):
        CompactionEvent.from_dict(dict(d, beta=dict(d["beta"], data="!!")))
    with pytest.raises(InvalidArgumentError, match="beta"):
        CompactionEvent.from_dict(dict(d, beta=dict(d["beta"], dtype="int32")))
    with pytest.raises(InvalidArgumentError, match="beta"):
        CompactionEvent.from_dict(dict(d, beta=dict(d["beta"], shape=[3, 4, 4])))
    with pytest.raises(InvalidArgumentError, match="beta"):
        _event(event.indices, beta=torch.zeros(3, 4, 2))
    with pytest.raises(InvalidArgumentError, match="beta"):
        _event(event.indices, beta=torch.zeros(3, 4, 3, dtype=torch.long))
