"""The GPU benchmark script's CPU dry run (`benchmarks/gpu_bench.py --device cpu`): every row of the one device
call that issue 3 asks for (transformers, full prefill, warm `pic`, `prefix`, `full`, the floor, decode, the (T, S)
rows) runs end to end on a tiny preset and lands in the JSON. Device time is scarce; a script that breaks after the
first rows costs a whole call (H100 run 138 ended at its prefix rows without a JSON). No timing is checked here."""

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# fla and causal_conv1d blocked in the child as in conftest (transformers would swap them in on a CPU)
_RUN = ("import runpy, sys; sys.modules['fla'] = None; sys.modules['causal_conv1d'] = None; "
        "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")


def test_gpu_bench_dry_run_has_every_row(tmp_path):
    args = ["benchmarks/gpu_bench.py", "--device", "cpu", "--preset", "tiny-qwen3.5-moe", "--sizes", "256,512",
            "--segments", "3", "--seg-len", "64", "--query", "8", "--reps", "1", "--decode-steps", "2",
            "--only", "default", "--out", str(tmp_path)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-c", _RUN, *args], cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    res = json.loads((tmp_path / "gpu_bench.json").read_text())
    full = res["full_prefill"]
    assert set(full) == {"256", "512"}
    for e in full.values():                               # ours against transformers on the same weights
        assert e["hypic_s"] > 0 and e["transformers_s"] > 0 and e["speedup"] > 0
    rag = res["rag"]
    for key in ("pic_warm_s", "prefix_s", "full_s", "pic_vs_full", "pic_vs_prefix"):
        assert math.isfinite(rag[key]) and rag[key] > 0, key
    assert "prefix_error" not in rag
    assert rag["pic_counts"]["cold"] == 0 and rag["pic_counts"]["recomputed"] == 3 * 8 + 8   # seams + query
    assert rag["roofline"]["floor_s"] > 0 and rag["roofline"]["entry_bytes"] > 0     # (read before the prefix rows)
    assert set(res["ts_overhead"]) == {"64", "128", "3x64"}
    for e in res["ts_overhead"].values():
        assert e["plain_s"] > 0 and e["summarized_s"] > 0
    assert "error" not in res["decode"] and all("error" not in res["decode"][b] for b in ("1", "8"))
    assert "| RAG warm TTFT pic (seam 8) |" in p.stdout and "| full prefill 512 tokens |" in p.stdout
