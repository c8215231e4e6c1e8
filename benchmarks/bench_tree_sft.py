"""Tree-packed SFT vs per-branch training: step time, peak memory, FlexAttention-vs-SDPA agreement.

A Qwen3-0.6B-shaped model (random weights, the real dimensions) trains on agent-like trees: a trunk
of turns, each turn's reasoning a side leaf (~20 leaves, ~8k packed tokens, longest path ~6k). One
"step" is the forward and backward of one tree's loss (the optimizer is excluded: it costs the same
in every mode). Modes:

* ``tree_flex``  — one packed forward, ancestor mask as a FlexAttention BlockMask (sibling blocks skipped);
* ``tree_sdpa``  — one packed forward, dense N×N ancestor mask through SDPA;
* ``per_branch`` — every root→leaf branch forwarded and back-propagated on its own with SDPA's causal
  kernel (the research code's baseline: one branch per micro-batch). Same loss, same gradient.

All modes read logits only at the rows that predict a target (``logits_to_keep``). The table printed
last has the median step times and the ratios (target: per_branch / tree_flex ≥ 4).

GPU (the numbers for docs/benchmarks.md)::

    python benchmarks/bench_tree_sft.py --json benchmarks/results/tree_sft.json

CPU smoke run (tiny model, no FlexAttention training on CPU)::

    python benchmarks/bench_tree_sft.py --small --threads 1
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from compaction_gym.trainers.tree_sft import (
    Tree,
    TreeNode,
    clear_block_mask_cache,
    pack_tree,
    tree_forward,
    tree_loss,
)

QWEN3_0_6B = dict(
    vocab_size=151936,
    hidden_size=1024,
    intermediate_size=3072,
    num_hidden_layers=28,
    num_attention_heads=16,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rope_theta=1_000_000.0,
    rms_norm_eps=1e-6,
    tie_word_embeddings=True,
)
SMALL = dict(
    vocab_size=1024,
    hidden_size=128,
    intermediate_size=256,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
)


def make_model(dims: dict, device: torch.device, dtype: torch.dtype, seed: int):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(**dims, attn_implementation="sdpa")
    torch.manual_seed(seed)
    with torch.device(device):
        model = Qwen3ForCausalLM(config).to(dtype)
    return model.train()


def agent_tree(
    rng: random.Random, *, leaves: int, packed_tokens: int, vocab: int, side_frac: float = 0.25
) -> Tree:
    """A multi-turn agent tree: ``leaves - 1`` turns, each = a trunk segment (observation + visible
    action, loss on the action) then a side leaf (the turn's reasoning + action, all loss); the trunk's
    end is the last leaf. ``side_frac`` of the packed tokens are in side leaves."""
    turns = leaves - 1
    side_total = int(packed_tokens * side_frac)
    trunk_total = packed_tokens - side_total

    def split(total: int, parts: int) -> list[int]:
        cuts = sorted(rng.sample(range(1, total), parts - 1)) if parts > 1 else []
        sizes = [b - a for a, b in zip([0, *cuts], [*cuts, total])]
        return [max(2, s) for s in sizes]

    trunk = split(trunk_total, turns + 1)
    side = split(side_total, turns)
    tok = lambda n: [rng.randrange(vocab) for _ in range(n)]  # noqa: E731
    nodes = [TreeNode(-1, tok(trunk[0]), [0] * trunk[0])]
    cur = 0
    for i in range(turns):
        nodes.append(TreeNode(cur, tok(side[i])))  # reasoning + action: a side leaf
        n = trunk[i + 1]
        act = min(8, n // 2)  # the visible action (trained) then the next observation (not)
        nodes.append(TreeNode(cur, tok(n), [1] * act + [0] * (n - act - 1) + [1]))
        cur = len(nodes) - 1
    return Tree(nodes)


# -- the three steps ---------------------------------------------------------------------------------
def step_tree(model, tree: Tree, attn: str) -> float:
    loss = tree_loss(model, tree, attn_implementation=attn)
    loss.backward()
    return loss.item()


def step_per_branch(model, tree: Tree) -> float:
    """Each branch alone (causal SDPA), normalised by the tree's total branch weight, grads accumulated."""
    branches = tree.branches()
    k = len(branches)
    total_weight = sum(sum(m[1:]) for _, m in branches) / k
    device = next(model.parameters()).device
    value = 0.0
    for ids, mask in branches:
        targets = [j for j in range(1, len(ids)) if mask[j]]
        if not targets:
            continue
        src = torch.tensor([j - 1 for j in targets], device=device)
        out = model(input_ids=torch.tensor([ids], device=device), logits_to_keep=src, use_cache=False)
        ce = F.cross_entropy(
            out.logits[0].float(), torch.tensor([ids[j] for j in targets], device=device), reduction="sum"
        )
        loss = ce / k / total_weight
        loss.backward()
        value += loss.item()
    return value


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def time_mode(fn: Callable[[Tree], float], model, trees: list[Tree], warmup: int, steps: int, device) -> dict:
    for i in range(warmup):
        fn(trees[i % len(trees)])
        model.zero_grad(set_to_none=True)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for i in range(steps):
        sync(device)
        t0 = time.perf_counter()
        losses.append(fn(trees[i % len(trees)]))
        sync(device)
        times.append(time.perf_counter() - t0)
        model.zero_grad(set_to_none=True)
    peak = torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else float("nan")
    return {"median_s": statistics.median(times), "min_s": min(times), "peak_gib": peak, "losses": losses}


def agreement(model, tree: Tree, device) -> dict:
    """FlexAttention vs SDPA on one tree, in float32 (TF32 off): loss, logits and (on CUDA) grads."""
    model32 = model.float()
    prev_tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    packed = pack_tree(tree)
    out = {}
    try:
        with torch.no_grad():
            a = tree_forward(
                model32, packed, attn_implementation="flex_attention", logits_to_keep=packed.source_index
            )
            b = tree_forward(model32, packed, attn_implementation="sdpa", logits_to_keep=packed.source_index)
        out["logits_rel"] = ((a - b).abs().max() / b.abs().max()).item()
        if device.type == "cuda":
            grads, losses = [], []
            for attn in ("flex_attention", "sdpa"):
                model32.zero_grad(set_to_none=True)
                loss = tree_loss(model32, packed, attn_implementation=attn)
                loss.backward()
                losses.append(loss.item())
                grads.append(
                    torch.cat([p.grad.flatten() for p in model32.parameters() if p.grad is not None])
                )
            out["loss_rel"] = abs(losses[0] - losses[1]) / abs(losses[1])
            out["grad_rel"] = ((grads[0] - grads[1]).norm() / grads[1].norm()).item()
            model32.zero_grad(set_to_none=True)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = prev_tf32
    return out


def mask_build_ms(tree: Tree, device) -> float:
    """Building one fresh BlockMask (compiled create_block_mask on CUDA), after a warm-up build."""
    packed = pack_tree(tree)
    clear_block_mask_cache()
    packed.block_mask(device)  # warm-up / compile
    clear_block_mask_cache()
    sync(device)
    t0 = time.perf_counter()
    packed.block_mask(device)
    sync(device)
    return (time.perf_counter() - t0) * 1e3


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--small", action="store_true", help="tiny model and trees (CPU smoke run)")
    parser.add_argument("--leaves", type=int, default=None, help="leaves per tree (default 20; --small 6)")
    parser.add_argument(
        "--packed-tokens", type=int, default=None, help="tokens per packed tree (default 8192; --small 512)"
    )
    parser.add_argument("--trees", type=int, default=4, help="distinct trees, cycled")
    parser.add_argument(
        "--steps", type=int, default=None, help="timed steps per mode (default 10; --small 4)"
    )
    parser.add_argument(
        "--warmup", type=int, default=None, help="untimed steps per mode (default 4; --small 1)"
    )
    parser.add_argument("--dtype", default=None, choices=["bfloat16", "float32"], help="default bf16 on CUDA")
    parser.add_argument("--modes", default=None, help="comma list of tree_flex,tree_sdpa,per_branch")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (1 on a busy CPU)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)

    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    small = args.small
    leaves = args.leaves or (6 if small else 20)
    packed_tokens = args.packed_tokens or (512 if small else 8192)
    steps = args.steps or (4 if small else 10)
    warmup = args.warmup if args.warmup is not None else (1 if small else 4)
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    default_modes = "tree_flex,tree_sdpa,per_branch" if device.type == "cuda" else "tree_sdpa,per_branch"
    modes = (args.modes or default_modes).split(",")
    if device.type != "cuda" and "tree_flex" in modes:
        print("note: FlexAttention has no backward on CPU; dropping tree_flex timing", file=sys.stderr)
        modes = [m for m in modes if m != "tree_flex"]
    dims = SMALL if small else QWEN3_0_6B

    rng = random.Random(args.seed)
    trees = [
        agent_tree(rng, leaves=leaves, packed_tokens=packed_tokens, vocab=dims["vocab_size"])
        for _ in range(args.trees)
    ]
    model = make_model(dims, device, dtype, args.seed)
    n_params = sum(p.numel() for p in model.parameters())
    shape = {
        "leaves": statistics.mean(t.num_leaves for t in trees),
        "packed_tokens": statistics.mean(t.num_tokens for t in trees),
        "seq_len": statistics.mean(t.seq_len for t in trees),
        "branch_tokens": statistics.mean(t.branch_tokens for t in trees),
    }
    print(
        f"device={device} ({torch.cuda.get_device_name() if device.type == 'cuda' else platform.processor()}) "
        f"dtype={dtype} params={n_params / 1e6:.0f}M torch={torch.__version__}"
    )
    print("trees: " + ", ".join(f"{k}={v:.0f}" for k, v in shape.items()))

    fns = {
        "tree_flex": lambda t: step_tree(model, t, "flex_attention"),
        "tree_sdpa": lambda t: step_tree(model, t, "sdpa"),
        "per_branch": lambda t: step_per_branch(model, t),
    }
    results, errors = {}, {}
    for mode in modes:
        try:
            results[mode] = time_mode(fns[mode], model, trees, warmup, steps, device)
        except Exception as exc:  # report and go on: the other modes' numbers are still useful
            errors[mode] = f"{type(exc).__name__}: {exc}"
            print(f"{mode}: FAILED {errors[mode][:2000]}", file=sys.stderr, flush=True)
            model.zero_grad(set_to_none=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            continue
        r = results[mode]
        print(f"{mode}: median {r['median_s'] * 1e3:.1f} ms, peak {r['peak_gib']:.2f} GiB", flush=True)

    extra: dict = {"errors": errors} if errors else {}
    if device.type == "cuda":
        extra["block_mask_build_ms"] = mask_build_ms(trees[0], device)
    try:
        extra["flex_vs_sdpa_fp32"] = agreement(model, trees[0], device)
    except Exception as exc:
        errors["agreement"] = f"{type(exc).__name__}: {exc}"
        extra["flex_vs_sdpa_fp32"] = {}
        print(f"agreement: FAILED {errors['agreement'][:2000]}", file=sys.stderr)
    ref = results.get("per_branch")
    for mode in modes:
        if ref is not None and mode != "per_branch":
            diffs = [abs(a - b) / abs(b) for a, b in zip(results[mode]["losses"], ref["losses"])]
            extra[f"{mode}_vs_per_branch_loss_rel"] = max(diffs)

    record = {
        "device": str(device),
        "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "dtype": str(dtype),
        "model": "Qwen3-0.6B-shaped (random)" if not small else "tiny Qwen3",
        "params_m": round(n_params / 1e6, 1),
        "trees": shape,
        "steps": steps,
        "warmup": warmup,
        "results": {m: {k: v for k, v in r.items() if k != "losses"} for m, r in results.items()},
        **extra,
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(record, indent=2))

    agree = extra["flex_vs_sdpa_fp32"]
    ok = (
        bool(agree)
        and not errors
        and all(v <= 1e-4 for k, v in agree.items() if k in ("loss_rel", "logits_rel"))
    )
    print()
    print(
        "flex vs sdpa (fp32): "
        + ", ".join(f"{k}={v:.2e}" for k, v in agree.items())
        + f"  [{'OK' if ok else 'FAIL'} ≤ 1e-4]"
    )
    for k, v in extra.items():
        if k.endswith("_loss_rel"):
            print(f"{k}: {v:.2e}")
    if "block_mask_build_ms" in extra:
        print(f"BlockMask build (compiled, fresh tree shape): {extra['block_mask_build_ms']:.1f} ms")
    print()
    print(
        f"{'mode':<12} {'median ms':>10} {'min ms':>10} {'peak GiB':>9} {'tokens/step':>12} {'speed-up vs per_branch':>23}"
    )
    for mode, r in results.items():
        tokens = shape["branch_tokens"] if mode == "per_branch" else shape["packed_tokens"]
        speed = f"{ref['median_s'] / r['median_s']:.2f}x" if ref is not None else "-"
        print(
            f"{mode:<12} {r['median_s'] * 1e3:>10.1f} {r['min_s'] * 1e3:>10.1f} {r['peak_gib']:>9.2f} {tokens:>12.0f} {speed:>23}"
        )
    if "tree_flex" in results and "tree_sdpa" in results:
        print(
            f"tree_sdpa / tree_flex: {results['tree_sdpa']['median_s'] / results['tree_flex']['median_s']:.2f}x"
        )
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
