"""The fast backend and the phased compose walk against their plain twins (CPU, fp32 / fp64).

The fast ops that run on any device (varlen conv, SDPA attention, grouped-GEMM MoE, the dense
chain scan's reference) are compared with the reference ops on random inputs; the phased walk
(batched compose pass) with the rounds walk on whole PIC requests of every architecture. fla's
kernels and the Triton scan need CUDA: scripts/gpu_check.py checks them on the GPU.

Tolerances: fp64 results agree to ~1e-12 (only the summation order differs): 1e-9 is asserted,
except attention, whose reference takes the softmax in fp32 (~1e-7 observed): 1e-6.
fp32 whole-model logits agree to ~1e-6; 1e-4 as in tests/test_invariants.py.
"""

import pytest
import torch

from hypic import LLM, Prompt, SamplingParams
from hypic.compose.scan import scan_chain, scan_dense, scan_dense_reference
from hypic.compose.transition import Form, Transition
from hypic.ops import fast, get_backend, reference as ref
from .conftest import rand_ids

D = torch.float64


def _rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=D)


@pytest.mark.parametrize("lens", [[5], [1, 2, 9, 3], [2, 2, 2], [40, 1, 17]])
@pytest.mark.parametrize("width", [2, 4])
def test_conv_varlen_equals_reference(lens, width):
    g = torch.Generator().manual_seed(sum(lens) + width)
    c, n = 6, sum(lens)
    x, w, b = _rand(n, c, g=g), _rand(c, width, g=g), _rand(c, g=g)
    windows = _rand(len(lens), width - 1, c, g=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    for act in ("silu", None):
        y0, w0 = ref.causal_conv1d_varlen(x, w, b, windows, cu, activation=act)
        y1, w1 = fast.causal_conv1d_varlen(x, w, b, windows, cu, activation=act)
        torch.testing.assert_close(y1, y0, atol=1e-9, rtol=0)
        torch.testing.assert_close(w1, w0, atol=0, rtol=0)
    # the new windows of runs shorter than W-1 keep part of the old window
    assert torch.equal(w0[0, -1], x[lens[0] - 1])


def test_conv_layout_made_in_inference_mode_serves_autograd():
    """The varlen conv's index tables are cached per layout. A serving forward (inference mode) that makes
    them first must not leave inference tensors that a later training forward of the same layout (the PIC
    tune) saves for backward; the gradient equals the reference op's."""
    g = torch.Generator().manual_seed(7)
    lens, c, width = [3, 11, 6], 5, 4       # a layout no other test uses: this test makes its tables
    x, w, b = _rand(sum(lens), c, g=g), _rand(c, width, g=g), _rand(c, g=g)
    windows = _rand(len(lens), width - 1, c, g=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    with torch.inference_mode():
        fast.causal_conv1d_varlen(x, w, b, windows, cu)
    grads = []
    for op in (fast, ref):
        xg = x.clone().requires_grad_(True)
        y, _ = op.causal_conv1d_varlen(xg, w, b, windows, cu)
        y.square().sum().backward()
        grads.append(xg.grad)
    torch.testing.assert_close(grads[0], grads[1], atol=1e-9, rtol=0)


def test_recurrent_entry_under_autograd_equals_the_recurrent_reference():
    """Under autograd the fast backend's recurrent gated delta rule runs the chunked reference (the recurrent one
    keeps a state per token for backward: the PIC tune ran out of memory). Same outputs, final states and
    gradients as the token-by-token reference, varlen with initial states. Both compute in fp32 with another
    summation order over <= 13 tokens: differences of 1e-7 to 4e-7 of each tensor's largest value observed
    (up to 1.5e-5 on the decay's gradient, whose entries reach 110); atol = rtol = 1e-5 asserted."""
    g_ = torch.Generator().manual_seed(3)
    lens, h, dk, dv = [5, 13, 1], 2, 8, 6
    n = sum(lens)
    cu = torch.tensor([0] + lens).cumsum(0)
    f32 = lambda *s: torch.randn(*s, generator=g_)      # noqa: E731
    inputs = dict(q=f32(1, n, h, dk), k=f32(1, n, h, dk), v=f32(1, n, h, dv),
                  g=-torch.rand(1, n, h, generator=g_) * 0.1, beta=torch.rand(1, n, h, generator=g_),
                  initial_state=f32(len(lens), h, dk, dv))
    results = []
    for fn in (fast.recurrent_gated_delta_rule, ref.recurrent_gated_delta_rule):
        xs = {k: t.clone().requires_grad_(True) for k, t in inputs.items()}
        o, final = fn(**xs, output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        (o.square().sum() + final.square().sum()).backward()
        results.append([o, final] + [xs[k].grad for k in inputs])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2), (6, 1)])
