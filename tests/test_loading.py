"""Checkpoint formats and bad-input handling of the loader."""

import json
import shutil

import pytest
import torch
from safetensors.torch import save_file

from hypic import LLM, ConfigError, Prompt, UnsupportedArchitectureError, WeightsError
from .conftest import rand_ids


def _reference_logits(path, ids):
    return LLM(str(path), cache_mode="full").next_token_logits(Prompt(query=ids))


def test_sharded_checkpoint(hf_checkpoints, tmp_path):
    model, path = hf_checkpoints["qwen3_5_moe"]
    model.save_pretrained(tmp_path, max_shard_size="300KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    assert len(list(tmp_path.glob("*.safetensors"))) > 1
    ids = rand_ids(20, 1)
    torch.testing.assert_close(_reference_logits(tmp_path, ids), _reference_logits(path, ids), atol=0, rtol=0)


def test_nested_text_config_and_fused_experts(hf_checkpoints, llms, tmp_path):
    """The multimodal layout: config with text_config, weights under model.language_model.*, experts
    already fused (gate_up_proj / down_proj), vision and MTP tensors present and ignored."""
    _, path = hf_checkpoints["qwen3_5_moe"]
    cfg = json.loads((path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_5_moe", "text_config": cfg,
                                                      "vision_config": {"depth": 1}}))
    sd = {k: v.clone() for k, v in llms["qwen3_5_moe"].engine.model.state_dict().items()}
    renamed = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v for k, v in sd.items()}
    renamed["model.visual.patch_embed.weight"] = torch.zeros(2, 2)
    renamed["mtp.fc.weight"] = torch.zeros(2, 2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    ids = rand_ids(20, 2)
    torch.testing.assert_close(_reference_logits(tmp_path, ids), _reference_logits(path, ids), atol=0, rtol=0)


def test_tokenizer_files_and_text_prompts(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["qwen3_5"]
    llm = LLM(str(path))
    assert llm.tokenizer is not None and llm.tokenizer.chat_template
    out = llm.generate([Prompt(segments=["a document"], query="a question")])[0]
    assert isinstance(out.text, str)
    # the same checkpoint without tokenizer files: token ids work, text is refused clearly
    for f in path.iterdir():
        if not f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(f, tmp_path / f.name)
    bare = LLM(str(tmp_path))
    assert bare.tokenizer is None
    assert bare.generate([Prompt(query=[1, 2, 3])])[0].text is None
    with pytest.raises(ValueError, match="no tokenizer"):
        bare.generate([Prompt(query="text")])


def test_unknown_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2", "n_embd": 8}))
    with pytest.raises(UnsupportedArchitectureError, match="gpt2"):
        LLM(str(tmp_path))


def test_sliding_window_transformer_parses():
    """Qwen2 with sliding-window layers (from max_window_layers on): their window is kept per layer (the oracle test
    is in tests/test_family_variants.py)."""
    from hypic.config import ModelConfig
    from hypic.models.presets import preset_config

    d = dict(preset_config("tiny-qwen2"), use_sliding_window=True, sliding_window=64, max_window_layers=2)
    c = ModelConfig.from_dict(d)
    assert c.params.sliding_window == 64 and c.params.window_layers == (2, 3)
    assert c.params.sliding_window == 64 and ModelConfig.from_dict(preset_config("tiny-qwen2")).params.window_layers == ()


def test_unsupported_layer_type(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["qwen3_5"]
    cfg = json.loads((path / "config.json").read_text())
    cfg["layer_types"] = ["sliding_attention"] + cfg["layer_types"][1:]
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(UnsupportedArchitectureError, match="sliding_attention"):
        LLM(str(tmp_path), load_format="dummy")


@pytest.mark.parametrize("arch,field,value,name", [
    ("kimi_linear", "layer_types", ["linear_attention", "sliding_attention"], "sliding_attention"),
    ("lfm2", "layer_types", ["conv", "sliding_attention"], "sliding_attention"),
    ("jamba", None, None, None),
])
def test_unsupported_layer_type_names_the_type(arch, field, value, name):
    """A config with a layer type hypic cannot serve fails at parse time, naming the type."""
    from hypic.config import ModelConfig
    from hypic.models.presets import preset_config

    presets = {"nemotron_h": "tiny-nemotron-h", "kimi_linear": "tiny-kimi-linear", "jamba": "tiny-jamba",
               "lfm2": "tiny-lfm2"}
    d = preset_config(presets[arch])
    if field is None:                                       # the preset itself parses
        assert ModelConfig.from_dict(d).arch == arch
        return
    d[field] = value
    d.pop("num_hidden_layers", None)
    if arch == "lfm2":
        d["num_hidden_layers"] = len(value)
    if arch == "kimi_linear":
        d["num_hidden_layers"] = len(value)
        d["mlp_layer_types"] = ["dense"] * len(value)
    with pytest.raises(UnsupportedArchitectureError, match=name):
        ModelConfig.from_dict(d)


def test_unsupported_hybrid_says_why(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "xlstm"}))
    with pytest.raises(UnsupportedArchitectureError, match="xlstm.*not affine"):
        LLM(str(tmp_path))


def test_missing_and_mismatched_weights(hf_checkpoints, tmp_path):
    _, path = hf_checkpoints["qwen3_5"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    with pytest.raises(WeightsError, match="no \\*.safetensors"):
        LLM(str(tmp_path))
    from safetensors.torch import load_file

    sd = load_file(str(path / "model.safetensors"))
    partial = dict(sd)
    partial.pop("model.norm.weight")
    save_file(partial, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="missing"):
        LLM(str(tmp_path))
    bad = dict(sd)
    bad["model.norm.weight"] = torch.zeros(3)
    save_file(bad, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="shape"):
        LLM(str(tmp_path))
    extra = dict(sd)
    extra["model.layers.0.something_else"] = torch.zeros(3)
    save_file(extra, str(tmp_path / "model.safetensors"))
    with pytest.raises(WeightsError, match="match no parameter"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").write_bytes(b"not a safetensors file")
    with pytest.raises(WeightsError, match="cannot read"):
        LLM(str(tmp_path))
    (tmp_path / "model.safetensors").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "shard-1.safetensors"}}))
    with pytest.raises(WeightsError, match="missing"):
        LLM(str(tmp_path))


