"""Linear weights that read the same input, joined into one matrix, so one GEMM reads x once for all of them: on the
few rows of a compose pass or a decode step each projection is a launch rather than work.

Two ways to a joined matrix: a copy made once per version of the parts (`JoinedWeights.weight`), or the parts
*packed* at load time (`pack_model`): one matrix holds them as consecutive rows and the parameters become views of
it, so the join costs no memory and no copy, and writes into a parameter (loading, training) are writes into the
join. A join that would copy large weights (a linear layer's input projections: ~75 MB a layer at 35B) is made only
where the parts are packed (`JoinedWeights.packed`); elsewhere the parts run apart."""

from __future__ import annotations

import torch
import torch.nn.functional as F

# the joined matrix's rows are padded with zeros to a multiple of this: an output row whose width is not a multiple
# of 16 bytes (the shared expert's 2I + 1 = 1025 columns) keeps cuBLAS off its Hopper kernels (H200 run 47: a
# cutlass sm75 kernel at 1.65 ms per layer for the 32k-token full prefill, against 2 x 0.24 ms for gate and up apart)
ROWS_MULTIPLE = 16

# packed joins used (gpu_bench variant `joins_apart` turns it off: the joins of before, copies of small parts only)
USE_PACKED = True


class JoinedWeights:
    """[w_1; w_2; ...; 0] made once per version of the parts (a copy: the parts stay the modules' parameters, which
    loading and training update), zero rows padding it to a multiple of ROWS_MULTIPLE; under autograd, concatenated
    at each call so gradients reach the parts. After `pack`, the parts' own storage is that matrix."""

    def __init__(self):
        self._hit = (None, None)
        self._packed = None            # (matrix, the parts' (data_ptr, shape, dtype) as packed)

    def pack(self, params: list[torch.nn.Parameter]) -> None:
        """One matrix [p_1; p_2; ...; 0] (zero rows to a multiple of ROWS_MULTIPLE); each parameter's data becomes
        its rows' view (the parameters stay leaves; their old storage is freed where nothing else holds it)."""
        with torch.no_grad():
            mat = _padded_cat([p.detach() for p in params])
            at = 0
            for p in params:
                p.data = mat[at:at + p.shape[0]]
                at += p.shape[0]
        self._packed = (mat, _layout(params))
        self._hit = (None, None)

    def packed(self, *ws: torch.Tensor) -> torch.Tensor | None:
        """The packed matrix if ws are its parts as packed (a parameter given new storage since, e.g. by
        `load_state_dict(assign=True)` or `.to()`, is not: then None)."""
        if self._packed is None or not USE_PACKED:
            return None
        mat, layout = self._packed
        return mat if _layout(ws) == layout else None

    def weight(self, *ws: torch.Tensor) -> torch.Tensor:
        if torch.is_grad_enabled() and any(w.requires_grad for w in ws):
            return _padded_cat(list(ws))
        mat = self.packed(*ws)
        if mat is not None:
            return mat
        key = tuple((w.data_ptr(), w._version, w.device, w.dtype) for w in ws)
        if self._hit[0] != key:
            self._hit = (key, _padded_cat([w.detach() for w in ws]))
        return self._hit[1]

    def linear(self, x: torch.Tensor, *ws: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """(x w_1^T, x w_2^T, ...) by one GEMM: views of its output, the padding left out."""
        y = F.linear(x, self.weight(*ws))
        sizes = [w.shape[0] for w in ws]
        return y.split(sizes + [y.shape[-1] - sum(sizes)], dim=-1)[:len(ws)]


def _layout(ws) -> tuple:
    return tuple((w.data_ptr(), tuple(w.shape), w.dtype) for w in ws)


def _padded_cat(parts: list) -> torch.Tensor:
    """[p_1; p_2; ...] with zero rows up to a multiple of ROWS_MULTIPLE."""
    pad = -sum(p.shape[0] for p in parts) % ROWS_MULTIPLE
    return torch.cat(parts + [parts[0].new_zeros(pad, parts[0].shape[1])] if pad else parts)


def pack_model(model: torch.nn.Module) -> int:
    """Packs every join the model's modules name (`joined_parts()`: [(JoinedWeights, [parameters])]) whose parts
    share dtype, device and width; returns how many. Called once the weights are loaded (models/loader.py)."""
    n = 0
    for m in model.modules():
        parts = getattr(m, "joined_parts", None)
        for join, params in (parts() if parts is not None else ()):
            first = params[0]
            if all(p.dim() == 2 and p.shape[1] == first.shape[1] and p.dtype == first.dtype
                   and p.device == first.device for p in params) and first.device.type != "meta":
                join.pack(params)
                n += 1
    return n


__all__ = ["JoinedWeights", "ROWS_MULTIPLE", "USE_PACKED", "pack_model"]
