"""Checkpoint key/layout converters: HF checkpoint tensors -> hypic parameter names.

Each converter takes a dict name -> tensor (one shard at a time is fine: converters only merge
tensors of the same layer, and the loader hands them all at once) and returns a new dict.
Handled layouts:
  - multimodal wrappers: `model.language_model.*` -> `model.*`; `model.visual.*`, `mtp.*` dropped
  - per-expert MoE weights `mlp.experts.{e}.{gate,up,down}_proj.weight` -> fused 3-D tensors
  - Qwen3-Next fused `in_proj_qkvz` / `in_proj_ba` (grouped per key head) -> Qwen3.5's
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`
"""

from __future__ import annotations

import re

import torch

from ..config import ModelConfig

DROP = (re.compile(r"^mtp\."), re.compile(r"^(model\.)?visual\."), re.compile(r"^model\.vision_tower\."))


def _common(tensors: dict, cfg: ModelConfig) -> dict:
    out = {}
    for name, t in tensors.items():
        if any(p.match(name) for p in DROP):
            continue
        if name.startswith("model.language_model."):
            name = "model." + name[len("model.language_model."):]
        elif name.startswith("language_model.model."):
            name = "model." + name[len("language_model.model."):]
        elif name.startswith("language_model.lm_head."):
            name = name[len("language_model."):]
        out[name] = t
    return _fuse_experts(out, cfg)


