"""Language-modelling suites (``kind = "lm"``): bits per byte by hand, records that re-derive, the
shipped suite, lower-is-better statistics, and ``check`` against broken and look-ahead mixers."""

from __future__ import annotations

import hashlib
import json
import math
import sys
from pathlib import Path

import pytest

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.leaderboard.compliance import check_all, check_record
from compaction_gym.leaderboard.lm_record import lm_comparison, seed_result
from compaction_gym.leaderboard.lm_runner import run_lm_suite
from compaction_gym.leaderboard.lm_suite import load_lm_suite, suite_kind
from compaction_gym.leaderboard.report import show
from compaction_gym.lmeval import mixer as mixer_module

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "lmeval"))
from mixer_variants import LookAheadMixer, TargetKeyedMixer  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_torch_thread")

TEXT = "The quick brown fox jumps over the lazy dog. A lazy dog sleeps; the fox runs. " * 10


def test_bits_per_byte_by_hand():
    """nll 1.0, 2.0, 0.5 nats over 2 + 3 + 1 bytes from position 1: 3.5 / (ln 2 · 6) bits per byte."""
    line = {
        "seed": 0,
        "token_ids": [5, 6, 7, 8],
        "bytes": [4, 2, 3, 1],
        "nll": [None, 1.0, 2.0, 0.5],
        "kv_seen": [1, 2, 3, 2],
        "events": 1,
    }
    r = seed_result(line, score_after=0)
    assert r["bits_per_byte"] == pytest.approx(3.5 / (math.log(2) * 6), rel=1e-15)
    assert r["n_scored"] == 3 and r["n_bytes"] == 6 and r["bytes_per_token"] == 2.0
    assert r["compression"] == pytest.approx((2 + 3 + 4) / 3 / ((2 + 3 + 2) / 3))
    r2 = seed_result(line, score_after=2)  # positions 2, 3 only
    assert r2["bits_per_byte"] == pytest.approx(2.5 / (math.log(2) * 4), rel=1e-15)


def test_comparison_is_lower_is_better():
    base = [{"seed": 0, "token_ids": [1, 2, 3, 4], "bytes": [1, 1, 2, 1], "nll": [None, 1.0, 1.0, 1.0]}]
    better = [{**base[0], "nll": [None, 0.5, 0.9, 1.0]}]
    comp = lm_comparison(better, base, 1)
    scale = 3 / (math.log(2) * 4)
    assert comp["mean_diff"] == pytest.approx((-0.5 - 0.1) / 3 * scale)  # the bits-per-byte gap
    assert comp["wins"] == 2 and comp["losses"] == 0 and comp["ties"] == 1 and comp["direction"] == "lower"
    assert lm_comparison(better, [{**base[0], "token_ids": [9, 9, 9, 9]}], 1) is None


def test_shipped_suite_parses():
    suite = load_lm_suite("lm-kv-budget")
    assert suite_kind("lm-kv-budget") == "lm" and suite_kind("babyai-balrog") == "env"
    seeds = {c.key: c.seeds for c in suite.cells}
    assert seeds["none/full"] == [0] and seeds["random/kv512"] == [0, 1, 2]
    assert seeds["attention_matching_random/kv1024"] == [0, 1, 2] and seeds["h2o/kv512"] == [0]
    assert suite.cell("h2o+ngram", "kv512").mixer is not None and suite.cell("h2o", "kv512").mixer is None
    text = suite.cells[0].text_file
    assert (text.parent / "LICENSE-PSF.txt").is_file() and text.stat().st_size > 30_000


def write_suite(tmp_path: Path, model: Path, **extra: str) -> Path:
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    sha = hashlib.sha256(text.read_bytes()).hexdigest()
    body = f"""
kind = "lm"
name = "lm-tiny"
model = "{model}"
text = "text.txt"
text_sha256 = "{extra.get("sha", sha)}"
max_tokens = 120
chunk = 16
score_after = 40
seeds = [0, 1, 2]
budgets = [{{ max_kv_len = 40 }}]

[mixer]
max_order = 4
buckets = 4096
min_count = 2

[[methods]]
name = "none"
mode = "none"

[[methods]]
name = "h2o"
mode = "h2o"

[[methods]]
name = "h2o+ngram"
mode = "h2o"
mixer = true

[[methods]]
name = "random"
mode = "random"
"""
    path = tmp_path / "lm-tiny.toml"
    path.write_text(body)
    return path


@pytest.fixture(scope="module")
def lm_run(tmp_path_factory, tiny_model_path, tiny_model, tiny_tokenizer):
    tmp = tmp_path_factory.mktemp("lm")
    suite = load_lm_suite(write_suite(tmp, tiny_model_path))
    out = tmp / "records"
    paths = run_lm_suite(suite, output=out, model_and_tokenizer=(tiny_model, tiny_tokenizer))
    return suite, out, paths


