"""``benchmarks/bench_tagged_layer.py``: the Qwen3-0.6B-shaped tagged stream computes the layer it
times (against float64 with the same bf16 roundings), under every ring, cap, layout, L2 prefetcher,
sum order, input, matmul (CUDA or tensor cores) and attention it offers, and the engine's launch it
is compared with runs (GPU); its layouts' tables cover every task once within each phase's cap, both
gate/up packings unpack, tensor cores' fragments are packed as PTX lays them out, bad ``--prefetch``
kinds are refused by name, and a layer's steps come out of its per-block stamps (CPU)."""

from __future__ import annotations

import pytest
import torch


@pytest.mark.gpu
def test_tagged_layer_matches_float64(load_benchmark, capsys):
    bench = load_benchmark("bench_tagged_layer")
    argv = ["--layers", "6", "--check-layers", "2", "--ahead", "2", "20", "--round-robin"]
    argv += ["--slots", "5", "6", "--input", "shared", "held"]
    argv += ["--prefetch", "none", "loads:2", "bulk:8", "--sums", "independent", "chained"]
    argv += ["--layout", "today", "spread", "spread-d", "spread-d-early", "--matmul", "fma", "mma"]
    argv += ["--unchecked", "--no-input", "--no-bytes", "--no-math", "--stamps"]
    assert bench.main([*argv, "--repeats", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    errors = dict(
        part.rsplit(" ", 1)
        for part in out.split("relative to the largest value: ")[1].splitlines()[0].split("; ")
    )
    # multiply-adds: 2 inputs × (5 layouts with independent sums: paired, round robin, spread, gate/up
    # spread, the same with down's blocks early; 2 with sums chained); tensor cores: 5 layouts; each × 2
    # rings × 2 caps × 3 prefetchers × (end to end, last phase)
    assert len(errors) == (2 * (5 + 2) + 5) * 2 * 2 * 3 * 2
    for name, error in errors.items():
        assert float(error) < (1e-2 if "end to end" in name else 1e-3), name
    assert "engine's persistent launch" in out and "gate/up round robin" in out
    assert "L2 asked 2 chunks ahead (loads)" in out and "tags unchecked" in out and "no weight bytes" in out
    assert "Where a layer goes" in out and "input held in registers" in out and "no math" in out
    assert (
        "spread layout" in out and "gate/up spread" in out and "tensor cores" in out and "blocks early" in out
    )


@pytest.mark.gpu
def test_tagged_layer_attention_by_quarters_matches_float64(load_benchmark, capsys):
    bench = load_benchmark("bench_tagged_layer")
    argv = ["--layers", "6", "--check-layers", "2", "--ahead", "2", "--attention", "quarters"]
    argv += ["--layout", "today", "spread", "--matmul", "fma", "mma", "--no-engine"]
    assert bench.main([*argv, "--repeats", "2", "--rounds", "1"]) == 0
    out = capsys.readouterr().out
    errors = dict(
        part.rsplit(" ", 1)
        for part in out.split("relative to the largest value: ")[1].splitlines()[0].split("; ")
    )
    assert len(errors) == 2 * 2 * 2  # 2 layouts × 2 matmuls × (end to end, last phase)
    for name, error in errors.items():
        assert "attention by quarters" in name
        assert float(error) < (1e-2 if "end to end" in name else 1e-3), name


def test_pairs_cover_every_gate_up_chunk_once(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    for programs in (128, 132, 144):
        for balanced in (False, True):
            table = bench.gate_up_pairs(programs, balanced)
            assert table.shape == (programs, 4)
            assert sorted(int(j) for j in table.flatten() if j >= 0) == list(range(bench.D // 2))


@pytest.mark.parametrize("only_d, down_early", [(False, False), (True, False), (True, True)])
def test_spread_tasks_cover_every_task_once_within_each_phase_s_cap(load_benchmark, only_d, down_early):
    bench = load_benchmark("bench_tagged_layer")
    for programs in (128, 132, 144, 256):
        table = bench.spread_tasks(programs, only_d, down_early)
        assert table.shape == (programs, 6)
        cap = -(-bench.D // programs)
        phases = {"D": (table[:, 1:] if only_d else table[:, 1:4], bench.D)}
        if not only_d:
            phases |= {"C": (table[:, :1], bench.C), "E": (table[:, 4:], bench.E)}
        else:
            assert (table[:, 0] < 0).all()
        for name, (cols, tasks) in phases.items():
            assert sorted(int(j) for j in cols.flatten() if j >= 0) == list(range(tasks)), name
            # no block runs more of a phase than its tasks ÷ the blocks, rounded up: the phase's path
            if not down_early:
                assert int((cols >= 0).sum(1).max()) == -(-tasks // programs), name
        if (
            down_early
        ):  # down's blocks (today's: odd, below 128) one D chunk under the cap, the others one over
            d = (table[:, 1:] >= 0).sum(1)
            down = torch.tensor([b < 128 and b % 2 == 1 for b in range(programs)])
            assert int(d[down].max()) <= cap - 1 and int(d[~down].max()) <= cap + 1
        elif only_d:
            assert (table[:, 4:] < 0).all()
        # and no block streams more chunks a layer than an even share of the 1,088, rounded up
        chunks = torch.tensor(bench.fixed_chunks(programs, only_d)) + (table >= 0).sum(1)
        assert int(chunks.sum()) == bench.CHUNKS
        assert int(chunks.max()) <= -(-bench.CHUNKS // programs)
    with pytest.raises(ValueError, match="programs"):
        bench.spread_tasks(100)
    with pytest.raises(ValueError, match="down_early"):
        bench.spread_tasks(132, only_d=False, down_early=True)


def test_unpack_reads_both_gate_up_packings(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    gate, up = torch.randn(3072, 1024), torch.randn(3072, 1024)
    paired = torch.zeros(bench.CHUNKS, 16, 1024)
    spread = torch.zeros(bench.CHUNKS, 16, 1024)
    d0 = bench.A + bench.B + bench.C
    for j in range(bench.D // 2):  # today's: gate rows 16j.., then up rows 16j..
        paired[d0 + 2 * j], paired[d0 + 2 * j + 1] = gate[16 * j : 16 * j + 16], up[16 * j : 16 * j + 16]
    for j in range(bench.D):  # spread: rows 2w and 2w + 1 are gate and up row 8j + w
        for w in range(8):
            spread[d0 + j, 2 * w], spread[d0 + j, 2 * w + 1] = gate[8 * j + w], up[8 * j + w]
    for layer, is_spread in ((paired, False), (spread, True)):
        m = bench.unpack(layer, is_spread)
        assert torch.equal(m["gate"].float(), gate) and torch.equal(m["up"].float(), up)


def test_mma_packed_lays_each_lane_s_a_fragment_out_as_the_ptx_layout_says(load_benchmark):
    """Lane l (g = l // 4, c = l % 4) of warp w holds, for k-tile t (k = 128w + 16t), the m16n8k16 A
    fragment a0..a3: rows g, g + 8 at columns k + 2c, k + 2c + 1, then k + 2c + 8, k + 2c + 9."""
    bench = load_benchmark("bench_tagged_layer")
    W = torch.randn(1, bench.CHUNKS, 16, 1024)
    packed = bench.mma_packed(W)
    assert torch.equal(packed[:, bench.A : bench.A + bench.B], W[:, bench.A : bench.A + bench.B])  # K/V as is
    for chunk in (0, bench.A - 1, bench.A + bench.B, bench.A + bench.B + bench.C + 5, bench.CHUNKS - 1):
        m, flat = W[0, chunk], packed[0, chunk].reshape(-1)
        for w, t, lane in ((0, 0, 0), (3, 5, 17), (7, 7, 31), (5, 2, 6)):
            g, c, k = lane // 4, lane % 4, 128 * w + 16 * t
            at = ((w * 8 + t) * 32 + lane) * 8
            expected = [m[r, k + 2 * c + kh * 8 + e] for kh in (0, 1) for r in (g, g + 8) for e in (0, 1)]
            assert torch.equal(flat[at : at + 8], torch.stack(expected)), (chunk, w, t, lane)


def test_handed_on_f32_reads_tagged_words_or_refuses_a_stale_one(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    values = torch.tensor([1.5, -2.25, 3.0e-5])
    words = (7 << 32) | values.view(torch.int32).long() & 0xFFFFFFFF
    assert torch.equal(bench.handed_on_f32(words, 7), values.double())
    words[1] = (6 << 32) | (words[1] & 0xFFFFFFFF)
    assert bench.handed_on_f32(words, 7) is None


def test_prefetch_spec_is_parsed_or_refused_by_name(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    assert bench.prefetch_mode("none") == (0, 0)
    assert bench.prefetch_mode("loads") == (1, 4)
    assert bench.prefetch_mode("bulk:8") == (2, 8)
    with pytest.raises(ValueError, match="--prefetch"):
        bench.prefetch_mode("l2:4")


def test_step_medians_take_the_last_block_at_each_event(load_benchmark):
    bench = load_benchmark("bench_tagged_layer")
    layers, blocks = 4, 3
    stamps = torch.zeros(layers, bench.EVENTS, blocks, dtype=torch.int64)
    for layer in range(layers):
        for event in range(bench.EVENTS):
            at = 10_000 * layer + 500 * event + (300 if event == 5 else 0)  # step M 0.8 µs, the next 0.2
            stamps[layer, event, 0] = at - 100  # an earlier block
            stamps[layer, event, 1] = at
    steps = bench.step_medians(stamps)
    assert steps["M: merge"] == pytest.approx(0.8)
    assert steps["hand-off 2: attention output to the output projection"] == pytest.approx(0.2)
    assert steps["hand-off 5 and the norm: h to the next layer"] == pytest.approx(10 - 11 * 0.5)
    assert steps["the layer"] == pytest.approx(10.0)
