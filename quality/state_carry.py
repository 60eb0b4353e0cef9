"""How much linear state a trained model carries across documents (issue 6: why `naive` can equal `pic`).

`pic` composes each cached document's linear state exactly, S_out = T @ S_in + S; `naive` adds it,
S_out = S_in + S. The two differ only by (T - I) @ S_in summed along the prompt: where every T is near 0
(the gates forget the earlier documents within one document's length) both reduce to the last
document's S and `naive` loses nothing; where T keeps S_in, `naive` double-counts old state. This
prefills each document of real evaluation prompts in isolation (the engine's own isolated prefill, seam
0: the whole document's T and S), chains them both ways from a zero state and reports per linear layer:

    |T|_2      the spectral norm of a document's transition, the largest over heads (median over documents)
    carried    |S_exact - S_last| / |S_exact| at the prompt's end: the share of the final state that
               comes from documents before the last
    naive err  |S_naive - S_exact| / |S_exact| at the prompt's end
    decay      the median per-token decay exp(g) (over tokens, and heads or key channels), and beta, the
               median write strength: a layer whose decay is ~0 keeps nothing from one token to the next

    python quality/state_carry.py --model checkpoints/qwen35-gdn-15m-pic --set twohop8 --n 50

Norms are Frobenius over every head's [K, V] state. CPU, fp32.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def chains(entries, layer: int):
    """Exact and naive composition of the documents' (T, S) at one layer, from a zero state."""
    from hypic.compose.transition import Transition, compose

    exact = naive = None
    for e in entries:
        part = e.layers[layer]
        S = part.S.double()
        if exact is None:
            exact, naive = S.clone(), S.clone()
            continue
        exact = compose(exact, Transition(part.T.form, part.T.t.double()), S)
        naive = compose(naive, part.T, S, exact=False)
    return exact, naive


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--set", default="twohop8")
    ap.add_argument("--n", type=int, default=50)
    ap.add_argument("--data", default=str(ROOT / ".data" / "corpus"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from hypic import LLM
    from hypic.cache.entry import SegmentKey
    from hypic.layers.linear import LinearMixer
    from hypic.plan.planner import SegmentSlot
    from hypic.prefill.isolated import prefill_segments

    llm = LLM(args.model, device="cpu", dtype="float32")
    model = llm.engine.model
    linear = [l for l, m in model.mixers.items() if isinstance(m, LinearMixer)]
    rows = [json.loads(x) for x in open(Path(args.data) / f"eval_{args.set}.jsonl")][: args.n]
    gates = {l: ([], []) for l in linear}
    for l in linear:                                   # the layer's per-token decay and write strength, as run
        mix = model.mixers[l]
        features = mix.features

        def spy(x, batch, features=features, l=l):
            f = features(x, batch)
            gates[l][0].append(f["g"].detach().float().exp().flatten())
            gates[l][1].append(f["beta"].detach().float().flatten())
            return f

        mix.features = spy
    tnorm = {l: [] for l in linear}
    carried = {l: [] for l in linear}
    naive_err = {l: [] for l in linear}
    for qi, row in enumerate(rows):
        docs = [tuple(llm.tokenizer.encode(d)) for d in row["segments"]]
        slots = [SegmentSlot(d, 0, SegmentKey("carry", "carry", f"{qi}.{i}", 0)) for i, d in enumerate(docs)]
        with torch.inference_mode():
            entries = prefill_segments(model, slots, torch.device("cpu"))
            for l in linear:
                for e in entries[:-1]:          # the transitions that act on a carried state
                    t = e.layers[l].T
                    mat = t.t if t.t.dim() == 3 else torch.diag_embed(t.t if t.t.dim() == 2 else t.t[:, None])
                    tnorm[l].append(float(torch.linalg.matrix_norm(mat.double(), ord=2).max()))
                exact, naive = chains(entries, l)
                last = entries[-1].layers[l].S.double()
                carried[l].append(float((exact - last).norm() / exact.norm()))
                naive_err[l].append(float((naive - exact).norm() / exact.norm()))
    med = statistics.median
    table = [dict(layer=l, t_norm=med(tnorm[l]), carried=med(carried[l]), naive_err=med(naive_err[l]),
                  naive_err_p90=sorted(naive_err[l])[int(0.9 * (len(naive_err[l]) - 1))],
                  decay=float(torch.cat(gates[l][0]).median()), beta=float(torch.cat(gates[l][1]).median()))
             for l in linear]
    print(f"{args.model} on {args.set}, {len(rows)} prompts of {len(rows[0]['segments'])} documents (medians)")
    print(f"{'layer':>5} {'|T|_2':>9} {'carried':>9} {'naive err':>10} {'p90':>9} {'decay':>7} {'beta':>6}")
    for r in table:
        print(f"{r['layer']:>5} {r['t_norm']:>9.2e} {r['carried']:>9.3f} {r['naive_err']:>10.3f} "
              f"{r['naive_err_p90']:>9.3f} {r['decay']:>7.3f} {r['beta']:>6.3f}")
    if args.out:
        Path(args.out).write_text(json.dumps(dict(model=args.model, set=args.set, n=len(rows), layers=table), indent=1))


if __name__ == "__main__":
    main()
