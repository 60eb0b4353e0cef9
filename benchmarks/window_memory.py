"""Keys a request holds in a model with sliding-window attention, with the windowed layers dropping the keys no later
query sees (the default) against keeping every key, side by side in one run; tokens and logits must agree.

    python benchmarks/window_memory.py [--models tiny-recurrent-gemma,tiny-lara-mini] [--tokens 16384] [--decode 64]

One `full`-mode request of --tokens random prompt tokens decoding --decode more; after every forward the request's
attention buffers are read (keys held, bytes of keys, values and positions, and the bytes their storage takes), and
the table gives the largest total seen, per kind of layer, and the request's wall time. Prints a table and writes JSON (--out).
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path


def one(model: str, tokens: int, decode: int, evict: bool) -> dict:
    import torch

    import hypic.layers.attention as attention
    from hypic import LLM, Prompt, SamplingParams
    from hypic.runtime.state import KVBuffer

    attention.EVICT_EVERY = 256 if evict else 1 << 62
    llm = LLM(model, cache_mode="full")
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(llm.model_config.vocab_size, 256), (tokens,), generator=g).tolist()
    mixers = llm.engine.model.mixers
    peak = {"windowed_keys": 0, "full_keys": 0, "bytes": 0, "allocated": 0}
    real = llm.engine.model.forward

    def counted(batch):
        out = real(batch)
        kinds = {"windowed_keys": 0, "full_keys": 0, "bytes": 0, "allocated": 0}
        for seq in batch.seqs:
            for i, st in seq.state.layers.items():
                if isinstance(st, KVBuffer):
                    kinds["windowed_keys" if getattr(mixers[i], "window", 0) else "full_keys"] += st.n
                    per = st.k[0].nbytes + st.v[0].nbytes + 8
                    kinds["bytes"] += st.n * per
                    kinds["allocated"] += st.k.shape[0] * per          # the buffers' storage, held or not
        for k, v in kinds.items():
            peak[k] = max(peak[k], v)
        return out

    llm.engine.model.forward = counted
    t0 = time.perf_counter()
    out = llm.generate([Prompt(query=ids)], SamplingParams(max_tokens=decode, return_logits=True, ignore_eos=True))[0]
    wall = time.perf_counter() - t0
    windows = sorted({m.window for m in mixers.values() if getattr(m, "window", 0)})
    return {"model": model, "evict": evict, "wall_s": wall, "windows": windows, **peak, "tokens": out.token_ids,
            "logits": out.logits.tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="tiny-recurrent-gemma,tiny-lara-mini")
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--out", default="benchmarks/results/window_memory.json")
    a = ap.parse_args()
    import torch

    rows = []
    print(f"{a.tokens}-token prompt, {a.decode} decoded tokens, full mode; largest state seen after a forward")
    print(f"{'model':24s} {'drop':>5s} {'windowed keys':>14s} {'full keys':>10s} {'KV MiB':>8s} {'alloc MiB':>9s} "
          f"{'wall s':>7s}")
    for model in a.models.split(","):
        pair = [one(model, a.tokens, a.decode, evict) for evict in (False, True)]
        same = pair[0]["tokens"] == pair[1]["tokens"] and torch.allclose(
            torch.tensor(pair[0]["logits"]), torch.tensor(pair[1]["logits"]), atol=1e-5, rtol=0)
        for r in pair:
            print(f"{model:24s} {'yes' if r['evict'] else 'no':>5s} {r['windowed_keys']:>14d} {r['full_keys']:>10d} "
                  f"{r['bytes'] / 2**20:>8.1f} {r['allocated'] / 2**20:>9.1f} {r['wall_s']:>7.2f}")
            rows.append({k: v for k, v in r.items() if k not in ("tokens", "logits")} | {"same_output": same})
        if not same:
            raise SystemExit(f"{model}: dropping keys changed the output")
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps({"tokens": a.tokens, "decode": a.decode, "rows": rows}, indent=1))
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
