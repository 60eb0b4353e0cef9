"""How far two equivalent bf16 computations of a deep random-weight MoE hybrid drift apart (CPU, transformers' own
Qwen3_5MoeForCausalLM): the yardstick for any "two kernel paths give the same logits" check on dummy weights.

The model has the 35B benchmark's depth and layer pattern (40 layers, 3 Gated DeltaNet : 1 attention, 256 experts,
top 8) at width 512, weights from transformers' normal(0, 0.02) initialisation. It runs once in fp32, once in bf16,
and once in bf16 with one element of every token's embedding moved by one bf16 ulp. Printed: the logits' relative
differences, the argmax agreement, and by layer the share of tokens whose top-k expert set differs between the two
bf16 runs. Writes JSON.

    python benchmarks/routing_chaos.py [--experts 256 --top-k 8 --layers 40] [--out benchmarks/results/routing_chaos.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.modules["fla"] = None             # transformers must not swap in GPU kernels on the CPU
sys.modules["causal_conv1d"] = None

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def main() -> None:
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeForCausalLM

    ap = argparse.ArgumentParser()
    ap.add_argument("--experts", type=int, default=256)
    ap.add_argument("--top-k", type=int, default=8)
    ap.add_argument("--layers", type=int, default=40)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "routing_chaos.json"))
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = Qwen3_5MoeTextConfig(
        vocab_size=1000, hidden_size=512, num_hidden_layers=args.layers, full_attention_interval=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=64, linear_num_key_heads=4, linear_num_value_heads=8,
        linear_key_head_dim=32, linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=args.experts,
        num_experts_per_tok=args.top_k, moe_intermediate_size=64, shared_expert_intermediate_size=64,
        initializer_range=0.02, rms_norm_eps=1e-6)
    cfg._attn_implementation = "sdpa"
    model = Qwen3_5MoeForCausalLM(cfg).eval()
    ids = torch.randint(0, cfg.vocab_size, (1, args.tokens))
    choices: dict = {}

    def hook(i):
        def f(mod, inp, out):
            logits = out[0] if isinstance(out, tuple) else out
            choices.setdefault(i, []).append(torch.topk(logits.float(), args.top_k, -1).indices.sort(-1).values)
        return f

    for i, layer in enumerate(model.model.layers):
        layer.mlp.gate.register_forward_hook(hook(i))
    with torch.no_grad():
        f32 = model(ids).logits[0].float()
        model = model.to(torch.bfloat16)
        emb = model.model.embed_tokens(ids)
        a = model(inputs_embeds=emb).logits[0].float()
        nudged = emb.clone()
        pos = torch.arange(nudged.shape[1])
        col = torch.randint(0, nudged.shape[-1], (nudged.shape[1],))
        x = nudged[0, pos, col]
        nudged[0, pos, col] = torch.nextafter(x, torch.full_like(x, 1e4))          # one bf16 ulp up
        b = model(inputs_embeds=nudged).logits[0].float()

    def rel(x, y):
        return float((x - y).norm() / y.norm())

    flips = [float((choices[i][1] != choices[i][2]).any(-1).float().mean()) for i in range(args.layers)]
    res = {"experts": args.experts, "top_k": args.top_k, "layers": args.layers, "width": cfg.hidden_size,
           "bf16_vs_fp32_logits_rel": rel(a, f32), "nudged_vs_bf16_logits_rel": rel(b, a),
           "nudged_vs_bf16_argmax_agreement": float((a.argmax(-1) == b.argmax(-1)).float().mean()),
           "topk_set_differs_share_by_layer": flips}
    print(f"{args.layers} layers, {args.experts} experts top {args.top_k}, width {cfg.hidden_size}: logits bf16 vs fp32 "
          f"{res['bf16_vs_fp32_logits_rel']:.3f}; bf16 vs bf16 with a one-ulp nudge {res['nudged_vs_bf16_logits_rel']:.3f} "
          f"(argmax agreement {res['nudged_vs_bf16_argmax_agreement']:.2f})")
    print("share of tokens whose top-k set differs (nudged vs not), every 4th layer:", [round(f, 2) for f in flips[::4]])
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
