"""Host → device copies that do not wait for the device (docs/engine.md, "Batched events").

A plain ``tensor.to("cuda")`` from pageable memory synchronises the stream (PyTorch copies and then
waits), so every index tensor built on the host would stall the host until the device had drained
its queue. :func:`upload` packs several host tensors of one dtype into one pinned buffer and copies
it asynchronously: one copy, no synchronisation (the caching host allocator keeps the pinned block
alive until the copy has run).
"""

from __future__ import annotations

import numpy as np
import torch


def upload(tensors: list[torch.Tensor | np.ndarray], device: torch.device) -> list[torch.Tensor]:
    """``tensors`` (host tensors or numpy arrays, one dtype) on ``device`` in one asynchronous copy,
    each reshaped as given (views of one buffer); on a CPU ``device``, the tensors themselves (an
    array as a tensor sharing its memory)."""
    tensors = [torch.from_numpy(np.ascontiguousarray(t)) if isinstance(t, np.ndarray) else t for t in tensors]
    if device.type == "cpu":
        return tensors
    flat = torch.empty(
        sum(t.numel() for t in tensors), dtype=tensors[0].dtype, pin_memory=device.type == "cuda"
    )
    torch.cat([t.reshape(-1) for t in tensors], out=flat)
    flat = flat.to(device, non_blocking=True)
    out, a = [], 0
    for t in tensors:
        out.append(flat[a : a + t.numel()].view(t.shape))
        a += t.numel()
    return out
