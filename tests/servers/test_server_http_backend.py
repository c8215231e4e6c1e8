"""HTTPBackend's retry policy and typed errors, against a scripted transport (no server)."""

from __future__ import annotations

import httpx
import pytest

from compaction_gym.errors import CapacityError, InvalidArgumentError, UnknownSessionError
from compaction_gym.servers.errors import ServerError, error_body
from compaction_gym.servers.http_backend import HTTPBackend


def _backend(handler, **kw) -> HTTPBackend:
    kw = {"backoff_s": 0.001, "max_backoff_s": 0.002} | kw
    return HTTPBackend("http://testserver", transport=httpx.MockTransport(handler), **kw)


def _ok_result(session_id: str = "s") -> dict:
    from compaction_gym.engine.types import StepResult
    from compaction_gym.servers.schemas import to_response

    return to_response(StepResult(session_id, [7], [-0.5], [1], "x", "stop", kv_len=3, total_tokens=3), "x")


def test_429_is_retried_then_succeeds():
    calls = []

    def handler(request: httpx.Request) -> httpx.Response:
        calls.append(request.url.path)
        if len(calls) < 3:
            return httpx.Response(
                429, json=error_body(429, "full", type_="CapacityError"), headers={"Retry-After": "0"}
            )
        return httpx.Response(200, json=_ok_result())

    result = _backend(handler).create_session([1, 2])
    assert len(calls) == 3 and result.token_ids == [7] and result.kv_len == 3


def test_429_after_retries_is_capacity_error():
    def handler(request):
        return httpx.Response(429, json=error_body(429, "no free slot", type_="CapacityError"))

    with pytest.raises(CapacityError, match="no free slot"):
        _backend(handler, max_retries=2).create_session([1])


def test_connection_errors_are_retried_only_when_safe():
    attempts = {"connect": 0, "read": 0}

    def connect_fails_twice(request):
        attempts["connect"] += 1
        if attempts["connect"] <= 2:
            raise httpx.ConnectError("refused", request=request)
        return httpx.Response(200, json=_ok_result())

    assert _backend(connect_fails_twice).step("s", [1]).token_ids == [7]

    def read_fails(request):
        attempts["read"] += 1
        raise httpx.ReadError("reset", request=request)

    with pytest.raises(ServerError, match="may or may not"):
        _backend(read_fails).step("s", [1])
    assert attempts["read"] == 1  # a step that may have been applied is never replayed


@pytest.mark.parametrize(
    ("status", "error"),
    [
        (404, UnknownSessionError),
        (422, InvalidArgumentError),
        (400, InvalidArgumentError),
        (500, ServerError),
    ],
)
def test_status_maps_to_typed_error(status, error):
    def handler(request):
        return httpx.Response(status, json=error_body(status, "the message", type_="X"))

    with pytest.raises(error, match="the message"):
        _backend(handler).step("s", [1])


def test_step_batch_raises_first_error_with_all_outcomes():
    def handler(request):
        missing = error_body(404, "unknown session 'b'", type_="UnknownSessionError")
        return httpx.Response(200, json={"results": [_ok_result("a"), missing]})

    from compaction_gym.engine.types import StepRequest

    with pytest.raises(UnknownSessionError) as info:
        _backend(handler).step_batch([StepRequest("a", [1]), StepRequest("b", [1])])
    outcomes = info.value.results
    assert outcomes[0].session_id == "a" and isinstance(outcomes[1], UnknownSessionError)


def test_tokenizer_of_a_registered_model_name_loads_its_local_copy():
    """A server started with ``--model babyai-tiny`` reports that name; the client's tokenizer is
    the bundled one (the same vocabulary and encoding), not a failed hub lookup."""
    from transformers import AutoTokenizer

    from compaction_gym import models

    def handler(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/health"
        return httpx.Response(200, json={"model": "babyai-tiny", "max_slots": 1, "eos_token_ids": [0]})

    reference = AutoTokenizer.from_pretrained(models.path("babyai-tiny"))
    tok = _backend(handler).tokenizer
    text = "Current Observation:\na wall 1 step forward"
    assert len(tok) == len(reference) and tok.encode(text) == reference.encode(text)
