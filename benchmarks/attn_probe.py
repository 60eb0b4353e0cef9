"""One position_attention call through the Triton kernel at the given head dims (a fault ends the process):
    python benchmarks/attn_probe.py D DV [H HKV N]"""
import sys

import torch

from hypic.ops.triton_attention import position_attention

d, dv = int(sys.argv[1]), int(sys.argv[2])
h, hkv, n = (int(x) for x in (sys.argv[3:6] if len(sys.argv) > 5 else (4, 4, 50)))
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(n, h, d, device="cuda", generator=g).bfloat16()
k = torch.randn(n, hkv, d, device="cuda", generator=g).bfloat16()
v = torch.randn(n, hkv, dv, device="cuda", generator=g).bfloat16()
pos = torch.arange(n, device="cuda")
try:
    o = position_attention(q, k, v, pos, pos, scale=d ** -0.5)
    torch.cuda.synchronize()
    print(d, dv, h, hkv, n, "ok", float(o.float().abs().sum()))
except Exception as e:
    print(d, dv, h, hkv, n, "FAULT", type(e).__name__, str(e)[:80])
