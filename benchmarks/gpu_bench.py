"""The headline GPU benchmark (issue 3), one device call: Qwen3.5-35B-A3B architecture, dummy bf16
weights normal(0, 0.02), one H200.

    python benchmarks/gpu_bench.py [--sizes 8192,32768] [--segments 20] [--seg-len 1600] [--query 64]

1. full prefill of one request at each size: transformers' own Qwen3_5MoeForCausalLM (sdpa attention,
   grouped_mm experts, fla kernels) vs hypic `full`, the same weight tensors (hypic's model is built
   on transformers' state dict without copies, after transformers is timed);
2. a RAG request, 20 x 1,600-token segments + a 64-token query, warm caches, the segments in a new
   order: TTFT of `pic` (seam 8), `prefix` (the first segment kept first, the rest reordered) and
   `full`;
3. the cost of building (T, S) in an isolated segment prefill (summarized run vs plain run), 512 /
   2k / 8k tokens;
4. a roofline floor for the warm `pic` request: bytes that must be read once (weights, cache
   entries) over the measured copy bandwidth, FLOPs of the active tokens over the measured bf16
   matmul rate; the larger is the floor.
Timings: median of --reps after a warm-up. A request's TTFT is the engine's: from LLM.generate's call (the prompt's
checks and tokenization included) to the first token on the host, CUDA-synchronised; before the 39th session it was
the wall of the whole one-token call, which also builds the output (~0.3 ms at 32k prompt ids; still printed beside
the headline rows). The transformers rows time its forward pass.
Prints a table, writes benchmarks/results/gpu_bench.json (or --out).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic import LLM, Prompt, SamplingParams  # noqa: E402
from hypic.config import EngineConfig, ModelConfig  # noqa: E402
from hypic.models.loader import from_tensors  # noqa: E402
from hypic.models.presets import preset_config  # noqa: E402
from hypic.runtime import trace as _spans  # noqa: E402
from hypic.runtime.batch import BatchBuilder  # noqa: E402
from hypic.runtime.state import SeqState  # noqa: E402


DEV = "cuda"


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


@contextlib.contextmanager
def flagged(mod, name: str, value):
    """A module switch (e.g. ops/fast.py's) set to value for the block, restored after it."""
    old = getattr(mod, name)
    setattr(mod, name, value)
    try:
        yield
    finally:
        setattr(mod, name, old)


@contextlib.contextmanager
def flags(mod, **values):
    """Several switches of one module set for the block, restored after it."""
    with contextlib.ExitStack() as stack:
        for name, value in values.items():
            stack.enter_context(flagged(mod, name, value))
        yield


def timed(fn, reps: int, warm: int = 1):
    for _ in range(warm):
        fn()
    ts = []
    for _ in range(reps):
        sync()
        t0 = time.perf_counter()
        fn()
        sync()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts), ts


def profile(name, fn, sources: bool = False):
    """sources: also the Python lines behind each aten op that ran on the device (op_sources; eager runs only)."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    sync()
    _spans.ENABLED = True
    try:
        # record_shapes: the by-shape table below names the tensors (run 53's log had that table without shapes)
        # (sources: the op's Python stack is kept only under the verbose experimental config in this torch)
        extra = dict(with_stack=True, experimental_config=torch._C._profiler._ExperimentalConfig(verbose=True)) \
            if sources else {}
        with prof(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True, **extra) as pr:
            fn()
            sync()
    finally:
        _spans.ENABLED = False
    tl_ = timeline(pr, name)
    ka = pr.key_averages()
    print(f"\n== profile: {name} ==")
    print(ka.table(sort_by="self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total", row_limit=36,
                   max_name_column_width=60))
    print(ka.table(sort_by="cpu_time_total", row_limit=16, max_name_column_width=60))
    # the aten ops by input shapes: which tensors the elementwise kernels and copies walk
    kb = pr.key_averages(group_by_input_shape=True)
    print(kb.table(sort_by="self_cuda_time_total" if DEV == "cuda" else "self_cpu_time_total", row_limit=30,
                   max_name_column_width=40, max_shapes_column_width=70))
    if sources:
        print(op_sources(pr))
    return tl_


def op_sources(pr, rows: int = 45, frames: int = 3) -> str:
    """The aten ops with device time, by input shapes and the hypic source lines that called them (all layers
    together), most time first: the small elementwise ops and copies between the compose pass's kernels, named where
    the kernel table cannot (its ~500 `elementwise_kernel` launches of 2-4 us each carry no op name)."""
    cuda = DEV == "cuda"
    t = lambda e: e.self_device_time_total if cuda else e.self_cpu_time_total  # noqa: E731
    groups: dict = {}
    for e in pr.events():
        if not e.name.startswith("aten::") or t(e) <= 0:
            continue
        src = tuple(f.split("hypic/")[-1] for f in (e.stack or []) if "hypic/" in f)[:frames]
        k = (e.name, str(e.input_shapes)[:90], src)
        us, n = groups.get(k, (0.0, 0))
        groups[k] = (us + t(e), n + 1)
    ranked = sorted(groups.items(), key=lambda kv: -kv[1][0])
    out = [f"\n== aten ops with device time, by shapes and source (top {rows} of {len(ranked)}; "
           f"{sum(v[0] for v in groups.values()) / 1e3:.2f} ms in all) ==",
           f"{'us':>8} {'calls':>5}  op  shapes  <- source"]
    for (name, shapes, src), (us, n) in ranked[:rows]:
        out.append(f"{us:8.1f} {n:5d}  {name}  {shapes}  <- {' | '.join(src)}")
    return "\n".join(out)


def timeline(pr, name: str) -> dict:
    """Where the wall time of one profiled call goes: the engine's named host spans (hypic/runtime/trace.py)
    with the GPU's busy time inside each, the GPU's idle time before its first kernel, between kernels (by
    gap size) and after its last one. Prints it and returns it (for the JSON)."""
    from torch.autograd import DeviceType

    evs = list(pr.events())
    # device events: kernels, copies, memsets (the spans' own GPU-side annotations, which cover the kernels
    # launched inside them, are not work)
    dev = sorted((e.time_range.start, e.time_range.end, e.name) for e in evs
                 if e.device_type != DeviceType.CPU and not e.name.startswith(("engine.", "compose.", "llm.")))
    cpu = [e for e in evs if e.device_type == DeviceType.CPU]
    if not cpu:
        return {}
    t0 = min(e.time_range.start for e in cpu)
    t1 = max([e.time_range.end for e in cpu] + [d[1] for d in dev])
    busy, gaps, last_end, merged, prev_name = 0.0, [], None, [], ""
    for a, b, n in dev:
        if last_end is None or a > last_end:
            if last_end is not None:
                gaps.append((a - last_end, prev_name, n))
            merged.append([a, b])
        else:
            merged[-1][1] = max(merged[-1][1], b)
        last_end = b if last_end is None else max(last_end, b)
        prev_name = n
    busy = sum(b - a for a, b in merged)

    def busy_in(a, b):
        return sum(max(0.0, min(b, y) - max(a, x)) for x, y in merged)

    out = dict(wall_us=t1 - t0, gpu_busy_us=busy, kernels=len(dev))
    print(f"\n== timeline: {name} ==")
    print(f"wall {(t1 - t0) / 1e3:.2f} ms; GPU busy {busy / 1e3:.2f} ms over {len(dev)} kernels/copies")
    if dev:
        first, last = merged[0][0], last_end
        out.update(before_first_us=first - t0, after_last_us=t1 - last)
        print(f"GPU idle before its first kernel {(first - t0) / 1e3:.2f} ms, after its last {(t1 - last) / 1e3:.2f} ms")
        buckets = [(0, 2), (2, 5), (5, 20), (20, 100), (100, 1e12)]
        rows = []
        for lo, hi in buckets:
            g = [x[0] for x in gaps if lo <= x[0] < hi]
            rows.append((lo, hi, len(g), sum(g)))
        out["gaps"] = [dict(lo_us=lo, hi_us=hi, n=k, sum_us=t) for lo, hi, k, t in rows]
        print("GPU idle between kernels: " + "; ".join(f"{lo:g}-{hi:g} us: {k} gaps, {t / 1e3:.2f} ms"
                                                          for lo, hi, k, t in rows if k))
        for g, a, b in sorted(gaps, reverse=True)[:8]:
            print(f"  gap {g:8.1f} us after {a[:50]} before {b[:50]}")
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in cpu
                   if e.name.startswith(("engine.", "compose.", "llm.")))
    out["spans"] = []
    for a, b, n in spans:
        g = busy_in(a, b)
        out["spans"].append(dict(name=n, start_us=a - t0, dur_us=b - a, gpu_busy_us=g))
        print(f"  span {n:18s} at {(a - t0) / 1e3:7.2f} ms for {(b - a) / 1e3:7.2f} ms; GPU busy inside {g / 1e3:7.2f} ms")
    return out


def gpu_ms(fn) -> float:
    """The kernels' time of one call of fn (sum of the profiler's device time over its events), in ms:
    the device's share of a call whose wall time may be bound by the host."""
    from torch.profiler import ProfilerActivity, profile as prof

    fn()
    sync()
    with prof(activities=[ProfilerActivity.CUDA]) as pr:
        fn()
        sync()
    return sum(e.self_device_time_total for e in pr.key_averages()) / 1e3


