"""Invariant 1: composition algebra. Composed segment summaries equal the sequential recurrence
on the same inputs, with slow decays (T far from 0, so a wrong transpose or order would show)."""

import pytest
import torch

from hypic.compose.transition import augment, compose, compose_chain, split_augmented, zero_start
from hypic.ops.reference import chunk_gated_delta_rule, recurrent_gated_delta_rule


def _seq(t, h=2, hv=4, dk=8, dv=6, seed=0, decay=0.02, write=0.5):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    return (r(1, t, h, dk), r(1, t, h, dk), r(1, t, hv, dv), -torch.rand(1, t, hv, generator=g) * decay,
            torch.rand(1, t, hv, generator=g) * write)


def summarize(q, k, v, g, beta, init=None):
    """(T, S(C|0)) of one segment with the appended-identity trick, via the chunk kernel."""
    hv, dk, dv = v.shape[2], k.shape[3], v.shape[3]
    init = torch.zeros(1, hv, dk, dv) if init is None else init
    v_aug, init_aug = augment(v, init, dk)
    _, final = chunk_gated_delta_rule(q, k, v_aug, g, beta, initial_state=init_aug, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, chunk_size=16)
    s_out, (t,) = split_augmented(final, dv)
    return s_out, t, zero_start(s_out, t, init)


@pytest.mark.parametrize("lengths", [[5], [1, 3, 7], [64, 130, 2, 33], [1, 1, 1, 1]])
def test_composed_summaries_equal_sequential(lengths):
    t = sum(lengths)
    q, k, v, g, beta = _seq(t)
    s_in = torch.randn(1, 4, 8, 6)
    _, ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s_in, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    pieces, a = [], 0
    for n in lengths:
        _, T, S = summarize(q[:, a : a + n], k[:, a : a + n], v[:, a : a + n], g[:, a : a + n], beta[:, a : a + n])
        pieces.append((T, S))
        a += n
    got = compose_chain(s_in, pieces)
    rel = (got - ref).norm() / ref.norm()
    assert rel < 1e-5, rel


def test_summary_with_nonzero_initial_state():
    """S(C|0) recovered from a pass started at S_in (the cold-prefill path) equals a zero start."""
    q, k, v, g, beta = _seq(40, seed=3)
    s_in = torch.randn(1, 4, 8, 6)
    s_out, T, S = summarize(q, k, v, g, beta, init=s_in)
    _, T0, S0 = summarize(q, k, v, g, beta)
    torch.testing.assert_close(T.t, T0.t, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(S, S0, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(compose(s_in, T, S), s_out, atol=1e-5, rtol=1e-5)


def test_transition_is_not_trivial_and_naive_is_wrong():
    """Sanity: with slow decay and gentle erasure T is far from 0, so naive addition is far off."""
    q, k, v, g, beta = _seq(48, seed=4, decay=0.005, write=0.1)
    s_in = torch.randn(1, 4, 8, 6)
    _, ref = recurrent_gated_delta_rule(q, k, v, g, beta, initial_state=s_in, output_final_state=True,
                                        use_qk_l2norm_in_kernel=True)
    _, T, S = summarize(q, k, v, g, beta)
    assert T.t.norm() > 0.1 * torch.eye(8).expand_as(T.t).norm()
    naive = compose(s_in, T, S, exact=False)
    assert (naive - ref).norm() / ref.norm() > 0.1
    assert (compose(s_in, T, S) - ref).norm() / ref.norm() < 1e-5


@pytest.mark.parametrize("per_channel", [True, False])
@pytest.mark.parametrize("lengths", [[5], [1, 3, 7], [64, 130, 2, 33], [1, 1, 1, 1]])
@pytest.mark.parametrize("h,hv,dk,dv", [(1, 1, 8, 8), (2, 4, 8, 6), (1, 3, 4, 1)])
def test_diagonal_and_scalar_summaries_compose(per_channel, lengths, h, hv, dk, dv):
    """Diagonal (GLA, Mamba1: a K-vector per head) and scalar (lightning, Mamba2: one number per
    head) transitions from the per-token log decays, S(C|0) from the chunk kernel: composed ==
    sequential, and naive addition is far off."""
    from hypic.compose.transition import Form, log_decay_transitions
    from hypic.ops.reference import chunk_gla, recurrent_gla

    t = sum(lengths)
    g_ = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(1, t, h, dk, generator=g_), torch.randn(1, t, h, dk, generator=g_), torch.randn(1, t, hv, dv, generator=g_)
    g = -torch.rand(1, t, hv, *((dk,) if per_channel else ()), generator=g_) * 0.05
    s_in = torch.randn(1, hv, dk, dv)
    _, ref = recurrent_gla(q, k, v, g, initial_state=s_in, output_final_state=True)
    cu = torch.tensor([0] + lengths).cumsum(0)
    _, s_zero = chunk_gla(q, k, v, g, initial_state=torch.zeros(len(lengths), hv, dk, dv), output_final_state=True,
                          cu_seqlens=cu, chunk_size=16)
    form = Form.DIAGONAL if per_channel else Form.SCALAR
    ts = log_decay_transitions(g[0], cu, form)
    assert ts[0].t.shape == ((hv, dk) if per_channel else (hv,))
    got = compose_chain(s_in, list(zip(ts, s_zero)))
    assert (got - ref).norm() / ref.norm() < 1e-5
    if t > 30:                          # enough decay for T to differ visibly from I
        naive = compose_chain(s_in, list(zip(ts, s_zero)), exact=False)
        assert (naive - ref).norm() / ref.norm() > 0.05


def test_prepaired_chain_equals_the_chain_of_runs_and_segments(monkeypatch):
    """benchmarks/scan_bench.py's `prepaired` form: each seam run composed with the cached segment after it into one
    map [T_e S_r + S_e | T_e T_r] before the scan gives the 44-step chain's states at every run's start (where the
    run's outputs are corrected) and its final state, in 24 steps (fp32 reference scans: 1e-5 relative)."""
    from pathlib import Path

    from hypic.compose.scan import scan_dense_reference

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import scan_bench as sb

    monkeypatch.setattr(sb, "H", 1)
    c = sb.chain(torch.device("cpu"))
    before, final = scan_dense_reference(c["init"], c["T"], c["S"], [0, len(c["order"])], c["order"], c["dense"])
    runs = [m for m in c["order"] if m >= sb.E]
    assert len(c["order"]) == 44 and len(runs) == 24
    b2, f2 = scan_dense_reference(c["init"], c["T"], c["S"], [0, len(runs)], runs, sb.pair_maps(c))
    rel = lambda a, b: float((a - b).norm() / b.norm())  # noqa: E731
    assert rel(f2, final) < 1e-5
    assert rel(b2[runs], before[runs]) < 1e-5
    # the order of the product matters: the run first, then the segment
    wrong = c["dense"].clone()                      # the segment first, then the run
    Sr, Tr = wrong[:sb.E, ..., :sb.V].clone(), wrong[:sb.E, ..., sb.V:].clone()
    wrong[:sb.E, ..., :sb.V] = Tr @ c["S"] + Sr
    wrong[:sb.E, ..., sb.V:] = Tr @ c["T"]
    assert rel(scan_dense_reference(c["init"], c["T"], c["S"], [0, len(runs)], runs, wrong)[1], final) > 1e-2
