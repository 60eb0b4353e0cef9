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
    """"pic:8" -> ("pic", 8); a "+anchor" suffix ("pic+anchor:8") runs the mode with CachePolicy.anchor = "prefix"
    (every document's isolated prefill after the prompt's prefix)."""
    name, _, seam = m.partition(":")
    base, plus, extra = name.partition("+")
    if base not in MODE_ORDER or (plus and extra != "anchor"):
        raise SystemExit(f"unknown mode {m!r}: full, prefix, pic or naive, optionally +anchor, then :seam")
    return name, int(seam) if seam else 8


MODE_ORDER = {"full": 0, "prefix": 1, "pic": 2, "naive": 3}


def mode_rank(key: tuple[str, int]) -> tuple:
    """Report order: full, prefix, pic, naive (each anchored variant after its plain one), then the seam."""
    base, _, extra = key[0].partition("+")
    return MODE_ORDER[base], extra, key[1]


CHAT_INSTRUCTION = ("Answer the question using the documents below. Reply with the answer only "
                    "(a name, number or short phrase), no explanation.\n\n")
_SLOT = "\x00DOCS\x00"


def chat_spans(tokenizer, row, lead: str = "") -> tuple[str, str, str]:
    """--format chat, for instruct models: the documents sit inside one user turn of the model's own
    chat template. The template is rendered once around a placeholder and split there, so the prefix
    (template head + instruction) and the query (question + template tail, up to the assistant's
    turn) are the template's exact text; every document is still its own PIC segment. `lead` starts
    the assistant's reply (e.g. "Answer:"), so that a chatty model puts the answer first.
    -> (prefix, query, gold continuation text without the end-of-turn token)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": _SLOT}], add_generation_prompt=True)
    head, tail = text.split(_SLOT)
    question = row["query"].removesuffix("Answer:").rstrip()    # "Question: ...\nAnswer:" -> "Question: ..."
    answer = row["answer"].strip()
    return head + CHAT_INSTRUCTION, "\n" + question + tail + lead, (" " + answer) if lead else answer


def forced(llm, prompt, cont: list[int]):
    """One teacher-forced pass (what LLM.score does), keeping the logits:
    -> (log-probs of the continuation tokens [len(cont)], argmax ids [len(cont)],
        log-softmax rows [len(cont), vocab]).
    Greedy decoding produces exactly `cont` (answer + end of turn) iff argmax == cont everywhere."""
    import torch

    from hypic import SamplingParams

    (req,) = llm.make_requests([prompt], SamplingParams(max_tokens=len(cont)))
    first = llm.engine.prefill([req])[0]
    rest = llm.engine.extend(req, cont[:-1]) if len(cont) > 1 else first.new_empty(0, first.shape[-1])
    logits = torch.cat([first[None], rest])
    req.state = None
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[i, t]) for i, t in enumerate(cont)], logits.argmax(-1).tolist(), logp


def weights_digest(model: str) -> str:
    """The first 16 hex digits of sha256 over the model's weight files (a checkpoint directory's *.safetensors in
    name order, or a single weights file such as a GGUF), recorded in every result row."""
    import hashlib

    p = Path(model)
    files = sorted(p.glob("*.safetensors")) if p.is_dir() else ([p] if p.is_file() else [])
    if not files:
        return "unknown"
    h = hashlib.sha256()
    for f in files:
        with open(f, "rb") as fh:
            for block in iter(lambda: fh.read(1 << 22), b""):
                h.update(block)
    return h.hexdigest()[:16]


def run(a) -> None:
    import torch

    from hypic import LLM, Prompt, SamplingParams

    torch.set_num_threads(a.threads)
    rows = [json.loads(line) for line in open(Path(a.data) / f"eval_{a.set}.jsonl")][: a.n]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    done = set()
    digest = weights_digest(a.model)
    if out.exists():
        for line in open(out):
            r = json.loads(line)
            if r.get("weights") != digest:
                # a checkpoint directory keeps its name when its weights are replaced (kimi-kda-16m: runs 5-10):
                # resuming would mix two models' answers in one cell
                raise SystemExit(f"{out} holds results of other weights ({r.get('weights') or 'not recorded'}; "
                                 f"{a.model}: {digest}): pass another --out")
            done.add((r["mode"], r["seam"], r["i"]))
    cache = int(a.cache_gb * (1 << 30))
    llm = LLM(a.model, cache_mode="full", device=a.device, segment_cache_bytes=cache, prefix_cache_bytes=cache)
    eos = llm.tokenizer.eos_token_ids
    params = SamplingParams(max_tokens=a.max_tokens, temperature=0.0)
    modes = [parse_mode(m) for m in a.modes.split(",")]
    t0 = time.perf_counter()
    with open(out, "a") as fh:
        # questions outer, modes inner: whenever the run stops, every mode covers the same questions.
        # Caches persist across modes and questions; PIC results do not depend on what is cached.
        shard, nshards = (int(x) for x in a.shard.split("/"))
        for i, row in enumerate(rows):
            if i % nshards != shard:
                continue
            rng = random.Random(f"{a.seed}:{a.set}:{i}")
            order = list(range(len(row["segments"])))
            rng.shuffle(order)
            segments = [row["segments"][j] for j in order]
            gold = row["answer"].strip()
            if a.format == "chat":
                prefix, query, answer = chat_spans(llm.tokenizer, row, a.lead)
                prompt = Prompt(prefix=prefix, segments=segments, query=query)
                cont = llm.tokenizer.encode(answer) + [eos[0]]
            else:          # the trained models' own format (docs/quality.md)
                prompt = Prompt(prefix=row["prefix"], segments=segments, query=row["query"])
                cont = llm.tokenizer.encode(" " + gold) + [eos[0]]
            ref = None                     # full mode's log-softmax rows for this question (--forced)
            for mode, seam in modes:
                if (mode, seam, i) in done:
                    continue
                base, _, extra = mode.partition("+")
                llm.set_policy(base, seam, anchor="prefix" if extra == "anchor" else "none")
                t_q = time.perf_counter()
                rec = {"model": a.model, "weights": digest, "set": a.set, "format": a.format, "mode": mode,
                       "seam": seam, "i": i,
                       "gold_position": order.index(row.get("gold", 0)), "gold": gold}
                if a.forced:       # one teacher-forced pass: greedy exact match, first-token match, NLL
                    lp, top, rows_lp = forced(llm, prompt, cont)
                    rec.update(em=float(top == cont), first=float(top[0] == cont[0]), nll=-sum(lp), forced=True,
                               starts=float(top[:-1] == cont[:-1]), pred_ids=top)
                    if mode == "full":
                        ref = rows_lp
                    elif ref is not None:
                        # distance to full recomputation itself, whether or not the model is right:
                        # KL(full || mode) of the next-token distributions at the gold answer's positions
                        # (mean over positions, nats) and agreement of the two argmaxes
                        kl = (ref.exp() * (ref - rows_lp)).sum(-1)
                        rec.update(kl_full=float(kl.mean()), kl_full_first=float(kl[0]),
                                   agree_full=float((ref.argmax(-1) == rows_lp.argmax(-1)).float().mean()))
                else:
                    o, lp = llm.generate_and_score(prompt, cont, params)     # one prefill for both
                    nll = -sum(lp)
                    rec.update(pred=o.text.strip(), em=exact_match(o.text, gold), f1=f1(o.text, gold), nll=nll,
                               prompt_tokens=o.num_prompt_tokens, composed_tokens=o.composed_tokens,
                               recomputed_tokens=o.recomputed_tokens, ttft_s=o.ttft_s)
                rec["wall_s"] = round(time.perf_counter() - t_q, 3)
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
    rows = [json.loads(line) for p in paths for line in open(p)]
    # a model is its directory's name, and where rows of one name come from different weights (the sha256 prefix
    # every row records since the fourteenth session; older rows have none) the weights too: never one cell of two
    digests = collections.defaultdict(set)
    for r in rows:
        digests[Path(r["model"]).name].add(r.get("weights"))

    def label(r):
        name = Path(r["model"]).name
        return name if len(digests[name]) == 1 else f"{name}@{(r.get('weights') or 'unrecorded')[:8]}"

    cells = collections.defaultdict(dict)        # (model, set) -> (mode, seam) -> {i: rec}
    for r in rows:
        cells[(label(r), r["set"])].setdefault((r["mode"], r["seam"]), {})[r["i"]] = r
    rng = random.Random(0)
    forced = {k: v for k, v in cells.items() if any(r.get("forced") for m in v.values() for r in m.values())}
    if forced:
        report_forced(forced, min_n, rng)
    cells = {k: v for k, v in cells.items() if k not in forced}
    if not cells:
        return
    print("| model | set | mode | seam | n | EM % [95% CI] | EM - full (paired) [95% CI] | F1 % | NLL (nats) |")
    print("|---|---|---|---:|---:|---|---|---:|---:|")
    for (model, st), modes in sorted(cells.items()):
        full = next((v for (m, _), v in modes.items() if m == "full"), {})
        order = sorted(modes, key=mode_rank)
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
    # the bar "naive clearly below pic": the two modes at one seam, paired per question
    pairs = [(model, st, seam, modes[("naive", seam)], modes[("pic", seam)]) for (model, st), modes in
             sorted(cells.items()) for (mode, seam) in sorted(modes) if mode == "naive" and ("pic", seam) in modes]
    if pairs:
        print("\n| model | set | seam | n | `naive` - `pic` EM (paired) [95% CI] |\n|---|---|---:|---:|---|")
    for model, st, seam, naive, pic in pairs:
        d = [naive[i]["em"] - pic[i]["em"] for i in sorted(naive) if i in pic]
        if len(d) < min_n:
            continue
        lo, hi = bootstrap(d, rng)
        print(f"| {model} | {st} | {seam} | {len(d)} | {100 * sum(d) / len(d):+.1f} [{100 * lo:+.1f}, {100 * hi:+.1f}] |")


def report_forced(cells, min_n: int, rng) -> None:
    """Table of --forced runs: task scores from one teacher-forced pass, and the distance of each
    mode to full recomputation (paired NLL difference, KL, argmax agreement), which stays
    meaningful when the model itself is weak at the task."""
    print("| model | set | mode | seam | n | greedy EM % | starts with gold % | first token % [95% CI] "
          "| NLL (nats) | NLL - full (paired) [95% CI] | KL(full ‖ mode), nats [95% CI] | KL, first answer token "
          "| argmax = full's % |")
    print("|---|---|---|---:|---:|---:|---:|---|---:|---|---|---:|---:|")
    mean = lambda xs: sum(xs) / len(xs) if xs else float("nan")  # noqa: E731
    for (model, st), modes in sorted(cells.items()):
        full = next((v for (m, _), v in modes.items() if m == "full"), {})
        order = sorted(modes, key=mode_rank)
        for (mode, seam) in order:
            recs = modes[(mode, seam)]
            ids = sorted(recs)
            if len(ids) < min_n:
                continue
            col = lambda key: [recs[i][key] for i in ids]  # noqa: E731
            first = col("first")
            lo, hi = bootstrap(first, rng)
            seam_s = "-" if mode in ("full", "prefix") else str(seam)
            row = (f"| {model} | {st} | {mode} | {seam_s} | {len(ids)} | {100 * mean(col('em')):.1f} | "
                   f"{100 * mean(col('starts')):.1f} | {100 * mean(first):.1f} [{100 * lo:.1f}, {100 * hi:.1f}] | "
                   f"{mean(col('nll')):.3f} | ")
            if mode == "full":
                print(row + " |  |  |  |")
                continue
            d = [recs[i]["nll"] - full[i]["nll"] for i in ids if i in full]
            dlo, dhi = bootstrap(d, rng)
            kl = [recs[i]["kl_full"] for i in ids if "kl_full" in recs[i]]
            klo, khi = bootstrap(kl, rng)
            kl1 = [recs[i]["kl_full_first"] for i in ids if "kl_full_first" in recs[i]]
            agree = [recs[i]["agree_full"] for i in ids if "agree_full" in recs[i]]
            print(row + f"{mean(d):+.3f} [{dlo:+.3f}, {dhi:+.3f}] | {mean(kl):.3f} [{klo:.3f}, {khi:.3f}] | "
                  f"{mean(kl1):.3f} | {100 * mean(agree):.1f} |")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/qwen35-gdn-15m")
    ap.add_argument("--data", default=".data/corpus", help="where build_corpus.py wrote eval_<set>.jsonl")
    ap.add_argument("--set", default="kc8")
    ap.add_argument("--n", type=int, default=500)
    ap.add_argument("--modes", default="full,pic:0,pic:2,pic:4,pic:8,pic:16,pic:32,naive:8,prefix")
    ap.add_argument("--max-tokens", type=int, default=24)
    ap.add_argument("--format", choices=("plain", "chat"), default="plain",
                    help="plain: the trained models' prompt format; chat: the model's chat template (instruct models)")
    ap.add_argument("--forced", action="store_true",
                    help="score only (one teacher-forced pass per mode, half the cost): EM = greedy decoding would "
                         "give exactly the gold tokens + end of turn; `starts`: greedy decoding starts with the "
                         "gold answer's tokens (a chatty model may go on); first-token match; no F1")
    ap.add_argument("--lead", default="", help="with --format chat: text that starts the assistant's reply")
    ap.add_argument("--shard", default="0/1", help="i/m: only questions with index %% m == i (parallel runs)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--cache-gb", type=float, default=1.0,
                    help="the segment and the prefix store's budgets each; results do not depend on it (invariant 4), "
                         "memory does: at the engine's 4 GiB default two evaluations with several modes side by side "
                         "outgrew this 24 GB machine")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (fp32 either way)")
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
