"""Zyphra Zamba (`zamba`) and Zamba2 (`zamba2`): Mamba layers, and "hybrid" layers that run a transformer block shared
across layers before their Mamba mixer:

    e = the token embeddings (the model's input, kept for every hybrid layer)
    a = attn(input_layernorm([h | e]))                     width 2 * hidden in, hidden out
    t = linear(feed_forward(pre_ff_layernorm(a)))         the block's MLP, then a per-layer linear map
    h = h + mamba(mamba_norm(h + t))                      the block's output enters the mixer, not the residual

Zamba2: Mamba2 mixers; `num_mem_blocks` distinct blocks serve the hybrid layers in turn (hybrid layer j uses block
j % num_mem_blocks); a block's weights are shared, its low-rank adapters are not: adapter slot j of that block (on
q / k / v when `use_shared_attention_adapter`, always on the MLP's gate/up projection) belongs to hybrid layer j. A hybrid layer has
two stateful mixers (`state_mixers`): the Mamba2 one under the layer's index i and the attention under
num_layers + i, whose keys are that layer's own (the shared weights see the layer's input), so a segment entry holds
both, as for Falcon-H1. Zamba: multi-head Mamba1 mixers (layers/mamba1.py), one block (`shared_transf`) for every
hybrid layer, no adapters, NoPE, a gate / up / down MLP. Parameter names are transformers'; a block's weights are
named once, at the first hybrid layer that uses it (transformers ties the later ones to it and saves them once)."""

from __future__ import annotations

import torch
from torch import nn

from ..config import PARALLEL, ModelConfig
from ..layers.attention import RopeAttention
from ..layers.mamba1 import MultiHeadMamba1Mixer
from ..layers.mamba2 import GroupedGatedRMSNorm, Mamba2Mixer, mamba2_dummy_init
from ..layers.mlp import activation
from ..layers.norm import ScaledRMSNorm
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM

EMBEDS = ("zamba", "embeds")        # batch.scratch key: the token embeddings of this forward


def _adapters(cfg: ModelConfig, block_id: int, d_in: int, d_out: int) -> nn.ModuleList:
    """One slot per hybrid layer; the slots of the layers this block serves hold a rank-r map, the others nothing
    (nn.Identity, never called: transformers' layout, so the names match)."""
    p = cfg.params
    return nn.ModuleList(
        nn.Sequential(nn.Linear(d_in, p.adapter_rank, bias=False), nn.Linear(p.adapter_rank, d_out, bias=False))
        if j % p.num_mem_blocks == block_id else nn.Identity()
        for j in range(len(p.hybrid_layer_ids)))


class SharedAttentionWeights(nn.Module):
    def __init__(self, cfg: ModelConfig, block_id: int):
        super().__init__()
        p = cfg.params
        d = 2 * cfg.hidden_size
        self.q_proj = nn.Linear(d, p.num_attention_heads * p.head_dim, bias=False)
        self.k_proj = nn.Linear(d, p.num_key_value_heads * p.head_dim, bias=False)
        self.v_proj = nn.Linear(d, p.num_key_value_heads * p.head_dim, bias=False)
        self.o_proj = nn.Linear(p.num_attention_heads * p.head_dim, cfg.hidden_size, bias=False)
        if p.attention_adapters:
            self.linear_q_adapter_list = _adapters(cfg, block_id, d, d)
            self.linear_k_adapter_list = _adapters(cfg, block_id, d, d)
            self.linear_v_adapter_list = _adapters(cfg, block_id, d, d)


class SharedMLP(nn.Module):
    """gate_up_proj emits [gate | up]; its per-layer adapter adds to both."""

    def __init__(self, cfg: ModelConfig, block_id: int):
        super().__init__()
        p = cfg.params
        hs, inter = cfg.hidden_size, p.intermediate_size
        self.gate_up_proj = nn.Linear(hs, 2 * inter, bias=p.use_bias)
        self.down_proj = nn.Linear(inter, hs, bias=p.use_bias)
        self.gate_up_proj_adapter_list = _adapters(cfg, block_id, hs, 2 * inter)
        self.act = activation(p.hidden_act)

    def forward(self, x, slot: int):
        gate, up = (self.gate_up_proj(x) + self.gate_up_proj_adapter_list[slot](x)).chunk(2, dim=-1)
        return self.down_proj(self.act(gate) * up)


class GatedMLP(nn.Module):
    """Zamba's block MLP: down(act(gate(x)) * up(x)), no adapters."""

    def __init__(self, cfg: ModelConfig, block_id: int):
        super().__init__()
        hs, inter = cfg.hidden_size, cfg.params.intermediate_size
        self.gate_proj = nn.Linear(hs, inter, bias=False)
        self.up_proj = nn.Linear(hs, inter, bias=False)
        self.down_proj = nn.Linear(inter, hs, bias=False)
        self.act = activation(cfg.params.hidden_act)

    def forward(self, x, slot: int):
        return self.down_proj(self.act(self.gate_proj(x)) * self.up_proj(x))


