"""The session routes' fast path answers exactly as FastAPI's own path does, valid or not.

Two real servers on engines loaded from the same files, one with ``fast_routes`` (the default)
and one with FastAPI serving every request (the reference), get the same requests in the same
order; status, content type and body (up to timings) must be the same for every one of them, and
so must the per-route request counts of ``/metrics``. Sessions are seeded and sampled at
temperature 1-2 with KV-budget compaction and β on, so equal bodies mean equal engine work.
"""

from __future__ import annotations

import contextlib
import json
import math

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter
from server_helpers import load_engine, running_server

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import StepResult
from compaction_gym.servers.app import FAST_PATHS, create_app
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.schemas import GenerateResponse, response_json, to_response

VOCAB_PROBE = 10**6  # beyond any vocabulary: the route's own 422
EPHEMERAL = ("/compact_generate", "/inject_generate")  # their session ids are the server's choice


@pytest.fixture(scope="module")
def pair(tiny_model_path):
    """(fast, reference) clients; each server holds session ``s`` (KV budget, β, temperature 1.5)."""
    with contextlib.ExitStack() as stack:
        clients = []
        for fast in (True, False):
            engine = load_engine(tiny_model_path, max_slots=6)
            args = ServerArgs(
                model=str(tiny_model_path),
                fast_routes=fast,
                max_request_bytes=4096,
                max_new_tokens_limit=64,
                session_ttl_s=None,
            )
            url = stack.enter_context(running_server(create_app(engine, args)))
            clients.append(stack.enter_context(httpx.Client(base_url=url, timeout=120)))
        create = {
            "prompt_ids": list(range(3, 23)),
            "session_id": "s",
            "max_kv_len": 32,
            "compact_window": 8,
            "compute_beta": True,
            "temperature": 1.5,
            "seed": 7,
            "max_new_tokens": 12,
        }
        for c in clients:
            assert c.post("/compact_session/create", json=create).status_code == 200
        yield clients


def _strip(body, drop: tuple[str, ...]):
    """A response body without what differs between two runs of the same work (timings; the ids
    the server picks for ephemeral sessions)."""
    if isinstance(body, dict):
        return {k: _strip(v, drop) for k, v in body.items() if k not in drop}
    if isinstance(body, list):
        return [_strip(v, drop) for v in body]
    return body


def _answer(response: httpx.Response, path: str) -> tuple:
    drop = ("timings", "server") + (("session_id",) if path in EPHEMERAL else ())
    try:
        body = _strip(response.json(), drop)
    except ValueError:
        body = response.text
    return response.status_code, response.headers.get("content-type"), body


def _same(pair, method: str, path: str, **kwargs) -> tuple:
    """Send one request to both servers; their answers must be equal. Returns the answer.
    (A callable argument is called once per server: a streamed body is read once.)"""
    fast, reference = (
        _answer(c.request(method, path, **{k: v() if callable(v) else v for k, v in kwargs.items()}), path)
        for c in pair
    )
    assert fast == reference, (path, kwargs)
    return fast


