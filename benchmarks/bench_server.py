"""Server throughput: N sessions stepping concurrently through the HTTP server vs one by one.

Starts ``compaction-gym serve`` in a subprocess (so client threads do not share a GIL with the
server), then runs the same workload twice against it:

* **one by one** — one client: create every session, then step them one request at a time
  (every engine batch holds one request);
* **concurrent** — ``--sessions`` client threads, one session each: all create at once, then all
  step at once (the server's auto-batcher folds concurrent steps into one ``step_batch``).

The stepping phase (``--steps`` steps per session) is what the ratio compares (docs/benchmarks.md: "64
concurrent sessions stepping"); the create phase is reported beside it. Every response is exactly
``--new-tokens`` greedy tokens (``ignore_eos``), so both runs do the same work. Prints generated
tokens/s, the ratio, client-side p50/p99 step latency and the mean engine batch size from
``/metrics``.

    python benchmarks/bench_server.py                      # tiny random model, CPU
    python benchmarks/bench_server.py --model Qwen/Qwen3-0.6B --device cuda --sessions 64

``--scenario head-of-line`` measures instead the latency of a small request (``--probe-tokens``
greedy tokens) sent while long requests (``--long-tokens``, KV-budget compaction so they never
fill a slot) keep the server busy: a client re-sends a long request as soon as the previous one
returns, and ``--probes`` small requests are sent one after another meanwhile. It runs against a
server with one-shot batching (``--no-continuous-batching``: a batch runs to completion, the
former behaviour) and one with continuous batching, and prints p50/p99 of both and their ratio.

    python benchmarks/bench_server.py --scenario head-of-line --threads 1
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import httpx

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.servers.http_backend import HTTPBackend


@dataclass
class Run:
    name: str
    wall_s: float = 0.0  # stepping phase
    tokens: int = 0  # generated while stepping
    create_wall_s: float = 0.0
    create_tokens: int = 0
    step_latencies: list[float] = field(default_factory=list)
    batch_mean: float = 0.0  # requests per step_batch while stepping

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s if self.wall_s else 0.0

    @property
    def create_tokens_per_s(self) -> float:
        return self.create_tokens / self.create_wall_s if self.create_wall_s else 0.0

    def pct(self, q: float) -> float:
        xs = sorted(self.step_latencies)
        return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1000 if xs else float("nan")

    def to_dict(self) -> dict:
        return {
            "create_tokens_per_s": self.create_tokens_per_s,
            "step_tokens": self.tokens,
            "step_wall_s": self.wall_s,
            "step_tokens_per_s": self.tokens_per_s,
            "p50_step_ms": self.pct(50),
            "p99_step_ms": self.pct(99),
            "mean_batch": self.batch_mean,
        }


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default=None, help="model path or hub id (default: a tiny random Qwen3)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--steps", type=int, default=4, help="steps per session after its create")
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--step-len", type=int, default=8, help="new input tokens per step")
    p.add_argument("--new-tokens", type=int, default=16, help="generated tokens per create/step")
    p.add_argument(
        "--max-kv-len", type=int, default=None, help="KV budget (enables attention-matching compaction)"
    )
    p.add_argument("--batch-window-ms", type=float, default=5.0)
    p.add_argument("--max-batch-wait-ms", type=float, default=None, help="server default: 10 x window")
    p.add_argument("--capacity", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads (server and in-process)")
    p.add_argument("--json", default=None, help="also write the results to this file")
    p.add_argument("--no-engine-baseline", action="store_true", help="skip the in-process engine measurement")
    p.add_argument("--scenario", choices=("throughput", "head-of-line"), default="throughput")
    p.add_argument("--long-tokens", type=int, default=1000, help="head-of-line: tokens of each long request")
    p.add_argument("--probe-tokens", type=int, default=2, help="head-of-line: tokens of each small request")
    p.add_argument("--probes", type=int, default=12, help="head-of-line: small requests per mode")
    p.add_argument("--probe-gap-s", type=float, default=0.05, help="head-of-line: pause between small requests")
    p.add_argument("--round-steps", type=int, default=None, help="the server's --round-steps (default: its own)")
    return p.parse_args(argv)


def start_server(args: argparse.Namespace, model: str, extra: tuple[str, ...] = ()) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "compaction_gym.cli", "serve", "--model", model, "--port", str(port)]
    cmd += ["--max-slots", str(args.sessions), "--capacity", str(args.capacity), "--device", args.device]
    cmd += ["--batch-window-ms", str(args.batch_window_ms), "--log-level", "warning", "--session-ttl-s", "0"]
    if args.threads is not None:
        cmd += ["--torch-threads", str(args.threads)]
    if args.max_batch_wait_ms is not None:
        cmd += ["--max-batch-wait-ms", str(args.max_batch_wait_ms)]
    if getattr(args, "round_steps", None) is not None:
        cmd += ["--round-steps", str(args.round_steps)]
    proc = subprocess.Popen(cmd + list(extra))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited with {proc.returncode}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return proc, url
        except httpx.TransportError:
            time.sleep(0.25)
    proc.kill()
    raise SystemExit("server did not come up in 600 s")


def _stream(args: argparse.Namespace, k: int, vocab: int) -> list[int]:
    """Session ``k``'s deterministic input tokens (prompt, then each step's new tokens)."""
    n = args.prompt_len + args.steps * args.step_len
    return [(args.seed * 7919 + k * 104729 + i * 31) % (vocab - 10) + 5 for i in range(n)]


def create(backend: HTTPBackend, k: int, args: argparse.Namespace, vocab: int) -> tuple[str, int]:
    config = None
    if args.max_kv_len:
        config = CompactionConfig(mode="attention_matching", max_kv_len=args.max_kv_len)
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    r = backend.create_session(_stream(args, k, vocab)[: args.prompt_len], config, sampling)
    return r.session_id, len(r.token_ids)


def step_all(backend: HTTPBackend, k: int, sid: str, args: argparse.Namespace, vocab: int, run: Run) -> int:
    """Step session ``k`` ``args.steps`` times, recording each step's latency; tokens generated."""
    stream, tokens = _stream(args, k, vocab), 0
    for i in range(args.steps):
        start = args.prompt_len + i * args.step_len
        t0 = time.perf_counter()
        out = backend.step(sid, stream[start : start + args.step_len])
        run.step_latencies.append(time.perf_counter() - t0)
        tokens += len(out.token_ids)
    return tokens