def test_records_rederive_and_pass_check(lm_run, tiny_model):
    suite, out, paths = lm_run
    assert len(paths) == 4
    results = check_all(out)
    assert [r.failures for r in results] == [[]] * 4
    recs = {json.loads(p.read_text())["method"]: json.loads(p.read_text()) for p in paths}
    assert recs["random"]["seeds"] == [0, 1, 2] and recs["h2o"]["seeds"] == [0]
    for method, rec in recs.items():
        lines = [
            json.loads(x)
            for x in (out / "lm-tiny" / method / rec["budget"]["label"] / "scores.jsonl")
            .read_text()
            .splitlines()
        ]
        for d, s in zip(sorted(lines, key=lambda d: d["seed"]), rec["results"]["per_seed"]):
            nll = [d["nll"][p] for p in range(40, 120)]
            nb = [d["bytes"][p] for p in range(40, 120)]
            assert s["bits_per_byte"] == pytest.approx(math.fsum(nll) / (math.log(2) * sum(nb)), rel=1e-12)
        assert rec["results"]["direction"] == "lower"
    none_lines = json.loads((out / "lm-tiny/none/full/scores.jsonl").read_text().splitlines()[0])
    h2o_lines = json.loads((out / "lm-tiny/h2o/kv40/scores.jsonl").read_text().splitlines()[0])
    mixed = json.loads((out / "lm-tiny/h2o+ngram/kv40/scores.jsonl").read_text().splitlines()[0])
    assert mixed["logprobs"] == h2o_lines["logprobs"] and mixed["nll"] != h2o_lines["nll"]
    assert max(h2o_lines["kv_seen"]) <= 40 + 16 and max(none_lines["kv_seen"]) == 120
    assert recs["none"]["comparison_vs_none"] is None
    comp = recs["h2o+ngram"]["comparison_vs_none"]
    gap = recs["h2o+ngram"]["results"]["score"]["mean"] - recs["none"]["results"]["score"]["mean"]
    assert comp["mean_diff"] == pytest.approx(gap, rel=1e-9)
    # a re-run finds every record standing: nothing is rescored
    before = {p: p.read_text() for p in paths}
    run_lm_suite(suite, output=out, model_and_tokenizer=(tiny_model, None))
    assert {p: p.read_text() for p in paths} == before


def test_show_ranks_lowest_bits_per_byte_first(lm_run, tmp_path):
    _, out, _ = lm_run
    page, plots = show(out, tmp_path)
    table = [line for line in page.splitlines() if line.startswith("| 1 ") or line.startswith("| 2 ")]
    assert "bits/byte" in page and len(table) == 2
    ranked = [
        float(line.split("|")[4]) for line in page.splitlines() if line.startswith("| ") and line[2].isdigit()
    ]
    assert ranked == sorted(ranked) and plots[0].name == "lm-tiny_budget.png"


def test_check_flags_a_target_keyed_mixer(lm_run, monkeypatch):
    _, out, _ = lm_run
    monkeypatch.setitem(mixer_module.MIXERS, "backoff", TargetKeyedMixer)
    res = check_record(out / "lm-tiny/h2o+ngram/kv40")
    assert any("normalisation" in f and "sum to" in f for f in res.failures)
    assert any("single pass" in f for f in res.failures)
    assert check_record(out / "lm-tiny/h2o/kv40").ok  # no mixer: nothing to flag


def test_check_flags_a_look_ahead_mixer(lm_run, monkeypatch):
    _, out, _ = lm_run
    monkeypatch.setitem(
        mixer_module.MIXERS, "backoff", lambda cfg, vocab: LookAheadMixer(cfg, vocab, peek=16)
    )
    res = check_record(out / "lm-tiny/h2o+ngram/kv40")
    assert any("looked ahead" in f for f in res.failures)


def test_check_flags_edited_scores(lm_run, tmp_path):
    import shutil

    _, out, _ = lm_run
    copy = tmp_path / "records"
    shutil.copytree(out, copy)
    path = copy / "lm-tiny/h2o/kv40/scores.jsonl"
    d = json.loads(path.read_text())
    d["nll"][50] = d["nll"][50] / 2  # a better score than the model gave
    path.write_text(json.dumps(d) + "\n")
    res = check_record(copy / "lm-tiny/h2o/kv40")
    assert any("differs from the one" in f for f in res.failures)
    assert any("not the model's -log p" in f for f in res.failures)
    d = json.loads((out / "lm-tiny/h2o/kv40/scores.jsonl").read_text())
    d["token_ids"][60] += 1  # another text
    path.write_text(json.dumps(d) + "\n")
    assert any("not the suite's text" in f for f in check_record(copy / "lm-tiny/h2o/kv40").failures)


def test_suite_errors_name_the_key(tmp_path, tiny_model_path):
    with pytest.raises(InvalidArgumentError, match="text_sha256"):
        load_lm_suite(write_suite(tmp_path, tiny_model_path, sha="0" * 64))
    path = write_suite(tmp_path, tiny_model_path)
    path.write_text(path.read_text().replace("min_count = 2", "min_count = 2\nbogus = 1"))
    with pytest.raises(InvalidArgumentError, match="bogus"):
        load_lm_suite(path)


def test_cli_runs_checks_and_shows_an_lm_suite(tmp_path, tiny_model_path, capsys):
    from compaction_gym.cli import main as cli_main

    suite = write_suite(tmp_path, tiny_model_path)
    out = tmp_path / "records"
    run = ["leaderboard", "run", str(suite), "--output", str(out), "--device", "cpu"]
    assert cli_main([*run, "--limit-episodes", "2"]) == 2
    assert "no episodes" in capsys.readouterr().err
    assert cli_main([*run, "--methods", "none", "h2o+ngram"]) == 0
    assert "h2o+ngram/kv40/submission.json" in capsys.readouterr().out
    assert cli_main(["leaderboard", "check", "--records", str(out)]) == 0
    assert "2 records, 0 failing" in capsys.readouterr().out
    assert cli_main(["leaderboard", "show", "--records", str(out)]) == 0
    assert "bits/byte" in capsys.readouterr().out