def test_attention_equals_reference(h, hkv, monkeypatch):
    g = torch.Generator().manual_seed(h * 10 + hkv)
    d = 8
    # a fresh sequence: keys are the queries' tokens (the flash / causal path)
    n = 37
    q, k, v = _rand(n, h, d, g=g), _rand(n, hkv, d, g=g), _rand(n, hkv, d, g=g)
    pos = torch.arange(n)
    o0 = ref.position_attention(q, k, v, pos, pos, scale=0.3)
    o1 = fast.position_attention(q, k, v, pos, pos, scale=0.3, contiguous=True)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)
    # queries scattered among placed keys (seams and a query after cached segments), chunked masks
    nk = 90
    k, v = _rand(nk, hkv, d, g=g), _rand(nk, hkv, d, g=g)
    k_pos = torch.arange(nk)
    q_pos = torch.tensor([3, 4, 5, 40, 41, 70, 71, 72, 88, 89])
    q = _rand(len(q_pos), h, d, g=g)
    o0 = ref.position_attention(q, k, v, q_pos, k_pos, scale=0.3)
    # explicit scores (few queries); SDPA with a mask in one call; in several query chunks
    for scores_bytes, mask_bytes in ((1 << 30, 1 << 28), (0, 1 << 28), (0, 7 * (h // hkv) * nk)):
        monkeypatch.setattr(fast, "_SCORES_BYTES", scores_bytes)
        monkeypatch.setattr(fast, "_MASK_BYTES", mask_bytes)
        o1 = fast.position_attention(q, k, v, q_pos, k_pos, scale=0.3)
        torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_experts_equal_reference(dtype):
    """Relative error ||fast - ref|| / ||ref||: fp32, summation order only (~1e-7; 1e-5 asserted);
    bf16, the reference rounds each expert's weighted output to bf16 before adding, the fast path
    sums in fp32: a few bf16 ulps (eps 2^-8 = 3.9e-3; 1e-2 asserted)."""
    g = torch.Generator().manual_seed(3)
    n, hd, i, e, k = 23, 16, 8, 6, 2
    x = torch.randn(n, hd, generator=g).to(dtype)
    router = torch.randn(e, hd, generator=g).to(dtype)
    gate_up, down = torch.randn(e, 2 * i, hd, generator=g).to(dtype), torch.randn(e, hd, i, generator=g).to(dtype)
    weights, experts = ref.route(x, router, k, True)
    experts[0] = torch.tensor([5, 5 - 1])                               # experts with no token stay empty
    y0 = ref.experts_forward(x, weights, experts, gate_up, down)
    y1 = fast.experts_forward(x, weights, experts, gate_up, down)
    err = (y1.float() - y0.float()).norm() / y0.float().norm()
    assert err < (1e-5 if dtype is torch.float32 else 1e-2), err
    # GLM-5 Next's clamped SwiGLU (gate <= 1, up in [-1, 1]: most of these inputs are clamped), the same bounds
    c0 = ref.experts_forward(x, weights, experts, gate_up, down, 1.0)
    c1 = fast.experts_forward(x, weights, experts, gate_up, down, 1.0)
    assert (c1.float() - c0.float()).norm() / c0.float().norm() < (1e-5 if dtype is torch.float32 else 1e-2)
    assert (c0.float() - y0.float()).norm() / y0.float().norm() > 0.1
    # a shared expert's output, gated by a sigmoid, added by the combine (Qwen's MoE blocks)
    scale = float(y0.float().abs().mean())                          # (the shared output as large as the routed one)
    shared = (torch.randn(n, 1, generator=g).to(dtype), (torch.randn(n, hd, generator=g) * scale).to(dtype))
    s0 = ref.experts_forward(x, weights, experts, gate_up, down, shared=shared)
    s1 = fast.experts_forward(x, weights, experts, gate_up, down, shared=shared)
    assert (s1.float() - s0.float()).norm() / s0.float().norm() < (1e-5 if dtype is torch.float32 else 1e-2)
    assert (s0.float() - y0.float()).norm() / y0.float().norm() > 0.1


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_plain_grouped_experts_equal_reference(dtype):
    """Nemotron 3's non-gated relu² experts, grouped GEMMs against the loop; bounds as for the gated experts (and
    sizes whose rows are not 16-byte aligned take the loop)."""
    g = torch.Generator().manual_seed(4)
    n, hd, i, e, k = 29, 16, 24, 8, 3
    x = torch.randn(n, hd, generator=g).to(dtype)
    up, down = torch.randn(e, i, hd, generator=g).to(dtype), torch.randn(e, hd, i, generator=g).to(dtype)
    weights, experts = ref.route_grouped_sigmoid(x, torch.randn(e, hd, generator=g), torch.zeros(e), k, 2, 1, True,
                                                 2.5)
    y0 = ref.experts_forward_plain(x, weights.to(dtype), experts, up, down)
    y1 = fast.experts_forward_plain(x, weights.to(dtype), experts, up, down)
    err = (y1.float() - y0.float()).norm() / y0.float().norm()
    assert err < (1e-5 if dtype is torch.float32 else 1e-2), err


def test_dense_scan_equals_chain():
    g = torch.Generator().manual_seed(5)
    h, k, v, cu = 3, 5, 4, [0, 3, 3, 7]
    init = _rand(len(cu) - 1, h, k, v, g=g)
    T, S = _rand(cu[-1], h, k, k, g=g) / 3, _rand(cu[-1], h, k, v, g=g)
    before, final = scan_dense(init, T, S, cu)                            # on CPU: the reference
    b0, f0 = scan_dense_reference(init, T, S, cu)
    assert torch.equal(before, b0) and torch.equal(final, f0)
    for r in range(len(cu) - 1):
        maps = [(Transition(Form.DENSE, T[j]), S[j]) for j in range(cu[r], cu[r + 1])]
        bb, ff = scan_chain(init[r], maps)
        torch.testing.assert_close(final[r], ff.float(), atol=1e-6, rtol=0)
        for j, st in zip(range(cu[r], cu[r + 1]), bb):
            torch.testing.assert_close(before[j], st.float(), atol=1e-6, rtol=0)


def test_backend_names():
    assert get_backend("auto") is get_backend("fast")
    assert get_backend("reference").name == "reference"


def _requests(seed):
    segs = [rand_ids(n, seed + i) for i, n in enumerate((2, 3, 40, 130, 5, 40))]
    return [Prompt(prefix=rand_ids(12, seed + 50), segments=segs + [segs[2]], query=rand_ids(6, seed + 60)),
            Prompt(segments=segs[::-1], query=rand_ids(3, seed + 70)),
            Prompt(segments=[segs[1], segs[0], segs[1]], query=rand_ids(4, seed + 80))]


@pytest.mark.parametrize("mode", ["pic", "naive"])
def test_phased_walk_equals_rounds(hf_checkpoints, arch, mode):
    """The batched compose pass (3 phases) == the plain walk, prefill and decode, several requests in
    one batch, short segments (conv windows spanning several pieces), repeated segments."""
    path = hf_checkpoints[arch][1]
    outs = {}
    for walk in ("rounds", "phased"):
        llm = LLM(str(path), cache_mode=mode, seam=4, walk=walk)
        outs[walk] = llm.generate(_requests(1), SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True))
    for a, b in zip(outs["rounds"], outs["phased"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)


def test_reference_backend_equals_fast(hf_checkpoints):
    path = hf_checkpoints["qwen3_5_moe"][1] if "qwen3_5_moe" in hf_checkpoints else next(iter(hf_checkpoints.values()))[1]
    outs = [LLM(str(path), backend=b).generate(_requests(2), SamplingParams(max_tokens=3, return_logits=True))
            for b in ("reference", "fast")]
    for a, b in zip(*outs):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("mode", ["prefix", "pic"])
def test_one_call_walk_for_long_chains_equals_rounds(hf_checkpoints, monkeypatch, mode):
    """On CUDA the readout walk also takes chains of long runs (prefix-mode spans): forced here on the CPU,
    it equals the rounds walk, and the prefix-cache states it captures serve later requests identically.
    Isolated prefills of Gated DeltaNet layers take their own one-pass form (LinearMixer._forward_isolated)
    before it."""
    from hypic.layers import linear

    path = hf_checkpoints["qwen3_5"][1]
    first, again = _requests(6), _requests(6)
    again = [Prompt(prefix=p.prefix, segments=p.segments[:1] + p.segments[1:][::-1], query=p.query) for p in again]
    sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    seen = []                     # per readout call: (longest non-last run, any run summarized for the cache)
    orig = linear.LinearMixer._forward_readout

    def spy(self, x, f, batch):
        runs = [r for s in batch.seqs for r in s.runs]
        seen.append((max((r.n for s in batch.seqs for r in s.runs[:-1]), default=0), any(r.summarize for r in runs)))
        return orig(self, x, f, batch)

    monkeypatch.setattr(linear.LinearMixer, "_forward_readout", spy)
    outs = {}
    for walk in ("rounds", "phased"):
        monkeypatch.setattr(linear, "LONG_CHAINS_EVERYWHERE", walk == "phased")
        llm = LLM(str(path), cache_mode=mode, seam=4, walk=walk)
        outs[walk] = llm.generate(first, sp) + llm.generate(again, sp)
    if mode == "prefix":                          # long chains did take the one-call walk
        assert max(n for n, _ in seen) > 64
    else:                                         # isolated prefills of cold segments did not (one pass)
        assert seen and not any(summ for _, summ in seen)
    for a, b in zip(outs["rounds"], outs["phased"]):
        assert a.token_ids == b.token_ids and a.prefix_tokens == b.prefix_tokens
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)


def test_long_chains_bounded_by_corrected_tokens():
    """The one-call walk takes a long chain only while the tokens it must correct (every run that does
    not open its sequence) stay few; past that, the rounds walk (and its per-span calls) is cheaper."""
    from hypic.layers import linear
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.state import SeqState

    def batch(lens):
        b = BatchBuilder("cpu")
        b.add(SeqState(), [("run", [1] * n, {"mark": True}) for n in lens])
        return b.build()

    limit = linear._CORRECTED_TOKENS
    assert linear._phased_ok(batch([8, 500, 600]), long_chains=True)
    assert not linear._phased_ok(batch([8, limit + 1]), long_chains=True)          # an 8k isolated prefill
    assert linear._phased_ok(batch([limit + 1, 8]), long_chains=True)              # the first run needs none
    assert not linear._phased_ok(batch([8, 500]), long_chains=False)


def test_phased_walk_for_chains_past_the_readout_bound(hf_checkpoints, monkeypatch):
    """linear.LONG_CHAINS_PHASED: a prefix-mode chain of long spans past the readout walk's bound goes through the
    phased walk (the spans' zero-start summaries in one call, the chain, every span from its initial state) instead
    of rounds, forced here on the CPU: the same tokens, logits within 1e-4 of rounds (fp32; the chain composes each
    span's state as T S0 + S instead of running on from the previous span's final state), and the prefix-cache
    states it captures serve later requests (prefix hits) the same way."""
    from hypic.layers import linear

    path = hf_checkpoints["qwen3_5"][1]
    first, again = _requests(6), _requests(6)
    again = [Prompt(prefix=p.prefix, segments=p.segments[:2] + p.segments[2:][::-1], query=p.query) for p in again]
    sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    seen = []                                  # per phased call: the longest run some later run depends on
    orig = linear.LinearMixer._forward_phased

    def spy(self, x, f, batch):
        seen.append(max((r.n for s in batch.seqs for r in s.runs[:-1]), default=0))
        return orig(self, x, f, batch)

    monkeypatch.setattr(linear.LinearMixer, "_forward_phased", spy)
    monkeypatch.setattr(linear, "_CORRECTED_TOKENS", 0)          # past the readout walk's bound at any length
    outs = {}
    for on in (False, True):
        monkeypatch.setattr(linear, "LONG_CHAINS_EVERYWHERE", on)
        monkeypatch.setattr(linear, "LONG_CHAINS_PHASED", on)
        llm = LLM(str(path), cache_mode="prefix", walk="phased" if on else "rounds")
        outs[on] = llm.generate(first, sp) + llm.generate(again, sp)
    assert seen and max(seen) > linear._SHORT_RUN                   # long spans took the phased walk
    assert any(o.prefix_tokens > 0 for o in outs[True])              # and later requests hit what it cached
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids and a.prefix_tokens == b.prefix_tokens
        torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)


@pytest.mark.parametrize("h,hkv", [(4, 4), (4, 2)])
@pytest.mark.parametrize("past,nk", [("scores_bytes", 50), ("many_queries", 50), ("scores_bytes", 20),
                                     ("many_queries", 20)])
def test_attention_continuing_an_ordered_prefix(h, hkv, past, nk, monkeypatch):
    """Keys in position order that end with the queries' own tokens (a request continuing a cached
    prefix): causal attention aligned at the bottom right, equal to the masked reference, off the explicit-score
    form both past its size and (with explicit scores that would fit) from _MANY_CONTINUING queries on; with at
    most as many held keys as queries (nk 20, 13 queries) as a square causal SDPA over front-padded queries, without
    a mask."""
    g = torch.Generator().manual_seed(h + hkv)
    d, nq = 8, 13
    q, k, v = _rand(nq, h, d, g=g), _rand(nk, hkv, d, g=g), _rand(nk, hkv, d, g=g)
    k_pos, q_pos = torch.arange(nk), torch.arange(nk - nq, nk)
    o0 = ref.position_attention(q, k, v, q_pos, k_pos, scale=0.3)
    if past == "scores_bytes":
        monkeypatch.setattr(fast, "_SCORES_BYTES", 0)
    else:
        monkeypatch.setattr(fast, "_MANY_CONTINUING", nq)

    def no_scores(*a, **kw):
        raise AssertionError("the explicit-score form ran")

    calls, sdpa = [], fast.F.scaled_dot_product_attention

    def spy(*a, **kw):
        calls.append((kw.get("is_causal", False), kw.get("attn_mask") is not None))
        return sdpa(*a, **kw)

    monkeypatch.setattr(fast, "_scaled_scores", no_scores)
    monkeypatch.setattr(fast.F, "scaled_dot_product_attention", spy)
    o1 = fast.position_attention(q, k, v, q_pos, k_pos, scale=0.3, contiguous=True)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)
    assert calls and all(c == ((True, False) if nk - nq <= nq else (False, True)) for c in calls)


