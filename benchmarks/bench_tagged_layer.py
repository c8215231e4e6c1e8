"""Session 38's capped, tagged stream laid out as a real Qwen3-0.6B layer, against the engine's one launch (GPU).

``bench_layer_chain.py`` found that a stream whose inputs carry their own tags, with at most 16–32 KB
of weights requested and not yet landed per block, runs its synthetic layer (five identical
phases) in 0.86–0.91 of today's persistent-kernel pattern. This benchmark asks whether that holds
for a layer with Qwen3-0.6B's bytes at 1,024 cached rows (35.7 MB: q/k/v, the K/V cache, the
output projection, gate/up, down) and its six hand-offs: the residual to q/k/v, each KV head's
q/k/v rows to its 16 attention splits (a local hand-off), the splits' float32 partials to a merge
per query head, the attention output to the output projection, the residual to gate/up, and
SiLU·mul to down (``tagged_layer_cuda.cu`` describes the layout). It has the layer's data flow and
bytes but not the model: norms without weights, no q/k norm or RoPE, the new token's K/V not
attended.

The baseline in the same run is the engine's own persistent launch (``engine/fast/persistent.py``,
Triton) on a random Qwen3-0.6B at the same cached length, per layer (its launch ÷ 28, the
embedding row included); each row's time is the median over ``--repeats`` of ten launches back
to back, so that the host's launch overhead overlaps the launch before. Each design first runs
once against float64 with the same bf16 roundings: over all ``--layers`` for the last phase from
the words it was handed (each must carry its hand-off's tag; within 1e-3), and end to end over
``--check-layers`` layers (within 1e-2: a float32 sum that rounds the residual the other way
moves an output by one bf16 step of it; over many layers such flips grow).

To see where a layer's time goes (session 39), timing-only rows take parts away: the tags not
checked (``--unchecked``), no hand-off read at all (``--no-input``), no weight bytes copied, so
the chain of hand-offs alone (``--no-bytes``), and no math either, so the hand-offs and the ring's
waits alone (``--no-math``, session 40); ``--stamps`` then times each step of a layer from every
block's ``%globaltimer``. Variants: a sixth ring slot (``--slots``), a prefetcher warp asking L2
for the next chunks (``--prefetch``), polls that back off (``--backoff``), the consumers' dot
products as one chain of multiply-adds (``--sums chained``, session 38's), the input of q/k/v and
gate/up held in registers for the phase (``--input held``), and from session 40: layouts that
spread the output projection, gate/up and down over all blocks a chunk a task, or only gate/up
(``--layout spread spread-d``), the projections' rows by tensor cores (``--matmul mma``: each
chunk packed as m16n8k16 A fragments, the normalised input rounded to bf16 as the model rounds
it), and attention's scores reduced together and P·V by quarters of the rows (``--attention
quarters``).

Usage:
    python benchmarks/bench_tagged_layer.py                      # caps of 16, 32 and 160 KB
    python benchmarks/bench_tagged_layer.py --ahead 2 4 --layers 28 --repeats 20
    python benchmarks/bench_tagged_layer.py --ahead 2 --unchecked --no-input --no-bytes --stamps
    python benchmarks/bench_tagged_layer.py --ahead 2 --layout spread-d --matmul mma --attention quarters
"""

from __future__ import annotations

import argparse
import statistics
import sys

import torch
from gpu_shapes import copy_bandwidth, cuda_extension, cuda_time, device_line, print_table, random_model

from compaction_gym.engine.fast.tagged import balanced_tasks, fixed_chunks, mma_fragments

CHUNK = (16, 1024)  # rows × columns of a 32 KB chunk
A, B, C, D, E = 256, 128, 128, 384, 192  # chunks a layer, by phase (tagged_layer_cuda.cu)
CHUNKS = A + B + C + D + E
KV_ROWS, HEAD_DIM, KV_HEADS = 1024, 128, 8


