"""The last layer on the logits rows alone (CausalLM.run_layers) against the last layer on every row, side by side in
one process, interleaved round by round (A B, B A, ...) and paired by round; the first token must agree.

    python benchmarks/last_layer.py [--models small-qwen3.5,tiny-recurrent-gemma] [--tokens 8192] [--reps 5]

Per model: a `full` prefill of --tokens random tokens, and a warm `pic` request (16 segments of --tokens / 16, a
32-token query, seam 8, the segments in a new order each time). Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path


def bench(model: str, tokens: int, reps: int) -> dict:
    import torch

    import hypic.models.base as base
    from hypic import LLM, Prompt, SamplingParams

    llm = LLM(model, cache_mode="full", seed=0)
    vocab = llm.model_config.vocab_size
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, vocab - 1) for _ in range(n)]  # noqa: E731
    one = SamplingParams(max_tokens=1, temperature=0.0, return_logits=True)
    full_prompt = Prompt(query=ids(tokens))
    segs = [ids(tokens // 16) for _ in range(16)]
    query = ids(32)
    out = {"model": model, "layers": len(llm.engine.model.model.layers)}
    for mode in ("full", "pic"):
        llm.set_policy(mode, 8)
        prompt = full_prompt
        if mode == "pic":
            llm.generate([Prompt(segments=segs, query=query)], one)           # cold: the segments cached
        times = {True: [], False: []}
        first = {}
        for r in range(2 * reps + 1):
            if mode == "pic":
                order = list(range(16))
                random.Random(r).shuffle(order)
                prompt = Prompt(segments=[segs[i] for i in order], query=query)
            for prune in ((True, False) if r % 2 == 0 else (False, True)):
                base.PRUNE_LAST_LAYER = prune
                t0 = time.perf_counter()
                o = llm.generate([prompt], one)[0]
                times[prune].append(time.perf_counter() - t0)
                first.setdefault(r, {})[prune] = (o.token_ids, o.logits)
        base.PRUNE_LAST_LAYER = True
        same = all(f[True][0] == f[False][0] for f in first.values())
        diff = max(float((f[True][1] - f[False][1]).abs().max()) for f in first.values())
        paired = [a - b for a, b in zip(times[False][1:], times[True][1:])]          # the first round: warm-up
        out[mode] = dict(cut_s=statistics.median(times[True][1:]), all_rows_s=statistics.median(times[False][1:]),
                         all_rows_minus_cut_s=statistics.median(paired), same_tokens=same, max_logit_diff=diff)
        torch.cuda.empty_cache() if torch.cuda.is_available() else None
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="small-qwen3.5,tiny-recurrent-gemma,tiny-kimi-linear")
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default="benchmarks/results/last_layer.json")
    args = ap.parse_args()
    rows = [bench(m, args.tokens, args.reps) for m in args.models.split(",")]
    print(f"\n{args.tokens} tokens; median of {2 * args.reps} interleaved requests per setting (paired by round)\n")
    print("| model | layers | mode | last layer on logits rows | on every row | every row minus cut (paired) | "
          "same first token | max logit diff |")
    print("|---|---:|---|---:|---:|---:|---|---:|")
    for r in rows:
        for mode in ("full", "pic"):
            e = r[mode]
            print(f"| {r['model']} | {r['layers']} | {mode} | {e['cut_s'] * 1e3:.1f} ms | {e['all_rows_s'] * 1e3:.1f} ms | "
                  f"{e['all_rows_minus_cut_s'] * 1e3:+.1f} ms ({e['all_rows_minus_cut_s'] / e['cut_s']:+.1%}) | "
                  f"{e['same_tokens']} | {e['max_logit_diff']:.1e} |")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d %H:%M"), tokens=args.tokens, reps=args.reps,
                                   rows=rows), indent=1))


if __name__ == "__main__":
    main()
