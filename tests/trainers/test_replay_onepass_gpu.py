"""One-pass replay on a GPU in bf16 (the path ``method="auto"`` takes there) against the segments."""

from __future__ import annotations

import pytest
import torch
from replay_helpers import MODES, TRIGGERS, max_sampled_diff, plain_session

from compaction_gym.engine import CompactionConfig
from compaction_gym.trainers.replay import replay_logprobs_batch


def config(mode: str, trigger: str) -> CompactionConfig:
    return CompactionConfig(**MODES[mode], **TRIGGERS[trigger], n_probe_queries=16)


@pytest.mark.gpu
def test_one_pass_equals_segments_on_the_gpu_in_bf16(tiny_model_path):
    """Both methods within bf16 noise of each other, and of the rollout, with and without gradients."""
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine import Engine

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.bfloat16, device="cuda", max_slots=3, capacity=1024
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda().eval()
    views = [plain_session(engine, config(m, "kv_budget"), seed=s, turns=4)
             for s, m in enumerate(("attention_matching+beta", "attention_matching", "markovian"))]  # fmt: skip
    for grad in (False, True):
        a = replay_logprobs_batch(model, views, method="auto", grad=grad)
        b = replay_logprobs_batch(model, views, method="segments", grad=grad)
        for x, y, v in zip(a.logprobs, b.logprobs, views):
            mask = torch.tensor(v.completion_mask, dtype=torch.bool)
            assert (x.detach().cpu() - y.detach().cpu())[mask].abs().max().item() < 0.1
            assert max_sampled_diff(x, v) < 0.5


@pytest.mark.gpu
def test_one_pass_equals_segments_on_the_gpu_in_float32(tiny_model_path):
    """In float32 on the GPU (cuBLAS/cuDNN kernels, TF32 only where products are exact) one pass
    stays near the CPU tolerance of the segments."""
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine import Engine

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cuda", max_slots=2, capacity=1024
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    views = [plain_session(engine, config(m, "kv_budget"), seed=s, turns=4)
             for s, m in enumerate(("attention_matching+beta", "attention_matching"))]  # fmt: skip
    a = replay_logprobs_batch(model, views, method="one_pass")
    b = replay_logprobs_batch(model, views, method="segments")
    for x, y in zip(a.logprobs, b.logprobs):
        assert (x - y).abs().max().item() < 1e-4


def _grads(model, views, **kwargs) -> dict[str, torch.Tensor]:
    model.zero_grad(set_to_none=True)
    out = replay_logprobs_batch(model, views, grad=True, **kwargs)
    torch.stack([lp.sum() for lp in out.logprobs]).sum().backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return grads


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_one_pass_gradients_on_the_gpu(tiny_model_path, monkeypatch, dtype):
    """Parameter gradients through the compaction: in float32 one pass equals the segments; in bf16
    the TF32 products of the value maps' and C2's backward move no gradient by more than two bf16
    ulps of the largest one (the bf16 gradients' own resolution)."""
    from transformers import AutoModelForCausalLM

    import compaction_gym.trainers.replay_onepass as onepass
    from compaction_gym.engine import Engine

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = Engine.from_pretrained(tiny_model_path, dtype=dtype, device="cuda", max_slots=2, capacity=1024)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=dtype).cuda().eval()
    views = [plain_session(engine, config(m, "kv_budget"), seed=s + 7, turns=4)
             for s, m in enumerate(("attention_matching+beta", "attention_matching"))]  # fmt: skip
    one_pass = _grads(model, views, method="one_pass")
    if dtype == torch.float32:
        other = _grads(model, views, method="segments")
    else:
        monkeypatch.setattr(onepass, "TF32_BACKWARD", False)
        other = _grads(model, views, method="one_pass")
    assert one_pass.keys() == other.keys() and one_pass
    for name in one_pass:
        scale = other[name].abs().max().clamp_min(1e-12)
        if dtype == torch.float32:
            bound = 1e-3 * scale
        else:  # two ulps of the largest gradient: 2 · 2^(⌊log2 scale⌋ − 7)
            bound = 2 * torch.finfo(torch.bfloat16).eps * 2 ** torch.floor(torch.log2(scale))
        assert (one_pass[name] - other[name]).abs().max().item() <= bound.item(), name


