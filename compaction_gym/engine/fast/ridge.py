"""C2's ridge solve on the GPU: the normal products and a batched Cholesky solve, as Triton kernels.

An Attention-Matching event refits the kept rows' values by ridge least squares
(:func:`compaction_gym.compaction.values.ridge_solve_ex`): ``(xᵀx + λI) c = xᵀy + λ·prior`` for
every layer × KV head, with ``x [B, n, t]`` the kept keys' attention weights and ``y [B, n, d]``
the span's attention outputs. On cuBLAS/cuSOLVER that is two float32 GEMMs, a batched Cholesky
and two batched triangular solves: 3.1 ms of a 4B-shaped event (``B = 288``, ``n = 1024``,
``t = 256``, ``d = 128``) on an H100, in float32 products without tensor cores (1.35 ms) and in
``potrf`` + ``trsm`` (1.78 ms), which run at a few TFLOP/s on batches of small systems. Here
instead (0.83 + 0.56 ms, ``benchmarks/bench_fast_kernels.py``):

* :func:`normal_products` — ``xᵀx`` and ``xᵀy`` (two launches) on the tensor cores with
  ``tf32x3`` products (each operand split into a TF32 head and tail, three products: float32
  accuracy, ~2⁻²² relative per product, float32 accumulation); only the Gram matrix's lower
  triangle is computed, each entry stored at both places (exactly symmetric).
* :func:`cholesky_solve` — two launches: one program per system runs a left-looking blocked
  Cholesky factorisation (32-row diagonal blocks factored and inverted in registers, panels as
  products with the inverted block); then one program per system and 64 right-hand-side
  columns runs the forward and backward block substitutions. Returns the solution and which
  systems factored (every pivot positive) with a finite solution, like
  :func:`~compaction_gym.compaction.values.cholesky_solve_ex`, whose torch version is the
  reference and the fallback.

Accuracy: the factorisation is the standard blocked algorithm with float32 arithmetic (products
in ``tf32x3``); the diagonal blocks' inverses cost their own condition number times ``eps``, far
below the system's, so solutions agree with cuSOLVER's to the system's conditioning
(``tests/engine/test_fast_ridge.py`` checks both against float64).
"""

from __future__ import annotations

import functools

import torch

from compaction_gym.compaction.values import cholesky_solve_ex
from compaction_gym.engine.fast.kernels import HAS_TRITON, use_triton

