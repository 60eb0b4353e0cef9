"""Where a model's wrong answers come from: for each question of an eval_pic.py result file, whether the predicted
answer is right, a span of the gold document, a span of another document, shares only words with the context, or
appears nowhere in it. Separates a model that finds the wrong passage (a distractor's entity) from one that does
not copy at all (an answer from its own memory), which a score alone cannot.

    python quality/answer_sources.py quality/results/kimi-kda-16m-run9_kc8_full200.jsonl --set kc8 --mode full
"""

from __future__ import annotations

import argparse
import json
from collections import Counter, defaultdict
from pathlib import Path

from metrics import normalize

KINDS = ("correct", "in the gold document", "in another document", "words from the context", "not in the context",
         "empty")


def source(pred: str, em: float, segments: list[str], gold: int) -> str:
    """The kind of a prediction (KINDS), spans compared after SQuAD normalisation."""
    p = normalize(pred)
    if em == 1.0:
        return "correct"
    if not p:
        return "empty"
    docs = [f" {normalize(s)} " for s in segments]
    if f" {p} " in docs[gold]:
        return "in the gold document"
    if any(f" {p} " in d for j, d in enumerate(docs) if j != gold):
        return "in another document"
    context = " ".join(docs)
    if any(f" {w} " in context for w in p.split() if len(w) > 3):
        return "words from the context"
    return "not in the context"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+", help="eval_pic.py --out files (shards of one model and set)")
    ap.add_argument("--data", default=".data/corpus", help="where build_corpus.py wrote eval_<set>.jsonl")
    ap.add_argument("--set", required=True)
    ap.add_argument("--mode", default="full")
    a = ap.parse_args()
    questions = [json.loads(line) for line in open(Path(a.data) / f"eval_{a.set}.jsonl")]
    rows = [json.loads(line) for f in a.results for line in open(f)]
    rows = [r for r in rows if r.get("mode") == a.mode and r.get("set") == a.set]
    if not rows:
        raise SystemExit(f"no {a.mode} rows of {a.set} in {a.results}")
    kinds, by_pos = Counter(), defaultdict(list)
    for r in rows:
        q = questions[r["i"]]
        kinds[source(r["pred"], r["em"], q["segments"], q["gold"])] += 1
        by_pos[r["gold_position"]].append(r["em"])
    n = len(rows)
    out = {"n": n, "model": rows[0]["model"], "set": a.set, "mode": a.mode,
           "kinds": {k: kinds[k] for k in KINDS},
           "em_by_gold_position": {p: sum(v) / len(v) for p, v in sorted(by_pos.items())}}
    print(f"{out['model']} {a.set} {a.mode}: {n} questions, EM {sum(r['em'] for r in rows) / n * 100:.1f}")
    for k in KINDS:
        print(f"  {k:24s} {kinds[k]:4d}  {kinds[k] / n * 100:5.1f}%")
    print("  EM by the gold document's position:",
          ", ".join(f"{p}: {v * 100:.0f}% (n={len(by_pos[p])})" for p, v in out["em_by_gold_position"].items()))
    print(json.dumps(out))


if __name__ == "__main__":
    main()
