"""Sweep the n-gram mixer's parameters over an ``eval-lm --per-token`` summary (docs/benchmarks.md).

The mixer needs no model pass of its own: its state depends on the text only, and each position
mixes the recorded model log-prob and entropy (``mix_stream``, score-first per chunk). So one
``eval-lm --per-token`` run is rescored here for every configuration of a grid, and the best one
on a held-out text can then be applied to the measured text.

    python benchmarks/bench_mixer.py --summary heldout.json --text heldout.txt \
        --model smollm2-135m-instruct --cells none --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import sys
from pathlib import Path
from typing import Any

from compaction_gym.lmeval.mixer import BackoffNgramMixer, MixerConfig, mix_stream
from compaction_gym.lmeval.scoring import bits_per_byte, piece_bytes
from compaction_gym.lmeval.text import load_text

GRID: dict[str, list[Any]] = {
    "max_order": [3, 4, 6],
    "min_count": [2, 4, 8],
    "alpha_base": [0.0, 0.05],
    "alpha_scale": [0.1, 0.2, 0.35, 0.55],
    "entropy_center": [3.0, 4.0, 5.0],
}


def rescore(
    cell: dict[str, Any], ids: list[int], nbytes: list[int], cfg: MixerConfig, chunk: int, vocab: int
) -> float:
    """Bits per byte of ``cell`` mixed with ``cfg`` over its scored positions."""
    lp = [None if x is None else -x for x in cell["nll"]]
    nll, _ = mix_stream(BackoffNgramMixer(cfg, vocab), ids, lp, cell["entropy"], chunk)
    first = len(ids) - cell["n_scored"]
    return bits_per_byte(nll[first:], nbytes[first:])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--summary", required=True, help="an eval-lm --per-token JSON summary")
    p.add_argument("--text", required=True, help="the text it scored")
    p.add_argument("--model", required=True, help="the model (its tokenizer is read)")
    p.add_argument("--cells", nargs="+", help="cell names to rescore (default: all unmixed cells)")
    p.add_argument("--config", help="one MixerConfig as JSON instead of the grid")
    p.add_argument("--grid", help="a grid as JSON {field: [values]} instead of the default GRID")
    p.add_argument("--json", help="write every (cell, config, bits per byte) here")
    args = p.parse_args(argv)
    from transformers import AutoConfig, AutoTokenizer

    from compaction_gym.models.registry import resolve_model

    summary = json.loads(Path(args.summary).read_text())
    resolved = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(resolved)
    vocab = int(AutoConfig.from_pretrained(resolved).vocab_size)
    ids = tokenizer(load_text(args.text), add_special_tokens=False)["input_ids"][: summary["n_tokens"]]
    nbytes = piece_bytes(tokenizer, ids)
    cells = [
        c for c in summary["cells"] if c.get("mixer") is None and (not args.cells or c["name"] in args.cells)
    ]
    if any("entropy" not in c for c in cells):
        print("the summary has no per-token entropies: run eval-lm with --per-token", file=sys.stderr)
        return 2
    grid = json.loads(args.grid) if args.grid else GRID
    configs = (
        [MixerConfig.from_dict(json.loads(args.config))]
        if args.config
        else [MixerConfig(**dict(zip(grid, values)))
              for values in itertools.product(*grid.values())]
    )  # fmt: skip
    rows = []
    for cell in cells:
        base = bits_per_byte(
            [x for x in cell["nll"][len(ids) - cell["n_scored"] :]], nbytes[len(ids) - cell["n_scored"] :]
        )
        for cfg in configs:
            bpb = rescore(cell, ids, nbytes, cfg, summary["chunk"], vocab)
            rows.append(
                {"cell": cell["name"], "config": cfg.to_dict(), "bits_per_byte": bpb, "unmixed": base}
            )
        best = min((r for r in rows if r["cell"] == cell["name"]), key=lambda r: r["bits_per_byte"])
        print(
            f"{cell['name']}: unmixed {base:.4f} bits/byte; best mixed {best['bits_per_byte']:.4f} "
            f"({best['bits_per_byte'] - base:+.4f}) with {best['config']}"
        )
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
    return 0 if all(math.isfinite(r["bits_per_byte"]) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
