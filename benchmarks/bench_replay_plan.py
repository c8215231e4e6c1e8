"""The one-pass replay plan's fixed cost per call, built afresh and kept by a ``ReplayPlanCache``.

Before the GPU starts, a one-pass replay call builds its plan: the host simulation of every
trajectory's cache states (``build_plan``) and the device plan (``OnePassReplay``: index layout and
uploads). This times, on saved sessions (``bench_replay.py --batch ... --save-views PATH``), the
two halves built afresh and a :class:`~compaction_gym.trainers.replay_cache.ReplayPlanCache`'s
answers for the passes of a GRPO step: the same batch again (in another order), and the same
trajectories reshuffled into chunks (simulations kept, device plans rebuilt). No model is run.

Usage:
    python benchmarks/bench_replay.py --batch 8 --turns 40 ... --save-views /tmp/views.pt
    python benchmarks/bench_replay_plan.py --views /tmp/views.pt --device cuda

Without a GPU, the target-1 sessions with the 0.6B cache layout (28 layers × 8 KV heads; 28,453
tokens and 180 events, as on the GPU) come from a narrow model on CPU in ~6 minutes:

    python benchmarks/bench_replay.py --device cpu --model qwen3-0.6b-layout --batch 8 --turns 40 \
        --prompt 128 --turn-input 60 --turn-tokens 24 --max-kv-len 384 --probes 256 \
        --config "AM kv-budget β" --save-views /tmp/views.pt --save-only
"""

from __future__ import annotations

import argparse
import random
import time

import torch
from bench_replay import timed  # benchmarks/ is on the path of a script run from it

from compaction_gym.trainers.replay import _one_pass_plan, scored_positions
from compaction_gym.trainers.replay_cache import ReplayPlanCache
from compaction_gym.trainers.replay_onepass import OnePassReplay
from compaction_gym.trainers.replay_plan import build_plan


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--views", required=True, help="torch.save'd {'views': [...]} (bench_replay.py --save-views)"
    )
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--head-dim", type=int, default=128, help="the model's head dim (Qwen3: 128)")
    p.add_argument("--q-per-kv", type=int, default=2, help="query heads per KV head (Qwen3-0.6B: 2)")
    p.add_argument("--chunks", type=int, default=2, help="the reshuffled pass: this many chunks")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    return p


class _Layout:
    def __init__(self, n_layers: int, n_kv_heads: int, head_dim: int, q_per_kv: int) -> None:
        self.n_layers, self.n_kv_heads, self.head_dim = n_layers, n_kv_heads, head_dim
        self.n_q_heads, self.scale = q_per_kv * n_kv_heads, head_dim**-0.5


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    views = torch.load(args.views, weights_only=False)["views"]
    n_layers, n_kv_heads = views[0].events[0].indices.shape[:2]
    layout = _Layout(n_layers, n_kv_heads, args.head_dim, args.q_per_kv)
    param = torch.zeros(1, dtype=getattr(torch, args.dtype), device=args.device)

    def inputs(vs: list) -> tuple:
        targets = [scored_positions(v, None, i) for i, v in enumerate(vs)]
        configs = [(v.config.n_probe_queries, v.config.ridge) for v in vs]
        return targets, [1.0] * len(vs), configs

    targets, temps, configs = inputs(views)
    plan = None

    def host() -> None:
        nonlocal plan
        plan = build_plan(views, targets=targets, temperatures=temps, configs=configs, n_layers=n_layers,
                          n_kv_heads=n_kv_heads)  # fmt: skip

    def device() -> None:
        OnePassReplay(plan, param.device, through=True, head_dim=layout.head_dim, q_heads=layout.n_q_heads,
                      probe_dtype=param.dtype, scale=layout.scale)  # fmt: skip

    def call(vs: list, cache: ReplayPlanCache | None) -> None:
        _one_pass_plan(vs, *inputs(vs), layout, param, through=True, cache=cache)

    cache = ReplayPlanCache()
    call(views, cache)
    order = views[::-1]
    rng = random.Random(0)

    def reshuffled() -> None:
        kept = ReplayPlanCache()
        call(views, kept)  # the step's first pass: the whole batch
        vs = views[:]
        rng.shuffle(vs)
        size = -(-len(vs) // args.chunks)
        t = time.perf_counter()
        for k in range(0, len(vs), size):
            call(vs[k : k + size], kept)
        if args.device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)

    times: list[float] = []
    for _ in range(args.repeats):
        reshuffled()
    rows = {
        "host simulation (build_plan)": timed(host, args.device, args.repeats, min),
        "device plan (OnePassReplay)": timed(device, args.device, args.repeats, min),
        "fresh, whole call": timed(lambda: call(views, None), args.device, args.repeats, min),
        "kept: the same batch": timed(lambda: call(views, cache), args.device, args.repeats, min),
        "kept: the same batch reversed": timed(lambda: call(order, cache), args.device, args.repeats, min),
        f"kept simulations: reshuffled into {args.chunks} chunks (all)": min(times),
    }
    tokens, events = sum(len(v.token_ids) for v in views), sum(len(v.events) for v in views)
    print(f"{len(views)} trajectories, {tokens} tokens, {events} events; {n_layers} layers × {n_kv_heads} KV heads; "
          f"{args.device} {args.dtype}; minimum of {args.repeats}")  # fmt: skip
    for name, s in rows.items():
        print(f"| {name} | {1e3 * s:.2f} ms |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
