"""The tagged launch (every layer of a batch-1 step, no grid barrier; Qwen3-0.6B's shape).

CPU: the packed chunks, multiplied as the PTX manual lays out m16n8k16's fragments (an emulation
that knows nothing of the packing), give each projection's rows; the gate/up table covers every
chunk once within its cap. GPU: one step against the layered path (itself tested against HF and
float32) at any cached length with β, the stored K/V row and the recorded queries; a padding row;
launches back to back and replayed from a CUDA graph; weights packed again after they change.
"""

from __future__ import annotations

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from compaction_gym.engine.fast.tagged import (
    CHUNK_COLS,
    CHUNK_ROWS,
    LAYER_CHUNKS,
    PHASE_CHUNKS,
    TABLE_WIDTH,
    fixed_chunks,
    gate_up_table,
    layer_chunks,
    mma_fragments,
)

CUDA = torch.device("cuda")


def _mma_rows(packed: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """The 16 row sums of each packed chunk ``[n, 16, 1,024]`` against ``x`` (1,024 columns), read
    as the kernel reads them: warp w's k-tile t is 32 lanes × 8 values; lane (g, c) holds A's rows g
    and g + 8 at columns 2c, 2c + 1 (a0-a3) and 2c + 8, 2c + 9 (a4-a7) in the order a0 a1 (row g), a2
    a3 (row g + 8), a4 a5 (row g), a6 a7 (row g + 8) — the PTX ISA's m16n8k16 .bf16 A fragment."""
    n = packed.shape[0]
    rows, cols = torch.empty(8, 8, 32, 8, dtype=torch.long), torch.empty(8, 8, 32, 8, dtype=torch.long)
    for w in range(8):
        for t in range(8):
            for lane in range(32):
                g, c = divmod(lane, 4)
                for i, (row, col) in enumerate(
                    [(g, 2 * c), (g, 2 * c + 1), (g + 8, 2 * c), (g + 8, 2 * c + 1),
                     (g, 2 * c + 8), (g, 2 * c + 9), (g + 8, 2 * c + 8), (g + 8, 2 * c + 9)]
                ):  # fmt: skip
                    rows[w, t, lane, i], cols[w, t, lane, i] = row, 128 * w + 16 * t + col
    terms = packed.reshape(n, -1).double() * x.double()[cols.reshape(-1)]  # chunk, warp, k-tile, lane, value
    out = torch.zeros(n, 16, dtype=torch.float64)
    out.index_add_(1, rows.reshape(-1), terms)
    return out


def test_packed_chunks_give_each_projections_rows():
    """Small random matrices of the real shapes: q/k/v, output projection, gate/up, down chunks,
    multiplied through the fragment layout, give W @ x for every row (gate/up: each chunk's rows 2w
    and 2w + 1 are gate and up row 8j + w)."""
    g = torch.Generator().manual_seed(0)
    qkv = torch.randn(4096, 1024, generator=g).to(torch.bfloat16)
    o = torch.randn(1024, 2048, generator=g).to(torch.bfloat16)
    gate_up = torch.randn(6144, 1024, generator=g).to(torch.bfloat16)
    down = torch.randn(1024, 3072, generator=g).to(torch.bfloat16)
    chunks = layer_chunks(qkv, o, gate_up, down)
    assert chunks.shape == (LAYER_CHUNKS, CHUNK_ROWS, CHUNK_COLS)
    packed = mma_fragments(chunks)
    x = torch.randn(3072, generator=g).to(torch.bfloat16)
    a, c, d = PHASE_CHUNKS["qkv"], PHASE_CHUNKS["o"], PHASE_CHUNKS["gate_up"]
    picks = {  # a few chunks of each phase: (chunk id, its input, the rows it must give)
        "qkv": [(i, x[:1024], qkv[16 * i : 16 * i + 16].double() @ x[:1024].double()) for i in (0, 127, 255)],
        "o": [
            (a + 2 * r + half, x[1024 * half : 1024 * half + 1024],
             o[16 * r : 16 * r + 16, 1024 * half : 1024 * half + 1024].double() @ x[1024 * half : 1024 * half + 1024].double())
            for r, half in ((0, 0), (0, 1), (63, 1))
        ],
        "gate_up": [
            (a + c + j, x[:1024],
             torch.stack([gate_up[8 * j : 8 * j + 8], gate_up[3072 + 8 * j : 3072 + 8 * j + 8]], 1).reshape(16, 1024).double()
             @ x[:1024].double())
            for j in (0, 200, 383)
        ],
        "down": [
            (a + c + d + 3 * r + k, x[1024 * k : 1024 * k + 1024],
             down[16 * r : 16 * r + 16, 1024 * k : 1024 * k + 1024].double() @ x[1024 * k : 1024 * k + 1024].double())
            for r, k in ((0, 0), (10, 2), (63, 1))
        ],
    }  # fmt: skip
    for phase, cases in picks.items():
        for chunk, inp, want in cases:
            got = _mma_rows(packed[chunk : chunk + 1], inp)[0]
            assert torch.allclose(got, want, rtol=1e-9, atol=1e-9), (phase, chunk)


@pytest.mark.parametrize("programs", [128, 132, 144, 256])
def test_gate_up_table_covers_every_chunk_once(programs):
    table = gate_up_table(programs)
    assert table.shape == (programs, TABLE_WIDTH)
    chunks = table[table >= 0]
    assert sorted(chunks.tolist()) == list(range(PHASE_CHUNKS["gate_up"]))
    per_block = (table >= 0).sum(1)
    assert int(per_block.max()) <= -(-PHASE_CHUNKS["gate_up"] // programs)
    # no block streams more chunks a layer than some block must (1,088 at 1,024 cached rows)
    load = torch.tensor(fixed_chunks(programs)) + per_block
    assert int(load.sum()) == LAYER_CHUNKS + 128
    assert int(load.max()) == -(-(LAYER_CHUNKS + 128) // programs)
    with pytest.raises(ValueError, match="programs"):
        gate_up_table(100)


# ------------------------------------------------------------------------------------------ GPU
def _model(tmp_path_factory):
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine.attention import register_attention
    from compaction_gym.models.tiny import make_tiny_model

    path = make_tiny_model(
        tmp_path_factory.mktemp("qwen3-0.6b-shape"), layers=3, hidden=1024, heads=16, kv_heads=8, head_dim=128,
        intermediate=3072, initializer_range=0.05,
    )  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, attn_implementation=register_attention())
    return model.to(CUDA).eval()


@pytest.fixture(scope="module")
def runner(tmp_path_factory):
    from compaction_gym.engine.fast import FastModelRunner
    from compaction_gym.engine.fast.tagged import tagged_supported
    from compaction_gym.engine.model_runner import ModelLayout
    from compaction_gym.engine.slot_cache import SlotKVCache

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    model = _model(tmp_path_factory)
    layout = ModelLayout.from_model(model)
    cache = SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, 2, 2200, torch.bfloat16, CUDA)
    r = FastModelRunner(model, cache, layout)
    reason = tagged_supported(r.decoder)
    if reason is not None:
        pytest.skip(reason)
    torch.manual_seed(0)
    cache.k.normal_()
    cache.v.normal_()
    cache.beta.normal_().mul_(2.0)
    return r


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-12)).item()