class SharedBlock(nn.Module):
    def __init__(self, cfg: ModelConfig, block_id: int):
        super().__init__()
        self.self_attn = SharedAttentionWeights(cfg, block_id)
        self.feed_forward = (GatedMLP if cfg.arch == "zamba" else SharedMLP)(cfg, block_id)
        self.input_layernorm = ScaledRMSNorm(2 * cfg.hidden_size, cfg.rms_norm_eps)
        self.pre_ff_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class BlockAttention(RopeAttention):
    """One hybrid layer's use of its block's attention: the shared q / k / v / o plus this layer's adapters (slot).
    The block is held outside this module's parameters (it is registered once, under the layer)."""

    def __init__(self, cfg: ModelConfig, mixer_id: int, ops, rotary, block: SharedBlock, slot: int):
        super().__init__(mixer_id, ops, rotary)
        p = cfg.params
        self.nh, self.num_kv_heads, self.hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        self.key_dim = self.value_dim = self.hd
        self.scale = (self.hd / 2) ** -0.5
        self.weights = [block.self_attn]
        self.slot, self.adapters, self.hidden = slot, p.attention_adapters, cfg.hidden_size

    def project(self, x, batch):
        w, n, j = self.weights[0], x.shape[0], self.slot
        q, k, v = w.q_proj(x), w.k_proj(x), w.v_proj(x)
        if self.adapters:
            q = q + w.linear_q_adapter_list[j](x)
            k = k + w.linear_k_adapter_list[j](x)
            v = v + w.linear_v_adapter_list[j](x)
        return q.view(n, self.nh, self.hd), k.view(n, self.num_kv_heads, self.hd), v.view(n, self.num_kv_heads,
                                                                                         self.hd), None

    def output(self, x, out, extra):
        return self.weights[0].o_proj(out.reshape(x.shape[0], -1))

    def no_tokens(self, x):
        return x.new_zeros(x.shape[0], self.hidden)


class Zamba2Mamba(Mamba2Mixer):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(cfg, layer_idx, ops)
        self.norm = GroupedGatedRMSNorm(self.inner, self.inner // self.groups, 1e-5)    # transformers fixes its eps


class MambaLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops):
        super().__init__()
        self.mamba = (MultiHeadMamba1Mixer if cfg.arch == "zamba" else Zamba2Mamba)(cfg, i, ops)
        self.input_layernorm = ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    @property
    def state_mixer(self):
        return self.mamba

    def forward(self, h: torch.Tensor, batch: ForwardBatch, extra: torch.Tensor | None = None) -> torch.Tensor:
        return h + self.mamba(self.input_layernorm(h if extra is None else h + extra), batch)


def block_name(cfg: ModelConfig) -> str:
    """The attribute a hybrid layer keeps its shared block under (transformers' names)."""
    return "shared_transf" if cfg.arch == "zamba" else "shared_transformer"


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, i: int, ops, rotary, block: SharedBlock, slot: int):
        super().__init__()
        self.linear = nn.Linear(cfg.hidden_size, cfg.hidden_size, bias=False)
        self.mamba_decoder = MambaLayer(cfg, i, ops)
        self.add_module(block_name(cfg), block)
        self.block = [block]                 # the same module, for forward (named once, under the name above)
        self.attn = BlockAttention(cfg, cfg.num_layers + i, ops, rotary, block, slot)
        self.slot = slot

    @property
    def state_mixers(self):
        return self.mamba_decoder.mamba, self.attn

    @property
    def state_mixer(self):
        return None

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        b = self.block[0]
        a = self.attn(b.input_layernorm(torch.cat([h, batch.scratch[EMBEDS]], dim=-1)), batch)
        t = self.linear(b.feed_forward(b.pre_ff_layernorm(a), self.slot))
        return self.mamba_decoder(h, batch, t)


def _layers(cfg: ModelConfig):
    """layer(cfg, i, ops, rotary) for the Backbone: Mamba layers, and hybrid layers with the shared block of their
    turn (a block is made at its first use, so its weights are named under that layer)."""
    p, blocks = cfg.params, {}

    def layer(cfg, i, ops, rotary):
        if cfg.layer_types[i] != PARALLEL:
            return MambaLayer(cfg, i, ops)
        slot = p.hybrid_layer_ids.index(i)
        bid = slot % p.num_mem_blocks
        if bid not in blocks:
            blocks[bid] = SharedBlock(cfg, bid)
        return HybridLayer(cfg, i, ops, rotary, blocks[bid], slot)
    return layer


class ZambaForCausalLM(CausalLM):
    """Zamba and Zamba2 (the config's arch picks the mixer, the block's MLP and its name)."""

    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, _layers(cfg), p.head_dim if p.rope_parameters else 0,
                                       p.rope_parameters, "final_layernorm"))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        e = self.model.embed_tokens(batch.input_ids)
        batch.scratch[EMBEDS] = e            # every hybrid layer reads the embeddings beside its hidden state
        return e

    def dummy_init(self, name, p, generator) -> bool:
        if self.config.arch == "zamba":
            return MultiHeadMamba1Mixer.dummy_init(self.config, name, p, generator)
        return mamba2_dummy_init(name, p, generator)
