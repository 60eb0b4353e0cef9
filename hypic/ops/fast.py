"""The fast op backend: the reference signatures (ops/reference) on batched kernels.

    gated delta rule   fla-core's Triton kernels (chunk for prefill, fused recurrent for decode)
                       when the tensors are on CUDA and fla imports; the reference otherwise
    short conv         fla-core's Triton varlen conv on CUDA; elsewhere one depthwise conv over all
                       runs of a varlen batch
    attention          PyTorch SDPA: flash (causal) when the keys are exactly the queries' tokens or
                       end with them (bottom-right); few queries at scattered positions over many keys
                       (the compose pass) in a split-K Triton kernel with a position mask
                       (ops/triton_attention.py; explicit scores where triton is missing); else SDPA
                       with a position mask; decode over fixed-size per-sequence slots without a host sync
    MoE experts        tokens sorted by expert; few rows per expert (a warm pic request, decode): the
                       weights streamed by a Triton kernel (ops/triton_moe.py), else two grouped GEMMs
                       (torch._grouped_mm); the routing (softmax, top k, renormalisation) and, for few
                       rows, the sort by expert in one Triton kernel each (ops/triton_route.py)
    norms, GDN gate    fla-core's fused kernels (one launch each, fp32 inside, one rounding); per-head norms
                       (ops/triton_norm.py, with RoPE), the GDN gate with sigmoid(b) and act(gate) * up
                       (ops/triton_gates.py) by own kernels reading the joined GEMM's columns in place
    diagonal scan      (RG-LRU) fla-core's fused recurrent HGRN kernel on CUDA
    KDA                fla-core's chunk and fused recurrent KDA kernels on CUDA (the gates computed here, as
                       in the reference: fla's in-kernel gate is not used); the reference elsewhere
GLA and simple GLA stay on the reference ops here (their fla kernels are not wired yet).

Every function here has a test against its reference twin (tests/test_fast_ops.py on CPU,
scripts/gpu_check.py on the GPU).
"""

from __future__ import annotations

import functools
import importlib
import logging

import torch
import torch.nn.functional as F

from . import reference as ref
from .reference import (  # noqa: F401  (re-exported: same names as the reference backend)
    causal_conv1d, chunk_gla, chunk_simple_gla, recurrent_gla, recurrent_simple_gla, route_grouped_sigmoid,
)
from .tuning import is_device_fault


@functools.lru_cache(maxsize=None)
def _fla():
    """fla-core's gated delta rule kernels, or None where fla is missing (CPU machines)."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule, fused_recurrent_gated_delta_rule
    except Exception:  # ImportError, or triton missing / broken on this machine
        return None
    return chunk_gated_delta_rule, fused_recurrent_gated_delta_rule


@functools.lru_cache(maxsize=None)
def _fla_conv():
    """fla-core's Triton short conv (channels last, varlen, initial and final states), or None."""
    try:
        from fla.modules.causal_conv1d import causal_conv1d
    except Exception:
        return None
    return causal_conv1d


@functools.lru_cache(maxsize=None)
def _fla_norms():
    """fla-core's fused norm and gate kernels, or None: the forward functions behind its autograd wrappers
    (layer_norm_fwd, layer_norm_gated_fwd, gdn_gate_fwd; rms_norm, rms_norm_gated and fused_gdn_gate call these
    after an autograd Function and a decorator that makes every argument contiguous: H200 run 40's profile of an
    eager prefill had ~0.2 ms of CPU per call in those wrappers, with the profiler's own cost)."""
    try:
        from fla.modules.norm.fused_norm_gate import layer_norm_gated_fwd
        from fla.modules.norm.layernorm import layer_norm_fwd
        from fla.ops.gated_delta_rule.gate import gdn_gate_fwd
    except Exception:
        return None
    return layer_norm_fwd, layer_norm_gated_fwd, gdn_gate_fwd


FUSED_NORMS = True       # False: the norms and the gate in their reference form (gpu_bench's side-by-side variant)


def _norm_kernels(*ts):
    """fla's norm kernels where they may run on these tensors (CUDA, fla present, no autograd), else None."""
    return _fla_norms() if FUSED_NORMS and ts[0].is_cuda and not needs_grad(*ts) else None


def _rows(x):
    """x as contiguous rows [N, D] (fla's forward functions index by row)."""
    return x.reshape(-1, x.shape[-1]).contiguous()


NORM_ROWS = True         # False: the per-head norms by fla's kernels too (gpu_bench's side-by-side variant)
_NORM_MAX_WIDTH = 512     # ops/triton_norm.py's MAX_WIDTH (that module needs triton to import)


def _own_norm(x, weight, eps, *ts, **kw):
    """ops/triton_norm.py's norm_rows(x, weight, eps, **kw) for rows of at most 512 columns (the per-head norms)
    where a Triton kernel may run (autograd through x, weight and ts: not); None elsewhere, or where it failed to
    build (fla's kernels for these widths compile and tune again for every bucket of the row count: the module's
    docstring)."""
    if not (NORM_ROWS and FUSED_NORMS and x.shape[-1] <= _NORM_MAX_WIDTH and triton_here(x)):
        return None
    kern = triton_kernel("norm", x, weight, *ts)
    if kern is None:
        return None
    try:
        return kern(x, weight, eps, **kw)
    except Exception as err:
        kernel_failed("norm", err)
        return None


def rms_norm(x, weight, eps):
    """The reference signature (ops/reference/norm.py) in one kernel: fp32 inside, one rounding. Per-head widths
    (<= 512) by ops/triton_norm.py, wider rows by fla's."""
    y = _own_norm(x, weight, eps)
    if y is not None:
        return y
    k = _norm_kernels(x, weight)
    if k is None:
        return ref.rms_norm(x, weight, eps)
    return k[0](_rows(x), weight.contiguous(), None, eps, is_rms_norm=True)[0].view(x.shape)


def rms_norm_gated(x, gate, weight, eps, activation):
    """The reference signature in one kernel (norm, weight, gate's activation, product, rounding)."""
    y = _own_norm(x, weight, eps, gate, gate=gate, activation=activation)
    if y is not None:
        return y
    k = _norm_kernels(x, gate, weight)
    if k is None:
        return ref.rms_norm_gated(x, gate, weight, eps, activation)
    y = k[1](x=_rows(x), g=_rows(gate), weight=weight.contiguous(), bias=None,
             activation="swish" if activation == "silu" else activation, eps=eps, is_rms_norm=True)[0]
    return y.view(x.shape)


def rms_norm_rope(x, weight, eps, cos, sin, rotary_dim, out=None):
    """The reference signature in one kernel (ops/triton_norm.py with its RoPE epilogue) that reads x's strided heads in
    place and writes out; else the norm, then the reference rotation."""
    if FUSED_GATES and x.dim() == 3:
        y = _own_norm(x, weight, eps, cos, sin, rope=(cos, sin, rotary_dim), out=out)
        if y is not None:
            return y
    from .reference.norm import rotated

    return rotated(rms_norm(x, weight, eps), cos, sin, rotary_dim, out)


