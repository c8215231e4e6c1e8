"""Property: any JSON body either validates into configs the engine accepts, or is refused with a
422-style error naming a field — never an exception of another kind (a would-be 500)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.schemas import (
    CompactGenerateRequest,
    InjectGenerateRequest,
    SessionCreateRequest,
    SessionStepRequest,
)

_JSON_SCALARS = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=False, allow_infinity=False),
    st.sampled_from(["1e400", "Infinity", "NaN"]).map(float),
    st.text(max_size=6),
)
_JSON = st.one_of(_JSON_SCALARS, st.lists(_JSON_SCALARS, max_size=3))


def _fields(model) -> list[str]:
    names = set(model.model_fields)
    for field in model.model_fields.values():
        alias = field.validation_alias
        names |= set(getattr(alias, "choices", []) or [])
    return sorted(n for n in names if isinstance(n, str))


@pytest.mark.parametrize(
    "model", [SessionCreateRequest, SessionStepRequest, CompactGenerateRequest, InjectGenerateRequest]
)
@settings(max_examples=300, deadline=None)
@given(data=st.data())
def test_any_body_validates_or_names_a_field(model, data):
    body = {"prompt_ids": [1, 2, 3]} if "prompt_ids" in model.model_fields else {"session_id": "s", "new_token_ids": [1]}
    if model is InjectGenerateRequest:
        body |= {"max_total_tokens": 16, "inject_budget_every": 4}
    for name in data.draw(st.lists(st.sampled_from(_fields(model)), max_size=3, unique=True)):
        body[name] = data.draw(_JSON)
    text = json.dumps(body, allow_nan=True)
    try:
        request = model.model_validate_json(text)
    except ValidationError as exc:
        assert all(e["loc"] for e in exc.errors())  # every error names where it is
        return
    try:  # what the app does next: build the engine's configs
        if hasattr(request, "compaction_config"):
            request.compaction_config()
        request.sampling()
    except InvalidArgumentError as exc:
        assert str(exc)  # the app answers 422 with this message
