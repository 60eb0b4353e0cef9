"""An independent reference forward of Ring-linear / Ling-linear 2.0 (`bailing_moe_linear`), the
oracle of invariant 7 for the one architecture transformers does not ship.

Written from the public ports' layout (docs/algorithm.md section 11), deliberately simple and
sharing no code with hypic: float64, weights in a dict under the checkpoint's own names, the
lightning layers as a token-by-token recurrence at true positions, softmax attention as one
causal matrix, the MoE as every expert on every token weighted by the routing. It mimics the
small part of a transformers model the tests use: `model(ids [1, T]).logits`,
`save_pretrained(dir)`, `named_parameters()`, `eval()`.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from types import SimpleNamespace

import torch


def _slopes(n: int) -> list[float]:
    if math.log2(n).is_integer():
        return [2.0 ** (-8.0 / n * (i + 1)) for i in range(n)]
    p = 2 ** int(math.floor(math.log2(n)))
    return _slopes(p) + _slopes(2 * p)[0::2][: n - p]


class RingLinearReference:
    def __init__(self, config: dict, seed: int = 0):
        self.config = dict(config)
        c = self.config
        self.L, self.hd, self.H = c["num_hidden_layers"], c["head_dim"], c["num_attention_heads"]
        self.Hkv, self.E = c["num_key_value_heads"], c["num_experts"]
        g = c["layer_group_size"]
        self.full = [(i + 1) % g == 0 or i >= self.L // g * g for i in range(self.L)]
        self.w = self._init(seed)

    # -- weights under checkpoint names ----------------------------------------------------------
    def _init(self, seed):
        c, gen = self.config, torch.Generator().manual_seed(seed)
        hs, D, H, Hkv = c["hidden_size"], self.hd, self.H, self.Hkv
        w = {}

        def mat(name, *shape, std=0.1):
            w[name] = torch.randn(*shape, generator=gen, dtype=torch.float64) * std

        def norm(name, n):
            w[name] = 1 + 0.1 * torch.randn(n, generator=gen, dtype=torch.float64)

        def mlp(prefix, inter):
            mat(f"{prefix}.gate_proj.weight", inter, hs)
            mat(f"{prefix}.up_proj.weight", inter, hs)
            mat(f"{prefix}.down_proj.weight", hs, inter)

        mat("model.word_embeddings.weight", c["vocab_size"], hs, std=1.0)
        for i in range(self.L):
            p = f"model.layers.{i}"
            norm(f"{p}.input_layernorm.weight", hs)
            norm(f"{p}.post_attention_layernorm.weight", hs)
            a = f"{p}.attention"
            if self.full[i]:
                mat(f"{a}.query_key_value.weight", (H + 2 * Hkv) * D, hs)
            else:
                mat(f"{a}.query_key_value.weight", 3 * H * D, hs)
                mat(f"{a}.g_proj.weight", H * D, hs)
                norm(f"{a}.g_norm.weight", H * D)
            norm(f"{a}.query_layernorm.weight", D)
            norm(f"{a}.key_layernorm.weight", D)
            mat(f"{a}.dense.weight", hs, H * D)
            if i < c["first_k_dense_replace"]:
                mlp(f"{p}.mlp", c["intermediate_size"])
            else:
                mat(f"{p}.mlp.gate.weight", self.E, hs, std=0.3)
                mat(f"{p}.mlp.gate.expert_bias", self.E, std=0.1)
                for e in range(self.E):
                    mlp(f"{p}.mlp.experts.{e}", c["moe_intermediate_size"])
                mlp(f"{p}.mlp.shared_experts", c["moe_shared_expert_intermediate_size"] * c["num_shared_experts"])
        norm("model.norm.weight", hs)
        mat("lm_head.weight", c["vocab_size"], hs)
        return w

    def named_parameters(self):
        return iter(self.w.items())

    def eval(self):
        return self

    def save_pretrained(self, path):
        from safetensors.torch import save_file

        path = Path(path)
        cfg = dict(self.config, architectures=["BailingMoeLinearV2ForCausalLM"])
        (path / "config.json").write_text(json.dumps(cfg, indent=2))
        save_file({k: v.float().contiguous() for k, v in self.w.items()}, str(path / "model.safetensors"))

    # -- forward -----------------------------------------------------------------------------------
    def _rms(self, x, weight):
        return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + self.config["rms_norm_eps"]) * weight

    def _rope(self, x, pos):
        """x [..., heads, D] at positions pos [...]: rotate-half RoPE on the first rotary_dim dims."""
        r = int(self.hd * self.config["partial_rotary_factor"])
        inv = self.config["rope_theta"] ** (-torch.arange(0, r, 2, dtype=torch.float64) / r)
        ang = pos.double()[..., None] * inv                     # [..., r/2]
        cos, sin = ang.cos()[..., None, :], ang.sin()[..., None, :]
        x1, x2, rest = x[..., : r // 2], x[..., r // 2 : r], x[..., r:]
        return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin, rest], dim=-1)

    def _lightning(self, i, x):
        """Token by token: S_t = exp(-slope) S_{t-1} + k_t v_t^T, o_t = S_t^T (q_t / sqrt(D))."""
        c, a, H, D = self.config, f"model.layers.{i}.attention", self.H, self.hd
        scale = 1 - i / (self.L - 1) + 1e-5 if self.L > 1 else 1 + 1e-5
        decay = torch.exp(-torch.tensor(_slopes(H), dtype=torch.float64) * scale)
        S = torch.zeros(H, D, D, dtype=torch.float64)
        outs = []
        for t in range(x.shape[0]):
            qkv = self.w[f"{a}.query_key_value.weight"] @ x[t]
            if c.get("linear_silu"):
                qkv = torch.nn.functional.silu(qkv)
            q, k, v = qkv.view(3, H, D)
            q = self._rms(q, self.w[f"{a}.query_layernorm.weight"])
            k = self._rms(k, self.w[f"{a}.key_layernorm.weight"])
            q, k = self._rope(q, torch.tensor(t)), self._rope(k, torch.tensor(t))
            S = decay[:, None, None] * S + k[:, :, None] * v[:, None, :]
            o = torch.einsum("hk,hkv->hv", q * D ** -0.5, S).reshape(-1)
            groups = c["group_norm_size"]
            o = self._rms(o.view(groups, -1), 1.0).reshape(-1) * self.w[f"{a}.g_norm.weight"]
            o = o * torch.sigmoid(self.w[f"{a}.g_proj.weight"] @ x[t])
            outs.append(self.w[f"{a}.dense.weight"] @ o)
        return torch.stack(outs)

    def _attention(self, i, x):
        a, H, Hkv, D, T = f"model.layers.{i}.attention", self.H, self.Hkv, self.hd, x.shape[0]
        qkv = (x @ self.w[f"{a}.query_key_value.weight"].T).view(T, H + 2 * Hkv, D)
        q, k, v = qkv[:, :H], qkv[:, H : H + Hkv], qkv[:, H + Hkv :]
        q, k = self._rms(q, self.w[f"{a}.query_layernorm.weight"]), self._rms(k, self.w[f"{a}.key_layernorm.weight"])
        pos = torch.arange(T)
        q, k = self._rope(q, pos), self._rope(k, pos)
        k, v = k.repeat_interleave(H // Hkv, dim=1), v.repeat_interleave(H // Hkv, dim=1)
        s = torch.einsum("thd,uhd->htu", q, k) * D ** -0.5
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        o = torch.einsum("htu,uhd->thd", s.softmax(-1), v).reshape(T, -1)
        return o @ self.w[f"{a}.dense.weight"].T

    def _mlp(self, prefix, x):
        w = self.w
        return (torch.nn.functional.silu(x @ w[f"{prefix}.gate_proj.weight"].T) * (x @ w[f"{prefix}.up_proj.weight"].T)
                ) @ w[f"{prefix}.down_proj.weight"].T

    def _moe(self, i, x):
        """Sigmoid scores; experts chosen by score + bias inside the best topk_group of n_group
        groups (group score: sum of its top two); weights = unbiased scores, renormalised, * scaling.
        Every expert is run on every token (dense), then weighted by the routing (zero if unchosen)."""
        c, p, T = self.config, f"model.layers.{i}.mlp", x.shape[0]
        G, per = c["n_group"], self.E // c["n_group"]
        scores = torch.sigmoid(x @ self.w[f"{p}.gate.weight"].T)                   # [T, E]
        choice = scores + self.w[f"{p}.gate.expert_bias"]
        gscore = choice.view(T, G, per).topk(2, dim=-1).values.sum(-1)            # [T, G]
        keep = torch.zeros(T, G, dtype=torch.bool).scatter_(1, gscore.topk(c["topk_group"], dim=-1).indices, True)
        choice = choice.masked_fill(~keep.repeat_interleave(per, dim=1), float("-inf"))
        experts = choice.topk(c["num_experts_per_tok"], dim=-1).indices            # [T, k]
        weights = scores.gather(1, experts)
        weights = weights / weights.sum(-1, keepdim=True) * c["routed_scaling_factor"]
        route = torch.zeros(T, self.E, dtype=x.dtype).scatter_(1, experts, weights)
        every = torch.stack([self._mlp(f"{p}.experts.{e}", x) for e in range(self.E)], dim=1)   # [T, E, hidden]
        return (route[..., None] * every).sum(1) + self._mlp(f"{p}.shared_experts", x)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor):
        x = self.w["model.word_embeddings.weight"][input_ids[0]]
        for i in range(self.L):
            h = self._rms(x, self.w[f"model.layers.{i}.input_layernorm.weight"])
            x = x + (self._attention(i, h) if self.full[i] else self._lightning(i, h))
            h = self._rms(x, self.w[f"model.layers.{i}.post_attention_layernorm.weight"])
            x = x + (self._mlp(f"model.layers.{i}.mlp", h) if i < self.config["first_k_dense_replace"]
                     else self._moe(i, h))
        logits = self._rms(x, self.w["model.norm.weight"]) @ self.w["lm_head.weight"].T
        return SimpleNamespace(logits=logits.float()[None])