def add_rms_norm(x, r, weight, eps):
    """The reference signature (a residual sum and its norm) in one kernel (ops/triton_norm.py add_norm_rows) where
    FUSED_ADD_NORM; else the add, then rms_norm."""
    if (FUSED_ADD_NORM and FUSED_NORMS and x.shape == r.shape and x.dtype == r.dtype and x.shape[-1] <= _ADD_MAX_WIDTH
            and triton_here(x)):
        kern = triton_kernel("add_norm", x, r, weight)
        if kern is not None:
            try:
                return kern(x, r, weight, eps)
            except Exception as err:
                kernel_failed("add_norm", err)
    s = x + r
    return s, rms_norm(s, weight, eps)


FUSED_ADD_NORM = True    # False: a layer's residual add, then its norm, as two launches (before the 39th session)
_ADD_MAX_WIDTH = 8192    # (triton_norm.ADD_MAX_WIDTH, without importing triton here)


def gdn_gate(a, a_log, dt_bias):
    """The reference signature in one fla kernel (fp32 out)."""
    k = _norm_kernels(a, a_log, dt_bias)
    if k is None:
        return ref.gdn_gate(a, a_log, dt_bias)
    return k[2](g=a.contiguous(), A_log=a_log.contiguous(), dt_bias=None if dt_bias is None else dt_bias.contiguous(),
                output_dtype=torch.float32)


FUSED_GATES = True       # False: the GDN gate with sigmoid(b), act(gate) * up, the head norms with RoPE as separate ops


def gdn_gate_beta(a, b, a_log, dt_bias):
    """The reference signature in one kernel (ops/triton_gates.py) that reads a and b in place (columns of the
    joined input GEMM); else fla's gate kernel and a sigmoid."""
    if FUSED_GATES and a.dim() == 2 and dt_bias is not None and triton_here(a):
        kern = triton_kernel("gate_beta", a, b, a_log, dt_bias)
        if kern is not None:
            try:
                return kern(a, b, a_log, dt_bias)
            except Exception as e:
                kernel_failed("gate_beta", e)
    return gdn_gate(a, a_log, dt_bias), torch.sigmoid(b)


def act_mul(gate, up, activation="silu"):
    """The reference signature in one kernel (ops/triton_gates.py) that reads gate and up in place."""
    if FUSED_GATES and gate.dim() in (2, 3) and triton_here(gate):
        kern = triton_kernel("act_mul", gate, up)
        if kern is not None:
            try:
                return kern(gate, up, activation)
            except Exception as e:
                kernel_failed("act_mul", e)
    return ref.act_mul(gate, up, activation)


# this backend's own Triton kernels (module, function under hypic.ops), each with a PyTorch form beside it
_KERNELS = {"attention": ("triton_attention", "position_attention"), "summary": ("triton_summary", "summary"),
            "chunk_summary": ("triton_summary", "chunk_summary"),
            "conv": ("triton_conv", "gathered_conv"), "steps": ("triton_scan", "scan_steps"),
            "copy": ("triton_copy", "copy_blocks"), "moe": ("triton_moe", "experts_few_rows"),
            "route": ("triton_route", "route"), "sort": ("triton_route", "sort_by_expert"),
            "transitions": ("triton_transition", "transitions"), "decode": ("triton_decode", "decode_attention"),
            "norm": ("triton_norm", "norm_rows"), "add_norm": ("triton_norm", "add_norm_rows"),
            "order": ("triton_place", "order_keys"),
            "pairs": ("triton_scan", "pair_lowrank"), "scan_pairs": ("triton_scan", "scan_pairs"),
            "tail": ("triton_scan", "tail_epilogue"),
            "gate_beta": ("triton_gates", "gate_beta"), "act_mul": ("triton_gates", "act_mul")}
FAILED: set = set()       # kernels that could not be built here: their PyTorch forms run from then on


@functools.lru_cache(maxsize=None)
def _import_kernel(name: str):
    mod, fn = _KERNELS[name]
    try:
        return getattr(importlib.import_module(f"hypic.ops.{mod}"), fn)
    except Exception:  # no triton on this machine
        return None


def triton_kernel(name: str, *tensors):
    """One of this backend's Triton kernels (`_KERNELS`), or None where triton is missing, the kernel could
    not be built here before (`kernel_failed`), or autograd would differentiate through `tensors` (the
    kernels have no backward: their PyTorch forms run then)."""
    return None if name in FAILED or needs_grad(*tensors) else _import_kernel(name)


def kernel_failed(name: str, e: Exception) -> None:
    """A kernel that a GPU / Triton cannot build (resources, a compiler error): its PyTorch form runs from
    now on. Inside a CUDA graph capture the error propagates (the composer then runs its buffers eagerly). A
    fault of a kernel that ran (ops/tuning.is_device_fault) has lost the process's CUDA context, so no PyTorch
    form can run after it: it raises, naming the kernel."""
    if is_device_fault(e):
        raise RuntimeError(f"Triton kernel {name!r} faulted on the device; this process's CUDA context is lost "
                           f"({type(e).__name__}: {e})") from e
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise e
    logging.getLogger("hypic.ops").warning("Triton kernel %r unavailable (%s: %s); its PyTorch form instead", name,
                                           type(e).__name__, e)
    FAILED.add(name)


_IDENTITY: dict = {}


def recurrent_gated_delta_summary(q, k, v, g, beta, *, cu_seqlens, scale=None, use_qk_l2norm_in_kernel=False,
                                  max_len=None, factors=False, values=False):
    """The reference signature (ops/reference/gated_delta.py): every run from [0 | I] with [v | 0].
    Runs of at most max_len <= 64 tokens (the caller's bound: reading the lengths would sync): the chunked
    Triton kernel, one small-matmul chunk per run; else the token-by-token Triton kernel (the identity
    made in registers); else fla's fused recurrent kernel from a cached [0 | I] (device lengths: no host
    sync); else the reference. Under autograd the reference: the kernels have no backward.
    factors (T in factored form, reference `run_factors`; with values, U in S's place, `run_values`): the chunked
    kernel, else the reference."""
    kernels = not needs_grad(q, k, v, g, beta)
    if kernels and triton_here(q):
        tries = [] if factors else [("summary", {})]
        if max_len is not None and max_len <= ref.gated_delta.CHUNK_MAX:
            tries.insert(0, ("chunk_summary", {"max_len": max_len, "factors": factors, "values": values}))
        for name, kw in tries:
            kern = triton_kernel(name)                # (autograd ruled out above: `kernels`)
            if kern is None:
                continue
            try:
                return kern(q, k, v, g, beta, cu_seqlens, scale=scale, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                            **kw)
            except Exception as e:
                kernel_failed(name, e)
    if kernels and not factors and q.is_cuda and _fla() is not None:
        r = cu_seqlens.shape[0] - 1
        hv, dv, dk = v.shape[-2], v.shape[-1], k.shape[-1]
        key = (r, hv, dk, dv, str(q.device))
        init = _IDENTITY.get(key)
        if init is None:                          # read-only, shared by every layer and call of this shape
            if len(_IDENTITY) > 8:
                _IDENTITY.clear()
            init = _IDENTITY[key] = torch.cat([torch.zeros(r, hv, dk, dv, device=q.device),
                                               torch.eye(dk, device=q.device).expand(r, hv, dk, dk)], dim=-1)
        va = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], dim=-1)
        o, final = _gated_delta(1, q, k, va, g, beta, scale, init, True, cu_seqlens, use_qk_l2norm_in_kernel)
        return o[0, ..., :dv], o[0, ..., dv:], final
    return ref.recurrent_gated_delta_summary(q, k, v, g, beta, cu_seqlens=cu_seqlens, scale=scale,
                                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, max_len=max_len,
                                             factors=factors, values=values)


