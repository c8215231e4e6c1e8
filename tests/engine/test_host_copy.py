"""``host_copy``: host tensors and numpy arrays reach the device as the same values and shapes
(``upload``); indices and β come back bit for bit (``HostCopy``)."""

from __future__ import annotations

import dataclasses
import io
import pickle

import numpy as np
import pytest
import torch

from compaction_gym.engine.host_copy import HostCopy, upload


def _inputs() -> list:
    rng = np.random.default_rng(0)
    grid = rng.integers(-5, 1 << 40, (4, 6))
    return [
        torch.arange(7),
        grid,
        grid[:, ::2],  # a strided view
        np.arange(3)[:, None, None],  # a broadcast shape
        torch.zeros(0, dtype=torch.int64),
    ]


def _check(got: list[torch.Tensor], want: list, device: str) -> None:
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = torch.as_tensor(np.asarray(w))
        assert g.device.type == device and g.dtype == torch.int64 and g.shape == w.shape
        assert torch.equal(g.cpu(), w)


def test_upload_takes_numpy_arrays_and_tensors_on_cpu():
    inputs = _inputs()
    got = upload(inputs, torch.device("cpu"))
    _check(got, inputs, "cpu")
    assert got[0] is inputs[0]  # a CPU tensor is passed through
    assert upload([], torch.device("cpu")) == []


@pytest.mark.gpu
def test_upload_takes_numpy_arrays_and_tensors_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    inputs = _inputs()
    got = upload(inputs, torch.device("cuda"))
    torch.cuda.synchronize()
    _check(got, inputs, "cuda")
    arrays = [np.asarray(x) for x in inputs]  # arrays only: written into the pinned buffer by numpy
    got = upload(arrays, torch.device("cuda"))
    torch.cuda.synchronize()
    _check(got, arrays, "cuda")
    flags = [np.array([[True, False]]), np.zeros(3, bool)]
    got = upload(flags, torch.device("cuda"))
    assert [g.dtype for g in got] == [torch.bool] * 2
    assert [g.cpu().numpy().tolist() for g in got] == [f.tolist() for f in flags]


def _indices_and_beta(device: str) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    indices = torch.randint(0, 1 << 40, (3, 4, 5), generator=g)
    beta = torch.randn(3, 4, 5, generator=g) * 30
    beta[0, 0, :4] = torch.tensor([0.0, -0.0, float("inf"), float("nan")])
    return indices.to(device), beta.to(device)


def _check_copy(device: str) -> None:
    indices, beta = _indices_and_beta(device)
    got_i, got_b = HostCopy(indices, beta).wait()
    assert got_i.device.type == got_b.device.type == "cpu"
    assert got_i.dtype == torch.int64 and got_b.dtype == torch.float32
    assert got_i.shape == got_b.shape == indices.shape
    assert torch.equal(got_i, indices.cpu())
    assert torch.equal(got_b.view(torch.int32), beta.cpu().view(torch.int32))  # bits: signed zero, NaN
    alone, none = HostCopy(indices[:, 1:], None).wait()  # a strided view, no β
    assert none is None and torch.equal(alone, indices[:, 1:].cpu())
    empty, empty_b = HostCopy(indices[..., :0], beta[..., :0]).wait()
    assert empty.shape == empty_b.shape == (3, 4, 0)
    # records hold these: they must save and pickle like any tensor (not one buffer under two dtypes)
    buf = io.BytesIO()
    torch.save({"indices": got_i, "beta": got_b}, buf)
    buf.seek(0)
    back = torch.load(buf)
    assert torch.equal(back["indices"], indices.cpu())
    assert torch.equal(back["beta"].view(torch.int32), beta.cpu().view(torch.int32))
    again = pickle.loads(pickle.dumps((got_i, got_b)))
    assert torch.equal(again[0], got_i) and torch.equal(again[1].view(torch.int32), got_b.view(torch.int32))
    # nor views of the input: the caller may reuse its device or host tensors
    src, want = indices.clone(), indices.cpu().clone()
    mine, _ = HostCopy(src, None).wait()
    src.zero_()
    assert torch.equal(mine, want)


def test_host_copy_is_bit_exact_on_cpu():
    _check_copy("cpu")


@pytest.mark.gpu
def test_host_copy_is_bit_exact_on_cuda_and_leaves_pageable_memory():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _check_copy("cuda")
    indices, beta = _indices_and_beta("cuda")
    got_i, got_b = HostCopy(indices, beta.bfloat16()).wait()  # β cast to float32 on the way
    assert not got_i.is_pinned() and not got_b.is_pinned()  # records live long; pinned memory goes back
    assert torch.equal(got_b.view(torch.int32), beta.bfloat16().float().cpu().view(torch.int32))


