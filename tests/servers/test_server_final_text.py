"""``final_text`` strips the BOS/EOS/pad markers from the engine's decoded text, without decoding again.

The reference is the former computation, made independently here: the tokenizer's own decode of
the response's ids with special tokens kept, then each marker string removed.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from compaction_gym.engine.config import SamplingParams
from compaction_gym.engine.types import StepResult
from compaction_gym.servers.args import ServerArgs
from compaction_gym.servers.state import ServerState


def _reference(tokenizer, eos_token_ids, ids: list[int]) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=False)
    markers = {getattr(tokenizer, a, None) for a in ("bos_token", "eos_token", "pad_token")}
    markers |= {tokenizer.convert_ids_to_tokens(t) for t in eos_token_ids}
    for m in markers:
        if isinstance(m, str) and m:
            text = text.replace(m, "")
    return text


def test_final_text_of_engine_results_equals_the_former_decode(reference_engine):
    state = ServerState(reference_engine, ServerArgs())
    tokenizer = reference_engine.tokenizer
    special = list(tokenizer.all_special_ids)
    eos = state.eos_token_ids

    @settings(max_examples=150, deadline=None)
    @given(ids=st.lists(st.integers(0, len(tokenizer) - 1) | st.sampled_from(special), max_size=24))
    def check(ids):
        text = tokenizer.decode(ids, skip_special_tokens=False) if ids else ""  # as the engine decodes
        result = StepResult("s", ids, [0.0] * len(ids), [1] * len(ids), text, "length")
        assert state.final_text(result) == _reference(tokenizer, eos, ids)

    check()
    # and on a real response (sampled at temperature 2, EOS allowed, so markers occur)
    sampling = SamplingParams(temperature=2.0, seed=5, max_new_tokens=40)
    result = reference_engine.create_session([3, 4, 5], None, sampling)
    reference_engine.close(result.session_id)
    assert state.final_text(result) == _reference(tokenizer, eos, result.token_ids)
    assert special and eos