def test_prefix_continuation_takes_the_ordered_path(hf_checkpoints, monkeypatch):
    """A prefix-cache hit continues an ordered buffer (the bottom-right causal path); a request with
    placed segments never does; both equal `full`."""
    from hypic.layers.attention import AttentionMixer

    seen = []
    orig = AttentionMixer.attend

    def spy(self, q, k, v, q_pos, k_pos, contiguous=False):
        seen.append((contiguous, q.shape[0], k.shape[0]))
        return orig(self, q, k, v, q_pos, k_pos, contiguous)

    monkeypatch.setattr(AttentionMixer, "attend", spy)
    path = hf_checkpoints["qwen3_5"][1]
    p = _requests(4)[0]
    sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    full = LLM(str(path), cache_mode="full").generate([p], sp)[0]
    llm = LLM(str(path), cache_mode="prefix")
    llm.generate([p], sp)
    seen.clear()
    hit = llm.generate([p], sp)[0]
    assert hit.prefix_tokens > 0
    assert any(c and nq < nk for c, nq, nk in seen)       # continued a cached prefix on the ordered path
    torch.testing.assert_close(hit.logits, full.logits, atol=1e-4, rtol=0)
    seen.clear()
    LLM(str(path), cache_mode="pic", seam=4).generate([p], sp)
    assert not any(c and nq < nk for c, nq, nk in seen if nq > 1)   # placed segments: the masked path