def kernel_times(fn) -> dict:
    """The device time of one call of fn by kernel name: {name: (us, launches)} (the profiler's self device time;
    the engine's span annotations left out)."""
    from torch.profiler import ProfilerActivity, profile as prof

    cuda = DEV == "cuda"                 # (a CPU dry run: the ops' own CPU time)
    fn()
    sync()
    with prof(activities=[ProfilerActivity.CUDA if cuda else ProfilerActivity.CPU]) as pr:
        fn()
        sync()
    t = {e.key: (e.self_device_time_total if cuda else e.self_cpu_time_total, e.count) for e in pr.key_averages()}
    return {k: v for k, v in t.items() if v[0] > 0 and not k.startswith(("engine.", "compose.", "llm."))}


def kernel_diff(base: dict, other: dict, rows: int = 14) -> str:
    """The kernels whose time differs most between two kernel_times tables, and the totals, as text lines."""
    names = sorted(set(base) | set(other), key=lambda k: -abs(other.get(k, (0, 0))[0] - base.get(k, (0, 0))[0]))
    out = [f"{'kernel':<60} {'default':>9} {'variant':>9} {'delta':>9}  launches"]
    for k in names[:rows]:
        (a, na), (b, nb) = base.get(k, (0.0, 0)), other.get(k, (0.0, 0))
        out.append(f"{k[:60]:<60} {a:9.1f} {b:9.1f} {b - a:+9.1f}  {na} -> {nb}")
    ta, tb = sum(v[0] for v in base.values()), sum(v[0] for v in other.values())
    out.append(f"{'all kernels':<60} {ta:9.1f} {tb:9.1f} {tb - ta:+9.1f}  "
               f"{sum(v[1] for v in base.values())} -> {sum(v[1] for v in other.values())}")
    return "\n".join(out)


def ceilings():
    big = DEV == "cuda"
    x = torch.empty(1 << (30 if big else 22), dtype=torch.float32, device=DEV).normal_()
    y = torch.empty_like(x)
    bw = 2 * x.numel() * 4 / timed(lambda: y.copy_(x), 10, 3)[0]
    del x, y
    m = 8192 if big else 512
    a = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    b = torch.randn(m, m, dtype=torch.bfloat16, device=DEV)
    rate = 2 * m ** 3 / timed(lambda: a @ b, 10, 3)[0]
    return bw, rate


def quick(llm, args, ids, ttft, res):
    """The warm pic request alone, no `full` row and no variants (a short device call): after the cold request, three
    groups of six requests in new orders, each group's median of its last five. (Before the forty-first session the
    groups toggled GatedDeltaNet.readout, which the CUDA-graph compose pass does not read: they were repeats already.)"""
    segs = [ids(args.seg_len) for _ in range(args.segments)]
    query = ids(args.query)
    llm.set_policy("pic", 8)
    ttft(Prompt(segments=segs, query=query))
    out = {}
    for g in range(3):
        ts = []
        for r in range(6):
            order = _shuffled(list(range(args.segments)), 6 * g + r + 1)
            ts.append(ttft(Prompt(segments=[segs[i] for i in order], query=query))[0])
        out[f"group {g + 1}"] = statistics.median(ts[1:])
        print(f"warm pic, group {g + 1}: {out[f'group {g + 1}'] * 1e3:.1f} ms  {[round(t * 1e3, 1) for t in ts]}",
              flush=True)
    res["quick"] = out
    (Path(args.out)).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "gpu_bench_quick.json").write_text(json.dumps(res, indent=1, default=str))


def oom_entry(what: str, e: BaseException) -> str:
    """Prints that `what` ran out of GPU memory and returns the JSON's error entry for it."""
    print(f"{what}: out of GPU memory ({str(e)[:160]})", flush=True)
    return f"out of memory: {str(e)[:300]}"


def decode_bench(llm, prompts, steps: int, batches=(1, 8), prof: bool = False):
    """Per-token decode latency after warm pic prefills of long prompts: the dynamic step (a planned
    batch per step) against the CUDA-graph step (fixed buffers, one replay), side by side. A batch that runs out of
    GPU memory (batch 8 at 32k on an 80 GB card: H100 runs 133 and 140) gets an error entry; the other batches keep
    their rows."""
    from hypic.runtime.decode import StaticDecoder

    eng = llm.engine
    graph_dec = eng.decoder or StaticDecoder(eng.model, eng.device, eng.model.lm_head.weight.dtype, graphs=False)
    out = {}
    live = []                                          # the requests of the batch being timed (finished on an error)

    def one_batch(b):
        first = {}
        for mode in ("dynamic", "graph"):
            eng.decoder = None if mode == "dynamic" else graph_dec
            reqs = llm.make_requests(prompts[:b], SamplingParams(max_tokens=steps + 8, ignore_eos=True,
                                                                 return_logits=True))
            live[:] = reqs
            for r in reqs:      # one prefill each (eight 32k prompts at once: out of memory on 80 GB, H100 runs 123-126)
                eng.accept(r, eng.prefill([r])[0])

            def step():
                for r, row in zip(reqs, eng.step(reqs)):
                    eng.accept(r, row)

            for _ in range(2):                        # warm-up (the graph is captured here)
                step()
            sync()
            t0 = time.perf_counter()
            for _ in range(steps):
                step()
            sync()
            per = (time.perf_counter() - t0) / steps
            if prof and mode == "graph" and b == batches[0]:
                out[f"timeline_step_batch_{b}"] = profile(f"decode step, batch {b} (graph)", step)
                if eng.decoder is not None and getattr(eng.decoder, "graphs", False):
                    # the same step's fixed buffers run eagerly: the aten ops behind the graph's kernels
                    for r in reqs:
                        eng.decoder.release(r, write_back=True)
                    eng.decoder = StaticDecoder(eng.model, eng.device, eng.model.lm_head.weight.dtype, graphs=False)
                    for _ in range(2):
                        step()
                    profile(f"decode step, batch {b}, the fixed buffers run eagerly", step)
                    for r in reqs:
                        eng.decoder.release(r, write_back=True)
                    eng.decoder = graph_dec
            first[mode] = reqs[0].logits[1]
            for r in reqs:
                eng.finish(r)
            live.clear()
            out.setdefault(b, {})[mode + "_s"] = per
            print(f"decode batch {b} ({mode}): {per * 1e3:.2f} ms per step", flush=True)
        d, g = first["dynamic"], first["graph"]
        out[b]["speedup"] = out[b]["dynamic_s"] / out[b]["graph_s"]
        out[b]["first_step_rel_diff"] = float((g - d).norm() / d.norm())

    for b in batches:
        try:
            one_batch(b)
        except torch.OutOfMemoryError as e:
            out[b] = {"error": oom_entry(f"decode batch {b}", e)}
            for r in live:             # (their rows released where the decoder holds them; its buffers are rebuilt
                eng.finish(r)          # at the next batch's shape)
            live.clear()
            (torch.cuda.empty_cache() if DEV == "cuda" else None)
    eng.decoder = graph_dec
    out["captures"] = graph_dec.captures if graph_dec else 0
    return out


