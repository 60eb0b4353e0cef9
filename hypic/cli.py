"""Command line: `hypic generate`, `hypic demo` and `hypic serve`.

    hypic demo [--model tiny-qwen3.5]
    hypic serve [--model DIR|PRESET] [--port 8000] [--cache-mode pic] [--api-key KEY]
    hypic generate --model DIR|PRESET --segment TEXT ... --query TEXT [--prefix TEXT] [--mode pic]
    hypic serve ... --workers 2                   cold segments prefilled on this process and a spawned worker
    hypic serve ... --workers 3 --rendezvous HOST:PORT     ... on workers started by hand (other hosts) with
    hypic worker --rendezvous HOST:PORT --rank R --workers 3 [--model ... --device cuda:0 ...]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from .config import ANCHORS
from .errors import HypicError


def _read(text: str | None, path: str | None) -> str | None:
    if path:
        return Path(path).read_text(encoding="utf-8")
    return text


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default="tiny-qwen3.5", help="checkpoint directory or preset name")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--load-format", default="auto", choices=["auto", "safetensors", "dummy"])
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seam", type=int, default=8)
    p.add_argument("--anchor", default="none", choices=ANCHORS,
                   help="what a segment's isolated prefill runs after: nothing, or the request's prefix")


def _store_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--segment-cache-gb", type=float, default=4.0, help="the segment store's device tier")
    p.add_argument("--host-cache-gb", type=float, default=0.0,
                   help="its host tier (pinned on CUDA): entries evicted from the device wait there")
    p.add_argument("--disk-cache-dir", default="", help="its disk tier: entries written through, kept across restarts")
    p.add_argument("--disk-cache-gb", type=float, default=64.0)
    p.add_argument("--eviction", default="lru", choices=["lru", "cost"],
                   help="device and host tiers: least recently used, or least prefill saved per byte first")
    p.add_argument("--admission", default="always", choices=["always", "repeat"],
                   help="store every cold entry, or only from a segment's second sighting")
    p.add_argument("--prefill-chunk-tokens", type=int, default=65536,
                   help="cold segments run in isolated-prefill forwards of at most this many tokens")


def _store(a: argparse.Namespace) -> dict:
    gb = 1 << 30
    return dict(segment_cache_bytes=int(a.segment_cache_gb * gb), host_cache_bytes=int(a.host_cache_gb * gb),
                disk_cache_dir=a.disk_cache_dir, disk_cache_bytes=int(a.disk_cache_gb * gb), eviction=a.eviction,
                admission=a.admission, prefill_chunk_tokens=a.prefill_chunk_tokens)


def _parallel_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--workers", type=int, default=1,
                   help="ranks that prefill cold segments, this process included (1: none; hypic.md 2.3)")
    p.add_argument("--worker-devices", default="", help="comma-separated devices of ranks 1.. (default: cuda:1, "
                                                          "cuda:2, ... on CUDA, else --device)")
    p.add_argument("--worker-threads", type=int, default=0, help="torch threads of a CPU worker (0: torch's default)")
    p.add_argument("--worker-transport", default="auto", choices=["auto", "gloo", "nccl"])
    p.add_argument("--worker-timeout", type=float, default=120.0,
                   help="seconds a cold prefill waits for the workers before prefilling their share itself")
    p.add_argument("--worker-restarts", type=int, default=3,
                   help="times a spawned worker that died is started again (0: never)")
    p.add_argument("--rendezvous", default="", help="HOST:PORT where workers started by hand (`hypic worker`) "
                                                    "connect; without it workers are spawned here")


def _parallel(a: argparse.Namespace):
    from .config import ParallelConfig

    host, port = _host_port(a.rendezvous) if a.rendezvous else ("127.0.0.1", 0)
    devices = tuple(d for d in a.worker_devices.split(",") if d)
    return ParallelConfig(workers=a.workers, devices=devices, spawn=not a.rendezvous, host=host, port=port,
                          transport=a.worker_transport, timeout_s=a.worker_timeout, threads=a.worker_threads,
                          restarts=a.worker_restarts)


def _host_port(text: str) -> tuple[str, int]:
    host, _, port = text.rpartition(":")
    if not host or not port.isdigit():
        raise HypicError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def cmd_worker(a: argparse.Namespace) -> int:
    """A worker started by hand: loads the model (the same source, dtype, seed and load format as rank 0), joins
    rank 0 at --rendezvous and prefills the segments it is sent until rank 0 stops it."""
    from .config import EngineConfig, ParallelConfig
    from .prefill.parallel import serve

    host, port = _host_port(a.rendezvous)
    if not 1 <= a.rank < a.workers:
        raise HypicError(f"--rank must be in 1..{a.workers - 1} (rank 0 is the engine)")
    pc = ParallelConfig(workers=a.workers, spawn=False, host=host, port=port, transport=a.worker_transport,
                        threads=a.worker_threads, startup_timeout_s=a.startup_timeout)
    cfg = EngineConfig(device=a.device, dtype=a.dtype, load_format=a.load_format, seed=a.seed)
    serve(a.model, cfg, a.rank, pc)
    return 0


def cmd_generate(a: argparse.Namespace) -> int:
    from . import LLM, Prompt, SamplingParams

    segments = list(a.segment or []) + [Path(f).read_text(encoding="utf-8") for f in (a.segment_file or [])]
    query = _read(a.query, a.query_file)
    if query is None:
        raise HypicError("give --query or --query-file")
    prefix = _read(a.prefix, a.prefix_file)
    llm = LLM(a.model, device=a.device, dtype=a.dtype, cache_mode=a.mode, seam=a.seam, anchor=a.anchor,
              load_format=a.load_format, seed=a.seed, parallel=_parallel(a), **_store(a))
    params = SamplingParams(max_tokens=a.max_tokens, temperature=a.temperature, top_p=a.top_p, top_k=a.top_k,
                            seed=a.seed)
    with llm:
        out = llm.generate([Prompt(segments=segments, query=query, prefix=prefix)], params)[0]
    if a.json:
        print(json.dumps({"text": out.text, "token_ids": out.token_ids, "finish_reason": out.finish_reason,
                          "ttft_ms": round(out.ttft_s * 1e3, 3), "prompt_tokens": out.num_prompt_tokens,
                          "prefix_tokens": out.prefix_tokens, "composed_tokens": out.composed_tokens,
                          "recomputed_tokens": out.recomputed_tokens, "cold_prefill_tokens": out.cold_prefill_tokens,
                          "mode": out.mode}))
    else:
        print(out.text if out.text is not None else out.token_ids)
        print(f"[{out.mode}] ttft {out.ttft_s * 1e3:.1f} ms | prompt {out.num_prompt_tokens} tokens: "
              f"prefix {out.prefix_tokens}, composed {out.composed_tokens}, recomputed {out.recomputed_tokens}",
              file=sys.stderr)
    return 0


DEMO_DOCS = [
    "Document 1. The Tarn valley railway opened in 1891 and carried slate from the upper quarries to the port "
    "of Aberlyn. Its locomotives were named after local rivers. " * 6,
    "Document 2. Aberlyn's harbour master keeps a log of every ship that enters the port. In winter storms the "
    "outer breakwater is closed and ships anchor in the bay. " * 6,
    "Document 3. The upper quarries closed in 1962; the railway bed is now a walking trail that climbs 400 metres "
    "over eleven kilometres. " * 6,
    "Document 4. Slate from the valley roofed houses across the region; the quarry company's ledgers survive in "
    "the county archive. " * 6,
]


def cmd_demo(a: argparse.Namespace) -> int:
    from . import LLM, Prompt, SamplingParams

    t0 = time.perf_counter()
    llm = LLM(a.model, device=a.device, dtype=a.dtype, seam=a.seam, anchor=a.anchor, load_format=a.load_format,
              seed=a.seed)
    print(f"model {a.model} loaded in {time.perf_counter() - t0:.2f} s "
          f"({sum(p.numel() for p in llm.engine.model.parameters()) / 1e6:.2f} M parameters, random weights)"
          if a.model.startswith(("tiny-", "small-")) else f"model {a.model} loaded")
    prefix = "You answer questions using the documents below.\n"
    query = "\nQuestion: when did the upper quarries close?\nAnswer:"
    params = SamplingParams(max_tokens=a.max_tokens)
    orders = [DEMO_DOCS, [DEMO_DOCS[i] for i in (2, 0, 3, 1)]]
    print("Two requests with the same four documents, the second in a new order (warm caches).\n")
    header = f"{'mode':<7} {'request':<9} {'ttft ms':>9} {'prefix':>7} {'composed':>9} {'recomputed':>11}  answer"
    print(header)
    print("-" * len(header))
    answers = {}
    for mode in ("full", "prefix", "pic"):
        llm.set_policy(mode, a.seam)
        llm.clear_cache()
        for i, docs in enumerate(orders):
            out = llm.generate([Prompt(prefix=prefix, segments=docs, query=query)], params)[0]
            answers[(mode, i)] = out.token_ids
            print(f"{mode:<7} {'first' if i == 0 else 'reordered':<9} {out.ttft_s * 1e3:>9.1f} {out.prefix_tokens:>7} "
                  f"{out.composed_tokens:>9} {out.recomputed_tokens:>11}  {out.text!r}")
    print()
    for i, name in enumerate(("first", "reordered")):
        same_prefix = answers[("prefix", i)] == answers[("full", i)]
        same_pic = answers[("pic", i)] == answers[("full", i)]
        print(f"{name} request: prefix {'==' if same_prefix else '!='} full; pic {'==' if same_pic else '!='} full"
              + ("" if same_pic else " (PIC is an approximation: seam window, independent segments)"))
    print("\nprefix mode reuses only an exact prefix, so the reordered request recomputes the moved documents;\n"
          "pic composes every cached document in its new place and recomputes only the seams and the query.")
    return 0


def cmd_serve(a: argparse.Namespace) -> int:
    import uvicorn

    from . import LLM
    from .runtime.scheduler import SchedulerConfig
    from .server.app import ServerConfig, build_app

    llm = LLM(a.model, device=a.device, dtype=a.dtype, cache_mode=a.cache_mode, seam=a.seam, anchor=a.anchor,
              load_format=a.load_format, seed=a.seed, max_segments=a.max_segments, parallel=_parallel(a),
              **_store(a))
    if a.warmup == "on" or (a.warmup == "auto" and llm.config.device.startswith("cuda")):
        times = llm.warmup(tokens=a.warmup_tokens)
        print("hypic: warm-up " + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()), flush=True)
    config = ServerConfig(
        model_name=a.served_model_name or a.model, api_key=a.api_key, separator=a.separator,
        default_max_tokens=a.default_max_tokens,
        scheduler=SchedulerConfig(max_waiting=a.max_waiting, max_running=a.max_running,
                                  max_running_tokens=a.max_running_tokens,
                                  max_state_bytes=int(a.max_state_gb * (1 << 30)), request_timeout_s=a.request_timeout))
    # uvicorn installs SIGINT/SIGTERM handlers: it stops accepting, lets the app's lifespan shut the
    # scheduler down (waiting requests get 503), then exits.
    with llm:                       # stops the workers, if any, once the server has shut down
        uvicorn.run(build_app(llm, config), host=a.host, port=a.port, log_level=a.log_level,
                    timeout_graceful_shutdown=5)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="hypic", description="Position-independent caching for hybrid LLMs")
    sub = ap.add_subparsers(dest="cmd", required=True)
    g = sub.add_parser("generate", help="generate from prefix + segments + query")
    _engine_args(g)
    g.add_argument("--mode", default="pic", help="full | prefix | naive | pic")
    g.add_argument("--prefix")
    g.add_argument("--prefix-file")
    g.add_argument("--segment", action="append", help="a segment's text (repeatable)")
    g.add_argument("--segment-file", action="append", help="a file whose text is one segment (repeatable)")
    g.add_argument("--query")
    g.add_argument("--query-file")
    g.add_argument("--max-tokens", type=int, default=32)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--json", action="store_true", help="print one JSON object")
    _parallel_args(g)
    _store_args(g)
    g.set_defaults(fn=cmd_generate)
    d = sub.add_parser("demo", help="a short RAG scenario under full, prefix and pic")
    _engine_args(d)
    d.add_argument("--max-tokens", type=int, default=12)
    d.set_defaults(fn=cmd_demo)
    s = sub.add_parser("serve", help="OpenAI-compatible HTTP server")
    _engine_args(s)
    s.add_argument("--host", default="127.0.0.1")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--cache-mode", default="pic", help="pic | prefix | naive | full")
    s.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    s.add_argument("--separator", default="<<PIC_SEP>>", help="splits a completions prompt into segments + query")
    s.add_argument("--served-model-name", default=None)
    s.add_argument("--max-segments", type=int, default=256)
    s.add_argument("--max-waiting", type=int, default=256, help="bounded queue; beyond it requests get 429")
    s.add_argument("--max-running", type=int, default=64)
    s.add_argument("--max-running-tokens", type=int, default=1 << 20,
                   help="sum of prompt + max_tokens over the running requests")
    s.add_argument("--max-state-gb", type=float, default=0.0,
                   help="memory admission: the running requests' per-layer states (KV of attention layers, linear "
                        "states) at their full length stay within this many GiB (0: no bound)")
    s.add_argument("--request-timeout", type=float, default=600.0, help="seconds")
    s.add_argument("--default-max-tokens", type=int, default=1024)
    s.add_argument("--log-level", default="warning")
    s.add_argument("--warmup", choices=("auto", "on", "off"), default="auto",
                   help="run the engine's paths once before serving (LLM.warmup), so the first requests do not "
                        "compile and tune kernels; auto: on for CUDA")
    s.add_argument("--warmup-tokens", type=int, default=2048)
    _parallel_args(s)
    _store_args(s)
    s.set_defaults(fn=cmd_serve)
    w = sub.add_parser("worker", help="a segment-parallel worker started by hand, for `serve --rendezvous`")
    _engine_args(w)
    w.add_argument("--rendezvous", required=True, help="HOST:PORT of rank 0's `serve --rendezvous`")
    w.add_argument("--rank", type=int, required=True)
    w.add_argument("--workers", type=int, required=True, help="ranks in all, rank 0 included")
    w.add_argument("--worker-transport", default="auto", choices=["auto", "gloo", "nccl"])
    w.add_argument("--worker-threads", type=int, default=0)
    w.add_argument("--startup-timeout", type=float, default=600.0)
    w.set_defaults(fn=cmd_worker)
    a = ap.parse_args(argv)
    try:
        return a.fn(a)
    except (HypicError, OSError) as e:
        print(f"hypic: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
