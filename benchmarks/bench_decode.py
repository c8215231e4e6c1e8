"""Fast-path decode tokens/s vs the HBM floor and vs Hugging Face ``generate`` (GPU, one run).

For each model shape (real Qwen3-0.6B / Qwen3-4B configs by default; Qwen3-1.7B and Llama-3.2-1B,
the "No Bubbles" megakernel's model, on request; random bf16 weights), KV length and
batch size: the slots are filled with random K/V of that length, then
:meth:`FastModelRunner.generate` decodes ``--steps`` greedy tokens per row (CUDA-graph replays,
device sampling, one host check per 32 steps); the time is the median of ``--repeats`` runs.

* **floor** = (weight bytes + K/V/β bytes read per step) ÷ device-to-device copy bandwidth
  measured in the same run (bytes read + written); ``× floor`` = measured step time ÷ floor;
  **TB/s read** = those bytes ÷ the step time (to set against a nominal HBM bandwidth).
* **HF generate**: the same model with SDPA attention and its default dynamic cache, greedy,
  ``min_new_tokens = max_new_tokens``; decode time = generate(N + 1) − generate(1) on the same
  prompt, so prefill is excluded from both sides.
* batches of ≤ 32 rows (``GEMV_MAX_M``) run each projection on the Triton GEMV where the tuner
  measured it faster than cuBLAS; ``--compare-gemv`` also times them with cuBLAS only
  (``FastDecoder.use_gemv = False``) in the same run.
* fusions: ``--fusions default`` (the decoder's defaults: gate/up GEMV with the SiLU·mul epilogue
  where the tuner finds it faster, single-launch decode attention where a graph uses one split),
  ``all`` (single-launch attention at every split count too) or ``off``; ``--compare-fusions
  [MODE]`` also times every batch with fusions ``MODE`` (default ``off``) in the same run.
* batch 1: ``--persistent auto`` (default) lets the runner time the decoder layers as one
  persistent launch against the layered kernels and use it below the cache length where it stops
  being faster (``FastDecoder.use_persistent = None``); ``on`` / ``off`` force one; ``--compare-persistent`` also times batch 1 with both
  forced in the same run (columns "layered" and "one launch") and prints what ``auto`` picked; where the
  one launch is the tagged kernel (``engine/fast/tagged.py``: Qwen3-0.6B on Hopper), also with the Triton
  launch (column "Triton one launch").
* ``--phases``: also prints, per model and KV length, where the persistent launch's time goes at
  batch 1: per phase (A q/k/v, B attention, C output projection, D gate/up, E down) the barrier
  (first program out − last program in) and the slowest program's work, medians over layers, and
  attention's steps (q/k rotated, keys done, merge counter, merged), from the kernel's own
  global-timer stamps (``persistent_layers(timings=...)``).
* **first run +s**: how much longer the first run of a batch took than a timed one — the
  projections' tuning, Triton compiles (cached on disk after a machine's first run) and the graph
  capture of that batch-size bucket.
* ``--profile``: also prints, per batch, where a captured step's GPU time goes (torch profiler
  over one timed run: kernels grouped by name, launches and µs per step, share of the step, and
  how busy the GPU was between the first kernel's start and the last one's end).

Usage:
    python benchmarks/bench_decode.py                          # both shapes, batch 1/8/32/64, KV 1k/8k
    python benchmarks/bench_decode.py --models qwen3-0.6b --batches 1 32 --kv 1024
"""

from __future__ import annotations

import argparse
import gc
import statistics
import sys
from collections.abc import Callable

import torch
from gpu_shapes import (
    DEFAULT_SHAPES,
    copy_bandwidth,
    device_line,
    print_table,
    random_model,
    shape_names,
    wall_time,
)


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=list(DEFAULT_SHAPES), choices=shape_names())
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64])
    p.add_argument("--kv", type=int, nargs="+", default=[1024, 8192])
    p.add_argument("--steps", type=int, default=128, help="decode steps per timed run")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--hf-batches", type=int, nargs="*", default=[1], help="batches run by HF (none: skip)")
    p.add_argument("--hf-steps", type=int, default=32)
    p.add_argument("--memory-fraction", type=float, default=0.9, help="share of free GPU memory the cache may take")
    p.add_argument(
        "--compare-gemv", action="store_true", help="also time batches ≤ 32 with cuBLAS projections instead of the GEMVs"
    )
    p.add_argument("--fusions", choices=("default", "all", "off"), default="default", help="decoder fusions")
    p.add_argument(
        "--compare-fusions", nargs="?", const="off", choices=("default", "all", "off"),
        help="also time every batch with these fusions (default: off) in the same run",
    )  # fmt: skip
    p.add_argument(
        "--persistent", choices=("auto", "on", "off"), default="auto",
        help="batch 1: the decoder layers as one persistent launch (auto: where the runner timed it faster)",
    )  # fmt: skip
    p.add_argument(
        "--compare-persistent", action="store_true",
        help="also time batch 1 with the persistent launch forced off and on in the same run",
    )  # fmt: skip
    p.add_argument("--phases", action="store_true", help="also print the persistent launch's per-phase times")
    p.add_argument("--profile", action="store_true", help="also print each batch's per-kernel time breakdown")
    return p


