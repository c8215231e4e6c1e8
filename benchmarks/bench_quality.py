"""Compaction quality on a real model: the mean NLL gap to the full cache of every compaction mode.

A pretrained model (default ``smollm2-135m-instruct``, the registered name; any ``--model PATH``
works) reads ``--max-tokens`` (≥ 4,096) tokens of real English prose (Python's own
``pydoc_data.topics``, offline everywhere), ``--chunk`` tokens per engine step, each token scored
under the session's cache as it stands (docs/engine.md, "Scoring fed tokens": the KV-budget
trigger compacts between steps, as decoding sees it). One session per cell:

* every compaction mode the engine has (``COMPACTION_MODES``, read at run time) plus Attention
  Matching's settings (``AM_SETTINGS``: with β, with the original values kept instead of the C2
  refit, with ``repeat`` probes), at each KV budget of ``--budgets`` (default 512 and 256,
  window = budget / 2);
* ``none`` (the full cache), the reference.

Per cell: mean NLL (nats/token), bits per byte, the **gap** to ``none``, and the real compression
ratio = mean context length of the scored tokens / mean KV rows they attended to (≥ 4× at 512 and
≥ 10× at 256 on 4,096 tokens). Every cell is scored on the same positions (after the largest
budget). The table is printed and ``--json`` writes it with the run's settings.

This is ``compaction-gym eval-lm`` with the sweep fixed (docs/eval-lm.md); the generic runner
scores on CPU and on CUDA (``--device cuda``).

Usage:
    python benchmarks/bench_quality.py --json quality.json                       # GPU when available
    python benchmarks/bench_quality.py --model /path/to/smollm2 --device cpu --max-tokens 1024 --budgets 256 128
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from compaction_gym.engine.config import COMPACTION_MODES
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.lmeval.cli import add_arguments, print_results, run
from compaction_gym.models.registry import MODEL_REGISTRY

DEFAULT_MODEL = "smollm2-135m-instruct"


#: Attention Matching's settings besides the plain mode (``--modes`` flags, docs/eval-lm.md): β,
#: kept values (``refit_values=False``) and ``repeat`` probes (docs/compaction.md, "Probes").
AM_SETTINGS = (
    "attention_matching+beta",
    "attention_matching+keep",
    "attention_matching+beta+keep",
    "attention_matching+keep+repeat",
    "attention_matching+beta+keep+repeat",
)


def sweep_modes() -> list[str]:
    """Every compaction mode of the engine, Attention Matching also in each of ``AM_SETTINGS``."""
    modes = []
    for m in COMPACTION_MODES:
        if m == "none":
            continue
        modes.append(m)
        if m == "attention_matching":
            modes.extend(AM_SETTINGS)
    return modes


def make_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    parser.add_argument("--json", help="write the JSON summary here (same as --output)")
    parser.set_defaults(model=DEFAULT_MODEL, budgets=[512, 256], modes=None)
    for action in parser._actions:  # --model has a default here
        if action.dest == "model":
            action.required = False
    return parser


def main(argv: list[str] | None = None) -> int:
    args = make_parser().parse_args(argv)
    args.modes = args.modes or sweep_modes()
    args.output = args.output or args.json
    args.reference = True
    if args.model == DEFAULT_MODEL and DEFAULT_MODEL not in MODEL_REGISTRY and not Path(args.model).is_dir():
        print(
            f"{DEFAULT_MODEL!r} is not a registered model in this checkout: pass --model PATH",
            file=sys.stderr,
        )
        return 2
    t0 = time.perf_counter()
    try:
        results, out = run(args)
    except InvalidArgumentError as exc:
        print(f"bench_quality: {exc}", file=sys.stderr)
        return 2
    out["wall_s"] = time.perf_counter() - t0
    out["modes"] = args.modes
    out["budgets"] = args.budgets
    print_results(results, out)
    cells = len(results)
    print(
        f"{cells} cells in {out['wall_s']:.1f} s ({out['wall_s'] / cells:.1f} s per cell, {out['n_tokens']} tokens each)"
    )
    if args.output:
        Path(args.output).write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
