"""Build a fresh (randomly initialised) small Qwen3 and its byte-level BPE tokenizer from a corpus.

This is step 0 of the ``babyai-tiny`` recipe (``benchmarks/recipes/``): the tokenizer is trained
on the text our envs and prompts produce, the model gets the architecture of the shipped model,
and both are written with ``save_pretrained`` so every later step loads them the normal way.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from compaction_gym.errors import InvalidArgumentError

#: Tags of the ``reasoning`` prompt format, added as whole tokens (as Qwen3's ``<think>``).
TAG_TOKENS = ("<think>", "</think>", "<action>", "</action>")


def object_tokens() -> list[str]:
    """``" {colour} {kind}"`` for every BabyAI object, leading space included (how every mention
    reads: "a green key", "the green key"), so that each object name encodes as one token."""
    from compaction_gym.envs.babyai.text import OBJECT_COLORS, OBJECT_KINDS

    return [f" {c} {k}" for c in OBJECT_COLORS for k in OBJECT_KINDS]


@dataclass
class BaseModelConfig:
    """Architecture and tokenizer of a fresh model (the ``[init]`` table of the demos recipe)."""

    layers: int = 4
    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 768
    vocab: int = 2048
    max_position_embeddings: int = 16384
    rope_theta: float = 10000.0
    tie_embeddings: bool = True
    initializer_range: float = 0.02
    seed: int = 0
    #: add :func:`object_tokens` as whole tokens: looking an object up by name becomes a one-token
    #: match instead of a (colour, kind) pair the small model fails to learn (benchmarks/recipes/README.md)
    object_tokens: bool = False

    def __post_init__(self) -> None:
        if self.heads % self.kv_heads:
            raise InvalidArgumentError(
                f"heads ({self.heads}) must be a multiple of kv_heads ({self.kv_heads})"
            )
        if min(self.layers, self.hidden, self.heads, self.head_dim, self.intermediate) < 1:
            raise InvalidArgumentError("layers, hidden, heads, head_dim and intermediate must be >= 1")


def build_base_model(
    output: str | Path, corpus: Sequence[str], config: BaseModelConfig | None = None
) -> Path:
    """Train the tokenizer on ``corpus``, initialise a ``Qwen3ForCausalLM``, save both to ``output``.

    Args:
        output: directory to create (``save_pretrained`` layout).
        corpus: texts for the BPE trainer (instructions, observations, outputs, ...).
        config: architecture; defaults to :class:`BaseModelConfig`.

    Returns:
        ``output`` as a :class:`~pathlib.Path`.
    """
    import torch
    from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

    from compaction_gym.models.tiny import make_tokenizer

    config = config or BaseModelConfig()
    if not corpus:
        raise InvalidArgumentError("the tokenizer corpus is empty")
    output = Path(output)
    output.mkdir(parents=True, exist_ok=True)
    tokenizer = make_tokenizer(None, vocab=config.vocab, corpus=list(corpus))
    tokenizer.add_tokens(list(TAG_TOKENS))
    if config.object_tokens:
        from tokenizers import AddedToken

        tokenizer.add_tokens([AddedToken(t, normalized=False) for t in object_tokens()])
    tokenizer.save_pretrained(str(output))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    model_config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=config.hidden,
        intermediate_size=config.intermediate,
        num_hidden_layers=config.layers,
        num_attention_heads=config.heads,
        num_key_value_heads=config.kv_heads,
        head_dim=config.head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_type": "default", "rope_theta": config.rope_theta},
        initializer_range=config.initializer_range,
        tie_word_embeddings=config.tie_embeddings,
        eos_token_id=im_end,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    with torch.random.fork_rng():
        torch.manual_seed(config.seed)
        model = Qwen3ForCausalLM(model_config)
    model.generation_config = GenerationConfig(
        eos_token_id=im_end, pad_token_id=tokenizer.pad_token_id, do_sample=False
    )
    model.save_pretrained(str(output))
    n_params = sum(p.numel() for p in model.parameters())
    (output / "base_model.json").write_text(
        json.dumps({**asdict(config), "parameters": n_params, "vocab_size": len(tokenizer)}, indent=2) + "\n"
    )
    return output
