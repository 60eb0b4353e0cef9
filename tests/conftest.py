"""Shared fixtures: tiny random models of every supported architecture, built with transformers'
own classes (the oracle), saved with save_pretrained and loaded by hypic. Ring-linear
(`bailing_moe_linear`) is not in transformers: its oracle is the independent reference forward in
tests/ring_reference.py, which writes a checkpoint in the real layout the same way.

fla, causal_conv1d and mamba_ssm are blocked before transformers is imported: they cannot run on a CPU and
transformers would otherwise swap them in. On a GPU machine, `pytest tests/test_gpu.py --gpu-kernels`
leaves them importable, so hypic's fast path runs fla's kernels there (without the flag those tests
exercise the reference ops on CUDA, and the fla-only ones skip).
"""

import sys

if "--gpu-kernels" not in sys.argv:
    sys.modules.setdefault("fla", None)
    sys.modules.setdefault("causal_conv1d", None)
    sys.modules.setdefault("mamba_ssm", None)

import pytest  # noqa: E402
import torch  # noqa: E402


def pytest_addoption(parser):
    parser.addoption("--gpu-kernels", action="store_true",
                     help="do not block fla / causal_conv1d / mamba_ssm (GPU machines; run tests/test_gpu.py alone)")

from hypic.models.presets import preset_config  # noqa: E402

ARCHS = {
    "qwen3_5": ("tiny-qwen3.5", "Qwen3_5ForCausalLM"),
    "qwen3_5_moe": ("tiny-qwen3.5-moe", "Qwen3_5MoeForCausalLM"),
    "qwen3_next": ("tiny-qwen3-next", "Qwen3NextForCausalLM"),
    "kimi_linear": ("tiny-kimi-linear", "KimiLinearForCausalLM"),
    "minimax": ("tiny-minimax", "MiniMaxForCausalLM"),
    "nemotron_h": ("tiny-nemotron-h", "NemotronHForCausalLM"),
    "jamba": ("tiny-jamba", "JambaForCausalLM"),
    "bailing_moe_linear": ("tiny-ring-linear", None),          # None: tests/ring_reference.py
    "lfm2": ("tiny-lfm2", "Lfm2ForCausalLM"),
    "lfm2_moe": ("tiny-lfm2-moe", "Lfm2MoeForCausalLM"),
    "granitemoehybrid": ("tiny-granite-4.0-h", "GraniteMoeHybridForCausalLM"),
    "olmo_hybrid": ("tiny-olmo-hybrid", "OlmoHybridForCausalLM"),
    "falcon_h1": ("tiny-falcon-h1", "FalconH1ForCausalLM"),
    "bailing_hybrid": ("tiny-ling-3.0", "BailingHybridForCausalLM"),
    "bamba": ("tiny-bamba", "BambaForCausalLM"),
    "zamba2": ("tiny-zamba2", "Zamba2ForCausalLM"),
    "zamba": ("tiny-zamba", "ZambaForCausalLM"),
    "lara_mini": ("tiny-lara-mini", "LaraMiniForCausalLM"),
    "lfm3": ("tiny-lfm3", "Lfm3ForCausalLM"),
    "recurrent_gemma": ("tiny-recurrent-gemma", "RecurrentGemmaForCausalLM"),
    "qwen4_exp": ("tiny-qwen4-exp", "Qwen4ExpForCausalLM"),
    "glm5_next": ("tiny-glm5-next", "Glm5NextForConditionalGeneration"),   # its only LM class: with a tiny vision tower
    "mamba": ("tiny-mamba", "MambaForCausalLM"),
    "falcon_mamba": ("tiny-falcon-mamba", "FalconMambaForCausalLM"),
    "mamba2": ("tiny-mamba2", "Mamba2ForCausalLM"),
    "llama": ("tiny-llama", "LlamaForCausalLM"),
    "qwen2": ("tiny-qwen2", "Qwen2ForCausalLM"),
}


def _shipped(cls: str | None) -> bool:
    """transformers ships the oracle class (bailing_hybrid is newer than 5.17, the GPU machine's)."""
    if cls is None:
        return True
    import transformers

    return hasattr(transformers, cls)


ARCHS = {a: v for a, v in ARCHS.items() if _shipped(v[1])}


TINY_VISION = dict(depth=1, hidden_size=16, num_heads=2, intermediate_size=16, out_hidden_size=64,
                   projection_intermediate_size=16)


