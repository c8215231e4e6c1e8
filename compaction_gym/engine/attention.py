"""The attention function registered with transformers, and the Cache that feeds it slot rows.

Any HF causal LM whose attention layers call ``past_key_values.update(k, v, layer_idx)`` and then
``ALL_ATTENTION_FUNCTIONS[config._attn_implementation](module, q, k, v, mask, scaling=...)``
(Llama, Qwen2, Qwen3, Mistral, ... in transformers 5.x) runs on the slot cache while its config
names ``ATTENTION_NAME``. The engine never leaves it there: :class:`EngineForward` switches the
caller's model to it (and to eval mode) around each of the engine's own forwards only, so the
model keeps its own attention implementation and mode between engine calls (docs/engine.md):

* :class:`SlotCache.update` writes the new tokens' post-RoPE K/V into their slot rows and returns
  the batch's live rows ``[B, H_kv, kv_len, d]``;
* :func:`slot_attention` adds the padding/causal mask and per-layer, per-KV-head β (float32) to
  the logits, records post-RoPE queries for ``suffix`` probes, and calls SDPA.

HF builds no mask for an attention name it does not know, so all masking comes from the
:class:`~compaction_gym.engine.context.ForwardContext`.
"""

from __future__ import annotations

from types import TracebackType

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache

from compaction_gym.engine.context import get_context
from compaction_gym.engine.slot_cache import SlotKVCache

#: The ``attn_implementation`` name the engine registers.
ATTENTION_NAME = "compaction_gym"


def slot_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """SDPA over slot rows with the context's mask and β; returns ``([B, N, H_q, d_v], None)``.

    Query heads are grouped by KV head (``[B, H_kv, G * N, d]``), so K/V are never repeated and β
    (per KV head) broadcasts over the group. With β and a half-precision model the product runs
    in float32 so that β keeps its precision.
    """
    ctx = get_context()
    n = query.shape[2]
    if ctx.record_rows is not None:
        ctx.recorded.append(query[ctx.record_rows, :, n - ctx.record_cols :])
    mask = ctx.mask
    if ctx.use_beta:
        beta = ctx.cache.read_beta(module.layer_idx, ctx)[:, :, None, :]
        mask = beta if mask is None else mask + beta
    # promote, never downcast (float64 models stay float64)
    compute = torch.promote_types(mask.dtype, query.dtype) if mask is not None else None
    if ctx.use_beta:  # β keeps float32 even under a trainer's autocast, as replay's attention does
        with torch.autocast(query.device.type, enabled=False):
            return grouped_sdpa(query, key, value, mask, scaling=scaling, compute_dtype=compute), None
    return grouped_sdpa(query, key, value, mask, scaling=scaling, compute_dtype=compute), None


def grouped_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """``scaled_dot_product_attention`` with the query heads grouped by KV head.

    The engine's attention and compaction replay's
    (:func:`compaction_gym.trainers.replay_attention.replay_attention`) both end here, so a
    rollout and its replay run the same product.

    Args:
        query: ``[B, H_q, N, d]``, ``H_q`` a multiple of ``H_kv``.
        key / value: ``[B, H_kv, S, d]`` / ``[B, H_kv, S, d_v]``; never repeated per query head.
        mask: additive mask broadcastable to ``[B, H_kv, G·N, S]`` (query ``g·N + i`` is head
            ``g`` of the group, token ``i``), or ``None``.
        compute_dtype: cast ``q``, ``k``, ``v`` and ``mask`` to it first (e.g. float32 for β).

    Returns:
        ``[B, N, H_q, d_v]`` in ``query``'s dtype.
    """
    batch, q_heads, n, d = query.shape
    q = query.reshape(batch, key.shape[1], -1, d)
    out = grouped_sdpa_heads(q, key, value, mask, scaling=scaling, dropout=dropout, compute_dtype=compute_dtype)
    return out.to(query.dtype).reshape(batch, q_heads, n, -1).transpose(1, 2)


