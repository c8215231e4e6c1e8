"""Continuous batching in the worker, admission limits, and a bounded concurrency + fault run.

The reference for every result is an independent in-process engine loaded from the same files,
making the same calls one by one with the same seeds.
"""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from server_helpers import assert_same_result, load_engine, running_server, wait_until

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import CapacityError
from compaction_gym.servers.app import create_app
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.http_backend import HTTPBackend
from compaction_gym.servers.worker import EngineWorker

# β left out: its NNLS active set may flip on 1e-6 batched-vs-single differences (engine numerics)
KV = CompactionConfig(mode="attention_matching", max_kv_len=48, compact_window=16)
LONG = SamplingParams(temperature=0.7, seed=1, max_new_tokens=600, ignore_eos=True)
SHORT = SamplingParams(temperature=0.0, max_new_tokens=2, ignore_eos=True)


async def _long_then_short(worker: EngineWorker, engine) -> tuple[object, object, bool]:
    """Start a long create; once it generates, send a 2-token create. Returns (long, short, long
    finished before short)."""
    long = asyncio.ensure_future(worker.create([3, 4, 5, 6], KV, LONG, session_id="long"))
    deadline = time.monotonic() + 30
    while "long" not in engine.running_session_ids:  # the long request is generating
        assert time.monotonic() < deadline and not long.done()
        await asyncio.sleep(0.005)
    short = await worker.create([7, 8, 9], None, SHORT, session_id="short")
    long_first = long.done()
    return await long, short, long_first


@pytest.mark.parametrize("continuous", [True, False])
def test_a_short_request_joins_a_long_one_instead_of_waiting(tiny_model_path, reference_engine, continuous):
    """Continuous batching: the 2-token create sent while a 600-token create runs is answered
    first; without it (one batch to completion) it waits for the long one. Results equal the
    calls made one by one either way (KV-budget events fire mid-generation, across rounds)."""
    engine = load_engine(tiny_model_path, max_slots=4)
    worker = EngineWorker(engine, batch_window_s=0.0, continuous=continuous, max_steps=4)
    worker.start()
    try:
        (long, _, _), (short, _, _), long_first = asyncio.run(_long_then_short(worker, engine))
    finally:
        worker.stop()
    assert long_first is (not continuous)
    assert_same_result(long, reference_engine.create_session([3, 4, 5, 6], KV, LONG, session_id="long"))
    assert_same_result(short, reference_engine.create_session([7, 8, 9], None, SHORT, session_id="short"))
    assert len(long.events) >= 10
    for sid in ("long", "short"):
        reference_engine.close(sid)


def test_closing_a_generating_session_cancels_its_request(tiny_model_path):
    engine = load_engine(tiny_model_path, max_slots=2)
    worker = EngineWorker(engine, batch_window_s=0.0, max_steps=4)
    worker.start()

    async def main():
        long = asyncio.ensure_future(worker.create([3, 4], KV, LONG, session_id="x"))
        while "x" not in engine.running_session_ids:
            await asyncio.sleep(0.005)
        await worker.close("x")
        return await asyncio.gather(long, return_exceptions=True)

    try:
        (out,) = asyncio.run(asyncio.wait_for(main(), 60))
    finally:
        worker.stop()
    assert "closed (delete) while generating" in str(out)
    assert engine.num_free_slots == 2 and engine.running_session_ids == []


def test_limits_are_refused_at_admission(tiny_model_path):
    """Over-limit requests get a 422 naming the field (nothing runs); a request that cannot join
    the running batch within ``max_queue_s`` gets a 429."""
    engine = load_engine(tiny_model_path, max_slots=3)
    args = ServerArgs(
        session_ttl_s=None, max_new_tokens_limit=2000, max_prompt_tokens=16, max_batch_size=1, max_queue_s=0.3,
        round_steps=4,
    )  # fmt: skip
    with running_server(create_app(engine, args)) as url:
        over = httpx.post(f"{url}/compact_session/create", json={"prompt_ids": [1], "max_new_tokens": 10**9})
        assert over.status_code == 422 and over.json()["error"]["param"] == "max_new_tokens"
        assert "limit of 2000" in over.json()["detail"]
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        chat = httpx.post(
            f"{url}/v1/chat/completions",
            json={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000},
        )
        assert chat.status_code == 422 and "limit of 2000" in chat.json()["detail"]
        long_prompt = httpx.post(f"{url}/compact_session/create", json={"prompt_ids": list(range(1, 18))})
        assert long_prompt.status_code == 422 and long_prompt.json()["error"]["param"] == "prompt_ids"
        client = HTTPBackend(url, max_retries=0)
        sid = client.create_session([1, 2], None, SamplingParams(temperature=0, max_new_tokens=1)).session_id
        step = httpx.post(
            f"{url}/compact_session/step", json={"session_id": sid, "new_token_ids": [3], "max_new_tokens": 2001}
        )
        assert step.status_code == 422 and step.json()["error"]["param"] == "max_new_tokens"
        with ThreadPoolExecutor(1) as pool:  # one place in the batch, held by a long request
            held = pool.submit(client.compact_generate, [5, 6], KV, LONG.replace(max_new_tokens=1200))
            assert wait_until(lambda: engine.running_session_ids != [], timeout=30)
            t0 = time.monotonic()
            with pytest.raises(CapacityError, match="max_queue_s"):
                client.step(sid, [4], SamplingParams(temperature=0, max_new_tokens=1))
            assert time.monotonic() - t0 < 10
            assert len(held.result(timeout=120).token_ids) == 1200
        assert len(engine.session(sid).token_ids) == 3  # the refused steps never ran
        client.close(sid)
        assert httpx.get(f"{url}/health").json()["free_slots"] == 3


