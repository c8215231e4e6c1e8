"""Helpers of the server tests: a real uvicorn on 127.0.0.1 (free port), result comparison."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Iterator

from compaction_gym.engine.types import StepResult

ENGINE_KWARGS = {"dtype": "float32", "device": "cpu", "capacity": 512}


def load_engine(path, max_slots: int):
    from compaction_gym.engine import Engine

    return Engine.from_pretrained(str(path), max_slots=max_slots, **ENGINE_KWARGS)


@contextlib.contextmanager
def running_server(app) -> Iterator[str]:
    """Serve ``app`` with uvicorn on 127.0.0.1 (a free port) in a background thread; yield its URL."""
    import uvicorn

    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", timeout_graceful_shutdown=5)
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.02)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(30)


def _event_dict(e) -> dict:
    d = e.to_dict()
    d.pop("timings")
    return d


def assert_same_result(
    got: StepResult, want: StepResult, *, session_id: bool = True, atol: float = 1e-5
) -> None:
    """Equal StepResults up to timings (and float round-off in logprobs)."""
    if session_id:
        assert got.session_id == want.session_id
    assert got.token_ids == want.token_ids
    assert got.completion_mask == want.completion_mask
    assert got.finish_reason == want.finish_reason
    assert got.text == want.text
    assert (got.kv_len, got.total_tokens, got.prompt_len) == (want.kv_len, want.total_tokens, want.prompt_len)
    assert got.inject_ranges == want.inject_ranges
    assert [_event_dict(e) for e in got.events] == [_event_dict(e) for e in want.events]
    assert len(got.logprobs) == len(want.logprobs)
    for a, b in zip(got.logprobs, want.logprobs):
        assert abs(a - b) <= atol, (got.logprobs, want.logprobs)
    assert (got.input_logprobs is None) == (want.input_logprobs is None)
    if want.input_logprobs is not None:
        assert len(got.input_logprobs) == len(want.input_logprobs)
        for a, b in zip(got.input_logprobs, want.input_logprobs):
            assert (a is None) == (b is None) and (a is None or abs(a - b) <= atol), (a, b)


def wait_until(predicate, timeout: float = 30.0, interval: float = 0.05) -> bool:
    """Poll ``predicate`` until it is true or ``timeout`` passes (bounded)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())
