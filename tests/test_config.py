"""CompactionConfig and SamplingParams validation."""

from __future__ import annotations

import warnings

import pytest

from compaction_gym.engine.config import CompactionConfig, SamplingParams
from compaction_gym.errors import InvalidArgumentError


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"mode": "zip"}, "mode"),
        ({"mode": "attention_matching", "queries": "future"}, "queries"),
        ({"mode": "attention_matching", "compact_target_ratio": 0.0}, "compact_target_ratio"),
        ({"mode": "attention_matching", "compact_target_ratio": 1.5}, "compact_target_ratio"),
        ({"mode": "attention_matching", "max_kv_len": 0}, "max_kv_len"),
        ({"mode": "attention_matching", "max_kv_len": 64, "compact_window": 64}, "compact_window"),
        ({"mode": "attention_matching", "n_compacts": -1}, "n_compacts"),
        ({"mode": "attention_matching", "n_protect_turns": -2}, "n_protect_turns"),
        ({"mode": "none", "max_kv_len": 64}, "mode='none'"),
        ({"mode": "markovian", "compute_beta": True}, "compute_beta"),
        ({"mode": "attention_matching", "inject_budget_message": True, "budget_message_template": "{oops}"}, "budget_message_template"),
        ({"budget_message_frame": ("only a prefix",)}, "budget_message_frame"),
        ({"budget_message_frame": "ab"}, "budget_message_frame"),
        ({"budget_message_frame": ("a", 2)}, "budget_message_frame"),
    ],
)
def test_compaction_config_rejects(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=field):
        CompactionConfig(**kwargs)


def test_kv_budget_defaults_window_to_half():
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=2048)
    assert cfg.kv_budget and not cfg.turn_based and cfg.compact_window == 1024


def test_window_with_turn_based_warns():
    with pytest.warns(UserWarning, match="compact_window is ignored"):
        cfg = CompactionConfig(mode="markovian", n_protect_turns=1, compact_window=32)
    assert cfg.turn_based and not cfg.kv_budget


def test_round_trip_dict():
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=128, compute_beta=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert CompactionConfig.from_dict(cfg.to_dict()) == cfg
    with pytest.raises(InvalidArgumentError, match="unknown CompactionConfig field"):
        CompactionConfig.from_dict({"modee": "none"})


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [({"temperature": -1}, "temperature"), ({"top_p": 0}, "top_p"), ({"top_k": -1}, "top_k"), ({"max_new_tokens": -3}, "max_new_tokens")],
)
def test_sampling_rejects(kwargs, field):
    with pytest.raises(InvalidArgumentError, match=field):
        SamplingParams(**kwargs)


def test_sampling_normalises_stop_ids():
    assert SamplingParams(stop_token_ids=[3, 4]).stop_token_ids == (3, 4)
    assert SamplingParams(temperature=0).greedy


def test_budget_message_frame_round_trips_as_a_tuple():
    cfg = CompactionConfig(budget_message_frame=["<u>", "</u><a>"])  # e.g. read back from JSON
    assert cfg.budget_message_frame == ("<u>", "</u><a>")
    assert CompactionConfig.from_dict(cfg.to_dict()) == cfg
