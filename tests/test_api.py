"""The Python API around the algorithm: bad requests, sampling, the store, namespaces, the CLI."""

import subprocess
import sys

import pytest
import torch

from hypic import LLM, InvalidRequestError, Prompt, SamplingParams
from hypic.cache.store import MemoryStore
from .conftest import rand_ids


@pytest.fixture(scope="module")
def tiny():
    return LLM("tiny-qwen3.5", cache_mode="pic", seam=4)


def _good():
    return Prompt(prefix=[5, 6, 7], segments=[rand_ids(30, 1), rand_ids(25, 2)], query=[9, 10])


@pytest.mark.parametrize("bad,match", [
    (Prompt(query=[]), "query is empty"),
    (Prompt(segments=[[1, 2]], query=""), "query is empty"),
    (Prompt(segments=[[]], query=[1]), "segment 0 is empty"),
    (Prompt(segments=[[1, 999999]], query=[1]), "outside the vocabulary"),
    (Prompt(query=[-1]), "outside the vocabulary"),
    (Prompt(query=[1.5]), "must be integers"),
    (Prompt(query=[5, True]), "must be integers, got bool"),
    (Prompt(query=[5, None]), "must be integers, got NoneType"),
    (Prompt(segments=[[3, 1 << 40]], query=[1]), "outside the vocabulary"),
    (Prompt(segments="one string", query=[1]), "not a single string"),
    (Prompt(query=[1] * 70000), "exceeds the model's maximum"),
])
def test_bad_prompts_raise_and_lose_nothing(tiny, bad, match):
    tiny.clear_cache()
    before = tiny.generate([_good()], SamplingParams(max_tokens=4, return_logits=True))[0]
    stats = tiny.cache_stats()
    with pytest.raises(InvalidRequestError, match=match):
        tiny.generate([_good(), bad])           # the whole call is refused before any work
    assert tiny.cache_stats() == stats
    after = tiny.generate([_good()], SamplingParams(max_tokens=4, return_logits=True))[0]
    assert after.token_ids == before.token_ids
    torch.testing.assert_close(after.logits, before.logits, atol=1e-6, rtol=0)


@pytest.mark.parametrize("kw,match", [
    ({"max_tokens": 0}, "max_tokens"), ({"temperature": -1.0}, "temperature"), ({"top_p": 0.0}, "top_p"),
    ({"top_k": -2}, "top_k"),
])
def test_bad_sampling_params(kw, match):
    with pytest.raises(InvalidRequestError, match=match):
        SamplingParams(**kw)


def test_sampling(tiny):
    p = _good()
    greedy = tiny.generate([p], SamplingParams(max_tokens=8, ignore_eos=True))[0].token_ids
    assert tiny.generate([p], SamplingParams(max_tokens=8, temperature=1.0, top_k=1, ignore_eos=True))[0].token_ids == greedy
    s = SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=123, ignore_eos=True)
    a, b = tiny.generate([p, p], [s, s])
    assert a.token_ids == b.token_ids                       # same seed, same tokens
    c = tiny.generate([p], SamplingParams(max_tokens=8, temperature=1.5, top_p=0.9, seed=7, ignore_eos=True))[0]
    assert c.token_ids != a.token_ids
    stop = greedy[2]
    o = tiny.generate([p], SamplingParams(max_tokens=8, stop_token_ids=(stop,), ignore_eos=True))[0]
    assert o.finish_reason == "stop" and o.token_ids == greedy[: greedy.index(stop) + 1]
    o = tiny.generate([p], SamplingParams(max_tokens=3, ignore_eos=True))[0]
    assert o.finish_reason == "length" and len(o.token_ids) == 3


def test_batched_generate_equals_one_by_one(tiny):
    prompts = [_good(), Prompt(segments=[rand_ids(40, 3)], query=[1]), Prompt(query=rand_ids(12, 4))]
    sp = SamplingParams(max_tokens=5, ignore_eos=True, return_logits=True)
    together = tiny.generate(prompts, sp)
    for p, o in zip(prompts, together):
        alone = tiny.generate([p], sp)[0]
        assert alone.token_ids == o.token_ids
        torch.testing.assert_close(alone.logits, o.logits, atol=1e-5, rtol=0)


def test_score_matches_generation_logits(tiny):
    p = _good()
    out = tiny.generate([p], SamplingParams(max_tokens=5, ignore_eos=True, return_logits=True))[0]
    lp = tiny.score(p, out.token_ids)
    ref = [float(torch.log_softmax(out.logits[i], -1)[t]) for i, t in enumerate(out.token_ids)]
    assert max(abs(a - b) for a, b in zip(lp, ref)) < 1e-4
    with pytest.raises(InvalidRequestError):
        tiny.score(p, [])