def _fuse_experts(tensors: dict, cfg: ModelConfig) -> dict:
    pat = re.compile(r"^(.*\.mlp\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
    groups: dict[str, dict] = {}
    out = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m is None:
            out[name] = t
            continue
        groups.setdefault(m.group(1), {})[(int(m.group(2)), m.group(3))] = t
    for prefix, parts in groups.items():
        n = cfg.params.num_experts
        missing = [(e, p) for e in range(n) for p in ("gate_proj", "up_proj", "down_proj") if (e, p) not in parts]
        if missing:
            from ..errors import WeightsError

            raise WeightsError(f"{prefix}: {len(missing)} expert tensors missing, e.g. expert {missing[0][0]} {missing[0][1]}")
        out[f"{prefix}.gate_up_proj"] = torch.stack(
            [torch.cat([parts[(e, "gate_proj")], parts[(e, "up_proj")]], dim=0) for e in range(n)])
        out[f"{prefix}.down_proj"] = torch.stack([parts[(e, "down_proj")] for e in range(n)])
    return out


def qwen3_5(tensors: dict, cfg: ModelConfig) -> dict:
    return _common(tensors, cfg)


def qwen3_next(tensors: dict, cfg: ModelConfig) -> dict:
    out = {}
    p = cfg.params
    h, hv, dk, dv = p.linear_num_key_heads, p.linear_num_value_heads, p.linear_key_head_dim, p.linear_value_head_dim
    r = hv // h
    for name, t in _common(tensors, cfg).items():
        if name.endswith("linear_attn.in_proj_qkvz.weight"):
            base = name[: -len("in_proj_qkvz.weight")]
            w = t.view(h, 2 * dk + 2 * r * dv, -1)                  # grouped per key head
            q, k, v, z = torch.split(w, [dk, dk, r * dv, r * dv], dim=1)
            flat = lambda x: x.reshape(-1, w.shape[-1])             # noqa: E731  head-major rows
            out[base + "in_proj_qkv.weight"] = torch.cat([flat(q), flat(k), flat(v)], dim=0)
            out[base + "in_proj_z.weight"] = flat(z)
        elif name.endswith("linear_attn.in_proj_ba.weight"):
            base = name[: -len("in_proj_ba.weight")]
            w = t.view(h, 2 * r, -1)
            b, a = torch.split(w, [r, r], dim=1)
            out[base + "in_proj_b.weight"] = b.reshape(-1, w.shape[-1])
            out[base + "in_proj_a.weight"] = a.reshape(-1, w.shape[-1])
        else:
            out[name] = t
    return out


def _rename(tensors: dict, rules) -> dict:
    out = {}
    for name, t in tensors.items():
        for pat, rep in rules:
            name = re.sub(pat, rep, name)
        out[name] = t
    return out


# Mixtral-style MoE checkpoints: block_sparse_moe.{gate, experts.{e}.w1 (gate) / w3 (up) / w2 (down)}
_MIXTRAL = [(r"\.block_sparse_moe\.", ".mlp."), (r"(\.mlp\.experts\.\d+)\.w1\.", r"\1.gate_proj."),
            (r"(\.mlp\.experts\.\d+)\.w3\.", r"\1.up_proj."), (r"(\.mlp\.experts\.\d+)\.w2\.", r"\1.down_proj.")]


def _join_convs(t: dict, owner: str) -> dict:
    """`{owner}.q_conv1d.weight`, `k_conv1d`, `v_conv1d` (a linear layer's separate short convs, as released) joined
    along the channels into `{owner}.conv1d.weight`, the one conv hypic runs over [q | k | v]; a missing part is an
    error. Joining needs only their order: transformers saves OLMo-Hybrid's in near-equal chunks, not at the q / k / v
    widths, and gets the same weight back."""
    out = {}
    for name, x in t.items():
        if name.endswith(f"{owner}.q_conv1d.weight"):
            parts = [t.get(name.replace("q_conv1d", c)) for c in ("q_conv1d", "k_conv1d", "v_conv1d")]
            if any(y is None for y in parts):
                from ..errors import WeightsError

                raise WeightsError(f"{name}: the k_conv1d / v_conv1d tensors beside it are missing")
            out[name.replace("q_conv1d", "conv1d")] = torch.cat(parts, dim=0)
        elif not name.endswith((f"{owner}.k_conv1d.weight", f"{owner}.v_conv1d.weight")):
            out[name] = x
    return out


def kimi_linear(tensors: dict, cfg: ModelConfig) -> dict:
    """Checkpoint layout (as save_pretrained writes it): block_sparse_moe.{gate, experts.{e}.w1/w2/w3,
    shared_experts} (dense layers too), q/k/v_conv1d (concatenated into one conv here), forget-gate
    tensors directly under self_attn."""
    t = _rename(tensors, _MIXTRAL + [(r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", r".self_attn.forget_gate.\1")])
    return _common(_join_convs(t, "self_attn"), cfg)


def minimax(tensors: dict, cfg: ModelConfig) -> dict:
    """Mixtral-style experts; the lightning decay buffers (slope_rate, *_decay) are dropped: hypic
    derives the slopes from the config."""
    t = {k: v for k, v in tensors.items() if not re.search(r"self_attn\.(slope_rate|query_decay|key_decay|diagonal_decay)$", k)}
    return _common(_rename(t, _MIXTRAL), cfg)


def nemotron_h(tensors: dict, cfg: ModelConfig) -> dict:
    """Original layout: backbone.{embeddings, layers.{i}.{norm, mixer.*}, norm_f}; Nemotron 3's MoE blocks store
    mixer.experts.{e}.{up,down}_proj.weight per expert (stacked into [E, ...] tensors here)."""
    t = _rename(tensors, [(r"^backbone\.embeddings\.", "model.embed_tokens."),
                          (r"^backbone\.norm_f\.", "model.norm."), (r"^backbone\.", "model.")])
    pat = re.compile(r"^(.*\.mixer\.experts)\.(\d+)\.(up_proj|down_proj)\.weight$")
    groups: dict = {}
    out = {}
    for name, x in t.items():
        m = pat.match(name)
        if m is None:
            out[name] = x
        else:
            groups.setdefault((m.group(1), m.group(3)), {})[int(m.group(2))] = x
    for (prefix, part), per in groups.items():
        n = cfg.params.num_experts
        if sorted(per) != list(range(n)):
            from ..errors import WeightsError

            raise WeightsError(f"{prefix}: {part} of {len(per)} experts, expected {n}")
        out[f"{prefix}.{part}"] = torch.stack([per[e] for e in range(n)])
    return _common(out, cfg)


def jamba(tensors: dict, cfg: ModelConfig) -> dict:
    """Per-expert feed_forward.experts.{e}.{gate,up,down}_proj -> fused 3-D tensors."""
    t = _rename(tensors, [(r"\.feed_forward\.experts\.", ".mlp.experts.")])
    return _rename(_common(t, cfg), [(r"\.mlp\.experts\.", ".feed_forward.experts.")])


def bailing_moe_linear(tensors: dict, cfg: ModelConfig) -> dict:
    """Ring-linear checkpoint layout: model.word_embeddings, model.layers.{i}.{attention.*, mlp.*},
    per-expert mlp.experts.{e}.{gate,up,down}_proj (fused here), mlp.gate.expert_bias (vLLM also
    accepts e_score_correction_bias). MTP layers and buffers (inv_freq, slopes) are dropped;
    `norm_head` checkpoints get their lm_head normalised per hidden column, as the ports do."""
    t = {k: v for k, v in tensors.items()
         if not re.match(r"^model\.mtp\.", k) and not re.search(r"(inv_freq|slope|slope_rate)$", k)}
    t = _rename(t, [(r"^model\.word_embeddings\.", "model.embed_tokens."),
                    (r"\.mlp\.gate\.e_score_correction_bias$", ".mlp.gate.expert_bias")])
    if cfg.params.norm_head and "lm_head.weight" in t:
        w = t["lm_head.weight"]
        t["lm_head.weight"] = (w.float() / (w.float().norm(dim=0, keepdim=True) + 1e-7)).to(w.dtype)
    return _common(t, cfg)


def lfm2(tensors: dict, cfg: ModelConfig) -> dict:
    """transformers' Lfm2ForCausalLM layout as saved (no renames). LFM2-MoE: the per-expert
    feed_forward.experts.{e}.{w1 (gate), w3 (up), w2 (down)} of the released checkpoints (transformers saves them so
    too) -> fused 3-D tensors."""
    if cfg.arch != "lfm2_moe":
        return _common(tensors, cfg)
    t = _rename(tensors, [(r"\.feed_forward\.experts\.(\d+)\.w1\.", r".mlp.experts.\1.gate_proj."),
                          (r"\.feed_forward\.experts\.(\d+)\.w3\.", r".mlp.experts.\1.up_proj."),
                          (r"\.feed_forward\.experts\.(\d+)\.w2\.", r".mlp.experts.\1.down_proj.")])
    return _rename(_common(t, cfg), [(r"\.mlp\.experts\.", ".feed_forward.experts.")])


def granitemoehybrid(tensors: dict, cfg: ModelConfig) -> dict:
    """The released checkpoints' expert names (as transformers' own conversion maps them):
    block_sparse_moe.{input_linear -> experts.gate_up_proj [E, 2I, H], output_linear -> experts.down_proj,
    router.layer -> router}."""
    moe = r"\.block_sparse_moe\."
    return _common(_rename(tensors, [(moe + r"input_linear\.weight$", ".block_sparse_moe.experts.gate_up_proj"),
                                     (moe + r"output_linear\.weight$", ".block_sparse_moe.experts.down_proj"),
                                     (moe + r"router\.layer\.", ".block_sparse_moe.router.")]), cfg)


def bailing_hybrid(tensors: dict, cfg: ModelConfig) -> dict:
    """Ling 3.0's released layout: model.word_embeddings, layers.{i}.attention.{..., dense (o_proj), q/k/v_conv1d,
    f_proj, dt_bias, A_log (the forget gate's)}, per-expert mlp.experts.{e}.{gate,up,down}_proj, mlp.gate.expert_bias;
    the MTP layers stored after the last decoder layer are dropped (standard decoding does not use them)."""
    n = cfg.num_layers
    t = {k: v for k, v in tensors.items()
         if not ((m := re.match(r"^model\.layers\.(\d+)\.", k)) and int(m.group(1)) >= n)}
    t = _rename(t, [(r"^model\.word_embeddings\.", "model.embed_tokens."), (r"\.attention\.", ".self_attn."),
                    (r"\.self_attn\.dense\.", ".self_attn.o_proj."),
                    (r"\.self_attn\.(f_proj\.|dt_bias$|A_log$)", r".self_attn.forget_gate.\1"),
                    (r"\.mlp\.gate\.expert_bias$", ".mlp.gate.e_score_correction_bias")])
    return _common(_join_convs(t, "self_attn"), cfg)


def falcon_h1(tensors: dict, cfg: ModelConfig) -> dict:
    """transformers' FalconH1ForCausalLM layout as saved (no renames)."""
    return _common(tensors, cfg)


def olmo_hybrid(tensors: dict, cfg: ModelConfig) -> dict:
    """The released layout (as transformers also saves it): a GDN layer's pre-norms are attention_layer_norm and
    feedforward_layer_norm, its short conv three tensors q_conv1d / k_conv1d / v_conv1d (joined)."""
    t = _rename(tensors, [(r"\.attention_layer_norm\.", ".input_layernorm."),
                          (r"\.feedforward_layer_norm\.", ".post_attention_layernorm.")])
    return _common(_join_convs(t, "linear_attn"), cfg)


def lfm3(tensors: dict, cfg: ModelConfig) -> dict:
    """The released layout names the attention's head gate `gate_proj` (transformers' module: `g_proj`)."""
    return _common(_rename(tensors, [(r"\.self_attn\.gate_proj\.", ".self_attn.g_proj.")]), cfg)


def qwen4_exp(tensors: dict, cfg: ModelConfig) -> dict:
    """The PLE n-gram tables as saved (`ngram_embedding.shard_{k}.weight`, split along the rows) joined in shard
    order; the hashing buffers (multipliers, head table sizes and offsets) checked against the ones the config gives
    (models/qwen4_ple.py) and dropped (hypic derives them)."""
    from ..errors import WeightsError
    from .qwen4_ple import ngram_tables

    shards: dict[str, dict[int, torch.Tensor]] = {}
    out = {}
    for name, t in _common(tensors, cfg).items():
        m = re.match(r"^(.*\.ngram_embedding)\.shard_(\d+)\.weight$", name)
        b = re.match(r"^model\.layers\.(\d+)\.ple\.ple_embedding\.(layer_multipliers|ngram_heads_vocab_sizes|"
                     r"ngram_heads_offsets)$", name)
        if m:
            shards.setdefault(m.group(1), {})[int(m.group(2))] = t
        elif b:
            layer = int(b.group(1))
            if layer not in cfg.params.ple_layers:
                raise WeightsError(f"{name}: layer {layer} has no n-gram embedding in the config")
            mults, sizes, offsets, _ = ngram_tables(cfg, cfg.params.ple_layers.index(layer))
            want = {"layer_multipliers": mults, "ngram_heads_vocab_sizes": sizes, "ngram_heads_offsets": offsets}
            if t.tolist() != want[b.group(2)]:
                raise WeightsError(f"{name} differs from the hashing tables the config gives")
        else:
            out[name] = t
    for prefix, parts in shards.items():
        if sorted(parts) != list(range(len(parts))):
            raise WeightsError(f"{prefix}: shards {sorted(parts)[:5]}... are not 0..{len(parts) - 1}")
        out[prefix + ".weight"] = torch.cat([parts[k] for k in range(len(parts))])
    return out


def glm5_next(tensors: dict, cfg: ModelConfig) -> dict:
    """The saved layout (transformers writes it back so): the hyper-connections' tensors as `hc_attn_*` / `hc_ffn_*`
    beside the layer's modules, the KDA forget gate's tensors directly under `self_attn`, q/k/v convs apart, experts
    per expert; the MTP layers (index num_hidden_layers and on) and `shared_head` tensors are dropped."""
    n = cfg.num_layers
    keep = {k: v for k, v in tensors.items()
            if not re.search(r"\.shared_head\.", k)
            and not ((m := re.search(r"(?:^|\.)layers\.(\d+)\.", k)) and "visual" not in k and int(m.group(1)) >= n)}
    t = _rename(keep, [(r"\.hc_attn_(base|fn|scale)$", r".attn_hc.\1"), (r"\.hc_ffn_(base|fn|scale)$", r".ffn_hc.\1"),
                       (r"\.self_attn\.(f_a_proj|f_b_proj|dt_bias|A_log)", r".self_attn.forget_gate.\1")])
    return _common(_join_convs(t, "self_attn"), cfg)


def recurrent_gemma(tensors: dict, cfg: ModelConfig) -> dict:
    """The released layout is transformers' (the LM head tied to the embeddings, not stored)."""
    return _common(tensors, cfg)


def lara_mini(tensors: dict, cfg: ModelConfig) -> dict:
    """The released layout (transformers writes it back so): a GDN layer's input projections fused into one `in_proj`,
    rows [q | k | v | z | b | a], split here; its gated norm named `out_norm`."""
    p = cfg.params
    kd, vd = p.linear_num_key_heads * p.linear_key_head_dim, p.linear_num_value_heads * p.linear_value_head_dim
    hv = p.linear_num_value_heads
    out = {}
    for name, t in _rename(tensors, [(r"\.linear_attn\.out_norm\.", ".linear_attn.norm.")]).items():
        if name.endswith(".linear_attn.in_proj.weight"):
            base = name[: -len("in_proj.weight")]
            qkv, z, b, a = torch.split(t, [2 * kd + vd, vd, hv, hv], dim=0)
            out[base + "in_proj_qkv.weight"], out[base + "in_proj_z.weight"] = qkv, z
            out[base + "in_proj_b.weight"], out[base + "in_proj_a.weight"] = b, a
        else:
            out[name] = t
    return _common(out, cfg)


def bamba(tensors: dict, cfg: ModelConfig) -> dict:
    """transformers' BambaForCausalLM layout as saved (no renames)."""
    return _common(tensors, cfg)


def zamba(tensors: dict, cfg: ModelConfig) -> dict:
    """transformers' ZambaForCausalLM / Zamba2ForCausalLM layout. A shared block's weights are kept under the first
    hybrid layer that uses it; copies stored under later layers (a checkpoint written without tying) are dropped, as
    transformers ties them to the first. A copy that differs from the first is an error: the layers would not share
    one block."""
    from .zamba import block_name

    p, blk = cfg.params, block_name(cfg)
    first = {}
    for slot, i in enumerate(p.hybrid_layer_ids):
        first.setdefault(slot % p.num_mem_blocks, i)
    owner = {i: first[slot % p.num_mem_blocks] for slot, i in enumerate(p.hybrid_layer_ids)}
    pat = re.compile(rf"^model\.layers\.(\d+)\.{blk}\.(.*)$")
    out = {}
    for name, t in tensors.items():
        m = pat.match(name)
        if m is None or owner.get(int(m.group(1)), int(m.group(1))) == int(m.group(1)):
            out[name] = t
            continue
        src = f"model.layers.{owner[int(m.group(1))]}.{blk}.{m.group(2)}"
        if src in tensors and not torch.equal(tensors[src], t):
            from ..errors import WeightsError

            raise WeightsError(f"{name} differs from {src}, the shared block it should be a copy of")
        if src not in tensors:
            out[src] = t
    return _common(out, cfg)


def transformer(tensors: dict, cfg: ModelConfig) -> dict:
    """Llama / Qwen2: transformers' names as they are; old checkpoints' `rotary_emb.inv_freq`
    buffers are dropped (hypic derives the frequencies from the config)."""
    return _common({k: v for k, v in tensors.items() if not k.endswith("rotary_emb.inv_freq")}, cfg)
