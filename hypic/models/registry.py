"""Architecture registry: hypic arch name -> (model class, checkpoint key converter), lazily imported."""

from __future__ import annotations

import importlib

from ..errors import UnsupportedArchitectureError

_MODELS = {
    "qwen3_5": ("hypic.models.qwen3_5", "HybridForCausalLM", "hypic.models.convert", "qwen3_5"),
    "qwen3_5_moe": ("hypic.models.qwen3_5", "HybridForCausalLM", "hypic.models.convert", "qwen3_5"),
    "qwen3_next": ("hypic.models.qwen3_5", "HybridForCausalLM", "hypic.models.convert", "qwen3_next"),
    "kimi_linear": ("hypic.models.kimi_linear", "KimiLinearForCausalLM", "hypic.models.convert", "kimi_linear"),
    "minimax": ("hypic.models.minimax", "MiniMaxForCausalLM", "hypic.models.convert", "minimax"),
    "nemotron_h": ("hypic.models.nemotron_h", "NemotronHForCausalLM", "hypic.models.convert", "nemotron_h"),
    "jamba": ("hypic.models.jamba", "JambaForCausalLM", "hypic.models.convert", "jamba"),
    "bailing_moe_linear": ("hypic.models.bailing_moe_linear", "BailingMoeLinearForCausalLM", "hypic.models.convert",
                           "bailing_moe_linear"),
    "lfm2": ("hypic.models.lfm2", "Lfm2ForCausalLM", "hypic.models.convert", "lfm2"),
    "lfm2_moe": ("hypic.models.lfm2", "Lfm2ForCausalLM", "hypic.models.convert", "lfm2"),
    "granitemoehybrid": ("hypic.models.granitemoehybrid", "GraniteMoeHybridForCausalLM", "hypic.models.convert",
                         "granitemoehybrid"),
    "bailing_hybrid": ("hypic.models.bailing_hybrid", "BailingHybridForCausalLM", "hypic.models.convert",
                       "bailing_hybrid"),
    "falcon_h1": ("hypic.models.falcon_h1", "FalconH1ForCausalLM", "hypic.models.convert", "falcon_h1"),
    "olmo_hybrid": ("hypic.models.olmo_hybrid", "OlmoHybridForCausalLM", "hypic.models.convert", "olmo_hybrid"),
    "bamba": ("hypic.models.bamba", "BambaForCausalLM", "hypic.models.convert", "bamba"),
    "lfm3": ("hypic.models.lfm3", "Lfm3ForCausalLM", "hypic.models.convert", "lfm3"),
    "lara_mini": ("hypic.models.lara_mini", "LaraMiniForCausalLM", "hypic.models.convert", "lara_mini"),
    "zamba2": ("hypic.models.zamba", "ZambaForCausalLM", "hypic.models.convert", "zamba"),
    "zamba": ("hypic.models.zamba", "ZambaForCausalLM", "hypic.models.convert", "zamba"),
    "recurrent_gemma": ("hypic.models.recurrent_gemma", "RecurrentGemmaForCausalLM", "hypic.models.convert",
                        "recurrent_gemma"),
    "qwen4_exp": ("hypic.models.qwen4_exp", "Qwen4ExpForCausalLM", "hypic.models.convert", "qwen4_exp"),
    "glm5_next": ("hypic.models.glm5_next", "Glm5NextForCausalLM", "hypic.models.convert", "glm5_next"),
    "mamba": ("hypic.models.mamba", "MambaForCausalLM", "hypic.models.convert", "nemotron_h"),
    "falcon_mamba": ("hypic.models.mamba", "MambaForCausalLM", "hypic.models.convert", "nemotron_h"),
    "mamba2": ("hypic.models.mamba", "MambaForCausalLM", "hypic.models.convert", "nemotron_h"),
    "llama": ("hypic.models.llama", "TransformerForCausalLM", "hypic.models.convert", "transformer"),
    "qwen2": ("hypic.models.llama", "TransformerForCausalLM", "hypic.models.convert", "transformer"),
}


def model_class(arch: str):
    if arch not in _MODELS:
        raise UnsupportedArchitectureError(f"no model registered for architecture {arch!r}")
    mod, cls, _, _ = _MODELS[arch]
    return getattr(importlib.import_module(mod), cls)


def converter(arch: str):
    mod, _, cmod, fn = _MODELS[arch]
    return getattr(importlib.import_module(cmod), fn)
