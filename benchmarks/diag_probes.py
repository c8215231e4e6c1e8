"""Why does Attention Matching lose on a real model? Per-layer attention-output error on *future* queries.

One compaction of the oldest ``window`` rows of a ``budget``-row cache (the KV-budget trigger's first
event, ``protect_prompt`` off), done offline on the post-RoPE queries/keys/values of a plain Hugging
Face forward of real text. The error of a method is, per layer, the relative squared error of the
attention output of the queries that come *after* the cache (positions ``budget .. budget + future``,
attending causally to ``[compacted span | rest]``), against the uncompacted cache — what those
queries will actually read. Probe sources: ``suffix`` (the queries of the rows after the span: what
the engine has), ``repeat`` (the queries of the span's tokens re-read after a "repeat" prompt),
``self`` (queries of greedy continuation tokens) and ``oracle`` (the future queries themselves: a
bound on what any probe source can reach).

Usage: OMP_NUM_THREADS=1 python benchmarks/diag_probes.py --model smollm2-135m-instruct [--budget 256] [--future 512]

Results and their reading: docs/benchmarks.md, "Why Attention Matching lost, and what changed".
"""

from __future__ import annotations

import argparse
import math

import torch

from compaction_gym.compaction import compact, gqa_probes

CAPTURE: list[torch.Tensor] = []


def _patch_rope(model) -> None:
    """Capture every layer's post-RoPE queries (the output of the model module's ``apply_rotary_pos_emb``)."""
    import importlib

    ml = importlib.import_module(type(model).__module__)
    orig = ml.apply_rotary_pos_emb

    def rope(q, k, cos, sin, *a, **kw):
        q2, k2 = orig(q, k, cos, sin, *a, **kw)
        CAPTURE.append(q2.detach())
        return q2, k2

    ml.apply_rotary_pos_emb = rope


def forward_qkv(model, ids: list[int]):
    """Queries ``[L, H_q, n, d]``, keys and values ``[L, H_kv, n, d]`` (post-RoPE) of ``ids``."""
    CAPTURE.clear()
    with torch.no_grad():
        out = model(torch.tensor([ids]), use_cache=True)
    q = torch.stack([c[0] for c in CAPTURE])
    cache = out.past_key_values
    k = torch.stack([cache.layers[i].keys[0] for i in range(len(cache.layers))])
    v = torch.stack([cache.layers[i].values[0] for i in range(len(cache.layers))])
    return q, k, v, out.logits[0]


