"""The quality study's analysis helpers (quality/), on hand-made cases."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "quality"))

from answer_sources import source  # noqa: E402


def test_answer_sources_places_each_kind():
    docs = ["Document: Claudia Jessie played the clerk.\n", "Document: The film starred Kane Hillen.\n",
            "Document: Nothing here.\n"]
    assert source("Claudia Jessie", 1.0, docs, 0) == "correct"
    assert source("the clerk", 0.0, docs, 0) == "in the gold document"
    assert source("Kane Hillen.", 0.0, docs, 0) == "in another document"         # punctuation normalised away
    assert source("Claudia Schiffer", 0.0, docs, 0) == "words from the context"  # a name half copied
    assert source("J. K. Simmons", 0.0, docs, 0) == "not in the context"
    assert source("  ", 0.0, docs, 0) == "empty"
    assert source("Kane", 0.0, docs, 0) == "in another document"                 # a whole word, not a substring
    assert source("Hill", 0.0, docs, 0) == "not in the context"


def test_recombined_names_take_the_last_word_of_another():
    """train.py --kc-recombine: one entity's words but its last, then another's last word (token arrays whose
    word-opening tokens `starts` marks); single-word names stay as they are."""
    import numpy as np
    from train import recombined

    starts = np.zeros(20, bool)
    starts[[1, 3, 5, 7, 9]] = True                 # tokens that open a word
    a = np.array([1, 2, 3, 4])                     # two words: [1 2] [3 4]
    b = np.array([5, 6, 7, 9, 8])                  # three words: [5 6] [7] [9 8]
    assert recombined(a, b, starts).tolist() == [1, 2, 9, 8]
    assert recombined(b, a, starts).tolist() == [5, 6, 7, 3, 4]
    single = np.array([1, 2])
    assert recombined(single, b, starts).tolist() == [1, 2] and recombined(a, single, starts).tolist() == a.tolist()


def test_eval_results_record_the_weights_and_refuse_other_weights(tmp_path):
    """eval_pic: every row names the weights it came from (sha256 of the weight files); a results file of other
    weights under the same checkpoint name is not resumed (the KDA checkpoint directory has held six trainings)."""
    import json
    import types

    import pytest
    from eval_pic import run, weights_digest

    ck = tmp_path / "ck"
    ck.mkdir()
    (ck / "model-00001-of-00002.safetensors").write_bytes(b"a" * 10)
    (ck / "model-00002-of-00002.safetensors").write_bytes(b"b" * 10)
    d0 = weights_digest(str(ck))
    assert len(d0) == 16 and d0 == weights_digest(str(ck))
    (ck / "model-00002-of-00002.safetensors").write_bytes(b"c" * 10)
    assert weights_digest(str(ck)) != d0
    assert weights_digest(str(tmp_path / "missing")) == "unknown"
    data = tmp_path / "data"
    data.mkdir()
    (data / "eval_kc8.jsonl").write_text(json.dumps({"prefix": "", "segments": ["x"], "query": "q", "answer": "a"}) + "\n")
    out = tmp_path / "res.jsonl"
    out.write_text(json.dumps({"model": str(ck), "weights": d0, "mode": "full", "seam": 8, "i": 0}) + "\n")
    a = types.SimpleNamespace(model=str(ck), data=str(data), set="kc8", n=1, out=str(out), threads=1)
    with pytest.raises(SystemExit, match="other weights"):
        run(a)


def test_long_memory_gates_give_gdn_heads_state_over_a_document():
    """train.py --gdn-gate-init long: every GDN head's dt in [1e-3, 1e-1] (dt_bias its inverse softplus), so at zero
    input the per-token decay exp(-A dt), through the engine's own gate op, is at least exp(-16 * 0.1) = 0.2; the
    attention layers and every other weight are untouched."""
    import torch
    from transformers import AutoModelForCausalLM

    from hypic.ops import reference as ref
    from train import long_memory_gates, make_config

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(make_config("qwen35", 300, "tiny"), dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    dts = long_memory_gates(model, seed=1)
    assert [name.split(".")[2] for name, _ in dts] == ["0", "2"]          # the tiny model's linear layers
    after = model.state_dict()
    changed = {k for k in after if not torch.equal(after[k], before[k])}
    assert changed == {f"model.layers.{i}.linear_attn.dt_bias" for i in (0, 2)}
    for i in (0, 2):
        mod = model.model.layers[i].linear_attn
        dt = torch.nn.functional.softplus(mod.dt_bias.double())
        assert ((dt > 1e-3 * 0.999) & (dt < 1e-1 * 1.001)).all()
        g = ref.gdn_gate(torch.zeros(1, dt.numel()), mod.A_log.detach(), mod.dt_bias.detach())
        assert (g.exp() >= 0.2 - 1e-6).all() and (g.exp() < 1).all()


def test_needle_first_puts_needles_after_the_header():
    """RowMaker.needle_first (pic_train.py --needle-first): 1.0 puts every needle sentence right after its
    document's header (the haystack's first cut); 0.0 leaves the place to the uniform draw over every cut."""
    import numpy as np
    from train import RowMaker

    class FakePools:                                   # haystack docs [header | s1 | s2 | s3], needles 900+
        def __init__(self):
            self.docs = [np.array([1, 2, 10 + i, 11, 20 + i, 21, 30 + i]) for i in range(6)]
            self.cuts = [np.array([2, 4, 6])] * 6
            self.needles = [np.array([900 + i, 901]) for i in range(5)]

        def n(self, name):
            return {"h_doc": 6, "n_s": 5}[name]

        def get(self, name, i):
            return {"h_doc": self.docs, "h_cut": self.cuts, "n_s": self.needles,
                    "n_q": [np.array([500 + i]) for i in range(5)], "n_a": [np.array([600 + i]) for i in range(5)]}[name][i]

    def places(first):
        m = RowMaker(FakePools(), 512, 0, {"needle": 1.0})
        m.needle_first = first
        out = []
        for _ in range(40):
            docs, qas = m.needle(4, 2)
            out += [int(np.nonzero(docs[j] >= 900)[0][0]) for _, _, j in qas]
        return set(out)

    assert places(1.0) == {2}                          # right after the 2-token header
    assert places(0.0) == {2, 4, 6}


def test_report_keeps_rows_of_other_weights_apart(tmp_path, capsys):
    """eval_pic --report: rows of one checkpoint name but different recorded weights are two models in the table
    (named with their digests), never pooled into one cell; one name with one digest keeps its plain name."""
    import json

    from eval_pic import report

    def row(model, weights, mode, i, em):
        r = {"model": model, "set": "kc8", "mode": mode, "seam": 8, "i": i, "em": em, "f1": em, "nll": 1.0}
        if weights:
            r["weights"] = weights
        return json.dumps(r)

    a = tmp_path / "a.jsonl"
    b = tmp_path / "b.jsonl"
    a.write_text("\n".join(row("ck/m", "aaaaaaaa11", mode, i, 1.0) for mode in ("full", "pic") for i in range(4)))
    b.write_text("\n".join(row("ck/m", "bbbbbbbb22", mode, i, 0.0) for mode in ("full", "pic") for i in range(4)))
    report([a, b])
    out = capsys.readouterr().out
    assert "| m@aaaaaaaa | kc8 | full | - | 4 | 100.0" in out and "| m@bbbbbbbb | kc8 | full | - | 4 | 0.0" in out
    report([a])
    assert "| m | kc8 | full | - | 4 | 100.0" in capsys.readouterr().out


def test_report_pairs_naive_with_pic_at_its_seam(tmp_path, capsys):
    """eval_pic --report: `naive` against `pic` at the same seam, paired per question (the bar "naive clearly below
    pic"); a seam with no `pic` rows gets no pair."""
    import json

    from eval_pic import report

    def row(mode, seam, i, em):
        return json.dumps({"model": "ck/m", "set": "kc8", "mode": mode, "seam": seam, "i": i, "em": em, "f1": em,
                           "nll": 1.0})

    a = tmp_path / "a.jsonl"
    lines = [row("full", 8, i, 1.0) for i in range(4)] + [row("pic", 8, i, 1.0) for i in range(4)]
    lines += [row("naive", 8, i, float(i % 2)) for i in range(4)] + [row("naive", 4, i, 0.0) for i in range(4)]
    a.write_text("\n".join(lines))
    report([a])
    out = capsys.readouterr().out
    assert "| m | kc8 | 8 | 4 | -50.0 [" in out and "| m | kc8 | 4 |" not in out


def test_gap_breakdown_places_the_gold_document_where_the_prompt_had_it():
    """gap_breakdown.groups: the needle's place is read from the stored gold document, the gold document's half
    from where the evaluated (shuffled) prompt put it, not from its stored index."""
    from gap_breakdown import groups

    row = {"segments": ["Document: The special magic number for kiwi is 42.\n", "Document: a\n",
                        "Document: b\n", "Document: the cache is flushed first. The special magic number for fig is 7.\n"], "gold": 0}
    assert groups(row, 3) == ["needle first in its document", "gold document in the second half", "all"]
    row["gold"] = 3
    assert groups(row, 0) == ["needle later in its document", "gold document in the first half", "all"]


def test_gap_breakdown_sorts_two_hop_questions_by_kind():
    """Two-hop questions (build_corpus.two_hop): city questions apart, job questions by which of the second person's
    sentences comes first in that person's document (the job sentence names the first name only)."""
    from gap_breakdown import groups

    docs = ["Document: Ana Bel's cousin is Cid Dor. Ana owns a cat.\n",
            "Document: Cid works as a baker. Cid Dor lives in Oslo.\n",
            "Document: Eva works as a tailor. Eva Fay lives in Lima.\n"]
    job = {"segments": docs, "gold": 0, "query": "Question: What is the job of Ana Bel's cousin?\nAnswer:",
           "answer": "baker"}
    assert groups(job, 2)[0] == "job question, job sentence first"
    job["segments"][1] = "Document: Cid Dor lives in Oslo. Cid works as a baker.\n"
    assert groups(job, 0)[:2] == ["job question, 'lives in' sentence first", "gold document in the first half"]
    city = dict(job, query="Question: In which city does Ana Bel's cousin live?\nAnswer:", answer="Oslo")
    assert groups(city, 1) == ["city question", "gold document in the second half", "all"]
    # by where the job word ends in its document's tokens (here one token per word): "Document: Cid works as a baker"
    job["segments"][1] = "Document: Cid works as a baker. Cid Dor lives in Oslo.\n"
    words = lambda text: len(text.split())  # noqa: E731
    assert groups(job, 2, words, seam=6)[:2] == ["job question, job sentence first", "job first, job word within the seam"]
    assert groups(job, 2, words, seam=5)[1] == "job first, job word past the seam"


def _state_carry(tmp_path, monkeypatch, ckpt, docs):
    import json

    import state_carry

    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    rows = [{"prefix": "", "segments": d, "query": "q", "answer": "a"} for d in docs]
    (data / "eval_x.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "carry.json"
    monkeypatch.setattr(sys, "argv", ["state_carry.py", "--model", str(ckpt), "--set", "x", "--n", str(len(rows)),
                                      "--data", str(data), "--out", str(out)])
    state_carry.main()
    return json.loads(out.read_text())["layers"]


DOCS = [["Ada Lovelace wrote the first program. ", "The engine was never built in her time. ",
         "Babbage designed it in London. "],
        ["Paris is the capital of France. ", "Rome sits on seven hills, they say. "]]


def test_state_carry_sees_state_cross_documents_only_where_the_gates_keep_it(tmp_path, monkeypatch, hf_checkpoints):
    """quality/state_carry.py's two regimes on the tiny Qwen3.5 model: with the test models' slow decays (A in
    [0.01, 0.3]) every linear layer keeps most of its state per token, a document's T is far from 0, the final state
    carries earlier documents and naive addition is off; with A = 1e4 (decay exp(-1e4 dt) = 0, the regime of
    transformers' init that left the first GDN model memoryless) T is 0, nothing is carried and the exact chain is
    the last document's S, while naive addition still differs from it."""
    import torch
    from transformers import AutoModelForCausalLM

    from hypic.segment.tokenizer import Tokenizer

    _, path = hf_checkpoints["qwen3_5"]
    (tmp_path / "slow").mkdir()
    slow = _state_carry(tmp_path / "slow", monkeypatch, path, DOCS)
    assert len(slow) >= 2
    for r in slow:
        assert 0.5 < r["decay"] < 1 and r["t_norm"] > 0.05 and r["carried"] > 0.01 and r["naive_err"] > 0.01

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.fill_(float(torch.tensor(1e4).log()))
    fast = tmp_path / "fast_ckpt"
    model.save_pretrained(fast)
    Tokenizer.builtin_bytes().hf.save_pretrained(fast)
    (tmp_path / "fast").mkdir()
    rows = _state_carry(tmp_path / "fast", monkeypatch, fast, DOCS)
    for r in rows:
        assert r["decay"] == 0 and r["t_norm"] == 0 and r["carried"] == 0 and r["naive_err"] > 0.01


def _byte_tokenizer(path):
    """A byte-level BPE tokenizer with <|endoftext|> as id 0 (as build_corpus's), trained on a few lines."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["Document: Kaba Ro lives in Torburg. Kaba works as a pilot.",
                             "Question: What is the job of Mi Ten's sister?\nAnswer: pilot"], trainer)
    tok.save(str(path))
    return tok


def test_fresh_two_hop_pairs_are_new_and_hard_ones_put_the_job_first(tmp_path):
    """pic_train.FreshTwoHop: build_corpus's generator on the fly, tokenized span by span as the corpus is; with
    hard=1 every question asks for B's job with B's job sentence first; no two examples share a person."""
    tok = _byte_tokenizer(tmp_path / "tokenizer.json")
    from pic_train import FreshTwoHop

    eos = tok.token_to_id("<|endoftext|>")
    hard = FreshTwoHop(tmp_path / "tokenizer.json", seed=1, hard=1.0)
    seen = set()
    for k in (2, 6, 8):
        docs, qas = hard(k)
        assert len(docs) == k and len(qas) == 1
        q, a, gold = qas[0]
        text = [tok.decode(d.tolist()) for d in docs]
        assert all(t.startswith("Document: ") and t.endswith("\n") for t in text)
        b = text[1]
        assert 0 <= b.find(" works as a ") < b.find(" lives in ")
        question = tok.decode(q.tolist())
        assert question.startswith("Question: What is the job of ") and question.endswith("\nAnswer:")
        assert a[-1] == eos and tok.decode(a[:-1].tolist()).strip() in b and gold == 0
        for d in docs:                                    # each span tokenized alone, as build_corpus does
            assert d.tolist() == tok.encode(tok.decode(d.tolist()), add_special_tokens=False).ids
        name = b[len("Document: "):].split(" works as")[0]
        assert name not in seen
        seen.add(name)
    plain = FreshTwoHop(tmp_path / "tokenizer.json", seed=1, hard=0.0)
    kinds = {tok.decode(plain(2)[1][0][0].tolist())[:24] for _ in range(40)}
    assert kinds == {"Question: In which city ", "Question: What is the jo"}        # both questions of two_hop
