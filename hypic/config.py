"""Typed, frozen configuration. Nothing in hypic reads environment variables; everything that
varies is one of these objects, built once and passed down.

    ModelConfig   what the checkpoint is (parsed from a Hugging Face config.json)
    CachePolicy   how prompts reuse state (mode, seam width, transition handling)
    EngineConfig  where and how the engine runs (device, dtype, store budgets, seed)
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnsupportedArchitectureError

LINEAR, FULL = "linear_attention", "full_attention"
MLP_ONLY = "mlp"              # a block without a token mixer (Nemotron-H's MLP / MoE blocks)
PARALLEL = "hybrid"           # a linear mixer and attention side by side in one layer (Falcon-H1)


@dataclass(frozen=True)
class ModelConfig:
    """A common core every architecture has, plus `params`: the architecture's own frozen
    dataclass (one per family, defined below), read by its model module as `cfg.params.<name>`.
    Values come from transformers' own config class for the model type (`AutoConfig.for_model`),
    so defaults, legacy names and validation match transformers."""

    arch: str                                  # hypic architecture (ARCHITECTURES values)
    hf_model_type: str                         # transformers model_type of the text model
    vocab_size: int
    hidden_size: int
    layer_types: tuple[str, ...]               # LINEAR, FULL, PARALLEL or MLP_ONLY per layer
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    initializer_range: float
    params: Any = None                         # architecture-specific frozen dataclass
    eos_token_ids: tuple[int, ...] = ()
    bos_token_id: int | None = None
    raw: tuple[tuple[str, Any], ...] = field(default=(), repr=False, compare=False)

    @property
    def num_layers(self) -> int:
        return len(self.layer_types)

    @property
    def linear_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (LINEAR, PARALLEL))

    @property
    def attention_layers(self) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t in (FULL, PARALLEL))

    def to_hf_dict(self) -> dict[str, Any]:
        """The text-model config dict as transformers reads it (used for RoPE variants and export)."""
        return json.loads(json.dumps(dict(self.raw)))

    def hf_config(self):
        from transformers import AutoConfig

        return AutoConfig.for_model(self.hf_model_type, **{k: v for k, v in self.to_hf_dict().items()
                                                           if k != "model_type"})

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        d = dict(d)
        top_type = d.get("model_type")
        if "text_config" in d and isinstance(d["text_config"], dict):
            text = dict(d["text_config"])
            text.setdefault("model_type", _TEXT_MODEL_TYPE.get(top_type, text.get("model_type")))
            d = text
        model_type = d.get("model_type")
        if model_type not in ARCHITECTURES:
            raise UnsupportedArchitectureError(
                f"unsupported model_type {model_type!r}; hypic supports {sorted(set(ARCHITECTURES))}"
                + (f" ({UNSUPPORTED[model_type]})" if model_type in UNSUPPORTED else "")
            )
        spec = ARCHITECTURES[model_type]
        kwargs = {k: v for k, v in d.items() if k not in ("model_type", "transformers_version", "architectures")}
        if spec.hf_type is None:          # not in transformers (remote code): the dict as written
            hf = _RemoteConfig(kwargs)
        else:
            import transformers
            from transformers import AutoConfig  # defaults and rope normalisation come from transformers itself
            from transformers.models.auto.configuration_auto import CONFIG_MAPPING

            if spec.hf_type not in CONFIG_MAPPING:
                raise UnsupportedArchitectureError(
                    f"{model_type} needs a transformers that ships it (this is {transformers.__version__})")
            try:
                hf = AutoConfig.for_model(spec.hf_type, **kwargs)
            except Exception as e:  # transformers validates values (types, ranges)
                raise ConfigError(f"invalid {model_type} config: {e}") from e
        layer_types, params = spec.parse(hf)
        bad = sorted({t for t in layer_types if t not in (LINEAR, FULL, PARALLEL, MLP_ONLY)})
        if bad:
            raise UnsupportedArchitectureError(f"unsupported layer type(s) {bad} in {model_type} config")
        g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        eos = g("eos_token_id")
        eos = () if eos is None else tuple(eos) if isinstance(eos, (list, tuple)) else (int(eos),)
        eps = g("rms_norm_eps", None) or g("layer_norm_epsilon", None) or g("norm_eps", None) or 1e-6
        return cls(
            arch=spec.arch, hf_model_type=spec.hf_type or model_type, vocab_size=hf.vocab_size,
            hidden_size=hf.hidden_size,
            layer_types=tuple(layer_types), rms_norm_eps=float(eps),
            max_position_embeddings=int(g("max_position_embeddings", 1 << 20) or (1 << 20)),
            tie_word_embeddings=bool(g("tie_word_embeddings", False)), initializer_range=g("initializer_range", 0.02),
            params=params, eos_token_ids=eos, bos_token_id=g("bos_token_id"),
            raw=tuple(sorted(((k, _freeze(v)) for k, v in hf.to_dict().items()), key=lambda kv: kv[0])),
        )

    @classmethod
    def from_file(cls, path: str | Path) -> "ModelConfig":
        path = Path(path)
        try:
            d = json.loads(path.read_text())
        except FileNotFoundError as e:
            raise ConfigError(f"no config.json at {path}") from e
        except json.JSONDecodeError as e:
            raise ConfigError(f"{path} is not valid JSON: {e}") from e
        from transformers import PretrainedConfig

        return cls.from_dict(PretrainedConfig._decode_special_floats(d))   # {"__float__": "Infinity"} -> inf


class _RemoteConfig:
    """A config.json of an architecture transformers does not ship (remote code): its values as
    written, read with getattr like a transformers config. Defaults are the parser's business."""

    def __init__(self, d: dict[str, Any]):
        self.__dict__.update(d)

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


# -- architecture-specific parts ---------------------------------------------------------------------
def _rope(hf) -> tuple[tuple[str, Any], ...]:
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    return tuple(sorted(rope.items(), key=lambda kv: kv[0]))


def _layer_types(hf, mapping: dict[str, str], attr: str = "layer_types") -> tuple[str, ...]:
    """HF per-layer type names -> LINEAR / FULL / MLP_ONLY; unknown names pass through (and are refused)."""
    return tuple(mapping.get(t, t) for t in getattr(hf, attr))


@dataclass(frozen=True)
class QwenHybridParams:
    """Qwen3.5 / Qwen3.5-MoE / Qwen3-Next: Gated DeltaNet + gated attention with partial RoPE."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_parameters: tuple
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    intermediate_size: int
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    norm_topk_prob: bool = True
    moe_layers: tuple[int, ...] = ()


def _parse_qwen(arch):
    def parse(hf):
        g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        rope = dict(_rope(hf))
        head_dim = g("head_dim") or hf.hidden_size // hf.num_attention_heads
        num_experts = int(g("num_experts", 0) or 0) if arch != "qwen3_5" else 0
        if arch == "qwen3_5_moe":
            moe_layers = tuple(range(hf.num_hidden_layers))
        elif arch == "qwen3_next" and num_experts > 0:
            step = g("decoder_sparse_step", 1)
            only = set(g("mlp_only_layers", []) or [])
            moe_layers = tuple(i for i in range(hf.num_hidden_layers) if i not in only and (i + 1) % step == 0)
        else:
            moe_layers = ()
        params = QwenHybridParams(
            num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
            head_dim=head_dim, rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)),
            rope_parameters=_rope(hf), attention_bias=bool(g("attention_bias", False)),
            linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
            linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
            linear_conv_kernel_dim=hf.linear_conv_kernel_dim, intermediate_size=int(g("intermediate_size", 0) or 0),
            num_experts=num_experts, num_experts_per_tok=int(g("num_experts_per_tok", 0) or 0),
            moe_intermediate_size=int(g("moe_intermediate_size", 0) or 0),
            shared_expert_intermediate_size=int(g("shared_expert_intermediate_size", 0) or 0),
            norm_topk_prob=bool(g("norm_topk_prob", True)), moe_layers=moe_layers)
        return _layer_types(hf, {}), params
    return parse


@dataclass(frozen=True)
class KimiLinearParams:
    """Kimi-Linear: KDA linear layers + MLA (NoPE) full attention, DeepSeek-style MoE."""

    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    num_attention_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    attention_bias: bool
    intermediate_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float


def _parse_kimi(hf):
    mlp_types = tuple(hf.mlp_layer_types)
    params = KimiLinearParams(
        linear_num_heads=hf.linear_num_heads, linear_head_dim=hf.linear_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, num_attention_heads=hf.num_attention_heads,
        q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank, qk_nope_head_dim=hf.qk_nope_head_dim,
        qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim, attention_bias=bool(hf.attention_bias),
        intermediate_size=hf.intermediate_size,
        moe_layers=tuple(i for i, t in enumerate(mlp_types) if t == "sparse"),
        num_experts=hf.num_local_experts, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, num_shared_experts=hf.n_shared_experts,
        n_group=hf.n_group, topk_group=hf.topk_group, norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor))
    if hf.num_key_value_heads != hf.num_attention_heads:
        raise UnsupportedArchitectureError("kimi_linear MLA with num_key_value_heads != num_attention_heads")
    return _layer_types(hf, {}), params


@dataclass(frozen=True)
class BailingHybridParams(KimiLinearParams):
    """Ling 3.0 (`bailing_hybrid`): Kimi-Linear's layout (KDA + MLA, DeepSeek MoE) with a full-rank KDA forget gate
    (bounded to [kda_lower_bound, 0] when `kda_safe_gate`) and output gate, and MLA layers with interleaved RoPE on
    the shared rope dims of q and k and a per-head sigmoid output gate."""

    kda_safe_gate: bool = True
    kda_lower_bound: float = -5.0
    rope_parameters: tuple = ()


def _parse_bailing_hybrid(hf):
    types, kimi = _parse_kimi(hf)
    rope = dict(getattr(hf, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") not in ("default", "yarn"):
        raise UnsupportedArchitectureError(f"bailing_hybrid with rope_type={rope.get('rope_type')!r} (default or yarn)")
    params = BailingHybridParams(**dataclasses.asdict(kimi), kda_safe_gate=bool(hf.kda_safe_gate),
                                 kda_lower_bound=float(hf.kda_lower_bound), rope_parameters=_rope(hf))
    return types, params


@dataclass(frozen=True)
class MiniMaxParams:
    """MiniMax-01: lightning attention (scalar decay) + softmax attention with RoPE, Mixtral MoE."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: tuple
    attention_bias: bool
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    lightning_norm_eps: float          # transformers builds the lightning output norm with eps 1e-6
    full_attn_alpha_factor: float
    full_attn_beta_factor: float
    linear_attn_alpha_factor: float
    linear_attn_beta_factor: float
    mlp_alpha_factor: float
    mlp_beta_factor: float


