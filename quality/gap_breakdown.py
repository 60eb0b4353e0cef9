"""Where a `pic` - `full` gap on needle or two-hop questions comes from: by the needle's place in its document (or
the two-hop question's kind) and the gold document's place in the prompt (issue 6; paired per question, as
eval_pic's report).

    python quality/gap_breakdown.py quality/results/kimi-kda-16m-pic_needle8.jsonl [--set needle8] [--seam 8]

Groups: the needle sentence first in its document (it starts within the first 30 characters, right after
"Document: ") or later; for two-hop questions (--set twohop8) the city questions, and the job questions by which of
the second person's two sentences comes first (and, job first, whether the job word lies within the seam); the gold
document among the first half of the prompt's documents or the second.
"""

from __future__ import annotations

import argparse
import collections
import json
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
NEEDLE = re.compile(r"magic number for (.+?) is (\S+?)\.")


def _job_document(row: dict) -> str:
    """A job question's second document: the one with the answer's job sentence and a "lives in" sentence."""
    return next(d for d in row["segments"] if f"works as a {row['answer']}." in d and " lives in " in d)


def two_hop_case(row: dict) -> str | None:
    """A two-hop question's kind (build_corpus.two_hop): the city of A's relative B, or B's job, and for a job
    question which of B's two sentences comes first in B's document ("B lives in C." with B's full name, or
    "Y works as a J." with the first name only, where the chain A -> B's full name -> the job must reach back).
    None for a question of another set."""
    query = row.get("query", "")
    if "In which city does" in query:
        return "city question"
    if "What is the job of" not in query:
        return None
    doc = _job_document(row)
    first = "job sentence first" if doc.index(" works as a ") < doc.index(" lives in ") else "'lives in' sentence first"
    return f"job question, {first}"


def job_word_tokens(row: dict, count) -> int:
    """A job question's answer word: how many tokens of the second person's document end with it (count: text ->
    its number of tokens, each span tokenized alone as the prompt's are; a byte-level BPE splits at the word's end,
    so the prefix's count is the document's own)."""
    doc = _job_document(row)
    return count(doc[: doc.index(f"works as a {row['answer']}.") + len(f"works as a {row['answer']}")])


def groups(row: dict, gold_position: int, count=None, seam: int = 8) -> list[str]:
    """row: the eval set's question (its documents in stored order, `gold` indexing them); gold_position: where the
    gold document stood in the prompt that was evaluated (eval_pic shuffles the documents per question). Needle
    questions by the needle's place in its document, two-hop questions by their kind (`two_hop_case`); with `count`
    (text -> tokens), job questions whose job sentence comes first also by whether the job word lies within the
    document's first `seam` tokens (recomputed in context) or past them (from the isolated prefill)."""
    half = ("gold document in the first half" if gold_position < len(row["segments"]) // 2
            else "gold document in the second half")
    kind = two_hop_case(row)
    if kind is not None:
        out = [kind, half, "all"]
        if count is not None and kind == "job question, job sentence first":
            inside = job_word_tokens(row, count) <= seam
            out.insert(1, f"job first, job word {'within' if inside else 'past'} the seam")
        return out
    m = NEEDLE.search(row["segments"][row["gold"]])
    place = "needle first in its document" if m is not None and m.start() < 30 else "needle later in its document"
    return [place, half, "all"]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("results", nargs="+")
    ap.add_argument("--set", default="needle8")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    args = ap.parse_args()
    ev = [json.loads(x) for x in open(Path(args.data) / f"eval_{args.set}.jsonl")]
    count = None
    if args.set.startswith("twohop"):
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(Path(args.data) / "tokenizer.json"))
        count = lambda text: len(tok.encode(text, add_special_tokens=False).ids)  # noqa: E731
    by = collections.defaultdict(dict)
    gold_at = {}                                      # question -> the gold document's place in its prompt
    sources = set()
    for path in args.results:
        for line in open(path):
            r = json.loads(line)
            sources.add(r.get("weights") or r["model"])      # one model's weights, under whatever path
            if r["set"] != args.set or (r["mode"] != "full" and r["seam"] != args.seam):
                continue
            by[r["i"]][r["mode"]] = r["em"]
            gold_at[r["i"]] = r["gold_position"]
    if len(sources) > 1:
        raise SystemExit(f"these files hold rows of {len(sources)} models or weights ({sorted(map(str, sources))}): "
                         "pass one model's results")
    order = ("full", "pic", "pic+anchor", "naive", "naive+anchor")
    modes = [m for m in order if any(m in d for d in by.values())]
    gaps = [m for m in ("pic", "pic+anchor") if m in modes]
    stats = collections.defaultdict(collections.Counter)
    for i, d in by.items():
        if "full" not in d or any(m not in d for m in gaps):      # questions every compared mode answered
            continue
        for g in groups(ev[i], gold_at[i], count, args.seam):
            stats[g]["n"] += 1
            for m in modes:
                stats[g][m] += d.get(m, 0.0)
    w = max(8, max(len(m) for m in modes) + 2)
    print(f"{'group':<42}{'n':>5}" + "".join(f"{m:>{w}}" for m in modes) + "".join(f"{m + ' - full':>{w + 7}}" for m in gaps))
    for g, c in sorted(stats.items(), key=lambda kv: kv[0]):
        n = c["n"]
        print(f"{g:<42}{n:>5}" + "".join(f"{100 * c[m] / n:>{w}.1f}" for m in modes)
              + "".join(f"{100 * (c[m] - c['full']) / n:>+{w + 7}.1f}" for m in gaps))


if __name__ == "__main__":
    main()