def _step(runner, n: int, path: str, slot: int = 0, token: int = 11):
    """One token at cache row ``n`` of ``slot`` through ``path`` (eager): (residual out of the last
    layer, new K row, new V row, queries); the cache is restored after."""
    from compaction_gym.engine.fast.attention import decode_attention, num_splits_for
    from compaction_gym.engine.fast.persistent import build_plan, persistent_layers
    from compaction_gym.engine.fast.tagged import build_tagged_plan, tagged_layers

    dec, c = runner.decoder, runner.cache
    t = lambda v: torch.tensor([v], device=CUDA)  # noqa: E731
    ids, pos, slots, rows, lens = t(token), t(n), t(slot), t(n), t(n + 1)
    q = torch.zeros(dec.n_layers, 1, dec.n_q, dec.head_dim, dtype=dec.dtype, device=CUDA)
    saved = c.k[slot, :, :, n].clone(), c.v[slot, :, :, n].clone()
    with torch.no_grad():
        if path == "layered":
            splits = num_splits_for(1, c.n_kv_heads, c.capacity, dec.sm_count)

            def attend(i, qq):
                return decode_attention(qq, c.k[:, i], c.v[:, i], c.beta[:, i], slots, lens, dec.scale, splits)

            logits = dec.run(ids, pos, slots, rows, c.k, c.v, attend, q_out=q)
        elif path == "persistent":
            plan = _plan_of(dec, "_test_plan", build_plan)
            h = persistent_layers(dec, plan, ids, pos, slots, rows, lens, c.k, c.v, c.beta, q)
            logits = dec._linear(_final_norm(dec, h), dec.lm_head)
        else:
            plan = _plan_of(dec, "_test_tagged", build_tagged_plan)
            h = tagged_layers(dec, plan, ids, pos, slots, rows, lens, c.k, c.v, c.beta, q)
            logits = dec._linear(_final_norm(dec, h), dec.lm_head)
            assert plan.faults() == 0
    out = (logits.float(), c.k[slot, :, :, n].clone(), c.v[slot, :, :, n].clone(), q)
    c.k[slot, :, :, n], c.v[slot, :, :, n] = saved
    return out


