"""Row gathers (GPU): :func:`~compaction_gym.engine.fast.gather.gather_rows` against
``torch.nn.functional.embedding``, the lookup it replaces in one-pass replay, in the same run.

The shapes are one-pass replay's at the 0.6B shape (``bench_replay.py --batch 8 --turns 40``: 8
KV heads × ~28.5k token rows of 128 bf16, about a million rows gathered per call, each piece's rows
a run of increasing positions), plus a smaller call and the 4B head dim. ``TB/s`` counts the rows
read plus the rows written; forward + backward adds the gradient's sums (embedding's backward in
both). Median of ``--repeats`` CUDA-event timings of 10 calls each.

Usage:
    python benchmarks/bench_gather.py
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from gpu_shapes import cuda_time, device_line, print_table

from compaction_gym.engine.fast.gather import gather_rows

#: (source rows, gathered rows, row width)
SHAPES = [(230_000, 1_000_000, 128), (230_000, 250_000, 128), (230_000, 1_000_000, 64)]


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    return p


def piece_indices(rows: int, n: int, run: int = 640, spread: int = 700, seed: int = 0) -> torch.Tensor:
    """``n`` indices in runs of ``run`` increasing rows drawn from windows of ``spread`` (a piece's
    snapshot and own rows), window starts at random."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    starts = torch.randint(0, rows - spread, (n // run + 1,), generator=g, device="cuda")
    offsets = torch.randint(0, spread, (starts.numel(), run), generator=g, device="cuda").sort(1).values
    return (starts[:, None] + offsets).reshape(-1)[:n]


def timed(fn, repeats: int) -> float:
    fn()
    return statistics.median(cuda_time(lambda: [fn() for _ in range(10)]) / 10 for _ in range(repeats))


def measure(src_rows: int, n: int, d: int, dtype: torch.dtype, repeats: int) -> list[object]:
    """One table row: both lookups forward, then forward + backward, at one shape."""
    x = torch.randn(src_rows, d, device="cuda", dtype=dtype)
    idx = piece_indices(src_rows, n)
    if not torch.equal(gather_rows(x, idx), torch.nn.functional.embedding(idx, x)):
        raise SystemExit("gather_rows differs from embedding")
    tb = 2 * n * d * x.element_size() / 1e12
    emb = timed(lambda: torch.nn.functional.embedding(idx, x), repeats)
    ours = timed(lambda: gather_rows(x, idx), repeats)
    xg = x.clone().requires_grad_(True)
    grad = torch.randn(n, d, device="cuda", dtype=dtype)

    def both(lookup):
        def run() -> None:
            lookup(xg).backward(grad)
            xg.grad = None

        return run

    emb_b = timed(both(lambda w: torch.nn.functional.embedding(idx, w)), repeats)
    ours_b = timed(both(lambda w: gather_rows(w, idx)), repeats)
    return [
        f"{src_rows:,} → {n:,} × {d}", 1e3 * emb, tb / emb, 1e3 * ours, tb / ours, emb / ours,
        1e3 * emb_b, 1e3 * ours_b, emb_b / ours_b,
    ]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gather needs a CUDA device", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype)
    rows = [measure(src_rows, n, d, dtype, args.repeats) for src_rows, n, d in SHAPES]
    print(f"\n{device_line()}; {args.dtype}\n")
    print_table(
        ["rows (source → gathered × d)", "embedding ms", "TB/s", "gather_rows ms", "TB/s", "speed-up",
         "fwd+bwd embedding ms", "fwd+bwd gather_rows ms", "speed-up"],
        rows,
    )  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
