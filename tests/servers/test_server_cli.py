"""``compaction-gym serve``: flags, ``--config`` merging, and a real process serving requests."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import httpx
import pytest
from server_helpers import wait_until

from compaction_gym.cli import make_parser
from compaction_gym.engine.config import SamplingParams
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.cli import args_from_namespace
from compaction_gym.servers.http_backend import HTTPBackend


def _args(argv: list[str]) -> ServerArgs:
    return args_from_namespace(make_parser().parse_args(["serve", *argv]))


def test_flags_map_onto_server_args():
    args = _args(["--model", "m", "--max-slots", "3", "--batch-window-ms", "2.5", "--session-ttl-s", "0"])
    assert (args.model, args.max_slots, args.batch_window_ms) == ("m", 3, 2.5)
    assert args.session_ttl_s is None  # 0 disables expiry
    assert _args([]) == ServerArgs()
    limits = _args(["--no-continuous-batching", "--round-steps", "4", "--max-new-tokens-limit", "0",
                    "--max-prompt-tokens", "100", "--max-queue-s", "2.5"])  # fmt: skip
    assert not limits.continuous_batching and limits.round_steps == 4
    assert limits.max_new_tokens_limit is None  # 0: no limit
    assert (limits.max_prompt_tokens, limits.max_queue_s) == (100, 2.5)
    assert ServerArgs().continuous_batching and ServerArgs().max_new_tokens_limit == 32768


def test_config_file_is_merged_and_flags_win(tmp_path):
    cfg = tmp_path / "serve.toml"
    cfg.write_text('[server]\nmodel = "from-file"\nport = 9001\nmax_slots = 5\n')
    args = _args(["--config", str(cfg), "--port", "9002"])
    assert (args.model, args.port, args.max_slots) == ("from-file", 9002, 5)
    cfg.write_text("max_slotz = 5\n")
    with pytest.raises(InvalidArgumentError, match="max_slotz"):
        _args(["--config", str(cfg)])


def test_invalid_values_name_the_field():
    with pytest.raises(InvalidArgumentError, match="dtype"):
        ServerArgs(dtype="float8")
    with pytest.raises(InvalidArgumentError, match="batch_window_ms"):
        ServerArgs(batch_window_ms=-1)
    for name, bad in (("round_steps", 0), ("max_prompt_tokens", -3), ("max_new_tokens_limit", -1), ("max_queue_s", 0)):
        with pytest.raises(InvalidArgumentError, match=name):
            ServerArgs(**{name: bad})


def test_serve_process_answers_and_stops(tiny_model_path, tiny_tokenizer):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "compaction_gym.cli",
        "serve",
        "--model",
        str(tiny_model_path),
        "--port",
        str(port),
    ]
    cmd += ["--max-slots", "2", "--capacity", "256", "--device", "cpu", "--log-level", "warning"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"serve exited early:\n{proc.stdout.read()}")
        try:
            return httpx.get(f"{url}/health", timeout=2).status_code == 200
        except httpx.TransportError:
            return False

    try:
        assert wait_until(up, timeout=120, interval=0.25)
        with HTTPBackend(url, tokenizer=tiny_tokenizer) as backend:
            assert backend.max_slots == 2
            result = backend.create_session(
                [1, 2, 3], sampling=SamplingParams(temperature=0, max_new_tokens=3)
            )
            assert 1 <= len(result.token_ids) <= 3
            backend.close(result.session_id)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=10)
    assert proc.returncode == 0


def test_clients_drop_idle_connections_before_the_server_closes_them(tiny_model_path, monkeypatch):
    """`serve` keeps idle connections ``keep_alive_s`` and HTTPBackend reuses them for less, so a
    (non-retryable) step never goes out on a connection the server is closing."""
    import inspect

    import uvicorn

    from compaction_gym.servers.cli import serve

    captured = {}
    monkeypatch.setattr(uvicorn, "run", lambda app, **kw: captured.update(kw))
    serve(ServerArgs(model=str(tiny_model_path), device="cpu", keep_alive_s=7.5))
    assert captured["timeout_keep_alive"] == 7.5
    client_expiry = inspect.signature(HTTPBackend).parameters["keepalive_expiry"].default
    assert client_expiry < ServerArgs().keep_alive_s
    assert client_expiry < 5.0  # also under uvicorn's own default, for apps served without `serve`
    with pytest.raises(InvalidArgumentError, match="keep_alive_s"):
        ServerArgs(keep_alive_s=0)
