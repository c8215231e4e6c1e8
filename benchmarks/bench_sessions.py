"""Many concurrent agent sessions on the fast engine: batched vs one by one, and with compaction (GPU).

A random-weight Qwen3-4B-shaped model (real config, bf16) in ``Engine(..., fast=True)``.
``--sessions`` sessions open with a ``--prompt``-token prompt, then play BabyAI-like turns: each
turn feeds 50–70 new tokens (an observation) and samples 20 (temperature 0.7, seeded, EOS
ignored so every turn has the same length). Tokens/s = sampled tokens ÷ wall time of the turns
(prefill of the inputs, decode and any compaction included).

* **concurrent**: one ``step_batch`` over all sessions per turn; the runner decodes in chunks of
  up to 32 steps on the device, one host synchronisation per chunk;
* **concurrent, token by token**: the same with chunks of one step (the host samples, checks and
  feeds every token: one synchronisation per token), the loop the chunks replaced;
* **one by one**: the same turns as ``step`` calls, session after session (fresh sessions);
* **concurrent + compaction**: KV-budget Attention Matching with β and suffix probes
  (``max_kv_len`` 512, window 256 → 64 rows), so events fire every few turns in every session;
  the events due at one scheduler step are scored in stacked calls (docs/engine.md, "Batched
  events"). Its ratio to **concurrent** is issue #28's "compaction nearly free" figure (target
  ≥ 90 %). ``--compare-unbatched-events`` also times it with every event scored alone
  (``Compactor.batch_events = False``, the path before stacking), ``--compare-chunk-cuts`` with
  decode chunks that run on past the rows' KV-budget pauses (``Scheduler.cut_chunks = False``,
  docs/engine.md, "Decode chunks end at pauses"), in the same run.

The concurrent and compaction runs alternate ``--pairs`` times (a shared GPU's speed drifts
between runs); their rows are the median pair's, and the ratio is the median of the pairs' ratios
(their range in the notes).

Usage:
    python benchmarks/bench_sessions.py
    python benchmarks/bench_sessions.py --sessions 64 --turns 12 --model qwen3-0.6b
    python benchmarks/bench_sessions.py --compare-unbatched-events --compare-chunk-cuts --pairs 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from gpu_shapes import QWEN3_SHAPES, device_line, print_table, random_model


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="qwen3-4b", choices=list(QWEN3_SHAPES))
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--turns", type=int, default=8, help="timed turns of the concurrent runs")
    p.add_argument("--sequential-turns", type=int, default=2, help="timed turns of the one-by-one run")
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--max-kv-len", type=int, default=512)
    p.add_argument("--window", type=int, default=256)
    p.add_argument(
        "--compare-unbatched-events",
        action="store_true",
        help="also time the compaction run with every event scored alone (events not stacked)",
    )
    p.add_argument(
        "--compare-chunk-cuts",
        action="store_true",
        help="also time the compaction run with decode chunks that run on past KV-budget pauses",
    )
    p.add_argument(
        "--pairs", type=int, default=3, help="concurrent / compaction runs alternated (medians reported)"
    )
    return p


def turn_input(session: int, turn: int) -> list[int]:
    g = torch.Generator().manual_seed(1000 * session + turn)
    n = int(torch.randint(50, 71, (1,), generator=g))
    return torch.randint(100, 50_000, (n,), generator=g).tolist()


def open_sessions(engine, n: int, prompt: int, config, offset: int) -> list[str]:
    from compaction_gym.engine import SamplingParams

    ids = []
    for i in range(n):
        g = torch.Generator().manual_seed(offset + i)
        prompt_ids = torch.randint(100, 50_000, (prompt,), generator=g).tolist()
        r = engine.create_session(prompt_ids, config, SamplingParams(max_new_tokens=0, seed=offset + i))
        ids.append(r.session_id)
    return ids


def compaction_run(
    engine, n, args, config, sampling, *, stacked: bool, cut_chunks: bool = True, offset: int = 0
):
    """(sampled tokens, seconds, events, scoring calls, kv lengths) of the turns with compaction.

    ``stacked=False`` scores every event alone; the scoring calls (one per stacked group or lone
    event) are counted. ``cut_chunks=False``: decode chunks run on past the rows' KV-budget pauses.
    """
    compactor, scheduler, calls = engine.compactor, engine.scheduler, []
    scorer, batch_events, cuts = compactor.compact_fn, compactor.batch_events, scheduler.cut_chunks

    def counted(*a, **kw):
        calls.append(1)
        return scorer(*a, **kw)

    compactor.compact_fn, compactor.batch_events, scheduler.cut_chunks = counted, stacked, cut_chunks
    try:
        sids = open_sessions(engine, n, args.prompt, config, offset)
        tok, sec, events = run_turns(engine, sids, range(args.turns), sampling, batched=True)
        kv_lens = [engine.session(s).kv_len for s in sids]
        for s in sids:
            engine.close(s)
    finally:
        compactor.compact_fn, compactor.batch_events, scheduler.cut_chunks = scorer, batch_events, cuts
    return tok, sec, events, len(calls), kv_lens


def median_run(runs: list[tuple]) -> tuple:
    """The run (sampled tokens, seconds, ...) with the median tokens/s (the lower one of an even count)."""
    return sorted(runs, key=lambda r: r[0] / r[1])[(len(runs) - 1) // 2]


def run_turns(engine, sids: list[str], turns: range, sampling, batched: bool) -> tuple[int, float, int]:
    """(sampled tokens, seconds, compaction events) of ``turns`` for every session."""
    from compaction_gym.engine import StepRequest

    tokens = events = 0
    torch.cuda.synchronize()
    t = time.perf_counter()
    for turn in turns:
        if batched:
            results = engine.step_batch(
                [StepRequest(s, turn_input(i, turn), sampling) for i, s in enumerate(sids)]
            )
        else:
            results = [engine.step(s, turn_input(i, turn), sampling) for i, s in enumerate(sids)]
        tokens += sum(sum(r.completion_mask) for r in results)
        events += sum(len(r.events) for r in results)
    torch.cuda.synchronize()
    return tokens, time.perf_counter() - t, events


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    parser = make_parser()
    args = parser.parse_args(argv)
    if args.pairs < 1:
        parser.error(f"--pairs must be at least 1, got {args.pairs}")
    if not torch.cuda.is_available():
        print("bench_sessions needs a CUDA device", file=sys.stderr)
        return 2
    from compaction_gym.engine import CompactionConfig, Engine, SamplingParams

    model = random_model(args.model)
    n = args.sessions
    capacity = args.prompt + (args.turns + 2) * (70 + args.new_tokens) + 16
    engine = Engine(model, None, max_slots=n, capacity=capacity, fast=True)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=args.new_tokens, ignore_eos=True)
    plain = CompactionConfig()
    compacting = CompactionConfig(
        mode="attention_matching", max_kv_len=args.max_kv_len, compact_window=args.window,
        compact_target_ratio=0.25, compute_beta=True, queries="suffix",
    )  # fmt: skip
    rows = []

    # warm-up: graphs of every bucket used below, Triton compilation
    warm = open_sessions(engine, n, args.prompt, plain, 10_000)
    run_turns(engine, warm, range(1), sampling, batched=True)
    run_turns(engine, warm[:1], range(1), sampling, batched=False)
    for s in warm:
        engine.close(s)
    # the compaction kernels compile at the timed events' shapes (with an empty Triton cache a lone
    # smaller event left compiles inside the timed run: 1,630 instead of 4,534 tok/s on an H100)
    variants = [("events stacked", True, True)]  # (label, events stacked, chunks cut at pauses)
    if args.compare_unbatched_events:
        variants.append(("events alone", False, True))
    if args.compare_chunk_cuts:
        variants.append(("events stacked, chunks run on", True, False))
    for _, stacked, cuts in variants:
        warm_events = compaction_run(
            engine, n, args, compacting, sampling, stacked=stacked, cut_chunks=cuts, offset=20_000
        )[2]
        assert warm_events, "the warm-up fired no compaction event: raise --turns or lower --max-kv-len"

    plain_runs, compaction = [], {v: [] for v in variants}
    for pair in range(args.pairs):
        sids = open_sessions(engine, n, args.prompt, plain, 0)
        plain_runs.append(run_turns(engine, sids, range(args.turns), sampling, batched=True))
        for s in sids:
            engine.close(s)
        tok_c, sec_c, _ = plain_runs[-1]
        print(f"pair {pair}: concurrent {tok_c} tokens in {sec_c:.2f} s", flush=True)
        for v in variants:
            compaction[v].append(
                run := compaction_run(engine, n, args, compacting, sampling, stacked=v[1], cut_chunks=v[2])
            )
            tok_k, sec_k, events, calls, _ = run
            print(
                f"pair {pair}: concurrent + compaction ({v[0]}): {tok_k} tokens in {sec_k:.2f} s, {events} events "
                f"in {calls} scoring calls; ÷ concurrent = {tok_k / sec_k / (tok_c / sec_c):.1%}",
                flush=True,
            )
    tok_c, sec_c, _ = median_run(plain_runs)
    chunk_steps, engine.runner.chunk_steps = engine.runner.chunk_steps, 1
    sids = open_sessions(engine, n, args.prompt, plain, 0)
    tok_1, sec_1, _ = run_turns(engine, sids, range(args.turns), sampling, batched=True)
    for s in sids:
        engine.close(s)
    engine.runner.chunk_steps = chunk_steps
    print(f"concurrent, token by token: {tok_1} tokens in {sec_1:.2f} s", flush=True)
    sids = open_sessions(engine, n, args.prompt, plain, 0)
    tok_s, sec_s, _ = run_turns(engine, sids, range(args.sequential_turns), sampling, batched=False)
    for s in sids:
        engine.close(s)
    print(f"one by one: {tok_s} tokens in {sec_s:.2f} s", flush=True)

    seq_tps = tok_s / sec_s
    rows.append([f"{n} sessions one by one", args.sequential_turns, tok_s, sec_s, seq_tps, 1.0, ""])
    rows.append(
        [
            f"{n} sessions concurrent, token by token",
            args.turns,
            tok_1,
            sec_1,
            tok_1 / sec_1,
            tok_1 / sec_1 / seq_tps,
            "1 sync/token",
        ]
    )
    rows.append([
        f"{n} sessions concurrent", args.turns, tok_c, sec_c, tok_c / sec_c, tok_c / sec_c / seq_tps,
        f"chunks of ≤ {chunk_steps} steps: {sec_1 / sec_c:.2f}× token by token",
    ])  # fmt: skip
    for (label, _, _), runs in compaction.items():
        ratios = [k[0] / k[1] / (c[0] / c[1]) for k, c in zip(runs, plain_runs)]
        tok_k, sec_k, events, calls, kv_lens = median_run(runs)
        rows.append([
            f"{n} sessions concurrent + AM β compaction, {label}",
            args.turns, tok_k, sec_k, tok_k / sec_k, tok_k / sec_k / seq_tps,
            f"{statistics.median(ratios):.1%} of concurrent (median of {len(ratios)} pairs, "
            f"{min(ratios):.1%}–{max(ratios):.1%}); {events} events in {calls} calls, kv_len {min(kv_lens)}–{max(kv_lens)}",
        ])  # fmt: skip
    print()
    print_table(
        ["run", "turns", "sampled tokens", "seconds", "tok/s", "vs one by one", "notes"],
        rows,
        title=(
            f"Sessions, {args.model} shape, bf16, prompt {args.prompt}, turns of 50–70 tokens in / "
            f"{args.new_tokens} out; {device_line()}"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
