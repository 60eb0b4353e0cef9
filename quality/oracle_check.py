"""hypic's full mode against transformers' own class on a real checkpoint directory and a real
eval prompt: max |log-softmax difference| over the whole vocabulary at every prompt position
(teacher forcing, fp32, CPU).

    python quality/oracle_check.py .data/models/smollm2-135m-instruct-q4_1 --set kc8 --i 0 --format chat
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--data", default=".data/corpus")
    ap.add_argument("--set", default="kc8")
    ap.add_argument("--i", type=int, default=0)
    ap.add_argument("--format", choices=("plain", "chat"), default="plain")
    ap.add_argument("--lead", default="")
    a = ap.parse_args()
    for name in ("fla", "causal_conv1d", "mamba_ssm"):
        sys.modules.setdefault(name, None)
    import torch
    from transformers import AutoModelForCausalLM

    from eval_pic import chat_spans, forced
    from hypic import LLM, Prompt, SamplingParams

    torch.set_num_threads(1)
    row = [json.loads(line) for line in open(Path(a.data) / f"eval_{a.set}.jsonl")][a.i]
    llm = LLM(a.model, cache_mode="full")
    if a.format == "chat":
        prefix, query, _ = chat_spans(llm.tokenizer, row, a.lead)
    else:
        prefix, query = row["prefix"], row["query"]
    prompt = Prompt(prefix=prefix, segments=row["segments"], query=query)
    ids = llm.make_requests([prompt], SamplingParams(max_tokens=1))[0].prompt.token_ids
    _, top, ours = forced(llm, Prompt(query=ids[:1]), ids[1:])          # rows for positions 0..n-2
    hf = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0, :-1].float(), -1)
    res = {"model": Path(a.model).name, "set": a.set, "i": a.i, "format": a.format, "tokens": len(ids),
           "max_abs_logsoftmax_diff": float((ours - ref).abs().max()),
           "argmax_agreement": float((ref.argmax(-1) == torch.tensor(top)).float().mean())}
    # invariants 2 and 3 of hypic.md on trained weights (next-token logits after the query):
    # a seam covering every segment, and one segment at position 0 with seam 0, equal full recompute
    def logits(mode, seam, p):
        llm.set_policy(mode, seam)
        return llm.next_token_logits(p)

    full = logits("full", 0, prompt)
    longest = max(len(llm.tokenizer.encode(x)) for x in row["segments"])
    res["inv2_seam_covers_all_max_abs_logit_diff"] = float((logits("pic", longest, prompt) - full).abs().max())
    one = Prompt(segments=["".join(row["segments"])], query=query)
    res["inv3_one_segment_seam0_max_abs_logit_diff"] = float((logits("pic", 0, one) - logits("full", 0, one)).abs().max())
    res["pic_seam0_max_abs_logit_diff"] = float((logits("pic", 0, prompt) - full).abs().max())   # for scale
    print(json.dumps(res))


if __name__ == "__main__":
    main()
