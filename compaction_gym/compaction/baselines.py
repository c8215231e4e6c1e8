"""Selection-only baselines as the field defines them: H2O, SnapKV, TOVA, StreamingLLM, key norm, random.

Each returns absolute cache indices ``[B, t]`` inside the span, ascending per row; the caller
keeps the original values at those rows and fits no β. The definitions follow the papers and
NVIDIA kvpress 0.5.5's presses (docs/compaction.md, "Modes"): with ``query_positions`` (the
cache row of each probe) a probe only sees keys at rows ``≤`` its own, as in a causal prefill;
without them every probe sees the whole cache.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from compaction_gym.compaction.scoring import top_indices

SNAPKV_KERNEL = 5  # SnapKV's (and kvpress') default avg-pool width over positions
STREAMING_SINKS = 4  # StreamingLLM (and kvpress) keep 4 attention-sink tokens


def visible(query_positions: torch.Tensor | None, logits: torch.Tensor) -> torch.Tensor | None:
    """Which keys each probe sees, ``[B or 1, n, T]`` bool (``None``: all of them)."""
    if query_positions is None:
        return None
    pos = query_positions if query_positions.dim() == 2 else query_positions[None]
    keys = torch.arange(logits.shape[-1], device=logits.device)
    return keys[None, None, :] <= pos[:, :, None]


def probe_attention(logits: torch.Tensor, query_positions: torch.Tensor | None = None) -> torch.Tensor:
    """Row softmax of ``logits [B, n, T]``, causally masked by ``query_positions`` when given."""
    mask = visible(query_positions, logits)
    if mask is not None:
        logits = logits.masked_fill(~mask, float("-inf"))
    return torch.softmax(logits, dim=-1)


def h2o_indices(
    logits: torch.Tensor,
    span: tuple[int, int],
    target: int,
    *,
    query_positions: torch.Tensor | None = None,
    average: bool = True,
) -> torch.Tensor:
    """H2O heavy hitters by observed attention (kvpress ``ObservedAttentionPress``).

    Score of key ``j``: the probes' attention to it summed and divided by the number of probes
    that can see it (``average=True``, the default: kvpress; without ``query_positions`` every
    probe sees every key and this is the mean). ``average=False`` keeps the plain accumulated sum
    of the H2O paper's score, which favours early keys under a causal mask.
    """
    start, end = span
    attn = probe_attention(logits, query_positions)[:, :, start:end]
    scores = attn.sum(dim=1)
    mask = visible(query_positions, logits)
    if average and mask is not None:
        seen = mask[:, :, start:end].sum(dim=1).to(scores.dtype)
        scores = torch.where(seen > 0, scores / seen.clamp_min(1), torch.zeros_like(scores))
    return top_indices(scores, target, start)


def snapkv_indices(
    logits: torch.Tensor,
    span: tuple[int, int],
    target: int,
    kernel_size: int = SNAPKV_KERNEL,
    *,
    query_positions: torch.Tensor | None = None,
    count_include_pad: bool = True,
) -> torch.Tensor:
    """SnapKV (kvpress ``SnapKVPress``): the probes' mean attention per key, average-pooled, top-t.

    The observation window's attention is causally masked when ``query_positions`` are given;
    the votes are pooled over positions ``j ± kernel_size // 2`` inside the span with zero
    padding counted in the mean (``count_include_pad=True``, as kvpress' ``F.avg_pool1d``), so
    keys at the span's edges score lower. ``count_include_pad=False`` averages only the span
    keys inside the window.
    """
    start, end = span
    votes = probe_attention(logits, query_positions)[:, :, start:end].mean(dim=1)
    pad = kernel_size // 2
    pooled = F.avg_pool1d(
        votes[:, None, :], 2 * pad + 1, stride=1, padding=pad, count_include_pad=count_include_pad
    )
    return top_indices(pooled[:, 0], target, start)


def tova_indices(
    logits: torch.Tensor,
    span: tuple[int, int],
    target: int,
    *,
    query_positions: torch.Tensor | None = None,
    layer_rows: int | None = None,
) -> torch.Tensor:
    """TOVA (Oren et al. 2024; kvpress ``TOVAPress``): keep the keys the *last* query attends to most.

    The last query is every probe at the row's largest ``query_positions`` (one per query head of
    the KV group, as :func:`~compaction_gym.compaction.probes.gqa_probes` stacks them), or the last
    probe row when no positions are given; its attention is averaged over those heads. With
    ``layer_rows = H_kv`` the average also runs over the layer's KV heads (consecutive groups of
    ``layer_rows`` rows), so every head of a layer keeps the same keys, as TOVA and kvpress do.
    """
    start, end = span
    attn = probe_attention(logits, query_positions)[:, :, start:end]
    if query_positions is None:
        last = torch.zeros(attn.shape[:2], dtype=torch.bool, device=attn.device)
        last[:, -1] = True
    else:
        pos = query_positions if query_positions.dim() == 2 else query_positions[None]
        last = (pos == pos.amax(dim=-1, keepdim=True)).expand(attn.shape[0], -1)
    weights = last.to(attn.dtype)
    scores = (attn * weights[:, :, None]).sum(1) / weights.sum(1, keepdim=True)
    if layer_rows is not None:
        scores = scores.view(-1, layer_rows, scores.shape[-1]).mean(dim=1, keepdim=True)
        scores = scores.expand(-1, layer_rows, -1).reshape(-1, scores.shape[-1])
    return top_indices(scores, target, start)


def knorm_indices(keys: torch.Tensor, span: tuple[int, int], target: int) -> torch.Tensor:
    """Key norm (Devoto et al. 2024; kvpress ``KnormPress``): keep the keys with the LOWEST L2 norm.

    A low key norm correlates with high attention (the paper's finding), so the score is ``−‖k_j‖``.
    """
    start, end = span
    norms = (
        keys[:, start:end].to(torch.float64 if keys.dtype == torch.float64 else torch.float32).norm(dim=-1)
    )
    return top_indices(-norms, target, start)


def streaming_indices(
    batch: int,
    span: tuple[int, int],
    target: int,
    device: torch.device | str = "cpu",
    *,
    n_sink: int = STREAMING_SINKS,
) -> torch.Tensor:
    """StreamingLLM (kvpress ``StreamingLLMPress``): ``min(n_sink, target)`` sink tokens at the span
    start, the rest the most recent rows (kvpress prunes the rows right after the sinks)."""
    start, end = span
    sinks = min(n_sink, target)
    rows = torch.cat(
        [
            torch.arange(start, start + sinks, device=device),
            torch.arange(end - (target - sinks), end, device=device),
        ]
    )
    return rows[None, :].expand(batch, -1).clone()


def random_indices(
    batch: int, span: tuple[int, int], target: int, seed: int | None, device: torch.device | str = "cpu"
) -> torch.Tensor:
    """A uniform random ``target``-subset of the span per row, drawn on CPU from ``seed``.

    The same ``seed`` gives the same subsets on every device; ``None`` draws from a fresh seed.
    """
    start, end = span
    generator = torch.Generator(device="cpu")
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(seed)
    noise = torch.rand(batch, end - start, generator=generator)
    return top_indices(noise, target, start).to(device)
