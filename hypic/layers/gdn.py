"""Gated DeltaNet mixer (Qwen3.5 / Qwen3-Next linear attention): dense transitions.

Parameter names follow the Qwen3.5 checkpoints (Qwen3-Next's fused in_proj_qkvz / in_proj_ba are
split into these at load time). Per value head the state is [K, V] and
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
so T is a dense K x K matrix per value head, computed with the appended-identity trick.
"""

from __future__ import annotations

import torch
from torch import nn

from ..compose.transition import Form, Transition
from ..config import ModelConfig
from ..ops.reference.gated_delta import CHUNK_MAX
from .joined import JoinedWeights
from .linear import LinearMixer, dense_summary_kernel
from .norm import RMSNormGated

SHORT_RUN = 64


class GatedDeltaNet(LinearMixer):
    form = Form.DENSE
    readout = True
    graph_compose = True
    isolated = True

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops):
        super().__init__(layer_idx, ops)
        p = cfg.params
        self.h, self.hv = p.linear_num_key_heads, p.linear_num_value_heads
        self.dk, self.dv = p.linear_key_head_dim, p.linear_value_head_dim
        self.key_dim, self.value_dim = self.h * self.dk, self.hv * self.dv
        self.conv_width = p.linear_conv_kernel_dim
        self.projections(cfg, ops)

    def recurrence_params(self) -> None:
        """The short conv, dt_bias and A_log (the same in every GDN family)."""
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.conv_width, groups=self.conv_dim, bias=False,
                                padding=self.conv_width - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))

    def projections(self, cfg: ModelConfig, ops) -> None:
        """Every parameter, under the checkpoint's names (Qwen3.5's here; features and output use them), with
        recurrence_params in between. The order is the parameters' order: dummy weights are drawn in it, so it
        stays what it was (a preset's random weights, and the disk entries made from them, do not change)."""
        hs = cfg.hidden_size
        self.in_proj_qkv = nn.Linear(hs, self.conv_dim, bias=False)
        self.in_proj_z = nn.Linear(hs, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(hs, self.hv, bias=False)
        self.in_proj_a = nn.Linear(hs, self.hv, bias=False)
        self._ab = JoinedWeights()
        self._in = JoinedWeights()             # all four, where packed (layers/joined.py)
        self.recurrence_params()
        self.norm = RMSNormGated(self.dv, cfg.rms_norm_eps, ops, getattr(cfg.params, "linear_output_gate", "silu"))
        self.out_proj = nn.Linear(self.value_dim, hs, bias=False)

    def capturable(self, device) -> bool:
        """The compose pass's kernel can be captured in a CUDA graph: fla's fused recurrent kernel reads
        cu_seqlens on the device; the reference (fla missing, or the reference backend) reads it on the host."""
        from ..ops.fast import fla_available

        return self.ops.name == "fast" and fla_available()

    def query_tail(self, max_len: int) -> bool:
        """Any backend gives a run's factors and values (the reference's solve; the chunked kernel's one chunk, for
        runs of up to CHUNK_MAX tokens)."""
        return max_len <= CHUNK_MAX

    def factored_runs(self, max_len: int) -> bool:
        """The backend's chunked summary kernel gives the runs' transitions in factored form."""
        from ..ops.fast import triton_kernel

        if self.ops.name != "fast" or triton_kernel("chunk_summary") is None:
            return False
        return max_len <= CHUNK_MAX

    @property
    def state_shape(self):
        return self.hv, self.dk, self.dv

    @property
    def conv_dim(self) -> int:
        return 2 * self.key_dim + self.value_dim

    def _input_weights(self) -> list:
        return [self.in_proj_qkv.weight, self.in_proj_z.weight, self.in_proj_b.weight, self.in_proj_a.weight]

    def joined_parts(self) -> list:
        """The four input projections, packed into one matrix at load time (layers/joined.py pack_model)."""
        return [(self._in, self._input_weights())]

    def features(self, x, batch):
        if self._in.packed(*self._input_weights()) is not None:      # every input projection by one GEMM
            raw, z, b, a = self._in.linear(x, *self._input_weights())
        else:
            # the decay and write-strength inputs, [HV] each, by one GEMM (a copy of two small matrices)
            b, a = self._ab.linear(x, self.in_proj_b.weight, self.in_proj_a.weight)
            raw, z = self.in_proj_qkv(x), self.in_proj_z(x)
        g, beta = self.ops.gdn_gate_beta(a, b, self.A_log, self.dt_bias)   # [N, HV]: fp32, b's dtype
        return {"raw": raw, "z": z, "g": g, "beta": beta}

    def kernel(self, f, conv_out, idx, init, cu, summarize, readout=False, short=None, init_augmented=False,
               max_len=None, factors=False, values=False):
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(-1, self.h, self.dk), k.reshape(-1, self.h, self.dk), v.reshape(-1, self.hv, self.dv)
        if init_augmented:             # every run from [0 | I] (the compose pass's short runs): one op, no init read
            return self.ops.recurrent_gated_delta_summary(q[None], k[None], v[None], f["g"][None, idx],
                                                          f["beta"][None, idx], cu_seqlens=cu,
                                                          use_qk_l2norm_in_kernel=True, max_len=max_len,
                                                          factors=factors, values=values)
        # short runs only (decode tokens, seam windows, a short query): the fused recurrent kernel is one
        # launch of exact fp32 steps; the chunked one costs several launches and pads every run to 64
        # (short given: the caller knows, and cu may be on the device: reading it would sync)
        if short is None:
            short = int((cu[1:] - cu[:-1]).max()) <= SHORT_RUN
        if summarize and not readout and not short:
            # a long run summarized for the cache (an isolated prefill's segment): the transition through the
            # state passing only (ops chunk_gated_delta_transition)
            o, final, t = self.ops.chunk_gated_delta_transition(
                q[None], k[None], v[None], f["g"][None, idx], f["beta"][None, idx], initial_state=init,
                cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
            own = t.shape[0] > 1                  # entries are cached one by one: no view pinning the batch
            return o[0], final, [Transition(Form.DENSE, t[i].clone() if own else t[i]) for i in range(t.shape[0])]
        fn = self.ops.recurrent_gated_delta_rule if short else self.ops.chunk_gated_delta_rule
        return dense_summary_kernel(fn, q, k, v, init, cu, summarize, readout, g=f["g"][None, idx],
                                    beta=f["beta"][None, idx], use_qk_l2norm_in_kernel=True)

    def kernel_isolated(self, f, conv_out, cu, seams):
        """An isolated prefill's sequences (cu over the whole flat axis) from zero, with each rest's (T, S)
        (ops chunk_gated_delta_isolated)."""
        q, k, v = torch.split(conv_out, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q, k, v = q.reshape(-1, self.h, self.dk), k.reshape(-1, self.h, self.dk), v.reshape(-1, self.hv, self.dv)
        o, final, t, s = self.ops.chunk_gated_delta_isolated(q[None], k[None], v[None], f["g"][None], f["beta"][None],
                                                             cu_seqlens=cu, seams=seams, use_qk_l2norm_in_kernel=True)
        return o[0], final, t, s

    def output(self, x, o, f):
        # [N, HV, dv]: z may be columns of the input projections' joined GEMM, read in place by the fused norm
        z = f["z"].unflatten(-1, (self.hv, self.dv))
        return self.out_proj(self.norm(o.reshape(-1, self.hv, self.dv), z).reshape(x.shape[0], self.value_dim))