def packed_weights(layers: int, device: torch.device, seed: int = 0) -> torch.Tensor:
    """``[layers, 1,088, 16, 1,024]`` bf16: each layer's chunks in the kernel's order. Weights have
    scale 1/√1,024 (outputs keep their input's scale); K/V rows scale 1 (attention scores ~N(0, 1))."""
    g = torch.Generator(device=device).manual_seed(seed)
    w = torch.randn(layers, CHUNKS, *CHUNK, device=device, generator=g) / CHUNK[1] ** 0.5
    w[:, A : A + B] *= CHUNK[1] ** 0.5
    return w.to(torch.bfloat16)


def unpack(layer: torch.Tensor, spread: bool = False) -> dict[str, torch.Tensor]:
    """One layer's matrices (float64) from its packed chunks. Gate/up chunks come in pairs (gate rows
    16j.., then up rows 16j..) or, ``spread``, one a task (rows 2w and 2w + 1: gate and up row 8j + w)."""
    c = layer.double()
    gate_up = (
        c[A + B + C : A + B + C + D].reshape(D, 8, 2, 1024).permute(2, 0, 1, 3)
        if spread
        else c[A + B + C : A + B + C + D].reshape(D // 2, 2, 16, 1024).transpose(0, 1)
    ).reshape(2, 3072, 1024)
    kv = c[A : A + B].reshape(KV_HEADS, 16, 2, 64, HEAD_DIM)  # task = head * 16 + split: K rows, then V rows
    return {
        "qkv": c[:A].reshape(4096, 1024),
        "k": kv[:, :, 0].reshape(KV_HEADS, KV_ROWS, HEAD_DIM),
        "v": kv[:, :, 1].reshape(KV_HEADS, KV_ROWS, HEAD_DIM),
        "o": c[A + B : A + B + C].reshape(64, 2, 16, 1024).permute(0, 2, 1, 3).reshape(1024, 2048),
        "gate": gate_up[0],
        "up": gate_up[1],
        "down": c[A + B + C + D :].reshape(64, 3, 16, 1024).permute(0, 2, 1, 3).reshape(1024, 3072),
    }


def mma_packed(W: torch.Tensor) -> torch.Tensor:
    """W with every projection chunk (all but attention's K/V) reordered as tensor cores' m16n8k16 A
    fragments (the engine's :func:`~compaction_gym.engine.fast.tagged.mma_fragments`)."""
    packed = mma_fragments(W)
    packed[:, A : A + B] = W[:, A : A + B]
    return packed.contiguous()


def bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).double()


def rms_normalised(x: torch.Tensor) -> torch.Tensor:
    return x * (x.square().mean() + 1e-6).rsqrt()


@torch.no_grad()
def reference(
    W: torch.Tensor, h0: torch.Tensor, layers: int, spread: bool = False, bf16_inputs: bool = False
) -> torch.Tensor:
    """The last layer's new residual, unrounded, in float64 with the kernel's bf16 hand-offs (gate/up
    packed a chunk a task given ``spread``: unpack; the normalised inputs of q/k/v and gate/up rounded
    to bf16 given ``bf16_inputs``, as tensor cores take them)."""
    norm = (lambda x: bf16(rms_normalised(x))) if bf16_inputs else rms_normalised
    h = h0.double()
    for layer in range(layers):
        m = unpack(W[layer], spread)
        qkv = bf16(m["qkv"] @ norm(h))
        q = qkv[:2048].reshape(KV_HEADS, 2, HEAD_DIM)
        scores = torch.einsum("gid,gtd->git", q, m["k"]) / HEAD_DIM**0.5
        att = bf16(torch.einsum("git,gtd->gid", scores.softmax(-1), m["v"]).reshape(2048))
        h_mid = bf16(h + m["o"] @ att)
        x = norm(h_mid)
        gate = m["gate"] @ x
        act = bf16(torch.nn.functional.silu(gate) * (m["up"] @ x))
        out = h_mid + m["down"] @ act
        h = bf16(out)
    return out


