"""Chunked prefill on the CPU: peak memory and time of one long `full`-mode prompt, one forward against forwards of
at most --chunk tokens (EngineConfig.prefill_chunk_tokens), side by side in one run; the outputs must agree.

    python benchmarks/chunked_prefill.py [--model small-qwen3.5] [--tokens 32768] [--chunk 4096]

Peak memory is the process's resident set sampled every 5 ms during the request (psutil), minus the resident set
before it; each configuration runs in a fresh subprocess so one's allocator cache does not hide the other's peak.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def one(model: str, tokens: int, chunk: int) -> dict:
    import threading

    import psutil
    import torch

    from hypic import LLM, Prompt, SamplingParams

    llm = LLM(model, cache_mode="full", prefill_chunk_tokens=chunk)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, min(llm.model_config.vocab_size, 256), (tokens,), generator=g).tolist()
    llm.generate([Prompt(query=ids[:64])], SamplingParams(max_tokens=1))            # warm-up
    sizes, real = [], llm.engine.model.forward

    def counted(batch):
        sizes.append(len(batch.input_ids))
        return real(batch)

    llm.engine.model.forward = counted
    proc, peak, stop = psutil.Process(), [0], threading.Event()
    base = proc.memory_info().rss

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.005)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.perf_counter()
    out = llm.generate([Prompt(query=ids)], SamplingParams(max_tokens=1, return_logits=True))[0]
    wall = time.perf_counter() - t0
    stop.set()
    t.join()
    return {"chunk": chunk, "wall_s": wall, "peak_rss_mb": (max(peak[0], base) - base) / 2**20, "forwards": sizes,
            "token": out.token_ids[0], "logits": out.logits[0][:64].tolist()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small-qwen3.5")
    ap.add_argument("--tokens", type=int, default=32768)
    ap.add_argument("--chunk", type=int, default=4096)
    ap.add_argument("--child", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--out", default="benchmarks/results/chunked_prefill.json")
    a = ap.parse_args()
    if a.child:
        print(json.dumps(one(a.model, a.tokens, a.child)))
        return
    rows = []
    for chunk in (1 << 30, a.chunk):
        r = subprocess.run([sys.executable, __file__, "--model", a.model, "--tokens", str(a.tokens), "--child",
                            str(chunk)], capture_output=True, text=True, check=True)
        rows.append(json.loads(r.stdout.strip().splitlines()[-1]))
    import torch

    diff = (torch.tensor(rows[0]["logits"]) - torch.tensor(rows[1]["logits"])).abs().max().item()
    print(f"model {a.model}, one full-mode prompt of {a.tokens} tokens")
    print(f"{'forwards':<22}{'count':>6}{'wall s':>8}{'peak RSS MB':>13}")
    for r in rows:
        name = "one" if r["chunk"] >= a.tokens else f"<= {r['chunk']} tokens"
        print(f"{name:<22}{len(r['forwards']):>6}{r['wall_s']:>8.2f}{r['peak_rss_mb']:>13.0f}")
    print(f"same first token: {rows[0]['token'] == rows[1]['token']}; max |logit difference| {diff:.2e}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    for r in rows:
        r.pop("logits")
    out.write_text(json.dumps({"model": a.model, "tokens": a.tokens, "rows": rows, "max_logit_diff": diff,
                               "date": time.strftime("%Y-%m-%d")}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