def test_unknown_model_and_options():
    with pytest.raises(ConfigError, match="neither a preset"):
        LLM("no-such-model-or-dir")
    with pytest.raises(ConfigError, match="seam"):
        LLM("tiny-qwen3.5", seam=-1)
    with pytest.raises(ConfigError, match="cache mode"):
        LLM("tiny-qwen3.5", cache_mode="bogus")
    with pytest.raises(ConfigError, match="load_format"):
        LLM("tiny-qwen3.5", load_format="gguf")


def test_dummy_load_every_architecture(hf_checkpoints, arch):
    """Dummy weights at the checkpoint's architecture: deterministic per seed, finite logits, and
    PIC still composes (a hit after a miss gives the same logits)."""
    _, path = hf_checkpoints[arch]
    a = LLM(str(path), load_format="dummy", seed=3)
    p = Prompt(segments=[rand_ids(30, 1), rand_ids(20, 2)], query=[1, 2])
    x, y = a.next_token_logits(p), a.next_token_logits(p)
    assert torch.isfinite(x).all()
    torch.testing.assert_close(x, y, atol=1e-6, rtol=0)
    b = LLM(str(path), load_format="dummy", seed=3)
    torch.testing.assert_close(b.next_token_logits(p), x, atol=0, rtol=0)


def test_dummy_load_of_a_directory(hf_checkpoints):
    _, path = hf_checkpoints["qwen3_next"]
    a = LLM(str(path), load_format="dummy", seed=1).next_token_logits(Prompt(query=[1, 2]))
    b = LLM(str(path), load_format="dummy", seed=1).next_token_logits(Prompt(query=[1, 2]))
    torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_real_size_presets_parse():
    from hypic.config import ModelConfig
    from hypic.models.presets import preset_config

    c = ModelConfig.from_dict(preset_config("qwen3.5-35b-a3b"))
    assert c.num_layers == 40 and len(c.linear_layers) == 30 and c.attention_layers[0] == 3
    assert c.params.rotary_dim == 64 and c.params.num_experts == 256 and len(c.params.moe_layers) == 40
    n = ModelConfig.from_dict(preset_config("qwen3-next-80b-a3b"))
    assert n.num_layers == 48 and len(n.attention_layers) == 12 and n.params.num_experts == 512


def test_zamba_7b_preset_matches_transformers_at_full_size():
    """Zamba-7B-v1's real config: hypic's model and transformers' own, both built on the meta device, have the same
    parameters (names and shapes; the one shared block counted once)."""
    import transformers
    from transformers import AutoConfig

    from hypic.config import PARALLEL, ModelConfig
    from hypic.models.presets import preset_config
    from hypic.models.registry import model_class
    from hypic.ops import get_backend

    d = preset_config("zamba-7b-v1")
    c = ModelConfig.from_dict(d)
    assert c.layer_types.count(PARALLEL) == 13 and c.params.hybrid_layer_ids[:3] == (2, 7, 13)
    with torch.device("meta"):
        ours = model_class(c.arch)(c, get_backend("reference"))
        theirs = transformers.ZambaForCausalLM(AutoConfig.for_model("zamba", **{k: v for k, v in d.items()
                                                                               if k != "model_type"}))
    shapes = lambda m: {n: tuple(p.shape) for n, p in m.named_parameters()}   # noqa: E731
    assert shapes(ours) == shapes(theirs)
    assert 7.0e9 < sum(p.numel() for p in ours.parameters()) < 7.5e9


