"""Bad input raises InvalidArgumentError (a ValueError) whose message starts with the argument's name."""

from __future__ import annotations

import pytest
import torch

from compaction_gym.compaction import compact, fit_beta, fit_values, gqa_probes, random_probes, select_keys
from compaction_gym.errors import InvalidArgumentError

B, T, D, N = 2, 24, 8, 6
K, V, Q = torch.randn(B, T, D), torch.randn(B, T, D), torch.randn(B, N, D)
IDX = torch.tensor([[5, 7, 9], [4, 6, 11]])

COMPACT_CASES = [
    ("span", dict(span=(10, 30))),
    ("span", dict(span=(10, 10))),
    ("span", dict(span=(-1, 5))),
    ("span", dict(span=5)),
    ("span", dict(span=(1.5, 9))),
    ("target", dict(target=0)),
    ("target", dict(target=13)),
    ("target", dict(target=2.5)),
    ("target", dict(target=True)),
    ("keys", dict(keys=K[0])),
    ("keys", dict(keys=K.long())),
    ("keys", dict(keys=K[:, :0])),
    ("values", dict(values=V[:, :20])),
    ("values", dict(values=V.double())),
    ("queries", dict(queries=Q[:, :, :4])),
    ("queries", dict(queries=Q[:1])),
    ("queries", dict(queries=Q.double())),
    ("queries", dict(queries=None)),
    ("queries", dict(queries=Q[:, :0])),
    ("queries", dict(queries=torch.empty(B, N, D, device="meta"))),
    ("mode", dict(mode="snap")),
    ("mode", dict(mode="none")),
    ("compute_beta", dict(mode="h2o", compute_beta=True)),
    ("forced_indices", dict(forced_indices=IDX[:, :2])),
    ("forced_indices", dict(forced_indices=IDX[:1])),
    ("forced_indices", dict(forced_indices=IDX + 10)),
    ("forced_indices", dict(forced_indices=IDX.flip(-1))),
    ("forced_indices", dict(forced_indices=IDX.float())),
    ("forced_indices", dict(forced_indices=IDX.tolist())),
    ("forced_indices", dict(mode="markovian", forced_indices=IDX)),
    ("key_bias", dict(key_bias=torch.zeros(B, T + 1))),
    ("key_bias", dict(key_bias=torch.zeros(B, T, dtype=torch.long))),
    ("scale", dict(scale=-1.0)),
    ("scale", dict(scale=float("nan"))),
    ("ridge", dict(ridge=-1e-3)),
    ("ridge", dict(ridge="big")),
    ("seed", dict(mode="random", seed="abc")),
    ("query_positions", dict(mode="h2o", query_positions=torch.arange(N - 1))),
    ("query_positions", dict(mode="snapkv", query_positions=torch.zeros(N))),
    ("query_positions", dict(mode="tova", query_positions=-torch.ones(N, dtype=torch.long))),
    ("query_positions", dict(mode="knorm", queries=None, query_positions=torch.arange(N))),
    ("n_kv_heads", dict(mode="tova", n_kv_heads=3)),
    ("n_kv_heads", dict(mode="tova", n_kv_heads=0)),
    ("queries", dict(mode="tova", queries=None)),
]


@pytest.mark.parametrize(
    ("name", "override"), COMPACT_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(COMPACT_CASES)]
)
def test_compact_rejects(name, override):
    args = dict(keys=K, values=V, queries=Q, span=(4, 16), target=3)
    args.update(override)
    with pytest.raises(InvalidArgumentError, match=rf"^{name}\b") as info:
        compact(**args)
    assert isinstance(info.value, ValueError)


OTHER_CASES = [
    ("span", lambda: select_keys(K, Q, (20, 25), 2)),
    ("target", lambda: select_keys(K, Q, (4, 8), 5)),
    ("queries", lambda: select_keys(K, Q[:, :, :3], (4, 8), 2)),
    ("key_bias", lambda: select_keys(K, Q, (4, 8), 2, key_bias=torch.zeros(B, T, device="meta"))),
    ("indices", lambda: fit_beta(K, Q, (4, 16), IDX[:, :0])),
    ("indices", lambda: fit_beta(K, Q, (4, 10), IDX)),
    ("indices", lambda: fit_beta(K, Q, (4, 16), IDX.unsqueeze(0))),
    ("scale", lambda: fit_beta(K, Q, (4, 16), IDX, scale=0)),
    ("beta", lambda: fit_values(K, V, Q, (4, 16), IDX, beta=torch.zeros(B, 4))),
    ("beta", lambda: fit_values(K, V, Q, (4, 16), IDX, beta=torch.zeros(B, 3, dtype=torch.long))),
    ("ridge", lambda: fit_values(K, V, Q, (4, 16), IDX, ridge=float("inf"))),
    ("values", lambda: fit_values(K, V.half(), Q, (4, 16), IDX)),
    ("bounds", lambda: fit_beta(K, Q, (4, 16), IDX, bounds=(0.5, 2.0))),
    ("bounds", lambda: fit_beta(K, Q, (4, 16), IDX, bounds=(-1.0,))),
    ("ridge", lambda: fit_beta(K, Q, (4, 16), IDX, ridge=-1.0)),
    ("min_probes_per_key", lambda: fit_beta(K, Q, (4, 16), IDX, min_probes_per_key=float("nan"))),
    ("queries", lambda: gqa_probes(torch.randn(2, 4, 8), 2)),
    ("n_kv_heads", lambda: gqa_probes(torch.randn(2, 6, 3, 8), 4)),
    ("n_kv_heads", lambda: gqa_probes(torch.randn(2, 6, 3, 8), 0)),
    ("seed", lambda: random_probes(-1, 0, 2, 2, 4, 8)),
    ("event_index", lambda: random_probes(0, -1, 2, 2, 4, 8)),
    ("n", lambda: random_probes(0, 0, 2, 2, 0, 8)),
    ("n_layers", lambda: random_probes(0, 0, 1.5, 2, 4, 8)),
    ("dtype", lambda: random_probes(0, 0, 2, 2, 4, 8, dtype=torch.int64)),
]


@pytest.mark.parametrize(
    ("name", "call"), OTHER_CASES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(OTHER_CASES)]
)
def test_other_functions_reject(name, call):
    with pytest.raises(InvalidArgumentError, match=rf"^{name}\b"):
        call()


def test_nnls_rejects_mismatched_system():
    from compaction_gym.compaction import nnls

    with pytest.raises(InvalidArgumentError, match=r"^gram\b"):
        nnls(torch.eye(3)[None], torch.ones(1, 4))
    with pytest.raises(InvalidArgumentError, match=r"^rhs\b"):
        nnls(torch.eye(3)[None], torch.ones(1, 3, dtype=torch.float64))
    with pytest.raises(InvalidArgumentError, match=r"^max_iter\b"):
        nnls(torch.eye(3)[None], torch.ones(1, 3), max_iter=-1)
    with pytest.raises(InvalidArgumentError, match=r"^lower\b"):
        nnls(torch.eye(3)[None], torch.ones(1, 3), lower=-1.0)
    with pytest.raises(InvalidArgumentError, match=r"^upper\b"):
        nnls(torch.eye(3)[None], torch.ones(1, 3), lower=1.0, upper=0.5)
