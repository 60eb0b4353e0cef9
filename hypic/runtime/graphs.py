"""Capturing one forward over fixed buffers as a CUDA graph (decode steps, one request's compose pass)."""

from __future__ import annotations

import torch


def capture_forward(model, batch, device):
    """Warm up on a side stream (Triton autotuning and compilation, lazy tables, workspaces), then capture
    one forward of `batch` as a CUDA graph. Returns (graph, its output, pinned): pinned holds the layout
    tensors the captured kernels read by address (the caller keeps them alive with the graph).
    Raises whatever the capture raises (an op that cannot be captured)."""
    from ..ops.fast import pin_layouts

    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(2):
            batch.scratch.clear()
            model(batch)
    torch.cuda.current_stream(device).wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    batch.scratch.clear()
    with torch.cuda.graph(graph):
        out = model(batch)
    return graph, out, pin_layouts()
