"""Kernels of the fast path against what they replace (GPU): small-batch GEMVs, β's NNLS, Cholesky.

* **GEMV** — :func:`compaction_gym.engine.fast.gemv.gemv` (its tilings ``GEMV_CANDIDATES``) vs
  ``torch.nn.functional.linear`` (cuBLAS) on the projections of the real Qwen3-0.6B / Qwen3-4B
  shapes (bf16, random data) at ``M`` = 1, 8, 16, 32 rows. Times are CUDA-graph replays of 32
  launches (several weight copies in rotation, so weights come from HBM), median of
  ``--repeats``. ``GB/s`` counts the weight bytes only (the faster of the two). Each case is
  checked against the torch reference first.
* **NNLS** — β's problem of one compaction event (Qwen3-4B shape: 288 problems, ``t`` = 256,
  Gram matrices of a ``[1024, 256]`` span-softmax design from random keys/queries): the FISTA
  kernel (float32 / float16 ``Ĝ``) vs the torch FISTA loop and the
  package's projected Newton with 2 steps (the fast path's previous solver); objective relative to
  the converged projected Newton.
* **Cholesky** — C2's normal products ``xᵀx``, ``xᵀy`` (``[288, 1024, 256]`` design, 128 targets):
  torch's float32 products vs :func:`compaction_gym.engine.fast.ridge.normal_products` on either
  memory layout; ``torch.linalg.cholesky_ex`` of ``[288, 256, 256]`` with cuSOLVER and MAGMA; and
  C2's ridge solve of that system with 128 right-hand sides: ``cholesky_solve`` (before), cuSOLVER's
  factor + two triangular solves (``cholesky_solve_ex``) and the fast path's kernels
  (``ridge.cholesky_solve``), each with its error vs float64.
* ``--attention``: instead, a grid of decode-attention launches (splits, keys per step, warps,
  pipeline stages) at the runner's shapes (batch 1 / 32, KV 1k / 8k, one layer of a slot cache with
  several layers in rotation), against the runner's choice and the floor = KV bytes ÷ copy bandwidth.

Usage:
    python benchmarks/bench_fast_kernels.py
    python benchmarks/bench_fast_kernels.py --skip gemv nnls     # C2's products and solve only
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from gpu_shapes import DEFAULT_SHAPES, device_line, print_table, shape_config, shape_names, wall_time


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--rows", type=int, nargs="+", default=[1, 8, 16, 32])
    p.add_argument("--skip", nargs="*", default=[], choices=["gemv", "nnls", "cholesky"])
    p.add_argument(
        "--sweep", nargs="*", default=None, metavar="MODEL/PROJECTION",
        help="instead: time a grid of GEMV tilings (block sizes, programs per SM, warps) on these "
        "projections (e.g. qwen3-4b/o; none given: every projection) and print the best per shape",
    )  # fmt: skip
    p.add_argument(
        "--grid", nargs="*", default=None, metavar="PARAM=V1,V2",
        help="with --sweep: the tilings to time instead of SWEEP_GRID (e.g. block_n=16,32 split=1 num_stages=3,4); "
        "with --attention: values replacing ATTENTION_GRID's (e.g. num_warps=1,2,4 split_factor=0.5,1)",
    )  # fmt: skip
    p.add_argument("--attention", action="store_true", help="instead: sweep decode-attention launches")
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32], help="with --attention")
    p.add_argument("--kv", type=int, nargs="+", default=[1024, 8192], help="with --attention")
    p.add_argument("--models", nargs="+", default=list(DEFAULT_SHAPES), choices=shape_names(), help="with --attention")
    return p


def graph_time(fn, launches: int = 32, repeats: int = 10) -> float:
    """Median seconds per call of ``fn`` replayed in a CUDA graph of ``launches`` calls."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for _ in range(2):
            fn(0)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(launches):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3 / launches)
    return statistics.median(times)


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


