"""Full attention over a planned batch: the shared machinery, and Qwen's gated attention.

`AttentionMixer` keeps every request's keys in a `KVBuffer` at their absolute positions and owns
what PIC adds: a summarized run captures its keys *before* any position encoding (`AttnKV`), so
placing a cached segment at a new position is one `place_keys` call at use; a marked run (prefix
boundary) captures its keys as attended, with their fixed positions (`KVSpan`). A subclass
writes `project` (queries, position-free keys, values), `place_keys` (RoPE at given positions;
identity for NoPE), optionally `attend`, and `output`.
"""

from __future__ import annotations

import torch
from torch import nn

from ..cache.entry import AttnKV, KVSpan
from ..config import ModelConfig
from ..runtime.batch import Apply, ForwardBatch
from ..runtime.state import KVBuffer, StaticKV
from .joined import JoinedWeights
from .norm import RMSNorm, ScaledRMSNorm



EVICT_EVERY = 256          # a sliding-window layer drops the keys it no longer sees once this many were appended
# the compose pass's cached keys placed and put in position order by the fill, ahead of the pass (which may run it on
# a stream of its own beside the layers before: runtime/compose_graph.py), so the pass only writes its active tokens'
# keys and values into their places. Off: 0.57 ms slower on the warm request than ordering inside the pass (H100 run
# 102, paired by round; gpu_bench's variant `order_ahead`)
ORDER_AHEAD = False
# the compose pass's cached keys and values read in place from the request's cached segments by the ordering kernel
# (an address table a layer, filled per request) instead of packed into the pass's buffers by the fill first (~134 MB
# of copies a full-attention layer on the 35B request); the request's state then takes the cached values from the
# segments after its first token. H100 run 109: -0.47 ms paired against packing (gpu_bench's variant `order_packed`; CUDA
# test test_cuda_graph_compose_order_from_entries, passed in run 108)
ORDER_FROM_ENTRIES = True


def _pack(buf: dict, parts: list) -> None:
    """The request's cached segments' position-free keys and values packed in order into the pass's buffers k, v."""
    kc = sum(p.k.shape[0] for p in parts)
    torch.cat([p.k for p in parts], out=buf["k"][:kc])
    torch.cat([p.v for p in parts], out=buf["v"][:kc])


