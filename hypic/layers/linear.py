"""The shared machinery of every linear-attention / state-space mixer over a planned batch.

A family subclasses `LinearMixer`, states its transition `form` and state shape [H, K, V], and
writes three pieces: `features` (per-token projections over the flat axis; "raw" is the conv
input when the family has a short conv), `kernel` (one varlen recurrence call for a group of runs
from given initial states, returning the transition of each run when asked) and `output`. The
base walks the pieces and owns everything PIC adds, identically for every family:

- rounds: round r takes the r-th piece of every sequence, so the runs of a round (cold segments,
  seams of many requests, decode tokens) go to the kernel together as one varlen call, while each
  sequence's running (state, conv window) is threaded through its pieces in order;
- `Apply`: state <- T @ state + S (naive: state + S), conv window <- last W-1 of (window, tail),
  with RoPE'd keys first rotated to the segment's start (S' = R S, T' = R T R^T);
- captures: a summarized run yields a `LinearSummary` (T, S(C|0), conv tail), a marked run the
  `LinearState` after it.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache.entry import LinearSummary
from ..compose.transition import Form, Transition, compose, zero_start
from ..runtime.batch import Apply, ForwardBatch
from ..runtime.state import LinearState


class LinearMixer(nn.Module):
    form: Form                       # the family's transition form
    conv_width: int = 0              # W of the short causal conv over "raw" (0: no conv)
    conv_activation: str | None = "silu"

    def __init__(self, layer_idx: int, ops):
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops

    # -- what a family provides ------------------------------------------------------------------
    @property
    def state_shape(self) -> tuple[int, int, int]:
        """(H, K, V): heads, the key axis the transition acts on, the value axis."""
        raise NotImplementedError

    @property
    def conv_dim(self) -> int:
        return 0

    def features(self, x: torch.Tensor, batch: ForwardBatch) -> dict:
        """Per-token tensors over the flat axis [N, ...]; "raw" [N, conv_dim] when conv_width > 0."""
        raise NotImplementedError

    def kernel(self, f: dict, conv_out, idx, init, cu, summarize: bool):
        """One varlen recurrence over the runs of a group.

        f: features; conv_out [n, C] conv outputs of the runs back to back (None without a conv);
        idx [n] their flat rows; init [R, H, K, V] fp32; cu [R + 1].
        Returns (o [n, ...] per-token outputs, final [R, H, K, V] fp32, [Transition] * R or None);
        the transitions are required when `summarize`."""
        raise NotImplementedError

    def output(self, x: torch.Tensor, o: torch.Tensor, f: dict) -> torch.Tensor:
        raise NotImplementedError

    def key_rotation(self, offset: int) -> torch.Tensor | None:
        """[H or 1, K, K] rotation of the key axis by `offset` positions (RoPE'd keys), else None."""
        return None

    def conv_weights(self):
        """(weight [C, W], bias [C] | None) of the short conv."""
        return self.conv1d.weight.squeeze(1), self.conv1d.bias

    # -- state ---------------------------------------------------------------------------------------
    def new_state(self, device, dtype, capacity: int) -> LinearState:
        h, k, v = self.state_shape
        conv = torch.zeros(self.conv_width - 1, self.conv_dim, dtype=dtype, device=device) if self.conv_width else None
        return LinearState(torch.zeros(h, k, v, dtype=torch.float32, device=device), conv)

    def restore(self, parts: list, device, dtype, capacity: int) -> LinearState:
        """The state after a chain of prefix nodes: the last node's (rec, conv), shared, not copied."""
        last = parts[-1]
        return LinearState(last.rec, last.conv)

    # -- the walk ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        L = self.layer_idx
        f = self.features(x, batch)
        out = None
        for seq in batch.seqs:
            if L not in seq.state.layers:
                seq.state.layers[L] = self.new_state(x.device, x.dtype, seq.state.capacity_hint)
        rounds = max((len(s.pieces) for s in batch.seqs), default=0)
        for r in range(rounds):
            groups: dict[bool, list] = {False: [], True: []}
            for seq in batch.seqs:
                if r >= len(seq.pieces):
                    continue
                piece = seq.pieces[r]
                if isinstance(piece, Apply):
                    self.apply_entry(seq.state.layers[L], piece, batch.exact_transition)
                else:
                    groups[piece.summarize].append((seq, piece))
            for summarize, items in groups.items():
                if items:
                    out = self._runs(items, x, f, out, summarize)
        if out is None:                                   # no runs: no active tokens, nothing to output
            return torch.zeros_like(x)
        return self.output(x, out, f)

    def apply_entry(self, st: LinearState, piece: Apply, exact: bool) -> None:
        summ: LinearSummary = piece.entry.layers[self.layer_idx]
        t, s = summ.T, summ.S
        rot = self.key_rotation(piece.position - piece.entry.seam)   # the segment's start
        if rot is not None:
            t, s = t.rotated(rot), rot @ s
        st.rec = compose(st.rec, t, s, exact=exact)
        if self.conv_width:
            st.conv = torch.cat([st.conv, summ.tail.to(st.conv.dtype)], dim=0)[-(self.conv_width - 1):]

    def _runs(self, items, x, f, out, summarize: bool):
        L = self.layer_idx
        lens = [run.n for _, run in items]
        idx = torch.cat([torch.arange(run.start, run.end, device=x.device) for _, run in items])
        conv_out, tails = None, []
        if self.conv_width:
            weight, bias = self.conv_weights()
            raw, ys = f["raw"], []
            for seq, run in items:
                st = seq.state.layers[L]
                y, window = self.ops.causal_conv1d(raw[None, run.start : run.end], weight, bias, window=st.conv[None],
                                                   activation=self.conv_activation)
                ys.append(y[0])
                st.conv = window[0]
                # the last W-1 raw inputs of the cached part: the next span's conv warm-up
                tails.append(raw[max(run.start, run.end - (self.conv_width - 1)) : run.end].clone())
            conv_out = torch.cat(ys, dim=0)
        init = torch.stack([seq.state.layers[L].rec for seq, _ in items])      # [R, H, K, V]
        cu = torch.tensor([0] + lens, device=x.device).cumsum(0)
        o, final, ts = self.kernel(f, conv_out, idx, init, cu, summarize)
        if out is None:
            out = o.new_zeros((x.shape[0],) + tuple(o.shape[1:]))
        out[idx] = o.to(out.dtype)
        for i, (seq, run) in enumerate(items):
            st = seq.state.layers[L]
            st.rec = final[i]
            if summarize:
                run.captures[L] = LinearSummary(ts[i], zero_start(final[i], ts[i], init[i]),
                                                tails[i] if self.conv_width else None)
            if run.mark:                 # cached in a prefix node: own the memory, not a view of the batch
                run.captures[L] = LinearState(final[i].clone(), st.conv)
        return out


def dense_summary_kernel(fn, q, k, v, init, cu, summarize: bool, **kw):
    """Run a delta-rule kernel; with `summarize`, through the appended-identity trick (dense T)."""
    from ..compose.transition import augment, split_augmented

    dv, dk = v.shape[-1], k.shape[-1]
    init_in = init
    if summarize:
        v, init_in = augment(v, init, dk)
    o, final = fn(q=q[None], k=k[None], v=v[None], initial_state=init_in, output_final_state=True, cu_seqlens=cu, **kw)
    o = o[0, ..., :dv]
    if not summarize:
        return o, final, None
    final, ts = split_augmented(final, dv)
    return o, final, ts


__all__ = ["LinearMixer", "dense_summary_kernel", "Transition", "Form"]