@torch.no_grad()
def gemv_case(name: str, case: str, n: int, k: int, args) -> list[list[object]]:
    """Time one projection shape at every ``M`` of ``args.rows`` (see the module docstring)."""
    from compaction_gym.engine.fast.gemv import GEMV_CANDIDATES, gemv, gemv_ref

    dt = torch.bfloat16
    copies = max(2, min(32, (512 << 20) // (n * k * 2)))  # rotate through more bytes than L2 holds
    ws = [torch.randn(n, k, device="cuda", dtype=dt) * k**-0.5 for _ in range(copies)]
    rows = []
    for m in args.rows:
        x = torch.randn(m, k, device="cuda", dtype=dt)
        check = max(rel(gemv(x, ws[0], **c), gemv_ref(x, ws[0])) for c in GEMV_CANDIDATES)
        cublas = graph_time(lambda i, x=x: torch.nn.functional.linear(x, ws[i % copies]), repeats=args.repeats)
        times = [
            graph_time(lambda i, x=x, c=c: gemv(x, ws[i % copies], **c), repeats=args.repeats) for c in GEMV_CANDIDATES
        ]
        best = min(times)
        rows.append([
            name, case, m, f"{n}×{k}", cublas * 1e6, *(t * 1e6 for t in times), cublas / best,
            n * k * 2 / min(best, cublas) / 1e9, f"{check:.1e}",
        ])  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def projection_shapes() -> dict[str, tuple[int, int]]:
    """``"model/projection"`` → ``(N, K)`` of every decode projection of the :data:`DEFAULT_SHAPES`."""
    shapes = {}
    for name in DEFAULT_SHAPES:
        sh = shape_config(name)
        h, inter, d = sh["hidden_size"], sh["intermediate_size"], sh["head_dim"]
        shapes[f"{name}/qkv"] = ((sh["num_attention_heads"] + 2 * sh["num_key_value_heads"]) * d, h)
        shapes[f"{name}/o"] = (h, sh["num_attention_heads"] * d)
        shapes[f"{name}/gate_up"] = (2 * inter, h)
        shapes[f"{name}/down"] = (h, inter)
        shapes[f"{name}/lm_head"] = (sh["vocab_size"], h)
    return shapes


def bench_gemv(args) -> list[list[object]]:
    rows = []
    for key, (n, k) in projection_shapes().items():
        rows += gemv_case(*key.split("/"), n, k, args)
        torch.cuda.empty_cache()
    return rows


#: The grid ``--sweep`` times (every combination).
SWEEP_GRID = {"block_n": (16, 32, 64), "block_k": (128, 256), "programs_per_sm": (2, 4, 8), "num_warps": (4, 8)}


def parse_grid(items: list[str]) -> dict[str, tuple]:
    """``["block_n=16,32", "split=1"]`` → ``{"block_n": (16, 32), "split": (1,)}`` (``none``: the default)."""
    grid = {}
    for item in items:
        name, _, values = item.partition("=")
        if not values:
            raise SystemExit(f"--grid: {item!r} is not PARAM=V1,V2")
        grid[name] = tuple(None if v.lower() == "none" else float(v) if "." in v else int(v) for v in values.split(","))
    return grid


def fastest(time_one, grid: dict[str, tuple], n: int = 3) -> list[tuple[float, dict]]:
    """The ``n`` fastest of every combination of ``grid``'s values, as ``(seconds, combination)``."""
    import itertools

    combos = [dict(zip(grid, values)) for values in itertools.product(*grid.values())]
    return sorted(((time_one(c), c) for c in combos), key=lambda tc: tc[0])[:n]


@torch.no_grad()
def sweep_gemv(args) -> list[list[object]]:
    """Every :data:`SWEEP_GRID` tiling on the chosen projections; the best three per (shape, M)."""
    from compaction_gym.engine.fast.gemv import gemv, gemv_ref

    shapes = projection_shapes()
    names = args.sweep or list(shapes)
    unknown = [n for n in names if n not in shapes]
    if unknown:
        raise SystemExit(f"--sweep: unknown projections {unknown}; valid: {list(shapes)}")
    rows = []
    for key in names:
        n, k = shapes[key]
        copies = max(2, min(32, (512 << 20) // (n * k * 2)))
        ws = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * k**-0.5 for _ in range(copies)]
        for m in args.rows:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            cublas = graph_time(lambda i, x=x, w=ws: torch.nn.functional.linear(x, w[i % len(w)]), repeats=args.repeats)

            def time(c: dict, x=x, ws=ws, key=key, m=m) -> float:
                if rel(gemv(x, ws[0], **c), gemv_ref(x, ws[0])) > 1e-2:
                    raise AssertionError(f"{key} M={m} {c}: GEMV disagrees with the reference")
                return graph_time(lambda i: gemv(x, ws[i % len(ws)], **c), repeats=args.repeats)

            default = time({})
            for rank, (t, c) in enumerate(fastest(time, parse_grid(args.grid) if args.grid else SWEEP_GRID)):
                rows.append([
                    key, m, f"{n}×{k}", rank + 1, " ".join(f"{a}={b}" for a, b in c.items()), t * 1e6,
                    default * 1e6, cublas * 1e6, cublas / t, n * k * 2 / t / 1e9,
                ])  # fmt: skip
                print(rows[-1], flush=True)
        ws.clear()
        torch.cuda.empty_cache()
    return rows


#: The launches ``--attention`` times (every combination; splits as multiples of the runner's).
ATTENTION_GRID = {
    "split_factor": (0.5, 1, 2, 4),
    "block_n": (32, 64, 128),
    "num_warps": (4, 8),
    "num_stages": (2, 3),
}


@torch.no_grad()
def attention_case(name: str, batch: int, kv: int, args, bw: float) -> list[list[object]]:
    """Every :data:`ATTENTION_GRID` launch of ``decode_attention`` on one (model, batch, KV): the
    runner's choice and the best three, as × the floor (KV bytes ÷ the copy bandwidth ``bw``)."""
    from compaction_gym.engine.fast.attention import decode_attention, decode_attention_sdpa, num_splits_for

    sh = shape_config(name)
    n_q, n_kv, d = sh["num_attention_heads"], sh["num_key_value_heads"], sh["head_dim"]
    per_layer = batch * n_kv * kv * d * 2 * 2  # K and V, bf16
    layers = max(2, min(sh["num_hidden_layers"], (512 << 20) // per_layer))
    shape = (batch, layers, n_kv, kv, d)  # the slot cache's layout; one layer per call, rotating
    k = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    v = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    beta = torch.zeros(batch, layers, n_kv, kv, device="cuda")
    q = torch.randn(batch, n_q, d, device="cuda", dtype=torch.bfloat16)
    slots = torch.arange(batch, device="cuda")
    lens = torch.full((batch,), kv, device="cuda", dtype=torch.int32)
    base = num_splits_for(batch, n_kv, kv, torch.cuda.get_device_properties(0).multi_processor_count)
    ref = decode_attention_sdpa(q, k[:, 0], v[:, 0], beta[:, 0], slots, lens, d**-0.5)
    floor = per_layer / bw

    def splits(c: dict) -> int:
        return max(1, int(base * c["split_factor"]))

    def time(c: dict) -> float:
        kw = dict(block_n=c["block_n"], num_warps=c["num_warps"], num_stages=c["num_stages"])

        def call(i: int) -> torch.Tensor:
            j = i % layers
            return decode_attention(
                q, k[:, j], v[:, j], beta[:, j], slots, lens, d**-0.5, splits(c), fused_merge=splits(c) == 1, **kw
            )

        if rel(call(0), ref) > 2e-2:
            raise AssertionError(f"{name} b{batch} kv{kv} {c}: attention disagrees with SDPA")
        return graph_time(call, repeats=args.repeats)

    default = time({"split_factor": 1, "block_n": 64, "num_warps": 4, "num_stages": 2})
    rows = []
    for rank, (t, c) in enumerate(fastest(time, {**ATTENTION_GRID, **parse_grid(args.grid or [])})):
        launch = " ".join([f"splits={splits(c)}"] + [f"{a}={b}" for a, b in c.items() if a != "split_factor"])
        rows.append([
            name, batch, kv, rank + 1, launch, t * 1e6, t / floor, default * 1e6, default / floor, per_layer / t / 1e9,
        ])  # fmt: skip
        print(rows[-1], flush=True)
    return rows


def sweep_attention(args) -> list[list[object]]:
    """:func:`attention_case` on every (model, batch, KV) of the arguments."""
    import itertools

    from gpu_shapes import copy_bandwidth

    bw = copy_bandwidth()
    rows = []
    for name, batch, kv in itertools.product(args.models, args.batches, args.kv):
        rows += attention_case(name, batch, kv, args, bw)
        torch.cuda.empty_cache()
    return rows


@torch.no_grad()
def nnls_problem(seed: int = 0):
    """β's Gram system of one 4B-shaped event (288 problems, t = 256, 1024 probes)."""
    from compaction_gym.engine.fast.compaction import _span_stats

    sh = shape_config("qwen3-4b")
    b, d = sh["num_hidden_layers"] * sh["num_key_value_heads"], sh["head_dim"]
    g = torch.Generator(device="cuda").manual_seed(seed)
    keys = torch.randn(b, 2048, d, device="cuda", generator=g).to(torch.bfloat16)
    values = torch.randn(b, 2048, d, device="cuda", generator=g).to(torch.bfloat16)
    queries = torch.randn(b, 1024, d, device="cuda", generator=g).to(torch.bfloat16)
    span, scale = (256, 1280), d**-0.5
    _, lse_span, _, imp = _span_stats(keys, values, queries, span, scale, None)
    idx = torch.sort(torch.topk(imp, 256, dim=-1).indices, -1).values + span[0]
    kept = torch.gather(keys, 1, idx[:, :, None].expand(-1, -1, d)).float()
    design = torch.exp(queries.float() @ kept.mT * scale - lse_span[:, :, None])
    return design


@torch.no_grad()
def bench_nnls(args) -> list[list[object]]:
    from compaction_gym.compaction.beta import nnls
    from compaction_gym.engine.fast.compaction import _gram
    from compaction_gym.engine.fast.nnls import nnls_fista, nnls_fista_torch

    design = nnls_problem()
    gram32, rhs32 = design.mT @ design, design.sum(1)
    gram, rhs = _gram(design.to(torch.bfloat16))

    def objective(w: torch.Tensor) -> float:
        beta = torch.log(w.clamp_min(torch.finfo(torch.float32).tiny)).clamp(-30, 30)
        return ((design @ beta.exp()[:, :, None])[..., 0] - 1).pow(2).sum().item()

    ref = objective(nnls(gram32, rhs32))
    variants = {
        "projected Newton, 2 steps (previous)": lambda: nnls(gram, rhs, max_iter=2, damping=1e-6),
        "FISTA torch loop, 128 it.": lambda: nnls_fista_torch(gram, rhs, 128),
        "FISTA kernel fp32 Ĝ, 128 it.": lambda: nnls_fista(gram, rhs, 128, g_dtype=torch.float32),
        "FISTA kernel fp16 Ĝ, 128 it.": lambda: nnls_fista(gram, rhs, 128, g_dtype=torch.float16),
        "FISTA kernel fp16 Ĝ, 96 it.": lambda: nnls_fista(gram, rhs, 96, g_dtype=torch.float16),
        "FISTA kernel fp16 Ĝ, 192 it.": lambda: nnls_fista(gram, rhs, 192, g_dtype=torch.float16),
    }
    rows = [["bf16 Gram (_gram)", statistics.median(wall_time(lambda: _gram(design.to(torch.bfloat16))) for _ in range(5)) * 1e3, ""]]
    rows.append(["fp32 Gram", statistics.median(wall_time(lambda: (design.mT @ design, design.sum(1))) for _ in range(5)) * 1e3, ""])
    torch_out = nnls_fista_torch(gram, rhs, 128, g_dtype=torch.float16)
    for name, fn in variants.items():
        w = fn()
        t = statistics.median(wall_time(fn) for _ in range(args.repeats))
        note = f"objective / converged {objective(w) / ref:.5f}"
        if "kernel fp16" in name and "128" in name:
            note += f", vs torch loop rel {rel(w, torch_out):.1e}"
        rows.append([name, t * 1e3, note])
        print(rows[-1], flush=True)
    return rows


@torch.no_grad()
def bench_cholesky(args) -> list[list[object]]:
    from compaction_gym.compaction.values import ridge_system
    from compaction_gym.engine.fast.ridge import normal_products

    design = nnls_problem()
    x = torch.softmax(torch.log(design), -1)  # C2's design softmax(S_sel): the event's [B, n, t]
    y = torch.randn(x.shape[0], x.shape[1], 128, device=x.device)  # C2's targets (d = 128)
    prior = torch.randn(x.shape[0], x.shape[2], 128, device=x.device)  # the kept rows' values
    rows = []
    x64, y64 = x.double(), y.double()
    ref = (x64.mT @ x64, x64.mT @ y64)

    def err(out: tuple[torch.Tensor, torch.Tensor]) -> str:
        rel = [((o.double() - r).norm() / r.norm()).item() for o, r in zip(out, ref)]
        return f"rel. error vs float64 {rel[0]:.1e} / {rel[1]:.1e}"

    # the event writes both designs with the probes contiguous (what the tensor cores take)
    xt, yt = x.mT.contiguous().mT, y.mT.contiguous().mT
    before = None
    for name, fn in (
        ("C2 products xᵀx, xᵀy: torch float32 (before)", lambda: (x.mT @ x, x.mT @ y)),
        ("C2 products: normal_products, rows contiguous", lambda: normal_products(x, y)),
        ("C2 products: normal_products, probes contiguous (used)", lambda: normal_products(xt, yt)),
    ):
        out = fn()
        t = statistics.median(wall_time(fn) for _ in range(args.repeats))
        before = before or t
        rows.append([name, t * 1e3, f"{before / t:.2f}× before; {err(out)}"])
        print(rows[-1], flush=True)
    a, rhs, _ = ridge_system(x, y, prior, 1e-4)  # C2's normal equations
    prev = torch.backends.cuda.preferred_linalg_library()
    for lib in ("cusolver", "magma"):
        try:
            torch.backends.cuda.preferred_linalg_library(lib)
            torch.linalg.cholesky_ex(a)
            t = statistics.median(wall_time(lambda: torch.linalg.cholesky_ex(a)) for _ in range(args.repeats))
            rows.append([f"cholesky_ex [288, 256, 256] {lib}", t * 1e3, ""])
        except RuntimeError as e:  # a build without MAGMA
            rows.append([f"cholesky_ex {lib}", "", str(e)[:60]])
        finally:
            torch.backends.cuda.preferred_linalg_library(prev)
        print(rows[-1], flush=True)
    solves = c2_solves(a, rhs, args.repeats)
    before = solves[1][1]  # cholesky_solve_ex: what the fast path ran before its kernels
    for name, ms, error in solves:
        rows.append([name, ms, f"{before / max(ms, 1e-6):.2f}× before; rel. error vs float64 {error:.1e}"])
        print(rows[-1], flush=True)
    return rows


def c2_solves(a: torch.Tensor, rhs: torch.Tensor, repeats: int) -> list[tuple[str, float, float]]:
    """C2's ridge system ``a c = rhs`` solved the old ways (``cholesky_solve``: MAGMA's triangular
    solves and a host check; ``cholesky_solve_ex``: cuSOLVER's factor and two triangular solves, no
    host sync) and the fast path's kernels (``engine.fast.ridge.cholesky_solve``): ms per solve
    (factorisation included; the kernels' copy of ``a``, which they overwrite, timed apart and
    subtracted) and relative error against a float64 solve."""
    from compaction_gym.compaction.values import cholesky_solve_ex
    from compaction_gym.engine.fast.ridge import cholesky_solve

    ref = torch.linalg.solve(a.double(), rhs.double())
    copy = statistics.median(wall_time(lambda: a.clone()) for _ in range(repeats))
    out = []
    for name, fn, overhead in (
        ("C2 solve: cholesky_ex + cholesky_solve (an earlier main)",
         lambda: torch.cholesky_solve(rhs, torch.linalg.cholesky_ex(a)[0]), 0.0),
        ("C2 solve: cholesky_solve_ex (cuSOLVER, no host sync; before)", lambda: cholesky_solve_ex(a, rhs)[0], 0.0),
        ("C2 solve: ridge.cholesky_solve kernels (used)", lambda: cholesky_solve(a.clone(), rhs)[0], copy),
    ):  # fmt: skip
        sol = fn()
        t = statistics.median(wall_time(fn) for _ in range(repeats)) - overhead
        out.append((name, t * 1e3, ((sol.double() - ref).norm() / ref.norm()).item()))
    return out


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_fast_kernels needs a CUDA device", file=sys.stderr)
        return 2
    tables = []
    if args.attention:
        headers = ["model", "batch", "KV", "rank", "launch", "µs", "× floor", "default µs", "default × floor", "GB/s"]
        tables.append((headers, sweep_attention(args), "Decode attention launches (bf16, one layer, CUDA-graph replays)"))
        args.skip = ["gemv", "nnls", "cholesky"]
    elif args.sweep is not None:
        headers = ["projection", "M", "N×K", "rank", "tiling", "µs", "default GEMV µs", "cuBLAS µs",
                   "cuBLAS / this", "GB/s"]  # fmt: skip
        tables.append((headers, sweep_gemv(args), "GEMV tilings (bf16, CUDA-graph replays)"))
        args.skip = ["gemv", "nnls", "cholesky"]
    if "nnls" not in args.skip:
        tables.append((["solver (288 problems, t = 256)", "ms", "note"], bench_nnls(args), "β's NNLS"))
    if "cholesky" not in args.skip:
        tables.append((["factorisation", "ms", "note"], bench_cholesky(args), "Cholesky"))
    if "gemv" not in args.skip:
        tables.append((
            ["model", "projection", "M", "N×K", "cuBLAS µs", "GEMV BK128 µs", "GEMV BK256 µs", "GEMV BK512 µs",
             "best GEMV speed-up", "best GB/s", "rel. err"],
            bench_gemv(args), "GEMV (bf16, CUDA-graph replays)",
        ))  # fmt: skip
    print()
    for headers, rows, title in tables:
        print_table(headers, rows, title=f"{title}; {device_line()}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
