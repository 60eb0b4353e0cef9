"""One position_attention call through the Triton kernel at the given head dims (a fault ends the process):
    python benchmarks/attn_probe.py D DV [H HKV N] [--same-width]
--same-width: one block width for keys and values (the kernel's default for D != DV since H100 run 95; at their own
widths the H200 faulted in run 92). Without it, their own widths (same_width=False)."""
import sys

import torch

from hypic.ops.triton_attention import position_attention

same = "--same-width" in sys.argv
args = [a for a in sys.argv[1:] if a != "--same-width"]
d, dv = int(args[0]), int(args[1])
h, hkv, n = (int(x) for x in (args[2:5] if len(args) > 4 else (4, 4, 50)))
g = torch.Generator(device="cuda").manual_seed(0)
q = torch.randn(n, h, d, device="cuda", generator=g).bfloat16()
k = torch.randn(n, hkv, d, device="cuda", generator=g).bfloat16()
v = torch.randn(n, hkv, dv, device="cuda", generator=g).bfloat16()
pos = torch.arange(n, device="cuda")
try:
    o = position_attention(q, k, v, pos, pos, scale=d ** -0.5, same_width=same)
    torch.cuda.synchronize()
    r = torch.softmax((q.float().transpose(0, 1) @ k.float().permute(1, 2, 0)) * d ** -0.5
                      + torch.full((n, n), float("-inf"), device="cuda").triu(1), -1) @ v.float().transpose(0, 1)
    err = float((o.float().transpose(0, 1) - r).norm() / r.norm())
    print(d, dv, h, hkv, n, "same_width" if same else "", "ok, rel err vs fp32", f"{err:.1e}")
except Exception as e:
    print(d, dv, h, hkv, n, "FAULT", type(e).__name__, str(e)[:80])
