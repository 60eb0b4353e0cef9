"""Invariant 7: hypic's `full` mode equals transformers' own implementation of the same
architecture with the same random weights (prefill logits and several decode steps). For
Ring-linear (`bailing_moe_linear`, not in transformers) the oracle is tests/ring_reference.py.

Bound: max |logit difference| <= 1e-4 (fp32; observed ~3e-7). The decode-step oracle is
transformers' forward over prompt + generated tokens (teacher forcing, no cache): its
`generate()` logits deviate from that same forward by up to ~5e-2 on these slow-decay weights
(transformers 5.24, CPU torch fallbacks; enough to flip a greedy token on qwen3_next), so the
greedy reference is built by repeated no-cache forwards."""

import torch

from hypic import Prompt, SamplingParams
from .conftest import rand_ids


def test_full_mode_matches_transformers(hf_checkpoints, llms, arch):
    model, _ = hf_checkpoints[arch]
    llm = llms[arch]
    llm.set_policy("full")
    ids = rand_ids(90, 5)
    seq = list(ids)
    with torch.no_grad():
        for _ in range(6):
            seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
    out = llm.generate([Prompt(query=ids)], SamplingParams(max_tokens=6, return_logits=True, ignore_eos=True))[0]
    assert out.token_ids == seq[len(ids):]
    with torch.no_grad():
        forced = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1 : -1]
    assert (out.logits - forced).abs().max() <= 1e-4
    # prefill logits of every position, through score(): teacher forcing over the prompt
    with torch.no_grad():
        all_ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    lp = llm.score(Prompt(query=ids[:10]), ids[10:])
    ref_lp = [float(all_ref[i - 1, ids[i]]) for i in range(10, len(ids))]
    assert max(abs(a - b) for a, b in zip(lp, ref_lp)) <= 1e-4


def test_pic_spans_are_the_concatenation(llms, arch):
    """Every mode runs on exactly the concatenated span tokens."""
    llm = llms[arch]
    p = Prompt(prefix=[1, 2], segments=[[3, 4, 5], [6]], query=[7, 8])
    for mode in ("full", "prefix", "pic"):
        llm.set_policy(mode)
        assert llm.generate([p], SamplingParams(max_tokens=1))[0].prompt_token_ids == list(range(1, 9))
