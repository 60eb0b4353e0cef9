"""Config variants of Granite 4.0-H (`granitemoehybrid`), OLMo-Hybrid (`olmo_hybrid`), Falcon-H1 (`falcon_h1`),
Ling 3.0 (`bailing_hybrid`), Zamba2, Zamba and Bamba beyond the tiny presets that every parametrized test runs, and
their released layouts.

Granite: the preset is NoPE with experts; here RoPE (cached keys placed at new positions), dense (no experts,
shared MLP only), the released expert names, a time-step limit. OLMo-Hybrid: the preset has RoPE and beta in
[0, 2]; here NoPE and beta in [0, 1], and the released layout's q / k / v conv tensors at their real widths.
Falcon-H1: the preset has a gated norm before the gate; here after it, none (y * silu(z)), and the Mamba2 width from
mamba_expand; and a segment entry holds both of a layer's mixers. Ling 3.0 (in transformers 5.24, not 5.17): the preset has
the bounded KDA gate and full-rank queries; here the unbounded gate and low-rank queries, and the released layout
(attention / dense names, split convs, per-expert tensors, expert_bias, MTP layers dropped). Zamba2 / Zamba: no
adapters, NoPE, one block, biases, two groups / one Mamba head; blocks are shared (named once), entries hold both
mixers of a hybrid layer, and checkpoints that repeat a block under every layer load (a differing copy is refused).
Bamba: biases, wider heads, two groups.
Oracle: transformers' own classes with the same random weights; bounds as tests/test_oracle.py and
tests/test_invariants.py (1e-4 on logits, fp32)."""

import math
from pathlib import Path

import pytest
import torch

from hypic import LLM, Prompt, SamplingParams
from hypic.segment.tokenizer import Tokenizer
from .conftest import hf_model, rand_ids

ATOL = 1e-4
ROPE = dict(position_embedding_type="rope", rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def _engine(model, path, **kw):
    model.save_pretrained(path)
    Tokenizer.builtin_bytes().hf.save_pretrained(path)
    return LLM(str(path), **kw)


def _same_engine_from(tmp_path, llm, tensors) -> Path:
    """Writes `tensors` as a checkpoint beside the one in tmp_path/a (same config and tokenizer) at tmp_path/b and
    checks that an engine on it gives `llm`'s logits bit for bit."""
    from safetensors.torch import save_file

    (tmp_path / "b").mkdir(exist_ok=True)
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "b" / f).write_bytes((tmp_path / "a" / f).read_bytes())
    save_file(tensors, str(tmp_path / "b" / "model.safetensors"))
    ids = rand_ids(50, 8)
    llm.set_policy("full")
    other = LLM(str(tmp_path / "b"), cache_mode="full")
    assert torch.equal(llm.next_token_logits(Prompt(query=ids)), other.next_token_logits(Prompt(query=ids)))
    return tmp_path / "b"


def _check_full(model, llm, n=70):
    """Greedy tokens and their logits equal transformers' forward over the same sequence."""
    ids = rand_ids(n, 3)
    llm.set_policy("full")
    out = llm.generate([Prompt(query=ids)], SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True))[0]
    with torch.no_grad():
        forced = model(torch.tensor([ids + out.token_ids])).logits[0, len(ids) - 1: -1]
    assert out.token_ids == forced.argmax(-1).tolist()
    assert (out.logits - forced).abs().max() <= ATOL


def _prompt(seed):
    return Prompt(prefix=rand_ids(10, seed), segments=[rand_ids(n, seed + n) for n in (40, 3, 90)],
                  query=rand_ids(6, seed + 1))


def _pic_checks(llm):
    """Invariant 2 (a seam covering every segment is full recomputation) and a hit equal to a miss after the
    segments moved (a cached RoPE key placed anew must equal one computed there)."""
    p = _prompt(1)
    llm.set_policy("full")
    full = llm.next_token_logits(p)
    llm.set_policy("pic", 90)
    torch.testing.assert_close(llm.next_token_logits(p), full, atol=ATOL, rtol=0)
    llm.set_policy("pic", 8)
    llm.clear_cache()
    moved = Prompt(prefix=rand_ids(23, 9), segments=list(reversed(p.segments)), query=p.query)
    cold = llm.next_token_logits(moved)
    llm.next_token_logits(p)                                  # the entries now also serve another order
    warm = llm.next_token_logits(moved)
    torch.testing.assert_close(warm, cold, atol=ATOL, rtol=0)
    assert (warm - full).abs().max() > 0                      # pic at seam 8 is not full recomputation


def _grouped_norm() -> bool:
    """transformers >= 5.24 normalises the Mamba2 output per group (mamba_ssm's gated norm with n_groups > 1);
    5.17 over the whole width. The two agree at one group, as the released Granite 4.0-H models have."""
    import inspect

    from transformers.models.granitemoehybrid import modeling_granitemoehybrid as m

    return "group_size" in inspect.signature(m.GraniteMoeHybridRMSNormGated.__init__).parameters


