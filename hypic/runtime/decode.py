"""Decode over fixed buffers, captured once as a CUDA graph and replayed every step.

The plain decode step (`Engine.step` in "dynamic" mode) plans a ForwardBatch per step: every layer
walks the requests in Python, KV buffers grow, and on a GPU the step is host-bound (thousands of
kernel launches for a few microseconds of work each). Here the running requests occupy rows of
fixed-shape buffers, one per stateful layer:

    linear layers   rec [R, H, K, V] fp32, conv [R, W-1, C]         (LinearMixer.static_state)
    attention       k, v [R, Hkv, C, D], pos [R, C], n [R]          (runtime.state.StaticKV; a sliding window's
                    rows are rings of min(C, window) slots)

and one step is a pure function of (ids [R], positions [R]) that updates them in place and returns
logits [R, V] (`ForwardBatch.static`: every mixer has a static branch). No host sync, no shape that
changes between steps: on CUDA it is captured once per (rows, capacity) bucket and replayed.

Rows are slots: a request is loaded into a free row when it first decodes (its SeqState's layers
copied in), and leaves when it finishes; rows hold KV for the next `ahead` tokens and grow (a
rebuild) when one runs out; a request that leaves unfinished gets its state written
back first, so `SeqState` stays the truth outside this module. When the rows or the KV capacity
run out, the buffers are rebuilt at the next bucket (rows: powers of two; KV slots: eighths of a
power of two) and the graph recaptured.
Idle rows compute on a dummy token and are ignored.
"""

from __future__ import annotations

import logging

import torch

from .batch import ForwardBatch
from .graphs import capture_forward

log = logging.getLogger("hypic.decode")


def _bucket(n: int, least: int) -> int:
    """Rows: the next power of two (at least `least`)."""
    b = least
    while b < n:
        b *= 2
    return b