STEP = {"session_id": "s", "new_token_ids": [5, 6, 7], "max_new_tokens": 6}
CASES = [
    ("valid step", "/compact_session/step", {"json": STEP}),
    ("temperature 2", "/compact_session/step", {"json": {**STEP, "temperature": 2.0, "top_k": 9}}),
    ("teacher-forced", "/compact_session/step",
     {"json": {"session_id": "s", "new_token_ids": [8, 9], "max_new_tokens": 0, "response_complete": True,
               "score_input": True}}),
    ("unknown session", "/compact_session/step", {"json": {**STEP, "session_id": "nope"}}),
    ("id outside the vocabulary", "/compact_session/step", {"json": {**STEP, "new_token_ids": [VOCAB_PROBE]}}),
    ("over the server's token limit", "/compact_session/step", {"json": {**STEP, "max_new_tokens": 65}}),
    ("unknown field", "/compact_session/step", {"json": {**STEP, "bogus": 1}}),
    ("string ids", "/compact_session/step", {"json": {**STEP, "new_token_ids": ["5"]}}),
    ("missing field", "/compact_session/step", {"json": {"session_id": "s"}}),
    ("negative temperature", "/compact_session/step", {"json": {**STEP, "temperature": -1.0}}),
    ("malformed JSON", "/compact_session/step",
     {"content": b'{"session_id": "s",', "headers": {"content-type": "application/json"}}),
    ("empty body", "/compact_session/step", {"content": b"", "headers": {"content-type": "application/json"}}),
    ("a JSON list", "/compact_session/step", {"json": [1, 2]}),
    ("no content type", "/compact_session/step", {"content": json.dumps(STEP).encode()}),
    ("text/plain", "/compact_session/step",
     {"content": json.dumps(STEP).encode(), "headers": {"content-type": "text/plain"}}),
    ("charset", "/compact_session/step",
     {"content": json.dumps(STEP).encode(), "headers": {"content-type": "application/json; charset=utf-8"}}),
    ("vendor +json", "/compact_session/step",
     {"content": json.dumps(STEP).encode(), "headers": {"content-type": "application/vnd.x+json"}}),
    ("too large, content-length", "/compact_session/step", {"json": {**STEP, "new_token_ids": [5] * 3000}}),
    ("too large, chunked", "/compact_session/step",
     {"content": lambda: iter([json.dumps({**STEP, "new_token_ids": [5] * 3000}).encode()]),
      "headers": {"content-type": "application/json"}}),
    ("create", "/compact_session/create",
     {"json": {"prompt_ids": [1, 2, 3, 4], "session_id": "c", "temperature": 1.0, "seed": 3, "max_new_tokens": 5}}),
    ("create, duplicate id", "/compact_session/create", {"json": {"prompt_ids": [1], "session_id": "c"}}),
    ("create, bad config", "/compact_session/create",
     {"json": {"prompt_ids": [1, 2], "max_kv_len": 8, "compact_window": 16, "mode": "attention_matching"}}),
    ("create, unknown mode", "/compact_session/create", {"json": {"prompt_ids": [1, 2], "mode": "nope"}}),
    ("batch", "/compact_session/step_batch",
     {"json": {"requests": [{**STEP, "temperature": 1.0}, {**STEP, "session_id": "c"},
                            {"session_id": "gone", "new_token_ids": [1]}]}}),
    ("batch, one invalid item", "/compact_session/step_batch",
     {"json": {"requests": [STEP, {"session_id": "s", "new_token_ids": "x"}]}}),
    ("batch, empty", "/compact_session/step_batch", {"json": {"requests": []}}),
    ("compact_generate", "/compact_generate",
     {"json": {"prompt_ids": [3, 4, 5], "max_kv_len": 12, "compact_window": 4, "max_new_tokens": 16,
               "temperature": 1.2, "seed": 1, "compute_beta": True, "ignore_eos": True}}),
    ("inject_generate", "/inject_generate",
     {"json": {"prompt_ids": [3, 4, 5], "max_total_tokens": 10, "inject_budget_every": 4, "seed": 2,
               "temperature": 1.0}}),
    ("inject_generate, missing field", "/inject_generate", {"json": {"prompt_ids": [3, 4, 5]}}),
]  # fmt: skip


def test_every_case_answers_as_fastapi_does(pair):
    statuses = {}
    for name, path, kwargs in CASES:
        statuses[name] = _same(pair, "POST", path, **kwargs)[0]
    _same(pair, "DELETE", "/compact_session/c")
    # the cases reach the answers they are named for (so the comparison covers each kind)
    assert statuses["valid step"] == statuses["create"] == statuses["batch"] == 200
    assert statuses["unknown session"] == 404 and statuses["malformed JSON"] == 400
    assert statuses["too large, content-length"] == statuses["too large, chunked"] == 413, {
        k: statuses[k] for k in statuses if "large" in k
    }
    assert statuses["id outside the vocabulary"] == statuses["unknown field"] == 422
    assert statuses["create, duplicate id"] == statuses["create, unknown mode"] == 422


def test_fast_routes_validate_with_fastapis_body_models(reference_engine):
    """Each fast route is the FastAPI route of its path, with the body model FastAPI validates with
    (read from the route, not written again); ``--no-fast-routes`` leaves none."""
    for fast in (True, False):
        app = create_app(reference_engine, ServerArgs(fast_routes=fast))
        (middleware,) = app.user_middleware
        routes = middleware.kwargs["fast"]
        assert sorted(path for _, path in routes) == (sorted(FAST_PATHS) if fast else [])
        for (method, path), route in routes.items():
            assert method == "POST" and route.route.path == path and route.endpoint is route.route.endpoint
            model = route.route.body_field.field_info.annotation
            assert route.adapter.core_schema == TypeAdapter(model).core_schema