def ts_rows(model, ids, args, res):
    """The cost of (T, S) in an isolated segment prefill: the segment as one plain run against its seam window
    plus the summarized rest (what prefill/isolated.py runs), side by side in three forms: the default, one
    pass per layer over the segment cut after its seam (fast.chunk_gated_delta_isolated); two rounds per layer
    (seam windows, then the rests) with the rest's transition through fla's state passing only
    (fast.chunk_gated_delta_transition); the same with the transition through fla's whole pipeline on appended
    columns (the form of runs 10-19). Then the same for the RAG request's segments (--segments x --seg-len, 20 x
    1,600 by default) in one forward (what a cold RAG request prefills). one_pass takes the rests' transitions from
    ops/triton_transition.py (fast.TRANSITION_KERNEL, the default since H200 run 50); one_pass_fla_T from fla's
    chunk-state pass instead. On CUDA each form is also timed by its kernels alone (the profiler's device time): the
    short segments' wall clock is host-bound."""
    from hypic.ops import fast as _fast

    over = {}
    sizes = (512, 2048, 8192) if DEV == "cuda" else (64, 128)
    batch = f"{args.segments}x{args.seg_len}"          # the RAG request's segments (20 x 1,600 by default)
    for n in sizes + (batch,):
        segs = [ids(args.seg_len) for _ in range(args.segments)] if n == batch else [ids(n)]

        def run(summarize: bool, walk: str = "phased"):
            b = BatchBuilder(DEV)
            for toks in segs:
                items = ([("run", toks[:8]), ("run", toks[8:], {"summarize": True})] if summarize else [("run", toks)])
                b.add(SeqState(capacity_hint=len(toks)), items, logits="none")
            model(b.build(walk=walk))

        def appended():
            with flagged(_fast, "TRANSITION_STAGES", False):
                run(True, "rounds")

        def fla_t():
            with flagged(_fast, "TRANSITION_KERNEL", False):
                run(True)

        forms = {"one_pass": lambda: run(True), "one_pass_fla_T": fla_t, "rounds": lambda: run(True, "rounds"),
                 "rounds_appended_columns": appended}
        if args.ts_default_only:       # the default form alone (the bar's), against the plain prefill
            forms = {"one_pass": forms["one_pass"]}
        e = over[n] = {"plain_s": timed(lambda: run(False), args.reps + 2)[0]}
        for name, fn in forms.items():
            e[f"{name}_s"] = timed(fn, args.reps + 2)[0]
        e["plain_again_s"] = timed(lambda: run(False), args.reps + 2)[0]       # the host's drift
        e["summarized_s"], e["overhead"] = e["one_pass_s"], e["one_pass_s"] / e["plain_s"] - 1
        line = f"(T, S) overhead at {n}: plain {e['plain_s'] * 1e3:.1f} ms (again {e['plain_again_s'] * 1e3:.1f})"
        for name in forms:
            line += f"; {name} {e[name + '_s'] * 1e3:.1f} ms ({(e[name + '_s'] / e['plain_s'] - 1) * 100:+.1f}%)"
        if DEV == "cuda":              # the same on the device alone (the short rows are host-bound)
            e["plain_gpu_ms"] = gp = gpu_ms(lambda: run(False))
            line += f"; kernels: plain {gp:.1f} ms"
            for name, fn in forms.items():
                e[f"{name}_gpu_ms"] = gs = gpu_ms(fn)
                line += f", {name} {gs:.1f} ({(gs / gp - 1) * 100:+.1f}%)"
            e["summarized_gpu_ms"], e["gpu_overhead"] = e["one_pass_gpu_ms"], e["one_pass_gpu_ms"] / gp - 1
        print(line, flush=True)
        if args.profile_ts and n in (512, 128):
            profile(f"isolated prefill {n}, plain", lambda: run(False))
            profile(f"isolated prefill {n}, summarized", lambda: run(True))
    res["ts_overhead"] = over
    return over


