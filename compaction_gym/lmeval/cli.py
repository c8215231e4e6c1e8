"""``compaction-gym eval-lm``: perplexity and bits per byte of a text under compacted KV caches.

See docs/eval-lm.md. The compaction flags are :class:`~compaction_gym.engine.CompactionConfig`'s
own (``--mode``, ``--max-kv-len``, ``--compact-window``, ``--ratio``, ``--queries``, ...);
``--modes`` and ``--budgets`` sweep several methods in one run (one session each, stepped together).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from compaction_gym.cli_args import add_dataclass_arguments, check_output_file, given_fields
from compaction_gym.engine.config import CompactionConfig
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.lmeval.mixer import MixerConfig
from compaction_gym.lmeval.scoring import (
    BETA_SUFFIX,
    CellResult,
    make_cells,
    mix_result,
    piece_bytes,
    score_cells,
    summary,
)
from compaction_gym.lmeval.text import BUILTIN_TEXTS, load_text


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of ``eval-lm`` (also used by ``benchmarks/bench_quality.py``)."""
    parser.add_argument("--model", required=True, help="registered model name, local directory or hub id")
    parser.add_argument(
        "--text",
        default="pydoc",
        help=f"a UTF-8 text file, or a built-in text: {', '.join(BUILTIN_TEXTS)} (default: pydoc)",
    )
    parser.add_argument(
        "--max-tokens", type=int, default=4096, help="score the text's first N tokens (default: 4096)"
    )
    parser.add_argument(
        "--chunk",
        type=int,
        default=64,
        help="tokens fed per step; compaction fires between steps (default: 64)",
    )
    parser.add_argument(
        "--score-after",
        type=int,
        help="first scored position (default: the largest budget, so every method is scored on the same positions)",
    )
    parser.add_argument(
        "--modes",
        nargs="+",
        help="several modes in one run (attention_matching+beta turns on beta); default: --mode",
    )
    parser.add_argument(
        "--budgets",
        nargs="+",
        type=int,
        help="several KV budgets (max_kv_len) in one run; default: --max-kv-len",
    )
    parser.add_argument(
        "--reference",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also score mode none, the full cache (default: on)",
    )
    parser.add_argument(
        "--mixer",
        action="store_true",
        help="also score every cell mixed with the eval-time BackoffNgramMixer (cells NAME+ngram)",
    )
    parser.add_argument(
        "--mixer-options",
        nargs="+",
        default=[],
        metavar="KEY=VALUE",
        help="MixerConfig fields: max_order, buckets, min_count, alpha_base, alpha_scale, alpha_slope, "
        "entropy_center",
    )
    parser.add_argument("--output", help="write the JSON summary here")
    parser.add_argument(
        "--per-token",
        action="store_true",
        help="include every position's NLL and model entropy in the JSON summary",
    )
    parser.add_argument(
        "--progress", action=argparse.BooleanOptionalAction, default=True, help="progress bar on stderr"
    )
    e = parser.add_argument_group("engine")
    e.add_argument(
        "--device", help="cuda / cpu (default: cuda when available); the generic runner scores on both"
    )
    e.add_argument(
        "--dtype", help="float32 / bfloat16 / ... (default: float32 on CPU, checkpoint dtype on GPU)"
    )
    e.add_argument(
        "--max-batch", type=int, default=8, help="sessions (methods) stepped together (default: 8)"
    )
    e.add_argument(
        "--fast", action=argparse.BooleanOptionalAction, default=False,
        help="the GPU fast runner (CUDA, Llama family) instead of the generic one (default: off)",
    )  # fmt: skip
    e.add_argument(
        "--prefill-chunk",
        type=int,
        default=2048,
        help="the engine's longest prefill per forward (default: 2048)",
    )
    c = parser.add_argument_group("compaction (CompactionConfig; protect_prompt defaults to off here)")
    add_dataclass_arguments(
        c, CompactionConfig, config=False, skip=("inject_budget_message", "inject_budget_every", "budget_message_template")
    )


def mixer_config(options: Sequence[str]) -> MixerConfig:
    """A :class:`MixerConfig` from ``KEY=VALUE`` strings (ints and floats as the fields' types).

    Raises:
        InvalidArgumentError: a malformed option, unknown key or bad value, naming it.
    """
    values: dict[str, Any] = {}
    types = {f: type(v) for f, v in MixerConfig().to_dict().items()}
    for opt in options:
        key, sep, raw = opt.partition("=")
        if not sep or key not in types:
            raise InvalidArgumentError(
                f"--mixer-options: {opt!r} is not KEY=VALUE with KEY in {sorted(types)}"
            )
        try:
            values[key] = types[key](raw)
        except ValueError as exc:
            raise InvalidArgumentError(
                f"--mixer-options: {key}={raw!r} is not a {types[key].__name__}"
            ) from exc
    return MixerConfig.from_dict(values)


def register(subparsers: Any) -> None:
    """Add ``eval-lm`` to the ``compaction-gym`` command."""
    parser = subparsers.add_parser(
        "eval-lm",
        help="perplexity / bits per byte of a text under compacted KV caches",
        description="Feed a text to one session per compaction method, chunk by chunk, and score every "
        "token under the cache as it stands (compacted between steps, as decoding sees it): mean NLL, "
        "bits per byte and the real compression ratio, with each method's gap to the full cache.",
    )
    add_arguments(parser)
    parser.set_defaults(func=main)