def _cap_bucket(n: int, least: int) -> int:
    """KV slots: n rounded up to an eighth of its power of two (at most 12.5% of attention reads wasted
    on empty slots, and few distinct shapes to capture)."""
    if n <= least:
        return least
    step = max(least, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


class StaticDecode:
    """The fixed buffers of R rows with KV capacity C, and the per-step inputs."""

    def __init__(self, model, rows: int, cap: int, device, dtype):
        self.rows_n, self.cap = rows, cap
        self.mixers = model.mixers
        self.layers = {l: m.static_state(rows, cap, device, dtype) for l, m in self.mixers.items()}
        self.ids = torch.zeros(rows, dtype=torch.long, device=device)
        self.pos = torch.zeros(rows, dtype=torch.long, device=device)
        self.rows = torch.arange(rows, device=device)
        self.cu = torch.arange(rows + 1)              # R runs of one token (CPU: kernels read lengths on the host)

    def batch(self) -> ForwardBatch:
        return ForwardBatch(self.ids, self.pos, [], self.rows, static=self)

    def load(self, row: int, state) -> None:
        for l, m in self.mixers.items():
            m.static_load(self.layers[l], row, state.layers[l])

    def store(self, row: int, state, kv_len: int) -> None:
        for l, m in self.mixers.items():
            state.layers[l] = m.static_store(self.layers[l], row, kv_len, state.capacity_hint)

    def clear(self, row: int) -> None:
        for st in self.layers.values():
            if hasattr(st, "clear"):
                st.clear(row)
            else:
                st.rec[row].zero_()
                if st.conv is not None:
                    st.conv[row].zero_()

    def reset(self) -> None:
        for r in range(self.rows_n):
            self.clear(r)


class StaticDecoder:
    """Engine-side owner of the rows: `step(reqs)` gives each request's next-token logits.

    graphs: capture the step as a CUDA graph (CUDA only); otherwise the same buffers run eagerly
    (what the CPU tests compare against the dynamic step)."""

    def __init__(self, model, device, dtype, *, graphs: bool, min_rows: int = 1, min_cap: int = 256,
                 ahead: int = 256):
        self.model, self.device, self.dtype = model, torch.device(device), dtype
        self.graphs = graphs and self.device.type == "cuda"
        self.min_rows, self.min_cap = min_rows, min_cap
        self.ahead = ahead                    # KV slots reserved past what a row holds (grown on demand)
        self.max_len = model.config.max_position_embeddings
        self.static: StaticDecode | None = None
        self.graph = None
        self.logits: torch.Tensor | None = None
        self.pinned: list = []                # tensors a captured graph reads by address (kept alive)
        self.row_of: dict[int, int] = {}      # id(request) -> row
        self.reqs: dict[int, object] = {}     # id(request) -> request (rows in use)
        self.kv_len: dict[int, int] = {}      # id(request) -> keys held in its row (host count)
        self.captures = 0                     # CUDA graphs captured
        self.capture_error: str | None = None  # why the last capture failed (then steps run eagerly)
        self.builds = 0                       # buffer sets made (first use and every growth)

    # -- rows ------------------------------------------------------------------------------------------
    def _need(self, r) -> int:
        """KV slots request r needs for its next `ahead` tokens (not its whole max_tokens: a row's
        capacity grows when it runs out, so a long max_tokens does not reserve memory up front)."""
        held = self._kv_len(r.state) if id(r) not in self.row_of else self.kv_len[id(r)]
        return min(held + min(self.ahead, max(1, r.params.max_tokens - len(r.output_ids))) + 1, self.max_len + 1)

    @torch.inference_mode()
    def release(self, r, write_back: bool = False) -> None:
        """Free r's row; write_back: copy its state into r.state first (it goes on elsewhere)."""
        key = id(r)
        row = self.row_of.pop(key, None)
        if row is None:
            return
        self.reqs.pop(key)
        kv = self.kv_len.pop(key)
        if write_back and r.state is not None:
            self.static.store(row, r.state, kv)
        self.static.clear(row)

    @torch.inference_mode()
    def _rebuild(self, rows: int, cap: int) -> None:
        """New buffers (and graph) at (rows, cap); the requests in rows move over through their states."""
        moving = list(self.reqs.values())
        for r in moving:
            self.release(r, write_back=True)
        self.static = self.graph = self.logits = None
        self.pinned = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()
        self.static = StaticDecode(self.model, rows, cap, self.device, self.dtype)
        self.builds += 1
        if self.graphs:
            self._capture()
        for r in moving:
            self._admit(r)

    def _capture(self) -> None:
        st = self.static
        batch = st.batch()
        try:
            self.graph, self.logits, self.pinned = capture_forward(self.model, batch, self.device)
            self.captures += 1
        except Exception as e:  # an op that cannot be captured: the same buffers, run eagerly
            from .graphs import host_read_site

            site = host_read_site(self.model, batch)
            self.capture_error = f"{type(e).__name__}: {e}" + (f"; host read: {site}" if site else "")
            log.warning("CUDA graph capture failed (%s); decoding eagerly", self.capture_error)
            self.graphs, self.graph, self.logits = False, None, None
        st.reset()

    def _admit(self, r) -> None:
        free = sorted(set(range(self.static.rows_n)) - set(self.row_of.values()))
        row = free[0]
        self.static.load(row, r.state)
        key = id(r)
        self.row_of[key], self.reqs[key] = row, r
        self.kv_len[key] = self._kv_len(r.state)

    def _kv_len(self, state) -> int:
        """Slots a request's row holds: one per position in each full-attention layer (a sliding-window layer
        drops the keys its window has passed, and its ring places keys by position, so its count is not it)."""
        n = state.length
        for l, s in state.layers.items():
            if hasattr(s, "n") and not getattr(self.model.mixers[l], "window", 0):
                return max(n, int(s.n))
        return n

    # -- one step ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self, reqs: list) -> torch.Tensor:
        keys = {id(r) for r in reqs}
        for key in [k for k in self.reqs if k not in keys]:      # left the running set
            r = self.reqs[key]
            self.release(r, write_back=r.state is not None and not r.finished)
        new = [r for r in reqs if id(r) not in self.row_of]
        full = [r for r in reqs if id(r) in self.row_of and self.kv_len[id(r)] + 1 > self.static.cap]
        if new or full:
            cap_need = max(self._need(r) for r in new + full)
            if self.static is None or len(reqs) > self.static.rows_n or cap_need > self.static.cap:
                rows = _bucket(len(reqs), self.min_rows) if self.static is None else max(
                    self.static.rows_n, _bucket(len(reqs), self.min_rows))
                cap = max(_cap_bucket(cap_need, self.min_cap), self.static.cap if self.static else 0)
                self._rebuild(rows, cap)
        for r in new:
            self._admit(r)
        st = self.static
        ids = torch.zeros(2, st.rows_n, dtype=torch.long)
        rows = []
        for r in reqs:
            row = self.row_of[id(r)]
            rows.append(row)
            ids[0, row], ids[1, row] = r.output_ids[-1], r.state.length
            r.state.length += 1
            self.kv_len[id(r)] += 1
        ids = ids.to(self.device, non_blocking=True)
        st.ids.copy_(ids[0])
        st.pos.copy_(ids[1])
        if self.graph is not None:
            self.graph.replay()
            logits = self.logits
        else:
            logits = self.model(st.batch())
        return logits[torch.tensor(rows).to(logits.device, non_blocking=True)]
