"""Tutorial 2: serving — ``compaction-gym serve``, ``HTTPBackend`` and the OpenAI client.

Starts ``compaction-gym serve --model babyai-tiny`` in a child process, then talks to it three ways:

1. an agent on :class:`~compaction_gym.servers.HTTPBackend` plays a BabyAI episode whose session
   lives (and is compacted) on the server — the same agent code as with the in-process backend;
2. the raw session API: open a session, step it, read its compaction events, close it;
3. the OpenAI Python client on ``/v1/chat/completions``, compaction passed in ``extra_body``.

Run it (CPU, about 20 s)::

    python docs/tutorials/t02_serving.py
"""

from __future__ import annotations

import argparse
import contextlib
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import gymnasium as gym
import httpx
from openai import OpenAI

import compaction_gym  # noqa: F401  (registers the env ids)
from compaction_gym.agents import CompactionAgent, run_episode
from compaction_gym.engine import CompactionConfig, SamplingParams
from compaction_gym.servers import HTTPBackend


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def server(model: str, port: int, max_slots: int = 4) -> Iterator[str]:
    """Run ``compaction-gym serve`` until the block ends; yield its URL once ``/health`` answers."""
    # The same as the shell command `compaction-gym serve --model babyai-tiny --port PORT ...`.
    cmd = [sys.executable, "-m", "compaction_gym.cli", "serve", "--model", model, "--port", str(port),
           "--max-slots", str(max_slots), "--torch-threads", "1", "--batch-window-ms", "2"]
    proc = subprocess.Popen(cmd)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"the server exited with code {proc.returncode}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(f"{url}/health", timeout=1.0).status_code == 200:
                    break
            if time.monotonic() > deadline:
                raise TimeoutError("the server did not answer /health within 120 s")
            time.sleep(0.25)
        yield url
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Serve babyai-tiny; return the episode's trajectory, the raw session's events and the chat reply."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="babyai-tiny")
    parser.add_argument("--task", default="open")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-kv-len", type=int, default=512)
    args = parser.parse_args(argv)
    compaction = CompactionConfig(mode="attention_matching", max_kv_len=args.max_kv_len,
                                  compact_window=args.max_kv_len // 2, compute_beta=True)

    with server(args.model, free_port()) as url:
        # 1. An agent whose session lives on the server. HTTPBackend implements the same Backend
        #    protocol as LocalBackend: the agent cannot tell them apart.
        backend = HTTPBackend(url)
        print("server:", backend.health()["model"], "slots:", backend.max_slots)
        agent = CompactionAgent(backend, compaction=compaction,
                                sampling=SamplingParams(temperature=0.0, max_new_tokens=64), prompt="reasoning")
        env = gym.make("AttnMatch-BabyAI-v0", task=args.task, action_parsing="tag")
        trajectory = run_episode(env, agent, seed=args.seed)
        agent.close()
        print(f"episode: success={trajectory.success} turns={len(trajectory.turns)} "
              f"tokens={trajectory.num_tokens} peak KV={trajectory.peak_kv_len} events={len(trajectory.events)}")

        # 2. The raw session API: token ids in, a StepResult (tokens, log-probs, events) out.
        tok = backend.tokenizer
        prompt_ids = tok.apply_chat_template([{"role": "user", "content": "go to the red ball"}],
                                             add_generation_prompt=True, tokenize=True, return_dict=False)
        small = CompactionConfig(mode="attention_matching", max_kv_len=len(prompt_ids) + 48, compact_window=32)
        first = backend.create_session(prompt_ids, small, SamplingParams(temperature=0.0, max_new_tokens=32))
        more_ids = tok.encode("\nCurrent Observation:\na wall 1 step forward", add_special_tokens=False)
        second = backend.step(first.session_id, more_ids)
        events = [*first.events, *second.events]
        backend.close(first.session_id)
        print(f"raw session: {len(first.token_ids) + len(second.token_ids)} tokens sampled, "
              f"kv_len {second.kv_len}, {len(events)} compaction events")

        # 3. The OpenAI client: each request is an ephemeral session, compacted per `compaction`.
        client = OpenAI(base_url=f"{url}/v1", api_key="unused")
        model_id = client.models.list().data[0].id
        reply = client.chat.completions.create(
            model=model_id,
            messages=[{"role": "user", "content": "go to the red ball"}],
            max_tokens=48, temperature=0.0, seed=0,
            extra_body={"compaction": {"mode": "attention_matching", "max_kv_len": 256, "compact_window": 64}},
        )
        text = reply.choices[0].message.content
        print("openai client:", repr(text[:80]), "finish:", reply.choices[0].finish_reason)
        env.close()
        backend.shutdown()  # closes the client's connection pool
    return {"trajectory": trajectory, "events": events, "kv_len": second.kv_len, "budget": small.max_kv_len,
            "chat": reply, "model_id": model_id}


if __name__ == "__main__":
    main()
