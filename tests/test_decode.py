"""Static decode (runtime/decode.py): fixed buffers, one token per row, the step CUDA graphs replay.

On the CPU the same buffers run eagerly; they must give the dynamic step's tokens and logits for
every architecture, with requests joining and leaving between steps, and hand a request's state
back intact when it leaves unfinished."""

import pytest
import torch

from hypic import LLM, SamplingParams
from hypic.ops import get_backend

from .test_fast import _requests

# fp32 on the CPU: the static step runs the same ops as the dynamic one on differently shaped
# tensors (a batched conv and kernel over rows instead of a varlen call, a masked GEMM over all
# slots instead of the valid keys); their sums differ in order only, ~1e-6 relative per op, and a
# few steps of a random 4-layer model keep that under 1e-4 on logits of size ~1.
ATOL = 1e-4


@pytest.mark.parametrize("mode", ["pic", "full"])
def test_static_decode_equals_dynamic(hf_checkpoints, arch, mode):
    path = hf_checkpoints[arch][1]
    outs = {}
    for decode in ("dynamic", "static"):
        llm = LLM(str(path), cache_mode=mode, seam=4, decode=decode)
        assert (llm.engine.decoder is None) == (decode == "dynamic")    # windowed (rings) and indexed models too
        outs[decode] = llm.generate(_requests(3), SamplingParams(max_tokens=6, return_logits=True, ignore_eos=True))
    for a, b in zip(outs["dynamic"], outs["static"]):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)


def _drive(llm, prompts, lens, joins, steps=12):
    """Run requests through prefill/step by hand: request i joins at step joins[i] and stops after
    lens[i] tokens. Returns i -> (token ids, logits)."""
    eng = llm.engine
    reqs = llm.make_requests(prompts, [SamplingParams(max_tokens=n, return_logits=True, ignore_eos=True) for n in lens])
    running = []
    for step in range(steps):
        for i, t in enumerate(joins):
            if t == step:
                logits = eng.prefill([reqs[i]])
                eng.accept(reqs[i], logits[0])
                running.append(reqs[i])
        running = [r for r in running if not r.finished]
        if running:
            for r, row in zip(running, eng.step(running)):
                eng.accept(r, row)
    out = {i: (list(r.output_ids), torch.stack(r.logits)) for i, r in enumerate(reqs)}
    for r in reqs:
        eng.finish(r)
    return out


def test_rows_join_leave_and_grow(hf_checkpoints):
    """Requests join while others decode, leave as they stop (rows freed and reused), and a joining
    request that does not fit the KV capacity makes the buffers grow, moving the running ones."""
    path = hf_checkpoints["qwen3_5"][1]
    prompts, lens, joins = _requests(4), [3, 7, 4], [3, 0, 1]
    ref = _drive(LLM(str(path), decode="dynamic"), prompts, lens, joins)
    llm = LLM(str(path), decode="static")
    dec = llm.engine.decoder
    dec.min_cap = 16                                    # small buckets: the later, longer prompt forces a rebuild
    got = _drive(llm, prompts, lens, joins)
    for i in ref:
        assert got[i][0] == ref[i][0]
        torch.testing.assert_close(got[i][1], ref[i][1], atol=ATOL, rtol=0)
    assert dec.builds >= 2 and dec.static.rows_n == 4          # grown; 3 requests at once at step 3
    assert not dec.row_of                               # every row released at finish


def test_write_back_when_leaving_unfinished(hf_checkpoints, arch):
    """A request that leaves the rows before it stops (here: teacher forcing after decode steps)
    continues from exactly the state the rows held."""
    path = hf_checkpoints[arch][1]
    outs = []
    for decode in ("dynamic", "static"):
        llm = LLM(str(path), decode=decode, seam=4)
        eng = llm.engine
        (r,) = llm.make_requests([_requests(5)[1]], SamplingParams(max_tokens=20, ignore_eos=True))
        eng.accept(r, eng.prefill([r])[0])
        for _ in range(3):
            eng.accept(r, eng.step([r])[0])
        outs.append(eng.extend(r, [5, 6, 7]))
        eng.finish(r)
    torch.testing.assert_close(outs[1], outs[0], atol=ATOL, rtol=0)


def test_decode_attention_fast_equals_reference():
    g = torch.Generator().manual_seed(0)
    b, h, hkv, cap, d, dv = 3, 6, 2, 11, 8, 5
    q = torch.randn(b, h, d, generator=g)
    k, v = torch.randn(b, hkv, cap, d, generator=g), torch.randn(b, hkv, cap, dv, generator=g)
    lengths = torch.tensor([1, 11, 6])
    ref, fast = get_backend("reference"), get_backend("fast")
    o0 = ref.decode_attention(q, k, v, lengths, scale=0.3)
    o1 = fast.decode_attention(q, k, v, lengths, scale=0.3)
    torch.testing.assert_close(o1, o0, atol=1e-6, rtol=0)


def test_rows_grow_while_decoding(hf_checkpoints):
    """Rows reserve KV for a few tokens ahead, not the whole max_tokens; a row that fills up makes the
    buffers grow between steps, and decoding goes on unchanged."""
    path = hf_checkpoints["qwen3_5"][1]
    p = _requests(7)[1]
    sp = SamplingParams(max_tokens=40, return_logits=True, ignore_eos=True)
    ref = LLM(str(path), decode="dynamic").generate([p], sp)[0]
    llm = LLM(str(path), decode="static")
    dec = llm.engine.decoder
    dec.min_cap, dec.ahead = 16, 4
    got = llm.generate([p], sp)[0]
    assert got.token_ids == ref.token_ids
    torch.testing.assert_close(got.logits, ref.logits, atol=ATOL, rtol=0)
    assert dec.builds >= 2                       # grew at least once while decoding