#: ``--persistent`` → ``FastDecoder.use_persistent``
PERSISTENT = {"auto": None, "on": True, "off": False}


def set_fusions(runner, mode: str) -> None:
    """Set the decoder's fusions (``default``, ``all``, ``off``); the next step recaptures its graphs."""
    dec = runner.decoder
    dec.fuse_attention = {"default": None, "all": True, "off": False}[mode]
    dec.fuse_mlp = mode != "off"
    runner.recapture()


def kv_bytes_per_token(layout) -> int:
    """K + V (model dtype) + β (float32) bytes of one token across all layers and KV heads."""
    per_head = 2 * layout.head_dim * 2 + 4
    return layout.n_layers * layout.n_kv_heads * per_head


@torch.no_grad()
def hf_decode_tok_s(model, batch: int, kv: int, steps: int) -> float:
    """HF ``generate`` decode tokens/s (prefill time subtracted)."""
    model.set_attn_implementation("sdpa")
    ids = torch.randint(10, 1000, (batch, kv), device="cuda")
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)

    def run(n: int) -> None:
        model.generate(ids, max_new_tokens=n, min_new_tokens=n, **kw)

    run(2)
    t1 = statistics.median(wall_time(lambda: run(1)) for _ in range(2))
    tn = statistics.median(wall_time(lambda: run(steps + 1)) for _ in range(2))
    return batch * steps / max(tn - t1, 1e-9)


def decode_run(runner, batch: int, kv: int, steps: int) -> Callable[[], None]:
    """A function that decodes ``steps`` greedy tokens for ``batch`` rows from KV length ``kv``."""
    from compaction_gym.engine.config import SamplingParams

    slots = list(range(batch))
    greedy = [SamplingParams(temperature=0.0)] * batch

    def run() -> None:
        lengths = list(runner.cache.lengths)  # the cache is the only writer of slot lengths
        for s in slots:
            lengths[s] = kv
        runner.cache.restore_lengths(lengths)
        runner.generate(slots, [11] * batch, [kv] * batch, greedy, steps)

    return run


def time_generate(runner, batch: int, kv: int, steps: int, repeats: int) -> tuple[float, float]:
    """Seconds per greedy decode step of ``batch`` rows at KV length ``kv`` (median of ``repeats``),
    and seconds the first run took beyond a timed one (tuning, Triton compiles, graph capture)."""
    run = decode_run(runner, batch, kv, steps)
    first = wall_time(run)  # tunes the projections, captures the graph
    step = statistics.median(wall_time(run) for _ in range(repeats)) / steps
    return step, first - step * steps


