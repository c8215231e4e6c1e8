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

:func:`nnls_fista` runs one Triton program per problem on ``Ĝ`` zero-padded to a power of two
``T`` (one scaling kernel writes it from ``G``). With float16 storage (half-precision callers:
its entries lie in ``[0, 1]``) and ``T ≤ 256``, ``Ĝ`` is loaded once and every product is a
tensor-core product ``Ĝ [v_hi, v_lo]`` with the iterate split into two float16 parts after scaling
by its largest entry (exact to ~2⁻²² of it, float32 accumulation): 0.62 instead of 1.15 ms at the
4B event shape (H100). Otherwise ``Ĝ`` is streamed from L2 in row blocks at each product and the
iterate goes through a two-slot scratch vector between products. The torch loop
:func:`nnls_fista_torch` computes the same iteration and is the fallback.

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
#: Largest padded ``T`` whose float16 ``Ĝ`` stays resident in one program (tensor-core products).
MAX_RESIDENT_T = 256

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

    @triton.jit
    def _matvec_resident(g, v, T: tl.constexpr):
        """``Ĝ v`` for float16 ``Ĝ [T, T]`` held by the program: one tensor-core product with
        ``[v_hi, v_lo]`` (``v`` scaled by its largest entry, split into two float16 parts)."""
        sc = tl.maximum(tl.max(tl.abs(v), axis=0), 1e-30)
        vs = v / sc
        hi = vs.to(tl.float16)
        lo = (vs - hi.to(tl.float32)).to(tl.float16)
        col = tl.arange(0, 16)[None, :]
        zero = tl.zeros([T, 16], tl.float16)
        rhs = tl.where(col == 0, hi[:, None] + zero, tl.where(col == 1, lo[:, None] + zero, zero))
        return tl.sum(tl.dot(g, rhs), axis=1) * sc

    @triton.jit
    def _product(g_base, g, slot, v, offs, T: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr):
        if RESIDENT:  # noqa: SIM108 - a statement-level branch on a constexpr
            out = _matvec_resident(g, v, T)
        else:
            out = _matvec(g_base, slot, v, offs, T, BLOCK)
        return out

    @triton.jit(do_not_specialize=["t"])
    def _scale_pad_kernel(G, D, OUT, t, stride_gb, T: tl.constexpr, BLOCK: tl.constexpr):
        """``Ĝ = D G D`` ``[T, T]`` in ``OUT``'s dtype, zero outside ``[t, t]`` (one row block a program)."""
        rb = tl.program_id(0)
        b = tl.program_id(1).to(tl.int64)
        rows = rb * BLOCK + tl.arange(0, BLOCK)
        cols = tl.arange(0, T)
        m = (rows[:, None] < t) & (cols[None, :] < t)
        g = tl.load(G + b * stride_gb + rows[:, None] * t + cols[None, :], mask=m, other=0.0)
        dr = tl.load(D + b * t + rows, mask=rows < t, other=0.0)
        dc = tl.load(D + b * t + cols, mask=cols < t, other=0.0)
        out = g * dr[:, None] * dc[None, :]
        tl.store(OUT + b * (T * T) + rows[:, None] * T + cols[None, :], out.to(OUT.dtype.element_ty))

    @triton.jit(do_not_specialize=["t", "iters", "power_iters"])
    def _fista_kernel(
        G, H, ONE, U, BUF, t, iters, power_iters, lower, upper,
        T: tl.constexpr, BLOCK: tl.constexpr, RESIDENT: tl.constexpr,
    ):  # fmt: skip
        b = tl.program_id(0).to(tl.int64)
        offs = tl.arange(0, T)
        valid = offs < t
        g_base = G + b * (T * T)
        g = g_base  # streamed: a placeholder
        if RESIDENT:
            g = tl.load(g_base + offs[:, None] * T + offs[None, :])
        buf = BUF + b * (2 * T)
        h = tl.load(H + b * T + offs)  # zero-padded
        one = tl.load(ONE + b * T + offs)
        diag = tl.load(g_base + offs * (T + 1)).to(tl.float32)
        tiny = 1e-30
        # step bound: power iterations, then Collatz–Wielandt (and the trace)
        x = tl.where(valid, 1.0, 0.0)
        ctr = tl.program_id(0) * 0  # matrix-vector products so far: picks the scratch slot
        for _ in range(power_iters):
            gx = _product(g_base, g, buf + (ctr % 2) * T, x, offs, T, BLOCK, RESIDENT)
            ctr += 1
            x = gx / tl.maximum(tl.max(gx, axis=0), tiny)
        x = tl.where(valid, tl.maximum(x, 1e-20), 0.0)
        gx = _product(g_base, g, buf + (ctr % 2) * T, x, offs, T, BLOCK, RESIDENT)
        ctr += 1
        lip = tl.max(tl.where(valid, gx / tl.where(valid, x, 1.0), 0.0), axis=0)
        lip = tl.maximum(tl.minimum(lip, tl.sum(diag, axis=0)), tiny)
        inv_l = 1.0 / lip
        # warm start: the best uniform w = c·1, i.e. u = c / D
        gone = _product(g_base, g, buf + (ctr % 2) * T, one, offs, T, BLOCK, RESIDENT)
        ctr += 1
        c = tl.sum(h * one, axis=0) / tl.maximum(tl.sum(one * gone, axis=0), tiny)
        lo = tl.where(valid, lower * one, 0.0)  # the box in scaled units (zero on padding, where
        hi = tl.where(valid, upper * one, 0.0)  # one = 0 and inf · 0 would be NaN)
        u = tl.minimum(tl.maximum(c * one, lo), hi)
        y = u
        tk = tl.sum(tl.zeros([1], tl.float32), axis=0) + 1.0
        for _ in range(iters):
            grad = _product(g_base, g, buf + (ctr % 2) * T, y, offs, T, BLOCK, RESIDENT) - h
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


