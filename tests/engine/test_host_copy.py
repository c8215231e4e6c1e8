"""``host_copy.upload``: host tensors and numpy arrays reach the device as the same values and shapes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from compaction_gym.engine.host_copy import upload


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


@pytest.mark.gpu
def test_upload_takes_numpy_arrays_and_tensors_on_cuda():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    inputs = _inputs()
    got = upload(inputs, torch.device("cuda"))
    torch.cuda.synchronize()
    _check(got, inputs, "cuda")
