"""Skinny matrix products ``y = f(x) Wᵀ`` for decode batches of at most 32 rows (Triton).

At batch 1–32 a decode step's projections are memory-bound matrix-vector products: the weight
``W [N, K]`` is read once and the arithmetic is negligible. :func:`gemv` streams ``W`` in tiles
of ``BLOCK_N × BLOCK_K`` (16-byte loads along ``K``), multiplies them with the rows of ``x``
padded to 16 (or 32) on the tensor cores (float32 accumulation) and, when ``N`` alone gives too few
programs to fill the GPU, splits ``K``: each split writes a float32 partial, and the last split
program to finish a tile (an atomic counter per tile, reset by that program, so the launch is
CUDA-graph replayable) sums the partials in a fixed order and stores the output — no second
launch, deterministic results.

The optional input transform ``f`` fuses the kernels that precede a projection (measured slower
than running them separately — every program recomputes the transform in its critical path — so
:class:`~compaction_gym.engine.fast.model.FastDecoder` uses only the plain product, and only
where it beats cuBLAS; see docs/benchmarks.md):

* ``norm_weight``: HF's RMSNorm of ``x`` (normalise in float32, round, multiply by the weight,
  round), optionally of ``residual + x`` (rounded; written to ``residual_out`` by the programs of
  the first output tile): every program computes the rows' ``rsqrt(mean(h²) + eps)`` itself;
* ``silu``: ``x = [gate | up]`` ``[M, 2K]`` → ``silu(gate) · up`` with :func:`silu_mul`'s roundings.

The output epilogue ``act="silu_mul"`` (used by the decoder for gate/up) takes ``W = [gate; up]``
``[2I, K]`` as it is stored and gathers the rows so that each output tile holds matching gate and
up rows (tile column ``2j`` is gate row ``c``, ``2j + 1`` up row ``I + c``); the value stored —
at the single-split store or by the last split's reducer — is ``silu(gate) · up`` ``[M, I]`` with
:func:`~compaction_gym.engine.fast.kernels.silu_mul_ref`'s roundings. Any even ``BLOCK_N`` works,
no interleaved copy of the weight is needed, and the HF modules keep their views.

:func:`gemv_ref` is the torch reference (and what runs without Triton).
"""

from __future__ import annotations

import torch

from compaction_gym.engine.fast.kernels import (
    HAS_TRITON,
    launch_counters,
    pdl_kwargs,
    rms_norm_ref,
    silu_mul_ref,
    use_triton,
)

#: Largest number of rows :func:`gemv` takes (its tallest tensor-core tile; ≤ 16 rows use a 16-row tile).
GEMV_MAX_M = 32
#: Tilings the fast decoder times against cuBLAS for each projection shape (``{}``: the defaults).
GEMV_CANDIDATES: tuple[dict, ...] = (
    {}, {"block_k": 256}, {"block_n": 64}, {"block_n": 64, "block_k": 256},
    {"split": 1, "block_k": 512, "num_stages": 3},  # no split-K
    # one warp per program: the fastest at M = 1 on most Qwen3 shapes (docs/benchmarks.md, H200)
    {"num_warps": 1}, {"num_warps": 1, "block_k": 64}, {"num_warps": 1, "block_n": 16},
    {"num_warps": 1, "block_n": 16, "block_k": 256},
)  # fmt: skip

