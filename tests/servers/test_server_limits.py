"""Slot exhaustion (429 + Retry-After, recovery) and idle-session expiry (TTL), on a 2-slot server."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from server_helpers import load_engine, running_server, wait_until

from compaction_gym.engine.config import SamplingParams
from compaction_gym.errors import CapacityError, UnknownSessionError
from compaction_gym.servers.app import create_app
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.http_backend import HTTPBackend

TTL_S = 1.5
QUICK = SamplingParams(temperature=0.0, max_new_tokens=1)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return load_engine(tiny_model_path, max_slots=2)


@pytest.fixture(scope="module")
def url(engine):
    app = create_app(engine, ServerArgs(session_ttl_s=None, retry_after_s=2))
    with running_server(app) as base:
        yield base


def test_slot_exhaustion_gives_429_and_recovers_after_delete(url, tiny_tokenizer):
    strict = HTTPBackend(url, tokenizer=tiny_tokenizer, max_retries=0)
    a = strict.create_session([1, 2], None, QUICK)
    b = strict.create_session([3, 4], None, QUICK)
    resp = httpx.post(f"{url}/compact_session/create", json={"prompt_ids": [5]})
    assert resp.status_code == 429 and resp.headers["retry-after"] == "2"
    assert "slots" in resp.json()["detail"]
    with pytest.raises(CapacityError):
        strict.create_session([5, 6], None, QUICK)
    assert httpx.get(f"{url}/health").json()["free_slots"] == 0
    strict.close(a.session_id)
    c = strict.create_session([5, 6], None, QUICK)
    strict.close(b.session_id)
    strict.close(c.session_id)
    assert httpx.get(f"{url}/health").json()["free_slots"] == 2


def test_retrying_client_gets_a_slot_once_one_frees(url, tiny_tokenizer):
    patient = HTTPBackend(url, tokenizer=tiny_tokenizer, max_retries=8, backoff_s=0.05, max_backoff_s=0.2)
    held = [patient.create_session([1], None, QUICK).session_id for _ in range(2)]
    timer = threading.Timer(0.5, patient.close, args=(held[0],))
    timer.start()
    t0 = time.monotonic()
    late = patient.create_session([9, 9], None, QUICK)  # 429s (Retry-After 2 s), then succeeds
    assert time.monotonic() - t0 >= 0.5
    timer.join()
    patient.close(late.session_id)
    patient.close(held[1])


def test_idle_sessions_expire_and_free_their_slots(tiny_model_path):
    ttl_engine = load_engine(tiny_model_path, max_slots=2)  # its own engine: one worker per engine
    with running_server(create_app(ttl_engine, ServerArgs(session_ttl_s=TTL_S))) as base:
        client = HTTPBackend(base, max_retries=0)
        sid = client.create_session([1, 2, 3], None, QUICK).session_id
        other = client.create_session([4, 5], None, QUICK).session_id
        for _ in range(3):  # a used session stays alive past the TTL
            time.sleep(TTL_S / 2)
            client.step(other, [6])
        assert wait_until(lambda: httpx.get(f"{base}/health").json()["sessions"] == 1, timeout=10 * TTL_S)
        with pytest.raises(UnknownSessionError, match="expired"):
            client.step(sid, [7])
        client.step(other, [8])
        client.create_session([9], None, QUICK)  # the freed slot is usable
        text = client.metrics()
        assert 'compaction_gym_sessions_closed_total{reason="ttl"} 1' in text


def test_an_internal_error_is_a_json_500_that_keeps_the_connection():
    """An untyped exception inside a route is answered as JSON 500 by our outermost middleware and
    not re-raised: Starlette's error middleware would answer and re-raise, and the ASGI server then
    drops the client's keep-alive connection (the next pooled request dies with a reset)."""
    import asyncio
    from types import SimpleNamespace

    from compaction_gym.servers.app import _ServerMiddleware
    from compaction_gym.servers.args import ServerArgs
    from compaction_gym.servers.metrics import Metrics

    async def crashing_route(scope, receive, send):
        raise RuntimeError("boom")

    app = _ServerMiddleware(crashing_route, SimpleNamespace(args=ServerArgs(), metrics=Metrics()))
    sent: list[dict] = []

    async def receive():
        return {"type": "http.request", "body": b"{}", "more_body": False}

    async def send(message):
        sent.append(message)

    scope = {"type": "http", "method": "POST", "path": "/compact_session/create", "headers": []}
    asyncio.run(app(scope, receive, send))  # must not raise: the connection stays usable
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"RuntimeError: boom" in body