@pytest.mark.parametrize("nq", [8, 40])
def test_cpu_attention_at_placed_positions(nq, monkeypatch):
    """Queries at arbitrary positions over keys placed anywhere (the compose pass): on the CPU explicit scores for
    fewer than _CPU_EXPLICIT_QUERIES queries, SDPA over masked blocks from there; both equal the reference."""
    g = torch.Generator().manual_seed(nq)
    h, hkv, d, nk = 4, 2, 8, 100
    q, k, v = _rand(nq, h, d, g=g), _rand(nk, hkv, d, g=g), _rand(nk, hkv, d, g=g)
    k_pos = torch.randperm(nk, generator=g)
    q_pos = torch.randint(0, nk, (nq,), generator=g)
    o0 = ref.position_attention(q, k, v, q_pos, k_pos, scale=0.3)
    used, scores = [], fast._scaled_scores

    def spy(*a, **kw):
        used.append(True)
        return scores(*a, **kw)

    monkeypatch.setattr(fast, "_scaled_scores", spy)
    o1 = fast.position_attention(q, k, v, q_pos, k_pos, scale=0.3)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)
    assert bool(used) == (nq < fast._CPU_EXPLICIT_QUERIES)


@pytest.mark.parametrize("held", [40, 400])
def test_long_prefix_continuation_equals_full(hf_checkpoints, held):
    """A prefix-cache hit followed by 300 new tokens (past _MANY_CONTINUING): with fewer held keys than queries the
    square causal form over front-padded queries, with more the masked blocks; either way the logits equal `full`
    (fp32, 1e-4 as the other engine-level comparisons)."""
    path = hf_checkpoints["qwen3_5"][1]
    first, rest = rand_ids(held, 71), rand_ids(300, 72)
    sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    warm = Prompt(segments=[first, rand_ids(20, 73)], query=rand_ids(4, 74))
    p = Prompt(segments=[first, rest], query=rand_ids(6, 75))
    full = LLM(str(path), cache_mode="full").generate([p], sp)[0]
    llm = LLM(str(path), cache_mode="prefix")
    llm.generate([warm], sp)
    hit = llm.generate([p], sp)[0]
    assert hit.prefix_tokens == held and hit.recomputed_tokens >= fast._MANY_CONTINUING
    assert hit.token_ids == full.token_ids
    torch.testing.assert_close(hit.logits, full.logits, atol=1e-4, rtol=0)