def _plan_of(dec, name: str, build):
    """A plan built once per decoder (kept on it under ``name``)."""
    if name not in dec.__dict__:
        setattr(dec, name, build(dec))
    return getattr(dec, name)


def _final_norm(dec, h):
    from compaction_gym.engine.fast.kernels import rms_norm

    return rms_norm(h, dec.norm, dec.eps)


@pytest.mark.gpu
@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.one_of(st.sampled_from([0, 1, 63, 64, 65, 1023, 1024, 1025, 2199]), st.integers(0, 2199)))
def test_one_step_matches_layered_at_any_length(runner, n):
    """Any cached length (empty, one row, chunk edges, several chunks a task, the full capacity), β
    on every key: logits, the stored K/V row and the recorded queries match the layered path's as
    closely as the persistent launch's do (layer 0's K and V within two rounding steps)."""
    ref = _step(runner, n, "layered")
    got = _step(runner, n, "tagged")
    per = _step(runner, n, "persistent")
    for i in range(4):
        assert _rel(got[i], ref[i]) < max(0.02, 2 * _rel(per[i], ref[i])), i
    eps = torch.finfo(torch.bfloat16).eps
    for i in (1, 2):
        assert (got[i][0] - ref[i][0]).abs().max() <= 2 * eps * ref[i][0].abs().max()


@pytest.mark.gpu
def test_beta_is_applied(runner):
    """Pushing β of half the keys to −30 changes the output as it changes the layered path's."""
    c = runner.cache
    saved = c.beta.clone()
    try:
        base = _step(runner, 900, "tagged")
        c.beta[0, :, :, :450] = -30.0
        masked, ref = _step(runner, 900, "tagged"), _step(runner, 900, "layered")
    finally:
        c.beta.copy_(saved)
    assert _rel(masked[0], ref[0]) < 0.02
    assert _rel(masked[0], base[0]) > 5 * _rel(masked[0], ref[0])


@pytest.mark.gpu
def test_padding_row_writes_and_reads_nothing(runner):
    from compaction_gym.engine.fast.tagged import build_tagged_plan, tagged_layers

    dec, c = runner.decoder, runner.cache
    plan = build_tagged_plan(dec)
    before = c.k.clone(), c.v.clone()
    t = lambda v: torch.tensor([v], device=CUDA)  # noqa: E731
    with torch.no_grad():
        h = tagged_layers(dec, plan, t(5), t(0), t(-1), t(0), t(0), c.k, c.v, c.beta)
    assert torch.isfinite(h).all() and plan.faults() == 0
    assert torch.equal(c.k, before[0]) and torch.equal(c.v, before[1])
    assert int(plan.state[0]) == 1 and int(plan.state[1]) == 0  # the next launch's tags; the count reset


