"""Tiny models without a hub: a random Qwen3 and a small byte-level BPE tokenizer.

Everything downstream loads what :func:`make_tiny_model` writes through the real
``from_pretrained`` path, so tests exercise the same loading code as users.
"""

from __future__ import annotations

import json
from pathlib import Path

SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")

#: Qwen-style ChatML template (no tools, no reasoning stripping).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _default_corpus() -> list[str]:
    """Text resembling what our envs and prompts emit, plus plain letters and digits."""
    colors = ["red", "green", "blue", "purple", "yellow", "grey"]
    kinds = ["ball", "box", "key", "door", "wall"]
    actions = ["turn left", "turn right", "go forward", "pick up", "drop", "toggle"]
    lines = []
    for c in colors:
        for k in kinds:
            for n in range(1, 7):
                lines.append(f"a {c} {k} {n} steps forward\na {c} {k} 1 step left and {n} steps forward")
            lines.append(f"go to the {c} {k}, then pick up a {c} {k}. put the {c} {k} next to the {c} ball")
            lines.append(f"You carry a {c} {k}. a locked {c} door. a open {c} door. a closed {c} door")
    for a in actions:
        lines.append(f"<action>{a}</action> <think>I should {a} now.</think> {a}")
    lines.append(
        "You are an agent playing a simple navigation game. Your goal is to open the door. The following "
        "are the possible actions you can take in the game, followed by a short description of each action"
        " Observation: Current Observation: Tips: PLAY! Budget: tokens generated. remaining."
    )
    lines.append("0123456789 + - * / = ( ) <answer></answer> What is the answer? Solve step by step.")
    lines.append("abcdefghijklmnopqrstuvwxyz ABCDEFGHIJKLMNOPQRSTUVWXYZ .,:;!?'\"")
    return lines


def make_tokenizer(path: str | Path | None = None, *, vocab: int = 1024, corpus: list[str] | None = None):
    """Train a byte-level BPE tokenizer with ChatML special tokens and a chat template.

    Args:
        path: directory to ``save_pretrained`` into (skipped when ``None``).
        vocab: target vocabulary size, special tokens included.
        corpus: training texts; defaults to text like our envs emit.

    Returns:
        A ``transformers.PreTrainedTokenizerFast``.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    if vocab < 300:
        raise ValueError(f"vocab must be >= 300 (256 bytes + specials + merges), got {vocab}")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus or _default_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        additional_special_tokens=["<|im_start|>"],
    )
    fast.chat_template = CHAT_TEMPLATE
    if path is not None:
        fast.save_pretrained(str(path))
    return fast


def make_tiny_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int = 64,
    vocab: int = 1024,
    intermediate: int | None = None,
    max_position_embeddings: int = 8192,
    initializer_range: float = 0.1,
    seed: int = 0,
    corpus: list[str] | None = None,
) -> Path:
    """Build a random ``Qwen3ForCausalLM`` plus tokenizer and ``save_pretrained`` both to ``path``.

    The weights are random (seeded); ``initializer_range`` is larger than Qwen's 0.02 so that
    greedy decoding has clear winners instead of near-ties.

    Args:
        path: output directory (created).
        layers, hidden, heads, kv_heads, head_dim: architecture (``head_dim=64``: vLLM's CPU
            attention rejects smaller heads).
        vocab: tokenizer vocabulary size; the model's embedding matches the tokenizer.
        seed: seeds the weight initialisation.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Example:
        >>> from transformers import AutoModelForCausalLM
        >>> p = make_tiny_model("/tmp/tiny")  # doctest: +SKIP
        >>> model = AutoModelForCausalLM.from_pretrained(p)  # doctest: +SKIP
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    if heads % kv_heads:
        raise ValueError(f"heads ({heads}) must be a multiple of kv_heads ({kv_heads})")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(path, vocab=vocab, corpus=corpus)
    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate or 2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=max_position_embeddings,
        initializer_range=initializer_range,
        tie_word_embeddings=False,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = Qwen3ForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(str(path))
    (path / "compaction_gym_tiny.json").write_text(json.dumps({"seed": seed, "vocab": len(tokenizer)}))
    return path


def main(argv: list[str] | None = None) -> int:
    """``python -m compaction_gym.models.tiny PATH``: write a tiny random model + tokenizer to PATH."""
    import argparse

    parser = argparse.ArgumentParser(prog="python -m compaction_gym.models.tiny", description=main.__doc__)
    parser.add_argument("path", help="output directory")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    out = make_tiny_model(args.path, layers=args.layers, hidden=args.hidden, seed=args.seed)
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
