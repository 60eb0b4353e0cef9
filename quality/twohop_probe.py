"""Does a PIC tune on the training pool's two-hop pairs carry any signal? (issue 6, GDN twohop8)

The GDN model's remaining seam-8 gap is one sub-case of twohop8 (a job question whose job sentence opens document
B: see pic_train.hard_twohop_questions). Two PIC tunes aimed at it moved nothing, and their `pic` loss sat near zero
from the first step. Hypothesis: the pool's 60,000 fixed pairs were read many times in base training, so the model
answers them from its weights, under `pic` as under `full`, and a tune on them cannot teach reading across isolated
documents. This probe measures the answer loss (mean NLL per answer token, nats) and the teacher-forced exact match
of three kinds of examples with the same shape (A, B and k - 2 fact documents, shuffled, k from HARD_K):

    pool-hard    the pool's pairs of the hard sub-case, pool fact documents (pic_train.twohop_hard)
    fresh-hard   the same sub-case made on the fly (pic_train.FreshTwoHop, hard=1)
    fresh        fresh pairs of every sub-case (hard=0)

under `full` and `pic` (seam 8). Prints a table, writes JSON. Outcome on qwen35-gdn-15m-long-pic (docs/quality.md
"Twenty-third session"): pool and fresh hard pairs score alike under `pic` (81.0 / 82.0 of 200): refuted.

    python quality/twohop_probe.py --model checkpoints/qwen35-gdn-15m-long-pic --n 200 \\
        --out quality/results/twohop_probe_gdn-long-pic.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "quality"))


def answer_stats(model, ex, mode: str, seam: int, device: str):
    """(mean NLL per answer token, every answer token the argmax) of one example under `mode`: pic_train's own
    batch and answer rows (`_answer_logits`), so the NLL is its training loss."""
    from pic_train import _answer_logits, _items_of

    items, _ = _items_of(model, [ex], mode, seam, device)
    logits, gold, _, _ = _answer_logits(model, [ex], items, device)
    nll = torch.nn.functional.cross_entropy(logits.float(), gold).item()
    return nll, bool((logits.argmax(-1) == gold).all())


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    ap.add_argument("--n", type=int, default=200, help="examples per kind")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kinds", default="pool-hard,fresh-hard,fresh", help="which kinds, comma-separated")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()

    from pic_train import Example, FreshTwoHop, HARD_K, hard_twohop_questions, twohop_hard
    from train import Pools, RowMaker, load_xz

    from hypic import LLM

    torch.manual_seed(args.seed)
    model = LLM(args.model, device="cpu", dtype="float32").engine.model
    P = Pools(load_xz(Path(args.data) / "train.bin.xz"))
    maker = RowMaker(P, 4096, args.seed, {"twohop": 1.0})
    hard_q = hard_twohop_questions(P, Path(args.data) / "tokenizer.json")
    fresh_hard = FreshTwoHop(Path(args.data) / "tokenizer.json", args.seed + 1, hard=1.0)
    fresh = FreshTwoHop(Path(args.data) / "tokenizer.json", args.seed + 2, hard=0.0)
    rng = np.random.default_rng(args.seed)

    def build(docs, qas):
        order = rng.permutation(len(docs))
        q, a, _ = qas[0]
        return Example(P.prefix.tolist(), [docs[i].tolist() for i in order], q.tolist() + a.tolist(),
                       [False] * len(q) + [True] * len(a))

    kinds = {"pool-hard": lambda: build(*twohop_hard(maker, hard_q)),
             "fresh-hard": lambda: build(*fresh_hard(int(rng.choice(HARD_K)))),
             "fresh": lambda: build(*fresh(int(rng.choice(HARD_K))))}
    kinds = {k: kinds[k] for k in args.kinds.split(",")}
    res, t0 = {}, time.time()
    with torch.no_grad():
        for kind, make in kinds.items():
            exs = [make() for _ in range(args.n)]
            for mode in ("full", "pic"):
                st = [answer_stats(model, ex, mode, args.seam, "cpu") for ex in exs]
                nll = np.array([s[0] for s in st])
                em = np.array([s[1] for s in st], float)
                res[f"{kind}/{mode}"] = {"nll": round(float(nll.mean()), 4), "em": round(100 * float(em.mean()), 1),
                                         "n": len(st)}
                print(json.dumps({"kind": kind, "mode": mode, **res[f"{kind}/{mode}"],
                                  "t": round(time.time() - t0)}), flush=True)
    print(f"\n{'kind':<12} {'full nll':>9} {'pic nll':>9} {'full em':>8} {'pic em':>8}")
    for kind in kinds:
        f, p = res[f"{kind}/full"], res[f"{kind}/pic"]
        print(f"{kind:<12} {f['nll']:>9.4f} {p['nll']:>9.4f} {f['em']:>8.1f} {p['em']:>8.1f}")
    Path(args.out).write_text(json.dumps({"model": args.model, "seam": args.seam, "n": args.n, "results": res},
                                         indent=1))


if __name__ == "__main__":
    main()
