"""What every hypic model shares: embed -> decoder layers over a ForwardBatch -> norm -> lm_head,
and the map from layer index to its stateful mixer (linear or attention), which the engine uses
to restore per-layer states without knowing the family."""

from __future__ import annotations

from types import MappingProxyType
from typing import Callable

import torch
from torch import nn

from ..config import ModelConfig
from ..layers.norm import ScaledRMSNorm
from ..layers.rope import Rotary
from ..runtime.batch import ForwardBatch


# the last layer computes only the rows that return logits (CausalLM.run_layers); False: every row (the plain
# forward the tests compare it with)
PRUNE_LAST_LAYER = True


class Backbone(nn.Module):
    """What every family's base model holds, in this order: `embed_tokens`, the one `rotary` table its attention
    layers share (rotary_dim 0: NoPE, none), `layers` (layer(cfg, i, ops, rotary) for each index), and the final
    norm under the checkpoint's name (`norm`, `final_layernorm`, `embedding_norm`, `final_norm`; ScaledRMSNorm unless `norm`
    makes another). The order is the parameters' order, in which dummy weights are drawn."""

    def __init__(self, cfg: ModelConfig, ops, layer: Callable, rotary_dim: int = 0, rope: tuple = (),
                 norm_name: str = "norm", norm: Callable | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg, rotary_dim, dict(rope)) if rotary_dim else None
        self.layers = nn.ModuleList(layer(cfg, i, ops, self.rotary) for i in range(cfg.num_layers))
        self.norm_name = norm_name
        self.add_module(norm_name, norm() if norm is not None else ScaledRMSNorm(cfg.hidden_size, cfg.rms_norm_eps))

    def norm_out(self, h: torch.Tensor) -> torch.Tensor:
        """The final norm, whatever its name."""
        return getattr(self, self.norm_name)(h)


class CausalLM(nn.Module):
    """forward(batch) -> fp32 logits [M, vocab] for the rows batch.logits_index names.

    Subclasses pass their backbone (a `Backbone`): `embed_tokens`, `layers` (each with a `state_mixer` property: its
    LinearMixer / AttentionMixer, None for a block without state; or `state_mixers`) and the final norm. The LM head
    (tied to the embeddings when the config says so) is built here."""

    # parameters kept in fp32 whatever the engine's dtype (name suffixes): the DeepSeek-style routers, as transformers
    # keeps them (`_keep_in_fp32_modules_strict`) and Ring-linear's config asks (router_dtype fp32): expert choices
    # from bf16-rounded router weights would differ from the checkpoint's
    fp32_params: tuple[str, ...] = ()

    def __init__(self, cfg: ModelConfig, backbone: nn.Module):
        super().__init__()
        self.config = cfg
        self.model = backbone
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def mixers(self) -> dict[int, nn.Module]:
        """mixer id -> stateful mixer (a LinearMixer or an AttentionMixer). The id is the mixer's `layer_idx`: the
        layer's index, except in a layer with several stateful mixers side by side (`state_mixers`, Falcon-H1),
        whose mixers carry ids of their own; every state, entry and buffer is keyed by this id. Made once per
        list of layers (a walk through nn.Module's attribute lookup: ~0.1 ms, asked for several times per request
        before its first kernel), read only."""
        layers = tuple(self.model.layers)
        hit = self.__dict__.get("_mixers")
        if hit is not None and hit[0] == layers:
            return hit[1]
        out = MappingProxyType(self._find_mixers(layers))
        self.__dict__["_mixers"] = (layers, out)
        return out

    @staticmethod
    def _find_mixers(layers) -> dict[int, nn.Module]:
        out = {}
        for i, layer in enumerate(layers):
            group = getattr(layer, "state_mixers", None)
            if group is None:
                group = () if layer.state_mixer is None else (layer.state_mixer,)
            for m in group:
                if m.layer_idx in out:
                    raise ValueError(f"two stateful mixers share the id {m.layer_idx} (layer {i})")
                out[m.layer_idx] = m
        return out

    def embed(self, batch: ForwardBatch) -> torch.Tensor:
        return self.model.embed_tokens(batch.input_ids)

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch) -> torch.Tensor:
        return self.logits(batch)

    def logits(self, batch: ForwardBatch) -> torch.Tensor:
        """The forward without inference mode: differentiable where the ops are (training with PIC in the
        loop, quality/pic_train.py); the engine calls `forward`."""
        h = self.run_layers(self.embed(batch), batch, 0, len(self.model.layers))
        return self.head(h, batch)

    def run_layers(self, h: torch.Tensor, batch: ForwardBatch, lo: int, hi: int) -> torch.Tensor:
        """Layers lo .. hi-1 (a captured graph runs the stack in pieces). Before the last layer, where fewer rows
        return logits than the batch holds (a prefill's last token, a warm request's query end), `batch.keep` names
        them: that layer's attention attends from those rows only and its MLP runs on them alone (their values
        are the same; no later layer reads the others). A layer takes part where it says so (`cuts_rows`: its
        stateful mixers read nothing an attention of the same layer computed, and it cuts the rows with
        `batch.kept` once they have run). PRUNE_LAST_LAYER False: every row to the end."""
        layers = self.model.layers
        for i in range(lo, hi):
            cut = (i == len(layers) - 1 and PRUNE_LAST_LAYER and getattr(layers[i], "cuts_rows", False)
                   and 0 < batch.logits_index.shape[0] < batch.num_tokens)
            batch.keep = batch.logits_index if cut else None
            try:
                h = layers[i](h, batch)
            finally:
                batch.keep = None
        return h

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final norm and the LM head on the rows that return logits (h holds only those where the last layer
        cut the others)."""
        h = self.model.norm_out(h if h.shape[0] != batch.num_tokens else h[batch.logits_index])
        return self.lm_head(h).float()

    def dummy_init(self, name: str, p: torch.Tensor, generator: torch.Generator) -> bool:
        """Architecture-specific init of one parameter (decays, gates, norms); False: the default."""
        return False

    def init_dummy(self, generator: torch.Generator) -> None:
        """Random weights at the real size (benchmarks): normal(0, initializer_range) for matrices,
        the architecture's own init (dummy_init) for gates, decays and norms."""
        std = self.config.initializer_range
        with torch.no_grad():
            for name, p in self.named_parameters():
                if self.dummy_init(name, p, generator):
                    continue
                if name.endswith(("conv1d.weight", "conv.conv.weight")):
                    bound = 1.0 / p.shape[-1] ** 0.5
                    p.copy_(torch.empty(p.shape, device=p.device).uniform_(-bound, bound, generator=generator))
                elif name.endswith(("conv1d.bias", "conv.conv.bias")):
                    p.zero_()
                elif p.dim() == 1 and "norm" in name:
                    p.fill_(1.0)
                elif p.dim() == 1 and name.endswith("bias"):
                    p.zero_()
                else:
                    p.copy_(torch.empty(p.shape, device=p.device).normal_(0.0, std, generator=generator))


def uniform(p, lo, hi, generator):
    return torch.empty(p.shape, device=p.device).uniform_(lo, hi, generator=generator)
