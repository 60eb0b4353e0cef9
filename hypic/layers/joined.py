"""Linear weights that read the same input, joined into one matrix, so one GEMM reads x once for all of them: on the
few rows of a compose pass or a decode step each projection is a launch rather than work."""

from __future__ import annotations

import torch


class JoinedWeights:
    """[w_1; w_2; ...] made once per version of the parts (a copy: the parts stay the modules' parameters, which
    loading and training update); under autograd, concatenated at each call so gradients reach the parts."""

    def __init__(self):
        self._hit = (None, None)

    def __call__(self, *ws: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return torch.cat(ws)
        key = tuple((w.data_ptr(), w._version, w.device, w.dtype) for w in ws)
        if self._hit[0] != key:
            self._hit = (key, torch.cat([w.detach() for w in ws]))
        return self._hit[1]


__all__ = ["JoinedWeights"]
