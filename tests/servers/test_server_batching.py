"""Creates batched with steps: the worker's one ``Engine.submit`` per admission, and the HTTP path to it."""

from __future__ import annotations

import asyncio
import threading

import pytest
from server_helpers import assert_same_result, load_engine, running_server

from compaction_gym.backends import LocalBackend
from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.engine.types import CreateRequest, StepRequest
from compaction_gym.errors import CapacityError, InvalidArgumentError
from compaction_gym.servers.app import create_app
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.http_backend import HTTPBackend
from compaction_gym.servers.worker import EngineWorker

KV = CompactionConfig(mode="attention_matching", max_kv_len=24, compact_window=8)
TURNS = CompactionConfig(mode="markovian", n_protect_turns=0)
SAMPLED = SamplingParams(temperature=0.9, top_k=30, seed=5, max_new_tokens=12, ignore_eos=True)
FEED = SamplingParams(temperature=0.0, max_new_tokens=0, seed=0)


def _spy(engine) -> list[list[str]]:
    """Record the request kinds of every ``engine.submit`` call (the worker's admissions)."""
    calls: list[list[str]] = []
    real = engine.submit

    def submit(requests):
        calls.append([type(r).__name__ for r in requests])
        return real(requests)

    engine.submit = submit
    return calls


def _one_batch(worker: EngineWorker, submissions) -> list:
    """Queue every submission while the worker is held, so they are collected as one batch."""

    async def main():
        gate = threading.Event()
        held = asyncio.ensure_future(worker.call(gate.wait, 30))
        await asyncio.sleep(0.05)
        tasks = [asyncio.ensure_future(make()) for make in submissions]
        await asyncio.sleep(0.1)  # every job is queued behind the held worker
        gate.set()
        await held
        return await asyncio.gather(*tasks, return_exceptions=True)

    return asyncio.run(main())


@pytest.fixture
def worker_and_reference(tiny_model_path):
    engine, reference = load_engine(tiny_model_path, max_slots=3), load_engine(tiny_model_path, max_slots=3)
    for eng in (engine, reference):
        eng.create_session([11, 12, 13], KV, SAMPLED, session_id="a")
        eng.create_session([14, 15], TURNS, SAMPLED.replace(seed=6), session_id="b")
    worker = EngineWorker(engine, batch_window_s=0.0, max_batch_size=8)
    worker.start()
    yield worker, engine, reference
    worker.stop()


def test_creates_and_steps_admitted_together_run_as_one_engine_batch(worker_and_reference):
    worker, engine, reference = worker_and_reference
    engine.close("b")
    reference.close("b")
    calls = _spy(engine)
    c_sampling = SAMPLED.replace(seed=9, max_new_tokens=20)
    out = _one_batch(
        worker,
        [
            lambda: worker.create([21, 22, 23, 24], KV, c_sampling, session_id="c"),
            lambda: worker.step("a", [25, 26], {"temperature": 0.5, "seed": 3}),
            lambda: worker.create([27], TURNS, SAMPLED.replace(seed=8), session_id="d"),
        ],
    )
    assert calls == [["CreateRequest", "StepRequest", "CreateRequest"]]
    want = [
        reference.create_session([21, 22, 23, 24], KV, c_sampling, session_id="c"),
        reference.step("a", [25, 26], SAMPLED.replace(temperature=0.5, seed=3)),
        reference.create_session([27], TURNS, SAMPLED.replace(seed=8), session_id="d"),
    ]
    for (result, _, info), ref in zip(out, want, strict=True):
        assert_same_result(result, ref)
        assert info["batch_size"] == 3.0
    assert {e.trigger for r, _, _ in out for e in r.events} == {"kv_budget", "turn"}
    assert worker.metrics.sessions_created.value() == 2


def test_a_rejected_request_fails_alone_and_the_rest_still_batch(worker_and_reference):
    worker, engine, reference = worker_and_reference  # 1 free slot
    calls = _spy(engine)
    out = _one_batch(
        worker,
        [
            lambda: worker.create([31, 32], None, SAMPLED, session_id="x"),
            lambda: worker.step("a", [33], None),
            lambda: worker.create([34], None, SAMPLED, session_id="y"),  # no slot left for it
            lambda: worker.step("b", [35] * 600, None),  # longer than a slot
            lambda: worker.step("b", [36], {"max_new_tokens": 2}, response_complete=True),
        ],
    )
    # round 1: each retry drops the request the engine named; round 2: b's second step
    assert [len(c) for c in calls] == [4, 3, 2, 1]
    assert isinstance(out[2], CapacityError) and "slot" in str(out[2])
    assert isinstance(out[3], CapacityError) and "do not fit" in str(out[3])
    assert isinstance(out[4], InvalidArgumentError) and "max_new_tokens=0" in str(out[4])
    assert_same_result(out[0][0], reference.create_session([31, 32], None, SAMPLED, session_id="x"))
    assert_same_result(out[1][0], reference.step("a", [33]))
    assert sorted(engine.session_ids) == ["a", "b", "x"]
    assert engine.session("b").token_ids == reference.session("b").token_ids  # untouched


def test_http_step_batch_carries_creates_and_forced_turns(tiny_model_path, tiny_tokenizer):
    engine = load_engine(tiny_model_path, max_slots=4)
    calls = _spy(engine)
    local = LocalBackend(load_engine(tiny_model_path, max_slots=4))
    with running_server(create_app(engine, ServerArgs(session_ttl_s=None))) as url:
        remote = HTTPBackend(url, tokenizer=tiny_tokenizer, max_retries=0)
        for b in (remote, local):
            b.create_session([1, 2, 3], TURNS, FEED, session_id="h-a")
        requests = [
            CreateRequest([4, 5, 6], KV, SAMPLED, "h-b"),
            StepRequest("h-a", [7, 8, 9, 10], FEED, response_complete=True),
            CreateRequest([11], None, FEED),
        ]
        got, want = remote.step_batch(requests), local.step_batch(requests)
        assert calls[-1] == ["CreateRequest", "StepRequest", "CreateRequest"]
        for g, w in zip(got[:2], want[:2], strict=True):
            assert_same_result(g, w)
        assert_same_result(got[2], want[2], session_id=False)  # server-chosen id
        ((event,),) = [got[1].events]
        assert (event.trigger, event.span) == ("turn", (3, 7))  # the forced turn was compacted
        with pytest.raises(InvalidArgumentError, match="already in use") as info:
            remote.step_batch([CreateRequest([1], None, FEED, "h-b"), StepRequest("h-b", [2], FEED)])
        assert isinstance(info.value.results[0], InvalidArgumentError)
        assert_same_result(info.value.results[1], local.step("h-b", [2], FEED))
