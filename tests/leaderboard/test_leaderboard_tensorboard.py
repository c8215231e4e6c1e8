"""`leaderboard run` logs every cell to TensorBoard; the values re-derive from the cell's files."""

from __future__ import annotations

import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from compaction_gym.leaderboard.record import RECORD_FILE, TRAJECTORIES_FILE


def _acc(log_dir) -> EventAccumulator:
    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0, "histograms": 0})
    acc.Reload()
    return acc


def test_every_cell_logs_its_episodes_events_and_score(tiny_records):
    cells = sorted(p.parent for p in tiny_records.rglob(RECORD_FILE) if "tensorboard" not in p.parts)
    assert len(cells) == 2
    with_events = 0
    for cell in cells:
        rel = cell.relative_to(tiny_records)
        acc = _acc(tiny_records / "tensorboard" / rel)
        lines = [json.loads(x) for x in (cell / TRAJECTORIES_FILE).read_text().splitlines()]
        record = json.loads((cell / RECORD_FILE).read_text())
        tokens = [(e.step, e.value) for e in acc.Scalars("episode/tokens")]
        assert tokens == [(i, float(len(d["token_ids"]))) for i, d in enumerate(lines)]
        peaks = [e.value for e in acc.Scalars("episode/peak_kv_len")]
        assert peaks == [max([d["prompt_len"], *(t["peak_kv_len"] for t in d["turns"])]) for d in lines]
        events = [e for d in lines for e in d["events"]]
        assert ("compaction/span_ratio" in acc.Tags()["scalars"]) == bool(events)
        if events:
            with_events += 1
            ratios = [e.value for e in acc.Scalars("compaction/span_ratio")]
            assert ratios == pytest.approx([e["target"] / (e["span"][1] - e["span"][0]) for e in events], rel=1e-6)
            hist = acc.Histograms("compaction/span_ratio")[0].histogram_value
            assert hist.num == len(events)
        score = acc.Scalars("summary/score")
        assert [(s.step, s.value) for s in score] == [(0, pytest.approx(record["results"]["score"]["mean"]))]
    assert with_events == 1  # the attention_matching cell compacts, the baseline does not
