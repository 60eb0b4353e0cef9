"""What the caches hold. Each stateful layer's mixer builds its own part from its captures; the
entries only store the parts by layer and account for their bytes.

SegmentEntry (PIC), built from an isolated prefill of one segment (positions 0..L-1, zero states; or, with an
anchor, after the anchor's tokens: positions A..A+L-1, `origin` = A), for the cached part: tokens [w, L) where
w = min(seam, L):
    layers[l]  LinearSummary  T (a Transition: scalar [H], diagonal [H, K] or dense [H, K, K], fp32),
                              S [H, K, V] fp32 (zero start; RoPE'd-key families at position `origin`),
                              tail [min(W-1, L-w), C] | None: last raw conv inputs (the next span's warm-up)
               AttnKV         k [L-w, Hkv, Dk] placeable at any position (pre-RoPE, or no RoPE at all),
                              v [L-w, Hkv, Dv]
PrefixNode (exact prefix cache), one per span boundary, positions fixed:
    layers[l]  LinearState    (rec, conv) after the span
               KVSpan         (k as attended, v, pos) of the span's own tokens
"""

from __future__ import annotations

import functools
import hashlib
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ..compose.transition import Transition
from ..runtime.state import nbytes


@dataclass(frozen=True)
class SegmentKey:
    """One entry per model fingerprint, namespace, token ids, seam width, anchor (what the isolated prefill ran
    after: "" for nothing, else the sha256 of those ids) and, for a tagged segment, document id and version."""

    model: str
    namespace: str
    tokens: str        # sha256 of the token ids
    seam: int
    anchor: str = ""
    doc: str = ""      # the document the segment came from (hypic.Segment.doc_id), "" if untagged
    version: str = ""

    @property
    def id(self) -> str:
        text = f"{self.model}|{self.namespace}|{self.tokens}|{self.seam}" + (f"|{self.anchor}" if self.anchor else "")
        if self.doc:
            text += f"|doc={self.doc}|v={self.version}"
        h = hashlib.sha256(text.encode()).hexdigest()
        return f"seg-{h[:24]}"


@dataclass(frozen=True)
class LinearSummary:
    T: Transition
    S: torch.Tensor
    tail: torch.Tensor | None = None

    @property
    def nbytes(self) -> int:
        return self.T.nbytes + nbytes(self.S, self.tail)

    def tensors(self):
        yield f"T.{self.T.form.value}", self.T.t
        yield "S", self.S
        if self.tail is not None:
            yield "tail", self.tail

    @functools.cached_property
    def tail_block(self):
        """`block` of the conv tail, made once."""
        return block(self.tail)

    @functools.cached_property
    def addresses(self) -> tuple[int, int] | None:
        """The data addresses of T and S where both are fp32, contiguous and 16-byte aligned (the compose pass's
        scan and pair kernels read them in place, by address, the pairs 16 bytes at a time); None otherwise. Made
        once: a cached summary is never written."""
        t, s = self.T.t, self.S
        if all(x.dtype == torch.float32 and x.is_contiguous() and x.data_ptr() % 16 == 0 for x in (t, s)):
            return t.data_ptr(), s.data_ptr()
        return None


def block(t: torch.Tensor | None, skip: int = 0):
    """(data address after `skip` rows, rows, bytes per row, dtype, device) of a contiguous tensor (rows on its
    first axis), for copies by address (runtime/compose_graph.py pack_blocks); None where it is not contiguous."""
    if t is None or t.dim() == 0 or not t.is_contiguous():
        return None
    rb = t.element_size() * (t.numel() // t.shape[0] if t.shape[0] else 0)
    return t.data_ptr() + skip * rb, t.shape[0] - skip, rb, t.dtype, t.device


@dataclass(frozen=True)
class AttnKV:
    k: torch.Tensor
    v: torch.Tensor

    @functools.cached_property
    def blocks(self):
        """`block` of k and of v, made once (a cached entry is never written)."""
        return block(self.k), block(self.v)

    @property
    def nbytes(self) -> int:
        return nbytes(self.k, self.v)

    def tensors(self):
        yield "k", self.k
        yield "v", self.v


@dataclass(frozen=True)
class KVSpan:
    k: torch.Tensor
    v: torch.Tensor
    pos: torch.Tensor

    @property
    def nbytes(self) -> int:
        return nbytes(self.k, self.v, self.pos)

    def tensors(self):
        yield "k", self.k
        yield "v", self.v
        yield "pos", self.pos


def _layer_tensors(layers: dict[int, Any]):
    for layer in sorted(layers):
        for name, t in layers[layer].tensors():
            yield f"{layer}.{name}", t


@dataclass
class SegmentEntry:
    key: SegmentKey
    seam_ids: tuple[int, ...]
    length: int
    seam: int                                   # w = min(policy seam, length)
    layers: dict[int, Any]                      # layer -> LinearSummary | AttnKV
    prefill_s: float = 0.0                      # isolated prefill time (cost-aware eviction)
    created: float = field(default_factory=time.time)
    origin: int = 0                             # the segment's first position in its isolated prefill (its anchor's
                                                # length): RoPE'd linear states are stored there

    @property
    def cached_tokens(self) -> int:
        return self.length - self.seam

    @functools.cached_property
    def tail_len(self) -> int:
        """Rows of the conv tail its linear layers keep (0: none); the same in every layer."""
        for part in self.layers.values():
            tail = getattr(part, "tail", None)
            if tail is not None:
                return int(tail.shape[0])
        return 0

    @property
    def dtype(self) -> str:
        kv = next((p for p in self.layers.values() if isinstance(p, AttnKV)), None)
        return str(kv.k.dtype).replace("torch.", "") if kv is not None else "float32"

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers.values())

    def tensors(self):
        yield from _layer_tensors(self.layers)

    def checksum(self) -> str:
        """sha256 over every tensor's bytes in a fixed order (for persistence and integrity checks)."""
        h = hashlib.sha256()
        for name, t in self.tensors():
            h.update(name.encode())
            h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
        return h.hexdigest()

    def describe(self) -> dict:
        return {"key": self.key.id, "namespace": self.key.namespace, "length": self.length, "seam": self.seam,
                "cached_tokens": self.cached_tokens, "bytes": self.nbytes, "dtype": self.dtype,
                "seam_ids": list(self.seam_ids), "prefill_s": round(self.prefill_s, 6), "origin": self.origin}


@dataclass
class PrefixNode:
    key: str
    parent: str | None
    tokens: tuple[int, ...]
    start: int                                  # absolute position of the span's first token
    layers: dict[int, Any]                      # layer -> LinearState | KVSpan
    namespace: str = ""                         # the tenant whose requests made it (invalidation by namespace)

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.layers.values())
