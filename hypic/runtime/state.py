"""Per-request running state, owned by the runtime and advanced layer by layer by the forward pass.

`SeqState.layers[layer]` holds what that layer's mixer keeps between forwards; the mixer creates
it (`new_state` / `restore`) and is the only code that reads it. Layouts, written here where the
types are defined:
    LinearState  rec  [H, K, V] fp32   recurrent state (heads, key axis the transition acts on, value axis)
                 conv [W-1, C] | None  the last W-1 raw conv inputs (model dtype); None without a conv
    KVBuffer     k, v, pos             keys as the attention reads them (RoPE'd at their absolute
                                       position), values and positions of every token the request
                                       has seen (prefix, placed segments, fresh tokens), any order
    StaticKV     k, v [R, Hkv, C, D], pos [R, C], n [R]
                                       fixed-shape keys of R sequences for the graph-captured
                                       decode (runtime/decode.py); n (on the device) counts the
                                       valid slots of each row; a sliding-window layer's is a ring
                                       (the key at position p in slot p % C, C <= window)
Layers never mutate a tensor they were given: they assign new ones, so states loaded from a
cache node or a segment entry can be shared without copies.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


def nbytes(*tensors) -> int:
    return sum(t.element_size() * t.nelement() for t in tensors if t is not None)


@dataclass
class LinearState:
    rec: torch.Tensor
    conv: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return nbytes(self.rec, self.conv)

    def fork(self) -> "LinearState":
        return LinearState(self.rec, self.conv)

    def tensors(self):
        yield "rec", self.rec
        if self.conv is not None:
            yield "conv", self.conv


class KVBuffer:
    """Growable [capacity, Hkv, D] key/value storage with an absolute position per slot."""

    def __init__(self, num_kv_heads: int, head_dim: int, value_dim: int, *, dtype, device, capacity: int = 64,
                 ordered: bool = False):
        capacity = max(capacity, 1)
        # ordered: the keys so far were appended at consecutive positions from 0, in order (a fresh buffer
        # that has only seen runs, or a cached prefix restored span by span); placed segments break it
        self.ordered = ordered
        self.k = torch.empty(capacity, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.v = torch.empty(capacity, num_kv_heads, value_dim, dtype=dtype, device=device)
        self.pos = torch.empty(capacity, dtype=torch.long, device=device)
        self.n = 0
        self.unchecked = 0             # keys appended since a sliding window last dropped the ones it no longer sees

    def reserve(self, extra: int) -> None:
        need = self.n + extra
        if need <= self.k.shape[0]:
            return
        cap = max(need, 2 * self.k.shape[0])
        for name in ("k", "v", "pos"):
            old = getattr(self, name)
            new = old.new_empty((cap,) + tuple(old.shape[1:]))
            new[: self.n] = old[: self.n]
            setattr(self, name, new)

    def append(self, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor) -> None:
        m = k.shape[0]
        self.reserve(m)
        self.k[self.n : self.n + m] = k
        self.v[self.n : self.n + m] = v
        self.pos[self.n : self.n + m] = pos
        self.n += m
        self.unchecked += m

    def drop_before(self, lo: int) -> int:
        """Removes the keys at positions below lo (those a sliding window no longer lets any later query see),
        keeping the others in their order, and gives back the storage beyond twice what is left (a long prefill's
        buffer shrinks to the window's size); returns how many went."""
        n = self.n
        keep = self.pos[:n] >= lo
        idx = keep.nonzero()[:, 0]
        m = idx.shape[0]
        if m == n:
            return 0
        cap = max(2 * m, 64)
        if self.k.shape[0] > cap:                     # new, smaller tensors: the old storage is released
            for name in ("k", "v", "pos"):
                old = getattr(self, name)
                setattr(self, name, torch.cat([old[idx], old.new_empty((cap - m,) + tuple(old.shape[1:]))]))
        else:
            self.k[:m] = self.k[idx]
            self.v[:m] = self.v[idx]
            self.pos[:m] = self.pos[idx]
        self.n = m
        return n - m

    def view(self):
        return self.k[: self.n], self.v[: self.n], self.pos[: self.n]

    def fork(self) -> "KVBuffer":
        """A buffer of its own with the same keys (capacity kept, so appends do not reallocate)."""
        k = self.k
        other = KVBuffer(k.shape[1], k.shape[2], self.v.shape[2], dtype=k.dtype, device=k.device, capacity=k.shape[0],
                         ordered=self.ordered)
        other.append(*self.view())
        return other

    @property
    def nbytes(self) -> int:
        return nbytes(self.k, self.v, self.pos)


@dataclass
class StaticKV:
    """R rows of C key/value slots at fixed addresses (CUDA-graph decode); the first n[r] of row r hold
    its keys (as attended) in the order they were appended, pos[r] their absolute positions.

    ring (a sliding-window layer, C at most its window): the key at position p sits in slot p % C, so a decode
    step's key overwrites the one C positions back, which a window of C no longer lets any query see; the
    row's positions are 0 .. P-1 (every attention layer keeps a key per position), so while P < C the valid
    slots are the first P and n counts them; from then on all C (n = C). A layer whose window is wider than
    C holds P < C positions by the decoder's capacity rule (C covers every row's next position), so its ring
    never wraps before the buffers grow."""

    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor
    n: torch.Tensor
    ring: bool = False

    @classmethod
    def empty(cls, rows: int, cap: int, num_kv_heads: int, key_dim: int, value_dim: int, *, dtype, device,
              ring: bool = False):
        return cls(torch.zeros(rows, num_kv_heads, cap, key_dim, dtype=dtype, device=device),
                   torch.zeros(rows, num_kv_heads, cap, value_dim, dtype=dtype, device=device),
                   torch.zeros(rows, cap, dtype=torch.long, device=device),
                   torch.zeros(rows, dtype=torch.long, device=device), ring)

    def load(self, row: int, buf: KVBuffer) -> None:
        k, v, pos = buf.view()
        n, cap = k.shape[0], self.k.shape[2]
        if self.ring:
            self.pos[row].fill_(-1)                       # slots holding no key of this row (store skips them)
            self.n[row] = 0
            if not n:
                return
            # what the next query (position P = newest + 1) can still see once its own key is in slot P % C
            nxt = int(pos.max()) + 1
            keep = (pos > nxt - cap).nonzero()[:, 0]
            want = min(nxt, cap - 1)
            if keep.numel() != want:
                raise ValueError(f"a sliding-window row holds {keep.numel()} of the {want} keys before position "
                                 f"{nxt} that its ring needs (positions missing or repeated)")
            slots = pos[keep] % cap
            self.k[row].index_copy_(1, slots, k[keep].transpose(0, 1))
            self.v[row].index_copy_(1, slots, v[keep].transpose(0, 1))
            self.pos[row].index_copy_(0, slots, pos[keep])
            self.n[row] = want
            return
        if n > cap:
            raise ValueError(f"{n} keys do not fit {cap} slots")
        self.k[row, :, :n] = k.transpose(0, 1)
        self.v[row, :, :n] = v.transpose(0, 1)
        self.pos[row, :n] = pos
        self.n[row] = n

    def append(self, rows: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> None:
        """One key per row at fixed shapes, no host sync (a decode step): at slot n (clamped to the last slot
        for idle rows, whose results are discarded), or in a ring at slot position % C."""
        cap = self.k.shape[2]
        at = positions % cap if self.ring else self.n.clamp(max=cap - 1)
        self.k[rows, :, at] = k
        self.v[rows, :, at] = v
        self.pos[rows, at] = positions
        self.n.copy_((self.n + 1).clamp(max=cap) if self.ring else at + 1)

    def store(self, row: int, n: int, capacity: int) -> KVBuffer:
        """Row `row` (n valid slots; a ring: the keys it holds, in position order) as a KVBuffer with its own
        memory."""
        hkv, d, dv = self.k.shape[1], self.k.shape[3], self.v.shape[3]
        if self.ring:
            held = (self.pos[row] >= 0).nonzero()[:, 0]
            idx = held[self.pos[row, held].argsort()]
            n = idx.numel()
            k, v, pos = self.k[row][:, idx], self.v[row][:, idx], self.pos[row, idx]
        else:
            k, v, pos = self.k[row, :, :n], self.v[row, :, :n], self.pos[row, :n]
        buf = KVBuffer(hkv, d, dv, dtype=self.k.dtype, device=self.k.device, capacity=max(n, capacity))
        buf.append(k.transpose(0, 1), v.transpose(0, 1), pos)
        return buf

    def clear(self, row: int) -> None:
        self.n[row] = 0

    @property
    def nbytes(self) -> int:
        return nbytes(self.k, self.v, self.pos, self.n)


class SeqState:
    """Everything a request needs to continue: one state object per stateful layer."""

    def __init__(self, length: int = 0, capacity_hint: int = 64):
        self.layers: dict[int, Any] = {}
        self.length = length            # positions 0 .. length-1 are covered
        self.capacity_hint = capacity_hint

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.layers.values())
