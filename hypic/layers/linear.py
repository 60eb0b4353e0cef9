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

import numpy as np
import torch
from torch import nn

from ..cache.entry import LinearSummary
from ..compose.scan import STEP_BY_POSITION, STEP_FROM_ZERO
from ..compose.transition import Form, Transition, compose, zero_start
from ..ops.reference.gated_delta import factor_width, factors_to_dense, values_to_state
from ..runtime.batch import Apply, ForwardBatch, Run
from ..runtime.state import LinearState


class LinearMixer(nn.Module):
    form: Form                       # the family's transition form
    readout: bool = False            # kernel(..., readout=True) gives u_t (dense families; dense_summary_kernel)
    isolated: bool = False           # kernel_isolated: an isolated prefill in one call (_forward_isolated)
    graph_compose: bool = False      # runs the fixed-buffer compose pass (runtime/compose_graph.py): a readout
                                     # family whose kernel takes device cu_seqlens for short runs (short=True)
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
    def state_bytes(self, tokens: int, elem: int) -> int:
        """Bytes of a request's state in this layer, whatever its length: the fp32 recurrent state and the conv tail
        (elem bytes per number)."""
        h, k, v = self.state_shape
        conv = (self.conv_width - 1) * self.conv_dim * elem if self.conv_width else 0
        return 4 * h * k * v + conv

    def new_state(self, device, dtype, capacity: int) -> LinearState:
        h, k, v = self.state_shape
        conv = torch.zeros(self.conv_width - 1, self.conv_dim, dtype=dtype, device=device) if self.conv_width else None
        return LinearState(torch.zeros(h, k, v, dtype=torch.float32, device=device), conv)

    def restore(self, parts: list, device, dtype, capacity: int) -> LinearState:
        """The state after a chain of prefix nodes: the last node's (rec, conv), shared, not copied."""
        last = parts[-1]
        return LinearState(last.rec, last.conv)

    # -- static decode (runtime/decode.py) ---------------------------------------------------------------
    def static_state(self, rows: int, cap: int, device, dtype) -> LinearState:
        """R rows of (state, conv window) at fixed addresses."""
        h, k, v = self.state_shape
        conv = (torch.zeros(rows, self.conv_width - 1, self.conv_dim, dtype=dtype, device=device)
                if self.conv_width else None)
        return LinearState(torch.zeros(rows, h, k, v, dtype=torch.float32, device=device), conv)

    def static_load(self, st: LinearState, row: int, state: LinearState) -> None:
        st.rec[row] = state.rec
        if st.conv is not None:
            st.conv[row] = state.conv

    def static_store(self, st: LinearState, row: int, n: int, capacity: int) -> LinearState:
        return LinearState(st.rec[row].clone(), None if st.conv is None else st.conv[row].clone())

    def _forward_static(self, x, f, batch):
        """One token per row over fixed buffers (CUDA-graph decode): the conv window and the recurrent
        state of every row advance in place; the same ops as a decode step of the walks."""
        st: LinearState = batch.static.layers[self.layer_idx]
        rows = x.shape[0]
        conv_out = None
        if self.conv_width:
            weight, bias = self.conv_weights()
            y, window = self.ops.causal_conv1d(f["raw"][:, None], weight, bias, window=st.conv,
                                               activation=self.conv_activation)
            st.conv.copy_(window)
            conv_out = y[:, 0]
        o, final, _ = self.kernel(f, conv_out, slice(0, rows), st.rec, batch.static.cu, False)
        st.rec.copy_(final)
        return o

    # -- the fixed-buffer compose pass (runtime/compose_graph.py) ---------------------------------------
    def capturable(self, device) -> bool:
        """The fixed-buffer compose pass can be captured as a CUDA graph on this device (no host reads)."""
        return False

    def factored_runs(self, max_len: int) -> bool:
        """kernel(..., init_augmented=True, factors=True) gives the runs' transitions in factored form (reference
        `run_factors`) by a kernel, for runs of up to max_len tokens (a family with such a summary says so)."""
        return False

    def query_tail(self, max_len: int) -> bool:
        """The compose pass may leave a request's query of up to max_len tokens out of the chain
        (runtime/compose_graph.py QUERY_TAIL): kernel(..., init_augmented=True, factors=True, values=True) gives a run's
        factors and WY values in any backend, from which `_tail` walks the query's runs to their outputs and the final
        state."""
        return False

    def compose_buffers(self, shape, device, dtype, shared: dict) -> dict:
        """init [2, H, K, V]: the request's initial state, then the pad chain's zero. The cached (T, S):
        an address table where the Triton scan reads them in place (CUDA), else stacked copies."""
        from ..compose.scan import kernel_ready
        from ..ops.fast import triton_kernel

        h, k, v = self.state_shape
        wm1 = self.conv_width - 1
        e = shape.entries
        buf = dict(init=torch.zeros(2, h, k, v, device=device),
                   src=torch.zeros(wm1 * (1 + shape.entries) + shape.tokens, self.conv_dim, dtype=dtype, device=device),
                   win=torch.zeros(max(wm1, 1), self.conv_dim, dtype=dtype, device=device),
                   init_is_zero=True, window_is_zero=True)
        if kernel_ready(device):
            # the chain's step table [E + R, 6] (runtime/compose_graph.py gives every layer a row of one host
            # and one device tensor, copied once per request); the runs' transitions in factored form where the
            # chunked summary kernel gives them (RUN_FACTORS; its width: the padded run length)
            shared.setdefault("steps", []).append(buf)
            buf["keep"] = []
            if LOWRANK_PAIRS and self.factored_runs(shape.lmax) and triton_kernel("pairs") is not None:
                # the runs' dense maps (each paired with the cached map after it, or alone), one buffer for the
                # layers of one state shape (they run one after another); with the pairs made inside the scan,
                # made at the first pass that needs it (`_pair_maps`: that kernel failed), still one for them all
                buf["factor_width"] = factor_width(shape.lmax)
                home = shared.setdefault("pair_maps", {})      # (tensors only: no reference back to buf)
                buf["pair_home"] = home
                buf["pair_maps"] = None if PAIRS_IN_SCAN else self._pair_maps(buf, shape.runs, device)
            elif RUN_FACTORS and self.factored_runs(shape.lmax):
                buf["factor_width"] = factor_width(shape.lmax)
        else:
            buf.update(T=torch.zeros(e, h, k, k, device=device), S=torch.zeros(e, h, k, v, device=device))
        return buf

    def _pair_maps(self, buf: dict, runs: int, device) -> torch.Tensor:
        """The pairs' map buffer [runs, H, K, V + K] fp32 of this layer's state shape, shared by the layers of one
        buffer set (`buf["pair_home"]`, keyed by the shape), made by the first layer that asks."""
        h, k, v = self.state_shape
        home = buf["pair_home"]
        if (h, k, v) not in home:
            home[(h, k, v)] = torch.empty(runs, h, k, v + k, device=device)
        return home[(h, k, v)]

    def compose_fill(self, buf: dict, low, L: int, copies: list | None = None) -> None:
        """The request's cached segments into the slots: (T, S) at storage 0..E-1 (their addresses, or
        copies), the tails packed (as (source, destination, bytes) blocks added to `copies` where given,
        copied by the caller in one launch)."""
        from ..runtime.compose_graph import pack_blocks

        parts = [e.layers[L] for e in low.entries]
        e = len(parts)
        st = low.state.layers.get(L)
        # the initial state and conv window: zero unless the request holds a state (a cached prefix); the pass
        # never writes them, so a buffer still zero from the last request is not zeroed again (a launch each)
        if st is None:
            if not buf.get("init_is_zero"):
                buf["init"][0].zero_()
                buf["init_is_zero"] = True
        else:
            buf["init"][0] = st.rec
            buf["init_is_zero"] = False
        if self.conv_width:
            wm1 = self.conv_width - 1
            if st is None or st.conv is None:
                if not buf.get("window_is_zero"):
                    buf["src"][:wm1].zero_()
                    buf["window_is_zero"] = True
            else:
                buf["src"][:wm1] = st.conv
                buf["window_is_zero"] = False
        if "steps" in buf:
            # read in place: each entry's own T and S (a copy only where one is not fp32, contiguous, here);
            # the entries outlive the replay (the request holds them; later frees are stream-ordered after it)
            # (numpy on the host: ~40 layers x a few small ops per request)
            keep = []
            addr = np.empty((e, 2), dtype=np.int64)
            dev = buf["init"].device
            for i, p in enumerate(parts):
                a = p.addresses if p.S.device == dev else None
                if a is None:
                    a = []
                    for t in (p.T.t, p.S):
                        t = t.to(dev, torch.float32).contiguous()
                        if t.data_ptr() % 16:           # (a view at an odd offset: the pair kernel reads 16 bytes)
                            t = t.clone()
                        keep.append(t)
                        a.append(t.data_ptr())
                addr[i] = a
            buf["keep"], buf["parts"] = keep, parts
            rows = buf["steps_host"].numpy()
            paired = "pair_maps" in buf
            is_run, off_t, off_s, ent, rest, pair_cols = self._step_columns(low, buf.get("factor_width"), paired)
            if pair_cols is None:
                rows[:, 0] = np.where(is_run, off_t, addr[ent, 0])
                rows[:, 1] = np.where(is_run, off_s, addr[ent, 1])
                rows[:, 2:] = rest
            else:       # a paired cached map's step left out (the pair's map, in its run's place, takes it over)
                run_k, offs_k, ent_k, rest_k, after, has, cols, by_pos = pair_cols
                nk = ent_k.shape[0]
                rows[:nk, :2] = np.where(run_k, offs_k, addr[ent_k])
                rows[:nk, 2:] = rest_k
                if by_pos:
                    rows[0, 2] |= STEP_BY_POSITION
                pairs = buf["pairs_host"].numpy()      # run i: (T_e, S_e addresses or 0, i, is a pad run, ...)
                pairs[:, :2] = addr[after] * has
                pairs[:, 2:4] = cols
            if CHAIN_FROM_ZERO and st is None and rows.shape[0]:
                rows[0, 2] |= STEP_FROM_ZERO         # the first chain starts from zero: its first step is its S
        else:
            torch.stack([p.T.t for p in parts], out=buf["T"][:e])
            torch.stack([p.S for p in parts], out=buf["S"][:e])
        if self.conv_width and any(t for _, t in low.tail_rows):
            a = low.tail_rows[0][0]
            last, t = low.tail_rows[-1]
            blocks = None
            if copies is not None:
                used = [(p, n) for p, (_, n) in zip(parts, low.tail_rows) if n]
                blocks = pack_blocks([p.tail_block for p, _ in used], buf["src"], a, [n for _, n in used])
            if blocks is not None:
                copies.extend(blocks)
            else:
                tails = [p.tail if p.tail.shape[0] == n else p.tail[p.tail.shape[0] - n:]
                         for p, (_, n) in zip(parts, low.tail_rows) if n]
                torch.cat(tails, out=buf["src"][a : last + t])       # the tails' rows are consecutive

    def _step_columns(self, low, width: int | None, paired: bool = False):
        """The step table's columns every layer of this state shape shares, made once per request: is_run,
        each run's byte offsets (of its [S | T]; or, with factors of `width` rows and not paired, of its factors
        and of its S), each cached map's entry index, (is_run, slot, first token, tokens), and with `paired` (else
        None) the kept steps' is_run [M', 1], offsets [M', 2], entry indices and rest columns, and per run the
        entry after it (`pair_runs`; 0 where none), whether one follows [R, 1], and (run index, is a pad run) [R, 2]."""
        key = ("steps", self.state_shape, width, paired)
        hit = low.memo.get(key)
        if hit is None:
            h, k, v = self.state_shape
            e = len(low.entries)
            order = low.tables["order"].numpy().astype(np.int64)
            is_run = order >= e
            ri = np.maximum(order - e, 0)                                  # run index (0 for cached maps)
            cu = low.tables["cu"].numpy()                                 # each run's tokens (for the correction)
            rest = np.stack([is_run.astype(np.int64), order, np.where(is_run, cu[ri], 0),
                             np.where(is_run, cu[ri + 1] - cu[ri], 0)], axis=1)
            if width is None or paired:          # (paired: the pair kernel writes each run's dense map)
                off_t = off_s = ri * (h * k * (v + k) * 4)
            else:
                off_t, off_s = ri * (h * (2 * width + 1) * k * 4), ri * (h * k * v * 4)
            ent = np.minimum(order, e - 1)
            pair_cols = None
            if paired:
                real = int(low.tables["cu_maps"][1]) - e                    # the request's runs (then the pads)
                keep, after = low.pairs                                    # (lowering: `pair_runs`)
                kept = np.flatnonzero(keep)
                runs = np.arange(after.shape[0])
                # the request's chain (its first cu_pairs[1] kept steps) by position: every step after its first a
                # run's map, at consecutive slots of the pairs' buffer (compose/scan.py STEP_BY_POSITION)
                n0 = int(low.tables["cu_pairs"][1])
                offs = off_t[kept[1:n0]]
                by_pos = n0 > 1 and bool(is_run[kept[1:n0]].all()) and bool(
                    (offs == offs[0] + np.arange(n0 - 1) * (h * k * (v + k) * 4)).all())
                pair_cols = (is_run[kept, None], np.stack([off_t[kept], off_s[kept]], 1), ent[kept], rest[kept],
                             np.maximum(after, 0), (after >= 0)[:, None].astype(np.int64),
                             np.stack([runs, runs >= real], 1), by_pos)
            hit = low.memo[key] = (is_run, off_t, off_s, ent, rest, pair_cols)
        return hit

    def _forward_captured(self, x, f, batch):
        """The compose pass of one lowered request over fixed buffers (no host sync, fixed shapes): the
        conv as a gather over the source rows, every run summarized from zero with its readout in one
        kernel call, the chain of maps in one scan (storage order through `order`), each run's outputs
        corrected by its initial state. Equal to `_forward_readout` up to rounding
        (tests/test_compose_graph.py)."""
        from ..compose.scan import scan_dense, scan_steps, stack_dense

        c = batch.captured
        buf = c.layers[self.layer_idx]
        sh = c.shape
        e = sh.entries
        raw = f["raw"]
        src = buf["src"]
        weight, bias = self.conv_weights()
        from ..ops.fast import kernel_failed, triton_here, triton_kernel

        conv = (triton_kernel("conv", src, weight, bias) if triton_here(src) and self.conv_activation in (None, "silu")
                else None)
        conv_out, window = None, None
        if conv is not None:                # one kernel (ops/triton_conv.py)
            try:
                # the active tokens' raw inputs read in place, and the request's window (the last token's newest
                # W - 1 inputs: the lowering has the request end with an active run) written by the kernel
                if CONV_IN_PLACE:
                    win = buf["win"] if self.conv_width > 1 else None
                    conv_out = conv(src, c.conv_idx, weight, bias, self.conv_activation, raw=raw, window=win,
                                    last=c.logits_index if win is not None else None)
                    window = win
                else:
                    src[src.shape[0] - sh.tokens :] = raw
                    conv_out = conv(src, c.conv_idx, weight, bias, self.conv_activation)
            except Exception as e:
                kernel_failed("conv", e)
        if conv_out is None:
            src[src.shape[0] - sh.tokens :] = raw             # the PyTorch form gathers from the buffer alone
            # [Np, W, C] times [W, C], summed over W: elementwise (as an einsum it became a batched GEMV, 0.11 ms
            # per layer on the H200 for ~10 us of work)
            y = (src[c.conv_idx].float() * weight.float().t()).sum(1)
            if bias is not None:
                y = y + bias.float()
            conv_out = (torch.nn.functional.silu(y) if self.conv_activation == "silu" else y).to(raw.dtype)
        kept = window if window is not None else src[c.window]        # the request's conv window
        # every run from zero: outputs, readout, and the runs' maps, [S | T] or S with T's factors (RUN_FACTORS),
        # or U with T's factors (LOWRANK_PAIRS)
        factored, paired = "factor_width" in buf, "pair_maps" in buf
        # (a tail's runs too: their outputs from zero, readout, and with the pairs their factors and values, which
        # `_tail` walks)
        o0, u, *maps = self.kernel(f, conv_out, slice(0, sh.tokens), None, c.cu, True, readout=True, short=True,
                                   init_augmented=True, max_len=sh.lmax, factors=factored, values=paired)
        if o0.shape[0] < sh.tokens:       # (the reference gives the rows its runs cover, here the first ones; eager)
            o0, u = (_rows_at(t, sh.tokens) for t in (o0, u))
        # the chain: entries' (T, S) from their slots, the runs' maps read where the kernel wrote them
        runs, factors = maps[0].float().contiguous(), (maps[1] if factored else None)
        final, cu_maps = None, c.cu_maps
        tail_maps = (runs, maps[1]) if paired else None       # (the tail's runs' values and factors, where made)
        # FUSE_CORRECTION: the scan corrects the runs' outputs in place as it reaches each run (its initial
        # state in registers; o0 and u are the two column ranges of the summary's [N, H, V + K] outputs);
        # else it writes the runs' initial states and `_corrected` applies them (gpu_bench times both)
        dv = o0.shape[-1]
        fused = (FUSE_CORRECTION and u.data_ptr() == o0.data_ptr() + dv * o0.element_size()
                 and u.stride() == o0.stride() and o0.stride(1) == dv + u.shape[-1])
        # (fused: the summary's [N, H, V + K] outputs, o0 and u its two column ranges, which the scan corrects in place)
        full = o0.as_strided((o0.shape[0], o0.shape[1], dv + u.shape[-1]), (o0.stride(0), o0.stride(1), 1)) \
            if fused else None
        if paired and fused and PAIRS_IN_SCAN and "steps" in buf:
            # the pairs made inside the scan (ops/triton_scan.scan_pairs): each run from its factors and values, then
            # the cached map after it read in place; no pair's map written to the shared buffer and read back
            kern = triton_kernel("scan_pairs")
            if kern is not None:
                try:
                    final = kern(buf["init"][:1], buf["steps"], c.cu_pairs[:2], buf["pairs"][: sh.runs - sh.tail],
                                 factors, runs, full, max_run=sh.lmax)
                except Exception as err:      # the pair kernel and the chain scan below from now on
                    kernel_failed("scan_pairs", err)
                else:
                    return self._finish(o0, u, final[0], f, conv_out, c, kept, tail_maps)
        if paired:
            # each run's dense map, composed with the cached map after it where one follows (the step table leaves
            # that map's step out: cu_pairs), into the layers' shared buffer; fused, the pad runs' maps need not be
            # made (no chain reads them: below; SKIP_PAD_PAIRS)
            kern = triton_kernel("pairs")
            try:
                if kern is None:      # failed to build before: the unpaired chain by the dense maps below (eager)
                    runs = None
                else:
                    pairs = buf["pairs"][: sh.runs - sh.tail]          # (not the tail's runs: no chain reads them)
                    if buf["pair_maps"] is None:        # (not made with the buffers: the pairs were the scan's)
                        buf["pair_maps"] = self._pair_maps(buf, sh.runs, o0.device)
                    runs = kern(pairs, factors, runs, buf["pair_maps"], skip_marked=SKIP_PAD_PAIRS and fused)
            except Exception as err:
                kernel_failed("pairs", err)
                runs = None
            if runs is not None:
                factors, cu_maps = None, c.cu_pairs
        if runs is not None and "steps" in buf and triton_kernel("steps") is not None:
            # fused, the pad runs need no chain (their outputs only need to be finite, and are from zero): the
            # request's chain alone (the pad chain's 128 programs took half the SMs of the first wave, H200 run 34)
            chains = 1 if fused else 2
            try:
                before, final = scan_steps(buf["init"][:chains], buf["steps"], cu_maps[: chains + 1], runs,
                                           e + sh.runs, outputs=full, max_run=sh.lmax, factors=factors)
            except Exception as err:  # the maps stacked from now on (eager)
                kernel_failed("steps", err)
            else:
                if fused:
                    return self._finish(o0, u, final[0], f, conv_out, c, kept, tail_maps)
        if final is None:
            if "steps" in buf:
                T, S = stack_dense([(p.T, p.S) for p in buf["parts"]])
            else:
                T, S = buf["T"], buf["S"]
            if paired:                    # the runs alone (no pairs: the chain below walks the cached maps too)
                aug = factors_to_dense(values_to_state(maps[0], maps[1]), maps[1])
            else:
                aug = runs if factors is None else factors_to_dense(runs, factors)
            before, final = scan_dense(buf["init"], T, S, c.cu_maps, order=c.order, runs=aug)
        # before[e:]: each run's start (the tail's runs are no chain's: their slots zero, where their and the pads'
        # rows gather; the tail corrects its own)
        s0 = before[e:]
        if sh.tail:
            s0 = torch.cat([s0[: sh.runs - sh.tail], s0.new_zeros((sh.tail,) + tuple(s0.shape[1:]))])
        return self._finish(_corrected(o0, u, s0, c.run_of, c.pos_in_run, sh.lmax), u, final[0], f, conv_out, c, kept,
                            tail_maps)

    def _finish(self, o, u, state, f, conv_out, c, window, tail_maps=None):
        """The pass's outputs and what it leaves for the request's state (final state, conv window); with a tail (the
        query's runs outside the chain, `state` the chain's last: the tail's initial state), the tail's part made by
        `_tail`."""
        if c.shape.tail:
            state = self._tail(o, u, state, f, conv_out, c, tail_maps)
        c.outputs[self.layer_idx] = (state, window)
        return o

    def _tail(self, o, u, s0, f, conv_out, c, maps=None):
        """The query's runs (the last c.shape.tail, summarized from zero with the others: o holds their outputs from
        zero, u every row's readout) walked from the chain's last state s0 [H, K, V] (fp32) by the op
        `gated_delta_tail`: each run's outputs corrected from the state entering it (o_t += x^T u_t, in place), the
        state taken through the run's factors, the pads' rows zeroed. The runs' values and factors: `maps` (U, F of
        every run, where the summary made them for the pairs), else a summary call of the tail's runs alone. Returns
        the request's final state."""
        sh = c.shape
        first = sh.runs - sh.tail
        cu_t = c.cu[first:]
        if maps is not None:
            U, F = (t[first:] for t in maps)
        else:
            _, _, U, F = self.kernel(f, conv_out, slice(0, sh.tokens), None, cu_t, True, readout=True, short=True,
                                     init_augmented=True, max_len=sh.lmax, factors=True, values=True)
        return self.ops.gated_delta_tail(o, u, s0, U, F, cu_t)

    def compose_state(self, out, bufs, low, old, capacity: int) -> LinearState:
        final, window = out
        return LinearState(final.clone(), window.clone() if self.conv_width else None)

    # -- the walk ------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        L = self.layer_idx
        f = self.features(x, batch)
        if batch.static is not None:
            return self.output(x, self._forward_static(x, f, batch), f)
        if batch.captured is not None:
            return self.output(x, self._forward_captured(x, f, batch), f)
        fresh = True                 # every sequence starts here from a zero state (its first forward)
        for seq in batch.seqs:
            if L not in seq.state.layers:
                seq.state.layers[L] = self.new_state(x.device, x.dtype, seq.state.capacity_hint)
            else:
                fresh = False
        one_call = self.readout and batch.exact_transition
        if batch.walk == "phased" and self.isolated and _isolated_ok(batch, fresh):
            out = self._forward_isolated(x, f, batch)
        elif batch.walk == "phased" and _phased_ok(batch, one_call and (x.is_cuda or LONG_CHAINS_EVERYWHERE)):
            if one_call:
                out = self._forward_readout(x, f, batch)
            else:
                out = self._forward_phased(x, f, batch)
        elif (batch.walk == "phased" and LONG_CHAINS_PHASED and self.isolated and batch.exact_transition
              and (x.is_cuda or LONG_CHAINS_EVERYWHERE) and _chained(batch)):
            out = self._forward_phased(x, f, batch)     # a chain of long spans: 3 calls per layer, not one per span
        else:
            out = self._forward_rounds(x, f, batch)
        if out is None:                                   # no runs: no active tokens, nothing to output
            return torch.zeros_like(x)
        return self.output(x, out, f)

    def _forward_isolated(self, x, f, batch):
        """An isolated prefill (prefill/isolated.py: every sequence its seam window, then the rest summarized,
        from a zero state) in one kernel call: the family's `kernel_isolated` gives the outputs of whole
        sequences and each rest's zero-start (T, S), without a second round over the rests. Equal to
        `_forward_rounds` up to rounding (tests/test_fast.py)."""
        L = self.layer_idx
        seqs = batch.seqs
        lens = [s.end - s.start for s in seqs]
        cu = torch.tensor([0] + lens).cumsum(0)
        conv_out = None
        if self.conv_width:
            weight, bias = self.conv_weights()
            windows = torch.stack([s.state.layers[L].conv for s in seqs])
            conv_out, new = self.ops.causal_conv1d_varlen(f["raw"], weight, bias, windows, cu,
                                                          activation=self.conv_activation)
        o, final, t, s0 = self.kernel_isolated(f, conv_out, cu, [s.pieces[0].n for s in seqs])
        own = len(seqs) > 1                 # entries are cached one by one: no view pinning the batch
        for i, seq in enumerate(seqs):
            st = seq.state.layers[L]
            st.rec = final[i]
            rest = seq.pieces[1]
            tail = None
            if self.conv_width:
                st.conv = new[i].clone() if own else new[i]
                tail = f["raw"][max(rest.start, rest.end - (self.conv_width - 1)) : rest.end].clone()
            rest.captures[L] = LinearSummary(Transition(self.form, t[i].clone() if own else t[i]),
                                             s0[i].clone() if own else s0[i], tail)
        return o

    def _forward_rounds(self, x, f, batch):
        """The plain walk (the reference): round r takes the r-th piece of every sequence; the runs of a
        round share one kernel call, Apply pieces compose one by one."""
        L, out = self.layer_idx, None
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
        return out

    def _forward_phased(self, x, f, batch):
        """The batched compose pass, three phases for the whole batch whatever the number of pieces:

        1. the zero-start summary (T, S) of every run that a later run depends on (seam windows),
           one varlen kernel call;
        2. each sequence's chain of affine maps (runs' summaries and cached segments, in order),
           folded to give every run its initial state (one kernel for dense transitions on CUDA);
        3. every run's outputs from its true initial state, one varlen call (two when some runs
           are summarized for the cache and others are not).
        Conv windows need no recurrence: the window before a run is the last W-1 raw inputs before
        it (the previous run's, or a cached segment's tail), so all runs share one conv call.
        Equal to `_forward_rounds` up to rounding (tests/test_fast.py)."""
        L = self.layer_idx
        seqs = batch.seqs
        runs = [(seq, p) for seq in seqs for p in seq.pieces if isinstance(p, Run)]
        if not runs:
            for seq in seqs:                                   # Apply pieces only: compose in place
                for p in seq.pieces:
                    self.apply_entry(seq.state.layers[L], p, batch.exact_transition)
            return None
        lens = [p.n for _, p in runs]
        cu_all = torch.tensor([0] + lens).cumsum(0)
        conv_out, tails = None, {}
        if self.conv_width:
            conv_out, tails = self._conv_phased(runs, f["raw"], cu_all)
        # phase 1: summaries of the runs that a later run depends on
        need = []                                              # (index into runs, seq, run)
        i = 0
        for seq in seqs:
            k = [j for j, p in enumerate(seq.pieces) if isinstance(p, Run)]
            for j in k:
                if j != k[-1]:
                    need.append((i, seq, seq.pieces[j]))
                i += 1
        summ = {}
        if need:
            idx = _rows([run for _, _, run in need], x.device)
            cu = torch.tensor([0] + [run.n for _, _, run in need]).cumsum(0)
            sub = None if conv_out is None else conv_out[idx]
            h, kk, vv = self.state_shape
            zeros = torch.zeros(len(need), h, kk, vv, device=x.device)
            _, final, ts = self.kernel(f, sub, idx, zeros, cu, True)
            for n_, (ri, _, _) in enumerate(need):
                summ[ri] = (ts[n_], final[n_])
        # phase 2: each sequence's chain of maps -> the initial state of every run
        inits = self._chain(seqs, summ, batch.exact_transition)
        finals_after: list = [None] * len(runs)
        # phase 3: every run from its initial state
        out = None
        init = torch.stack(inits)
        for summarize in (False, True):
            sel = [i for i, (_, p) in enumerate(runs) if p.summarize == summarize]
            if not sel:
                continue
            items = [runs[i] for i in sel]
            idx = _rows([p for _, p in items], x.device)
            cu = torch.tensor([0] + [p.n for _, p in items]).cumsum(0)
            sub = None if conv_out is None else (conv_out if len(sel) == len(runs) else conv_out[idx])
            part = init if len(sel) == len(runs) else init[torch.tensor(sel).to(init.device, non_blocking=True)]
            o, final, ts = self.kernel(f, sub, idx, part, cu, summarize)
            out = _place(out, o, idx, x.shape[0])
            for n_, i in enumerate(sel):
                seq, run = runs[i]
                if summarize:
                    run.captures[L] = LinearSummary(ts[n_], zero_start(final[n_], ts[n_], init[i]), tails.get(i))
                if run.mark:
                    run.captures[L] = LinearState(final[n_].clone(), tails.get(("window", i)))
                finals_after[i] = final[n_]
        # each sequence's state after its last piece: its last run's final, then any Apply after it
        i = 0
        for seq in seqs:
            st = seq.state.layers[L]
            last = None
            for j, p in enumerate(seq.pieces):
                if isinstance(p, Run):
                    last, i = (i, j), i + 1
            st.rec = finals_after[last[0]]
            for p in seq.pieces[last[1] + 1:]:
                self.apply_entry(st, p, batch.exact_transition, conv=False)
        return out

    def _forward_readout(self, x, f, batch):
        """The compose pass in one kernel call (dense families with readout): every run summarized from
        zero with its per-token readout u_t; every sequence's chain (runs and cached segments) folded
        in one scan; each run's outputs corrected by its true initial state: o_t = o_t(0) + S0^T u_t.
        Equal to `_forward_rounds` up to rounding (tests/test_fast.py)."""
        from ..compose.scan import scan_dense

        L = self.layer_idx
        seqs = batch.seqs
        runs = [(seq, p) for seq in seqs for p in seq.pieces if isinstance(p, Run)]
        if not runs:                                   # cached segments only: compose in place
            return self._forward_phased(x, f, batch)
        lens = [p.n for _, p in runs]
        cu = torch.tensor([0] + lens).cumsum(0)
        conv_out, tails = (None, {})
        if self.conv_width:
            conv_out, tails = self._conv_phased(runs, f["raw"], cu)
        idx = _rows([p for _, p in runs], x.device)
        h, kk, vv = self.state_shape
        zeros = torch.zeros(len(runs), h, kk, vv, device=x.device)
        o0, u, S, ts = self.kernel(f, conv_out, idx, zeros, cu, True, readout=True)
        # every sequence's maps in order; a run's initial state is the state before its map
        Ts, Ss, cu_maps, at, i = [], [], [0], [], 0
        for seq in seqs:
            for p in seq.pieces:
                if isinstance(p, Run):
                    at.append(len(Ts))
                    Ts.append(ts[i].t)
                    Ss.append(S[i])
                    i += 1
                else:
                    e = p.entry.layers[L]
                    Ts.append(e.T.t)
                    Ss.append(e.S)
            cu_maps.append(len(Ts))
        init = torch.stack([seq.state.layers[L].rec for seq in seqs])
        before, final = scan_dense(init, torch.stack(Ts), torch.stack(Ss), cu_maps)
        # index tensors of this layout, the same for every linear layer of the forward: made once, on the
        # device, without a host sync (indexing with a Python list would copy it synchronously per layer)
        key = ("readout rows", tuple(lens), tuple(at))
        if key not in batch.scratch:
            n = sum(lens)
            lt, at_t, starts = (torch.tensor(t).to(x.device, non_blocking=True) for t in (lens, at, cu[:-1].tolist()))
            run_of = torch.repeat_interleave(torch.arange(len(runs), device=x.device), lt, output_size=n)
            batch.scratch[key] = (at_t, run_of, torch.arange(n, device=x.device) - starts[run_of])
        at_t, run_of, pos = batch.scratch[key]
        s0 = before[at_t]                                                # [R, H, K, V]
        out = _place(None, _corrected(o0, u, s0, run_of, pos, max(lens)), idx, x.shape[0])
        for r, (seq, run) in enumerate(runs):
            if run.summarize:
                run.captures[L] = LinearSummary(Transition(ts[r].form, ts[r].t.clone()), S[r].clone(), tails.get(r))
            if run.mark:
                after = ts[r].apply(s0[r]) + S[r]
                run.captures[L] = LinearState(after, tails.get(("window", r)))
        for n, seq in enumerate(seqs):
            seq.state.layers[L].rec = final[n]
        return out

    def _conv_phased(self, runs, raw, cu_all):
        """One conv call for every run; also sets each sequence's final conv window and returns the
        cache tails (index -> last W-1 raw inputs of a run; ("window", index) -> the window after it)."""
        L, wm1 = self.layer_idx, self.conv_width - 1
        weight, bias = self.conv_weights()
        windows, tails, i = [], {}, 0
        done = set()
        for seq, _ in runs:
            if id(seq) in done:
                continue
            done.add(id(seq))
            st = seq.state.layers[L]
            window = st.conv
            for p in seq.pieces:
                if isinstance(p, Apply):
                    window = _shift(window, p.entry.layers[L].tail, wm1)
                    continue
                windows.append(window)
                own = raw[max(p.start, p.end - wm1) : p.end]
                if p.summarize:
                    tails[i] = own.clone()
                window = _shift(window, own, wm1)
                if p.mark:
                    tails[("window", i)] = window.clone()
                i += 1
            st.conv = window.clone() if _is_view_of(window, raw) else window   # own memory: states are cached
        conv_out, _ = self.ops.causal_conv1d_varlen(raw, weight, bias, torch.stack(windows), cu_all,
                                                    activation=self.conv_activation)
        return conv_out, tails

    def _chain(self, seqs, summ, exact_applies: bool):
        """Phase 2: every run's initial state, in run order."""
        L = self.layer_idx
        plans = []                    # per sequence: (its state, [("run", run index) | ("apply", piece)], run indices)
        i = 0
        for seq in seqs:
            st = seq.state.layers[L]
            maps, run_ids = [], []
            for p in seq.pieces:
                if isinstance(p, Run):
                    run_ids.append(i)
                    maps.append(("run", i))
                    i += 1
                else:
                    maps.append(("apply", p))
            plans.append((st.rec, maps, run_ids))
        inits: list = [None] * i
        dense_fast = self.form is Form.DENSE and exact_applies and self.key_rotation(0) is None
        if dense_fast and any(len(m) > 1 for _, m, _ in plans):
            return self._chain_dense(plans, summ, inits)
        for rec, maps, run_ids in plans:
            state = rec
            for kind, v in maps:
                if kind == "run":
                    inits[v] = state
                    if v in summ:
                        t, s = summ[v]
                        state = compose(state, t, s, exact=True)
                    else:
                        break                                  # the last run: phase 3 continues from here
                else:
                    state = self._applied(state, v, exact_applies)
        return inits

    def _chain_dense(self, plans, summ, inits):
        """Dense chains of all sequences in one scan (compose/scan.py): every sequence's maps before its
        last run; a non-last run starts from the state before its own map, the last run from the end."""
        from ..compose.scan import scan_dense

        L = self.layer_idx
        Ts, Ss, cu, at = [], [], [0], {}
        for rec, maps, run_ids in plans:
            last = run_ids[-1] if run_ids else None
            for kind, v in maps:
                if kind == "run":
                    if v == last:
                        break
                    at[v] = len(Ts)
                    t, s = summ[v]
                else:
                    e = v.entry.layers[L]
                    t, s = e.T, e.S
                Ts.append(t.t)
                Ss.append(s)
            cu.append(len(Ts))
        if not Ts:                                             # every sequence starts with its last run
            for rec, _, run_ids in plans:
                for v in run_ids:
                    inits[v] = rec
            return inits
        before, final = scan_dense(torch.stack([rec for rec, _, _ in plans]), torch.stack(Ts), torch.stack(Ss), cu)
        for n, (rec, maps, run_ids) in enumerate(plans):
            for v in run_ids:
                inits[v] = before[at[v]] if v in at else final[n]
        return inits

    def _applied(self, state, piece: Apply, exact: bool):
        summ: LinearSummary = piece.entry.layers[self.layer_idx]
        t, s = summ.T, summ.S
        rot = self.key_rotation(piece.position - piece.entry.seam - piece.entry.origin)   # from where it was stored
        if rot is not None:
            t, s = t.rotated(rot), rot @ s
        return compose(state, t, s, exact=exact)

    def apply_entry(self, st: LinearState, piece: Apply, exact: bool, conv: bool = True) -> None:
        st.rec = self._applied(st.rec, piece, exact)
        if self.conv_width and conv:
            summ = piece.entry.layers[self.layer_idx]
            st.conv = _shift(st.conv, summ.tail, self.conv_width - 1)

    def _runs(self, items, x, f, out, summarize: bool):
        L = self.layer_idx
        lens = [run.n for _, run in items]
        idx = _rows([run for _, run in items], x.device)
        cu = torch.tensor([0] + lens).cumsum(0)
        conv_out, tails = None, []
        if self.conv_width:
            weight, bias = self.conv_weights()
            raw = f["raw"]
            windows = torch.stack([seq.state.layers[L].conv for seq, _ in items])
            conv_out, new = self.ops.causal_conv1d_varlen(raw[idx], weight, bias, windows, cu,
                                                          activation=self.conv_activation)
            for i, (seq, run) in enumerate(items):
                seq.state.layers[L].conv = new[i].clone() if len(items) > 1 else new[i]   # own memory
                # the last W-1 raw inputs of the cached part: the next span's conv warm-up
                tails.append(raw[max(run.start, run.end - (self.conv_width - 1)) : run.end].clone())
        init = torch.stack([seq.state.layers[L].rec for seq, _ in items])      # [R, H, K, V]
        o, final, ts = self.kernel(f, conv_out, idx, init, cu, summarize)
        out = _place(out, o, idx, x.shape[0])
        for i, (seq, run) in enumerate(items):
            st = seq.state.layers[L]
            st.rec = final[i]
            if summarize:
                run.captures[L] = LinearSummary(ts[i], zero_start(final[i], ts[i], init[i]),
                                                tails[i] if self.conv_width else None)
            if run.mark:                 # cached in a prefix node: own the memory, not a view of the batch
                run.captures[L] = LinearState(final[i].clone(), st.conv)
        return out


