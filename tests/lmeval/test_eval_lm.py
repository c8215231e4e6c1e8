"""``compaction-gym eval-lm`` on the tiny random model: arithmetic against hand computations,
mode ``none`` against a plain forward, the CLI's JSON summary and its argument errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.backends import LocalBackend
from compaction_gym.cli import main as cli_main
from compaction_gym.engine import Engine
from compaction_gym.errors import InvalidArgumentError
from compaction_gym.lmeval import bits_per_byte, load_text, make_cells, piece_bytes, pydoc_text, score_cells

TEXT = "The quick brown fox jumps over the lazy dog. " * 12


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def ids(tiny_tokenizer):
    return tiny_tokenizer(TEXT, add_special_tokens=False)["input_ids"]


def plain_nll(model, ids: list[int]) -> list[float]:
    """float64 ``-log_softmax(logits[p - 1])[ids[p]]`` of one plain forward, for p >= 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].double()
    lp = torch.log_softmax(logits[:-1], -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
    return [math.nan, *(-lp).tolist()]


def test_bits_per_byte_by_hand():
    # 3.5 nats over 6 bytes = 3.5 / ln 2 / 6 bits per byte
    assert bits_per_byte([1.0, 2.0, 0.5], [3, 1, 2]) == pytest.approx(3.5 / math.log(2) / 6, rel=1e-15)
    with pytest.raises(InvalidArgumentError):
        bits_per_byte([1.0], [0])


@settings(max_examples=50, deadline=None)
@given(st.lists(st.tuples(st.floats(0, 20), st.integers(1, 8)), min_size=1, max_size=30), st.integers(1, 5))
def test_bits_per_byte_is_additive_over_repeats(pairs, k):
    """Repeating the text ``k`` times leaves bits per byte unchanged (a ratio of sums)."""
    nll, nb = [p[0] for p in pairs], [p[1] for p in pairs]
    assert bits_per_byte(nll * k, nb * k) == pytest.approx(bits_per_byte(nll, nb), rel=1e-12, abs=1e-15)


def test_piece_bytes_sum_to_the_decoded_text(tiny_tokenizer, ids):
    """ASCII prose: every character lies in one token, so the pieces' bytes add up to the text's."""
    counts = piece_bytes(tiny_tokenizer, ids)
    assert sum(counts) == len(tiny_tokenizer.decode(ids).encode("utf-8")) == len(TEXT.encode())
    assert all(c >= 1 for c in counts)


def test_mode_none_equals_plain_forward(tiny_model_path, tiny_model, tiny_tokenizer, ids):
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=3, capacity=len(ids)
    )
    cells = make_cells(["streaming", "attention_matching+beta"], [48], {"protect_prompt": False})
    counts = piece_bytes(tiny_tokenizer, ids)
    results = score_cells(LocalBackend(engine), ids, cells, counts, chunk=10, score_after=20)
    none = results[0]
    ref = plain_nll(tiny_model, ids)
    assert none.name == "none" and none.n_scored == len(ids) - 20
    assert max(abs(a - b) for a, b in zip(none.nll[1:], ref[1:])) < 1e-5
    assert none.mean_nll == pytest.approx(math.fsum(ref[20:]) / (len(ids) - 20), abs=1e-6)
    by_hand = math.fsum(ref[20:]) / math.log(2) / sum(counts[20:])
    assert none.bits_per_byte == pytest.approx(by_hand, abs=1e-6)
    assert none.compression == 1.0 and none.events == 0
    for r in results[1:]:  # compacting cells attend to at most budget rows, and it shows in the scores
        assert r.events > 0 and r.mean_kv <= 48 and r.compression > 1.5
        assert max(abs(a - b) for a, b in zip(r.nll[21:], none.nll[21:])) > 1e-3
    assert engine.session_ids == []  # sessions closed


def test_make_cells():
    cells = make_cells(["h2o", "attention_matching+beta"], [64, 32], {"compact_target_ratio": 0.5})
    assert [c.name for c in cells] == [
        "none",
        "h2o@64",
        "h2o@32",
        "attention_matching+beta@64",
        "attention_matching+beta@32",
    ]
    assert (
        cells[3].config.compute_beta
        and cells[3].config.compact_window == 32
        and cells[3].config.compact_target_ratio == 0.5
    )
    assert [c.name for c in make_cells(["snapkv"], [16], reference=False)] == ["snapkv@16"]
    with pytest.raises(InvalidArgumentError, match="unknown mode"):
        make_cells(["nope"], [16])
    with pytest.raises(InvalidArgumentError, match="needs a KV budget"):
        make_cells(["h2o"], [None])
    with pytest.raises(InvalidArgumentError, match="n_protect_turns"):
        make_cells(["h2o"], [16], {"n_protect_turns": 1})
    with pytest.raises(InvalidArgumentError, match="compact_window"):
        make_cells(["h2o"], [16], {"compact_window": 16})