@pytest.mark.parametrize("variant", ["rope", "dense", "rope-dense", "groups2"])
def test_granite_variants_match_transformers(tmp_path, variant):
    over = dict(ROPE) if "rope" in variant else {}
    if "dense" in variant:
        over["num_local_experts"] = 0
    if variant == "groups2":
        if not _grouped_norm():
            pytest.skip("this transformers normalises the Mamba2 output over all groups at once (5.17)")
        over["mamba_n_groups"] = 2
    model = hf_model("granitemoehybrid", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    assert (llm.engine.model.model.rotary is not None) == ("rope" in variant)
    assert all((layer.block_sparse_moe is None) == ("dense" in variant) for layer in llm.engine.model.model.layers)
    _check_full(model, llm)
    _pic_checks(llm)


def test_granite_released_expert_names(tmp_path):
    """Granite 4.0-H checkpoints as released name the experts block_sparse_moe.{input_linear, output_linear,
    router.layer}: the same weights under those names give the same engine."""
    from safetensors.torch import load_file

    model = hf_model("granitemoehybrid", seed=5)
    llm = _engine(model, tmp_path / "a")
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    old = {}
    for k, v in sd.items():
        k = k.replace("block_sparse_moe.experts.gate_up_proj", "block_sparse_moe.input_linear.weight")
        k = k.replace("block_sparse_moe.experts.down_proj", "block_sparse_moe.output_linear.weight")
        old[k.replace("block_sparse_moe.router.weight", "block_sparse_moe.router.layer.weight")] = v
    assert any("input_linear" in k for k in old) and any("router.layer" in k for k in old)
    _same_engine_from(tmp_path, llm, old)


def test_granite_time_step_limit_clamps_dt(tmp_path):
    """A finite time_step_limit clamps dt on both sides, as transformers' chunked scan does (the default
    (0, inf) clamps nothing)."""
    model = hf_model("granitemoehybrid", seed=6, time_step_limit=(0.05, 0.2))
    llm = _engine(model, tmp_path)
    mixer = llm.engine.model.model.layers[0].mamba
    assert (mixer.dt_min, mixer.dt_max) == (0.05, 0.2)
    ids = rand_ids(60, 2)
    llm.set_policy("full")
    with torch.no_grad():
        ref = model(torch.tensor([ids])).logits[0, -1]
    assert (llm.next_token_logits(Prompt(query=ids)) - ref).abs().max() <= ATOL


@pytest.mark.parametrize("variant", ["nope", "beta01", "nope-beta01"])
def test_olmo_variants_match_transformers(tmp_path, variant):
    over = {}
    if "nope" in variant:
        over["rope_parameters"] = {"rope_type": "default", "rope_theta": None}     # how a config says NoPE
    if "beta01" in variant:
        over["linear_allow_neg_eigval"] = False
    model = hf_model("olmo_hybrid", seed=4, **over)
    assert (model.model.rotary_emb is None) == ("nope" in variant)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    assert (llm.engine.model.model.rotary is None) == ("nope" in variant)
    gdn = llm.engine.model.model.layers[0].linear_attn
    assert gdn.beta_scale == (1.0 if "beta01" in variant else 2.0)
    _check_full(model, llm)
    _pic_checks(llm)


def test_olmo_released_layout(tmp_path):
    """The released layout: attention_layer_norm / feedforward_layer_norm on the GDN layers, and the short conv as
    q_conv1d [key_dim], k_conv1d [key_dim], v_conv1d [value_dim] (transformers saves near-equal chunks instead:
    joining gives the same weight, and a missing part is a clear error)."""
    from safetensors.torch import load_file, save_file

    from hypic.errors import WeightsError

    model = hf_model("olmo_hybrid", seed=7)
    llm = _engine(model, tmp_path / "a")
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    kd, vd = 2 * 16, 4 * 16                                   # the preset's key and value widths
    real = {}
    for k, v in sd.items():
        if k.endswith("linear_attn.q_conv1d.weight"):
            full = torch.cat([v] + [sd[k.replace("q_conv1d", c)] for c in ("k_conv1d", "v_conv1d")], dim=0)
            for c, part in zip(("q_conv1d", "k_conv1d", "v_conv1d"), full.split([kd, kd, vd], dim=0)):
                real[k.replace("q_conv1d", c)] = part.clone()
        elif not k.endswith(("linear_attn.k_conv1d.weight", "linear_attn.v_conv1d.weight")):
            real[k] = v
    assert any(k.endswith("attention_layer_norm.weight") for k in real)
    assert real["model.layers.0.linear_attn.v_conv1d.weight"].shape[0] == vd
    _same_engine_from(tmp_path, llm, real)
    del real["model.layers.0.linear_attn.k_conv1d.weight"]
    save_file(real, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(WeightsError, match="k_conv1d"):
        LLM(str(tmp_path / "b"))


@pytest.mark.parametrize("variant", ["norm-after-gate", "no-norm", "expand"])
def test_falcon_variants_match_transformers(tmp_path, variant):
    over = {"norm-after-gate": dict(mamba_norm_before_gate=False), "no-norm": dict(mamba_rms_norm=False),
            "expand": dict(mamba_d_ssm=None, mamba_expand=1)}[variant]
    model = hf_model("falcon_h1", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    mamba = llm.engine.model.model.layers[0].mamba
    assert (mamba.norm is None) == (variant == "no-norm")
    _check_full(model, llm)
    _pic_checks(llm)


def test_falcon_entry_holds_both_mixers_of_a_layer(tmp_path):
    """Each Falcon-H1 layer has a Mamba2 mixer (id i) and attention (id num_layers + i) side by side: a cached
    segment carries T, S and the conv tail for the first and position-free K / V for the second."""
    from hypic.cache.entry import AttnKV, LinearSummary

    model = hf_model("falcon_h1", seed=2)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    n = len(llm.engine.model.model.layers)
    model_ = llm.engine.model
    assert sorted(model_.mixers) == list(range(2 * n))
    # made once per list of layers, read only; another list of layers (fewer here) is walked again
    assert model_.mixers is model_.mixers
    with pytest.raises(TypeError):
        model_.mixers[0] = None
    layers = model_.model.layers
    model_.model.layers = torch.nn.ModuleList(list(layers)[:2])
    assert sorted(model_.mixers) == [0, 1, n, n + 1]
    model_.model.layers = layers
    assert sorted(model_.mixers) == list(range(2 * n))
    seg = rand_ids(60, 4)
    llm.next_token_logits(Prompt(prefix=rand_ids(5, 1), segments=[seg], query=rand_ids(4, 2)))
    (entry,) = list(llm.engine.segments.values())
    assert sorted(entry.layers) == list(range(2 * n))
    for i in range(n):
        assert isinstance(entry.layers[i], LinearSummary) and isinstance(entry.layers[n + i], AttnKV)
        assert entry.layers[n + i].k.shape[0] == 60 - 8          # the keys after the seam window


def _ling():
    import transformers

    if not hasattr(transformers, "BailingHybridForCausalLM"):
        pytest.skip(f"transformers {transformers.__version__} does not ship bailing_hybrid")


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 64,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0}


@pytest.mark.parametrize("variant", ["unbounded-gate", "q-lora", "yarn"])
def test_ling_variants_match_transformers(tmp_path, variant):
    """yarn: YaRN frequencies and attention factor in the cos / sin tables, and DeepSeek's mscale ** 2 on the
    softmax scale (a context 8x the original 64 positions, so the prompts here reach the interpolated band; with
    mscale = mscale_all_dim the tables' own attention factor is 1)."""
    _ling()
    over = {"unbounded-gate": dict(kda_safe_gate=False), "q-lora": dict(q_lora_rank=24),
            "yarn": dict(rope_parameters=YARN, max_position_embeddings=512)}[variant]
    model = hf_model("bailing_hybrid", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    assert llm.engine.model.model.layers[0].self_attn.forget_gate.safe == (variant != "unbounded-gate")
    if variant == "yarn":
        mla = llm.engine.model.model.layers[3].self_attn
        assert mla.scale == pytest.approx(mla.key_dim ** -0.5 * (0.1 * math.log(8.0) + 1.0) ** 2)
        plain = 1.0 / 10000.0 ** (torch.arange(0, mla.rope, 2, dtype=torch.float64) / mla.rope)
        assert not torch.allclose(mla.rotary[0].inv_freq.double(), plain)       # the interpolated frequencies
    _check_full(model, llm)
    _pic_checks(llm)


def test_ling_released_layout(tmp_path):
    """The same weights under the released names load to the same engine; an MTP layer after the last decoder
    layer is dropped."""
    from safetensors.torch import load_file

    _ling()
    model = hf_model("bailing_hybrid", seed=7)
    llm = _engine(model, tmp_path / "a")
    sd = load_file(str(tmp_path / "a" / "model.safetensors"))
    n = model.config.num_hidden_layers
    rel = {}
    for k, v in sd.items():
        k = k.replace("model.embed_tokens.", "model.word_embeddings.").replace(".self_attn.", ".attention.")
        k = k.replace(".attention.o_proj.", ".attention.dense.").replace(".attention.forget_gate.", ".attention.")
        k = k.replace(".mlp.gate.e_score_correction_bias", ".mlp.gate.expert_bias")
        if k.endswith("attention.conv1d.weight"):
            q, kk, vv = v.split(v.shape[0] // 3, dim=0)
            for c, part in zip(("q_conv1d", "k_conv1d", "v_conv1d"), (q, kk, vv)):
                rel[k.replace("conv1d", c)] = part.clone()
        elif k.endswith("mlp.experts.gate_up_proj"):
            gate, up = v.chunk(2, dim=1)
            for e in range(v.shape[0]):
                rel[k.replace("gate_up_proj", f"{e}.gate_proj.weight")] = gate[e].clone()
                rel[k.replace("gate_up_proj", f"{e}.up_proj.weight")] = up[e].clone()
        elif k.endswith("mlp.experts.down_proj"):
            for e in range(v.shape[0]):
                rel[k.replace("down_proj", f"{e}.down_proj.weight")] = v[e].clone()
        else:
            rel[k] = v
    rel[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(4, 4)               # an MTP layer's tensor
    assert any(".attention.dense." in k for k in rel) and any(".attention.f_proj." in k for k in rel)
    _same_engine_from(tmp_path, llm, rel)


# -- Zamba2: shared transformer blocks with per-layer adapters ---------------------------------------------------------
@pytest.mark.parametrize("variant", ["no-adapters-gqa", "nope", "one-block", "silu-bias", "groups2"])
def test_zamba2_variants_match_transformers(tmp_path, variant):
    """The preset has two blocks in turn, q / k / v adapters, RoPE and GELU; here no attention adapters (with GQA,
    which adapters rule out), NoPE (`use_mem_rope` off: cached keys are used as they are), one block serving every
    hybrid layer, SiLU with biases on the Mamba2 and MLP projections (`add_bias_linear`), and two Mamba2 groups
    (Zamba2 normalises per group in transformers 5.17 and 5.24 alike)."""
    over = {"no-adapters-gqa": dict(use_shared_attention_adapter=False, num_key_value_heads=2),
            "nope": dict(use_mem_rope=False), "one-block": dict(num_mem_blocks=1),
            "silu-bias": dict(hidden_act="silu", add_bias_linear=True), "groups2": dict(mamba_ngroups=2)}[variant]
    model = hf_model("zamba2", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    attn = llm.engine.model.model.layers[1].attn
    assert attn.places_keys() == (variant != "nope")
    _check_full(model, llm)
    _pic_checks(llm)


def test_zamba2_shared_blocks_and_entries(tmp_path):
    """A block is one set of weights however many layers use it (named once, as transformers saves it), each
    hybrid layer's attention has its own mixer id (num_layers + i) beside its Mamba2 mixer (i), and a cached segment
    holds both for a hybrid layer, the Mamba2 summary alone for the others."""
    from hypic.cache.entry import AttnKV, LinearSummary

    model = hf_model("zamba2", seed=2)
    llm = _engine(model, tmp_path / "a", cache_mode="pic", seam=8)
    layers = llm.engine.model.model.layers
    n, hybrid = len(layers), (1, 3, 5)
    assert layers[1].shared_transformer is layers[5].shared_transformer is not layers[3].shared_transformer
    ours = sum(p.numel() for p in llm.engine.model.parameters())
    assert ours == sum(p.numel() for p in model.parameters())          # both count each shared tensor once
    assert sorted(llm.engine.model.mixers) == sorted(list(range(n)) + [n + i for i in hybrid])
    seg = rand_ids(60, 4)
    llm.next_token_logits(Prompt(prefix=rand_ids(5, 1), segments=[seg], query=rand_ids(4, 2)))
    (entry,) = list(llm.engine.segments.values())
    assert sorted(entry.layers) == sorted(llm.engine.model.mixers)
    for i in range(n):
        assert isinstance(entry.layers[i], LinearSummary)
    for i in hybrid:
        assert isinstance(entry.layers[n + i], AttnKV) and entry.layers[n + i].k.shape[0] == 60 - 8


@pytest.mark.parametrize("arch", ["zamba2", "zamba"])
def test_zamba_checkpoint_with_untied_copies(tmp_path, arch):
    """A checkpoint that stores a shared block again under every layer using it loads to the same engine; a copy that
    differs from the block it should repeat is refused."""
    from safetensors.torch import load_file, save_file

    from hypic.errors import WeightsError

    block, first, later = {"zamba2": ("shared_transformer", 1, 5), "zamba": ("shared_transf", 2, 5)}[arch]
    model = hf_model(arch, seed=3)
    llm = _engine(model, tmp_path / "a", cache_mode="full")
    real = load_file(str(tmp_path / "a" / "model.safetensors"))
    assert not any(k.startswith(f"model.layers.{later}.{block}.") for k in real)      # saved once
    copies = {k.replace(f"layers.{first}.", f"layers.{later}."): v.clone() for k, v in real.items()
              if k.startswith(f"model.layers.{first}.{block}.")}
    assert copies
    _same_engine_from(tmp_path, llm, {**real, **copies})
    key = f"model.layers.{later}.{block}.self_attn.q_proj.weight"
    copies[key] = copies[key] + 1.0
    save_file({**real, **copies}, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(WeightsError, match="shared block"):
        LLM(str(tmp_path / "b"))


@pytest.mark.parametrize("variant", ["one-head-mha", "biases-silu"])
def test_zamba_variants_match_transformers(tmp_path, variant):
    """Zamba (Mamba1 with per-head x_proj / dt_proj): the preset has two Mamba heads, GQA and GELU; here one head (plain
    S6 without Jamba's norms) with full multi-head attention, and biases on in_proj / out_proj with a SiLU MLP."""
    over = {"one-head-mha": dict(n_mamba_heads=1, num_key_value_heads=4),
            "biases-silu": dict(mamba_proj_bias=True, hidden_act="silu")}[variant]
    model = hf_model("zamba", seed=4, **over)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("in_proj.bias", "out_proj.bias")):
                p.copy_(torch.randn_like(p) * 0.1)                     # zero at init: make them count
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    layers = llm.engine.model.model.layers
    assert layers[2].shared_transf is layers[5].shared_transf
    assert layers[0].mamba.heads == over.get("n_mamba_heads", 2)
    _check_full(model, llm)
    _pic_checks(llm)


# -- Bamba ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["biases", "wide-heads", "groups2"])
def test_bamba_variants_match_transformers(tmp_path, variant):
    """The preset has no biases and RoPE on half of each head (transformers fixes partial_rotary_factor at 0.5 for
    Bamba); here biases on attention, MLP and Mamba2 projections, a wider head with its half rotated, and two Mamba2
    groups (normalised per group from transformers 5.24 on, as mamba_ssm does; 5.17 normalises the whole width)."""
    import inspect

    from transformers.models.bamba import modeling_bamba

    if variant == "groups2" and "group_size" not in inspect.signature(modeling_bamba.BambaRMSNormGated).parameters:
        pytest.skip("this transformers normalises Bamba's Mamba2 output over all groups at once")
    over = {"biases": dict(attention_bias=True, mlp_bias=True, mamba_proj_bias=True),
            "wide-heads": dict(num_attention_heads=2, num_key_value_heads=1), "groups2": dict(mamba_n_groups=2)}[variant]
    model = hf_model("bamba", seed=4, **over)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias") and "conv1d" not in name and "dt_bias" not in name:
                p.copy_(torch.randn_like(p) * 0.1)                     # zero at init: make them count
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    attn = llm.engine.model.model.layers[2].self_attn
    assert attn.rotary[0].rotary_dim == attn.hd // 2
    _check_full(model, llm)
    _pic_checks(llm)


# -- LFM2-MoE ------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["no-bias-no-norm", "state-dict-layout"])
def test_lfm2_moe_variants(tmp_path, variant):
    """The preset has the selection-only expert bias and renormalised weights; here neither. The checkpoint transformers
    writes has per-expert w1 / w3 / w2 tensors (fused on load); its in-memory state dict has the fused 3-D ones, which
    load as they are to the same engine."""
    over = {"no-bias-no-norm": dict(use_expert_bias=False, norm_topk_prob=False), "state-dict-layout": {}}[variant]
    model = hf_model("lfm2_moe", seed=4, **over)
    llm = _engine(model, tmp_path / "a", cache_mode="pic", seam=8)
    moe = llm.engine.model.model.layers[2].feed_forward
    assert (moe.expert_bias is None) == (variant == "no-bias-no-norm")
    if variant == "state-dict-layout":
        sd = {k: v.contiguous() for k, v in model.state_dict().items() if k != "lm_head.weight"}
        assert "model.layers.2.feed_forward.experts.gate_up_proj" in sd
        _same_engine_from(tmp_path, llm, sd)
        return
    _check_full(model, llm)
    _pic_checks(llm)


# -- Nemotron 3: Nemotron-H's MoE blocks --------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["moe", "latent", "one-group"])
def test_nemotron_3_moe_blocks_match_transformers(tmp_path, variant):
    """Nemotron-H with MoE blocks (tiny-nemotron-3: grouped sigmoid routing over relu² experts with a selection-only
    correction bias, a relu² shared expert); here also experts in a latent space (`moe_latent_size`) and one group.
    The released per-expert up / down tensors (transformers writes them so) are stacked at load."""
    from hypic.models.presets import preset_config

    over = {k: v for k, v in preset_config("tiny-nemotron-3").items() if k != "model_type"}
    over.update({"moe": {}, "latent": dict(moe_latent_size=32), "one-group": dict(n_group=1, topk_group=1)}[variant])
    model = hf_model("nemotron_h", seed=4, **over)
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.rand_like(b) * 0.3)                         # zero at init: make it count
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    moe = llm.engine.model.model.layers[1].mixer
    assert moe.experts.up_proj.shape == (8, 32, 32 if variant == "latent" else 64)
    _check_full(model, llm)
    _pic_checks(llm)


# -- Sliding-window attention (Qwen2's use_sliding_window) --------------------------------------------------------------
@pytest.mark.parametrize("window", [16, 5])
def test_qwen2_sliding_window_layers_match_transformers(tmp_path, window):
    """Qwen2 with sliding-window attention from layer 2 on (`max_window_layers`): a query sees the keys of the last
    `window` positions. Cached keys are placed by position as for full attention, so PIC holds as it is: invariant 2
    (a seam covering every segment is full recomputation) and hits equal misses after the segments moved."""
    model = hf_model("qwen2", seed=4, use_sliding_window=True, sliding_window=window, max_window_layers=2)
    assert model.config.layer_types[2] == "sliding_attention"
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    layers = llm.engine.model.model.layers
    assert [l.self_attn.window for l in layers] == [0, 0, window, window]
    _check_full(model, llm)
    _pic_checks(llm)


# -- RecurrentGemma ------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["mha-bias", "pattern-full-rope", "wide-window"])
def test_recurrent_gemma_variants_match_transformers(tmp_path, variant):
    """The preset: MQA, no q/k/v bias, lru_width != hidden, pattern (r, r, a), window 12, RoPE on half of each head.
    Here: MHA with q/k/v biases; the pattern (r, a) with lru_width == hidden and RoPE on the whole head; a window
    longer than every test prompt (attention as good as full)."""
    over = {"mha-bias": dict(num_key_value_heads=4, attention_bias=True),
            "pattern-full-rope": dict(block_types=["recurrent", "attention"], lru_width=48,
                                      rope_parameters={"rope_type": "default", "rope_theta": 500.0,
                                                       "partial_rotary_factor": 1.0}),
            "wide-window": dict(attention_window_size=4096)}[variant]
    model = hf_model("recurrent_gemma", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    layers = llm.engine.model.model.layers
    kinds = ["attn" if hasattr(l.temporal_block, "q_proj") else "rec" for l in layers]
    pattern = ["rec", "attn"] if variant == "pattern-full-rope" else ["rec", "rec", "attn"]
    assert kinds == (pattern * 3)[:6]
    attn = layers[kinds.index("attn")].temporal_block
    assert attn.window == model.config.attention_window_size
    _check_full(model, llm)
    _pic_checks(llm)


# -- Qwen4-Exp ----------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["sigmoid-gate-two-streams", "blocks8-full-rope"])
def test_qwen4_exp_variants_match_transformers(tmp_path, variant):
    """The preset: silu GDN output gate, three residual streams, blocks of 4 (top 4), RoPE on half of each head. Here:
    a sigmoid output gate with two streams; blocks of 8 (top 3) with RoPE on the whole head (indexer head dim 16)."""
    over = {"sigmoid-gate-two-streams": dict(output_gate_type="sigmoid", hc_count=2),
            "blocks8-full-rope": dict(indexer_compress_ratio=8, indexer_budget=24, indexer_head_dim=16,
                                      rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                       "partial_rotary_factor": 1.0})}[variant]
    model = hf_model("qwen4_exp", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    _check_full(model, llm)
    _pic_checks(llm)


def test_qwen4_exp_selection_is_sparse_and_follows_positions():
    """The indexer's selection on the engine's own keys: past `top` complete blocks a query reads `top` blocks of
    `block` keys plus its incomplete block (not every causal key); before that, every key (None). The same raw keys
    in another slot order select the same positions (the buffer of a request with placed segments is not in
    position order)."""
    from hypic.layers.indexed import IndexerKeys
    from hypic.config import ModelConfig
    from hypic.layers.rope import Rotary
    from hypic.models.presets import preset_config

    cfg = ModelConfig.from_dict(preset_config("tiny-qwen4-exp"))
    p = cfg.params
    rot = Rotary(cfg, p.rotary_dim, dict(p.rope_parameters))
    ix = IndexerKeys(cfg, 99, None, rot)
    g = torch.Generator().manual_seed(0)
    n = 50
    keys = torch.randn(n, 1, p.indexer_head_dim, generator=g)
    q = torch.randn(3, p.indexer_n_heads, p.indexer_head_dim, generator=g)
    pos = torch.arange(n)
    assert ix.select((q,), torch.tensor([3, 10, 15]), keys, pos, pos) is None          # at most 4 complete blocks
    q_pos = torch.tensor([20, 33, 49])
    allowed = ix.select((q,), q_pos, keys, pos, pos) & (pos[None, :] <= q_pos[:, None])
    blocks = (q_pos + 1) // ix.block
    for i in range(3):
        tail = int(q_pos[i]) + 1 - int(blocks[i]) * ix.block
        assert int(allowed[i].sum()) == ix.top * ix.block + tail
        assert allowed[i, int(blocks[i]) * ix.block : int(q_pos[i]) + 1].all()
    perm = torch.randperm(n, generator=g)
    again = ix.select((q,), q_pos, keys[perm], pos[perm], pos[perm]) & (pos[perm][None, :] <= q_pos[:, None])
    assert torch.equal(again, allowed[:, perm])
    import hypic.layers.indexed as indexed

    old, indexed.SCORE_BYTES = indexed.SCORE_BYTES, 1              # the scores one query at a time: the same choice
    try:
        sliced = ix.select((q,), q_pos, keys, pos, pos) & (pos[None, :] <= q_pos[:, None])
    finally:
        indexed.SCORE_BYTES = old
    assert torch.equal(sliced, allowed)


QWEN4_PLE = dict(ple_layer_ids=[1, 4], ple_embed_dim=32, ple_conv_kernel_size=4, ngram_size=3, heads_per_ngram=2,
                 ngram_vocab_size_base=1000, make_ngram_vocab_size_divisible_by=128)


def test_qwen4_exp_ple_matches_transformers_across_eos(tmp_path):
    """Per-layer n-gram embeddings on layers 0 and 3 (small tables): with EOS tokens inside the prompt (the n-gram
    history resets after each) every position's log-probabilities equal transformers' (1e-4), and so do greedy
    decode steps; PIC with a seam covering every segment equals full recomputation (the history crosses segment
    boundaries through the cached conv tails), a hit equals a miss after the segments moved, and `prefix` equals
    `full`. The saved table shards are joined, and hashing buffers that differ from the config's are refused."""
    from safetensors.torch import load_file, save_file

    from hypic.errors import WeightsError

    model = hf_model("qwen4_exp", seed=6, **QWEN4_PLE)
    assert model.config.ple_layer_ids == [1, 4]
    llm = _engine(model, tmp_path / "a", cache_mode="full")
    eos = 256
    ids = rand_ids(70, 9)
    for i in (20, 41, 42, 69):
        ids[i] = eos
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), -1)
    lp = llm.score(Prompt(query=ids[:10]), ids[10:])
    assert max(abs(a - float(ref[i - 1, ids[i]])) for a, i in zip(lp, range(10, 70))) <= ATOL
    _check_full(model, llm)
    p = Prompt(prefix=rand_ids(5, 1), segments=[ids[:30], ids[30:55], rand_ids(12, 3)], query=ids[55:])
    full = llm.next_token_logits(p)
    llm.set_policy("pic", 40)
    torch.testing.assert_close(llm.next_token_logits(p), full, atol=ATOL, rtol=0)
    llm.set_policy("prefix")
    for _ in range(2):                                      # cold, then from the prefix cache
        torch.testing.assert_close(llm.next_token_logits(p), full, atol=ATOL, rtol=0)
    _pic_checks(llm)
    sd = load_file(str(next((tmp_path / "a").glob("*.safetensors"))))
    assert any(".ngram_embedding.shard_" in k for k in sd)
    bad = dict(sd)
    key = "model.layers.0.ple.ple_embedding.layer_multipliers"
    bad[key] = bad[key] + 2
    (tmp_path / "b").mkdir()
    for f in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "b" / f).write_bytes((tmp_path / "a" / f).read_bytes())
    save_file(bad, str(tmp_path / "b" / "model.safetensors"))
    with pytest.raises(WeightsError, match="hashing tables"):
        LLM(str(tmp_path / "b"))


@pytest.mark.parametrize("preset", ["tiny-qwen4-exp", "tiny-glm5-next"])
def test_indexed_attention_in_query_slices_and_chunked_prefill_alike(preset):
    """An indexed layer attends for a bounded number of [query, key] mask elements at a time: slices of a few queries
    give the prefill's and the decode's logits of one slice (equal up to summation order); so does a prefill in
    forwards of at most 16 tokens (the selection then reads the keys of earlier forwards from the buffer)."""
    import hypic.layers.indexed as indexed

    llm = LLM(preset, cache_mode="pic", seam=4)
    p = Prompt(prefix=rand_ids(9, 1), segments=[rand_ids(n, 2 + n) for n in (30, 41)], query=rand_ids(5, 3))
    sp = SamplingParams(max_tokens=4, return_logits=True, ignore_eos=True)
    want = llm.generate([p], sp)[0]
    old, indexed.MASK_ELEMENTS = indexed.MASK_ELEMENTS, 300        # about 3 queries of ~90 keys per slice
    try:
        llm.clear_cache()
        got = llm.generate([p], sp)[0]
    finally:
        indexed.MASK_ELEMENTS = old
    assert got.token_ids == want.token_ids
    torch.testing.assert_close(got.logits, want.logits, atol=1e-5, rtol=0)
    chunked = LLM(preset, cache_mode="pic", seam=4, prefill_chunk_tokens=16)
    for mode in ("full", "pic"):
        llm.set_policy(mode, 4)
        chunked.set_policy(mode, 4)
        a, b = llm.generate([p], sp)[0], chunked.generate([p], sp)[0]
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(b.logits, a.logits, atol=1e-5, rtol=0)


# -- GLM-5 Next ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("variant", ["unbounded-gate-two-streams", "pools8-one-group"])
def test_glm5_next_variants_match_transformers(tmp_path, variant):
    """The preset: the bounded forget gate (-5), three mHC streams, pools of 4 (top 16 tokens), two router groups. Here:
    Kimi's unbounded gate with two streams; pools of 8 (top 24 tokens) with one router group."""
    over = {"unbounded-gate-two-streams": dict(linear_lower_bound=None, hc_mult=2),
            "pools8-one-group": dict(index_kpool=8, index_topk=24, n_group=1, topk_group=1)}[variant]
    model = hf_model("glm5_next", seed=4, **over)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    _check_full(model, llm)
    _pic_checks(llm)


@pytest.mark.parametrize("over,match", [(dict(indexer_types=["full", "full", "full", "full", "full", "shared"]),
                                         "sharing the previous layer"),
                                        (dict(index_kpool_always_select_tail=False), "always_select_tail")])
def test_glm5_next_refuses_what_it_does_not_serve(over, match):
    from hypic.config import ModelConfig
    from hypic.errors import UnsupportedArchitectureError
    from hypic.models.presets import preset_config

    with pytest.raises(UnsupportedArchitectureError, match=match):
        ModelConfig.from_dict(dict(preset_config("tiny-glm5-next"), **over))


def test_glm5_next_released_layout_loads(tmp_path):
    """The checkpoint as transformers saves it (multimodal: `model.language_model.*`, a vision tower, `hc_attn_*`
    tensors, q/k/v convs and forget-gate tensors under `self_attn`, experts one by one) plus an MTP layer and a
    `shared_head` tensor as released checkpoints carry them: the engine drops what it does not serve and loads the
    rest; its logits equal those from the same weights without the extra tensors."""
    from safetensors.torch import load_file

    model = hf_model("glm5_next", seed=2)
    llm = _engine(model, tmp_path / "a", cache_mode="full")
    sd = load_file(str(next((tmp_path / "a").glob("*.safetensors"))))
    assert any(k.startswith("model.visual.") for k in sd) and any(".hc_attn_fn" in k for k in sd)
    extra = dict(sd)
    extra["model.language_model.layers.6.self_attn.q_a_proj.weight"] = torch.zeros(16, 64)       # an MTP layer
    extra["model.language_model.layers.5.shared_head.norm.weight"] = torch.ones(64)
    path = _same_engine_from(tmp_path, llm, extra)
    assert path.exists()


# -- State-space models with no attention layer ------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["mamba", "falcon_mamba", "mamba2"])
def test_ssm_one_layer_pic_is_exact_once_the_seam_covers_the_conv(tmp_path, arch):
    """One SSM layer over the token embeddings: its inputs carry no context, so a cached segment differs from its
    in-context self only by the state it starts from (composed exactly) and its conv warm-up (the seam's business):
    with a seam of W - 1 = 3 tokens PIC equals full recomputation for several segments in any order, cold and warm;
    with a seam of 0 it does not, and neither does a second layer (its inputs, the first layer's outputs, were
    computed without the context: what the seam window approximates in every deeper model)."""
    model = hf_model(arch, seed=5, num_hidden_layers=1)
    llm = _engine(model, tmp_path / "one", cache_mode="full")
    two = _engine(hf_model(arch, seed=5, num_hidden_layers=2), tmp_path / "two", cache_mode="full")
    segs = [rand_ids(n, 60 + n) for n in (40, 3, 90, 17)]
    for order in (segs, segs[::-1]):
        p = Prompt(prefix=rand_ids(7, 1), segments=list(order), query=rand_ids(5, 2))
        for m in (llm, two):
            m.set_policy("full")
        full, full2 = llm.next_token_logits(p), two.next_token_logits(p)
        llm.set_policy("pic", 3)
        for _ in range(2):                                     # cold, then from the cache
            torch.testing.assert_close(llm.next_token_logits(p), full, atol=ATOL, rtol=0)
        llm.set_policy("pic", 0)
        assert (llm.next_token_logits(p) - full).abs().max() > 10 * ATOL
        two.set_policy("pic", 3)
        assert (two.next_token_logits(p) - full2).abs().max() > 10 * ATOL


def test_mamba2_two_groups_match_transformers(tmp_path):
    """Two B / C groups, and the gated output normalised per group (transformers >= 5.24, as mamba_ssm does; the
    preset has one group, where 5.17's whole-width norm agrees)."""
    import inspect

    from transformers.models.mamba2 import modeling_mamba2

    if "group_size" not in inspect.signature(modeling_mamba2.MambaRMSNormGated.__init__).parameters:
        pytest.skip("this transformers normalises Mamba2's output over all groups at once")
    model = hf_model("mamba2", seed=4, n_groups=2)
    llm = _engine(model, tmp_path, cache_mode="pic", seam=8)
    _check_full(model, llm)
    _pic_checks(llm)


# -- Sliding windows drop the keys they no longer see --------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["recurrent_gemma", "lara_mini", "lfm3"])
def test_sliding_window_layers_drop_keys_they_no_longer_see(hf_checkpoints, arch, monkeypatch):
    """A windowed layer's buffer keeps the keys of its last `window` positions (plus up to EVICT_EVERY not yet
    dropped): checking after every key, the buffers stay within the window while the full layers keep every key, and
    tokens and logits equal those with nothing dropped, in full, prefix and pic modes, prefill (in one forward, or in
    forwards of at most 32 tokens) and decode."""
    import hypic.layers.attention as attention

    if arch not in hf_checkpoints:
        pytest.skip(f"this transformers does not ship {arch}")
    path = str(hf_checkpoints[arch][1])
    p = Prompt(prefix=rand_ids(20, 1), segments=[rand_ids(n, 5 + n) for n in (60, 45)], query=rand_ids(6, 2))
    sp = SamplingParams(max_tokens=5, return_logits=True, ignore_eos=True)
    want = {}
    llm = LLM(path)
    for mode in ("full", "prefix", "pic"):
        llm.set_policy(mode, 8)
        llm.clear_cache()
        want[mode] = llm.generate([p], sp)[0]
    seen = []
    evict = attention.AttentionMixer.evict

    def recording(self, batch):
        evict(self, batch)
        seen.extend((self.window, s.state.layers[self.layer_idx].n) for s in batch.seqs)

    monkeypatch.setattr(attention, "EVICT_EVERY", 1)
    monkeypatch.setattr(attention.AttentionMixer, "evict", recording)
    for llm in (LLM(path), LLM(path, prefill_chunk_tokens=32)):    # also a prefill in forwards of <= 32 tokens
        for mode in ("full", "prefix", "pic"):
            llm.set_policy(mode, 8)
            llm.clear_cache()
            for _ in range(2):                      # cold, then from the caches
                got = llm.generate([p], sp)[0]
                assert got.token_ids == want[mode].token_ids
                torch.testing.assert_close(got.logits, want[mode].logits, atol=1e-5, rtol=0)
    window = seen[0][0]
    assert seen and all(w == window for w, _ in seen) and max(n for _, n in seen) <= window
    # several requests of different lengths batched together (prefill and decode steps): each its own buffer
    batch = [p, Prompt(segments=[rand_ids(33, 70)], query=rand_ids(4, 71)), Prompt(query=rand_ids(50, 72))]
    llm = LLM(path)
    got = llm.generate(batch, sp)
    monkeypatch.setattr(attention, "EVICT_EVERY", 1 << 62)              # nothing dropped
    ref = LLM(path).generate(batch, sp)
    for a, b in zip(got, ref):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(a.logits, b.logits, atol=1e-5, rtol=0)


def test_qwen4_exp_token_history_is_exact_in_bf16(tmp_path, monkeypatch):
    """The n-gram history travels as 8-bit digits of (id XOR EOS) through a bf16 conv window: the ids a PLE layer
    reads are the request's previous tokens exactly (EOS before the first), in a bf16 engine too, over prefill and
    decode."""
    import hypic.models.qwen4_ple as ple

    model = hf_model("qwen4_exp", seed=6, **QWEN4_PLE)
    model.save_pretrained(tmp_path)
    Tokenizer.builtin_bytes().hf.save_pretrained(tmp_path)
    llm = LLM(str(tmp_path), cache_mode="full", dtype="bfloat16")
    seen = []
    real = ple.PLE.ngram_ids

    def record(self, ids, prev):
        seen.append((ids.clone(), prev.clone()))
        return real(self, ids, prev)

    monkeypatch.setattr(ple.PLE, "ngram_ids", record)
    ids = [319, 0, 256, 300] + rand_ids(30, 4)
    out = llm.generate([Prompt(query=ids)], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    seq = [256, 256] + ids + out.token_ids
    stream = torch.cat([i for i, _ in seen[::2]]).tolist()           # layer 0's calls: prefill, then each step
    prevs = torch.cat([p for _, p in seen[::2]]).tolist()
    assert stream == (ids + out.token_ids)[: len(stream)]
    assert prevs == [[seq[t + 1], seq[t]] for t in range(len(stream))]