#: Block size of the factorisation (diagonal blocks factored in registers).
CHOL_BLOCK = 32
#: Largest system the Cholesky kernel takes (beyond it: torch's solve).
MAX_CHOL_T = 1024
#: Right-hand side columns per program of the substitutions.
SOLVE_COLS = 64

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _normal_kernel(
        X, Z, OUT, n, t, width,
        sxb, sxn, sxt, szb, szn, szj, sob, soi, soj,
        SYMMETRIC: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_K: tl.constexpr,
        PRECISION: tl.constexpr,
    ):  # fmt: skip
        """One ``[BLOCK_I, BLOCK_J]`` tile of ``xᵀz``; ``SYMMETRIC`` (``z = x``): the tiles on and
        below the diagonal, their lower triangle stored at both places."""
        it = tl.program_id(0)
        jt = tl.program_id(1)
        b = tl.program_id(2).to(tl.int64)
        if SYMMETRIC:  # noqa: SIM102 - a compile-time branch around the runtime test
            if jt * BLOCK_J >= (it + 1) * BLOCK_I:  # strictly upper tile: its mirror writes it
                return
        offs_i = it * BLOCK_I + tl.arange(0, BLOCK_I)
        offs_j = jt * BLOCK_J + tl.arange(0, BLOCK_J)
        offs_k = tl.arange(0, BLOCK_K)
        x_ptr = X + b * sxb + offs_k[:, None] * sxn + offs_i[None, :] * sxt
        z_ptr = Z + b * szb + offs_k[:, None] * szn + offs_j[None, :] * szj
        imask = offs_i[None, :] < t
        jmask = offs_j[None, :] < width
        acc = tl.zeros([BLOCK_I, BLOCK_J], tl.float32)
        for k0 in range(0, n, BLOCK_K):
            kmask = (k0 + offs_k)[:, None] < n
            a = tl.load(x_ptr, mask=kmask & imask, other=0.0)
            z = tl.load(z_ptr, mask=kmask & jmask, other=0.0)
            acc = tl.dot(tl.trans(a), z, acc, input_precision=PRECISION)
            x_ptr += BLOCK_K * sxn
            z_ptr += BLOCK_K * szn
        omask = (offs_i[:, None] < t) & (offs_j[None, :] < width)
        if SYMMETRIC:  # the lower triangle, and its mirror: every entry written once, exactly symmetric
            lower = offs_i[:, None] >= offs_j[None, :]
            tl.store(OUT + b * sob + offs_i[:, None] * soi + offs_j[None, :] * soj, acc, mask=omask & lower)
            upper = OUT + b * sob + offs_j[None, :] * soi + offs_i[:, None] * soj
            tl.store(upper, acc, mask=omask & (offs_i[:, None] > offs_j[None, :]))
        else:
            tl.store(OUT + b * sob + offs_i[:, None] * soi + offs_j[None, :] * soj, acc, mask=omask)

    @triton.jit
    def _factor_block(a, BS: tl.constexpr):
        """Lower Cholesky factor of the register tile ``a [BS, BS]`` (right-looking, column by
        column) and whether every pivot was positive and finite (a failed pivot is replaced by 1
        so the rest stays finite; the caller discards the system)."""
        rows = tl.arange(0, BS)
        low = tl.zeros([BS, BS], tl.float32)
        ok = tl.sum(rows) >= 0
        for j in tl.static_range(BS):
            col = tl.sum(tl.where(rows[None, :] == j, a, 0.0), axis=1)
            piv = tl.sum(tl.where(rows == j, col, 0.0), axis=0)
            good = piv > 0.0
            ok = ok & good
            root = tl.sqrt(tl.where(good, piv, 1.0))
            lcol = tl.where(rows >= j, col / root, 0.0)
            low = tl.where(rows[None, :] == j, lcol[:, None], low)
            a = a - lcol[:, None] * lcol[None, :]
        return low, ok

    @triton.jit
    def _invert_lower(low, BS: tl.constexpr):
        """``low⁻¹`` for a lower-triangular register tile, by forward substitution row by row."""
        rows = tl.arange(0, BS)
        inv = tl.zeros([BS, BS], tl.float32)
        for j in tl.static_range(BS):
            lrow = tl.sum(tl.where(rows[:, None] == j, low, 0.0), axis=0)  # L[j, :]
            diag = tl.sum(tl.where(rows == j, lrow, 0.0), axis=0)
            acc = tl.sum(tl.where(rows[:, None] < j, lrow[:, None] * inv, 0.0), axis=0)  # Σ_m<j L[j,m] X[m,:]
            new = (tl.where(rows == j, 1.0, 0.0) - acc) / diag
            inv = tl.where(rows[:, None] == j, new[None, :], inv)
        return inv

    @triton.jit
    def _cholesky_solve_kernel(
        A, RHS, OUT, DINV, OK, t, w,
        sab, sai, saj, srb, sri, srj, sob, soi, soj,
        BS: tl.constexpr, W: tl.constexpr, PRECISION: tl.constexpr, FACTOR: tl.constexpr, SOLVE: tl.constexpr,
    ):  # fmt: skip
        """``A c = rhs`` for one system: ``FACTOR`` overwrites ``A``'s lower blocks by the factor and
        writes the diagonal blocks' inverses to ``DINV`` and the pivots' verdict to ``OK`` (int32);
        ``SOLVE`` (program ``(b, c)``: columns ``[c·W, (c+1)·W)``) writes the solution to ``OUT``
        and clears ``OK`` where it is not finite."""
        b = tl.program_id(0).to(tl.int64)
        nb = tl.cdiv(t, BS)
        rows = tl.arange(0, BS)
        cols_w = tl.program_id(1) * W + tl.arange(0, W)
        a_base = A + b * sab
        d_base = DINV + b * nb * BS * BS
        tile = rows[:, None] * BS + rows[None, :]
        ok = tl.program_id(0) >= 0
        if FACTOR:
            for k in range(0, nb):
                rk = k * BS + rows
                # diagonal block: A_kk − Σ_{j<k} L_kj L_kjᵀ, padding rows get a unit diagonal
                diag_mask = (rk[:, None] < t) & (rk[None, :] < t)
                acc = tl.load(a_base + rk[:, None] * sai + rk[None, :] * saj, mask=diag_mask, other=0.0)
                acc = tl.where((rk[:, None] >= t) & (rows[:, None] == rows[None, :]), 1.0, acc)
                for j in range(0, k):
                    rj = j * BS + rows
                    lkj = tl.load(a_base + rk[:, None] * sai + rj[None, :] * saj, mask=rk[:, None] < t, other=0.0)
                    acc -= tl.dot(lkj, tl.trans(lkj), input_precision=PRECISION)
                low, good = _factor_block(acc, BS)
                ok = ok & good
                inv = _invert_lower(low, BS)
                tl.store(d_base + k * BS * BS + tile, inv)
                # panel below: L_ik = (A_ik − Σ_{j<k} L_ij L_kjᵀ) L_kk⁻ᵀ
                for i in range(k + 1, nb):
                    ri = i * BS + rows
                    pmask = ri[:, None] < t
                    acc = tl.load(a_base + ri[:, None] * sai + rk[None, :] * saj, mask=pmask, other=0.0)
                    for j in range(0, k):
                        rj = j * BS + rows
                        lij = tl.load(a_base + ri[:, None] * sai + rj[None, :] * saj, mask=pmask, other=0.0)
                        lkj = tl.load(a_base + rk[:, None] * sai + rj[None, :] * saj, mask=rk[:, None] < t, other=0.0)
                        acc -= tl.dot(lij, tl.trans(lkj), input_precision=PRECISION)
                    lik = tl.dot(acc, tl.trans(inv), input_precision=PRECISION)
                    tl.store(a_base + ri[:, None] * sai + rk[None, :] * saj, lik, mask=pmask)
                tl.debug_barrier()  # this column's factor is in memory before the next column reads it
            tl.store(OK + b, ok.to(tl.int32))
        if not SOLVE:
            return
        # forward substitution: z_i = L_ii⁻¹ (rhs_i − Σ_{j<i} L_ij z_j), z stored in OUT
        wmask = cols_w[None, :] < w
        for i in range(0, nb):
            ri = i * BS + rows
            acc = tl.load(RHS + b * srb + ri[:, None] * sri + cols_w[None, :] * srj, mask=(ri[:, None] < t) & wmask, other=0.0)
            for j in range(0, i):
                rj = j * BS + rows
                lij = tl.load(a_base + ri[:, None] * sai + rj[None, :] * saj, mask=ri[:, None] < t, other=0.0)
                zj = tl.load(OUT + b * sob + rj[:, None] * soi + cols_w[None, :] * soj, mask=(rj[:, None] < t) & wmask, other=0.0)
                acc -= tl.dot(lij, zj, input_precision=PRECISION)
            inv = tl.load(d_base + i * BS * BS + tile)
            z = tl.dot(inv, acc, input_precision=PRECISION)
            tl.store(OUT + b * sob + ri[:, None] * soi + cols_w[None, :] * soj, z, mask=(ri[:, None] < t) & wmask)
            tl.debug_barrier()
        # backward substitution: c_i = L_iiᵀ⁻¹ (z_i − Σ_{j>i} L_jiᵀ c_j), in place over z
        finite = tl.program_id(0) >= 0
        for step in range(0, nb):
            i = nb - 1 - step
            ri = i * BS + rows
            acc = tl.load(OUT + b * sob + ri[:, None] * soi + cols_w[None, :] * soj, mask=(ri[:, None] < t) & wmask, other=0.0)
            for j in range(i + 1, nb):
                rj = j * BS + rows
                lji = tl.load(a_base + rj[:, None] * sai + ri[None, :] * saj, mask=rj[:, None] < t, other=0.0)
                cj = tl.load(OUT + b * sob + rj[:, None] * soi + cols_w[None, :] * soj, mask=(rj[:, None] < t) & wmask, other=0.0)
                acc -= tl.dot(tl.trans(lji), cj, input_precision=PRECISION)
            inv = tl.load(d_base + i * BS * BS + tile)
            c = tl.dot(tl.trans(inv), acc, input_precision=PRECISION)
            finite = finite & (tl.sum((tl.abs(c) < float("inf")).to(tl.int32)) == BS * W)
            tl.store(OUT + b * sob + ri[:, None] * soi + cols_w[None, :] * soj, c, mask=(ri[:, None] < t) & wmask)
            tl.debug_barrier()
        tl.atomic_and(OK + b, finite.to(tl.int32))


