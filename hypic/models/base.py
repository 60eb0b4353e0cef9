"""What every hypic model shares: embed -> decoder layers over a ForwardBatch -> norm -> lm_head,
and the map from layer index to its stateful mixer (linear or attention), which the engine uses
to restore per-layer states without knowing the family."""

from __future__ import annotations

import torch
from torch import nn

from ..config import ModelConfig
from ..runtime.batch import ForwardBatch


class CausalLM(nn.Module):
    """forward(batch) -> fp32 logits [M, vocab] for the rows batch.logits_index names.

    Subclasses pass their backbone: a module with `embed_tokens`, `layers` (each with a
    `state_mixer` property: its LinearMixer / AttentionMixer, None for a block without state) and
    `norm`. The LM head (tied to the embeddings when the config says so) is built here."""

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
        whose mixers carry ids of their own; every state, entry and buffer is keyed by this id."""
        out = {}
        for i, layer in enumerate(self.model.layers):
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
        h = self.embed(batch)
        for layer in self.model.layers:
            h = layer(h, batch)
        return self.head(h, batch)

    def head(self, h: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        """The final norm and the LM head on the rows that return logits."""
        h = self.model.norm(h[batch.logits_index])
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