def interleaved_variants(llm, comp, segs, order_a, query, ttft, args, rag):
    # variants of the compose pass, side by side: each variant gets its own composer (fixed buffers, its
    # graph captured under its setting), then the requests alternate between the default and the
    # variants, round by round in rotating order, so a drift of the machine touches all alike. Variants:
    # the runs' transitions factored in the chain scan (runs 27-32) instead of dense; the MoE's grouped GEMMs
    # instead of the few-rows kernel (before run 33); the norms and the GDN gate unfused, the routing and the
    # sort by PyTorch ops (before run 38); the attention operands placed and ordered by PyTorch ops (RoPE
    # products, a copy, two gathers: before run 77); the MoE's sort by comparing every pair of choices (before run
    # 77, where histograms give the ranks); the graph in one piece; a one-layer first piece. With
    # --all-variants also those decided before: the runs' outputs corrected after the scan instead of inside
    # it, the fill by a copy kernel (runs 32-35), the graph in 4 or 16 pieces (run 19 also timed seam runs
    # fused with the segment after them: 68.2 against 64.7 ms, removed)
    from hypic.layers import attention as _attention
    from hypic.layers import joined as _joined
    from hypic.layers import linear as _linear
    from hypic.runtime import compose_graph as _cg

    try:
        from hypic.ops import triton_scan as _ts
        from hypic.ops import triton_route as _tr
    except ImportError:                          # the CPU dry run without triton
        _ts = _tr = None

    def flag(mod, name, value):                 # a variant's switch: a context manager per use
        return lambda: flagged(mod, name, value)

    def both(*switches):                        # several switches as one variant
        @contextlib.contextmanager
        def cm():
            with contextlib.ExitStack() as stack:
                for f in switches:
                    stack.enter_context(f())
                yield
        return cm

    from hypic.ops import fast as _fast
    import hypic.models.base as _base

    nop = contextlib.nullcontext
    variants = [("default", nop, {}),
                ("runs_T_factored", flag(_linear, "RUN_FACTORS", True), {}),          # the default of runs 27-32
                ("runs_dense", flag(_linear, "LOWRANK_PAIRS", False), {}),            # before the 30th session
                ("pairs_skip_pads", flag(_linear, "SKIP_PAD_PAIRS", True), {}),       # 30th session; H100 run 102: +0.17 ms
                ("moe_grouped_mm", flag(_fast, "MOE_FEW_ROWS", False), {}),           # before run 33
                ("norms_unfused", flag(_fast, "FUSED_NORMS", False), {}),             # before run 38
                ("route_by_torch", flag(_fast, "ROUTE_KERNELS", False), {}),          # before run 38
                ("head_norms_by_fla", flag(_fast, "NORM_ROWS", False), {}),           # before run 49
                ("order_keys_by_torch", flag(_fast, "ORDER_KERNEL", False), {}),      # before run 77
                ("last_layer_all_rows", flag(_base, "PRUNE_LAST_LAYER", False), {}),  # before the 28th session
                # the cached keys ordered by the fill ahead of the pass / the later fills on a side stream (31st
                # session; no gain in H100 runs 102-103: off)
                ("order_ahead", flag(_attention, "ORDER_AHEAD", True), {}),
                # the cached keys and values read in place by the ordering kernel, not packed by the fill (32nd)
                ("order_packed" if _attention.ORDER_FROM_ENTRIES else "order_from_entries",
                 flag(_attention, "ORDER_FROM_ENTRIES", not _attention.ORDER_FROM_ENTRIES), {}),
                ("fills_beside", flag(_cg, "SIDE_FILL", True), {}),
                # every request lowered afresh, no layout kept for the next of the same layout (before the 33rd)
                ("layouts_off", flag(_cg, "LAYOUTS", 0), {}),
                # the runs cut into pieces of 32 or 64 tokens instead of 16 (the 64-token query: 2 or 1 chain steps,
                # not 4; every run's summary chunk, pair factors and scan correction rows 32 or 64 wide)
                # the query's pieces outside the chain, walked by one launch a layer (32nd session; the 31st's form,
                # the query as one 64-token chunk by a call of its own: +1.26 ms in H200 run 107)
                ("query_chained" if _cg.QUERY_TAIL else "query_tail", flag(_cg, "QUERY_TAIL", 0 if _cg.QUERY_TAIL else 64), {}),
                # the chain's first step from the zero init by its product, not marked as from zero (35th session)
                ("chain_from_init", flag(_linear, "CHAIN_FROM_ZERO", False), {}),
                ("sub_run_32", flag(_cg, "SUB_RUN", 32), {}),
                ("sub_run_64", flag(_cg, "SUB_RUN", 64), {}),
                # the projections that read one input by their GEMMs of before the 37th session (a linear layer's
                # q | k | v, z and b | a; the attention's q and k | v; the router and the shared expert's inputs), not
                # by one GEMM over their packed matrix (layers/joined.py)
                ("joins_apart", flag(_joined, "USE_PACKED", False), {}),
                # the small gates by the ops of before the 38th session: the GDN gate (a copy of a, fla's kernel) and
                # sigmoid(b), silu(gate) then * up, the query and key norms (a copy of the strided heads each) then
                # RoPE by PyTorch ops
                ("gates_apart", flag(_fast, "FUSED_GATES", False), {}),
                # the active tokens' raw conv inputs copied into the conv's source buffer, the window gathered (before
                # the 38th session), not read in place by the conv kernel
                ("conv_copied", flag(_linear, "CONV_IN_PLACE", False), {}),
                # the pad tokens through the MoE's routed experts like tokens (before the 39th session), not left out
                ("pads_routed", flag(_cg, "PADS_ROUTED", True), {}),
                # a layer's residual add and the norm after it as two launches (before the 39th session)
                ("add_norm_apart", flag(_fast, "FUSED_ADD_NORM", False), {})]
    if _tr is not None:
        variants += [("sort_by_comparisons", flag(_tr, "PREFIX_RANK", False), {})]      # before run 77
    try:
        from hypic.ops import triton_moe as _tm
    except ImportError:
        _tm = None
    if _tm is not None:             # the MoE's k rows and shared expert combined by PyTorch ops (before the 29th session)
        variants += [("moe_combine_by_torch", flag(_tm, "COMBINE_KERNEL", False), {})]
        # the experts' weights read by tensor descriptors (TMA) or by pointers (32nd session; the tuner keeps each
        # form's picks apart)
        variants += [("moe_tma" if not _tm.TMA_WEIGHTS else "moe_by_pointers",
                      flag(_tm, "TMA_WEIGHTS", not _tm.TMA_WEIGHTS), {})]
    if _ts is not None:             # each chain step's map loaded during the step before it (twenty-third session)
        variants += [("scan_prefetch", flag(_ts, "PREFETCH", True), {})]
        # the pair kernel's cached maps and the ordering kernel's cached rows read an element at a time, their
        # integer addresses' alignment unknown to the compiler (before the 36th session)
        from hypic.ops import triton_place as _tp

        variants += [("loads_by_element", both(flag(_ts, "PAIR_ALIGNED", False), flag(_tp, "ALIGNED_ENTRIES", False)),
                      {})]
        # the pairs made inside the chain scan, or by the pair kernel before it (40th session)
        variants += [("pairs_apart" if _linear.PAIRS_IN_SCAN else "pairs_in_scan",
                      flag(_linear, "PAIRS_IN_SCAN", not _linear.PAIRS_IN_SCAN), {})]
        # the chain's steps read through their table rows, not by position in the pairs' buffer (36th session)
        variants += [("scan_by_table" if _ts.BY_POSITION else "scan_by_position",
                      flag(_ts, "BY_POSITION", not _ts.BY_POSITION), {})]
    try:
        from hypic.ops import triton_attention as _ta
    except ImportError:
        _ta = None
    if _ta is not None:             # the compose attention's forms (twenty-ninth session; ops/triton_attention.py)
        variants += [("attention_before_29th", lambda: flags(_ta, FULL_FAST=False, FUSED_FOLD=False, BALANCE=False),
                      {}),
                     ("attention_unbalanced", flag(_ta, "BALANCE", False), {}),
                     ("attention_vsplit_2", flag(_ta, "VSPLIT", 2), {}),
                     ("attention_splits_2", flag(_ta, "PROGRAMS_PER_SM", 2), {})]     # before the 39th session
        # whole key blocks' tiles by tensor descriptors (42nd session)
        variants += [("attention_by_pointers" if _ta.TMA_KV else "attention_tma", flag(_ta, "TMA_KV", not _ta.TMA_KV),
                      {})]
    # the graph in one piece (the whole fill, then one launch, as before run 34); equal pieces (0: before the 33rd
    # session) or a one-layer first piece
    variants += [(f"graph_in_{p}_pieces", nop, {"pieces": p}) for p in (1,) if p != comp.pieces]
    variants += [(f"first_piece_{f}_layers", nop, {"first": f}) for f in (0, 1) if f != comp.first_piece]
    if args.all_variants:           # decided in runs 19-37 (docs/benchmarks.md)
        variants += [("correction_after_scan", flag(_linear, "FUSE_CORRECTION", False), {}),
                     ("fill_by_address", flag(_cg, "COPY_BY_ADDRESS", True), {})]
        variants += [(f"graph_in_{p}_pieces", nop, {"pieces": p}) for p in (4, 16) if p != comp.pieces]
    left_out = set(filter(None, args.without.split(",")))
    variants = [v for v in variants if v[0] not in left_out]
    only = set(filter(None, args.only.split(",")))
    if only:
        unknown = only - {v[0] for v in variants}
        if unknown:                 # said, not fatal: the rest of the call's rows still run
            print(f"--only: no variant named {sorted(unknown)} (known here: {[v[0] for v in variants]})", flush=True)
        variants = [v for v in variants if v[0] == "default" or v[0] in only]
    tuned = _ts.TUNED if _ts is not None else {}
    print(f"scan tuner picks: {({k: v[0] for k, v in tuned.items()})}", flush=True)
    rag["scan_tuned"] = {str(k): [str(v[0]), {str(c): t for c, t in v[1].items()}] for k, v in tuned.items()}
    try:                           # the expert kernels' configurations as timed on the shapes met so far (us)
        from hypic.ops import triton_moe as _tmo
        moe_tuned = {k: (v[0], {c: round(t * 1e3, 1) for c, t in v[1].items()}) for k, v in _tmo.TUNED.items()}
    except ImportError:
        moe_tuned = {}
    print(f"moe tuner: {moe_tuned} (us)", flush=True)
    rag["moe_tuned"] = {str(k): [str(v[0]), {str(c): t for c, t in v[1].items()}] for k, v in moe_tuned.items()}
    pairs_tuned = _ts.PAIR_TUNED if _ts is not None else {}       # the pair kernel's forms timed on the request's shape
    print(f"pair tuner: {({k: (v[0], {c: round(t * 1e3, 1) for c, t in v[1].items()}) for k, v in pairs_tuned.items()})}"
          " (us)", flush=True)
    rag["pair_tuned"] = {str(k): [str(v[0]), {str(c): t for c, t in v[1].items()}] for k, v in pairs_tuned.items()}
    default, rest = variants[0], variants[1:]
    size = args.variant_group or len(rest) or 1
    for g in range(0, max(len(rest), 1), size):
        # (1 + size) composers alive at once: each keeps its own buffers and graphs (an 80 GB card held the default
        # and three, H100 run 109, not seven, run 108), and the default is timed again beside each group
        try:
            _time_group(llm, comp, [default] + rest[g:g + size], segs, order_a, query, ttft, args, rag)
        except Exception:  # a group that fails (a variant's fault, out of memory) must not cost the next groups
            import traceback

            traceback.print_exc()
            llm.engine.composer = comp


def _time_group(llm, comp, variants, segs, order_a, query, ttft, args, rag):
    """The default (variants[0]) and a group of variants, each with its own composer, their warm requests interleaved
    round by round and paired with the default's of the same round; with --profile, each one's kernels against the
    default's. The group's composers are cleared at the end, also when one of them fails."""
    from hypic.runtime.compose_graph import GraphCompose

    composers = {}
    model = llm.engine.model
    try:
        for name, switch, kw in variants:
            c = comp if name == "default" else GraphCompose(model, comp.device, comp.dtype, graphs=comp.graphs,
                                                             pieces=kw.get("pieces", comp.pieces),
                                                             first_piece=kw.get("first", comp.first_piece))
            llm.engine.composer = c
            try:
                with switch():
                    for r in range(3):                   # planned walk, capture, replay
                        ttft(Prompt(segments=[segs[i] for i in order_a[r:] + order_a[:r]], query=query))
            finally:
                llm.engine.composer = comp
            composers[name] = c
        var_ts = {name: [] for name, *_ in variants}
        for r in range(2 * args.reps + 1):
            order = _shuffled(order_a, r + 1)
            p_r = Prompt(segments=[segs[i] for i in order], query=query)
            k = r % len(variants)
            for name, switch, kw in variants[k:] + variants[:k]:
                llm.engine.composer = composers[name]
                try:
                    with switch():
                        var_ts[name].append(ttft(p_r)[0])
                finally:
                    llm.engine.composer = comp
        rag.setdefault("pic_warm_default_interleaved_by_group_s", []).append(statistics.median(var_ts["default"]))
        for name, *_ in variants[1:]:          # (the default's median beside this variant, for the summary table)
            rag[f"pic_warm_{name}_default_interleaved_s"] = statistics.median(var_ts["default"])
        for name, *_ in variants:
            rag[f"pic_warm_{name}_interleaved_s"] = statistics.median(var_ts[name])
            rag[f"pic_warm_{name}_interleaved_all_s"] = var_ts[name]
            # the variant minus the default within each round (a drift of the machine across rounds cancels)
            paired = [a - b for a, b in zip(var_ts[name], var_ts["default"])]
            rag[f"pic_warm_{name}_minus_default_s"] = statistics.median(paired)
            print(f"pic warm TTFT, interleaved, {name}: {statistics.median(var_ts[name]) * 1e3:.1f} ms "
                  f"{[round(t * 1e3, 1) for t in var_ts[name]]}; minus default, paired by round: median "
                  f"{statistics.median(paired) * 1e3:+.2f} ms", flush=True)
        if args.profile and len(variants) > 1:
            # each variant's kernels against the default's in one profiled warm request (a variant that wins or loses
            # then says where: H200 run 107's query tail lost 1.26 ms with no profile to tell which kernel)
            p_k = Prompt(segments=[segs[i] for i in _shuffled(order_a, 99)], query=query)
            per = {}
            for name, switch, kw in variants:
                llm.engine.composer = composers[name]
                try:
                    with switch():
                        per[name] = kernel_times(lambda: ttft(p_k))
                finally:
                    llm.engine.composer = comp
            rag.setdefault("variant_kernels_us", {}).update({n: {k: v[0] for k, v in t.items()} for n, t in per.items()})
            for name, *_ in variants[1:]:
                print(f"\n== kernels: {name} minus default (one profiled warm request; us, count) ==")
                print(kernel_diff(per["default"], per[name]))
    finally:
        for name, c in composers.items():
            if c is not comp:
                c.clear()
        composers.clear()
        (torch.cuda.empty_cache() if DEV == "cuda" else None)