@pytest.mark.parametrize("decode", ["dynamic", "static"])
def test_generate_and_score_equal_separate_calls(decode):
    """One prefill, forked: the generation and the scores are those of generate() and score() (fp32;
    the same ops on the same inputs, so equal up to the order of a few sums: 1e-5)."""
    llm = LLM("tiny-qwen3.5", cache_mode="pic", seam=4, decode=decode)
    p = _good()
    sp = SamplingParams(max_tokens=6, ignore_eos=True, return_logits=True)
    cont = [11, 12, 13, 14]
    out, lp = llm.generate_and_score(p, cont, sp)
    ref_out = llm.generate([p], sp)[0]
    ref_lp = llm.score(p, cont)
    assert out.token_ids == ref_out.token_ids and out.composed_tokens == ref_out.composed_tokens
    torch.testing.assert_close(out.logits, ref_out.logits, atol=1e-5, rtol=0)
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) < 1e-5
    with pytest.raises(InvalidRequestError):
        llm.generate_and_score(p, [], sp)


def test_namespaces_isolate_segments(tiny):
    tiny.clear_cache()
    seg = rand_ids(50, 9)
    a = tiny.generate([Prompt(segments=[seg], query=[1], namespace="tenant-a")])[0]
    b = tiny.generate([Prompt(segments=[seg], query=[1], namespace="tenant-b")])[0]
    again = tiny.generate([Prompt(segments=[seg], query=[1], namespace="tenant-a")])[0]
    assert a.cold_prefill_tokens == 50 and b.cold_prefill_tokens == 50 and again.cold_prefill_tokens == 0
    assert tiny.cache_stats()["segments"]["entries"] == 2


