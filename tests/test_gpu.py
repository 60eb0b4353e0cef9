"""GPU-only checks (skipped without CUDA; CI has none): the fast backend's CUDA kernels against the
reference ops on small shapes, the Triton chain scan, and a whole model in bf16. The full-size
checks and their justified bounds live in benchmarks/gpu_check.py (one device call).

On every machine: the GPU modules import cleanly (fla and triton are optional there).
"""

import importlib
import importlib.util

import pytest
import torch

from hypic.ops import fast, reference as ref

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def rel(x, y):
    x, y = x.double().cpu(), y.double().cpu()
    return float((x - y).norm() / y.norm())


needs_triton = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                  reason="needs triton (its CPU interpreter)")


def _run_in_interpreter(code: str) -> None:
    """Run `code` in a fresh Python with Triton's CPU interpreter chosen (it is chosen when triton is imported, so a
    subprocess) and require it to print "ok" last."""
    import os
    import subprocess
    import sys

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


@needs_triton
def test_compose_kernels_build_for_sm90():
    """No GPU needed (CI has triton): every configuration of the compose pass's Triton kernels that the runtime may
    launch (the chain scan's tuner configurations in the compose pass's form, dense and factored, and those with the
    walk by position within the H200's shared memory; the attention, its
    fold, the pair maps, the query tail, the key ordering, the experts, the summaries: benchmarks/kernel_resources.py's
    builds) compiles for sm_90a with the ptxas Triton ships, at most 255 registers; the defaults also fit the H200's
    shared memory. Triton's interpreter runs source the compiler may refuse: H100 run 111 found the chain's from-zero
    prologue (a helper with a return in each branch of an `if`) unbuildable only on the device. A subprocess: the
    builds import triton for a compile target, not the interpreter."""
    if torch.cuda.is_available():
        pytest.skip("the GPU builds and runs the kernels itself (the tests above)")
    import os
    import subprocess
    import sys
    from pathlib import Path

    code = r'''
import sys
sys.path.insert(0, "benchmarks")
import kernel_resources as kr
from hypic.ops import triton_scan as ts
for bv, w, st in ts._CONFIGS:                      # the compose pass's form (corrected outputs), every tuner pick
    for factors in (False, True):
        r = kr.scan_build(bv=bv, warps=w, stages=st, factors=factors)
        assert r["registers"] is not None and r["registers"] <= 255, (bv, w, st, factors, r)
        if not factors and ts.position_fits(128, bv):       # with the walk by position: it must also fit
            assert r["shared"] <= kr.SMEM_LIMIT, (bv, w, st, r)
import torch
default = kr.scan_build(*ts._default(1, 32, 128, torch.device("cpu")))
assert default["shared"] <= kr.SMEM_LIMIT, default
rows = kr.other_builds()
assert len(rows) > 40
for name, cfg, (regs, spill, shared) in rows:
    assert regs is not None and regs <= 255 and shared <= kr.SMEM_LIMIT, (name, cfg, regs, shared)
print("ok")
'''
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, "-c", code], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), (r.stdout[-2000:], r.stderr[-3000:])


def test_gpu_modules_import_everywhere():
    importlib.import_module("hypic.ops.fast")
    importlib.import_module("hypic.compose.scan")
    try:                                   # needs triton; on a CPU machine it may be missing
        importlib.import_module("hypic.ops.triton_scan")
    except ImportError:
        pass
    assert isinstance(fast.fla_available(), bool)


def _gdn_inputs(lens, seed: int, h=2, hv=4, dk=64, dv=32):
    """Gated-delta-rule inputs on CUDA for a varlen batch: bf16 q, k, v, beta, fp32 log decays in
    [log 0.9, log 0.999], a small fp32 initial state per run, CPU cu_seqlens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    n = sum(lens)
    q = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, n, hv, dv, device="cuda", generator=g).bfloat16()
    gate = torch.empty(1, n, hv, device="cuda").uniform_(0.9, 0.999, generator=g).log()
    beta = torch.rand(1, n, hv, device="cuda", generator=g).bfloat16()
    init = torch.randn(len(lens), hv, dk, dv, device="cuda", generator=g) * 0.1
    return q, k, v, gate, beta, init, torch.tensor([0] + list(lens)).cumsum(0)


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
def test_fla_hgrn_diagonal_scan_matches_reference():
    """The RG-LRU's elementwise scan through fla's fused recurrent HGRN kernel (varlen, initial states, fp32 in and
    out) against the reference token loop: the same fp32 products in the same order, so equal to rounding."""
    g = torch.Generator(device="cuda").manual_seed(0)
    lens = [1, 9, 70, 200]
    n = sum(lens)
    x = torch.randn(1, n, 384, device="cuda", generator=g)
    gs = torch.empty(1, n, 384, device="cuda").uniform_(0.5, 0.999, generator=g).log()
    h0 = torch.randn(len(lens), 384, device="cuda", generator=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    kw = dict(initial_state=h0, output_final_state=True, cu_seqlens=cu)
    o0, s0 = ref.recurrent_diagonal_scan(x, gs, **kw)
    for fn in (fast.chunk_diagonal_scan, fast.recurrent_diagonal_scan):
        o1, s1 = fn(x, gs, **kw)
        assert "hgrn" not in fast.FAILED
        assert o1.dtype == s1.dtype == torch.float32
        assert rel(o1, o0) < 1e-5 and rel(s1, s0) < 1e-5


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
@pytest.mark.parametrize("dk", [16, 128])
def test_fla_kda_matches_reference(dk):
    """KDA through fla's chunk and fused recurrent kernels (varlen, initial states, per-channel log decays computed
    outside, qk l2norm in the kernel) against the fp32 reference: bf16 operands, the bound of the gated delta rule's
    test; decays from slow (0.999) to strong (e^-4 per step: a 64-token chunk's cumulative decay e^-256, which a
    chunked form must not turn into inf * 0). Head dims 16 (the tiny presets) and 128 (Kimi-Linear's)."""
    g = torch.Generator(device="cuda").manual_seed(1)
    lens, h = [1, 9, 70, 200], 4
    n = sum(lens)
    q = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    gate = -torch.empty(1, n, h, dk, device="cuda").uniform_(0.001, 4.0, generator=g)
    beta = torch.rand(1, n, h, device="cuda", generator=g).bfloat16()
    init = torch.randn(len(lens), h, dk, dk, device="cuda", generator=g) * 0.1
    cu = torch.tensor([0] + lens).cumsum(0)
    kw = dict(g=gate, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True,
              initial_state=init)
    o0, s0 = ref.recurrent_kda(q.float(), k.float(), v.float(), **kw)
    for fn in (fast.chunk_kda, fast.recurrent_kda):
        o1, s1 = fn(q, k, v, **kw)
        assert "kda" not in fast.FAILED, fn.__name__
        assert o1.dtype == torch.bfloat16 and s1.dtype == torch.float32
        assert bool(o1.isfinite().all()) and rel(o1, o0) < 2e-2 and rel(s1, s0) < 2e-2, fn.__name__


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
def test_fla_gated_delta_rule_matches_reference():
    q, k, v, gate, beta, init, cu = _gdn_inputs([1, 9, 70, 200], seed=0)
    kw = dict(g=gate, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, output_final_state=True,
              initial_state=init)
    o0, s0 = ref.chunk_gated_delta_rule(q.float(), k.float(), v.float(), **kw)
    o1, s1 = fast.chunk_gated_delta_rule(q, k, v, **kw)
    assert rel(o1, o0) < 2e-2 and rel(s1, s0) < 2e-2          # bf16 operands (gpu_check.py's bound)
    # fla's stages called one by one (the default) against its chunk function: the same kernels in the same order
    fast.CHUNK_BY_STAGES = False
    try:
        o2, s2 = fast.chunk_gated_delta_rule(q, k, v, **kw)
    finally:
        fast.CHUNK_BY_STAGES = True
    assert rel(o1, o2) < 1e-6 and rel(s1, s2) < 1e-6


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
def test_fla_transition_stages_match_reference():
    """The isolated prefill's summary on fla's stages (the transition through the state passing only) against
    the fp32 reference, and against the same through fla's whole pipeline on appended columns: bf16 operands
    (the bound of the chunk check above); the two fla forms run the same state-passing kernel on the T
    columns, so they agree to its rounding."""
    q, k, v, gate, beta, init, cu = _gdn_inputs([70, 200, 1], seed=4)
    kw = dict(g=gate, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, initial_state=init)
    want = ref.chunk_gated_delta_transition(q.float(), k.float(), v.float(), **kw)
    got = fast.chunk_gated_delta_transition(q, k, v, **kw)
    fast.TRANSITION_STAGES = False
    try:
        whole = fast.chunk_gated_delta_transition(q, k, v, **kw)
    finally:
        fast.TRANSITION_STAGES = True
    for a, b, c in zip(got, want, whole):
        assert a.shape == b.shape and rel(a, b) < 2e-2 and rel(a, c) < 1e-2


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
def test_transition_kernel_matches_fla_and_reference():
    """The runs' transitions from the forward's WY factors (ops/triton_transition.py, fast.TRANSITION_KERNEL, the
    default) against fla's chunk-state pass from the identity and the fp32 reference: both read the same bf16 keys and WY
    factors. In its default form the kernel multiplies by bf16 copies of the state as fla's pass does (the two
    within the bf16 bound of the chunk checks, 2e-2, of each other and of the reference); in its "tf32" form by tf32
    roundings of it (8x finer), no farther from the reference than fla's pass (both read the same bf16 WY factors,
    whose rounding dominates; 5% and 1e-4 of slack for the reference's own fp32 rounding). Square and non-square
    heads, GQA."""
    from hypic.ops import triton_transition

    for dv in (32, 64):
        q, k, v, gate, beta, init, cu = _gdn_inputs([70, 200, 1, 700], seed=7, dv=dv)
        kw = dict(g=gate, beta=beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, initial_state=init)
        want = ref.chunk_gated_delta_transition(q.float(), k.float(), v.float(), **kw)[2]
        was = fast.TRANSITION_KERNEL
        try:
            fast.TRANSITION_KERNEL = True
            got = fast.chunk_gated_delta_transition(q, k, v, **kw)[2]           # "bf16": fla's arithmetic
            assert "transitions" not in fast.FAILED
            fast.TRANSITION_KERNEL = False
            old = fast.chunk_gated_delta_transition(q, k, v, **kw)[2]           # fla's chunk-state pass
        finally:
            fast.TRANSITION_KERNEL = was
        assert rel(got, old) < 2e-2 and rel(got, want) < 2e-2, (dv, rel(got, old), rel(got, want))
        # "tf32": the same on the forward's own factors, from fp32 copies of the state
        st = fast._fla_stages()
        qq, kk, vv, bb, sc = fast._stages_prepare(st, q, k, v, beta, None, True)
        _, _, reuse = fast._stages_forward(st, qq, kk, vv, gate, bb, sc, cu, init.float().contiguous())
        w, gc, _, _, _ = reuse
        bounds = torch.stack([cu[:-1], cu[1:]], 1).to(torch.int32).cuda()
        t32 = triton_transition.transitions(kk, w, gc, bounds, precision="tf32")
        assert rel(t32, want) <= 1.05 * rel(old, want) + 1e-4, (dv, rel(t32, want), rel(old, want))


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
@pytest.mark.parametrize("lens,seams", [([70, 200, 129], [8, 8, 5]), ([40, 300], [8, 64]), ([9], [8])])
def test_fla_isolated_prefill_matches_reference(lens, seams):
    """An isolated prefill's linear layer in one pass on fla's stages (every sequence cut after its seam window
    into two pieces of one layout, the rests from the seams' states) against the fp32 reference (whole
    sequences, then the rests from zero): bf16 operands, the bound of the chunk checks above. Sequences
    shorter than a chunk, a seam of a whole chunk, a rest of one token."""
    q, k, v, gate, beta, _, cu = _gdn_inputs(lens, seed=5)
    kw = dict(g=gate, beta=beta, cu_seqlens=cu, seams=seams, use_qk_l2norm_in_kernel=True)
    want = ref.chunk_gated_delta_isolated(q.float(), k.float(), v.float(), **kw)
    got = fast.chunk_gated_delta_isolated(q, k, v, **kw)
    for name, a, b in zip(("o", "final", "T", "S"), got, want):
        assert a.shape == b.shape and rel(a, b) < 2e-2, name


@cuda
def test_triton_scan_matches_fp64():
    pytest.importorskip("triton")
    from hypic.compose.scan import scan_dense, scan_dense_reference

    g = torch.Generator(device="cuda").manual_seed(1)
    cu = [0, 5, 5, 12]
    init = torch.randn(3, 4, 64, 32, device="cuda", generator=g)
    T = torch.randn(cu[-1], 4, 64, 64, device="cuda", generator=g) / 8 * 0.9
    S = torch.randn(cu[-1], 4, 64, 32, device="cuda", generator=g)
    b1, f1 = scan_dense(init, T, S, cu)
    b0, f0 = scan_dense_reference(init.double(), T.double(), S.double(), cu)
    assert rel(b1, b0) < 1e-5 and rel(f1, f0) < 1e-5           # tf32x3: fp32-level
    # the compose graph's form: one chain through a slot order, runs' [S | T] read in place
    runs = torch.cat([torch.randn(4, 4, 64, 32, device="cuda", generator=g),
                      torch.randn(4, 4, 64, 64, device="cuda", generator=g) / 8 * 0.9], dim=-1)
    order = torch.tensor([12, 0, 13, 1, 2, 14, 3, 4, 5, 6, 7, 8, 15, 9, 10, 11], dtype=torch.int32, device="cuda")
    cu1 = torch.tensor([0, 16], dtype=torch.int32, device="cuda")
    b1, f1 = scan_dense(init[:1], T, S, cu1, order=order, runs=runs)
    b0, f0 = scan_dense_reference(init[:1].double(), T.double(), S.double(), cu1, order, runs.double())
    assert b1.shape[0] == 16 and rel(b1, b0) < 1e-5 and rel(f1, f0) < 1e-5


@cuda
def test_triton_scan_steps_matches_fp64():
    """The compose pass's step-table scan at the 35B model's shape (K = V = 128, 32 heads, a chain of 20 seam runs
    and 20 cached maps, then 4 query runs; the runs' outputs corrected in place), in every configuration the tuner
    may pick, against the fp64 chain: tf32x3 products are fp32-level (1e-5 relative after 44 maps of spectral norm
    ~0.9, as test_triton_scan_matches_fp64)."""
    pytest.importorskip("triton")
    from hypic.compose import scan as sc
    from hypic.ops import triton_scan

    g = torch.Generator(device="cuda").manual_seed(3)
    H, K, V, E, N, L = 32, 128, 128, 20, 24, 8
    init = torch.randn(1, H, K, V, device="cuda", generator=g)
    T = torch.randn(E, H, K, K, device="cuda", generator=g) / K ** .5 * .9
    S = torch.randn(E, H, K, V, device="cuda", generator=g)
    runs = torch.cat([torch.randn(N, H, K, V, device="cuda", generator=g),
                      torch.randn(N, H, K, K, device="cuda", generator=g) / K ** .5 * .9], -1).contiguous()
    order = [m for i in range(E) for m in (E + i, i)] + list(range(2 * E, E + N))    # seam, segment, ..., query
    b0, f0 = sc.scan_dense_reference(init.double(), T.double(), S.double(), [0, len(order)], order, runs.double())
    rows, t0 = [], 0
    for m in order:
        if m < E:
            rows.append([T[m].data_ptr(), S[m].data_ptr(), 0, m, 0, 0])
        else:
            off = (m - E) * H * K * (V + K) * 4
            rows.append([off, off, 1, m, t0, L])
            t0 += L
    steps = torch.tensor(rows, dtype=torch.int64, device="cuda")
    cu = torch.tensor([0, len(order)], dtype=torch.int32, device="cuda")
    outs = torch.randn(t0, H, V + K, device="cuda", generator=g)
    runs_in_order = [m for m in order if m >= E]
    want = outs[..., :V].double() + torch.einsum(
        "nhk,nhkv->nhv", outs[..., V:].double(), b0[runs_in_order].double().repeat_interleave(L, 0))
    from triton.runtime.errors import OutOfResources

    built = []
    # (the prefetching form, gpu_bench's scan_prefetch, in the configurations it would be tuned over: stages unused)
    forms = [(cfg, False) for cfg in triton_scan._CONFIGS] + [(cfg, True) for cfg in triton_scan._CONFIGS if cfg[2] == 1]
    for cfg, pre in forms:                           # a configuration that cannot be built is skipped, as the tuner does
        for correct in (False, True):
            try:
                if correct:
                    got = outs.clone()
                    triton_scan.scan_steps(init, steps, cu, runs, E + N, outputs=got, max_run=L, bv=cfg[0],
                                           warps=cfg[1], stages=cfg[2], prefetch=pre)
                else:
                    b1, f1 = triton_scan.scan_steps(init, steps[:, :4].contiguous(), cu, runs, E + N, bv=cfg[0],
                                                    warps=cfg[1], stages=cfg[2], prefetch=pre)
            except OutOfResources:            # H200 run 41: (64, 8, 2) with the correction needs 279 KB of shared memory
                continue
            if not pre:
                built.append((cfg, correct))
            if correct:
                assert rel(got[..., :V], want) < 1e-5, cfg
            else:
                assert rel(f1, f0) < 1e-5 and rel(b1[E:], b0[E:]) < 1e-5, cfg
    defaults = {triton_scan._default(1, H, V, init.device) + (c,) for c in (False, True)}
    assert defaults <= {cfg + (c,) for cfg, c in built}           # the untuned default always builds


@cuda
def test_triton_scan_pairs_matches_fp64():
    """The pairs made inside the chain scan (ops/triton_scan.scan_pairs, PAIRS_IN_SCAN) at the 35B model's shape: a
    cached map from zero, then 20 seam runs of 8 tokens each with the cached map after it and 4 query runs alone, by
    position, each run from its factors and values. The final state within 1e-5 of the fp64 chain (the step-table
    scan's tolerance) in every configuration the tuner may pick that builds; the corrected bf16 outputs within their
    rounding (2^-8) of the fp64 correction, and within 2^-7 of the pair kernel's chain (`pair_lowrank`, then
    `scan_steps` by position)."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from hypic.compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
    from hypic.ops import triton_scan
    from hypic.ops.reference.gated_delta import factors_to_dense

    g = torch.Generator(device="cuda").manual_seed(6)
    H, K, V, E, L, WF, Q = 32, 128, 128, 20, 8, 16, 4
    n = E + Q
    T = torch.randn(E + 1, H, K, K, device="cuda", generator=g) / K ** .5 * .9
    S = torch.randn(E + 1, H, K, V, device="cuda", generator=g)
    F = torch.zeros(n, H, 2 * WF + 1, K, device="cuda")
    F[:, :, :L] = torch.randn(n, H, L, K, device="cuda", generator=g) / K ** .5 * .4
    F[:, :, WF:WF + L] = torch.randn(n, H, L, K, device="cuda", generator=g) / K ** .5 * .4
    F[:, :, 2 * WF, 0] = 0.9 + 0.1 * torch.rand(n, H, device="cuda", generator=g)
    U = torch.zeros(n, H, WF, V, device="cuda")
    U[:, :, :L] = torch.randn(n, H, L, V, device="cuda", generator=g)
    dense = factors_to_dense(F[:, :, :WF].transpose(-1, -2) @ U, F).double()
    pairs = torch.tensor([[T[i + 1].data_ptr(), S[i + 1].data_ptr(), i, 0, 0, 0] if i < E else [0, 0, i, 0, 0, 0]
                          for i in range(n)], dtype=torch.int64, device="cuda")
    off = lambda i: i * H * K * (V + K) * 4  # noqa: E731
    rows = [[T[0].data_ptr(), S[0].data_ptr(), STEP_FROM_ZERO | STEP_BY_POSITION, 0, 0, 0]]
    rows += [[off(i), off(i), 1, 1 + i, i * L, L] for i in range(n)]
    steps = torch.tensor(rows, dtype=torch.int64, device="cuda")
    cu = torch.tensor([0, len(rows)], dtype=torch.int32, device="cuda")
    outs = torch.randn(n * L, H, V + K, device="cuda", generator=g).bfloat16()
    x = S[0].double()
    want = outs[..., :V].double().clone()
    for i in range(n):
        want[i * L:(i + 1) * L] += torch.einsum("nhk,hkv->nhv", outs[i * L:(i + 1) * L, :, V:].double(), x)
        x = dense[i, ..., V:] @ x + dense[i, ..., :V]
        if i < E:
            x = T[i + 1].double() @ x + S[i + 1].double()
    init = torch.zeros(1, H, K, V, device="cuda")
    maps = torch.empty(n, H, K, V + K, device="cuda")
    triton_scan.pair_lowrank(pairs, F, U, maps)
    apart = outs.clone()
    triton_scan.scan_steps(init, steps, cu, maps, 1 + n, outputs=apart, max_run=L, position=True)
    built = 0
    for cfg in triton_scan.PAIRS_SCAN_CONFIGS:
        got = outs.clone()
        try:
            f = triton_scan.scan_pairs(init, steps, cu, pairs, F, U, got, max_run=L, bv=cfg[0], warps=cfg[1],
                                       stages=cfg[2])
        except OutOfResources:                # a configuration that cannot be built is skipped, as the tuner does
            continue
        built += 1
        assert rel(f[0], x) < 1e-5, (cfg, rel(f[0], x))
        assert rel(got[..., :V], want) < 2 ** -8, cfg
        assert rel(got[..., :V], apart[..., :V].double()) < 2 ** -7, cfg
        assert torch.equal(got[..., V:], outs[..., V:]), cfg
    assert built


@cuda
def test_triton_scan_by_position_matches_fp64():
    """The chain by position (ops/triton_scan.py `_by_position`, STEP_BY_POSITION) at the 35B model's shape: 24 runs'
    dense maps (20 pairs and 4 query pieces) at consecutive slots, first the chain's first map a run's or a cached
    one's from zero. M x as three tf32 products of M as loaded (the wgmma drops M's low 13 bits; M's rest made in
    registers): the final state within 1e-5 of the fp64 chain, as the table's walk (test_triton_scan_steps_matches_fp64),
    in every configuration the tuner may pick that builds. The corrected outputs are bf16: within their rounding
    (2^-8) of the fp64 correction of the same bf16 inputs, and within 2^-7 of the table walk's. A flagged table whose
    rows name the slots in another order is walked by position (the device takes the flag). H100 run 114: the final
    state's error was 1.1e-5 in scan_bench's chain while the parts were left to the instruction's truncation; this
    test's chain passed at 1e-5 then."""
    pytest.importorskip("triton")
    from triton.runtime.errors import OutOfResources

    from hypic.compose import scan as sc
    from hypic.compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
    from hypic.ops import triton_scan

    g = torch.Generator(device="cuda").manual_seed(4)
    H, K, V, N, L = 32, 128, 128, 24, 8
    runs = torch.cat([torch.randn(N, H, K, V, device="cuda", generator=g),
                      torch.randn(N, H, K, K, device="cuda", generator=g) / K ** .5 * .9], -1).contiguous()
    T0 = torch.randn(1, H, K, K, device="cuda", generator=g) / K ** .5 * .9
    S0 = torch.randn(1, H, K, V, device="cuda", generator=g)
    outs = torch.randn(N * L, H, V + K, device="cuda", generator=g).bfloat16()
    off = lambda i: i * H * K * (V + K) * 4  # noqa: E731
    for first_cached in (False, True):
        slots = list(range(N - 1 if first_cached else N))
        rows = [[T0.data_ptr(), S0.data_ptr(), 0, 0, 0, 0]] if first_cached else []
        rows += [[off(i), off(i), 1, 1 + i, i * L, L] for i in slots]
        order = ([0] if first_cached else []) + [1 + i for i in slots]
        init = torch.randn(1, H, K, V, device="cuda", generator=g)
        if first_cached:
            init.zero_()
            rows[0][2] |= STEP_FROM_ZERO
        b0, f0 = sc.scan_dense_reference(init.double(), T0.double(), S0.double(), [0, len(order)], order,
                                         runs.double())
        starts = b0[[1 + i for i in slots]].double().repeat_interleave(L, 0)
        n_tok = len(slots) * L
        want = outs[:n_tok, :, :V].double() + torch.einsum("nhk,nhkv->nhv", outs[:n_tok, :, V:].double(), starts)
        table = torch.tensor(rows, dtype=torch.int64, device="cuda")
        flagged = table.clone()
        flagged[0, 2] |= STEP_BY_POSITION
        cu = torch.tensor([0, len(rows)], dtype=torch.int32, device="cuda")
        walked = outs.clone()
        triton_scan.scan_steps(init, table, cu, runs, 1 + N, outputs=walked, max_run=L, position=False)
        built = 0
        for cfg in triton_scan._CONFIGS:
            got = outs.clone()
            try:
                _, f1 = triton_scan.scan_steps(init, flagged, cu, runs, 1 + N, outputs=got, max_run=L, bv=cfg[0],
                                               warps=cfg[1], stages=cfg[2], position=True)
            except OutOfResources:            # a configuration that cannot be built is skipped, as the tuner does
                continue
            built += 1
            assert rel(f1, f0[0]) < 1e-5, (first_cached, cfg, rel(f1, f0[0]))
            assert rel(got[:n_tok, :, :V], want) < 2 ** -8, (first_cached, cfg)
            assert rel(got[:n_tok, :, :V], walked[:n_tok, :, :V].double()) < 2 ** -7, (first_cached, cfg)
        assert built, first_cached
    # the rows after the second name the slots backwards: by position from the second row's slot the chain still goes
    # 0, 1, 2, ... (the first row's step as it names it, then slots from the second's on)
    back = [[off(i), off(i), 1, 1 + i, 0, L if i < 2 else 0] for i in [0, 1] + list(range(N - 1, 1, -1))]
    back[0][2] |= STEP_BY_POSITION
    init = torch.randn(1, H, K, V, device="cuda", generator=g)
    _, f0 = sc.scan_dense_reference(init.double(), T0.double(), S0.double(), [0, N], list(range(1, N + 1)),
                                    runs.double())
    _, f1 = triton_scan.scan_steps(init, torch.tensor(back, dtype=torch.int64, device="cuda"),
                                   torch.tensor([0, N], dtype=torch.int32, device="cuda"), runs, 1 + N,
                                   outputs=outs.clone(), max_run=L, position=True)
    assert rel(f1, f0[0]) < 1e-5