@functools.cache
def _precision(device: torch.device) -> str:
    """``tf32x3`` products where the tensor cores take TF32 (compute capability ≥ 8), else ``ieee``."""
    return "tf32x3" if torch.cuda.get_device_capability(device)[0] >= 8 else "ieee"


def normal_products(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(xᵀx, xᵀy)`` in float32 for float32 ``x [B, n, t]`` and ``y [B, n, d]`` (two launches on
    CUDA with Triton; ``torch`` products elsewhere). Any strides; the tensor cores want ``n``
    contiguous (``x.mT`` and ``y.mT`` contiguous, as the event's kernels write them): 0.83 instead
    of 1.35 ms for torch's float32 products at the 4B event shape (H100), 1.68 ms with rows contiguous."""
    if not (use_triton(x) and x.dtype == y.dtype == torch.float32):
        return x.mT @ x, x.mT @ y
    batch, n, t = x.shape
    gram = torch.empty(batch, t, t, dtype=torch.float32, device=x.device)
    xty = torch.empty(batch, t, y.shape[-1], dtype=torch.float32, device=x.device)
    block = 64
    for z, out, symmetric in ((x, gram, True), (y, xty, False)):
        width = z.shape[-1]
        grid = (triton.cdiv(t, block), triton.cdiv(width, block), batch)
        _normal_kernel[grid](
            x, z, out, n, t, width, *x.stride(), *z.stride(), *out.stride(), SYMMETRIC=symmetric,
            BLOCK_I=block, BLOCK_J=block, BLOCK_K=32, PRECISION=_precision(x.device), num_warps=4, num_stages=3,
        )  # fmt: skip
    return gram, xty


def cholesky_solve(a: torch.Tensor, rhs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Solve ``a c = rhs`` for symmetric positive definite float32 ``a [B, t, t]`` and
    ``rhs [B, t, w]`` without a host synchronisation. Returns ``c`` and which systems factored
    with a finite solution (:func:`~compaction_gym.compaction.values.cholesky_solve_ex`'s
    contract, which is also what runs without Triton or beyond ``MAX_CHOL_T``).

    ``a`` is overwritten by its factor on the kernel path (callers pass a buffer of their own).
    """
    batch, t, _ = a.shape
    w = rhs.shape[-1]
    if not (use_triton(a) and a.dtype == rhs.dtype == torch.float32 and t <= MAX_CHOL_T):
        return cholesky_solve_ex(a, rhs)
    block = CHOL_BLOCK
    out = torch.empty(batch, t, w, dtype=torch.float32, device=a.device)
    dinv = torch.empty(batch, triton.cdiv(t, block), block, block, dtype=torch.float32, device=a.device)
    ok = torch.empty(batch, dtype=torch.int32, device=a.device)
    args = (a, rhs, out, dinv, ok, t, w, *a.stride(), *rhs.stride(), *out.stride())
    common = dict(BS=block, PRECISION=_precision(a.device))
    # the factorisation is a chain of small steps (one warp runs it fastest); the substitutions
    # then run in parallel over column blocks of the right-hand side
    # (W only sizes the substitutions' tile: any valid value for the factorisation)
    _cholesky_solve_kernel[(batch, 1)](*args, W=16, FACTOR=True, SOLVE=False, num_warps=1, **common)
    grid = (batch, triton.cdiv(w, SOLVE_COLS))
    _cholesky_solve_kernel[grid](*args, W=SOLVE_COLS, FACTOR=False, SOLVE=True, num_warps=4, **common)
    return out, ok != 0
