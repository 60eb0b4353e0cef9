"""Invariant 1 for every linear family, at the mixer level: conv + gates + recurrence on the same
per-token inputs. A sequence is run in one piece, then as segments the way the engine composes
them: each segment's seam [0, w) forwarded in context and its isolated summary of [w, L) (built
from positions 0..L-1 and a zero state) applied in between.

Parametrized over families (dense: Gated DeltaNet, KDA; scalar: lightning, Mamba2; diagonal:
Mamba1, Zamba's multi-head Mamba1, RecurrentGemma's RG-LRU; RoPE'd lightning, MiniMax layout and Ring-linear's), shapes (heads, key / value dims,
value heads per key head), seams and segment lengths down to 1 (shorter than the conv window,
and chains of such segments); LFM2's short conv (no state) has its own window-chain test.

Tolerances: fp32 everywhere; the composed and the sequential state differ only in summation
order (chunk boundaries move, S(C|0) = S_out - T S_in subtracts), observed ~1e-7 relative; we
assert 1e-5. Where the composition is exact by construction, naive addition must be > 10% off.
"""

import pytest
import torch

from hypic.cache.entry import SegmentEntry
from hypic.compose.transition import Form
from hypic.config import ModelConfig
from hypic.models.presets import preset_config
from hypic.ops import get_backend
from hypic.runtime.batch import BatchBuilder
from hypic.runtime.state import SeqState

OPS = get_backend("reference")


def _gdn(h, r, dk, dv):
    from hypic.layers.gdn import GatedDeltaNet

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-qwen3.5"), linear_num_key_heads=h,
                                     linear_num_value_heads=h * r, linear_key_head_dim=dk, linear_value_head_dim=dv))
    layer = GatedDeltaNet(cfg, 0, OPS)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.1).log())
    return cfg, layer


def _kda(h, r, dk, dv):
    from hypic.layers.kda import KimiDeltaAttention

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-kimi-linear"), linear_num_heads=h, linear_head_dim=dk))
    layer = KimiDeltaAttention(cfg, 0, OPS)
    with torch.no_grad():
        layer.forget_gate.A_log.copy_(torch.empty_like(layer.forget_gate.A_log).uniform_(0.01, 0.1).log())
        layer.forget_gate.dt_bias.uniform_(-2.0, 0.0)
    return cfg, layer


def _lightning(h, r, dk, dv, rope=False):
    from hypic.layers.lightning import LightningAttention
    from hypic.layers.rope import Rotary

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-minimax"), num_attention_heads=h, head_dim=dk))
    rotary = Rotary(cfg, dk, {"rope_type": "default", "rope_theta": 10000.0}) if rope else None
    layer = LightningAttention(cfg, 0, OPS, rotary=rotary)
    layer.slopes = torch.empty(h).uniform_(0.005, 0.05)          # slow decays: T far from 0
    return cfg, layer


def _ring(h, r, dk, dv):
    """Ring-linear's layer: fused qkv, q/k norm, partial RoPE (half the head), group-normed output."""
    from hypic.layers.lightning import BailingLinearAttention
    from hypic.layers.rope import Rotary

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-ring-linear"), num_attention_heads=h, head_dim=dk,
                                     group_norm_size=1))
    p = cfg.params
    layer = BailingLinearAttention(cfg, 0, OPS, Rotary(cfg, p.rotary_dim, dict(p.rope_parameters)))
    layer.slopes = torch.empty(h).uniform_(0.005, 0.05)          # slow decays: T far from 0
    return cfg, layer


def _mamba2(h, r, dk, dv):
    from hypic.layers.mamba2 import Mamba2Mixer

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-nemotron-h"), mamba_num_heads=h * r, n_groups=h,
                                     ssm_state_size=dk, mamba_head_dim=dv))
    layer = Mamba2Mixer(cfg, 0, OPS)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.1).log())
        layer.dt_bias.uniform_(-2.0, 0.0)
        layer.D.mul_(0.1)
    return cfg, layer


def _mamba1(h, r, dk, dv):
    """Every channel is a head with K = d_state and V = 1 (heads = expand * hidden)."""
    from hypic.layers.mamba1 import Mamba1Mixer

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-jamba"), mamba_d_state=dk, mamba_expand=h))
    layer = Mamba1Mixer(cfg, 0, OPS)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.1).log())
        layer.dt_proj.bias.uniform_(-2.0, 0.0)
        layer.D.mul_(0.1)
    return cfg, layer


