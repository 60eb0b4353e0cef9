"""The last layer on the logits rows alone (models/base.py CausalLM.run_layers, `ForwardBatch.keep`).

After the last layer only the rows that return logits are read, so its attention attends from those rows only and
its MLP runs on them alone (every layer's state is still updated from every row). Against the plain forward
(PRUNE_LAST_LAYER False), for every architecture and mode, prefill and decode: the same tokens, and logits within
1e-5 (fp32: the kept rows' values are the same numbers, only the GEMMs' row counts differ, which may change their
summation order, ~1e-7 relative here). And the cut happens: the last layer's MLP sees as many rows as return logits,
its attention (planned walk and fixed-buffer compose pass) queries from those rows only."""

import pytest
import torch

import hypic.models.base as base
from hypic import LLM, Prompt, SamplingParams

from .test_fast import _requests

ATOL = 1e-5


@pytest.mark.parametrize("mode", ["full", "pic", "prefix"])
def test_last_layer_on_logits_rows_equals_plain_forward(hf_checkpoints, arch, mode, monkeypatch):
    path = hf_checkpoints[arch][1]
    outs = {}
    for prune in (False, True):
        monkeypatch.setattr(base, "PRUNE_LAST_LAYER", prune)
        llm = LLM(str(path), cache_mode=mode, seam=4)
        outs[prune] = llm.generate(_requests(2), SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True))
    for a, b in zip(outs[False], outs[True]):
        assert b.token_ids == a.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=ATOL, rtol=0)


def _spy_last_layer(llm, monkeypatch):
    """Rows seen by the last layer's MLP and by its attention's queries, per forward."""
    model = llm.engine.model
    last = model.model.layers[-1]
    seen = {"mlp": [], "queries": []}
    last.mlp.register_forward_hook(lambda mod, args, out: seen["mlp"].append(args[0].shape[0]))
    attn = last.state_mixer
    ops = attn.ops
    orig = ops.position_attention

    def spy(q, *a, **k):
        seen["queries"].append(q.shape[0])
        return orig(q, *a, **k)

    monkeypatch.setattr(attn, "ops", type("Ops", (), {"__getattr__": lambda self, n: getattr(ops, n),
                                                       "position_attention": staticmethod(spy)})())
    return seen


@pytest.mark.parametrize("compose", ["eager", "static"])
def test_last_layer_cuts_rows(hf_checkpoints, compose, monkeypatch):
    """tiny-qwen3.5 ends with an attention layer: a 3-segment request computes the last layer's MLP and attention
    queries for its last token only, in the planned walk and in the fixed-buffer compose pass; decode steps (one row
    per request, all returning logits) are not cut."""
    path = hf_checkpoints["qwen3_5"][1]
    llm = LLM(str(path), seam=4, compose=compose, decode="dynamic")
    p = Prompt(segments=[list(range(3, 40)), list(range(50, 90)), list(range(100, 130))], query=list(range(140, 150)))
    sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
    llm.generate([p], sp)                                  # cold: the segments cached (their prefill returns nothing)
    seen = _spy_last_layer(llm, monkeypatch)
    o = llm.generate([p], sp)[0]                           # warm: seams and query, then two decode steps
    assert o.composed_tokens > 0
    assert seen["mlp"] == [1, 1, 1]
    assert seen["queries"] == [1, 1, 1]
    if compose == "static":
        assert llm.engine.composer.runs == 2               # both requests composed over the fixed buffers
    seen["mlp"].clear()
    monkeypatch.setattr(base, "PRUNE_LAST_LAYER", False)
    llm.generate([Prompt(query=list(range(3, 30)))], SamplingParams(max_tokens=1))
    assert seen["mlp"] == [27]