def handed_on(words: torch.Tensor, tag: int) -> torch.Tensor | None:
    """The bf16 values of tagged words, or None if any word carries another tag."""
    w = words.long() & 0xFFFFFFFF
    if not bool(((w >> 16) == tag).all()):
        return None
    return ((w & 0xFFFF) << 16).int().view(torch.float32).double()


def handed_on_f32(words: torch.Tensor, tag: int) -> torch.Tensor | None:
    """The float32 values of 64-bit tagged words (value low, tag high), or None if any carries another tag."""
    if not bool(((words >> 32) == tag).all()):
        return None
    return (words & 0xFFFFFFFF).int().view(torch.float32).double()


def last_phase_error(
    layer: torch.Tensor,
    words: torch.Tensor,
    part: torch.Tensor,
    out: torch.Tensor,
    seq: int,
    layers: int,
    partials: bool,
) -> float:
    """The last layer's down projection against float64 from the words it was handed, relative to
    the largest value (inf if a word carries a stale tag): today's ``out`` = h_mid + down · act, or (the
    spread layout's ``partials``) the three partial sums, each down's third · act's."""
    act = handed_on(words[7168:10240], tag_of(seq, layers, layers - 1, 4))
    down = unpack(layer)["down"]
    if partials:
        parts = handed_on_f32(part[-3072:], tag_of(seq, layers, layers - 1, 5))
        if act is None or parts is None:
            return float("inf")
        ref = torch.cat(
            [down[:, k * 1024 : (k + 1) * 1024] @ act[k * 1024 : (k + 1) * 1024] for k in range(3)]
        )
        return ((parts - ref).abs().max() / ref.abs().max()).item()
    h_mid = handed_on(words[6144:7168], tag_of(seq, layers, layers - 1, 3))
    if act is None or h_mid is None:
        return float("inf")
    ref = h_mid + down @ act
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


def tag_of(seq: int, layers: int, layer: int, handoff: int) -> int:
    return 1 + (seq * 6 * layers + layer * 6 + handoff) % 65535


