"""Every decoder layer of a batch-1 decode step as one CUDA launch of tagged hand-offs (Qwen3-0.6B).

The persistent Triton launch (:mod:`~compaction_gym.engine.fast.persistent`) separates a layer's
five phases by grid-wide barriers; at Qwen3-0.6B's size each barrier costs about as much as the
phase's bytes. :func:`tagged_layers` runs the same step without any barrier (benchmarked as
``benchmarks/bench_tagged_layer.py``'s best design, docs/benchmarks.md "Session 40"): one block of
eight consumer warps and a producer warp per multiprocessor; the producer streams the block's
weight chunks (32 KB, packed once as tensor cores' fragments: :func:`pack_weights`) and its cached
K/V rows into a ring of shared-memory slots with bulk copies, and every hand-off between blocks is
a vector of words that carry their own tag, polled until every tag is current
(``csrc/tagged_layers.cu`` describes the layer). Roundings are HF's (each projection's output, the
residual, the norms, RoPE's products and SiLU·mul rounded to bf16); only float32 summation orders
differ, and P·V multiplies float32 weights where the Triton kernels round them to bf16.

Only Qwen3-0.6B's shape is built (hidden 1,024, 16 query and 8 KV heads of 128, intermediate 3,072,
q/k norm, no biases, bf16) on Hopper GPUs with 128–256 multiprocessors; :func:`tagged_supported`
says why not otherwise. The kernel is compiled on first use (``torch.utils.cpp_extension``; needs
the CUDA toolkit's ``nvcc``, about a minute once). The packed weights are a second copy (0.85 GB
at 0.6B); :meth:`TaggedPlan.refresh` packs them again when a parameter changed in place (its
version counter moved: optimizer steps, ``load_state_dict``); writes through ``.data`` do not move
it, so call :meth:`~compaction_gym.engine.fast.model.FastDecoder.weights_changed` after those.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

#: the one shape the kernel is built for
SHAPE = {"hidden": 1024, "n_q": 16, "n_kv": 8, "head_dim": 128, "intermediate": 3072}
CHUNK_ROWS, CHUNK_COLS = 16, 1024
#: weight chunks a layer, by phase: q/k/v rows, output projection, gate/up, down
PHASE_CHUNKS = {"qkv": 256, "o": 128, "gate_up": 384, "down": 192}
LAYER_CHUNKS = sum(PHASE_CHUNKS.values())
#: D chunks a block may run (the kernel's table width)
TABLE_WIDTH = 5
#: attention tasks (KV head, split) and each partial's words (128 outputs, max, sum)
TASKS, PARTIAL = 128, 130
WORDS = 4096 + 2048 + 1024 + 3072 + 1024  # q/k/v, attention, h_mid, act, h
CSRC = Path(__file__).with_name("csrc")


def tagged_supported(decoder) -> str | None:
    """Why :func:`tagged_layers` cannot run ``decoder``'s model here, or ``None`` when it can."""
    if decoder.device.type != "cuda":
        return "needs CUDA"
    if decoder.dtype != torch.bfloat16:
        return f"weights in {decoder.dtype} (bf16 only)"
    lw = decoder.layers[0]
    shape = {
        "hidden": decoder.embed.shape[1],
        "n_q": decoder.n_q,
        "n_kv": decoder.n_kv,
        "head_dim": decoder.head_dim,
        "intermediate": lw.down.shape[1],
    }
    if shape != SHAPE:
        return f"built for Qwen3-0.6B's shape {SHAPE}, not {shape}"
    if lw.q_norm is None or lw.k_norm is None:
        return "needs q/k norms (Qwen3)"
    if lw.qkv_bias is not None or lw.o_bias is not None:
        return "projections with biases"
    major, minor = torch.cuda.get_device_capability(decoder.device)
    if major != 9:
        return f"needs a Hopper GPU (compute capability 9.x, not {major}.{minor})"
    if not 128 <= decoder.sm_count <= 256:
        return f"needs 128 to 256 multiprocessors, not {decoder.sm_count}"
    from torch.utils.cpp_extension import CUDA_HOME, is_ninja_available

    if CUDA_HOME is None:
        return "needs the CUDA toolkit's nvcc (CUDA_HOME) to build the kernel"
    if not is_ninja_available():
        return "needs ninja to build the kernel (pip install ninja)"
    return None


