"""VLLMBackend sessions vs the embedded engine (LocalBackend) on the same CPU, measured in one run.

Both run the same session loop (the embedded engine's code; inside vLLM's worker the model's
modules are vLLM's). Greedy decoding (EOS ignored) of ``--new-tokens`` tokens after seeded random
prompts at each batch size: B sessions are opened and step one ``step_batch``; tokens/s counts
generated tokens over the wall time of the whole call (prefill + decode, and for vLLM the RPC to
its worker process). Each cell is the median of ``--repeats`` runs after one warm-up, the two
backends interleaved. A last row adds KV-budget Attention-Matching compaction (β on). Needs vLLM
(docs/vllm.md: the second environment); run it from a file, never interactively (vLLM may spawn).

Usage:
    /work/venv-vllm/bin/python benchmarks/bench_vllm.py                        # tiny random Qwen3
    /work/venv-vllm/bin/python benchmarks/bench_vllm.py --model smollm2-135m-instruct
"""

from __future__ import annotations

import argparse
import platform
import statistics
import tempfile
import time


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="tiny", help="'tiny' (random Qwen3, head_dim 64), a registered name or a folder")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 4])
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--new-tokens", type=int, default=64)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads of this process")
    return p


def run(args: argparse.Namespace) -> list[dict]:
    import torch

    from compaction_gym.backends import LocalBackend
    from compaction_gym.backends.vllm_backend import VLLMBackend
    from compaction_gym.engine import CompactionConfig, SamplingParams
    from compaction_gym.engine.types import CreateRequest

    torch.set_num_threads(args.threads)
    model = args.model
    if model == "tiny":
        from compaction_gym.models.tiny import make_tiny_model

        model = str(make_tiny_model(tempfile.mkdtemp(prefix="bench-vllm-")))
    slots = max(args.batches)
    capacity = args.prompt_len + args.new_tokens + 64
    vb = VLLMBackend(model, max_slots=slots, capacity=capacity)
    local = LocalBackend.from_pretrained(model, max_slots=slots, capacity=capacity, device="cpu", dtype="float32")
    sampling = SamplingParams(temperature=0.0, max_new_tokens=args.new_tokens, ignore_eos=True)
    window = max(8, args.new_tokens // 2)
    configs = {"none": CompactionConfig()}
    configs["attention_matching"] = CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=args.prompt_len + window,
        compact_window=window, compact_target_ratio=0.25,
    )  # fmt: skip
    g = torch.Generator().manual_seed(0)
    rows = []
    try:
        for name, config in configs.items():
            for batch in args.batches if name == "none" else [max(args.batches)]:
                prompts = [torch.randint(3, 400, (args.prompt_len,), generator=g).tolist() for _ in range(batch)]
                times: dict[str, list[float]] = {"vllm": [], "local": []}
                tokens: dict[str, list[list[int]]] = {}
                for rep in range(args.repeats + 1):
                    for label, backend in (("vllm", vb), ("local", local)):
                        t = time.perf_counter()
                        results = backend.step_batch([CreateRequest(p, config, sampling) for p in prompts])
                        elapsed = time.perf_counter() - t
                        tokens[label] = [r.token_ids for r in results]
                        for r in results:
                            backend.close(r.session_id)
                        if rep:  # the first run warms up
                            times[label].append(elapsed)
                generated = batch * args.new_tokens
                tps = {k: generated / statistics.median(v) for k, v in times.items()}
                rows.append({"config": name, "batch": batch, "vllm_tok_s": tps["vllm"], "local_tok_s": tps["local"],
                             "ratio": tps["vllm"] / tps["local"], "same_tokens": tokens["vllm"] == tokens["local"]})  # fmt: skip
    finally:
        vb.shutdown()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    rows = run(args)
    print(f"# {platform.processor() or platform.machine()}, model {args.model}, prompt {args.prompt_len}, "
          f"{args.new_tokens} new tokens, median of {args.repeats}")  # fmt: skip
    print(f"{'config':<20}{'batch':>6}{'vllm tok/s':>12}{'local tok/s':>13}{'ratio':>8}  same tokens")
    for r in rows:
        print(f"{r['config']:<20}{r['batch']:>6}{r['vllm_tok_s']:>12.1f}{r['local_tok_s']:>13.1f}{r['ratio']:>8.2f}  {r['same_tokens']}")
    return 0


if __name__ == "__main__":  # vLLM may spawn its workers: they import this module again
    raise SystemExit(main())