def gate_up_pairs(programs: int, balanced: bool) -> torch.Tensor:
    """``[programs, 4]`` int32: the gate/up pairs each block runs (-1: no more). Round robin (pair j on
    block j mod P), or ``balanced``: each pair in turn to the block with the fewest chunks so far,
    counting the phases whose blocks are fixed (tagged_layer_cuda.cu's layout)."""
    table = torch.full((programs, 4), -1, dtype=torch.int32)
    if not balanced:
        for j in range(D // 2):
            b = j % programs
            table[b, (table[b] >= 0).sum()] = j
        return table
    for b, pairs in enumerate(
        balanced_tasks(D // 2, [4] * programs, fixed_chunks(programs), 2)
    ):
        table[b, : len(pairs)] = torch.tensor(pairs, dtype=torch.int32)
    return table


def spread_tasks(programs: int, only_d: bool = False, down_early: bool = False) -> torch.Tensor:
    """``[programs, 6]`` int32 for the spread layouts: each block's C task (16 rows × one half of the
    output projection), up to 3 D chunks (8 gate and 8 up rows) and up to 2 E tasks (16 rows × one
    third of down), -1: none; ``only_d``: D's chunks only, up to 5 in columns 1-5 (C and E on today's
    64 blocks each). Each phase's tasks go one by one to the block with the fewest chunks so far among
    those under the phase's cap (its tasks ÷ the blocks, rounded up), so that every phase is as short
    as it can be and no block streams more than it must. ``down_early`` (with ``only_d``): the blocks
    of down get one D chunk fewer than the cap and the others one more, so that down's blocks are
    polling for their input before the last gate/up rows are handed on."""
    if not 128 <= programs <= 256:
        raise ValueError(f"programs: 128 to 256, not {programs}")
    if down_early and not only_d:
        raise ValueError("down_early: only with only_d")
    table = torch.full((programs, 6), -1, dtype=torch.int32)
    load = fixed_chunks(programs, output_and_down=only_d)
    cap = -(-D // programs)
    d_caps = [cap] * programs
    if down_early:
        d_caps = [cap - 1 if b < 128 and b % 2 == 1 else cap + 1 for b in range(programs)]
    phases = [(D, 1, d_caps)]
    if not only_d:
        phases = [(C, 0, [1] * programs), *phases, (E, 4, [-(-E // programs)] * programs)]
    for tasks, first, caps in phases:
        for b, mine in enumerate(balanced_tasks(tasks, caps, load)):
            table[b, first : first + len(mine)] = torch.tensor(mine, dtype=torch.int32)
    return table


def engine_launch(kv: int):
    """The layer count of a random Qwen3-0.6B and a callable running the engine's persistent launch on
    it once (batch 1, ``kv`` cached rows, no queries recorded)."""
    from compaction_gym.engine.fast.persistent import build_plan, persistent_layers
    from compaction_gym.engine.fast.runner import FastModelRunner
    from compaction_gym.engine.model_runner import ModelLayout
    from compaction_gym.engine.slot_cache import SlotKVCache

    model = random_model("qwen3-0.6b")
    model.set_attn_implementation("compaction_gym")
    layout = ModelLayout.from_model(model)
    cap = kv + 64
    cache = SlotKVCache(
        layout.n_layers, layout.n_kv_heads, layout.head_dim, 1, cap, torch.bfloat16, torch.device("cuda")
    )
    cache.k.normal_()
    cache.v.normal_()
    cache.beta.zero_()
    runner = FastModelRunner(model, cache, layout)
    dec = runner.decoder
    plan = build_plan(dec)

    def t(v: int) -> torch.Tensor:
        return torch.tensor([v], device="cuda")

    inputs = (t(11), t(kv), t(0), t(cap - 1), t(kv), cache.k, cache.v, cache.beta)
    return layout.n_layers, lambda: persistent_layers(dec, plan, *inputs)


PREFETCH_KINDS = {"none": 0, "loads": 1, "bulk": 2}
# the tables' keys of spread_tasks
SPREAD, SPREAD_D, SPREAD_D_EARLY = (
    ", spread layout",
    ", gate/up spread",
    ", gate/up spread, down's blocks early",
)
LAYOUTS = {SPREAD: 1, SPREAD_D: 2, SPREAD_D_EARLY: 2}  # the kernel's layout of a table (0: today's)
# slots, 8 KB copies in flight, layout's table, (prefetch, depth), ns between polls, independent sums,
# q/k/v's and gate/up's input held in registers, the projections' rows by tensor cores, attention by
# quarters (its scores reduced together, P·V by quarters of the rows)
Design = tuple[int, int, str, tuple[int, int], int, bool, bool, bool, bool]


def prefetch_mode(spec: str) -> tuple[int, int]:
    """``--prefetch``'s KIND[:DEPTH] as the kernel's (mode, depth); depth 4 unless given."""
    kind, _, depth = spec.partition(":")
    if kind not in PREFETCH_KINDS:
        raise ValueError(f"--prefetch: kind must be one of {sorted(PREFETCH_KINDS)}, not {kind!r}")
    mode = PREFETCH_KINDS[kind]
    return (mode, int(depth or 4)) if mode else (0, 0)


def prefetch_label(spec: str) -> str:
    mode, depth = prefetch_mode(spec)
    kind = {1: "loads", 2: "bulk prefetches"}.get(mode)
    return f", L2 asked {depth} chunks ahead ({kind})" if kind else ""


def make_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=28)
    p.add_argument(
        "--check-layers", type=int, default=3, help="layers of the end-to-end check against float64"
    )
    p.add_argument(
        "--ahead", type=int, nargs="+", default=[2, 4, 20],
        help="8 KB copies a block may have requested and not yet received (4 × the slots: the whole ring, no "
        "cap; larger values are cut to that)",
    )  # fmt: skip
    p.add_argument(
        "--slots", type=int, nargs="+", default=[5], choices=[5, 6], help="32 KB slots of the ring"
    )
    p.add_argument(
        "--sums", nargs="+", default=["independent"], choices=["independent", "chained"],
        help="the consumers' dot products: four independent sums a lane, reduced over the warp once a row, or "
        "(session 38) one chain of multiply-adds, reduced after every chunk",
    )  # fmt: skip
    p.add_argument(
        "--input", nargs="+", default=["shared"], choices=["shared", "held"],
        help="q/k/v's and gate/up's input: its lane slice read from shared memory for every chunk, or held "
        "in registers for the phase",
    )  # fmt: skip
    p.add_argument(
        "--matmul", nargs="+", default=["fma"], choices=["fma", "mma"],
        help="the projections' rows: multiply-adds on the CUDA cores, or mma.sync on tensor cores (each chunk "
        "packed as m16n8k16 A fragments, the normalised input rounded to bf16; sums independent, input shared "
        "only)",
    )  # fmt: skip
    p.add_argument(
        "--attention", nargs="+", default=["rows"], choices=["rows", "quarters"],
        help="attention's scores and P·V: each row's two scores reduced over the warp by their own shuffles and "
        "a thread a (head, dim) over all 64 rows, or a warp's 16 scores reduced together (halving exchanges) "
        "and each lane a pair of dims for both heads over a quarter of the rows, the quarters summed through "
        "shared memory",
    )  # fmt: skip
    p.add_argument(
        "--backoff",
        type=int,
        nargs="+",
        default=[0],
        help="ns a thread sleeps between polls of a group (0: none)",
    )
    p.add_argument(
        "--round-robin", action="store_true", help="also run round-robin gate/up pairs (unbalanced)"
    )
    p.add_argument(
        "--layout", nargs="+", default=["today"], choices=["today", "spread", "spread-d", "spread-d-early"],
        help="C, D and E on 64, all and 64 blocks (today: 14 chunks on the critical path), every phase "
        "spread a chunk a task over all blocks (spread: 9, C's and E's partial sums gathered by every "
        "block), or only D (spread-d: 11; spread-d-early: 12, down's blocks with one D chunk fewer, so that "
        "they wait for D's output early; spread_tasks; the spread layouts' sums independent only)",
    )  # fmt: skip
    p.add_argument(
        "--prefetch", nargs="+", default=["none"], metavar="KIND[:DEPTH]",
        help="rows with a prefetcher warp asking L2 for the block's next DEPTH chunks past the producer's: "
        "'loads' (16-byte loads with the L2::256B hint, two 8 KB pieces unanswered at most), 'bulk' "
        "(cp.async.bulk.prefetch.L2) or 'none'",
    )  # fmt: skip
    p.add_argument(
        "--unchecked", action="store_true",
        help="also time each design reading every hand-off once, tags unchecked (timing only: races)",
    )  # fmt: skip
    p.add_argument(
        "--no-input", action="store_true",
        help="also time each design without reading any hand-off (timing only: the stream and the consumers' work)",
    )  # fmt: skip
    p.add_argument(
        "--no-bytes", action="store_true",
        help="also time each design copying no weights, tags checked (timing only: the chain of hand-offs alone)",
    )  # fmt: skip
    p.add_argument(
        "--no-math", action="store_true",
        help="also time each design copying no weights and computing nothing (timing only: the hand-offs and "
        "the ring's waits alone)",
    )  # fmt: skip
    p.add_argument(
        "--stamps", action="store_true",
        help="then time each step of a layer (%%globaltimer) in the first design of each layout and matmul "
        "(and without weight bytes, given --no-bytes, and computing nothing, given --no-math)",
    )  # fmt: skip
    p.add_argument("--repeats", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3, help="alternations of the designs (best median kept)")
    p.add_argument("--no-engine", action="store_true", help="skip the engine's persistent launch")
    return p


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        print("bench_tagged_layer needs a Hopper GPU", file=sys.stderr)
        return 2
    ext = cuda_extension("tagged_layer_cuda.cu")
    if ext is None:
        print("bench_tagged_layer needs a CUDA compiler (CUDA_HOME)", file=sys.stderr)
        return 2
    assert ext.layer_chunks() == CHUNKS
    dev = torch.device("cuda")
    P = torch.cuda.get_device_properties(dev).multi_processor_count
    L = args.layers
    W = packed_weights(L, dev)
    W_mma = mma_packed(W) if "mma" in args.matmul else None
    h0 = torch.randn(1024, device=dev)
    words = torch.zeros(11264, device=dev, dtype=torch.int32)  # q/k/v, attention, h_mid, act, h
    part = torch.zeros(128 * 2 * 130 + 5 * 1024, device=dev, dtype=torch.int64)  # attention's, then spread's
    out = torch.zeros(1024, device=dev)
    seq = [0]
    tables = {"": gate_up_pairs(P, True).to(dev)} if "today" in args.layout else {}
    if args.round_robin and "today" in args.layout:
        tables[", gate/up round robin"] = gate_up_pairs(P, False).to(dev)
    if "spread" in args.layout:
        tables[SPREAD] = spread_tasks(P).to(dev)
    if "spread-d" in args.layout:
        tables[SPREAD_D] = spread_tasks(P, only_d=True).to(dev)
    if "spread-d-early" in args.layout:
        tables[SPREAD_D_EARLY] = spread_tasks(P, only_d=True, down_early=True).to(dev)

    no_stamps = torch.empty(0, device=dev, dtype=torch.int64)

    def launch(
        layers: int,
        design: Design,
        check: int = 1,
        copies: bool = True,
        stamps: torch.Tensor = no_stamps,
        math: bool = True,
    ) -> None:
        seq[0] += 1  # consecutive launches: no word keeps a tag of this one
        slots, ahead, table, prefetch, backoff, ilp, held, mma, quarters = design
        ext.launch(W_mma if mma else W, h0, words, part, out, tables[table], layers, P, seq[0], slots,
                   min(ahead, 4 * slots), *prefetch, check, copies, math, quarters, backoff, stamps, ilp, held,
                   LAYOUTS.get(table, 0), mma)  # fmt: skip

    designs = {
        f"tagged stream, {r} slots, ≤ {min(a, 4 * r) * 8} KB in flight{t}{prefetch_label(f)}"
        + (f", polls {n} ns apart" if n else "")
        + ("" if sums == "independent" else ", sums chained")
        + (", input held in registers" if held == "held" else "")
        + (", tensor cores" if mm == "mma" else "")
        + (", attention by quarters" if pv == "quarters" else ""):
        (r, a, t, prefetch_mode(f), n, sums == "independent", held == "held", mm == "mma", pv == "quarters")
        for pv in args.attention
        for mm in args.matmul
        for held in args.input
        for sums in args.sums
        for n in args.backoff
        for f in args.prefetch
        for t in tables
        for r in args.slots
        for a in args.ahead
        if t not in LAYOUTS or sums == "independent"
        if mm == "fma" or (sums, held) == ("independent", "shared")
    }  # fmt: skip
    errors = {}
    for name, design in designs.items():
        layout = LAYOUTS.get(design[2], 0)
        n = min(args.check_layers, L)
        launch(n, design)
        ref = reference(W, h0, n, spread=layout != 0, bf16_inputs=design[7])
        errors[f"{name}, {n} layers end to end"] = ((out.double() - ref).abs().max() / ref.abs().max()).item()
        launch(L, design)
        errors[f"{name}, last phase of {L} layers"] = last_phase_error(
            W[L - 1], words, part, out, seq[0], L, partials=layout == LAYOUTS[SPREAD]
        )
    torch.cuda.synchronize()
    print(
        "largest error against float64, relative to the largest value: "
        + "; ".join(f"{n} {e:.1e}" for n, e in errors.items()),
        flush=True,
    )
    if any(e > (1e-2 if "end to end" in n else 1e-3) for n, e in errors.items()):
        print("the design computed something else: the timings below do not count", file=sys.stderr)
        return 1

    runs = {name: (L, lambda d=d: launch(L, d)) for name, d in designs.items()}
    timing_only = {"tags unchecked": (0, True)} if args.unchecked else {}
    if args.no_input:
        timing_only["no hand-off read"] = (-1, True)
    if args.no_bytes:
        timing_only["no weight bytes copied"] = (1, False)
    if args.no_math:
        timing_only["no weight bytes copied, no math"] = (1, False, no_stamps, False)
    runs |= {
        f"timing only: {name}, {how}": (L, lambda d=d, c=c: launch(L, d, *c))
        for how, c in timing_only.items()
        for name, d in designs.items()
    }
    if not args.no_engine:
        layers, fn = engine_launch(KV_ROWS)
        fn()
        runs = {"engine's persistent launch (Triton; Qwen3-0.6B, random weights)": (layers, fn), **runs}
    bandwidth = copy_bandwidth()
    layer_bytes = CHUNKS * 16 * 1024 * 2
    bytes_us = layer_bytes / bandwidth * 1e6
    best: dict[str, float] = {}
    for _ in range(args.rounds):
        for name, (layers, fn) in runs.items():
            ten = statistics.median(
                cuda_time(lambda fn=fn: [fn() for _ in range(10)]) for _ in range(args.repeats)
            )
            best[name] = min(best.get(name, float("inf")), ten / 10 * 1e6 / layers)
    base = next(iter(best.values()))
    print_table(
        ["design", "µs/layer", "× the bytes", "÷ first row"],
        [[name, us, us / bytes_us, us / base] for name, us in best.items()],
        title=f"A Qwen3-0.6B layer at {KV_ROWS} cached rows, {device_line()}; {P} blocks, {L} layers of "
        f"{layer_bytes / 1e6:.1f} MB ({bytes_us:.2f} µs at the copy bandwidth {bandwidth / 1e12:.2f} TB/s)",
    )
    if args.stamps:
        firsts = {}  # the first design of each layout and matmul
        for name, design in designs.items():
            firsts.setdefault((LAYOUTS.get(design[2], 0), design[7]), (name, design))
        columns = {}
        for name, design in firsts.values():
            modes = {"": (True, True)}
            if args.no_bytes:
                modes[", no weight bytes copied (timing only)"] = (False, True)
            if args.no_math:
                modes[", no weight bytes copied, no math (timing only)"] = (False, False)
            for how, (copies, math) in modes.items():
                stamps = torch.zeros(L * EVENTS * P, device=dev, dtype=torch.int64)
                launch(L, design, copies=copies, stamps=stamps, math=math)
                columns[name + how] = step_medians(stamps.view(L, EVENTS, P).cpu())
        print_table(
            ["step (µs, median over layers)", *columns],
            [[step, *(c[step] for c in columns.values())] for step in STEPS],
            title="Where a layer goes: the last block's %globaltimer at each event, differences",
        )
    return 0


EVENTS = 12  # a phase's input polled, then its output handed on: A, B, M, C, D, E
STEPS = [
    "A: q/k/v rows (h polled and normalised before)",
    "hand-off 0: q/k/v to the attention splits",
    "B: attention split",
    "hand-off 1: the partials to the merge",
    "M: merge",
    "hand-off 2: attention output to the output projection",
    "C: output projection",
    "hand-off 3 and the norm: h_mid to gate/up",
    "D: gate/up",
    "hand-off 4: act to down",
    "E: down projection",
    "hand-off 5 and the norm: h to the next layer",
    "the layer",
]


def step_medians(stamps: torch.Tensor) -> dict[str, float]:
    """``[layers, 12, blocks]`` globaltimer stamps (0: the block has no such event) as the median over
    layers of each step: the latest block's stamp at each event, differences in µs."""
    last = stamps.max(dim=2).values.double()  # blocks without the event wrote 0
    # each event's next: the layer's next event, and for the last, layer + 1's first
    ends = torch.cat([last[:-1, 1:], last[1:, :1]], dim=1)
    steps = torch.cat([ends - last[:-1], (last[1:, 0] - last[:-1, 0])[:, None]], dim=1) / 1e3
    return dict(zip(STEPS, steps.median(dim=0).values.tolist(), strict=True))


if __name__ == "__main__":
    raise SystemExit(main())