def hf_model(arch: str, seed: int = 0, **overrides):
    """A transformers model of the arch's tiny preset with *slow* decays (A in [0.01, 0.3]) and
    non-trivial norms, so the transition operator T is far from zero and a wrong composition shows."""
    import transformers
    from transformers import AutoConfig

    preset, cls = ARCHS[arch]
    d = preset_config(preset)
    d.update(overrides)
    if cls is None:
        from .ring_reference import RingLinearReference

        return RingLinearReference(d, seed)
    mt = d.pop("model_type")
    torch.manual_seed(seed)
    if cls.endswith("ForConditionalGeneration"):       # a multimodal class: the text config under a tiny vision tower
        config = AutoConfig.for_model(mt.removesuffix("_text"), text_config=dict(d, model_type=mt),
                                      vision_config=TINY_VISION)
    else:
        config = AutoConfig.for_model(mt, **d)
    model = getattr(transformers, cls)(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "visual" in name:
                continue
            if arch in ("bailing_hybrid", "glm5_next") and "forget_gate" in name and name.endswith(("A_log", "dt_bias")):
                # the bounded gate g = -5 sigmoid(exp(A_log) (f + dt_bias)) is slow when its argument is well below 0
                lo, hi = (1.0, 16.0) if name.endswith("A_log") else (-2.0, -0.5)
                p.copy_(torch.empty_like(p).uniform_(lo, hi))
                if name.endswith("A_log"):
                    p.log_()
            elif name.endswith("A_log"):
                p.copy_(torch.empty_like(p).uniform_(0.01, 0.3).log())
            elif name.endswith(("dt_bias", "dt_proj_bias")):
                p.copy_(torch.empty_like(p).uniform_(-2.0, 0.0))
            elif "norm" in name:
                p.add_(torch.randn_like(p) * 0.1)
            elif arch == "qwen4_exp" and name.endswith("ple.conv1d.weight"):
                p.copy_(torch.randn_like(p) * 0.5)      # the n-gram embeddings' dilated conv: zero at init
            elif name.endswith(("conv1d.weight", "conv.conv.weight")):
                p.mul_(3.0)
            elif name.endswith((".mixer.D", ".mamba.D")):   # Mamba's skip: small, so the state path shows
                p.copy_(torch.randn_like(p) * 0.1)
            elif name.endswith(("mixer.in_proj.weight", "mamba.in_proj.weight", "conv.in_proj.weight")):
                p.mul_(5.0)                        # Mamba's x, B, C (and LFM2's B, C, x) at O(1)
            elif arch == "glm5_next" and name.endswith(("compress_ape", "_hc.base", "k_norm.bias")):
                p.copy_(torch.randn_like(p) * 0.5)      # zero at init: make them count
            elif arch == "glm5_next" and name.endswith(("compress_gate", "weights_proj.weight")):
                p.copy_(torch.randn_like(p) * 0.3)      # ones / tiny at init: pooling weights and head weights at O(1)
            elif "adapter_list" in name:          # Zamba2's per-layer adapters: as large as the shared weights
                p.mul_(8.0)
            elif name.endswith("x_proj_weight"):  # Zamba's per-head x_proj: B and C at O(1) (no norms after it)
                p.mul_(25.0)
            elif arch in ("llama", "qwen2", "recurrent_gemma") and name.endswith("bias"):   # zero at init: make them count
                p.copy_(torch.randn_like(p) * 0.1)
            elif arch == "recurrent_gemma" and name.endswith(("gate_weight", "conv_1d.weight")):
                p.mul_(10.0)                       # the RG-LRU's gates and conv at O(1): their inputs show
        if arch == "glm5_next":                   # the router's correction bias (a buffer, zero at init)
            for name, b in model.named_buffers():
                if name.endswith("e_score_correction_bias"):
                    b.copy_(torch.rand_like(b) * 0.3)
        if arch == "lfm2_moe":                    # the selection-only expert bias (a buffer, zero at init): make it count
            for name, b in model.named_buffers():
                if name.endswith("expert_bias"):
                    b.copy_(torch.rand_like(b) * 0.3)
    return model


@pytest.fixture(scope="session")
def hf_checkpoints(tmp_path_factory):
    """arch -> (transformers model, checkpoint dir with the builtin tokenizer saved beside it)."""
    from hypic.segment.tokenizer import Tokenizer

    out = {}
    for arch in ARCHS:
        model = hf_model(arch)
        path = tmp_path_factory.mktemp(arch)
        model.save_pretrained(path)
        Tokenizer.builtin_bytes().hf.save_pretrained(path)
        out[arch] = (model, path)
    return out


@pytest.fixture(params=list(ARCHS), scope="session")
def arch(request):
    return request.param


@pytest.fixture(scope="session")
def llms(hf_checkpoints):
    """arch -> hypic.LLM on that checkpoint (pic mode, seam 8); tests switch mode with set_policy."""
    from hypic import LLM

    return {a: LLM(str(path), cache_mode="pic", seam=8) for a, (_, path) in hf_checkpoints.items()}


@pytest.fixture
def llm(llms, arch):
    engine = llms[arch]
    engine.clear_cache()
    engine.set_policy("pic", 8, anchor="none")
    yield engine
    engine.clear_cache()


def rand_ids(n: int, seed: int, vocab: int = 256) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()
