"""Engine throughput vs Hugging Face ``generate`` on a random Qwen3, measured in one run.

Greedy decoding (EOS ignored) of ``--new-tokens`` tokens after seeded random prompts, at each
batch size; tokens/s counts generated tokens over the wall time of prefill + decode; each cell is
the median of ``--repeats`` runs after one warm-up, engine and HF runs interleaved. The engine at batch B opens B sessions
(``create_session(max_new_tokens=0)``, the prefill) and generates with one ``step_batch``; HF
runs ``generate`` on the B prompts as one batch. A last row runs the engine with KV-budget
Attention-Matching compaction (β on) for the cost of compaction events.

Usage:
    python benchmarks/bench_engine.py                    # tiny model (2 layers, hidden 128)
    python benchmarks/bench_engine.py --model small      # 4 layers, hidden 256
    python benchmarks/bench_engine.py --model PATH_OR_ID --device cuda
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time
from dataclasses import dataclass

import torch

MODELS = {"tiny": {}, "small": {"layers": 4, "hidden": 256, "heads": 4, "kv_heads": 2}}


@dataclass
class Args:
    model: str = "tiny"
    device: str = "cpu"
    batches: tuple[int, ...] = (1, 8)
    prompt_len: int = 64
    new_tokens: int = 128
    repeats: int = 3
    threads: int | None = None


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=Args.model, help="'tiny', 'small' (random Qwen3) or a path / hub id")
    p.add_argument("--device", default=Args.device)
    p.add_argument("--batches", type=int, nargs="+", default=list(Args.batches))
    p.add_argument("--prompt-len", type=int, default=Args.prompt_len)
    p.add_argument("--new-tokens", type=int, default=Args.new_tokens)
    p.add_argument("--repeats", type=int, default=Args.repeats)
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    return p


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t


def _median_times(fns: list, repeats: int) -> list[float]:
    """Median wall time of each function; runs are interleaved so that load drifts hit all alike."""
    for fn in fns:  # warm-up
        fn()
    times = [[] for _ in fns]
    for _ in range(repeats):
        for fn, ts in zip(fns, times):
            ts.append(_timed(fn))
    return [statistics.median(ts) for ts in times]


def main(argv: list[str] | None = None) -> list[dict]:
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine import CompactionConfig, Engine, SamplingParams, StepRequest
    from compaction_gym.models.tiny import make_tiny_model

    a = make_parser().parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    path = a.model
    if a.model in MODELS:
        path = make_tiny_model(tempfile.mkdtemp(prefix=f"bench-{a.model}-"), **MODELS[a.model])
    dtype = torch.float32 if a.device == "cpu" else torch.bfloat16
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(a.device).eval()
    max_b = max(a.batches)
    engine = Engine.from_pretrained(
        path, dtype=dtype, device=a.device, max_slots=max_b, capacity=a.prompt_len + a.new_tokens + 8
    )
    vocab = engine.layout.vocab_size
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, vocab, (max_b, a.prompt_len), generator=gen)
    greedy = SamplingParams(temperature=0, max_new_tokens=a.new_tokens, ignore_eos=True)

    def run_engine(batch: int, config: CompactionConfig | None = None) -> None:
        ids = [
            engine.create_session(prompts[i].tolist(), config, greedy.replace(max_new_tokens=0)).session_id
            for i in range(batch)
        ]
        results = engine.step_batch([StepRequest(s, [], greedy) for s in ids])
        assert all(len(r.token_ids) == a.new_tokens for r in results)
        for s in ids:
            engine.close(s)

    @torch.no_grad()
    def run_hf(batch: int) -> None:
        out = hf.generate(
            prompts[:batch].to(a.device),
            attention_mask=torch.ones(batch, a.prompt_len, dtype=torch.long, device=a.device),
            max_new_tokens=a.new_tokens,
            min_new_tokens=a.new_tokens,
            do_sample=False,
        )
        assert out.shape[1] == a.prompt_len + a.new_tokens

    budget = max(16, (a.prompt_len + a.new_tokens) // 2)
    am = CompactionConfig(
        mode="attention_matching", max_kv_len=budget, compact_window=budget // 2, compute_beta=True
    )
    rows = []
    for b in a.batches:
        fns = [lambda b=b: run_engine(b), lambda b=b: run_hf(b)]
        if b == 1:  # compaction cost, interleaved with the same runs
            fns.append(lambda: run_engine(1, am))
        times = _median_times(fns, a.repeats)
        rows.append(
            {"case": f"batch {b}", "engine": b * a.new_tokens / times[0], "hf": b * a.new_tokens / times[1]}
        )
        if b == 1:
            rows.append(
                {
                    "case": f"batch 1, AM β {budget}/{budget // 2}/0.25",
                    "engine": a.new_tokens / times[2],
                    "hf": None,
                }
            )

    print(
        f"\nmodel={a.model} device={a.device} dtype={dtype} threads={torch.get_num_threads()} "
        f"prompt={a.prompt_len} new={a.new_tokens} repeats={a.repeats} "
        f"torch={torch.__version__} cpu={platform.processor() or platform.machine()}"
    )
    print("| case | engine tok/s | HF generate tok/s | engine / HF |")
    print("|---|---:|---:|---:|")
    for r in rows:
        hf_cell = f"{r['hf']:.1f}" if r["hf"] else "—"
        ratio = f"{r['engine'] / r['hf']:.2f}×" if r["hf"] else "—"
        print(f"| {r['case']} | {r['engine']:.1f} | {hf_cell} | {ratio} |")
    return rows


if __name__ == "__main__":
    main()