@cuda
def test_triton_decode_attention_matches_reference():
    """A decode step's split-K attention (ops/triton_decode.py) in bf16 against the fp32 reference over the same bf16
    inputs, at the 35B model's head shapes with a 32k-slot capacity, lengths from one slot to all: bf16 operands
    and an fp32 softmax, the bound of the other bf16 attention checks (2e-2)."""
    pytest.importorskip("triton")
    from hypic.ops.reference import decode_attention as ref_decode

    g = torch.Generator(device="cuda").manual_seed(4)
    b, h, hkv, cap, d = 8, 16, 2, 32768, 256
    q = torch.randn(b, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(b, hkv, cap, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(b, hkv, cap, d, device="cuda", generator=g).bfloat16()
    lengths = torch.tensor([1, 2, 63, 64, 65, 4000, 32767, 32768], device="cuda")
    got = fast.decode_attention(q, k, v, lengths, scale=d ** -0.5)
    assert "decode" not in fast.FAILED
    want = ref_decode(q.float(), k.float(), v.float(), lengths, scale=d ** -0.5)
    assert rel(got, want) < 2e-2


@cuda
def test_position_attention_with_other_value_dim_on_cuda():
    """Keys and values of different head dims (MLA: Kimi-Linear's 24 / 16) in bf16: the Triton attention kernel
    faulted on them at their own block widths on the H200 (an illegal address, benchmarks/attn_probe.py; in Triton's
    interpreter it is right), so it takes them at one width for both; compose-pass shapes (few queries: the kernel,
    which must not have failed over to SDPA) and a prefill's (contiguous) against the fp32 reference."""
    g = torch.Generator(device="cuda").manual_seed(0)
    for nq, nk, contiguous in ((8, 300, False), (50, 50, True)):
        q = torch.randn(nq, 4, 24, device="cuda", generator=g).bfloat16()
        k = torch.randn(nk, 4, 24, device="cuda", generator=g).bfloat16()
        v = torch.randn(nk, 4, 16, device="cuda", generator=g).bfloat16()
        qp, kp = torch.arange(nk - nq, nk, device="cuda"), torch.arange(nk, device="cuda")
        o0 = ref.position_attention(q.float(), k.float(), v.float(), qp, kp, scale=0.2)
        o1 = fast.position_attention(q, k, v, qp, kp, scale=0.2, contiguous=contiguous)
        torch.cuda.synchronize()
        assert rel(o1, o0) < 2e-2
    assert "attention" not in fast.FAILED


@cuda
def test_triton_position_attention_matches_reference():
    """bf16 operands, fp32 softmax: the bound of the other bf16 attention checks (gpu_check.py). Split counts from the
    rule (20 here), 1, 7 and 40 (more than FOLD_UNROLL: the fold's run-time loop); sorted keys unbalanced, and with
    whole blocks' tiles by tensor descriptors."""
    pytest.importorskip("triton")
    from hypic.ops import triton_attention

    g = torch.Generator(device="cuda").manual_seed(2)
    nq, h, hkv, d, nk = 70, 16, 2, 256, 5000
    q = torch.randn(nq, h, d, device="cuda", generator=g).bfloat16()
    k = torch.randn(nk, hkv, d, device="cuda", generator=g).bfloat16()
    v = torch.randn(nk, hkv, d, device="cuda", generator=g).bfloat16()
    kpos = torch.randperm(nk, device="cuda", generator=g)
    qpos = torch.randint(0, nk, (nq,), device="cuda", generator=g)
    kpos[0], qpos[0] = 0, 0
    o0 = ref.position_attention(q.double(), k.double(), v.double(), qpos, kpos, scale=d ** -0.5)
    for splits in (None, 1, 7, 40):
        o1 = triton_attention.position_attention(q, k, v, qpos, kpos, scale=d ** -0.5, splits=splits)
        assert rel(o1, o0) < 2e-2
    o2 = fast.position_attention(q, k, v, qpos, kpos, scale=d ** -0.5)        # the backend takes it
    assert rel(o2, o0) < 2e-2
    kp2, qp2 = torch.arange(nk, device="cuda"), torch.randint(0, nk, (nq,), device="cuda", generator=g)
    o3 = ref.position_attention(q.double(), k.double(), v.double(), qp2, kp2, scale=d ** -0.5)
    for splits in (None, 1, 7, 40):
        o4 = triton_attention.position_attention(q, k, v, qp2, kp2, scale=d ** -0.5, sorted_keys=True, splits=splits)
        assert rel(o4, o3) < 2e-2
    for splits in (7, 79):                   # unbalanced (idle programs: nothing but m and l written), 79 past FOLD_UNROLL
        for tma in (False, True):            # (whole key blocks' tiles by tensor descriptors: TMA_KV)
            o5 = triton_attention.position_attention(q, k, v, qp2, kp2, scale=d ** -0.5, sorted_keys=True, splits=splits,
                                                     balance=False, tma=tma)
            assert rel(o5, o3) < 2e-2
    o6 = triton_attention.position_attention(q, k, v, qp2, kp2, scale=d ** -0.5, sorted_keys=True, tma=True)
    assert rel(o6, o3) < 2e-2


@cuda
def test_triton_order_keys_equals_reference_bitwise():
    """The compose pass's attention operands at the 35B shape (2 kv heads of 256, RoPE over the first 64 dims,
    ~8k keys with a cached block of 6k): one launch equals the PyTorch ops (RoPE products and sums, a copy, two
    gathers) bit for bit in bf16 and fp32, the placed keys left in the buffer included."""
    pytest.importorskip("triton")
    from hypic.ops import triton_place

    g = torch.Generator(device="cuda").manual_seed(3)
    n_all, lo, n, r = 8200, 17, 6000, 64
    for dt in (torch.bfloat16, torch.float32):
        keys = torch.randn(n_all, 2, 256, device="cuda", generator=g).to(dt)
        values = torch.randn(n_all, 2, 256, device="cuda", generator=g).to(dt)
        free = torch.randn(n, 2, 256, device="cuda", generator=g).to(dt)
        pos = torch.randint(0, 40000, (n,), device="cuda", generator=g).float()
        inv = 1.0 / (1e7 ** (torch.arange(0, r, 2, device="cuda").float() / r))
        ang = pos[:, None] * inv[None, :]
        cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
        kperm = torch.randperm(n_all, device="cuda", generator=g)
        k0, k1 = keys.clone(), keys.clone()
        a = ref.order_keys(k0, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r)
        b = triton_place.order_keys(k1, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r)
        assert torch.equal(k0, k1) and torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]), dt
        c = fast.order_keys(keys.clone(), values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r)
        assert torch.equal(c[0], a[0]) and "order" not in fast.FAILED


@cuda
def test_triton_summary_matches_reference():
    """Runs from [0 | I]: the Triton kernels (token by token, chunked; the chunked one also with T factored)
    against the fp32 reference on bf16 inputs (the fla bound)."""
    pytest.importorskip("triton")
    from hypic.ops.reference.gated_delta import factors_to_dense
    from hypic.ops.triton_summary import chunk_summary, summary

    g = torch.Generator(device="cuda").manual_seed(3)
    lens = [8] * 20 + [16] * 4 + [16, 16]
    n, h, hv, dk, dv = sum(lens), 16, 32, 128, 128
    q = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    k = torch.randn(1, n, h, dk, device="cuda", generator=g).bfloat16()
    v = torch.randn(1, n, hv, dv, device="cuda", generator=g).bfloat16()
    gate = torch.empty(1, n, hv, device="cuda").uniform_(0.9, 0.999, generator=g).log()
    beta = torch.rand(1, n, hv, device="cuda", generator=g).bfloat16()
    cu = torch.tensor([0] + lens, device="cuda").cumsum(0)
    want = ref.recurrent_gated_delta_summary(q.float(), k.float(), v.float(), gate, beta.float(), cu_seqlens=cu,
                                             use_qk_l2norm_in_kernel=True)
    got = summary(q, k, v, gate, beta, cu, use_qk_l2norm_in_kernel=True)
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2
    got = chunk_summary(q, k, v, gate, beta, cu, max(lens), use_qk_l2norm_in_kernel=True)
    for a, b in zip(got, want):
        assert rel(a, b) < 2e-2
    # the transitions factored (reference run_factors): the same kernel's products, so the dense T they give
    # matches its dense form to fp32 rounding, and the reference's to the bf16-input bound
    fac = chunk_summary(q, k, v, gate, beta, cu, max(lens), use_qk_l2norm_in_kernel=True, factors=True)
    wf = ref.recurrent_gated_delta_summary(q.float(), k.float(), v.float(), gate, beta.float(), cu_seqlens=cu,
                                           use_qk_l2norm_in_kernel=True, max_len=max(lens), factors=True)
    for a, b in zip(fac, wf):
        assert rel(a, b) < 2e-2
    assert rel(factors_to_dense(fac[2], fac[3]), got[2]) < 1e-5


