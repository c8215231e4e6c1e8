"""The GPU fast path of the engine (Qwen3, Qwen2, Llama families) (docs/fast-path.md).

* :mod:`~compaction_gym.engine.fast.model` — :class:`FastDecoder`: the HF model's own weights
  (q/k/v and gate/up packed in place), one fused kernel per normalisation / rotary / activation;
* :mod:`~compaction_gym.engine.fast.kernels` — those Triton kernels and their torch references;
* :mod:`~compaction_gym.engine.fast.gemv` — the split-K GEMV for decode batches of ≤ 32 rows (used
  per projection where it measured faster than cuBLAS);
* :mod:`~compaction_gym.engine.fast.attention` — split-K flash-decode and varlen prefill
  attention over the slot cache with per-key β, plus fallbacks and a float64 reference;
* :mod:`~compaction_gym.engine.fast.runner` — :class:`FastModelRunner`: the generic runner's
  contract with CUDA-graph decode per batch-size bucket, and a device-resident ``generate``;
* :mod:`~compaction_gym.engine.fast.sampler` — sampling on the device with counter-based RNG;
* :mod:`~compaction_gym.engine.fast.compaction` — :func:`compact_fast`, fused Attention Matching;
* :mod:`~compaction_gym.engine.fast.nnls` — β's NNLS as a fixed number of FISTA iterations in one
  Triton kernel (no factorisation, no host sync);
* :mod:`~compaction_gym.engine.fast.softmax` — one-pass replay's design softmaxes in one pass;
* :mod:`~compaction_gym.engine.fast.flex` — one-pass replay's β attention through FlexAttention;
* :mod:`~compaction_gym.engine.fast.gather` — row gathers at memory bandwidth (one-pass replay's layouts).

``Engine(..., fast=None)`` picks this path on CUDA for supported models. See docs/fast-path.md.
"""

from compaction_gym.engine.fast.compaction import compact_fast
from compaction_gym.engine.fast.kernels import HAS_TRITON
from compaction_gym.engine.fast.model import SUPPORTED_MODEL_TYPES, FastDecoder, unsupported_reason
from compaction_gym.engine.fast.runner import FastModelRunner, graph_buckets

__all__ = [
    "HAS_TRITON",
    "SUPPORTED_MODEL_TYPES",
    "FastDecoder",
    "FastModelRunner",
    "compact_fast",
    "graph_buckets",
    "unsupported_reason",
]