def prefix_rows(llm, segs, order_a, query, ttft, args, rag):
    """The prefix-caching rows: the cache populated by one order, then requests in new orders that keep only the
    first segment in place (they miss after it), and the same with long chains through the phased walk, interleaved
    and paired by round."""
    llm.set_policy("prefix", 0)
    ttft(Prompt(segments=[segs[i] for i in order_a], query=query))          # populate the prefix cache
    pre_ts = []
    for r in range(args.reps):
        order = [0] + random.Random(100 + r).sample(order_a[1:], args.segments - 1)
        dt, o = ttft(Prompt(segments=[segs[i] for i in order], query=query))
        pre_ts.append(dt)
        rag["prefix_counts"] = dict(prefix=o.prefix_tokens, recomputed=o.recomputed_tokens)
    rag["prefix_s"], rag["prefix_all_s"] = statistics.median(pre_ts), pre_ts
    print(f"prefix TTFT: {rag['prefix_s'] * 1e3:.0f} ms {rag['prefix_counts']} (each: "
          f"{', '.join(f'{t * 1e3:.0f}' for t in pre_ts)} ms)", flush=True)
    # the same requests with a chain of long spans through the phased walk (layers/linear.py LONG_CHAINS_PHASED),
    # interleaved with the default (rounds) on fresh orders, paired by round
    from hypic.layers import linear as _linear

    pairs = []
    try:                 # a variant not yet run on the GPU: a failure must not cost the rest of the device call
        for r in range(args.reps if DEV == "cuda" else 0):            # (off CUDA the flag changes nothing)
            row = {}
            for name, on in (("rounds", False), ("long_chains_phased", True)):
                order = [0] + random.Random(300 + 2 * r + on).sample(order_a[1:], args.segments - 1)
                with flagged(_linear, "LONG_CHAINS_PHASED", on):
                    row[name] = ttft(Prompt(segments=[segs[i] for i in order], query=query))[0]
            pairs.append(row)
    except Exception:
        import traceback

        traceback.print_exc()
        pairs = []
    rag["prefix_long_chains"] = pairs
    if pairs:                  # medians of each way and of the paired difference
        rag["prefix_long_chains_medians_s"] = med = (
            statistics.median(p["rounds"] for p in pairs), statistics.median(p["long_chains_phased"] for p in pairs),
            statistics.median(p["long_chains_phased"] - p["rounds"] for p in pairs))
        print(f"prefix TTFT, interleaved: rounds {med[0] * 1e3:.0f} ms, long chains phased {med[1] * 1e3:.0f} ms; "
              f"paired median {med[2] * 1e3:+.0f} ms", flush=True)
    if args.profile:   # a prefix request that misses after its first segment (profile() runs it twice: the first
        # run would make the second a full prefix hit, so the profiled one takes an order of its own)
        orders = iter([[0] + random.Random(200 + k).sample(order_a[1:], args.segments - 1) for k in range(2)])
        profile("prefix request", lambda: ttft(Prompt(segments=[segs[i] for i in next(orders)], query=query)))


# the prefix rows' last try: forwards of at most this many tokens (EngineConfig.prefill_chunk_tokens), and a prefix
# cache of at most this many bytes, as a server on a card too small for the defaults would be set; the row then says
# so (`prefix_prefill_chunk_tokens`, `prefix_cache_bytes`). The cache bound: each request that misses after its first
# segment stores ~1.9 GB of new nodes, so the 16 GB default filled the H100's last ~9 GB over the rows' requests, and
# their third took 20.1 s against 0.98-0.99 s for the first two, then the next request ran out of memory (run 142)
PREFIX_FALLBACK_CHUNK = 8192
PREFIX_FALLBACK_CACHE_BYTES = 4 << 30


def prefix_rows_fitted(llm, segs, order_a, query, ttft, args, rag):
    """`prefix_rows`; out of GPU memory, once more without the segment cache's entries (H100 run 140: 952 MB short
    with them held beside the prefix cache), then once more in forwards of at most PREFIX_FALLBACK_CHUNK tokens (H100
    run 141: the warm prefix request's forward of 30,464 tokens was 902 MB short without them) with the prefix
    cache bounded to PREFIX_FALLBACK_CACHE_BYTES (run 142: the nodes of the rows' requests filled the card), and out
    of memory every time, an error entry: the rows after them and the JSON still come. The prefix cache is dropped
    after them (its entries are not read again: the full row gets their memory) and gets its own budget back."""
    errors = []
    config, store = llm.config, llm.engine.prefix.store
    capacity = store.stats().capacity_bytes
    for attempt in range(3):
        chunk = PREFIX_FALLBACK_CHUNK if attempt == 2 else None
        if chunk is not None:           # (on the LLM's config: prefix_rows' set_policy hands it to the engine)
            llm.config = config.replace(prefill_chunk_tokens=min(chunk, config.prefill_chunk_tokens))
            llm.engine.config = llm.config
            store.set_capacity(min(PREFIX_FALLBACK_CACHE_BYTES, capacity))
        try:
            prefix_rows(llm, segs, order_a, query, ttft, args, rag)
            if chunk is not None:
                rag["prefix_prefill_chunk_tokens"] = llm.config.prefill_chunk_tokens
                rag["prefix_cache_bytes"] = store.stats().capacity_bytes
            if errors:                           # the tries before the one that fitted
                rag["prefix_errors_before"] = errors
            break
        except torch.OutOfMemoryError as e:
            errors.append(oom_entry("prefix rows", e))
            llm.engine.prefix.clear()
            if attempt == 0:
                print("prefix rows: again, the segment cache dropped", flush=True)
                llm.engine.segments.clear()
            elif attempt == 1:
                print(f"prefix rows: again, in forwards of at most {PREFIX_FALLBACK_CHUNK} tokens and a prefix cache "
                      f"of at most {PREFIX_FALLBACK_CACHE_BYTES >> 30} GiB", flush=True)
            (torch.cuda.empty_cache() if DEV == "cuda" else None)
        finally:
            llm.config = config.replace(policy=llm.config.policy)     # the chunk back; the policy as the rows left it
            llm.engine.config = llm.config
            store.set_capacity(capacity)                               # the prefix cache's own budget back
    else:                                        # out of memory every time
        rag["prefix_s"], rag["prefix_error"] = float("nan"), errors[-1]
    llm.engine.prefix.clear()
    (torch.cuda.empty_cache() if DEV == "cuda" else None)


def _shuffled(order, seed):
    """A copy of the segment order shuffled by random.Random(seed) (the same orders for the same seeds in every run)."""
    order = order[:]
    random.Random(seed).shuffle(order)
    return order


def host_spans(run, n: int) -> dict:
    """The engine's named host spans (hypic/runtime/trace.py TIMES: wall seconds, no profiler) over n warm requests
    run(r), each span's median in ms; "before the GPU" sums what the host does before the first graph piece is
    launched (the prompt's checks, the plan, the lowering, the tables, the first piece's fill), "first fill" is that
    fill alone. Printed and returned."""
    from hypic.runtime import trace

    trace.TIMES = times = {}
    try:
        for r in range(n):
            run(r)
    finally:
        trace.TIMES = None
    out = {}
    for name, ts in times.items():
        per = len(ts) // n if n else 0
        if per > 1:         # several calls per request (a fill per graph piece): the first of each and their sum
            out[f"{name} (first)"] = statistics.median(ts[::per]) * 1e3
            out[f"{name} (sum)"] = statistics.median(sum(ts[i * per:(i + 1) * per]) for i in range(n)) * 1e3
        elif ts:
            out[name] = statistics.median(ts) * 1e3
    before = ["llm.make_requests", "engine.plan", "engine.cold", "compose.lower", "compose.load_tables",
              "compose.fill (first)"]
    out["before the GPU"] = sum(out.get(k, 0.0) for k in before)
    print("host spans of warm requests, median ms (no profiler): "
          + ", ".join(f"{k} {v:.2f}" for k, v in sorted(out.items(), key=lambda kv: -kv[1])), flush=True)
    return out


