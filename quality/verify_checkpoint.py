"""Load a trained checkpoint with plain transformers on CPU (fla blocked) and score it by real greedy
generation on held-out questions, each span tokenized alone as the engine will do.

    .venv/bin/python quality/verify_checkpoint.py checkpoints/qwen35-gdn-15m --n 50

Reads .data/corpus/eval_<set>.jsonl (rebuilt by quality/data/build_corpus.py). Prints and writes JSON:
exact match (strict: generated text == gold after stripping spaces; normalized: SQuAD-style lowercase,
no punctuation/articles) and token F1, plus the teacher-forced greedy check used on the GPU.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.modules["fla"] = None  # fla's Triton kernels cannot run on CPU: use transformers' torch paths

import torch  # noqa: E402

from metrics import f1, normalize as norm  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def encode(tok, e):
    ids = tok(e["prefix"], add_special_tokens=False)["input_ids"]
    for s in e["segments"]:
        ids += tok(s, add_special_tokens=False)["input_ids"]
    ids += tok(e["query"], add_special_tokens=False)["input_ids"]
    return ids


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--sets", default="needle8,kc4,kc8,twohop8")
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer
    import transformers
    tok = AutoTokenizer.from_pretrained(args.ckpt)
    model = AutoModelForCausalLM.from_pretrained(args.ckpt, dtype=torch.float32).eval()
    eos = tok.eos_token_id
    torch.set_num_threads(max(1, torch.get_num_threads()))
    res = {"ckpt": args.ckpt, "transformers": transformers.__version__, "torch": torch.__version__,
           "params": sum(p.numel() for p in model.parameters()), "sets": {}}
    for name in args.sets.split(","):
        rows = [json.loads(l) for l in open(Path(args.data) / f"eval_{name}.jsonl")][: args.n]
        em = emn = f1s = tf = 0.0
        t0 = time.time()
        examples = []
        for e in rows:
            ids = encode(tok, e)
            x = torch.tensor([ids])
            with torch.no_grad():
                out = model.generate(x, max_new_tokens=args.max_new, do_sample=False, eos_token_id=eos,
                                     pad_token_id=eos)
                gold_ids = tok(" " + e["answer"], add_special_tokens=False)["input_ids"] + [eos]
                lg = model(torch.tensor([ids + gold_ids[:-1]])).logits[0, len(ids) - 1:]
                tf += float((lg.argmax(-1) == torch.tensor(gold_ids)).all())
            gen = out[0, len(ids):].tolist()
            if eos in gen:
                gen = gen[: gen.index(eos)]
            pred = tok.decode(gen).strip()
            em += float(pred == e["answer"].strip())
            emn += float(norm(pred) == norm(e["answer"]))
            f1s += f1(pred, e["answer"])
            if len(examples) < 3:
                examples.append({"gold": e["answer"], "pred": pred})
        n = len(rows)
        res["sets"][name] = {"n": n, "em": em / n, "em_norm": emn / n, "f1": f1s / n, "tf_greedy_em": tf / n,
                             "seconds": round(time.time() - t0, 1), "examples": examples}
        print(name, json.dumps(res["sets"][name]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
