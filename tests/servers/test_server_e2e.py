"""The session API end to end: a real uvicorn on 127.0.0.1, driven through HTTPBackend and raw HTTP.

The reference for every result is an independent in-process engine loaded from the same files
(``LocalBackend``), run with the same seeds.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import assert_same_result, load_engine, running_server, wait_until

from compaction_gym.backends import LocalBackend
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest
from compaction_gym.errors import InvalidArgumentError, UnknownSessionError
from compaction_gym.servers.app import create_app
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.http_backend import HTTPBackend

KV_BUDGET = CompactionConfig(mode="attention_matching", max_kv_len=40, compact_window=16)
TURNS = CompactionConfig(mode="markovian", n_protect_turns=0)
BUDGET_MSG = CompactionConfig(
    mode="attention_matching",
    max_kv_len=40,
    compact_window=16,
    max_total_tokens=64,
    inject_budget_message=True,
)
INJECT_ONLY = CompactionConfig(max_total_tokens=48, inject_budget_every=7)
CONFIGS = {
    "none": None,
    "kv_budget": KV_BUDGET,
    "turns": TURNS,
    "budget_message": BUDGET_MSG,
    "inject_every": INJECT_ONLY,
}


@pytest.fixture(scope="module")
def server(tiny_model_path):
    engine = load_engine(tiny_model_path, max_slots=40)
    args = ServerArgs(model=str(tiny_model_path), max_request_bytes=256 * 1024, session_ttl_s=None)
    app = create_app(engine, args)
    with running_server(app) as url:
        yield url, app


@pytest.fixture(scope="module")
def url(server):
    return server[0]


@pytest.fixture(scope="module")
def backend(url, tiny_tokenizer):
    with HTTPBackend(url, tokenizer=tiny_tokenizer, max_retries=2) as b:
        yield b


@pytest.fixture(scope="module")
def local(reference_engine):
    return LocalBackend(reference_engine)


def _sessions(url: str) -> int:
    return httpx.get(f"{url}/health").json()["sessions"]


def test_health_reports_the_engine(url, tiny_model_path, reference_engine):
    health = httpx.get(f"{url}/health").json()
    assert health["status"] == "ok" and health["model"] == str(tiny_model_path)
    assert health["max_slots"] == 40 and health["capacity"] == reference_engine.capacity
    assert health["eos_token_ids"] == list(reference_engine.eos_token_ids)


def _session_script(b, sid: str, config) -> list:
    first = SamplingParams(temperature=0.9, top_k=50, seed=7, max_new_tokens=12, ignore_eos=True)
    out = [b.create_session([11, 12, 13, 14, 15], config, first, session_id=sid)]
    out.append(b.step(sid, [21, 22, 23]))
    out.append(b.step(sid, [24], SamplingParams(temperature=0.0, max_new_tokens=6)))
    out.append(b.step(sid, [25, 26], SamplingParams(temperature=0.7, top_p=0.8, seed=3, max_new_tokens=5)))
    b.close(sid)
    return out


def test_http_backend_is_a_backend_with_the_servers_tokenizer(url, tiny_model_path, tiny_tokenizer):
    from compaction_gym.backends import Backend

    lazy = HTTPBackend(url)  # no tokenizer given: loaded from the model path the server reports
    assert isinstance(lazy, Backend)
    assert lazy.name == str(tiny_model_path) and lazy.max_slots == 40
    assert lazy.tokenizer.encode("go to the red ball") == tiny_tokenizer.encode("go to the red ball")
    assert lazy.eos_token_ids == [tiny_tokenizer.convert_tokens_to_ids("<|im_end|>")]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_session_create_step_close_equal_local(name, backend, local):
    config = CONFIGS[name]
    remote = _session_script(backend, f"equal-{name}", config)
    for got, want in zip(remote, _session_script(local, f"equal-{name}", config)):
        assert_same_result(got, want)
    if config is not None and config.enabled:
        assert any(r.events for r in remote), "this config should have compacted"
    if name in ("budget_message", "inject_every"):
        assert any(r.inject_ranges for r in remote)
    with pytest.raises(UnknownSessionError):
        backend.step(f"equal-{name}", [1])


def test_agent_episode_through_http_equals_local(backend, local):
    """Agents switch backends by argument only: the same BabyAI episode, token for token."""
    import gymnasium as gym

    import compaction_gym  # noqa: F401  (registers the env ids)
    from compaction_gym.agents import CompactionAgent, run_episode

    config = CompactionConfig(mode="attention_matching", max_kv_len=448, compact_window=96, compute_beta=True)
    trajectories = []
    for b in (backend, local):
        agent = CompactionAgent(
            b, compaction=config, sampling=SamplingParams(temperature=0.8, seed=3, max_new_tokens=6)
        )
        env = gym.make("AttnMatch-BabyAI-GoTo-v0", max_episode_steps=3)
        trajectories.append(run_episode(env, agent, seed=0))
    remote, want = trajectories
    assert remote.token_ids == want.token_ids and remote.completion_mask == want.completion_mask
    assert remote.logprobs == pytest.approx(want.logprobs, abs=1e-5)
    assert remote.events and [e.to_dict() | {"timings": {}} for e in remote.events] == [
        e.to_dict() | {"timings": {}} for e in want.events
    ]


def test_compact_generate_equal_engine(backend, reference_engine):
    sampling = SamplingParams(temperature=0.8, seed=5, max_new_tokens=40, ignore_eos=True)
    remote = backend.compact_generate([3, 4, 5, 6], KV_BUDGET, sampling)
    want = reference_engine.compact_generate([3, 4, 5, 6], KV_BUDGET, sampling)
    assert_same_result(remote, want, session_id=False)
    assert len(remote.events) >= 1


def test_inject_generate_equal_engine(backend, local, url):
    """``POST /inject_generate`` through HTTPBackend equals the in-process LocalBackend."""
    sampling = SamplingParams(temperature=0.8, seed=5, max_new_tokens=30, ignore_eos=True)
    remote = backend.inject_generate([3, 4, 5, 6], INJECT_ONLY, sampling)
    want = local.inject_generate([3, 4, 5, 6], INJECT_ONLY, sampling)
    assert_same_result(remote, want, session_id=False)
    assert len(remote.inject_ranges) == 4 and sum(remote.completion_mask) == 30
    for a, b in remote.inject_ranges:
        assert set(remote.completion_mask[a:b]) == {0} and set(remote.logprobs[a:b]) == {0.0}
    # raw body, the seeds' fields; max_new_tokens defaults to max_total_tokens
    body = {
        "prompt_ids": [3, 4, 5, 6],
        "max_total_tokens": 20,
        "inject_budget_every": 8,
        "temperature": 0.6,
        "seed": 1,
    }
    before = _sessions(url)
    data = httpx.post(f"{url}/inject_generate", json=body, timeout=120).json()
    assert data["finish_reason"] == "stop" or sum(data["completion_mask"]) == 20
    assert all(data["completion_mask"][a] == 0 for a, _ in data["diagnostics"]["inject_ranges"])
    assert _sessions(url) == before  # no session is kept
    with pytest.raises(InvalidArgumentError, match="mode='none'"):
        backend.inject_generate([3, 4], KV_BUDGET)


def test_compact_generate_seed_fields_raw(url):
    body = {
        "prompt_ids": [3, 4, 5, 6],
        "max_kv_len": 40,
        "compact_window": 16,
        "compact_target_ratio": 0.25,
        "n_compacts": 99,
        "compute_beta": True,
        "max_total_tokens": 48,
        "temperature": 0.6,
        "top_p": 0.95,
        "seed": 1,
    }
    data = httpx.post(f"{url}/compact_generate", json=body, timeout=120).json()
    diag = data["diagnostics"]
    assert len(data["all_token_ids"]) == len(data["all_logprobs"]) > 0
    assert isinstance(data["final_text"], str)
    assert {
        "prompt_len",
        "total_tokens",
        "compaction_events",
        "segment_boundaries",
        "inject_ranges",
        "timings",
    } <= set(diag)
    assert diag["compaction_events"] and diag["compaction_events"][0]["compute_beta"] is True
    assert len(diag["segment_boundaries"]) == len(diag["compaction_events"])


def test_step_batch_endpoint_equal_sequential(backend, local):
    ids = ["sb-a", "sb-b", "sb-c"]
    samplings = [
        SamplingParams(temperature=0.0, max_new_tokens=5),
        SamplingParams(temperature=1.0, seed=9, max_new_tokens=7, ignore_eos=True),
        SamplingParams(temperature=0.5, top_p=0.5, seed=2, max_new_tokens=3),
    ]
    for sid, sp in zip(ids, samplings):
        backend.create_session([7, 8, 9], KV_BUDGET, sp, session_id=sid)
        local.create_session([7, 8, 9], KV_BUDGET, sp, session_id=sid)
    remote = backend.step_batch([StepRequest(sid, [10, 11]) for sid in ids])
    want = [local.step(sid, [10, 11]) for sid in ids]
    for r, w in zip(remote, want):
        assert_same_result(r, w)
    for sid in ids:
        backend.close(sid)
        local.close(sid)


def test_score_input_through_http_equals_local(backend, local):
    """``score_input`` on create, step and step_batch items: the same input log-probs as in process."""
    forced = SamplingParams(max_new_tokens=0)
    results = []
    for b in (backend, local):
        out = [
            b.create_session(list(range(5, 30)), KV_BUDGET, forced, session_id="score-a", score_input=True)
        ]
        out.append(
            b.step("score-a", list(range(40, 70)), SamplingParams(seed=1, max_new_tokens=4), score_input=True)
        )
        out += b.step_batch(
            [
                StepRequest("score-a", list(range(80, 95)), forced, score_input=True),
                CreateRequest([3, 4, 5], None, forced, session_id="score-b", score_input=True),
            ]
        )
        out.append(b.step("score-a", [9, 10]))
        b.close("score-a")
        b.close("score-b")
        results.append(out)
    for got, want in zip(*results):
        assert_same_result(got, want)
    assert results[0][0].input_logprobs[0] is None and results[0][0].input_logprobs[1] < 0
    assert len(results[0][2].input_logprobs) == 15 and results[0][4].input_logprobs is None


@pytest.mark.parametrize(
    ("queries", "refit_values"), [("repeat", False), ("suffix+repeat", True), ("keys", True)]
)
def test_probe_sources_through_http_equal_local(backend, local, queries, refit_values):
    """A per-session probe source (β on) over HTTP: the same events (kept rows, β, the ``repeat``
    probes' recorded tokens) and log-probs as in process."""
    config = CompactionConfig(
        mode="attention_matching", max_kv_len=40, compact_window=16, compute_beta=True,
        queries=queries, refit_values=refit_values, n_probe_queries=8,
    )  # fmt: skip
    sampling = SamplingParams(temperature=1.5, seed=3, max_new_tokens=6, ignore_eos=True)
    results = []
    for b in (backend, local):
        out = [b.create_session(list(range(5, 17)), config, sampling, session_id=f"probes-{queries}")]
        out += [
            b.step(f"probes-{queries}", list(range(40 + 9 * t, 49 + 9 * t)), score_input=True)
            for t in range(3)
        ]
        b.close(f"probes-{queries}")
        results.append(out)
    for got, want in zip(*results):
        assert_same_result(got, want)
    events = [e for r in results[0] for e in r.events]
    assert len(events) >= 2 and {e.probe_source for e in events} == {queries}
    assert all((e.probe_tokens is not None) == ("repeat" in queries) for e in events)


def _conversation(b, k: int) -> list:
    """Create session k and step it 5 times; parameters differ per session and per step."""
    config = [None, KV_BUDGET, TURNS][k % 3]
    sampling = SamplingParams(
        temperature=[0.0, 0.8, 1.2][k % 3], top_k=[0, 20][k % 2], seed=100 + k, max_new_tokens=3
    )
    out = [b.create_session([5 + k % 7, 6, 7 + k % 5], config, sampling, session_id=f"conc-{k}")]
    for step in range(5):
        override = (
            None
            if step % 2 == 0
            else SamplingParams(temperature=0.5, seed=k * 10 + step, max_new_tokens=2 + k % 3)
        )
        out.append(b.step(f"conc-{k}", [30 + step, 40 + k % 9], override))
    b.close(f"conc-{k}")
    return out


def _batch_counts(metrics_text: str) -> tuple[int, int]:
    """(observations of batch size 1, all observations) from the batch-size histogram."""
    ones = total = 0
    for line in metrics_text.splitlines():
        if line.startswith('compaction_gym_batch_size_bucket{le="1"}'):
            ones = int(float(line.split()[-1]))
        elif line.startswith("compaction_gym_batch_size_count"):
            total = int(float(line.split()[-1]))
    return ones, total


def test_32_concurrent_sessions_equal_sequential_and_batch(backend, local, url):
    want = [_conversation(local, k) for k in range(32)]
    ones_before, total_before = _batch_counts(backend.metrics())
    with ThreadPoolExecutor(32) as pool:
        got = list(pool.map(lambda k: _conversation(backend, k), range(32)))
    for g, w in zip(got, want):
        for r, ref in zip(g, w):
            assert_same_result(r, ref)
    ones, total = _batch_counts(backend.metrics())
    assert total - total_before > ones - ones_before, "no step_batch ran more than one request"
    assert _sessions(url) == 0


@pytest.mark.parametrize(
    ("path", "body", "status", "field"),
    [
        ("/compact_session/create", {}, 422, "prompt_ids"),
        ("/compact_session/create", {"prompt_ids": "hello"}, 422, "prompt_ids"),
        ("/compact_session/create", {"prompt_ids": [1, 2], "temperature": "hot"}, 422, "temperature"),
        ("/compact_session/create", {"prompt_ids": [1, 2], "max_kv_len": -1}, 422, "max_kv_len"),
        (
            "/compact_session/create",
            {"prompt_ids": [1, 2], "max_response_tokens": -5},
            422,
            "max_response_tokens",
        ),
        ("/compact_session/create", {"prompt_ids": [1, 2], "max_tokens": 5}, 422, "max_tokens"),
        ("/compact_session/create", {"prompt_ids": [1, 10**6]}, 422, "prompt_ids"),
        ("/compact_session/create", {"prompt_ids": [1] * 600}, 422, "prompt_ids"),
        (
            "/compact_session/create",
            {"prompt_ids": [1], "max_kv_len": 32, "compact_window": 40},
            422,
            "compact_window",
        ),
        ("/compact_session/create", {"prompt_ids": [1], "compaction_mode": "zip"}, 422, "mode"),
        ("/compact_session/create", {"prompt_ids": [1], "max_kv_len": 4096}, 422, "max_kv_len"),
        ("/compact_generate", {"prompt_ids": []}, 422, "prompt_ids"),
        ("/inject_generate", {"prompt_ids": [1], "max_total_tokens": 8}, 422, "inject_budget_every"),
        ("/inject_generate", {"prompt_ids": [1], "inject_budget_every": 4}, 422, "max_total_tokens"),
        (
            "/inject_generate",
            {"prompt_ids": [1], "max_total_tokens": 8, "inject_budget_every": 0},
            422,
            "inject_budget_every",
        ),
        (
            "/inject_generate",
            {"prompt_ids": [1], "max_total_tokens": 8, "inject_budget_every": 2, "max_kv_len": 9},
            422,
            "max_kv_len",
        ),
        (
            "/inject_generate",
            {
                "prompt_ids": [1],
                "max_total_tokens": 8,
                "inject_budget_every": 2,
                "budget_message_template": "{x}",
            },
            422,
            "budget_message_template",
        ),
        (
            "/compact_session/create",
            {"prompt_ids": [1], "inject_budget_every": 3},
            422,
            "inject_budget_every",
        ),
        ("/compact_session/step", {"new_token_ids": [1]}, 422, "session_id"),
        ("/compact_session/step", {"session_id": "nope", "new_token_ids": [1]}, 404, "nope"),
        ("/compact_session/step", {"session_id": "nope", "new_token_ids": [1], "top_p": 2}, 422, "top_p"),
        ("/compact_session/step_batch", {"requests": []}, 422, "requests"),
        # an id DELETE /compact_session/{id} could not route would hold its slot for good
        ("/compact_session/create", {"prompt_ids": [1], "session_id": "a/b"}, 422, "session_id"),
    ],
)
def test_bad_inputs_get_4xx_and_the_server_keeps_serving(url, path, body, status, field):
    resp = httpx.post(f"{url}{path}", json=body, timeout=60)
    assert resp.status_code == status, resp.text
    assert field in resp.json()["detail"]
    assert httpx.get(f"{url}/health").status_code == 200


def test_malformed_json_unknown_delete_and_huge_body(url, backend):
    resp = httpx.post(
        f"{url}/compact_session/create",
        content=b'{"prompt_ids": [1, 2',
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 400 and "JSON" in resp.json()["detail"]
    assert httpx.delete(f"{url}/compact_session/never-was").status_code == 404
    huge = httpx.post(f"{url}/compact_generate", json={"prompt_ids": [1] * 200_000}, timeout=60)
    assert huge.status_code == 413
    with pytest.raises(InvalidArgumentError):
        backend.create_session([1, 2], sampling=SamplingParams(max_new_tokens=1), session_id="bad id")
    result = backend.compact_generate([1, 2, 3], None, SamplingParams(temperature=0, max_new_tokens=2))
    assert len(result.token_ids) >= 1  # still serving


def test_an_exception_in_one_request_fails_only_that_request(server, backend, local):
    url, app = server
    engine = app.state.server.engine
    real_submit = engine.submit

    def submit(requests):
        if any(isinstance(r, CreateRequest) and list(r.prompt_ids) == [66, 66] for r in requests):
            raise RuntimeError("boom inside one create")
        if any(getattr(r, "session_id", None) == "poison" for r in requests):  # rejected in validation
            raise InvalidArgumentError("session 'poison' cannot step")  # (no request_index: one by one)
        return real_submit(requests)

    sp = SamplingParams(temperature=0.0, max_new_tokens=3)
    for b in (backend, local):
        b.create_session([1, 2, 3], None, sp, session_id="poison")
        b.create_session([4, 5, 6], None, sp, session_id="healthy")
    engine.submit = submit
    try:
        with pytest.raises(InvalidArgumentError, match="poison") as info:
            backend.step_batch([StepRequest("poison", [7]), StepRequest("healthy", [8])])
        assert_same_result(info.value.results[1], local.step("healthy", [8]))
        crashed = httpx.post(f"{url}/compact_session/create", json={"prompt_ids": [66, 66]}, timeout=60)
        assert crashed.status_code == 500 and "boom" in crashed.json()["detail"]
    finally:
        engine.submit = real_submit
    assert_same_result(backend.step("healthy", [9]), local.step("healthy", [9]))
    for b in (backend, local):
        b.close("poison")
        b.close("healthy")


def test_client_disconnect_frees_the_session(server, monkeypatch):
    url, app = server
    engine = app.state.server.engine
    real_submit = engine.submit

    def slow_submit(requests):  # the create is still running when its client gives up
        if any(isinstance(r, CreateRequest) for r in requests):
            time.sleep(1.0)
        return real_submit(requests)

    monkeypatch.setattr(engine, "submit", slow_submit)
    before = _sessions(url)
    body = {"prompt_ids": [1, 2, 3], "max_response_tokens": 4, "temperature": 0}
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/compact_session/create", json=body, timeout=0.3)

    def freed() -> bool:  # the running create was cancelled at a round boundary
        text = httpx.get(f"{url}/metrics").text
        return 'compaction_gym_sessions_closed_total{reason="cancelled"}' in text and _sessions(url) == before

    assert wait_until(freed, timeout=60)
    assert 'compaction_gym_abandoned_total{stage="running"} 1' in httpx.get(f"{url}/metrics").text


def test_a_request_cancelled_while_queued_never_runs(server, backend, monkeypatch):
    url, app = server
    engine = app.state.server.engine
    sid = backend.create_session([1, 2, 3], None, SamplingParams(temperature=0, max_new_tokens=2)).session_id
    length = engine.session(sid).token_ids
    real_submit = engine.submit

    def slow_submit(requests):  # a create keeps the worker busy while the step waits in the queue
        if any(isinstance(r, CreateRequest) for r in requests):
            time.sleep(1.0)
        return real_submit(requests)

    monkeypatch.setattr(engine, "submit", slow_submit)
    blocker = threading.Thread(
        target=backend.compact_generate, args=([4, 5], None, SamplingParams(max_new_tokens=1))
    )
    blocker.start()
    time.sleep(0.3)  # the create's batch has closed and is running
    with pytest.raises(httpx.TimeoutException):
        httpx.post(f"{url}/compact_session/step", json={"session_id": sid, "new_token_ids": [6]}, timeout=0.3)
    blocker.join(30)
    assert 'compaction_gym_abandoned_total{stage="queued"}' in backend.metrics()
    assert engine.session(sid).token_ids == length  # the cancelled step never ran
    backend.close(sid)


def test_metrics_cover_sessions_batches_tokens_events_latency(url, backend):
    r = backend.create_session(
        [1, 2, 3], KV_BUDGET, SamplingParams(seed=0, max_new_tokens=48, ignore_eos=True)
    )
    backend.step(r.session_id, [4])
    backend.close(r.session_id)
    assert httpx.post(f"{url}/compact_session/create", json={}).status_code == 422
    text = httpx.get(f"{url}/metrics").text
    for name in (
        "compaction_gym_sessions_active",
        "compaction_gym_sessions_created_total",
        "compaction_gym_batch_size_bucket",
        'compaction_gym_tokens_total{kind="generated"}',
        'compaction_gym_compaction_events_total{mode="attention_matching",trigger="kv_budget"}',
        'compaction_gym_request_latency_seconds_bucket{route="/compact_session/step",le="+Inf"}',
        'compaction_gym_requests_total{method="POST",route="/compact_session/create",status="422"}',
    ):
        assert name in text, name


def test_openai_client_chat_completions(url, tiny_tokenizer, reference_engine):
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "You play BabyAI."},
        {"role": "user", "content": "go to the red ball"},
    ]
    out = client.chat.completions.create(
        model=model, messages=messages, max_tokens=8, temperature=0.7, seed=4, logprobs=True
    )
    prompt = tiny_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    prompt = list(prompt["input_ids"] if hasattr(prompt, "keys") else prompt)
    want = reference_engine.compact_generate(
        prompt, CompactionConfig(), SamplingParams(temperature=0.7, seed=4, max_new_tokens=8)
    )
    sampled = [t for t, m in zip(want.token_ids, want.completion_mask) if m]
    assert out.choices[0].message.content == tiny_tokenizer.decode(sampled, skip_special_tokens=True)
    assert out.usage.prompt_tokens == len(prompt) and out.usage.completion_tokens == len(sampled)
    assert [c.logprob for c in out.choices[0].logprobs.content] == pytest.approx(want.logprobs, abs=1e-5)
    assert out.choices[0].finish_reason in ("stop", "length")

    chunks = list(
        client.chat.completions.create(
            model=model, messages=messages, max_tokens=8, temperature=0.7, seed=4, stream=True
        )
    )
    assert (
        "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        == out.choices[0].message.content
    )

    two = client.chat.completions.create(
        model=model, messages=messages, max_tokens=4, n=2, temperature=1.0, seed=1
    )
    assert len(two.choices) == 2
    compacted = client.chat.completions.create(
        model=model,
        messages=messages,
        max_tokens=4,
        extra_body={"compaction": {"compaction_mode": "markovian", "n_protect_turns": 0}},
    )
    assert compacted.usage.completion_tokens >= 1
    with pytest.raises(openai.UnprocessableEntityError):  # typos in the extension are not ignored
        client.chat.completions.create(
            model=model, messages=messages, extra_body={"compaction": {"max_kv": 9}}
        )
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="not-this-one", messages=messages, max_tokens=2)
    with pytest.raises(openai.UnprocessableEntityError):
        client.chat.completions.create(model=model, messages=messages, presence_penalty=1.0)


