"""CPU time of one isolated prefill batch against the same segments prefilled in smaller batches (the engine's cold
path, prefill/isolated.py), side by side in one run: a varlen op that pads every sequence to the longest makes one
batch of uneven segments slower than the segments one by one.

    python benchmarks/isolated_batch.py [--model small-qwen3.5] [--threads 1] \
        [--out benchmarks/results/isolated_batch.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from hypic.cache.entry import SegmentKey
from hypic.config import EngineConfig
from hypic.models.loader import load_model
from hypic.plan.planner import SegmentSlot
from hypic.prefill.isolated import prefill_segments


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="small-qwen3.5")
    ap.add_argument("--lengths", default="2048,1536,1024,1024,768,512,512,256")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--out", default="benchmarks/results/isolated_batch.json")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    loaded = load_model(a.model, EngineConfig())
    g = torch.Generator().manual_seed(0)
    lens = [int(x) for x in a.lengths.split(",")]
    slots = [SegmentSlot(tuple(torch.randint(1, 256, (n,), generator=g).tolist()), 8, SegmentKey("m", "n", str(i), 8))
             for i, n in enumerate(lens)]
    dev = torch.device("cpu")
    prefill_segments(loaded.model, slots[:2], dev)                    # warm-up
    ways = {"one batch": [slots], "two batches": [slots[0::2], slots[1::2]], "one by one": [[s] for s in slots]}
    res = {}
    for name, groups in ways.items():
        times = []
        for _ in range(a.runs):
            t0 = time.perf_counter()
            for grp in groups:
                prefill_segments(loaded.model, grp, dev)
            times.append(time.perf_counter() - t0)
        res[name] = statistics.median(times)
    print(f"{a.model}, {len(lens)} segments ({sum(lens)} tokens), {a.threads} thread(s), median of {a.runs}")
    for name, t in res.items():
        print(f"{name:<12}{t:>8.2f} s")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"date": time.strftime("%Y-%m-%d"), "args": vars(a), "seconds": res}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