def _rows_at(t, total: int):
    """Rows a kernel gave packed (the reference's varlen outputs: the rows its runs cover, the first ones) among
    `total` rows, the others zero (eager: the compose pass's reference path)."""
    out = t.new_zeros((total,) + tuple(t.shape[1:]))
    out[: t.shape[0]] = t
    return out


def _corrected(o0, u, s0, run_of, pos, lmax: int):
    """A run's outputs from its true initial state: o_t = o_t(0) + S0^T u_t (dense_summary_kernel), for every
    token at once, the runs padded to `lmax` rows for one batched product in fp32.
    o0 [N, H, V], u [N, H, K] (token n: run run_of[n], row pos[n]), s0 [R, H, K, V] fp32."""
    up = u.new_zeros((s0.shape[0], lmax) + tuple(u.shape[1:]), dtype=torch.float32)
    up[run_of, pos] = u.float()
    corr = torch.einsum("rlhk,rhkv->rlhv", up, s0)[run_of, pos]
    return corr.add_(o0).to(o0.dtype)


def _place(out, o, idx, n: int):
    """Write per-run outputs o (rows `idx` of the flat axis of n rows) into `out` (None: not made yet).
    When o covers every row in order it becomes the output as is: no zeros, no scatter."""
    if out is None and isinstance(idx, slice) and idx == slice(0, n):
        return o
    if out is None:
        out = o.new_zeros((n,) + tuple(o.shape[1:]))
    out[idx] = o.to(out.dtype)
    return out