def test_store_lru_budget_and_accounting(tiny):
    class V:
        def __init__(self, n):
            self.nbytes = n

    s = MemoryStore(100)
    assert s.put("a", V(40)) and s.put("b", V(40))
    s.get("a")                                   # b is now least recently used
    assert s.put("c", V(40))
    assert "b" not in s and "a" in s and "c" in s
    assert not s.put("huge", V(101)) and len(s) == 2
    st = s.stats()
    assert st.evictions == 1 and st.rejected == 1 and st.bytes == 80
    s.check()
    assert s.delete("a") and not s.delete("a")
    s.check()
    # the engine's store under a small budget: entries are evicted, results do not change
    small = LLM("tiny-qwen3.5", cache_mode="pic", seam=4, segment_cache_bytes=60_000)
    p = Prompt(segments=[rand_ids(200, i) for i in range(4)], query=[1, 2])
    first = small.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    second = small.generate([p], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    st = small.cache_stats()["segments"]
    assert st["bytes"] <= 60_000 and st["evictions"] + st["rejected"] > 0
    assert first.token_ids == second.token_ids
    small.engine.segments.check()


def test_cli_demo_and_generate():
    out = subprocess.run([sys.executable, "-m", "hypic.cli", "demo", "--max-tokens", "3"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "reordered" in out.stdout and "pic" in out.stdout and "== full" in out.stdout
    out = subprocess.run([sys.executable, "-m", "hypic.cli", "generate", "--segment", "doc one", "--segment",
                          "doc two", "--query", "q?", "--max-tokens", "2", "--json"], capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert '"composed_tokens"' in out.stdout
    out = subprocess.run([sys.executable, "-m", "hypic.cli", "generate", "--query", "q", "--seam", "-1"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 2 and "seam" in out.stderr


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-minimax", "tiny-nemotron-h", "tiny-jamba", "tiny-kimi-linear"])
def test_cached_tensors_own_their_memory(preset):
    """Byte accounting is truthful: every tensor held by a segment entry or a prefix node owns its
    storage. A view into a batch tensor (a conv window of the whole run, a state slice of a
    batched kernel output) would pin far more memory than `nbytes` counts: a long prefix-mode run
    once grew to 15 GB under a 4 GB budget that way."""
    llm = LLM(preset, cache_mode="prefix", seam=4)
    p = Prompt(prefix=rand_ids(20, 1), segments=[rand_ids(60, 2), rand_ids(3, 3), rand_ids(80, 4)], query=[5, 6])
    llm.generate([p, Prompt(prefix=p.prefix, segments=list(p.segments[::-1]), query=[7])],
                 SamplingParams(max_tokens=2))
    llm.set_policy("pic", 4)
    llm.generate([p], SamplingParams(max_tokens=2))
    held = [v for v in llm.engine.segments.values()] + [v for v in llm.engine.prefix.store.values()]
    assert len(held) > 3
    for value in held:
        layers = value.layers if hasattr(value, "layers") else {}
        for part in layers.values():
            for name, t in part.tensors():
                assert t.untyped_storage().nbytes() == t.element_size() * t.nelement(), (type(value).__name__, name)


def test_segment_digests_made_while_validating_equal_the_plain_digest(tiny):
    """The digests the validation makes from its array (one conversion of the ids per span) equal
    tokens_digest's, also for a span given as a tuple, for ids 0 and 1 and near the vocabulary's end; the
    planner keys segments by them."""
    from hypic.segment.spans import tokenize_prompt, tokens_digest

    v = tiny.engine.cfg.vocab_size
    segs = [[0, 1, 5, v - 1], tuple(range(2, 40)), [7] * 9]
    tp = tokenize_prompt(Prompt(prefix=[3, 4], segments=segs, query=[1, 2]), None, vocab_size=v, max_len=10_000,
                         max_segments=8, default_namespace="ns")
    assert len(tp.known_digests) == 5
    for span in tp.spans:
        assert tp.digest(span) == tokens_digest(span) == tokens_digest(list(span))
    plan = tiny.engine.planner.plan(tp, tiny.policy)
    keys = [s.key.tokens for s in plan.slots if s.key is not None]      # (a segment within the seam has none)
    assert keys == [tokens_digest(s) for s in segs if len(s) > tiny.policy.seam] and len(keys) >= 2


def test_warmup_runs_every_mode_and_leaves_no_trace():
    """LLM.warmup (hypic serve runs it before serving on CUDA): full, pic (cold, then reordered) and prefix requests
    on made-up ids; afterwards the caches are empty with zeroed counters, the policy is the one set before, and the
    engine answers as a fresh one does."""
    llm = LLM("tiny-qwen3.5", cache_mode="prefix", seam=2)
    seen, generate = [], llm.generate

    def spy(prompts, sp):
        outs = generate(prompts, sp)
        seen.extend((llm.cache_mode, o) for o in outs)
        return outs

    llm.generate = spy
    times = llm.warmup(tokens=256, segments=3, decode_tokens=2)
    del llm.generate
    assert set(times) == {"full", "pic", "prefix"} and all(t > 0 for t in times.values())
    prefix = [o for mode, o in seen if mode == "prefix"]       # cold, a miss after the first segment, a whole hit
    assert [o.prefix_tokens > 0 for o in prefix] == [False, True, True]
    assert prefix[2].recomputed_tokens == len(prefix[2].prompt_token_ids) - prefix[2].prefix_tokens
    assert prefix[2].prefix_tokens > prefix[1].prefix_tokens
    assert llm.cache_mode == "prefix" and llm.policy.seam == 2
    for s in llm.cache_stats().values():
        assert s["entries"] == 0 and s["hits"] == 0 and s["misses"] == 0 and s["insertions"] == 0
    sp = SamplingParams(max_tokens=4, return_logits=True)
    fresh = LLM("tiny-qwen3.5", cache_mode="prefix", seam=2)
    a, b = llm.generate([_good()], sp)[0], fresh.generate([_good()], sp)[0]
    assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)
    with pytest.raises(InvalidRequestError, match="warm-up needs"):
        llm.warmup(tokens=8, segments=3)


def test_cold_segments_run_in_bounded_forwards(tiny, monkeypatch):
    """EngineConfig.prefill_chunk_tokens: the cold segments of a prefill go through the isolated prefill in forwards
    of at most that many tokens (a longer segment alone), and the entries and outputs are those of one forward
    (1e-5: only the batch's shapes differ)."""
    import hypic.runtime.engine as engine_mod

    batches = []
    real = engine_mod.prefill_segments

    def spy(model, slots, device, **kw):
        batches.append(sum(len(s.tokens) for s in slots))
        return real(model, slots, device, **kw)

    monkeypatch.setattr(engine_mod, "prefill_segments", spy)
    p = Prompt(prefix=[5, 6, 7], segments=[rand_ids(n, 30 + n) for n in (40, 90, 25, 150, 70)], query=[9, 10])
    sp = SamplingParams(max_tokens=4, ignore_eos=True, return_logits=True)
    small = LLM("tiny-qwen3.5", cache_mode="pic", seam=4, prefill_chunk_tokens=120)
    out = small.generate([p], sp)[0]
    assert batches == [40, 90 + 25, 150, 70]                 # in order, each batch within 120 tokens or one segment
    tiny.clear_cache()
    batches.clear()
    ref = tiny.generate([p], sp)[0]
    assert batches == [375]
    assert out.token_ids == ref.token_ids
    torch.testing.assert_close(out.logits, ref.logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-jamba", "tiny-ring-linear", "tiny-lfm2", "tiny-zamba2",
                                    "tiny-kimi-linear"])
def test_a_long_segment_prefilled_in_parts_equals_one_forward(preset):
    """A segment longer than prefill_chunk_tokens runs in parts on one sequence state; its entry (T and S joined by
    composition, the last part's conv tail, keys and values end to end) equals the one-forward entry (1e-5 relative:
    only summation order and the zero-start subtraction's rounding differ) and so do the outputs; dense, diagonal,
    RoPE'd-key and conv-only families, and a layer with two stateful mixers."""
    from hypic.prefill.isolated import _parts

    assert _parts(300, 100) == [(0, 100), (100, 200), (200, 300)] and _parts(330, 100)[-1] == (200, 330)
    seg = rand_ids(333, 7)
    p = Prompt(prefix=[5, 6, 7], segments=[rand_ids(20, 8), seg], query=[9, 10])
    sp = SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True)
    whole = LLM(preset, cache_mode="pic", seam=8)
    parts = LLM(preset, cache_mode="pic", seam=8, prefill_chunk_tokens=100)
    a, b = whole.generate([p], sp)[0], parts.generate([p], sp)[0]
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
    ea = max(whole.engine.segments.values(), key=lambda e: e.length)
    eb = max(parts.engine.segments.values(), key=lambda e: e.length)
    assert ea.length == eb.length == 333 and sorted(ea.layers) == sorted(eb.layers)
    for layer in ea.layers:
        for (name, x), (_, y) in zip(ea.layers[layer].tensors(), eb.layers[layer].tensors()):
            assert x.shape == y.shape, (layer, name)
            err = (x.float() - y.float()).norm() / max(x.float().norm(), 1e-30)
            assert err < 1e-5, (layer, name, float(err))


@pytest.mark.parametrize("mode,preset", [("full", "tiny-qwen3.5"), ("prefix", "tiny-qwen3.5"), ("pic", "tiny-qwen3.5"),
                                         ("prefix", "tiny-jamba"), ("prefix", "tiny-lfm2"), ("prefix", "tiny-zamba2"),
                                         ("prefix", "tiny-kimi-linear")])
def test_a_long_prompt_is_prefilled_in_bounded_forwards(mode, preset):
    """Chunked prefill: a request with more active tokens than prefill_chunk_tokens runs its leading parts in
    forwards of at most that many tokens (runs cut anywhere; a prefix-cache boundary span cut into parts whose
    captures join) before the forward that samples; outputs equal one forward's (1e-4 on logits: only the
    attention's blocking differs), and the prefix cache built along the way serves a later request the same."""
    p = Prompt(prefix=rand_ids(150, 1), segments=[rand_ids(n, 40 + n) for n in (60, 120)], query=rand_ids(260, 3))
    sp = SamplingParams(max_tokens=3, ignore_eos=True, return_logits=True)
    one = LLM(preset, cache_mode=mode, seam=8)
    parts = LLM(preset, cache_mode=mode, seam=8, prefill_chunk_tokens=100)
    sizes = []
    real = parts.engine.model.forward

    def spy(batch):
        sizes.append(len(batch.input_ids))
        return real(batch)

    parts.engine.model.forward = spy
    a, b = one.generate([p], sp)[0], parts.generate([p], sp)[0]
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
    # every forward within 100 tokens (prefix spans and the cold prefix cut into parts whose captures join), but
    # pic's cold segment of 120 tokens, which keeps its 112 cached tokens in one part (a last part would be shorter
    # than MIN_PART)
    assert max(sizes) <= {"full": 100, "prefix": 100, "pic": 120}[mode] and len(sizes) >= 5
    nodes = lambda llm: {k: llm.engine.prefix.store.peek(k) for k in llm.engine.prefix.store.keys()}  # noqa: E731
    whole, cut = nodes(one), nodes(parts)
    assert sorted(whole) == sorted(cut) and bool(whole) == (mode != "full")   # the same boundary nodes
    for key, node in whole.items():
        other = cut[key]
        assert other.tokens == node.tokens and sorted(other.layers) == sorted(node.layers)
        for layer, part in node.layers.items():
            for (name, x), (_, y) in zip(part.tensors(), other.layers[layer].tensors()):
                assert x.shape == y.shape and torch.allclose(x.float(), y.float(), atol=1e-4, rtol=1e-4), (
                    key, layer, name)
    q = Prompt(prefix=p.prefix, segments=p.segments, query=rand_ids(30, 9))
    a, b = one.generate([q], sp)[0], parts.generate([q], sp)[0]
    assert a.token_ids == b.token_ids
    torch.testing.assert_close(b.logits, a.logits, atol=1e-4, rtol=0)
