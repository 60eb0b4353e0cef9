"""The fixed-buffer compose pass (runtime/compose_graph.py), which CUDA graphs replay.

On the CPU the same buffers run eagerly; one request at a time, they must give the planned walk's
tokens and logits (prefill and the decode after it, whose states the pass hands over), for every
architecture the lowering takes, and leave every other request to the planned walk."""

import pytest
import torch

from hypic import LLM, Prompt, SamplingParams
from hypic.runtime.compose_graph import ComposeShape, lower

from .test_fast import _requests
from .conftest import rand_ids

# fp32 on the CPU: the fixed-buffer pass runs the same recurrences as the planned walk on
# differently shaped tensors (a gathered conv instead of a varlen one, padded runs in the readout
# correction, the chain scanned through a slot order); sums differ in order only (~1e-6 relative
# per op), and a few decode steps of a random 4-6 layer model keep that under 1e-4 on logits ~1.
ATOL = 1e-4
GRAPH_ARCHS = {"qwen3_5", "qwen3_5_moe", "qwen3_next", "olmo_hybrid", "llama", "qwen2",   # GDN hybrids, transformers
               "kimi_linear", "bailing_hybrid"}                                          # KDA hybrids


def _one_by_one(llm, prompts, n=5):
    return [llm.generate([p], SamplingParams(max_tokens=n, return_logits=True, ignore_eos=True))[0] for p in prompts]


def _prompts(seed):
    """Cold and warm requests: short segments (conv windows across pieces, segments within the
    seam), a repeated segment, a cached prefix (the second time), reordered segments, a query
    longer than SUB_RUN (cut into pieces the chain composes)."""
    ps = _requests(seed)
    segs = [rand_ids(n, seed + 90 + i) for i, n in enumerate((30, 7, 52))]
    return ps + [Prompt(segments=segs, query=rand_ids(5, seed + 95)),
                 Prompt(segments=segs[::-1], query=rand_ids(9, seed + 96)),
                 Prompt(segments=segs[1:], query=rand_ids(41, seed + 97)),
                 ps[0]]