def test_ring_linear_config_and_layout(hf_checkpoints, tmp_path):
    """bailing_moe_linear: the real Ring-mini config parses (every 5th layer full, layer 0 dense); the
    tail of a stack that is not a whole number of groups is full attention; the checkpoint's
    alternative names load to the same model (vLLM's e_score_correction_bias, dropped MTP tensors)."""
    from safetensors.torch import load_file

    from hypic.config import FULL, ModelConfig, bailing_layer_types
    from hypic.models.presets import preset_config

    c = ModelConfig.from_dict(preset_config("ring-mini-linear-2.0"))
    assert c.attention_layers == (4, 9, 14, 19) and len(c.linear_layers) == 16
    assert c.params.moe_layers == tuple(range(1, 20)) and c.params.rotary_dim == 64
    assert [i for i, t in enumerate(bailing_layer_types(22, 5)) if t == FULL] == [4, 9, 14, 19, 20, 21]
    _, path = hf_checkpoints["bailing_moe_linear"]
    shutil.copy(path / "config.json", tmp_path / "config.json")
    sd = load_file(str(path / "model.safetensors"))
    renamed = {k.replace("mlp.gate.expert_bias", "mlp.gate.e_score_correction_bias"): v for k, v in sd.items()}
    renamed["model.mtp.layers.0.weight"] = torch.zeros(2)
    save_file(renamed, str(tmp_path / "model.safetensors"))
    ids = rand_ids(20, 3)
    torch.testing.assert_close(_reference_logits(tmp_path, ids), _reference_logits(path, ids), atol=0, rtol=0)


@pytest.mark.parametrize("field,value,name", [
    ("rope_scaling", {"type": "yarn", "factor": 4.0}, "rope_scaling"),
    ("score_function", "tanh", "tanh"),
])
def test_ring_linear_unsupported_values_are_named(field, value, name):
    from hypic.config import ModelConfig
    from hypic.models.presets import preset_config

    d = dict(preset_config("tiny-ring-linear"), **{field: value})
    with pytest.raises(UnsupportedArchitectureError, match=name):
        ModelConfig.from_dict(d)


def test_routers_stay_fp32_in_bf16(hf_checkpoints):
    """DeepSeek-style routers (Kimi-Linear here; Nemotron 3, Ring-linear and Ling 3.0 alike) keep their weights and
    correction bias in fp32 when the engine runs in bf16, and so does KDA's dt_bias (Ling 3.0: also A_log), as
    transformers keeps them: loaded from the checkpoint without rounding; every other parameter is bf16."""
    from safetensors.torch import load_file

    _, path = hf_checkpoints["kimi_linear"]
    llm = LLM(str(path), dtype="bfloat16")
    params = dict(llm.engine.model.named_parameters())
    kept = {n for n, p in params.items() if p.dtype == torch.float32}
    assert kept and all(n.endswith((".gate.weight", ".e_score_correction_bias", ".dt_bias")) for n in kept)
    assert any(n.endswith(".dt_bias") for n in kept)                   # KDA's, as transformers keeps it
    assert all(p.dtype == torch.bfloat16 for n, p in params.items() if n not in kept)
    from hypic.models.registry import converter

    cfg = llm.engine.cfg
    sd = converter(cfg.arch)(load_file(str(path / "model.safetensors")), cfg)    # hypic's names
    name = next(n for n in kept if n.endswith(".gate.weight"))
    assert torch.equal(params[name], sd[name].float())
    assert torch.isfinite(llm.next_token_logits(Prompt(query=rand_ids(20, 1)))).all()


def test_from_tensors_builds_every_architecture(hf_checkpoints, arch):
    """`loader.from_tensors` (the model built on the meta device, its parameters then the given checkpoint-named
    tensors: gpu_bench's way to share transformers' weights) gives the same logits as loading the checkpoint, for
    every architecture: nothing a model makes at construction may stay on the meta device (RecurrentGemma's bf16
    embedding scale was read from a meta tensor and failed)."""
    from safetensors.torch import load_file

    from hypic import LLM, Prompt
    from hypic.config import EngineConfig
    from hypic.models.loader import from_tensors

    path = hf_checkpoints[arch][1]
    ref = LLM(str(path))
    tensors = {}
    for f in sorted(path.glob("*.safetensors")):
        tensors.update(load_file(str(f)))
    loaded = from_tensors(ref.model_config, tensors, EngineConfig(), "from-tensors")
    assert not any(p.is_meta for p in loaded.model.parameters())
    llm = LLM.from_loaded(loaded, EngineConfig())
    p = Prompt(segments=[list(range(3, 30)), list(range(40, 60))], query=list(range(70, 80)))
    # (fp32; the tensors may sit in other layouts than a loaded checkpoint's, so GEMMs may sum in another order)
    torch.testing.assert_close(llm.next_token_logits(p), ref.next_token_logits(p), atol=1e-5, rtol=0)
