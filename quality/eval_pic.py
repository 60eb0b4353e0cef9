"""Context-grounded QA through the hypic API: PIC against full recomputation on trained models.

For each held-out question (prefix + k documents as PIC segments in a random order, the gold
document among them, + query) and each mode (full, prefix, pic with a seam width, naive):
  - generate (greedy, up to --max-tokens) -> exact match and token F1 (SQuAD normalisation);
  - score   -> negative log-likelihood of the gold answer (" <answer>" then end-of-text), in nats.
The segment order is drawn once per question (seeded) and shared by every mode: the comparison is
paired. Per-question results are appended to a JSONL file as they come (a run can be resumed);
`--report` prints the table with bootstrap 95% intervals (1,000 resamples of questions), also for
the paired difference to `full`.

    python quality/eval_pic.py --model checkpoints/qwen35-gdn-15m --set kc8 --n 500 \\
        --modes full,pic:0,pic:8,naive:8 --out quality/results/qwen35-gdn-15m_kc8.jsonl
    python quality/eval_pic.py --report quality/results/*.jsonl
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import sys
import time
from pathlib import Path

from metrics import exact_match, f1


def parse_mode(m: str) -> tuple[str, int]:
    name, _, seam = m.partition(":")
    return name, int(seam) if seam else 8


def run(a) -> None:
    import torch

    from hypic import LLM, Prompt, SamplingParams

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in open(Path(a.data) / f"eval_{a.set}.jsonl")][: a.n]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    if out.exists():
        for line in open(out):
            r = json.loads(line)
            done.add((r["mode"], r["seam"], r["i"]))
    llm = LLM(a.model, cache_mode="full")
    eos = llm.tokenizer.eos_token_ids
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    modes = [parse_mode(m) for m in a.modes.split(",")]
    t0 = time.perf_counter()
    with open(out, "a") as fh:
        # questions outer, modes inner: whenever the run stops, every mode covers the same questions.
        # Caches persist across modes and questions; PIC results do not depend on what is cached.
        for i, row in enumerate(rows):
            rng = random.Random(f"{a.seed}:{a.set}:{i}")
            order = list(range(len(row["segments"])))
            rng.shuffle(order)
            prompt = Prompt(prefix=row["prefix"], segments=[row["segments"][j] for j in order], query=row["query"])
            gold = row["answer"].strip()
            cont = llm.tokenizer.encode(" " + gold) + [eos[0]]
            for mode, seam in modes:
                if (mode, seam, i) in done:
                    continue
                llm.set_policy(mode, seam)
                o = llm.generate([prompt], params)[0]
                nll = -sum(llm.score(prompt, cont))
                rec = {"model": a.model, "set": a.set, "mode": mode, "seam": seam, "i": i,
                       "gold_position": order.index(row.get("gold", 0)), "pred": o.text.strip(), "gold": gold,
                       "em": exact_match(o.text, gold), "f1": f1(o.text, gold), "nll": nll,
                       "prompt_tokens": o.num_prompt_tokens, "composed_tokens": o.composed_tokens,
                       "recomputed_tokens": o.recomputed_tokens, "ttft_s": o.ttft_s}
                fh.write(json.dumps(rec) + "\n")
                fh.flush()
            if (i + 1) % 10 == 0:
                print(f"{a.set}: {i + 1} questions, {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)


def bootstrap(values, rng, n=1000):
    if not values:
        return float("nan"), float("nan")
    means = sorted(sum(rng.choice(values) for _ in values) / len(values) for _ in range(n))
    return means[int(0.025 * n)], means[int(0.975 * n) - 1]


def report(paths, min_n: int = 1) -> None:
    cells = collections.defaultdict(dict)        # (model, set) -> (mode, seam) -> {i: rec}
    for p in paths:
        for line in open(p):
            r = json.loads(line)
            cells[(Path(r["model"]).name, r["set"])][(r["mode"], r["seam"])] = \
                cells[(Path(r["model"]).name, r["set"])].get((r["mode"], r["seam"]), {})
            cells[(Path(r["model"]).name, r["set"])][(r["mode"], r["seam"])][r["i"]] = r
    rng = random.Random(0)
    print("| model | set | mode | seam | n | EM % [95% CI] | EM - full (paired) [95% CI] | F1 % | NLL (nats) |")
    print("|---|---|---|---:|---:|---|---|---:|---:|")
    for (model, st), modes in sorted(cells.items()):
        full = next((v for (m, _), v in modes.items() if m == "full"), {})
        order = sorted(modes, key=lambda k: ({"full": 0, "prefix": 1, "pic": 2, "naive": 3}[k[0]], k[1]))
        for (mode, seam) in order:
            recs = modes[(mode, seam)]
            ids = sorted(recs)
            if len(ids) < min_n:
                continue
            em = [recs[i]["em"] for i in ids]
            lo, hi = bootstrap(em, rng)
            paired = [recs[i]["em"] - full[i]["em"] for i in ids if i in full]
            dlo, dhi = bootstrap(paired, rng) if paired and mode != "full" else (float("nan"), float("nan"))
            d = sum(paired) / len(paired) if paired and mode != "full" else float("nan")
            fmean = sum(recs[i]["f1"] for i in ids) / len(ids)
            nll = sum(recs[i]["nll"] for i in ids) / len(ids)
            seam_s = "-" if mode in ("full", "prefix") else str(seam)
            dtxt = "" if mode == "full" else f"{100 * d:+.1f} [{100 * dlo:+.1f}, {100 * dhi:+.1f}]"
            print(f"| {model} | {st} | {mode} | {seam_s} | {len(ids)} | {100 * sum(em) / len(em):.1f} "
                  f"[{100 * lo:.1f}, {100 * hi:.1f}] | {dtxt} | {100 * fmean:.1f} | {nll:.3f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/qwen35-gdn-15m")
    ap.add_argument("--data", default=".data/corpus", help="where build_corpus.py wrote eval_<set>.jsonl")
    ap.add_argument("--set", default="kc8")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--modes", default="full,pic:0,pic:2,pic:4,pic:8,pic:16,pic:32,naive:8,prefix")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out")
    ap.add_argument("--report", nargs="*", help="print the table of these result files")
    ap.add_argument("--min-n", type=int, default=1, help="with --report: hide cells with fewer questions")
    a = ap.parse_args()
    if a.report:
        report(a.report, a.min_n)
    else:
        a.out = a.out or f"quality/results/{Path(a.model).name}_{a.set}.jsonl"
        run(a)


if __name__ == "__main__":
    main()
