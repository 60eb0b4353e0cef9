"""Request -> PrefillPlan: what is reused, what is cold, what the compose pass forwards.

    FULL    one run over every token from a zero state
    PREFIX  the longest chain of cached span boundaries; the remaining spans are forwarded, each
            marked so its boundary is cached afterwards
    PIC /   prefix span from the exact prefix cache (computed alone and cached when cold);
    NAIVE   every segment longer than the seam: a SegmentEntry (hit, or cold -> isolated prefill);
            the compose pass forwards the prefix remainder, each segment's first w tokens, and
            the query, and composes the entries in between
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..cache.entry import PrefixNode, SegmentEntry, SegmentKey
from ..cache.prefix import PrefixCache
from ..cache.store import SegmentStore
from ..config import CacheMode, CachePolicy
from ..segment.spans import TokenizedPrompt, tokens_digest


@dataclass
class SegmentSlot:
    tokens: tuple[int, ...]
    seam: int                                  # w = min(policy seam, L)
    key: SegmentKey | None                     # None: the whole segment is a seam (nothing to cache)
    entry: SegmentEntry | None = None
    hit: bool = False
    anchor: tuple[int, ...] = ()               # what its isolated prefill runs after (CachePolicy.anchor)

    @property
    def cached(self) -> bool:
        return self.key is not None


@dataclass
class PrefillPlan:
    prompt: TokenizedPrompt
    policy: CachePolicy
    boundary_keys: list[str] = field(default_factory=list)   # prefix-cache keys of the cacheable spans
    matched: list[PrefixNode] = field(default_factory=list)  # cached boundaries, root first
    slots: list[SegmentSlot] = field(default_factory=list)

    @property
    def mode(self) -> CacheMode:
        return self.policy.mode

    @property
    def boundary_spans(self) -> list[tuple[int, ...]]:
        """Spans whose end is a prefix-cache boundary: PREFIX mode every span but the query;
        PIC modes only the prefix."""
        tp = self.prompt
        if self.mode is CacheMode.PREFIX:
            return ([tp.prefix] if tp.prefix else []) + list(tp.segments)
        if self.policy.uses_segments and tp.prefix:
            return [tp.prefix]
        return []

    @property
    def prefix_cold(self) -> bool:
        return self.policy.uses_segments and bool(self.prompt.prefix) and not self.matched

    @property
    def cold_slots(self) -> list[SegmentSlot]:
        return [s for s in self.slots if s.cached and s.entry is None]


class Planner:
    def __init__(self, fingerprint: str, segments: SegmentStore, prefix: PrefixCache):
        self.fingerprint = fingerprint
        self.segments = segments
        self.prefix = prefix

    def segment_key(self, tokens, seam: int, namespace: str, digest: str | None = None, anchor: str = "",
                    doc: tuple[str, str] | None = None) -> SegmentKey:
        d, v = doc or ("", "")
        return SegmentKey(self.fingerprint, namespace, digest or tokens_digest(tokens), seam, anchor, d, v)

    def plan(self, tp: TokenizedPrompt, policy: CachePolicy) -> PrefillPlan:
        plan = PrefillPlan(tp, policy)
        if policy.mode is CacheMode.FULL:
            return plan
        plan.boundary_keys = self.prefix.chain_keys(tp.namespace, plan.boundary_spans, tp.digest)
        plan.matched = self.prefix.match(plan.boundary_keys)
        if policy.uses_segments:
            anchor = tuple(tp.prefix) if policy.anchor == "prefix" and tp.prefix else ()
            anchor_digest = tp.digest(tp.prefix) if anchor else ""
            for i, seg in enumerate(tp.segments):
                w = min(policy.seam, len(seg))
                key = (self.segment_key(seg, policy.seam, tp.namespace, tp.digest(seg), anchor_digest, tp.doc(i))
                       if w < len(seg) else None)
                slot = SegmentSlot(seg, w, key, anchor=anchor)
                if key is not None:
                    slot.entry = self.segments.get(key)
                    slot.hit = slot.entry is not None
                plan.slots.append(slot)
        return plan
