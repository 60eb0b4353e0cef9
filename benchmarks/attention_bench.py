"""The compose pass's position-masked attention alone (ops/triton_attention.py), at the 35B warm request's shape, in
several launch configurations (CUDA).

One full-attention layer of the warm `pic` request: 20 segments of 1,600 tokens, each with its first 8 tokens
recomputed (seam) and 1,592 cached, then a 64-token query: 224 active queries plus 32 pads at position 0 (the
compose pass's 256 rows), 16 query heads over 2 KV heads, head dim 256; keys in position order (`sorted_keys`), the
cached keys' bucket (32,768) padded with keys no query sees, then the active tokens' keys. Each configuration
(query rows per block, keys per block, warps, pipeline stages, key splits) is checked against the fp32 reference
(bf16 inputs: 2e-2 relative, the bound of tests/test_gpu.py) and timed by CUDA events over --reps launches after a
warm-up (median per launch). Prints a table and writes JSON. H200 run 49's profile: 403 us per layer.

    python benchmarks/attention_bench.py [--reps 30] [--out benchmarks/results]      # on the device
    TRITON_INTERPRET=1 python benchmarks/attention_bench.py --device cpu --keys 1024 --reps 1 --out /tmp/ab   # dry run
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

H, HKV, D, SEAM, QLEN, NP = 16, 2, 256, 8, 64, 256
_NEVER = 1 << 62


def layout(segments: int, seg_len: int, bucket: int, dev):
    """Queries and keys as the compose pass lays them out (keys gathered into position order)."""
    qpos, kpos = [], []
    p = 0
    for _ in range(segments):
        qpos += list(range(p, p + SEAM))                 # the seam, recomputed
        kpos += list(range(p, p + seg_len))              # its keys and the cached ones, in position order
        p += seg_len
    qpos += list(range(p, p + QLEN))
    kpos += list(range(p, p + QLEN))
    n = len(qpos)
    qpos += [0] * (NP - n)                               # pads: at position 0, where a key always is
    nk = bucket + NP
    kpos += [_NEVER] * (nk - len(kpos))                  # unused bucket slots and the pads' keys: never seen
    return torch.tensor(qpos, device=dev), torch.tensor(kpos, device=dev)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--segments", type=int, default=20)
    ap.add_argument("--seg-len", type=int, default=1600)
    ap.add_argument("--keys", type=int, default=32768, help="the cached keys' bucket")
    args = ap.parse_args()
    from launches import first_launch, launch_times

    from hypic.ops import triton_attention as ta
    from hypic.ops.reference import position_attention as ref

    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    seg_len = args.seg_len if args.keys >= args.segments * args.seg_len else args.keys // args.segments
    qpos, kpos = layout(args.segments, seg_len, args.keys, dev)
    g = torch.Generator(device=dev).manual_seed(6)
    dt = torch.bfloat16 if cuda else torch.float32
    q = torch.randn(NP, H, D, device=dev, generator=g).to(dt)
    k = torch.randn(kpos.shape[0], HKV, D, device=dev, generator=g).to(dt)
    v = torch.randn(kpos.shape[0], HKV, D, device=dev, generator=g).to(dt)
    scale = D ** -0.5
    want = torch.cat([ref(q[i:i + 64].float(), k.float(), v.float(), qpos[i:i + 64], kpos, scale=scale)
                      for i in range(0, NP, 64)])                       # in pieces: [16, 64, 33k] fp32 scores each
    rel = lambda a, b: float((a.float() - b).norm() / b.norm())  # noqa: E731
    # (rows per block, keys per block, warps, stages, splits; None: the kernel's rule, ~2 programs per SM), then the
    # kernel's forms (ops/triton_attention.py FULL_FAST, FUSED_FOLD, BALANCE, VSPLIT) at the default launch: "old" is
    # the kernel before the twenty-ninth session (every block masked, the splits folded by PyTorch ops)
    old = dict(full_fast=False, fused_fold=False, balance=False, vsplit=1)
    new = dict(full_fast=True, fused_fold=True, balance=True, vsplit=1)
    cfgs = [(128, 64, 8, 2, None, "old", old), (128, 64, 8, 2, None, "default", new),
            (128, 64, 8, 2, None, "masked blocks", dict(new, full_fast=False)),
            (128, 64, 8, 2, None, "fold by torch", dict(new, fused_fold=False)),
            (128, 64, 8, 2, None, "unbalanced", dict(new, balance=False)),
            (128, 64, 8, 2, None, "vsplit 2", dict(new, vsplit=2)),
            (128, 64, 8, 2, 16, "default", new), (128, 64, 8, 2, 32, "default", new),
            (128, 64, 8, 2, 8, "default", new), (64, 64, 4, 2, None, "default", new),
            (128, 32, 8, 3, None, "default", new), (128, 32, 8, 2, None, "default", new)]
    # whole key blocks' tiles by tensor descriptors (TMA_KV; 42nd session; 3 stages do not fit in shared memory)
    cfgs += [(128, 64, 8, 2, None, "tma", dict(new, tma=True))]
    if not cuda:
        cfgs = [(16, 16, 4, 1, None, "old", old), (16, 16, 4, 1, None, "default", new),
                (16, 16, 4, 1, 3, "balanced, vsplit 2", dict(new, balance=True, vsplit=2)),
                (16, 16, 4, 1, None, "tma", dict(new, tma=True))]
    rows = []
    for bm, bn, w, st, sp, form, kw in cfgs:
        row = dict(block_m=bm, block_n=bn, warps=w, stages=st, splits=sp, form=form)

        def launch(bm=bm, bn=bn, w=w, st=st, sp=sp, kw=kw):
            return ta.position_attention(q, k, v, qpos, kpos, scale=scale, sorted_keys=True, block_m=bm, block_n=bn,
                                         splits=sp, warps=w, stages=st, **kw)
        got = first_launch(launch, cuda, row, rows)
        if got is None:
            if row["fault"]:
                break
            continue
        row["rel"] = rel(got, want)
        row["ok"] = row["rel"] < 2e-2
        row.update(launch_times(launch, args.reps, cuda))
        rows.append(row)
        print(f"{(bm, bn, w, st, sp)} {form}: {row['us']:8.1f} us (min {row['us_min']:.1f}); rel {row['rel']:.1e}"
              f"{'' if row['ok'] else '  WRONG'}", flush=True)
    print("\n| rows per block | keys per block | warps | stages | splits | form | us per call (median) | check |")
    print("|---:|---:|---:|---:|---|---|---:|---|")
    for r in rows:
        cell = f"{r['us']:.1f} | {'ok' if r['ok'] else 'WRONG'}" if "us" in r else f"not built | {r['error'][:50]}"
        print(f"| {r['block_m']} | {r['block_n']} | {r['warps']} | {r['stages']} | {r['splits'] or 'rule'} | {r['form']} | {cell} |")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    name = torch.cuda.get_device_name() if cuda else "cpu (Triton interpreter)"
    (out / "attention_bench.json").write_text(json.dumps(dict(date=time.strftime("%Y-%m-%d"), device=name,
                                                               torch=torch.__version__, rows=rows), indent=1))


if __name__ == "__main__":
    main()
