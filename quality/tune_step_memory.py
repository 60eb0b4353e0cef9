"""Peak memory and time of one PIC-tune full-mode pass on the CPU (forward + backward), for the reference ops.

    python quality/tune_step_memory.py --model checkpoints/kimi-kda-16m --data .data/corpus --batch 8

Draws 2 x batch examples as quality/pic_train.py does (seed 31, its KDA-run-12 mix, budget 1,536) and runs the
second half in `full` mode; prints the sequence lengths, the peak resident memory above the start and the seconds
(one JSON line). Used for the varlen chunk layout of ops/reference/kda.py (quality/NOTES.md "Nineteenth session")."""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

sys.modules.setdefault("fla", None)                 # CPU: keep transformers' fla / causal_conv1d swaps out
sys.modules.setdefault("causal_conv1d", None)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="checkpoints/kimi-kda-16m")
    ap.add_argument("--data", default=".data/corpus")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    import pic_train as pt
    from train import Pools, RowMaker, load_xz, word_starts

    from hypic import LLM

    torch.set_num_threads(args.threads)
    model = LLM(args.model, device="cpu", dtype="float32").engine.model
    model.train()
    data = Path(args.data)
    mix = dict(needle=0.3, twohop=0.25, kc=0.35, facts=0.1)
    maker = RowMaker(Pools(load_xz(data / "train.bin.xz")), 1536, 31, mix, 1.0, 0.8, word_starts(data / "tokenizer.json"))
    maker.needle_first = 0.4
    exs = pt.examples_from(maker, 2 * args.batch, 1536)[args.batch:]
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t = time.time()
    pt.example_loss(model, exs, "full", 8, "cpu").backward()
    print(json.dumps({"lengths": sorted(len(e.prefix) + sum(map(len, e.docs)) + len(e.query) for e in exs),
                      "peak_mb": round((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base) / 1024),
                      "seconds": round(time.time() - t, 1)}))


if __name__ == "__main__":
    main()