WINDOWED = ["lara_mini", "lfm3", "recurrent_gemma"]      # tiny presets with 12-position sliding windows


@pytest.mark.parametrize("arch_w", WINDOWED)
def test_sliding_window_rows_are_rings(hf_checkpoints, arch_w):
    """A sliding-window layer decodes over a ring of min(capacity, window) slots (the key at position p in slot
    p % C): the same tokens and logits as the dynamic step (which holds and masks every key), through
    - a short prompt whose rows are first narrower than the window (the ring grows with the buffers, never
      wrapping before), then a long decode that wraps it many times;
    - requests joining and leaving between steps (rows reused, a long prompt forcing a rebuild that moves the
      running rows through their states, ring order unrolled);
    - a request leaving unfinished and continuing on the dynamic path from the state the ring wrote back."""
    if arch_w not in hf_checkpoints:
        pytest.skip(f"{arch_w}: transformers lacks its class")
    from hypic import Prompt
    from hypic.runtime.decode import StaticDecoder

    path = hf_checkpoints[arch_w][1]
    short = [Prompt(query=[5, 9, 17]), Prompt(segments=[[7, 8, 9, 10]], query=[11, 12])]
    sp = SamplingParams(max_tokens=30, return_logits=True, ignore_eos=True)
    ref = LLM(str(path), decode="dynamic").generate(short, sp)
    llm = LLM(str(path), decode="static", seam=4)
    dec = llm.engine.decoder
    assert isinstance(dec, StaticDecoder)
    dec.min_cap, dec.ahead = 4, 2                           # rows of 4 slots first: rings of 4, then 8, 12
    got = llm.generate(short, sp)
    for a, b in zip(ref, got):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)
    assert dec.builds >= 3
    windows = {l: m.window for l, m in llm.engine.model.mixers.items() if getattr(m, "window", 0)}
    assert windows and all(dec.static.layers[l].ring and dec.static.layers[l].k.shape[2] == w
                           for l, w in windows.items())
    assert all(not dec.static.layers[l].ring for l in llm.engine.model.mixers if l not in windows
               and hasattr(dec.static.layers[l], "ring"))

    prompts, lens, joins = _requests(4), [3, 20, 9], [3, 0, 1]
    ref = _drive(LLM(str(path), decode="dynamic"), prompts, lens, joins, steps=24)
    llm = LLM(str(path), decode="static")
    llm.engine.decoder.min_cap = 16
    got = _drive(llm, prompts, lens, joins, steps=24)
    for i in ref:
        assert got[i][0] == ref[i][0]
        torch.testing.assert_close(got[i][1], ref[i][1], atol=ATOL, rtol=0)
    assert llm.engine.decoder.builds >= 2


def test_ring_load_refuses_missing_positions():
    """A window's ring is filled by position; a buffer that lacks a position the next query sees is refused with
    the reason, not decoded over a stale slot."""
    from hypic.runtime.state import KVBuffer, StaticKV

    st = StaticKV.empty(1, 4, 1, 2, 2, dtype=torch.float32, device="cpu", ring=True)
    buf = KVBuffer(1, 2, 2, dtype=torch.float32, device="cpu")
    pos = torch.tensor([0, 1, 2, 3, 5, 6])                 # position 4 missing: the next query (7) sees 4 .. 7
    buf.append(torch.randn(6, 1, 2), torch.randn(6, 1, 2), pos)
    with pytest.raises(ValueError, match="ring needs"):
        st.load(0, buf)
    buf = KVBuffer(1, 2, 2, dtype=torch.float32, device="cpu")
    k, v = torch.randn(7, 1, 2), torch.randn(7, 1, 2)
    buf.append(k, v, torch.arange(7))
    st.load(0, buf)                                        # positions 4, 5, 6 in slots 0, 1, 2; slot 3 free for 7
    assert st.n.tolist() == [3] and st.pos[0].tolist() == [4, 5, 6, -1]
    back = st.store(0, 0, 4)
    torch.testing.assert_close(back.view()[0], k[4:])
    assert back.view()[2].tolist() == [4, 5, 6]


@pytest.mark.parametrize("arch_i", ["qwen4_exp", "glm5_next"])
def test_indexed_rows_select_like_the_planned_walk(hf_checkpoints, arch_i, monkeypatch):
    """Indexed attention decodes over fixed buffers: each step pools every row's raw indexer keys (slots in any
    order, placed segments' first) into blocks at their true positions and selects per row with no host sync
    (`_Indexer.select_rows`); the same tokens and logits as the planned step, requests joining and leaving, and the
    selection really leaves keys out (each step's rows hold more complete blocks than the indexer's budget)."""
    if arch_i not in hf_checkpoints:
        pytest.skip(f"{arch_i}: transformers lacks its class")
    import hypic.layers.indexed as indexed

    seen = []
    orig = indexed._Indexer.select_rows

    def spy(self, q, q_pos, st, attn_pos):
        allowed = orig(self, q, q_pos, st, attn_pos)
        valid = torch.arange(allowed.shape[1])[None, :] < st.n[:, None]
        seen.append(bool(((~allowed) & valid).any()))
        return allowed

    monkeypatch.setattr(indexed._Indexer, "select_rows", spy)
    path = hf_checkpoints[arch_i][1]
    prompts, lens, joins = _requests(6), [3, 7, 4], [2, 0, 1]
    ref = _drive(LLM(str(path), decode="dynamic", seam=4), prompts, lens, joins)
    assert not seen
    got = _drive(LLM(str(path), decode="static", seam=4), prompts, lens, joins)
    for i in ref:
        assert got[i][0] == ref[i][0]
        torch.testing.assert_close(got[i][1], ref[i][1], atol=ATOL, rtol=0)
    assert seen and all(seen)
