"""What the single-kernel benchmarks (scan_bench.py, attention_bench.py) share: a first launch that builds the
configuration (or says why it cannot be built), and the time of each later launch."""

from __future__ import annotations

import statistics
import time

import torch


def first_launch(launch, cuda: bool, row: dict, rows: list):
    """The launch's result, or None where the configuration cannot be built (resources) or faulted: then row, with
    its "error", is printed and added to rows. After a fault (row["fault"]) the process's CUDA context is lost and
    no later launch can run."""
    try:
        out = launch()
        if cuda:
            torch.cuda.synchronize()
        return out
    except Exception as e:
        row["error"] = f"{type(e).__name__}: {str(e)[:160]}"
        row["fault"] = "illegal" in str(e) or "unspecified launch failure" in str(e)
        rows.append(row)
        print(row, flush=True)
        return None


def launch_times(launch, reps: int, cuda: bool) -> dict:
    """Median and minimum microseconds per launch over reps launches: CUDA events on the GPU, the wall clock
    elsewhere (Triton's interpreter: a dry run)."""
    times = []
    for _ in range(reps):
        if not cuda:
            t = time.perf_counter()
            launch()
            times.append((time.perf_counter() - t) * 1e6)
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        launch()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1e3)
    return dict(us=statistics.median(times), us_min=min(times))
