"""The host side of a warm `pic` request at the 35B benchmark's layout, on the CPU (issue 3).

On the H200 the warm RAG request (20 x 1,600-token segments + a 64-token query, seam 8) spends ~4.5 ms of
its TTFT before the GPU starts: the prompt validated and hashed (`llm.make_requests`), the plan, the
compose pass lowered to tables (`compose.lower`) and the tables loaded (H200 run 53's profile: 2.28,
0.22, 2.24 and 0.65 ms). That work depends on the layout (layers, segments, tokens), not on the widths,
so it is measured here with the 35B preset's layer layout (40 layers, full attention every 4th) at tiny
widths: the fixed buffers run eagerly (`compose="static"`, the same lowering and loading as the CUDA
graph's), and each host span's wall time is taken by `runtime.trace.TIMES`.

    python benchmarks/host_bench.py [--reps 30] [--segments 20] [--seg-len 1600] [--query 64]

Prints a table of each span's median and writes host_bench.json (--out). Spans that include the tiny
model's eager forward on the CPU (engine.compose, engine.sample) or its packing of cached tensors
(compose.load) say nothing about the GPU and are listed only for completeness; the host-only sum is of
the spans a CUDA request also runs on the host before its first graph piece, and after its first token.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hypic import LLM, Prompt, SamplingParams  # noqa: E402
from hypic.config import EngineConfig, ModelConfig  # noqa: E402
from hypic.models.loader import LoadedModel, _build, _fingerprint, _generator  # noqa: E402
from hypic.models.presets import preset_config  # noqa: E402
from hypic.runtime import trace  # noqa: E402

HOST_SPANS = ("llm.make_requests", "engine.plan", "engine.cold", "compose.lower", "compose.load_tables",
              "compose.state", "engine.complete")
# compose.load_tables is what a CUDA request loads before its first graph piece; the static CPU pass's compose.load
# also packs every layer's cached tensors, which CUDA does piece by piece beside the running graph
NOTES = {"compose.load": "CPU: the tables, then every layer's cached tensors packed (CUDA: per graph piece)",
         "engine.compose": "the tiny model's eager forward on the CPU included",
         "engine.sample": "CPU sampling of the tiny model's logits"}


def layout_config(preset: str, layers: int) -> dict:
    """The preset's layer layout at tiny widths (host work depends on the layout only)."""
    raw = dict(preset_config(preset))
    raw.update(vocab_size=4096, hidden_size=64, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
               linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16,
               eos_token_id=4095)
    for k, v in dict(num_experts=16, moe_intermediate_size=16, shared_expert_intermediate_size=16,
                     intermediate_size=64).items():
        if k in raw:
            raw[k] = v
    if layers:
        raw["num_hidden_layers"] = layers
        raw.pop("layer_types", None)
    return raw


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3.5-35b-a3b")
    ap.add_argument("--layers", type=int, default=0, help="0: the preset's")
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--seg-len", type=int, default=1600)
    ap.add_argument("--query", type=int, default=64)
    ap.add_argument("--seam", type=int, default=8)
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    torch.set_num_threads(1)

    cfg = ModelConfig.from_dict(layout_config(args.preset, args.layers))
    econf = EngineConfig(device="cpu", dtype="float32", compose="static")
    model = _build(cfg, econf)
    model.init_dummy(_generator(econf))
    loaded = LoadedModel(cfg, model, None, _fingerprint(cfg, "host-bench", econf.dtype), "host-bench")
    llm = LLM.from_loaded(loaded, econf)
    rng = random.Random(0)
    ids = lambda n: [rng.randrange(3, cfg.vocab_size - 2) for _ in range(n)]  # noqa: E731
    segs = [ids(args.seg_len) for _ in range(args.segments)]
    query = ids(args.query)
    one = SamplingParams(max_tokens=1, temperature=0.0)
    llm.set_policy("pic", args.seam)
    t0 = time.perf_counter()
    llm.generate([Prompt(segments=segs, query=query)], one)
    print(f"{cfg.num_layers} layers; cold request (isolated prefill of {args.segments} x {args.seg_len}) "
          f"{time.perf_counter() - t0:.1f} s", flush=True)

    trace.TIMES = times = {}
    walls = []
    for r in range(args.reps + 1):
        order = list(range(args.segments))
        random.Random(r + 1).shuffle(order)
        p = Prompt(segments=[segs[i] for i in order], query=query)
        t0 = time.perf_counter()
        out = llm.generate([p], one)[0]
        walls.append(time.perf_counter() - t0)
        if r == 0:                        # the first warm request: its shape is new (buffers made)
            times.clear()
    trace.TIMES = None
    assert out.composed_tokens > 0 and out.cold_prefill_tokens == 0, "the warm request was not composed"

    rows = {}
    for name, ts in times.items():
        ts = ts[-args.reps:]
        rows[name] = dict(median_ms=statistics.median(ts) * 1e3, min_ms=min(ts) * 1e3, calls=len(ts))
    host = sum(rows[n]["median_ms"] for n in HOST_SPANS if n in rows)
    print(f"\nwarm pic request, {args.reps} reps (median wall {statistics.median(walls[1:]) * 1e3:.1f} ms, "
          f"the tiny model's eager CPU forward included)")
    print(f"{'span':<22}{'median ms':>11}{'min ms':>9}{'calls':>7}  host-only")
    for name, r in sorted(rows.items(), key=lambda kv: -kv[1]["median_ms"]):
        print(f"{name:<22}{r['median_ms']:>11.3f}{r['min_ms']:>9.3f}{r['calls']:>7}  "
              f"{'yes' if name in HOST_SPANS else '   '}  {NOTES.get(name, '')}")
    print(f"{'host-only spans':<22}{host:>11.3f}")
    res = dict(date=time.strftime("%Y-%m-%d %H:%M"), torch=torch.__version__, preset=args.preset,
               layers=cfg.num_layers, segments=args.segments, seg_len=args.seg_len, query=args.query,
               seam=args.seam, reps=args.reps, spans=rows, host_only_ms=host,
               wall_median_ms=statistics.median(walls[1:]) * 1e3)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "host_bench.json").write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