@cuda
def test_triton_moe_matches_reference():
    """The few-rows MoE kernel (ops/triton_moe.py) in bf16, through the backend's dispatch, against the fp32
    per-expert reference, its weights read by pointers and by tensor descriptors; an expert with more rows than a block
    (several passes) included. Bound:
    gpu_check.py's (bf16 operands and bf16 rows between the products)."""
    from hypic.ops import triton_moe

    g = torch.Generator(device="cuda").manual_seed(1)
    ne, hd, inter, k = 16, 256, 128, 4
    gu = (torch.randn(ne, 2 * inter, hd, device="cuda", generator=g) * 0.05).bfloat16()
    dn = (torch.randn(ne, hd, inter, device="cuda", generator=g) * 0.05).bfloat16()
    for n in (1, 9, 60):
        x = torch.randn(n, hd, device="cuda", generator=g).bfloat16()
        w, ex = fast.route(x, (torch.randn(ne, hd, device="cuda", generator=g) * 0.05).bfloat16(), k, True)
        if n == 60:
            ex[:40, 0] = 3                                  # 40+ rows on one expert: several blocks
        y0 = ref.experts_forward(x.float(), w.float(), ex, gu.float(), dn.float())
        assert n * k <= fast.FEW_ROWS_PER_EXPERT * ne
        old = triton_moe.TMA_WEIGHTS
        try:
            for tma in (False, True):                   # the weights read by pointers and by tensor descriptors
                triton_moe.TMA_WEIGHTS = tma
                y1 = fast.experts_forward(x, w, ex, gu, dn)
                assert "moe" not in fast.FAILED and rel(y1, y0) < 1e-2, (n, tma)
                # fp32 (the quality study's evaluation): the same kernel with fp32 products (no grouped GEMM in fp32,
                # and the reference loop reads the experts in use on the host, which a decode step's capture
                # refuses). Only the summation order differs from the reference: 1e-5
                y2 = fast.experts_forward(x.float(), w.float(), ex, gu.float(), dn.float())
                assert "moe" not in fast.FAILED and rel(y2, y0) < 1e-5, (n, tma)
                if n > 1:             # the last rows padding (the compose pass's pads): no routed rows of theirs
                    rows = torch.tensor([n - n // 4], device="cuda")
                    y3 = fast.experts_forward(x, w, ex, gu, dn, rows=rows)
                    y4 = ref.experts_forward(x.float(), w.float(), ex, gu.float(), dn.float(), rows=rows)
                    assert rel(y3, y4) < 1e-2 and not y3[n - n // 4:].any(), (n, tma)
        finally:
            triton_moe.TMA_WEIGHTS = old


@cuda
def test_triton_route_and_sort_match_reference():
    """The routing kernel in bf16 (ops/triton_route.py) keeps a valid top k: the chosen experts' probabilities
    are the k largest (bf16 logits tie often among 256 experts; at the k-th place the kernel may keep another
    id of an equal probability than torch.topk), weights within a bf16 rounding; the sort kernel equals a
    stable argsort and the cumulative counts exactly."""
    g = torch.Generator(device="cuda").manual_seed(2)
    for n, ne, k in ((1, 256, 8), (224, 256, 8), (64, 128, 4)):
        x = torch.randn(n, 512, device="cuda", generator=g).bfloat16()
        router = (torch.randn(ne, 512, device="cuda", generator=g) * 0.05).bfloat16()
        w1, e1 = fast.route(x, router, k, True)
        assert "route" not in fast.FAILED
        probs = torch.softmax(torch.nn.functional.linear(x, router), -1, dtype=torch.float32)
        top = probs.topk(k, -1).values
        assert torch.allclose(probs.gather(1, e1).sort(-1, descending=True).values, top, rtol=1e-6, atol=0)
        w0 = probs.gather(1, e1)
        assert rel(w1, (w0 / w0.sum(-1, keepdim=True))) < 4e-3                # bf16 rounding of the weights
        flat = e1.reshape(-1)
        order, offs = fast._sort_by_expert(flat, ne, True)
        assert "sort" not in fast.FAILED and torch.equal(order, flat.argsort(stable=True))
        assert torch.equal(offs, torch.bincount(flat, minlength=ne).cumsum(0).to(torch.int32))
        real = torch.tensor([max(0, n - 32)], device="cuda")     # the last 32 rows padding: sorted last, not counted
        nr = int(real) * k
        order, offs = fast._sort_by_expert(flat, ne, True, real=real, top_k=k)
        assert torch.equal(order[:nr], flat[:nr].argsort(stable=True))
        assert torch.equal(order[nr:], torch.arange(nr, n * k, device="cuda"))
        assert torch.equal(offs, torch.bincount(flat[:nr], minlength=ne).cumsum(0).to(torch.int32))


@cuda
@pytest.mark.skipif(not fast.fla_available(), reason="needs fla-core")
def test_fused_norms_and_gate_match_reference():
    """The fast backend's fused norm kernels (ops/triton_norm.py for per-head widths <= 512, the default, and fla's
    for every width; for <= 512 also the l2 norm of the chunked forward) and fla's gate kernel against the
    reference ops (the same arithmetic:
    fp32 inside, one rounding): bf16 outputs within one bf16 ulp of the reference's (the reductions' order is
    all that differs, ~1e-7 relative before the rounding); the gate in fp32 within 1e-5 relative plus
    5e-7 * A absolute per element: fla's softplus is log(1 + e^x) through the hardware's approximate exp2 and
    log2 (ex2.approx ~2^-22 relative: <= 2.4e-7 absolute on the softplus; lg2.approx ~2^-22 absolute: 1.7e-7
    after the ln 2 factor; the fp32 rounding of 1 + e^x: 6e-8), ~4.7e-7 in all, and g = -A * softplus scales
    it by A = exp(A_log) <= 16 here. (H200 run 38 failed an earlier bound of 1e-6 absolute that left out the
    factor A: max |difference| 3.1e-5 over 300 x 32 gates, |g| up to ~250; which element failed was not
    recorded, and this bound has not run on the GPU yet.) Then the modules: the
    zero-centred RMSNorm's fused form is its own arithmetic (one ulp), the gated norm's fused form skips
    transformers' two roundings in between (two ulps)."""
    from hypic.layers.norm import RMSNorm, RMSNormGated, SigmoidGatedRMSNorm
    from hypic.ops import get_backend

    g = torch.Generator(device="cuda").manual_seed(3)

    def ulps(a, b):                       # |a - b| in units of b's bf16 spacing (2^-7 of its magnitude's power of 2)
        a, b = a.float(), b.float()
        spacing = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(1e-30)))) * 2.0 ** -7
        return float(((a - b).abs() / spacing).max())

    for n, d in ((1, 128), (7, 256), (300, 2048)):
        x = torch.randn(n, d, device="cuda", generator=g).bfloat16() * 3
        gate = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        w = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
        for own in (True, False):          # widths <= 512: ops/triton_norm.py (default) and fla's kernels
            fast.NORM_ROWS = own
            try:
                assert ulps(fast.rms_norm(x, w, 1e-6), ref.rms_norm(x, w, 1e-6)) <= 1, (n, d, own)
                for act in ("silu", "sigmoid"):
                    assert ulps(fast.rms_norm_gated(x, gate, w.bfloat16(), 1e-6, act),
                                ref.rms_norm_gated(x, gate, w.bfloat16(), 1e-6, act)) <= 1, (n, d, act, own)
                if d <= 512:               # the l2 norm of the chunked forward's queries and keys
                    assert ulps(fast._l2norm(fast._fla_stages()[0], x), ref.l2norm(x.float()).bfloat16()) <= 1
            finally:
                fast.NORM_ROWS = True
        assert "norm" not in fast.FAILED
        hv = 32
        a = torch.randn(n, hv, device="cuda", generator=g).bfloat16() * 4
        a_log = torch.empty(hv, device="cuda").uniform_(0.01, 16.0, generator=g).log()
        dt = torch.randn(hv, device="cuda", generator=g).bfloat16()
        g0, g1 = ref.gdn_gate(a, a_log, dt), fast.gdn_gate(a, a_log, dt)
        bound = 1e-5 * g0.abs() + 5e-7 * a_log.exp()                  # softplus's absolute error, scaled by A
        assert g1.dtype == torch.float32 and bool(((g1 - g0).abs() <= bound).all()), (n, float((g1 - g0).abs().max()))
    ops = get_backend("fast")
    x = torch.randn(5, 4, 256, device="cuda", generator=g).bfloat16()
    gate = torch.randn(5, 4, 256, device="cuda", generator=g).bfloat16()
    for cls, two in ((RMSNorm, False), (RMSNormGated, True), (SigmoidGatedRMSNorm, True)):
        plain, fused = cls(256, 1e-6).cuda().bfloat16(), cls(256, 1e-6, ops).cuda().bfloat16()
        with torch.no_grad():
            plain.weight.normal_(0.0 if cls is RMSNorm else 1.0, 0.1, generator=g)
            fused.weight.copy_(plain.weight)
        args = (x,) if not two else (x, gate)
        with torch.inference_mode():
            assert ulps(fused(*args), plain(*args)) <= (2 if cls is RMSNormGated else 1), cls.__name__


@cuda
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-granite-4.0-h", "tiny-olmo-hybrid", "tiny-falcon-h1",
                                    "tiny-bamba", "tiny-zamba2", "tiny-zamba", "tiny-lfm2-moe",
                                    "tiny-nemotron-3", "tiny-kimi-linear", "tiny-lara-mini",
                                    "tiny-lfm3", "tiny-recurrent-gemma", "tiny-qwen4-exp",
                                    "tiny-glm5-next"])
def test_engine_bf16_cuda_matches_cpu_reference(preset):
    """The same weights in fp32 on the CPU (reference ops) and bf16 on CUDA (fast ops); the bound is
    twice the CPU reference's own error in bf16 on this model (gpu_check.py explains why). Granite 4.0-H,
    OLMo-Hybrid and Falcon-H1: their Mamba2 and GDN layers (beta in [0, 2]) through fla's kernels, and Falcon-H1's
    two stateful mixers per layer; Bamba, Zamba2 and Zamba (shared blocks reading the embeddings, Zamba's multi-head
    Mamba1), LFM2-MoE, Nemotron 3 (relu² experts by grouped GEMM), Kimi-Linear (its router and dt_bias kept fp32
    in bf16; KDA through fla's kernels; its MLA's key and value head dims differ, which the Triton attention kernel
    faulted on: SDPA takes them), Lara-mini and LFM3 (sliding-window attention through the masked blocks; skipped
    where transformers lacks them, as 5.17 does), RecurrentGemma (the RG-LRU through fla's HGRN kernel), Qwen4-Exp and
    GLM-5 Next (indexed attention through SDPA with the selection mask; a block chosen differently in bf16 than in
    fp32 would show here as a large error). H200, twenty-eighth session: every preset but the two skipped passed."""
    from hypic import LLM, Prompt
    from hypic.errors import UnsupportedArchitectureError

    try:
        cpu = LLM(preset, device="cpu", dtype="float32", backend="reference")
    except UnsupportedArchitectureError as e:        # Lara-mini, LFM3: newer than the GPU machine's transformers
        pytest.skip(str(e))
    cpu16 = LLM(preset, device="cpu", dtype="bfloat16", backend="reference")
    gpu = LLM(preset, device="cuda", dtype="bfloat16")
    with torch.no_grad():
        for other in (cpu16, gpu):
            for (_, a), (_, b) in zip(other.engine.model.named_parameters(), cpu.engine.model.named_parameters()):
                a.copy_(b)
    p = Prompt(prefix="system: ", segments=["alpha " * 40, "beta " * 50, "gamma " * 30], query="question?")
    for mode in ("full", "pic"):
        for llm in (cpu, cpu16, gpu):
            llm.set_policy(mode, 8)
        ref32 = cpu.next_token_logits(p)
        yard = rel(cpu16.next_token_logits(p), ref32)
        assert rel(gpu.next_token_logits(p), ref32) <= 2 * max(yard, 1e-3)


def _compose_prompts(queries, orders=((0, 1, 2), (2, 0, 1), (1, 2, 0), (2, 1, 0))):
    """The CUDA compose tests' requests: three segments after a 3-token prefix, in the given orders (one per query
    length in `queries`), the query's tokens 100, 101, ..."""
    from hypic import Prompt

    segs = [list(range(3, 40)), list(range(50, 90)), list(range(120, 200))]
    return [Prompt(prefix=[5, 6, 7], segments=[segs[i] for i in o], query=list(range(100, 100 + q)))
            for o, q in zip(orders, queries)]


def _with_flags(flags, values, prompts, max_tokens, **llm_kw):
    """The prompts through a fresh engine per value, each module flag in `flags` ((module, name) pairs) set to that
    value meanwhile and restored after: value -> (outputs, the LLM). tiny-qwen3.5 on CUDA in fp32 unless llm_kw
    says otherwise."""
    from hypic import LLM, SamplingParams

    kw = dict(device="cuda", dtype="float32", seed=0) | llm_kw
    sp = SamplingParams(max_tokens=max_tokens, return_logits=True, ignore_eos=True)
    got = {}
    saved = [getattr(mod, name) for mod, name in flags]
    for value in values:
        for mod, name in flags:
            setattr(mod, name, value)
        try:
            llm = LLM("tiny-qwen3.5", **kw)
            got[value] = ([llm.generate([p], sp)[0] for p in prompts], llm)
        finally:
            for (mod, name), v in zip(flags, saved):
                setattr(mod, name, v)
    return got


@cuda
@pytest.mark.parametrize("preset", ["tiny-qwen3.5", "tiny-kimi-linear"])
def test_cuda_graph_compose_matches_eager_buffers(preset):
    """The captured compose pass replays the same kernels as the fixed buffers run eagerly; warm
    requests of one shape replay one graph. Kimi-Linear: KDA's runs summarized by fla's fused recurrent KDA kernel
    on [v | 0] from [0 | I] (device lengths) inside the graph, the chain by the dense scan."""
    from hypic import LLM, SamplingParams
    from hypic.runtime.compose_graph import GraphCompose

    llm = LLM(preset, device="cuda", dtype="bfloat16", seed=0)
    eng = llm.engine
    assert isinstance(eng.composer, GraphCompose) and eng.composer.graphs
    ps = _compose_prompts((10, 10, 10))
    sp = SamplingParams(max_tokens=6, return_logits=True, ignore_eos=True)
    graph = [llm.generate([p], sp)[0] for p in ps]
    assert eng.composer.captures == 1 and eng.composer.replays == 2     # the shape's first request: planned
    eng.composer = GraphCompose(eng.model, "cuda", torch.bfloat16, graphs=False)
    eager = [llm.generate([p], sp)[0] for p in ps]
    # the first request went the planned walk (other kernels: fla's fused recurrent summaries, the
    # separate readout correction), so in bf16 it agrees with the buffers to rounding: the bf16 bound of
    # this file's kernel tests, on its first-token logits (later tokens may take another argmax)
    assert rel(graph[0].logits[0], eager[0].logits[0]) < 2e-2
    for a, b in zip(graph[1:], eager[1:]):          # replays: the buffers' own kernels, captured
        assert a.token_ids == b.token_ids
        assert rel(a.logits, b.logits) < 1e-3
    # the same pass captured in three graphs over consecutive layers, replayed in order
    eng.composer = GraphCompose(eng.model, "cuda", torch.bfloat16, graphs=True, pieces=3)
    pieces = [llm.generate([p], sp)[0] for p in ps]
    assert eng.composer.captures == 1 and len(next(iter(eng.composer.ready.values()))[1].graphs) == 3
    for a, b in zip(pieces[1:], eager[1:]):
        assert a.token_ids == b.token_ids
        assert rel(a.logits, b.logits) < 1e-3


@cuda
def test_cuda_graph_compose_with_low_rank_pairs():
    """LOWRANK_PAIRS (layers/linear.py): the seam runs' summaries as factors and values, every run's dense map made by
    the pair kernel (composed with the cached map after it), the chain one step shorter per segment, all inside the
    captured graph, against the captured pass with dense runs (the default). fp32: the two differ by the order of
    fp32-level (tf32x3) products only, ~1e-6 relative on the states; 1e-4 on the logits leaves room for the layers
    after them."""
    from hypic.layers import linear as lin
    from hypic.runtime.compose_graph import GraphCompose

    # max_tokens 1: the compose pass's token only (no decode kernels to build: a short call)
    got = _with_flags([(lin, "LOWRANK_PAIRS")], (False, True), _compose_prompts((10, 10, 10)), 1)
    for paired, (_, llm) in got.items():
        comp = llm.engine.composer
        assert isinstance(comp, GraphCompose) and comp.captures == 1 and comp.replays == 2
        lay0 = next(iter(comp.ready.values()))[0].layers[0]
        assert ("pair_maps" in lay0) == paired
    for a, b in zip(got[False][0][1:], got[True][0][1:]):
        assert a.token_ids == b.token_ids
        assert rel(b.logits, a.logits) < 1e-4


@cuda
def test_cuda_graph_compose_with_query_tail():
    """QUERY_TAIL (runtime/compose_graph.py): a 41- or 37-token query's three pieces left out of the chain, summarized
    with the other runs, walked from the chain's last state by one launch per layer (their outputs and the final state
    by fp32 products, the pads' rows zeroed), all inside the captured graph; against the query chained in pieces of 16
    (QUERY_TAIL 0). fp32: the two
    differ by the order of fp32-level products only (~1e-6 relative on the states), so 1e-4 on the logits as in the
    pairs' test; the decode steps after them run from the tail's final state."""
    from hypic.runtime import compose_graph as cg

    got = _with_flags([(cg, "QUERY_TAIL")], (0, 64), _compose_prompts((41, 41, 41, 37)), 3)
    for tail, (_, llm) in got.items():
        comp = llm.engine.composer
        assert comp.captures >= 1 and comp.replays >= 1
        assert {s.tail for s in comp.ready} == ({3} if tail else {0})
    for a, b in zip(got[0][0][1:], got[64][0][1:]):
        assert a.token_ids == b.token_ids
        assert rel(b.logits, a.logits) < 1e-4


@cuda
def test_cuda_graph_compose_order_from_entries():
    """ORDER_FROM_ENTRIES (layers/attention.py): the captured pass's ordering kernel reads the cached keys and values
    in place from the request's segments (an address table a layer) instead of the fill's packed copies; logits and
    the decode steps after them (the state's cached values taken from the entries) equal the packed form's. fp32, the
    same kernels on the same values: 1e-5 on the logits."""
    from hypic.layers import attention as attn_mod

    got = _with_flags([(attn_mod, "ORDER_FROM_ENTRIES")], (False, True), _compose_prompts((41, 41, 41, 37)), 3)
    for on, (_, llm) in got.items():
        comp = llm.engine.composer
        assert comp.captures >= 1 and comp.replays >= 1
        bufs = next(iter(comp.ready.values()))[0]
        assert any("entries" in b for b in bufs.layers.values()) == on
    for a, b in zip(got[False][0], got[True][0]):
        assert a.token_ids == b.token_ids
        assert rel(b.logits, a.logits) < 1e-5


@cuda
def test_cuda_graph_compose_chain_from_zero():
    """CHAIN_FROM_ZERO (layers/linear.py): where a request holds no state, its chain's first step is marked in the step
    table and the scan takes that step's S without the product T 0 (compose/scan.py STEP_FROM_ZERO). Requests without a
    prefix, and with one (a prefix cached after the first of them: the chain then starts from its state, unmarked),
    captured and replayed, decode after them; against the mark off. fp32, the same kernels on the same values (the
    skipped product is T 0 = 0): 1e-5 on the logits, as for the in-place reads."""
    from hypic import Prompt
    from hypic.layers import linear as lin

    segs = [list(range(3, 40)), list(range(50, 90)), list(range(120, 200))]
    ps = [Prompt(prefix=pre, segments=[segs[i] for i in o], query=list(range(100, 141)))
          for pre in (None, [5, 6, 7, 8]) for o in ((0, 1, 2), (2, 0, 1), (1, 2, 0))]
    got = _with_flags([(lin, "CHAIN_FROM_ZERO")], (False, True), ps, 3)
    for on, (_, llm) in got.items():
        comp = llm.engine.composer
        assert comp.captures >= 1 and comp.replays >= 1
    for a, b in zip(got[False][0], got[True][0]):
        assert a.token_ids == b.token_ids
        assert rel(b.logits, a.logits) < 1e-5


