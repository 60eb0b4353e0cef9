"""Capturing one forward over fixed buffers as CUDA graphs (decode steps, one request's compose pass)."""

from __future__ import annotations

import torch


class Captured:
    """One forward captured as one or several CUDA graphs, replayed in order on the current stream. With
    several, the GPU starts on the first while the host is still launching the rest (a graph's launch
    costs the host time in proportion to its nodes: ~5 ms for the 35B compose pass's ~3,000)."""

    def __init__(self, graphs: list, bounds: list[int] | None = None):
        self.graphs = graphs
        self.bounds = bounds if bounds is not None else [0, 0]     # graph i runs layers bounds[i]..bounds[i+1]-1

    def replay(self, before=None) -> None:
        """before(lo, hi) (optional) runs on the host ahead of the graph over layers lo..hi-1 (the compose pass
        fills that piece's buffers there, so the GPU starts on the first piece before the last is filled)."""
        for i, g in enumerate(self.graphs):
            if before is not None:
                before(self.bounds[i], self.bounds[i + 1])
            g.replay()


def cuts(n_layers: int, pieces: int, first: int = 0) -> list[int]:
    """Layer boundaries of `pieces` consecutive parts (at least one layer each): of nearly equal size, or with
    first > 0 a first part of that many layers and the rest split evenly (a short first piece is filled and
    launched sooner, so the GPU starts sooner; the later pieces are filled while it runs)."""
    pieces = max(1, min(pieces, n_layers))
    if first <= 0 or pieces == 1 or first >= n_layers - (pieces - 2):
        return [round(i * n_layers / pieces) for i in range(pieces + 1)]
    rest = cuts(n_layers - first, pieces - 1)
    return [0] + [first + b for b in rest]


def capture_forward(model, batch, device, pieces: int = 1, first: int = 0):
    """Warm up on a side stream (Triton autotuning and compilation, lazy tables, workspaces), then capture
    one forward of `batch`: as one CUDA graph, or (pieces > 1) as that many graphs over consecutive
    layers (`cuts`; first: the first piece's layers), sharing one memory pool (replayed in capture order, as `Captured` does). Returns (Captured,
    its output, pinned): pinned holds the layout tensors the captured kernels read by address (the
    caller keeps them alive with the graphs). Raises whatever the capture raises (an op that cannot be
    captured)."""
    from ..ops.fast import pin_layouts

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            batch.scratch.clear()
            model(batch)
    torch.cuda.current_stream(device).wait_stream(side)
    batch.scratch.clear()
    layers = model.model.layers
    bounds = cuts(len(layers), pieces, first)
    graphs, pool, h, out = [], None, None, None
    with torch.inference_mode():
        for i in range(len(bounds) - 1):
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                if i == 0:
                    h = model.embed(batch)
                h = model.run_layers(h, batch, bounds[i], bounds[i + 1])
                if i == len(bounds) - 2:
                    out = model.head(h, batch)
            pool = graph.pool() if pool is None else pool
            graphs.append(graph)
    return Captured(graphs, bounds), out, pin_layouts()


def host_read_site(model, batch) -> str | None:
    """Why a capture of `batch`'s forward failed, where the cause is a host read of device memory (a sync, which a
    capture refuses; the capture's own error names no op): one eager forward under CUDA's sync debug mode set to
    raise, and the innermost hypic frame of what raised. None where the forward reads nothing back."""
    import traceback

    prev = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        batch.scratch.clear()
        with torch.inference_mode():
            model(batch)
    except Exception as e:
        frames = [f for f in traceback.extract_tb(e.__traceback__) if "hypic" in f.filename]
        where = f" at {frames[-1].filename}:{frames[-1].lineno} ({frames[-1].line})" if frames else ""
        return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}{where}"
    finally:
        torch.cuda.set_sync_debug_mode(prev)
        batch.scratch.clear()
    return None
