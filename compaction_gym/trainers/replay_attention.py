"""The attention function of compaction replay: past K/V + per-row β, differentiable.

A replay forward (see :mod:`compaction_gym.trainers.replay`) feeds a batch of segments, each row
continuing its own (compacted) cache. Everything a layer needs travels in a :class:`ReplayRound`
passed to the model as the keyword argument ``replay_round``: Hugging Face models hand unknown
keyword arguments down to the attention function, and gradient checkpointing re-runs a layer with
the same arguments, so the round object (not a global) is what makes recomputation safe. No
``transformers.Cache`` is used (gradient checkpointing drops caches); the function concatenates the
round's past K/V itself.

Outside a replay (no ``replay_round``) the function *is* SDPA: Hugging Face builds its usual SDPA
mask for the name and the call goes to ``sdpa_attention_forward``. That makes it safe to leave a
model on :data:`REPLAY_ATTENTION` for good, which gradient checkpointing requires: the layers are
recomputed during ``backward`` and look their attention function up again then
(:func:`install_replay_attention`).

The computation is the engine's (:func:`compaction_gym.engine.attention.slot_attention`): both call
:func:`~compaction_gym.engine.attention.grouped_sdpa` (query heads grouped per KV head,
``[B, H_kv, G·N, d]``) with an additive mask and β (float32) added per KV head — with β the
product runs in float32 as in the engine.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from compaction_gym.engine.attention import folded_bias_sdpa, grouped_sdpa

#: The ``attn_implementation`` name replay switches a model to (only inside :func:`use_attention`).
REPLAY_ATTENTION = "compaction_gym_replay"


@dataclass
class ReplayRound:
    """One batched replay forward: row ``b`` feeds ``n_b`` new tokens after ``P_b`` past rows.

    New tokens are right-padded to ``N``; past rows are right-padded to ``P = max_b P_b``.

    Attributes:
        past_keys / past_values: per layer ``[B, H_kv, P, d]`` (``None`` entries when ``P = 0``).
        beta: per layer ``[B, H_kv, P + N]`` float32 (0 on new and padded rows), or ``None``.
        mask: additive float32 mask ``[B, 1, G·N, P + N]`` (past rows, causality, padding).
        record_queries: keep every layer's post-RoPE queries (``suffix`` probes).
        queries / keys / values: filled by the attention function, per layer ``[B, H, N, d]``
            (overwritten, not appended, so a checkpointed layer's recomputation is harmless).
    """

    past_keys: list[torch.Tensor | None]
    past_values: list[torch.Tensor | None]
    beta: list[torch.Tensor] | None
    mask: torch.Tensor
    record_queries: bool = False
    queries: dict[int, torch.Tensor] = field(default_factory=dict)
    keys: dict[int, torch.Tensor] = field(default_factory=dict)
    values: dict[int, torch.Tensor] = field(default_factory=dict)


def round_mask(past_lens: list[int], new_lens: list[int], groups: int, device: torch.device) -> torch.Tensor:
    """Additive float32 mask ``[B, 1, G·N, P + N]`` for :class:`ReplayRound`.

    Query ``i < n_b`` of row ``b`` sees the row's ``P_b`` past rows and new tokens ``0..i``; a padding
    query sees only itself (its output is discarded; the row stays finite).
    """
    past = torch.tensor(past_lens)[:, None, None]
    n = torch.tensor(new_lens)[:, None, None]
    p_max, n_max = max(past_lens), max(new_lens)
    col = torch.arange(p_max + n_max)[None, None, :]
    i = torch.arange(n_max)[None, :, None]
    j = col - p_max  # index among the new tokens (negative on past columns)
    real = i < n
    allowed = ((col < past) | ((j >= 0) & (j <= i))) & real
    allowed = allowed | (~real & (j == i))
    mask = torch.zeros(allowed.shape, dtype=torch.float32).masked_fill_(~allowed, float("-inf"))
    return mask[:, None].repeat(1, 1, groups, 1).to(device)


def replay_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    replay_round: ReplayRound | None = None,
    replay_plan: Any = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA over ``[past | new]`` rows with the round's mask and β; returns ``([B, N, H_q, d_v], None)``.

    With a ``replay_plan`` (one-pass replay, :class:`~compaction_gym.trainers.replay_onepass.
    OnePassReplay`) the plan computes the layer's attention; without either (a plain forward) it is
    Hugging Face's SDPA attention.
    """
    if replay_plan is not None:
        return replay_plan.attend(module.layer_idx, query, key, value, scaling), None
    if replay_round is None:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    r = replay_round
    layer = module.layer_idx
    r.keys[layer], r.values[layer] = key, value
    if r.record_queries:
        r.queries[layer] = query
    past_k, past_v = r.past_keys[layer], r.past_values[layer]
    k = key if past_k is None else torch.cat([past_k, key], dim=2)
    v = value if past_v is None else torch.cat([past_v, value], dim=2)
    if r.beta is None:
        return grouped_sdpa(query, k, v, r.mask.to(query.dtype), scaling=scaling, dropout=dropout), None
    if query.dtype in (torch.bfloat16, torch.float16) and k.dtype == query.dtype:  # β inside the half product
        out = folded_bias_sdpa(query, k, v, r.beta[layer], r.mask.to(query.dtype), scaling=scaling, dropout=dropout)
        return out, None
    # as the engine: β is float32, so the product runs in (at least) float32, and an enclosing
    # autocast must not recast it
    dtype = torch.promote_types(query.dtype, torch.float32)
    mask = r.mask.to(dtype) + r.beta[layer][:, :, None, :].to(dtype)
    with torch.autocast(query.device.type, enabled=False):
        out = grouped_sdpa(query, k, v, mask, scaling=scaling, dropout=dropout, compute_dtype=dtype)
    return out, None


def register_replay_attention() -> str:
    """Register :func:`replay_attention` (and SDPA's mask builder) under :data:`REPLAY_ATTENTION`; idempotent."""
    if AttentionInterface._global_mapping.get(REPLAY_ATTENTION) is not replay_attention:
        AttentionInterface.register(REPLAY_ATTENTION, replay_attention)
        AttentionMaskInterface.register(REPLAY_ATTENTION, sdpa_mask)
    return REPLAY_ATTENTION


def install_replay_attention(model: torch.nn.Module) -> None:
    """Switch ``model`` to :data:`REPLAY_ATTENTION` for good (plain forwards then run SDPA).

    Needed when replay gradients are computed with gradient checkpointing: the recomputation in
    ``backward`` happens after any temporary switch would have been undone.
    """
    unwrap(model).config._attn_implementation = register_replay_attention()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module under DDP/FSDP-style ``.module`` wrappers (PEFT models are kept: they forward ``config``)."""
    while (
        hasattr(model, "module")
        and isinstance(model.module, torch.nn.Module)
        and not hasattr(model, "config")
    ):
        model = model.module
    return model


@contextmanager
def use_attention(model: torch.nn.Module, name: str) -> Iterator[None]:
    """Run ``model`` with attention implementation ``name`` inside the block, then restore it.

    Attention modules read ``config._attn_implementation`` at every forward, so switching the
    config is enough (and cheap); the original value is restored even on error.
    """
    config = unwrap(model).config
    before = config._attn_implementation
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = before