def batch_stats(backend: HTTPBackend) -> tuple[float, float]:
    """(sum, count) of the server's batch-size histogram."""
    total = count = 0.0
    for line in backend.metrics().splitlines():
        if line.startswith("compaction_gym_batch_size_sum"):
            total = float(line.split()[-1])
        elif line.startswith("compaction_gym_batch_size_count"):
            count = float(line.split()[-1])
    return total, count


def measure(backend: HTTPBackend, args: argparse.Namespace, vocab: int, concurrent: bool) -> Run:
    """Create every session, then step them all; both phases timed separately."""
    run = Run("concurrent" if concurrent else "one by one")
    ks = range(args.sessions)
    with ThreadPoolExecutor(args.sessions if concurrent else 1) as pool:
        t0 = time.perf_counter()
        created = list(pool.map(lambda k: create(backend, k, args, vocab), ks))
        run.create_wall_s = time.perf_counter() - t0
        run.create_tokens = sum(n for _, n in created)
        s0, c0 = batch_stats(backend)
        t0 = time.perf_counter()
        run.tokens = sum(pool.map(lambda k: step_all(backend, k, created[k][0], args, vocab, run), ks))
        run.wall_s = time.perf_counter() - t0
        s1, c1 = batch_stats(backend)
    run.batch_mean = (s1 - s0) / max(1.0, c1 - c0)
    for sid, _ in created:
        backend.close(sid)
    return run