def test_texts(tmp_path):
    prose = pydoc_text()
    assert len(prose) > 100_000 and "assignment" in prose and load_text("pydoc") == prose
    f = tmp_path / "t.txt"
    f.write_text("hello world")
    assert load_text(str(f)) == "hello world"
    with pytest.raises(InvalidArgumentError, match="--text"):
        load_text(str(tmp_path / "missing.txt"))


def test_cli_writes_the_summary(tiny_model_path, tmp_path, capsys):
    out = tmp_path / "lm.json"
    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = [
        "eval-lm",
        "--model",
        str(tiny_model_path),
        "--text",
        str(text),
        "--max-tokens",
        "90",
        "--chunk",
        "16",
    ]
    argv += ["--modes", "random", "markovian", "--budgets", "40", "--no-progress", "--output", str(out)]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    assert data["n_tokens"] == 90 and data["score_after"] == 40
    assert [c["name"] for c in data["cells"]] == ["none", "random@40", "markovian@40"]
    none = data["cells"][0]
    for c in data["cells"]:
        assert c["n_scored"] == 50 and c["nll_gap"] == pytest.approx(c["mean_nll"] - none["mean_nll"])
    printed = capsys.readouterr().out
    assert "random@40" in printed and "Δ NLL" in printed


def test_cli_single_mode_line_and_bad_arguments(tiny_model_path, capsys):
    base = ["eval-lm", "--model", str(tiny_model_path), "--max-tokens", "40", "--no-progress"]
    assert (
        cli_main(base + ["--no-reference", "--mode", "streaming", "--max-kv-len", "24", "--chunk", "8"]) == 0
    )
    assert "streaming@24: mean NLL" in capsys.readouterr().out
    beta = [
        "--no-reference",
        "--mode",
        "attention_matching",
        "--compute-beta",
        "--max-kv-len",
        "24",
        "--chunk",
        "8",
    ]
    assert cli_main(base + beta) == 0
    assert "attention_matching+beta@24: mean NLL" in capsys.readouterr().out
    assert cli_main(base + ["--mode", "h2o"]) == 2
    assert "needs a KV budget" in capsys.readouterr().err
    assert cli_main(base + ["--score-after", "40"]) == 2
    assert "score_after" in capsys.readouterr().err


def test_cli_mixer_cells_rescore_each_cell_in_one_pass(tiny_model_path, tmp_path):
    """``--mixer`` adds a NAME+ngram cell per cell, gaps to the unmixed ``none``."""
    out, text = tmp_path / "lm.json", tmp_path / "t.txt"
    text.write_text(TEXT)
    argv = ["eval-lm", "--model", str(tiny_model_path), "--text", str(text), "--max-tokens", "90"]
    argv += ["--chunk", "16", "--modes", "h2o", "--budgets", "40", "--no-progress", "--per-token"]
    argv += ["--mixer", "--mixer-options", "max_order=3", "min_count=1", "--output", str(out)]
    assert cli_main(argv) == 0
    data = json.loads(out.read_text())
    cells = {c["name"]: c for c in data["cells"]}
    assert list(cells) == ["none", "h2o@40", "none+ngram", "h2o@40+ngram"]
    assert data["mixer"]["max_order"] == 3 and cells["none+ngram"]["mixer"]["min_count"] == 1
    assert cells["none"]["mixer"] is None and "nll_gap" in cells["h2o@40+ngram"]
    assert cli_main([*argv[:-2], "--mixer-options", "max_order=one"]) == 2


def test_mix_result_equals_mix_stream(tiny_model_path, ids):
    from compaction_gym.lmeval.mixer import BackoffNgramMixer, MixerConfig, mix_stream
    from compaction_gym.lmeval.scoring import mix_result

    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=1024
    )
    tok = engine.tokenizer
    cells = make_cells(["h2o"], [40], {})
    nb = piece_bytes(tok, ids)
    res = score_cells(LocalBackend(engine), ids, cells, nb, chunk=16)
    cfg = MixerConfig(max_order=3, min_count=1)
    vocab = engine.model.get_output_embeddings().weight.shape[0]
    for r in res:
        assert all(math.isfinite(h) and h >= 0 for h in r.entropy[1:])
        mixed = mix_result(r, ids, nb, cfg, vocab, 16)
        lp = [None] + [-x for x in r.nll[1:]]
        ref, _ = mix_stream(BackoffNgramMixer(cfg, vocab), ids, lp, [None, *r.entropy[1:]], 16)
        first = len(ids) - r.n_scored
        assert mixed.nll[first:] == pytest.approx(ref[first:], rel=1e-12)
        assert mixed.bits_per_byte == pytest.approx(bits_per_byte(ref[first:], nb[first:]), rel=1e-12)
        assert mixed.name == r.name + "+ngram" and mixed.n_scored == r.n_scored
        assert mixed.mean_nll < r.mean_nll  # the text repeats: the n-gram side helps
