"""Gradients of compaction replay: they cross compaction boundaries, agree with finite differences,
and survive gradient checkpointing."""

from __future__ import annotations

import copy
import types

import pytest
import torch
from replay_helpers import plain_session, token_ids
from transformers import AutoModelForCausalLM

from compaction_gym.engine import CompactionConfig, Engine
from compaction_gym.trainers.replay import replay_logprobs
from compaction_gym.trainers.replay_attention import REPLAY_ATTENTION


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cpu", max_slots=2, capacity=512
    )


def _rms_norm_float64(self, x: torch.Tensor) -> torch.Tensor:
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.fixture(scope="module")
def model64(tiny_model_path):
    """The tiny model in float64 throughout: HF's RMSNorm computes in float32 even for float64 models,
    which would leave finite differences with float32 noise."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float64).eval()
    for module in model.modules():
        if type(module).__name__.endswith("RMSNorm"):
            module.forward = types.MethodType(_rms_norm_float64, module)
    return model


def last_turn_positions(view) -> list[int]:
    """The sampled tokens of the last response."""
    sampled = [p for p, m in enumerate(view.completion_mask) if m]
    return sampled[-15:]


class EmbeddingGrads:
    """Captures every replay forward's input embeddings, so ∂f/∂(embedding of position p) can be read.

    With one trajectory, replay feeds its tokens in logical order, so concatenating the forwards'
    embeddings along the sequence gives position ``p`` at index ``p``.
    """

    def __init__(self, model):
        self.outputs: list[torch.Tensor] = []
        self.handle = model.get_input_embeddings().register_forward_hook(self._hook)

    def _hook(self, module, args, output):
        output.retain_grad()
        self.outputs.append(output)

    def per_position(self) -> torch.Tensor:
        self.handle.remove()
        return torch.cat([o.grad[0] for o in self.outputs]).norm(dim=-1)


@pytest.mark.parametrize("beta", [False, True])
def test_gradient_reaches_tokens_compacted_away(engine, model64, beta):
    # turn-based k=0: after each response, the turn (minus the pending last token) becomes a block;
    # those tokens are never raw in the cache again, so their only path to later scores is C1/C2
    cfg = CompactionConfig(
        mode="attention_matching", n_protect_turns=0, compute_beta=beta, n_probe_queries=16
    )
    view = plain_session(engine, cfg, seed=3, turns=2)
    positions = last_turn_positions(view)
    applied = [e for e in view.events if e.logical_len < positions[-1]]
    assert len(applied) == 2 and applied[0].logical_span == (16, 35)
    compacted = sorted({p for e in applied for p in range(*e.logical_span)})
    raw = [p for p in range(positions[-1]) if p not in set(compacted)]  # prompt, pending tokens, last turn
    grads = {}
    for through in (True, False):
        hooks = EmbeddingGrads(model64)
        lp = replay_logprobs(model64, view, grad=True, grad_through_compaction=through, positions=positions)
        lp.sum().backward()
        model64.zero_grad()
        grads[through] = hooks.per_position()
    assert len(grads[True]) == positions[-1]  # every token before the last score was fed once
    assert (grads[True] > 0).all()  # including every token compacted away
    assert (grads[False][compacted] == 0).all()  # the original research code's detached blocks: no signal at all
    assert (grads[False][raw] > 0).all()


def directional(model, view, through: bool, positions, param_name: str, direction: torch.Tensor) -> float:
    model.zero_grad()
    lp = replay_logprobs(model, view, grad=True, grad_through_compaction=through, positions=positions)
    lp.sum().backward()
    return float((dict(model.named_parameters())[param_name].grad * direction).sum())


@torch.no_grad()
def finite_difference(
    model, view, positions, param_name: str, direction: torch.Tensor, eps: float = 1e-6
) -> float:
    param = dict(model.named_parameters())[param_name]
    values = []
    for sign in (1, -1):
        param.add_(sign * eps * direction)
        values.append(float(replay_logprobs(model, view, positions=positions).sum()))
        param.sub_(sign * eps * direction)
    return (values[0] - values[1]) / (2 * eps)


@pytest.mark.parametrize(
    "param_name", ["model.layers.0.self_attn.k_proj.weight", "model.layers.1.self_attn.v_proj.weight"]
)
def test_gradient_matches_finite_differences(engine, model64, param_name):
    """float64 replay of a KV-budget session with suffix probes (no β: the function is then smooth
    in the weights, kept indices fixed), scoring the tokens after the first event."""
    cfg = CompactionConfig(mode="attention_matching", max_kv_len=48, compact_window=24, n_probe_queries=8)
    view = plain_session(engine, cfg, seed=5, turns=2, prompt=8, inputs=6)
    assert len(view.events) >= 2
    positions = [p for p, m in enumerate(view.completion_mask) if m and p > view.events[0].logical_len]
    model = copy.deepcopy(model64)
    g = torch.Generator().manual_seed(0)
    direction = torch.randn(
        dict(model.named_parameters())[param_name].shape, generator=g, dtype=torch.float64
    )
    fd = finite_difference(model, view, positions, param_name, direction)
    exact = directional(model, view, True, positions, param_name, direction)
    detached = directional(model, view, False, positions, param_name, direction)
    assert abs(exact - fd) <= 1e-6 * max(1.0, abs(fd))
    assert abs(detached - fd) > 1e-2 * abs(fd)  # the path through C1/C2 carries real gradient


@pytest.mark.parametrize("method", ["segments", "one_pass"])
def test_gradient_checkpointing(engine, tiny_model_path, method):
    """Checkpointed layers are recomputed in backward: replay leaves the model on its attention
    (SDPA for plain forwards), and the gradients equal the non-checkpointed ones (one pass: the
    layers' value maps are recomputed too)."""
    cfg = CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=64, compact_window=32, n_probe_queries=16
    )
    view = plain_session(engine, cfg, seed=9, turns=2)
    grads = []
    for checkpointing in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
        if checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        model.train()
        replay_logprobs(model, view, grad=True, method=method).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None]))
    assert torch.allclose(grads[0], grads[1], rtol=1e-4, atol=1e-6)
    assert model.config._attn_implementation == REPLAY_ATTENTION
    ids = torch.tensor([token_ids(12, 0)])
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32).eval()
    model.eval()
    with torch.no_grad():
        assert torch.allclose(model(ids).logits, plain(ids).logits, atol=1e-5)
