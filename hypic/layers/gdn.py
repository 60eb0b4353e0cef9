"""Gated DeltaNet mixer (Qwen3.5 / Qwen3-Next linear attention) over a planned batch.

Parameter names follow the Qwen3.5 checkpoints (Qwen3-Next's fused in_proj_qkvz / in_proj_ba are
split into these at load time). Per layer, the batch's pieces are walked in rounds: round r takes
the r-th piece of every sequence, so the runs of a round (cold segments of a request, seams of
many requests, decode tokens) go to the kernel together as one varlen call, while each
sequence's running (state, conv window) is threaded through its pieces in order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ..compose.linear import augment, compose, split_summary
from ..config import ModelConfig
from ..runtime.batch import Apply, ForwardBatch, Run
from .norm import RMSNormGated


class GatedDeltaNet(nn.Module):
    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops
        self.h, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.key_dim, self.value_dim = self.h * self.dk, self.hv * self.dv
        self.conv_dim = cfg.conv_dim
        self.width = cfg.linear_conv_kernel_dim
        hs = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hs, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hs, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hs, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hs, self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.width, groups=self.conv_dim, bias=False,
                                padding=self.width - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps)
        self.out_proj = nn.Linear(self.value_dim, hs, bias=False)

    # -- per-token inputs -------------------------------------------------------------------
    def _gates(self, x):
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        return g, beta

    def _split(self, mixed):
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        return (q.reshape(-1, self.h, self.dk), k.reshape(-1, self.h, self.dk), v.reshape(-1, self.hv, self.dv))

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        L = self.layer_idx
        raw = self.in_proj_qkv(x)                                  # [N, C] raw conv inputs
        z = self.in_proj_z(x).reshape(-1, self.hv, self.dv)
        g, beta = self._gates(x)                                   # [N, HV] fp32, [N, HV]
        weight = self.conv1d.weight.squeeze(1)                     # [C, W]
        out = x.new_empty(x.shape[0], self.hv, self.dv)

        for seq in batch.seqs:                                     # zero state for fresh sequences
            st = seq.state
            if L not in st.rec:
                st.rec[L] = torch.zeros(self.hv, self.dk, self.dv, dtype=torch.float32, device=x.device)
                st.conv[L] = x.new_zeros(self.width - 1, self.conv_dim)

        rounds = max((len(s.pieces) for s in batch.seqs), default=0)
        for r in range(rounds):
            groups: dict[bool, list] = {False: [], True: []}
            for seq in batch.seqs:
                if r >= len(seq.pieces):
                    continue
                piece = seq.pieces[r]
                if isinstance(piece, Apply):
                    self._compose_entry(seq.state, piece.entry, batch.exact_transition)
                else:
                    groups[piece.summarize].append((seq, piece))
            for summarize, items in groups.items():
                if items:
                    self._runs(items, raw, g, beta, weight, out, summarize)

        o = self.norm(out.reshape(-1, self.dv), z.reshape(-1, self.dv)).reshape(x.shape[0], self.value_dim)
        return self.out_proj(o)

    def _compose_entry(self, st, entry, exact: bool):
        L = self.layer_idx
        summ = entry.linear[L]
        st.rec[L] = compose(st.rec[L], summ.T, summ.S, exact=exact)
        st.conv[L] = torch.cat([st.conv[L], summ.tail.to(st.conv[L].dtype)], dim=0)[-(self.width - 1):]

    def _runs(self, items, raw, g, beta, weight, out, summarize: bool):
        """One varlen kernel call for runs that start from known states."""
        L = self.layer_idx
        conv_out, lens = [], []
        for seq, run in items:
            y, window = self.ops.causal_conv1d(raw[None, run.start : run.end], weight, window=seq.state.conv[L][None])
            conv_out.append(y[0])
            lens.append(run.n)
            if summarize:   # the last W-1 raw inputs of the cached part: the next segment's conv warm-up
                tail_n = min(self.width - 1, run.n)
                run.captures.setdefault(L, {})["tail"] = raw[run.end - tail_n : run.end].clone()
            seq.state.conv[L] = window[0]
        idx = torch.cat([torch.arange(run.start, run.end, device=raw.device) for _, run in items])
        q, k, v = self._split(torch.cat(conv_out, dim=0))
        init = torch.stack([seq.state.rec[L] for seq, _ in items])        # [R, HV, K, V]
        if summarize:
            v, init_aug = augment(v, init, self.dk)
        else:
            init_aug = init
        cu = torch.tensor([0] + lens, device=raw.device).cumsum(0)
        fn = self.ops.recurrent_gated_delta_rule if max(lens) == 1 else self.ops.chunk_gated_delta_rule
        o, final = fn(q[None], k[None], v[None], g[None, idx], beta[None, idx], initial_state=init_aug,
                      output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
        o = o[0, :, :, : self.dv]
        if summarize:
            final, t_op, s_zero = split_summary(final, init, self.dv)
        for i, (seq, run) in enumerate(items):
            out[run.start : run.end] = o[cu[i] : cu[i + 1]].to(out.dtype)
            seq.state.rec[L] = final[i]
            if summarize:
                run.captures[L].update(T=t_op[i], S=s_zero[i])
            if run.mark:
                run.captures[L] = {"rec": final[i], "conv": seq.state.conv[L]}
