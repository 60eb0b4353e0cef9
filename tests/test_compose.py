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


@pytest.mark.parametrize("lengths", [[1, 2, 1, 5], [2, 2, 2], [10]])
@pytest.mark.parametrize("seam", [0, 3, 4])
def test_gdn_layer_compose_equals_sequential(lengths, seam):
    """Layer level (conv + gates + recurrence) on the same per-token inputs: running a sequence,
    versus seams forwarded in context with each segment's isolated summary of [w, L) composed in
    between. Exact when w >= W-1 (the cached part's conv warm-up lies inside the segment); for
    w < W-1 only the conv window chain is exact, and the test checks that alone."""
    from hypic.cache.entry import SegmentEntry
    from hypic.config import ModelConfig
    from hypic.layers.gdn import GatedDeltaNet
    from hypic.models.presets import preset_config
    from hypic.ops import get_backend
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.state import SeqState

    cfg = ModelConfig.from_dict(preset_config("tiny-qwen3.5"))
    torch.manual_seed(0)
    layer = GatedDeltaNet(cfg, 0, get_backend("reference")).eval()
    with torch.no_grad():
        layer.A_log.copy_(torch.empty(cfg.params.linear_num_value_heads).uniform_(0.01, 0.1).log())
        for p in (layer.in_proj_qkv, layer.in_proj_z, layer.in_proj_a, layer.in_proj_b, layer.out_proj):
            p.weight.normal_(0, 0.3)
    total = sum(lengths)
    x = torch.randn(total, cfg.hidden_size)

    def run(items_fn, xs):
        b = BatchBuilder("cpu")
        st = SeqState()
        b.add(st, items_fn(), logits="none")
        batch = b.build()
        with torch.no_grad():
            y = layer(xs, batch)
        return y, st, batch

    ids = list(range(total))
    y_ref, st_ref, _ = run(lambda: [("run", ids)], x)

    entries, a = [], 0
    for n in lengths:                                            # isolated summaries
        w = min(seam, n)
        items = [("run", ids[a : a + w]), ("run", ids[a + w : a + n], {"summarize": True})]
        _, _, batch = run(lambda: items, x[a : a + n])
        cap = batch.seqs[0].pieces[-1].captures[0] if n > w else None
        entries.append((w, n, cap))
        a += n
    items, xs, a = [], [], 0
    for w, n, cap in entries:
        items.append(("run", ids[a : a + w]))
        xs.append(x[a : a + w])
        if cap is not None:
            e = SegmentEntry(None, (), n, w, {0: cap})
            items.append(("apply", e))
        a += n
    _, st, _ = run(lambda: items, torch.cat(xs))
    torch.testing.assert_close(st.layers[0].conv, st_ref.layers[0].conv, atol=1e-6, rtol=1e-6)
    if seam >= cfg.params.linear_conv_kernel_dim - 1:
        rel = (st.layers[0].rec - st_ref.layers[0].rec).norm() / st_ref.layers[0].rec.norm()
        assert rel < 1e-5, rel
