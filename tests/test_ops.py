"""Reference ops against plainer formulations (token-by-token recurrence, F.conv1d with padding,
SDPA with a causal mask)."""

import pytest
import torch
import torch.nn.functional as F

from hypic.ops.reference import (causal_conv1d, chunk_gated_delta_rule, experts_forward,
                                 position_attention, recurrent_gated_delta_rule, route)


def _inputs(b, t, h, hv, dk, dv, seed=0, decay=0.1):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(b, t, h, dk), r(b, t, h, dk), r(b, t, hv, dv), -torch.rand(b, t, hv, generator=g) * decay,
            torch.rand(b, t, hv, generator=g), r(b, hv, dk, dv))


@pytest.mark.parametrize("t", [1, 5, 64, 65, 200])
@pytest.mark.parametrize("h,hv,dk,dv", [(1, 1, 8, 8), (2, 4, 16, 8), (2, 2, 8, 24)])
def test_chunk_matches_recurrent(t, h, hv, dk, dv):
    q, k, v, g, beta, s0 = _inputs(2, t, h, hv, dk, dv)
    o1, s1 = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                    use_qk_l2norm_in_kernel=True, chunk_size=16)
    o2, s2 = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    # fp32 throughout; differences are summation order only
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-5)


def test_varlen_equals_separate_sequences():
    lens = [3, 70, 1, 17]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 4, 8, 8, seed=1)
    s0 = torch.randn(len(lens), 4, 8, 8)
    o, s = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                  use_qk_l2norm_in_kernel=True)
    for i in range(len(lens)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        oi, si = recurrent_gated_delta_rule(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],
                                            initial_state=s0[i : i + 1], output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(o[:, sl], oi, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s[i : i + 1], si, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["gated_delta", "kda"])
def test_varlen_gradients_equal_separate_sequences(family):
    """Under autograd (the quality study's PIC tune) the packed varlen chunked call, padded by one gather and
    unpadded by one mask, gives every input the gradient the sequences' own token-by-token calls give, a zero-length
    sequence included (fp32; the bound is the forward's, test_chunk_matches_recurrent)."""
    from hypic.ops.reference import kda

    lens = [3, 40, 0, 17]
    cu = torch.tensor([0] + lens).cumsum(0)
    if family == "kda":
        q, k, v, g, beta, _ = _gla_inputs(1, sum(lens), 2, 2, 8, 8, per_channel=True, seed=2)
        chunk, rec = kda.chunk_kda, kda.recurrent_kda
    else:
        q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 4, 8, 8, seed=2)
        chunk, rec = chunk_gated_delta_rule, recurrent_gated_delta_rule
    s0 = torch.randn(len(lens), *( (2, 8, 8) if family == "kda" else (4, 8, 8)))
    weight = torch.linspace(-1, 1, v.shape[1] * v.shape[2] * v.shape[3]).view(1, *v.shape[1:])

    def grads(fn):
        ins = [x.clone().requires_grad_(True) for x in (q, k, v, g, beta, s0)]
        out, st = fn(*ins)
        ((out * weight).sum() + st.square().sum()).backward()
        return [x.grad for x in ins]

    def packed(q, k, v, g, beta, s0):
        return chunk(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                     use_qk_l2norm_in_kernel=True)

    def separate(q, k, v, g, beta, s0):
        outs, sts = [], []
        for i in range(len(lens)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            if lens[i] == 0:
                sts.append(s0[i : i + 1])
                continue
            o, st = rec(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl], initial_state=s0[i : i + 1],
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
            outs.append(o)
            sts.append(st)
        return torch.cat(outs, dim=1), torch.cat(sts)

    for a, b in zip(grads(packed), grads(separate)):
        torch.testing.assert_close(a, b, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_chunk_transition_composes_exactly(backend):
    """chunk_gated_delta_transition: outputs and final state as the plain chunked call from the same initial
    state, and per run a transition T with final = T @ init + (the final state from zero), T the product of
    the tokens' own maps exp(g_t) (I - beta_t k_t k_t^T) (k l2-normed). The ops compute in fp32: the bounds are
    fp32 rounding over ~100 steps (as test_chunk_matches_recurrent).
    (The fast backend on a CPU takes its appended-columns form; on CUDA its fla stages: tests/test_gpu.py.)"""
    from hypic.ops import get_backend

    op = get_backend(backend).chunk_gated_delta_transition
    lens = [5, 70, 130]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 4, 8, 6, seed=3)
    s0 = torch.randn(len(lens), 4, 8, 6)
    o, final, t = op(q, k, v, g, beta, initial_state=s0, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    o_ref, f_ref = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel=True)
    _, f_zero = chunk_gated_delta_rule(q, k, v, g, beta, initial_state=torch.zeros_like(s0), output_final_state=True,
                                       cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
    torch.testing.assert_close(o, o_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, f_ref, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(final, t @ s0 + f_zero, atol=2e-5, rtol=1e-5)
    kn = F.normalize(k.double(), dim=-1).repeat_interleave(2, dim=2)   # 2 key heads -> 4 value heads
    for i in range(len(lens)):
        want = torch.eye(8, dtype=torch.float64).expand(4, 8, 8)
        for j in range(int(cu[i]), int(cu[i + 1])):
            kj, bj = kn[0, j], beta[0, j].double()
            step = g[0, j].double().exp()[:, None, None] * (torch.eye(8, dtype=torch.float64) - bj[:, None, None]
                                                   * kj[:, :, None] * kj[:, None, :])
            want = step @ want
        torch.testing.assert_close(t[i].double(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_run_summary_factors_give_the_transition(backend):
    """recurrent_gated_delta_summary(..., factors=True): the same outputs and S as the dense summary, and a
    transition T = gamma I - Kd^T W (run_factors) equal to the product of the run's token maps exp(g_t)
    (I - beta_t k_t k_t^T), for runs of 0 to 16 tokens padded to 16 rows (rows past a run zero), so a chain
    step through the factors, gamma x - Kd^T (W x) + S, is the dense step. fp32 ops: the bounds are fp32
    rounding over <= 16 steps. (On CUDA the fast backend's chunked Triton kernel: tests/test_gpu.py.)"""
    from hypic.ops import get_backend
    from hypic.ops.reference.gated_delta import factor_width, factors_to_dense

    op = get_backend(backend).recurrent_gated_delta_summary
    lens = [3, 16, 0, 1, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 4, 24, 6, seed=5, decay=0.5)
    o, u, dense = op(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=16)
    o2, u2, S, fac = op(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=16, factors=True)
    assert factor_width(16) == 16 and factor_width(9) == 16 and factor_width(17) == 32
    assert fac.shape == (len(lens), 4, 33, 24) and S.shape == (len(lens), 4, 24, 6)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(u2, u)
    torch.testing.assert_close(factors_to_dense(S, fac), dense, atol=2e-6, rtol=1e-5)
    kn = F.normalize(k.double(), dim=-1).repeat_interleave(2, dim=2)
    x = torch.randn(4, 24, 6, dtype=torch.float64)
    for i, n in enumerate(lens):
        assert not fac[i, :, n:16].any() and not fac[i, :, 16 + n : 32].any()
        want = torch.eye(24, dtype=torch.float64).expand(4, 24, 24)
        for j in range(int(cu[i]), int(cu[i + 1])):
            kj, bj = kn[0, j], beta[0, j].double()
            step = g[0, j].double().exp()[:, None, None] * (torch.eye(24, dtype=torch.float64) - bj[:, None, None]
                                                            * kj[:, :, None] * kj[:, None, :])
            want = step @ want
        kd, w, gam = fac[i, :, :16].double(), fac[i, :, 16:32].double(), fac[i, :, 32, 0].double()
        torch.testing.assert_close(gam[:, None, None] * x - kd.transpose(-1, -2) @ (w @ x), want @ x,
                                   atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("backend", ["reference", "fast"])
def test_run_summary_values_and_low_rank_pairs(backend):
    """recurrent_gated_delta_summary(..., factors=True, values=True): the same outputs and factors, with the runs'
    WY-solved values U in S's place (S = Kd^T U: `values_to_state`); and `pair_maps`, a run composed with a cached
    map (T_e, S_e) after it from (Kd, W, g, U) alone, [S_e + P U | g T_e - P W] with P = T_e Kd^T, equal to the
    dense composition [T_e S_r + S_e | T_e T_r] in fp64 (and to the run's own [S_r | T_r] without a map). fp32 ops
    on maps of norm ~1 over <= 16 tokens: 2e-5 is fp32 rounding with room."""
    from hypic.ops import get_backend
    from hypic.ops.reference.gated_delta import pair_maps, values_to_state

    op = get_backend(backend).recurrent_gated_delta_summary
    lens = [3, 16, 0, 1, 9]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 4, 24, 6, seed=7, decay=0.5)
    o, u, dense = op(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=16)
    o2, u2, U, fac = op(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=16, factors=True,
                        values=True)
    assert U.shape == (len(lens), 4, 16, 6) and fac.shape == (len(lens), 4, 33, 24)
    torch.testing.assert_close(o2, o)
    torch.testing.assert_close(u2, u)
    torch.testing.assert_close(values_to_state(U, fac), dense[..., :6], atol=2e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="values"):
        op(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=16, values=True)
    torch.testing.assert_close(pair_maps(fac, U), dense, atol=2e-6, rtol=1e-5)
    gen = torch.Generator().manual_seed(1)
    T_e = torch.randn(len(lens), 4, 24, 24, generator=gen) / 24 ** 0.5
    S_e = torch.randn(len(lens), 4, 24, 6, generator=gen)
    d = dense.double()
    want = torch.cat([T_e.double() @ d[..., :6] + S_e.double(), T_e.double() @ d[..., 6:]], dim=-1)
    torch.testing.assert_close(pair_maps(fac, U, T_e, S_e).double(), want, atol=2e-5, rtol=1e-5)


def test_pair_runs_pairs_each_run_with_the_cached_map_after_it():
    """The compose lowering's pairing (runtime/compose_graph.pair_runs): a run followed by a cached map in the
    request's chain is paired with it (that map's step left out), a run followed by another run or ending the chain
    is not, and the pad chain after `main` is never paired."""
    import numpy as np

    from hypic.runtime.compose_graph import pair_runs

    e = 3                                       # entries 0..2; runs 3..8 (8: a pad run)
    order = np.array([3, 0, 4, 5, 1, 2, 6, 7, 8])    # run, E0, run, run, E1, E2, run, run | pad
    keep, after = pair_runs(order, 8, e)
    assert keep.tolist() == [True, False, True, True, False, True, True, True, True]
    assert after.tolist() == [0, -1, 1, -1, -1, -1]
    keep, after = pair_runs(np.array([0, 2, 1]), 3, 2)       # a chain that starts with a map: nothing before it
    assert keep.tolist() == [True, True, False] and after.tolist() == [1]
    keep, after = pair_runs(np.array([2, 0, 1]), 1, 2)       # main 1: E0 is past the chain's end
    assert keep.all() and after.tolist() == [-1]


def test_initial_state_is_not_modified():
    q, k, v, g, beta, s0 = _inputs(1, 20, 1, 1, 4, 4)
    before = s0.clone()
    chunk_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s0, output_final_state=True)
    assert torch.equal(s0, before)


@pytest.mark.parametrize("t", [1, 2, 9])
def test_conv_with_window_equals_padded_conv(t):
    c, w = 6, 4
    x = torch.randn(1, 12, c)
    weight = torch.randn(c, w)
    full = F.silu(F.conv1d(x.transpose(1, 2), weight[:, None], padding=w - 1, groups=c)[..., :12]).transpose(1, 2)
    # the same sequence in two pieces: the window carries the boundary
    y1, win = causal_conv1d(x[:, :t], weight)
    y2, _ = causal_conv1d(x[:, t:], weight, window=win)
    torch.testing.assert_close(torch.cat([y1, y2], 1), full, atol=1e-6, rtol=1e-6)


def test_position_attention_matches_sdpa_and_ignores_key_order():
    nq, h, hkv, d = 7, 4, 2, 8
    q, k, v = torch.randn(nq, h, d), torch.randn(nq, hkv, d), torch.randn(nq, hkv, d)
    pos = torch.arange(10, 10 + nq)
    out = position_attention(q, k, v, pos, pos, scale=d ** -0.5)
    ref = F.scaled_dot_product_attention(q.transpose(0, 1), k.repeat_interleave(2, 1).transpose(0, 1),
                                         v.repeat_interleave(2, 1).transpose(0, 1), is_causal=True).transpose(0, 1)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    perm = torch.randperm(nq)
    out2 = position_attention(q, k[perm], v[perm], pos, pos[perm], scale=d ** -0.5)
    torch.testing.assert_close(out2, out, atol=1e-6, rtol=1e-6)


def test_moe_matches_dense_loop():
    n, hd, e, i, k = 10, 8, 5, 6, 2
    x, router = torch.randn(n, hd), torch.randn(e, hd)
    gate_up, down = torch.randn(e, 2 * i, hd), torch.randn(e, hd, i)
    w, idx = route(x, router, k, True)
    y = experts_forward(x, w, idx, gate_up, down)
    ref = torch.zeros_like(x)
    for t in range(n):
        for j in range(k):
            ex = int(idx[t, j])
            gu = gate_up[ex] @ x[t]
            ref[t] += w[t, j] * (down[ex] @ (F.silu(gu[:i]) * gu[i:]))
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(w.sum(-1), torch.ones(n))
    # rows from `rows` on are padding (the compose pass's pads): no routed expert, the shared part alone; the rest
    # exactly as without padding, in both backends (the fast one runs the reference on the CPU)
    from hypic.ops import get_backend

    sg, so = torch.randn(n, 1), torch.randn(n, hd)
    full = experts_forward(x, w, idx, gate_up, down, shared=(sg, so))
    rows = torch.tensor([7])
    for name in ("reference", "fast"):
        got = get_backend(name).experts_forward(x, w, idx, gate_up, down, shared=(sg, so), rows=rows)
        assert torch.equal(got[:7], full[:7]), name
        torch.testing.assert_close(got[7:], torch.sigmoid(sg[7:]) * so[7:], atol=0, rtol=0)


# -- KDA and GLA (diagonal / scalar decay) ------------------------------------------------------------
from hypic.ops.reference import (chunk_gla, chunk_kda, chunk_simple_gla, recurrent_gla, recurrent_kda,  # noqa: E402
                                 recurrent_simple_gla)


def _gla_inputs(b, t, h, hv, dk, dv, *, per_channel, seed=0, decay=0.3):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    gs = -torch.rand(b, t, hv, *((dk,) if per_channel else ()), generator=g) * decay
    return r(b, t, h, dk), r(b, t, h, dk), r(b, t, hv, dv), gs, torch.rand(b, t, hv, generator=g), r(b, hv, dk, dv)


@pytest.mark.parametrize("t", [1, 5, 33, 70])
@pytest.mark.parametrize("h,hv,dk,dv", [(1, 1, 8, 8), (2, 2, 16, 8), (3, 3, 4, 12)])
def test_kda_chunk_matches_recurrent(t, h, hv, dk, dv):
    q, k, v, g, beta, s0 = _gla_inputs(2, t, h, hv, dk, dv, per_channel=True)
    kw = dict(initial_state=s0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o1, s1 = chunk_kda(q, k, v, g, beta, chunk_size=16, **kw)
    o2, s2 = recurrent_kda(q, k, v, g, beta, **kw)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("t", [1, 5, 33, 70])
@pytest.mark.parametrize("h,hv,dk,dv", [(1, 1, 8, 8), (2, 4, 16, 8), (1, 3, 4, 1)])
def test_gla_chunk_matches_recurrent(t, h, hv, dk, dv, per_channel):
    q, k, v, g, _, s0 = _gla_inputs(2, t, h, hv, dk, dv, per_channel=per_channel)
    chunk, rec = (chunk_gla, recurrent_gla) if per_channel else (chunk_simple_gla, recurrent_simple_gla)
    o1, s1 = chunk(q, k, v, g, initial_state=s0, output_final_state=True, chunk_size=16)
    o2, s2 = rec(q, k, v, g, initial_state=s0, output_final_state=True)
    torch.testing.assert_close(o1, o2, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(s1, s2, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["kda", "gla", "simple_gla"])
def test_varlen_equals_separate_sequences_every_family(family):
    lens = [3, 40, 1, 17]
    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _gla_inputs(1, sum(lens), 2, 2, 8, 8, per_channel=family != "simple_gla", seed=1)
    s0 = torch.randn(len(lens), 2, 8, 8)
    if family == "kda":
        run = lambda fn, sl, **kw: fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], beta[:, sl],  # noqa: E731
                                      use_qk_l2norm_in_kernel=True, **kw)
        chunk, rec = chunk_kda, recurrent_kda
    else:
        run = lambda fn, sl, **kw: fn(q[:, sl], k[:, sl], v[:, sl], g[:, sl], **kw)  # noqa: E731
        chunk, rec = (chunk_gla, recurrent_gla) if family == "gla" else (chunk_simple_gla, recurrent_simple_gla)
    o, s = run(chunk, slice(None), initial_state=s0, output_final_state=True, cu_seqlens=cu)
    for i in range(len(lens)):
        sl = slice(int(cu[i]), int(cu[i + 1]))
        oi, si = run(rec, sl, initial_state=s0[i : i + 1], output_final_state=True)
        torch.testing.assert_close(o[:, sl], oi, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s[i : i + 1], si, atol=2e-5, rtol=1e-5)


# -- the elementwise scan (RG-LRU) ---------------------------------------------------------------------------------
from hypic.ops.reference import chunk_diagonal_scan, recurrent_diagonal_scan  # noqa: E402


@pytest.mark.parametrize("t", [1, 5, 16, 33, 70])
@pytest.mark.parametrize("decay", [0.05, 3.0, 60.0])
def test_diagonal_scan_chunk_matches_recurrent_and_a_plain_loop(t, decay):
    """h_t = exp(g_t) h_{t-1} + x_t per channel: the chunked form equals the token loop, and both equal the recurrence
    written out here in fp64; strong decays (60 per token: exp(-G) alone would overflow in a 16-token chunk) stay
    finite."""
    g = torch.Generator().manual_seed(t)
    x = torch.randn(2, t, 24, generator=g)
    gs = -torch.rand(2, t, 24, generator=g) * decay
    h0 = torch.randn(2, 24, generator=g)
    o1, s1 = chunk_diagonal_scan(x, gs, initial_state=h0, output_final_state=True)
    o2, s2 = recurrent_diagonal_scan(x, gs, initial_state=h0, output_final_state=True)
    h, ref = h0.double(), torch.empty(2, t, 24, dtype=torch.float64)
    for i in range(t):
        h = gs[:, i].double().exp() * h + x[:, i].double()
        ref[:, i] = h
    for o, s in ((o1, s1), (o2, s2)):
        assert torch.isfinite(o).all()
        torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(s.double(), h, atol=2e-5, rtol=1e-5)


def test_diagonal_scan_varlen_equals_separate_sequences():
    lens = [3, 40, 1, 17]
    cu = torch.tensor([0] + lens).cumsum(0)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, sum(lens), 16, generator=g)
    gs = -torch.rand(1, sum(lens), 16, generator=g) * 0.3
    h0 = torch.randn(len(lens), 16, generator=g)
    for fn in (chunk_diagonal_scan, recurrent_diagonal_scan):
        o, s = fn(x, gs, initial_state=h0, output_final_state=True, cu_seqlens=cu)
        for i in range(len(lens)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            oi, si = recurrent_diagonal_scan(x[:, sl], gs[:, sl], initial_state=h0[i : i + 1], output_final_state=True)
            torch.testing.assert_close(o[:, sl], oi, atol=2e-5, rtol=1e-5)
            torch.testing.assert_close(s[i : i + 1], si, atol=2e-5, rtol=1e-5)


def test_joined_weights_equal_separate_projections_and_pad_rows():
    """layers/joined.py: one GEMM over [w_1; w_2; w_3; 0] gives each projection (fp64: the same dot products, so
    equal to rounding), the joined matrix padded to a multiple of ROWS_MULTIPLE rows (the shared expert's 2I + 1
    rows), cached per weight version, and under autograd the gradients reach the parts."""
    from hypic.layers.joined import ROWS_MULTIPLE, JoinedWeights

    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 24, generator=g, dtype=torch.float64)
    ws = [torch.randn(r, 24, generator=g, dtype=torch.float64) for r in (8, 8, 1)]
    j = JoinedWeights()
    w = j.weight(*ws)
    assert w.shape[0] % ROWS_MULTIPLE == 0 and w.shape[0] >= 17 and not w[17:].any()
    outs = j.linear(x, *ws)
    assert [o.shape for o in outs] == [(5, 8), (5, 8), (5, 1)]
    for o, wi in zip(outs, ws):
        torch.testing.assert_close(o, F.linear(x, wi), rtol=1e-12, atol=1e-12)
    assert j.weight(*ws) is w                       # cached while the parts are unchanged
    ws[2].add_(1.0)
    assert j.weight(*ws) is not w and torch.equal(j.weight(*ws)[16], ws[2][0])
    p = [wi.clone().requires_grad_() for wi in ws]
    sum(o.sum() for o in j.linear(x, *p)).backward()
    for pi in p:
        torch.testing.assert_close(pi.grad, x.sum(0).expand_as(pi))


def test_packed_joins_are_the_parameters_storage_and_follow_their_writes():
    """JoinedWeights.pack: the parts become views of one matrix (no copy: the join is their storage), in-place writes
    into a part (load_state_dict, an optimizer step) are writes into the join, and a part given new storage
    (`assign`, `.to()`) is no longer taken for packed: the copy of before, with its new values. Without packing
    (USE_PACKED off) the same results (fp64: equal to rounding)."""
    from hypic.layers import joined
    from hypic.layers.joined import ROWS_MULTIPLE, JoinedWeights

    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 24, generator=g, dtype=torch.float64)
    ps = [torch.nn.Parameter(torch.randn(r, 24, generator=g, dtype=torch.float64)) for r in (8, 5, 1)]
    want = [F.linear(x, p.detach()) for p in ps]
    j = JoinedWeights()
    j.pack(ps)
    mat = j.packed(*ps)
    assert mat is not None and mat.shape == (16, 24) and not mat[14:].any() and 16 % ROWS_MULTIPLE == 0
    assert [p.data_ptr() for p in ps] == [mat.data_ptr() + r * 24 * 8 for r in (0, 8, 13)]
    assert all(p.is_leaf and isinstance(p, torch.nn.Parameter) for p in ps)
    grads = j.linear(x, *ps)                  # under autograd: the parts concatenated, so gradients reach them
    sum(o.sum() for o in grads).backward()
    assert all(p.grad is not None for p in ps)
    with torch.no_grad():
        assert j.weight(*ps) is mat
        for o, w in zip(j.linear(x, *ps), want):
            torch.testing.assert_close(o, w, rtol=1e-12, atol=1e-12)
        assert j.packed(ps[1], ps[0], ps[2]) is None                   # another order is another join
        ps[1].copy_(torch.ones(5, 24, dtype=torch.float64))              # an in-place load: the join sees it
        assert j.weight(*ps) is mat and torch.equal(mat[8:13], torch.ones(5, 24, dtype=torch.float64))
        ps[2].data = ps[2].data.clone() * 2                             # new storage: not packed any more
        assert j.packed(*ps) is None
        w = j.weight(*ps)
        assert w.data_ptr() != mat.data_ptr() and torch.equal(w[13], ps[2][0])
    joined.USE_PACKED = False
    try:
        ps2 = [torch.nn.Parameter(p.detach().clone()) for p in ps]
        j2 = JoinedWeights()
        j2.pack(ps2)
        with torch.no_grad():
            assert j2.packed(*ps2) is None and j2.weight(*ps2).data_ptr() != ps2[0].data_ptr()
    finally:
        joined.USE_PACKED = True


def test_packed_models_equal_their_unpacked_projections():
    """models/loader.py packs every join a model names (a linear layer's q | k | v | z | b | a, the attention's
    q | k | v, the router with the shared expert's inputs); the logits equal those with the projections run apart
    (USE_PACKED off: the GEMMs of before) to fp32 rounding of the same dot products (2e-6 relative: the joined GEMM
    may block its sums otherwise), and every packed join is used."""
    from hypic import LLM, Prompt
    from hypic.layers import joined

    prompt = Prompt(segments=[list(range(3, 40)), list(range(50, 90))], query=list(range(5, 12)))
    for name in ("tiny-qwen3.5-moe", "tiny-olmo-hybrid", "tiny-llama"):
        llm = LLM(name, cache_mode="full", dtype="float32")
        joins = [j for m in llm.engine.model.modules() if hasattr(m, "joined_parts") for j, _ in m.joined_parts()]
        assert joins and all(j._packed is not None for j in joins), name
        a = llm.next_token_logits(prompt)
        joined.USE_PACKED = False
        try:
            b = llm.next_token_logits(prompt)
        finally:
            joined.USE_PACKED = True
        assert float((a - b).norm() / b.norm()) < 2e-6, name
    moe = next(m for m in LLM("tiny-qwen3.5-moe", dtype="float32").engine.model.modules()
               if type(m).__name__ == "SparseMoe")
    (join, parts), = moe.joined_parts()
    assert parts[0] is moe.gate.weight and join.packed(*parts) is not None    # the router's columns come first


def test_route_from_given_logits_equals_route():
    from hypic.ops.reference.moe import route

    g = torch.Generator().manual_seed(2)
    x, w = torch.randn(7, 16, generator=g), torch.randn(12, 16, generator=g)
    for norm in (False, True):
        a, b = route(x, w, 3, norm), route(x, w, 3, norm, logits=F.linear(x, w))
        assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


@pytest.mark.parametrize("lens", [[1, 1, 1, 1, 1], [4, 4, 4]])
def test_varlen_of_one_length_is_a_view_and_equals_separate_sequences(lens):
    """Sequences of one length (a decode step: R runs of one token, CPU cu_seqlens) are laid out by a reshape,
    not a gather: no index tensor goes to the device, which a CUDA graph capture of the decode step would refuse
    (the KDA model's fp32 decode fell back to eager for that). Results equal each sequence run alone, exactly."""
    from hypic.ops.reference.gated_delta import _pad_varlen, _unpad

    cu = torch.tensor([0] + lens).cumsum(0)
    q, k, v, g, beta, _ = _inputs(1, sum(lens), 2, 2, 8, 8, seed=3)
    (pq, pk), got = _pad_varlen((q, k), cu)
    assert got == lens and pq.shape[:2] == (len(lens), lens[0]) and pq.data_ptr() == q.data_ptr()
    assert torch.equal(_unpad(pq, lens), q)
    s0 = torch.randn(len(lens), 2, 8, 8)
    gk = -torch.rand(1, sum(lens), 2, 8) * 0.1                                  # KDA: a decay per key channel
    for fn, gate in ((recurrent_gated_delta_rule, g), (recurrent_kda, gk)):
        o, s = fn(q, k, v, gate, beta, initial_state=s0, output_final_state=True, cu_seqlens=cu,
                  use_qk_l2norm_in_kernel=True)
        for i in range(len(lens)):
            sl = slice(int(cu[i]), int(cu[i + 1]))
            oi, si = fn(q[:, sl], k[:, sl], v[:, sl], gate[:, sl], beta[:, sl], initial_state=s0[i : i + 1],
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
            assert torch.equal(o[:, sl], oi) and torch.equal(s[i : i + 1], si), fn.__name__