def _mamba1_heads(h, r, dk, dv):
    """Zamba's multi-head Mamba1: h Mamba heads (one key head each: B and C per head), each serving its channels."""
    from hypic.layers.mamba1 import MultiHeadMamba1Mixer

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-zamba"), mamba_d_state=dk, n_mamba_heads=h, mamba_expand=r))
    layer = MultiHeadMamba1Mixer(cfg, 0, OPS)
    with torch.no_grad():
        layer.A_log.copy_(torch.empty_like(layer.A_log).uniform_(0.01, 0.1).log())
        layer.dt_proj_bias.uniform_(-2.0, 0.0)
        layer.x_proj_weight.normal_(0.0, 0.3)
        layer.dt_proj_weight.normal_(0.0, 0.3)
        layer.D.mul_(0.1)
    return cfg, layer


def _rglru(h, r, dk, dv):
    """RecurrentGemma's RG-LRU: h gate blocks of dk channels (lru_width h * dk); every channel a head, K = V = 1."""
    from hypic.layers.rglru import RGLRUMixer

    cfg = ModelConfig.from_dict(dict(preset_config("tiny-recurrent-gemma"), num_attention_heads=h, lru_width=h * dk))
    layer = RGLRUMixer(cfg, 0, OPS)
    with torch.no_grad():
        g = layer.rg_lru
        g.recurrent_param.uniform_(-6.0, -3.0)                 # slow decays: T far from 0
        for w in (g.input_gate_weight, g.recurrent_gate_weight):
            w.normal_(0.0, 0.3)
        for b in (g.input_gate_bias, g.recurrent_gate_bias, layer.conv_1d.bias):
            b.normal_(0.0, 0.1)
        layer.conv_1d.weight.normal_(0.0, 0.5)
    return cfg, layer


FAMILIES = {"gdn": _gdn, "kda": _kda, "lightning": _lightning, "mamba2": _mamba2, "mamba1": _mamba1,
            "mamba1_heads": _mamba1_heads, "lightning_rope": lambda *a: _lightning(*a, rope=True), "ring_linear": _ring,
            "rglru": _rglru}
SHAPES = [(1, 1, 8, 8), (2, 2, 16, 8), (2, 1, 4, 12)]       # (key heads, value heads per key head, K, V)


def _layer(family, shape, seed=0):
    torch.manual_seed(seed)
    h, r, dk, dv = shape
    if family in ("kda", "lightning", "lightning_rope", "ring_linear", "rglru"):
        r, dv = 1, dk                                          # one head count, K == V in these families
    cfg, layer = FAMILIES[family](h, r, dk, dv)
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if name.endswith("weight") and p.dim() == 2:
                p.normal_(0, 0.3)
            elif name.endswith("conv1d.weight"):
                p.normal_(0, 0.5)
    return cfg, layer.eval()


def _forward(layer, items, xs, state=None):
    b = BatchBuilder("cpu")
    st = state or SeqState()
    b.add(st, items, logits="none")
    batch = b.build()
    with torch.no_grad():
        y = layer(xs, batch)
    return y, st, batch


def _compose(layer, x, lengths, seam, *, exact=True, origin=0):
    """The engine's way: isolated summaries of every segment's [w, L), then seams + applies. origin > 0: each
    isolated prefill first runs `origin` other rows (an anchor, CachePolicy.anchor), so the segment sits at
    positions origin.. there."""
    L = layer.layer_idx
    ids = list(range(x.shape[0]))
    pad = torch.randn(origin, x.shape[1], generator=torch.Generator().manual_seed(5))
    entries, a = [], 0
    for n in lengths:
        w = min(seam, n)
        items = [("run", ids[a : a + w]), ("run", ids[a + w : a + n], {"summarize": True})]
        if origin:
            items.insert(0, ("run", list(range(origin))))
        _, _, batch = _forward(layer, items, torch.cat([pad, x[a : a + n]]))
        entries.append((w, n, batch.seqs[0].pieces[-1].captures.get(L) if n > w else None))
        a += n
    items, xs, a = [], [], 0
    for w, n, part in entries:
        items.append(("run", ids[a : a + w]))
        xs.append(x[a : a + w])
        if part is not None:
            items.append(("apply", SegmentEntry(None, (), n, w, {L: part}, origin=origin)))
        a += n
    b = BatchBuilder("cpu")
    st = SeqState()
    b.add(st, items, logits="none")
    batch = b.build(exact_transition=exact)
    with torch.no_grad():
        layer(torch.cat(xs), batch)
    return st.layers[L], entries


