"""Serving benchmark: a closed loop of clients sending RAG requests to `hypic serve`, in `pic`
and `prefix` mode, one server after the other in the same run (CPU, tiny preset by default).

Each request: 8 distinct documents drawn from a pool of 50 with Zipf popularity (s = 1.1), in a
random order, plus a short query. Every client sends its next request as soon as the previous one
ends. TTFT is measured by the client: from sending the request to the first streamed token.

    python benchmarks/serve_rag.py [--model tiny-qwen3.5] [--clients 8] [--requests 160]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _docs(n: int, length: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    words = [f"w{i}" for i in range(2000)]
    docs = []
    for i in range(n):
        text = f"Document {i}. "
        while len(text) < length:
            text += rng.choice(words) + " "
        docs.append(text[:length])
    return docs


def _percentile(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def run_mode(mode: str, a, docs) -> dict:
    port = _port()
    proc = subprocess.Popen([sys.executable, "-m", "hypic.cli", "serve", "--model", a.model, "--port", str(port),
                             "--cache-mode", mode, "--seam", str(a.seam), "--max-running", str(a.clients)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(600):
            try:
                if httpx.get(base + "/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        weights = [1.0 / (i + 1) ** a.zipf for i in range(len(docs))]
        lock = threading.Lock()
        todo = list(range(a.requests))
        records = []

        def client(cid: int):
            rng = random.Random(1000 + cid)
            with httpx.Client(timeout=600) as h:
                while True:
                    with lock:
                        if not todo:
                            return
                        k = todo.pop()
                    chosen: list[int] = []
                    while len(chosen) < a.segments:
                        d = rng.choices(range(len(docs)), weights)[0]
                        if d not in chosen:
                            chosen.append(d)
                    body = {"model": a.model, "prompt": f"\nQuestion {k}: what do the documents say?\nAnswer:",
                            "segments": [docs[d] for d in chosen], "max_tokens": a.max_tokens, "temperature": 0,
                            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
                    t0 = time.perf_counter()
                    ttft, usage = None, None
                    with h.stream("POST", base + "/v1/completions", json=body) as r:
                        for line in r.iter_lines():
                            if not line.startswith("data: ") or line == "data: [DONE]":
                                continue
                            obj = json.loads(line[6:])
                            if obj.get("choices") and ttft is None:
                                ttft = time.perf_counter() - t0
                            if obj.get("usage"):
                                usage = obj["usage"]
                    with lock:
                        records.append({"ttft": ttft, "e2e": time.perf_counter() - t0, "usage": usage})

        t_start = time.perf_counter()
        threads = [threading.Thread(target=client, args=(c,)) for c in range(a.clients)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        wall = time.perf_counter() - t_start
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
    ttfts = [r["ttft"] for r in records if r["ttft"] is not None]
    hyp = [r["usage"]["hypic"] for r in records if r["usage"]]
    gen = sum(r["usage"]["completion_tokens"] for r in records if r["usage"])
    prompt = sum(r["usage"]["prompt_tokens"] for r in records if r["usage"])
    return {"requests": len(records), "wall_s": wall, "ttft_p50_ms": _percentile(ttfts, 0.5) * 1e3,
            "ttft_p99_ms": _percentile(ttfts, 0.99) * 1e3, "ttft_mean_ms": statistics.mean(ttfts) * 1e3,
            "requests_per_s": len(records) / wall, "output_tokens_per_s": gen / wall,
            "prompt_tokens_per_s": prompt / wall,
            "composed_share": sum(h["composed_tokens"] for h in hyp) / max(prompt, 1),
            "prefix_share": sum(h["prefix_tokens"] for h in hyp) / max(prompt, 1),
            "recomputed_share": sum(h["recomputed_tokens"] for h in hyp) / max(prompt, 1)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="tiny-qwen3.5")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--requests", type=int, default=160, help="per mode")
    ap.add_argument("--documents", type=int, default=50)
    ap.add_argument("--doc-len", type=int, default=400, help="characters (= tokens with the byte tokenizer)")
    ap.add_argument("--segments", type=int, default=8)
    ap.add_argument("--zipf", type=float, default=1.1)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--modes", default="pic,prefix")
    ap.add_argument("--out", default="benchmarks/results/serve_rag.json")
    a = ap.parse_args()
    docs = _docs(a.documents, a.doc_len, seed=0)
    results = {m: run_mode(m, a, docs) for m in a.modes.split(",")}
    print(f"{a.clients} clients, {a.requests} requests per mode, {a.segments} of {a.documents} documents "
          f"(Zipf {a.zipf}) x {a.doc_len} tokens, {a.max_tokens} output tokens, model {a.model}")
    print(f"{'mode':<8}{'TTFT p50 ms':>12}{'p99 ms':>10}{'req/s':>8}{'out tok/s':>10}{'composed':>10}"
          f"{'prefix':>8}{'recomp':>8}")
    for m, r in results.items():
        print(f"{m:<8}{r['ttft_p50_ms']:>12.1f}{r['ttft_p99_ms']:>10.1f}{r['requests_per_s']:>8.2f}"
              f"{r['output_tokens_per_s']:>10.1f}{r['composed_share']:>10.2f}{r['prefix_share']:>8.2f}"
              f"{r['recomputed_share']:>8.2f}")
    if "pic" in results and "prefix" in results:
        ratio = results["prefix"]["ttft_p50_ms"] / results["pic"]["ttft_p50_ms"]
        print(f"pic p50 TTFT is {ratio:.1f}x lower than prefix (bar: >= 3x); throughput "
              f"{results['pic']['requests_per_s'] / results['prefix']['requests_per_s']:.1f}x")
        results["pic_vs_prefix_ttft_p50"] = ratio
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(a), "results": results, "date": time.strftime("%Y-%m-%d"),
                               "machine": {"python": platform.python_version(), "cpu": platform.machine()}}, indent=2))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
