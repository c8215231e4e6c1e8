"""Top-K GJS loss against an independent float64 numpy reference, plus its properties and errors."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest
import torch

from compaction_gym.errors import InvalidArgumentError
from compaction_gym.trainers.gjs import (
    DIVERGENCE_MODES,
    GJSLossConfig,
    divergence_mode,
    topk_gjs,
    topk_gjs_from_lists,
    topk_gjs_from_teacher_topk,
)

ALPHAS = (0.0, 0.1, 0.5, 0.9, 1.0)


SUPPORTS = ("teacher", "student", "union")


# ------------------------------------------------------------------------------------------------
# Independent reference: one position at a time, python sets and dicts, float64 numpy.
# ------------------------------------------------------------------------------------------------


def _ref_position(t_known, s_known, *, k, alpha, support, tail, normalize):
    """GJS between two sides given as {token: logprob} for the tokens each side knows."""

    def top(known):
        return {tok for tok, _ in sorted(known.items(), key=lambda kv: -kv[1])[:k]}

    sup = sorted(
        {"teacher": top(t_known), "student": top(s_known), "union": top(t_known) | top(s_known)}[support]
    )
    p = np.array([math.exp(t_known[v]) if v in t_known else 0.0 for v in sup], dtype=np.float64)
    q = np.array([math.exp(s_known[v]) if v in s_known else 0.0 for v in sup], dtype=np.float64)
    if tail:  # floored at machine epsilon, as documented: below it 1 - sum is rounding noise
        eps = np.finfo(np.float64).eps
        p = np.append(p, max(1.0 - p.sum(), eps))
        q = np.append(q, max(1.0 - q.sum(), eps))
    else:  # renormalise; a side with no mass on the support sits entirely in an extra bucket
        p = np.append(p / p.sum(), 0.0) if p.sum() > 0 else np.append(np.zeros_like(p), 1.0)
        q = np.append(q / q.sum(), 0.0) if q.sum() > 0 else np.append(np.zeros_like(q), 1.0)

    def kl(a, b):
        total = 0.0
        for x, y in zip(a, b):
            if x > 0:
                total += math.inf if y == 0 else x * math.log(x / y)
        return total

    if alpha == 0.0:
        return kl(p, q)
    if alpha == 1.0:
        return kl(q, p)
    m = alpha * p + (1 - alpha) * q
    value = alpha * kl(p, m) + (1 - alpha) * kl(q, m)
    return value / (alpha * (1 - alpha)) if normalize else value


def _ref_full(student, teacher, **kw):
    s = student.detach().double().reshape(-1, student.shape[-1]).numpy()
    t = teacher.detach().double().reshape(-1, teacher.shape[-1]).numpy()
    out = [_ref_position(dict(enumerate(tr)), dict(enumerate(sr)), **kw) for sr, tr in zip(s, t)]
    return np.array(out).reshape(student.shape[:-1])


def _ref_lists(s_ids, s_lp, t_ids, t_lp, **kw):
    out = []
    for si, sl, ti, tl in zip(s_ids, s_lp, t_ids, t_lp):
        s_known = {int(a): float(b) for a, b in zip(si, sl) if a >= 0}
        t_known = {int(a): float(b) for a, b in zip(ti, tl) if a >= 0}
        out.append(_ref_position(t_known, s_known, **kw))
    return np.array(out)


def _dists(*shape, seed=0, scale=2.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(*shape, generator=g, dtype=torch.float64)).log_softmax(-1).to(dtype)


# ------------------------------------------------------------------------------------------------
# Against the reference
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("normalize", [False, True])
@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("support", SUPPORTS)
def test_tensor_form_matches_reference(support, tail, normalize):
    s, t = _dists(2, 3, 40, seed=1), _dists(2, 3, 40, seed=2)
    for alpha in ALPHAS:
        kw = dict(k=5, alpha=alpha, support=support, tail=tail, normalize=normalize)
        got = topk_gjs(s, t, **kw)
        assert got.dtype == torch.float64 and got.shape == (2, 3)
        np.testing.assert_allclose(got.numpy(), _ref_full(s, t, **kw), rtol=1e-10, atol=1e-13)
        # float32 inputs compute in float32
        got32 = topk_gjs(s.float(), t.float(), **kw)
        assert got32.dtype == torch.float32
        np.testing.assert_allclose(got32.double().numpy(), _ref_full(s, t, **kw), rtol=2e-4, atol=1e-5)


def test_half_precision_inputs_are_upcast():
    s, t = _dists(4, 64, seed=3), _dists(4, 64, seed=4)
    got = topk_gjs(s.bfloat16(), t.bfloat16(), k=8, alpha=0.5, support="union")
    assert got.dtype == torch.float32
    ref = _ref_full(s.bfloat16(), t.bfloat16(), k=8, alpha=0.5, support="union", tail=True, normalize=False)
    np.testing.assert_allclose(got.double().numpy(), ref, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("alpha", ALPHAS)
def test_alpha_convention_matches_trl_gkd(alpha):
    """With the whole vocabulary as support, the value is TRL's generalized_jsd_loss (beta = alpha)."""
    os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
    gkd = pytest.importorskip("trl.experimental.gkd")
    s, t = _dists(2, 3, 16, seed=5), _dists(2, 3, 16, seed=6)
    trl = gkd.GKDTrainer.generalized_jsd_loss(s, t, beta=alpha, reduction="none").sum(-1)
    ours = topk_gjs(s, t, k=16, alpha=alpha, support="teacher", tail=True)
    torch.testing.assert_close(ours, trl, rtol=1e-9, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# Properties
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [True, False])
def test_symmetric_at_half_with_shared_support(tail):
    s, t = _dists(5, 30, seed=7), _dists(5, 30, seed=8)
    kw = dict(k=6, alpha=0.5, tail=tail)
    torch.testing.assert_close(topk_gjs(s, t, support="union", **kw), topk_gjs(t, s, support="union", **kw))
    # the teacher's support seen from the other side is the student's support
    torch.testing.assert_close(
        topk_gjs(s, t, support="teacher", **kw), topk_gjs(t, s, support="student", **kw)
    )


