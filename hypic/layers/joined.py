"""Linear weights that read the same input, joined into one matrix, so one GEMM reads x once for all of them: on the
few rows of a compose pass or a decode step each projection is a launch rather than work."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the joined matrix's rows are padded with zeros to a multiple of this: an output row whose width is not a multiple
# of 16 bytes (the shared expert's 2I + 1 = 1025 columns) keeps cuBLAS off its Hopper kernels (H200 run 47: a
# cutlass sm75 kernel at 1.65 ms per layer for the 32k-token full prefill, against 2 x 0.24 ms for gate and up apart)
ROWS_MULTIPLE = 16


class JoinedWeights:
    """[w_1; w_2; ...; 0] made once per version of the parts (a copy: the parts stay the modules' parameters, which
    loading and training update), zero rows padding it to a multiple of ROWS_MULTIPLE; under autograd, concatenated
    at each call so gradients reach the parts."""

    def __init__(self):
        self._hit = (None, None)

    def weight(self, *ws: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return _padded_cat(list(ws))
        key = tuple((w.data_ptr(), w._version, w.device, w.dtype) for w in ws)
        if self._hit[0] != key:
            self._hit = (key, _padded_cat([w.detach() for w in ws]))
        return self._hit[1]

    def linear(self, x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x w_1^T, x w_2^T, ...) by one GEMM: views of its output, the padding left out."""
        y = F.linear(x, self.weight(*ws))
        sizes = [w.shape[0] for w in ws]
        return y.split(sizes + [y.shape[-1] - sum(sizes)], dim=-1)[:len(ws)]


def _padded_cat(parts: list) -> torch.Tensor:
    """[p_1; p_2; ...] with zero rows up to a multiple of ROWS_MULTIPLE."""
    pad = -sum(p.shape[0] for p in parts) % ROWS_MULTIPLE
    return torch.cat(parts + [parts[0].new_zeros(pad, parts[0].shape[1])] if pad else parts)


__all__ = ["JoinedWeights", "ROWS_MULTIPLE"]