@pytest.mark.parametrize("mode", ["pic", "naive"])
def test_static_compose_equals_planned_walk(hf_checkpoints, arch, mode):
    path = hf_checkpoints[arch][1]
    outs, llms = {}, {}
    for compose in ("eager", "static"):
        llms[compose] = LLM(str(path), cache_mode=mode, seam=4, compose=compose)
        outs[compose] = _one_by_one(llms[compose], _prompts(3))
    for a, b in zip(outs["eager"], outs["static"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    comp = llms["static"].engine.composer
    if comp is None:                                # sliding-window or indexed attention: the planned paths only
        assert any(getattr(m, "window", 0) or getattr(m, "planned_only", False)
                   for m in llms["static"].engine.model.mixers.values())
        return
    runs = comp.runs
    assert comp.supported == (arch in GRAPH_ARCHS)
    if arch in GRAPH_ARCHS and mode == "pic":
        # every request with a cached segment took the fixed buffers (one has only short segments)
        assert runs == sum(o.composed_tokens > 0 for o in outs["static"]) == len(outs["static"]) - 1
    else:
        assert runs == 0                            # naive addition, or a family the lowering does not take


def test_buffers_reused_across_requests_and_shapes(hf_checkpoints):
    """Requests of one shape reuse one set of buffers (what a graph replays); a new shape makes a new
    set, the oldest is dropped past max_shapes; a prefix-holding request after a fresh one leaves no
    stale keys or states behind (each request equals the planned walk alone)."""
    path = hf_checkpoints["qwen3_5"][1]
    prompts = _prompts(7)
    ref = _one_by_one(LLM(str(path), seam=4, compose="eager"), prompts, n=3)
    llm = LLM(str(path), seam=4, compose="static")
    comp = llm.engine.composer
    comp.max_shapes = 2
    got = _one_by_one(llm, prompts, n=3)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    assert len(comp.ready) == 2 and comp.runs == sum(o.composed_tokens > 0 for o in got) == len(prompts) - 1
    assert comp.nbytes > 0
    llm.clear_cache()                                   # the buffers hold copies of cached entries: dropped too
    assert not comp.ready and comp.nbytes == 0


def test_lowering_tables():
    """The layout of a small request: pad run last in the chain, conv windows through the tails."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.state import SeqState

    class E:
        def __init__(self, n, tail_rows):
            self.cached_tokens = n
            self.layers = {0: type("P", (), {"tail": torch.zeros(tail_rows, 2)})()}
            self.tail_len = tail_rows                       # (SegmentEntry.tail_len: its layers' tail rows)

    b = BatchBuilder("cpu")
    e1, e2 = E(10, 3), E(2, 2)
    w = b.add(SeqState(), [("run", [1, 2]), ("apply", e1), ("run", [3]), ("apply", e2), ("run", [4, 5, 6])])
    low = lower(w, b.ids, b.pos, conv_width=4, held=0)
    assert low.shape == ComposeShape(tokens=64, runs=7, entries=2, keys=256, held=0, lmax=16)
    t = low.tables
    assert t["order"].tolist() == [2, 0, 3, 1, 4, 5, 6, 7, 8]   # runs at 2.., entries at 0, 1; pad runs last
    assert t["cu"].tolist() == [0, 2, 3, 6, 22, 38, 54, 64]     # 58 pads in runs of at most SUB_RUN = 16
    assert t["cu_maps"].tolist() == [0, 5, 9]                   # the request's chain, then the pads' own
    assert t["positions"][:6].tolist() == [0, 1, 12, 15, 16, 17]
    # source rows: 0..2 initial window, 3..5 e1's tail, 6..7 e2's tail, active tokens from 3 * (1 + 2) = 9
    assert t["conv_idx"][2].tolist() == [3, 4, 5, 11]            # token 3 after e1: its tail, then itself
    assert t["conv_idx"][3].tolist() == [11, 6, 7, 12]           # token 4: token 3, e2's 2-row tail
    assert t["window"].tolist() == [12, 13, 14]
    assert t["kpos"][:12].tolist() == list(range(2, 12)) + [13, 14]
    assert (low.kmask[256 + 6 :] == 1 << 62).all() and low.kmask[256:262].tolist() == [0, 1, 12, 15, 16, 17]
    assert t["logits_index"].tolist() == [5]
    # in position order: tokens 0, 1, e1's keys 2..11, token 12, e2's 13, 14, tokens 15..17; pads last
    sorted_pos = low.kmask[t["kperm"]]
    assert sorted_pos[:18].tolist() == list(range(18)) and (sorted_pos[18:] == 1 << 62).all()
    assert t["qlast"][:6].tolist() == [0, 1, 12, 15, 16, 17] and (t["qlast"][6:] == 0).all()


def test_not_lowered():
    """What goes the planned way: no cached segment, a run longer than MAX_RUN, a
    summarized run (a cold prefill), several requests (the engine checks that)."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.state import SeqState

    b = BatchBuilder("cpu")
    assert lower(b.add(SeqState(), [("run", list(range(10)))]), b.ids, b.pos, 4, 0) is None

    class E:
        cached_tokens, layers = 5, {}

    b = BatchBuilder("cpu")
    assert lower(b.add(SeqState(), [("apply", E()), ("run", list(range(257)))]), b.ids, b.pos, 4, 0) is None
    b = BatchBuilder("cpu")
    w = b.add(SeqState(), [("run", [1, 2], {"summarize": True}), ("apply", E()), ("run", [3])])
    assert lower(w, b.ids, b.pos, 4, 0) is None


def test_graphs_only_where_the_kernels_can_be_captured(hf_checkpoints):
    """The reference ops read run lengths on the host: a composer over them never tries a graph (it
    would fail mid-capture); the fast backend's Gated DeltaNet needs fla for it."""
    from hypic.ops.fast import fla_available
    from hypic.runtime.compose_graph import GraphCompose

    path = hf_checkpoints["qwen3_5"][1]
    for backend in ("reference", "fast"):
        model = LLM(str(path), backend=backend).engine.model
        mixers = model.mixers.values()
        ok = backend == "fast" and fla_available()
        assert all(m.capturable(torch.device("cuda")) == ok for m in mixers if hasattr(m, "conv_width"))
        assert GraphCompose(model, "cpu", torch.float32, graphs=True).graphs is False     # CPU: never


def test_capture_waits_for_a_shape_to_repeat(hf_checkpoints):
    """With graphs on, a shape's first request goes the planned way (no buffers, no capture: a one-off
    shape would pay three forwards); from its second on it gets the buffers. The capture itself needs
    CUDA: here the composer is told graphs are on and the capture is stubbed."""
    path = hf_checkpoints["qwen3_5"][1]
    llm = LLM(str(path), seam=4, compose="static")
    comp = llm.engine.composer
    comp.graphs = True
    comp._capture = lambda hit: None                    # (CUDA only) leave the buffers eager
    a, b = _prompts(11)[3], _prompts(11)[1]                 # 3 and 6 cached segments: two shapes
    sp = SamplingParams(max_tokens=1)
    runs = []
    for p in (a, a, b, a, b):
        llm.generate([p], sp)
        runs.append(comp.runs)
    assert runs == [0, 1, 1, 2, 3] and len(comp.ready) == 2


def test_graph_pieces_cover_every_layer_once():
    """The compose graph in pieces: consecutive layer ranges, none empty, all layers covered; the engine
    option is checked."""
    from hypic.config import ConfigError, EngineConfig
    from hypic.runtime.graphs import cuts

    for n, p, first in ((40, 1, 0), (40, 4, 0), (40, 3, 0), (8, 8, 0), (3, 5, 0), (40, 8, 1), (40, 4, 2), (40, 1, 3),
                        (8, 8, 2), (5, 3, 4), (40, 2, 39)):
        b = cuts(n, p, first)
        assert b[0] == 0 and b[-1] == n and len(b) == min(p, n) + 1
        assert all(x < y for x, y in zip(b, b[1:]))
        if first and 1 < p <= n and first <= n - (p - 1):
            assert b[1] == first
    assert cuts(40, 8, 1) == [0, 1, 7, 12, 18, 23, 29, 34, 40]
    with pytest.raises(ConfigError):
        EngineConfig(compose_pieces=0)
    with pytest.raises(ConfigError):
        EngineConfig(compose_first_piece=-1)


def test_state_made_after_the_first_token_only_for_requests_that_go_on(hf_checkpoints, monkeypatch):
    """Engine.begin samples the first token before the pass's states are cut out (compose_state); a request
    that ends at its first token gets none (nothing stays pending), one that decodes gets them and equals
    the planned walk, and generate_and_score keeps the state of a one-token request to fork it."""
    from hypic.runtime.compose_graph import GraphCompose

    path = hf_checkpoints["qwen3_5"][1]
    segs = [rand_ids(n, 300 + i) for i, n in enumerate((30, 41, 52))]
    prompts = [Prompt(segments=segs[::s], query=rand_ids(6, 310 + s)) for s in (1, -1)]
    ref = LLM(str(path), seam=4, compose="eager")
    llm = LLM(str(path), seam=4, compose="static")
    kept = []
    orig = GraphCompose.settle

    def spy(self, keep=True):
        if self.pending is not None:
            kept.append(keep)
        return orig(self, keep)

    monkeypatch.setattr(GraphCompose, "settle", spy)
    for p in prompts:                                       # cold, then warm (composed over the buffers)
        ref.generate([p], SamplingParams(max_tokens=1))
        llm.generate([p], SamplingParams(max_tokens=1))
    comp = llm.engine.composer
    assert comp.runs >= 1 and comp.pending is None and kept and not any(kept)
    kept.clear()
    sp = SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True)
    a, b = ref.generate([prompts[0]], sp)[0], llm.generate([prompts[0]], sp)[0]
    assert kept == [True] and comp.pending is None and a.token_ids == b.token_ids
    torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    assert b.ttft_s > 0
    cont = rand_ids(3, 320)
    one = SamplingParams(max_tokens=1)
    kept.clear()
    out, logp = llm.generate_and_score(prompts[1], cont, one)
    assert kept == [True]
    want = ref.score(prompts[1], cont)
    assert out.token_ids == ref.generate([prompts[1]], one)[0].token_ids
    assert max(abs(x - y) for x, y in zip(logp, want)) < 1e-4


PIECES = 3


def test_pieces_filled_just_before_each_runs(hf_checkpoints):
    """With the compose graph in pieces, a replay fills each piece's layers just before launching it (the
    GPU starts on the first piece while the host fills the rest). The CUDA graphs are stood in for by the same
    layers run eagerly over the same buffers: the fills and pieces interleave in layer order, every layer is
    filled once per request, and tokens and logits equal the planned walk's."""
    from hypic.runtime.compose_graph import ComposeBuffers, GraphCompose
    from hypic.runtime.graphs import Captured, cuts

    path = hf_checkpoints["qwen3_5"][1]
    segs = [rand_ids(n, 400 + i) for i, n in enumerate((30, 41, 52, 25))]
    prompts = [Prompt(segments=[segs[i] for i in o], query=rand_ids(6, 410 + j))
               for j, o in enumerate(((0, 1, 2, 3), (3, 1, 0, 2), (2, 3, 1, 0), (1, 0, 3, 2)))]
    ref = LLM(str(path), seam=4, compose="eager")
    llm = LLM(str(path), seam=4, compose="static")
    comp = llm.engine.composer
    comp.graphs = True                             # capture on a shape's second request, as on CUDA
    events = []

    def capture(self, hit):                        # eager pieces in place of the graphs
        bufs = hit[0]
        batch = bufs.batch()
        layers = self.model.model.layers
        bounds = cuts(len(layers), PIECES)
        logits = self.model(batch).clone()
        h = {}

        class Piece:
            def __init__(self, i):
                self.i = i

            def replay(self):
                events.append(("run", bounds[self.i], bounds[self.i + 1]))
                with torch.inference_mode():
                    if self.i == 0:                # (a graph recomputes what the scratch memoizes)
                        batch.scratch.clear()
                        h["x"] = comp.model.embed(batch)
                    h["x"] = comp.model.run_layers(h["x"], batch, bounds[self.i], bounds[self.i + 1])
                    if self.i == len(bounds) - 2:
                        logits.copy_(comp.model.head(h["x"], batch))

        hit[1], hit[2], hit[3] = Captured([Piece(i) for i in range(len(bounds) - 1)], bounds), logits, \
            [None, bufs.outputs, batch.scratch]

    orig_fill = ComposeBuffers.fill

    def fill(self, low, lo, hi):
        events.append(("fill", lo, hi))
        return orig_fill(self, low, lo, hi)

    GraphCompose._capture, saved = capture, GraphCompose._capture
    ComposeBuffers.fill = fill
    try:
        sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
        for p in prompts[:1]:                                  # cold: the segments cached
            ref.generate([p], sp)
            llm.generate([p], sp)
        for p in prompts[1:]:                                  # warm: planned, captured, then staged replays
            events.clear()
            a, b = ref.generate([p], sp)[0], llm.generate([p], sp)[0]
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    finally:
        GraphCompose._capture = saved
        ComposeBuffers.fill = orig_fill
    n = len(comp.model.model.layers)
    b = cuts(n, 3)
    want = [e for i in range(3) for e in (("fill", b[i], b[i + 1]), ("run", b[i], b[i + 1]))]
    assert comp.replays >= 1 and events == want


def test_rotary_into_equals_rotary():
    """Rotary.apply_into (the compose pass writes cached keys as placed straight into its keys buffer; apply goes
    through it too) gives the rotate-half form's result bit for bit: the same products and sums in the same
    roundings, in bf16 and fp32, partial and full."""
    from hypic.config import ModelConfig
    from hypic.layers.rope import Rotary
    from hypic.models.presets import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny-qwen3.5-moe"))
    g = torch.Generator().manual_seed(0)
    for rdim, d in ((16, 64), (64, 64)):
        rot = Rotary(cfg, rdim, {"rope_type": "default", "rope_theta": 10000.0})
        for dtype in (torch.bfloat16, torch.float32):
            x = torch.randn(37, 3, d, generator=g).to(dtype)
            pos = torch.randint(0, 1 << 20, (37,), generator=g)
            cos, sin = rot.cos_sin(pos, dtype)
            out = torch.full_like(x, float("nan"))
            rot.apply_into(x, cos, sin, out)
            xr, xp = x[..., :rdim], x[..., rdim:]                    # the rotate-half form, written out
            x1, x2 = xr[..., : rdim // 2], xr[..., rdim // 2 :]
            want = torch.cat([xr * cos[:, None] + torch.cat([-x2, x1], -1) * sin[:, None], xp], -1)
            assert torch.equal(out, want), (rdim, dtype)
            assert torch.equal(rot.apply(x, cos, sin), want), (rdim, dtype)


def test_order_keys_places_and_orders_like_rotary():
    """ops.order_keys (the compose pass's attention operands): the cached rows of the keys buffer become
    Rotary.apply_into's placed keys bit for bit, then keys and values come back gathered by kperm; without free
    keys it is the plain gather. The reference and the fast backend (PyTorch here) agree exactly."""
    from hypic.config import ModelConfig
    from hypic.layers.rope import Rotary
    from hypic.models.presets import preset_config
    from hypic.ops import get_backend

    cfg = ModelConfig.from_dict(preset_config("tiny-qwen3.5-moe"))
    g = torch.Generator().manual_seed(1)
    for rdim, d in ((16, 64), (64, 64), (0, 32)):
        rot = Rotary(cfg, max(rdim, 2), {"rope_type": "default", "rope_theta": 10000.0})
        for dtype in (torch.bfloat16, torch.float32):
            n_all, lo, n = 45, 4, 30
            keys, values = torch.randn(n_all, 2, d, generator=g).to(dtype), torch.randn(n_all, 2, 24, generator=g).to(dtype)
            free = torch.randn(n, 2, d, generator=g).to(dtype)
            cos, sin = rot.cos_sin(torch.randint(0, 1 << 16, (n,), generator=g), dtype)
            kperm = torch.randperm(n_all, generator=g)
            want = keys.clone()
            if rdim:
                rot.apply_into(free, cos, sin, want[lo : lo + n])
            else:
                want[lo : lo + n] = free
            for name in ("reference", "fast"):
                k = keys.clone()
                ok, ov = get_backend(name).order_keys(k, values, kperm, free=free, lo=lo, cos=cos, sin=sin,
                                                      rotary_dim=rdim)
                assert torch.equal(k, want) and torch.equal(ok, want[kperm]) and torch.equal(ov, values[kperm])
                ok, ov = get_backend(name).order_keys(keys, values, kperm)
                assert torch.equal(ok, keys[kperm]) and torch.equal(ov, values[kperm])


@pytest.mark.parametrize("arch", ["qwen3_5", "bailing_hybrid", "kimi_linear"])
def test_keys_ordered_ahead_equal_ordered_in_the_pass(hf_checkpoints, arch, monkeypatch):
    """layers/attention.py ORDER_AHEAD: the fill places the cached keys and puts every key in position order ahead of
    the pass, which then writes only its active tokens' keys and values into their places (the lowering's aslot).
    The same values in the same places as ordering inside the pass: tokens and logits equal bit for bit (RoPE'd
    keys, MLA's keys placed by its own rotation, NoPE keys), over requests that reuse one shape's buffers."""
    from hypic.layers import attention

    path = hf_checkpoints[arch][1]
    outs = {}
    for ahead in (False, True):
        monkeypatch.setattr(attention, "ORDER_AHEAD", ahead)
        llm = LLM(str(path), seam=4, compose="static")
        outs[ahead] = _one_by_one(llm, _prompts(11), n=3)
        assert llm.engine.composer.runs >= 3
        bufs = [b for b, *_ in llm.engine.composer.ready.values()]
        assert all(("ok" in b.layers[l]) == ahead for b in bufs for l, m in llm.engine.model.mixers.items()
                   if isinstance(m, attention.AttentionMixer))
    for a, b in zip(outs[False], outs[True]):
        assert a.token_ids == b.token_ids
        assert torch.equal(a.logits, b.logits)


def test_aslot_names_each_active_key_place_in_position_order():
    """ComposeBuffers.active_slots: the place of each active (and pad) token's key among the keys in position order
    (the inverse of kperm on those rows, by a scatter on the device), so the pass's writes through it give what
    gathering by kperm gives."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.compose_graph import ComposeBuffers
    from hypic.runtime.state import SeqState

    class E:
        def __init__(self, n):
            self.cached_tokens, self.tail_len = n, 0
            self.layers = {}

    class NoLayers:
        mixers = {}

    b = BatchBuilder("cpu")
    w = b.add(SeqState(), [("run", [1, 2]), ("apply", E(10)), ("run", [3]), ("apply", E(2)), ("run", [4, 5, 6])])
    low = lower(w, b.ids, b.pos, conv_width=0, held=0)
    sh = low.shape
    bufs = ComposeBuffers(NoLayers(), sh, "cpu", torch.float32)
    bufs.load_tables(low)
    aslot = bufs.active_slots()
    active = torch.arange(sh.held + sh.keys, sh.held + sh.keys + sh.tokens)
    assert aslot.shape == (sh.tokens,) and torch.equal(low.tables["kperm"][aslot], active)
    assert aslot[:6].tolist() == [0, 1, 12, 15, 16, 17]            # tokens at positions 0, 1, 12, 15, 16, 17


@pytest.mark.parametrize("sub", [32, 64])
def test_longer_run_pieces_equal_planned_walk(hf_checkpoints, sub, monkeypatch):
    """SUB_RUN: the runs cut into pieces of 32 or 64 tokens (fewer chain steps for a long query; wider chunks) give
    the planned walk's tokens and logits; the pads stay in pieces of PAD_RUN, so the longest run is a real one."""
    from hypic.runtime import compose_graph as cg

    monkeypatch.setattr(cg, "SUB_RUN", sub)
    monkeypatch.setattr(cg, "QUERY_TAIL", 0)                      # (a query past SUB_RUN: in pieces, chained)
    path = hf_checkpoints["qwen3_5"][1]
    prompts = _prompts(5)
    ref = _one_by_one(LLM(str(path), seam=4, compose="eager"), prompts, n=3)
    llm = LLM(str(path), seam=4, compose="static")
    got = _one_by_one(llm, prompts, n=3)
    for a, b in zip(ref, got):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    shapes = list(llm.engine.composer.ready)
    assert max(s.lmax for s in shapes) == min(sub, 48)             # the 41-token query: one piece of 41 at 64


def test_lowering_a_query_tail():
    """QUERY_TAIL: a last run of up to tail_max tokens is cut into pieces of SUB_RUN like the others, but its pieces
    (the tail's runs) are last in storage and outside both chains (the chain ends where the query starts; their slots
    after the chain's, unwalked); no pad runs (the pads' rows, after the tail's, belong to no run: the correction's
    gather points them at the last tail run, a slot of no chained run)."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.compose_graph import SUB_RUN, pair_runs
    from hypic.runtime.state import SeqState

    class E:
        def __init__(self, n):
            self.cached_tokens, self.tail_len = n, 0
            self.layers = {}

    assert SUB_RUN == 16
    b = BatchBuilder("cpu")
    query = list(range(100, 141))                                    # 41 tokens: pieces of 16, 16, 9
    w = b.add(SeqState(), [("run", [1, 2]), ("apply", E(10)), ("run", [3]), ("apply", E(2)), ("run", query)])
    low = lower(w, b.ids, b.pos, conv_width=0, held=0, tail_max=64)
    sh, t = low.shape, low.tables
    assert sh == ComposeShape(tokens=64, runs=5, entries=2, keys=256, held=0, lmax=16, tail=3)
    assert t["cu"].tolist() == [0, 2, 3, 19, 35, 44]                 # two chained runs, then the tail's three
    assert t["order"].tolist() == [2, 0, 3, 1, 4, 5, 6]              # the tail's slots (4, 5, 6) after the chain
    assert t["cu_maps"].tolist() == [0, 4, 4] and t["cu_pairs"].tolist() == [0, 2, 2]
    assert t["run_of"].tolist() == [0, 0, 1] + [2] * 16 + [3] * 16 + [4] * 9 + [4] * 20
    assert t["pos_in_run"].tolist() == [0, 1, 0] + list(range(16)) * 2 + list(range(9)) + [0] * 20
    keep, after = low.pairs
    assert keep.tolist() == [True, False, True, False, True, True, True] and after.tolist() == [0, 1, -1, -1, -1]
    assert pair_runs(t["order"].numpy().astype("int64"), 4, 2)[1].tolist() == [0, 1, -1, -1, -1]
    # a query within SUB_RUN: one tail run
    b = BatchBuilder("cpu")
    w = b.add(SeqState(), [("run", [1, 2]), ("apply", E(10)), ("run", list(range(100, 110)))])
    low = lower(w, b.ids, b.pos, conv_width=0, held=0, tail_max=64)
    assert low.shape.tail == 1 and low.tables["cu"].tolist() == [0, 2, 12] and low.tables["cu_maps"].tolist() == [0, 2, 2]
    # not a tail: past tail_max, off, or no chained run before the query
    for pieces, tail_max in (([("run", [1, 2]), ("apply", E(10)), ("run", list(range(100, 180)))], 64),
                             ([("run", [1, 2]), ("apply", E(10)), ("run", query)], 0),
                             ([("apply", E(10)), ("run", query)], 64)):
        b = BatchBuilder("cpu")
        w = b.add(SeqState(), pieces)
        low = lower(w, b.ids, b.pos, conv_width=0, held=0, tail_max=tail_max)
        assert low.shape.tail == 0 and low.tables["cu"][-1] == low.shape.tokens  # the pads in runs again


@pytest.mark.parametrize("arch", ["qwen3_5", "llama", "kimi_linear"])
def test_query_tail_on_and_off_equal_planned_walk(hf_checkpoints, arch, monkeypatch):
    """The static pass with the query outside the chain (QUERY_TAIL 64) and with it chained in pieces of SUB_RUN (the
    default, 0): both the planned walk's tokens and logits, also after a cached prefix (a nonzero initial state); the
    41-token query's request took a tail shape where every linear layer takes one (Gated DeltaNet; attention alone:
    the runs only shape the tables; KDA: none, its query chained as before)."""
    from hypic.runtime import compose_graph as cg

    path = hf_checkpoints[arch][1]
    segs = [rand_ids(n, 700 + i) for i, n in enumerate((30, 23, 44))]
    long_q = Prompt(prefix=rand_ids(12, 710), segments=segs, query=rand_ids(41, 711))   # twice: the prefix cached
    prompts = _prompts(9) + [long_q, Prompt(prefix=long_q.prefix, segments=segs[::-1], query=rand_ids(37, 712))]
    ref = _one_by_one(LLM(str(path), seam=4, compose="eager"), prompts, n=3)
    for tail in (0, 64):
        monkeypatch.setattr(cg, "QUERY_TAIL", tail)
        llm = LLM(str(path), seam=4, compose="static")
        got = _one_by_one(llm, prompts, n=3)
        for a, b in zip(ref, got):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
        tails = {s.tail for s in llm.engine.composer.ready}
        assert (tails == {0}) if tail == 0 or arch == "kimi_linear" else (3 in tails), tails       # 41 tokens: 3 runs


def test_kept_layout_equals_a_fresh_lowering():
    """Two requests of one layout (the same segment lengths in another order, other segments and token ids): their
    `layout_key`s are equal, and the first's kept layout with the second's state, entries and ids (`again`) is the
    second's own lowering, table for table; a key changes with a cached length, a tail's length, a run's extent or a
    position, and there is none where keys are held (their positions) or a run summarizes."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.compose_graph import layout_key
    from hypic.runtime.state import SeqState

    class E:
        def __init__(self, n, tail):
            self.cached_tokens, self.tail_len, self.layers = n, tail, {}

    def work(entries, run_ids, flags=None):
        b = BatchBuilder("cpu")
        items = []
        for i, (e, ids) in enumerate(zip(entries, run_ids)):
            items.append(("run", ids, flags or {}) if i == 0 else ("run", ids))
            items.append(("apply", e))
        items.append(("run", run_ids[-1]))
        return b.add(SeqState(), items), b.ids, b.pos

    ea, eb, ec = E(12, 3), E(12, 3), E(12, 3)
    w1, ids1, pos1 = work([ea, eb, ec], [[1, 2], [3, 4], [5, 6], list(range(7, 27))])
    w2, ids2, pos2 = work([ec, ea, eb], [[31, 32], [33, 34], [35, 36], list(range(37, 57))])
    for tail_max in (0, 64):
        k1, k2 = (layout_key(w, p, 4, 0, tail_max) for w, p in ((w1, pos1), (w2, pos2)))
        assert k1 == k2 and hash(k1) == hash(k2)
        first = lower(w1, ids1, pos1, 4, 0, tail_max)
        first.memo["x"] = 1
        again = first.kept(k1).again(w2, ids2)
        fresh = lower(w2, ids2, pos2, 4, 0, tail_max)
        assert again.shape == fresh.shape and again.tables.keys() == fresh.tables.keys()
        for name, t in fresh.tables.items():
            assert torch.equal(again.tables[name], t), name
        assert torch.equal(again.kmask, fresh.kmask) and again.tail_rows == fresh.tail_rows
        assert (again.n, again.kc, again.held) == (fresh.n, fresh.kc, fresh.held)
        assert all(a is b for a, b in zip(again.entries, fresh.entries)) and len(again.entries) == 3
        assert again.state is w2.state and again.key is k1 and again.memo is first.memo
        assert not torch.equal(again.tables["ids"], first.tables["ids"])
    base = layout_key(w1, pos1, 4, 0, 0)
    for other in (work([ea, E(13, 3), ec], [[1, 2], [3, 4], [5, 6], list(range(7, 27))]),   # a cached length
                  work([ea, E(12, 1), ec], [[1, 2], [3, 4], [5, 6], list(range(7, 27))]),   # a conv tail's
                  work([ea, eb, ec], [[1, 2, 3], [4], [5, 6], list(range(7, 27))])):        # where a run ends
        assert layout_key(other[0], other[2], 4, 0, 0) != base
    assert layout_key(w1, [p + 1 for p in pos1], 4, 0, 0) != base                 # positions
    assert layout_key(w1, pos1, 4, 0, 64) != base and layout_key(w1, pos1, 3, 0, 0) != base
    assert layout_key(w1, pos1, 4, 5, 0) is None                                  # held keys
    ws = work([ea, eb, ec], [[1, 2], [3, 4], [5, 6], list(range(7, 27))], {"summarize": True})
    assert layout_key(ws[0], ws[2], 4, 0, 0) is None


@pytest.mark.parametrize("arch", ["qwen3_5", "kimi_linear"])
def test_requests_of_one_layout_reuse_it(hf_checkpoints, arch, monkeypatch):
    """Warm requests of one layout (equal segment lengths in new orders, new queries of one length) take the kept
    layout (`GraphCompose.layouts`), and where the buffers loaded it last only the token ids are copied in: each
    gives the planned walk's tokens and logits, and the same as with no layouts kept (LAYOUTS 0), bit for bit."""
    from hypic.runtime import compose_graph as cg

    path = hf_checkpoints[arch][1]
    segs = [rand_ids(24, 800 + i) for i in range(4)]
    orders = ([0, 1, 2, 3], [2, 0, 3, 1], [3, 2, 1, 0], [1, 3, 0, 2])
    prompts = [Prompt(segments=[segs[i] for i in o], query=rand_ids(7, 810 + j)) for j, o in enumerate(orders)]
    prompts.insert(3, Prompt(segments=segs[:3], query=rand_ids(7, 820)))     # another layout between them
    ref = _one_by_one(LLM(str(path), seam=4, compose="eager"), prompts, n=3)
    got = {}
    for kept in (0, cg.LAYOUTS):
        monkeypatch.setattr(cg, "LAYOUTS", kept)
        llm = LLM(str(path), seam=4, compose="static")
        got[kept] = _one_by_one(llm, prompts, n=3)
        comp = llm.engine.composer
        for a, b in zip(ref, got[kept]):
            assert a.token_ids == b.token_ids
            torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
        # every request composed (the first after its segments' cold prefill); the three after the first of the
        # four-segment layout reuse it, the one between them of three segments is kept beside it
        assert comp.runs == 5 and comp.layout_hits == (3 if kept else 0) and len(comp.layouts) == (2 if kept else 0)
    for a, b in zip(got[0], got[cg.LAYOUTS]):
        assert torch.equal(a.logits, b.logits)
