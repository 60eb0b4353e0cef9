"""Qwen4-Exp (text): Gated DeltaNet layers and, every `full_attention_interval`-th layer, Qwen3.5's gated attention
reading the keys a QSA indexer selects (layers/indexed.py); a softmax top-k MoE with a sigmoid-gated shared expert
after every layer; no per-layer norms but `hc_count` residual streams (hyper-connections): before each block a
`GatedResidual` normalises every stream, mixes them into the block's input by per-token weights and, after the block,
adds its output into every stream with per-token injection weights; a last one (without injection) mixes the streams
into the LM head's input (no final norm). Per-layer n-gram embeddings (PLE) on the layers the config lists:
models/qwen4_ple.py.
Parameter names are transformers' (`attn_hyper_connection`, `mlp_hyper_connection`, `hyper_connection_mixer`)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..config import LINEAR, ModelConfig
from ..layers.gdn import GatedDeltaNet
from ..layers.indexed import IndexedAttention
from ..layers.mlp import SparseMoe
from ..runtime.batch import ForwardBatch
from .base import Backbone, CausalLM, uniform
from .qwen4_ple import PLE


class GroupedRMSNorm(nn.Module):
    """Zero-centred RMSNorm of each `group`-wide slice of the features (each residual stream alone), weight (1 + w)
    over all of them, fp32 inside, one rounding."""

    def __init__(self, dim: int, group: int, eps: float):
        super().__init__()
        self.group, self.eps = group, eps
        self.weight = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        xf = x.float().unflatten(-1, (-1, self.group))
        y = (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)).flatten(-2)
        return (y * (1.0 + self.weight.float())).to(x.dtype)


class GatedResidual(nn.Module):
    """One hyper-connection: h [N, n * H] -> (the block's input [N, H], injection weights [N, n]); `inject` is None in
    the last one (which returns the mixed input alone)."""

    def __init__(self, cfg: ModelConfig, inject: bool = True):
        super().__init__()
        p = cfg.params
        self.n, self.hidden = p.hc_count, cfg.hidden_size
        width = self.n * self.hidden
        self.hc_norm = GroupedRMSNorm(width, self.hidden, cfg.rms_norm_eps)
        self.input_mix_weight_down = nn.Linear(width, p.hc_lowrank, bias=False)
        self.input_mix_weight_up = nn.Linear(p.hc_lowrank, width, bias=False)
        self.block_inject_weight = nn.Linear(width, self.n, bias=False) if inject else None

    def forward(self, h):
        hn = self.hc_norm(h)
        w = torch.sigmoid(self.input_mix_weight_up(F.silu(self.input_mix_weight_down(hn) / self.n)))
        mixed = (w.unflatten(-1, (self.n, self.hidden)) * hn.unflatten(-1, (self.n, self.hidden))).mean(-2)
        if self.block_inject_weight is None:
            return mixed
        return mixed, 2 * torch.sigmoid(self.block_inject_weight(hn) / self.n)

    @staticmethod
    def add(h, y, inject):
        """h + the block's output y [N, H] into every stream, weighted per stream."""
        return h + (y[:, None, :] * inject[:, :, None]).flatten(-2)


class DecoderLayer(nn.Module):
    cuts_rows = True                  # the last layer's MLP on the logits rows alone (CausalLM.run_layers)

    def __init__(self, cfg: ModelConfig, i: int, ops, rotary):
        super().__init__()
        p = cfg.params
        if cfg.layer_types[i] == LINEAR:
            self.linear_attn = GatedDeltaNet(cfg, i, ops)
        else:
            self.self_attn = IndexedAttention(cfg, i, ops, rotary)
        self.mlp = SparseMoe(cfg, ops)
        if i in p.ple_layers:
            self.ple = PLE(cfg, i, p.ple_layers.index(i), ops, GroupedRMSNorm)
        self.attn_hyper_connection = GatedResidual(cfg)
        self.mlp_hyper_connection = GatedResidual(cfg)

    @property
    def state_mixers(self):
        ple = self.ple.mixers if hasattr(self, "ple") else ()
        if hasattr(self, "linear_attn"):
            return (self.linear_attn, *ple)
        return (self.self_attn, self.self_attn.indexer, *ple)

    def forward(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if hasattr(self, "ple"):
            h = h + self.ple(h, batch)
        m, inject = self.attn_hyper_connection(h)
        mixer = self.linear_attn if hasattr(self, "linear_attn") else self.self_attn
        h = batch.kept(GatedResidual.add(h, mixer(m, batch), inject))
        m, inject = self.mlp_hyper_connection(h)
        return GatedResidual.add(h, self.mlp(m), inject)


class Qwen4ExpForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, ops):
        p = cfg.params
        super().__init__(cfg, Backbone(cfg, ops, DecoderLayer, p.rotary_dim, p.rope_parameters,
                                       norm_name="hyper_connection_mixer", norm=lambda: GatedResidual(cfg, False)))

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids).repeat(1, self.config.params.hc_count)   # every stream alike

    def dummy_init(self, name, p, generator) -> bool:
        if name.endswith("A_log"):                        # as Qwen3.5: A uniform in [0.01, 16]
            p.copy_(uniform(p, 0.01, 16.0, generator).log())
        elif name.endswith("dt_bias"):
            p.fill_(1.0)
        elif p.dim() == 1 and "norm" in name and not name.endswith("linear_attn.norm.weight"):
            p.zero_()                                     # zero-centred norms (the GDN's gated norm is w itself)
        else:
            return False
        return True
