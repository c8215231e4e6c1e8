"""What one round of stacked compaction events costs per event outside the scoring math (issue #28).

A random Qwen3 of a small layout (CPU by default) opens ``--sessions`` sessions with prompts of
``--kv-len`` ± 32 tokens (suffix probes recorded), then times ``Compactor.compact_many`` on forks
of them: one KV-budget-like event per session (span ``[--prompt, --prompt + --window)`` →
``window / 4`` rows, β on), events forced into stacked calls (``batch_events = True``). The scoring
itself is a stub (the span's first ``t`` rows, β = 0: a few ops per call), so what is timed is the
round's own work: probes, stacking, the host copy, the write-back into the slots and the records.

Printed per event: wall µs of the round (median over ``--repeats`` rounds; on CUDA until the
device has finished it, so kernels' time counts too) and the aten operations the round
dispatches (a ``TorchDispatchMode`` count, views and the stub's own ops excluded), split by stage
(the profiler ranges of ``compact_many``). On CUDA every one of those operations on a
device tensor is a kernel launch.

``--baseline REV`` runs the same measurement on the package of git revision ``REV`` too (its
``compaction_gym/`` checked out into a temporary folder, run in a subprocess), alternating rounds
of both, and prints the ratio; ``REV`` may also be a folder holding that ``compaction_gym/``
(``git archive REV compaction_gym | tar -x -C DIR``, for a machine without the repository's git).

Usage:
    python benchmarks/bench_event_rounds.py
    python benchmarks/bench_event_rounds.py --baseline 7c0a627 --sessions 32 --repeats 20
    # GPU, the Qwen3-4B attention layout (36 layers, 32/8 heads, d 128), a bench_sessions-sized call
    python benchmarks/bench_event_rounds.py --device cuda --layers 36 --heads 32 --kv-heads 8 \
        --head-dim 128 --sessions 58 --baseline 7c0a627
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: metadata-only operations (no kernel): not counted
VIEW_OPS = {
    "view", "_unsafe_view", "as_strided", "slice", "select", "expand", "unsqueeze", "squeeze",
    "permute", "t", "transpose", "alias", "detach", "_reshape_alias", "split", "unbind", "lift_fresh",
    "split_with_sizes", "narrow", "unfold",
}  # fmt: skip


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sessions", type=int, default=32)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=1)
    p.add_argument("--head-dim", type=int, default=16)
    p.add_argument("--prompt", type=int, default=200, help="protected prompt rows: the span starts here")
    p.add_argument("--window", type=int, default=256, help="span rows (compacted to a quarter)")
    p.add_argument("--kv-len", type=int, default=488, help="mean session length (± 32) at the event")
    p.add_argument("--probes", type=int, default=256, help="n_probe_queries (suffix probes recorded)")
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default=None, help="K/V dtype (default: float32 on CPU, bfloat16 on CUDA)")
    p.add_argument(
        "--baseline",
        default=None,
        help="git revision (or a folder holding its compaction_gym/) to measure too, in the same run",
    )
    p.add_argument("--json", action="store_true", help="print one JSON line (used by --baseline)")
    return p


class OpCounter(TorchDispatchMode):
    """Counts dispatched aten operations (views excluded) by stage, except inside the stub scorer."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.by_op: Counter[str] = Counter()
        self.stage = "other"
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if not self.paused and name not in VIEW_OPS:
            self.counts[self.stage] += 1
            self.by_op[name] += 1
        return func(*args, **(kwargs or {}))


def stub_scorer(counter: OpCounter | None):
    """``compact``'s signature: the span's first ``target`` rows, β zero (no scoring math)."""
    from compaction_gym.compaction import CompactionResult

    def score(keys, values, queries, span, target, *, compute_beta=False, **_):
        if counter is not None:
            counter.paused = True
        try:
            a = span[0]
            idx = torch.arange(a, a + target, device=keys.device).expand(keys.shape[0], target)
            beta = torch.zeros(keys.shape[0], target, device=keys.device) if compute_beta else None
            return CompactionResult(
                keys[:, a : a + target].clone(), values[:, a : a + target].clone(), beta, idx
            )
        finally:
            if counter is not None:
                counter.paused = False

    return score


def staged(counter: OpCounter):
    """A stand-in for the compactor's profiler ranges that tells ``counter`` the stage."""

    @contextlib.contextmanager
    def record(name: str):
        before, counter.stage = counter.stage, name.removeprefix("compaction.")
        try:
            yield
        finally:
            counter.stage = before

    return record


def build(args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from compaction_gym.engine import CompactionConfig, Engine

    config = Qwen3Config(
        hidden_size=128, num_hidden_layers=args.layers, num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads, head_dim=args.head_dim, intermediate_size=256, vocab_size=1024,
        max_position_embeddings=4096, attn_implementation="sdpa",
    )  # fmt: skip
    torch.manual_seed(0)
    dtype = getattr(torch, args.dtype or ("bfloat16" if args.device.startswith("cuda") else "float32"))
    model = Qwen3ForCausalLM._from_config(config, dtype=dtype).to(args.device).eval()
    n = args.sessions
    engine = Engine(model, None, max_slots=2 * n, capacity=args.kv_len + 64, fast=False)
    engine.compactor.batch_events = True
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=True, queries="suffix", n_probe_queries=args.probes
    )
    sids = []
    for i in range(n):
        g = torch.Generator().manual_seed(i)
        length = args.kv_len - 32 + int(torch.randint(0, 65, (1,), generator=g))
        ids = torch.randint(10, 1000, (length,), generator=g).tolist()
        sids.append(engine.create_session(ids, cfg).session_id)
    return engine, sids


