"""One GRPO step's replay on babyai-tiny memory-task rollouts: old (event by event) vs batched events.

The GRPO recipe ``benchmarks/recipes/grpo_babyai_memory`` spends most of a step replaying its
trajectories (issue 24, issue 28 item 1). This benchmark plays one group of episodes per task with
the recipe's rollout settings (``recipe.toml``: attention_matching, max_kv_len 384, window 192,
ratio 0.25, temperature 1, the reasoning prompt, 64 sampled tokens per turn) on the bundled
``babyai-tiny`` policy, saves them (``--trajectories``, reused when the file exists), then times
what the trainer does with them in one optimizer step:

* ``policy fwd+bwd``: :func:`~compaction_gym.trainers.replay.replay_logprobs_batch` with
  ``grad=True`` (grad through compaction, as ``am_grad``) and ``backward`` of the summed log-probs;
* ``reference fwd``: the same replay without grad (TRL's reference / old log-prob pass);

each with events applied one trajectory at a time (``batch_events=False``, the path before this
benchmark) and batched across trajectories (``batch_events=True``), in the same process,
alternating, median of ``--repeats`` (CPU: process CPU seconds; CUDA: wall seconds), and the
aten operations each pass runs (forward and backward: the kernel launches a GPU would see); the
max |Δ| between the two paths' log-probs and gradients is printed too.

Usage:
    python benchmarks/bench_grpo_replay.py --trajectories /tmp/mem.json            # CPU
    python benchmarks/bench_grpo_replay.py --device cuda --trajectories /tmp/mem.json --episodes 8
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_shapes import device_line  # noqa: E402

RECIPE = Path(__file__).resolve().parent / "recipes" / "grpo_babyai_memory" / "recipe.toml"


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trajectories", required=True, help="JSON file of the rollouts (written if absent)")
    p.add_argument("--tasks", nargs="+", default=["putnext", "pick_up_seq_go_to"])
    p.add_argument("--episodes", type=int, default=4, help="episodes per task (one GRPO group)")
    p.add_argument("--seed", type=int, default=500000, help="env seed of each task's group")
    p.add_argument("--device", default="cpu")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--use", default=":", help="slice of the saved trajectories to replay, e.g. 2:5")
    p.add_argument("--grad-use", default=":",
                   help="slice of those the policy (grad) pass replays (its graph holds ~0.3 MB a token)")  # fmt: skip
    p.add_argument("--rollouts-only", action="store_true", help="play and save the rollouts, then stop")
    p.add_argument("--no-grad-through", action="store_true", help="detach compacted blocks (am_detached)")
    return p


def play(args, model, tokenizer) -> list:
    """One group of ``--episodes`` episodes per task under the recipe's rollout settings."""
    from compaction_gym.engine import CompactionConfig, SamplingParams
    from compaction_gym.envs.registration import BABYAI_TASK_IDS
    from compaction_gym.trainers.rollouts import EnvRollouts, EpisodeSpec

    recipe = tomllib.loads(RECIPE.read_text())
    train = recipe["training"]
    rollouts = EnvRollouts(
        model,
        tokenizer,
        {t: BABYAI_TASK_IDS[t] for t in args.tasks},
        compaction=CompactionConfig(**recipe["compaction"]),
        sampling=SamplingParams(temperature=train["temperature"], max_new_tokens=train["max_turn_tokens"]),
        prompt=train["prompt_format"],
        max_slots=args.episodes * len(args.tasks),
        capacity=train["engine_capacity"],
    )
    specs = [
        EpisodeSpec(t, args.seed, 1000 * k + i)
        for k, t in enumerate(args.tasks)
        for i in range(args.episodes)
    ]
    trajs = rollouts.run(specs)
    rollouts.close()
    return trajs


def _slice(text: str) -> slice:
    lo, _, hi = text.partition(":")
    return slice(int(lo) if lo else None, int(hi) if hi else None)


class OpCounter(TorchDispatchMode):
    """Counts the aten operations run inside it (forward and backward): a device-independent proxy
    for the kernel launches a GPU would issue."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += 1
        return func(*args, **(kwargs or {}))


def count_ops(fn) -> int:
    with OpCounter() as counter:
        fn()
    return counter.ops


def timed(fn, device: str, repeats: int) -> list[float]:
    """Seconds per call: wall time on CUDA (synchronised), this process's CPU time on CPU (the
    shared box's other load then barely moves it)."""
    clock = time.perf_counter if device == "cuda" else time.process_time
    out = []
    for _ in range(repeats):
        if device == "cuda":
            torch.cuda.synchronize()
        t = clock()
        fn()
        if device == "cuda":
            torch.cuda.synchronize()
        out.append(clock() - t)
    return out


