"""Reference computations shared by the engine tests (independent of the engine code)."""

from __future__ import annotations

import torch


def make_prompt(n: int, seed: int, vocab: int = 500) -> list[int]:
    """Random token ids in ``[3, vocab)`` (no special tokens), seeded."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, vocab, (n,), generator=g).tolist()


@torch.no_grad()
def plain_logprobs(model, ids: list[int]) -> torch.Tensor:
    """log_softmax of a plain full-sequence HF forward, ``[len(ids), V]`` (float32)."""
    return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)


def reference_sampling_logprobs(
    logits: torch.Tensor, temperature: float, top_k: int, top_p: float
) -> torch.Tensor:
    """Log-probs of the sampling distribution for one logits row, written plainly (token by token).

    Temperature scaling, then the ``top_k`` best tokens, then the smallest prefix of the sorted
    distribution whose mass reaches ``top_p``; renormalised. ``temperature == 0``: plain log-softmax.
    """
    logits = logits.double()
    if temperature == 0:
        return torch.log_softmax(logits, -1)
    probs = torch.softmax(logits / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    keep = order[:top_k] if top_k > 0 else order
    kept_probs = torch.softmax(logits[keep] / temperature, -1)
    support, mass = [], 0.0
    for tok, p in zip(keep, kept_probs.tolist()):
        support.append(tok)
        mass += p
        if mass >= top_p:
            break
    out = torch.full_like(logits, float("-inf"))
    out[support] = torch.log_softmax(logits[support] / temperature, -1)
    return out


_REFERENCE: dict = {}
REFERENCE_ATTENTION = "cg_test_reference_eager"


def _reference_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Eager attention over ``[P past rows | N new tokens]`` with β on the past rows, in float64."""
    beta = _REFERENCE["beta"][module.layer_idx]  # [H_kv, P]
    batch, q_heads, n, d = query.shape
    kv_heads, total = key.shape[1], key.shape[2]
    group = q_heads // kv_heads
    past = beta.shape[-1]
    assert total == past + n
    k = key.double().repeat_interleave(group, dim=1)
    v = value.double().repeat_interleave(group, dim=1)
    scores = query.double() @ k.transpose(-1, -2) * scaling  # [B, H_q, N, T]
    bias = torch.zeros(kv_heads, total, dtype=torch.float64)
    bias[:, :past] = beta.double()
    scores = scores + bias.repeat_interleave(group, dim=0)[None, :, None, :]
    visible = torch.arange(total)[None, :] <= past + torch.arange(n)[:, None]
    scores = scores.masked_fill(~visible, float("-inf"))
    out = torch.softmax(scores, dim=-1) @ v
    return out.transpose(1, 2).to(query.dtype), None


def load_reference_model(path):
    """The model loaded with the test's own eager attention (β-aware), float32."""
    from transformers import AttentionInterface, AutoModelForCausalLM

    AttentionInterface.register(REFERENCE_ATTENTION, _reference_attention)
    return AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation=REFERENCE_ATTENTION
    ).eval()


@torch.no_grad()
def reference_logprobs_over_cache(
    model, keys, values, beta, token_ids: list[int], start_position: int
) -> torch.Tensor:
    """Feed ``token_ids`` after a given cache (K/V ``[L, H_kv, P, d]``, β ``[L, H_kv, P]``) with HF's DynamicCache.

    Positions are ``start_position + i`` (logical positions). Returns log_softmax ``[len, V]``.
    """
    from transformers import DynamicCache

    cache = DynamicCache()
    for layer in range(keys.shape[0]):
        cache.update(keys[layer][None].clone(), values[layer][None].clone(), layer)
    _REFERENCE["beta"] = beta
    n = len(token_ids)
    out = model(
        input_ids=torch.tensor([token_ids]),
        position_ids=torch.arange(start_position, start_position + n)[None],
        past_key_values=cache,
        use_cache=True,
    )
    return torch.log_softmax(out.logits[0].float(), dim=-1)


def triton_device() -> torch.device:
    """The device Triton kernel tests run on: the interpreter's CPU (``TRITON_INTERPRET=1``) or
    CUDA; skips the calling test module otherwise (call it at module level)."""
    import pytest

    from compaction_gym.engine.fast.kernels import HAS_TRITON, _interpreting

    if not HAS_TRITON:
        pytest.skip("Triton is not installed", allow_module_level=True)
    if _interpreting():
        return torch.device("cpu")
    if torch.cuda.is_available():
        return torch.device("cuda")
    pytest.skip("needs TRITON_INTERPRET=1 (CPU) or a CUDA device", allow_module_level=True)


def stacked_blocks(events, **kwargs) -> list:
    """Each event's block from one stacked ``apply_event`` call over ``events`` (Attention Matching;
    ``kwargs``: ``compute_beta``, ``refit_values``, ``compact_fn``)."""
    from compaction_gym.compaction import apply_event
    from compaction_gym.engine.event_batch import event_blocks, stack_rows

    rows = stack_rows(events)
    block = apply_event(
        rows.keys, rows.values, rows.queries, mode="attention_matching", span=rows.span, target=events[0].target,
        key_bias=rows.key_bias, query_mask=rows.query_mask, **kwargs,
    )  # fmt: skip
    blocks = event_blocks(block, rows)
    return [blocks[i] for i in range(len(events))]