@pytest.mark.gpu
def test_launches_back_to_back_and_from_a_graph(runner):
    """Ten launches in a row, then thirty replays of a captured graph, at two lengths: every one
    gives the first eager launch's residual to the last bit (the tags advance on the device)."""
    from compaction_gym.engine.fast.tagged import build_tagged_plan, tagged_layers

    dec, c = runner.decoder, runner.cache
    plan = build_tagged_plan(dec)
    inputs = torch.tensor([[11], [700], [1], [700], [701]], device=CUDA)
    ids, pos, slots, rows, lens = inputs

    def launch():
        return tagged_layers(dec, plan, ids, pos, slots, rows, lens, c.k, c.v, c.beta)

    with torch.no_grad():
        first = launch().clone()
        for _ in range(10):
            assert torch.equal(launch(), first)
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            launch()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = launch()
        for length in (701, 1500):
            inputs.copy_(torch.tensor([[11], [length - 1], [1], [length - 1], [length]], device=CUDA))
            want = launch().clone()
            for _ in range(15):
                graph.replay()
                assert torch.equal(out, want)
    torch.cuda.synchronize()
    assert plan.faults() == 0 and int(plan.state[0]) == 1 + 10 + 1 + 2 * 16  # capture runs nothing


@pytest.mark.gpu
def test_weights_packed_again_after_they_change(runner):
    """An in-place update of one parameter (as an optimizer step makes) is seen at the next refresh."""
    from compaction_gym.engine.fast.tagged import build_tagged_plan

    dec = runner.decoder
    plan = build_tagged_plan(dec)
    assert not plan.refresh(dec)
    down = dec.layers[1].down
    saved = down.clone()
    try:
        with torch.no_grad():
            down.mul_(0.5)
        assert plan.refresh(dec)
        assert torch.equal(plan.weights[1], build_tagged_plan(dec).weights[1])
    finally:
        with torch.no_grad():
            down.copy_(saved)
    assert plan.refresh(dec)
    # a write through .data moves no version counter: weights_changed packs again
    dec._tagged = plan
    down.data.mul_(2.0)
    try:
        assert not plan.refresh(dec)
        dec.weights_changed()
        assert torch.equal(plan.weights[1], build_tagged_plan(dec).weights[1])
    finally:
        down.data.copy_(saved)
        dec.weights_changed()
        dec._tagged = None