def test_swapping_sides_mirrors_alpha():
    s, t = _dists(5, 30, seed=9), _dists(5, 30, seed=10)
    for alpha in ALPHAS:
        torch.testing.assert_close(
            topk_gjs(s, t, k=4, alpha=alpha, support="union"),
            topk_gjs(t, s, k=4, alpha=1.0 - alpha, support="union"),
        )


@pytest.mark.parametrize("support", SUPPORTS)
@pytest.mark.parametrize("tail", [True, False])
def test_normalized_form_tends_to_the_endpoint_kls(support, tail):
    s, t = _dists(3, 25, seed=11), _dists(3, 25, seed=12)
    kw = dict(k=5, support=support, tail=tail)
    kl_ts = topk_gjs(s, t, alpha=0.0, **kw)
    kl_st = topk_gjs(s, t, alpha=1.0, **kw)
    assert (kl_ts > 0.01).all() and (kl_st > 0.01).all()
    torch.testing.assert_close(topk_gjs(s, t, alpha=1e-6, normalize=True, **kw), kl_ts, rtol=1e-4, atol=0)
    torch.testing.assert_close(topk_gjs(s, t, alpha=1 - 1e-6, normalize=True, **kw), kl_st, rtol=1e-4, atol=0)
    # normalize does not change the endpoints, and the unscaled GJS vanishes there
    torch.testing.assert_close(topk_gjs(s, t, alpha=0.0, normalize=True, **kw), kl_ts)
    assert (topk_gjs(s, t, alpha=1e-6, **kw) < 1e-5).all()
    assert (topk_gjs(s, t, alpha=1 - 1e-6, **kw) < 1e-5).all()


