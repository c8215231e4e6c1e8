"""Batched non-negative least squares by accelerated projected gradient (FISTA), on the GPU.

β's span-mass fit solves ``min_w ½ wᵀGw − hᵀw`` s.t. ``lower ≤ w ≤ upper`` for every layer × KV
head, with ``G`` the (ridge-regularised) Gram matrix of the design (docs/compaction.md, "β bounds
and fallback"). The package's solver
(:func:`compaction_gym.compaction.beta.nnls`) is a projected Newton method: each step is a batched
Cholesky of ``[B, t, t]``, which on a GPU costs milliseconds at ``t = 256``. Here instead:

1. Jacobi scaling ``u = w / D`` with ``D = diag(G)^-½`` gives ``Ĝ = DGD`` a unit diagonal;
2. a step ``1/L`` with ``L ≥ λ_max(Ĝ)`` guaranteed: a few power iterations from the all-ones
   vector give ``x > 0``, and since ``Ĝ ≥ 0`` elementwise (A is a matrix of probabilities) the
   Collatz–Wielandt bound ``λ_max ≤ max_i (Ĝx)_i / x_i`` holds for any positive ``x``; it is
   tight after a few iterations (capped by ``trace Ĝ``, also a bound);
3. warm start at the best uniform ``w = c·1`` (``c = 1ᵀh / 1ᵀG1``), projected onto the box;
4. a fixed number of FISTA iterations (Beck & Teboulle 2009) with gradient-based adaptive restart
   (O'Donoghue & Candès 2015), each projected onto the box (``lower/D ≤ u ≤ upper/D`` in scaled
   units): no host synchronisation, one matrix-vector product each.

:func:`nnls_fista` runs one Triton program per problem: ``Ĝ`` (float16 for half-precision
callers: its entries lie in ``[0, 1]``; zero-padded to a power of two so every load is an
unmasked 16-byte load) is streamed from L2 in row blocks at each product, and the iterate goes
through a two-slot scratch vector between products. (Holding ``Ĝ`` in registers spills at
``t = 256``.) The torch loop :func:`nnls_fista_torch` computes the same iteration and is the
fallback.

With 128 iterations the span-mass objective is within 0.1 % of the fully converged projected
Newton solution on the benchmark's problems (condition numbers ~10³), see docs/fast-path.md.
"""

from __future__ import annotations

import torch

from compaction_gym.engine.fast.kernels import HAS_TRITON, use_triton

#: FISTA iterations of :func:`nnls_fista` (each one product with ``Ĝ``).
FISTA_ITERS = 128
#: Power iterations for the step bound.
POWER_ITERS = 8
#: Largest ``t`` run by the Triton kernel (larger problems use the torch loop).
MAX_KERNEL_T = 2048

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _matvec(g_base, slot, v, offs, T: tl.constexpr, BLOCK: tl.constexpr):
        """``Ĝ v`` for symmetric, zero-padded ``Ĝ [T, T]``: row blocks ``Ĝ[r, :] · v[r]``, one reduction at the end."""
        tl.store(slot + offs, v)
        tl.debug_barrier()  # the whole vector is written before any thread reads its block
        acc = tl.zeros([BLOCK, T], tl.float32)
        for r0 in range(0, T, BLOCK):
            rows = r0 + tl.arange(0, BLOCK)
            g = tl.load(g_base + rows[:, None] * T + offs[None, :])  # unmasked: 16-byte loads
            vr = tl.load(slot + rows, cache_modifier=".cg")
            acc += g.to(tl.float32) * vr[:, None]
        return tl.sum(acc, axis=0)

    @triton.jit(do_not_specialize=["t", "iters", "power_iters"])
    def _fista_kernel(G, H, ONE, U, BUF, t, iters, power_iters, lower, upper, T: tl.constexpr, BLOCK: tl.constexpr):
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, T)
        valid = offs < t
        g_base = G + b * (T * T)
        buf = BUF + b * (2 * T)
        h = tl.load(H + b * T + offs)  # zero-padded
        one = tl.load(ONE + b * T + offs)
        diag = tl.load(g_base + offs * (T + 1)).to(tl.float32)
        tiny = 1e-30
        # step bound: power iterations, then Collatz–Wielandt (and the trace)
        x = tl.where(valid, 1.0, 0.0)
        ctr = tl.program_id(0) * 0  # matrix-vector products so far: picks the scratch slot
        for _ in range(power_iters):
            gx = _matvec(g_base, buf + (ctr % 2) * T, x, offs, T, BLOCK)
            ctr += 1
            x = gx / tl.maximum(tl.max(gx, axis=0), tiny)
        x = tl.where(valid, tl.maximum(x, 1e-20), 0.0)
        gx = _matvec(g_base, buf + (ctr % 2) * T, x, offs, T, BLOCK)
        ctr += 1
        lip = tl.max(tl.where(valid, gx / tl.where(valid, x, 1.0), 0.0), axis=0)
        lip = tl.maximum(tl.minimum(lip, tl.sum(diag, axis=0)), tiny)
        inv_l = 1.0 / lip
        # warm start: the best uniform w = c·1, i.e. u = c / D
        gone = _matvec(g_base, buf + (ctr % 2) * T, one, offs, T, BLOCK)
        ctr += 1
        c = tl.sum(h * one, axis=0) / tl.maximum(tl.sum(one * gone, axis=0), tiny)
        lo = tl.where(valid, lower * one, 0.0)  # the box in scaled units (zero on padding, where
        hi = tl.where(valid, upper * one, 0.0)  # one = 0 and inf · 0 would be NaN)
        u = tl.minimum(tl.maximum(c * one, lo), hi)
        y = u
        tk = tl.sum(tl.zeros([1], tl.float32), axis=0) + 1.0
        for _ in range(iters):
            grad = _matvec(g_base, buf + (ctr % 2) * T, y, offs, T, BLOCK) - h
            ctr += 1
            un = tl.minimum(tl.maximum(y - grad * inv_l, lo), hi)
            tn = (1.0 + tl.sqrt(1.0 + 4.0 * tk * tk)) * 0.5
            mom = (tk - 1.0) / tn
            restart = tl.sum((y - un) * (un - u), axis=0) > 0.0
            mom = tl.where(restart, 0.0, mom)
            tn = tl.where(restart, 1.0, tn)
            y = un + mom * (un - u)
            u = un
            tk = tn
        tl.store(U + b * T + offs, u)