def engine_ceiling(args: argparse.Namespace, model: str) -> tuple[float, float]:
    """The same stepping phase in process, without HTTP: (one-by-one tok/s, one step_batch per wave tok/s).

    Runs on a non-main thread, as the server's engine worker does (on a busy CPU, torch's
    intra-op pool behaves very differently on the main thread).
    """
    with ThreadPoolExecutor(1) as pool:
        return pool.submit(_engine_ceiling, args, model).result()


def _engine_ceiling(args: argparse.Namespace, model: str) -> tuple[float, float]:
    import torch

    from compaction_gym.engine import Engine, StepRequest

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    engine = Engine.from_pretrained(
        model, device=args.device, max_slots=args.sessions, capacity=args.capacity
    )
    vocab = int(engine.model.get_input_embeddings().num_embeddings)
    config = (
        CompactionConfig(mode="attention_matching", max_kv_len=args.max_kv_len) if args.max_kv_len else None
    )
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    rates = []
    for batched in (False, True):
        streams = [_stream(args, k, vocab) for k in range(args.sessions)]
        sids = [engine.create_session(st[: args.prompt_len], config, sampling).session_id for st in streams]
        tokens, t0 = 0, time.perf_counter()
        for i in range(args.steps):
            a = args.prompt_len + i * args.step_len
            reqs = [StepRequest(sid, st[a : a + args.step_len]) for sid, st in zip(sids, streams)]
            results = engine.step_batch(reqs) if batched else [engine.step_batch([r])[0] for r in reqs]
            tokens += sum(len(r.token_ids) for r in results)
        rates.append(tokens / (time.perf_counter() - t0))
        for sid in sids:
            engine.close(sid)
    return rates[0], rates[1]


def _pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))] * 1000 if xs else float("nan")


def probe_latencies(url: str, args: argparse.Namespace, vocab: int) -> tuple[list[float], int]:
    """Small-request latencies (s) while a client keeps one long request running; long requests served."""
    import threading

    stop = threading.Event()
    served = [0]
    long_body = {
        "prompt_ids": _stream(args, 1, vocab)[:16], "max_new_tokens": args.long_tokens, "ignore_eos": True,
        "temperature": 0.0, "max_kv_len": 256, "compact_window": 128, "mode": "markovian",
    }  # fmt: skip

    def hog() -> None:
        with httpx.Client(timeout=600) as c:
            while not stop.is_set():
                assert c.post(f"{url}/compact_generate", json=long_body).status_code == 200
                served[0] += 1

    small = {"prompt_ids": _stream(args, 2, vocab)[:8], "max_new_tokens": args.probe_tokens, "temperature": 0.0,
             "ignore_eos": True}  # fmt: skip
    latencies: list[float] = []
    thread = threading.Thread(target=hog, daemon=True)
    with httpx.Client(timeout=600) as c:
        c.post(f"{url}/compact_generate", json=small)  # warm-up
        thread.start()
        time.sleep(0.5)  # the first long request is running
        for _ in range(args.probes):
            t0 = time.perf_counter()
            assert c.post(f"{url}/compact_generate", json=small).status_code == 200
            latencies.append(time.perf_counter() - t0)
            time.sleep(args.probe_gap_s)
    stop.set()
    thread.join(600)
    return latencies, served[0]