class AttentionMixer(nn.Module):
    num_kv_heads: int
    key_dim: int
    value_dim: int
    scale: float
    window: int = 0               # sliding-window attention: a key is seen by the next `window` positions only (0: all)

    def __init__(self, layer_idx: int, ops):
        super().__init__()
        self.layer_idx = layer_idx
        self.ops = ops

    def project(self, x, batch):
        """-> (q [N, H, Dk], k [N, Hkv, Dk] position-free, v [N, Hkv, Dv], extra passed to output)."""
        raise NotImplementedError

    def place_keys(self, k: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch | None,
                   key=None) -> torch.Tensor:
        """Keys as attended at absolute `positions` (RoPE); NoPE: unchanged. positions are the batch's own
        (key None) or, with a key, positions whose tables batch.scratch[key] caches for later layers."""
        return k

    def place_queries(self, q: torch.Tensor, positions: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        return q

    def places_keys(self) -> bool:
        """Whether a key as attended depends on its position (RoPE): a cached segment's keys are then placed at
        every pass; else (NoPE) they are attended as cached."""
        return False

    def place_keys_into(self, k: torch.Tensor, out: torch.Tensor, positions: torch.Tensor, batch, key=None) -> None:
        """place_keys(k, ...) written into out."""
        out.copy_(self.place_keys(k, positions, batch, key))

    def project_placed(self, x, batch, k_out: torch.Tensor):
        """project, then the queries placed at the batch's positions and the keys placed into k_out:
        (q placed, v, extra). A layer whose norms and RoPE are one kernel overrides it (GatedAttention)."""
        q, k_raw, v, extra = self.project(x, batch)
        self.place_keys_into(k_raw, k_out, batch.positions, batch)
        return self.place_queries(q, batch.positions, batch), v, extra

    def key_tables(self, k: torch.Tensor, positions: torch.Tensor, batch, key=None):
        """(cos, sin, rotary_dim): the rotate-half RoPE tables that place keys k at `positions` (ops.order_keys
        applies them), or None where keys are placed some other way (placed by place_keys_into instead)."""
        return None

    def output(self, x, out, extra):
        raise NotImplementedError

    # -- state ---------------------------------------------------------------------------------------
    def state_bytes(self, tokens: int, elem: int) -> int:
        """Bytes of a request's state in this layer after `tokens` tokens: keys and values (elem bytes per number)
        and an int64 position per token (KVBuffer); a sliding window holds at most window + EVICT_EVERY of them."""
        if self.window:
            tokens = min(tokens, self.window + EVICT_EVERY)
        return tokens * (self.num_kv_heads * (self.key_dim + self.value_dim) * elem + 8)

    def evict(self, batch: ForwardBatch) -> None:
        """Sliding window: after a forward, each sequence's keys that no later query sees (every position before the
        next query's window) leave its buffer; checked once every EVICT_EVERY appended keys (one host
        read of the positions), so a request holds about window + EVICT_EVERY keys per windowed layer, not all."""
        for seq in batch.seqs:
            buf = seq.state.layers.get(self.layer_idx)
            if buf is None or buf.unchecked < EVICT_EVERY or not buf.n:
                continue
            buf.unchecked = 0
            # the next query (one past the newest key) sees positions newest + 2 - window on
            buf.drop_before(int(buf.pos[: buf.n].max()) - self.window + 2)

    def new_state(self, device, dtype, capacity: int) -> KVBuffer:
        return KVBuffer(self.num_kv_heads, self.key_dim, self.value_dim, dtype=dtype, device=device, capacity=capacity,
                        ordered=True)

    def restore(self, parts: list, device, dtype, capacity: int) -> KVBuffer:
        buf = self.new_state(device, dtype, capacity)
        for span in parts:
            buf.append(span.k, span.v, span.pos)
        return buf

    # -- static decode (runtime/decode.py) ---------------------------------------------------------------
    def static_state(self, rows: int, cap: int, device, dtype) -> StaticKV:
        """A sliding window: a ring of at most `window` slots (a step reads the window's keys, not the row's)."""
        if self.window:
            return StaticKV.empty(rows, min(cap, self.window), self.num_kv_heads, self.key_dim, self.value_dim,
                                  dtype=dtype, device=device, ring=True)
        return StaticKV.empty(rows, cap, self.num_kv_heads, self.key_dim, self.value_dim, dtype=dtype, device=device)

    def static_load(self, st: StaticKV, row: int, state: KVBuffer) -> None:
        st.load(row, state)

    def static_store(self, st: StaticKV, row: int, n: int, capacity: int) -> KVBuffer:
        return st.store(row, n, capacity)

    def _forward_static(self, x, batch):
        """One token per row, fixed shapes, no host sync: the key goes into its row (StaticKV.append), then the
        query attends to the row's valid slots (a sliding window's ring holds exactly the keys it sees)."""
        st: StaticKV = batch.static.layers[self.layer_idx]
        q, k_raw, v, extra = self.project(x, batch)
        q = self.place_queries(q, batch.positions, batch)
        st.append(batch.static.rows, self.place_keys(k_raw, batch.positions, batch), v, batch.positions)
        allowed = self.static_selection(x, batch, extra, st)
        return self.output(x, self.ops.decode_attention(q, st.k, st.v, st.n, scale=self.scale, allowed=allowed), extra)

    def static_selection(self, x, batch, extra, st: StaticKV):
        """A decode step's selection of each row's slots ([R, C] bool) on top of its valid ones, after the step's
        key went in; None: every valid slot (indexed attention selects, layers/indexed.py)."""
        return None

    # -- the fixed-buffer compose pass (runtime/compose_graph.py) ---------------------------------------
    graph_compose = True

    def capturable(self, device) -> bool:
        return True

    def compose_buffers(self, shape, device, dtype, shared: dict) -> dict:
        """The pass's keys and values as attended, one buffer each, in the order [held | cached | active]: the
        fill writes the held keys and values and the cached values in place, the pass its active tokens' and the
        cached keys as placed (RoPE: from the fill's position-free copy `k`; NoPE: `k` is their place itself), so
        nothing is concatenated per pass."""
        z = lambda n, d: torch.zeros(n, self.num_kv_heads, d, dtype=dtype, device=device)  # noqa: E731
        p, kc = shape.held, shape.keys
        keys, values = z(p + kc + shape.tokens, self.key_dim), z(p + kc + shape.tokens, self.value_dim)
        placed = keys[p : p + kc]
        buf = dict(keys=keys, values=values, hk=keys[:p], placed=placed, kt=keys[p + kc :], hv=values[:p],
                   v=values[p : p + kc], vt=values[p + kc :], k=z(kc, self.key_dim) if self.places_keys() else placed)
        if ORDER_AHEAD:                 # the keys and values in position order (`compose_ahead`)
            buf.update(ok=torch.empty_like(keys), ov=torch.empty_like(values))
        elif ORDER_FROM_ENTRIES and self._entries_ready(device):
            # a row of the shape's step table (runtime/compose_graph.py: copied piece by piece) holds the entries'
            # addresses: (keys, values, first cached row) per entry, then the cached rows' count
            shared.setdefault("steps", []).append(buf)
            buf["entries"] = shape.entries
        return buf

    def _entries_ready(self, device) -> bool:
        """The ordering kernel reads cached keys by address here (ORDER_FROM_ENTRIES): RoPE-placed keys, the fast
        backend's kernel on a device that runs address tables (compose/scan.py kernel_ready)."""
        from ..compose.scan import kernel_ready
        from ..ops.fast import ORDER_KERNEL, triton_kernel

        return (self.places_keys() and getattr(self, "rotary", None) is not None and self.ops.name == "fast"
                and ORDER_KERNEL and kernel_ready(device) and triton_kernel("order") is not None)

    def compose_fill(self, buf: dict, low, L: int, copies: list | None = None) -> None:
        """The keys the request holds (as attended), then its cached segments' position-free keys and
        values, packed in order. copies: a list to add the packing to as (source, destination, bytes)
        blocks, copied by the caller in one launch (else torch.cat here)."""
        from ..runtime.compose_graph import pack_blocks

        if low.held:
            k, v, _ = low.state.layers[L].view()
            buf["hk"][: low.held] = k
            buf["hv"][: low.held] = v
        parts = [e.layers[L] for e in low.entries]
        if "entries" in buf:
            self._fill_entries(buf, parts, low.kc)
            return
        if copies is not None:
            bl = [p.blocks for p in parts]
            ks = pack_blocks([b[0] for b in bl], buf["k"])
            vs = pack_blocks([b[1] for b in bl], buf["v"]) if ks is not None else None
            if vs is not None:
                copies.extend(ks)
                copies.extend(vs)
                return
        _pack(buf, parts)

    def _fill_entries(self, buf: dict, parts: list, kc: int) -> None:
        """ORDER_FROM_ENTRIES: the entries' addresses into this layer's table row (keys, values, first cached row;
        then the count), read in place by the ordering kernel; an entry not addressable so (another layout, dtype or
        device) is copied into the packed buffers and named there (the captured pass reads addresses either way)."""
        rows = buf["steps_host"].numpy()
        e = len(parts)
        kb, vb = buf["k"], buf["v"]
        sk, sv = kb.element_size() * kb[0].numel(), vb.element_size() * vb[0].numel()
        start = 0
        for i, p in enumerate(parts):
            bk, bv = p.blocks
            n = p.k.shape[0]
            if not (bk and bv and bk[2] == sk and bv[2] == sv and bk[3] is kb.dtype and bv[3] is vb.dtype
                    and bk[4] == kb.device and bv[4] == vb.device and bk[0] % 16 == 0 and bv[0] % 16 == 0):
                kb[start : start + n] = p.k
                vb[start : start + n] = p.v
                bk, bv = (kb.data_ptr() + start * sk,), (vb.data_ptr() + start * sv,)
            rows[i, :3] = (bk[0], bv[0], start)
            start += n
        rows[e, 2] = kc
        buf["parts"] = parts

    def compose_ahead(self, buf: dict, low, tables) -> None:
        """After the fill (ORDER_AHEAD): the cached keys placed at their positions (into `placed`, which the request
        keeps) and every key and value put in position order into the buffers ok / ov, as the pass would before its
        attention; the active tokens' rows there are the pass's to write (through aslot). Depends on the cached
        tensors and the tables alone, so it may run before the pass reaches this layer. tables: the request's
        ComposeBuffers (kperm, kpos; its scratch keeps the RoPE tables one request's layers share)."""
        if "ok" not in buf:
            return
        tables.active_slots()
        self._in_position_order(buf, tables.kpos, tables.kperm, tables, (buf["ok"], buf["ov"]))

    def _in_position_order(self, buf, kpos, kperm, batch, out=None):
        """keys and values of the pass in position order (ops.order_keys), the cached keys placed on the way."""
        keys, values = buf["keys"], buf["values"]
        rope = self.key_tables(buf["k"], kpos, batch, "placed")
        if rope is None:
            if self.places_keys():                                     # placed some other way than RoPE tables
                self.place_keys_into(buf["k"], buf["placed"], kpos, batch, "placed")
            return self.ops.order_keys(keys, values, kperm, out=out)
        entries = (buf["steps"], buf["entries"]) if "entries" in buf else None
        kw = dict(free=buf["k"], lo=buf["hk"].shape[0], cos=rope[0], sin=rope[1], rotary_dim=rope[2], out=out)
        try:
            return self.ops.order_keys(keys, values, kperm, entries=entries, **kw)
        except ValueError:
            if entries is None:
                raise
        # the kernel that reads by address could not run (eager only: a capture fails before): this request's
        # cached rows packed now, then ordered from there
        _pack(buf, buf["parts"])
        return self.ops.order_keys(keys, values, kperm, **kw)

    def _forward_captured(self, x, batch):
        """Every cached key placed at its position (one RoPE call from the positions table), the active
        tokens' keys after them; each query attends to the keys whose position is at most its own (pads
        never visible), taken in position order through the permutation kperm. The keys and values stay
        in the pass's outputs for the request's state."""
        c = batch.captured
        buf = c.layers[self.layer_idx]
        q, v, extra = self.project_placed(x, batch, buf["kt"])
        buf["vt"].copy_(v)
        keys, values = buf["keys"], buf["values"]
        c.outputs[self.layer_idx] = (keys, values)
        # attended in position order (keys[kperm]): query i sees the ordered keys 0..qlast[i] (a prefix: the
        # fast kernel walks only the blocks before it), keys no query may see last. Gathered copies, not read
        # through kperm in the kernel: the index load before each key block stalled its pipeline (H200 run 15:
        # 0.75 ms per call through the index, 0.51 ms on gathered keys; the two copies ~0.04 ms). The cached keys
        # are placed (RoPE, into `placed`, which the request keeps) by the same op that gathers (one launch on CUDA).
        # ORDER_AHEAD: that was done by the fill (`compose_ahead`); here only the active tokens' rows go to their places
        if "ok" in buf:
            ok, ov = buf["ok"], buf["ov"]
            ok.index_copy_(0, c.aslot, buf["kt"])
            ov.index_copy_(0, c.aslot, buf["vt"])
        else:
            ok, ov = self._in_position_order(buf, c.kpos, c.kperm, batch)
        if batch.keep is None:
            out = self.ops.position_attention(q, ok, ov, c.qlast, c.kidx, scale=self.scale, sorted_keys=True)
        else:                             # the last layer: the logits rows only (the others zero)
            out = q.new_zeros(q.shape[:2] + ov.shape[2:])
            out[batch.keep] = self.ops.position_attention(q[batch.keep], ok, ov, c.qlast[batch.keep], c.kidx,
                                                          scale=self.scale, sorted_keys=True)
        return self.output(x, out, extra)

    def compose_state(self, out, bufs, low, old, capacity: int) -> KVBuffer:
        """The request's keys after the pass: those it held (its buffer, appended to), the placed
        segments', the active tokens'."""
        keys, values = out
        p0 = bufs.shape.held
        kp, n = p0 + bufs.shape.keys, low.n
        kv = old if old is not None else self.new_state(keys.device, keys.dtype, capacity)
        kv.ordered = False                                              # placed segments
        kv.reserve(low.kc + n)
        cached_v = values[p0 : p0 + low.kc]
        if "entries" in bufs.layers[self.layer_idx]:        # (ORDER_FROM_ENTRIES: not packed; from the entries)
            cached_v = torch.cat([e.layers[self.layer_idx].v for e in low.entries])
        kv.append(keys[p0 : p0 + low.kc], cached_v, bufs.kpos[: low.kc])
        kv.append(keys[kp : kp + n], values[kp : kp + n], bufs.positions[:n])
        return kv

    # -- forward ---------------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        if batch.static is not None:
            return self._forward_static(x, batch)
        if batch.captured is not None:
            return self._forward_captured(x, batch)
        n = x.shape[0]
        q, k_raw, v, extra = self.project(x, batch)
        q = self.place_queries(q, batch.positions, batch)
        k = self.place_keys(k_raw, batch.positions, batch)
        out = None
        keep = batch.keep_rows()          # the last layer: only these rows are read after it (the others zero)
        for seq, kk, vv, pp, ordered in self.store(x, batch, k_raw, k, v):
            if keep is None:
                sl = slice(seq.start, seq.end)
                o = self.attend(q[sl], kk, vv, batch.positions[sl], pp, contiguous=ordered)
            else:
                sl = [r for r in keep if seq.start <= r < seq.end]
                if not sl:
                    continue
                sl = torch.tensor(sl, device=q.device)
                o = self.attend(q[sl], kk, vv, batch.positions[sl], pp)
            if out is None:
                out = (o.new_empty if keep is None else o.new_zeros)((n,) + tuple(o.shape[1:]))
            out[sl] = o
        if self.window:
            self.evict(batch)
        if out is None:                                   # no active tokens
            return self.no_tokens(x)
        return self.output(x, out, extra)

    def store(self, x, batch: ForwardBatch, k_raw, k, v):
        """Every sequence's keys into its buffer (its cached segments placed, then its active tokens), the captures
        of its runs (position-free keys of summarized runs, keys as attended at marks); yields (seq, keys, values,
        positions, ordered) of each sequence with active tokens, its buffer's view after the append."""
        L = self.layer_idx
        for seq in batch.seqs:
            buf = seq.state.layers.get(L)
            if buf is None:
                buf = seq.state.layers[L] = self.new_state(x.device, x.dtype, seq.state.capacity_hint)
            applies = [p for p in seq.pieces if isinstance(p, Apply)]
            ordered = buf.ordered = buf.ordered and not applies    # keys at consecutive positions, in order
            if applies:                       # every cached segment placed with one RoPE call
                kvs = [p.entry.layers[L] for p in applies]
                key = ("placed", id(seq))       # positions (and their RoPE tables): the same in every layer
                if key not in batch.scratch:
                    pos = torch.cat([torch.arange(p.position, p.position + kv.k.shape[0]) for p, kv in zip(applies, kvs)])
                    batch.scratch[key] = pos.to(x.device, non_blocking=True)
                pos = batch.scratch[key]
                kk = kvs[0].k if len(kvs) == 1 else torch.cat([kv.k for kv in kvs])
                vv = kvs[0].v if len(kvs) == 1 else torch.cat([kv.v for kv in kvs])
                buf.append(self.place_keys(kk.to(x.dtype), pos, batch, key), vv.to(x.dtype), pos)
            sl = slice(seq.start, seq.end)
            if seq.end > seq.start:           # the active tokens: the runs back to back
                buf.append(k[sl], v[sl], batch.positions[sl])
            for piece in seq.pieces:
                if isinstance(piece, Apply):
                    continue
                r = slice(piece.start, piece.end)
                if piece.summarize:
                    piece.captures[L] = AttnKV(k_raw[r].clone(), v[r].clone())
                if piece.mark:
                    piece.captures[L] = KVSpan(k[r].clone(), v[r].clone(), batch.positions[r].clone())
            if seq.end == seq.start:
                continue
            yield (seq, *buf.view(), ordered)

    def no_tokens(self, x):
        """The output of a forward with no active token (zeros of the layer's output width)."""
        return torch.zeros_like(x)

    def attend(self, q, k, v, q_pos, k_pos, contiguous: bool = False, allowed=None):
        """contiguous: k, v are in position order at consecutive positions and end with q's own tokens (a
        fresh sequence, or one continuing a cached prefix; no placed segments). allowed [Nq, Nk] bool: the keys each
        query may see besides causality (a sparse selection), or None."""
        if self.window or allowed is not None:
            return self.ops.position_attention(q, k, v, q_pos, k_pos, scale=self.scale, window=self.window,
                                               allowed=allowed)
        return self.ops.position_attention(q, k, v, q_pos, k_pos, scale=self.scale, contiguous=contiguous)


class RopeAttention(AttentionMixer):
    """Attention whose keys and queries carry RoPE from a shared `Rotary` module (rotated at use);
    rotary=None: NoPE (Nemotron-H), keys are position-free as they are."""

    def __init__(self, layer_idx: int, ops, rotary):
        super().__init__(layer_idx, ops)
        self.rotary = [rotary] if rotary is not None else None   # shared module, kept out of this module's parameters

    def _rope(self, positions, dtype, batch, key="rope"):
        if batch is None:
            return self.rotary[0].cos_sin(positions, dtype)
        key = (key, "rope", dtype, id(self.rotary[0]))     # per table: a model may have several (LFM3's per kind)
        if key not in batch.scratch:
            batch.scratch[key] = self.rotary[0].cos_sin(positions, dtype)
        return batch.scratch[key]

    def place_keys(self, k, positions, batch, key=None):
        if self.rotary is None:
            return k
        cos, sin = self._key_rope(k, positions, batch, key)
        return self.rotary[0].apply(k, cos, sin)

    def _key_rope(self, k, positions, batch, key):
        """cos, sin for keys at `positions` (the batch's own where key is None; else cached under key)."""
        if key is None and batch is not None:
            positions = batch.positions
        return self._rope(positions, k.dtype, batch, "rope" if key is None else key)

    def places_keys(self) -> bool:
        return self.rotary is not None

    def place_keys_into(self, k, out, positions, batch, key=None):
        if self.rotary is None:
            out.copy_(k)
            return
        cos, sin = self._key_rope(k, positions, batch, key)
        self.rotary[0].apply_into(k, cos, sin, out)

    def key_tables(self, k, positions, batch, key=None):
        if self.rotary is None:
            return None
        cos, sin = self._key_rope(k, positions, batch, key)
        return cos, sin, self.rotary[0].rotary_dim

    def place_queries(self, q, positions, batch):
        if self.rotary is None:
            return q
        cos, sin = self._rope(positions, q.dtype, batch)
        return self.rotary[0].apply(q, cos, sin)


def _unbiased(m) -> bool:
    return all(isinstance(p, nn.Linear) and p.bias is None for p in (m.q_proj, m.k_proj, m.v_proj))


def _qkv_parts(m) -> list:
    """q | k | v packed into one matrix at load time (layers/joined.py pack_model) where none has a bias (so a packed
    join is never a biased module's)."""
    return [(m._qkv, [m.q_proj.weight, m.k_proj.weight, m.v_proj.weight])] if _unbiased(m) else []


class GatedAttention(RopeAttention):
    """Qwen3.5 / Qwen3-Next: q_proj emits [query | gate] per head; q and k get a per-head RMSNorm,
    then partial RoPE; the output is multiplied by sigmoid(gate)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary):
        super().__init__(layer_idx, ops, rotary)
        p = cfg.params
        self.nh, self.num_kv_heads, self.hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        self.key_dim = self.value_dim = self.hd
        hs, bias = cfg.hidden_size, p.attention_bias
        self.q_proj = nn.Linear(hs, self.nh * self.hd * 2, bias=bias)
        self.k_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=bias)
        self.v_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=bias)
        self.o_proj = nn.Linear(self.nh * self.hd, hs, bias=bias)
        self.q_norm = RMSNorm(self.hd, cfg.rms_norm_eps, ops)
        self.k_norm = RMSNorm(self.hd, cfg.rms_norm_eps, ops)
        self.scale = self.hd ** -0.5
        self._kv = JoinedWeights()
        self._qkv = JoinedWeights()            # all three, where packed (layers/joined.py)

    def joined_parts(self) -> list:
        return _qkv_parts(self)

    def _projected(self, x):
        """(q [N, H, D], gate [N, H, D], k [N, Hkv, D], v [N, Hkv, D]) before the norms: views of the projections'
        outputs (of one GEMM where packed)."""
        n = x.shape[0]
        ws = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if self._qkv.packed(*ws) is not None:                           # queries, keys and values by one GEMM
            qg, k, v = self._qkv.linear(x, *ws)
        else:
            qg = self.q_proj(x)
            if self.k_proj.bias is None and self.v_proj.bias is None:    # keys and values by one GEMM
                k, v = self._kv.linear(x, self.k_proj.weight, self.v_proj.weight)
            else:
                k, v = self.k_proj(x), self.v_proj(x)
        q, gate = qg.reshape(n, self.nh, 2 * self.hd).chunk(2, dim=-1)
        return q, gate, k.view(n, self.num_kv_heads, self.hd), v.view(n, self.num_kv_heads, self.hd)

    def project(self, x, batch):
        q, gate, k, v = self._projected(x)
        return self.q_norm(q), self.k_norm(k), v, gate

    def project_placed(self, x, batch, k_out):
        """The query and key norms with their RoPE as one op each (`RMSNorm.rope`: on the fast backend one kernel
        that reads the heads in place), the keys written into k_out; equal to project, place_queries and
        place_keys_into (tests/test_compose_graph.py)."""
        if self.rotary is None:
            return super().project_placed(x, batch, k_out)
        q, gate, k, v = self._projected(x)
        cos, sin = self._rope(batch.positions, q.dtype, batch)
        r = self.rotary[0].rotary_dim
        self.k_norm.rope(k, cos, sin, r, out=k_out)
        return self.q_norm.rope(q, cos, sin, r), v, gate

    def output(self, x, out, gate):
        # out [N, H, D] times sigmoid(gate) (the strided heads of q_proj's output, read in place by the fast op)
        return self.o_proj(self.ops.act_mul(gate, out.reshape(gate.shape), "sigmoid"))


class Attention(RopeAttention):
    """Plain multi-head / grouped-query attention, with RoPE (MiniMax, Llama, Qwen2) or without
    (Nemotron-H, Jamba). Biases: `qkv_bias` / `o_bias` (default: the config's `attention_bias`
    for all four; Qwen2 has q/k/v biases and none on o_proj)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary,
                 qkv_bias: bool | None = None, o_bias: bool | None = None):
        super().__init__(layer_idx, ops, rotary)
        p = cfg.params
        self.nh, self.num_kv_heads, self.hd = p.num_attention_heads, p.num_key_value_heads, p.head_dim
        self.key_dim = self.value_dim = self.hd
        hs = cfg.hidden_size
        qkv_bias = p.attention_bias if qkv_bias is None else qkv_bias
        o_bias = p.attention_bias if o_bias is None else o_bias
        self.q_proj = nn.Linear(hs, self.nh * self.hd, bias=qkv_bias)
        self.k_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=qkv_bias)
        self.v_proj = nn.Linear(hs, self.num_kv_heads * self.hd, bias=qkv_bias)
        self.o_proj = nn.Linear(self.nh * self.hd, hs, bias=o_bias)
        self.scale = self.hd ** -0.5
        self._qkv = JoinedWeights()            # where packed (layers/joined.py)

    def joined_parts(self) -> list:
        return _qkv_parts(self)

    def project(self, x, batch):
        n = x.shape[0]
        ws = (self.q_proj.weight, self.k_proj.weight, self.v_proj.weight)
        if self._qkv.packed(*ws) is not None:                           # queries, keys and values by one GEMM
            q, k, v = self._qkv.linear(x, *ws)
        else:
            q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        return (q.reshape(n, self.nh, self.hd), k.reshape(n, self.num_kv_heads, self.hd),
                v.reshape(n, self.num_kv_heads, self.hd), None)

    def output(self, x, out, extra):
        return self.o_proj(out.reshape(x.shape[0], -1))


class HeadNormAttention(Attention):
    """Attention with an RMSNorm over each head's queries and keys (`q_norm`, `k_norm`; Qwen3's convention: Lara-mini,
    LFM3). norm: the RMSNorm class (the family's rounding)."""

    def __init__(self, cfg: ModelConfig, layer_idx: int, ops, rotary, norm=ScaledRMSNorm):
        super().__init__(cfg, layer_idx, ops, rotary)
        self.q_norm = norm(self.hd, cfg.rms_norm_eps)
        self.k_norm = norm(self.hd, cfg.rms_norm_eps)

    def project(self, x, batch):
        q, k, v, extra = super().project(x, batch)
        return self.q_norm(q), self.k_norm(k), v, extra