if HAS_TRITON:
    import triton
    import triton.language as tl

    from compaction_gym.engine.fast.kernels import pdl_prologue

    @triton.jit
    def _input_tile(X, R, RO, NW, offs_m, offs_k, mmask, kmask, stride_x, stride_r, stride_ro, K, rstd, write_res,
                    NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, SILU: tl.constexpr):  # fmt: skip
        """``f(x)`` for rows ``offs_m`` and columns ``offs_k`` in the model dtype (stores ``residual + x``
        into ``RO`` where ``write_res``)."""
        dt = X.dtype.element_ty
        mk = mmask[:, None] & kmask[None, :]
        xk = tl.load(X + offs_m[:, None] * stride_x + offs_k[None, :], mask=mk, other=0.0)
        if SILU:
            g = xk.to(tl.float32)
            u = tl.load(X + offs_m[:, None] * stride_x + K + offs_k[None, :], mask=mk, other=0.0).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            xk = (s * u).to(dt)
        if NORM:
            if HAS_RES:
                r = tl.load(R + offs_m[:, None] * stride_r + offs_k[None, :], mask=mk, other=0.0)
                xk = (r.to(tl.float32) + xk.to(tl.float32)).to(dt)
                if WRITE_RES:
                    tl.store(RO + offs_m[:, None] * stride_ro + offs_k[None, :], xk, mask=mk & write_res)
            w = tl.load(NW + offs_k, mask=kmask, other=0.0).to(tl.float32)
            xk = (w[None, :] * (xk.to(tl.float32) * rstd[:, None]).to(dt).to(tl.float32)).to(dt)
        return xk

    @triton.jit
    def _store_output(Y, BIAS, acc, pid_n, offs_m, offs_n, w_idx, mmask, nmask, N, stride_y,
                      HAS_BIAS: tl.constexpr, ACT: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):  # fmt: skip
        """Store the float32 tile ``acc`` (+ bias) in ``Y``'s dtype; with ``ACT``, ``silu(gate) · up``
        of its (gate, up) column pairs with :func:`silu_mul_ref`'s roundings (gate and up rounded as
        a projection's output would be, SiLU rounded, product rounded) into ``[M, N / 2]``."""
        dt = Y.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(BIAS + w_idx, mask=nmask, other=0.0).to(tl.float32)[None, :]
        if ACT:
            gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N // 2, 2]))
            g = gate.to(dt).to(tl.float32)
            s = (g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32)
            out = (s * up.to(dt).to(tl.float32)).to(dt)
            offs_c = pid_n * (BLOCK_N // 2) + tl.arange(0, BLOCK_N // 2)
            mask = mmask[:, None] & (offs_c < N // 2)[None, :]
            tl.store(Y + offs_m[:, None] * stride_y + offs_c[None, :], out, mask=mask)
        else:
            y_ptr = Y + offs_m[:, None] * stride_y + offs_n[None, :]
            tl.store(y_ptr, acc.to(dt), mask=mmask[:, None] & nmask[None, :])

    @triton.jit
    def _gemv_kernel(
        X, R, RO, NW, W, BIAS, Y, WS, CNT,
        M, N, K, k_split, stride_x, stride_r, stride_ro, stride_w, stride_y, eps,
        NORM: tl.constexpr, HAS_RES: tl.constexpr, WRITE_RES: tl.constexpr, SILU: tl.constexpr,
        HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, IEEE: tl.constexpr, ACT: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, PDL: tl.constexpr,
    ):  # fmt: skip
        pdl_prologue(PDL)
        pid_n = tl.program_id(0)
        pid_k = tl.program_id(1)
        offs_m = tl.arange(0, BLOCK_M)
        mmask = offs_m < M
        offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # columns of the tile (of [M, N])
        nmask = offs_n < N
        # with ACT, tile column 2j is gate row c and 2j + 1 up row N/2 + c, for output column c = offs_n // 2
        if ACT:  # noqa: SIM108 - a statement-level branch on a constexpr
            w_idx = offs_n // 2 + (offs_n % 2) * (N // 2)
        else:
            w_idx = offs_n
        rstd = tl.zeros([BLOCK_M], tl.float32)
        if NORM:  # the rows' RMS over all of K (each program: x is tiny next to W)
            ss = tl.zeros([BLOCK_M], tl.float32)
            for k0 in range(0, K, BLOCK_K):
                offs_k = k0 + tl.arange(0, BLOCK_K)
                kmask = offs_k < K
                mk = mmask[:, None] & kmask[None, :]
                h = tl.load(X + offs_m[:, None] * stride_x + offs_k[None, :], mask=mk, other=0.0)
                if HAS_RES:
                    r = tl.load(R + offs_m[:, None] * stride_r + offs_k[None, :], mask=mk, other=0.0)
                    h = (r.to(tl.float32) + h.to(tl.float32)).to(X.dtype.element_ty)
                hf = h.to(tl.float32)
                ss += tl.sum(hf * hf, axis=1)
            rstd = tl.rsqrt(ss / K + eps)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        k_lo = pid_k * k_split
        k_hi = tl.minimum(k_lo + k_split, K)
        w_rows = W + w_idx.to(tl.int64)[:, None] * stride_w
        write_res = pid_n == 0  # the first output tile's programs (one per split) write residual + x
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            kmask = offs_k < k_hi
            xk = _input_tile(X, R, RO, NW, offs_m, offs_k, mmask, kmask, stride_x, stride_r, stride_ro, K, rstd,
                             write_res, NORM, HAS_RES, WRITE_RES, SILU)  # fmt: skip
            w = tl.load(w_rows + offs_k[None, :], mask=nmask[:, None] & kmask[None, :], other=0.0)
            if IEEE:
                acc += tl.dot(xk, tl.trans(w), input_precision="ieee")
            else:
                acc += tl.dot(xk, tl.trans(w))
        out_mask = mmask[:, None] & nmask[None, :]
        if SPLIT == 1:
            _store_output(Y, BIAS, acc, pid_n, offs_m, offs_n, w_idx, mmask, nmask, N, stride_y,
                          HAS_BIAS, ACT, BLOCK_M, BLOCK_N)  # fmt: skip
        else:
            # partial of this split; the last split program of the tile reduces, in split order
            ws_tile = WS + offs_m[:, None] * N + offs_n[None, :]
            tl.store(ws_tile + pid_k * (BLOCK_M * N), acc, mask=out_mask)
            tl.debug_barrier()  # every thread's partial is stored before the counter moves
            done = tl.atomic_add(CNT + pid_n, 1, sem="acq_rel", scope="gpu")
            if done == SPLIT - 1:
                total = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
                for s in range(SPLIT):
                    total += tl.load(ws_tile + s * (BLOCK_M * N), mask=out_mask, other=0.0, cache_modifier=".cg")
                _store_output(Y, BIAS, total, pid_n, offs_m, offs_n, w_idx, mmask, nmask, N, stride_y,
                              HAS_BIAS, ACT, BLOCK_M, BLOCK_N)  # fmt: skip
                tl.atomic_xchg(CNT + pid_n, 0)  # ready for the next launch (graph replay)


_WORKSPACES: dict[tuple, torch.Tensor] = {}


def _workspace(device: torch.device, n: int, split: int, n_tiles: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Float32 partials ``[split, GEMV_MAX_M, n]`` (shared by launches of one shape) and zeroed tile counters
    (:func:`~compaction_gym.engine.fast.kernels.launch_counters`). Created on first use, outside
    graph capture: the runner's warm-up steps run first."""
    key = (device, n, split)
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(split, GEMV_MAX_M, n, dtype=torch.float32, device=device)
    cnt = launch_counters(device, n_tiles)
    assert cnt is not None, "the split-K GEMV's counters must exist before graph capture"
    return _WORKSPACES[key], cnt


def gemv_ref(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None, silu: bool = False, act: str | None = None,
) -> torch.Tensor:  # fmt: skip
    """Reference of :func:`gemv` (torch ops)."""
    if silu:
        x = silu_mul_ref(x)
    if norm_weight is not None:
        if residual is not None:
            h = (residual + x).to(x.dtype)
            if residual_out is not None:
                residual_out.copy_(h)
            x = rms_norm_ref(h, norm_weight, eps)
        else:
            x = rms_norm_ref(x, norm_weight, eps)
    y = torch.nn.functional.linear(x, weight, bias)
    return silu_mul_ref(y) if act == "silu_mul" else y


def gemv_supported(x: torch.Tensor, weight: torch.Tensor, act: str | None = None) -> bool:
    """Whether :func:`gemv` runs its kernel for these operands (else it runs :func:`gemv_ref`)."""
    return (
        (act is None or weight.shape[0] % 2 == 0)
        and use_triton(x)
        and x.dim() == 2
        and 0 < x.shape[0] <= GEMV_MAX_M
        and x.dtype == weight.dtype
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and weight.stride(-1) == 1
        and x.stride(-1) == 1
    )


def gemv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
    norm_weight: torch.Tensor | None = None, eps: float = 1e-6, residual: torch.Tensor | None = None,
    residual_out: torch.Tensor | None = None, silu: bool = False, act: str | None = None,
    sm_count: int | None = None, block_n: int | None = None, block_k: int | None = None, split: int | None = None,
    programs_per_sm: int = 2, num_warps: int = 4, num_stages: int | None = None,
) -> torch.Tensor:  # fmt: skip
    """``f(x) Wᵀ (+ bias)`` for ``x [M ≤ 32, K]`` (``[M, 2K]`` with ``silu``), ``W [N, K]`` → ``[M, N]``
    (``[M, N / 2]`` with ``act``).

    Args:
        x, weight, bias: the operands (same dtype; ``weight`` rows contiguous).
        norm_weight, eps: apply HF's RMSNorm to the input rows first (see module docstring).
        residual: with ``norm_weight``, normalise ``residual + x`` instead.
        residual_out: where ``residual + x`` is written (must not alias ``residual`` or ``x``).
        silu: the input is ``[gate | up]``; use ``silu(gate) · up``.
        act: ``"silu_mul"``: the output is ``silu_mul(f(x) Wᵀ)`` for ``W = [gate rows; up rows]``
            (``N`` even): each output tile multiplies matching gate and up rows, and the value
            stored is ``silu(gate) · up`` with :func:`silu_mul_ref`'s roundings.
        sm_count: multiprocessors of the device (for the split-K choice).
        block_n, block_k, split: override the tiling (tests and benchmarks).
        programs_per_sm: without ``split``, split ``K`` until the launch has about this many
            programs per multiprocessor (more programs keep more weight bytes in flight).
        num_warps, num_stages: the Triton launch's warps and software-pipeline depth (default:
            as many stages of the ``W`` tile as fit 160 KiB, 2 to 4).
    """
    assert act in (None, "silu_mul"), act
    if not gemv_supported(x, weight, act):
        return gemv_ref(
            x, weight, bias, norm_weight=norm_weight, eps=eps, residual=residual, residual_out=residual_out,
            silu=silu, act=act,
        )  # fmt: skip
    m = x.shape[0]
    block_m = 16 if m <= 16 else GEMV_MAX_M
    n, k = weight.shape
    assert x.shape[1] == (2 * k if silu else k), (tuple(x.shape), tuple(weight.shape), silu)
    assert residual is None or norm_weight is not None
    assert residual_out is None or residual is not None
    sms = sm_count or torch.cuda.get_device_properties(x.device).multi_processor_count
    ieee = x.dtype == torch.float32
    bk = min(block_k or 128, 64 if ieee else 512)
    # wide tiles even when they leave SMs idle: at M = 1 a program's fixed cost (x loads, split-K
    # partials) outweighs parallelism (docs/benchmarks.md, "GEMV tilings")
    bn = block_n or (64 if triton.cdiv(n, 64) >= 4 * sms else 32)
    n_tiles = triton.cdiv(n, bn)
    if split is None:
        split = max(1, min(triton.cdiv(programs_per_sm * sms, n_tiles), k // (4 * bk)))
    k_split = triton.cdiv(triton.cdiv(k, split), bk) * bk
    split = triton.cdiv(k, k_split)
    y = x.new_empty(m, n // 2 if act else n)
    if split > 1:
        ws, cnt = _workspace(x.device, n, split, n_tiles)
    else:
        ws = cnt = y
    r = residual if residual is not None else x
    ro = residual_out if residual_out is not None else r
    _gemv_kernel[(n_tiles, split)](
        x, r, ro, norm_weight if norm_weight is not None else x, weight, bias if bias is not None else x, y, ws, cnt,
        m, n, k, k_split, x.stride(0), r.stride(0), ro.stride(0), weight.stride(0), y.stride(0), eps,
        NORM=norm_weight is not None, HAS_RES=residual is not None, WRITE_RES=residual_out is not None, SILU=silu,
        HAS_BIAS=bias is not None, SPLIT=split, IEEE=ieee, ACT=act is not None, BLOCK_M=block_m, BLOCK_N=bn,
        BLOCK_K=bk, num_warps=num_warps,
        num_stages=num_stages or max(2, min(4, (160 << 10) // ((bn + block_m) * bk * x.element_size()))),
        **pdl_kwargs(x),
    )  # fmt: skip
    return y
