"""Gated delta rule, pure PyTorch reference (CPU and any device).

Layout (the fla convention, used everywhere in hypic):
    q, k   [B, T, H, K]      H key heads
    v      [B, T, HV, V]     HV value heads, HV a multiple of H (each key head serves HV // H
                             consecutive value heads)
    g      [B, T, HV]        log decay, <= 0: the state is multiplied by exp(g_t)
    beta   [B, T, HV]        write strength in (0, 1)
    state  [N, HV, K, V]     fp32; N = B, or the number of sequences when varlen
    varlen: B = 1 and cu_seqlens [N + 1] (int64) marks sequence boundaries

Recurrence for one value head (S is [K, V]):
    S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T
    o_t = S_t^T (scale * q_t)
The state acts on every value column independently; hypic relies on that to compute a
segment's transition operator T by appending K value columns (see compose/linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(|x|^2 + eps) along the last axis (the fla / transformers definition)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def _expand_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    h = x.shape[-2]
    if h == hv:
        return x
    if hv % h:
        raise ValueError(f"value heads ({hv}) must be a multiple of key heads ({h})")
    return x.repeat_interleave(hv // h, dim=-2)


def _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel):
    hv = v.shape[-2]
    q = _expand_heads(q, hv).float()
    k = _expand_heads(k, hv).float()
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    return q * scale, k, v.float(), g.float(), beta.float()


def _pad_varlen(tensors, cu_seqlens):
    """[1, T, ...] packed -> [N, Tmax, ...] right-padded with zeros.

    Zero padding is inert for the recurrence: g = 0 keeps the state, beta = 0 and k = 0 write
    nothing, so each sequence's final state is read at the padded end. One gather per tensor (a loop
    over the sequences was ~3 launches per sequence and tensor: under autograd on a GPU, most of the
    quality study's PIC-tune step).
    """
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    tmax = max(lens) if lens else 0
    if not lens:
        return [x.new_zeros((0, 0) + tuple(x.shape[2:])) for x in tensors], lens
    total = tensors[0].shape[1]
    if min(lens) == tmax and tmax * len(lens) == total:
        # sequences of one length (a decode step: R runs of one token) need no padding: a view, with no index
        # tensor sent to the device (a host-to-device copy, which a CUDA graph capture refuses)
        return [x[0].reshape((len(lens), tmax) + tuple(x.shape[2:])) for x in tensors], lens
    starts = cu_seqlens[:-1].to(device=tensors[0].device, dtype=torch.long)
    cols = torch.arange(tmax, device=starts.device)
    lens_t = torch.as_tensor(lens, device=starts.device)
    idx = torch.where(cols[None, :] < lens_t[:, None], starts[:, None] + cols[None, :], total)   # pads: a zero row
    return [torch.cat([x[0], x.new_zeros((1,) + tuple(x.shape[2:]))])[idx] for x in tensors], lens


def _chunk_layout(cu_seqlens, c: int, device):
    """Index tables that lay a packed varlen batch out as chunks of c tokens, each sequence padded to a multiple of
    c only (not to the longest sequence, as _pad_varlen does: the chunked form's pairwise decays are C x C x K floats
    per chunk, so padding a batch of mixed lengths to the longest multiplies their memory and work by about max / mean;
    a PIC-tune batch's full pass of 8 sequences, lengths 270-1,226, went from 8.72 to 4.87 GB peak and 41.6 to 21.0 s
    on the CPU: quality/tune_step_memory.py). Returns (tok [M * c]: the token at each chunk slot, T for a pad slot (a zero row appended); grid
    [N, n_max]: the chunk at each (sequence, chunk index), M (an identity chunk appended) past a sequence's end;
    back [T]: each token's chunk slot; place [M]: each chunk's index in the flattened grid; lens)."""
    lens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()
    total = int(cu_seqlens[-1]) if lens else 0
    nch = [-(-n // c) for n in lens]
    m, n_max = sum(nch), max(nch, default=0)
    first = torch.tensor([0] + nch[:-1], dtype=torch.long).cumsum(0)                 # each sequence's first chunk
    nch_t, lens_t = torch.tensor(nch, dtype=torch.long), torch.tensor(lens, dtype=torch.long)
    seq = torch.repeat_interleave(torch.arange(len(lens)), nch_t)                   # [M] sequence of each chunk
    idx = torch.arange(m) - first[seq]                                              # [M] chunk index in its sequence
    slot = idx[:, None] * c + torch.arange(c)[None, :]                              # [M, c] offset in the sequence
    starts = cu_seqlens[:-1].cpu().long()
    tok = torch.where(slot < lens_t[seq][:, None], starts[seq][:, None] + slot, total).reshape(-1)
    cols = torch.arange(n_max)
    grid = torch.where(cols[None, :] < nch_t[:, None], first[:, None] + cols[None, :], m)
    back = torch.empty(total, dtype=torch.long)
    real = tok < total
    back[tok[real]] = torch.arange(m * c)[real]
    place = seq * n_max + idx
    return tuple(t.to(device, non_blocking=True) for t in (tok, grid, back, place)) + (lens,)


def _unpad(o, lens):
    if not lens:
        return o.new_zeros((1, 0) + tuple(o.shape[2:]))
    if min(lens) == o.shape[1]:                       # every sequence as long as the padding: no pads to drop
        return o.reshape((1, -1) + tuple(o.shape[2:]))
    keep = torch.arange(o.shape[1], device=o.device)[None, :] < torch.as_tensor(lens, device=o.device)[:, None]
    return o[keep].unsqueeze(0)


def recurrent_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False,
):
    """Token-by-token reference. Returns (o [B, T, HV, V] in v's dtype, final_state fp32 or None)."""
    dtype = v.dtype
    if cu_seqlens is not None:
        (q, k, v, g, beta), lens = _pad_varlen((q, k, v, g, beta), cu_seqlens)
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    b, t, hv, dv = v.shape
    dk = k.shape[-1]
    s = q.new_zeros(b, hv, dk, dv) if initial_state is None else initial_state.float().clone()
    o = q.new_empty(b, t, hv, dv)
    for i in range(t):
        s = s * g[:, i].exp()[..., None, None]
        kt = k[:, i]
        pred = torch.einsum("bhk,bhkv->bhv", kt, s)
        delta = (v[:, i] - pred) * beta[:, i, :, None]
        s = s + kt[..., None] * delta[..., None, :]
        o[:, i] = torch.einsum("bhk,bhkv->bhv", q[:, i], s)
    if cu_seqlens is not None:
        o = _unpad(o, lens)
    return o.to(dtype), (s if output_final_state else None)


def recurrent_gated_delta_summary(q, k, v, g, beta, *, cu_seqlens, scale=None, use_qk_l2norm_in_kernel=False,
                                  max_len=None, factors=False, values=False):
    """Every run of a varlen batch from zero, with its transition: K value columns appended ([v | 0]),
    the state started at [0 | I] (max_len: a bound on the run lengths, a hint for fast backends). Returns (o [N, HV, V], u [N, HV, K] the appended columns' outputs,
    in v's dtype; final [R, HV, K, V + K] fp32 = [S | T] per run).
    factors: the transition in its factored form instead, (o, u, S [R, HV, K, V], F [R, HV, 2 w + 1, K]) fp32, w =
    factor_width(max_len) (`run_factors`); with values too, the runs' WY-solved values U [R, HV, w, V] in S's place
    (`run_values`: S = Kd^T U, `values_to_state`)."""
    if values and not factors:
        raise ValueError("values (U) come with the factors")
    r = cu_seqlens.shape[0] - 1
    hv, dv, dk = v.shape[-2], v.shape[-1], k.shape[-1]
    init = torch.cat([torch.zeros(r, hv, dk, dv, device=v.device),
                      torch.eye(dk, device=v.device).expand(r, hv, dk, dk)], dim=-1)
    va = torch.cat([v, v.new_zeros(v.shape[:-1] + (dk,))], dim=-1)
    o, final = recurrent_gated_delta_rule(q, k, va, g, beta, scale=scale, initial_state=init, output_final_state=True,
                                          cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    if factors:
        if max_len is None:
            max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max()) if r else 1
        w = factor_width(max_len)
        f = run_factors(k, g, beta, cu_seqlens, w, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
        if values:
            return o[0, ..., :dv], o[0, ..., dv:], run_values(k, v, g, beta, cu_seqlens, w,
                                                              use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel), f
        return o[0, ..., :dv], o[0, ..., dv:], final[..., :dv].contiguous(), f
    return o[0, ..., :dv], o[0, ..., dv:], final


CHUNK_MAX = 64      # longest run a short-run summary takes as one chunk (ops/triton_summary.py's kernel; the query tail)


def factor_width(max_len: int) -> int:
    """Rows of each factor of a short run's transition (`run_factors`): the run length bound rounded up to a power
    of two, at least 16 (the least size of a tensor-core product)."""
    return max(16, 1 << (max(int(max_len), 1) - 1).bit_length())


def run_factors(k, g, beta, cu_seqlens, width: int, *, use_qk_l2norm_in_kernel=False) -> torch.Tensor:
    """The transition of each run (from zero, tokens t = 1..L <= width) in factored (WY) form:

        T = gamma I - Kd^T W,    gamma = exp(G_L),    Kd_t = exp(G_L - G_t) k_t,
        W = (I + A)^-1 diag(beta exp(G)) K,    A[t, s] = beta_t exp(G_t - G_s) k_t.k_s (s < t)

    (G_t the cumulative log decay from the run's start; the chunked form's factors with S_0 = I). A step of
    a chain through the run is then x <- gamma x - Kd^T (W x) + S: two products through a rank-L
    factor instead of a dense K x K one. Returns F [R, HV, 2 width + 1, K] fp32: rows 0..width-1 Kd, rows
    width..2 width-1 W (rows past a run's length zero), row 2 width [gamma, 0, ...]."""
    r = cu_seqlens.shape[0] - 1
    hv, dk = g.shape[-1], k.shape[-1]
    out = torch.zeros(r, hv, 2 * width + 1, dk, dtype=torch.float32, device=k.device)
    if r == 0:
        return out
    k, beta, _, G, system = _run_systems(cu_seqlens, width, k, g, beta,
                                         use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    n = k.shape[2]
    GL = G[..., -1:]
    w = torch.linalg.solve_triangular(system, (beta * G.exp())[..., None] * k, upper=False, unitriangular=True)
    out[:, :, :n] = k * (GL - G).exp()[..., None]
    out[:, :, width : width + n] = w
    out[:, :, 2 * width, 0] = GL[..., 0].exp()
    return out


def run_values(k, v, g, beta, cu_seqlens, width: int, *, use_qk_l2norm_in_kernel=False) -> torch.Tensor:
    """Each run's WY-solved values (from zero, tokens t = 1..L <= width): U = (I + A)^-1 diag(beta) V with the system
    of `run_factors`, so that the run's zero-start state is S = Kd^T U (Kd the decayed keys of its factors). Returns
    U [R, HV, width, V] fp32, rows past a run's length zero."""
    r = cu_seqlens.shape[0] - 1
    hv, dv = v.shape[-2], v.shape[-1]
    out = torch.zeros(r, hv, width, dv, dtype=torch.float32, device=v.device)
    if r == 0:
        return out
    k, beta, (v,), _, system = _run_systems(cu_seqlens, width, k, g, beta, v,
                                            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    out[:, :, : k.shape[2]] = torch.linalg.solve_triangular(system, beta[..., None] * v, upper=False,
                                                            unitriangular=True)
    return out


def _run_systems(cu_seqlens, width: int, k, g, beta, *rest, use_qk_l2norm_in_kernel=False):
    """The runs of a varlen batch padded to [R, HV, L, ...] in fp32 (k expanded to the value heads, l2-normalised if
    asked; rest: more per-token tensors of the value heads) with each run's WY system (`_ut_system`): (k, beta, rest,
    G, system). `run_factors` and `run_values` solve it for W and U."""
    hv = g.shape[-1]
    (k, g, beta, *rest), lens = _pad_varlen((k, g, beta, *rest), cu_seqlens)        # [R, L, ...]
    if max(lens) > width:
        raise ValueError(f"a run of {max(lens)} tokens; the factors hold {width}")
    k = _expand_heads(k, hv).float()
    if use_qk_l2norm_in_kernel:
        k = l2norm(k)
    k, g, beta = k.transpose(1, 2), g.float().transpose(1, 2), beta.float().transpose(1, 2)      # [R, HV, L]
    rest = tuple(x.float().transpose(1, 2) for x in rest)
    G, _, system = _ut_system(k, g, beta)
    return k, beta, rest, G, system


def factors_to_dense(S: torch.Tensor, fac: torch.Tensor) -> torch.Tensor:
    """S [R, HV, K, V] and the factors [R, HV, 2 w + 1, K] (`run_factors`) -> [S | T] [R, HV, K, V + K] fp32."""
    w = (fac.shape[-2] - 1) // 2
    eye = torch.eye(fac.shape[-1], dtype=torch.float32, device=fac.device)
    T = fac[..., 2 * w, :1, None].float() * eye - fac[..., :w, :].transpose(-1, -2).float() @ fac[..., w : 2 * w, :].float()
    return torch.cat([S.float(), T], dim=-1)


def values_to_state(U: torch.Tensor, fac: torch.Tensor) -> torch.Tensor:
    """The runs' zero-start states S = Kd^T U [R, HV, K, V] fp32 from their WY-solved values U [R, HV, w, V]
    (`run_values`) and factors [R, HV, 2 w + 1, K] (`run_factors`: Kd its first w rows)."""
    w = (fac.shape[-2] - 1) // 2
    return fac[..., :w, :].transpose(-1, -2).float() @ U.float()


def gated_delta_tail(o, u, s0, U, fac, cu) -> torch.Tensor:
    """The compose pass's query tail (runtime/compose_graph.py QUERY_TAIL): the query's runs (pieces of at most w
    tokens, summarized from zero with the others) outside the chain, walked from the state s0 [HV, K, V] the chain left
    before them. o [N, HV, V]: the pass's outputs, on the tail's rows their outputs from zero; u [N, HV, K]: the
    readout of every row; U [R, HV, w, V], fac [R, HV, 2 w + 1, K]: the tail runs' WY values and factors (`run_values`,
    `run_factors`); cu [R + 1] (device): their rows, run j at cu[j]..cu[j+1]-1. With x = s0, for each run in turn:

        o_t += x^T u_t on its rows,    then x <- gamma x + Kd^T (U - W x)   (= T x + S)

    in place in o (each row rounded once), the rows from cu[R] on (the pads') zeroed; returns the state after the last
    run, [HV, K, V] fp32. Device tensors only (no host read: CUDA-graph safe)."""
    w = U.shape[-2]
    x = s0.float()
    rows = torch.arange(o.shape[0], device=o.device)[:, None, None]
    uf = u.float()
    for j in range(U.shape[0]):
        kd, wf, gamma = fac[j, :, :w].float(), fac[j, :, w : 2 * w].float(), fac[j, :, 2 * w, :1, None].float()
        run = torch.einsum("nhk,hkv->nhv", uf, x).add_(o.float()).to(o.dtype)
        o.copy_(torch.where((rows >= cu[j]) & (rows < cu[j + 1]), run, o))
        x = torch.baddbmm(gamma * x, kd.transpose(1, 2), U[j].float() - torch.bmm(wf, x))
    o.masked_fill_(rows >= cu[U.shape[0]], 0)
    return x


def pair_maps(fac: torch.Tensor, U: torch.Tensor, T_e: torch.Tensor | None = None,
              S_e: torch.Tensor | None = None) -> torch.Tensor:
    """Each run's map composed with the cached map after it, from the run's factors and values: with
    T_r = g I - Kd^T W and S_r = Kd^T U, the pair (run, then (T_e, S_e)) maps x to T_e (T_r x + S_r) + S_e, i.e.

        [c | M] = [S_e + P U | g T_e - P W],    P = T_e Kd^T

    fac [R, HV, 2 w + 1, K], U [R, HV, w, V]; T_e [R, HV, K, K] and S_e [R, HV, K, V] (None: every run alone, its
    own [S_r | T_r]). Returns [R, HV, K, V + K] fp32 (the dense composition the Triton kernel
    `ops/triton_scan.pair_lowrank` forms by three thin products)."""
    w = (fac.shape[-2] - 1) // 2
    kd, wf, g = fac[..., :w, :].float(), fac[..., w : 2 * w, :].float(), fac[..., 2 * w, :1, None].float()
    if T_e is None:
        T_e = torch.eye(fac.shape[-1], dtype=torch.float32, device=fac.device).expand(*fac.shape[:2], -1, -1)
    T_e = T_e.float()
    P = T_e @ kd.transpose(-1, -2)
    c = P @ U.float()
    if S_e is not None:
        c = c + S_e.float()
    return torch.cat([c, g * T_e - P @ wf], dim=-1)


def transition_by_augment(chunk, q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                          use_qk_l2norm_in_kernel=False):
    """chunk_gated_delta_transition from a backend's chunk_gated_delta_rule: K zero value columns appended,
    their initial state the identity (compose/transition.py `augment`)."""
    from ...compose.transition import augment

    dv, dk = v.shape[-1], k.shape[-1]
    r = 1 if cu_seqlens is None else cu_seqlens.shape[0] - 1
    init = (torch.zeros(r, v.shape[-2], dk, dv, device=v.device) if initial_state is None
            else initial_state.float())
    va, init_aug = augment(v, init, dk)
    o, final = chunk(q, k, va, g, beta, scale=scale, initial_state=init_aug, output_final_state=True,
                     cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o[..., :dv], final[..., :dv], final[..., dv:]


def chunk_gated_delta_transition(q, k, v, g, beta, *, scale=None, initial_state=None, cu_seqlens=None,
                                 use_qk_l2norm_in_kernel=False):
    """The chunked recurrence from `initial_state` that also gives each run's transition T (state after =
    T @ state before + the zero-start state after). Returns (o [B, N, HV, V], final [R, HV, K, V] fp32,
    T [R, HV, K, K] fp32)."""
    return transition_by_augment(chunk_gated_delta_rule, q, k, v, g, beta, scale=scale, initial_state=initial_state,
                                 cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def isolated_by_parts(chunk, transition, q, k, v, g, beta, *, cu_seqlens, seams, scale=None,
                      use_qk_l2norm_in_kernel=False):
    """chunk_gated_delta_isolated from two plain ops (a backend's chunk_gated_delta_rule and
    chunk_gated_delta_transition): the sequences whole from zero, then the rest of each (after its seam)
    again from zero with its transition."""
    o, final = chunk(q, k, v, g, beta, scale=scale, output_final_state=True, cu_seqlens=cu_seqlens,
                     use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    cu = cu_seqlens.tolist()
    idx = torch.cat([torch.arange(a + w, b) for a, b, w in zip(cu[:-1], cu[1:], seams)]).to(q.device)
    cu_rest = torch.tensor([0] + [b - a - w for a, b, w in zip(cu[:-1], cu[1:], seams)]).cumsum(0)
    _, s0, t = transition(q[:, idx], k[:, idx], v[:, idx], g[:, idx], beta[:, idx], scale=scale,
                          cu_seqlens=cu_rest, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    return o, final, t, s0


def chunk_gated_delta_isolated(q, k, v, g, beta, *, cu_seqlens, seams, scale=None, use_qk_l2norm_in_kernel=False):
    """An isolated prefill's linear layer in one op: every sequence (cu_seqlens, on the CPU) from a zero
    state, and the zero-start summary of each one's rest, the tokens after its first seams[i] (>= 1 left).
    Returns (o [B, N, HV, V], final [R, HV, K, V] fp32, T [R, HV, K, K] fp32, S [R, HV, K, V] fp32): T and S
    of the rest, so that the state after it is T @ (the state before it) + S."""
    return isolated_by_parts(chunk_gated_delta_rule, chunk_gated_delta_transition, q, k, v, g, beta,
                             cu_seqlens=cu_seqlens, seams=seams, scale=scale,
                             use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)


def _ut_system(k, g, beta):
    """Within a chunk (tokens on the second-last axis of k, the last of g and beta): the cumulative log decay
    G, exp(G_t - G_s) for s <= t (else 0), and the unit lower-triangular system I + A of the WY form,
    A[t, s] = beta_t exp(G_t - G_s) k_t.k_s for s < t."""
    c = k.shape[-2]
    G = g.cumsum(-1)
    lower = torch.ones(c, c, dtype=torch.bool, device=k.device).tril()
    decay = (G[..., :, None] - G[..., None, :]).masked_fill(~lower, float("-inf")).exp()
    strict = decay.masked_fill(lower & ~lower.tril(-1), 0.0)            # s < t only
    system = torch.eye(c, device=k.device) + beta[..., :, None] * (k @ k.transpose(-1, -2)) * strict
    return G, decay, system


def chunk_state_pass(u0, w, k_tail, chunk_decay, init):
    """The states entering each chunk of the chunked delta-rule forms, and the final state: per chunk i,
    s_{i+1} = s_i * d_i + k_tail_i^T (u0_i - w_i s_i). u0 [B, H, n, C, V], w / k_tail [B, H, n, C, K],
    chunk_decay [B, H, n, K] (per key row; a scalar decay expanded), init [B, H, K, V] fp32. Returns
    (starts [B, H, n, K, V], final [B, H, K, V]); the outputs are then one batched product for every chunk.
    (A log-depth scan of the chunks' affine maps was tried for the GPU's sake: ~3% fewer launches in a PIC-train
    step than this loop, at n log n [K, K] maps kept for the backward, >15 GB on the CPU for one step: not kept.)"""
    starts = []
    s = init
    for i in range(u0.shape[2]):
        starts.append(s)
        s = s * chunk_decay[:, :, i, :, None] + k_tail[:, :, i].transpose(-1, -2) @ (u0[:, :, i] - w[:, :, i] @ s)
    return torch.stack(starts, dim=2), s


def _varlen_chunks(x, tok, m: int, c: int):
    """[1, T, H, *] packed -> [1, H, M, C, *] at _chunk_layout's token slots (pad slots: zero rows, inert: see
    _pad_varlen)."""
    xz = torch.cat([x[0], x.new_zeros((1,) + tuple(x.shape[2:]))])[tok]
    return xz.reshape(m, c, *x.shape[2:]).movedim(2, 0)[None]


def _chunk_outputs(q_decay, qk, u0, w, k_tail, chunk_decay, s0, t=None, varlen=None):
    """The chunked forms' finish: the chunk states walked in order, every chunk's outputs from its entering state.
    Dense: inputs [B, H, n, C, *] (chunk_decay [B, H, n, K]), the first t tokens kept. Varlen (varlen = (grid, place,
    back) of _chunk_layout): inputs [1, H, M, C, *], the states walked on the [N, n_max] grid (cells past a sequence's
    end are identity maps), the tokens put back in packed order. s0 [B or N, H, K, V].
    Returns (o [B, T, H, V], final)."""
    b, h, m, c, dv = *u0.shape[:4], u0.shape[-1]
    dk = w.shape[-1]
    if varlen is None:
        starts, s = chunk_state_pass(u0, w, k_tail, chunk_decay, s0)
        o = q_decay @ starts + qk @ (u0 - w @ starts)
        return o.reshape(b, h, -1, dv)[:, :, :t].transpose(1, 2), s
    grid, place, back = varlen

    def on_grid(x, fill):           # [1, H, M, *] -> [N, H, n_max, *], cells past a sequence's end `fill`
        xz = torch.cat([x[0], torch.full_like(x[0, :, :1], fill)], dim=1)[:, grid]       # [H, N, n_max, *]
        return xz.transpose(0, 1)

    starts, s = chunk_state_pass(on_grid(u0, 0.0), on_grid(w, 0.0), on_grid(k_tail, 0.0), on_grid(chunk_decay, 1.0), s0)
    starts = starts.transpose(0, 1).reshape(h, -1, dk, dv)[:, place][None]            # [1, H, M, K, V]
    o = q_decay @ starts + qk @ (u0 - w @ starts)                                       # [1, H, M, C, V]
    return o[0].reshape(h, m * c, dv)[:, back].transpose(0, 1)[None], s                # [1, T, H, V]


def chunk_gated_delta_rule(
    q, k, v, g, beta, *, scale=None, initial_state=None, output_final_state=False,
    cu_seqlens=None, use_qk_l2norm_in_kernel=False, chunk_size=64,
):
    """Chunked (WY / UT-transform) form of the same recurrence, fp32 inside.

    Within a chunk, with G_t the cumulative log decay from the chunk start and S_0 the state
    entering the chunk, the write vectors u_t solve the unit lower-triangular system
        (I + A) U = beta*V - diag(beta exp(G)) K S_0,   A[t,s] = beta_t exp(G_t - G_s) k_t.k_s (s < t)
    and then
        o_t = exp(G_t) S_0^T q_t + sum_{s<=t} exp(G_t - G_s) (q_t.k_s) u_s
        S_C = exp(G_C) S_0 + sum_s exp(G_C - G_s) k_s u_s^T.
    """
    dtype = v.dtype
    q, k, v, g, beta = _prepare(q, k, v, g, beta, scale, use_qk_l2norm_in_kernel)
    dk, dv, c = k.shape[-1], v.shape[-1], chunk_size
    if cu_seqlens is not None:
        # every sequence's chunks side by side (_chunk_layout: each padded to a multiple of c, not to the longest), the
        # per-chunk terms computed once for all of them, the chunk states walked on a [N, n_max] grid whose cells past
        # a sequence's end are identity maps (the layout chunk_kda uses; padding an isolated prefill's 8 segments of
        # 256-2,048 tokens to the longest had doubled its CPU time)
        if q.shape[0] != 1:
            raise ValueError("varlen inputs must be packed as a batch of one")
        tok, grid, back, place, lens = _chunk_layout(cu_seqlens, c, q.device)
        n_seq, m, hv = len(lens), tok.shape[0] // c, v.shape[2]
        if m == 0:                  # no tokens: nothing written, every state as it entered
            s0 = q.new_zeros(n_seq, hv, dk, dv) if initial_state is None else initial_state.float()
            return v.new_zeros(v.shape).to(dtype), (s0 if output_final_state else None)
        q, k, v, g, beta = (_varlen_chunks(x, tok, m, c) for x in (q, k, v, g, beta))
        b = 1
    else:
        b, t, hv = v.shape[:3]
        pad = (-t) % c
        # -> [B, HV, n_chunks, C, ...]
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).reshape(b, hv, -1, c, x.shape[-1]) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)).transpose(1, 2).reshape(b, hv, -1, c) for x in (g, beta))
    G, decay, system = _ut_system(k, g, beta)                   # [B, HV, n, C], exp(G_t - G_s) for s <= t
    rhs_v = beta[..., None] * v
    rhs_s = (beta * G.exp())[..., None] * k
    sol = torch.linalg.solve_triangular(system, torch.cat([rhs_v, rhs_s], dim=-1), upper=False, unitriangular=True)
    u0, w = sol[..., :dv], sol[..., dv:]                        # U = u0 - w @ S_0
    qk = (q @ k.transpose(-1, -2)) * decay
    q_decay = q * G.exp()[..., None]
    k_tail = k * (G[..., -1:] - G).exp()[..., None]
    chunk_decay = G[..., -1].exp()[..., None].expand(*G.shape[:-1], dk)     # [B, HV, n, K]
    s0 = q.new_zeros(b if cu_seqlens is None else n_seq, hv, dk, dv) if initial_state is None else initial_state.float()
    o, s = _chunk_outputs(q_decay, qk, u0, w, k_tail, chunk_decay, s0, t=None if cu_seqlens is not None else t,
                          varlen=None if cu_seqlens is None else (grid, place, back))
    return o.to(dtype), (s if output_final_state else None)
