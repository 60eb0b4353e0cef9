"""PIC on plain transformers (llama, qwen2: no linear layer), beyond the shared invariants.

A one-layer transformer's keys and values depend on each token alone, so a segment's isolated,
position-free K/V are exactly what full recomputation computes there. PIC with seam 0 must then
equal full for any prefix and any number of segments: this pins down the placement of cached keys
at non-zero positions (RoPE re-rotation by the segment's true start), which invariants 2 and 3 do
not reach (a seam covering everything uses no entry; one segment at 0 is placed at 0)."""

import pytest
import torch

from hypic import LLM, Prompt, SamplingParams
from .conftest import hf_model, rand_ids


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_one_layer_pic_is_exact_at_any_position(arch, tmp_path):
    from hypic.segment.tokenizer import Tokenizer

    hf_model(arch, num_hidden_layers=1).save_pretrained(tmp_path)
    Tokenizer.builtin_bytes().hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), cache_mode="full")
    p = Prompt(prefix=rand_ids(7, 1), segments=[rand_ids(n, 10 + n) for n in (30, 5, 64, 17)], query=rand_ids(4, 2))
    params = SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True)
    full = llm.generate([p], params)[0]
    for seam in (0, 3):
        llm.set_policy("pic", seam)
        pic = llm.generate([p], params)[0]
        assert pic.composed_tokens == sum(max(0, n - seam) for n in (30, 5, 64, 17))
        assert pic.token_ids == full.token_ids
        torch.testing.assert_close(pic.logits, full.logits, atol=1e-5, rtol=0)
    # with two layers the second layer's keys depend on context: PIC is no longer exact
    hf_model(arch, num_hidden_layers=2).save_pretrained(tmp_path)
    two = LLM(str(tmp_path), cache_mode="full")
    ref = two.next_token_logits(p)
    two.set_policy("pic", 0)
    assert (two.next_token_logits(p) - ref).abs().max() > 1e-3