@pytest.mark.parametrize("lengths", [[1, 2, 1, 5], [2, 2, 2], [3, 40, 1, 17], [10]])
@pytest.mark.parametrize("seam", [0, 3, 4])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_layer_compose_equals_sequential(family, shape, seam, lengths):
    """Exact whenever the cached part's conv warm-up lies inside the segment (w >= W-1, or no conv);
    for w < W-1 only the conv window chain is exact (docs/algorithm.md section 5), and the test
    checks that alone. Segments shorter than the window and chains of them are included."""
    cfg, layer = _layer(family, shape)
    x = torch.randn(sum(lengths), cfg.hidden_size)
    _, ref, _ = _forward(layer, [("run", list(range(x.shape[0])))], x)
    ref = ref.layers[layer.layer_idx]
    got, _ = _compose(layer, x, lengths, seam)
    if layer.conv_width:
        torch.testing.assert_close(got.conv, ref.conv, atol=1e-6, rtol=1e-6)
    if not layer.conv_width or seam >= layer.conv_width - 1:
        rel = (got.rec - ref.rec).norm() / ref.rec.norm()
        assert rel < 1e-5, rel


@pytest.mark.parametrize("family", list(FAMILIES))
def test_naive_addition_is_wrong_and_storage_matches_the_form(family):
    """The straw man for every family: state + S instead of T @ state + S, on the same inputs where
    T composition is exact. And each form stores only its own size: scalar [H], dense [H, K, K]."""
    cfg, layer = _layer(family, (2, 2, 8, 8))
    lengths = [40, 30, 50]
    x = torch.randn(sum(lengths), cfg.hidden_size)
    _, ref, _ = _forward(layer, [("run", list(range(x.shape[0])))], x)
    ref = ref.layers[layer.layer_idx].rec
    exact, entries = _compose(layer, x, lengths, seam=4)
    naive, _ = _compose(layer, x, lengths, seam=4, exact=False)
    assert (exact.rec - ref).norm() / ref.norm() < 1e-5
    assert (naive.rec - ref).norm() / ref.norm() > 0.1
    h, k, v = layer.state_shape
    t = entries[0][2].T
    assert t.form is layer.form
    assert t.t.shape == {Form.SCALAR: (h,), Form.DIAGONAL: (h, k), Form.DENSE: (h, k, k)}[layer.form]


@pytest.mark.parametrize("origin", [0, 7])
@pytest.mark.parametrize("family,dims", [("lightning_rope", (2, 1, 8, 8)), ("ring_linear", (2, 1, 16, 16))])
def test_rope_state_needs_the_rotation(family, dims, origin):
    """RoPE'd lightning (MiniMax layout with rotated keys; Ring-linear's partial RoPE): the summary is
    stored at the position the segment had in its isolated prefill (0, or its anchor's length `origin`);
    composition with S' = R(start - origin) S is exact (offsets -7, 13 and 38 with origin 7), and without
    the rotation it is far off (so the rotation tests above can fail)."""
    cfg, layer = _layer(family, dims)
    lengths = [20, 25, 30]
    x = torch.randn(sum(lengths), cfg.hidden_size)
    _, ref, _ = _forward(layer, [("run", list(range(x.shape[0])))], x)
    ref = ref.layers[layer.layer_idx].rec
    rotated, _ = _compose(layer, x, lengths, seam=2, origin=origin)
    assert (rotated.rec - ref).norm() / ref.norm() < 1e-5
    layer.key_rotation = lambda offset: None
    unrotated, _ = _compose(layer, x, lengths, seam=2)
    assert (unrotated.rec - ref).norm() / ref.norm() > 0.1


@pytest.mark.parametrize("lengths", [[1, 2, 1, 5], [2, 2, 2], [3, 40, 1, 17], [10]])
@pytest.mark.parametrize("seam", [0, 1, 2, 3])
def test_short_conv_window_chain(seam, lengths):
    """LFM2's gated short conv keeps no recurrent state: its PIC is the conv warm-up alone. The window
    handed on through seams and cached tails equals the sequential one for every seam and segment
    length (shorter than the window, chains of such segments), and an entry stores no state: its
    T and S are empty, only the conv tail has bytes."""
    from hypic.layers.short_conv import ShortConv

    torch.manual_seed(0)
    cfg = ModelConfig.from_dict(preset_config("tiny-lfm2"))
    layer = ShortConv(cfg, 0, OPS).eval()
    x = torch.randn(sum(lengths), cfg.hidden_size)
    _, ref, _ = _forward(layer, [("run", list(range(x.shape[0])))], x)
    got, entries = _compose(layer, x, lengths, seam)
    # the window rows are in_proj outputs: GEMMs over other row counts here than in the sequential run, which
    # BLAS may block differently (last-bit differences on an AVX-512 CPU, 5e-7): fp32 rounding bounds,
    # torch.testing's fp32 defaults (a wrong window row would be off by O(1))
    torch.testing.assert_close(got.conv, ref.layers[0].conv, atol=1e-5, rtol=1.3e-6)
    for w, n, part in entries:
        if part is not None:
            assert part.T.t.numel() == 0 and part.S.numel() == 0
            assert part.nbytes == part.tail.element_size() * part.tail.numel()
