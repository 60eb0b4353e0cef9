"""Host time of the compose pass's lowering (runtime/compose_graph.lower) for the 35B benchmark's request
layout (20 cached segments of 1,600 tokens in a new order, a 64-token query), on the CPU with the tiny MoE
preset: the lowering's work depends on the request's pieces and tokens, not on the model's width. Prints the
median and minimum of many calls and writes JSON.

    python benchmarks/host_lowering.py [--calls 300] [--out benchmarks/results/host_lowering.json]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.modules["fla"] = None             # transformers must not swap in GPU kernels on the CPU
sys.modules["causal_conv1d"] = None

from hypic import LLM, Prompt, SamplingParams  # noqa: E402
from hypic.runtime import compose_graph as cg  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=300)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "host_lowering.json"))
    args = ap.parse_args()
    llm = LLM("tiny-qwen3.5-moe", device="cpu", dtype="float32", seed=0, compose="static")
    llm.set_policy("pic", 8)
    rng = random.Random(0)
    vocab = llm.engine.cfg.vocab_size
    segs = [[rng.randrange(3, vocab - 1) for _ in range(1600)] for _ in range(20)]
    query = [rng.randrange(3, vocab - 1) for _ in range(64)]

    def prompt(seed):
        order = list(range(20))
        random.Random(seed).shuffle(order)
        return Prompt(segments=[segs[i] for i in order], query=query)

    seen, plain = [], cg.lower
    cg.lower = lambda *a, **k: seen.append((a, k)) or plain(*a, **k)
    try:
        llm.generate([prompt(0)], SamplingParams(max_tokens=1))          # cold: the segments cached
        llm.generate([prompt(1)], SamplingParams(max_tokens=1))          # warm: lowered
    finally:
        cg.lower = plain
    a, k = seen[-1]
    ts = []
    for _ in range(args.calls):
        t0 = time.perf_counter()
        plain(*a, **k)
        ts.append(time.perf_counter() - t0)
    ts.sort()
    res = dict(date=time.strftime("%Y-%m-%d %H:%M"), calls=args.calls, median_ms=ts[len(ts) // 2] * 1e3,
               min_ms=ts[0] * 1e3)
    print(f"| lower(), 20 x 1,600 + 64 tokens | median {res['median_ms']:.3f} ms | min {res['min_ms']:.3f} ms |")
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