def _parse_minimax(hf):
    if getattr(hf, "sliding_window", None) is not None:
        raise UnsupportedArchitectureError("minimax with sliding_window attention is not supported")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    params = MiniMaxParams(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads, head_dim=head_dim,
        rope_parameters=_rope(hf), attention_bias=False, num_experts=hf.num_local_experts,
        num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.intermediate_size,
        lightning_norm_eps=1e-6,
        **{f"{w}_{ab}_factor": float(getattr(hf, f"{w}_{ab}_factor"))
           for w in ("full_attn", "linear_attn", "mlp") for ab in ("alpha", "beta")})
    return _layer_types(hf, {}), params


@dataclass(frozen=True)
class Mamba2Params:
    """The Mamba2 mixer's fields (layers/mamba2.py reads them), shared by the families that have one."""

    mamba_num_heads: int
    mamba_head_dim: int
    ssm_state_size: int
    n_groups: int
    conv_kernel: int
    use_conv_bias: bool
    use_bias: bool                     # in_proj (and out_proj unless the family says otherwise)
    time_step_min: float
    time_step_max: float               # dt = clamp(softplus(...), min, max); inf: no upper limit


@dataclass(frozen=True)
class NemotronHParams(Mamba2Params):
    """Nemotron-H: single-mixer blocks (Mamba2 / NoPE attention / squared-ReLU MLP), and in Nemotron 3 MoE blocks:
    DeepSeek-style grouped sigmoid routing with a selection-only correction bias over non-gated squared-ReLU experts
    (optionally in a latent space of `moe_latent_size`), plus a squared-ReLU shared expert."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    intermediate_size: int
    mlp_bias: bool
    moe_layers: tuple[int, ...] = ()
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    moe_shared_intermediate_size: int = 0
    moe_latent_size: int = 0           # 0: the experts work at hidden_size
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0


def _parse_nemotron_h(hf):
    raw = list(getattr(hf, "layers_block_type"))
    types = _layer_types(hf, {"mlp": MLP_ONLY, "moe": MLP_ONLY}, attr="layers_block_type")
    if hf.mlp_hidden_act != "relu2":
        raise UnsupportedArchitectureError(f"nemotron_h with mlp_hidden_act={hf.mlp_hidden_act!r} (only relu2)")
    if getattr(hf, "sliding_window", None) is not None:
        raise UnsupportedArchitectureError("nemotron_h with sliding_window attention is not supported")
    params = NemotronHParams(
        mamba_num_heads=hf.mamba_num_heads, mamba_head_dim=hf.mamba_head_dim, ssm_state_size=hf.ssm_state_size,
        n_groups=hf.n_groups, conv_kernel=hf.conv_kernel, use_conv_bias=bool(hf.use_conv_bias),
        use_bias=bool(hf.use_bias), time_step_min=float(hf.time_step_min), time_step_max=math.inf,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.head_dim, attention_bias=False, intermediate_size=hf.intermediate_size,
        mlp_bias=bool(hf.mlp_bias), moe_layers=tuple(i for i, t in enumerate(raw) if t == "moe"))
    if params.moe_layers:
        g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        params = dataclasses.replace(
            params, num_experts=int(hf.n_routed_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
            moe_intermediate_size=int(hf.moe_intermediate_size),
            moe_shared_intermediate_size=int(hf.moe_shared_expert_intermediate_size),
            moe_latent_size=int(g("moe_latent_size") or 0), n_group=int(g("n_group", 1) or 1),
            topk_group=int(g("topk_group", 1) or 1), norm_topk_prob=bool(g("norm_topk_prob", True)),
            routed_scaling_factor=float(g("routed_scaling_factor", 1.0)))
        if params.num_experts % params.n_group or params.num_experts // params.n_group < 2:
            raise ConfigError("nemotron_h: n_group must divide n_routed_experts into groups of two or more")
    return types, params


@dataclass(frozen=True)
class JambaParams:
    """Jamba: Mamba (S6) layers + NoPE attention, MLP or softmax top-k MoE (not renormalised)."""

    mamba_expand: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    intermediate_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int


def _parse_jamba(hf):
    experts = tuple(hf.layers_num_experts)
    params = JambaParams(
        mamba_expand=hf.mamba_expand, mamba_d_state=hf.mamba_d_state, mamba_d_conv=hf.mamba_d_conv,
        mamba_dt_rank=hf.mamba_dt_rank, mamba_conv_bias=bool(hf.mamba_conv_bias),
        mamba_proj_bias=bool(hf.mamba_proj_bias), num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads, head_dim=hf.hidden_size // hf.num_attention_heads,
        attention_bias=False, intermediate_size=hf.intermediate_size,
        moe_layers=tuple(i for i, e in enumerate(experts) if e > 1), num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.intermediate_size)
    return tuple(hf.layer_types), params


@dataclass(frozen=True)
class BailingLinearParams:
    """Ring-linear / Ling-linear 2.0 (`bailing_moe_linear`, remote code): lightning attention with
    RoPE'd keys + GQA attention, every `layer_group_size`-th layer full; DeepSeek-style MoE after the
    first `first_k_dense_replace` dense layers. Names are the checkpoint config's (docs/algorithm.md
    section 11 lists the public sources and what could not be verified)."""

    num_attention_heads: int           # linear layers: MHA with this many heads
    num_key_value_heads: int           # full-attention layers (GQA)
    head_dim: int
    rotary_dim: int                    # partial RoPE on q and k, rotate-half (neox) layout
    rope_parameters: tuple
    use_qk_norm: bool
    linear_silu: bool                  # silu on the fused q/k/v of the linear layers
    group_norm_size: int               # groups of the linear output RMSNorm
    qkv_bias: bool                     # use_bias or use_qkv_bias
    dense_bias: bool                   # use_bias
    intermediate_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_intermediate_size: int      # (moe_shared_expert_intermediate_size or moe_intermediate_size) * shared
    score_function: str                # "sigmoid" | "softmax"
    expert_bias: bool                  # moe_router_enable_expert_bias: a selection-only bias per expert
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    norm_head: bool                    # lm_head rows normalised at load


def bailing_layer_types(num_layers: int, group: int) -> tuple[str, ...]:
    """Every `group`-th layer is full attention, and so is every layer after the last whole group
    (MLX-LM's rule; SGLang requires num_layers % group == 0, where the two agree). group <= 0: all full."""
    if group <= 0:
        return (FULL,) * num_layers
    tail = num_layers // group * group
    return tuple(FULL if (i + 1) % group == 0 or i >= tail else LINEAR for i in range(num_layers))


def _parse_bailing_linear(hf):
    g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    heads = hf.num_attention_heads
    head_dim = g("head_dim") or hf.hidden_size // heads
    if g("rope_scaling"):
        raise UnsupportedArchitectureError(
            f"bailing_moe_linear with rope_scaling={g('rope_scaling')!r} is not supported")
    rotary_dim = g("rotary_dim") or int(head_dim * float(g("partial_rotary_factor", 1.0) or 1.0))
    rope = {"rope_type": "default", "rope_theta": float(g("rope_theta", 600000))}
    n_layers = hf.num_hidden_layers
    num_experts = int(g("num_experts", 0) or 0)
    first_dense = int(g("first_k_dense_replace", 0) or 0)
    moe_layers = tuple(i for i in range(n_layers) if num_experts > 1 and i >= first_dense)
    score = g("score_function", None) or "softmax"
    expert_bias = bool(g("moe_router_enable_expert_bias", False))
    n_group, topk_group = int(g("n_group", 0) or 0), int(g("topk_group", 0) or 0)
    if score not in ("sigmoid", "softmax"):
        raise UnsupportedArchitectureError(f"bailing_moe_linear with score_function={score!r}")
    if moe_layers and score == "softmax" and (expert_bias or n_group > 1):
        raise UnsupportedArchitectureError("bailing_moe_linear softmax routing with groups or an expert bias "
                                           "(the public ports disagree on it)")
    if g("use_bias", False) and num_experts:
        raise UnsupportedArchitectureError("bailing_moe_linear with use_bias=True (MLP biases) is not supported")
    shared = int(g("num_shared_experts", 0) or 0)
    moe_inter = int(g("moe_intermediate_size", 0) or 0)
    if (heads * head_dim) % max(int(g("group_norm_size", 1) or 1), 1):
        raise ConfigError("bailing_moe_linear: group_norm_size must divide num_attention_heads * head_dim")
    params = BailingLinearParams(
        num_attention_heads=heads, num_key_value_heads=int(g("num_key_value_heads") or heads), head_dim=head_dim,
        rotary_dim=rotary_dim, rope_parameters=tuple(sorted(rope.items())), use_qk_norm=bool(g("use_qk_norm", False)),
        linear_silu=bool(g("use_linear_silu", g("linear_silu", False))),
        group_norm_size=max(int(g("group_norm_size", 1) or 1), 1),
        qkv_bias=bool(g("use_bias", False) or g("use_qkv_bias", False)), dense_bias=bool(g("use_bias", False)),
        intermediate_size=int(g("intermediate_size", 0) or 0), moe_layers=moe_layers, num_experts=num_experts,
        num_experts_per_tok=int(g("num_experts_per_tok", 0) or 0), moe_intermediate_size=moe_inter,
        shared_intermediate_size=(int(g("moe_shared_expert_intermediate_size", 0) or 0) or moe_inter) * shared,
        score_function=score, expert_bias=expert_bias, n_group=n_group, topk_group=topk_group,
        norm_topk_prob=bool(g("norm_topk_prob", True)), routed_scaling_factor=float(g("routed_scaling_factor", 1.0)),
        norm_head=bool(g("norm_head", False)))
    return bailing_layer_types(n_layers, int(g("layer_group_size", 1))), params


@dataclass(frozen=True)
class Lfm2Params:
    """LFM2: gated short-convolution layers (no recurrent state, only a conv window) + GQA attention
    with q/k RMSNorm and RoPE; SwiGLU MLP in every layer."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: tuple
    conv_kernel: int                   # conv_L_cache
    conv_bias: bool
    intermediate_size: int             # after block_auto_adjust_ff_dim, as transformers builds it


@dataclass(frozen=True)
class Lfm2MoeParams(Lfm2Params):
    """LFM2-MoE (`lfm2_moe`): LFM2's layers with a SwiGLU MLP in the first `num_dense_layers` and, after them, a MoE
    with sigmoid routing (experts chosen by score + a selection-only `expert_bias`), the chosen scores renormalised
    when `norm_topk_prob`, times `routed_scaling_factor`; no shared expert."""

    num_dense_layers: int = 0
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    norm_topk_prob: bool = True
    routed_scaling_factor: float = 1.0
    expert_bias: bool = False


def _parse_lfm2_moe(hf):
    params = Lfm2MoeParams(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, rope_parameters=_rope(hf),
        conv_kernel=hf.conv_L_cache, conv_bias=bool(hf.conv_bias), intermediate_size=hf.intermediate_size,
        num_dense_layers=int(hf.num_dense_layers), num_experts=int(hf.num_experts),
        num_experts_per_tok=int(hf.num_experts_per_tok), moe_intermediate_size=int(hf.moe_intermediate_size),
        norm_topk_prob=bool(hf.norm_topk_prob), routed_scaling_factor=float(hf.routed_scaling_factor),
        expert_bias=bool(hf.use_expert_bias))
    if params.num_experts_per_tok > params.num_experts or params.num_experts < 2:
        raise ConfigError("lfm2_moe: needs num_experts >= 2 and num_experts_per_tok <= num_experts")
    return _layer_types(hf, {"conv": LINEAR}), params


def _parse_lfm2(hf):
    inter = hf.intermediate_size
    if hf.block_auto_adjust_ff_dim:
        inter = int(2 * inter / 3)
        if hf.block_ffn_dim_multiplier is not None:
            inter = int(hf.block_ffn_dim_multiplier * inter)
            inter = hf.block_multiple_of * ((inter + hf.block_multiple_of - 1) // hf.block_multiple_of)
    params = Lfm2Params(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads, rope_parameters=_rope(hf),
        conv_kernel=hf.conv_L_cache, conv_bias=bool(hf.conv_bias), intermediate_size=inter)
    return _layer_types(hf, {"conv": LINEAR}), params


def _bamba_mamba2(hf) -> dict:
    """Mamba2Params from the `mamba_*` / `time_step_limit` names Granite 4.0-H and Falcon-H1 share (Bamba's)."""
    lo, hi = tuple(hf.time_step_limit) if hf.time_step_limit is not None else (0.0, math.inf)
    return dict(mamba_num_heads=hf.mamba_n_heads, mamba_head_dim=hf.mamba_d_head, ssm_state_size=hf.mamba_d_state,
                n_groups=hf.mamba_n_groups, conv_kernel=hf.mamba_d_conv, use_conv_bias=bool(hf.mamba_conv_bias),
                use_bias=bool(hf.mamba_proj_bias), time_step_min=float(lo), time_step_max=float(hi))


@dataclass(frozen=True)
class GraniteHybridParams(Mamba2Params):
    """IBM Granite 4.0-H (`granitemoehybrid`): Mamba2 and attention layers (NoPE, or RoPE when
    `position_embedding_type` is "rope"), each followed by a shared SwiGLU MLP plus, when the config has
    experts, a softmax-over-top-k MoE; muP multipliers on the embeddings, the residual branches, the
    attention scores (in place of 1/sqrt(d)) and the logits. Field names of the Mamba2 part are those
    layers/mamba2.py reads (Mamba2Params)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_parameters: tuple             # () for NoPE
    shared_intermediate_size: int
    num_experts: int                   # 0: a dense model (shared MLP only)
    num_experts_per_tok: int
    moe_intermediate_size: int
    embedding_multiplier: float
    residual_multiplier: float
    attention_multiplier: float
    logits_scaling: float


def _parse_granitemoehybrid(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"granitemoehybrid with hidden_act={hf.hidden_act!r} (only silu)")
    pe = getattr(hf, "position_embedding_type", None)
    if pe not in (None, "nope", "rope"):
        raise UnsupportedArchitectureError(f"granitemoehybrid with position_embedding_type={pe!r}")
    params = GraniteHybridParams(
        **_bamba_mamba2(hf), num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        attention_bias=bool(hf.attention_bias), rope_parameters=_rope(hf) if pe == "rope" else (),
        shared_intermediate_size=hf.shared_intermediate_size,
        num_experts=int(hf.num_local_experts or 0), num_experts_per_tok=int(hf.num_experts_per_tok or 0),
        moe_intermediate_size=hf.intermediate_size, embedding_multiplier=float(hf.embedding_multiplier),
        residual_multiplier=float(hf.residual_multiplier), attention_multiplier=float(hf.attention_multiplier),
        logits_scaling=float(hf.logits_scaling))
    # transformers 5.x remaps the legacy names ("mamba", "attention"); older configs may still carry them
    return _layer_types(hf, {"mamba": LINEAR, "attention": FULL}), params


@dataclass(frozen=True)
class OlmoHybridParams:
    """OLMo-Hybrid (`olmo_hybrid`): Gated DeltaNet layers (separate q / k / v / a / b / g projections, beta
    scaled to [0, 2] when `linear_allow_neg_eigval`) with pre-norms, and OLMo 3 attention layers (q / k RMSNorm
    over all heads at once, RoPE or NoPE, norms after the attention and after the MLP). The GDN field names are
    those layers/gdn.py reads (shared with Qwen3.5)."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    allow_neg_eigval: bool
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_parameters: tuple             # () for NoPE (no rope_theta), as transformers decides
    intermediate_size: int


def _parse_olmo_hybrid(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"olmo_hybrid with hidden_act={hf.hidden_act!r} (only silu)")
    rope = getattr(hf, "rope_parameters", None)
    params = OlmoHybridParams(
        linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
        linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, allow_neg_eigval=bool(hf.linear_allow_neg_eigval),
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        attention_bias=bool(hf.attention_bias),
        rope_parameters=_rope(hf) if rope is not None and rope.get("rope_theta") is not None else (),
        intermediate_size=hf.intermediate_size)
    return _layer_types(hf, {}), params


@dataclass(frozen=True)
class FalconH1Params(Mamba2Params):
    """Falcon-H1 (`falcon_h1`): every layer runs a Mamba2 mixer and RoPE attention side by side on the same normed
    input and adds both (PARALLEL layers), then a SwiGLU MLP; muP multipliers on the embeddings, the Mamba2 input and
    each part of its projection, the attention's input, keys and output, the MLP's gate and output, and the logits.
    The Mamba2 fields (Mamba2Params): use_bias is in_proj's (mamba_proj_bias), projectors_bias out_proj's."""

    projectors_bias: bool              # the Mamba2 out_proj
    mamba_rms_norm: bool               # a grouped gated RMSNorm before out_proj (else y * silu(z))
    mamba_norm_before_gate: bool
    ssm_in_multiplier: float
    ssm_multipliers: tuple             # z, x, B, C, dt parts of in_proj's output
    ssm_out_multiplier: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_parameters: tuple
    key_multiplier: float
    attention_in_multiplier: float
    attention_out_multiplier: float
    intermediate_size: int
    mlp_bias: bool
    mlp_multipliers: tuple             # gate (inside the activation), down
    embedding_multiplier: float
    lm_head_multiplier: float


def _parse_falcon_h1(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"falcon_h1 with hidden_act={hf.hidden_act!r} (only silu)")
    params = FalconH1Params(
        **_bamba_mamba2(hf), projectors_bias=bool(hf.projectors_bias), mamba_rms_norm=bool(hf.mamba_rms_norm),
        mamba_norm_before_gate=bool(hf.mamba_norm_before_gate), ssm_in_multiplier=float(hf.ssm_in_multiplier),
        ssm_multipliers=tuple(float(m) for m in hf.ssm_multipliers), ssm_out_multiplier=float(hf.ssm_out_multiplier),
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        attention_bias=bool(hf.attention_bias), rope_parameters=_rope(hf), key_multiplier=float(hf.key_multiplier),
        attention_in_multiplier=float(hf.attention_in_multiplier),
        attention_out_multiplier=float(hf.attention_out_multiplier), intermediate_size=hf.intermediate_size,
        mlp_bias=bool(hf.mlp_bias), mlp_multipliers=tuple(float(m) for m in hf.mlp_multipliers),
        embedding_multiplier=float(hf.embedding_multiplier), lm_head_multiplier=float(hf.lm_head_multiplier))
    if len(params.ssm_multipliers) != 5 or len(params.mlp_multipliers) != 2:
        raise ConfigError("falcon_h1: ssm_multipliers needs 5 values (z, x, B, C, dt), mlp_multipliers 2")
    return (PARALLEL,) * hf.num_hidden_layers, params


@dataclass(frozen=True)
class BambaParams(Mamba2Params):
    """IBM Bamba (`bamba`): Mamba2 layers and GQA attention layers with RoPE on the first half of each head's dims
    (transformers fixes partial_rotary_factor at 0.5), each followed by a SwiGLU MLP; pre-norms, a final norm."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    attention_bias: bool
    rope_parameters: tuple
    intermediate_size: int
    mlp_bias: bool


def _parse_bamba(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"bamba with hidden_act={hf.hidden_act!r} (only silu)")
    head_dim = getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads
    rope = dict(_rope(hf))
    params = BambaParams(
        **_bamba_mamba2(hf), num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=head_dim, rotary_dim=int(head_dim * float(rope.get("partial_rotary_factor", 1.0))),
        attention_bias=bool(hf.attention_bias), rope_parameters=_rope(hf), intermediate_size=hf.intermediate_size,
        mlp_bias=bool(hf.mlp_bias))
    return _layer_types(hf, {"mamba": LINEAR, "attention": FULL}, attr="layers_block_type"), params


ACTIVATIONS = ("silu", "gelu", "gelu_pytorch_tanh", "gelu_new", "relu")


@dataclass(frozen=True)
class Zamba2Params(Mamba2Params):
    """Zyphra Zamba2 (`zamba2`): Mamba2 layers, and "hybrid" layers that first run a transformer block shared across
    layers (`num_mem_blocks` distinct blocks, used in turn) on [hidden | the token embeddings], each use with its own
    low-rank adapters on q / k / v (when `use_shared_attention_adapter`) and on the MLP's gate/up projection, then
    a per-layer linear map whose output is added to the Mamba2 mixer's input (not to the residual). Attention: width
    2 * hidden_size, head_dim = 2 * hidden_size / heads, scores scaled by (head_dim / 2) ** -0.5, RoPE when
    `use_mem_rope`. A hybrid layer has two stateful mixers: the Mamba2 one under the layer's index i, the
    attention under num_layers + i (its keys are its own: the shared weights see that layer's input)."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: tuple             # () without use_mem_rope
    intermediate_size: int
    hidden_act: str
    num_mem_blocks: int
    attention_adapters: bool           # use_shared_attention_adapter
    adapter_rank: int
    hybrid_layer_ids: tuple[int, ...]


def _parse_zamba2(hf):
    if hf.hidden_act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"zamba2 with hidden_act={hf.hidden_act!r} (one of {ACTIVATIONS})")
    if hf.use_shared_attention_adapter and hf.num_key_value_heads != hf.num_attention_heads:
        raise UnsupportedArchitectureError("zamba2 attention adapters with num_key_value_heads != num_attention_heads "
                                           "(transformers' adapters emit the query width for keys and values too)")
    inner = int(hf.mamba_expand * hf.hidden_size)
    params = Zamba2Params(
        mamba_num_heads=hf.n_mamba_heads, mamba_head_dim=inner // hf.n_mamba_heads, ssm_state_size=hf.mamba_d_state,
        n_groups=hf.mamba_ngroups, conv_kernel=hf.mamba_d_conv, use_conv_bias=bool(hf.use_conv_bias),
        use_bias=bool(hf.add_bias_linear), time_step_min=float(hf.time_step_min), time_step_max=math.inf,
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=hf.attention_head_dim, rope_parameters=_rope(hf) if hf.use_mem_rope else (),
        intermediate_size=hf.intermediate_size, hidden_act=hf.hidden_act, num_mem_blocks=int(hf.num_mem_blocks),
        attention_adapters=bool(hf.use_shared_attention_adapter), adapter_rank=int(hf.adapter_rank),
        hybrid_layer_ids=tuple(hf.hybrid_layer_ids))
    if inner % hf.n_mamba_heads:
        raise ConfigError("zamba2: n_mamba_heads must divide mamba_expand * hidden_size")
    return _layer_types(hf, {"mamba": LINEAR, "hybrid": PARALLEL}, attr="layers_block_type"), params


@dataclass(frozen=True)
class ZambaParams:
    """Zyphra Zamba (`zamba`): multi-head Mamba1 layers (per-head x_proj / dt_proj, interleaved (x, z) in_proj), and
    hybrid layers that first run one transformer block shared by all of them (NoPE attention of width 2 * hidden on
    [hidden | embeddings], scores scaled by (head_dim / 2) ** -0.5; a gate / up / down MLP), whose output, through a
    per-layer linear map, is added to the Mamba mixer's input. The block fields carry the names Zamba2Params uses
    (models/zamba.py reads both): one block, no adapters, no RoPE."""

    mamba_expand: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    n_mamba_heads: int
    time_step_min: float               # dummy init of dt (the forward has no clamp)
    time_step_max: float
    time_step_floor: float
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    hidden_act: str
    hybrid_layer_ids: tuple[int, ...]
    rope_parameters: tuple = ()
    num_mem_blocks: int = 1
    attention_adapters: bool = False
    adapter_rank: int = 0


def _parse_zamba(hf):
    if hf.hidden_act not in ACTIVATIONS:
        raise UnsupportedArchitectureError(f"zamba with hidden_act={hf.hidden_act!r} (one of {ACTIVATIONS})")
    if hf.hidden_mamba_act != "silu":
        raise UnsupportedArchitectureError(f"zamba with hidden_mamba_act={hf.hidden_mamba_act!r} (only silu)")
    if hf.attention_hidden_size != 2 * hf.hidden_size:
        raise ConfigError("zamba: attention_hidden_size must be 2 * hidden_size (the block reads [hidden | "
                          "embeddings])")
    types = _layer_types(hf, {"mamba": LINEAR, "hybrid": PARALLEL}, attr="layers_block_type")
    params = ZambaParams(
        mamba_expand=hf.mamba_expand, mamba_d_state=hf.mamba_d_state, mamba_d_conv=hf.mamba_d_conv,
        mamba_dt_rank=int(hf.mamba_dt_rank), mamba_conv_bias=bool(hf.mamba_conv_bias),
        mamba_proj_bias=bool(hf.mamba_proj_bias), n_mamba_heads=hf.n_mamba_heads,
        time_step_min=float(hf.time_step_min), time_step_max=float(hf.time_step_max),
        time_step_floor=float(hf.time_step_floor), num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads, head_dim=hf.attention_head_dim,
        intermediate_size=hf.intermediate_size, hidden_act=hf.hidden_act,
        hybrid_layer_ids=tuple(i for i, t in enumerate(types) if t == PARALLEL))
    return types, params


@dataclass(frozen=True)
class Lfm3Params:
    """LFM3 (`lfm3`): LFM2's gated short convs (conv_L_cache wide) and attention layers of two kinds, sliding-window
    and full, each with its own RoPE parameters (`rope_by_type`: the full layers' are "proportional", a partial
    rotation over the whole head), q / k RMSNorm per head and a sigmoid gate per head on the output; norms after the
    mixer and the MLP as well as before them (`sandwich`); a SwiGLU MLP (w1 / w3 / w2) in every layer."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    conv_kernel: int
    conv_bias: bool
    intermediate_size: int
    attention_bias: bool
    attention_gate: bool
    sandwich: bool
    sliding_window: int
    window_layers: tuple[int, ...]
    rope_by_type: tuple                # ((layer type, sorted rope items), ...)


def _parse_lfm3(hf):
    raw = list(hf.layer_types)
    window_layers = tuple(i for i, t in enumerate(raw) if t == "sliding_attention")
    rope = dict(hf.rope_parameters or {})
    by_type = tuple((t, tuple(sorted(dict(rope[t]).items()))) for t in ("full_attention", "sliding_attention")
                    if t in rope)
    params = Lfm3Params(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
        head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
        conv_kernel=hf.conv_L_cache, conv_bias=bool(hf.conv_bias), intermediate_size=hf.intermediate_size,
        attention_bias=bool(hf.attention_bias), attention_gate=bool(hf.use_attention_gate),
        sandwich=bool(hf.use_sandwich_norm), sliding_window=int(hf.sliding_window or 0) if window_layers else 0,
        window_layers=window_layers, rope_by_type=by_type)
    missing = {t for t in raw if t != "conv"} - {t for t, _ in by_type}
    if missing:
        raise ConfigError(f"lfm3: no RoPE parameters for the layer types {sorted(missing)}")
    return tuple(LINEAR if t == "conv" else FULL if t in ("full_attention", "sliding_attention") else t
                 for t in raw), params


@dataclass(frozen=True)
class LaraMiniParams:
    """Lara-mini (`lara_mini`): Qwen3.5's Gated DeltaNet layers, and Qwen3-style attention (q / k RMSNorm per head)
    in two kinds: sliding-window layers with RoPE, and full-attention layers with no positional encoding; every layer
    followed by a softmax top-k MoE (router in fp32) plus a shared expert added in full. The GDN field names are those
    layers/gdn.py reads."""

    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    attention_bias: bool
    rope_parameters: tuple
    sliding_window: int
    window_layers: tuple[int, ...]     # the sliding layers: RoPE and the window; the other attention layers: NoPE
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool


def _parse_lara_mini(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"lara_mini with hidden_act={hf.hidden_act!r} (only silu)")
    raw = list(hf.layer_types)
    window_layers = tuple(i for i, t in enumerate(raw) if t == "sliding_attention")
    if window_layers and not hf.sliding_window:
        raise ConfigError("lara_mini: sliding_attention layers without a sliding_window")
    params = LaraMiniParams(
        linear_num_key_heads=hf.linear_num_key_heads, linear_num_value_heads=hf.linear_num_value_heads,
        linear_key_head_dim=hf.linear_key_head_dim, linear_value_head_dim=hf.linear_value_head_dim,
        linear_conv_kernel_dim=hf.linear_conv_kernel_dim, num_attention_heads=hf.num_attention_heads,
        num_key_value_heads=hf.num_key_value_heads, head_dim=hf.head_dim, attention_bias=bool(hf.attention_bias),
        rope_parameters=_rope(hf), sliding_window=int(hf.sliding_window or 0), window_layers=window_layers,
        num_experts=int(hf.num_experts), num_experts_per_tok=int(hf.num_experts_per_tok),
        moe_intermediate_size=int(hf.moe_intermediate_size),
        shared_expert_intermediate_size=int(hf.shared_expert_intermediate_size), norm_topk_prob=bool(hf.norm_topk_prob))
    return tuple(FULL if t == "sliding_attention" else t for t in raw), params


@dataclass(frozen=True)
class TransformerParams:
    """Plain decoder-only transformers (Llama, Qwen2): every layer is full attention with RoPE,
    SwiGLU MLP, plain RMSNorm. A hybrid with no linear layers: PIC reduces to per-segment
    pre-RoPE K/V reuse plus the seam window."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rope_parameters: tuple
    qkv_bias: bool
    o_bias: bool
    intermediate_size: int
    mlp_bias: bool
    sliding_window: int = 0            # Qwen2's sliding-window layers see the last `sliding_window` positions only
    window_layers: tuple[int, ...] = ()


def _parse_transformer(arch):
    def parse(hf):
        g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
        if g("hidden_act", "silu") != "silu":
            raise UnsupportedArchitectureError(f"{arch} with hidden_act={g('hidden_act')!r} (only silu)")
        types = tuple(g("layer_types", None) or ["full_attention"] * hf.num_hidden_layers)
        window_layers = tuple(i for i, t in enumerate(types) if t == "sliding_attention")
        window = int(g("sliding_window", 0) or 0) if window_layers else 0
        if window_layers and window < 1:
            raise ConfigError(f"{arch}: sliding_attention layers without a sliding_window")
        types = tuple(FULL if t == "sliding_attention" else t for t in types)
        if arch == "qwen2":                  # q/k/v always carry a bias, o_proj never
            qkv_bias, o_bias, mlp_bias = True, False, False
        else:                                # llama: one flag for the four projections
            qkv_bias = o_bias = bool(g("attention_bias", False))
            mlp_bias = bool(g("mlp_bias", False))
        params = TransformerParams(
            num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads,
            head_dim=g("head_dim") or hf.hidden_size // hf.num_attention_heads, rope_parameters=_rope(hf),
            qkv_bias=qkv_bias, o_bias=o_bias, intermediate_size=hf.intermediate_size, mlp_bias=mlp_bias,
            sliding_window=window, window_layers=window_layers)
        return types, params
    return parse


@dataclass(frozen=True)
class RecurrentGemmaParams:
    """RecurrentGemma (Griffin): RG-LRU recurrent blocks and local sliding-window attention in the repeated
    `block_types` pattern, GeGLU MLPs with biases, Gemma's norms and embedding scale, soft-capped logits."""

    num_attention_heads: int           # attention heads, and the RG-LRU's gate blocks
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int                    # RoPE on the first half of each head (partial_rotary_factor)
    rope_parameters: tuple
    attention_bias: bool               # q/k/v; o_proj always has a bias
    attention_window_size: int
    lru_width: int
    conv1d_width: int
    intermediate_size: int             # the MLP is intermediate_size // 2 wide (as transformers builds it)
    hidden_activation: str
    logits_soft_cap: float


def _parse_recurrent_gemma(hf):
    rope = dict(_rope(hf))
    if rope.get("rope_type", "default") != "default":
        raise UnsupportedArchitectureError(f"recurrent_gemma with rope_type {rope.get('rope_type')!r} (only default)")
    if hf.lru_width % hf.num_attention_heads:
        raise ConfigError(f"recurrent_gemma: lru_width {hf.lru_width} is not a multiple of num_attention_heads "
                          f"{hf.num_attention_heads}")
    head_dim = hf.head_dim
    params = RecurrentGemmaParams(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads, head_dim=head_dim,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope_parameters=_rope(hf),
        attention_bias=bool(hf.attention_bias), attention_window_size=int(hf.attention_window_size),
        lru_width=int(hf.lru_width), conv1d_width=int(hf.conv1d_width), intermediate_size=int(hf.intermediate_size),
        hidden_activation=hf.hidden_activation, logits_soft_cap=float(hf.logits_soft_cap or 0.0))
    # transformers 5.24 names the layers linear_attention / sliding_attention, 5.17 recurrent / attention
    types = {"linear_attention": LINEAR, "recurrent": LINEAR, "sliding_attention": FULL, "attention": FULL}
    return tuple(types.get(t, t) for t in hf.layers_block_type), params


# the indexed attention layers' type names: transformers 5.24's, and 5.17's per family (both rename "full_attention")
_INDEXED = ("indexed_attention", "qwen_sparse_attention", "deepseek_sparse_attention")


@dataclass(frozen=True)
class Qwen4ExpParams:
    """Qwen4-Exp (text): Qwen3.5's Gated DeltaNet (output gate activation configurable) and gated attention layers
    whose keys an indexer selects (QSA: per query, the top `indexer_budget / indexer_compress_ratio` blocks of
    `indexer_compress_ratio` consecutive tokens by a pooled-key score, plus the incomplete last block); hc_count
    residual streams mixed per token (hyper-connections) around every block; a softmax top-k MoE with a gated shared
    expert after every layer; optionally per-layer n-gram embeddings (PLE) on some linear layers."""

    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rotary_dim: int
    rope_parameters: tuple
    attention_bias: bool
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int
    linear_output_gate: str            # the GDN output norm's gate activation: silu or sigmoid
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    shared_expert_intermediate_size: int
    norm_topk_prob: bool
    hc_count: int
    hc_lowrank: int
    indexer_n_heads: int
    indexer_head_dim: int
    indexer_budget: int
    indexer_compress_ratio: int
    ple_layers: tuple[int, ...] = ()   # per-layer n-gram embeddings on these layers (0-indexed; linear layers)
    ple_embed_dim: int = 0
    ple_conv_kernel_size: int = 0
    ngram_size: int = 0
    heads_per_ngram: int = 0
    ngram_vocab_size_base: int = 0
    make_ngram_vocab_size_divisible_by: int = 1
    seed: int = 0
    ple_eos: int = 0


def _parse_qwen4_exp(hf):
    g = lambda name, default=None: getattr(hf, name, default)  # noqa: E731
    fields = ("indexer_n_heads", "indexer_kv_heads", "indexer_head_dim", "indexer_budget", "indexer_compress_ratio")
    missing = [f for f in fields if not g(f)]
    if missing:
        raise ConfigError(f"qwen4_exp: the indexer needs {missing}")
    if hf.indexer_kv_heads != 1:
        raise ConfigError(f"qwen4_exp: indexer_kv_heads must be 1, not {hf.indexer_kv_heads}")
    rope = dict(_rope(hf))
    head_dim = hf.head_dim
    params = Qwen4ExpParams(
        num_attention_heads=hf.num_attention_heads, num_key_value_heads=hf.num_key_value_heads, head_dim=head_dim,
        rotary_dim=int(head_dim * rope.get("partial_rotary_factor", 1.0)), rope_parameters=_rope(hf),
        attention_bias=bool(hf.attention_bias), linear_num_key_heads=hf.linear_num_key_heads,
        linear_num_value_heads=hf.linear_num_value_heads, linear_key_head_dim=hf.linear_key_head_dim,
        linear_value_head_dim=hf.linear_value_head_dim, linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
        linear_output_gate=g("output_gate_type") or hf.hidden_act, num_experts=hf.num_experts,
        num_experts_per_tok=hf.num_experts_per_tok, moe_intermediate_size=hf.moe_intermediate_size,
        shared_expert_intermediate_size=hf.shared_expert_intermediate_size, norm_topk_prob=bool(hf.norm_topk_prob),
        hc_count=hf.hc_count, hc_lowrank=hf.hc_lowrank, indexer_n_heads=hf.indexer_n_heads,
        indexer_head_dim=hf.indexer_head_dim, indexer_budget=hf.indexer_budget,
        indexer_compress_ratio=hf.indexer_compress_ratio)
    if g("ple_layer_ids"):
        eos = hf.eos_token_id[0] if isinstance(hf.eos_token_id, (list, tuple)) else hf.eos_token_id
        if eos is None or not 0 <= eos < (1 << 24) or hf.vocab_size > (1 << 24):
            raise ConfigError("qwen4_exp with per-layer n-gram embeddings needs an eos_token_id and ids below 2^24")
        params = dataclasses.replace(
            params, ple_layers=tuple(i - 1 for i in hf.ple_layer_ids), ple_embed_dim=int(hf.ple_embed_dim),
            ple_conv_kernel_size=int(hf.ple_conv_kernel_size), ngram_size=int(hf.ngram_size),
            heads_per_ngram=int(hf.heads_per_ngram), ngram_vocab_size_base=int(hf.ngram_vocab_size_base),
            make_ngram_vocab_size_divisible_by=int(hf.make_ngram_vocab_size_divisible_by), seed=int(hf.seed),
            ple_eos=int(eos))
    return tuple(FULL if t in _INDEXED else t for t in hf.layer_types), params


@dataclass(frozen=True)
class Glm5NextParams:
    """GLM-5 Next (text): KDA layers (bounded low-rank forget gate) and, every fourth layer, MLA (NoPE, q through a
    LoRA latent) reading the keys a DSA indexer selects (pools of `index_kpool` tokens, the top `index_topk` tokens'
    worth per query, plus the incomplete last pool); `hc_mult` residual streams mixed per token by Sinkhorn-normalised
    hyper-connections (mHC); dense clamped-SwiGLU MLPs on the first layers, a DeepSeek-V3 MoE (sigmoid grouped
    routing with a correction bias, clamped SwiGLU experts, shared experts) after."""

    num_attention_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int              # 0 (validated by transformers): NoPE
    v_head_dim: int
    attention_bias: bool
    linear_num_heads: int
    linear_head_dim: int
    linear_conv_kernel_dim: int
    linear_lower_bound: float | None   # the forget gate's bound (lb * sigmoid(...)); None: -exp(A_log) softplus(...)
    intermediate_size: int
    moe_layers: tuple[int, ...]
    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    num_shared_experts: int
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    swiglu_limit: float | None
    hc_mult: int
    hc_eps: float
    hc_sinkhorn_iters: int
    index_topk: int
    index_n_heads: int
    index_head_dim: int
    index_kpool: int


def _parse_glm5_next(hf):
    shared = [i for i, t in enumerate(hf.indexer_types) if t != "full" and hf.layer_types[i] in _INDEXED]
    if shared:
        raise UnsupportedArchitectureError(
            f"glm5_next with indexer layers sharing the previous layer's selection ({shared}) is not supported")
    if not hf.index_kpool_always_select_tail:
        raise UnsupportedArchitectureError(
            "glm5_next with index_kpool_always_select_tail=False (a query would not see its own incomplete pool)")
    params = Glm5NextParams(
        num_attention_heads=hf.num_attention_heads, q_lora_rank=hf.q_lora_rank, kv_lora_rank=hf.kv_lora_rank,
        qk_nope_head_dim=hf.qk_nope_head_dim, qk_rope_head_dim=hf.qk_rope_head_dim, v_head_dim=hf.v_head_dim,
        attention_bias=bool(hf.attention_bias), linear_num_heads=hf.linear_num_heads,
        linear_head_dim=hf.linear_head_dim, linear_conv_kernel_dim=hf.linear_conv_kernel_dim,
        linear_lower_bound=None if hf.linear_lower_bound is None else float(hf.linear_lower_bound),
        intermediate_size=hf.intermediate_size,
        moe_layers=tuple(i for i, t in enumerate(hf.mlp_layer_types) if t == "sparse"),
        num_experts=hf.n_routed_experts, num_experts_per_tok=hf.num_experts_per_tok,
        moe_intermediate_size=hf.moe_intermediate_size, num_shared_experts=hf.n_shared_experts, n_group=hf.n_group,
        topk_group=hf.topk_group, norm_topk_prob=bool(hf.norm_topk_prob),
        routed_scaling_factor=float(hf.routed_scaling_factor),
        swiglu_limit=None if hf.swiglu_limit is None else float(hf.swiglu_limit), hc_mult=hf.hc_mult,
        hc_eps=float(hf.hc_eps), hc_sinkhorn_iters=hf.hc_sinkhorn_iters, index_topk=hf.index_topk,
        index_n_heads=hf.index_n_heads, index_head_dim=hf.index_head_dim, index_kpool=hf.index_kpool)
    return tuple(FULL if t in _INDEXED else t for t in hf.layer_types), params


@dataclass(frozen=True)
class MambaParams:
    """Mamba / FalconMamba (`mamba`, `falcon_mamba`): a stack of Mamba (S6) blocks and nothing else; the Mamba1Mixer
    fields (Jamba's names) plus how dt, B and C are normed."""

    mamba_expand: int
    mamba_d_state: int
    mamba_d_conv: int
    mamba_dt_rank: int
    mamba_conv_bias: bool
    mamba_proj_bias: bool
    ssm_norms: str | None              # "weightless" (FalconMamba) or None (Mamba)
    ssm_norm_eps: float


def _parse_mamba(arch):
    def parse(hf):
        if hf.hidden_act != "silu":
            raise UnsupportedArchitectureError(f"{arch} with hidden_act={hf.hidden_act!r} (only silu)")
        falcon = arch == "falcon_mamba"
        params = MambaParams(
            mamba_expand=hf.expand, mamba_d_state=hf.state_size, mamba_d_conv=hf.conv_kernel,
            mamba_dt_rank=int(hf.time_step_rank), mamba_conv_bias=bool(hf.use_conv_bias),
            mamba_proj_bias=bool(hf.use_bias), ssm_norms="weightless" if falcon else None,
            ssm_norm_eps=float(hf.mixer_rms_eps) if falcon else 0.0)
        return (LINEAR,) * hf.num_hidden_layers, params
    return parse


def _parse_mamba2(hf):
    if hf.hidden_act != "silu":
        raise UnsupportedArchitectureError(f"mamba2 with hidden_act={hf.hidden_act!r} (only silu)")
    if hf.num_heads * hf.head_dim != int(hf.expand * hf.hidden_size):
        raise ConfigError(f"mamba2: num_heads x head_dim ({hf.num_heads} x {hf.head_dim}) must be expand x "
                          f"hidden_size ({hf.expand} x {hf.hidden_size})")
    lo, hi = hf.time_step_limit
    params = Mamba2Params(
        mamba_num_heads=hf.num_heads, mamba_head_dim=hf.head_dim, ssm_state_size=hf.state_size, n_groups=hf.n_groups,
        conv_kernel=hf.conv_kernel, use_conv_bias=bool(hf.use_conv_bias), use_bias=bool(hf.use_bias),
        time_step_min=float(lo), time_step_max=float(hi))
    return (LINEAR,) * hf.num_hidden_layers, params


@dataclass(frozen=True)
class ArchSpec:
    arch: str          # hypic architecture: selects the model module (models/registry.py)
    hf_type: str | None  # transformers model_type whose config class parses the dict (None: remote code)
    parse: Any         # hf config -> (layer_types, params)


# HF model_type -> hypic architecture. The nested multimodal configs (`qwen3_5`, `qwen3_5_moe`)
# carry the text model under `text_config`; hypic serves the text model.
ARCHITECTURES: dict[str, ArchSpec] = {
    "qwen3_5": ArchSpec("qwen3_5", "qwen3_5_text", _parse_qwen("qwen3_5")),
    "qwen3_5_text": ArchSpec("qwen3_5", "qwen3_5_text", _parse_qwen("qwen3_5")),
    "qwen3_5_moe": ArchSpec("qwen3_5_moe", "qwen3_5_moe_text", _parse_qwen("qwen3_5_moe")),
    "qwen3_5_moe_text": ArchSpec("qwen3_5_moe", "qwen3_5_moe_text", _parse_qwen("qwen3_5_moe")),
    "qwen3_next": ArchSpec("qwen3_next", "qwen3_next", _parse_qwen("qwen3_next")),
    "kimi_linear": ArchSpec("kimi_linear", "kimi_linear", _parse_kimi),
    "minimax": ArchSpec("minimax", "minimax", _parse_minimax),
    "nemotron_h": ArchSpec("nemotron_h", "nemotron_h", _parse_nemotron_h),
    "jamba": ArchSpec("jamba", "jamba", _parse_jamba),
    "bailing_moe_linear": ArchSpec("bailing_moe_linear", None, _parse_bailing_linear),
    "lfm2": ArchSpec("lfm2", "lfm2", _parse_lfm2),
    "lfm2_moe": ArchSpec("lfm2_moe", "lfm2_moe", _parse_lfm2_moe),
    "granitemoehybrid": ArchSpec("granitemoehybrid", "granitemoehybrid", _parse_granitemoehybrid),
    "olmo_hybrid": ArchSpec("olmo_hybrid", "olmo_hybrid", _parse_olmo_hybrid),
    "falcon_h1": ArchSpec("falcon_h1", "falcon_h1", _parse_falcon_h1),
    "bailing_hybrid": ArchSpec("bailing_hybrid", "bailing_hybrid", _parse_bailing_hybrid),
    "bamba": ArchSpec("bamba", "bamba", _parse_bamba),
    "zamba2": ArchSpec("zamba2", "zamba2", _parse_zamba2),
    "zamba": ArchSpec("zamba", "zamba", _parse_zamba),
    "lara_mini": ArchSpec("lara_mini", "lara_mini", _parse_lara_mini),
    "lfm3": ArchSpec("lfm3", "lfm3", _parse_lfm3),
    "recurrent_gemma": ArchSpec("recurrent_gemma", "recurrent_gemma", _parse_recurrent_gemma),
    "qwen4_exp": ArchSpec("qwen4_exp", "qwen4_exp_text", _parse_qwen4_exp),
    "qwen4_exp_text": ArchSpec("qwen4_exp", "qwen4_exp_text", _parse_qwen4_exp),
    "glm5_next": ArchSpec("glm5_next", "glm5_next_text", _parse_glm5_next),
    "glm5_next_text": ArchSpec("glm5_next", "glm5_next_text", _parse_glm5_next),
    # state-space models: the degenerate hybrid with no attention layer
    "mamba": ArchSpec("mamba", "mamba", _parse_mamba("mamba")),
    "falcon_mamba": ArchSpec("falcon_mamba", "falcon_mamba", _parse_mamba("falcon_mamba")),
    "mamba2": ArchSpec("mamba2", "mamba2", _parse_mamba2),
    # plain transformers: the degenerate hybrid with no linear layer (all layers full attention)
    "llama": ArchSpec("llama", "llama", _parse_transformer("llama")),
    "qwen2": ArchSpec("qwen2", "qwen2", _parse_transformer("qwen2")),
}
_TEXT_MODEL_TYPE = {"qwen3_5": "qwen3_5_text", "qwen3_5_moe": "qwen3_5_moe_text", "qwen4_exp": "qwen4_exp_text",
                    "glm5_next": "glm5_next_text"}
# Recurrent and sparse-attention architectures transformers ships that hypic does not serve, and why (also in README).
UNSUPPORTED: dict[str, str] = {
    "rwkv": "RWKV-4's WKV recurrence, a pure RNN with no attention layer: not implemented",
    "xlstm": "xLSTM: its sLSTM cells are not affine in their state, so no exact composition",
    "zaya": "ZAYA's convolutional attention (q/k through a causal conv, delayed values): not implemented",
    "deepseek_v4": "DeepSeek-V4's indexer-selected sparse attention in a model with no linear layer: not implemented",
    "minimax_m3_vl": "MiniMax-M3's indexer-selected sparse attention: not implemented",
}


def _freeze(v):
    return json.loads(json.dumps(v, default=str))


class CacheMode(str, enum.Enum):
    FULL = "full"        # no cache: recompute the whole prompt
    PREFIX = "prefix"    # exact prefix reuse at span boundaries (KV + linear states + conv windows)
    NAIVE = "naive"      # PIC with state addition instead of the transition operator (a straw man)
    PIC = "pic"          # PIC: S_out = T @ S_in + S, plus the seam window

    @classmethod
    def parse(cls, value: "CacheMode | str") -> "CacheMode":
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"unknown cache mode {value!r}; choose one of {[m.value for m in cls]}") from None


ANCHORS = ("none", "prefix")


@dataclass(frozen=True)
class CachePolicy:
    """How a request reuses state. Policy is data: layers read these fields, never mode strings."""

    mode: CacheMode = CacheMode.PIC
    seam: int = 8                 # tokens recomputed at the start of every reused segment
    anchor: str = "none"          # what a segment's isolated prefill runs after: "none" (nothing: positions 0..L-1,
                                  # hypic.md section 3) or "prefix" (the request's prefix, so the segment's first
                                  # tokens are not the sequence's first and its entry is keyed by the prefix too)

    def __post_init__(self):
        if not isinstance(self.seam, int) or isinstance(self.seam, bool) or self.seam < 0:
            raise ConfigError(f"seam must be an integer >= 0, got {self.seam!r}")
        if self.anchor not in ANCHORS:
            raise ConfigError(f"unknown anchor {self.anchor!r}; use one of {', '.join(map(repr, ANCHORS))}")

    def updated(self, mode=None, seam: int | None = None, anchor: str | None = None) -> "CachePolicy":
        """This policy with the fields given replaced (None, or an empty mode, keeps a field); `mode` as
        CacheMode.parse takes it. The API's set_policy and the server's per-request overrides both go through it."""
        return CachePolicy(CacheMode.parse(mode or self.mode), self.seam if seam is None else seam,
                           self.anchor if anchor is None else anchor)

    @property
    def uses_segments(self) -> bool:
        return self.mode in (CacheMode.PIC, CacheMode.NAIVE)

    @property
    def exact_transition(self) -> bool:
        """Compose with T (PIC) or with the identity (naive addition)."""
        return self.mode is not CacheMode.NAIVE


@dataclass(frozen=True)
class ParallelConfig:
    """Segment-parallel cold prefill (hypic.md 2.3): the cold segments of a request are prefilled in isolation on
    `workers` ranks at once (this process is rank 0 and takes a share; ranks 1..workers-1 are worker processes, each
    with its own copy of the model), placed longest-first (LPT), and their entries stream back to rank 0, which
    inserts them and composes. A worker that fails or misses `timeout_s` has its segments prefilled on rank 0."""

    workers: int = 1                   # ranks in the group, this process included; 1: no workers
    devices: tuple[str, ...] = ()      # the workers' devices (ranks 1..); empty: cuda:1, cuda:2, ... when the engine
                                       # is on CUDA, else the engine's device
    spawn: bool = True                 # start the workers as local processes; False: wait for `hypic worker` processes
                                       # (other hosts) to connect to host:port
    host: str = "127.0.0.1"            # where rank 0's rendezvous store listens
    port: int = 0                      # its port; 0: a free one (spawn only)
    transport: str = "auto"            # entry tensors between ranks: "gloo" (through host memory), "nccl" (GPU to GPU);
                                       # auto: nccl on CUDA, gloo elsewhere. Orders and headers always go over gloo
    timeout_s: float = 120.0           # a cold prefill's entries from the workers must all arrive within this, counted
                                       # from when rank 0 has prefilled its own share
    startup_timeout_s: float = 600.0   # workers must load their model and join within this
    threads: int = 0                   # torch threads of a CPU worker (0: torch's default, one per core)
    placement: str = "lpt"             # "lpt" (longest first to the least-loaded rank) or "count" (round robin in
                                       # prompt order, equal counts: the baseline LPT is measured against)
    chunk_tokens: int = 16384          # a worker prefills its share in batches of about this many tokens, sending each
                                       # batch's entries as soon as they are built
    restarts: int = 3                  # a spawned worker that dies is started again (its model loaded anew, then every
                                       # rank joins a new group between two prefills) at most this many times; 0: never
                                       # (a hand-started worker is taken back whenever its operator starts it again)

    def __post_init__(self):
        if not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"workers must be an integer >= 1, got {self.workers!r}")
        if self.transport not in ("auto", "gloo", "nccl"):
            raise ConfigError(f"unknown transport {self.transport!r}; use 'auto', 'gloo' or 'nccl'")
        if self.devices and len(self.devices) != self.workers - 1:
            raise ConfigError(f"{len(self.devices)} worker devices for {self.workers - 1} workers")
        if not self.spawn and not self.port:
            raise ConfigError("workers started by hand (spawn=False) need a fixed port to connect to")
        if not 0 <= self.port < 65536:
            raise ConfigError(f"port must be in 0..65535, got {self.port}")
        for name in ("timeout_s", "startup_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name} must be > 0")
        if self.placement not in ("lpt", "count"):
            raise ConfigError(f"unknown placement {self.placement!r}; use 'lpt' or 'count'")
        if self.threads < 0 or self.chunk_tokens < 1:
            raise ConfigError("threads must be >= 0 and chunk_tokens >= 1")
        if not isinstance(self.restarts, int) or self.restarts < 0:
            raise ConfigError(f"restarts must be an integer >= 0, got {self.restarts!r}")

    @property
    def enabled(self) -> bool:
        return self.workers > 1

    def worker_device(self, rank: int, engine_device: str) -> str:
        """The device of worker `rank` (1..workers-1)."""
        if self.devices:
            return self.devices[rank - 1]
        return f"cuda:{rank}" if engine_device.startswith("cuda") else engine_device

    def data_transport(self, engine_device: str) -> str:
        if self.transport != "auto":
            return self.transport
        return "nccl" if engine_device.startswith("cuda") else "gloo"