def _scaling(gram: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jacobi scaling ``(D, ĥ, 1/D)``; zero-diagonal variables keep scale 1 (as the package's nnls)."""
    diag = torch.diagonal(gram, dim1=-2, dim2=-1)
    d = torch.where(diag > 0, diag.clamp_min(torch.finfo(gram.dtype).tiny).rsqrt(), torch.ones_like(diag))
    return d, rhs * d, 1.0 / d


def _scaled(gram: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Jacobi scaling: ``(Ĝ, ĥ, D, 1/D)`` (:func:`_scaling` and ``Ĝ = DGD``)."""
    d, hs, one = _scaling(gram, rhs)
    gs = gram * d[:, :, None]
    gs.mul_(d[:, None, :])
    return gs, hs, d, one


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
    gram, rhs = gram.float().contiguous(), rhs.float()
    d, hs, one = _scaling(gram, rhs)
    T = max(16, triton.next_power_of_2(t))
    g_dtype = g_dtype or torch.float32
    g_pad = torch.empty(batch, T, T, dtype=g_dtype, device=gram.device)
    rows = max(1, min(T, 4096 // T))
    _scale_pad_kernel[(triton.cdiv(T, rows), batch)](gram, d, g_pad, t, gram.stride(0), T=T, BLOCK=rows)
    h_pad, one_pad = hs, one
    if t != T:  # zero padding: unmasked, vectorised loads in the kernel
        h_pad, one_pad = hs.new_zeros(batch, T), one.new_zeros(batch, T)
        h_pad[:, :t], one_pad[:, :t] = hs, one
    u = torch.empty(batch, T, dtype=torch.float32, device=gram.device)
    buf = torch.empty(batch, 2, T, dtype=torch.float32, device=gram.device)
    resident = g_dtype == torch.float16 and T <= MAX_RESIDENT_T
    _fista_kernel[(batch,)](
        g_pad, h_pad.contiguous(), one_pad.contiguous(), u, buf, t, iters, power_iters,
        float(lower), float(upper), T=T, BLOCK=rows, RESIDENT=resident, num_warps=8 if resident else 4,
    )  # fmt: skip
    return u[:, :t] * d