@cuda
def test_cuda_graph_compose_fills_beside_the_pass():
    """SIDE_FILL (runtime/compose_graph.py) with ORDER_AHEAD (layers/attention.py): on replays in pieces, every fill
    after the first runs on a side stream beside the pieces before it (the cached keys' copies, their placing and
    ordering, the conv tails, the step tables), and the pass writes only the active tokens' keys into the ordered
    buffers. Against both off (every fill on the pass's stream, keys ordered inside the pass): the same kernels on the
    same values, so the tokens agree and the logits to bf16 rounding at most (a fill that a piece did not wait for,
    or a stale ordered key, reorders whole segments' keys: far above that). Five requests of one shape: planned,
    captured, then three staged replays, segments reordered each time."""
    from hypic import Prompt
    from hypic.layers import attention
    from hypic.runtime import compose_graph as cg

    segs = [list(range(3, 40)), list(range(50, 90)), list(range(120, 200)), list(range(210, 260))]
    ps = [Prompt(prefix=[5, 6, 7], segments=[segs[i] for i in o], query=list(range(100, 110)))
          for o in ((0, 1, 2, 3), (2, 0, 3, 1), (1, 3, 0, 2), (3, 2, 1, 0), (0, 2, 1, 3))]
    got = _with_flags([(attention, "ORDER_AHEAD"), (cg, "SIDE_FILL")], (False, True), ps, 1, dtype="bfloat16",
                      compose_pieces=3)
    for on, (_, llm) in got.items():
        comp = llm.engine.composer
        assert comp.captures == 1 and comp.replays == 4 and (comp._side is not None) == on
        bufs, graph = next(iter(comp.ready.values()))[:2]
        assert len(graph.graphs) == 3
        assert all(("ok" in bufs.layers[l]) == on for l, m in llm.engine.model.mixers.items()
                   if isinstance(m, attention.AttentionMixer))
    for a, b in zip(got[False][0][1:], got[True][0][1:]):
        assert a.token_ids == b.token_ids
        assert rel(b.logits, a.logits) < 1e-3, ("bit-equal" if torch.equal(a.logits, b.logits) else "differ")


@cuda
@pytest.mark.parametrize("preset,dtype", [("tiny-qwen3.5", "bfloat16"), ("tiny-kimi-linear", "float32"),
                                          ("tiny-recurrent-gemma", "bfloat16"), ("tiny-qwen4-exp", "bfloat16")])
def test_cuda_graph_decode_matches_eager_buffers(preset, dtype):
    """The captured step replays the same kernels as the eager static step on the same buffers. The KDA model in
    fp32 (the quality study's evaluation) runs reference linear ops on the GPU: its capture used to fail (an index
    tensor sent to the device inside the step) and decode fell back to eager. RecurrentGemma: sliding-window rings
    (slots by position, 12 of them: the 87-token prompt wraps them) and the RG-LRU's diagonal scan in the graph.
    Qwen4-Exp: the indexer's per-row pooling, top-k and the selection-masked attention in the graph."""
    from hypic import LLM, Prompt, SamplingParams
    from hypic.runtime.decode import StaticDecoder

    llm = LLM(preset, device="cuda", dtype=dtype, seed=0)
    eng = llm.engine
    assert isinstance(eng.decoder, StaticDecoder) and eng.decoder.graphs
    p = Prompt(segments=[list(range(3, 40)), list(range(50, 90))], query=list(range(100, 110)))
    sp = SamplingParams(max_tokens=6, return_logits=True, ignore_eos=True)
    graph = llm.generate([p, p], sp)
    assert eng.decoder.captures >= 1 and eng.decoder.graph is not None, eng.decoder.capture_error
    eng.decoder = StaticDecoder(eng.model, "cuda", getattr(torch, dtype), graphs=False)
    eager = llm.generate([p, p], sp)
    for a, b in zip(graph, eager):
        assert a.token_ids == b.token_ids
        assert rel(a.logits, b.logits) < 1e-3


@cuda
@pytest.mark.skipif(fast._fla_conv() is None, reason="needs fla-core")
def test_fla_varlen_conv_matches_reference():
    """fla's Triton conv behind causal_conv1d_varlen: windows in, new windows out, runs shorter than
    the window included (fp32: only the summation order differs)."""
    g = torch.Generator(device="cuda").manual_seed(2)
    lens = [5, 1, 9, 70, 2]
    c, w = 48, 4
    x = torch.randn(sum(lens), c, device="cuda", generator=g)
    weight = torch.randn(c, w, device="cuda", generator=g)
    bias = torch.randn(c, device="cuda", generator=g)
    windows = torch.randn(len(lens), w - 1, c, device="cuda", generator=g)
    cu = torch.tensor([0] + lens).cumsum(0)
    y0, n0 = ref.causal_conv1d_varlen(x, weight, bias, windows, cu, activation="silu")
    y1, n1 = fast.causal_conv1d_varlen(x, weight, bias, windows, cu, activation="silu")
    assert rel(y1, y0) < 1e-5 and torch.equal(n1, n0)


@cuda
def test_pic_training_step_on_cuda_matches_cpu():
    """quality/pic_train.py's loss on CUDA (fla's kernels and their backward, the reference scan under
    autograd) against the CPU reference ops, fp32: losses and gradients agree to the tf32 level."""
    import importlib.util
    import sys
    from pathlib import Path

    from hypic import LLM

    spec = importlib.util.spec_from_file_location("pic_train", Path(__file__).resolve().parents[1] / "quality" / "pic_train.py")
    pt = importlib.util.module_from_spec(spec)
    sys.modules["pic_train"] = pt
    spec.loader.exec_module(pt)
    docs = [list(range(3 + i, 40 + 3 * i)) for i in range(3)]
    exs = [pt.Example([5, 6, 7], docs, list(range(100, 110)), [False] * 6 + [True] * 4)]
    out, weights = {}, None
    for dev in ("cpu", "cuda"):
        model = LLM("tiny-qwen3.5", device=dev, dtype="float32", seed=0).engine.model
        # dummy weights come from a generator on the engine's device (a 35B model is not drawn on the host):
        # the same seed gives other weights on CUDA, so the CUDA model takes the CPU model's
        if weights is None:
            weights = {k: v.clone() for k, v in model.state_dict().items()}
        else:
            model.load_state_dict(weights)
        for p in model.parameters():
            p.requires_grad_(True)
        loss = pt.example_loss(model, exs, "pic", 4, dev)
        loss.backward()
        out[dev] = (loss.item(), {n: p.grad.cpu() for n, p in model.named_parameters() if p.grad is not None})
    (lc, gc), (lg, gg) = out["cpu"], out["cuda"]
    assert abs(lc - lg) < 1e-3 * max(1.0, abs(lc))
    assert gc.keys() == gg.keys()
    for n in gc:
        assert rel(gg[n], gc[n]) < 2e-2, n