def attn_out(q, k, v, bias, causal_offset, scale):
    """Per KV-head-grouped attention output. q [B, n, d] (GQA grouped), k/v [B, T, d], bias [B, T]."""
    s = scale * q @ k.transpose(1, 2) + bias[:, None, :]
    return torch.softmax(s + causal_offset, -1) @ v


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--budget", type=int, default=256)
    p.add_argument("--ratio", type=float, default=0.25)
    p.add_argument("--future", type=int, default=512)
    p.add_argument("--offset", type=int, default=0, help="text offset in tokens")
    p.add_argument("--self-tokens", type=int, default=64)
    args = p.parse_args()
    from compaction_gym.lmeval.text import load_text
    from compaction_gym.models.registry import load_model

    model, tok = load_model(args.model, dtype="float32", device="cpu")
    model.eval()
    _patch_rope(model)
    ids = tok(load_text("pydoc"), add_special_tokens=False)["input_ids"][args.offset :]
    B, W = args.budget, args.budget // 2
    t = max(1, math.floor(W * args.ratio))
    n_all = B + args.future
    q, k, v, _ = forward_qkv(model, ids[:n_all])
    L, Hq, _, d = q.shape
    Hkv = k.shape[1]
    G = Hq // Hkv
    scale = d**-0.5
    keys = k[:, :, :B].reshape(L * Hkv, B, d)
    vals = v[:, :, :B].reshape(L * Hkv, B, d)
    span = (0, W)

    # future queries (grouped) and their causal view of the raw rows B..n_all
    fq = gqa_probes(q[:, :, B:n_all], Hkv)  # [L*Hkv, G*F, d]
    F = n_all - B
    kf = k[:, :, B:n_all].reshape(L * Hkv, F, d)
    vf = v[:, :, B:n_all].reshape(L * Hkv, F, d)
    causal = torch.full((F, F), float("-inf")).triu(1)  # query i sees future rows <= i
    causal = causal.repeat(G, 1)  # grouped probe layout: head-major, positions inner

    def full_error(ck, cv, cb):
        """Relative squared error of the future queries' attention outputs, per layer."""
        pre_k = torch.cat([ck, keys[:, W:], kf], 1)
        pre_v = torch.cat([cv, vals[:, W:], vf], 1)
        bias = torch.cat([cb, torch.zeros(L * Hkv, B - W + F)], 1)
        mask = torch.cat([torch.zeros(G * F, ck.shape[1] + B - W), causal], 1)
        o = attn_out(fq, pre_k, pre_v, bias, mask, scale)
        return o

    ref = full_error(keys[:, :W], vals[:, :W], torch.zeros(L * Hkv, W))

    def err(o):
        e = ((o - ref) ** 2).sum(-1).mean(-1) / (ref**2).sum(-1).mean(-1)
        return e.reshape(L, Hkv).mean(1)

    # probe sources
    probes = {"suffix": gqa_probes(q[:, :, W:B], Hkv), "oracle": fq}
    # repeat: context B tokens, then a repeat prompt, then the span's tokens again
    prompt = tok("\n\nRepeat the previous text exactly.\n\n", add_special_tokens=False)["input_ids"]
    rep_ids = ids[:B] + prompt + ids[:W]
    rq, rk, _, _ = forward_qkv(model, rep_ids)
    assert torch.allclose(rk[:, :, :B], k[:, :, :B], atol=1e-4)
    probes["repeat"] = gqa_probes(rq[:, :, B:], Hkv)  # prompt + re-read span
    # self: greedy continuation of the cache
    gen = list(ids[:B])
    with torch.no_grad():
        for _ in range(args.self_tokens):
            CAPTURE.clear()
            lg = model(torch.tensor([gen])).logits[0, -1]
            gen.append(int(lg.argmax()))
    sq, _, _, _ = forward_qkv(model, gen)
    probes["self"] = gqa_probes(sq[:, :, B:], Hkv)
    probes["suffix+repeat"] = torch.cat([probes["suffix"], probes["repeat"]], 1)
    probes["suffix+self"] = torch.cat([probes["suffix"], probes["self"]], 1)

    rows = []
    zero_b = torch.zeros(L * Hkv, t)
    rows.append(("delete span", err(full_error(keys[:, :0], vals[:, :0], torch.zeros(L * Hkv, 0)))))
    for name, pr in probes.items():
        for mode in ("attention_matching", "h2o"):
            r = compact(keys, vals, pr, span, t, mode=mode, scale=scale, compute_beta=False)
            sel_v = torch.gather(vals, 1, r.indices[..., None].expand(-1, -1, d))
            if mode == "h2o":
                rows.append((f"{name}: h2o", err(full_error(r.keys, sel_v, zero_b))))
                continue
            rows.append((f"{name}: AM select, orig V", err(full_error(r.keys, sel_v, zero_b))))
            rows.append((f"{name}: AM select, C2", err(full_error(r.keys, r.values, zero_b))))
            rb = compact(keys, vals, pr, span, t, mode=mode, scale=scale, compute_beta=True)
            rows.append((f"{name}: AM select, beta, orig V", err(full_error(rb.keys, sel_v, rb.beta.float()))))
            rows.append((f"{name}: AM select, beta, C2", err(full_error(rb.keys, rb.values, rb.beta.float()))))
    # streaming for reference
    r = compact(keys, vals, None, span, t, mode="streaming", scale=scale)
    rows.append(("streaming", err(full_error(r.keys, r.values, zero_b))))

    print(f"budget {B}, window {W}, kept {t}, future {F}, probes per KV head: "
          + ", ".join(f"{k_}={v_.shape[1]}" for k_, v_ in probes.items()))
    print(f"{'method':45s} mean  L0-9  L10-19 L20-29")
    for name, e in rows:
        print(f"{name:45s} {e.mean():.4f} {e[:10].mean():.4f} {e[10:20].mean():.4f} {e[20:].mean():.4f}")


if __name__ == "__main__":
    main()
