"""TTFT of a cold PIC request with its segments prefilled on one rank or on several (hypic.md 2.3), side by side in one
run: the same request, the caches cleared before every timed request, so every segment is cold each time.

Configurations (each an LLM of its own; the one-rank engine's first-token logits are the reference):
    1 rank     one process with all the threads (CPU) or one GPU
    N ranks    N processes (this one + N-1 workers), threads split between them (CPU) or one GPU each; LPT placement
    N, count   the same ranks with equal segment counts per rank in prompt order (the placement LPT is compared to)
Segment lengths are uneven on purpose (longest first in the prompt, so equal counts load rank 0 most).

    python benchmarks/parallel_bench.py                                   # CPU: small-qwen3.5, 2 ranks x 1 thread
    python benchmarks/parallel_bench.py --device cuda --dtype bfloat16 --model qwen3.5-35b-a3b --load-format dummy \
        --lengths 1600x20 --ranks 2 --out benchmarks/results/parallel_h200x2.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from hypic import LLM, ParallelConfig, Prompt, SamplingParams


def _lengths(spec: str) -> list[int]:
    out = []
    for part in spec.split(","):
        n, _, k = part.partition("x")
        out += [int(n)] * (int(k) if k else 1)
    return out


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def run(a, name: str, ranks: int, placement: str, threads0: int, threads_w: int, segs, query) -> dict:
    if not a.device.startswith("cuda"):
        torch.set_num_threads(threads0)
    par = ParallelConfig(workers=ranks, threads=threads_w, placement=placement, timeout_s=600.0) if ranks > 1 \
        else ParallelConfig()
    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, load_format=a.load_format, seam=a.seam, parallel=par)
    start_s = time.perf_counter() - t0
    sp = SamplingParams(max_tokens=1, return_logits=True)
    prompt = Prompt(segments=segs, query=query)
    ttfts, logits = [], None
    try:
        for i in range(a.warmup + a.runs):
            llm.clear_cache()
            _sync(a.device)
            out = llm.generate([prompt], sp)[0]
            _sync(a.device)
            if i >= a.warmup:
                ttfts.append(out.ttft_s)
            logits = out.logits[0].float()
            assert out.cold_prefill_tokens == sum(len(s) for s in segs)
        stats = llm.parallel_stats()
    finally:
        llm.close()
    return {"name": name, "ranks": ranks, "placement": placement if ranks > 1 else None,
            "threads_rank0": threads0 if not a.device.startswith("cuda") else None,
            "threads_worker": threads_w if ranks > 1 and not a.device.startswith("cuda") else None,
            "ttft_ms_median": statistics.median(ttfts) * 1e3, "ttft_ms_all": [t * 1e3 for t in ttfts],
            "startup_s": start_s, "parallel": stats, "logits": logits}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small-qwen3.5")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--load-format", default="auto")
    ap.add_argument("--lengths", default="2048,1536,1024x2,768,512x2,256",
                    help="segment lengths: N or NxK, comma-separated")
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads in all (0: the machine's cores)")
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/parallel_cpu.json")
    a = ap.parse_args()
    threads = a.threads or os.cpu_count() or 1
    g = torch.Generator().manual_seed(0)
    llm_vocab = 256
    segs = [torch.randint(1, llm_vocab, (n,), generator=g).tolist() for n in _lengths(a.lengths)]
    query = torch.randint(1, llm_vocab, (a.query_len,), generator=g).tolist()
    per = max(1, threads // a.ranks)
    rows = [run(a, "1 rank", 1, "lpt", threads, 0, segs, query)]
    if threads > 1 and not a.device.startswith("cuda"):        # per-core scaling: one rank on one rank's threads
        rows.append(run(a, f"1 rank, {per} thr", 1, "lpt", per, 0, segs, query))
    rows += [
            run(a, f"{a.ranks} ranks, lpt", a.ranks, "lpt", per, per, segs, query),
             run(a, f"{a.ranks} ranks, count", a.ranks, "count", per, per, segs, query)]
    ref = rows[0]["logits"]
    base = rows[0]["ttft_ms_median"]
    tokens = sum(len(s) for s in segs)
    print(f"model {a.model} on {a.device} ({a.dtype}), cold request: {len(segs)} segments ({tokens} tokens: "
          f"{a.lengths}) + {a.query_len}-token query, seam {a.seam}; median of {a.runs} after {a.warmup} warm-up")
    print(f"{'config':<18}{'threads':>9}{'TTFT ms':>10}{'speed-up':>10}{'local':>7}{'remote':>8}{'max |dlogit|':>14}")
    for r in rows:
        r["max_abs_logit_diff"] = float((r.pop("logits") - ref).abs().max())
        st = r["parallel"] or {"local_segments": len(segs) * (a.runs + a.warmup)}
        th = "" if r["threads_rank0"] is None else (f"{r['threads_rank0']}" if r["ranks"] == 1 else
                                                    f"{r['threads_rank0']}+{r['threads_worker']}x{r['ranks'] - 1}")
        r["speedup"] = base / r["ttft_ms_median"]
        print(f"{r['name']:<18}{th:>9}{r['ttft_ms_median']:>10.1f}{r['speedup']:>9.2f}x"
              f"{st['local_segments'] // (a.runs + a.warmup):>7}"
              f"{st.get('remote_segments', 0) // (a.runs + a.warmup):>8}{r['max_abs_logit_diff']:>14.2e}")
    lpt, count = rows[-2]["ttft_ms_median"], rows[-1]["ttft_ms_median"]
    print(f"{a.ranks} ranks: {base / lpt:.2f}x faster than one rank; LPT {count / lpt:.2f}x faster than equal counts")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(a), "threads": threads,
                               "machine": {"python": platform.python_version(), "torch": torch.__version__,
                                           "cpus": os.cpu_count()},
                               "segments": [len(s) for s in segs], "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
