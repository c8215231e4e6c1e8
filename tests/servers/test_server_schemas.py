"""Request models → engine configs, and StepResult ↔ wire shape (no model needed)."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from compaction_gym.compaction.events import CompactionEvent
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import StepResult
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.http_backend import config_fields, sampling_fields
from compaction_gym.servers.schemas import (
    CompactGenerateRequest,
    SessionCreateRequest,
    SessionStepRequest,
    from_response,
    segment_boundaries,
    to_response,
)


def _event(index: int, logical_len: int) -> CompactionEvent:
    return CompactionEvent(
        index=index,
        trigger="kv_budget",
        mode="attention_matching",
        span=(4, 20),
        logical_span=(4, 20),
        indices=torch.arange(8).reshape(2, 2, 2),
        target=2,
        probe_source="suffix",
        probe_logical_range=(20, 30),
        probe_seed=None,
        compute_beta=False,
        kv_len_before=32,
        kv_len_after=18,
        logical_len=logical_len,
        position_offset=logical_len - 18,
        timings={"solve": 0.01},
    )


def test_unset_fields_leave_engine_defaults():
    req = SessionCreateRequest.model_validate({"prompt_ids": [1, 2]})
    assert req.compaction_config() is None and req.sampling() is None


def test_max_kv_len_implies_attention_matching_and_seed_names():
    req = SessionCreateRequest.model_validate(
        {
            "prompt_ids": [1],
            "max_kv_len": 64,
            "compact_window": 16,
            "max_response_tokens": 5,
            "temperature": 0,
        }
    )
    assert req.compaction_config() == CompactionConfig(
        mode="attention_matching", max_kv_len=64, compact_window=16
    )
    assert req.sampling() == SamplingParams(temperature=0.0, max_new_tokens=5)
    alias = SessionCreateRequest.model_validate({"prompt_ids": [1], "max_new_tokens": 7})
    assert alias.sampling().max_new_tokens == 7


def test_use_suffix_queries_alias():
    req = SessionCreateRequest.model_validate(
        {"prompt_ids": [1], "max_kv_len": 64, "use_suffix_queries": False}
    )
    assert req.compaction_config().queries == "random"


def test_compact_generate_budget_is_the_seeds_generation_cap():
    req = CompactGenerateRequest.model_validate(
        {"prompt_ids": [1], "max_kv_len": 64, "max_total_tokens": 300}
    )
    assert req.sampling().max_new_tokens == 300


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({}, "prompt_ids"),
        ({"prompt_ids": "abc"}, "prompt_ids"),
        ({"prompt_ids": ["1"]}, "prompt_ids"),
        ({"prompt_ids": [-1]}, "prompt_ids"),
        ({"prompt_ids": [1], "max_kv_len": -4}, "max_kv_len"),
        ({"prompt_ids": [1], "max_response_tokens": -1}, "max_response_tokens"),
        ({"prompt_ids": [1], "top_p": 0}, "top_p"),
        ({"prompt_ids": [1], "temperature": "hot"}, "temperature"),
        ({"prompt_ids": [1], "max_tokens": 5}, "max_tokens"),
        ({"prompt_ids": [1], "session_id": "bad id with spaces"}, "session_id"),
    ],
)
def test_bad_fields_are_named(body, field):
    with pytest.raises(ValidationError) as info:
        SessionCreateRequest.model_validate(body)
    assert field in str(info.value)


def test_invalid_combination_is_a_typed_error():
    req = SessionCreateRequest.model_validate({"prompt_ids": [1], "max_kv_len": 16, "compact_window": 16})
    with pytest.raises(InvalidArgumentError, match="compact_window"):
        req.compaction_config()


def test_step_overrides_only_what_was_set():
    req = SessionStepRequest.model_validate(
        {"session_id": "s", "new_token_ids": [], "seed": None, "top_k": 3}
    )
    assert req.sampling_overrides() == {"seed": None, "top_k": 3}


def test_client_fields_rebuild_the_same_configs():
    config = CompactionConfig(mode="h2o", max_kv_len=100, compact_window=40, n_compacts=2, queries="keys")
    sampling = SamplingParams(
        temperature=0.7, top_p=0.9, top_k=5, seed=11, max_new_tokens=9, stop_token_ids=(3,)
    )
    req = SessionCreateRequest.model_validate(
        {"prompt_ids": [1]} | config_fields(config) | sampling_fields(sampling)
    )
    assert req.compaction_config() == config
    assert req.sampling() == sampling
    turn = CompactionConfig(mode="markovian", n_protect_turns=1)
    req = SessionCreateRequest.model_validate({"prompt_ids": [1]} | config_fields(turn))
    assert req.compaction_config() == turn
    framed = CompactionConfig(
        mode="markovian", n_protect_turns=0, max_total_tokens=9, inject_budget_message=True,
        budget_message_frame=("<start_of_turn>user\n", "<end_of_turn>\n<start_of_turn>model\n"),
    )  # fmt: skip
    req = SessionCreateRequest.model_validate({"prompt_ids": [1]} | config_fields(framed))
    assert req.compaction_config() == framed
    with pytest.raises(ValidationError, match="budget_message_frame"):
        SessionCreateRequest.model_validate({"prompt_ids": [1], "budget_message_frame": ["only a prefix"]})


def test_wire_round_trip_is_lossless():
    result = StepResult(
        session_id="s1",
        token_ids=[5, 6, 7, 8, 9],
        logprobs=[-0.1, -0.25, 0.0, 0.0, -1.5],
        completion_mask=[1, 1, 0, 0, 1],
        text="abc",
        finish_reason="length",
        events=[_event(0, 52)],
        kv_len=30,
        total_tokens=55,
        prompt_len=3,
        inject_ranges=[(2, 4)],
        timings={"total": 0.5},
    )
    import json

    wire = json.loads(json.dumps(to_response(result, "abc", {"batch_size": 2.0})))
    back = from_response(wire)
    assert back.to_dict() == result.to_dict()
    assert wire["diagnostics"]["segment_boundaries"] == [2]
    assert wire["current_seq_len"] == 30


def test_segment_boundaries_clamp():
    r = StepResult(
        "s", [1, 2], [0.0, 0.0], [1, 1], "", "stop", events=[_event(0, 1), _event(1, 99)], total_tokens=10
    )
    assert segment_boundaries(r) == [0, 2]


def test_request_fields_are_the_dataclass_fields():
    """Every CompactionConfig / SamplingParams field is a request field of the same name (and help);
    the only other names are the original research API's documented aliases."""
    from dataclasses import fields

    from compaction_gym.engine.config import CompactionConfig, SamplingParams
    from compaction_gym.servers.schemas import SEED_ALIASES, CompactionFields, SamplingFields

    for model, cls in ((SamplingFields, SamplingParams), (CompactionFields, CompactionConfig)):
        declared = {f.name: f.metadata["help"] for f in fields(cls)}
        request = set(model.model_fields)
        extra = request - set(declared)
        assert extra <= set(SEED_ALIASES), f"{model.__name__} has undocumented fields {extra - set(SEED_ALIASES)}"
        assert set(declared) <= request, f"{model.__name__} lacks {set(declared) - request}"
        for name, help_text in declared.items():
            assert help_text and help_text in (model.model_fields[name].description or ""), name
    for alias, name in SEED_ALIASES.items():
        assert name in {f.name for f in fields(SamplingParams)} | {f.name for f in fields(CompactionConfig)}
        model = SamplingFields if name in SamplingFields.model_fields else CompactionFields
        assert alias in model.model_fields or alias in str(model.model_fields[name].validation_alias)