@pytest.mark.parametrize("support", SUPPORTS)
def test_zero_iff_support_and_tail_agree(support):
    t = _dists(4, 30, seed=13)
    for alpha in ALPHAS:
        kw = dict(k=5, alpha=alpha, support=support)
        assert topk_gjs(t.clone(), t, **kw).abs().max() < 1e-12
    # Move mass among tokens outside everybody's top-5: support and tail unchanged -> zero.
    order = t.argsort(-1, descending=True)
    s = t.clone()
    outside = order[:, 10:]
    s.scatter_(-1, outside, t.gather(-1, outside.flip(-1)))
    assert not torch.equal(s, t)
    for alpha in ALPHAS:
        assert topk_gjs(s, t, k=5, alpha=alpha, support=support).abs().max() < 1e-12
    # Raise the support mass (the tail changes, the support's shape does not): zero only renormalised.
    s2 = t.clone()
    s2.scatter_(-1, order[:, :5], t.gather(-1, order[:, :5]) + math.log(1.5))
    s2 = s2.log_softmax(-1)
    for alpha in ALPHAS:
        assert topk_gjs(s2, t, k=5, alpha=alpha, support="teacher", tail=False).abs().max() < 1e-12
        assert (topk_gjs(s2, t, k=5, alpha=alpha, support="teacher", tail=True) > 1e-4).all()
    # Change the support itself: positive.
    s3 = t.clone()
    s3[:, order[0, 0]] -= 1.0
    s3 = s3.log_softmax(-1)
    for alpha in ALPHAS:
        assert (topk_gjs(s3, t, k=5, alpha=alpha, support=support)[0] > 1e-6).all()


def test_non_negative_including_near_identical_inputs():
    t = _dists(64, 50, seed=14, dtype=torch.float32)
    noisy = (t + 1e-7 * torch.randn(t.shape, generator=torch.Generator().manual_seed(0))).log_softmax(-1)
    far = _dists(64, 50, seed=15, dtype=torch.float32)
    for s in (t.clone(), noisy, far):
        for support in SUPPORTS:
            for tail in (True, False):
                for alpha in ALPHAS:
                    for normalize in (False, True):
                        d = topk_gjs(s, t, k=7, alpha=alpha, support=support, tail=tail, normalize=normalize)
                        assert torch.isfinite(d).all() and (d >= 0).all()


def test_tail_form_is_a_lower_bound_of_the_full_divergence():
    """Same coarse-graining on both sides: the data-processing inequality bounds the value."""
    s, t = _dists(6, 30, seed=31), _dists(6, 30, seed=32)
    for support in SUPPORTS:
        for alpha in ALPHAS:
            full = topk_gjs(s, t, k=30, alpha=alpha)
            for k in (1, 4, 12):
                assert (topk_gjs(s, t, k=k, alpha=alpha, support=support) <= full + 1e-12).all()


def test_tail_near_zero_is_clamped_and_finite():
    """k = V leaves no tail: the bucket is floored at machine epsilon, values and gradients stay finite."""
    logits = torch.randn(3, 12, dtype=torch.float64, requires_grad=True)
    t = _dists(3, 12, seed=16)
    for alpha in ALPHAS:
        d = topk_gjs(logits.log_softmax(-1), t, k=12, alpha=alpha, support="teacher")
        (grad,) = torch.autograd.grad(d.sum(), logits)
        assert torch.isfinite(d).all() and torch.isfinite(grad).all()
        np.testing.assert_allclose(
            d.detach().numpy(),
            _ref_full(
                logits.log_softmax(-1), t, k=12, alpha=alpha, support="teacher", tail=True, normalize=False
            ),
            rtol=1e-9,
            atol=1e-12,
        )


def test_zero_probability_tokens():
    """-inf log-probs (masked vocabulary) are zero-mass buckets: finite GJS, infinite endpoint KL."""
    t = _dists(2, 20, seed=17)
    top = t.topk(3).indices
    s_logits = torch.randn(2, 20, dtype=torch.float64)
    s_logits.scatter_(-1, top[:, :1], float("-inf"))  # the student rules out the teacher's best token
    s_logits = s_logits.requires_grad_()
    s = s_logits.log_softmax(-1)
    d = topk_gjs(s, t, k=3, alpha=0.5)
    (grad,) = torch.autograd.grad(d.sum(), s_logits)
    assert torch.isfinite(d).all() and torch.isfinite(grad).all()
    np.testing.assert_allclose(
        d.detach().numpy(),
        _ref_full(s, t, k=3, alpha=0.5, support="teacher", tail=True, normalize=False),
        rtol=1e-10,
    )
    assert torch.isinf(topk_gjs(s, t, k=3, alpha=0.0)).all()
    assert torch.isfinite(topk_gjs(s, t, k=3, alpha=1.0)).all()