@pytest.mark.gpu
def test_kept_plans_on_the_gpu(tiny_model_path):
    """A ``ReplayPlanCache`` on the GPU (the device plan sent in pinned asynchronous copies, then kept):
    later passes in another order and chunking, with and without gradients, give the fresh plan's
    log-probs (float32)."""
    from transformers import AutoModelForCausalLM

    from compaction_gym.engine import Engine
    from compaction_gym.trainers.replay_cache import ReplayPlanCache

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cuda", max_slots=3, capacity=1024
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).cuda().eval()
    views = [plain_session(engine, config(m, t), seed=s, turns=4)
             for s, (m, t) in enumerate((("attention_matching+beta", "kv_budget"), ("attention_matching", "turn"),
                                         ("h2o", "kv_budget")))]  # fmt: skip
    cache = ReplayPlanCache()
    for batch, grad in ((views, False), (views[::-1], True), (views[1:], True), (views[:1], False)):
        kept = replay_logprobs_batch(model, batch, method="one_pass", grad=grad, plan_cache=cache)
        fresh = replay_logprobs_batch(model, batch, method="one_pass", grad=grad)
        for x, y in zip(kept.logprobs, fresh.logprobs):
            assert (x.detach() - y.detach()).abs().max().item() < 1e-5
    assert cache.stats.device_plans_reused == 1 and cache.stats.simulations_built == len(views)


@pytest.mark.gpu
def test_flex_beta_equals_folded_beta_on_the_gpu(tiny_model_path, monkeypatch):
    """bf16 with β, several events per episode, two sessions batched: FlexAttention's buckets (β added
    to the float32 scores) and the folded head-dim columns give the same log-probabilities and
    gradients to bf16 rounding, and FlexAttention's are at least as close to float64."""
    from transformers import AutoModelForCausalLM

    import compaction_gym.trainers.replay_onepass as onepass
    from compaction_gym.engine import Engine

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.bfloat16, device="cuda", max_slots=2, capacity=1024
    )
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.bfloat16).cuda().eval()
    views = [plain_session(engine, config("attention_matching+beta", "kv_budget"), seed=s, turns=5)
             for s in (3, 4)]  # fmt: skip
    assert all(len(v.events) >= 2 for v in views)
    calls = []
    real = onepass.key_bias_attention
    monkeypatch.setattr(onepass, "key_bias_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    flex = replay_logprobs_batch(model, views, method="one_pass", temperature=1.5)
    flex_grads = _grads(model, views, method="one_pass", temperature=1.5)
    assert calls
    with torch.autocast("cuda", dtype=torch.bfloat16):  # as a trainer's mixed precision runs it
        under_autocast = replay_logprobs_batch(model, views, method="one_pass", temperature=1.5)
    for a, b in zip(flex.logprobs, under_autocast.logprobs):
        assert (a.float() - b.float()).abs().max().item() < 0.1
    monkeypatch.setattr(onepass, "FLEX_BIAS", False)
    calls.clear()
    folded = replay_logprobs_batch(model, views, method="one_pass", temperature=1.5)
    folded_grads = _grads(model, views, method="one_pass", temperature=1.5)
    assert not calls
    model64 = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64).cuda().eval()
    exact = replay_logprobs_batch(model64, views, method="one_pass", temperature=1.5)
    for a, b, e, v in zip(flex.logprobs, folded.logprobs, exact.logprobs, views):
        mask = torch.tensor(v.completion_mask, dtype=torch.bool, device=a.device)
        err_flex = (a.double() - e)[mask].abs().max().item()
        err_fold = (b.double() - e)[mask].abs().max().item()
        assert (a - b)[mask].abs().max().item() < 0.1
        assert err_flex <= 1.5 * err_fold + 1e-3, (err_flex, err_fold)
    for name in flex_grads:
        scale = folded_grads[name].abs().max().clamp_min(1e-12)
        assert ((flex_grads[name] - folded_grads[name]).abs().max() / scale).item() < 5e-2, name
