"""Plot exact match and gold-answer NLL against the seam width, with full recomputation and naive
addition as reference lines, from eval_pic.py result files (needs matplotlib).

    python quality/plot_seam.py quality/results/qwen35-gdn-15m_kc8*.jsonl --out docs/seam_kc8.png

Runs made with `eval_pic.py --forced` get three panels instead: paired NLL difference to full, KL
of full's next-token distribution to PIC's, and argmax agreement with full.
"""

from __future__ import annotations

import argparse
import collections
import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out", default="docs/seam.png")
    ap.add_argument("--min-n", type=int, default=100)
    a = ap.parse_args()
    cells = collections.defaultdict(dict)                      # (mode, seam) -> i -> rec
    title = ""
    for f in a.files:
        for line in open(f):
            r = json.loads(line)
            cells[(r["mode"], r["seam"])][r["i"]] = r
            title = f"{r['model'].rsplit('/', 1)[-1]}, {r['set']}"
    mean = lambda recs, key: sum(x[key] for x in recs.values()) / len(recs)  # noqa: E731
    pic = sorted((s, c) for (m, s), c in cells.items() if m == "pic" and len(c) >= a.min_n)
    full = next((c for (m, _), c in cells.items() if m == "full"), None)
    naive = [c for (m, _), c in cells.items() if m == "naive" and len(c) >= a.min_n]
    if full and any(r.get("forced") for r in full.values()):
        return plot_forced(pic, full, title, a.out)
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for ax, key, label, scale in ((axes[0], "em", "exact match (%)", 100), (axes[1], "nll", "gold-answer NLL (nats)", 1)):
        xs = [s for s, _ in pic]
        ax.plot(xs, [scale * mean(c, key) for _, c in pic], "o-", label="pic")
        if full:
            ax.axhline(scale * mean(full, key), color="k", ls="--", label="full recompute")
        for c in naive:
            ax.axhline(scale * mean(c, key), color="r", ls=":", label="naive (seam 8)")
        ax.set_xlabel("seam width w (tokens)")
        ax.set_ylabel(label)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(alpha=0.3)
    axes[0].legend()
    fig.suptitle(f"{title}: PIC against the seam width (n = {len(full) if full else 0} questions)")
    fig.tight_layout()
    fig.savefig(a.out, dpi=110)
    print(f"wrote {a.out}")


def plot_forced(pic, full, title, out) -> None:
    """--forced runs (a model too weak for exact match to tell seams apart): the distance of PIC to
    full recomputation on the questions every cell has, against the seam width."""
    ids = sorted(set(full).intersection(*(set(c) for _, c in pic)))
    xs = [s for s, _ in pic]
    mean = lambda xs_: sum(xs_) / len(xs_)  # noqa: E731
    panels = (("gold-answer NLL - full (nats)", lambda c: mean([c[i]["nll"] - full[i]["nll"] for i in ids])),
              ("KL(full || pic) at answer tokens (nats)", lambda c: mean([c[i]["kl_full"] for i in ids])),
              ("argmax = full's (%)", lambda c: 100 * mean([c[i]["agree_full"] for i in ids])))
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    for ax, (label, f) in zip(axes, panels):
        ax.plot(xs, [f(c) for _, c in pic], "o-", label="pic")
        ax.set_xlabel("seam width w (tokens)")
        ax.set_ylabel(label)
        ax.set_xscale("symlog", linthresh=1)
        ax.set_xticks(xs)
        ax.set_xticklabels([str(x) for x in xs])
        ax.grid(alpha=0.3)
    axes[0].axhline(0.0, color="k", ls="--", label="full recompute")
    axes[0].legend()
    fig.suptitle(f"{title}: PIC against the seam width, distance to full recomputation (n = {len(ids)} questions)")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