def _rows(runs, device):
    """The flat rows of runs given in order: a slice when they lie back to back (no gather, no copy),
    else the concatenated index."""
    if all(a.end == b.start for a, b in zip(runs, runs[1:])):
        return slice(runs[0].start, runs[-1].end)
    return torch.cat([torch.arange(r.start, r.end, device=device) for r in runs])


def _shift(window, new, wm1: int):
    """The last wm1 rows of (window, new): the conv window after `new` raw inputs."""
    if new.shape[0] >= wm1:
        return new[new.shape[0] - wm1 :]
    return torch.cat([window, new.to(window.dtype)], dim=0)[-wm1:]


def _is_view_of(t, base) -> bool:
    return t.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()


_SHORT_RUN = 64
_CORRECTED_TOKENS = 4096
LONG_CHAINS_EVERYWHERE = False     # tests: take the one-call walk for long chains on the CPU too
# A chain of long runs past the readout walk's bound (a prefix-mode request: one marked span per segment) through
# the phased walk instead of rounds, for families whose long runs summarize in one pass (`isolated`: Gated DeltaNet,
# T from the forward's WY factors): the spans' zero-start summaries in one call, the chain, then every span from its
# initial state in one call; 2 passes over the tokens in 3 calls per layer instead of 1 pass in one call per span.
# H200 run 49: a prefix request recomputing 28,864 tokens in 20 spans took 1.35 s against 0.68 s for `full` on 32k
# (rounds: 600 fla calls of ~1,600 tokens on a host-bound path; the profile of run 53: 16k kernels, GPU busy 0.8 s of
# 2.1 s). On since run 53: 899 against 1,371 ms in rounds, interleaved (paired median -470 ms); gpu_bench still times
# both (`long_chains_phased` against `rounds`).
LONG_CHAINS_PHASED = True
FUSE_CORRECTION = True             # the compose pass's step-table scan corrects the runs' outputs itself
# the compose pass's runs' transitions in factored form where a kernel gives them (T = gamma I - Kd^T W). Off: the
# dense [S | T] was 0.5 ms faster on the warm request in both interleaved runs (H200 runs 30, 31) and its chain
# 8% faster in the micro-benchmark with the step's loads issued first (0.350 vs 0.382 ms; run 54's scan_bench: 352 vs
# 379 us); kept as a variant. (A seam run and the segment after it as one step, x <- T_e (g x + S_r) - P (W x) + S_e,
# measured in runs 53-54 and removed: 447 us per chain against 352 in isolation, +0.81 ms on the warm request; the
# step spills 170-250 values at 255 registers. Code at git 4a0a8c6.)
RUN_FACTORS = False
# The compose pass's seam runs composed with the cached map after them before the chain, by their low-rank factors
# (ops/triton_scan.pair_lowrank: [S_e + P U | g T_e - P W], P = T_e Kd^T): the runs' summary writes its factors and
# WY-solved values (Kd, W, g, U) instead of a dense [S | T], one kernel makes every run's dense map (paired or alone)
# into a fixed buffer, and the chain takes one step per pair (the warm pic request: 24 steps per layer instead of 44).
# Cost model (docs/gpu-notes.md "Twenty-ninth session"): 345 + 79 -> 239 + ~40 + ~40 us per layer. H100 run 98: the
# pair kernel alone 167 us per layer (not ~40-80), yet the warm request -0.59 ms against dense runs, paired by round
# (the shorter chain and the summary's smaller writes outweigh it); run 99, the pair kernel tuned (135.5 us): -0.82 ms.
# On since; gpu_bench's variant `runs_dense`.
# the compose pass's conv kernel reads the active tokens' raw inputs where the input GEMM wrote them and writes the
# request's conv window itself (38th session); False: the raw rows copied into the source buffer, the window gathered
CONV_IN_PLACE = True
LOWRANK_PAIRS = True
# With the pairs, the pad runs' maps left unmade when the scan corrects the outputs itself (no chain reads them; 2 of
# the warm request's 26 runs). Written and checked in Triton's interpreter after run 99; H100 run 102, paired (gpu_bench's
# variant `pairs_skip_pads`): +0.17 ms (predicted -0.05 to -0.3): off.
SKIP_PAD_PAIRS = False
# The pairs made inside the chain scan (ops/triton_scan.scan_pairs, fortieth session): each step takes a seam run from
# its factors and values, y = g x + Kd^T (U - W x), then the cached map after it read in place, T_e y + S_e, so the
# pair kernel's [c | M] (~84 MB a layer at the warm 35B request) is neither written nor read back and its launch goes.
# Needs the scan's fused correction (FUSE_CORRECTION). H100 run 127 (scan_bench, the 24-step chain alone): 264.9 us a
# layer against 286.7 for the pair kernel (126.4) and the walk by position (160.3); correct on the device
# (`test_triton_scan_pairs_matches_fp64`). Off until the warm request measures it (gpu_bench's variant
# `pairs_in_scan`; runs 127-128 stalled before it): in the request the walk by position took ~4.5 us a step (run 126)
# against ~6.7 alone, likely from the pairs' maps just written and still in L2, which the fused step, reading the
# cached maps from memory, cannot have: ~19 fused steps of ~10 us could cost more than the 167 us they replace.
PAIRS_IN_SCAN = False
# A request without a cached prefix: its chain's first step marked as from zero (compose/scan.py STEP_FROM_ZERO), so the
# scan takes its S without the product T 0 (one step of the warm 35B request's ~20 a layer; the same result to the
# bit). H100 run 112, paired against it off (gpu_bench's variant `chain_from_init`): -0.11 ms on the warm request, the
# scan kernel -0.22 ms (prediction -0.15 to -0.3 ms).
CHAIN_FROM_ZERO = True