token_ids = st.lists(st.integers(0, 60) | st.sampled_from([-1, VOCAB_PROBE]), max_size=6)
step_bodies = st.fixed_dictionaries(
    {"session_id": st.sampled_from(["s", "missing"]), "new_token_ids": token_ids},
    optional={
        "temperature": st.sampled_from([0.0, 1.0, 1.5, 2.0, -0.5]),
        "top_k": st.integers(-1, 20),
        "top_p": st.sampled_from([0.5, 1.0, 1.5]),
        "max_new_tokens": st.integers(0, 8) | st.just(100),
        "seed": st.integers(0, 3),
        "ignore_eos": st.booleans(),
        "stop_token_ids": st.lists(st.integers(0, 60), max_size=2),
        "response_complete": st.booleans(),
        "score_input": st.booleans(),
        "unexpected": st.integers(),
        "session": st.just("s"),
    },
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bodies=st.lists(step_bodies, min_size=1, max_size=3))
def test_random_steps_and_batches_answer_as_fastapi_does(pair, bodies):
    """Random step bodies, valid and not, alone and as one batch: the same answers, and the same
    session afterwards (the steps that ran did the same work)."""
    for body in bodies:
        _same(pair, "POST", "/compact_session/step", json=body)
    _same(pair, "POST", "/compact_session/step_batch", json={"requests": bodies})
    _same(
        pair,
        "POST",
        "/compact_session/step",
        json={"session_id": "s", "new_token_ids": [4], "max_new_tokens": 3},
    )


def test_request_metrics_count_the_same_routes(pair):
    """Both servers counted the same requests per route and status (the fast path labels its
    requests with the route, as FastAPI's router does), over every request of this module so far."""

    _same(pair, "POST", "/compact_session/step", json=STEP)
    _same(pair, "POST", "/compact_session/step", json={**STEP, "bogus": 1})

    def counts(client: httpx.Client) -> list[str]:
        return sorted(
            line
            for line in client.get("/metrics").text.splitlines()
            if line.startswith("compaction_gym_requests_total")
        )

    fast, reference = (counts(c) for c in pair)
    assert fast == reference and any('route="/compact_session/step"' in line for line in fast)


floats = st.floats(allow_nan=True, allow_infinity=True) | st.integers(-3, 3)
results = st.builds(
    StepResult,
    session_id=st.text(max_size=4),
    token_ids=st.lists(st.integers(0, 2**31), max_size=5),
    logprobs=st.lists(floats, max_size=5),
    completion_mask=st.lists(st.integers(0, 1) | st.booleans(), max_size=5),
    text=st.text(max_size=5),
    finish_reason=st.sampled_from(["length", "stop", "budget"]),
    kv_len=st.integers(0, 10**6),
    total_tokens=st.integers(0, 10**6),
    prompt_len=st.integers(0, 10**6),
    inject_ranges=st.lists(st.tuples(st.integers(0, 9), st.integers(0, 9)), max_size=2),
    timings=st.dictionaries(st.sampled_from(["prefill", "decode", "total"]), floats),
    input_logprobs=st.none() | st.lists(st.none() | floats, max_size=4),
    input_entropies=st.none() | st.lists(st.none() | floats, max_size=4),
)


@settings(max_examples=200, deadline=None)
@given(result=results, server=st.dictionaries(st.sampled_from(["queue_s", "batch_size"]), floats))
def test_response_bytes_equal_the_response_models(result, server):
    """What the routes send equals FastAPI's response-model serialisation of the same dict:
    validated against GenerateResponse, then dumped (ints in float fields, NaN and infinities as
    null, bools in int fields)."""
    body = to_response(result, "final", server)
    adapter = TypeAdapter(GenerateResponse)
    assert response_json(body) == adapter.dump_json(adapter.validate_python(body))


def test_response_bytes_with_compaction_events(reference_engine):
    """The same, for a real result carrying several compaction events (their dicts go out as is)."""
    config = CompactionConfig(mode="attention_matching", max_kv_len=16, compact_window=4, compute_beta=True)
    sampling = SamplingParams(temperature=1.5, seed=4, max_new_tokens=24, ignore_eos=True)
    result = reference_engine.create_session([3, 4, 5, 6], config, sampling)
    reference_engine.close(result.session_id)
    assert len(result.events) >= 3
    body = to_response(result, "final", {"queue_s": 0.5, "batch_size": 2.0})
    adapter = TypeAdapter(GenerateResponse)
    assert response_json(body) == adapter.dump_json(adapter.validate_python(body))
    assert not math.isnan(json.loads(response_json(body))["all_logprobs"][0])