# ------------------------------------------------------------------------------------------------
# Gradients by finite differences
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("support", SUPPORTS)
def test_gradcheck_tensor_form(support, tail):
    s_logits = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    t_logits = torch.randn(2, 3, 12, dtype=torch.float64, requires_grad=True)
    for alpha, normalize in ((0.0, False), (0.3, False), (0.7, True), (1.0, False)):

        def f(sl, tl, alpha=alpha, normalize=normalize):
            return topk_gjs(
                sl.log_softmax(-1),
                tl.log_softmax(-1),
                k=4,
                alpha=alpha,
                support=support,
                tail=tail,
                normalize=normalize,
            )

        assert torch.autograd.gradcheck(f, (s_logits, t_logits), fast_mode=True)
    # directly w.r.t. the log-probs too (the tail reads them as given)
    s = _dists(2, 12, seed=18).requires_grad_()
    t = _dists(2, 12, seed=19)
    assert torch.autograd.gradcheck(
        lambda x: topk_gjs(x, t, k=4, alpha=0.4, support=support, tail=tail), (s,)
    )


@pytest.mark.parametrize("support", SUPPORTS)
def test_gradcheck_list_and_mixed_forms(support):
    s_full = _dists(4, 15, seed=20)
    t_full = _dists(4, 15, seed=21)
    s_top, t_top = s_full.topk(6), t_full.topk(6)
    s_lp = s_top.values.clone().requires_grad_()
    t_lp = t_top.values.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: topk_gjs_from_lists(s_top.indices, a, t_top.indices, b, k=4, alpha=0.3, support=support),
        (s_lp, t_lp),
    )
    s_logits = torch.randn(4, 15, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda x: topk_gjs_from_teacher_topk(
            x.log_softmax(-1), t_top.indices, t_top.values, k=4, alpha=0.6, support=support
        ),
        (s_logits,),
    )


# ------------------------------------------------------------------------------------------------
# List forms
# ------------------------------------------------------------------------------------------------


def _shuffled_full_lists(x, seed):
    """The whole vocabulary as a 'top-K list', in a random order per position."""
    g = torch.Generator().manual_seed(seed)
    perm = torch.stack([torch.randperm(x.shape[-1], generator=g) for _ in range(x.shape[0])])
    return perm, x.gather(-1, perm)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("support", SUPPORTS)
def test_list_form_agrees_with_tensor_form(support, tail):
    s, t = _dists(6, 30, seed=22), _dists(6, 30, seed=23)
    s_ids, s_lp = _shuffled_full_lists(s, 0)
    t_ids, t_lp = _shuffled_full_lists(t, 1)
    for alpha in ALPHAS:
        kw = dict(k=5, alpha=alpha, support=support, tail=tail, normalize=alpha == 0.5)
        want = topk_gjs(s, t, **kw)
        torch.testing.assert_close(topk_gjs_from_lists(s_ids, s_lp, t_ids, t_lp, **kw), want)
        torch.testing.assert_close(topk_gjs_from_teacher_topk(s, t_ids, t_lp, **kw), want)
        # Lists that are just the support tokens (each side lists every support token) agree too.
        sup = torch.cat([t.topk(5).indices, s.topk(5).indices], -1)
        torch.testing.assert_close(
            topk_gjs_from_lists(sup, s.gather(-1, sup), sup, t.gather(-1, sup), **kw), want
        )
        # Python lists give the same numbers.
        py = topk_gjs_from_lists(s_ids.tolist(), s_lp.tolist(), t_ids.tolist(), t_lp.tolist(), **kw)
        assert py.dtype == torch.float64
        torch.testing.assert_close(py, want)


