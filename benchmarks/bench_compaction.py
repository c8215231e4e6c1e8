"""One Attention-Matching compaction event over all layers × KV heads: fused vs reference (GPU).

Qwen3-4B shape (36 layers × 8 KV heads = 288 rows, head_dim 128, 4 query heads per KV head),
bf16 cache of ``--kv`` rows; the span ``[prompt, prompt + 1024)`` is compacted to 256 rows with
``suffix`` probes: the last ``--probes`` recorded query positions × 4 query heads per KV head.
K/V/queries are random (seeded), so the logits have a realistic spread but no special structure.

Rows, each the median of ``--repeats`` runs (wall time, device synchronised):

* ``compact`` — :func:`compaction_gym.compaction.api` (the reference implementation);
* ``compact_fast`` — :func:`compaction_gym.engine.fast.compact_fast` (fused kernels);
* ``engine event`` — the whole event the engine runs (``Compactor.compact`` with the fast
  function: probe selection from the query ring, compaction, write-back into the slot cache,
  the event record).

Agreement of the two implementations is printed beside the timings (same kept indices, relative
difference of C2, largest β difference).

``--baseline REV`` also times ``compact_fast`` of git revision ``REV`` (its
``engine/fast/compaction.py``, run on the current package) in the same process, and prints the
ratio and the agreement of the two; ``REV`` may instead name such a file (no git on the device:
``git show REV:compaction_gym/engine/fast/compaction.py > benchmarks/baseline_compaction.py``).

Usage:
    python benchmarks/bench_compaction.py --repeats 7
    python benchmarks/bench_compaction.py --repeats 7 --baseline benchmarks/baseline_compaction.py
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from gpu_shapes import QWEN3_SHAPES, device_line, print_table, wall_time


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv", type=int, default=2048, help="cache rows before the event")
    p.add_argument("--prompt", type=int, default=256, help="protected rows before the span")
    p.add_argument("--span", type=int, default=1024)
    p.add_argument("--target", type=int, default=256)
    p.add_argument("--probes", type=int, default=256, help="recorded query positions (n_probe_queries)")
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--baseline", default=None, help="git revision (or file) of a compact_fast to time beside")
    return p


def load_baseline(spec: str):
    """``compact_fast`` of ``spec``: an ``engine/fast/compaction.py`` file, or a git revision's."""
    path = Path(spec)
    if not path.is_file():
        root = Path(__file__).resolve().parent.parent
        text = subprocess.run(
            ["git", "show", f"{spec}:compaction_gym/engine/fast/compaction.py"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
        with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:  # Triton reads the source
            f.write(text)
        path = Path(f.name)
    module_spec = importlib.util.spec_from_file_location("baseline_compaction", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module.compact_fast


def inputs(args, seed: int = 0):
    shape = QWEN3_SHAPES["qwen3-4b"]
    layers, kv_heads, d = shape["num_hidden_layers"], shape["num_key_value_heads"], shape["head_dim"]
    group = shape["num_attention_heads"] // kv_heads
    g = torch.Generator(device="cuda").manual_seed(seed)
    rows = layers * kv_heads
    keys = torch.randn(rows, args.kv, d, device="cuda", generator=g).to(torch.bfloat16)
    values = torch.randn(rows, args.kv, d, device="cuda", generator=g).to(torch.bfloat16)
    queries = torch.randn(rows, group * args.probes, d, device="cuda", generator=g).to(torch.bfloat16)
    return keys, values, queries, d**-0.5


def agreement(ref, out, keys, queries, span, scale) -> str:
    same = (ref.indices == out.indices).float().mean().item()
    dv = ((ref.values.float() - out.values.float()).norm() / ref.values.float().norm()).item()
    text = f"indices {100 * same:.2f}% equal, C2 rel. diff {dv:.1e}"
    if ref.beta is not None:  # span-mass objective Σ_i (Σ_sel exp(S + β − lse_W) − 1)² of each β
        s_span = (queries.float() @ keys[:, span[0] : span[1]].float().mT) * scale
        lse = torch.logsumexp(s_span, -1, keepdim=True)
        obj = []
        for r in (out, ref):
            kept = torch.gather(s_span, 2, (r.indices - span[0])[:, None, :].expand(-1, s_span.shape[1], -1))
            obj.append((torch.exp(kept + r.beta[:, None, :] - lse).sum(-1) - 1).pow(2).sum().item())
        text += f", β objective fast/ref {obj[0] / obj[1]:.4f}"
    return text


def engine_event(args, compute_beta: bool) -> float:
    """Median seconds of ``Compactor.compact`` on a real slot cache and query ring."""
    from compaction_gym.engine.compactor import Compactor
    from compaction_gym.engine.config import CompactionConfig, SamplingParams
    from compaction_gym.engine.fast import compact_fast
    from compaction_gym.engine.model_runner import ModelLayout
    from compaction_gym.engine.session import ProbeRing, Session
    from compaction_gym.engine.slot_cache import SlotKVCache

    shape = QWEN3_SHAPES["qwen3-4b"]
    d = shape["head_dim"]
    layout = ModelLayout(
        shape["num_hidden_layers"], shape["num_attention_heads"], shape["num_key_value_heads"], d, d,
        shape["vocab_size"], d**-0.5,
    )  # fmt: skip
    cache = SlotKVCache(
        layout.n_layers, layout.n_kv_heads, d, 1, args.kv, torch.bfloat16, torch.device("cuda")
    )
    compactor = Compactor(cache, layout, compact_fn=compact_fast)
    config = CompactionConfig(
        mode="attention_matching", compute_beta=compute_beta, n_probe_queries=args.probes
    )
    times = []
    for _ in range(args.repeats + 1):
        cache.k.normal_()
        cache.v.normal_()
        cache.restore_lengths([args.kv])  # `cache.lengths` is a copy
        s = Session("bench", 0, config, SamplingParams(), None, 0, args.prompt, args.prompt)
        s.row_map.append(0, args.kv)
        s.fed = args.kv
        s.probes = ProbeRing(
            layout.n_layers, layout.n_q_heads, d, args.probes, torch.bfloat16, cache.k.device
        )
        s.probes.push(
            torch.randn(
                layout.n_layers, layout.n_q_heads, args.probes, d, device="cuda", dtype=torch.bfloat16
            ),
            args.kv - args.probes,
        )
        span = (args.prompt, args.prompt + args.span)
        t = wall_time(lambda: compactor.compact(s, span, args.target / args.span, "manual"))  # noqa: B023
        assert cache.length(0) == args.kv - args.span + args.target
        times.append(t)
    return statistics.median(times[1:])


@torch.no_grad()
def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_compaction needs a CUDA device", file=sys.stderr)
        return 2
    from compaction_gym.compaction import compact
    from compaction_gym.engine.fast import compact_fast

    keys, values, queries, scale = inputs(args)
    span = (args.prompt, args.prompt + args.span)
    rows = []
    fns = [("compact", compact), ("compact_fast", compact_fast)]
    if args.baseline:
        fns.append((f"compact_fast@{args.baseline}", load_baseline(args.baseline)))
    for beta in (False, True):
        res = {}
        times = {}
        for name, fn in fns:

            def call(fn=fn, beta=beta):
                return fn(keys, values, queries, span, args.target, compute_beta=beta, scale=scale)

            res[name] = call()  # warm-up (and Triton compilation)
            reps = args.repeats if name.startswith("compact_fast") else max(3, args.repeats // 3)
            times[name] = statistics.median(wall_time(call) for _ in range(reps))
            print(f"{name} beta={beta}: {times[name] * 1e3:.2f} ms", flush=True)
        event = engine_event(args, beta)
        note = agreement(res["compact"], res["compact_fast"], keys, queries, span, scale)
        rows.append(["compact (reference)", beta, times["compact"] * 1e3, 1.0, ""])
        rows.append(
            [
                "compact_fast",
                beta,
                times["compact_fast"] * 1e3,
                times["compact"] / times["compact_fast"],
                note,
            ]
        )
        if args.baseline:
            name = f"compact_fast@{args.baseline}"
            note = agreement(res[name], res["compact_fast"], keys, queries, span, scale).replace(
                "fast/ref", "current/baseline"
            )
            note += f"; current is {times[name] / times['compact_fast']:.2f}x faster"
            rows.append(
                [
                    f"compact_fast (baseline {args.baseline})",
                    beta,
                    times[name] * 1e3,
                    times["compact"] / times[name],
                    note,
                ]
            )
        rows.append(
            [
                "engine event (fast)",
                beta,
                event * 1e3,
                times["compact"] / event,
                "probes + compact + write-back",
            ]
        )
    print()
    print_table(
        ["implementation", "β", "ms", "speed-up vs reference", "agreement"],
        rows,
        title=(
            f"Compaction event, Qwen3-4B shape (288 layer×KV-head rows, d=128, bf16), KV {args.kv}, "
            f"span {span} → {args.target}, {4 * args.probes} suffix probes per KV head; {device_line()}"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