def kernel_profile(run: Callable[[], None], steps: int, title: str) -> None:
    """Print where the GPU time of ``run`` (``steps`` decode steps, graph already captured) goes."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run()
    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name) for e in prof.events() if e.device_type == DeviceType.CUDA
    )
    if not spans:
        print(f"{title}: the profiler saw no kernels", flush=True)
        return
    per_name: dict[str, list[float]] = {}
    busy, reach = 0.0, spans[0][0]
    for start, end, name in spans:
        per_name.setdefault(name[:60], []).append(end - start)
        busy += max(0.0, end - max(start, reach))
        reach = max(reach, end)
    total = sum(sum(t) for t in per_name.values())
    rows = [
        [name, len(t) / steps, sum(t) / steps, statistics.median(t), sum(t) / total]
        for name, t in sorted(per_name.items(), key=lambda kv: -sum(kv[1]))
    ]
    rows.append(["all kernels", sum(len(t) for t in per_name.values()) / steps, total / steps, "", 1.0])
    span = spans[-1][1] - spans[0][0]
    print_table(
        ["kernel", "launches/step", "µs/step", "median µs", "share"],
        rows,
        title=f"{title}: GPU busy {busy / span:.1%} of {span / steps:.1f} µs/step",
    )


@torch.no_grad()
def phase_profile(runner, kv: int, title: str) -> None:
    """Print the persistent launch's phase times for one row of ``kv`` cached rows (slot 0, its last row free)."""
    from compaction_gym.engine.fast.persistent import build_plan, persistent_layers, persistent_supported

    dec, c = runner.decoder, runner.cache
    reason = persistent_supported(dec)
    if reason is not None:
        print(f"{title}: no persistent launch ({reason})", flush=True)
        return
    plan = build_plan(dec)
    t = lambda v: torch.tensor([v], device="cuda")  # noqa: E731
    inputs = (t(11), t(kv), t(0), t(c.capacity - 1), t(kv), c.k, c.v, c.beta)
    stamps = torch.zeros(dec.sm_count, 4096, dtype=torch.int64, device="cuda")
    with torch.no_grad():
        for _ in range(3):
            persistent_layers(dec, plan, *inputs)
        persistent_layers(dec, plan, *inputs, timings=stamps)
    torch.cuda.synchronize()
    ts = stamps.double().cpu() / 1e3  # µs
    n_layers, barriers = dec.n_layers, 5 * dec.n_layers
    arrive, leave, after = ts[:, 0 : 2 * barriers : 2], ts[:, 1 : 2 * barriers : 2], ts[:, 2 : 2 * barriers + 1 : 2]
    wait = leave.min(0).values - arrive.max(0).values
    work = (after - leave).max(0).values
    rows = []
    for j, phase in enumerate(("A q/k/v", "B attention", "C output", "D gate/up", "E down")):
        rows.append([phase, wait[j::5][1:].median().item(), work[j::5][1:].median().item()])
    span = (ts[:, 2 * barriers].max() - ts[:, 0].min()).item()
    print_table(["phase", "barrier µs", "work µs (slowest program)"], rows, title=f"{title}: persistent launch {span:.0f} µs")
    b_leave = leave[:, 1::5].min(0).values  # per layer: the first program out of the barrier before B
    marks = [ts[:, 3000 + k : 3000 + 4 * n_layers : 4] - b_leave for k in range(4)]
    steps = ("q/k rotated", "keys done", "merge counter", "merged")
    cells = [m[m > -1e6].median().item() if k < 3 else (m[ts[:, 3003 : 3000 + 4 * n_layers : 4] > 0]).median().item()
             for k, m in enumerate(marks)]  # fmt: skip
    print(f"{title}: attention after its barrier (µs, medians): " + ", ".join(f"{s} {v:.2f}" for s, v in zip(steps, cells)))


