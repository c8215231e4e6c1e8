"""The fast decoder: the HF model's own weights, run by fused kernels over the slot cache.

:class:`FastDecoder` reads a Llama-family model (Qwen3, Qwen2, Llama) and packs each layer's
q/k/v projections into one matrix and gate/up into another. The HF modules' parameters are
re-pointed at row slices of the packed matrices, so the model keeps working unchanged (the
generic path, training) and no weight is stored twice. One layer then costs: a fused
residual-add + RMSNorm, one q/k/v GEMM, one kernel for q/k norm + RoPE + the K/V store into the
slot cache, attention, the output GEMM, a fused add + RMSNorm, one gate/up GEMM, one SiLU·mul
kernel and the down GEMM. For batches of at most 32 tokens (small-batch decode) each projection
runs either cuBLAS or the Triton split-K GEMV (:mod:`~compaction_gym.engine.fast.gemv`),
whichever measured faster for its shape and batch size on this device (timed once, with CUDA
graphs, before the decode graph is captured); gate/up may also run as one GEMV with the SiLU·mul
in its epilogue (:attr:`FastDecoder.fuse_mlp`), timed against the unfused pair the same way.

:meth:`FastDecoder.run` runs a flat batch of tokens with any attention function: the decode
step (one token per row, Triton flash-decode) and the batched prefill (many rows of different
lengths, SDPA over their slot rows) share it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from compaction_gym.engine.fast.gemv import GEMV_CANDIDATES, GEMV_MAX_M, gemv, gemv_supported
from compaction_gym.engine.fast.kernels import qkv_rope_store, rms_norm, silu_mul
from compaction_gym.engine.fast.persistent import (
    PersistentPlan,
    build_plan,
    persistent_layers,
    persistent_supported,
)
from compaction_gym.engine.fast.tagged import TaggedPlan, build_tagged_plan, tagged_layers, tagged_supported

logger = logging.getLogger(__name__)

#: ``config.model_type`` values the fast decoder runs.
SUPPORTED_MODEL_TYPES = ("qwen3", "qwen2", "llama")

#: ``attend(layer, q [N, H_q, d]) -> [N, H_q, d]``; K/V of the tokens are already in the cache.
AttendFn = Callable[[int, torch.Tensor], torch.Tensor]


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why :class:`FastDecoder` cannot run ``model``, or ``None`` when it can."""
    cfg = getattr(model, "config", None)
    if cfg is None:
        return "the model has no config"
    cfg = cfg.get_text_config()
    kind = getattr(cfg, "model_type", None)
    if kind not in SUPPORTED_MODEL_TYPES:
        return f"model_type {kind!r} is not one of {SUPPORTED_MODEL_TYPES}"
    if getattr(cfg, "hidden_act", "silu") != "silu":
        return f"hidden_act {cfg.hidden_act!r} is not silu"
    if getattr(cfg, "mlp_bias", False):
        return "mlp_bias=True is not supported"
    if getattr(cfg, "use_sliding_window", False):
        return "sliding-window attention is not supported"
    if any(t != "full_attention" for t in (getattr(cfg, "layer_types", None) or [])):
        return "only full-attention layers are supported"
    inner = getattr(model, "model", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
        return "the model does not have the model.layers / lm_head layout"
    attn = inner.layers[0].self_attn
    if not all(hasattr(attn, n) for n in ("q_proj", "k_proj", "v_proj", "o_proj")):
        return "attention has no q/k/v/o projections"
    rope = getattr(inner, "rotary_emb", None)
    if rope is None:
        return "the model has no rotary embedding module"
    if getattr(rope, "rope_type", "default") in ("dynamic", "longrope"):
        return f"position-dependent rope_type {rope.rope_type!r} is not supported"
    return None


@dataclass
class LayerWeights:
    """One decoder layer's weights (views of the HF model's parameters)."""

    in_norm: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    q_norm: torch.Tensor | None
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    post_norm: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


def _fuse(modules: list[torch.nn.Module], name: str) -> torch.Tensor | None:
    """Concatenate ``modules[i].<name>`` along dim 0 and re-point each parameter at its slice.

    Idempotent: parameters that already are consecutive slices of one buffer are returned as
    that buffer without copying.
    """
    params = [getattr(m, name) for m in modules]
    if any(p is None for p in params):
        assert all(p is None for p in params), f"{name}: some projections have it and some do not"
        return None
    first = params[0].detach()
    rows = sum(p.shape[0] for p in params)
    storage, offset, packed = first.untyped_storage(), first.storage_offset(), True
    for p in params:
        packed &= p.is_contiguous() and p.untyped_storage().data_ptr() == storage.data_ptr()
        packed &= p.storage_offset() == offset
        offset += p.numel()
    if packed:  # already fused by an earlier FastDecoder
        return first.new_empty(0).set_(storage, first.storage_offset(), (rows, *first.shape[1:]))
    with torch.no_grad():
        fused = torch.cat([p.detach() for p in params], dim=0).contiguous()
    offset = 0
    for m, p in zip(modules, params):
        n = p.shape[0]
        setattr(m, name, torch.nn.Parameter(fused[offset : offset + n], requires_grad=p.requires_grad))
        offset += n
    return fused


class FastDecoder:
    """Weights and the layer loop of a Llama-family model for the fast path.

    Args:
        model: a Qwen3/Qwen2/Llama causal LM (see :func:`unsupported_reason`); its projection
            parameters become views of packed matrices.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"the fast decoder cannot run {type(model).__name__}: {reason}")
        cfg = model.config.get_text_config()
        inner = model.model
        self.model = model
        self.n_layers = cfg.num_hidden_layers
        self.n_q = cfg.num_attention_heads
        self.n_kv = getattr(cfg, "num_key_value_heads", None) or self.n_q
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // self.n_q
        self.eps = float(cfg.rms_norm_eps)
        self.scale = float(inner.layers[0].self_attn.scaling)
        self.embed = inner.embed_tokens.weight
        self.norm = inner.norm.weight
        self.lm_head = model.lm_head.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        #: let captured decode graphs of ≤ 32 rows (GEMV_MAX_M) use the split-K GEMV where it beats cuBLAS
        self.use_gemv = True
        fusions = os.environ.get("COMPACTION_GYM_FUSIONS", "1") != "0"
        #: decode attention in one launch (the last split program merges; read by the runner):
        #: ``True`` always, ``False`` never (split + merge kernels), ``None`` (default) only where the
        #: runner uses one split — with several, the last program's serial merge (release fence,
        #: atomic, dependent L2 reads) measured slower on an H200 than a graph-launched merge kernel
        self.fuse_attention: bool | None = None if fusions else False
        #: in captured graphs of ≤ 32 rows, gate/up GEMV with the SiLU·mul in its epilogue, where
        #: it measured faster than the projection and ``silu_mul`` run separately
        self.fuse_mlp = fusions
        #: batch-1 decode graphs with the layers as one persistent launch (:meth:`run_persistent`,
        #: where :func:`persistent_supported` allows): ``True`` always, ``False`` never, ``None``
        #: (default) for rows shorter than :attr:`persistent_max_len`;
        #: ``COMPACTION_GYM_PERSISTENT=1`` / ``0`` in the environment sets ``True`` / ``False``
        self.use_persistent: bool | None = {"0": False, "1": True}.get(os.environ.get("COMPACTION_GYM_PERSISTENT", ""))
        #: cached rows below which the persistent launch measured faster (set by the runner's first
        #: batch-1 capture; ``None``: not timed yet) and its timings ``{(persistent, rows): seconds}``
        self.persistent_max_len: int | None = None
        self.persistent_times: dict[tuple[bool, int], float] = {}
        self._plan: PersistentPlan | None = None
        self._tagged: TaggedPlan | None = None
        #: set by the runner while it warms up and captures a decode graph (see :meth:`_linear`)
        self.graph_mode = False
        self._gemv_choice: dict[tuple, tuple | bool] = {}
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count if self.device.type == "cuda" else 1
        )
        self.layers: list[LayerWeights] = []
        for layer in inner.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv_mods = [attn.q_proj, attn.k_proj, attn.v_proj]
            q_norm = getattr(attn, "q_norm", None)
            k_norm = getattr(attn, "k_norm", None)
            self.layers.append(
                LayerWeights(
                    in_norm=layer.input_layernorm.weight,
                    qkv=_fuse(qkv_mods, "weight"),
                    qkv_bias=_fuse(qkv_mods, "bias"),
                    q_norm=q_norm.weight if q_norm is not None else None,
                    k_norm=k_norm.weight if k_norm is not None else None,
                    o=attn.o_proj.weight,
                    o_bias=attn.o_proj.bias,
                    post_norm=layer.post_attention_layernorm.weight,
                    gate_up=_fuse([mlp.gate_proj, mlp.up_proj], "weight"),
                    down=mlp.down_proj.weight,
                )
            )
        self._rotary = inner.rotary_emb
        self.cos = self.sin = torch.empty(0, self.head_dim // 2, dtype=self.dtype, device=self.device)
        self.ensure_positions(int(getattr(cfg, "max_position_embeddings", 4096) or 4096))
        #: the one launch of :meth:`run_persistent`: ``"tagged"`` (:func:`tagged_layers`, no grid
        #: barrier; Qwen3-0.6B's shape on Hopper, where :func:`tagged_supported` allows) or ``"triton"``
        #: (:func:`persistent_layers`); ``COMPACTION_GYM_TAGGED=0`` in the environment keeps ``"triton"``
        tagged = os.environ.get("COMPACTION_GYM_TAGGED", "1") != "0" and tagged_supported(self) is None
        self.persistent_kernel = "tagged" if tagged else "triton"

    # ------------------------------------------------------------------ rotary
    @torch.no_grad()
    def ensure_positions(self, n: int) -> None:
        """Make the rotary tables cover logical positions ``[0, n)`` (grown in powers of two).

        The tables come from the model's own rotary module (so any static RoPE scaling is
        honoured) and hold one half of each row: the halves of HF's tables are equal.
        """
        if n <= self.cos.shape[0]:
            return
        size = max(n, 2 * self.cos.shape[0], 1024)
        pos = torch.arange(size, device=self.device)[None]
        probe = torch.zeros(1, dtype=self.dtype, device=self.device)
        cos, sin = self._rotary(probe, pos)
        half = self.head_dim // 2
        assert torch.equal(cos[0, :, :half], cos[0, :, half:]), "rotary tables with unequal halves"
        self.cos = cos[0, :, :half].to(self.dtype).contiguous()
        self.sin = sin[0, :, :half].to(self.dtype).contiguous()

    # ------------------------------------------------------------------ forward
    def weight_bytes(self) -> int:
        """Bytes of weights one forward reads (embedding rows excluded, lm_head included)."""
        seen, total = set(), 0
        for t in [self.norm, self.lm_head] + [
            w for lw in self.layers for w in vars(lw).values() if isinstance(w, torch.Tensor)
        ]:
            if t.data_ptr() not in seen:
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
        return total

    def run(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        attend: AttendFn,
        last: torch.Tensor | None = None,
        record: Callable[[int, torch.Tensor], None] | None = None,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run ``N`` tokens through every layer; return logits of the tokens ``last`` (default all).

        Args:
            ids, positions: token ids and logical positions ``[N]`` (int64).
            slots, rows: cache slot and row each token's K/V are stored at (``slot < 0``: not stored).
            k_cache, v_cache: the slot cache ``[slots, layers, H_kv, capacity, d]``.
            attend: attention over the cache for one layer (the tokens' K/V are stored first).
            last: token indices whose logits are returned.
            record: called with ``(layer, q)`` for every layer's rotated queries ``[N, H_q, d]``.
            q_out: ``[layers, N, H_q, d]``: where each layer's rotated queries are written (by the
                RoPE kernel itself: recording them costs no copy).

        Returns:
            Logits ``[len(last), V]`` in the model dtype.
        """
        residual = torch.nn.functional.embedding(ids, self.embed)  # updated in place by rms_norm
        x = None
        for i, lw in enumerate(self.layers):
            if x is None:
                y = rms_norm(residual, lw.in_norm, self.eps)
            else:
                y = rms_norm(x, lw.in_norm, self.eps, residual)
            qkv = self._linear(y, lw.qkv, lw.qkv_bias)
            q = qkv_rope_store(
                qkv, positions, self.cos, self.sin, lw.q_norm, lw.k_norm, self.eps,
                k_cache[:, i], v_cache[:, i], slots, rows, self.n_q, self.n_kv,
                out=q_out[i] if q_out is not None else None,
            )  # fmt: skip
            if record is not None:
                record(i, q)
            attn = attend(i, q).reshape(q.shape[0], -1)
            x = self._linear(attn, lw.o, lw.o_bias)
            y = rms_norm(x, lw.post_norm, self.eps, residual)
            x = self._linear(self._gate_up_silu(y, lw.gate_up), lw.down)
        if last is not None:
            x, residual = x[last], residual[last]
        y = rms_norm(x, self.norm, self.eps, residual)
        return self._linear(y, self.lm_head)

    def persistent_ready(self) -> bool:
        """Whether :meth:`run_persistent` is allowed (not turned off) and can run this model here."""
        return self.use_persistent is not False and persistent_supported(self) is None

    def run_persistent(
        self,
        ids: torch.Tensor,
        positions: torch.Tensor,
        slots: torch.Tensor,
        rows: torch.Tensor,
        lens: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        beta: torch.Tensor,
        q_out: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """:meth:`run` for one decode token, its layers in one persistent launch; logits ``[1, V]``.

        ``lens`` is the rows attended (the new one included); ``beta`` the cache's β; ``q_out``
        ``[layers, 1, H_q, d]`` receives the rotated queries (see
        :func:`~compaction_gym.engine.fast.persistent.persistent_layers`).
        """
        self.refresh_packed()
        if self.persistent_kernel == "tagged":
            h = tagged_layers(self, self._tagged, ids, positions, slots, rows, lens, k_cache, v_cache, beta, q_out)
        else:
            if self._plan is None:
                self._plan = build_plan(self)
            h = persistent_layers(self, self._plan, ids, positions, slots, rows, lens, k_cache, v_cache, beta, q_out)
        return self._linear(rms_norm(h, self.norm, self.eps), self.lm_head)

    def refresh_packed(self) -> None:
        """Before a tagged launch (or a graph holding one) runs: build its packed weights on first use, and
        pack them again if a parameter changed in place since (docs/fast-path.md, "Tagged hand-offs")."""
        if self.persistent_kernel != "tagged":
            return
        if self._tagged is not None:
            if not torch.cuda.is_current_stream_capturing():  # a pack inside a graph would replay with it
                self._tagged.refresh(self)
            return
        try:
            self._tagged = build_tagged_plan(self)  # compiles the kernel on first use
        except Exception as err:  # noqa: BLE001 - a failed build keeps the Triton launch, said once
            logger.warning("tagged layers unavailable (%s: %s); using the Triton persistent launch", type(err).__name__, err)
            self.persistent_kernel = "triton"

    def check_handoffs(self) -> None:
        """Raise if a tagged launch gave up waiting for a hand-off since the last check (its outputs are
        wrong: docs/fast-path.md, "Tagged hand-offs"); the count restarts. Reads one device word."""
        if self._tagged is None:
            return
        lost = self._tagged.faults()
        if lost:
            self._tagged.state[2] = 0
            raise RuntimeError(
                f"the tagged batch-1 launch gave up on {lost} hand-off polls: the tokens and cached K/V of its "
                "steps since the last check are wrong (did other work hold multiprocessors while it ran?); "
                "COMPACTION_GYM_TAGGED=0 keeps the Triton launch"
            )

    def weights_changed(self) -> None:
        """Say that weights were written where their version counters do not see it (through ``.data``):
        the tagged launch's packed copy is packed again now (optimizer steps and ``load_state_dict`` need
        no call: :meth:`refresh_packed` sees them)."""
        if self._tagged is not None:
            self._tagged.pack(self)

    # ------------------------------------------------------------------ projections
    def _linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x Wᵀ + b``: cuBLAS, or in captured graphs the split-K GEMV where it measured faster.

        While :attr:`graph_mode` is set (the runner's warm-up and capture of a decode graph), a
        projection of ≤ 32 rows is first timed both ways (:meth:`_tune`, outside capture) and the
        captured graph then holds the faster one. Eagerly run batches always use cuBLAS: a Triton
        launch costs more host time than the product itself at these sizes.
        """
        tiling = self._gemv_tiling(x, weight, bias, None)
        if tiling is not None:
            return gemv(x, weight, bias, sm_count=self.sm_count, **tiling)
        return torch.nn.functional.linear(x, weight, bias)

    def _gate_up_silu(self, x: torch.Tensor, gate_up: torch.Tensor) -> torch.Tensor:
        """``silu(x Gᵀ) · (x Uᵀ)`` for ``gate_up = [G; U]``: in captured graphs of ≤ 32 rows the GEMV
        with the SiLU·mul epilogue (one launch) where it measured faster, else projection + :func:`silu_mul`."""
        if self.fuse_mlp:
            tiling = self._gemv_tiling(x, gate_up, None, "silu_mul")
            if tiling is not None:
                return gemv(x, gate_up, act="silu_mul", sm_count=self.sm_count, **tiling)
        return silu_mul(self._linear(x, gate_up))

    def _gemv_tiling(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None
    ) -> dict | None:
        """The GEMV tiling a captured graph runs for this product, or ``None`` (cuBLAS / unfused).

        Outside capture (the runner's warm-up steps) a new (shape, row bucket, bias, act) is timed
        first (:meth:`_tune`); during capture the choice is looked up.
        """
        m = x.shape[0]
        if not (self.graph_mode and self.use_gemv and m <= GEMV_MAX_M and gemv_supported(x, weight, act)):
            return None
        key = (tuple(weight.shape), 1 << (m - 1).bit_length(), bias is not None, act)
        if not torch.cuda.is_current_stream_capturing():
            if key not in self._gemv_choice:
                self._gemv_choice[key] = self._tune(x, weight, bias, act)
            return None  # warm-up steps run the plain path (its kernels and workspaces get made too)
        choice = self._gemv_choice.get(key)
        return choice[1] if choice else None

    def _tune(
        self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, act: str | None = None
    ) -> tuple | bool:
        """Time cuBLAS and the GEMV tilings of :data:`GEMV_CANDIDATES` on this shape (CUDA-graph replays).

        The weights rotate through the layers' matrices of the same shape (so the timing reads
        HBM, as decode does). Returns ``("gemv", tiling)`` when a GEMV beats cuBLAS by 3 %, else
        ``False``. With ``act="silu_mul"`` the GEMV with the SiLU·mul epilogue is timed against
        the unfused pair (cuBLAS or the plain GEMV, then :func:`silu_mul`). Runs once per (shape,
        rows, bias, act), outside graph capture (the runner's warm-up steps come first).
        """
        from triton.runtime.errors import OutOfResources

        mats = self._same_shape(weight)
        x = torch.randn_like(x)  # warm-up inputs may be all zeros (padding rows)
        post = silu_mul if act else (lambda y: y)

        def cublas(i: int) -> None:
            post(torch.nn.functional.linear(x, mats[i % len(mats)], bias))

        launches = max(16, len(mats))
        base = _graph_time(cublas, launches)
        options = [(fused, t) for fused in ((False, True) if act else (False,)) for t in GEMV_CANDIDATES]
        times = {}
        for fused, tiling in options:

            def run(i: int, fused=fused, tiling=tiling) -> None:
                w = mats[i % len(mats)]
                if fused:
                    gemv(x, w, bias, act=act, sm_count=self.sm_count, **tiling)
                else:
                    post(gemv(x, w, bias, sm_count=self.sm_count, **tiling))

            try:
                times[fused, tuple(tiling.items())] = _graph_time(run, launches)
            except OutOfResources:  # a tiling this device cannot hold
                continue
        unfused = min([base] + [t for (fused, _), t in times.items() if not fused])
        best, best_t = False, 0.97 * (unfused if act else base)
        for (fused, tiling), t in times.items():
            if fused == (act is not None) and t < best_t:
                best, best_t = ("gemv", dict(tiling)), t
        return best

    def _same_shape(self, weight: torch.Tensor) -> list[torch.Tensor]:
        """Up to 32 of the model's matrices shaped like ``weight`` (timings rotate through them: HBM reads)."""
        mats = [w for w in self._matrices() if w.shape == weight.shape and w.dtype == weight.dtype]
        return mats[:32] or [weight]

    def _matrices(self) -> list[torch.Tensor]:
        return [w for lw in self.layers for w in (lw.qkv, lw.o, lw.gate_up, lw.down)] + [self.lm_head]


#: Captures fail only on unsafe CUDA calls of the capturing thread: with the default "global"
#: mode a CUDA call from any other thread of the process (a background worker, a finalizer)
#: invalidates the capture, which surfaced as "operation failed due to a previous error during
#: capture" in one long GPU test run (docs/fast-path.md).
CAPTURE_ERROR_MODE = "thread_local"


def _graph_time(fn: Callable[[int], None], launches: int = 16, replays: int = 3) -> float:
    """Smallest seconds per call of ``fn(i)`` over ``replays`` replays of a graph of ``launches`` calls."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(2):  # compiles Triton kernels, allocates split-K workspaces
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode=CAPTURE_ERROR_MODE):
        for i in range(launches):
            fn(i)
    best = float("inf")
    for _ in range(replays):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3 / launches)
    del graph
    return best