def test_concurrent_steps_of_one_session_are_serialised(backend, local):
    """Two concurrent steps of the same session never share a batch; both apply, in some order."""
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    created = backend.create_session([1, 2], None, sp, session_id="twice")
    barrier = threading.Barrier(2)

    def go(ids):
        barrier.wait()
        return backend.step("twice", ids)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(go, [[3], [4]]))
    assert all(len(r.token_ids) >= 1 for r in results)
    assert max(r.total_tokens for r in results) == created.total_tokens + 2 + sum(
        len(r.token_ids) for r in results
    )
    backend.close("twice")


def test_an_untyped_failure_opening_one_session_fails_only_that_request(server, backend, monkeypatch):
    """A create whose opening raises an untyped error (here: a simulated allocation failure) fails
    alone with a 500; the innocent create batched with it runs, and every slot is accounted for."""
    from compaction_gym.engine import scheduler as scheduler_module
    from compaction_gym.engine.config import CompactionConfig
    from compaction_gym.engine.types import CreateRequest
    from compaction_gym.servers.errors import ServerError

    url, app = server
    engine = app.state.server.engine
    real_ring = scheduler_module.ProbeRing

    def ring(*args, **kwargs):
        if args[3] == 13:
            raise RuntimeError("allocation failed (simulated)")
        return real_ring(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "ProbeRing", ring)
    free = engine.num_free_slots
    sp = SamplingParams(temperature=0.0, max_new_tokens=2)
    requests = [
        CreateRequest(
            [1, 2, 3], CompactionConfig(mode="attention_matching", max_kv_len=64, n_probe_queries=13), sp
        ),
        CreateRequest(
            [4, 5, 6], CompactionConfig(mode="attention_matching", max_kv_len=64, n_probe_queries=8), sp
        ),
    ]
    with pytest.raises(ServerError, match="allocation failed") as info:
        backend.step_batch(requests)
    bad, good = info.value.results
    assert isinstance(bad, ServerError) and not isinstance(good, Exception)
    assert engine.num_free_slots == free - 1
    backend.close(good.session_id)
    assert engine.num_free_slots == free