@pytest.mark.parametrize("tail", [True, False])
@pytest.mark.parametrize("support", SUPPORTS)
def test_missing_tokens_count_in_the_tail(support, tail):
    """Server-style top-K lists: support tokens absent from a side's list move to its tail bucket."""
    s, t = _dists(8, 40, seed=24, scale=1.0), _dists(8, 40, seed=25, scale=1.0)
    s_top, t_top = s.topk(6), t.topk(6)
    for alpha in ALPHAS:
        kw = dict(k=4, alpha=alpha, support=support, tail=tail, normalize=False)
        got = topk_gjs_from_lists(s_top.indices, s_top.values, t_top.indices, t_top.values, **kw)
        ref = _ref_lists(s_top.indices, s_top.values, t_top.indices, t_top.values, **kw)
        np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-13)
        # the mixed form: the student side is the whole vocabulary
        mixed = topk_gjs_from_teacher_topk(s, t_top.indices, t_top.values, **kw)
        s_all = torch.arange(40).expand(8, 40)
        ref_mixed = _ref_lists(s_all, s, t_top.indices, t_top.values, **kw)
        np.testing.assert_allclose(mixed.numpy(), ref_mixed, rtol=1e-10, atol=1e-13)


def test_ragged_python_lists_and_edge_cases():
    s_ids = [[3, 1, 4], [2], [], [5, 5, 6]]  # ragged, one empty row, one duplicate id
    s_lp = [[-0.5, -1.5, -2.0], [-0.2], [], [-1.0, -1.0, -0.7]]
    t_ids = [[1, 3], [2, 7], [9], [6, 5]]
    t_lp = [[-0.3, -1.9], [-0.1, -3.0], [-0.05], [-0.9, -1.1]]
    for support in SUPPORTS:
        for tail in (True, False):
            for alpha in ALPHAS:
                kw = dict(k=2, alpha=alpha, support=support, tail=tail, normalize=False)
                got = topk_gjs_from_lists(s_ids, s_lp, t_ids, t_lp, **kw)
                ref = _ref_lists(s_ids, s_lp, t_ids, t_lp, **kw)
                np.testing.assert_allclose(got.numpy(), ref, rtol=1e-10, atol=1e-13)
    # disjoint lists without a tail: all mass sits in different buckets -> GJS is the entropy of alpha
    d = topk_gjs_from_lists([[1]], [[-0.5]], [[2]], [[-0.5]], k=1, alpha=0.3, tail=False)
    assert d.item() == pytest.approx(-(0.3 * math.log(0.3) + 0.7 * math.log(0.7)))
    assert topk_gjs_from_lists([], [], [], [], k=3, alpha=0.5).shape == (0,)


# ------------------------------------------------------------------------------------------------
# Config, mode names, errors
# ------------------------------------------------------------------------------------------------


def test_divergence_mode_names_what_is_computed():
    assert divergence_mode(GJSLossConfig(alpha=0.0)) == "kl_teacher_student"
    assert divergence_mode(GJSLossConfig(alpha=1.0, normalize=True)) == "kl_student_teacher"
    assert divergence_mode(GJSLossConfig(alpha=0.5)) == "topk_gjs"
    assert divergence_mode(GJSLossConfig(alpha=0.5, normalize=True)) == "topk_gjs_normalized"
    assert set(DIVERGENCE_MODES) == {
        "topk_gjs",
        "topk_gjs_normalized",
        "kl_teacher_student",
        "kl_student_teacher",
    }
    # the names match the numbers: alpha = 0 is KL(T||S) on the buckets
    s, t = _dists(3, 20, seed=26), _dists(3, 20, seed=27)
    cfg = GJSLossConfig(k=20, alpha=0.0)
    kl_ts = (t.exp() * (t - s)).sum(-1)
    torch.testing.assert_close(topk_gjs(s, t, **cfg.to_dict()), kl_ts)
    with pytest.raises(InvalidArgumentError, match="GJSLossConfig"):
        divergence_mode({"alpha": 0.5})


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(k=0), "k must be an int >= 1"),
        (dict(k=True), "k must be an int >= 1"),
        (dict(k=2.0), "k must be an int >= 1"),
        (dict(alpha=-0.1), r"alpha must be in \[0, 1\]"),
        (dict(alpha=1.5), r"alpha must be in \[0, 1\]"),
        (dict(alpha=float("nan")), r"alpha must be in \[0, 1\]"),
        (dict(alpha="0.5"), "alpha must be a float"),
        (dict(support="both"), r"support must be one of \['teacher', 'student', 'union'\]"),
        (dict(tail="yes"), "tail must be True or False"),
        (dict(normalize=1), "normalize must be True or False"),
    ],
)
def test_bad_settings_raise(kwargs, match):
    with pytest.raises(InvalidArgumentError, match=match):
        GJSLossConfig(**kwargs)
    s = _dists(2, 10, seed=28)
    full = dict(k=3, alpha=0.5) | kwargs
    with pytest.raises(InvalidArgumentError, match=match):
        topk_gjs(s, s, **full)
    with pytest.raises(InvalidArgumentError, match=match):
        topk_gjs_from_lists([[1]], [[-0.1]], [[1]], [[-0.1]], **full)