def grouped_sdpa_heads(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
    compute_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """:func:`grouped_sdpa` for queries already grouped by KV head, ``[B, H_kv, G·N, d]`` (query
    ``g·N + i`` of KV head ``h`` is head ``h·G + g``, token ``i``); returns ``[B, H_kv, G·N, d_v]``
    in the compute dtype (one-pass replay gathers its queries straight into this layout)."""
    if compute_dtype is not None:
        query, key, value = query.to(compute_dtype), key.to(compute_dtype), value.to(compute_dtype)
        mask = mask.to(compute_dtype) if mask is not None else None
    return F.scaled_dot_product_attention(query, key, value, attn_mask=mask, dropout_p=dropout, scale=scaling)


#: Head-dim columns that carry β in :func:`folded_bias_sdpa`: three half-precision terms, then zeros
#: to keep the head dim a multiple of 8 (what the fused attention kernels take).
BIAS_COLUMNS, FOLD_PAD = 3, 8


def folded_bias_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    bias: torch.Tensor,
    mask: torch.Tensor | None,
    *,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """:func:`~compaction_gym.engine.attention.grouped_sdpa` with a per-key bias ``[B, H_kv, S]``
    (β) added to the logits, in the inputs' half precision.

    The bias rides in extra head-dim columns: ``q' = [q, 1, 1, 1, 0…]`` and
    ``k' = [k, r₁, r₂, r₃, 0…]`` with ``r₁ + r₂ + r₃ = β / scale`` (three half-precision terms: ~24
    bits, float32's precision), so ``scale · q'·k' = scale · q·k + β`` is formed in the kernel's
    float32 accumulator, as the engine's decode kernels form ``S + β``. Nothing ``[B, H, N, S]``
    sized is built per layer, and the product runs on the fused half-precision kernels instead of
    float32 attention over float32 copies of q, k and v (docs/grpo.md, "Replay in one pass"). Replay
    takes it for half-precision models; ``mask`` is additive, broadcastable to ``[B, H_kv, G·N, S]``."""
    key = pad_head(key)
    scale = write_bias_columns(key, bias, scaling)
    out = grouped_sdpa(fold_query(query), key, pad_head(value), mask, scaling=scale, dropout=dropout)
    return out[..., : value.shape[-1]]


def write_bias_columns(key: torch.Tensor, bias: torch.Tensor, scaling: float | None) -> float:
    """Write ``β / scale`` into the β columns of padded keys (:func:`pad_head`) ``[..., d + FOLD_PAD]``
    as :data:`BIAS_COLUMNS` terms of the keys' dtype whose float32 sum is ``β / scale`` to ~24 bits
    (each term rounds what the previous ones left); ``bias`` is ``key.shape[:-1]``. Returns the
    logit scale the columns assume: ``scaling``, or ``d ** -0.5`` of the unpadded head dim."""
    d = key.shape[-1] - FOLD_PAD
    scale = scaling if scaling is not None else d**-0.5
    rest = bias.float() / scale
    for j in range(BIAS_COLUMNS):
        term = rest.to(key.dtype)
        key[..., d + j] = term
        rest = rest - term.float()
    return scale


def fold_query(query: torch.Tensor) -> torch.Tensor:
    """``[q, 1, 1, 1, 0…]``: the query side of :func:`folded_bias_sdpa` (head dim + :data:`FOLD_PAD`)."""
    ones = query.new_ones(*query.shape[:-1], BIAS_COLUMNS)
    return torch.cat([query, ones, query.new_zeros(*query.shape[:-1], FOLD_PAD - BIAS_COLUMNS)], -1)


def pad_head(x: torch.Tensor) -> torch.Tensor:
    """``x`` with :data:`FOLD_PAD` zero columns appended (keys before :func:`write_bias_columns`, values)."""
    return torch.cat([x, x.new_zeros(*x.shape[:-1], FOLD_PAD)], -1)


class SlotCache(Cache):
    """A transformers ``Cache`` whose ``update`` reads and writes the engine's slot cache."""

    def __init__(self, slot_cache: SlotKVCache) -> None:
        super().__init__(layers=[])
        self.slot_cache = slot_cache

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):  # noqa: D401
        ctx = get_context()
        self.slot_cache.write(layer_idx, key_states, value_states, ctx)
        return self.slot_cache.read(layer_idx, ctx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return get_context().kv_len

    def __len__(self) -> int:
        return self.slot_cache.n_layers


def register_attention() -> str:
    """Register :func:`slot_attention` under :data:`ATTENTION_NAME` (idempotent); return the name."""
    if AttentionInterface._global_mapping.get(ATTENTION_NAME) is not slot_attention:
        AttentionInterface.register(ATTENTION_NAME, slot_attention)
    return ATTENTION_NAME


def _configs(config) -> list:
    """``config`` and its sub-configs, parents first (``_attn_implementation`` is set recursively)."""
    out = [config]
    for key in getattr(config, "sub_configs", None) or {}:
        sub = getattr(config, key, None)
        if sub is not None and hasattr(sub, "_attn_implementation"):
            out += _configs(sub)
    return out


class EngineForward:
    """Context for one of the engine's own forwards: the model runs :data:`ATTENTION_NAME` in eval
    mode inside the block, and gets back its own attention implementation(s) and mode after it.

    Attention modules read ``config._attn_implementation`` at every forward, so switching the
    config is enough (and cheap). Each config and sub-config gets its own value back, even on error.

    Args:
        model: the caller's model (PEFT wrappers are fine: they forward ``config``).
    """

    def __init__(self, model: torch.nn.Module) -> None:
        register_attention()
        self.model = model
        self.config = model.config
        self._configs = _configs(self.config)
        self._saved: list[tuple[object, object]] = []
        self._training: list[torch.nn.Module] = []

    def __enter__(self) -> EngineForward:
        assert not self._saved, "EngineForward is not reentrant"
        self._saved = [(c, c._attn_implementation) for c in self._configs]
        self.config._attn_implementation = ATTENTION_NAME  # the setter recurses into sub-configs
        if self.model.training:  # modules in training mode get it back exactly (mixed modes too)
            self._training = [m for m in self.model.modules() if m.training]
            self.model.eval()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for config, impl in self._saved:  # parents first: a child's own value is written last
            config._attn_implementation = impl
        self._saved = []
        for m in self._training:
            m.training = True
        self._training = []