def _chained(batch) -> bool:
    """Some sequence of the batch has several runs one after another (rounds would take one call per run)."""
    return any(sum(isinstance(p, Run) for p in seq.pieces) > 1 for seq in batch.seqs)


def _isolated_ok(batch, fresh: bool) -> bool:
    """The batch is an isolated prefill the one-call form takes: sequences back to back in the flat axis, each
    from a zero state, each its seam window (>= 1 token) then the rest (>= 1 token) summarized, nothing marked."""
    if (not fresh or not batch.exact_transition or not batch.seqs or batch.seqs[0].start != 0
            or batch.seqs[-1].end != batch.input_ids.shape[0]):
        return False
    for a, b in zip(batch.seqs, batch.seqs[1:]):
        if a.end != b.start:
            return False
    for seq in batch.seqs:
        p = seq.pieces
        if not (len(p) == 2 and isinstance(p[0], Run) and isinstance(p[1], Run) and p[0].n >= 1 and p[1].n >= 1
                and not p[0].summarize and p[1].summarize and not p[0].mark and not p[1].mark
                and p[0].start == seq.start and p[0].end == p[1].start and p[1].end == seq.end):
            return False
    return True


def _phased_ok(batch, long_chains: bool = False) -> bool:
    """The phased walk pays when the runs that later runs depend on are short (seam windows between
    cached segments, the seam part of an isolated prefill): their summaries cost little. A long run
    followed by another (a prefix-mode chain of marked spans) would be summarized at full length: the
    CPU walks those in rounds. long_chains (the one-call readout walk on CUDA): every sequence of
    several pieces goes in one call whatever the run lengths: summarizing costs K extra value
    columns in one kernel, while rounds cost a kernel call and its host overhead per span per layer
    (a 20-span prefix chain: 20 calls per layer)."""
    if long_chains:
        # the readout walk corrects every run that does not open its sequence, over its whole length
        # ([tokens, H, K] x [H, K, V] in fp32): past a few thousand such tokens that costs more than the
        # rounds' extra calls (H200 run 12: an 8k isolated prefill +34% with it, +8% in rounds)
        corrected = sum(p.n for seq in batch.seqs for p in seq.pieces[1:] if isinstance(p, Run))
        long_chains = corrected <= _CORRECTED_TOKENS
    applies = many = False
    for seq in batch.seqs:
        runs = [p for p in seq.pieces if isinstance(p, Run)]
        applies = applies or len(runs) < len(seq.pieces)
        many = many or len(seq.pieces) > 1
        if not long_chains and any(r.n > _SHORT_RUN for r in runs[:-1]):
            return False
    return applies or (long_chains and many)