def gated_delta_tail(o, u, s0, U, fac, cu):
    """The reference signature (ops/reference/gated_delta.py): where Triton runs, one launch (ops/triton_scan.py
    `tail_epilogue`: the tail's runs walked from the chain's state, their outputs corrected, the pads' rows zeroed);
    else the reference's few batched products per run."""
    kern = triton_kernel("tail", s0, u, U, fac) if triton_here(s0) else None
    if kern is not None:
        try:
            return kern(o, u, s0.contiguous(), U.contiguous(), fac.contiguous(), cu)
        except Exception as e:
            kernel_failed("tail", e)
    return ref.gated_delta_tail(o, u, s0, U, fac, cu)


def needs_grad(*ts) -> bool:
    """Autograd will differentiate through these tensors (None entries ignored): the Triton / fla kernels
    without a usable backward must step aside."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in ts)


def fla_available() -> bool:
    return _fla() is not None


INTERPRETED = False     # tests: the Triton kernels also take CPU tensors, in any float dtype (Triton's interpreter)


def triton_here(t: torch.Tensor) -> bool:
    """A Triton kernel of this backend may run on t: a CUDA tensor, or any under the interpreter (tests)."""
    return t.is_cuda or INTERPRETED


_LAYOUTS: dict = {}


def _layout(key, make):
    """Device tensors derived from one varlen layout, made once and reused by every layer of a forward
    (and by later forwards of the same layout); bounded, cleared when full. Made outside inference mode: a
    table first made by a serving forward is later an index saved for backward by a training forward (the PIC
    tune), which an inference tensor cannot be."""
    hit = _LAYOUTS.get(key)
    if hit is None:
        if len(_LAYOUTS) > 512:
            _LAYOUTS.clear()
        with torch.inference_mode(False):
            hit = _LAYOUTS[key] = make()
    return hit


def _cu(cu_seqlens, device):
    """(cu on the device, cu on the CPU, fla chunk indices) for one varlen layout: fla caches its
    derived index tensors by the identity of the device tensor, and building them costs a
    host-to-device copy and ~1 ms of CPU per call."""
    if cu_seqlens is None:
        return None, None, None
    cpu = cu_seqlens.cpu()

    def make():
        from fla.ops.utils import prepare_chunk_indices

        dev = cpu.to(device, non_blocking=True)
        return dev, cpu, prepare_chunk_indices(dev, 64, cu_seqlens_cpu=cpu)

    return _layout(("cu", tuple(cpu.tolist()), str(device)), make)


def pin_layouts() -> list:
    """The cached layout tensors as they are now: a CUDA graph that captured fla calls reads them by
    address, so its owner keeps this list alive (the cache itself may be cleared)."""
    return list(_LAYOUTS.values())


CHUNK_BY_STAGES = True    # False: the plain chunked forward through fla's chunk_gated_delta_rule (before run 44)


def _gated_delta(which: int, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                 use_qk_l2norm_in_kernel):
    """fla's chunk (which=0) or fused recurrent (which=1) kernel on CUDA, else the reference twin. Under
    autograd the reference twin (PyTorch, on the same device): fla 0.6's fused recurrent gated delta rule
    has no backward, and its chunk backward refuses Hopper GPUs with Triton < 3.7.1 (fla issue #640; the
    H200's Triton is 3.6, H200 run 17). Under autograd the chunked twin for either: the recurrent one keeps a
    [B, H, K, V] state per token for backward, and a PIC-tune batch of short runs (seam windows and documents
    summarized in context, the state widened by K identity columns) ran the CPU out of 24 GB that way."""
    grad = needs_grad(q, k, v, g, beta, initial_state)
    kern = _fla() if q.is_cuda and not grad else None
    if kern is None:
        fn = ref.chunk_gated_delta_rule if grad or which == 0 else ref.recurrent_gated_delta_rule
        return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    st = _fla_stages() if which == 0 and CHUNK_BY_STAGES else None
    if st is not None:
        # the stages fla's chunk function runs (cumsum, WY factors, chunk states, outputs), without its autograd
        # wrapper (H200 run 40's profile of an eager prefill: ~1.45 ms of CPU per call through the wrapper)
        q, k, v, beta, scale = _stages_prepare(st, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
        init = None if initial_state is None else initial_state.float().contiguous()
        o, final, _ = _stages_forward(st, q, k, v, g, beta, scale,
                                      None if cu_seqlens is None else cu_seqlens.cpu(), init)
        return o, (final if output_final_state else None)
    if which == 1 and cu_seqlens is not None and cu_seqlens.is_cuda:
        cu, extra = cu_seqlens, {}             # device lengths (the captured compose pass): the kernel reads them
    else:
        cu, cu_cpu, chunks = _cu(cu_seqlens, q.device)
        extra = dict(cu_seqlens_cpu=cu_cpu, chunk_indices=chunks) if which == 0 else {}
    init = None if initial_state is None else initial_state.float().contiguous()
    o, final = kern[which](q=q, k=k, v=v, g=g.float(), beta=beta, scale=scale, initial_state=init,
                           output_final_state=output_final_state, cu_seqlens=cu,
                           use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)
    return o.to(v.dtype), final


@functools.lru_cache(maxsize=None)
def _fla_hgrn():
    """fla-core's fused recurrent HGRN kernel (h_t = exp(g_t) h_{t-1} + x_t per channel, varlen), or None."""
    try:
        from fla.ops.hgrn import fused_recurrent_hgrn
    except Exception:
        return None
    return fused_recurrent_hgrn


def _diagonal_scan(chunked: bool, x, g, initial_state, output_final_state, cu_seqlens):
    """fla's fused recurrent HGRN kernel on CUDA (one program per sequence and channel block, the tokens in
    order; fp32 in and out, so the state stays fp32), else the reference twin (the chunked one for prefill)."""
    kern = _fla_hgrn() if x.is_cuda and not needs_grad(x, g, initial_state) and "hgrn" not in FAILED else None
    if kern is not None:
        cu = _cu(cu_seqlens, x.device)[0]
        init = None if initial_state is None else initial_state.float().contiguous()
        try:
            o, final = kern(x.float().contiguous(), g.float().contiguous(), initial_state=init,
                            output_final_state=output_final_state, cu_seqlens=cu)
        except Exception as e:
            kernel_failed("hgrn", e)
        else:
            return o.to(x.dtype), final
    fn = ref.chunk_diagonal_scan if chunked else ref.recurrent_diagonal_scan
    return fn(x, g, initial_state=initial_state, output_final_state=output_final_state, cu_seqlens=cu_seqlens)


def chunk_diagonal_scan(x, g, *, initial_state=None, output_final_state=False, cu_seqlens=None):
    return _diagonal_scan(True, x, g, initial_state, output_final_state, cu_seqlens)


def recurrent_diagonal_scan(x, g, *, initial_state=None, output_final_state=False, cu_seqlens=None):
    return _diagonal_scan(False, x, g, initial_state, output_final_state, cu_seqlens)


@functools.lru_cache(maxsize=None)
def _fla_kda():
    """fla-core's KDA kernels (chunk, fused recurrent; the delta rule with a per-key-channel decay), or None."""
    try:
        from fla.ops.kda import chunk_kda as chunk, fused_recurrent_kda as recurrent
    except Exception:
        return None
    return chunk, recurrent


def _kda(which: int, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
         use_qk_l2norm_in_kernel):
    """fla's chunk (which=0) or fused recurrent (which=1) KDA kernel on CUDA, else the reference twin (under
    autograd the chunked twin, as for the gated delta rule). g: the log decays [B, T, H, K] as computed by the
    model (fla's gate-in-kernel options stay off); the state fp32 in and out; varlen by cu_seqlens (device
    lengths, the captured compose pass, go to the recurrent kernel as they are)."""
    grad = needs_grad(q, k, v, g, beta, initial_state)
    kern = _fla_kda() if q.is_cuda and not grad and "kda" not in FAILED else None
    if kern is not None:
        if which == 1 and cu_seqlens is not None and cu_seqlens.is_cuda:
            cu, extra = cu_seqlens, {}
        else:
            cu, cu_cpu, _ = _cu(cu_seqlens, q.device)
            extra = dict(cu_seqlens_cpu=cu_cpu) if which == 0 and cu is not None else {}
        init = None if initial_state is None else initial_state.float().contiguous()
        try:
            o, final = kern[which](q=q, k=k, v=v, g=g.float(), beta=beta, scale=scale, initial_state=init,
                                   output_final_state=output_final_state, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **extra)
        except Exception as e:
            kernel_failed("kda", e)
        else:
            return o.to(v.dtype), (final.float() if final is not None else None)
    fn = ref.chunk_kda if grad or which == 0 else ref.recurrent_kda
    return fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def chunk_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
              use_qk_l2norm_in_kernel=False):
    return _kda(0, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def recurrent_kda(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
                  use_qk_l2norm_in_kernel=False):
    return _kda(1, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel)


def chunk_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    return _gated_delta(0, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel)


def recurrent_gated_delta_rule(q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
                               cu_seqlens=None, use_qk_l2norm_in_kernel=False):
    return _gated_delta(1, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                        use_qk_l2norm_in_kernel)


@functools.lru_cache(maxsize=None)
def _fla_stages():
    """fla-core 0.6's forward stages of the chunked gated delta rule (the pipeline inside its
    chunk_gated_delta_rule), or None where fla is missing or laid out otherwise."""
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.chunk_delta_h import chunk_gated_delta_rule_fwd_h
        from fla.ops.common.chunk_o import chunk_fwd_o
        from fla.ops.gated_delta_rule.chunk_fwd import chunk_gated_delta_rule_fwd_intra
        from fla.ops.utils import chunk_local_cumsum
        from fla.ops.utils.constant import RCP_LN2
    except Exception:
        return None
    return l2norm_fwd, chunk_local_cumsum, RCP_LN2, chunk_gated_delta_rule_fwd_intra, chunk_gated_delta_rule_fwd_h, \
        chunk_fwd_o


_ZEROS: dict = {}
TRANSITION_STAGES = True     # False: the transition through fla's whole pipeline on appended columns (gpu_bench)


def _stages_prepare(st, q, k, v, beta, scale, use_qk_l2norm_in_kernel):
    """Contiguous inputs, the default scale and fla's l2 norm of q and k, as fla's chunk function does first."""
    l2norm_fwd = st[0]
    q, k, v, beta = (t.contiguous() for t in (q, k, v, beta))
    scale = k.shape[-1] ** -0.5 if scale is None else scale
    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(l2norm_fwd, q), _l2norm(l2norm_fwd, k)
    return q, k, v, beta, scale


def _l2norm(l2norm_fwd, x):
    """fla's l2 norm (eps 1e-6), by ops/triton_norm.py where its width allows (fla's tunes again for every
    65,536 rows)."""
    y = _own_norm(x, None, 1e-6, l2=True)
    return y if y is not None else l2norm_fwd(x)[0]


def _stages_forward(st, q, k, v, g, beta, scale, cu_cpu, init):
    """fla's chunked forward, stage by stage, over the varlen layout cu_cpu (a CPU tensor) from `init`: the
    outputs (in v's dtype), the final states, and what a transition pass reuses (w, the cumsum, the layout)."""
    _, cumsum, rcp_ln2, intra, fwd_h, fwd_o = st
    cu, _, chunks = _cu(cu_cpu, q.device)
    gc = cumsum(g.float().contiguous(), chunk_size=64, scale=rcp_ln2, cu_seqlens=cu, chunk_indices=chunks)
    w, u, _ = intra(k=k, v=v, g=gc, beta=beta, cu_seqlens=cu, chunk_indices=chunks, chunk_size=64)
    h, v_new, final = fwd_h(k=k, w=w, u=u, g=gc, initial_state=init, output_final_state=True, cu_seqlens=cu,
                            chunk_indices=chunks)
    o = fwd_o(q=q, k=k, v=v_new, h=h, g=gc, scale=scale, cu_seqlens=cu, chunk_indices=chunks)
    return o.to(v.dtype), final, (w, gc, cu, chunks, cu_cpu)


# The runs' transitions by ops/triton_transition.py (True) or by fla's chunk-state pass from the identity (False).
# H200 run 48 (benchmarks/transition_bench.py, one GDN layer, 35B head shapes, bf16 products as fla's): 57 / 44 / 172
# us per call at 512 / 2k / 8k tokens against 156 / 123 / 258 us for fla's pass (host-bound at 512 and 2k; at 8k the
# GPU sets the time). Its unpipelined configuration faulted in runs 44-46 and is gone. H200 run 50 (gpu_bench's (T, S)
# rows, inside the 35B model): the (T, S) share of an isolated segment's kernel time 4.5 / 3.8 / 3.8 / 3.2% at 512 /
# 2k / 8k / 20 x 1,600 tokens against 5.3 / 4.6 / 5.0 / 4.2% through fla's pass, no fault: on by default since.
TRANSITION_KERNEL = True


def _stages_transitions(st, k, reuse, r: int, step: int = 1, first: int = 0):
    """The transitions T [., HV, K, K] of the forward's runs first, first + step, ... (of r): from the forward's
    WY factors w and decays by ops/triton_transition.py (only T written, only these runs walked); where that
    kernel cannot run, fla's chunk-state pass once more over w, with zero values, from the identity (zeros and
    identity cached read-only per shape), for every run."""
    w, gc, cu, chunks, cu_cpu = reuse
    kern = triton_kernel("transitions") if TRANSITION_KERNEL and cu_cpu is not None and k.shape[0] == 1 else None
    if kern is not None:
        b = tuple(cu_cpu.tolist())

        def make():
            pairs = [(b[i], b[i + 1]) for i in range(first, r, step)]
            return torch.tensor(pairs, dtype=torch.int32).reshape(-1, 2).to(k.device, non_blocking=True)

        bounds = _layout(("bounds", b, first, step, str(k.device)), make)
        try:
            return kern(k, w, gc, bounds)
        except Exception as err:
            kernel_failed("transitions", err)
    return _fla_transitions(st, k, w, gc, cu, chunks, r)[first::step]


def _fla_transitions(st, k, w, gc, cu, chunks, r: int):
    fwd_h = st[4]
    dk, hv = k.shape[-1], w.shape[-2]
    key = (tuple(w.shape), r, str(k.device), w.dtype)
    zi = _ZEROS.get(key)
    if zi is None:
        if len(_ZEROS) > 8:
            _ZEROS.clear()
        zi = _ZEROS[key] = (w.new_zeros(w.shape), torch.eye(dk, device=k.device).expand(r, hv, dk, dk).contiguous())
    _, _, t = fwd_h(k=k, w=w, u=zi[0], g=gc, initial_state=zi[1], output_final_state=True, save_new_value=False,
                    cu_seqlens=cu, chunk_indices=chunks)
    return t


def chunk_gated_delta_transition(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                                 use_qk_l2norm_in_kernel=False):
    """The reference signature (ops/reference/gated_delta.py): the chunked recurrence from `initial_state`
    and each run's transition T. On CUDA with fla, T goes through the state passing only: fla's stages run
    once for the outputs and the state (cumsum, the chunks' WY factors w and u, the chunk states h, the
    outputs), then the chunk-state pass once more over the same w from the identity with zero values,
    whose final state is T. Appending K zero value columns to the whole pipeline (the reference form)
    also computes their outputs and their WY values, which nothing reads (H200 run 19: (T, S) +9.5% of an
    8k segment's prefill kernels that way). Elsewhere, or under autograd, the reference form on the
    fast backend's chunk kernel."""
    st = _fla_stages() if q.is_cuda and TRANSITION_STAGES else None
    if st is None or needs_grad(q, k, v, g, beta, initial_state):
        from .reference.gated_delta import transition_by_augment

        return transition_by_augment(chunk_gated_delta_rule, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    q, k, v, beta, scale = _stages_prepare(st, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    r = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = (torch.zeros(r, v.shape[-2], k.shape[-1], v.shape[-1], device=q.device) if initial_state is None
            else initial_state.float().contiguous())
    o, final, reuse = _stages_forward(st, q, k, v, g, beta, scale, cu_seqlens, init)
    return o, final, _stages_transitions(st, k, reuse, r)


def chunk_gated_delta_isolated(q, k, v, g, beta, *, cu_seqlens, seams, scale=None, use_qk_l2norm_in_kernel=False):
    """The reference signature (ops/reference/gated_delta.py): an isolated prefill's linear layer, every
    sequence from zero plus the zero-start summary (T, S) of its rest (the tokens after its seam window).

    On CUDA with fla, over the rows as they lie (no gather of the rests, no second round): each sequence is
    cut after its seam window into two pieces of one varlen layout;
      1. the seam windows from zero (fla's fused recurrent kernel on their few rows): the states S_w after them;
      2. fla's stages once over the cut layout, every seam from zero and every rest from its S_w: the outputs of
         all tokens and the state after each sequence (a plain prefill's work, one more piece per sequence);
      3. the chunk-state pass once more over the same w, with zero values, from the identity: each rest's T;
      and S = S_final - T S_w. Elsewhere, or under autograd: the two plain ops."""
    st = _fla_stages() if q.is_cuda and TRANSITION_STAGES else None
    bounds = cu_seqlens.tolist()
    if st is None or needs_grad(q, k, v, g, beta) or any(
            sw < 1 or b - a <= sw for a, b, sw in zip(bounds[:-1], bounds[1:], seams)):
        from .reference.gated_delta import isolated_by_parts

        return isolated_by_parts(chunk_gated_delta_rule, chunk_gated_delta_transition, q, k, v, g, beta,
                                 cu_seqlens=cu_seqlens, seams=seams, scale=scale,
                                 use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    q, k, v, beta, scale = _stages_prepare(st, q, k, v, beta, scale, use_qk_l2norm_in_kernel)
    r = len(seams)
    # 1. the seam windows (one sequence: its first rows as they lie; several: gathered)
    if r == 1:
        idx = slice(bounds[0], bounds[0] + seams[0])
    else:
        idx = _layout(("seam rows", tuple(bounds), tuple(seams), str(q.device)), lambda: torch.cat(
            [torch.arange(a, a + sw) for a, sw in zip(bounds[:-1], seams)]).to(q.device, non_blocking=True))
    _, s_w = recurrent_gated_delta_rule(*(t[:, idx].contiguous() for t in (q, k, v, g, beta)), scale=scale,
                                        output_final_state=True, cu_seqlens=torch.tensor([0] + list(seams)).cumsum(0))
    # 2. the cut layout: pieces alternate seam, rest
    split = [x for a, sw in zip(bounds[:-1], seams) for x in (a, a + sw)] + [bounds[-1]]
    init = s_w.new_zeros((2 * r,) + tuple(s_w.shape[1:]))
    init[1::2] = s_w
    o, final, reuse = _stages_forward(st, q, k, v, g, beta, scale, torch.tensor(split), init)
    # 3. the rests' transitions (a second launch: H200 run 41 made them in the state pass's own launch over a doubled
    # token axis, [k | k], [u | 0], [init | I], for one document: kernels +7.9 / +7.2 / +7.5% of the 512 / 2k / 8k
    # prefill against +5.6 / +5.5 / +5.2% for the two launches; removed)
    t, s_n = _stages_transitions(st, k, reuse, 2 * r, step=2, first=1), final[1::2]
    return o, s_n, t, s_n - t @ s_w


def _conv_layout(cu: tuple, wm1: int, device):
    """Device index tensors of one varlen conv layout: rows of x, of the windows, of the outputs and of
    the new windows in the padded buffer."""
    def make():
        r, n = len(cu) - 1, cu[-1]
        lens = torch.tensor([b - a for a, b in zip(cu[:-1], cu[1:])])
        run_of = torch.repeat_interleave(torch.arange(r), lens)                   # run index of each row
        x_rows = torch.arange(n) + wm1 * (run_of + 1)                              # row of x[i] in xx
        blocks = torch.tensor(cu[1:]) + wm1 * torch.arange(1, r + 1)               # end of each block in xx
        w_rows = (blocks - lens - wm1)[:, None] + torch.arange(wm1)[None]          # rows of each window
        tails = (blocks - wm1)[:, None] + torch.arange(wm1)[None]                  # rows of each new window
        return tuple(t.reshape(-1).to(device, non_blocking=True) for t in (x_rows, w_rows, x_rows - wm1, tails))

    return _layout(("conv", cu, wm1, str(device)), make)


def causal_conv1d_varlen(x, weight, bias, windows, cu_seqlens, *, activation: str | None = "silu"):
    """All runs of a varlen batch in one depthwise conv.

    x [n, C] runs back to back, windows [R, W-1, C] the raw inputs before each run, cu_seqlens [R + 1]
    (CPU). Each run is laid out after its window in one buffer xx; a valid conv over xx gives every
    output, and the new windows are the last W-1 rows of each (window, run) block.
    Returns (y [n, C] in x's dtype, new_windows [R, W-1, C])."""
    n, c = x.shape
    wm1 = weight.shape[-1] - 1
    r = cu_seqlens.shape[0] - 1
    # under autograd the PyTorch form (a depthwise conv), as for the gated delta rule: with only that one on
    # its reference, the PIC trainer's loss on the H200 still differed from the CPU's by 3% (run 18), and
    # fla's conv was the remaining fla kernel in its graph (this change not yet run on the GPU)
    conv = _fla_conv() if x.is_cuda and activation in (None, "silu") and not needs_grad(x, weight, bias, windows) \
        else None
    if conv is not None:
        # fla's state is the last W inputs channels-first, the newest last ([N, C, W]); the kernel reads
        # its last W-1 columns, which are hypic's window transposed (tested in tests/test_gpu.py)
        cu, cu_cpu, chunks = _cu(cu_seqlens, x.device)
        init = x.new_zeros(r, c, wm1 + 1)
        init[:, :, 1:] = windows.transpose(1, 2)
        y, final = conv(x=x[None], weight=weight, bias=bias, initial_state=init, output_final_state=True,
                        activation=activation, backend="triton", cu_seqlens=cu, cu_seqlens_cpu=cu_cpu,
                        chunk_indices=chunks)
        return y[0], final[:, :, 1:].transpose(1, 2).contiguous()
    x_rows, w_rows, y_rows, tail_rows = _conv_layout(tuple(cu_seqlens.tolist()), wm1, x.device)
    xx = x.new_empty(n + r * wm1, c)
    xx[x_rows] = x
    xx[w_rows] = windows.reshape(-1, c).to(x.dtype)
    y = F.conv1d(xx.t()[None].to(weight.dtype), weight[:, None], bias, groups=c)[0].t()   # [n + r*wm1 - wm1, C]
    y = y[y_rows]
    if activation == "silu":
        y = F.silu(y)
    elif activation is not None:
        raise ValueError(f"unsupported conv activation {activation!r}")
    new_windows = xx[tail_rows].view(r, wm1, c)
    return y.to(x.dtype), new_windows


# -- attention -------------------------------------------------------------------------------------------
_MASK_BYTES = 1 << 28          # the largest [queries, keys] mask one SDPA call materialises
_SCORES_BYTES = 1 << 30        # few queries over many keys: explicit fp32 scores up to this size
# ... unless they continue an ordered prefix and are this many: SDPA then (lower-right causal on CUDA, masked blocks
# or a square on the CPU). `python benchmarks/cpu_attention.py` (results/cpu_attention_20261201.json, 2-core CPU,
# 3,617 keys, 4 heads of 64, explicit / lower-right / masked blocks): 256 queries 23.7 / 13.8 / 14.7 ms, 1,024
# 133 / 46 / 45, 3,569 448 / 183 / 240 (8 heads of 128: 68 / 59 / 37 at 256, 1,196 / 490 / 605 at 3,569). The
# `prefix` request of `hypic demo`, 3,569 tokens after a cached 48-token prefix, spent 490 of its 740 ms in the
# explicit form. (On CUDA in bf16 the Triton kernel takes the few-query case first.)
_MANY_CONTINUING = 256
# On the CPU the explicit scores only for fewer queries than this; from there SDPA over masked blocks, whatever the
# positions (the same benchmark, queries at random positions over 8,224 keys, explicit / masked blocks: 192 queries
# 49 / 32 ms with 4 heads of 64, 128 / 69 with 8 of 128, 331 / 222 with 16 of 256; at 32 queries 9.2 / 6.9, 15.9 /
# 15.6, 44 / 48; at 8 within 10% either way)
_CPU_EXPLICIT_QUERIES = 32


def position_attention(q, k, v, q_pos, k_pos, *, scale: float, contiguous: bool = False, sorted_keys: bool = False,
                       window: int = 0, allowed=None):
    """SDPA behind the reference signature. contiguous: the keys are in position order, at consecutive
    positions, and end with the queries' own tokens (a fresh sequence: keys == queries; or a request
    continuing a cached prefix): causal attention aligned at the bottom right, which flash serves
    without a mask (masks of [queries, keys] for long prefix continuations cost more than the attention).
    sorted_keys: k_pos is non-decreasing (the Triton kernel then walks each query block's visible prefix only)."""
    nq, h, d = q.shape
    nk, (hkv, dv) = k_pos.shape[0], v.shape[1:]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    rep = h // hkv
    if allowed is not None:                     # a sparse selection: SDPA with its mask (and the window's)
        mask = (k_pos[None, :] <= q_pos[:, None]) & allowed
        if window:
            mask &= k_pos[None, :] > q_pos[:, None] - window
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None].to(q.dtype),
                                           v.transpose(0, 1)[None].to(q.dtype), attn_mask=mask[None, None],
                                           scale=scale, enable_gqa=rep > 1)
        return o[0].transpose(0, 1)
    if window:                                  # sliding window: the masked blocks, the window in their mask
        return _masked_blocks(q, k, v, q_pos, k_pos, scale, window)
    few = h * nq * nk * 4 <= _SCORES_BYTES
    # (fp32 stays on the explicit path: the kernel's products are tf32 on the GPU; so does autograd: the
    # kernel has no backward)
    # (D != Dv, MLA: Kimi-Linear's 24 / 16, at one block width for both: at their own widths the kernel faulted on
    # the H200, twenty-eighth session; ops/triton_attention.py)
    kern = triton_kernel("attention", q, k, v) if few and triton_here(q) and (
        q.dtype in (torch.bfloat16, torch.float16) or INTERPRETED) else None
    if kern is not None:
        # one kernel: no [H, Nq, Nk] scores in memory, key blocks no query may see skipped
        try:
            return kern(q, k.to(q.dtype), v.to(q.dtype), q_pos, k_pos, scale=scale, sorted_keys=sorted_keys)
        except Exception as e:
            kernel_failed("attention", e)
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]                  # [1, Hkv, Nk, D]
    held = nk - nq                          # (contiguous: the keys before the queries' own)
    if contiguous and (nq == nk or (not q.is_cuda and held <= nq and (not few or nq >= _MANY_CONTINUING))):
        # causal over a square: on the CPU a continuation with at most as many held keys as queries pads the
        # queries at the front (rows computed and dropped), since a mask costs more there than the extra rows
        # (benchmarks/cpu_attention.py, 3,617 keys, square / masked blocks: 3,569 queries 80 / 240 ms with 4 heads of
        # 64, 274 / 605 with 8 of 128; 1,800 queries 60 / 98, 262 / 314; 1,024, i.e. 2.5x as many held keys, 63 /
        # 45 and 247 / 163: the square loses there)
        qq = q if held == 0 else torch.cat([q.new_zeros(held, h, d), q])
        o = F.scaled_dot_product_attention(qq.transpose(0, 1)[None], kt, vt, is_causal=True, scale=scale,
                                           enable_gqa=rep > 1)
        return o[0].transpose(0, 1)[held:]
    # GQA folded into the query axis: [Hkv, rep * Nq, D] against [Hkv, Nk, D], one mask row per query
    qf = q.view(nq, hkv, rep, d).permute(1, 2, 0, 3)                             # [Hkv, rep, Nq, D]
    if few and not (contiguous and nq >= _MANY_CONTINUING) and (q.is_cuda or nq < _CPU_EXPLICIT_QUERIES):
        # few queries (seams, a query, decode) over many keys: the fused kernels parallelise over query
        # blocks and heads, too few here to fill the GPU; two batched GEMMs and a softmax do
        # The scores stay in the input dtype: scaled inside the GEMM (fp32 accumulator, alpha), masked in
        # place, and softmax accumulates in fp32 and writes the input dtype (as the fp32 detour did after
        # the GEMM had rounded them anyway): one pass each over [H, Nq, Nk] instead of five, in half the bytes.
        s = _scaled_scores(qf.reshape(hkv, rep * nq, d), k.permute(1, 2, 0), scale)   # [Hkv, rep*Nq, Nk]
        s.view(hkv, rep, nq, nk).masked_fill_(k_pos[None, :] > q_pos[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        o = torch.matmul(p, v.transpose(0, 1))                                        # [Hkv, rep*Nq, Dv]
        return o.view(hkv, rep, nq, dv).permute(2, 0, 1, 3).reshape(nq, h, dv)
    if contiguous and q.is_cuda:
        # (not on the CPU: importing torch.nn.attention.bias imports torch._dynamo, 2.8 s on the first request that
        # gets here; the masked blocks below are within 5-15% of it there)
        from torch.nn.attention.bias import causal_lower_right

        # K / V expanded to every query head (the lower-right causal kernels take no GQA argument)
        ke = kt.repeat_interleave(rep, dim=1) if rep > 1 else kt
        ve = vt.repeat_interleave(rep, dim=1) if rep > 1 else vt
        o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ke, ve, attn_mask=causal_lower_right(nq, nk),
                                           scale=scale)
        return o[0].transpose(0, 1)
    return _masked_blocks(q, k, v, q_pos, k_pos, scale, 0)


def _masked_blocks(q, k, v, q_pos, k_pos, scale: float, window: int):
    """SDPA over blocks of queries, each with its [queries, keys] mask from the positions (causal, and the sliding
    window when window > 0)."""
    nq, h, d = q.shape
    nk, (hkv, dv) = k_pos.shape[0], v.shape[1:]
    rep = h // hkv
    kt, vt = k.transpose(0, 1)[None], v.transpose(0, 1)[None]                  # [1, Hkv, Nk, D]
    qf = q.view(nq, hkv, rep, d).permute(1, 2, 0, 3)                             # [Hkv, rep, Nq, D]
    out = q.new_empty(hkv, rep, nq, dv)
    # queries per block: the mask [m, Nk] (bool, repeated per query head of a kv head) within _MASK_BYTES; on the CPU
    # SDPA with a mask materialises the fp32 scores of every head as well ([H, m, Nk]), so those are bounded too
    per_query = rep * nk if q.is_cuda else max(rep * nk, 4 * h * nk)
    step = max(1, _MASK_BYTES // per_query)
    for a in range(0, nq, step):
        b = min(nq, a + step)
        mask = (k_pos[None, :] <= q_pos[a:b, None])                              # [m, Nk]
        if window:
            mask &= k_pos[None, :] > q_pos[a:b, None] - window
        m = b - a
        qq = qf[:, :, a:b].reshape(1, hkv, rep * m, d)
        o = F.scaled_dot_product_attention(qq, kt, vt, attn_mask=mask.repeat(rep, 1)[None, None], scale=scale)
        out[:, :, a:b] = o[0].view(hkv, rep, m, dv)
    return out.permute(2, 0, 1, 3).reshape(nq, h, dv)


def _scaled_scores(a, b, scale: float):
    """scale * (a @ b) for [G, M, D] @ [G, D, N], scaled in the GEMM's accumulator, in a's dtype."""
    return torch.baddbmm(a.new_empty(()).expand(a.shape[0], a.shape[1], b.shape[2]), a, b, beta=0.0, alpha=scale)


ORDER_KERNEL = True        # False: the compose pass's keys placed and ordered by PyTorch ops (gpu_bench's variant)


def order_keys(keys, values, kperm, *, free=None, lo: int = 0, cos=None, sin=None, rotary_dim: int = 0, out=None,
               entries=None):
    """The reference signature (ops/reference/attention.py): where Triton runs, one launch that places the cached
    keys (RoPE) and gathers keys and values into position order (ops/triton_place.py), equal to the reference bit
    for bit; else the reference's ops (RoPE products and sums, a copy, two gathers). entries (the cached rows read
    by address, layers/attention.py ORDER_FROM_ENTRIES): the kernel alone (the caller packs the rows where it fails)."""
    kern = triton_kernel("order", keys, values) if ORDER_KERNEL and triton_here(keys) else None
    if kern is not None:
        try:
            return kern(keys, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=rotary_dim, out=out,
                        entries=entries)
        except Exception as e:
            kernel_failed("order", e)
    return ref.order_keys(keys, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=rotary_dim, out=out,
                          entries=entries)


def decode_attention(q, k, v, lengths, *, scale: float, allowed=None):
    """The reference signature without a host sync (CUDA-graph safe). In bf16 / fp16 where Triton runs: the
    split-K kernel of ops/triton_decode.py over each sequence's valid slots. Else (and under a selection,
    `allowed`) every sequence's scores over all C slots in two batched GEMMs, the slots past its length (or not
    selected) masked; GQA folded into the query axis; [B, Hkv, C, D] keys make k^T a view, so nothing is copied."""
    # (one head dim for keys and values, as for the compose attention's kernel: MLA's D != Dv goes the GEMMs, untested
    # in the kernel)
    kern = triton_kernel("decode", q, k, v) if allowed is None and q.shape[-1] == v.shape[-1] and triton_here(q) and (
        q.dtype in (torch.bfloat16, torch.float16) or INTERPRETED) else None
    if kern is not None:
        try:
            return kern(q, k, v, lengths, scale=scale)
        except Exception as err:
            kernel_failed("decode", err)
    b, h, d = q.shape
    hkv, cap, dv = k.shape[1], k.shape[2], v.shape[-1]
    if h % hkv:
        raise ValueError(f"query heads ({h}) must be a multiple of kv heads ({hkv})")
    rep = h // hkv
    s = _scaled_scores(q.reshape(b * hkv, rep, d), k.reshape(b * hkv, cap, d).transpose(1, 2), scale)
    s = s.view(b, hkv, rep, cap)                                                    # [B, Hkv, rep, C]
    hide = torch.arange(cap, device=q.device)[None, :] >= lengths[:, None]
    if allowed is not None:
        hide = hide | ~allowed
    s.masked_fill_(hide[:, None, None, :], float("-inf"))
    p = torch.softmax(s, dim=-1)
    return torch.matmul(p, v).reshape(b, h, dv)


# -- MoE -------------------------------------------------------------------------------------------------
# few rows per expert (a warm pic request's seams and query, decode): the experts' weight tiles streamed by a
# Triton kernel (ops/triton_moe.py) where the rows average at most FEW_ROWS_PER_EXPERT per expert; more
# rows: torch._grouped_mm. MOE_FEW_ROWS False: always the grouped GEMMs (gpu_bench's side-by-side variant)
MOE_FEW_ROWS = True
FEW_ROWS_PER_EXPERT = 16


SORT_MAX = 8192            # ops/triton_route.py's rank sort: at most this many choices (n * k)
ROUTE_KERNELS = True       # False: routing and sort by PyTorch ops (gpu_bench's side-by-side variant)


def route(x, router, top_k: int, norm_topk_prob: bool, logits=None):
    """The reference signature (ops/reference/moe.py): the router's GEMM (unless its logits are given), then softmax,
    top k and the renormalisation in one Triton kernel (ops/triton_route.py); the reference where it cannot run."""
    kern = triton_kernel("route", x, router) if ROUTE_KERNELS and triton_here(x) else None
    if kern is not None:
        try:
            return kern(F.linear(x, router) if logits is None else logits, top_k, norm_topk_prob)
        except Exception as err:
            kernel_failed("route", err)
    return ref.route(x, router, top_k, norm_topk_prob, logits=logits)


def _sort_by_expert(flat, e: int, few: bool, real=None, top_k: int = 1):
    """(order: the n*k choices sorted by expert, stable; offs [E] int32 inclusive cumulative counts). On the
    few-rows path one Triton kernel (ops/triton_route.py, a counting sort by ranks) makes both; else a radix sort
    and a scatter-add. real ([1] int tensor or None; the kernel only): the tokens from real on (top_k choices each)
    are padding, their choices left out of every expert's rows (they sort last, in their order; offs does not count
    them)."""
    if few and ROUTE_KERNELS and flat.numel() <= SORT_MAX:
        kern = triton_kernel("sort")
        if kern is not None:
            try:
                return kern(flat, e, top_k, real=real)
            except Exception as err:
                kernel_failed("sort", err)
    # a stable sort of the expert ids on the narrowest key that holds them: the radix sort's passes follow the
    # key's width (H200 run 23: int64 keys, 29 us per layer for 224 x 8 entries)
    keys = flat.to(torch.uint8) if e <= 256 else flat.to(torch.int16) if e <= 1 << 15 else flat
    order = keys.argsort(stable=True)
    counts = torch.zeros(e, dtype=torch.int32, device=flat.device)
    offs = counts.scatter_add_(0, flat, torch.ones_like(flat, dtype=torch.int32)).cumsum(0, dtype=torch.int32)  # no sync
    return order, offs


def experts_forward(x, weights, experts, gate_up, down, limit: float | None = None, shared=None, rows=None):
    """Tokens sorted by expert; the Triton kernel for few rows per expert, else two grouped GEMMs; a
    deterministic combine (no atomics). `limit` (clamped SwiGLU inputs): the grouped GEMMs with the clamps between
    them (the Triton kernel does not clamp). shared: (gate, out) of a shared expert, added as sigmoid(gate) * out (in
    the few-rows kernel's combine, in fp32 with the routed rows, rounded once). rows: the rows from it on are padding
    (ops/reference/moe.py `pad_weights`): on the few-rows path their choices join no expert's rows and the combine
    adds no routed row for them; elsewhere their weights are zero."""
    n, k = experts.shape
    e = gate_up.shape[0]
    few = (MOE_FEW_ROWS and limit is None and n * k <= FEW_ROWS_PER_EXPERT * e and triton_here(x)
           and x.dtype != torch.float64)
    # grouped GEMM: bf16 on CUDA. fp32 on CUDA (the quality study) takes the few-rows kernel (fp32 products) where
    # it applies, else the reference loop, which reads the experts in use on the host: a decode step's CUDA graph
    # capture failed on it (H200 run 77), so an fp32 decode step must stay on the kernel
    other = x.dtype == torch.float64 or (x.is_cuda and x.dtype != torch.bfloat16) or not _grouped_dims(gate_up, down)
    if other and not few:
        return ref.experts_forward(x, weights, experts, gate_up, down, limit, shared, rows)
    flat = experts.reshape(-1)
    if few:
        kern = triton_kernel("moe", x)
        if kern is not None:
            order, offs = _sort_by_expert(flat, e, few, real=rows, top_k=k)
            try:
                return kern(x, weights, experts, gate_up, down, order, offs, shared=shared, rows=rows)
            except Exception as err:
                kernel_failed("moe", err)
    if other:
        return ref.experts_forward(x, weights, experts, gate_up, down, limit, shared, rows)
    weights = ref.pad_weights(weights, rows)
    order, offs = _sort_by_expert(flat, e, False)
    xs = x[order // k]
    gate, up = torch._grouped_mm(xs, gate_up.transpose(1, 2), offs=offs).chunk(2, dim=-1)
    ys = torch._grouped_mm(ref.clamped_swiglu(gate, up, limit), down.transpose(1, 2), offs=offs)     # [n*k, H]
    return ref.with_shared(_combine(ys, order, weights, x.dtype), shared)


def _combine(ys, order, weights, dtype):
    """The experts' rows (sorted by expert, `order`) back in token order by a gather (a scatter of n*k rows costs
    more), then the weighted sum of each token's k rows as one batched GEMM (fp32 accumulation inside, no fp32 copy
    of the n*k rows)."""
    n, k = weights.shape
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    y = ys[inv].view(n, k, -1)
    return torch.bmm(weights.to(y.dtype).view(n, 1, k), y).view(n, -1).to(dtype)


def _grouped_dims(*weights) -> bool:
    """torch._grouped_mm needs every operand's rows 16-byte aligned: the experts' inner and hidden sizes."""
    return all((w.shape[-1] * w.element_size()) % 16 == 0 for w in weights)


def experts_forward_plain(x, weights, experts, up, down, act: str = "relu2"):
    """Non-gated experts (Nemotron 3): tokens sorted by expert, two grouped GEMMs around relu², the same
    deterministic combine as experts_forward; fp64, or CUDA in another dtype than bf16: the reference loop."""
    if act != "relu2":
        raise ValueError(f"unknown expert activation {act!r}")
    if x.dtype == torch.float64 or (x.is_cuda and x.dtype != torch.bfloat16) or not _grouped_dims(up, down):
        return ref.experts_forward_plain(x, weights, experts, up, down, act)
    n, k = experts.shape
    order, offs = _sort_by_expert(experts.reshape(-1), up.shape[0], False)
    h = torch._grouped_mm(x[order // k], up.transpose(1, 2), offs=offs)
    ys = torch._grouped_mm(F.relu(h).square(), down.transpose(1, 2), offs=offs)          # [n*k, H]
    return _combine(ys, order, weights, x.dtype)
