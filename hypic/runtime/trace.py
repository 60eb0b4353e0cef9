"""Named host spans of a request's stages, for profiler timelines and host-time benchmarks (off unless a
benchmark turns them on).

    with span("compose.lower"): ...
With ENABLED false and TIMES None a span is a no-op context (nothing on the request path). ENABLED: a
torch.profiler record_function per span. TIMES (a dict): each span's wall seconds appended under its name
(benchmarks/host_bench.py), without a profiler's own overhead in them."""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

ENABLED = False
TIMES: dict[str, list[float]] | None = None
_NULL = nullcontext()


@contextmanager
def _timed(name: str, times: dict):
    t0 = time.perf_counter()
    try:
        yield
    finally:
        times.setdefault(name, []).append(time.perf_counter() - t0)


def span(name: str):
    if TIMES is not None:
        return _timed(name, TIMES)
    if not ENABLED:
        return _NULL
    from torch.profiler import record_function

    return record_function(name)
