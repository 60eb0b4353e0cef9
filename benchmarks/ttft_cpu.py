"""TTFT of one RAG request under pic / prefix / full, side by side in one run (CPU).

One request of 16 segments x 512 tokens + a 32-token query. Warm caches: every mode first sees
the segments once (order A); each timed request then presents them in a new random order, so the
prefix cache misses after the first moved segment while PIC composes every cached segment.
Each figure is the median over --runs requests.

    python benchmarks/ttft_cpu.py [--model tiny-qwen3.5] [--runs 5] [--out benchmarks/results/ttft_cpu.json]
    python benchmarks/ttft_cpu.py --models tiny --out benchmarks/results/ttft_cpu_families.json   # every family
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import time
from pathlib import Path

import torch

from hypic import LLM, Prompt, SamplingParams


def measure(model: str, a) -> dict:
    """mode -> TTFT figures of the request on `model` (see the module docstring)."""
    rng = random.Random(0)
    llm = LLM(model, cache_mode="full", seam=a.seam)
    vocab = min(llm.model_config.vocab_size, 256)
    segs = [[rng.randrange(vocab) for _ in range(a.segment_len)] for _ in range(a.segments)]
    query = [rng.randrange(vocab) for _ in range(a.query_len)]
    orders = []
    for _ in range(a.runs):
        o = list(range(a.segments))
        while o[0] == 0:                      # the first segment moves: the prefix cache misses at once
            rng.shuffle(o)
        orders.append(o)
    params = SamplingParams(max_tokens=1)
    results = {}
    for mode in ("full", "prefix", "pic"):
        llm.set_policy(mode, a.seam)
        llm.clear_cache()
        warm = llm.generate([Prompt(segments=segs, query=query)], params)[0]     # order A: warms the caches
        ttfts, outs = [], []
        for o in orders:
            t0 = time.perf_counter()
            out = llm.generate([Prompt(segments=[segs[i] for i in o], query=query)], params)[0]
            ttfts.append(time.perf_counter() - t0)
            outs.append(out)
        last = outs[-1]
        results[mode] = {
            "ttft_ms_median": statistics.median(ttfts) * 1e3, "ttft_ms_all": [t * 1e3 for t in ttfts],
            "cold_ttft_ms": warm.ttft_s * 1e3, "prompt_tokens": last.num_prompt_tokens,
            "prefix_tokens": last.prefix_tokens, "composed_tokens": last.composed_tokens,
            "recomputed_tokens": last.recomputed_tokens,
        }
    return results


def _machine() -> dict:
    return {"python": platform.python_version(), "torch": torch.__version__,
            "cpu": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3.5")
    ap.add_argument("--models", default="", help="several models, comma-separated, or 'tiny' (every tiny preset: "
                                                 "one row per family); one table, JSON to --out")
    ap.add_argument("--segments", type=int, default=16)
    ap.add_argument("--segment-len", type=int, default=512)
    ap.add_argument("--query-len", type=int, default=32)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--out", default="benchmarks/results/ttft_cpu.json")
    a = ap.parse_args()
    if a.threads:
        torch.set_num_threads(a.threads)
    if a.models:
        return families(a)
    results = measure(a.model, a)
    full = results["full"]["ttft_ms_median"]
    print(f"model {a.model}, {a.segments} segments x {a.segment_len} tokens + {a.query_len}-token query, "
          f"seam {a.seam}, median of {a.runs}, torch threads {torch.get_num_threads()}")
    print(f"{'mode':<8}{'TTFT ms':>10}{'vs full':>9}{'cold ms':>10}{'prefix':>8}{'composed':>10}{'recomputed':>12}")
    for mode, r in results.items():
        print(f"{mode:<8}{r['ttft_ms_median']:>10.1f}{full / r['ttft_ms_median']:>8.1f}x{r['cold_ttft_ms']:>10.1f}"
              f"{r['prefix_tokens']:>8}{r['composed_tokens']:>10}{r['recomputed_tokens']:>12}")
    ratio = full / results["pic"]["ttft_ms_median"]
    print(f"pic TTFT is {ratio:.1f}x lower than full (bar: >= 5x), "
          f"{results['prefix']['ttft_ms_median'] / results['pic']['ttft_ms_median']:.1f}x lower than prefix")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results, "pic_vs_full": ratio, "machine": _machine(),
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


def families(a) -> None:
    """The same request on several models, one row each: TTFT of full / prefix / pic, pic's ratios."""
    from hypic.models.presets import PRESETS

    models = ([m for m in PRESETS if m.startswith("tiny-")] if a.models == "tiny"
              else [m for m in a.models.split(",") if m])
    rows = {}
    print(f"{a.segments} segments x {a.segment_len} tokens + {a.query_len}-token query, seam {a.seam}, median of "
          f"{a.runs}, torch threads {torch.get_num_threads()}")
    print(f"{'model':<22}{'full ms':>10}{'prefix ms':>11}{'pic ms':>9}{'pic vs full':>13}{'vs prefix':>11}")
    for m in models:
        r = measure(m, a)
        f, p, c = (r[k]["ttft_ms_median"] for k in ("full", "prefix", "pic"))
        rows[m] = {"results": r, "pic_vs_full": f / c, "pic_vs_prefix": p / c}
        print(f"{m:<22}{f:>10.1f}{p:>11.1f}{c:>9.1f}{f / c:>12.1f}x{p / c:>10.1f}x", flush=True)
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "models": rows, "machine": _machine(),
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