def test_concurrent_clients_with_disconnects_poison_and_ttl_account_for_every_slot(
    tiny_model_path, reference_engine, monkeypatch
):
    """16 concurrent clients against a 16-slot server: 8 healthy (create + 2 steps, varied configs
    and seeds), 3 that disconnect mid-create, 2 that disconnect mid-step (their sessions then
    expire by TTL), and a step_batch holding a poisoned create (an untyped allocation failure while
    opening it) and a duplicate id beside healthy items. Afterwards every slot is free, nothing
    hung, and every healthy result equals the same calls made one by one."""
    from compaction_gym.engine import scheduler as scheduler_module

    real_ring = scheduler_module.ProbeRing

    def ring(*args, **kwargs):  # the poison: opening a session with 13 probe queries fails
        if args[3] == 13:
            raise RuntimeError("allocation failed (simulated)")
        return real_ring(*args, **kwargs)

    monkeypatch.setattr(scheduler_module, "ProbeRing", ring)
    slots = 16
    engine = load_engine(tiny_model_path, max_slots=slots)
    args = ServerArgs(session_ttl_s=2.0, round_steps=4, max_new_tokens_limit=5000, batch_window_ms=2)
    configs = [None, KV, CompactionConfig(mode="markovian", n_protect_turns=0), KV]

    def healthy(k: int, url: str) -> list:
        sid = f"healthy-{k}"
        sp = SamplingParams(temperature=0.0 if k % 2 else 0.9, seed=k, max_new_tokens=10 + 7 * k, ignore_eos=True)
        with HTTPBackend(url, max_retries=0, timeout=120) as c:
            out = [c.create_session([5 + k, 6, 7 + k], configs[k % 4], sp, session_id=sid)]
            out.append(c.step(sid, [8, 9 + k]))
            out.append(c.step(sid, [10], SamplingParams(temperature=1.0, seed=100 + k, max_new_tokens=5 + k)))
            c.close(sid)
        return out

    def drop_create(k: int, url: str) -> str:
        body = {"prompt_ids": [4, 5 + k], "max_kv_len": 48, "compact_window": 16, "max_new_tokens": 4000,
                "ignore_eos": True, "temperature": 0}  # fmt: skip
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/compact_session/create", json=body, timeout=0.3)
        return "dropped create"

    def drop_step(k: int, url: str) -> str:
        with HTTPBackend(url, max_retries=0, timeout=60) as c:
            sid = c.create_session([9, k], KV, SamplingParams(temperature=0, max_new_tokens=1)).session_id
        body = {"session_id": sid, "new_token_ids": [3], "max_new_tokens": 3000, "ignore_eos": True}
        with pytest.raises(httpx.TimeoutException):
            httpx.post(f"{url}/compact_session/step", json=body, timeout=0.3)
        return "dropped step"

    def poisoned(url: str) -> list[int]:
        good = {"prompt_ids": [1, 2, 3], "max_new_tokens": 4, "temperature": 0, "session_id": "batch-ok"}
        bad = {"prompt_ids": [1, 2], "max_kv_len": 64, "n_probe_queries": 13, "max_new_tokens": 4}
        dup = {"prompt_ids": [4], "max_new_tokens": 2, "session_id": "batch-ok"}  # typed: id used twice
        resp = httpx.post(f"{url}/compact_session/step_batch", json={"requests": [good, bad, dup]}, timeout=60)
        results = resp.json()["results"]
        httpx.delete(f"{url}/compact_session/batch-ok", timeout=30)
        return [r.get("error", {}).get("code", 200) for r in results]

    with running_server(create_app(engine, args)) as url, ThreadPoolExecutor(16) as pool:
        futures = [pool.submit(healthy, k, url) for k in range(8)]
        futures += [pool.submit(drop_create, k, url) for k in range(3)]
        futures += [pool.submit(drop_step, k, url) for k in range(2)]
        poison = pool.submit(poisoned, url)
        outcomes = [f.result(timeout=300) for f in futures]  # bounded: nothing hangs
        codes = poison.result(timeout=300)
        assert codes == [200, 500, 422]

        def all_free() -> bool:
            health = httpx.get(f"{url}/health").json()
            return health["free_slots"] == slots and health["sessions"] == 0 and health["running_requests"] == 0

        assert wait_until(all_free, timeout=60), httpx.get(f"{url}/health").json()
        assert engine.num_free_slots == slots and engine.running_session_ids == []
        metrics = httpx.get(f"{url}/metrics").text
        assert 'compaction_gym_sessions_closed_total{reason="ttl"} 2' in metrics
        assert 'compaction_gym_abandoned_total{stage="running"}' in metrics
    for k, got in enumerate(outcomes[:8]):
        sid = f"healthy-{k}"
        sp = SamplingParams(temperature=0.0 if k % 2 else 0.9, seed=k, max_new_tokens=10 + 7 * k, ignore_eos=True)
        want = [reference_engine.create_session([5 + k, 6, 7 + k], configs[k % 4], sp, session_id=sid)]
        want.append(reference_engine.step(sid, [8, 9 + k]))
        want.append(
            reference_engine.step(sid, [10], SamplingParams(temperature=1.0, seed=100 + k, max_new_tokens=5 + k))
        )
        reference_engine.close(sid)
        for g, w in zip(got, want, strict=True):
            assert_same_result(g, w)