def test_seed_aliases_and_dataclass_names_give_the_same_config():
    from compaction_gym.servers.schemas import SessionCreateRequest

    seeds = SessionCreateRequest.model_validate(
        {"prompt_ids": [1], "compaction_mode": "markovian", "max_kv_len": 64, "max_response_tokens": 3,
         "use_suffix_queries": False}
    )
    ours = SessionCreateRequest.model_validate(
        {"prompt_ids": [1], "mode": "markovian", "max_kv_len": 64, "max_new_tokens": 3, "queries": "random"}
    )
    assert seeds.compaction_config() == ours.compaction_config()
    assert seeds.sampling() == ours.sampling()
    assert ours.compaction_config().mode == "markovian" and ours.sampling().max_new_tokens == 3


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ('{"prompt_ids": [1], "temperature": Infinity}', "temperature"),
        ('{"prompt_ids": [1], "temperature": 1e400}', "temperature"),
        ('{"prompt_ids": [1], "ridge": NaN}', "ridge"),
        ('{"prompt_ids": [1], "top_k": 1180591620717411303424}', "top_k"),
        ('{"prompt_ids": [1], "max_new_tokens": 2.5}', "max_new_tokens"),
        ('{"prompt_ids": [1], "max_kv_len": 64.5}', "max_kv_len"),
        ('{"prompt_ids": [1], "max_kv_len": "64"}', "max_kv_len"),
        ('{"prompt_ids": [1], "n_probe_queries": 1000000000000}', "n_probe_queries"),
        ('{"prompt_ids": [1], "stop_token_ids": "ab"}', "stop_token_ids"),
    ],
)
def test_non_finite_and_wrongly_typed_values_are_422s_naming_the_field(body, field):
    """The schema refuses them before the engine is asked (its bounds come from the dataclasses)."""
    from pydantic import ValidationError

    from compaction_gym.servers.schemas import SessionCreateRequest

    with pytest.raises(ValidationError) as info:
        SessionCreateRequest.model_validate_json(body)
    assert any(field in ".".join(map(str, e["loc"])) for e in info.value.errors()), info.value.errors()
