"""Row gathers at memory bandwidth: ``x[idx]`` for a ``[rows, d]`` matrix (docs/fast-path.md, "Row gathers").

One-pass replay lays every piece's keys, values, probes and query rows out by row gathers
(``torch.nn.functional.embedding``): on an H100 PyTorch's gather kernel moves bf16 rows of 128 at
~0.83 TB/s, while one Triton program per 32 rows (one index load per row, each row one vector load
and store) moves them at ~3.5 TB/s (``benchmarks/bench_gather.py``). :func:`gather_rows` is that
kernel, with ``embedding``'s backward (the gradient of every source row summed after sorting the
indices) so that gradients are the same bits as through ``embedding``. Where Triton or CUDA is
missing it *is* ``embedding``.
"""

from __future__ import annotations

from typing import Any

import torch

from compaction_gym.engine.fast.kernels import HAS_TRITON

#: bytes of one program's rows (32 rows of 128 bf16; measured flat from 16 to 128 rows)
_PROGRAM_BYTES = 8192

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _gather_rows_kernel(X, IDX, OUT, n, rows, stride_x, D: tl.constexpr, BLOCK_D: tl.constexpr,
                            BLOCK_R: tl.constexpr):  # fmt: skip
        r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
        live = r < n
        src = tl.load(IDX + r, mask=live, other=0).to(tl.int64)
        # an index outside [0, rows) reads nothing (a zero row) instead of memory past x
        ok = live & (src >= 0) & (src < rows)
        d = tl.arange(0, BLOCK_D)
        dmask = d < D
        v = tl.load(X + src[:, None] * stride_x + d[None, :], mask=ok[:, None] & dmask[None, :], other=0)
        out = v.to(OUT.dtype.element_ty)
        tl.store(OUT + r[:, None].to(tl.int64) * D + d[None, :], out, mask=live[:, None] & dmask[None, :])


def gather_supported(x: torch.Tensor, idx: torch.Tensor) -> bool:
    """Whether :func:`gather_rows` runs the Triton kernel for these operands (else ``embedding``)."""
    return (
        HAS_TRITON
        and x.is_cuda
        and idx.device == x.device
        and x.dim() == 2
        and x.stride(1) == 1
        and idx.dtype in (torch.int32, torch.int64)
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.int32, torch.int64)
    )


def _launch(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``x[idx]`` ``[*idx.shape, d]`` in ``dtype``, as a fresh tensor of that shape, never a view: a
    view made inside an autograd Function may not be written in place afterwards, and the folded-β
    attention writes its β columns into the gathered keys."""
    flat = idx.reshape(-1).contiguous()
    n, d = flat.numel(), x.shape[1]
    out = torch.empty((*idx.shape, d), dtype=dtype, device=x.device)  # rows at r·d, as [n, d]
    if n and d:
        block_d = triton.next_power_of_2(d)
        block_r = max(1, min(128, _PROGRAM_BYTES // (block_d * max(x.element_size(), out.element_size()))))
        _gather_rows_kernel[(triton.cdiv(n, block_r),)](
            x, flat, out, n, x.shape[0], x.stride(0), D=d, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4
        )
    return out


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        ctx.save_for_backward(idx)
        ctx.rows, ctx.dtype = x.shape[0], x.dtype
        return _launch(x, idx, dtype)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor | None, None, None]:
        (idx,) = ctx.saved_tensors
        # the cast's backward, then embedding's own: the same sums as through embedding and .to(dtype)
        rows = torch.ops.aten.embedding_dense_backward(
            grad.reshape(-1, grad.shape[-1]).to(ctx.dtype), idx.reshape(-1), ctx.rows, -1, False
        )
        return rows, None, None


def gather_rows(x: torch.Tensor, idx: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """``x[idx]``: rows of a 2-D ``x`` ``[rows, d]`` for indices of any shape, ``[*idx.shape, d]``;
    with ``dtype``, cast in the same pass (``x[idx].to(dtype)`` without the second pass over the rows).

    The same values as ``torch.nn.functional.embedding(idx, x)`` and, when ``x`` requires a
    gradient, its gradient (embedding's backward). Indices must lie in ``[0, rows)`` (on the
    Triton path one outside reads a zero row; ``embedding`` raises).
    """
    dtype = x.dtype if dtype is None else dtype
    if not gather_supported(x, idx):
        return torch.nn.functional.embedding(idx, x).to(dtype)
    if x.requires_grad and torch.is_grad_enabled():
        return _GatherRows.apply(x, idx, dtype)
    return _launch(x, idx, dtype)


__all__ = ["gather_rows", "gather_supported"]