def one_round(engine, sids, args, counter: OpCounter | None) -> float:
    """Seconds of one ``compact_many`` over forks of ``sids`` (forks closed afterwards)."""
    forks = [engine.fork(s) for s in sids]
    sessions = [engine.scheduler.get(f) for f in forks]
    requests = [(s, (args.prompt, args.prompt + args.window), 0.25, "kv_budget") for s in sessions]
    ctx = counter if counter is not None else contextlib.nullcontext()
    if engine.cache.k.is_cuda:
        torch.cuda.synchronize()  # the forks' copies are not the round's
    with ctx:
        t = time.perf_counter()
        events = engine.compactor.compact_many(requests)
        if engine.cache.k.is_cuda:
            torch.cuda.synchronize()
        sec = time.perf_counter() - t
    assert len(events) == len(sids) and all(e.target == args.window // 4 for e in events)
    for f in forks:
        engine.close(f)
    return sec


@torch.no_grad()
def measure(args) -> dict:
    from compaction_gym.engine import compactor as compactor_module

    torch.set_num_threads(1)
    engine, sids = build(args)
    engine.compactor.compact_fn = stub_scorer(None)
    one_round(engine, sids, args, None)  # warm-up
    times = [one_round(engine, sids, args, None) for _ in range(args.repeats)]
    counter = OpCounter()
    engine.compactor.compact_fn = stub_scorer(counter)
    # the ranges' name: profiler_range, record_function in revisions before it (--baseline)
    compactor_module.profiler_range = compactor_module.record_function = staged(counter)
    one_round(engine, sids, args, counter)
    n = args.sessions
    return {
        "us_per_event": statistics.median(times) / n * 1e6,
        "ops_per_event": sum(counter.counts.values()) / n,
        "by_stage": {k: v / n for k, v in sorted(counter.counts.items())},
        "top_ops": dict(counter.by_op.most_common(12)),
        "torch": torch.__version__,
        "package": str(Path(compactor_module.__file__).parents[2]),
    }


def checkout(rev: str, into: Path) -> Path:
    """``compaction_gym/`` of git revision ``rev`` extracted under ``into``."""
    root = Path(__file__).resolve().parents[1]
    tar = subprocess.run(["git", "archive", rev, "compaction_gym"], cwd=root, capture_output=True, check=True)
    with tarfile.open(fileobj=io.BytesIO(tar.stdout)) as t:
        t.extractall(into, filter="data")
    return into


def run_child(args, pythonpath: Path) -> dict:
    argv = [a for a in sys.argv[1:] if a != "--json"]
    if "--baseline" in argv:
        i = argv.index("--baseline")
        del argv[i : i + 2]
    env = {**os.environ, "PYTHONPATH": f"{pythonpath}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = subprocess.run(
        [sys.executable, __file__, *argv, "--json"], env=env, capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if args.json:
        print(json.dumps(measure(args)))
        return 0
    here = Path(__file__).resolve().parents[1]
    runs: dict[str, list[dict]] = {"current": []}
    with tempfile.TemporaryDirectory() as tmp:
        baseline = Path(tmp)
        if args.baseline:
            runs[args.baseline] = []
            if (Path(args.baseline) / "compaction_gym").is_dir():  # an extracted tree (no git on the device)
                baseline = Path(args.baseline).resolve()
            else:
                checkout(args.baseline, baseline)
        for _ in range(2):  # alternating, so that load drift on a shared machine hits both alike
            for name in runs:
                runs[name].append(run_child(args, here if name == "current" else baseline))
    print(
        f"{args.sessions} sessions, layout L={args.layers} H_q={args.heads} H_kv={args.kv_heads} d={args.head_dim}, "
        f"span {args.window} -> {args.window // 4}, kv_len {args.kv_len}±32, {args.probes} probes, {args.device}, "
        f"torch {runs['current'][0]['torch']}"
    )
    summary = {}
    for name, rs in runs.items():
        us = statistics.median(r["us_per_event"] for r in rs)
        ops = rs[0]["ops_per_event"]
        summary[name] = (us, ops)
        stages = ", ".join(f"{k} {v:.1f}" for k, v in rs[0]["by_stage"].items())
        print(f"{name}: {us:.0f} µs/event, {ops:.1f} ops/event ({stages})")
        print(f"    most frequent ops: {rs[0]['top_ops']}")
    if args.baseline:
        (us_b, ops_b), (us_c, ops_c) = summary[args.baseline], summary["current"]
        print(f"current ÷ {args.baseline}: time {us_c / us_b:.2f}×, ops {ops_c / ops_b:.2f}×")
    return 0


if __name__ == "__main__":
    sys.exit(main())