def head_of_line(args: argparse.Namespace, model: str) -> dict:
    """p50/p99 of a small request's latency under long-request load, one-shot vs continuous batching."""
    out: dict[str, dict] = {}
    for name, flag in (("one-shot", "--no-continuous-batching"), ("continuous", "--continuous-batching")):
        proc, url = start_server(argparse.Namespace(**{**vars(args), "sessions": 4}), model, (flag,))
        try:
            vocab = int(httpx.get(f"{url}/health").json()["vocab_size"])
            lat, served = probe_latencies(url, args, vocab)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
        out[name] = {"p50_ms": _pct(lat, 50), "p99_ms": _pct(lat, 99), "max_ms": max(lat) * 1000,
                     "probes": len(lat), "long_requests_served": served}  # fmt: skip
    print(
        f"\nhead-of-line: {args.probes} requests of {args.probe_tokens} tokens while {args.long_tokens}-token "
        f"requests run back to back; model {args.model or 'tiny random'}, device {args.device}, "
        f"torch threads {args.threads or 'default'}, round steps {args.round_steps or 'server default'}"
    )
    print(f"{'batching':<11} {'p50 ms':>9} {'p99 ms':>9} {'max ms':>9} {'long served':>12}")
    for name, r in out.items():
        print(f"{name:<11} {r['p50_ms']:>9.1f} {r['p99_ms']:>9.1f} {r['max_ms']:>9.1f} {r['long_requests_served']:>12}")
    ratio50 = out["one-shot"]["p50_ms"] / out["continuous"]["p50_ms"]
    ratio99 = out["one-shot"]["p99_ms"] / out["continuous"]["p99_ms"]
    print(f"small-request latency ratio (one-shot / continuous): p50 {ratio50:.1f}x, p99 {ratio99:.1f}x")
    return {"args": vars(args), "runs": out, "ratio_p50": ratio50, "ratio_p99": ratio99}


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    if args.scenario == "head-of-line":
        with tempfile.TemporaryDirectory() as tmp:
            model = args.model
            if model is None:
                from compaction_gym.models.tiny import make_tiny_model

                model = str(make_tiny_model(os.path.join(tmp, "tiny"), seed=args.seed))
            out = head_of_line(args, model)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=2)
        return out
    with tempfile.TemporaryDirectory() as tmp:
        model = args.model
        if model is None:
            from compaction_gym.models.tiny import make_tiny_model

            model = str(make_tiny_model(os.path.join(tmp, "tiny"), seed=args.seed))
        proc, url = start_server(args, model)
        try:
            with HTTPBackend(url, max_connections=args.sessions + 4) as backend:
                vocab = int(backend.health()["vocab_size"])
                measure(backend, argparse.Namespace(**{**vars(args), "sessions": 2, "steps": 1}), vocab, True)
                sequential = measure(backend, args, vocab, concurrent=False)
                concurrent = measure(backend, args, vocab, concurrent=True)
        finally:
            proc.send_signal(signal.SIGINT)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
        single, batched = engine_ceiling(args, model) if not args.no_engine_baseline else (float("nan"),) * 2
    ratio = concurrent.tokens_per_s / sequential.tokens_per_s
    print(
        f"\nserver: {args.sessions} sessions, create + {args.steps} steps each, prompt {args.prompt_len}, "
        f"+{args.step_len} tokens/step, {args.new_tokens} new tokens/response, "
        f"model {args.model or 'tiny random'}, device {args.device}, torch threads {args.threads or 'default'}"
    )
    print(
        f"{'mode':<12} {'create tok/s':>12} {'step tokens':>11} {'wall s':>8} {'step tok/s':>10} "
        f"{'p50 step ms':>12} {'p99 step ms':>12} {'mean batch':>11}"
    )
    for r in (sequential, concurrent):
        print(
            f"{r.name:<12} {r.create_tokens_per_s:>12.1f} {r.tokens:>11} {r.wall_s:>8.2f} {r.tokens_per_s:>10.1f} "
            f"{r.pct(50):>12.1f} {r.pct(99):>12.1f} {r.batch_mean:>11.1f}"
        )
    print(f"stepping throughput ratio (concurrent / one by one): {ratio:.2f}x")
    print(
        f"engine in process, no HTTP: one by one {single:.1f} tok/s, one step_batch of {args.sessions} "
        f"{batched:.1f} tok/s, ratio {batched / single:.2f}x (the ceiling batching can reach here)"
    )
    out = {
        "args": vars(args),
        "ratio": ratio,
        "runs": {r.name: r.to_dict() for r in (sequential, concurrent)},
    }
    out["engine_in_process"] = {"one_by_one_tokens_per_s": single, "step_batch_tokens_per_s": batched}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return out


if __name__ == "__main__":
    main()
