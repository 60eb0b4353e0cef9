"""Train a small hybrid LM (Qwen3.5-style GDN or Kimi-style KDA) for hypic's quality study.

One command on a machine with a CUDA GPU (after `python quality/data/build_corpus.py`):

    python quality/train.py --arch qwen35 --minutes 7 --out out/qwen35

transformers + fla (fla-core) kernels, bf16 autocast with fp32 master weights, fused AdamW, packed
rows of pre-tokenised pieces assembled by DataLoader workers. The learning-rate schedule runs on
wall-clock time (warm-up 4%, cosine to 10%) so that a fixed budget ends with a decayed model.

A training row (length --seq) starts at position 0 with one complete prompt in the exact engine
format (prefix, documents each tokenized alone, then 1-3 "Question: ...\nAnswer:" + answer + eos),
then further complete examples while they fit, then language-model text. Loss = mean CE over
non-answer tokens + --qa-weight * mean CE over answer tokens (answer + eos).

At the end: held-out evaluation (greedy exact match computed by teacher forcing: the greedy output
equals the gold ids followed by eos exactly when argmax matches at every answer position; plus gold
NLL), and a Hugging Face checkpoint (bf16 safetensors sharded below 14 MB, tokenizer files).
"""
from __future__ import annotations

import argparse
import io
import json
import lzma
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------- models
def make_config(arch: str, vocab: int, size: str = "base"):
    L = 8
    full = [3, 7]  # full attention every 4th layer, as Qwen3.5 (full_attention_interval=4)
    if size == "tiny":  # CPU debugging
        L, full = 4, [1, 3]
    layer_types = ["full_attention" if i in full else "linear_attention" for i in range(L)]
    d = 384 if size == "base" else 64
    # ~16M parameters each (~31-33 MB in bf16, so both checkpoints come back from the GPU machine in one
    # 64 MiB transfer); KimiLinear cannot tie its LM head, so its MLP is narrower
    ff = (896 if arch == "qwen35" else 512) if size == "base" else 128
    if arch == "qwen35":
        from transformers import Qwen3_5TextConfig
        return Qwen3_5TextConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=L,
            num_attention_heads=6 if size == "base" else 2, num_key_value_heads=2, head_dim=64 if size == "base" else 32,
            # key head dim 128: fla's gated chunk_bwd_dqkwg is miscompiled by Triton 3.4-3.7.0 on Hopper only
            # for BK=64 (fla issue #640); K=128 gives BK=128 (checked on the device by gradcheck below)
            linear_num_key_heads=2, linear_key_head_dim=128 if size == "base" else 32,
            linear_num_value_heads=4 if size == "base" else 2, linear_value_head_dim=64 if size == "base" else 32,
            linear_conv_kernel_dim=4, layer_types=layer_types, max_position_embeddings=8192,
            tie_word_embeddings=True, rms_norm_eps=1e-6, eos_token_id=0, pad_token_id=0, bos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
        )
    if arch == "kimi":
        from transformers import KimiLinearConfig
        return KimiLinearConfig(
            vocab_size=vocab, hidden_size=d, intermediate_size=ff, num_hidden_layers=L,
            num_attention_heads=6 if size == "base" else 2, num_key_value_heads=6 if size == "base" else 2,
            kv_lora_rank=128 if size == "base" else 32, q_lora_rank=None,
            qk_nope_head_dim=64 if size == "base" else 16, qk_rope_head_dim=32 if size == "base" else 16,
            v_head_dim=64 if size == "base" else 16,
            linear_attn_config={"head_dim": 64 if size == "base" else 16, "num_heads": 6 if size == "base" else 4,
                                "short_conv_kernel_size": 4},
            layer_types=layer_types, mlp_layer_types=["dense"] * L, moe_intermediate_size=ff,
            num_local_experts=1, num_experts_per_tok=1, n_shared_experts=1,
            max_position_embeddings=8192, tie_word_embeddings=False, rms_norm_eps=1e-6,
            eos_token_id=0, pad_token_id=0, bos_token_id=None,
        )
    raise ValueError(arch)