def main():
    t_bench = time.perf_counter()
    ap = argparse.ArgumentParser()
    ap.add_argument("--sizes", default="8192,32768")
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--seg-len", type=int, default=1600)
    ap.add_argument("--query", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--layers", type=int, default=0, help="fewer layers (a quick run); 0: the real 40")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--skip-prefix", action="store_true", help="no prefix-caching rows (they need ~20 GB beside the 35B)")
    ap.add_argument("--quick", action="store_true", help="only the warm pic request, readout walk vs 3-phase walk")
    ap.add_argument("--profile", action="store_true", help="print torch.profiler tables of a warm pic request and a full prefill")
    ap.add_argument("--decode-steps", type=int, default=16)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--device", default="cuda", help="cpu: a dry run of the script on a tiny preset")
    ap.add_argument("--all-variants", action="store_true", help="also the compose variants of runs 16-19")
    ap.add_argument("--without", default="", help="compose variants to leave out, comma-separated (e.g. one whose "
                                                   "GPU test failed in the same call: a fault would end the run)")
    ap.add_argument("--variant-group", type=int, default=0, help="time the compose variants this many at a time beside "
                    "the default (each keeps its own buffers and graphs: 3 fit beside the 35B model on an 80 GB card); "
                    "0: all at once")
    ap.add_argument("--only", default="", help="the compose variants to time beside the default, comma-separated "
                                                "(instead of every variant but those of --without)")
    ap.add_argument("--ts-first", action="store_true", help="the (T, S) rows first (then the rest)")
    ap.add_argument("--ts-only", action="store_true", help="only the (T, S) rows")
    ap.add_argument("--skip-ts", action="store_true", help="no (T, S) rows (a call of its own: --ts-only)")
    ap.add_argument("--profile-ts", action="store_true", help="profiler tables of the isolated prefill rows")
    ap.add_argument("--ts-default-only", action="store_true", help="the (T, S) rows of the default form only (not the "
                    "forms it replaced: fla's chunk-state pass for T, two rounds, appended columns)")
    args = ap.parse_args()
    global DEV
    DEV = args.device
    sizes = [int(s) for s in args.sizes.split(",")]
    res = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__,
               device=torch.cuda.get_device_name() if DEV == "cuda" else "cpu",
               model=f"{args.preset} (dummy bf16 weights, normal(0, 0.02))")
    bw, rate = ceilings()
    res["ceilings"] = dict(copy_bytes_per_s=bw, bf16_flops_per_s=rate)
    print(f"copy {bw / 1e12:.2f} TB/s, bf16 matmul {rate / 1e12:.0f} TFLOP/s", flush=True)

    raw = preset_config(args.preset)
    if args.layers:
        raw = dict(raw, num_hidden_layers=args.layers)
    cfg = ModelConfig.from_dict(raw)
    vocab = cfg.vocab_size
    rng = random.Random(0)
    lo, hi = (1000, vocab - 1000) if vocab > 4000 else (3, vocab - 1)
    ids = lambda n: [rng.randrange(lo, hi) for _ in range(n)]  # noqa: E731
    full_ids = {n: ids(n) for n in sizes}

    # -- transformers, the peer --------------------------------------------------------------------------
    import transformers
    from transformers import AutoModelForCausalLM

    hf_cfg = cfg.hf_config()
    t0 = time.perf_counter()
    with torch.device(DEV):
        moe = {"experts_implementation": "grouped_mm"} if getattr(hf_cfg, "num_experts", 0) else {}
        hf = AutoModelForCausalLM.from_config(hf_cfg, dtype=torch.bfloat16, attn_implementation="sdpa", **moe)
    hf.eval()
    print(f"transformers {transformers.__version__} {type(hf).__name__} built in {time.perf_counter() - t0:.1f} s; "
          f"params {sum(p.numel() for p in hf.parameters()) / 1e9:.2f} B", flush=True)
    sd = hf.state_dict()
    stds = {k: float(sd[k].float().std()) for k in list(sd)[:4] if sd[k].dim() >= 2}
    print("init check (std of a few matrices):", stds, flush=True)
    res["hf"] = dict(version=transformers.__version__, cls=type(hf).__name__, init_std=stds)
    hf_times = {}
    if not args.skip_hf:
        for n in sizes:
            x = torch.tensor([full_ids[n]], device=DEV)
            with torch.inference_mode():
                med, all_ = timed(lambda: hf(input_ids=x, use_cache=False, logits_to_keep=1), args.reps)
                hf_last = hf(input_ids=x, use_cache=False, logits_to_keep=1).logits[0, -1].float().cpu()
            hf_times[n] = dict(median_s=med, all_s=all_, last_logits=hf_last)
            print(f"transformers full prefill {n}: {med * 1e3:.0f} ms", flush=True)
            (torch.cuda.empty_cache() if DEV == 'cuda' else None)

    # -- hypic on the same tensors -----------------------------------------------------------------------
    econf = EngineConfig(device=DEV, dtype="bfloat16", segment_cache_bytes=16 << 30, prefix_cache_bytes=16 << 30,
                         compose="static" if DEV == "cpu" else "auto")   # CPU dry run: the fixed buffers, eagerly
    loaded = from_tensors(cfg, sd, econf, "hf-dummy-seed0")
    del hf, sd
    (torch.cuda.empty_cache() if DEV == 'cuda' else None)
    llm = LLM.from_loaded(loaded, econf)
    if DEV == "cuda":
        print(f"hypic model on the same weights; GPU memory {torch.cuda.memory_allocated() / 2**30:.1f} GiB", flush=True)
    one = SamplingParams(max_tokens=1, temperature=0.0)

    walls = []

    def ttft(prompt):
        """(TTFT, output) of a one-token request: the engine's TTFT, from LLM.generate's call (the prompt's checks and
        tokenization included) to the first token on the host, as the server counts it from a request's arrival.
        The call's wall, which adds building the output (~0.3 ms at 32k prompt ids), goes to `walls`."""
        sync()
        t0 = time.perf_counter()
        o = llm.generate([prompt], one)[0]
        sync()
        walls.append(time.perf_counter() - t0)
        return o.ttft_s, o

    def ttft_median(prompt, reps: int):
        """The median TTFT of `reps` runs after one warm-up, and all of them."""
        ttft(prompt)
        ts = [ttft(prompt)[0] for _ in range(reps)]
        return statistics.median(ts), ts

    if args.quick:
        quick(llm, args, ids, ttft, res)
        return
    if args.ts_first or args.ts_only:
        ts_rows(llm.engine.model, ids, args, res)
        if args.ts_only:
            out = Path(args.out)
            out.mkdir(parents=True, exist_ok=True)
            (out / "gpu_bench.json").write_text(json.dumps(res, indent=1, default=str))
            return
    res["full_prefill"] = {}
    llm.set_policy("full", 0)
    for n in sizes:
        p = Prompt(query=full_ids[n])
        med, all_ = ttft_median(p, args.reps)
        ours = llm.next_token_logits(p).float().cpu()
        entry = dict(hypic_s=med, hypic_all_s=all_)
        if n in hf_times:
            h = hf_times[n]
            entry.update(transformers_s=h["median_s"], transformers_all_s=h["all_s"], speedup=h["median_s"] / med,
                         last_logits_rel_diff=float((ours - h["last_logits"]).norm() / h["last_logits"].norm()))
        # the last layer on every row (before the twenty-eighth session), interleaved with the default (the last
        # layer's attention and MLP on the logits row only), paired by round
        import hypic.models.base as _base

        pair = {"default": [], "last_layer_all_rows": []}
        for r in range(2 * args.reps):
            for name in (["default", "last_layer_all_rows"] if r % 2 == 0 else ["last_layer_all_rows", "default"]):
                with flagged(_base, "PRUNE_LAST_LAYER", name == "default"):
                    pair[name].append(ttft(p)[0])
        diff = statistics.median(a - b for a, b in zip(pair["last_layer_all_rows"], pair["default"]))
        entry.update(interleaved_s={k: statistics.median(v) for k, v in pair.items()}, last_layer_all_rows_minus_default_s=diff)
        res["full_prefill"][n] = entry
        print(f"hypic full prefill {n}: {med * 1e3:.0f} ms  {entry}", flush=True)
        print(f"full prefill {n}, interleaved: last layer on all rows minus default, paired by round: "
              f"{diff * 1e3:+.2f} ms", flush=True)
        (torch.cuda.empty_cache() if DEV == 'cuda' else None)

    # -- the RAG request --------------------------------------------------------------------------------
    segs = [ids(args.seg_len) for _ in range(args.segments)]
    query = ids(args.query)
    order_a = list(range(args.segments))
    rag = {}
    llm.set_policy("pic", 8)
    # (a stall here is a kernel build: the compose pass's kernels are built and tuned in this first request; H100
    # runs 127-128 stopped here on a 141 s build of the attention fold)
    print(f"pic cold: the first request starts, {time.perf_counter() - t_bench:.0f} s into the bench", flush=True)
    t_cold, o = ttft(Prompt(segments=[segs[i] for i in order_a], query=query))
    rag["pic_cold_s"] = t_cold
    print(f"pic cold (isolated prefill of {args.segments} segments + compose): {t_cold * 1e3:.0f} ms", flush=True)
    warm_ts, counts = [], None
    for r in range(args.reps + 2):
        order = _shuffled(order_a, r + 1)
        dt, o = ttft(Prompt(segments=[segs[i] for i in order], query=query))
        warm_ts.append(dt)
        counts = dict(composed=o.composed_tokens, recomputed=o.recomputed_tokens, cold=o.cold_prefill_tokens)
    rag["pic_warm_s"] = statistics.median(warm_ts[1:])
    rag["pic_warm_wall_s"] = statistics.median(walls[-(args.reps + 1):])     # the generate calls' walls
    # the engine's own TTFT (prompt in -> first token on the host) of warm requests that go on decoding (their
    # states are cut out after the first token): beside the wall of the one-token request above
    two = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    eng = []
    for r in range(args.reps + 1):
        order = _shuffled(order_a, 50 + r)
        sync()
        eng.append(llm.generate([Prompt(segments=[segs[i] for i in order], query=query)], two)[0].ttft_s)
        sync()
    rag["pic_warm_engine_ttft_2tok_s"] = statistics.median(eng[1:])
    print(f"pic warm, 2-token requests: engine TTFT {rag['pic_warm_engine_ttft_2tok_s'] * 1e3:.1f} ms "
          f"{[round(t * 1e3, 1) for t in eng]}", flush=True)
    rag["host_spans_ms"] = host_spans(lambda r: ttft(Prompt(segments=[segs[i] for i in _shuffled(order_a, 70 + r)],
                                                            query=query)), args.reps + 2)
    # the same warm requests through the planned walk (no fixed buffers, no graph), side by side
    comp = llm.engine.composer
    if comp is not None:
        rag["compose_graph"] = dict(captures=comp.captures, replays=comp.replays, runs=comp.runs)
        p_cmp = Prompt(segments=[segs[i] for i in order_a[::-1]], query=query)
        lg = llm.next_token_logits(p_cmp).float().cpu()
        llm.engine.composer = None
        le = llm.next_token_logits(p_cmp).float().cpu()
        # the yardstick: the planned walk against itself with the norms unfused (the same arithmetic, other roundings).
        # On random weights 40 layers amplify one-ulp differences: on the CPU (transformers, width 512, 40 layers,
        # 256 experts top 8) a one-ulp nudge of one element per token's embedding gave logits 0.33 apart and 57%
        # argmax agreement, and changed the top-8 set of 89% of the tokens by layer 8 (docs/gpu-notes.md)
        from hypic.ops import fast as _fast
        with flagged(_fast, "FUSED_NORMS", False):
            lu = llm.next_token_logits(p_cmp).float().cpu()
        eager_ts = []
        for r in range(args.reps + 2):
            order = _shuffled(order_a, r + 1)
            eager_ts.append(ttft(Prompt(segments=[segs[i] for i in order], query=query))[0])
        llm.engine.composer = comp
        rag["pic_warm_planned_s"] = statistics.median(eager_ts[1:])
        rag["pic_warm_planned_all_s"] = eager_ts
        rag["graph_vs_planned_logits_rel"] = float((lg - le).norm() / le.norm())
        rag["planned_unfused_norms_vs_planned_logits_rel"] = float((lu - le).norm() / le.norm())
        print(f"pic warm TTFT, planned walk: {rag['pic_warm_planned_s'] * 1e3:.1f} ms; graph vs planned logits "
              f"rel {rag['graph_vs_planned_logits_rel']:.2e} (yardstick, the planned walk with the norms unfused: "
              f"{rag['planned_unfused_norms_vs_planned_logits_rel']:.2e})", flush=True)
    if comp is not None and (getattr(comp, "graphs", False) or DEV == "cpu"):   # (CPU: a dry run of the code)
        try:
            interleaved_variants(llm, comp, segs, order_a, query, ttft, args, rag)
        except Exception:  # a variant that fails must not cost the rest of the device call
            import traceback

            traceback.print_exc()
            llm.engine.composer = comp
    llm.engine.segments.clear()              # cold again, now that every kernel shape has been tuned and the
    llm.engine.prefix.clear()                # compose graph of this shape captured (kept: not the caches' part)
    order = order_a[::-1]
    oom = None
    try:
        rag["pic_cold_steady_s"], _ = ttft(Prompt(segments=[segs[i] for i in order], query=query))
        print(f"pic cold, second time (kernels tuned): {rag['pic_cold_steady_s'] * 1e3:.0f} ms", flush=True)
    except torch.OutOfMemoryError as e:
        # (an 80 GB card: H100 runs 97-110 ran out of memory here, the 20 segments' isolated prefill in one batch
        # beside the 35B model and the composers' buffers, and lost every row after it)
        rag["pic_cold_steady_s"] = float("nan")
        oom = str(e)[:100]
    if oom is not None:
        # (outside the except block: the exception's traceback holds the failed prefill's frames, and with them its
        # activations, until the block ends; H100 runs 114-116 ran out of memory again in the warming below, run
        # inside the block)
        print(f"pic cold, second time: skipped, out of GPU memory ({oom})", flush=True)
        llm.engine.segments.clear()
        gc.collect()
        (torch.cuda.empty_cache() if DEV == "cuda" else None)
        # the caches warmed again, untimed, in isolated prefills of at most 4,096 tokens, so the rows after this
        # one (the warm request's profiles, decode) find them warm (H100 run 112 lost them to a second OOM)
        engine_cfg = llm.engine.config
        llm.engine.config = dataclasses.replace(engine_cfg, prefill_chunk_tokens=4096)
        try:
            ttft(Prompt(segments=[segs[i] for i in order], query=query))
        finally:
            llm.engine.config = engine_cfg
    if args.profile:
        rag["timeline_warm_pic"] = profile("warm pic request",
                                           lambda: ttft(Prompt(segments=[segs[i] for i in order_a[::-1]], query=query)))
        if comp is not None and getattr(comp, "graphs", False):
            # the same fixed buffers run eagerly: the profile then names the aten op (and its shapes) behind each
            # of the graph's ~3,000 kernels, which a replay hides
            from hypic.runtime.compose_graph import GraphCompose

            eager = GraphCompose(llm.engine.model, comp.device, comp.dtype, graphs=False)
            llm.engine.composer = eager
            try:
                p_e = Prompt(segments=[segs[i] for i in order_a[::-1]], query=query)
                ttft(p_e)
                profile("warm pic request, the fixed buffers run eagerly (ops behind the graph's kernels)",
                        lambda: ttft(p_e), sources=True)
            except Exception:  # a diagnostic: it must not cost the rest of the device call
                import traceback

                traceback.print_exc()
            finally:
                llm.engine.composer = comp
                eager.clear()
        llm.set_policy("full", 0)
        (torch.cuda.empty_cache() if DEV == "cuda" else None)
        try:                  # a diagnostic: on an 80 GB card it ran out of memory (H100 run 119), costing the JSON
            profile(f"full prefill {sizes[0]}", lambda: ttft(Prompt(query=full_ids[sizes[0]])))
        except torch.OutOfMemoryError as e:
            print(f"full prefill profile: skipped, out of GPU memory ({str(e)[:120]})", flush=True)
        finally:
            llm.set_policy("pic", 8)
    rag["pic_warm_all_s"] = warm_ts
    rag["pic_counts"] = counts
    print(f"pic warm TTFT: {rag['pic_warm_s'] * 1e3:.1f} ms {counts} (the generate call's wall "
          f"{rag['pic_warm_wall_s'] * 1e3:.1f} ms)", flush=True)
    # the pic rows are done: the composer's buffers and graphs go before the prefix rows (a later pic request captures
    # again), and the allocator's cached blocks with them (H100 run 138 ran out of memory in the first prefix request
    # with them held, 76 GB allocated, which cost the JSON)
    if comp is not None:
        comp.clear()
    (torch.cuda.empty_cache() if DEV == "cuda" else None)
    entry_bytes = llm.cache_stats()["segments"].get("bytes", 0)      # the warm request's cache entries (the floor)
    if args.skip_prefix:                # (an 80 GB card: the prefix cache beside the 35B model may not fit)
        rag["prefix_s"] = float("nan")
    else:
        prefix_rows_fitted(llm, segs, order_a, query, ttft, args, rag)
    llm.set_policy("full", 0)
    p_full = Prompt(segments=[segs[i] for i in order_a[::-1]], query=query)
    rag["full_s"] = ttft_median(p_full, args.reps)[0]
    rag["full_wall_s"] = statistics.median(walls[-args.reps:])
    print(f"full TTFT: {rag['full_s'] * 1e3:.0f} ms (the generate call's wall {rag['full_wall_s'] * 1e3:.0f} ms)",
          flush=True)
    rag["pic_vs_full"] = rag["full_s"] / rag["pic_warm_s"]
    rag["pic_vs_prefix"] = rag["prefix_s"] / rag["pic_warm_s"]

    # roofline floor of the warm pic request
    model = llm.engine.model
    p_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    n_all = sum(p.numel() for p in model.parameters())
    n_embed = model.model.embed_tokens.weight.numel()
    experts = getattr(cfg.params, "num_experts", 0) or 0           # 0: a dense model (the CPU dry run's presets)
    active_per_token = (n_all - n_expert - n_embed) + (
        n_expert * cfg.params.num_experts_per_tok / experts if experts else 0)
    active = counts["recomputed"]
    ctx = args.segments * args.seg_len + args.query
    p = cfg.params
    n_attn = sum(1 for t in cfg.layer_types if t == "full_attention")
    # (other families than the 35B's: the attention's width where the config names it, and each linear layer's chain
    # as dense [K, K] maps on its state's [H, K, V], an upper bound for the diagonal and scalar forms)
    attn_flops = n_attn * 4 * active * ctx * getattr(p, "num_attention_heads", 0) * (getattr(p, "head_dim", 0) or 0)
    compose_flops = sum(args.segments * 2 * h * k * k * (v + k) for h, k, v in
                        (m.state_shape for m in model.mixers.values() if hasattr(m, "state_shape")))
    flops = 2 * active_per_token * active + attn_flops + compose_flops
    read = p_bytes + entry_bytes
    floor = max(read / bw, flops / rate)
    rag["roofline"] = dict(weight_bytes=p_bytes, entry_bytes=entry_bytes, flops=flops, active_tokens=active,
                           bytes_s=read / bw, flops_s=flops / rate, floor_s=floor,
                           measured_over_floor=rag["pic_warm_s"] / floor)
    print(f"roofline: read {read / 1e9:.1f} GB -> {read / bw * 1e3:.1f} ms, {flops / 1e12:.2f} TFLOP -> "
          f"{flops / rate * 1e3:.2f} ms; floor {floor * 1e3:.1f} ms; measured/floor {rag['pic_warm_s'] / floor:.2f}",
          flush=True)
    res["rag"] = rag

    # -- decode after the warm pic prefill --------------------------------------------------------------
    llm.set_policy("pic", 8)
    dprompts = []
    for r in range(8):
        order = _shuffled(order_a, 200 + r)
        dprompts.append(Prompt(segments=[segs[i] for i in order], query=query))
    (torch.cuda.empty_cache() if DEV == "cuda" else None)       # (as before the full row: H100 run 118 ran out here)
    try:
        res["decode"] = decode_bench(llm, dprompts, args.decode_steps, prof=args.profile)
    except Exception as e:  # report and go on: one device call should say as much as it can
        import traceback

        traceback.print_exc()
        res["decode"] = {"error": repr(e)}
    llm.clear_cache()
    (torch.cuda.empty_cache() if DEV == 'cuda' else None)

    over = res.get("ts_overhead") or ({} if args.skip_ts else ts_rows(model, ids, args, res))

    # -- table -----------------------------------------------------------------------------------------
    print("\n| measurement | hypic | peer | ratio | bar |")
    print("|---|---|---|---|---|")
    for n, e in res["full_prefill"].items():
        if "transformers_s" in e:
            print(f"| full prefill {n} tokens | {e['hypic_s'] * 1e3:.0f} ms | transformers {e['transformers_s'] * 1e3:.0f} ms "
                  f"| {e['speedup']:.2f}x | >= 1.5x at 32k |")
    print(f"| RAG warm TTFT pic (seam 8) | {rag['pic_warm_s'] * 1e3:.1f} ms | full {rag['full_s'] * 1e3:.0f} ms | "
          f"{rag['pic_vs_full']:.1f}x | >= 20x |")
    if "pic_warm_planned_s" in rag:
        print(f"| RAG warm TTFT pic: compose graph vs planned walk | {rag['pic_warm_s'] * 1e3:.1f} ms | planned "
              f"{rag['pic_warm_planned_s'] * 1e3:.1f} ms | {rag['pic_warm_planned_s'] / rag['pic_warm_s']:.1f}x | |")
    d_int = rag.get("pic_warm_default_interleaved_s")
    for key, v in rag.items():
        if d_int and key.startswith("pic_warm_") and key.endswith("_interleaved_s") and "default" not in key:
            name = key[len("pic_warm_"):-len("_interleaved_s")]
            pd = rag.get(f"pic_warm_{name}_minus_default_s")
            d_own = rag.get(f"pic_warm_{name}_default_interleaved_s", d_int)       # its own group's default
            print(f"| RAG warm TTFT pic, interleaved: default vs variant {name} | {d_own * 1e3:.1f} ms | "
                  f"{v * 1e3:.1f} ms | {v / d_own:.3f}x | paired by round: {pd * 1e3:+.2f} ms |")
    chunked = (f" (forwards of at most {rag['prefix_prefill_chunk_tokens']} tokens, prefix cache "
               f"{rag['prefix_cache_bytes'] >> 30} GiB)"
               if "prefix_prefill_chunk_tokens" in rag else "")
    print(f"| RAG warm TTFT pic vs prefix{chunked} | {rag['pic_warm_s'] * 1e3:.1f} ms | "
          f"prefix {rag['prefix_s'] * 1e3:.0f} ms | {rag['pic_vs_prefix']:.1f}x | |")
    if rag.get("prefix_long_chains"):
        a, b, pd = rag["prefix_long_chains_medians_s"]
        print(f"| RAG prefix TTFT, interleaved: rounds vs long chains phased | {a * 1e3:.0f} ms | {b * 1e3:.0f} ms | "
              f"{b / a:.3f}x | paired by round: {pd * 1e3:+.0f} ms |")
    print(f"| pic vs roofline floor | {rag['pic_warm_s'] * 1e3:.1f} ms | floor {floor * 1e3:.1f} ms | "
          f"{rag['pic_warm_s'] / floor:.2f}x | <= 3x |")
    if d_int:
        print(f"| pic (interleaved default, later in the run) vs roofline floor | {d_int * 1e3:.1f} ms | floor "
              f"{floor * 1e3:.1f} ms | {d_int / floor:.2f}x | <= 3x |")
    for b, e in res["decode"].items():
        if isinstance(e, dict) and "graph_s" in e:
            print(f"| decode step, batch {b}, {ctx}-token context | graph {e['graph_s'] * 1e3:.2f} ms | "
                  f"dynamic {e['dynamic_s'] * 1e3:.2f} ms | {e['speedup']:.1f}x | |")
    for n, e in over.items():
        print(f"| (T, S) overhead, {n}-token segment | {e['summarized_s'] * 1e3:.1f} ms | plain {e['plain_s'] * 1e3:.1f} ms "
              f"| {e['overhead'] * 100:.1f}% | <= 5% |")
        if "gpu_overhead" in e:
            print(f"| (T, S) overhead, {n}-token segment, kernel time | {e['summarized_gpu_ms']:.1f} ms | plain "
                  f"{e['plain_gpu_ms']:.1f} ms | {e['gpu_overhead'] * 100:.1f}% | <= 5% |")
        for name in ("rounds", "rounds_appended_columns"):
            if name + "_s" not in e:
                continue
            print(f"| (T, S) overhead, {n}-token segment, {name.replace('_', ' ')} | {e[name + '_s'] * 1e3:.1f} ms "
                  f"| plain {e['plain_s'] * 1e3:.1f} ms | {(e[name + '_s'] / e['plain_s'] - 1) * 100:.1f}% | |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for e in res["full_prefill"].values():
        e.pop("last_logits", None)
    (out / "gpu_bench.json").write_text(json.dumps(res, indent=1, default=str))


if __name__ == "__main__":
    main()