@functools.cache
def extension():
    """The compiled kernel (built on first use, then cached by torch under its extensions folder)."""
    from torch.utils.cpp_extension import load

    ext = load(
        name="compaction_gym_tagged_layers",
        sources=[str(CSRC / "tagged_layers.cu")],
        extra_include_paths=[str(CSRC)],
        extra_cuda_cflags=["-O3"],
    )
    assert ext.layer_chunks() == LAYER_CHUNKS
    return ext


def mma_fragments(chunks: torch.Tensor) -> torch.Tensor:
    """``[..., 16, 1,024]`` chunks reordered as tensor cores' m16n8k16 A fragments: warp w's 8 k-tiles
    (columns 128w + 16t ..), 16 bytes a lane (g, c: lane // 4, lane % 4): rows g and g + 8 at columns
    2c, 2c + 1, then 2c + 8, 2c + 9 (``rows_mma`` in ``csrc/tagged_layers.cu``)."""
    # [.., 16, 1,024] as [.., row half, g, w, t, k half, c, e]: row 8 half + g, column 128w + 16t + 8 khalf + 2c + e
    frag = chunks.unflatten(-1, (8, 8, 2, 4, 2)).unflatten(-6, (2, 8))
    lead = list(range(chunks.dim() - 2))
    return frag.permute(*lead, -5, -4, -6, -2, -3, -7, -1).reshape(chunks.shape)