@dataclass(frozen=True)
class EngineConfig:
    device: str = "cpu"
    dtype: str = "float32"
    load_format: str = "auto"          # "auto" (safetensors) | "dummy" (random weights at full size)
    seed: int = 0                      # dummy weights: drawn on `device` (a 35B model is not drawn on the host), so
                                       # one seed gives other weights on CUDA than on the CPU
    policy: CachePolicy = CachePolicy()
    segment_cache_bytes: int = 4 << 30    # the segment store's device tier
    host_cache_bytes: int = 0             # its host tier (pinned on CUDA): entries evicted from the device go there and
                                          # come back on a hit with one copy; 0: none
    disk_cache_dir: str = ""              # its disk tier: every entry written through to this directory (persists
                                          # across restarts; checked by sha256 when read); "": none
    disk_cache_bytes: int = 64 << 30
    eviction: str = "lru"                 # the segment store's device and host tiers: "lru", or "cost" (GreedyDual-Size
                                          # on the prefill work an entry saves per byte it holds: cache/store.py)
    admission: str = "always"             # the segment store's admission: "always" (every cold entry is stored), or
                                          # "repeat" (only from a segment's second sighting within the last
                                          # admission_window distinct ones: one-off documents do not evict reused ones)
    admission_window: int = 65536
    supersede_versions: bool = True       # a request bringing version v of a tagged document (hypic.Segment) drops
                                          # the cached entries of its other versions, in every tier
    prefix_cache_bytes: int = 4 << 30
    namespace: str = "default"
    backend: str = "auto"              # op backend (hypic/ops): "auto" (= "fast"), "fast", "reference"
    max_segments: int = 1024
    walk: str = "phased"               # linear layers' compose pass: "phased" (batched) or "rounds" (plain)
    decode: str = "auto"               # "dynamic" (a planned batch per step), "static" (fixed buffers),
                                       # "graph" (fixed buffers replayed as a CUDA graph); auto: graph on CUDA
    compose: str = "auto"              # one request's compose pass: "eager" (the planned walk), "static" (fixed
                                       # buffers, runtime/compose_graph.py), "graph" (those replayed as a CUDA
                                       # graph); auto: graph on CUDA, eager elsewhere
    compose_pieces: int = 8            # the compose graph captured as this many graphs over consecutive layers,
                                       # each piece's buffers filled just before its launch (the GPU starts on
                                       # the first while the host fills and launches the rest); H200 runs 34-35,
                                       # paired per round against 4 pieces: 1 piece +2.1 ms, 2 +0.7, 8 -0.3
    compose_first_piece: int = 1       # layers in the first of those pieces (0: equal pieces); a short first piece
                                       # lets the GPU start after a shorter fill and launch: H200 runs 37, 38, 40,
                                       # 41, 47, 49, paired per round against equal pieces, -0.33, -0.31, -0.49,
                                       # -0.25, -0.03, -0.48 ms: a gain in all six (on since the 33rd session)
    parallel: ParallelConfig = ParallelConfig()   # segment-parallel cold prefill (off: one rank)
    prefill_chunk_tokens: int = 65536  # the cold segments of a prefill run in isolated-prefill forwards of at most this
                                       # many tokens each; a longer segment runs alone, in parts of this size joined by
                                       # the composition algebra: activation memory stays bounded

    def __post_init__(self):
        if self.decode not in ("auto", "dynamic", "static", "graph"):
            raise ConfigError(f"unknown decode {self.decode!r}; use 'auto', 'dynamic', 'static' or 'graph'")
        if self.compose not in ("auto", "eager", "static", "graph"):
            raise ConfigError(f"unknown compose {self.compose!r}; use 'auto', 'eager', 'static' or 'graph'")
        if self.compose_pieces < 1:
            raise ConfigError(f"compose_pieces must be >= 1, got {self.compose_pieces}")
        if self.prefill_chunk_tokens < 1:
            raise ConfigError(f"prefill_chunk_tokens must be >= 1, got {self.prefill_chunk_tokens}")
        if self.compose_first_piece < 0:
            raise ConfigError(f"compose_first_piece must be >= 0, got {self.compose_first_piece}")
        if self.eviction not in ("lru", "cost"):
            raise ConfigError(f"unknown eviction {self.eviction!r}; use 'lru' or 'cost'")
        if self.admission not in ("always", "repeat"):
            raise ConfigError(f"unknown admission {self.admission!r}; use 'always' or 'repeat'")
        if self.admission_window < 1:
            raise ConfigError(f"admission_window must be >= 1, got {self.admission_window}")
        if self.walk not in ("phased", "rounds"):
            raise ConfigError(f"unknown walk {self.walk!r}; use 'phased' or 'rounds'")
        if self.dtype not in ("float32", "bfloat16", "float16", "float64"):
            raise ConfigError(f"unsupported dtype {self.dtype!r}")
        if self.load_format not in ("auto", "dummy", "safetensors"):
            raise ConfigError(f"unknown load_format {self.load_format!r}; use 'auto', 'safetensors' or 'dummy'")
        if not isinstance(self.parallel, ParallelConfig):
            raise ConfigError(f"parallel must be a ParallelConfig, got {type(self.parallel).__name__}")
        for name in ("segment_cache_bytes", "prefix_cache_bytes", "host_cache_bytes", "disk_cache_bytes"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name} must be >= 0")

    @property
    def decode_mode(self) -> str:
        if self.decode != "auto":
            return self.decode
        return "graph" if self.device.startswith("cuda") else "dynamic"

    @property
    def compose_mode(self) -> str:
        if self.compose != "auto":
            return self.compose
        return "graph" if self.device.startswith("cuda") else "eager"

    @property
    def torch_dtype(self):
        import torch

        return getattr(torch, self.dtype)

    def replace(self, **kw) -> "EngineConfig":
        return dataclasses.replace(self, **kw)


def human_bytes(n: int) -> str:
    if n <= 0:
        return "0 B"
    i = min(int(math.log(n, 1024)), 4)
    return f"{n / 1024 ** i:.1f} {['B', 'KiB', 'MiB', 'GiB', 'TiB'][i]}"
