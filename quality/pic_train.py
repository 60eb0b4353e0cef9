"""Fine-tune a trained hybrid checkpoint with PIC in the loop (issue 6: closing the two-hop gap).

Under `pic` the documents of a prompt are prefilled in isolation and composed: a model that links facts
across documents while reading (the two-hop task) loses that link. Training with the engine's own PIC
forward in the loop teaches it to answer from the query side instead, as block-attention fine-tuning
does for transformers. A step mixes two kinds of examples from the training generators of
quality/train.py (the same tasks, passages split from the evaluation's):

    pic   every document prefilled alone (hypic's isolated prefill: T, S, conv tails, position-free
          K / V, all with their gradients), then the compose pass (seam tokens recomputed, states
          composed exactly, cached keys placed) and the questions; loss on the answer tokens
    full  the same prompt in one ordinary forward (keeps full-recomputation quality)

Both run through `CausalLM.logits` (the engine's forward without inference mode), so what is trained
is exactly what the engine computes. With a seam that covers every document, `pic` equals `full` in
loss and gradients (tests/test_pic_train.py), which pins the differentiable path down.

    python quality/pic_train.py --model checkpoints/qwen35-gdn-15m --out out/gdn-pic --minutes 10 \\
        --device cuda --mix twohop=0.4,needle=0.2,kc=0.2,facts=0.2

Tasks: kc, twohop, needle, facts (quality/train.py's generators, one question each), twohop_hard (the
two-hop sub-case that `pic` fails, with ~8 documents: see hard_twohop_questions) and twohop_fresh (two-hop
pairs made on the fly, never repeated: FreshTwoHop).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hypic.config import ANCHORS

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Example:
    prefix: list[int]
    docs: list[list[int]]
    query: list[int]            # questions and answers after the documents, back to back
    answer: list[bool]          # per query token: it is an answer token (its prediction is scored)


def _items_of(model, examples: list[Example], mode: str, seam: int, device, anchor: bool = False):
    """Each example's batch items under `mode`, and (pic) the isolated entries by (example, document).

    pic    every document longer than the seam prefilled alone (hypic's isolated prefill; with `anchor`, after the
           example's prefix, as CachePolicy.anchor = "prefix"), then its seam run and its entry applied; shorter
           ones recomputed whole
    full   the prompt in one ordinary forward
    full+  the same forward with each such document split as pic splits it, its part after the seam summarized
           in context: the run's captures are what isolated prefill would have to cache for `pic` to equal
           `full` (the zero-start T, S and conv tail computed from the in-context inputs, and the raw K / V)"""
    from hypic.cache.entry import SegmentKey
    from hypic.plan.planner import SegmentSlot
    from hypic.prefill.isolated import prefill_segments

    items_of, entries = [], {}
    if mode == "pic":
        # the engine's isolated prefill, run through the differentiable forward: documents within the seam
        # have nothing to cache and are recomputed whole below
        cold = {(e, d): SegmentSlot(tuple(doc), min(seam, len(doc)), SegmentKey("train", "train", f"{e}.{d}", seam),
                                    anchor=tuple(ex.prefix) if anchor else ())
                for e, ex in enumerate(examples) for d, doc in enumerate(ex.docs) if seam < len(doc)}
        entries = dict(zip(cold, prefill_segments(model, list(cold.values()), device, forward=model.logits)))
        for e, ex in enumerate(examples):
            items = [("run", list(ex.prefix))] if ex.prefix else []
            for d, doc in enumerate(ex.docs):
                ent = entries.get((e, d))
                items += [("run", list(doc))] if ent is None else [("run", list(doc[: ent.seam])), ("apply", ent)]
            items_of.append(items + [("run", list(ex.query))])
    elif mode == "full":
        for ex in examples:
            items_of.append([("run", list(ex.prefix) + [t for doc in ex.docs for t in doc] + list(ex.query))])
    elif mode == "full+":
        for ex in examples:
            items = [("run", list(ex.prefix))] if ex.prefix else []
            for doc in ex.docs:
                if seam < len(doc):
                    items += ([("run", list(doc[:seam]))] if seam else []) + [("run", list(doc[seam:]), {"summarize": True})]
                else:
                    items += [("run", list(doc))]
            items_of.append(items + [("run", list(ex.query))])
    else:
        raise ValueError(mode)
    return items_of, entries


def _answer_logits(model, examples: list[Example], items_of, device):
    """Every example's items in one batch (one forward): the logits that predict the answer tokens [A, vocab], those
    tokens [A], each one's example index [A], and each example's work (its pieces carry the captures of summarized
    runs)."""
    from hypic.runtime.batch import BatchBuilder
    from hypic.runtime.state import SeqState

    b = BatchBuilder(device)
    rows, gold, owner, works = [], [], [], []
    for e, (ex, items) in enumerate(zip(examples, items_of)):
        cap = sum(len(i[1]) if i[0] == "run" else i[1].length for i in items) + 8
        work = b.add(SeqState(capacity_hint=cap), items, logits="all")
        works.append(work)
        # every sequence returns logits for all its active rows, so logits rows are flat rows; the row before
        # an answer token predicts it (answers follow their question: that row is a query token, after every
        # composed document)
        q0 = work.end - len(ex.query)
        for j, (tok, is_answer) in enumerate(zip(ex.query, ex.answer)):
            if is_answer:
                rows.append(q0 + j - 1)
                gold.append(tok)
                owner.append(e)
    logits = model.logits(b.build(exact_transition=True, walk="phased"))
    dev = logits.device
    return (logits[torch.tensor(rows, device=dev)], torch.tensor(gold, device=dev), torch.tensor(owner, device=dev),
            works)


def _answer_loss(model, examples: list[Example], items_of, device, parts: int = 1):
    """Mean cross-entropy of the answer tokens, every example's items in one batch (one forward); with parts > 1
    the examples are that many equal groups (the same examples under different modes) and the result is one mean
    per group. Also each example's work (its pieces carry the captures of summarized runs)."""
    logits, gold, owner, works = _answer_logits(model, examples, items_of, device)
    ce = F.cross_entropy(logits, gold, reduction="none")
    if parts == 1:
        return ce.mean(), works
    group = owner // (len(examples) // parts)
    return [ce[group == g].mean() for g in range(parts)], works


def example_loss(model, examples: list[Example], mode: str, seam: int, device, anchor: bool = False) -> torch.Tensor:
    """Mean cross-entropy of the answer tokens of `examples` under `mode` ("pic" or "full")."""
    if mode not in ("pic", "full"):
        raise ValueError(mode)
    items_of, _ = _items_of(model, examples, mode, seam, device, anchor)
    return _answer_loss(model, examples, items_of, device)[0]


def _capture_tensors(cap):
    """The tensors of one layer's capture that `pic` reads from a cache entry (LinearSummary: T, S, conv tail;
    AttnKV: raw K, V), in a fixed order."""
    return [t for _, t in cap.tensors()]


# RMS floor of the consistency loss's normaliser: a capture tensor much smaller than this (a long document's T,
# decayed to ~0) counts its difference against this scale, not its own, so rounding-level values do not dominate
CONSIST_FLOOR = 1e-2


def capture_gap(entries: dict, works: list, examples: list[Example]) -> torch.Tensor:
    """The consistency loss: for every document `pic` takes from a cache entry and every layer, the relative
    squared difference between what isolated prefill cached (entries[(example, document)]) and what the same
    run computes in context (the matching summarized run of the `full+` forward), averaged over (document,
    layer, tensor). Zero exactly when every entry equals its in-context counterpart, which makes `pic` equal
    `full` for that prompt. Gradients reach both sides: the in-context side learns to depend less on the
    documents before it (what isolation cannot see), the isolated side to anticipate it."""
    terms = []
    for e, (ex, work) in enumerate(zip(examples, works)):
        runs = [p for p in work.pieces if getattr(p, "summarize", False)]
        docs = [d for d in range(len(ex.docs)) if (e, d) in entries]
        if len(runs) != len(docs):
            raise RuntimeError(f"example {e}: {len(runs)} summarized runs for {len(docs)} cached documents")
        for d, run in zip(docs, runs):
            iso = entries[(e, d)].layers
            for layer, cap in run.captures.items():
                for a, b in zip(_capture_tensors(iso[layer]), _capture_tensors(cap)):
                    a, b = a.float(), b.float()
                    scale = (a.detach().square().mean() + b.detach().square().mean()) / 2 + CONSIST_FLOOR ** 2
                    terms.append((a - b).square().mean() / scale)
    if not terms:
        return torch.zeros(())
    return torch.stack(terms).mean()


def consistency_losses(model, examples: list[Example], seam: int, device, anchor: bool = False):
    """(pic answer loss, full answer loss, capture gap) of the same examples, their graphs alive together."""
    items_p, entries = _items_of(model, examples, "pic", seam, device, anchor)
    items_f, _ = _items_of(model, examples, "full+", seam, device)
    # both modes' sequences in one forward: on the GPU the tune is bound by the count of launched ops (quality/
    # NOTES.md, fifteenth session), which one batch of 2N sequences keeps at about one forward's
    (lp, lf), works = _answer_loss(model, examples + examples, items_p + items_f, device, parts=2)
    return lp, lf, capture_gap(entries, works[len(examples):], examples)


# Documents per `twohop_hard` example: around the 8 of the twohop8 evaluation (the other tasks draw k from
# {2, 3, 4, 6, 8}, so most of their two-hop examples have 0-4 distractors and 0-2 competing jobs).
HARD_K = (6, 8, 10)


def hard_twohop_questions(P, tokenizer_path) -> np.ndarray:
    """The training pool's two-hop questions of the one sub-case that `pic` still fails on the GDN model.

    build_corpus.two_hop writes document B as two shuffled sentences, "Y Z lives in C." (full name) and
    "Y works as a J." (first name only), and asks for B's city or B's job. On twohop8 (qwen35-gdn-15m-pic,
    500 questions) every question that `full` answers and `pic` seam 8 misses (21 of 21; 24 of 24 after the
    GPU fine-tune) asks for the job of a B whose job sentence comes FIRST: that cell is full 91.3 / pic 76.2
    (126 questions), every other cell 100 / 100. City questions need no chaining ("lives in" is only in
    document B), and when the job follows "lives in" its tokens were computed after B's full name and the
    "lives in" sentence; when it comes first, the query has to chain A -> B's name -> "Y works as a", and
    the wrong answers are always another job of the prompt (a distractor's, or one in document A).
    Selected here from the TRAINING pool only (train.bin.xz: the two-hop pairs of build_corpus's
    training stream, distractors from its training fact documents), so the train / eval split is the
    same as for the other tasks: nothing of eval_twohop8 is read."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(tokenizer_path))
    qs = P.twohop_q
    qtext = tok.decode_batch([P.get("g_q", q).tolist() for q in qs])
    btext = tok.decode_batch([P.get("g_doc", P.A["g_qdoc2"][q]).tolist() for q in qs])
    keep = [q for q, qt, bt in zip(qs, qtext, btext)
            if "What is the job of" in qt and 0 <= bt.find(" works as a ") < bt.find(" lives in ")]
    return np.asarray(keep, np.int64)


def twohop_hard(maker, hard_q: np.ndarray):
    """A two-hop example of the hard sub-case (see hard_twohop_questions) among k - 2 training fact
    documents, k from HARD_K; examples_from shuffles the document order (A before or after B, any distance)."""
    P, r = maker.P, maker.rng
    k = int(r.choice(HARD_K))
    q = hard_q[r.integers(len(hard_q))]
    docs = [P.get("g_doc", P.A["g_qdoc"][q]), P.get("g_doc", P.A["g_qdoc2"][q])]
    docs += [P.get("g_doc", d) for d in r.choice(P.fact_docs, size=k - 2, replace=False)]
    return docs, [(P.get("g_q", q), P.get("g_a", q), 0)]


class FreshTwoHop:
    """Two-hop examples made on the fly by build_corpus's own generator (two_hop, fact_doc): people, places and
    jobs drawn anew for every example, so no answer can come from memory.

    The training pool holds 60,000 fixed two-hop pairs which the base training read many times. Made to test
    whether the GDN model answers those from its weights (so that a PIC tune on them could teach nothing about
    reading across isolated documents): it does not; on the hard sub-case pool and fresh pairs score alike
    under `pic` (quality/twohop_probe.py, quality/NOTES.md "Twenty-third session"). Kept as the task whose loss
    is a held-out loss: no example repeats. The evaluation sets are drawn by the same generator from
    their own seeds (build_corpus.make_eval_sets); a fresh draw is a new made-up person, not an evaluation
    passage (two syllable-built full names colliding with an evaluation's, with the same relation, is
    negligible). `hard`: share of examples forced into the sub-case `pic` fails (a job question whose job
    sentence opens document B: see hard_twohop_questions). Tokenized as build_corpus tokenizes (each span
    alone: "Document: <sentences>\n", "Question: <q>\nAnswer:", " <answer>" + eos)."""

    def __init__(self, tokenizer_path, seed: int, hard: float = 0.0):
        import random

        from tokenizers import Tokenizer

        sys.path.insert(0, str(ROOT / "quality" / "data"))
        import build_corpus as bc

        self.bc, self.hard = bc, hard
        self.tok = Tokenizer.from_file(str(tokenizer_path))
        self.eos = self.tok.token_to_id(bc.EOS)
        self.rng = random.Random(seed)

    def _ids(self, s: str) -> np.ndarray:
        return np.asarray(self.tok.encode(s, add_special_tokens=False).ids, np.int64)

    def pair(self, hard: bool):
        bc = self.bc
        while True:
            sa, sb, q, ans = bc.two_hop(self.rng)
            if not hard or (q.startswith("What is the job of") and " works as a " in sb[0]):
                return sa, sb, q, ans

    def __call__(self, k: int):
        """Documents (A, B, then k - 2 fresh fact documents; examples_from shuffles the order) and the question."""
        bc = self.bc
        sa, sb, q, ans = self.pair(self.rng.random() < self.hard)
        texts = [" ".join(sa), " ".join(sb)]
        texts += [" ".join(f[0] for f in bc.fact_doc(self.rng)[1]) for _ in range(max(0, k - 2))]
        docs = [self._ids(f"{bc.DOC_HEAD} {t}\n") for t in texts]
        answer = np.concatenate([self._ids(" " + ans), [self.eos]])
        return docs, [(self._ids(f"Question: {q}\nAnswer:"), answer, 0)]


def examples_from(maker, n: int, budget: int) -> list[Example]:
    """n structured examples from quality/train.py's RowMaker (its task mix and k choices), plus the tasks
    `twohop_hard` (needs maker.twohop_hard_q, set by main) and `twohop_fresh` (maker.fresh_twohop, a FreshTwoHop;
    k from HARD_K)."""
    out = []
    P, r = maker.P, maker.rng
    while len(out) < n:
        task = maker.tasks[r.choice(len(maker.tasks), p=maker.mix)]
        k = int(r.choice([2, 3, 4, 6, 8]))
        nq = 1
        docs, qas = {"kc": maker.kc, "twohop": maker.twohop, "needle": maker.needle,
                     "facts": lambda k, nq: maker.generic(P.fact_docs, k, nq),
                     "twohop_hard": lambda k, nq: twohop_hard(maker, maker.twohop_hard_q),
                     "twohop_fresh": lambda k, nq: maker.fresh_twohop(int(r.choice(HARD_K)))}[task](k, nq)
        if not qas:
            continue
        total = len(P.prefix) + sum(len(d) for d in docs) + sum(len(q) + len(a) for q, a, _ in qas)
        if total > budget:
            continue
        order = list(range(len(docs)))
        r.shuffle(order)
        query, answer = [], []
        for q, a, _ in qas:
            query += q.tolist() + a.tolist()
            answer += [False] * len(q) + [True] * len(a)
        out.append(Example(P.prefix.tolist(), [docs[i].tolist() for i in order], query, answer))
    return out


def save_hf(model, src: Path, out: Path) -> None:
    """hypic's weights into src's transformers checkpoint layout (names as the checkpoint's), saved to out."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
    sd = {k: v.detach().float().cpu() for k, v in model.state_dict().items()}
    target = hf.state_dict()
    missing = [k for k in target if k not in sd]
    if missing:
        raise SystemExit(f"hypic's state dict lacks {missing[:5]}: save_hf supports checkpoints whose names hypic keeps")
    hf.load_state_dict({k: sd[k] for k in target})
    hf.to(torch.bfloat16).save_pretrained(out, max_shard_size="14MB")
    AutoTokenizer.from_pretrained(src).save_pretrained(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--minutes", type=float, default=10.0)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--budget", type=int, default=1024, help="most tokens of one example")
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--pic-share", type=float, default=0.5, help="share of examples run under pic")
    ap.add_argument("--seams", default="0,4,8", help="seam widths drawn per pic batch")
    ap.add_argument("--anchor", default="none", choices=ANCHORS,
                    help="prefill each document after its example's prefix (the engine's CachePolicy.anchor)")
    ap.add_argument("--mix", default="twohop=0.4,needle=0.2,kc=0.2,facts=0.2")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--save-every", type=int, default=0, help="also save the checkpoint every N steps (0: at the end)")
    ap.add_argument("--kc-subst", type=float, default=0.7,
                    help="share of KC passages whose answer entity is replaced (as quality/train.py)")
    ap.add_argument("--kc-recombine", type=float, default=0.0,
                    help="share of those replacements that are a name no one has (as quality/train.py)")
    ap.add_argument("--needle-first", type=float, default=0.0,
                    help="share of needles put first in their document (the case isolated prefill hurts most: "
                         "quality/gap_breakdown.py); 0: where the data puts them (~28%% first on needle8)")
    ap.add_argument("--consist", type=float, default=0.0,
                    help="weight of the capture-gap loss (capture_gap); > 0: every example runs under both pic and "
                         "full (--pic-share is then unused) and the step's loss is (pic + full) / 2 + consist x gap")
    ap.add_argument("--fresh-hard", type=float, default=0.0,
                    help="task twohop_fresh: share of its examples in the sub-case pic fails (job question, job first)")
    ap.add_argument("--max-steps", type=int, default=0,
                    help="stop after N steps, the LR schedule by step (reproducible); 0: by --minutes and time")
    args = ap.parse_args()

    sys.path.insert(0, str(ROOT / "quality"))
    from train import Pools, RowMaker, load_xz, word_starts  # noqa: E402

    from hypic import LLM

    torch.manual_seed(args.seed)
    llm = LLM(args.model, device=args.device, dtype="float32")
    model = llm.engine.model
    model.train()
    for p in model.parameters():
        p.requires_grad_(True)
    P = Pools(load_xz(Path(args.data) / "train.bin.xz"))
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}
    starts = word_starts(Path(args.data) / "tokenizer.json") if args.kc_recombine > 0 else None
    maker = RowMaker(P, args.budget, args.seed, mix, args.kc_subst, args.kc_recombine, starts)
    maker.needle_first = args.needle_first
    if "twohop_hard" in mix:
        maker.twohop_hard_q = hard_twohop_questions(P, Path(args.data) / "tokenizer.json")
        print(json.dumps({"event": "twohop_hard", "questions": len(maker.twohop_hard_q),
                          "of": len(P.twohop_q)}), flush=True)
    if "twohop_fresh" in mix:
        maker.fresh_twohop = FreshTwoHop(Path(args.data) / "tokenizer.json", args.seed, args.fresh_hard)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    seams = [int(s) for s in args.seams.split(",")]
    anchored = args.anchor == "prefix"
    rng = np.random.default_rng(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    log = open(out / "pic_train_log.jsonl", "a")
    t0, step = time.time(), 0
    while (step < args.max_steps) if args.max_steps else (time.time() - t0 < args.minutes * 60):
        frac = step / args.max_steps if args.max_steps else (time.time() - t0) / (args.minutes * 60)
        for g in opt.param_groups:
            g["lr"] = args.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * frac)))
        exs = examples_from(maker, args.batch, args.budget)
        n_pic = int(round(args.pic_share * len(exs)))
        seam = int(rng.choice(seams))
        losses = {}
        opt.zero_grad(set_to_none=True)
        try:
            if args.consist > 0:
                lp, lf, lc = consistency_losses(model, exs, seam, args.device, anchored)
                ((lp + lf) / 2 + args.consist * lc).backward()
                losses.update(pic=round(lp.item(), 4), full=round(lf.item(), 4), gap=round(lc.item(), 5))
            elif n_pic:
                lp = example_loss(model, exs[:n_pic], "pic", seam, args.device, anchored)
                (lp * n_pic / len(exs)).backward()
                losses["pic"] = round(lp.item(), 4)
            if not args.consist and n_pic < len(exs):
                lf = example_loss(model, exs[n_pic:], "full", seam, args.device)
                (lf * (len(exs) - n_pic) / len(exs)).backward()
                losses["full"] = round(lf.item(), 4)
        except torch.OutOfMemoryError:
            # a batch too large for the device: drop this step's gradients (and the losses' graphs, so their memory
            # is freed), halve the batch, go on (logged)
            lp = lf = lc = None
            opt.zero_grad(set_to_none=True)
            if args.batch <= 1:
                raise
            args.batch //= 2
            if str(args.device).startswith("cuda"):
                torch.cuda.empty_cache()
            rec = {"event": "out_of_memory", "step": step, "batch": args.batch}
            log.write(json.dumps(rec) + "\n")
            print(json.dumps(rec), flush=True)
            continue
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        rec = {"step": step, "seam": seam, **losses, "gnorm": round(float(gn), 3), "t": round(time.time() - t0, 1)}
        if str(args.device).startswith("cuda") and (step % 10 == 0 or step <= 3):
            rec["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 1)
        log.write(json.dumps(rec) + "\n")
        log.flush()
        if step % 10 == 0 or step <= 3:
            print(json.dumps(rec), flush=True)
        if args.save_every and step % args.save_every == 0:
            save_hf(model, Path(args.model), out / "model")
            print(json.dumps({"event": "saved", "path": str(out / "model"), "steps": step}), flush=True)
    model.eval()
    save_hf(model, Path(args.model), out / "model")
    (out / "model" / "pic_train.json").write_text(json.dumps({"steps": step, "args": vars(args)}, indent=1))
    print(json.dumps({"event": "saved", "path": str(out / "model"), "steps": step, "done": True}), flush=True)


if __name__ == "__main__":
    main()