def layer_chunks(qkv: torch.Tensor, o: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """One layer's ``[960, 16, 1,024]`` weight chunks in the kernel's order, before :func:`mma_fragments`:
    q/k/v's rows 16 at a time; the output projection's 16 rows × each half of its columns; gate/up a
    chunk a task (rows 2w and 2w + 1: gate and up row 8j + w); down's 16 rows × each third."""
    inter = down.shape[1]
    gate, up = gate_up[:inter], gate_up[inter:]
    rows = CHUNK_ROWS
    return torch.cat(
        [
            qkv.reshape(-1, rows, CHUNK_COLS),
            o.reshape(-1, rows, 2, CHUNK_COLS).transpose(1, 2).reshape(-1, rows, CHUNK_COLS),
            torch.stack([gate.reshape(-1, 8, CHUNK_COLS), up.reshape(-1, 8, CHUNK_COLS)], dim=2).reshape(
                -1, rows, CHUNK_COLS
            ),
            down.reshape(-1, rows, 3, CHUNK_COLS).transpose(1, 2).reshape(-1, rows, CHUNK_COLS),
        ]
    )


def balanced_tasks(tasks: int, caps: list[int], load: list[int], chunks: int = 1) -> list[list[int]]:
    """Each block's tasks: each task in turn (of ``chunks`` chunks) to the block with the fewest chunks
    so far (``load``, updated) among those with fewer tasks than their cap, the lowest index on a tie."""
    assigned: list[list[int]] = [[] for _ in caps]
    for task in range(tasks):
        b = min((b for b in range(len(caps)) if len(assigned[b]) < caps[b]), key=lambda b: (load[b], b))
        assigned[b].append(task)
        load[b] += chunks
    return assigned


def fixed_chunks(programs: int, output_and_down: bool = True) -> list[int]:
    """Each block's chunks a layer outside gate/up, at 1,024 cached rows: its q/k/v chunks (b, b + P,
    ...), its attention chunk (block P - 1 - task), and (``output_and_down``) 2 output-projection
    chunks on even blocks below 128, 3 of down on odd ones."""
    qkv = PHASE_CHUNKS["qkv"]
    return [
        len(range(b, qkv, programs)) + (programs - 1 - b < TASKS) + (b < 128) * (2 + b % 2) * output_and_down
        for b in range(programs)
    ]


def gate_up_table(programs: int) -> torch.Tensor:
    """``[programs, 5]`` int32: the gate/up chunks each block runs (-1: none), each in turn to the block
    with the fewest chunks a layer so far, at most ⌈384 / programs⌉ a block."""
    if not 128 <= programs <= 256:
        raise ValueError(f"programs: 128 to 256, not {programs}")
    tasks = PHASE_CHUNKS["gate_up"]
    cap = -(-tasks // programs)
    table = torch.full((programs, TABLE_WIDTH), -1, dtype=torch.int32)
    for b, mine in enumerate(balanced_tasks(tasks, [cap] * programs, fixed_chunks(programs))):
        table[b, : len(mine)] = torch.tensor(mine, dtype=torch.int32)
    return table


def _sources(decoder) -> list[torch.Tensor]:
    return [
        t
        for lw in decoder.layers
        for t in (lw.qkv, lw.o, lw.gate_up, lw.down, lw.in_norm, lw.post_norm, lw.q_norm, lw.k_norm)
    ]


@dataclass
class TaggedPlan:
    """What one model's tagged launch needs besides the step's inputs (built once per decoder)."""

    weights: torch.Tensor  # [L, 960, 16, 1,024] bf16, tensor cores' fragments
    norms: torch.Tensor  # [L, 2,304]: in_norm, post_norm, q_norm, k_norm
    table: torch.Tensor  # [programs, 5] int32: gate/up chunks a block
    words: torch.Tensor  # int32 hand-offs (bf16 value, 16-bit tag)
    part: torch.Tensor  # int64 attention partials (float32 value, 32-bit tag)
    state: torch.Tensor  # int32 [3]: launches so far (the tags' sequence), blocks done, polls that gave up
    h0: torch.Tensor  # [1, H]: the embedding row
    out: torch.Tensor  # [1, H]: the last layer's residual
    versions: tuple[int, ...]  # the source parameters' version counters when packed

    @torch.no_grad()
    def pack(self, decoder) -> None:
        """Pack ``decoder``'s weights into :attr:`weights` and :attr:`norms` (in place: graphs keep them)."""
        for i, lw in enumerate(decoder.layers):
            self.weights[i] = mma_fragments(layer_chunks(lw.qkv, lw.o, lw.gate_up, lw.down))
            torch.cat([lw.in_norm, lw.post_norm, lw.q_norm, lw.k_norm], out=self.norms[i])
        self.versions = tuple(t._version for t in _sources(decoder))

    def refresh(self, decoder) -> bool:
        """Pack again if a source parameter changed in place since; returns whether it did."""
        if tuple(t._version for t in _sources(decoder)) == self.versions:
            return False
        self.pack(decoder)
        return True

    def faults(self) -> int:
        """Hand-off polls that gave up waiting since the plan was built (0 unless something is wrong)."""
        return int(self.state[2])


def build_tagged_plan(decoder) -> TaggedPlan:
    """Packed weights, the gate/up table and the hand-off buffers of ``decoder``'s model."""
    reason = tagged_supported(decoder)
    if reason is not None:
        raise ValueError(f"tagged layers: {reason}")
    extension()  # compiled before anything is allocated: a failed build costs no memory
    dev, n = decoder.device, len(decoder.layers)
    norm_elems = 2 * SHAPE["hidden"] + 2 * SHAPE["head_dim"]
    plan = TaggedPlan(
        weights=torch.empty(n, LAYER_CHUNKS, CHUNK_ROWS, CHUNK_COLS, dtype=torch.bfloat16, device=dev),
        norms=torch.empty(n, norm_elems, dtype=torch.bfloat16, device=dev),
        table=gate_up_table(decoder.sm_count).to(dev),
        words=torch.zeros(WORDS, dtype=torch.int32, device=dev),
        part=torch.zeros(TASKS * 2 * PARTIAL, dtype=torch.int64, device=dev),
        state=torch.zeros(3, dtype=torch.int32, device=dev),
        h0=torch.zeros(1, SHAPE["hidden"], dtype=torch.bfloat16, device=dev),
        out=torch.zeros(1, SHAPE["hidden"], dtype=torch.bfloat16, device=dev),
        versions=(),
    )
    plan.pack(decoder)
    return plan


def tagged_layers(
    decoder,
    plan: TaggedPlan,
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
    """Run one token (batch 1) through every decoder layer in one launch; return the residual stream ``[1, H]``.

    The arguments are :func:`~compaction_gym.engine.fast.persistent.persistent_layers`'s: ``ids``,
    ``positions``, ``slots``, ``rows``, ``lens`` are int64 ``[1]`` device tensors (the token, its
    position, its slot — ``< 0``: padding, nothing stored or read — the cache row its K/V go to, the
    rows attended, the new one included); ``k_cache``, ``v_cache`` the slot cache ``[slots, layers,
    H_kv, capacity, d]`` and ``beta`` its float32 β; ``q_out`` ``[layers, ., H_q, d]`` receives each
    layer's rotated queries (its row 0). Capturable in a CUDA graph: every input is read on the device.
    """
    torch.index_select(decoder.embed.detach(), 0, ids[:1], out=plan.h0)
    extension().launch(
        plan.weights, plan.norms, decoder.cos, decoder.sin, k_cache, v_cache, beta, positions, slots, rows, lens,
        plan.h0.view(-1), plan.out.view(-1), q_out, plan.table, plan.words, plan.part, plan.state,
        len(decoder.layers), decoder.eps, decoder.scale,
    )  # fmt: skip
    return plan.out
