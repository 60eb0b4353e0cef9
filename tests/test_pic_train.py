"""PIC in the loop (quality/pic_train.py): the engine's compose path is differentiable, and with a seam
covering every document it equals full recomputation in loss and gradients."""

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from hypic import LLM

from .conftest import rand_ids

ROOT = Path(__file__).resolve().parents[1]


def _pic_train():
    spec = importlib.util.spec_from_file_location("pic_train", ROOT / "quality" / "pic_train.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pic_train"] = mod
    spec.loader.exec_module(mod)
    return mod


def _examples(pt, seed):
    docs = [rand_ids(n, seed + i) for i, n in enumerate((23, 9, 41))]
    q, a = rand_ids(6, seed + 10), rand_ids(4, seed + 11)
    return [pt.Example(rand_ids(5, seed + 20), docs, q + a, [False] * 6 + [True] * 4),
            pt.Example([], docs[::-1], a + q, [False] * 4 + [True] * 6)]


def _loss_and_grads(model, pt, exs, mode, seam):
    model.zero_grad(set_to_none=True)
    loss = pt.example_loss(model, exs, mode, seam, "cpu")
    loss.backward()
    return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_pic_with_covering_seam_equals_full_in_loss_and_gradients(hf_checkpoints, arch):
    pt = _pic_train()
    model = LLM(str(hf_checkpoints[arch][1])).engine.model
    for p in model.parameters():
        p.requires_grad_(True)
    exs = _examples(pt, 3)
    lf, gf = _loss_and_grads(model, pt, exs, "full", 0)
    lp, gp = _loss_and_grads(model, pt, exs, "pic", 1000)          # every document recomputed
    assert abs(lp - lf) < 1e-5
    assert gf.keys() == gp.keys() and len(gf) > 10
    for n in gf:
        torch.testing.assert_close(gp[n], gf[n], atol=1e-5, rtol=1e-4, msg=n)
    # with a short seam the documents are isolated: another loss, and gradients reach every layer
    # through the composed states and the placed keys
    # (a random model predicts nearly uniformly, so compare gradients, not losses)
    l0, g0 = _loss_and_grads(model, pt, exs, "pic", 2)
    assert l0 != lf
    assert max(float((g0[n] - gf[n]).norm() / gf[n].norm().clamp(min=1e-12)) for n in gf) > 1e-2
    assert all(g0[n].abs().sum() > 0 for n in g0 if "layers.0." in n)


def test_anchored_pic_with_one_document_after_the_prefix_equals_full(hf_checkpoints):
    """--anchor prefix: each document's isolated prefill runs after its example's prefix (the engine's
    CachePolicy.anchor), so one document after a prefix is exact in the trainer too; unanchored it is not."""
    pt = _pic_train()
    model = LLM(str(hf_checkpoints["qwen3_5"][1])).engine.model
    q, a = rand_ids(6, 62), rand_ids(4, 63)
    exs = [pt.Example(rand_ids(5, 60), [rand_ids(23, 61)], q + a, [False] * 6 + [True] * 4)]
    with torch.no_grad():
        lf = pt.example_loss(model, exs, "full", 0, "cpu").item()
        la = pt.example_loss(model, exs, "pic", 2, "cpu", anchor=True).item()
        lu = pt.example_loss(model, exs, "pic", 2, "cpu").item()
    assert abs(la - lf) < 1e-5 and abs(lu - lf) > 1e-4


def test_a_few_pic_steps_lower_the_pic_loss(hf_checkpoints):
    pt = _pic_train()
    model = LLM(str(hf_checkpoints["qwen3_5"][1])).engine.model
    for p in model.parameters():
        p.requires_grad_(True)
    exs = _examples(pt, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss = pt.example_loss(model, exs, "pic", 2, "cpu")
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1


def test_fast_backend_kernels_step_aside_under_autograd(monkeypatch):
    """Where the fast backend's Triton kernels would run (a GPU; here the interpreter flag on CPU tensors),
    none is called on tensors that need gradients: they have no backward, and a kernel there silently cut
    the gradient of the isolated prefill's (T, S) and of the placed keys (found for the H200's PIC
    trainer test). Each kernel here records whether it was handed such tensors, then fails, so its
    PyTorch form runs; the trainer's loss and gradients equal the plain backend's."""
    from hypic.ops import fast

    pt = _pic_train()
    exs = _examples(pt, 5)
    model = LLM("tiny-qwen3.5", device="cpu", dtype="float32", seed=0).engine.model
    for p in model.parameters():
        p.requires_grad_(True)
    lr, gr = _loss_and_grads(model, pt, exs, "pic", 2)

    calls = []

    def fake(name):
        def kern(*args, **kw):
            calls.append((name, fast.needs_grad(*[a for a in args if isinstance(a, torch.Tensor)])))
            raise RuntimeError("no kernel in this test")
        return kern

    monkeypatch.setattr(fast, "INTERPRETED", True)
    monkeypatch.setattr(fast, "FAILED", set())
    monkeypatch.setattr(fast, "_import_kernel", fake)
    lk, gk = _loss_and_grads(model, pt, exs, "pic", 2)
    assert not any(g for _, g in calls), calls
    assert lk == pytest.approx(lr, abs=1e-6)
    assert gk.keys() == gr.keys()
    for n in gr:
        torch.testing.assert_close(gk[n], gr[n], atol=1e-6, rtol=1e-5, msg=n)


@pytest.mark.parametrize("arch", ["qwen3_5", "qwen3_5_moe"])
def test_capture_gap_is_zero_for_a_first_document_and_positive_after_others(hf_checkpoints, arch):
    """The consistency loss compares what isolated prefill caches with what the same run computes in context.
    A document that opens the prompt (no prefix) starts from the zero state in both: its gap is rounding. Behind
    other documents it is not, and its gradient reaches the model; the answer losses of consistency_losses are
    example_loss's."""
    pt = _pic_train()
    model = LLM(str(hf_checkpoints[arch][1])).engine.model
    for p in model.parameters():
        p.requires_grad_(True)
    docs = [rand_ids(n, 40 + i) for i, n in enumerate((23, 9, 41))]
    q, a = rand_ids(6, 50), rand_ids(4, 51)
    alone = [pt.Example([], docs[:1], q + a, [False] * 6 + [True] * 4)]
    _, _, gap = pt.consistency_losses(model, alone, 4, "cpu")
    assert gap.item() < 1e-9
    exs = _examples(pt, 3)
    lp, lf, gap = pt.consistency_losses(model, exs, 4, "cpu")
    assert gap.item() > 1e-4
    assert lp.item() == pytest.approx(pt.example_loss(model, exs, "pic", 4, "cpu").item(), abs=1e-5)
    assert lf.item() == pytest.approx(pt.example_loss(model, exs, "full", 4, "cpu").item(), abs=1e-5)
    model.zero_grad(set_to_none=True)
    gap.backward()
    grads = [p.grad for n, p in model.named_parameters() if "layers.0." in n and p.grad is not None]
    assert grads and sum(float(g.abs().sum()) for g in grads) > 0


def test_a_few_consistency_steps_lower_the_capture_gap(hf_checkpoints):
    pt = _pic_train()
    model = LLM(str(hf_checkpoints["qwen3_5"][1])).engine.model
    for p in model.parameters():
        p.requires_grad_(True)
    exs = _examples(pt, 5)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    gaps = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        _, _, gap = pt.consistency_losses(model, exs, 2, "cpu")
        gap.backward()
        opt.step()
        gaps.append(gap.item())
    assert gaps[-1] < 0.7 * gaps[0], gaps
