"""Named model presets: HF-style config dicts. Tiny presets run in seconds on a CPU and ship a
built-in byte-level tokenizer; real-size presets (dummy weights) are for GPU benchmarks."""

from __future__ import annotations

from ..errors import ConfigError

_TINY_COMMON = dict(
    vocab_size=320, hidden_size=64, num_hidden_layers=6, layer_types=None, full_attention_interval=3,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16,
    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
    linear_conv_kernel_dim=4, max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
    eos_token_id=256, bos_token_id=None, initializer_range=0.02,
)


def _tiny(model_type, **kw):
    d = dict(_TINY_COMMON, model_type=model_type)
    d.pop("layer_types")
    interval = d.pop("full_attention_interval")
    d["layer_types"] = ["full_attention" if (i + 1) % interval == 0 else "linear_attention"
                        for i in range(d["num_hidden_layers"])]
    d.update(kw)
    return d


PRESETS: dict[str, dict] = {
    "tiny-qwen3.5": _tiny("qwen3_5_text", intermediate_size=128),
    "tiny-qwen3.5-moe": _tiny("qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                              shared_expert_intermediate_size=32),
    "tiny-qwen3-next": _tiny("qwen3_next", intermediate_size=128, num_experts=8, num_experts_per_tok=2,
                             moe_intermediate_size=32, shared_expert_intermediate_size=32, decoder_sparse_step=1,
                             mlp_only_layers=[1], norm_topk_prob=True),
    "tiny-kimi-linear": dict(
        model_type="kimi_linear", vocab_size=320, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        mlp_layer_types=["dense", "sparse", "sparse", "sparse"], intermediate_size=128, moe_intermediate_size=32,
        num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=16,
        qk_rope_head_dim=8, v_head_dim=16, linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4,
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=256,
        bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    "tiny-minimax": dict(
        model_type="minimax", vocab_size=320, hidden_size=64, num_hidden_layers=4,
        layer_types=["linear_attention", "linear_attention", "full_attention", "linear_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=32, num_local_experts=4,
        num_experts_per_tok=2, block_size=16, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, tie_word_embeddings=False,
        eos_token_id=256, bos_token_id=None, initializer_range=0.02,
    ),
    "tiny-nemotron-h": dict(
        model_type="nemotron_h", vocab_size=320, hidden_size=64,
        layers_block_type=["mamba", "mlp", "mamba", "attention", "mlp", "mamba"],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
        max_position_embeddings=65536, layer_norm_epsilon=1e-5, tie_word_embeddings=False,
        eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Nemotron 3 (Nano's layout): Mamba2, MoE blocks (grouped sigmoid routing, relu² experts, a shared expert) and
    # one attention block.
    "tiny-nemotron-3": dict(
        model_type="nemotron_h", vocab_size=320, hidden_size=64,
        layers_block_type=["mamba", "moe", "mamba", "attention", "moe", "mamba"],
        mamba_num_heads=8, mamba_head_dim=8, ssm_state_size=16, n_groups=2, conv_kernel=4, chunk_size=16,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128, n_routed_experts=8,
        num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=64, n_group=2,
        topk_group=1, norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=65536,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    "tiny-jamba": dict(
        model_type="jamba", vocab_size=320, hidden_size=32, num_hidden_layers=4, attn_layer_period=4,
        attn_layer_offset=2, expert_layer_period=2, expert_layer_offset=1, num_experts=4, num_experts_per_tok=2,
        intermediate_size=64, num_attention_heads=4, num_key_value_heads=2, mamba_d_state=8, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=8, max_position_embeddings=65536, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Ring-linear: layers 2 and 5 full attention (layer_group_size 3), layer 0 a dense MLP, MoE with
    # sigmoid scores, expert bias and 2 groups; the real checkpoint's config names.
    "tiny-ring-linear": dict(
        model_type="bailing_moe_linear", vocab_size=320, hidden_size=64, num_hidden_layers=6, layer_group_size=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, partial_rotary_factor=0.5, rope_theta=10000.0,
        use_qk_norm=True, linear_silu=False, group_norm_size=2, use_bias=False,
        use_qkv_bias=False, intermediate_size=128, first_k_dense_replace=1, num_experts=8, num_experts_per_tok=2,
        moe_intermediate_size=32, num_shared_experts=1, moe_shared_expert_intermediate_size=32,
        score_function="sigmoid", moe_router_enable_expert_bias=True, n_group=2, topk_group=1,
        norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=65536, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=256, initializer_range=0.02,
    ),
    # LFM2: conv, conv, attention, conv, conv, attention (conv window 3), tied embeddings.
    "tiny-lfm2": dict(
        model_type="lfm2", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=192, block_auto_adjust_ff_dim=True,
        block_ffn_dim_multiplier=1.0, block_multiple_of=32, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=65536,
        tie_word_embeddings=True, eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # LFM2-MoE: LFM2's layers, two dense MLPs, then an 8-expert top-2 MoE with sigmoid routing and an expert bias.
    "tiny-lfm2-moe": dict(
        model_type="lfm2_moe", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layer_types=["conv", "conv", "full_attention", "conv", "conv", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, moe_intermediate_size=32,
        num_dense_layers=2, num_experts=8, num_experts_per_tok=2, use_expert_bias=True, routed_scaling_factor=1.5,
        norm_topk_prob=True, conv_L_cache=3, conv_bias=False, norm_eps=1e-5,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=65536,
        tie_word_embeddings=True, eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Granite 4.0-H: Mamba2 (one group, as released) and NoPE attention (layers 2 and 5; the legacy type names the
    # released configs carry), a shared MLP plus a 4-expert top-2 MoE after every mixer, muP multipliers away from 1.
    "tiny-granite-4.0-h": dict(
        model_type="granitemoehybrid", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layer_types=["mamba", "mamba", "attention", "mamba", "mamba", "attention"],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=False, position_embedding_type="nope", intermediate_size=32,
        shared_intermediate_size=64, num_local_experts=4, num_experts_per_tok=2, embedding_multiplier=2.0,
        residual_multiplier=0.5, attention_multiplier=0.1, logits_scaling=3.0, hidden_act="silu",
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=256,
        bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Ling 3.0: KDA (bounded gate) x3 then MLA with interleaved RoPE, twice; a dense first layer, then the DeepSeek MoE.
    "tiny-ling-3.0": dict(
        model_type="bailing_hybrid", vocab_size=320, hidden_size=64, num_hidden_layers=8, layer_group_size=4,
        num_attention_heads=4, num_key_value_heads=4, head_dim=16, short_conv_kernel_size=4, kv_lora_rank=16,
        q_lora_rank=None, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, intermediate_size=128,
        moe_intermediate_size=32, num_local_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, first_k_dense_replace=1, routed_scaling_factor=2.5, norm_topk_prob=True, kda_safe_gate=True,
        kda_lower_bound=-5.0, rope_theta=10000.0, num_mtp_layers=0, max_position_embeddings=65536, rms_norm_eps=1e-6,
        tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Falcon-H1: Mamba2 (2 groups, a gated norm before the gate) beside RoPE attention in every layer, muP multipliers
    # away from 1 everywhere.
    "tiny-falcon-h1": dict(
        model_type="falcon_h1", vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head="auto", mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, mamba_conv_bias=True,
        mamba_proj_bias=False, mamba_norm_before_gate=True, mamba_rms_norm=True, projectors_bias=False,
        intermediate_size=128, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        embedding_multiplier=1.5, lm_head_multiplier=0.5, mlp_multipliers=[1.2, 0.8], key_multiplier=0.7,
        attention_in_multiplier=0.9, attention_out_multiplier=1.1, ssm_multipliers=[1.1, 0.9, 1.2, 0.8, 1.3],
        ssm_in_multiplier=1.2, ssm_out_multiplier=0.8, hidden_act="silu", max_position_embeddings=65536,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    # OLMo-Hybrid: GDN with 2 key / 4 value heads (beta in [0, 2]), OLMo 3 attention (RoPE) at layers 2 and 5.
    "tiny-olmo-hybrid": dict(
        model_type="olmo_hybrid", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2, num_attention_heads=4,
        num_key_value_heads=2, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
        linear_value_head_dim=16, linear_conv_kernel_dim=4, linear_allow_neg_eigval=True, intermediate_size=128,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, attention_bias=False, hidden_act="silu",
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=256,
        bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Bamba: Mamba2 with attention (RoPE on half of each head's dims) at layers 2 and 5, a SwiGLU MLP after each.
    "tiny-bamba": dict(
        model_type="bamba", vocab_size=320, hidden_size=64, num_hidden_layers=6, attn_layer_indices=[2, 5],
        mamba_n_heads=8, mamba_d_head=16, mamba_d_state=16, mamba_n_groups=1, mamba_d_conv=4, mamba_expand=2,
        mamba_chunk_size=16, mamba_conv_bias=True, mamba_proj_bias=False, num_attention_heads=4,
        num_key_value_heads=2, attention_bias=False, mlp_bias=False, intermediate_size=128, hidden_act="silu",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=65536,
        rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    # Zamba2: Mamba2 layers and three hybrid layers served by two shared blocks in turn (per-layer adapters on q / k /
    # v and the MLP), RoPE in the shared attention, GELU MLP, tied embeddings.
    "tiny-zamba2": dict(
        model_type="zamba2", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layers_block_type=["mamba", "hybrid", "mamba", "hybrid", "mamba", "hybrid"], mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_ngroups=1, n_mamba_heads=8, chunk_size=16, num_attention_heads=4,
        num_key_value_heads=4, intermediate_size=128, hidden_act="gelu", num_mem_blocks=2,
        use_shared_attention_adapter=True, adapter_rank=8, use_mem_rope=True,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, max_position_embeddings=65536,
        rms_norm_eps=1e-5, tie_word_embeddings=True, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    # LFM3: short convs (width 7), sliding-window attention (window 12, RoPE) and full attention ("proportional" RoPE
    # on half of each head's pairs), sandwich norms, per-head output gates.
    "tiny-lfm3": dict(
        model_type="lfm3", vocab_size=320, hidden_size=64, num_hidden_layers=6, intermediate_size=128,
        layer_types=["conv", "sliding_attention", "full_attention", "conv", "sliding_attention", "full_attention"],
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, conv_L_cache=7, conv_bias=False,
        sliding_window=12, use_sandwich_norm=True, use_attention_gate=True, norm_eps=1e-5,
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "proportional", "rope_theta": 1000000.0,
                                            "partial_rotary_factor": 0.5}},
        max_position_embeddings=65536, tie_word_embeddings=True, eos_token_id=256, bos_token_id=None,
        pad_token_id=None, initializer_range=0.02,
    ),
    # Lara-mini: GDN, sliding-window attention with RoPE (window 12), full attention without, MoE after every layer.
    "tiny-lara-mini": dict(
        model_type="lara_mini", vocab_size=320, hidden_size=64, num_hidden_layers=5,
        layer_types=["linear_attention", "sliding_attention", "linear_attention", "full_attention",
                     "sliding_attention"], sliding_window=12, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
        linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, norm_topk_prob=True, rope_parameters={"rope_type": "default",
        "rope_theta": 10000.0}, max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Zamba: two-head Mamba1 layers and two hybrid layers sharing one block (NoPE GQA attention, GELU MLP).
    "tiny-zamba": dict(
        model_type="zamba", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layers_block_type=["mamba", "mamba", "hybrid", "mamba", "mamba", "hybrid"], mamba_d_state=16,
        mamba_d_conv=4, mamba_expand=2, mamba_dt_rank=8, n_mamba_heads=2, mamba_conv_bias=True,
        mamba_proj_bias=False, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, hidden_act="gelu",
        hidden_mamba_act="silu", max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=True,
        eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # RecurrentGemma: RG-LRU blocks (lru_width 96 != hidden) and MQA sliding-window attention (window 12) in the (r, r, a)
    # pattern; hidden 48 (sqrt(48) is not a bf16 number, so the bf16 embedding scale shows); a small soft cap so that
    # the cap shows on random weights.
    "tiny-recurrent-gemma": dict(
        model_type="recurrent_gemma", vocab_size=320, hidden_size=48, num_hidden_layers=6, intermediate_size=128,
        num_attention_heads=4, num_key_value_heads=1, lru_width=96, attention_window_size=12, conv1d_width=4,
        block_types=["recurrent", "recurrent", "attention"], logits_soft_cap=2.0, hidden_activation="gelu_pytorch_tanh",
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5},
        max_position_embeddings=65536, rms_norm_eps=1e-6, tie_word_embeddings=True, eos_token_id=256,
        bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # Qwen4-Exp: GDN and QSA-indexed gated attention (every third layer), three residual streams, MoE after every
    # layer. The indexer reads the top 4 blocks of 4 tokens (budget 16): test prompts are sparse past 20 tokens; 16
    # indexer heads, so a block scoring exactly 0 (relu of every head's score) is rare (ties would order by chance).
    "tiny-qwen4-exp": _tiny("qwen4_exp_text", num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                            shared_expert_intermediate_size=32, hc_count=3, hc_lowrank=16, indexer_n_heads=16,
                            indexer_kv_heads=1, indexer_head_dim=8, indexer_budget=16, indexer_compress_ratio=4,
                            layer_types=["linear_attention", "linear_attention", "full_attention"] * 2),
    # GLM-5 Next: KDA (bounded gate) and NoPE MLA with a DSA indexer (pools of 4, top 16 tokens) every third layer,
    # three mHC streams, dense and MoE MLPs with a SwiGLU clamp low enough to bite on random weights (0.1).
    "tiny-glm5-next": dict(
        model_type="glm5_next_text", vocab_size=320, hidden_size=64, num_hidden_layers=6,
        layer_types=["linear_attention", "linear_attention", "full_attention"] * 2,
        mlp_layer_types=["dense", "sparse", "sparse", "dense", "sparse", "sparse"], intermediate_size=128,
        moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
        topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, swiglu_limit=0.1, num_attention_heads=4,
        num_key_value_heads=4, q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=0, v_head_dim=16,
        linear_num_heads=4, linear_head_dim=16, linear_conv_kernel_dim=4, linear_lower_bound=-5.0, hc_mult=3,
        hc_eps=1e-6, hc_sinkhorn_iters=20, index_topk=16, index_kpool=4, index_n_heads=16, index_head_dim=8,
        max_position_embeddings=65536, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=256,
        bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # State-space models with no attention layer: Mamba, FalconMamba (dt / B / C normed, no weights), Mamba2 (one group:
    # transformers 5.17 normalises the gated output over the whole width, 5.24 per group; they agree at one).
    "tiny-mamba": dict(
        model_type="mamba", vocab_size=320, hidden_size=64, num_hidden_layers=4, state_size=16, expand=2,
        conv_kernel=4, time_step_rank=8, use_bias=False, use_conv_bias=True, hidden_act="silu",
        layer_norm_epsilon=1e-5, tie_word_embeddings=True, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    "tiny-falcon-mamba": dict(
        model_type="falcon_mamba", vocab_size=320, hidden_size=64, num_hidden_layers=4, state_size=16, expand=2,
        conv_kernel=4, time_step_rank=8, use_bias=False, use_conv_bias=True, hidden_act="silu", mixer_rms_eps=1e-6,
        layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, bos_token_id=None, pad_token_id=None,
        initializer_range=0.02,
    ),
    "tiny-mamba2": dict(
        model_type="mamba2", vocab_size=320, hidden_size=64, num_hidden_layers=4, num_heads=8, head_dim=16, expand=2,
        state_size=16, n_groups=1, conv_kernel=4, chunk_size=16, use_bias=False, use_conv_bias=True,
        hidden_act="silu", layer_norm_epsilon=1e-5, tie_word_embeddings=False, eos_token_id=256, bos_token_id=None,
        pad_token_id=None, initializer_range=0.02,
    ),
    # Plain transformers (no linear layer): SmolLM2's layout (tied, no biases) and Qwen2's (q/k/v biases).
    "tiny-llama": dict(
        model_type="llama", vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, intermediate_size=128, max_position_embeddings=65536,
        rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True, attention_bias=False, mlp_bias=False, eos_token_id=256, bos_token_id=None,
        pad_token_id=None, initializer_range=0.02,
    ),
    "tiny-qwen2": dict(
        model_type="qwen2", vocab_size=320, hidden_size=64, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, intermediate_size=128, max_position_embeddings=65536, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0}, tie_word_embeddings=False,
        use_sliding_window=False, eos_token_id=256, bos_token_id=None, pad_token_id=None, initializer_range=0.02,
    ),
    # A larger CPU preset for benchmarks (still random weights, still the built-in tokenizer).
    "small-qwen3.5": dict(_tiny("qwen3_5_text", intermediate_size=1024), hidden_size=256, num_hidden_layers=8,
                          num_attention_heads=8, num_key_value_heads=2, head_dim=32, linear_num_key_heads=4,
                          linear_num_value_heads=8, linear_key_head_dim=32, linear_value_head_dim=32,
                          layer_types=["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3
                          + ["full_attention"]),
    # Real architectures at full size (dummy weights); sizes from the public model configs.
    "qwen3.5-35b-a3b": dict(
        model_type="qwen3_5_moe_text", vocab_size=248320, hidden_size=2048, num_hidden_layers=40,
        full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, initializer_range=0.02, eos_token_id=248044,
    ),
    "qwen3-next-80b-a3b": dict(
        model_type="qwen3_next", vocab_size=151936, hidden_size=2048, num_hidden_layers=48,
        full_attention_interval=4, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
        linear_conv_kernel_dim=4, num_experts=512, num_experts_per_tok=10, moe_intermediate_size=512,
        shared_expert_intermediate_size=512, intermediate_size=5120, decoder_sparse_step=1, mlp_only_layers=[],
        norm_topk_prob=True, max_position_embeddings=262144, rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25},
        tie_word_embeddings=False, initializer_range=0.02, eos_token_id=151645,
    ),
    # Zamba-7B-v1's config.json (Zyphra, public): 76 layers, the shared block at layer 2, 7, 13, ... (transformers' rule
    # for attn_layer_offset 4 / period 6), two Mamba heads.
    "zamba-7b-v1": dict(
        model_type="zamba", vocab_size=32000, hidden_size=3712, intermediate_size=14848, num_hidden_layers=76,
        attn_layer_offset=4, attn_layer_period=6, num_attention_heads=16, num_key_value_heads=16, hidden_act="gelu",
        hidden_mamba_act="silu", mamba_conv_bias=True, mamba_d_conv=4, mamba_d_state=16, mamba_dt_rank=232,
        mamba_expand=2, mamba_proj_bias=False, n_mamba_heads=2, max_position_embeddings=4096, rms_norm_eps=1e-5,
        initializer_range=0.02, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=0,
    ),
    # Ring-mini-linear-2.0's config.json (inclusionAI; as quoted in public ports), for dummy weights.
    "ring-mini-linear-2.0": dict(
        model_type="bailing_moe_linear", vocab_size=157184, hidden_size=2048, num_hidden_layers=20,
        layer_group_size=5, num_attention_heads=16, num_key_value_heads=4, head_dim=128, partial_rotary_factor=0.5,
        rope_theta=1000000, rope_scaling=None, use_qk_norm=True, linear_silu=False, group_norm_size=4,
        use_bias=False, use_qkv_bias=False, intermediate_size=5120, first_k_dense_replace=1, num_experts=256,
        num_experts_per_tok=8, moe_intermediate_size=512, num_shared_experts=1,
        moe_shared_expert_intermediate_size=512, score_function="sigmoid", moe_router_enable_expert_bias=True,
        n_group=8, topk_group=4, norm_topk_prob=True, routed_scaling_factor=2.5, router_dtype="fp32",
        max_position_embeddings=131072, rms_norm_eps=1e-6, tie_word_embeddings=False, eos_token_id=156892,
        pad_token_id=156892, initializer_range=0.02,
    ),
}
TINY_TOKENIZER_PRESETS = {name for name in PRESETS if name.startswith(("tiny-", "small-"))}
DEFAULT_PRESET = "tiny-qwen3.5"


def preset_config(name: str) -> dict:
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; presets: {sorted(PRESETS)}")
    return dict(PRESETS[name])
