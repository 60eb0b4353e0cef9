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


def _gpu_bench(monkeypatch):
    """benchmarks/gpu_bench.py as a module, set for the CPU (its DEV global)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_bench_under_test", ROOT / "benchmarks" / "gpu_bench.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    monkeypatch.setattr(mod, "DEV", "cpu")
    return mod


def test_decode_rows_survive_a_batch_out_of_memory(monkeypatch):
    """A decode batch that runs out of GPU memory (batch 8 at 32k on an 80 GB card, H100 runs 133 and 140) gets an
    error entry; the batch before it keeps its rows, and every request of the failed batch is finished (no state
    left in the engine's decoder)."""
    import torch

    from hypic import LLM, Prompt

    gb = _gpu_bench(monkeypatch)
    llm = LLM("tiny-qwen3.5", cache_mode="pic", seam=4, compose="static", decode="static")
    prompts = [Prompt(segments=[[5 + i, 6, 7, 8, 9, 10], [11, 12, 13, 14, 15]], query=[16 + i, 17]) for i in range(2)]
    eng = llm.engine
    real_step = eng.step
    graph_steps = []

    def step(reqs):             # batch 2's second step on the fixed buffers fails, its rows admitted by the first
        if len(reqs) == 2 and eng.decoder is not None:
            graph_steps.append(1)
            if len(graph_steps) == 2:
                assert len(eng.decoder.row_of) == 2
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB (simulated)")
        return real_step(reqs)

    monkeypatch.setattr(eng, "step", step)
    out = gb.decode_bench(llm, prompts, steps=2, batches=(1, 2))
    assert out[1]["graph_s"] > 0 and out[1]["dynamic_s"] > 0 and "speedup" in out[1]
    assert out[2]["error"].startswith("out of memory") and "graph_s" not in out[2]
    assert len(graph_steps) == 2
    dec = eng.decoder
    assert dec is not None and not dec.row_of and not dec.reqs       # the failed batch's rows were released


def test_prefix_rows_retry_without_the_segment_cache_then_chunked(monkeypatch):
    """Prefix rows that run out of GPU memory run once more with the segment cache dropped (H100 run 140), then once
    more in forwards of at most PREFIX_FALLBACK_CHUNK tokens (H100 run 141) and a prefix cache bounded to
    PREFIX_FALLBACK_CACHE_BYTES (run 142), which the row then names; a third failure leaves an error entry and NaN
    rows instead of ending the script. Either way the prefix cache is empty afterwards (the full row gets its memory)
    and the engine's chunk and prefix budget are its own again."""
    import torch

    from hypic import LLM, Prompt, SamplingParams

    gb = _gpu_bench(monkeypatch)
    monkeypatch.setattr(gb, "PREFIX_FALLBACK_CHUNK", 8)   # the 23-token populating request then runs in parts
    monkeypatch.setattr(gb, "PREFIX_FALLBACK_CACHE_BYTES", 1 << 20)
    llm = LLM("tiny-qwen3.5", cache_mode="pic", seam=4)
    default_chunk = llm.config.prefill_chunk_tokens
    default_capacity = llm.cache_stats()["prefix"]["capacity_bytes"]
    assert default_capacity > 1 << 20
    segs = [[5 + i, 6 + i, 7, 8, 9, 10, 11] for i in range(3)]
    query = [20, 21]
    order_a = [0, 1, 2]
    seen_settings = []

    def ttft(prompt):
        seen_settings.append((llm.engine.config.prefill_chunk_tokens,   # what the engine runs the request with
                              llm.cache_stats()["prefix"]["capacity_bytes"]))
        o = llm.generate([prompt], SamplingParams(max_tokens=1))[0]
        return o.ttft_s, o

    class Args:
        reps, segments, profile = 2, 3, False

    real = gb.prefix_rows
    for fails in (1, 2, 3):
        llm.set_policy("pic", 4)
        ttft(Prompt(segments=segs, query=query))                    # the segment cache holds the three
        assert llm.cache_stats()["segments"]["entries"] == 3
        calls = []

        def rows(*a, fails=fails):
            calls.append(llm.cache_stats()["segments"]["entries"])
            if len(calls) <= fails:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 952.00 MiB (simulated)")
            del seen_settings[:]
            return real(*a)

        monkeypatch.setattr(gb, "prefix_rows", rows)
        rag = {}
        gb.prefix_rows_fitted(llm, segs, order_a, query, ttft, Args, rag)
        assert calls == ([3, 0] if fails == 1 else [3, 0, 0])       # the second try without the segment cache
        if fails == 1:
            assert math.isfinite(rag["prefix_s"]) and "prefix_error" not in rag
            assert [e[:13] for e in rag["prefix_errors_before"]] == ["out of memory"]
            assert "prefix_prefill_chunk_tokens" not in rag and set(seen_settings) == {(default_chunk, default_capacity)}
        elif fails == 2:
            assert math.isfinite(rag["prefix_s"]) and "prefix_error" not in rag
            assert len(rag["prefix_errors_before"]) == 2
            # the chunk held through prefix_rows' set_policy, and the bounded prefix cache, on every request of the rows
            assert rag["prefix_prefill_chunk_tokens"] == 8 and rag["prefix_cache_bytes"] == 1 << 20
            assert set(seen_settings) == {(8, 1 << 20)} and rag["prefix_counts"]["prefix"] > 0   # (the hit still comes)
        else:
            assert math.isnan(rag["prefix_s"]) and rag["prefix_error"].startswith("out of memory")
            assert "prefix_errors_before" not in rag and "prefix_prefill_chunk_tokens" not in rag
            assert "prefix_cache_bytes" not in rag
        assert llm.cache_stats()["prefix"]["bytes"] == 0
        assert llm.cache_stats()["prefix"]["capacity_bytes"] == default_capacity      # its own budget back
        assert llm.config.prefill_chunk_tokens == default_chunk == llm.engine.config.prefill_chunk_tokens
        assert llm.cache_mode == "prefix" or fails == 3