def long_memory_gates(model, seed: int, dt_min: float = 1e-3, dt_max: float = 1e-1) -> list:
    """Gated DeltaNet decay gates initialised for long memory, as transformers initialises KDA's forget gate
    ("following FLA initialization": dt = exp(U(log dt_min, log dt_max)) per head, dt_bias = softplus^-1(dt)).
    transformers' Qwen3.5 init sets dt_bias = 1 (softplus 1.31) beside A = U(0.01, 16), so a fresh GDN head decays
    by exp(-1.31 A) per token at zero input: below 1e-4 for A > 7. qwen35-gdn-15m was trained from that init and
    kept it (A 0.5-15 after training, per-token decay 0.000 in four of six layers: quality/state_carry.py), so no
    state crosses a document. With this init a head's per-token decay exp(-A dt) starts between ~0.2 and ~1.
    Returns the new per-head dt of each layer (for the log)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for name, mod in model.named_modules():
        if hasattr(mod, "dt_bias") and hasattr(mod, "A_log") and mod.dt_bias.dim() == 1 \
                and mod.dt_bias.shape == mod.A_log.shape:                  # a GDN layer: one gate per value head
            u = torch.rand(mod.dt_bias.shape, generator=gen, dtype=torch.float64)
            dt = torch.exp(u * (math.log(dt_max) - math.log(dt_min)) + math.log(dt_min)).clamp_min(1e-4)
            with torch.no_grad():
                mod.dt_bias.copy_((dt + torch.log(-torch.expm1(-dt))).to(mod.dt_bias.dtype))
            out.append((name, [round(float(x), 5) for x in dt]))
    return out


# ------------------------------------------------------------------------------------------ data
def load_xz(path):
    return dict(np.load(io.BytesIO(lzma.decompress(Path(path).read_bytes()))))


class Pools:
    def __init__(self, A):
        self.A = A
        self.prefix = A["prefix"].astype(np.int64)
        # questions of each generic doc
        qdoc = A["g_qdoc"]
        order = np.argsort(qdoc, kind="stable")
        self.g_qs_order = order
        self.g_qs_start = np.searchsorted(qdoc[order], np.arange(len(A["g_doc_off"])))
        dtask = A["g_dtask"]
        self.disfl_docs = np.nonzero(dtask == 0)[0]
        self.fact_docs = np.nonzero(dtask == 1)[0]
        self.twohop_q = np.nonzero(A["g_qdoc2"] >= 0)[0]

    def get(self, name, i):
        o = self.A[name + "_off"]
        return self.A[name + "_tok"][o[i]:o[i + 1]].astype(np.int64)

    def n(self, name):
        return len(self.A[name + "_off"]) - 1

    def doc_questions(self, d):
        s, e = self.g_qs_start[d], self.g_qs_start[d + 1]
        return self.g_qs_order[s:e]


K_CHOICES = np.array([1, 2, 3, 4, 5, 6, 8, 8, 10, 12, 16])


def word_starts(tokenizer_json) -> np.ndarray:
    """Per token id: whether the token opens a word (byte-level BPE: its text starts with the space marker)."""
    from tokenizers import Tokenizer

    vocab = Tokenizer.from_file(str(tokenizer_json)).get_vocab()
    starts = np.zeros(max(vocab.values()) + 1, bool)
    for tok, i in vocab.items():
        starts[i] = tok.startswith("\u0120")
    return starts


def recombined(a: np.ndarray, b: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """An entity name no model has seen: a's words but its last, then b's last word (both token arrays that open
    with a word); a as it is when either has a single word."""
    wa, wb = np.flatnonzero(starts[a]), np.flatnonzero(starts[b])
    if len(wa) < 2 or len(wb) < 2 or wa[0] != 0 or wb[0] != 0:
        return a
    return np.concatenate([a[:wa[-1]], b[wb[-1]:]])


class RowMaker:
    def __init__(self, P: Pools, seq: int, seed: int, mix, kc_subst: float = 0.7, kc_recombine: float = 0.0,
                 starts: np.ndarray | None = None):
        self.P, self.seq, self.kc_subst = P, seq, kc_subst
        self.kc_recombine, self.starts = kc_recombine, starts
        self.needle_first = 0.0    # share of needles put first in their document (pic_train.py --needle-first)
        if kc_recombine > 0 and starts is None:
            raise ValueError("kc_recombine needs the tokenizer's word starts")
        self.rng = np.random.default_rng(seed)
        self.tasks = list(mix.keys())
        p = np.array(list(mix.values()), float)
        self.mix = p / p.sum()

    # each example: list of docs (arrays), list of (question, answer) pairs
    def kc(self, k, nq):
        P, r = self.P, self.rng
        ids = r.choice(P.n("kc_doc"), size=k, replace=False)
        docs, qas = [], []
        for j, i in enumerate(ids):
            doc = P.get("kc_doc", i)
            ans = P.get("kc_a", i)
            if r.random() < self.kc_subst:  # substitute another entity at every answer slot
                ent = P.get("kc_ent", r.integers(P.n("kc_ent")))
                if self.kc_recombine and r.random() < self.kc_recombine:   # a name the prior cannot complete
                    ent = recombined(ent, P.get("kc_ent", r.integers(P.n("kc_ent"))), self.starts)
                slots = P.get("kc_slot", i).reshape(-1, 2)
                parts, last = [], 0
                for s, e in slots:
                    parts += [doc[last:s], ent]
                    last = e
                parts.append(doc[last:])
                doc = np.concatenate(parts)
                ans = np.concatenate([ent, [0]])
            docs.append(doc)
            if j < nq:
                qas.append((P.get("kc_q", i), ans, j))
        return docs, qas

    def generic(self, pool, k, nq):
        P, r = self.P, self.rng
        ids = r.choice(pool, size=min(k, len(pool)), replace=False)
        docs, qas = [], []
        for j, d in enumerate(ids):
            docs.append(P.get("g_doc", d))
            if j < nq:
                qs = P.doc_questions(d)
                if len(qs):
                    q = qs[r.integers(len(qs))]
                    qas.append((P.get("g_q", q), P.get("g_a", q), j))
        return docs, qas

    def twohop(self, k, nq):
        P, r = self.P, self.rng
        nq = min(nq, max(1, k // 2))
        qs = r.choice(P.twohop_q, size=nq, replace=False)
        docs, qas = [], []
        for q in qs:
            docs += [P.get("g_doc", P.A["g_qdoc"][q]), P.get("g_doc", P.A["g_qdoc2"][q])]
            qas.append((P.get("g_q", q), P.get("g_a", q), len(docs) - 2))
        need = max(0, k - len(docs))
        for d in r.choice(P.fact_docs, size=need, replace=False):
            docs.append(P.get("g_doc", d))
        return docs, qas

    def needle(self, k, nq):
        P, r = self.P, self.rng
        ids = r.choice(P.n("h_doc"), size=k, replace=False)
        m = min(k, nq + int(r.integers(0, 3)))
        nid = r.choice(P.n("n_s"), size=m, replace=False)
        docs, qas = [], []
        for j, i in enumerate(ids):
            doc = P.get("h_doc", i)
            if j < m:
                cuts = P.get("h_cut", i)
                if self.needle_first and r.random() < self.needle_first:   # (0: the same draws as before)
                    c = cuts[0]                                   # right after the "Document:" header
                else:
                    c = cuts[r.integers(len(cuts))]
                doc = np.concatenate([doc[:c], P.get("n_s", nid[j]), doc[c:]])
                if j < nq:
                    qas.append((P.get("n_q", nid[j]), P.get("n_a", nid[j]), j))
            docs.append(doc)
        return docs, qas

    def example(self, budget):
        r = self.rng
        for _ in range(20):
            task = self.tasks[r.choice(len(self.tasks), p=self.mix)]
            k = int(r.choice(K_CHOICES))
            nq = int(r.choice([1, 1, 2, 3]))
            if task == "kc":
                docs, qas = self.kc(k, nq)
            elif task == "disfl":
                docs, qas = self.generic(self.P.disfl_docs, k, nq)
            elif task == "facts":
                docs, qas = self.generic(self.P.fact_docs, k, nq)
            elif task == "twohop":
                docs, qas = self.twohop(k, nq)
            else:
                docs, qas = self.needle(k, nq)
            if not qas:
                continue
            gold = set()
            for _, _, j in qas:
                gold.add(j)
                if task == "twohop":
                    gold.add(j + 1)
            # drop distractors until the example fits
            qa_len = sum(len(q) + len(a) for q, a, _ in qas)
            keep = list(range(len(docs)))
            while len(self.P.prefix) + sum(len(docs[i]) for i in keep) + qa_len > budget:
                drop = [i for i in keep if i not in gold]
                if not drop:
                    keep = None
                    break
                keep.remove(drop[r.integers(len(drop))])
            if keep is None:
                continue
            r.shuffle(keep)
            toks = [self.P.prefix] + [docs[i] for i in keep]
            w = [np.ones(len(t), np.int8) for t in toks]
            for q, a, _ in qas:
                toks += [q, a]
                w += [np.ones(len(q), np.int8), np.full(len(a), 2, np.int8)]
            return np.concatenate(toks), np.concatenate(w)
        return None

    def row(self):
        """seq+1 tokens and, per target position, 0/1/2 (ignore / LM / answer)."""
        n = self.seq + 1
        toks, ws, used = [], [], 0
        while n - used > 96:
            ex = self.example(n - used)
            if ex is None:
                break
            toks.append(ex[0]), ws.append(ex[1])
            used += len(ex[0])
            if self.rng.random() < 0.3:
                break
        if used < n:  # language-model filler (after an eos), from a random offset of the LM stream
            lm = self.P.A["lm"]
            s = int(self.rng.integers(0, len(lm) - n))
            fill = np.concatenate([[0], lm[s:s + n - used - 1].astype(np.int64)])
            toks.append(fill), ws.append(np.ones(len(fill), np.int8))
        t = np.concatenate(toks)[:n]
        w = np.concatenate(ws)[:n]
        return t, w


class RowDataset(torch.utils.data.IterableDataset):
    def __init__(self, P, seq, batch, seed, mix, kc_subst=0.7, kc_recombine=0.0, starts=None):
        self.P, self.seq, self.batch, self.seed, self.mix = P, seq, batch, seed, mix
        self.kc_subst, self.kc_recombine, self.starts = kc_subst, kc_recombine, starts

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        wid = info.id if info else 0
        rm = RowMaker(self.P, self.seq, self.seed * 1000 + wid, self.mix, self.kc_subst, self.kc_recombine,
                      self.starts)
        while True:
            T = np.zeros((self.batch, self.seq + 1), np.int64)
            W = np.zeros((self.batch, self.seq + 1), np.int8)
            for b in range(self.batch):
                T[b], W[b] = rm.row()
            yield torch.from_numpy(T), torch.from_numpy(W)


# ------------------------------------------------------------------------------------ evaluation
@torch.no_grad()
def evaluate(model, E, names, device, max_n=500, bs_tokens=48_000, dtype=torch.bfloat16):
    model.eval()
    res = {}
    for name in names:
        po, ao = E[f"{name}_p_off"], E[f"{name}_a_off"]
        n = min(max_n, len(po) - 1)
        items = []
        for i in range(n):
            p = E[f"{name}_p_tok"][po[i]:po[i + 1]].astype(np.int64)
            a = E[f"{name}_a_tok"][ao[i]:ao[i + 1]].astype(np.int64)
            items.append((p, a))
        order = sorted(range(n), key=lambda i: len(items[i][0]) + len(items[i][1]))
        em = np.zeros(n)
        nll = np.zeros(n)
        i = 0
        while i < n:
            Lmax = len(items[order[i]][0]) + len(items[order[i]][1])
            j = i
            while j < n and (j - i + 1) * (len(items[order[j]][0]) + len(items[order[j]][1])) <= bs_tokens:
                j += 1
            j = max(j, i + 1)
            idx = order[i:j]
            Lmax = max(len(items[x][0]) + len(items[x][1]) for x in idx)
            X = torch.zeros((len(idx), Lmax), dtype=torch.long)
            for r_, x in enumerate(idx):
                s = np.concatenate(items[x])
                X[r_, :len(s)] = torch.from_numpy(s)
            X = X.to(device)
            with torch.autocast(device.type, dtype=dtype, enabled=device.type == "cuda"):
                logits = model(input_ids=X, use_cache=False).logits.float()
            for r_, x in enumerate(idx):
                p, a = items[x]
                lg = logits[r_, len(p) - 1:len(p) + len(a) - 1]
                tgt = torch.from_numpy(a).to(device)
                em[x] = float((lg.argmax(-1) == tgt).all())
                nll[x] = float(F.cross_entropy(lg, tgt, reduction="sum"))
            i = j
        res[name] = {"n": n, "em": float(em.mean()), "nll": float(nll.mean())}
    model.train()
    return res


# ------------------------------------------------------------------------------- kernel checks
def patch_fla_guard(cfg, log):
    """fla 0.6.0 refuses gated chunk_bwd_dqkwg on Hopper with Triton in [3.4, 3.7.1) (fla issue #640: the
    miscompile hits BK=64). With key head dim 128 the kernel runs with BK=128; gradcheck() verifies it."""
    if cfg.model_type != "qwen3_5_text" or not torch.cuda.is_available():
        return
    import fla.ops.common.chunk_o as co
    if getattr(co, "TRITON_ABOVE_3_7_1", True) or not getattr(co, "IS_NVIDIA_HOPPER", False):
        return
    assert cfg.linear_key_head_dim >= 128, "BK=64 path is miscompiled on this Triton; use key head dim 128"
    co.TRITON_ABOVE_3_7_1 = True
    log({"event": "fla_guard_patched", "reason": "issue #640 affects BK=64 only; key head dim 128 -> BK=128"})


def gradcheck(cfg, device, log):
    """Output and gradients of the fla kernel transformers uses vs its own fp32 torch reference."""
    import inspect as _inspect
    if cfg.model_type == "qwen3_5_text":
        from transformers.models.qwen3_5 import modeling_qwen3_5 as M
        fast = M.torch_chunk_gated_delta_rule
        H, K, V = cfg.linear_num_value_heads, cfg.linear_key_head_dim, cfg.linear_value_head_dim
        gshape = (H,)
    else:
        from transformers.models.kimi_linear import modeling_kimi_linear as M
        fast = M.chunk_kimi_delta_attention
        H, K, V = cfg.linear_num_heads, cfg.linear_head_dim, cfg.linear_head_dim
        gshape = (H, K)
    ref = _inspect.unwrap(fast)
    gen = torch.Generator(device="cpu").manual_seed(0)
    B, T = 2, 512
    x = {"query": torch.randn(B, T, H, K, generator=gen), "key": torch.randn(B, T, H, K, generator=gen),
         "value": torch.randn(B, T, H, V, generator=gen),
         "g": -F.softplus(torch.randn(B, T, *gshape, generator=gen)) * 0.3,
         "beta": torch.rand(B, T, H, generator=gen)}
    do = torch.randn(B, T, H, V, generator=gen).to(device)
    outs = {}
    for name, fn, dt in (("fla", fast, torch.bfloat16), ("ref", ref, torch.float32)):
        inp = {k: v.to(device=device, dtype=dt if k != "g" else torch.float32).requires_grad_() for k, v in x.items()}
        o, _ = fn(inp["query"], inp["key"], inp["value"], g=inp["g"], beta=inp["beta"], use_qk_l2norm_in_kernel=True)
        (o.float() * do).sum().backward()
        outs[name] = {"o": o.detach().float(), **{k: v.grad.float() for k, v in inp.items()}}
    rel = {k: float((outs["fla"][k] - outs["ref"][k]).norm() / outs["ref"][k].norm().clamp(min=1e-12))
           for k in outs["ref"]}
    ok = all(v < 0.05 for v in rel.values())
    log({"event": "gradcheck", "fn": fast.__name__, "is_fla": fast is not ref, "rel_err": rel, "ok": ok})
    return ok


# --------------------------------------------------------------------------------------- training
def flops_per_token(model, cfg, seq):
    """6 x matmul parameters (incl. the tied LM head) + causal attention scores/values of full layers."""
    n_mat = sum(p.numel() for n, p in model.named_parameters() if p.dim() == 2 and "embed" not in n)
    if not any("lm_head" in n for n, _ in model.named_parameters()):  # tied head: count it once
        n_mat += cfg.vocab_size * cfg.hidden_size
    n_full = sum(t == "full_attention" for t in cfg.layer_types)
    heads = cfg.num_attention_heads
    hd = getattr(cfg, "head_dim", 64)
    if cfg.model_type == "kimi_linear":
        hd = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    attn = n_full * 6 * 2 * heads * hd * seq / 2  # QK^T and PV, causal half, fwd+bwd
    return 6 * n_mat + attn


def save_checkpoint(model, tok_path, out, max_shard="14MB"):
    from transformers import PreTrainedTokenizerFast
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    model = model.to(torch.bfloat16)
    model.config.torch_dtype = "bfloat16"
    model.save_pretrained(out, max_shard_size=max_shard, safe_serialization=True)
    tk = PreTrainedTokenizerFast(tokenizer_file=str(tok_path), eos_token="<|endoftext|>",
                                 pad_token="<|endoftext|>", model_max_length=8192)
    tk.save_pretrained(out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--arch", choices=["qwen35", "kimi"], required=True)
    ap.add_argument("--size", default="base", choices=["base", "tiny"])
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    ap.add_argument("--out", required=True)
    ap.add_argument("--minutes", type=float, default=7.0)
    ap.add_argument("--max-steps", type=int, default=10**9)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--wd", type=float, default=0.1)
    ap.add_argument("--qa-weight", type=float, default=1.0)
    ap.add_argument("--workers", type=int, default=6)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--eval-n", type=int, default=500)
    ap.add_argument("--eval-every-min", type=float, default=2.5)
    ap.add_argument("--mix", default="kc=0.30,needle=0.22,facts=0.12,twohop=0.16,disfl=0.20")
    ap.add_argument("--peak-tflops", type=float, default=790.0)
    ap.add_argument("--kc-subst", type=float, default=0.7,
                    help="share of KC training passages whose answer entity is replaced (everywhere in the passage)")
    ap.add_argument("--kc-recombine", type=float, default=0.0,
                    help="share of those replacements that are a name no one has (one entity's words but its last, "
                         "then another's last word), so the answer must be copied, not completed from memory")
    ap.add_argument("--no-save", action="store_true")
    ap.add_argument("--deadline", type=float, default=0.0,
                    help="epoch seconds by which the process must be done: training stops --reserve s before")
    ap.add_argument("--reserve", type=float, default=80.0)
    ap.add_argument("--require-fla", action="store_true", help="exit if fla does not import (GPU runs)")
    ap.add_argument("--total-train-s", type=float, default=0.0,
                    help="length of the LR schedule in training seconds, across resumed runs (default: --minutes)")
    ap.add_argument("--state", default="", help="file to resume from (if it exists) and to save the full state to")
    ap.add_argument("--skip-eval", action="store_true")
    ap.add_argument("--init", default="",
                    help="checkpoint directory to start from (continued training; ignored when --state resumes)")
    ap.add_argument("--warm", type=float, default=0.04, help="warm-up share of the LR schedule")
    ap.add_argument("--gdn-gate-init", choices=["transformers", "long"], default="transformers",
                    help="a fresh GDN model's decay gates: transformers' init (dt_bias 1: most heads keep no state "
                         "from one token to the next), or long memory (dt in [1e-3, 1e-1], see long_memory_gates)")
    args = ap.parse_args()

    torch.manual_seed(args.seed)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    logf = open(out / "train_log.jsonl", "a")

    def log(d):
        d["t"] = round(time.time() - t_start, 1)
        print(json.dumps(d), flush=True)
        logf.write(json.dumps(d) + "\n")
        logf.flush()

    t_start = time.time()
    data = Path(args.data)
    A = load_xz(data / "train.bin.xz")
    E = load_xz(data / "eval_tok.bin.xz")
    meta = json.loads((data / "meta.json").read_text())
    P = Pools(A)
    mix = {k: float(v) for k, v in (kv.split("=") for kv in args.mix.split(","))}

    from transformers import AutoModelForCausalLM
    try:
        import fla  # noqa: F401
        fla_ok = True
    except Exception:
        fla_ok = False
    if args.require_fla and not fla_ok:
        sys.exit("fla does not import: refusing to train on the slow torch path")
    cfg = make_config(args.arch, meta["vocab"], args.size)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).to(device)
    if args.gdn_gate_init == "long":
        if args.arch != "qwen35" or args.init:       # (a resumed --state overwrites it with the saved gates)
            sys.exit("--gdn-gate-init long is for a fresh qwen35 model (not with --init)")
        log({"event": "gdn_gate_init", "dt": long_memory_gates(model, args.seed)})
    if device.type == "cuda":
        patch_fla_guard(cfg, log)
        if not (Path(args.state).exists() if args.state else False):
            gradcheck(cfg, device, log)
    n_params = sum(p.numel() for p in model.parameters())
    fpt = flops_per_token(model, cfg, args.seq)
    log({"event": "start", "arch": args.arch, "params": n_params, "fla": fla_ok, "device": str(device),
         "gpu": torch.cuda.get_device_name() if device.type == "cuda" else None,
         "flops_per_token": fpt, "args": vars(args), "torch": torch.__version__,
         "transformers": __import__("transformers").__version__})

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.wd},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")

    prev_s, step0, tokens0 = 0.0, 0, 0
    if args.state and Path(args.state).exists():
        st = torch.load(args.state, map_location=device, weights_only=False)
        model.load_state_dict(st["model"])
        opt.load_state_dict(st["opt"])
        prev_s, step0, tokens0 = st["train_s"], st["step"], st["tokens"]
        log({"event": "resumed", "from": args.state, "train_s": prev_s, "step": step0, "tokens": tokens0})
    elif args.init:
        # Continued training: the weights of a saved checkpoint (bf16 on disk, fp32 master weights here), a new
        # optimizer and a new LR schedule (re-warmed). Step and token counts restart; the log says where from.
        src = AutoModelForCausalLM.from_pretrained(args.init, dtype=torch.float32)
        missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
        if missing or unexpected:
            sys.exit(f"--init {args.init}: missing {missing[:5]} unexpected {unexpected[:5]}")
        del src
        log({"event": "init", "from": args.init})
    total_s = args.total_train_s or args.minutes * 60
    starts = word_starts(data / "tokenizer.json") if args.kc_recombine > 0 else None
    ds = RowDataset(P, args.seq, args.batch, args.seed + 7919 * step0, mix, args.kc_subst, args.kc_recombine, starts)
    dl = torch.utils.data.DataLoader(ds, batch_size=None, num_workers=args.workers,
                                     pin_memory=device.type == "cuda", prefetch_factor=4 if args.workers else None,
                                     persistent_workers=False)
    it = iter(dl)
    budget = args.minutes * 60
    eval_names = ["needle8", "kc4", "kc8", "twohop8", "disfl8"]
    t0 = None
    step, tokens = step0, tokens0
    next_eval = args.eval_every_min * 60
    V = cfg.vocab_size
    while True:
        T, W = next(it)
        if t0 is None:
            t0 = time.time()
        frac = min(1.0, (prev_s + time.time() - t0) / total_s) if step > 0 else 0.0
        if frac >= 1.0 or time.time() - t0 >= budget or step >= args.max_steps or (args.deadline and time.time() > args.deadline - args.reserve):
            break
        warm = args.warm
        lr = args.lr * (frac / warm if frac < warm else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (frac - warm) / (1 - warm))))
        lr = max(lr, args.lr * 0.01)
        for g in opt.param_groups:
            g["lr"] = lr
        T = T.to(device, non_blocking=True)
        W = W.to(device, non_blocking=True)
        x, y, w = T[:, :-1], T[:, 1:], W[:, 1:]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=device.type == "cuda"):
            logits = model(input_ids=x, use_cache=False).logits
        ce = F.cross_entropy(logits.float().reshape(-1, V), y.reshape(-1), reduction="none").view_as(y)
        m_lm = (w == 1).float()
        m_qa = (w == 2).float()
        lm_loss = (ce * m_lm).sum() / m_lm.sum().clamp(min=1)
        qa_loss = (ce * m_qa).sum() / m_qa.sum().clamp(min=1)
        loss = lm_loss + args.qa_weight * qa_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        gn = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += x.numel()
        if step % 25 == 0 or step <= 3:
            if device.type == "cuda":
                torch.cuda.synchronize()
            el = time.time() - t0
            tps = (tokens - tokens0) / el
            log({"step": step, "tokens": tokens, "lm": round(lm_loss.item(), 4), "qa": round(qa_loss.item(), 4),
                 "gnorm": round(float(gn), 3), "lr": round(lr, 6), "tok_s": round(tps),
                 "mfu": round(tps * fpt / (args.peak_tflops * 1e12), 4)})
        if device.type == "cuda" and time.time() - t0 > next_eval and frac < 0.9:
            next_eval += args.eval_every_min * 60
            te = time.time()
            r = evaluate(model, E, ["needle8", "kc4"], device, max_n=200)
            t0 += time.time() - te  # evaluation time does not count against the training budget
            log({"event": "eval", "step": step, "tokens": tokens, **{k: v["em"] for k, v in r.items()}})
    if device.type == "cuda":
        torch.cuda.synchronize()
    el = time.time() - t0
    tps = (tokens - tokens0) / el
    log({"event": "train_done", "steps": step, "tokens": tokens, "seconds": round(el, 1), "train_s_total": round(prev_s + el, 1),
         "lr_frac": round(frac, 3), "tok_s": round(tps), "mfu": round(tps * fpt / (args.peak_tflops * 1e12), 4)})
    del it, dl
    if args.state:
        torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "train_s": prev_s + el,
                    "step": step, "tokens": tokens}, args.state)
    if not args.no_save:
        save_checkpoint(model, data / "tokenizer.json", out / "model")  # model is bf16 from here on
        log({"event": "saved", "path": str(out / "model")})
    if args.eval_n <= 0 or args.skip_eval:
        return
    te = time.time()
    names = eval_names + ["kc16", "needle16"] if device.type == "cuda" else eval_names
    res = {}
    for name in names:
        if args.deadline and time.time() > args.deadline - 5:
            log({"event": "eval_skipped", "set": name})
            continue
        res.update(evaluate(model, E, [name], device, max_n=args.eval_n))
        (out / "eval.json").write_text(json.dumps(res, indent=1))
    log({"event": "final_eval", "seconds": round(time.time() - te, 1), "dtype": str(next(model.parameters()).dtype), **res})


if __name__ == "__main__":
    main()
