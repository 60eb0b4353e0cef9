"""The CPU forms of `fast.position_attention`, side by side (the measurements behind _CPU_EXPLICIT_QUERIES,
_MANY_CONTINUING and the square causal form), then the warm `pic` request of benchmarks/ttft_cpu.py's shape with
the explicit-score threshold at its default and switched off, interleaved in one process. Prints tables, writes JSON.

    python benchmarks/cpu_attention.py --out benchmarks/results/cpu_attention.json

Forms: explicit fp32 scores (two GEMMs and a softmax), SDPA over masked blocks, and for a request continuing an
ordered prefix also the lower-right causal SDPA (the CUDA form; imports torch._dynamo) and one square causal SDPA
over front-padded queries (the CPU form while the held keys are no more than the queries).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path
from unittest import mock

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic import LLM, Prompt, SamplingParams  # noqa: E402
from hypic.ops import fast  # noqa: E402

HEADS = ((4, 2, 64), (8, 2, 128), (16, 2, 256))
PLACED = ((8224, 8), (8224, 32), (8224, 192), (32768, 224))          # (keys, queries at random positions)
CONTINUING = ((3617, 256), (3617, 1024), (3617, 1800), (3617, 3569))  # (keys, queries after nk - nq held keys)
NEVER = 1 << 40
WARM = 6


def ms(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps * 1e3


def explicit(q, k, v, qp, kp, contiguous=False):
    with mock.patch.object(fast, "_CPU_EXPLICIT_QUERIES", NEVER), mock.patch.object(fast, "_MANY_CONTINUING", NEVER):
        return fast.position_attention(q, k, v, qp, kp, scale=0.1, contiguous=contiguous)


def masked(q, k, v, qp, kp):
    with mock.patch.object(fast, "_SCORES_BYTES", 0):
        return fast.position_attention(q, k, v, qp, kp, scale=0.1)


def square(q, k, v):
    held, (_, h, d) = k.shape[0] - q.shape[0], q.shape
    qq = torch.cat([q.new_zeros(held, h, d), q]).transpose(0, 1)[None]
    o = F.scaled_dot_product_attention(qq, k.transpose(0, 1)[None], v.transpose(0, 1)[None], is_causal=True,
                                       scale=0.1, enable_gqa=h != k.shape[1])
    return o[0].transpose(0, 1)[held:]


def lower_right(q, k, v):
    from torch.nn.attention.bias import causal_lower_right

    rep = q.shape[1] // k.shape[1]
    ke, ve = (t.transpose(0, 1)[None].repeat_interleave(rep, dim=1) for t in (k, v))
    o = F.scaled_dot_product_attention(q.transpose(0, 1)[None], ke, ve,
                                       attn_mask=causal_lower_right(q.shape[0], k.shape[0]), scale=0.1)
    return o[0].transpose(0, 1)


def warm_pic(rounds: int) -> dict:
    """benchmarks/ttft_cpu.py's request (tiny-qwen3.5, 16 x 512 + 32, seam 8), the threshold at its default and
    off (explicit scores for every few-query call), alternating, after WARM warm-up rounds (with two, one run gave
    -55 ms paired and the next, in the same process, -10 ms: the first rounds of each form are not steady)."""
    llm = LLM("tiny-qwen3.5", cache_mode="pic", seam=8)
    v = llm.engine.cfg.vocab_size
    rng = random.Random(0)
    segs = [[rng.randrange(1, v) for _ in range(512)] for _ in range(16)]
    query = [rng.randrange(1, v) for _ in range(32)]
    one = SamplingParams(max_tokens=1)
    llm.generate([Prompt(segments=segs, query=query)], one)
    ts = {"default": [], "explicit": []}
    for r in range(rounds + WARM):
        for name, thr in (("default", fast._CPU_EXPLICIT_QUERIES), ("explicit", NEVER)):
            order = list(range(16))
            rng.shuffle(order)
            with mock.patch.object(fast, "_CPU_EXPLICIT_QUERIES", thr):
                t = time.perf_counter()
                llm.generate([Prompt(segments=[segs[i] for i in order], query=query)], one)
                ts[name].append(time.perf_counter() - t)
    ts = {k: v[WARM:] for k, v in ts.items()}
    return {"default_ms": statistics.median(ts["default"]) * 1e3, "explicit_ms": statistics.median(ts["explicit"]) * 1e3,
            "paired_ms": statistics.median(a - b for a, b in zip(ts["default"], ts["explicit"])) * 1e3,
            "rounds": rounds}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=10, help="interleaved pairs of warm pic requests")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_attention.json"))
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    g = torch.Generator().manual_seed(0)
    res = {"torch": torch.__version__, "threads": a.threads, "placed": [], "continuing": []}
    print("queries at placed positions (the compose pass), ms per call")
    print("| heads x dim (kv heads) | keys | queries | explicit | masked blocks |\n|---|---:|---:|---:|---:|")
    for h, hkv, d in HEADS:
        for nk, nq in PLACED:
            q, k, v = (torch.randn(n, m, d, generator=g) for n, m in ((nq, h), (nk, hkv), (nk, hkv)))
            kp, qp = torch.arange(nk), torch.randint(0, nk, (nq,), generator=g).sort().values
            row = dict(h=h, hkv=hkv, d=d, keys=nk, queries=nq, explicit_ms=ms(lambda: explicit(q, k, v, qp, kp), a.reps),
                       masked_ms=ms(lambda: masked(q, k, v, qp, kp), a.reps))
            res["placed"].append(row)
            print(f"| {h} x {d} ({hkv}) | {nk} | {nq} | {row['explicit_ms']:.1f} | {row['masked_ms']:.1f} |")
    print("\nqueries continuing an ordered prefix, ms per call")
    print("| heads x dim (kv heads) | keys | queries | explicit | lower-right | masked blocks | square |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for h, hkv, d in HEADS[:2]:
        for nk, nq in CONTINUING:
            q, k, v = (torch.randn(n, m, d, generator=g) for n, m in ((nq, h), (nk, hkv), (nk, hkv)))
            kp, qp = torch.arange(nk), torch.arange(nk - nq, nk)
            want = explicit(q, k, v, qp, kp, contiguous=True)
            assert (square(q, k, v) - want).abs().max() < 1e-4 and (lower_right(q, k, v) - want).abs().max() < 1e-4
            row = dict(h=h, hkv=hkv, d=d, keys=nk, queries=nq,
                       explicit_ms=ms(lambda: explicit(q, k, v, qp, kp, contiguous=True), a.reps),
                       lower_right_ms=ms(lambda: lower_right(q, k, v), a.reps),
                       masked_ms=ms(lambda: masked(q, k, v, qp, kp), a.reps), square_ms=ms(lambda: square(q, k, v), a.reps))
            res["continuing"].append(row)
            print(f"| {h} x {d} ({hkv}) | {nk} | {nq} | {row['explicit_ms']:.1f} | {row['lower_right_ms']:.1f} | "
                  f"{row['masked_ms']:.1f} | {row['square_ms']:.1f} |")
    res["warm_pic"] = w = warm_pic(a.rounds)
    print(f"\nwarm pic request (16 x 512 + 32, tiny-qwen3.5), {a.rounds} interleaved pairs: default "
          f"{w['default_ms']:.1f} ms, explicit scores for every few-query call {w['explicit_ms']:.1f} ms, paired median "
          f"{w['paired_ms']:+.1f} ms")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(res, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