def run(args: argparse.Namespace) -> tuple[list[CellResult], dict[str, Any]]:
    """Load the model and text, score every cell; returns the results and the JSON summary."""
    import torch
    from tqdm.auto import tqdm

    from compaction_gym.backends import LocalBackend
    from compaction_gym.engine import Engine

    if args.max_tokens < 2:
        raise InvalidArgumentError(f"max_tokens must be >= 2, got {args.max_tokens}")
    mixer = mixer_config(args.mixer_options) if args.mixer else None
    base = {"protect_prompt": False, **given_fields(CompactionConfig, args)}
    modes = args.modes or [base.get("mode", "none") + (BETA_SUFFIX if base.get("compute_beta") else "")]
    budgets = args.budgets or [base.get("max_kv_len")]
    cells = make_cells(modes, budgets, base, reference=args.reference)
    text = load_text(args.text)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    from compaction_gym.models.registry import load_model

    model, tokenizer = load_model(args.model, dtype=args.dtype, device=device)
    if tokenizer is None:
        raise InvalidArgumentError(f"--model {args.model}: eval-lm needs a model with a tokenizer")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: args.max_tokens]
    if len(ids) < 2:
        raise InvalidArgumentError(f"--text {args.text}: fewer than 2 tokens")
    # one slot holds the whole text (the `none` cell) or a budget plus one chunk, whichever is larger
    capacity = max(len(ids), max((c.config.max_kv_len or 0) + args.chunk for c in cells))
    engine = Engine(
        model, tokenizer, max_slots=min(args.max_batch, len(cells)), capacity=capacity,
        prefill_chunk=args.prefill_chunk, fast=args.fast,
    )  # fmt: skip
    byte_counts = piece_bytes(tokenizer, ids)
    bar = tqdm(
        total=len(ids) * len(cells), desc="eval-lm", unit="tok", disable=not args.progress, file=sys.stderr
    )
    try:
        results = score_cells(
            LocalBackend(engine, name=str(args.model)), ids, cells, byte_counts,
            chunk=args.chunk, score_after=args.score_after, max_batch=args.max_batch, progress=bar.update,
        )  # fmt: skip
    finally:
        bar.close()
    if mixer is not None:
        vocab = int(model.get_output_embeddings().weight.shape[0])
        results += [mix_result(r, ids, byte_counts, mixer, vocab, args.chunk) for r in results]
    run_info = {
        "model": str(args.model),
        "text": args.text,
        "n_tokens": len(ids),
        "score_after": len(ids) - results[0].n_scored,
        "chunk": args.chunk,
        "device": str(device),
        "dtype": str(engine.dtype).removeprefix("torch."),
        "mixer": None if mixer is None else mixer.to_dict(),
    }
    out = summary(results, **run_info)
    if args.per_token:
        for d, r in zip(out["cells"], results):
            d["nll"] = r.to_dict(with_nll=True)["nll"]
            d["entropy"] = [None if math.isnan(x) else x for x in r.entropy]
    return results, out


def print_results(results: Sequence[CellResult], out: dict[str, Any], console: Any = None) -> None:
    """One line for a single method; a table (with gaps to ``none``) for several."""
    from rich.console import Console
    from rich.table import Table

    if console is None:
        console = Console()
        console.width = max(console.width, 140)
    head = (
        f"{out['model']} on {out['text']}: {out['n_tokens']} tokens, scored from position "
        f"{out['score_after']} (chunk {out['chunk']}, {out['device']} {out['dtype']})"
    )
    if len(results) == 1:
        r = results[0]
        console.print(head)
        console.print(
            f"{r.name}: mean NLL {r.mean_nll:.4f} nats/token, {r.bits_per_byte:.4f} bits/byte, "
            f"compression {r.compression:.2f}x ({r.events} events)"
        )
        return
    table = Table(title=head)
    for col in (
        "method",
        "budget",
        "window",
        "compression",
        "mean NLL",
        "Δ NLL vs none",
        "bits/byte",
        "Δ bpb",
        "events",
        "s",
    ):
        table.add_column(col, justify="left" if col == "method" else "right")
    for d in out["cells"]:
        gap = d.get("nll_gap")
        table.add_row(
            d["name"],
            str(d["max_kv_len"] or "—"),
            str(d["compact_window"] or "—"),
            f"{d['compression']:.2f}x",
            f"{d['mean_nll']:.4f}",
            "—" if gap is None else f"{gap:+.4f}",
            f"{d['bits_per_byte']:.4f}",
            "—" if gap is None else f"{d['bpb_gap']:+.4f}",
            str(d["events"]),
            f"{d['seconds']:.1f}",
        )
    console.print(table)


def main(args: argparse.Namespace) -> int:
    """Run ``compaction-gym eval-lm``; returns the exit code (2 on a bad argument)."""
    try:
        check_output_file(args.output, "--output")
        results, out = run(args)
    except InvalidArgumentError as exc:
        print(f"compaction-gym eval-lm: {exc}", file=sys.stderr)
        return 2
    print_results(results, out)
    if args.output:
        Path(args.output).parent.mkdir(parents=True, exist_ok=True)
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0
