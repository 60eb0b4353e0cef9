"""Named host spans of a request's stages, for profiler timelines (off unless a benchmark turns them on).

    with span("compose.lower"): ...
With ENABLED false a span is a no-op context (no profiler call on the request path)."""

from __future__ import annotations

from contextlib import nullcontext

ENABLED = False
_NULL = nullcontext()


def span(name: str):
    if not ENABLED:
        return _NULL
    from torch.profiler import record_function

    return record_function(name)