def test_bad_inputs_raise():
    s, t = _dists(2, 10, seed=29), _dists(2, 10, seed=30)
    kw = dict(k=3, alpha=0.5)
    with pytest.raises(InvalidArgumentError, match="same shape"):
        topk_gjs(s, t[:, :9], **kw)
    with pytest.raises(InvalidArgumentError, match="k must be <= the vocabulary size 10"):
        topk_gjs(s, t, k=11, alpha=0.5)
    with pytest.raises(InvalidArgumentError, match="student_logprobs must be a floating tensor"):
        topk_gjs(torch.zeros(2, 10, dtype=torch.long), t, **kw)
    with pytest.raises(InvalidArgumentError, match="teacher_logprobs must be a torch.Tensor"):
        topk_gjs(s, t.numpy(), **kw)
    with pytest.raises(InvalidArgumentError, match="teacher_logprobs: probabilities .* sum to .* not logits"):
        topk_gjs(s, 3.0 + torch.randn(2, 10, dtype=torch.float64), **kw)
    bad = s.clone()
    bad[0, 0] = float("nan")
    with pytest.raises(InvalidArgumentError, match="student_logprobs holds NaN"):
        topk_gjs(bad, t, k=10, alpha=0.5)
    ids = torch.tensor([[1, 2]])
    lp = torch.tensor([[-0.5, -1.5]])
    with pytest.raises(InvalidArgumentError, match="same positions"):
        topk_gjs_from_lists(ids, lp, torch.tensor([[1], [2]]), torch.tensor([[-0.1], [-0.1]]), **kw)
    with pytest.raises(InvalidArgumentError, match="student_topk_ids must be an integer tensor"):
        topk_gjs_from_lists(ids.float(), lp, ids, lp, **kw)
    with pytest.raises(InvalidArgumentError, match="both be tensors or both be python lists"):
        topk_gjs_from_lists(ids, lp.tolist(), ids, lp, **kw)
    with pytest.raises(InvalidArgumentError, match="one shape"):
        topk_gjs_from_lists(ids, lp[:, :1], ids, lp, **kw)
    with pytest.raises(InvalidArgumentError, match="has 1 positions but"):
        topk_gjs_from_lists([[1]], [[-0.1], [-0.2]], [[1]], [[-0.1]], **kw)
    with pytest.raises(InvalidArgumentError, match="position 0 must hold two lists of equal length"):
        topk_gjs_from_lists([[1, 2]], [[-0.1]], [[1]], [[-0.1]], **kw)
    with pytest.raises(InvalidArgumentError, match="non-integer token id"):
        topk_gjs_from_lists([[1.5]], [[-0.1]], [[1]], [[-0.1]], **kw)
    with pytest.raises(InvalidArgumentError, match="teacher_topk_logprobs: probabilities"):
        topk_gjs_from_lists([[1]], [[-0.1]], [[1, 2]], [[0.5, 0.5]], **kw)
    with pytest.raises(InvalidArgumentError, match="ids >= the vocabulary size 10"):
        topk_gjs_from_teacher_topk(s, torch.tensor([[1, 10], [2, 3]]), torch.full((2, 2), -2.0), **kw)
    with pytest.raises(InvalidArgumentError, match="leading dims of student_logprobs"):
        topk_gjs_from_teacher_topk(s, ids, lp, **kw)
