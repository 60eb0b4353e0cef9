"""What the caches hold.

SegmentEntry (PIC), built from an isolated prefill of one segment (positions 0..L-1, zero states),
for the cached part: tokens [w, L) where w = min(seam, L):
    linear[layer]  LinearSummary  T [HV, K, K] fp32, S [HV, K, V] fp32 (zero start),
                                  tail [min(W-1, L-w), C]: last raw conv inputs (the next segment's warm-up)
    attn[layer]    AttnKV         k [L-w, Hkv, D] *pre-RoPE*, v [L-w, Hkv, D]: placeable at any position
PrefixNode (exact prefix cache), one per span boundary, positions fixed:
    linear[layer]  (rec [HV, K, V] fp32, conv [W-1, C]) after the span
    attn[layer]    (k post-RoPE, v, pos) of the span's own tokens
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field

import torch


def _nbytes(*tensors) -> int:
    return sum(t.element_size() * t.nelement() for t in tensors if t is not None)


@dataclass(frozen=True)
class SegmentKey:
    """One entry per model fingerprint, namespace, token ids and seam width."""

    model: str
    namespace: str
    tokens: str        # sha256 of the token ids
    seam: int

    @property
    def id(self) -> str:
        h = hashlib.sha256(f"{self.model}|{self.namespace}|{self.tokens}|{self.seam}".encode()).hexdigest()
        return f"seg-{h[:24]}"


@dataclass
class LinearSummary:
    T: torch.Tensor
    S: torch.Tensor
    tail: torch.Tensor


@dataclass
class AttnKV:
    k: torch.Tensor
    v: torch.Tensor


@dataclass
class SegmentEntry:
    key: SegmentKey
    seam_ids: tuple[int, ...]
    length: int
    seam: int                                   # w = min(policy seam, length)
    linear: dict[int, LinearSummary]
    attn: dict[int, AttnKV]
    prefill_s: float = 0.0                      # isolated prefill time (cost-aware eviction)
    created: float = field(default_factory=time.time)

    @property
    def cached_tokens(self) -> int:
        return self.length - self.seam

    @property
    def dtype(self) -> str:
        kv = next(iter(self.attn.values()), None)
        return str(kv.k.dtype).replace("torch.", "") if kv is not None else "float32"

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(s.T, s.S, s.tail) for s in self.linear.values())
        return n + sum(_nbytes(a.k, a.v) for a in self.attn.values())

    def tensors(self):
        for layer in sorted(self.linear):
            s = self.linear[layer]
            yield f"linear.{layer}.T", s.T
            yield f"linear.{layer}.S", s.S
            yield f"linear.{layer}.tail", s.tail
        for layer in sorted(self.attn):
            yield f"attn.{layer}.k", self.attn[layer].k
            yield f"attn.{layer}.v", self.attn[layer].v

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
                "seam_ids": list(self.seam_ids), "prefill_s": round(self.prefill_s, 6)}


@dataclass
class PrefixNode:
    key: str
    parent: str | None
    tokens: tuple[int, ...]
    start: int                                  # absolute position of the span's first token
    linear: dict[int, tuple[torch.Tensor, torch.Tensor]]
    attn: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]]

    @property
    def end(self) -> int:
        return self.start + len(self.tokens)

    @property
    def nbytes(self) -> int:
        n = sum(_nbytes(*v) for v in self.linear.values())
        return n + sum(_nbytes(*v) for v in self.attn.values())
