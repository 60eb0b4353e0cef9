"""Picking a Triton kernel's launch configuration per shape by timing a few (this backend's kernels).

Imports no triton: the kernels' modules pass their own launch functions."""

from __future__ import annotations

import torch


def is_device_fault(e: BaseException) -> bool:
    """A fault of a kernel that ran (an illegal address, a trap), not a configuration that failed to build: the
    process's CUDA context is lost, so no other configuration and no fallback can run after it (H200 runs 44-46:
    the transition kernel's unpipelined build; the tuner used to skip it and fail later, far from the cause)."""
    text = str(e)
    return "illegal memory access" in text or "illegal instruction" in text or "device-side assert" in text \
        or "unspecified launch failure" in text


def descriptors_fit(*tensors: torch.Tensor) -> bool:
    """The tensors can be read by TMA tensor descriptors of their rows (the last dim): on a GPU of compute capability 9
    or more (or Triton's interpreter, the tensors on the CPU), with 16-byte aligned bases and rows."""
    t0 = tensors[0]
    if t0.is_cuda and torch.cuda.get_device_capability(t0.device)[0] < 9:
        return False
    return all((t.shape[-1] * t.element_size()) % 16 == 0 and t.data_ptr() % 16 == 0 for t in tensors)


def tuned_config(table: dict, key, configs, device, launch, out: torch.Tensor, fallback, rel_tol: float):
    """The fastest of `configs` for this shape key, timed once (3 launches each after a first that compiles)
    and remembered in table[key] = (config, {config: ms}). A configuration whose output differs from the first
    one's by more than rel_tol (relative norm: a broken build, not rounding) is never chosen; one that cannot be
    built is skipped; one that faults on the device raises (is_device_fault). Off CUDA, or while a CUDA graph is
    being captured (no timing there), the fallback."""
    hit = table.get(key)
    if hit is not None:
        return hit[0]
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return fallback
    times, first = {}, None
    for cfg in configs:
        try:
            launch(cfg)
            if first is None:
                first = out.float().clone()
            elif float((out.float() - first).norm()) > rel_tol * float(first.norm()):
                continue
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(3):
                launch(cfg)
            b.record()
            b.synchronize()
            times[cfg] = a.elapsed_time(b) / 3
        except Exception as e:  # a configuration this GPU / Triton cannot build: skipped
            if is_device_fault(e):
                raise
            continue
    if not times:
        return fallback
    best = min(times, key=times.get)
    table[key] = (best, times)
    return best
