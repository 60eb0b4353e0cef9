"""LRU against cost-aware (GreedyDual-Size) eviction of the segment store, each with and without the "repeat"
admission policy, on a synthetic RAG trace at the size of Qwen3.5-35B-A3B's entries, side by side in one run (the
store and its doorkeeper themselves, hypic/cache/store.py MemoryStore and Doorkeeper; no model).

A hybrid model's PIC entry has a fixed part (T and S of every linear layer: 30 x 4 MiB here, whatever the segment's
length) and a part that grows with the length (K/V of the attention layers), while the prefill it saves grows with
the length. So a short segment holds many bytes per unit of work saved, and a store that weighs work per byte keeps
more of the work. The trace: D documents with log-normal lengths, Zipf popularity (independent of length), each
request k distinct documents, of which a share (--oneoff) are one-off documents no other request brings (a fresh
search result, a user's upload). Reported after a warm-up: the share of lookups that hit and the share of the prefill
work (placement.segment_cost, FLOP-proportional) that hits saved, per store budget (a share of the recurring
documents' bytes). Admission "repeat" stores an entry from its second sighting (EngineConfig.admission).

    python benchmarks/eviction_sim.py [--docs 2000] [--requests 12000] [--oneoff 0.0] [--out ...json]
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path

from hypic.cache.store import Doorkeeper, MemoryStore
from hypic.config import ModelConfig
from hypic.models.presets import preset_config
from hypic.prefill.placement import segment_cost


@dataclass(frozen=True)
class Entry:
    length: int
    nbytes: int
    origin: int = 0


def entry_bytes(cfg: ModelConfig, length: int, seam: int) -> int:
    """Bytes of one PIC entry of a qwen3_5 family model, bf16 K/V and conv tail, fp32 T and S (cache/entry.py)."""
    p = cfg.params
    hv, dk, dv = p.linear_num_value_heads, p.linear_key_head_dim, p.linear_value_head_dim
    conv_dim = 2 * p.linear_num_key_heads * dk + hv * dv
    per_layer = hv * dk * dk * 4 + hv * dk * dv * 4 + (p.linear_conv_kernel_dim - 1) * conv_dim * 2   # T, S, tail
    linear = len(cfg.linear_layers) * per_layer
    attn = len(cfg.attention_layers) * (length - seam) * p.num_key_value_heads * p.head_dim * 2 * 2
    return linear + attn


def zipf_sampler(n: int, alpha: float, rng: random.Random):
    weights = [1.0 / (i + 1) ** alpha for i in range(n)]
    order = list(range(n))
    rng.shuffle(order)                                       # popularity independent of length
    return lambda k: rng.choices(order, weights=weights, k=k)


POLICIES = ("lru", "cost", "lru+repeat", "cost+repeat")


def simulate(policy: str, docs: list[Entry], trace: list[list[int]], budget: int, warmup: int, cost,
             window: int) -> dict:
    store = MemoryStore(budget, cost=None if policy.startswith("lru") else cost)
    door = Doorkeeper(window) if policy.endswith("+repeat") else None
    hits = looks = 0
    saved = total = 0.0
    for r, req in enumerate(trace):
        for d in req:
            e = docs[d]
            got = store.get(d)
            if got is None and (door is None or door.admit(d)):
                store.put(d, e)
            if r >= warmup:
                looks += 1
                total += cost(e)
                if got is not None:
                    hits += 1
                    saved += cost(e)
    store.check()
    return {"hit_ratio": hits / looks, "work_saved": saved / total, "evictions": store.stats().evictions}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen3.5-35b-a3b")
    ap.add_argument("--docs", type=int, default=2000)
    ap.add_argument("--requests", type=int, default=12000)
    ap.add_argument("--warmup", type=int, default=2000)
    ap.add_argument("--k", type=int, default=10, help="documents per request")
    ap.add_argument("--median-len", type=float, default=600.0)
    ap.add_argument("--sigma", type=float, default=1.0, help="log-normal spread of the lengths")
    ap.add_argument("--alpha", type=float, default=0.9, help="Zipf exponent of popularity")
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--budgets", default="0.05,0.1,0.2,0.4", help="store budgets, shares of all documents' bytes")
    ap.add_argument("--oneoff", type=float, default=0.0, help="share of each request's documents seen only once")
    ap.add_argument("--window", type=int, default=65536, help="the doorkeeper's memory (EngineConfig.admission_window)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="benchmarks/results/eviction_sim.json")
    a = ap.parse_args()
    cfg = ModelConfig.from_dict(preset_config(a.model))
    rng = random.Random(a.seed)
    lens = [min(8000, max(a.seam + 8, int(rng.lognormvariate(0.0, a.sigma) * a.median_len))) for _ in range(a.docs)]
    docs = [Entry(n, entry_bytes(cfg, n, a.seam)) for n in lens]
    draw = zipf_sampler(a.docs, a.alpha, rng)
    recurring_bytes = sum(d.nbytes for d in docs)
    trace = []
    for _ in range(a.requests):
        req = []
        while len(req) < a.k:
            if a.oneoff and rng.random() < a.oneoff:     # a document no other request brings
                n = min(8000, max(a.seam + 8, int(rng.lognormvariate(0.0, a.sigma) * a.median_len)))
                docs.append(Entry(n, entry_bytes(cfg, n, a.seam)))
                req.append(len(docs) - 1)
                continue
            d = draw(1)[0]
            if d not in req:
                req.append(d)
        trace.append(req)

    def cost(e):
        return segment_cost(e.origin + e.length, cfg)

    all_bytes = recurring_bytes
    rows = []
    t0 = time.perf_counter()
    for share in (float(x) for x in a.budgets.split(",")):
        budget = int(share * all_bytes)
        res = {p: simulate(p, docs, trace, budget, a.warmup, cost, a.window) for p in POLICIES}
        rows.append({"budget_share": share, "budget_gib": budget / 2 ** 30, **res})
    fixed = entry_bytes(cfg, a.seam, a.seam)
    print(f"{a.model}: an entry holds {fixed / 2 ** 20:.0f} MiB of linear-layer state whatever its length, plus "
          f"{entry_bytes(cfg, 1000 + a.seam, a.seam) / 2 ** 20 - fixed / 2 ** 20:.0f} MiB of K/V per 1,000 tokens")
    print(f"{a.docs} recurring documents (median {a.median_len:.0f} tokens, log-normal sigma {a.sigma}; "
          f"{all_bytes / 2 ** 30:.0f} GiB of entries), Zipf {a.alpha}, {a.requests} requests x {a.k} documents "
          f"({a.oneoff:.0%} one-off: {len(docs) - a.docs} of them), the first {a.warmup} not counted")
    print(f"{'budget':>8}{'GiB':>8}" + "".join(f"{'hits ' + p:>18}" for p in POLICIES)
          + "".join(f"{'saved ' + p:>19}" for p in POLICIES))
    for r in rows:
        print(f"{r['budget_share']:>7.0%}{r['budget_gib']:>8.0f}"
              + "".join(f"{r[p]['hit_ratio']:>18.1%}" for p in POLICIES)
              + "".join(f"{r[p]['work_saved']:>19.1%}" for p in POLICIES))
    print(f"({time.perf_counter() - t0:.0f} s)")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(a), "total_gib": all_bytes / 2 ** 30,
                               "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