def test_a_session_with_beta_events_saves_and_loads(engine):
    """The records the compactor fills from a ``HostCopy`` go through ``torch.save`` whole (a session's
    events with β, several of them, as ``bench_replay.py --save-views`` saves them)."""
    from engine_helpers import make_prompt

    from compaction_gym.engine import CompactionConfig, SamplingParams

    config = CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=48, compact_window=24, n_probe_queries=8
    )
    sampling = SamplingParams(max_new_tokens=60, ignore_eos=True)
    sid = engine.create_session(make_prompt(40, seed=1), config, sampling).session_id
    view = engine.session(sid)
    assert len(view.events) >= 2 and all(e.beta is not None for e in view.events)
    buf = io.BytesIO()
    torch.save({"events": view.events}, buf)
    buf.seek(0)
    back = torch.load(buf, weights_only=False)["events"]
    for a, b in zip(view.events, back):
        assert torch.equal(a.indices, b.indices)
        assert torch.equal(a.beta.view(torch.int32), b.beta.view(torch.int32))


def _events(engine, prompts: int) -> list:
    """One session's events with β (several), ``prompts`` sessions compacting in the same rounds."""
    from engine_helpers import make_prompt

    from compaction_gym.engine import CompactionConfig, CreateRequest, SamplingParams

    config = CompactionConfig(
        mode="attention_matching", compute_beta=True, max_kv_len=48, compact_window=24, n_probe_queries=8
    )
    sampling = SamplingParams(max_new_tokens=60, ignore_eos=True)
    results = engine.step_batch([CreateRequest(make_prompt(16, seed=s), config, sampling) for s in range(prompts)])
    events = engine.session(results[0].session_id).events
    assert len(events) >= 2 and all(e.beta is not None for e in events)
    return events


def _check_own_bytes(events: list) -> None:
    """Pickled and saved, ``events`` take about their own indices' and β's bytes, and come back equal,
    each tensor with a storage of its own; the records themselves are left as they were."""
    storages = [(e.indices.untyped_storage().nbytes(), e.beta.untyped_storage().nbytes()) for e in events]
    own = sum(e.indices.nbytes + e.beta.nbytes for e in events)
    for data in (pickle.dumps(events), _torch_bytes(events)):
        assert len(data) < own + 4096 * len(events)  # the records' other fields and framing
    for back in (pickle.loads(pickle.dumps(events)), torch.load(io.BytesIO(_torch_bytes(events)), weights_only=False)):
        for a, b in zip(events, back):
            assert torch.equal(a.indices, b.indices)
            assert torch.equal(a.beta.view(torch.int32), b.beta.view(torch.int32))
            assert b.indices.untyped_storage().nbytes() == b.indices.nbytes
            assert (a.span, a.kv_len_before, a.timings) == (b.span, b.kv_len_before, b.timings)
    assert storages == [(e.indices.untyped_storage().nbytes(), e.beta.untyped_storage().nbytes()) for e in events]


def test_an_event_saves_its_own_bytes_only(engine):
    """Events compacted in one stacked call hold views of that call's ``[E, ...]`` tensors (on a GPU,
    docs/engine.md "The copy back lands in place"); pickling or saving one session's events writes
    that session's indices and β only, not the whole call's. Here the views are made by hand."""
    events = [
        dataclasses.replace(e, indices=e.indices.expand(8, *e.indices.shape).clone()[5],
                            beta=e.beta.expand(8, *e.beta.shape).clone()[2])  # fmt: skip
        for e in _events(engine, 1)
    ]
    assert all(e.indices.untyped_storage().nbytes() == 8 * e.indices.nbytes for e in events)
    _check_own_bytes(events)


@pytest.mark.gpu
def test_a_stacked_calls_events_save_their_own_bytes_on_cuda(tiny_model_path):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from compaction_gym.engine import Engine

    engine = Engine.from_pretrained(
        tiny_model_path, dtype=torch.float32, device="cuda", max_slots=4, capacity=512, fast=True
    )
    events = _events(engine, 4)
    assert any(e.indices.untyped_storage().nbytes() > e.indices.nbytes for e in events), "not stacked"
    _check_own_bytes(events)


def _torch_bytes(x: object) -> bytes:
    buf = io.BytesIO()
    torch.save(x, buf)
    return buf.getvalue()
