"""Decode chunks that end where rows pause, against chunks that run on (docs/engine.md, "Decode
chunks end at pauses"): ``bench_sessions.py``'s compacting workload played both ways in one run.

Sessions open with a prompt and play lock-step turns (one ``step_batch`` per turn, 50–70 tokens in,
20 sampled, KV-budget Attention Matching with β and suffix probes, ``max_kv_len`` 512, window
256 → 64), so KV-budget events fire inside responses. Per policy it prints the decode chunks, the
decode steps (and those of partial batches: rows left behind by a pause), the event calls, the
wall time of the turns and its ratio to the chunks that run on, and whether the tokens agree
(they need not in float32 or bf16: other batch compositions round differently).

On a CPU the model is a random Qwen3 at tiny widths (the step and event counts are the workload's, the times
the CPU's); on CUDA a random Qwen3 shape of ``gpu_shapes.py`` on the fast engine.

Where the time goes: the seconds spent inside decode chunks and inside event calls (each call
timed; on CUDA only with ``--attribute``, which synchronises the device around every call and so
slows the runs it attributes), and the rest (prefill of the turns' inputs, the host's work).

Usage:
    python benchmarks/bench_chunk_cuts.py                      # CPU, tiny model (~30 s)
    python benchmarks/bench_chunk_cuts.py --device cuda --model qwen3-4b --repeats 3
    python benchmarks/bench_chunk_cuts.py --device cuda --model qwen3-4b --repeats 3 --attribute
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from bench_sessions import open_sessions, turn_input
from gpu_shapes import QWEN3_SHAPES, device_line, print_table, random_model


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--model", default="qwen3-4b", choices=list(QWEN3_SHAPES), help="CUDA only")
    p.add_argument("--sessions", type=int, default=64)
    p.add_argument("--prompt", type=int, default=200)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=20)
    p.add_argument("--repeats", type=int, default=1, help="alternating runs per policy (median)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument(
        "--attribute",
        action="store_true",
        help="on CUDA: synchronise around each chunk and event call to time them",
    )
    return p


def play(engine, args, config, sampling, cut: bool) -> dict:
    """One compacting run of the turns with chunks cut (or not): counts, seconds and tokens."""
    from compaction_gym.engine import StepRequest

    scheduler, runner, compactor = engine.scheduler, engine.runner, engine.compactor
    chunks, calls, inside = [], [], {"decode": 0.0, "events": 0.0}
    decode_chunk, compact_many = runner.decode_chunk, compactor.compact_many
    cuda = engine.cache.k.is_cuda
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    attribute = args.attribute or not cuda

    def timed(part: str, fn, *a):
        if not attribute:
            return fn(*a)
        sync()
        t = time.perf_counter()
        out = fn(*a)
        sync()
        inside[part] += time.perf_counter() - t
        return out

    def counted_chunk(rows, steps):
        chunks.append((len(rows), steps))
        return timed("decode", decode_chunk, rows, steps)

    def counted_calls(requests):
        if requests:
            calls.append(len(requests))
        return timed("events", compact_many, requests)

    runner.decode_chunk, compactor.compact_many = counted_chunk, counted_calls
    scheduler.cut_chunks = cut
    try:
        sids = open_sessions(engine, args.sessions, args.prompt, config, 0)
        chunks.clear(), calls.clear()
        inside.update(decode=0.0, events=0.0)
        sync()
        t = time.perf_counter()
        for turn in range(args.turns):
            engine.step_batch([StepRequest(s, turn_input(i, turn), sampling) for i, s in enumerate(sids)])
        sync()
        seconds = time.perf_counter() - t
        tokens = [engine.session(s).token_ids for s in sids]
        for s in sids:
            engine.close(s)
    finally:
        del runner.decode_chunk, compactor.compact_many
        scheduler.cut_chunks = True
    return {
        "chunks": len(chunks),
        "steps": sum(n for _, n in chunks),
        "partial": sum(n for rows, n in chunks if rows < args.sessions),
        "calls": len(calls),
        "events": sum(calls),
        "seconds": seconds,
        "decode_s": inside["decode"] if attribute else None,
        "events_s": inside["events"] if attribute else None,
        "tokens": tokens,
    }


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    from compaction_gym.engine import CompactionConfig, Engine, SamplingParams

    cuda = args.device.startswith("cuda")
    # on a CPU: two narrow layers (head dim 64), a vocabulary that holds the workload's ids
    tiny = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
                intermediate_size=128, vocab_size=50_304)  # fmt: skip
    model = random_model(args.model) if cuda else random_model(args.model, "cpu", torch.float32, **tiny)
    capacity = args.prompt + (args.turns + 2) * (70 + args.new_tokens) + 16
    engine = Engine(model, None, max_slots=args.sessions, capacity=capacity, fast=cuda)
    sampling = SamplingParams(temperature=0.7, max_new_tokens=args.new_tokens, ignore_eos=True)
    config = CompactionConfig(
        mode="attention_matching", max_kv_len=512, compact_window=256, compact_target_ratio=0.25,
        compute_beta=True, queries="suffix",
    )  # fmt: skip
    if cuda:  # graphs and kernels compiled outside the timed runs
        play(engine, args, config, sampling, cut=True)
    runs: dict[bool, list[dict]] = {True: [], False: []}
    for _ in range(args.repeats):
        for cut in (False, True):
            runs[cut].append(play(engine, args, config, sampling, cut))
    same = all(a["tokens"] == b["tokens"] for a, b in zip(runs[True], runs[False]))
    base = statistics.median(r["seconds"] for r in runs[False])
    rows = []
    for cut in (False, True):
        r, sec = runs[cut][0], statistics.median(x["seconds"] for x in runs[cut])
        name = "chunks end at pauses (ChunkCosts)" if cut else "chunks run on"
        parts = ["", "", ""]
        if r["decode_s"] is not None:
            decode, events = (statistics.median(x[k] for x in runs[cut]) for k in ("decode_s", "events_s"))
            parts = [decode, events, sec - decode - events]
        rows.append(
            [name, r["chunks"], r["steps"], r["partial"], r["calls"], r["events"], sec, *parts, base / sec]
        )
    print(f"{device_line()}; {args.sessions} sessions × {args.turns} turns, {args.repeats} run(s) per policy")
    headers = ["policy", "chunks", "decode steps", "partial-batch steps", "event calls", "events", "s"]
    print_table(headers + ["in decode chunks s", "in event calls s", "rest s", "speed-up"], rows)
    # each row samples from its own stream and its events fire at the same tokens either way; the
    # batches' compositions differ, and in float32 / bf16 so may a later token (float64: equal)
    print(f"tokens equal in both policies: {same}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