def test_triton_scan_in_triton_interpreter():
    """Where triton is installed but there is no GPU: the scan kernel's forms (stacked maps, slot order,
    runs read in place, the compose pass's step table and two chains, runs' transitions dense or factored),
    the split-K position attention, the zero-start summary of short runs (dense or factored transitions) and
    the gathered conv, the few-rows MoE kernel and the attention operands' placing and ordering (fp32 bit for bit; bf16 within
    the interpreter's truncating casts) run in Triton's CPU interpreter against the fp64 references; a whole compose pass through those kernels equals the planned walk (its
    runs dense, factored, paired by the pair kernel or inside the scan, PAIRS_IN_SCAN), and so does one with every
    kernel marked as failed to build (their PyTorch forms; a subprocess: the interpreter
    is chosen when triton is imported)."""
    import importlib.util

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed")
    if torch.cuda.is_available():
        pytest.skip("the GPU runs the kernels compiled (the tests above); the interpreter is for CPU machines")
    code = r'''
import sys
sys.modules["fla"] = None; sys.modules["causal_conv1d"] = None
import torch
from hypic.ops import triton_scan
from hypic.ops.reference import experts_forward as ref_moe
from hypic.compose import scan as sc
torch.manual_seed(0)
H, K, V, E, N = 2, 32, 16, 3, 4
init = torch.randn(2, H, K, V)
T = torch.randn(E, H, K, K) / K ** .5 * .9
S = torch.randn(E, H, K, V)
runs = torch.cat([torch.randn(N, H, K, V), torch.randn(N, H, K, K) / K ** .5 * .9], -1).contiguous()
order = torch.tensor([3, 0, 4, 1, 5, 2, 6], dtype=torch.int32)
cu = torch.tensor([0, 5, 7], dtype=torch.int32)
rel = lambda a, b: float((a.double() - b).norm() / b.norm())
b0, f0 = sc.scan_dense_reference(init.double(), T.double(), S.double(), cu, order, runs.double())
for bv in (16, 32):
    b1, f1 = triton_scan.scan_dense(init, T, S, cu, order=order, runs=runs, bv=bv)
    assert rel(b1, b0) < 1e-6 and rel(f1, f0) < 1e-6, bv
Ts, Ss = [T[i].clone() for i in range(E)], [S[i].clone() for i in range(E)]
rows = []
for m in order.tolist():                       # the step table: cached maps by address, runs by offset
    if m < E:
        rows.append([Ts[m].data_ptr(), Ss[m].data_ptr(), 0, m])
    else:
        off = (m - E) * H * K * (V + K) * 4
        rows.append([off, off, 1, m])
steps = torch.tensor(rows, dtype=torch.int64)
b1, f1 = triton_scan.scan_steps(init, steps, cu, runs, E + N)
assert rel(f1, f0) < 1e-6 and rel(b1[E:], b0[E:]) < 1e-6
run_len = 3                                    # with the readout correction fused: runs of 3 tokens
steps6 = torch.tensor([r + ([(r[3] - E) * run_len, run_len] if r[2] else [0, 0]) for r in rows], dtype=torch.int64)
outs = torch.randn(N * run_len, H, V + K)
want = outs[..., :V].double() + torch.einsum("nhk,nhkv->nhv", outs[..., V:].double(),
                                             b0[E:].double().repeat_interleave(run_len, 0))
got = outs.clone()
triton_scan.scan_steps(init, steps6, cu, runs, E + N, outputs=got, max_run=run_len)
assert rel(got[..., :V], want) < 1e-6
b1, f1 = triton_scan.scan_steps(init, steps, cu, runs, E + N, bv=16, stages=1)   # blocks cover K and V: no masks
assert rel(f1, f0) < 1e-6 and rel(b1[E:], b0[E:]) < 1e-6
got = outs.clone()
triton_scan.scan_steps(init, steps6, cu, runs, E + N, outputs=got, max_run=run_len, bv=16, stages=1)
assert rel(got[..., :V], want) < 1e-6
for bv in (16, 32):                              # the prefetching form (gpu_bench's scan_prefetch), both tables
    b1, f1 = triton_scan.scan_steps(init, steps, cu, runs, E + N, bv=bv, prefetch=True)
    assert rel(f1, f0) < 1e-6 and rel(b1[E:], b0[E:]) < 1e-6, bv
    got = outs.clone()
    triton_scan.scan_steps(init, steps6, cu, runs, E + N, outputs=got, max_run=run_len, bv=bv, prefetch=True)
    assert rel(got[..., :V], want) < 1e-6, bv
# a chain from zero with its first row flagged (STEP_FROM_ZERO: x <- S, no product, no correction): the same to the
# bit as the product from the zero init, whether the first map is a run's (cu from 0) or a cached one's (from 1)
from hypic.compose.scan import STEP_FROM_ZERO
init_z = init.clone()
init_z[0] = 0
for first in (0, 1):
    cu_z = torch.tensor([first, 5, 7], dtype=torch.int32)
    for tbl in (steps, steps6):
        flagged = tbl.clone()
        flagged[first, 2] |= STEP_FROM_ZERO
        for kw in (dict(), dict(bv=16, stages=1), dict(prefetch=True)):
            if tbl is steps6:
                want_o, got_o = outs.clone(), outs.clone()
                _, f_a = triton_scan.scan_steps(init_z, tbl, cu_z, runs, E + N, outputs=want_o, max_run=run_len, **kw)
                _, f_b = triton_scan.scan_steps(init_z, flagged, cu_z, runs, E + N, outputs=got_o, max_run=run_len,
                                                **kw)
                assert torch.equal(got_o, want_o), (first, kw)
            else:
                b_a, f_a = triton_scan.scan_steps(init_z, tbl, cu_z, runs, E + N, **kw)
                b_b, f_b = triton_scan.scan_steps(init_z, flagged, cu_z, runs, E + N, **kw)
                at = [m for m in order[first:5].tolist() if m >= E]      # the runs' before slots (others unwritten)
                assert torch.equal(b_b[at], b_a[at]), (first, kw)
            assert torch.equal(f_b, f_a), (first, kw)
    _, f_0 = sc.scan_dense_reference(init_z.double(), T.double(), S.double(), cu_z, order, runs.double())
    assert rel(f_b, f_0) < 1e-6, first
one = torch.tensor([0, 1, 1], dtype=torch.int32)  # a one-step chain and an empty one
b1, f1 = triton_scan.scan_steps(init, steps, one, runs, E + N, prefetch=True)
bo, fo = sc.scan_dense_reference(init.double(), T.double(), S.double(), one, order, runs.double())
assert rel(f1, fo) < 1e-6 and torch.equal(f1[1], init[1])
from hypic.ops import triton_attention
from hypic.ops.reference import position_attention
for nq, h, hkv, d, nk in ((13, 4, 2, 32, 300), (5, 2, 2, 16, 70)):
    q, k, v = torch.randn(nq, h, d), torch.randn(nk, hkv, d), torch.randn(nk, hkv, d)
    kpos = torch.randperm(nk)
    kpos[torch.rand(nk) < 0.1] = 1 << 62           # keys no query may see (the compose pass's pads)
    qpos = torch.randint(0, nk, (nq,))
    kpos[0], qpos[0] = 0, 0
    o0 = position_attention(q.double(), k.double(), v.double(), qpos, kpos, scale=d ** -0.5)
    for splits in (None, 1, 3):
        o1 = triton_attention.position_attention(q, k, v, qpos, kpos, scale=d ** -0.5, block_m=16, block_n=16,
                                                 splits=splits)
        assert rel(o1, o0) < 1e-6, (nq, splits)
    kp2 = torch.arange(nk)
    kp2[-5:] = 1 << 62                             # sorted keys (the compose pass's gathered order)
    qp2 = torch.randint(0, nk - 5, (nq,))
    o2 = position_attention(q.double(), k.double(), v.double(), qp2, kp2, scale=d ** -0.5)
    for splits in (None, 1, 3):
        o3 = triton_attention.position_attention(q, k, v, qp2, kp2, scale=d ** -0.5, sorted_keys=True, block_n=16,
                                                 splits=splits)
        assert rel(o3, o2) < 1e-6, (nq, splits)
from hypic.ops.triton_summary import summary
from hypic.ops.reference import recurrent_gated_delta_summary
lens = [3, 8, 16, 1]
n, h, hv, dk, dv = sum(lens), 2, 4, 32, 16
qkv = torch.randn(n, 2 * h * dk + hv * dv)               # q, k, v as views of one conv output (row strides)
q, k, v = torch.split(qkv, [h * dk, h * dk, hv * dv], -1)
q, k, v = q.reshape(1, n, h, dk), k.reshape(1, n, h, dk), v.reshape(1, n, hv, dv)
g, beta, cu = -torch.rand(1, n, hv) * 0.2, torch.rand(1, n, hv), torch.tensor([0] + lens).cumsum(0)
want = recurrent_gated_delta_summary(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True)
for bv in (16, 64):
    got = summary(q, k, v, g, beta, cu, use_qk_l2norm_in_kernel=True, block_v=bv)
    assert all(rel(a, b.double()) < 1e-6 for a, b in zip(got, want)), bv
from hypic.ops.triton_summary import chunk_summary
for bv, lmax in ((16, 16), (32, 16), (64, 40)):          # one chunk per run (16 rows; 64 rows)
    got = chunk_summary(q, k, v, g, beta, cu, lmax, use_qk_l2norm_in_kernel=True, block_v=bv)
    assert all(rel(a, b.double()) < 1e-6 for a, b in zip(got, want)), bv
    # the transitions in factored form (reference run_factors; zero rows past each run)
    wf = recurrent_gated_delta_summary(q, k, v, g, beta, cu_seqlens=cu, use_qk_l2norm_in_kernel=True, max_len=lmax,
                                       factors=True)
    for nb in (None, 1, 64):              # the default (here: one block a program, few runs), one, every block
        got = chunk_summary(q, k, v, g, beta, cu, lmax, use_qk_l2norm_in_kernel=True, block_v=bv, factors=True,
                            blocks_per_program=nb)
        assert got[3].shape == wf[3].shape and all(rel(a, b.double()) < 1e-6 for a, b in zip(got, wf)), (bv, nb)
    # with the runs' WY-solved values U in S's place (reference run_values; S = Kd^T U)
    from hypic.ops.reference.gated_delta import run_values
    gv = chunk_summary(q, k, v, g, beta, cu, lmax, use_qk_l2norm_in_kernel=True, block_v=bv, factors=True, values=True)
    wu = run_values(k, v, g, beta, cu, gv[3].shape[2] // 2, use_qk_l2norm_in_kernel=True)
    w_ = (gv[3].shape[2] - 1) // 2
    assert gv[2].shape == wu.shape and rel(gv[2], wu.double()) < 1e-6, bv
    assert rel(gv[3][:, :, :w_].transpose(-1, -2) @ gv[2], wf[2].double()) < 1e-6, bv
# the step-table scan with the runs' transitions factored, against the fp64 chain over their dense form
from hypic.ops.reference.gated_delta import factors_to_dense
S_r, F_r = wf[2].contiguous(), wf[3].contiguous()
nr, wd = S_r.shape[0], (F_r.shape[2] - 1) // 2
init_f = torch.randn(2, hv, dk, dv)
T_f, S_f = [torch.randn(hv, dk, dk) / dk ** .5 * .9 for _ in range(2)], [torch.randn(hv, dk, dv) for _ in range(2)]
order_f = [2, 0, 3, 1, 4, 5]                        # run, entry, run, entry, run | run (a second chain)
rows_f = [[T_f[m].data_ptr(), S_f[m].data_ptr(), 0, m] if m < 2 else
          [(m - 2) * hv * (2 * wd + 1) * dk * 4, (m - 2) * hv * dk * dv * 4, 1, m] for m in order_f]
cu_f = torch.tensor([0, 5, 6], dtype=torch.int32)
b0, f0 = sc.scan_dense_reference(init_f.double(), torch.stack(T_f).double(), torch.stack(S_f).double(), cu_f,
                                 order_f, factors_to_dense(S_r, F_r).double())
b1, f1 = triton_scan.scan_steps(init_f, torch.tensor(rows_f, dtype=torch.int64), cu_f, S_r, 2 + nr, factors=F_r)
assert rel(f1, f0) < 1e-6 and rel(b1[2:], b0[2:]) < 1e-6
init_fz = init_f.clone()                            # from zero, the first (factored) run's row flagged
init_fz[0] = 0
rows_fz = torch.tensor(rows_f, dtype=torch.int64)
b_a, f_a = triton_scan.scan_steps(init_fz, rows_fz, cu_f, S_r, 2 + nr, factors=F_r)
rows_fz[0, 2] |= STEP_FROM_ZERO
b_b, f_b = triton_scan.scan_steps(init_fz, rows_fz, cu_f, S_r, 2 + nr, factors=F_r)
assert torch.equal(f_b, f_a) and torch.equal(b_b[[2, 3, 4]], b_a[[2, 3, 4]])
# the cached maps pre-split (T's tf32 part at column 0, the rest at column 6): scan_steps(split=True)
T_hi, T_lo = zip(*(triton_scan.split_tf32(t) for t in T_f))
assert all(torch.equal(a + b, t) for a, b, t in zip(T_hi, T_lo, T_f))
rows_s = [[T_hi[m].data_ptr(), S_f[m].data_ptr(), 0, m, 0, 0, T_lo[m].data_ptr()] if m < 2 else r + [0, 0, 0]
          for r, m in zip(rows_f, order_f)]
b1, f1 = triton_scan.scan_steps(init_f, torch.tensor(rows_s, dtype=torch.int64), cu_f, S_r, 2 + nr, factors=F_r,
                                split=True)
assert rel(f1, f0) < 1e-6 and rel(b1[2:], b0[2:]) < 1e-6
# with the readout correction fused: runs' outputs corrected by their true initial states
lens_f = [lens[m - 2] for m in order_f if m >= 2]
t0s, acc = {}, 0
for m in order_f:
    if m >= 2:
        t0s[m] = acc
        acc += lens[m - 2]
rows6 = [r + ([t0s[m], lens[m - 2]] if m >= 2 else [0, 0]) for r, m in zip(rows_f, order_f)]
outs_f = torch.randn(acc, hv, dv + dk)
want_f = outs_f[..., :dv].double().clone()
for m in order_f:
    if m >= 2:
        a = t0s[m]
        want_f[a:a + lens[m - 2]] += torch.einsum("nhk,hkv->nhv", outs_f[a:a + lens[m - 2], :, dv:].double(),
                                                  b0[m].double())
got_f = outs_f.clone()
triton_scan.scan_steps(init_f, torch.tensor(rows6, dtype=torch.int64), cu_f, S_r, 2 + nr, outputs=got_f,
                       max_run=max(lens), factors=F_r)
assert rel(got_f[..., :dv], want_f) < 1e-6
from hypic.ops.triton_copy import copy_blocks          # blocks copied by address, one launch
import numpy as np
srcs = [torch.randn(n, 8) for n in (3, 40, 1)]
dst = torch.zeros(50, 8)
rows = np.asarray([[t.data_ptr(), dst.data_ptr() + o * 32, t.numel() * 4] for t, o in zip(srcs, (0, 5, 49))])
copy_blocks(rows, "cpu")
assert torch.equal(dst[0:3], srcs[0]) and torch.equal(dst[5:45], srcs[1]) and torch.equal(dst[49:], srcs[2])
assert dst[3:5].abs().sum() == 0 and dst[45:49].abs().sum() == 0
from hypic.ops import triton_moe, triton_route       # the routed experts for few rows per expert
for n, k, ne, hd, inter in ((7, 3, 5, 64, 48), (40, 2, 4, 32, 16), (1, 2, 6, 48, 32)):   # (40, 2, 4): 20 rows > BM
    x = torch.randn(n, hd)
    wt, ex = torch.softmax(torch.randn(n, ne), -1).topk(k, -1)
    gu, dn = torch.randn(ne, 2 * inter, hd) / hd ** .5, torch.randn(ne, hd, inter) / inter ** .5
    y0 = ref_moe(x.double(), wt.double(), ex, gu.double(), dn.double())
    flat = ex.reshape(-1)
    offs = torch.bincount(flat, minlength=ne).cumsum(0).to(torch.int32)
    for cfgs in ((triton_moe._CONFIGS["gate_up"][0], triton_moe._CONFIGS["down"][0]),
                 (triton_moe._CONFIGS["gate_up"][1], triton_moe._CONFIGS["down"][1])):
        for desc in (False, True):            # the weights by pointers, and by tensor descriptors (TMA_WEIGHTS)
            y1 = triton_moe.experts_few_rows(x, wt, ex, gu, dn, flat.argsort(stable=True), offs, configs=cfgs,
                                             desc=desc)
            assert rel(y1, y0) < 1e-6, (n, k, ne, desc)
    sg, so = torch.randn(n, 5)[:, 3:4], torch.randn(n, hd)     # a shared expert's gate (a column of the joined
                                                                 # GEMM's output, as the model passes it) and output
    y2 = triton_moe.experts_few_rows(x, wt, ex, gu, dn, flat.argsort(stable=True), offs, shared=(sg, so))
    assert rel(y2, y0 + torch.sigmoid(sg.double()) * so.double()) < 1e-6, (n, k, ne)
    if n > 1:                 # the last rows padding (compose_graph's pads): in no expert's rows, their routed sum zero
        real = torch.tensor([n - 1 - n // 3])
        r0 = int(real)
        po, pf = triton_route.sort_by_expert(flat, ne, k, real=real)
        y3 = triton_moe.experts_few_rows(x, wt, ex, gu, dn, po, pf, shared=(sg, so), rows=real)
        y4 = ref_moe(x.double(), wt.double(), ex, gu.double(), dn.double(), shared=(sg.double(), so.double()),
                     rows=real)
        assert rel(y3, y4) < 1e-6 and rel(y3[:r0], y2[:r0]) < 1e-6, (n, k, ne)
        assert torch.equal(y4[r0:], torch.sigmoid(sg[r0:].double()) * so[r0:].double())      # the shared part alone
ys = torch.randn(4 * 3, 16)                       # the combine reads no padding row: NaN there changes nothing
ys[2 * 3:] = float("nan")
sg, so = torch.randn(4, 1), torch.randn(4, 16)
got = triton_moe.combine(ys, 3, (sg, so), rows=torch.tensor([2]))
assert torch.allclose(got[:2], ys.view(4, 3, 16)[:2].sum(1) + torch.sigmoid(sg[:2]) * so[:2], atol=1e-6)
assert torch.allclose(got[2:], torch.sigmoid(sg[2:]) * so[2:], atol=1e-6)
from hypic.ops import triton_route                    # the MoE's routing and its sort by expert
from hypic.ops.reference import route as ref_route
for n, ne, k, norm in ((5, 16, 4, True), (33, 64, 8, False), (1, 256, 8, True)):
    x, router = torch.randn(n, 32), torch.randn(ne, 32)       # fp32: no two probabilities equal
    w0, e0 = ref_route(x, router, k, norm)
    w1, e1 = triton_route.route(torch.nn.functional.linear(x, router), k, norm)
    assert torch.equal(e1, e0) and rel(w1, w0.double()) < 1e-6, (n, ne, k)
for nk, ne in ((0, 8), (8, 256), (37, 5), (1800, 256), (4096, 64)):
    flat = torch.randint(0, ne, (nk,))
    flat[: nk // 3] = 1                                       # many equal ids: the sort must keep index order
    order, offs = triton_route.sort_by_expert(flat, ne)
    assert torch.equal(order, flat.argsort(stable=True)), nk
    assert torch.equal(offs, torch.bincount(flat, minlength=ne).cumsum(0).to(torch.int32)), nk
    for k in (1, 4):            # tokens of k choices from `real` on are padding: sorted last, in order, not counted
        if nk % k or not nk:
            continue
        real = torch.tensor([max(0, nk // k - 3)])
        nr = int(real) * k
        for prefix in (True, False):                          # the ranks from histograms (default), by comparisons
            triton_route.PREFIX_RANK = prefix
            try:
                order, offs = triton_route.sort_by_expert(flat, ne, k, real=real)
            finally:
                triton_route.PREFIX_RANK = True
            assert torch.equal(order[:nr], flat[:nr].argsort(stable=True)), (nk, k, prefix)
            assert torch.equal(order[nr:], torch.arange(nr, nk)), (nk, k, prefix)
            assert torch.equal(offs, torch.bincount(flat[:nr], minlength=ne).cumsum(0).to(torch.int32)), (nk, k)
from hypic.ops import triton_transition                # runs' transitions from their chunks' WY factors
from hypic.ops.reference.gated_delta import _ut_system
import math
lens_t, h_t, hv_t, dk_t, C = [3, 70, 130, 64], 2, 4, 32, 64
n_t = sum(lens_t)
k_t = torch.nn.functional.normalize(torch.randn(1, n_t, h_t, dk_t, dtype=torch.float64), dim=-1)
beta_t = torch.rand(1, n_t, hv_t, dtype=torch.float64)
g_t = torch.empty(1, n_t, hv_t, dtype=torch.float64).uniform_(math.log(0.9), math.log(0.999))
kh_t = k_t.repeat_interleave(hv_t // h_t, dim=2)
w_t, gc_t, want_t, a = torch.zeros(1, n_t, hv_t, dk_t, dtype=torch.float64), torch.zeros(1, n_t, hv_t, dtype=torch.float64), [], 0
eye_t = torch.eye(dk_t, dtype=torch.float64)
for L in lens_t:
    T_ = eye_t.expand(hv_t, dk_t, dk_t).clone()                  # the sequential product of the token maps
    for t in range(a, a + L):
        kt = kh_t[0, t]
        T_ = g_t[0, t].exp()[:, None, None] * (eye_t - beta_t[0, t][:, None, None] * kt[:, :, None] * kt[:, None, :]) @ T_
    want_t.append(T_)
    for c0 in range(a, a + L, C):                                # fla's WY factors and log2 decays, chunk by chunk
        c1 = min(c0 + C, a + L)
        kc, gch, bc = kh_t[0, c0:c1].transpose(0, 1), g_t[0, c0:c1].transpose(0, 1), beta_t[0, c0:c1].transpose(0, 1)
        G, _, system = _ut_system(kc, gch, bc)
        w_t[0, c0:c1] = torch.linalg.solve_triangular(system, (bc * G.exp())[..., None] * kc, upper=False,
                                                      unitriangular=True).transpose(0, 1)
        gc_t[0, c0:c1] = (G / math.log(2)).transpose(0, 1)
    a += L
want_t = torch.stack(want_t)
cu_t = torch.tensor([0] + lens_t).cumsum(0)
bounds_t = torch.stack([cu_t[:-1], cu_t[1:]], 1).to(torch.int32).contiguous()
for cfg in ((32, 4, 1), (16, 4, 1)):                          # fp32 products (exact in the interpreter)
    got = triton_transition.transitions(k_t.float(), w_t.float(), gc_t.float(), bounds_t, config=cfg, precision="tf32")
    assert rel(got, want_t) < 1e-6, cfg
got = triton_transition.transitions(k_t.float(), w_t.float(), gc_t.float(), bounds_t[[1, 3]].contiguous(),
                                    config=(32, 4, 1), precision="tf32")
assert rel(got, want_t[[1, 3]]) < 1e-6
# (the default "bf16" form is checked on the GPU only: Triton 3.6's interpreter multiplies bf16 blocks wrongly)
from hypic.ops import triton_decode                    # a decode step's attention, split over the slots
from hypic.ops.reference import decode_attention as ref_decode
for b, h, hkv, cap, d, dv, lens in ((3, 6, 2, 300, 32, 16, [1, 300, 150]), (1, 4, 4, 70, 16, 16, [70])):
    q = torch.randn(b, h, d)
    kk = torch.randn(b, hkv, cap + 5, d)[:, :, :cap]           # strided, as the decode buffers' capacity leaves them
    vv = torch.randn(b, hkv, cap, dv)
    o0 = ref_decode(q.double(), kk.double(), vv.double(), torch.tensor(lens), scale=0.3)
    for splits in (None, 1, 3):
        o1 = triton_decode.decode_attention(q, kk, vv, torch.tensor(lens), scale=0.3, block_n=16, splits=splits)
        assert rel(o1, o0) < 1e-6, (b, splits)
from hypic.ops.triton_norm import norm_rows
from hypic.ops.reference import rms_norm as ref_rms, rms_norm_gated as ref_rms_gated
from hypic.ops.reference.gated_delta import l2norm as ref_l2
for d in (256, 128, 20):                       # per-head widths; rows not a multiple of a program's block
    x, gt, wt = torch.randn(37, 3, d), torch.randn(37, 3, d), torch.randn(d)
    assert rel(norm_rows(x, wt, 1e-6), ref_rms(x.double(), wt.double(), 1e-6)) < 1e-6
    for act in ("silu", "sigmoid"):
        y0 = ref_rms_gated(x.double(), gt.double(), wt.double(), 1e-6, act)
        assert rel(norm_rows(x, wt, 1e-6, gate=gt, activation=act), y0) < 1e-6
    # the gate read in place as columns of a wider matrix (a joined GEMM's z: groups of 3 rows, 3d + 10 apart),
    # and one that is no such view (heads transposed: copied)
    wide = torch.randn(37, 3 * d + 10)
    gv = wide[:, 4:4 + 3 * d].unflatten(-1, (3, d))
    assert rel(norm_rows(x, wt, 1e-6, gate=gv), ref_rms_gated(x.double(), gv.double(), wt.double(), 1e-6, "silu")) < 1e-6
    gtr = torch.randn(3, 37, d).transpose(0, 1)
    assert rel(norm_rows(x, wt, 1e-6, gate=gtr), ref_rms_gated(x.double(), gtr.double(), wt.double(), 1e-6, "silu")) < 1e-6
    assert rel(norm_rows(x, None, 1e-6, l2=True), ref_l2(x.double())) < 1e-6
    assert norm_rows(x[:0], wt, 1e-6).shape == (0, 3, d)
from hypic.ops.triton_conv import gathered_conv
src, idx = torch.randn(50, 300), torch.randint(0, 50, (9, 4))
w, b = torch.randn(300, 4), torch.randn(300)
y0 = torch.nn.functional.silu((src[idx] * w.t()).sum(1) + b)
assert rel(gathered_conv(src, idx, w, b, "silu"), y0.double()) < 1e-6
assert rel(gathered_conv(src, idx, w, None, None), (src[idx] * w.t()).sum(1).double()) < 1e-6
wide = torch.randn(20, 310)                 # src's last 20 rows read in place from a joined GEMM's columns
raw = wide[:, 5:305]
src2 = torch.cat([src[:30], raw])
win = torch.full((3, 300), float("nan"))
last = torch.tensor([6])
got = gathered_conv(src[:50].clone(), idx, w, b, "silu", raw=raw, window=win, last=last)
y2 = torch.nn.functional.silu((src2[idx] * w.t()).sum(1) + b)
assert rel(got, y2.double()) < 1e-6 and torch.equal(win, src2[idx[6, 1:]])     # the window: rows as read
try:
    gathered_conv(src, idx, w, b, "silu", raw=raw.t())
    raise AssertionError("column-strided raw rows must be refused")
except ValueError:
    pass
from hypic.ops import triton_place                   # the attention operands placed and ordered in one launch
from hypic.ops.reference import order_keys as ref_order
for dt in (torch.float32, torch.bfloat16):
    for n_all, hkv, d, lo, n, r in ((50, 2, 16, 5, 30, 8), (37, 1, 20, 0, 37, 20), (64, 2, 32, 3, 10, 0)):
        keys, values = torch.randn(n_all, hkv, d).to(dt), torch.randn(n_all, hkv, 12).to(dt)
        free, kperm = torch.randn(n, hkv, d).to(dt), torch.randperm(n_all)
        ang = torch.randint(0, 5000, (n, 1)).float() * torch.rand(1, max(r // 2, 1))
        cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
        k0, k1 = keys.clone(), keys.clone()
        a = ref_order(k0, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r)
        b = triton_place.order_keys(k1, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r)
        assert torch.equal(a[1], b[1]) and torch.equal(b[0], k1[kperm])
        if dt == torch.float32:        # the interpreter rounds like the GPU in fp32 (bf16 casts: it truncates)
            assert torch.equal(k0, k1) and torch.equal(a[0], b[0]), (n_all, r)
        else:                          # two products and a sum, each within a bf16 ulp of the other's rounding
            h = max(r // 2, 1)
            part = torch.cat([free[..., h:r], free[..., :h]], -1).float().abs() if r else 0
            bound = 2.0 ** -6 * (free[..., :r].float().abs() * cos[:, None, :r].float().abs()
                                 + part * sin[:, None, :r].float().abs()) if r else 0
            diff = (k0[lo:lo + n, :, :r].float() - k1[lo:lo + n, :, :r].float()).abs()
            assert (diff <= bound + 1e-30).all() and torch.equal(k0[lo:lo + n, :, r:], k1[lo:lo + n, :, r:])
            assert torch.equal(torch.cat([k0[:lo], k0[lo + n:]]), torch.cat([k1[:lo], k1[lo + n:]]))
        c = triton_place.order_keys(keys.clone(), values, kperm)
        assert torch.equal(c[0], keys[kperm]) and torch.equal(c[1], values[kperm])
        out = (torch.full_like(keys, float("nan")), torch.full_like(values, float("nan")))   # into fixed buffers
        k2 = keys.clone()
        c = triton_place.order_keys(k2, values, kperm, free=free, lo=lo, cos=cos, sin=sin, rotary_dim=r, out=out)
        assert c[0] is out[0] and c[1] is out[1] and torch.equal(out[0], b[0]) and torch.equal(out[1], b[1])
        assert torch.equal(k2, k1)
# the cached rows read in place by address (entries: ORDER_FROM_ENTRIES) equal to the packed form on every real row
for dt in (torch.float32, torch.bfloat16):
    hkv, d, dv, r, held, lens, nact = 2, 16, 12, 8, 5, [7, 1, 12], 9
    kc = sum(lens)
    bucket = kc + 4                                             # unused slots past the count: no entry's
    n_all = held + bucket + nact
    ents_k = [torch.randn(n, hkv, d).to(dt) for n in lens]
    ents_v = [torch.randn(n, hkv, dv).to(dt) for n in lens]
    keys0, values0 = torch.randn(n_all, hkv, d).to(dt), torch.randn(n_all, hkv, dv).to(dt)
    free = torch.zeros(bucket, hkv, d).to(dt)
    free[:kc] = torch.cat(ents_k)
    packed_v = values0.clone()
    packed_v[held:held + kc] = torch.cat(ents_v)
    kperm = torch.randperm(n_all)
    ang = torch.randint(0, 5000, (bucket, 1)).float() * torch.rand(1, r // 2)
    cos, sin = torch.cat([ang, ang], -1).cos().to(dt), torch.cat([ang, ang], -1).sin().to(dt)
    k1, k2 = keys0.clone(), keys0.clone()
    a = triton_place.order_keys(k1, packed_v, kperm, free=free, lo=held, cos=cos, sin=sin, rotary_dim=r)
    table = torch.zeros(len(lens) + 3, 6, dtype=torch.int64)   # (keys, values, first row) per entry, then the count
    starts = [0, 7, 8]
    for i, (ek, ev) in enumerate(zip(ents_k, ents_v)):
        table[i, :3] = torch.tensor([ek.data_ptr(), ev.data_ptr(), starts[i]])
    table[len(lens), 2] = kc
    b = triton_place.order_keys(k2, values0, kperm, free=torch.zeros_like(free), lo=held, cos=cos, sin=sin,
                                rotary_dim=r, entries=(table, len(lens)))
    real = torch.ones(n_all, dtype=torch.bool)
    real[held + kc : held + bucket] = False
    seen = real[kperm]
    assert torch.equal(a[0][seen], b[0][seen]) and torch.equal(a[1][seen], b[1][seen]), dt
    assert torch.equal(k1[real], k2[real]), dt                  # the placed keys the request keeps
    try:
        ref_order(keys0.clone(), values0, kperm, free=free, lo=held, cos=cos, sin=sin, rotary_dim=r,
                  entries=(table, len(lens)))
        raise AssertionError("the reference must refuse reading by address")
    except ValueError:
        pass
for bad in ((torch.empty_like(keys[1:]), torch.empty_like(values)), (keys.new_empty(keys.shape[::-1]).transpose(0, 2),
                                                                     torch.empty_like(values))):
    try:
        triton_place.order_keys(keys, values, kperm, out=bad)
        raise AssertionError("out buffers of another shape or layout must be refused")
    except ValueError:
        pass
try:
    triton_place.order_keys(keys, values, kperm[1:])
    raise AssertionError("a kperm that leaves rows out must be refused")
except ValueError:
    pass
sc.kernel_ready = lambda device: True          # the compose pass's address-table form, interpreted
from hypic.ops import fast
fast.INTERPRETED = True                        # and its conv and attention kernels
from hypic import LLM, Prompt, SamplingParams
segs = [list(range(3, 40)), list(range(50, 90)), list(range(120, 200))]
ps = [Prompt(prefix=[5, 6, 7], segments=[segs[i] for i in o], query=list(range(100, 100 + q)))
      for o, q in (((0, 1, 2), 10), ((2, 0, 1), 41))]
sp = SamplingParams(max_tokens=3, return_logits=True, ignore_eos=True)
out = {}
llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="eager", seed=0)
out["eager"] = [llm.generate([p], sp)[0] for p in ps]
from hypic.layers import linear as lin
from hypic.runtime import compose_graph as cg
cg.COPY_BY_ADDRESS = True                      # the fill's packing through the copy kernel (default: torch.cat)
# the runs' transitions dense [S | T] (default), factored, or paired with the cached map after them (low rank); runs cut
# into pieces of 16 tokens (default), 32 or 64 (the 41-token query in two pieces or one: the summary's chunk, the pairs'
# factors and the scan's correction rows 64 wide)
# (the 41-token query's pieces outside the chain as its tail, QUERY_TAIL, except where it is off: 0)
# (in_scan: the pairs made inside the chain scan, PAIRS_IN_SCAN: no pair kernel launched; with the query's pieces in
# the chain too, no tail, the last runs alone)
from hypic.ops import triton_scan
in_scan0 = lin.PAIRS_IN_SCAN                   # (the default, restored after)
launched, _pair_lowrank, _scan_pairs = [], triton_scan.pair_lowrank, triton_scan.scan_pairs
triton_scan.pair_lowrank = lambda *a, **kw: launched.append("pairs") or _pair_lowrank(*a, **kw)
triton_scan.scan_pairs = lambda *a, **kw: launched.append("scan_pairs") or _scan_pairs(*a, **kw)
fast._import_kernel.cache_clear()
for factored, paired, skip, sub, tail, in_scan in (
        (False, False, False, 16, 64, False), (True, False, False, 16, 64, False), (False, True, False, 16, 64, False),
        (False, True, True, 16, 64, False), (False, True, False, 16, 0, False), (False, True, False, 32, 0, False),
        (False, True, False, 64, 64, False), (False, True, False, 16, 64, True), (False, True, False, 16, 0, True)):
    lin.RUN_FACTORS, lin.LOWRANK_PAIRS, lin.SKIP_PAD_PAIRS = factored, paired, skip   # skip: the pads' maps unmade
    lin.PAIRS_IN_SCAN = in_scan
    cg.SUB_RUN, cg.QUERY_TAIL = sub, tail
    llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="static", seed=0)
    launched.clear()
    got = [llm.generate([p], sp)[0] for p in ps]
    if paired:
        assert set(launched) == ({"scan_pairs"} if in_scan else {"pairs"}), (launched, in_scan)
    bufs0 = next(iter(llm.engine.composer.ready.values()))[0]
    assert getattr(bufs0, "copy_tables", None)                      # the fill went through the copy kernel
    lay0 = bufs0.layers[0]
    assert llm.engine.composer.runs == len(ps) and "steps" in lay0
    width = max(16, 1 << (bufs0.shape.lmax - 1).bit_length())       # (the factors' rows: lmax to a power of two)
    assert lay0.get("factor_width") == (width if factored or paired else None) and ("pair_maps" in lay0) == paired
    assert width == 16 or sub > 16
    for a, b in zip(out["eager"], got):
        assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4, (factored, paired)
    assert not fast.FAILED, fast.FAILED            # every kernel ran (no PyTorch form stood in for one)
    if paired:                  # the last request's chain: each seam run paired, so one step fewer per segment
        cu_m, cu_p = bufs0.cu_maps.tolist(), bufs0.cu_pairs.tolist()
        assert cu_m[1] - cu_p[1] == 3 and cu_m[2] - cu_p[2] == 3, (cu_m, cu_p)
        assert (lay0["pairs"][:, 0] != 0).sum() == 3
        # every step after the chain's first a run's map at the next slot: taken by position (STEP_BY_POSITION)
        from hypic.compose.scan import STEP_BY_POSITION
        assert int(lay0["steps_host"][0, 2]) & STEP_BY_POSITION
    last = list(llm.engine.composer.ready)[-1]              # the 41-token query's shape
    assert last.tail == (-(-41 // sub) if tail else 0), (last, sub, tail)          # the query's runs (pieces of sub)
    if sub > 16:                # the longest run of the last request (41 tokens) in one or two pieces (the pads too)
        assert last.lmax == 32 if sub == 32 else last.lmax > 32, last
# the pairs made inside the scan, whose kernel fails: the pair kernel and the chain scan from then on, into one pairs'
# buffer for all the layers of a shape, made at that pass (as the switch off makes it with the buffers)
def _fails(*a, **kw):
    raise RuntimeError("a build that failed")
triton_scan.scan_pairs = _fails
fast._import_kernel.cache_clear()
lin.RUN_FACTORS, lin.LOWRANK_PAIRS, lin.SKIP_PAD_PAIRS, lin.PAIRS_IN_SCAN = False, True, False, True
cg.SUB_RUN, cg.QUERY_TAIL = 16, 64
llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="static", seed=0)
launched.clear()
got = [llm.generate([p], sp)[0] for p in ps]
assert fast.FAILED == {"scan_pairs"} and set(launched) == {"pairs"}, (fast.FAILED, launched)
for a, b in zip(out["eager"], got):
    assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4
for bufs in (hit[0] for hit in llm.engine.composer.ready.values()):            # (each slot: its buffers first)
    maps = [lay["pair_maps"] for lay in bufs.layers.values() if "pair_maps" in lay]
    assert len(maps) > 1 and all(m is maps[0] for m in maps), [None if m is None else m.data_ptr() for m in maps]
fast.FAILED.clear()
lin.RUN_FACTORS = lin.LOWRANK_PAIRS = lin.SKIP_PAD_PAIRS = False
lin.PAIRS_IN_SCAN = in_scan0
triton_scan.pair_lowrank, triton_scan.scan_pairs = _pair_lowrank, _scan_pairs
fast._import_kernel.cache_clear()
cg.SUB_RUN, cg.QUERY_TAIL = 16, 0
# the cached keys and values read in place by the ordering kernel (layers/attention.py ORDER_FROM_ENTRIES): not packed
from hypic.layers import attention as attn_mod
attn_mod.ORDER_FROM_ENTRIES = True
llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="static", seed=0)
got = [llm.generate([p], sp)[0] for p in ps]
for a, b in zip(out["eager"], got):
    assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4
bufs0 = next(iter(llm.engine.composer.ready.values()))[0]
assert any("entries" in b for b in bufs0.layers.values()) and not fast.FAILED, fast.FAILED
attn_mod.ORDER_FROM_ENTRIES = False
# the MoE model's static pass with the experts' weights read by tensor descriptors (triton_moe.TMA_WEIGHTS)
from hypic.ops import triton_moe
want = [LLM("tiny-qwen3.5-moe", device="cpu", dtype="float32", compose="eager", seed=0).generate([p], sp)[0]
        for p in ps]
triton_moe.TMA_WEIGHTS = True
made, _desc = [], triton_moe._desc
triton_moe._desc = lambda *a: made.append(a[1:]) or _desc(*a)      # (the descriptors the kernels were given)
# and the pass's pad tokens left out of the experts (compose_graph.PADS_ROUTED False): the sort is told where they start
reals, _sort = [], triton_route.sort_by_expert
triton_route.sort_by_expert = lambda *a, **kw: reals.append(kw.get("real")) or _sort(*a, **kw)
fast._import_kernel.cache_clear()                                   # (the backend keeps the functions it found)
llm = LLM("tiny-qwen3.5-moe", device="cpu", dtype="float32", compose="static", seed=0)
for a, p in zip(want, ps):
    b = llm.generate([p], sp)[0]
    assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4
assert made and not fast.FAILED, fast.FAILED
assert any(r is not None for r in reals), "the compose pass's pads went through the experts"
triton_moe.TMA_WEIGHTS, triton_moe._desc, triton_route.sort_by_expert = False, _desc, _sort
fast._import_kernel.cache_clear()
# warm requests of one layout (equal segment lengths in new orders, no prefix: compose_graph.LAYOUTS) through the
# address-table scan with the default low-rank pairs: the kept layout's shared step columns and the ids-only load
lin.LOWRANK_PAIRS = True
eq = [list(range(3 + 50 * i, 43 + 50 * i)) for i in range(3)]
same = [Prompt(segments=[eq[i] for i in o], query=list(range(200 + 20 * j, 210 + 20 * j)))
        for j, o in enumerate(((0, 1, 2), (2, 0, 1), (1, 2, 0), (0, 2, 1)))]
want = [LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="eager", seed=0).generate([p], sp)[0] for p in same]
llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="static", seed=0)
for a, p in zip(want, same):
    b = llm.generate([p], sp)[0]
    assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4
comp = llm.engine.composer
assert comp.runs == 4 and comp.layout_hits == 3 and not fast.FAILED, (comp.runs, comp.layout_hits, fast.FAILED)
assert "pair_maps" in next(iter(comp.ready.values()))[0].layers[0]
lin.LOWRANK_PAIRS = False
fast.FAILED.update(("steps", "attention", "conv", "summary", "chunk_summary", "order"))   # kernels that could not
llm = LLM("tiny-qwen3.5", device="cpu", dtype="float32", compose="static", seed=0)  # be built: PyTorch forms
for a, p in zip(out["eager"], ps):
    b = llm.generate([p], sp)[0]
    assert a.token_ids == b.token_ids and float((a.logits - b.logits).abs().max()) < 1e-4
print("ok")
'''
    _run_in_interpreter(code)