def dense_summary_kernel(fn, q, k, v, init, cu, summarize: bool, readout: bool = False, **kw):
    """Run a delta-rule kernel; with `summarize`, through the appended-identity trick (dense T).

    readout (with summarize, from zero initial states): also return u_t = X_t^T q_t, the outputs of the
    appended columns (X_t: the transition from the run's start to t). A run started from S0 instead
    outputs o_t = o_t(0) + S0^T u_t, since S_t = X_t S0 + S_t(0): one kernel call gives every run's
    summary and, once its true initial state is known, its outputs (LinearMixer._forward_readout).
    (The compose pass's runs, all from [0 | I], take the backend's `recurrent_gated_delta_summary`.)
    Returns (o, final, transitions) or, with readout, (o, u, final, transitions)."""
    from ..compose.transition import augment, split_augmented

    dv, dk = v.shape[-1], k.shape[-1]
    init_in = init
    if summarize:
        v, init_in = augment(v, init, dk)
    o, final = fn(q=q[None], k=k[None], v=v[None], initial_state=init_in, output_final_state=True, cu_seqlens=cu, **kw)
    if readout:                                 # views: the readout walk clones what it caches
        final, ts = split_augmented(final, dv, own=False)
        return o[0, ..., :dv], o[0, ..., dv:], final, ts
    o = o[0, ..., :dv]
    if not summarize:
        return o, final, None
    final, ts = split_augmented(final, dv)
    return o, final, ts


__all__ = ["LinearMixer", "dense_summary_kernel", "Transition", "Form"]
