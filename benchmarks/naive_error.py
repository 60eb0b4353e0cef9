"""Naive state addition vs the exact transition, per family: relative state error after a segment.

Setup (fixed seeds, fp32, CPU): a context of --context tokens leaves state S_in; then a segment C of
L tokens. The reference is the token-by-token recurrence over context + segment. PIC composes the
segment's cached pair, T(C) @ S_in + S(C|0); naive addition uses S_in + S(C|0). Reported: the
relative Frobenius error |S - S_ref| / |S_ref| of the end state.

Rows: RetNet's fixed decays, gamma_h = 1 - 2^(-5-h) for heads h = 0..7 (the article's "RetNet slow
head"), then one row per family with random inputs: scalar decay (lightning / Mamba2), diagonal
(GLA / Mamba1), dense (Gated DeltaNet, KDA), each with slow data-dependent decays.

    python benchmarks/naive_error.py [--context 256] [--lengths 64 256 1024] [--out benchmarks/results/naive_error.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from hypic.compose.transition import Form, augment, compose, log_decay_transitions, split_augmented, zero_start
from hypic.ops.reference import (chunk_gated_delta_rule, chunk_gla, chunk_kda, recurrent_gated_delta_rule,
                                 recurrent_gla, recurrent_kda)

K = V = 64


def _inputs(n, h, seed):
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, h, d, generator=g) for d in (K, K, V))
    k = k / k.norm(dim=-1, keepdim=True)                  # unit keys, as RetNet / GDN normalise them
    return q, k, v, g


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def retnet_rows(context, lengths):
    """Scalar decay per head, fixed: log gamma_h per token."""
    h = 8
    gamma = 1 - 2.0 ** (-5 - torch.arange(h, dtype=torch.float64))
    rows = []
    for L in lengths:
        n = context + L
        q, k, v, _ = _inputs(n, h, seed=L)
        g = gamma.log().float()[None, None].expand(1, n, h)
        _, ref = recurrent_gla(q, k, v, g, scale=1.0, output_final_state=True)
        _, s_in = recurrent_gla(q[:, :context], k[:, :context], v[:, :context], g[:, :context], scale=1.0,
                                output_final_state=True)
        sl = slice(context, n)
        _, s_zero = chunk_gla(q[:, sl], k[:, sl], v[:, sl], g[:, sl], scale=1.0, output_final_state=True)
        (t,) = log_decay_transitions(g[0, sl], torch.tensor([0, L]), Form.SCALAR)
        exact, naive = compose(s_in, t, s_zero), compose(s_in, t, s_zero, exact=False)
        for head in range(h):
            rows.append({"family": "retnet", "head": head, "gamma": float(gamma[head]), "segment_len": L,
                         "T": float(t.t[head]), "naive_rel_err": _rel(naive[:, head], ref[:, head]),
                         "pic_rel_err": _rel(exact[:, head], ref[:, head])})
    return rows


def family_rows(context, lengths, decay=2.0 ** -9):
    """Random data-dependent decays with mean log decay -decay per token (slow), 4 heads."""
    h, rows = 4, []
    for L in lengths:
        n = context + L
        q, k, v, gen = _inputs(n, h, seed=100 + L)
        g_head = -torch.rand(1, n, h, generator=gen) * 2 * decay
        g_chan = -torch.rand(1, n, h, K, generator=gen) * 2 * decay
        beta = torch.rand(1, n, h, generator=gen) * 0.1          # gentle erasure
        sl, ctx = slice(context, n), slice(0, context)
        cu = torch.tensor([0, L])
        for name, form in (("scalar (lightning, Mamba2)", Form.SCALAR), ("diagonal (GLA, Mamba1)", Form.DIAGONAL),
                           ("dense (Gated DeltaNet)", Form.DENSE), ("dense (KDA)", Form.DENSE)):
            if form is not Form.DENSE:
                g = g_head if form is Form.SCALAR else g_chan
                run = lambda s, init=None, fn=recurrent_gla: fn(q[:, s], k[:, s], v[:, s], g[:, s],  # noqa: E731
                                                               initial_state=init, output_final_state=True)
                _, ref = run(slice(0, n))
                _, s_in = run(ctx)
                _, s_zero = run(sl, fn=chunk_gla)
                (t,) = log_decay_transitions(g[0, sl], cu, form)
            else:
                kda = "KDA" in name
                g = g_chan if kda else g_head
                rec, chunk = (recurrent_kda, chunk_kda) if kda else (recurrent_gated_delta_rule, chunk_gated_delta_rule)
                run = lambda s, vv=v, init=None, fn=rec: fn(q[:, s], k[:, s], vv[:, s], g[:, s], beta[:, s],  # noqa: E731
                                                            initial_state=init, output_final_state=True)
                _, ref = run(slice(0, n))
                _, s_in = run(ctx)
                v_aug, init_aug = augment(v, torch.zeros(1, h, K, V), K)
                _, final = run(sl, vv=v_aug, init=init_aug, fn=chunk)
                s_out, (t,) = split_augmented(final, V)
                s_zero = zero_start(s_out, t, torch.zeros(1, h, K, V))
            exact, naive = compose(s_in, t, s_zero), compose(s_in, t, s_zero, exact=False)
            rows.append({"family": name, "segment_len": L, "mean_log_decay": -decay,
                         "naive_rel_err": _rel(naive, ref), "pic_rel_err": _rel(exact, ref)})
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--context", type=int, default=256)
    ap.add_argument("--lengths", type=int, nargs="+", default=[64, 256, 1024])
    ap.add_argument("--out", default="benchmarks/results/naive_error.json")
    a = ap.parse_args()
    torch.manual_seed(0)
    rows = retnet_rows(a.context, a.lengths) + family_rows(a.context, a.lengths)
    print(f"context {a.context} tokens, K = V = {K}; relative end-state error vs the sequential recurrence")
    print(f"{'family':28s} {'head':>4s} {'gamma':>10s} {'L':>5s} {'T':>7s} {'naive':>8s} {'pic':>9s}")
    for r in rows:
        head = str(r.get("head", "-"))
        gamma = f"{r['gamma']:.6f}" if "gamma" in r else "-"
        t = f"{r['T']:.3f}" if "T" in r else "-"
        print(f"{r['family']:28s} {head:>4s} {gamma:>10s} {r['segment_len']:5d} {t:>7s} "
              f"{100 * r['naive_rel_err']:7.1f}% {r['pic_rel_err']:9.1e}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"context": a.context, "k_dim": K, "v_dim": V, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