@needs_triton
def test_triton_attention_other_value_dim_in_interpreter():
    """The compose attention kernel with key and value head dims that differ (MLA: 24 / 16, and 32 / 16, 16 / 32), at
    its own block widths and at one width for both (`same_width`: the default since H100 run 95 ran it; at their own
    widths the H200 faulted, run 92): in Triton's interpreter equal to the reference to fp32 rounding, so the kernel's
    index arithmetic is right and the fault is in what the GPU compiler makes of it."""
    code = """
import torch
from hypic.ops.triton_attention import position_attention
from hypic.ops.reference.attention import position_attention as ref
g = torch.Generator().manual_seed(0)
for d, dv in ((24, 16), (32, 16), (16, 32)):
    q, k, v = torch.randn(20, 4, d, generator=g), torch.randn(30, 2, d, generator=g), torch.randn(30, 2, dv, generator=g)
    qp, kp = torch.arange(10, 30), torch.arange(30)
    r = ref(q, k, v, qp, kp, scale=0.3)
    for same in (False, True):
        o = position_attention(q, k, v, qp, kp, scale=0.3, same_width=same)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, same)
print("ok")
"""
    _run_in_interpreter(code)

@needs_triton
def test_triton_attention_forms_in_interpreter():
    """The compose attention kernel's forms (ops/triton_attention.py: key blocks every row sees walked unmasked, the
    splits folded by a kernel, each row block's visible prefix split evenly, the value columns over two programs) on
    the compose pass's layout (sorted keys, seam queries at segment starts, a query tail, pads at position 0, unseen
    bucket keys), at key blocks of 16 so that whole blocks precede each row block's first seam: each equal to the
    reference to fp32 rounding (1e-5), and unsorted keys through the fold and the value split alike; the fold with
    its split count a compile-time constant (rounded up to FOLD_BUCKET, the splits past the call's masked: five build
    counts for 1-39 splits) and as a run-time loop (more splits than FOLD_UNROLL); unbalanced splits of 16 or 32 keys,
    so that most of the early row blocks' programs are idle, with or without the unmasked blocks; whole key blocks'
    tiles by tensor descriptors (TMA_KV) where the blocks cover the head dims. Every
    buffer the wrapper allocates starts as NaN: an idle program's unwritten partial sums (SKIP_EMPTY) read by the fold
    would show (a mutant fold without the `w > 0` mask fails)."""
    code = """
import itertools, torch
_new_empty = torch.Tensor.new_empty
def _nan_empty(self, *a, **kw):                 # every buffer the wrapper makes starts as NaN
    t = _new_empty(self, *a, **kw)
    return t.fill_(float("nan")) if t.is_floating_point() else t
torch.Tensor.new_empty = _nan_empty
_empty_like = torch.empty_like
torch.empty_like = lambda t, *a, **kw: _empty_like(t, *a, **kw).fill_(float("nan")) if t.is_floating_point() else _empty_like(t, *a, **kw)
from hypic.ops.triton_attention import position_attention
from hypic.ops.reference.attention import position_attention as ref
from triton.tools.tensor_descriptor import TensorDescriptor
g = torch.Generator().manual_seed(0)
seg, nseg, seam, ql = 40, 5, 3, 7
qpos = [i * seg + j for i in range(nseg) for j in range(seam)] + list(range(nseg * seg, nseg * seg + ql)) + [0] * 4
kpos = list(range(nseg * seg + ql)) + [1 << 62] * 13
qp, kp = torch.tensor(qpos), torch.tensor(kpos)
for d, dv, h, hkv in ((32, 32, 4, 2), (24, 16, 4, 1)):
    q = torch.randn(len(qpos), h, d, generator=g)
    k = torch.randn(len(kpos), hkv, d, generator=g)
    v = torch.randn(len(kpos), hkv, dv, generator=g)
    r = ref(q, k, v, qp, kp, scale=0.3)
    for ff, bal, vs, sp in [(ff, bal, vs, 3) for ff, bal, vs in itertools.product((False, True), (False, True),
                                                                                     (1, 2))] + [(True, False, 1, None)]:
        o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, full_fast=ff, fused_fold=True,
                               balance=bal, vsplit=vs, splits=sp, block_n=16)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, ff, bal, vs, sp)
    o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, fused_fold=False, block_n=16)
    assert float((o - r).abs().max()) < 1e-5, (d, dv, "fold by torch")
    for sp, ff in itertools.product((7, 14), (False, True)):    # unbalanced, most early row blocks' programs idle
        o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, full_fast=ff, balance=False, splits=sp,
                               block_n=16)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, "unbalanced", sp, ff)
    # whole key blocks' tiles by tensor descriptors (where the blocks cover the head dims: 32 / 32, not 24 / 16)
    made, _from = [], TensorDescriptor.from_tensor
    TensorDescriptor.from_tensor = lambda t, b: made.append(b) or _from(t, b)
    for bal, vs, sp in ((True, 1, 3), (False, 1, 14), (True, 2, 3)):
        o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, balance=bal, vsplit=vs, splits=sp,
                               block_n=16, tma=True)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, "tma", bal, vs)
    assert len(made) == (6 if d == 32 else 0), (d, made)
    TensorDescriptor.from_tensor = _from
    o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, vsplit=3, block_n=16)  # blocks past Dv
    assert float((o - r).abs().max()) < 1e-5, (d, dv, "vsplit 3")
    perm = torch.randperm(len(kpos), generator=g)
    for fold, vs in ((False, 1), (True, 2)):
        o = position_attention(q, k[perm], v[perm], qp, kp[perm], scale=0.3, fused_fold=fold, vsplit=vs, splits=3)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, fold, vs)
    # the fold's run-time loop, for more splits than FOLD_UNROLL (the unrolled form above, its compile-time count
    # rounded up to FOLD_BUCKET with the rest masked: 3 splits fold as 8): here past 2
    from hypic.ops import triton_attention
    triton_attention.FOLD_UNROLL = 2
    for sp in (3, 7):
        o = position_attention(q, k, v, qp, kp, scale=0.3, sorted_keys=True, fused_fold=True, splits=sp, block_n=16)
        assert float((o - r).abs().max()) < 1e-5, (d, dv, "fold by a run-time loop", sp)
    triton_attention.FOLD_UNROLL = 32
builds = [triton_attention._fold_splits(n) for n in range(1, 40)]
assert sorted(set(builds)) == [0, 8, 16, 24, 32], builds
assert all(b >= n for n, b in zip(range(1, 33), builds)) and builds[32:] == [0] * 7, builds
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_scan_by_position_in_interpreter():
    """The compose pass's chain by position (ops/triton_scan.py `_by_position`, compose/scan.py STEP_BY_POSITION): a chain
    whose steps after the first are runs' dense maps at consecutive slots of the pairs' buffer, taken by position with
    the product M x as three tf32 products of M as loaded, M's rest and x's two parts, and the runs' corrections as three
    bf16 products. In Triton's interpreter, which drops each tf32 operand's low 13 bits as the device's wgmma does
    (`_tf32`), the final states and corrected outputs against the fp64 chain within 1e-6 (the interpreter measured
    1.1-1.6e-7 and 1.0-1.5e-7; without M's rest 5.7e-4, one slot off 1.2): the first map a cached one's (from zero or
    not) or a run's, from zero or not, value blocks of 16 and 32, beside a second chain of one unflagged run; the same
    tables unflagged, or flagged with the form off, as their rows name them (1e-6)."""
    code = """
import sys
sys.modules["fla"] = None; sys.modules["causal_conv1d"] = None
import torch
from hypic.ops import triton_scan
from hypic.compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
torch.manual_seed(0)
H, K, V, N = 2, 32, 32, 5
rel = lambda a, b: float((a.double() - b).norm() / b.norm())
T_e = [torch.randn(H, K, K) / K ** .5 * .9 for _ in range(2)]
S_e = [torch.randn(H, K, V) for _ in range(2)]
runs = torch.cat([torch.randn(N, H, K, V), torch.randn(N, H, K, K) / K ** .5 * .9], -1).contiguous()   # [c | M]
lens, t0 = [3, 5, 2, 4, 1], [0, 3, 8, 10, 14]
outs = torch.randn(15, H, V + K)
outs[..., V:] = outs[..., V:].bfloat16().float()          # u_t in bf16, as the summary writes it (exact in tf32)


def rows_for(first, p0, p1):
    # first: None, or a cached map's index; then runs p0..p1-1 (consecutive slots of `runs`)
    rows = [] if first is None else [[T_e[first].data_ptr(), S_e[first].data_ptr(), 0, first, 0, 0]]
    for i in range(p0, p1):
        off = i * H * K * (V + K) * 4
        rows.append([off, off, 1, 2 + i, t0[i], lens[i]])
    return rows


def reference(init, chains):
    # fp64: each chain's steps from its init, runs' outputs corrected by the state entering them
    o = outs.double().clone()
    finals = []
    for x, rows in zip(init.double(), chains):
        for tv, sv, kind, slot, a, n in rows:
            if kind & 1:
                i = slot - 2
                o[a:a + n, :, :V] += torch.einsum("nhk,hkv->nhv", o[a:a + n, :, V:], x)
                x = runs[i, :, :, V:].double() @ x + runs[i, :, :, :V].double()
            else:
                x = T_e[slot].double() @ x + S_e[slot].double()
        finals.append(x)
    return o[..., :V], torch.stack(finals)


for first, p0, from_zero in ((0, 1, False), (1, 0, True), (None, 0, False), (None, 1, True)):
    chain0 = rows_for(first, p0, 4)
    chain1 = rows_for(None, 4, 5)                         # a second chain of one run (unflagged)
    tbl = torch.tensor(chain0 + chain1, dtype=torch.int64)
    cu = torch.tensor([0, len(chain0), len(chain0) + 1], dtype=torch.int32)
    init = torch.randn(2, H, K, V)
    if from_zero:
        init[0] = 0
        tbl[0, 2] |= STEP_FROM_ZERO
    want_o, want_f = reference(init, [tbl[:len(chain0)].tolist(), tbl[len(chain0):].tolist()])
    flagged = tbl.clone()
    flagged[0, 2] |= STEP_BY_POSITION
    for bv in (16, 32):
        for t, pos in ((tbl, True), (flagged, False), (flagged, True)):
            got = outs.clone()
            _, f = triton_scan.scan_steps(init, t, cu, runs, 2 + N, outputs=got, max_run=8, bv=bv, position=pos)
            assert rel(f, want_f) < 1e-6 and rel(got[..., :V], want_o) < 1e-6, (first, p0, bv, pos)
print("ok")
"""
    _run_in_interpreter(code)


# interpreter-test code (needs g, H, K, V, WF, lens): runs of `lens` tokens summarized by the reference recurrence from
# [0 | I] (dense [S | T] [R, H, K, V + K]), their factors F by reference `run_factors` and U (the WY-solved values) by
# the same triangular system
_RUNS_WITH_FACTORS = """
n = sum(lens)
k = torch.nn.functional.normalize(torch.randn(1, n, H, K, generator=g), dim=-1)
q = torch.randn(1, n, H, K, generator=g)
v = torch.randn(1, n, H, V, generator=g)
gl = torch.empty(1, n, H).uniform_(math.log(0.5), 0, generator=g)
beta = torch.rand(1, n, H, generator=g)
cu_t = torch.tensor([0] + lens).cumsum(0)
_, _, dense = recurrent_gated_delta_summary(q, k, v, gl, beta, cu_seqlens=cu_t)      # [R, H, K, V + K] fp32
F = run_factors(k, gl, beta, cu_t, WF).contiguous()
U = torch.zeros(len(lens), H, WF, V)
for i, (a, b) in enumerate(zip(cu_t[:-1].tolist(), cu_t[1:].tolist())):
    kk, gg, bb = k[0, a:b].transpose(0, 1), gl[0, a:b].transpose(0, 1), beta[0, a:b].transpose(0, 1)
    _, _, system = _ut_system(kk[None], gg[None], bb[None])
    U[i, :, : b - a] = torch.linalg.solve_triangular(system[0], bb[..., None] * v[0, a:b].transpose(0, 1), upper=False,
                                                     unitriangular=True)
"""


@needs_triton
def test_triton_pair_lowrank_in_interpreter():
    """Seam runs composed with the cached map after them from the runs' low-rank factors (ops/triton_scan.pair_lowrank,
    the compose pass's LOWRANK_PAIRS): runs of 5, 8 and 16 tokens summarized by the reference recurrence
    from [0 | I] (their dense [S | T]), their factors by reference `run_factors` and U by the same triangular system;
    [S_e + P U | g T_e - P W] equal to T_e [S_r | T_r] + [S_e | 0] in fp64 to fp32 rounding (1e-5), and a run with no
    cached map after it to its own [S_r | T_r]; in one program per row block, in two (halves), with the columns in
    chunks, with every load first, and those items walked by a fixed grid of programs (persist3: one item a program,
    and a grid of two, each walking every other item), from a table of 4-wide and of 6-wide rows (the compose
    pass's); a row marked skipped writes nothing."""
    code = """
import math, torch
from hypic.ops.triton_scan import pair_lowrank
from hypic.ops.reference.gated_delta import recurrent_gated_delta_summary, run_factors, factors_to_dense, _ut_system
g = torch.Generator().manual_seed(0)
H, K, V, WF = 2, 32, 16, 16
lens = [5, 8, 16]
""" + _RUNS_WITH_FACTORS + """
Te = torch.randn(2, H, K, K, generator=g) / K ** .5
Se = torch.randn(2, H, K, V, generator=g)
pairs = torch.tensor([[Te[0].data_ptr(), Se[0].data_ptr(), 0, 0], [Te[1].data_ptr(), Se[1].data_ptr(), 2, 0],
                      [0, 0, 1, 0]])
wide = torch.zeros(3, 6, dtype=torch.int64)
wide[:, :4] = pairs
d = dense.double()
want = [torch.cat([Te[0].double() @ d[0, ..., :V] + Se[0].double(), Te[0].double() @ d[0, ..., V:]], -1),
        d[1], torch.cat([Te[1].double() @ d[2, ..., :V] + Se[1].double(), Te[1].double() @ d[2, ..., V:]], -1)]
for table, rows, halves in ((pairs, 16, False), (pairs, 32, True), (wide, 16, True), (wide, 32, 16), (pairs, 16, 16),
                            (pairs, 16, "first"), (wide, 32, "first"), (pairs, 16, "persist3"), (wide, 32, "persist3")):
    out = torch.full((len(lens), H, K, V + K), float("nan"))
    pair_lowrank(table, F, U, out, block_rows=rows, warps=4, halves=halves)
    for i in range(3):
        err = float((out[i].double() - want[i]).abs().max() / want[i].abs().max())
        assert err < 1e-5, (i, err, rows, halves)
    marked = table.clone()
    marked[2, 3] = 1                                   # run 1 marked (a pad run): with skip_marked, not written
    out = torch.full((len(lens), H, K, V + K), float("nan"))
    pair_lowrank(marked, F, U, out, block_rows=rows, warps=4, halves=halves, skip_marked=True)
    assert out[1].isnan().all() and not out[[0, 2]].isnan().any(), (rows, halves)
from hypic.ops import triton_scan
triton_scan._SMS[torch.device("cpu")] = 1              # a grid of 2 programs: each walks every other item
for table, rows in ((pairs, 16), (wide, 32)):
    out = torch.full((len(lens), H, K, V + K), float("nan"))
    pair_lowrank(table, F, U, out, block_rows=rows, warps=4, halves="persist3")
    for i in range(3):
        err = float((out[i].double() - want[i]).abs().max() / want[i].abs().max())
        assert err < 1e-5, (i, err, rows)
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_scan_pairs_in_interpreter():
    """The seam runs' pairs made inside the chain scan (ops/triton_scan.scan_pairs, the compose pass's PAIRS_IN_SCAN):
    each run taken from x by its factors and WY values, y = g x + Kd^T (U - W x), then the cached map after it read in
    place, T_e y + S_e (or y where none follows), its outputs corrected from x first. Runs of 5, 8, 16 and 8 tokens
    summarized by the reference recurrence from [0 | I] (the dense [S_r | T_r] the fp64 chain takes), their factors by
    reference `run_factors` and U by the same triangular system; the final states and corrected outputs within 1e-5 of
    the fp64 chain (fp32 products: the pair kernel's tolerance): chains whose first step is a cached map (from zero or
    not) or a run (from zero or not), then runs by position (flagged) or as their rows name them (unflagged), with a
    cached map alone in the middle of an unflagged chain, value blocks of 16 and 32, beside a second chain of one run.
    A mutant that drops the cached map's S_e fails."""
    code = """
import sys, math
sys.modules["fla"] = None; sys.modules["causal_conv1d"] = None
import torch
from hypic.ops import triton_scan
from hypic.compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
from hypic.ops.reference.gated_delta import recurrent_gated_delta_summary, run_factors, _ut_system
g = torch.Generator().manual_seed(0)
H, K, V, WF = 2, 32, 32, 16
lens = [5, 8, 16, 8]
""" + _RUNS_WITH_FACTORS + """
T_e = [torch.randn(H, K, K, generator=g) / K ** .5 * .9 for _ in range(3)]
S_e = [torch.randn(H, K, V, generator=g) for _ in range(3)]
after = [1, None, 2, 0]                                   # the cached map after each run (run 1: none)
pairs = torch.zeros(len(lens), 6, dtype=torch.int64)
for i, e in enumerate(after):
    if e is not None:
        pairs[i, 0], pairs[i, 1] = T_e[e].data_ptr(), S_e[e].data_ptr()
    pairs[i, 2] = i
outs = torch.randn(n, H, V + K, generator=g)
outs[..., V:] = outs[..., V:].bfloat16().float()          # u_t in bf16, as the summary writes it
mb = H * K * (V + K) * 4                                  # a run's offset unit in the paired table


def entry_row(e):
    return [T_e[e].data_ptr(), S_e[e].data_ptr(), 0, e, 0, 0]


def run_row(i):
    return [i * mb, i * mb, 1, 3 + i, int(cu_t[i]), lens[i]]


def reference(init, chains, drop_se=False):
    o = outs.double().clone()
    finals = []
    for x, rows in zip(init.double(), chains):
        for tv, sv, kind, slot, a, m in rows:
            if kind & 1:
                i = slot - 3
                o[a:a + m, :, :V] += torch.einsum("nhk,hkv->nhv", o[a:a + m, :, V:], x)
                x = dense[i, ..., V:].double() @ x + dense[i, ..., :V].double()
                if after[i] is not None:
                    x = T_e[after[i]].double() @ x + (0 if drop_se else S_e[after[i]].double())
            else:
                x = T_e[slot].double() @ x + S_e[slot].double()
        finals.append(x)
    return o[..., :V], torch.stack(finals)


rel = lambda a, b: float((a.double() - b).norm() / b.norm())
cases = (([entry_row(0), run_row(0), run_row(1), run_row(2)], True, False),
         ([entry_row(2), run_row(0), run_row(1), run_row(2)], True, True),
         ([run_row(0), run_row(1), run_row(2)], True, False),
         ([run_row(0), run_row(1), run_row(2)], True, True),
         ([run_row(0), entry_row(1), run_row(1), run_row(2)], False, False),
         ([entry_row(0), run_row(2), entry_row(1), run_row(1)], False, True))
for chain0, by_pos, from_zero in cases:
    chain1 = [run_row(3)]
    tbl = torch.tensor(chain0 + chain1, dtype=torch.int64)
    cu = torch.tensor([0, len(chain0), len(chain0) + 1], dtype=torch.int32)
    init = torch.randn(2, H, K, V, generator=g)
    if from_zero:
        init[0] = 0
        tbl[0, 2] |= STEP_FROM_ZERO
    if by_pos:
        tbl[0, 2] |= STEP_BY_POSITION
    want_o, want_f = reference(init, [chain0, chain1])
    for bv in (16, 32):
        got = outs.clone()
        f = triton_scan.scan_pairs(init, tbl, cu, pairs, F, U, got, max_run=16, bv=bv, warps=4)
        ef, eo = rel(f, want_f), rel(got[..., :V], want_o)
        assert ef < 1e-5 and eo < 1e-5, (chain0, by_pos, from_zero, bv, ef, eo)
        assert torch.equal(got[..., V:], outs[..., V:])             # the readout columns untouched
_, mutant = reference(init, [chain0, chain1], drop_se=True)
assert rel(f, mutant) > 1e-2
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_tail_epilogue_in_interpreter():
    """The query's tail walked from the chain's state (ops/triton_scan.tail_epilogue, the compose pass's QUERY_TAIL) in
    Triton's interpreter: a 41-token query in three runs (16, 16, 9 tokens) summarized from zero by the reference
    (outputs, readout, factors and WY values at width 16) inside rows of a larger pass (rows 9..49 of 64, the pads
    after them), then walked from a random state s0. Against the token-by-token recurrence of the same tokens from s0
    in fp64 (outputs and final state, 1e-5: fp32 products), for the kernel and the reference op; the rows before the
    tail left as they were, the pads' rows zero; the summary's [N, HV, V + K] views (strided rows) as the pass gives
    them. A mutant that skips a run's state update fails."""
    code = """
import math, torch
from hypic.ops.triton_scan import tail_epilogue
from hypic.ops.reference.gated_delta import gated_delta_tail, recurrent_gated_delta_rule, recurrent_gated_delta_summary
g = torch.Generator().manual_seed(0)
HV, K, V, N, t0, t1 = 2, 32, 32, 64, 9, 50
k = torch.nn.functional.normalize(torch.randn(1, N, HV, K, generator=g), dim=-1)
q = torch.randn(1, N, HV, K, generator=g)
v = torch.randn(1, N, HV, V, generator=g)
gl = torch.empty(1, N, HV).uniform_(math.log(0.7), 0, generator=g)
beta = torch.rand(1, N, HV, generator=g)
cu_t = torch.tensor([9, 25, 41, 50])
sl = slice(t0, t1)
ot, ut, U, F = recurrent_gated_delta_summary(q[:, sl], k[:, sl], v[:, sl], gl[:, sl], beta[:, sl],
                                             cu_seqlens=cu_t - t0, max_len=16, factors=True, values=True)
assert U.shape == (3, HV, 16, V) and F.shape == (3, HV, 33, K)
buf = torch.full((N, HV, V + K), float("nan"))           # the summary's outputs as the pass has them: [o | u] rows
buf[sl, :, :V], buf[sl, :, V:] = ot, ut
s0 = torch.randn(HV, K, V, generator=g)
o0 = torch.randn(N, HV, V, generator=g)
want_o, want_s = recurrent_gated_delta_rule(q[:, sl].double(), k[:, sl].double(), v[:, sl].double(), gl[:, sl].double(),
                                            beta[:, sl].double(), initial_state=s0[None].double(),
                                            output_final_state=True)
for name in ("kernel", "reference", "reference in two calls", "mutant"):
    b = buf.clone()
    b[:t0, :, :V] = o0[:t0]                               # rows before the tail: the chained runs', left as they are
    o, u = b[..., :V], b[..., V:]
    if name == "kernel":
        fin = tail_epilogue(o, u, s0, U, F, cu_t, block_v=16, warps=4)
    elif name == "reference":
        fin = gated_delta_tail(o, u, s0, U, F, cu_t)
    elif name == "reference in two calls":                # runs 0-1, then run 2 from the state they leave
        fin = gated_delta_tail(o[:41], u[:41], s0, U[:2], F[:2], cu_t[:3])
        fin = gated_delta_tail(o, u, fin, U[2:], F[2:], cu_t[2:])
    else:                                                 # run 1 taken as the identity (T = I, S = 0): must fail
        Fm, Um = F.clone(), U.clone()
        Fm[1], Um[1] = 0, 0
        Fm[1, :, 32, :] = 1.0
        fin = tail_epilogue(o, u, s0, Um, Fm, cu_t, block_v=16, warps=4)
        assert float((fin.double() - want_s[0]).abs().max() / want_s.abs().max()) > 1e-2
        continue
    err_o = float((o[sl].double() - want_o[0]).abs().max() / want_o.abs().max())
    err_s = float((fin.double() - want_s[0]).abs().max() / want_s.abs().max())
    assert err_o < 1e-5 and err_s < 1e-5, (name, err_o, err_s)
    assert torch.equal(o[:t0], o0[:t0]) and (o[t1:] == 0).all(), name
for bad in ((U[:, :1], F, cu_t), (U.transpose(-1, -2).contiguous(), F, cu_t), (U, F, cu_t[:3])):
    try:
        tail_epilogue(buf[..., :V].clone(), buf[..., V:].clone(), s0, *bad)
        raise AssertionError("mismatched values must be refused")
    except ValueError:
        pass
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_gates_in_interpreter():
    """ops/triton_gates.py in Triton's interpreter against the reference in fp64: the GDN gate and write strength of a
    and b read in place as columns of a wider matrix (a joined GEMM's output), with |a + dt_bias| up to ~40 so that
    softplus's threshold (20) and its tiny tail (where log(1 + e) would be 0) are both crossed; act(gate) * up from
    columns likewise (SwiGLU), and sigmoid(gate) * out with gate the strided heads of a gated attention's q_proj output.
    fp32: the interpreter's bf16 casts truncate, so the roundings are the GPU test's. 1e-6: a few fp32 ulps of exp,
    log and sigmoid. And the fast backend's ops take these kernels (the reference ops when the switch is off)."""
    code = """
import torch
from hypic.ops import fast, triton_gates
from hypic.ops.reference import gdn_gate_beta as ref_gb, act_mul as ref_am
def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm())
g = torch.Generator().manual_seed(0)
for n, h in ((37, 32), (5, 6), (0, 8)):
    wide = torch.randn(n, 3 * h + 7, generator=g) * 12
    a, b = wide[:, 3:3 + h], wide[:, 3 + h + 2:3 + 2 * h + 2]
    a_log, dt = torch.randn(h, generator=g), torch.randn(h, generator=g)
    g1, b1 = triton_gates.gate_beta(a, b, a_log, dt)
    assert g1.shape == b1.shape == (n, h) and g1.dtype == torch.float32 and b1.dtype == b.dtype
    gu = torch.randn(n, 2 * h + 3, generator=g) * 4
    s1 = triton_gates.act_mul(gu[:, :h], gu[:, h + 3:])
    assert s1.shape == (n, h) and s1.is_contiguous()
    qg = torch.randn(n, 4, 2 * h, generator=g) * 4               # [query | gate] per head; the gate's heads strided
    gate, out = qg.chunk(2, dim=-1)[1], torch.randn(n, 4, h, generator=g)
    s2 = triton_gates.act_mul(gate, out, "sigmoid")
    assert s2.shape == (n, 4 * h) and s2.is_contiguous()
    if n:
        g0, b0 = ref_gb(a.double(), b.double(), a_log.double(), dt.double())
        assert rel(g1, g0) < 1e-6 and rel(b1, b0) < 1e-6, (n, h)
        assert rel(s1, ref_am(gu[:, :h].double(), gu[:, h + 3:].double())) < 1e-6
        assert rel(s2, ref_am(gate.double(), out.double(), "sigmoid")) < 1e-6
        assert rel(s2, ref_am(gate.double(), out.double(), "silu")) > 1e-2
x = torch.tensor([[-100., -30., -17., -5., 0., 5., 19.9, 20.1, 50.]])     # softplus across its range, elementwise
z = torch.zeros(9)
g1 = triton_gates.gate_beta(x, x, z, z)[0]
g0 = ref_gb(x.double(), x.double(), z.double(), z.double())[0]
assert ((g1.double() - g0).abs() <= 4e-7 * g0.abs()).all(), (g1, g0)
n, h = 9, 8
wide, gu, qg = torch.randn(n, 3 * h + 7, generator=g), torch.randn(n, 2 * h + 3, generator=g), torch.randn(n, 4, 2 * h)
gate, out = qg.chunk(2, dim=-1)[1], torch.randn(n, 4, h, generator=g)
a_log, dt = torch.randn(h, generator=g), torch.randn(h, generator=g)
fast.INTERPRETED = True
calls = []
for name in ("gate_beta", "act_mul"):
    fn = getattr(triton_gates, name)
    setattr(triton_gates, name, lambda *a, _fn=fn, _n=name: calls.append(_n) or _fn(*a))
a, b = wide[:, 3:3 + h], wide[:, 3 + h + 2:3 + 2 * h + 2]
fast.gdn_gate_beta(a, b, a_log, dt)
fast.act_mul(gu[:, :h], gu[:, h + 3:])
fast.act_mul(gate, out, "sigmoid")
assert calls == ["gate_beta", "act_mul", "act_mul"], calls
fast.FUSED_GATES = False
fast.gdn_gate_beta(a, b, a_log, dt)
assert torch.equal(fast.act_mul(gate, out, "sigmoid"), ref_am(gate, out, "sigmoid"))
assert calls == ["gate_beta", "act_mul", "act_mul"], calls
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_norm_rope_in_interpreter():
    """ops/triton_norm.py's rows read in place and its RoPE epilogue, in Triton's interpreter against the reference in
    fp64 (1e-6: fp32 sums of squares): the query heads of a gated attention's joined GEMM ([N, 16, 512] rows, the
    first half of each head's 2 D columns: neither contiguous nor viewable as rows) normed in place; normed and rotated
    over rotary_dim 0, 8 and D columns (cos / sin of one row per token, as `Rotary.cos_sin` makes them), into a new
    tensor or into rows of a larger buffer whose other rows stay as they were; the gated norm of a summary's [o | u]
    view; a mutant with sin negated fails. And the fast backend's rms_norm_rope takes the kernel (its result equal to
    the reference op's within the same bound), and the reference when the switch is off."""
    code = """
import torch
from hypic.ops import fast
from hypic.ops.triton_norm import norm_rows
from hypic.ops.reference import rms_norm, rms_norm_gated, rms_norm_rope
def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm())
g = torch.Generator().manual_seed(0)
N, G, D = 19, 4, 32
wide = torch.randn(N, G, 2 * D, generator=g) * 3
q = wide.chunk(2, dim=-1)[0]                         # strided heads, as GatedAttention's q
assert not q.is_contiguous()
w = torch.randn(D, generator=g)
assert rel(norm_rows(q, w, 1e-6), rms_norm(q.double(), w.double(), 1e-6)) < 1e-6
pos = torch.randint(0, 30000, (N,), generator=g).float()
for r in (0, 8, D):
    inv = 1.0 / (10000 ** (torch.arange(0, max(r, 2), 2).float() / max(r, 2)))
    ang = pos[:, None] * inv[None, :]
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    want = rms_norm_rope(q.double(), w.double(), 1e-6, cos.double(), sin.double(), r)
    got = norm_rows(q, w, 1e-6, rope=(cos, sin, r))
    assert got.is_contiguous() and rel(got, want) < 1e-6, r
    big = torch.full((N + 5, G, D), 7.0)
    into = big[2:N + 2]
    assert norm_rows(q, w, 1e-6, rope=(cos, sin, r), out=into) is into
    assert rel(into, want) < 1e-6 and (big[:2] == 7).all() and (big[N + 2:] == 7).all(), r
    if r:
        bad = norm_rows(q, w, 1e-6, rope=(cos, -sin, r))
        assert rel(bad, want) > 1e-2
        fast.INTERPRETED = True
        ropes = []
        kern = fast.triton_kernel("norm")
        fast._import_kernel.cache_clear()
        import hypic.ops.triton_norm as tn
        tn.norm_rows = lambda *a, **kw: ropes.append(kw.get("rope") is not None) or kern(*a, **kw)
        assert rel(fast.rms_norm_rope(q, w, 1e-6, cos, sin, r), want) < 1e-6 and ropes == [True]
        fast.FUSED_GATES = False                     # the norm's kernel, then the reference's rotation
        assert rel(fast.rms_norm_rope(q, w, 1e-6, cos, sin, r), want) < 1e-6 and ropes == [True, False]
        tn.norm_rows = kern
        fast._import_kernel.cache_clear()
        fast.FUSED_GATES, fast.INTERPRETED = True, False
ou = torch.randn(N, G, D + 16, generator=g)          # the summary's [o | u] rows: o read in place
o, z = ou[..., :D], torch.randn(N, G, D, generator=g)
assert rel(norm_rows(o, w, 1e-6, gate=z), rms_norm_gated(o.double(), z.double(), w.double(), 1e-6, "silu")) < 1e-6
for bad in (dict(rope=(cos, sin, 7)), dict(rope=(cos, sin, r), gate=z), dict(out=torch.empty(N, G, D).transpose(0, 1))):
    try:
        norm_rows(q, w, 1e-6, **bad)
        raise AssertionError(bad)
    except ValueError:
        pass
print("ok")
"""
    _run_in_interpreter(code)


@needs_triton
def test_triton_add_norm_in_interpreter():
    """ops/triton_norm.py add_norm_rows (a layer's residual add with the norm after it) in Triton's interpreter: in fp32
    the sum bit for bit the PyTorch add's and the norm against the reference op in fp64 (1e-6: fp32 sums of squares);
    in bf16 (the interpreter's casts truncate where the GPU's round to nearest: test_add_norm_matches_reference_on_cuda
    checks the roundings) the sum within one bf16 step of PyTorch's and the norm of the kernel's own rounded sum within
    a bf16 rounding; rows of 2,048 (the 35B's hidden size) and of an odd width. And the fast backend routes
    `add_rms_norm` to the kernel, and to the add and rms_norm when FUSED_ADD_NORM is off."""
    code = """
import torch
from hypic.ops import fast
from hypic.ops.triton_norm import add_norm_rows
from hypic.ops.reference import add_rms_norm, rms_norm
def rel(x, y):
    x, y = x.double(), y.double()
    return float((x - y).norm() / y.norm())
g = torch.Generator().manual_seed(0)
for n, d in ((5, 2048), (9, 200)):
    w = 1 + 0.1 * torch.randn(d, generator=g)
    for dt in (torch.float32, torch.bfloat16):
        x, r = (torch.randn(n, d, generator=g) * 3).to(dt), torch.randn(n, d, generator=g).to(dt)
        s, y = add_norm_rows(x, r, w, 1e-6)
        assert s.dtype == y.dtype == dt and s.shape == y.shape == x.shape
        if dt == torch.float32:
            assert torch.equal(s, x + r), (n, d)
            s0, y0 = add_rms_norm(x.double(), r.double(), w.double(), 1e-6)
            assert rel(y, y0) < 1e-6, (n, d)
        else:
            want = (x + r).float()
            assert bool(((s.float() - want).abs() <= want.abs() * 2 ** -7).all()), (n, d)
            assert rel(y, rms_norm(s.double(), w.double(), 1e-6)) < 8e-3, (n, d)
fast.INTERPRETED = True
w = torch.randn(64, generator=g)
x, r = torch.randn(3, 7, 64, generator=g), torch.randn(3, 7, 64, generator=g)
calls = []
kern = fast.triton_kernel("add_norm")
fast._import_kernel.cache_clear()
import hypic.ops.triton_norm as tn
tn.add_norm_rows = lambda *a: calls.append(1) or kern(*a)
s, y = fast.add_rms_norm(x, r, w, 1e-6)
assert calls == [1] and s.shape == x.shape and torch.equal(s, x + r) and rel(y, rms_norm(x + r, w, 1e-6)) < 1e-6
fast.FUSED_ADD_NORM = False
s, y = fast.add_rms_norm(x, r, w, 1e-6)
assert calls == [1] and torch.equal(s, x + r)
tn.add_norm_rows = kern
fast._import_kernel.cache_clear()
fast.FUSED_ADD_NORM, fast.INTERPRETED = True, False
try:
    add_norm_rows(x, r[..., :32], w, 1e-6)
    raise AssertionError("mismatched shapes must be refused")
except ValueError:
    pass
print("ok")
"""
    _run_in_interpreter(code)


@cuda
def test_add_norm_matches_reference_on_cuda():
    """The residual add with its norm in one kernel (ops/triton_norm.py add_norm_rows), bf16 on the GPU: the sum bit for
    bit PyTorch's add (one round-to-nearest of the fp32 sum), the norm within one bf16 ulp of the reference op on that
    sum (only the reduction's order differs), at the 35B's hidden size and the full prefill's row count scale."""
    from hypic.ops import fast

    g = torch.Generator(device="cuda").manual_seed(5)
    for n, d in ((1, 2048), (256, 2048), (4099, 2048), (7, 200)):
        x = (torch.randn(n, d, device="cuda", generator=g) * 4).bfloat16()
        r = torch.randn(n, d, device="cuda", generator=g).bfloat16()
        w = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
        s, y = fast.add_rms_norm(x, r, w, 1e-6)
        assert "add_norm" not in fast.FAILED and torch.equal(s, x + r), (n, d)
        want = ref.rms_norm(x + r, w, 1e-6).float()
        spacing = torch.exp2(torch.floor(torch.log2(want.abs().clamp_min(1e-30)))) * 2.0 ** -7
        assert float(((y.float() - want).abs() / spacing).max()) <= 1, (n, d)


@cuda
def test_gates_match_unfused_ops_on_cuda():
    """The fused gates on the GPU in bf16 against the ops they replace: act(gate) * up within one bf16 rounding of
    PyTorch's two ops (the activation's fp32 value may round the other way where it sits on a bf16 midpoint: rare),
    for SwiGLU's columns and a gated attention's strided gate heads; the GDN gate (fp32) within 1e-6 of the
    reference's, sigmoid(b) within one bf16 rounding; the query norm with RoPE likewise against the norm kernel and
    the reference rotation."""
    from hypic.ops import fast, triton_gates
    from hypic.ops.reference import gdn_gate_beta as ref_gb
    from hypic.ops.reference.attention import rope_into

    def within_ulp(a, b, frac=0.02):
        a, b = a.float(), b.float()
        return bool(((a - b).abs() <= b.abs() * 2 ** -8 + 1e-30).all()) and float((a != b).float().mean()) < frac

    g = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randn(256, 2 * 512 + 1 + 32 * 2, device="cuda", generator=g).bfloat16() * 4
    gate, up = wide[:, :512], wide[:, 512:1024]
    assert within_ulp(triton_gates.act_mul(gate, up), torch.nn.functional.silu(gate) * up)
    qg = (torch.randn(256, 16, 512, device="cuda", generator=g) * 4).bfloat16()
    hg, out = qg.chunk(2, dim=-1)[1], torch.randn(256, 16, 256, device="cuda", generator=g).bfloat16()
    assert within_ulp(triton_gates.act_mul(hg, out, "sigmoid"), (out * torch.sigmoid(hg)).reshape(256, -1))
    a, b = wide[:, 1025:1057], wide[:, 1057:1089]
    a_log, dt = torch.randn(32, device="cuda", generator=g), torch.randn(32, device="cuda", generator=g)
    g0, b0 = ref_gb(a, b, a_log, dt)
    g1, b1 = triton_gates.gate_beta(a, b, a_log, dt)
    assert rel(g1, g0) < 1e-6 and within_ulp(b1, b0, 1.0)
    q, w = qg.chunk(2, dim=-1)[0], torch.randn(256, device="cuda", generator=g) * 0.1 + 1
    ang = torch.arange(256, device="cuda").float()[:, None] * 1e4 ** -torch.linspace(0, 1, 32, device="cuda")
    cos, sin = torch.cat([ang, ang], -1).cos().bfloat16(), torch.cat([ang, ang], -1).sin().bfloat16()
    want = torch.empty_like(q, memory_format=torch.contiguous_format)
    rope_into(fast.rms_norm(q, w, 1e-6), cos, sin, want, 64)
    assert within_ulp(fast.rms_norm_rope(q, w, 1e-6, cos, sin, 64), want)


def _parallel_against_one_rank(parallel):
    """A cold PIC request in bf16 on CUDA with segment-parallel workers against the one-rank CUDA engine (the workers
    draw the preset's weights from its seed on their own GPU, so the CUDA engine's weights, not the CPU's). Bound:
    twice the CPU reference's own bf16 error on this prompt, as test_engine_bf16_cuda_matches_cpu_reference; two bf16
    runs that differ only in batch composition should sit far inside it."""
    from hypic import LLM, Prompt

    cpu = LLM("tiny-qwen3.5", device="cpu", dtype="float32", backend="reference")
    cpu16 = LLM("tiny-qwen3.5", device="cpu", dtype="bfloat16", backend="reference")
    with torch.no_grad():
        for (_, a), (_, b) in zip(cpu16.engine.model.named_parameters(), cpu.engine.model.named_parameters()):
            a.copy_(b)
    p = Prompt(segments=["alpha " * 40, "beta " * 50, "gamma " * 30, "delta " * 60], query="question?")
    ref32 = cpu.next_token_logits(p)
    yard = rel(cpu16.next_token_logits(p), ref32)
    one = LLM("tiny-qwen3.5", device="cuda:0", dtype="bfloat16")
    with LLM("tiny-qwen3.5", device="cuda:0", dtype="bfloat16", parallel=parallel) as llm:
        got = llm.next_token_logits(p)
        st = llm.parallel_stats()
        assert st["remote_segments"] >= 1 and st["fallback_segments"] == 0, st
    assert rel(got, one.next_token_logits(p)) <= 2 * max(yard, 1e-3)


@cuda
def test_parallel_prefill_on_one_gpu_over_gloo():
    from hypic import ParallelConfig

    _parallel_against_one_rank(ParallelConfig(workers=2, devices=("cuda:0",), transport="gloo", timeout_s=300.0))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_parallel_prefill_on_two_gpus_over_nccl():
    from hypic import ParallelConfig

    _parallel_against_one_rank(ParallelConfig(workers=2, transport="nccl", timeout_s=300.0))


@cuda
def test_host_and_disk_tiers_on_cuda(tmp_path):
    """Entries evicted from the GPU wait in pinned host memory and come back bit for bit; a second engine on the same
    disk directory serves them from files (cache/tiers.py; tests/test_tiers.py has the CPU versions)."""
    from hypic import LLM, Prompt, SamplingParams

    sp = SamplingParams(max_tokens=3, return_logits=True)
    segs = [f"document {i} " * (8 + 3 * i) for i in range(5)]
    p, rev = Prompt(segments=segs, query="q?"), Prompt(segments=segs[::-1], query="q?")
    plain = LLM("tiny-qwen3.5", device="cuda", dtype="bfloat16", compose="eager")
    want = [plain.generate([x], sp)[0] for x in (p, rev)]
    one = max(e.nbytes for e in plain.engine.segments.values())
    llm = LLM("tiny-qwen3.5", device="cuda", dtype="bfloat16", compose="eager", segment_cache_bytes=2 * one,
              host_cache_bytes=10 * one, disk_cache_dir=str(tmp_path))
    got = [llm.generate([x], sp)[0] for x in (p, rev)]
    assert llm.engine.segments.promotions["host"] >= 1 and got[1].cold_prefill_tokens == 0
    assert all(e.payload.is_pinned() for e in llm.engine.segments.host.values())
    for a, b in zip(got, want):
        assert a.token_ids == b.token_ids and torch.equal(a.logits, b.logits)
    llm.close()
    again = LLM("tiny-qwen3.5", device="cuda", dtype="bfloat16", compose="eager", disk_cache_dir=str(tmp_path))
    out = again.generate([rev], sp)[0]
    assert out.cold_prefill_tokens == 0 and torch.equal(out.logits, want[1].logits)