def _scaled(gram: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jacobi scaling: ``(Ĝ, ĥ, D, 1/D)``; zero-diagonal variables keep scale 1 (as the package's nnls)."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    d = torch.where(diag > 0, diag.clamp_min(torch.finfo(gram.dtype).tiny).rsqrt(), torch.ones_like(diag))
    gs = gram * d[:, :, None]
    gs.mul_(d[:, None, :])
    return gs, rhs * d, d, 1.0 / d


def nnls_fista_torch(
    gram: torch.Tensor, rhs: torch.Tensor, iters: int = FISTA_ITERS, power_iters: int = POWER_ITERS,
    g_dtype: torch.dtype | None = None, lower: float = 0.0, upper: float = float("inf"),
) -> torch.Tensor:  # fmt: skip
    """The iteration of :func:`nnls_fista` as a torch loop (any device); ``w`` ``[B, t]`` in the box."""
    gs, hs, d, one = _scaled(gram.float(), rhs.float())
    if g_dtype is not None:
        gs = gs.to(g_dtype).float()

    def mv(v: torch.Tensor) -> torch.Tensor:
        return torch.einsum("bij,bj->bi", gs, v)

    tiny = 1e-30
    x = torch.ones_like(hs)
    for _ in range(power_iters):
        gx = mv(x)
        x = gx / gx.amax(-1, keepdim=True).clamp_min(tiny)
    x = x.clamp_min(1e-20)
    lip = (mv(x) / x).amax(-1)
    lip = torch.minimum(lip, torch.diagonal(gs, dim1=-2, dim2=-1).sum(-1)).clamp_min(tiny)
    c = (hs * one).sum(-1) / (one * mv(one)).sum(-1).clamp_min(tiny)
    lo, hi = lower * one, upper * one
    u = torch.minimum(torch.maximum(c[:, None] * one, lo), hi)
    y, tk = u, torch.ones_like(c)
    for _ in range(iters):
        un = torch.minimum(torch.maximum(y - (mv(y) - hs) / lip[:, None], lo), hi)
        tn = (1 + torch.sqrt(1 + 4 * tk * tk)) / 2
        mom = (tk - 1) / tn
        restart = ((y - un) * (un - u)).sum(-1) > 0
        mom = torch.where(restart, 0.0, mom)
        tn = torch.where(restart, 1.0, tn)
        y = un + mom[:, None] * (un - u)
        u, tk = un, tn
    return (u * d).to(rhs.dtype)


def nnls_fista(
    gram: torch.Tensor, rhs: torch.Tensor, iters: int = FISTA_ITERS, power_iters: int = POWER_ITERS,
    *, g_dtype: torch.dtype | None = None, lower: float = 0.0, upper: float = float("inf"),
) -> torch.Tensor:  # fmt: skip
    """``argmin_{lower ≤ w ≤ upper} ½ wᵀGw − hᵀw`` for ``G [B, t, t]`` (a Gram matrix of a non-negative
    design, possibly plus a ridge), ``h [B, t]``.

    A fixed number of FISTA iterations on the Jacobi-scaled problem (module docstring): no host
    synchronisation, no factorisation.

    Args:
        gram, rhs: float32 ``G`` and ``h``.
        iters, power_iters: FISTA and power iterations.
        g_dtype: storage dtype of ``Ĝ`` in the kernel (float16 halves its bytes; default float32).
        lower, upper: the box (``0 ≤ lower ≤ upper``, ``inf`` for none).

    Returns:
        ``w`` ``[B, t]`` float32 in the box.
    """
    batch, t = rhs.shape
    if not (use_triton(gram) and 0 < t <= MAX_KERNEL_T):
        return nnls_fista_torch(gram, rhs, iters, power_iters, g_dtype, lower, upper)
    gs, hs, d, one = _scaled(gram.float(), rhs.float())
    T = max(16, triton.next_power_of_2(t))
    g_pad = gs.to(g_dtype or torch.float32)
    h_pad, one_pad = hs, one
    if t != T:  # zero padding: unmasked, vectorised loads in the kernel
        g_pad = g_pad.new_zeros(batch, T, T)
        g_pad[:, :t, :t] = gs
        h_pad, one_pad = hs.new_zeros(batch, T), one.new_zeros(batch, T)
        h_pad[:, :t], one_pad[:, :t] = hs, one
    u = torch.empty(batch, T, dtype=torch.float32, device=gram.device)
    buf = torch.empty(batch, 2, T, dtype=torch.float32, device=gram.device)
    _fista_kernel[(batch,)](
        g_pad.contiguous(), h_pad.contiguous(), one_pad.contiguous(), u, buf, t, iters, power_iters,
        float(lower), float(upper), T=T, BLOCK=max(1, min(T, 4096 // T)), num_warps=4,
    )  # fmt: skip
    return u[:, :t] * d