def main(argv: list[str] | None = None) -> int:
    from compaction_gym.agents import Trajectory
    from compaction_gym.models.registry import load_model, resolve_model
    from compaction_gym.trainers.replay import replay_logprobs_batch

    args = make_parser().parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tokenizer = load_model(resolve_model("babyai-tiny"), dtype=torch.float32, device=args.device)
    path = Path(args.trajectories)
    if path.is_file():
        trajs = [Trajectory.from_dict(d) for d in json.loads(path.read_text())]
        rollout_s = float("nan")
    else:
        clock = time.perf_counter if args.device == "cuda" else time.process_time
        t = clock()
        trajs = play(args, model, tokenizer)
        rollout_s = clock() - t
        path.write_text(json.dumps([tr.to_dict() for tr in trajs]))
    if args.rollouts_only:
        print(f"{len(trajs)} trajectories in {rollout_s:.1f} s -> {path}")
        return 0
    trajs = trajs[_slice(args.use)]
    grad_trajs = trajs[_slice(args.grad_use)]
    model.train()
    through = not args.no_grad_through

    def policy(batched: bool) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        model.zero_grad(set_to_none=True)
        out = replay_logprobs_batch(
            model,
            grad_trajs,
            grad=True,
            grad_through_compaction=through,
            temperature=1.0,
            batch_events=batched,
        )
        torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
        grads = [p.grad.detach().clone() for p in model.parameters() if p.grad is not None]
        return [lp.detach() for lp in out.logprobs], grads

    def reference(batched: bool) -> None:
        replay_logprobs_batch(model, trajs, temperature=1.0, batch_events=batched)

    lp_old, g_old = policy(False)  # warm-up and the two paths' agreement
    lp_new, g_new = policy(True)
    d_lp = max((a - b).abs().max().item() for a, b in zip(lp_old, lp_new))
    d_g = max(((a - b).abs().max() / a.abs().max().clamp(min=1e-30)).item() for a, b in zip(g_old, g_new))
    ops = {
        "pol old": count_ops(lambda: policy(False)),
        "pol new": count_ops(lambda: policy(True)),
        "ref old": count_ops(lambda: reference(False)),
        "ref new": count_ops(lambda: reference(True)),
    }
    times: dict[str, list[float]] = {k: [] for k in ("pol old", "pol new", "ref old", "ref new")}
    for _ in range(args.repeats):  # alternate, so load drift hits both paths alike
        times["pol old"] += timed(lambda: policy(False), args.device, 1)
        times["pol new"] += timed(lambda: policy(True), args.device, 1)
        times["ref old"] += timed(lambda: reference(False), args.device, 1)
        times["ref new"] += timed(lambda: reference(True), args.device, 1)
    med = {k: statistics.median(v) for k, v in times.items()}

    def size(ts: list) -> str:
        tokens = sum(len(t.token_ids) for t in ts)
        sampled = sum(sum(t.completion_mask) for t in ts)
        return f"{len(ts)} trajectories, {tokens} tokens, {sampled} sampled, {sum(len(t.events) for t in ts)} events"

    print(
        f"{device_line()}; babyai-tiny float32; {', '.join(args.tasks)}; policy pass: {size(grad_trajs)}; "
        f"reference pass: {size(trajs)}; grad through compaction {through}; threads {args.threads}; "
        f"rollout of these episodes {rollout_s:.1f} s; median of {args.repeats}"
    )
    print(f"max |Δ logprob| old vs batched {d_lp:.2e}; max relative |Δ grad| {d_g:.2e}")
    print("| pass | old s | batched s | speed-up | old aten ops | batched aten ops | ops ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, a, b in (("policy fwd+bwd", "pol old", "pol new"), ("reference fwd", "ref old", "ref new")):
        print(
            f"| {name} | {med[a]:.2f} | {med[b]:.2f} | {med[a] / med[b]:.2f}× | {ops[a]} | {ops[b]} | "
            f"{ops[a] / ops[b]:.2f}× |"
        )
    old, new = med["pol old"] + med["ref old"], med["pol new"] + med["ref new"]
    o_old, o_new = ops["pol old"] + ops["ref old"], ops["pol new"] + ops["ref new"]
    print(
        f"| policy + reference | {old:.2f} | {new:.2f} | {old / new:.2f}× | {o_old} | {o_new} | "
        f"{o_old / o_new:.2f}× |"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
