"""A vLLM-loaded model seen as a Hugging Face causal LM, so the embedded engine can drive it (docs/vllm.md).

Inside a vLLM worker, :class:`VLLMCausalLM` wraps the model vLLM loaded (and, under tensor
parallelism, sharded): the engine's :class:`~compaction_gym.engine.model_runner.ModelRunner` calls
it exactly as it calls an HF model (``input_ids``/``position_ids`` ``[B, N]``, a
``past_key_values`` cache, ``logits_to_keep``) and gets ``.logits`` back. The forward runs vLLM's
own decoder (embeddings, fused QKV projection, q/k norms, rotary, RMS norms, MLP, final norm,
LM head) on the flattened tokens; only each layer's attention call ``self.attn(q, k, v)`` is
replaced, for the duration of the forward, by :class:`SlotAttentionLayer`, which feeds the
engine's slot cache and attention function (:func:`compaction_gym.engine.attention.slot_attention`:
mask, β, query recording). So sessions, compaction, sampling and events are the embedded engine's
own code; vLLM's paged KV cache and attention backend are not used.

Families: :data:`SUPPORTED_ARCHITECTURES` (Qwen3, Qwen2, Llama); others are refused with
:class:`~compaction_gym.errors.InvalidArgumentError`.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from compaction_gym.engine.attention import slot_attention
from compaction_gym.errors import InvalidArgumentError

#: vLLM model classes whose attention layers call ``self.attn(q, k, v)`` with post-RoPE q/k.
SUPPORTED_ARCHITECTURES = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM")


def check_architecture(model: nn.Module, hf_config: Any) -> None:
    """Refuse a model outside :data:`SUPPORTED_ARCHITECTURES` or not shaped like them."""
    name = type(model).__name__
    if name not in SUPPORTED_ARCHITECTURES:
        archs = getattr(hf_config, "architectures", None)
        raise InvalidArgumentError(
            f"model: the vLLM backend supports {', '.join(SUPPORTED_ARCHITECTURES)}; "
            f"this model is {name} (architectures {archs})"
        )
    layer_types = getattr(hf_config, "layer_types", None) or []
    if any(t != "full_attention" for t in layer_types):
        raise InvalidArgumentError(
            f"model: the vLLM backend supports full-attention layers only; this model has layer types "
            f"{sorted(set(layer_types))}"
        )
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None or any(not hasattr(getattr(lay, "self_attn", None), "attn") for lay in layers):
        raise InvalidArgumentError(f"model: {name} has layers without self_attn.attn (pipeline parallelism?)")


class SlotAttentionLayer(nn.Module):
    """Stands in for one vLLM ``Attention`` module during the engine's forwards.

    Takes vLLM's flat ``q [T, H·d]``, ``k``/``v [T, H_kv·d]`` (``T = B·N`` tokens, post-RoPE),
    writes K/V into the slot cache, attends with the engine's attention function and returns
    ``[T, H·d]``. ``layer_idx`` and ``scaling`` are what the engine's layout and β lookup read.
    """

    def __init__(self, layer_idx: int, n_heads: int, n_kv_heads: int, head_dim: int, scaling: float) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.scaling = scaling
        self.batch: tuple[int, int, Any] | None = None  # (B, N, past_key_values) of the running forward

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        assert self.batch is not None, "SlotAttentionLayer runs inside VLLMCausalLM.forward only"
        b, n, cache = self.batch
        q = query.view(b, n, self.n_heads, self.head_dim).transpose(1, 2)
        k = key.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = value.view(b, n, self.n_kv_heads, self.head_dim).transpose(1, 2)
        k_all, v_all = cache.update(k, v, self.layer_idx)
        out, _ = slot_attention(self, q, k_all, v_all, None, scaling=self.scaling)
        return out.reshape(b * n, self.n_heads * self.head_dim)


class VLLMCausalLM(nn.Module):
    """The HF-shaped view of a vLLM ``*ForCausalLM`` that the engine's runner drives.

    Args:
        model: the vLLM model (``worker.model_runner.get_model()``), one of
            :data:`SUPPORTED_ARCHITECTURES`.
        hf_config: vLLM's ``model_config.hf_config``; copied, with this rank's head counts.
        generation_config: the checkpoint's ``GenerationConfig`` (EOS ids), or ``None``.
        tp_size: tensor-parallel world size; above 1 the logits are all-gathered so every rank
            samples the same tokens.
    """

    def __init__(self, model: nn.Module, hf_config: Any, generation_config: Any = None, tp_size: int = 1) -> None:
        super().__init__()
        check_architecture(model, hf_config)
        object.__setattr__(self, "vllm_model", model)  # not a submodule: its attention modules stay hidden
        self.tp_size = tp_size
        attns = [layer.self_attn for layer in model.model.layers]
        first = attns[0]
        self.config = copy.deepcopy(hf_config)
        text = self.config.get_text_config()
        text.num_attention_heads = first.num_heads  # this rank's shard of the heads
        text.num_key_value_heads = first.num_kv_heads
        text.head_dim = first.head_dim
        self.vocab_size = int(text.vocab_size)
        self.generation_config = generation_config
        self.shims = nn.ModuleList(
            SlotAttentionLayer(i, a.num_heads, a.num_kv_heads, a.head_dim, float(a.scaling))
            for i, a in enumerate(attns)
        )
        self._attns = attns
        self.eval()

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        """vLLM's parameters (the engine reads their device and dtype)."""
        return self.vllm_model.parameters(recurse)

    def get_input_embeddings(self) -> SimpleNamespace:
        """The vocabulary size as ``num_embeddings`` (the engine's id check)."""
        return SimpleNamespace(num_embeddings=self.vocab_size)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Any,
        use_cache: bool = True,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> SimpleNamespace:
        """``.logits [B, k, V]`` (float, this rank's full vocabulary) of the last ``logits_to_keep`` columns (0: all)."""
        b, n = input_ids.shape
        originals = [a.attn for a in self._attns]
        for a, shim in zip(self._attns, self.shims):
            shim.batch = (b, n, past_key_values)
            a.attn = shim
        try:  # the undecorated forward: no torch.compile / CUDA-graph wrapper, no vLLM forward context
            hidden = self.vllm_model.model.forward(input_ids.reshape(-1), position_ids.reshape(-1), None)
        finally:
            for a, shim, original in zip(self._attns, self.shims, originals):
                a.attn = original
                shim.batch = None
        hidden = hidden.view(b, n, -1)
        if logits_to_keep:
            hidden = hidden[:, -logits_to_keep:]
        logits = self._logits(hidden.reshape(-1, hidden.shape[-1]))
        return SimpleNamespace(logits=logits.view(b, hidden.shape[1], -1))

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        lm = self.vllm_model
        if self.tp_size == 1:
            logits = lm.logits_processor(lm.lm_head, hidden)
        else:  # every rank needs the logits to sample the same token
            from vllm.distributed import tensor_model_parallel_all_gather

            local = lm.logits_processor(lm.lm_head, hidden, skip_gather=True)
            logits = tensor_model_parallel_all_gather(local)
        return logits[..., : self.vocab_size]