def bench_model(name: str, args, bandwidth: float) -> list[list[object]]:
    from compaction_gym.engine.fast.gemv import GEMV_MAX_M
    from compaction_gym.engine.fast.runner import FastModelRunner
    from compaction_gym.engine.model_runner import ModelLayout
    from compaction_gym.engine.slot_cache import SlotKVCache

    model = random_model(name)
    hf = {}
    for b in args.hf_batches:
        for kv in args.kv:
            hf[(b, kv)] = hf_decode_tok_s(model, b, kv, args.hf_steps)
            print(f"[{name}] HF generate batch {b} kv {kv}: {hf[(b, kv)]:.1f} tok/s", flush=True)
    model.set_attn_implementation("compaction_gym")
    layout = ModelLayout.from_model(model)
    rows = []
    for kv in args.kv:
        capacity = kv + args.steps + 8
        free, _ = torch.cuda.mem_get_info()
        per_slot = kv_bytes_per_token(layout) * capacity
        fits = int(free * args.memory_fraction - (2 << 30)) // per_slot
        batches = [b for b in args.batches if b <= fits]
        for b in args.batches:
            if b > fits:
                rows.append([name, b, kv, "does not fit", *[""] * 13])
        if not batches:
            continue
        cache = SlotKVCache(
            layout.n_layers, layout.n_kv_heads, layout.head_dim, max(batches), capacity, torch.bfloat16, torch.device("cuda")
        )
        cache.k.normal_()
        cache.v.normal_()
        runner = FastModelRunner(model, cache, layout)
        set_fusions(runner, args.fusions)
        mode = PERSISTENT[args.persistent]
        runner.decoder.use_persistent = mode
        weight_bytes = runner.decoder.weight_bytes()
        for b in batches:
            step, setup = time_generate(runner, b, kv, args.steps, args.repeats)
            cublas = ""
            if args.compare_gemv and b <= GEMV_MAX_M:
                for use in (False, True):  # recapture without, then again with the GEMVs
                    runner.decoder.use_gemv = use
                    runner.recapture()
                    if not use:
                        cublas = time_generate(runner, b, kv, args.steps, args.repeats)[0] * 1e3
            unfused = ""
            if args.compare_fusions and args.compare_fusions != args.fusions:
                set_fusions(runner, args.compare_fusions)
                unfused = time_generate(runner, b, kv, args.steps, args.repeats)[0] * 1e3
                set_fusions(runner, args.fusions)
            forced = {}
            if args.compare_persistent and b == 1:
                dec = runner.decoder
                kernel = dec.persistent_kernel
                for use in (False, True):
                    dec.use_persistent = use
                    runner.recapture()
                    forced[use] = time_generate(runner, b, kv, args.steps, args.repeats)[0] * 1e3
                if kernel == "tagged":  # the Triton launch too, in the same run
                    dec.persistent_kernel = "triton"
                    runner.recapture()
                    forced["triton"] = time_generate(runner, b, kv, args.steps, args.repeats)[0] * 1e3
                    dec.persistent_kernel = kernel
                dec.use_persistent = mode
                runner.recapture()
            dec = runner.decoder
            pick = (dec.persistent_max_len is not None and kv < dec.persistent_max_len) if mode is None else mode
            kv_read = b * (kv + args.steps / 2) * kv_bytes_per_token(layout)
            floor = (weight_bytes + kv_read) / bandwidth
            hf_tps = hf.get((b, kv))
            tps = b / step
            rows.append([
                name, b, kv, tps, step * 1e3, floor * 1e3, step / floor, (weight_bytes + kv_read) / step / 1e12,
                hf_tps if hf_tps else "", tps / hf_tps if hf_tps else "", cublas, unfused,
                forced.get(False, ""), forced.get(True, ""), forced.get("triton", ""),
                (f"one launch ({dec.persistent_kernel})" if pick else "layered") if b == 1 else "", setup,
            ])  # fmt: skip
            print(f"[{name}] batch {b} kv {kv}: {tps:.0f} tok/s, {step * 1e3:.3f} ms/step, {step / floor:.2f}x floor", flush=True)
            if b == 1:
                times = {f"{'one launch' if k[0] else 'layered'} @ {k[1]}": f"{v * 1e3:.3f} ms" for k, v in dec.persistent_times.items()}
                print(f"[{name}] batch 1 ran {'one launch' if pick else 'layered'} (below {dec.persistent_max_len} rows: one launch; timed {times})", flush=True)
            if args.phases and b == 1:
                phase_profile(runner, kv, f"[{name}] kv {kv}")
            if args.profile:
                kernel_profile(decode_run(runner, b, kv, args.steps), args.steps, f"[{name}] batch {b} kv {kv}")
        chosen = {k: v[1] for k, v in runner.decoder._gemv_choice.items() if v}
        print(f"[{name}] GEMV instead of cuBLAS for (shape, rows, bias, act): {chosen}", flush=True)
        del runner, cache
        gc.collect()
        torch.cuda.empty_cache()
    del model
    gc.collect()
    torch.cuda.empty_cache()
    return rows


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_decode needs a CUDA device", file=sys.stderr)
        return 2
    bandwidth = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {bandwidth / 1e12:.2f} TB/s (read + write)", flush=True)
    rows = []
    for name in args.models:
        rows += bench_model(name, args, bandwidth)
    print()
    headers = [
        "model", "batch", "KV", "fast tok/s", "ms/step", "floor ms", "× floor", "TB/s read", "HF tok/s", "fast / HF",
        "cuBLAS ms/step", f"fusions {args.compare_fusions or '—'} ms/step", "layered ms/step", "one launch ms/step",
        "Triton one launch ms/step", "batch 1 ran", "first run +s",
    ]  # fmt: skip
    print_table(
        headers,
        rows,
        title=f"Decode, {device_line()}; copy bandwidth {bandwidth / 1e12:.2f} TB/s; {args.steps} greedy steps"
        + f"; fusions {args.fusions}; persistent {args.persistent}",
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