def test_device_fault_is_raised_not_skipped(monkeypatch):
    """A kernel that faulted on the device (the CUDA context is lost) raises with the kernel's name, from the
    tuner (which skips only configurations that cannot be built) and from kernel_failed (no PyTorch form can run
    after it); a build failure is still skipped / recorded."""
    from hypic.ops import fast, tuning

    fault = RuntimeError("Triton Error [CUDA]: an illegal memory access was encountered")
    assert tuning.is_device_fault(fault) and not tuning.is_device_fault(RuntimeError("out of resource: shared memory"))

    def launch(cfg):
        raise fault

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    with pytest.raises(RuntimeError, match="illegal memory access"):
        tuning.tuned_config({}, "k", [(1,), (2,)], torch.device("cuda"), launch, torch.zeros(1), (1,), 1e-5)
    monkeypatch.setattr(fast, "FAILED", set())
    with pytest.raises(RuntimeError, match="'transitions' faulted on the device"):
        fast.kernel_failed("transitions", fault)
    assert "transitions" not in fast.FAILED
    fast.kernel_failed("transitions", RuntimeError("out of resource: shared memory"))
    assert "transitions" in fast.FAILED


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window_attention_equals_reference(window):
    """The fast backend's windowed attention (masked blocks with the window in the mask) against the reference, for
    queries continuing held keys and for keys in any order (placed segments); 1e-6 in fp32."""
    g = torch.Generator().manual_seed(7)
    nq, nk, h, hkv, d = 37, 90, 4, 2, 8
    q, k, v = _rand(nq, h, d, g=g), _rand(nk, hkv, d, g=g), _rand(nk, hkv, d, g=g)
    k_pos = torch.randperm(nk, generator=g)
    q_pos = torch.sort(k_pos[torch.randperm(nk, generator=g)[:nq]]).values          # each query's own key is there
    o0 = ref.position_attention(q, k, v, q_pos, k_pos, scale=0.3, window=window)
    o1 = fast.position_attention(q, k, v, q_pos, k_pos, scale=0.3, window=window)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)
    assert not torch.allclose(o0, ref.position_attention(q, k, v, q_pos, k_pos, scale=0.3), atol=1e-3) or window > nk