@pytest.mark.gpu
def test_generate_runs_the_tagged_launch(runner, monkeypatch):
    """Through the runner: a batch-1 chunk sampled at temperature 1.5 with β on a third of the prompt
    replays the tagged launch from its graph; the layered path, fed the same tokens, gives each
    emitted log-prob to bf16 noise. ``COMPACTION_GYM_TAGGED=0`` keeps the Triton launch."""
    from compaction_gym.engine.config import SamplingParams
    from compaction_gym.engine.fast import FastModelRunner
    from compaction_gym.engine.model_runner import ModelLayout, RowFeed
    from compaction_gym.engine.slot_cache import SlotKVCache

    model, layout = runner.model, ModelLayout.from_model(runner.model)

    def fresh(persistent: bool) -> FastModelRunner:
        cache = SlotKVCache(layout.n_layers, layout.n_kv_heads, layout.head_dim, 1, 600, torch.bfloat16, CUDA)
        r = FastModelRunner(model, cache, layout)
        r.decoder.use_persistent = persistent
        return r

    prompt = list(range(30, 230))
    tagged = fresh(True)
    assert tagged.decoder.persistent_kernel == "tagged"
    first = tagged.forward([RowFeed(0, prompt, 0)]).argmax(-1).tolist()
    tagged.cache.beta[0, :, :, :70] = torch.linspace(-3, 1, 70, device=CUDA)
    tagged.cache.has_beta[0] = True
    toks, lps = tagged.generate([0], first, [len(prompt)], [SamplingParams(temperature=1.5)], 48, seeds=[3])
    assert len(toks[0]) == 48 and tagged.decoder._tagged is not None and tagged.decoder._tagged.faults() == 0
    ref = fresh(False)
    ref.forward([RowFeed(0, prompt, 0)])
    ref.cache.beta[0, :, :, :70] = torch.linspace(-3, 1, 70, device=CUDA)
    ref.cache.has_beta[0] = True
    want = []
    for j, tok in enumerate(first + toks[0][:-1]):  # the layered decode graph, a token at a time
        logits = ref.forward([RowFeed(0, [tok], len(prompt) + j)]).float()
        want.append(torch.log_softmax(logits[0] / 1.5, -1)[toks[0][j]])
    want, got = torch.stack(want), torch.tensor(lps[0], device=CUDA)
    assert (got - want).abs().max() < 0.1, (got - want).abs().max()
    monkeypatch.setenv("COMPACTION_GYM_TAGGED", "0")
    assert fresh(True).decoder.persistent_kernel == "triton"


def _decoder(**changes):
    """A stand-in decoder with Qwen3-0.6B's shapes on the meta device, reported as on CUDA."""
    from types import SimpleNamespace

    meta = torch.device("meta")
    layer = SimpleNamespace(
        down=torch.empty(1024, 3072, device=meta), q_norm=torch.empty(128, device=meta),
        k_norm=torch.empty(128, device=meta), qkv_bias=None, o_bias=None,
    )  # fmt: skip
    dec = SimpleNamespace(
        device=torch.device("cuda"), dtype=torch.bfloat16, embed=torch.empty(151936, 1024, device=meta),
        n_q=16, n_kv=8, head_dim=128, sm_count=132, layers=[layer],
    )  # fmt: skip
    for key, value in changes.items():
        target = layer if hasattr(layer, key) else dec
        setattr(target, key, value)
    return dec


@pytest.mark.parametrize(
    ("changes", "capability", "reason"),
    [
        ({}, (9, 0), None),
        ({"device": torch.device("cpu")}, (9, 0), "needs CUDA"),
        ({"dtype": torch.float16}, (9, 0), "bf16 only"),
        ({"head_dim": 64}, (9, 0), "Qwen3-0.6B's shape"),
        ({"down": torch.empty(1024, 2816, device="meta")}, (9, 0), "'intermediate': 2816"),
        ({"q_norm": None}, (9, 0), "q/k norms"),
        ({"qkv_bias": torch.empty(4096, device="meta")}, (9, 0), "biases"),
        ({}, (8, 0), "Hopper GPU (compute capability 9.x, not 8.0)"),
        ({}, (10, 0), "not 10.0"),
        ({"sm_count": 114}, (9, 0), "128 to 256 multiprocessors, not 114"),
    ],
)
def test_tagged_supported_names_what_is_missing(monkeypatch, changes, capability, reason):
    """Each unmet requirement is named (shape checks need no device: a CPU run asks the same)."""
    from compaction_gym.engine.fast.tagged import tagged_supported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: capability)
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: True)
    got = tagged_supported(_decoder(**changes))
    assert got is None if reason is None else reason in got


def test_tagged_supported_needs_a_compiler_and_ninja(monkeypatch):
    from compaction_gym.engine.fast.tagged import tagged_supported

    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", None)
    assert "nvcc" in tagged_supported(_decoder())
    monkeypatch.setattr("torch.utils.cpp_extension.CUDA_HOME", "/usr/local/cuda")
    monkeypatch.setattr("torch.utils.cpp_extension.is_ninja_available", lambda: False)
    assert "ninja" in tagged_supported(_decoder())
