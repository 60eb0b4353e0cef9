"""Cold prefill: segments computed in isolation (positions 0..L-1, zero states), all cold
segments of a batch in one varlen forward, turned into SegmentEntries. With an anchor
(CachePolicy.anchor = "prefix"), each segment's sequence first runs the anchor's tokens (captured
nowhere): the segment sits at positions A..A+L-1 after them, its linear layers start from the
anchor's states and its attention layers see the anchor.

Each segment is two runs: its first w tokens (the seam, recomputed at every reuse) and the
cached part [w, L), whose run is summarized: T and S over [w, L) per linear layer, the conv
tail, and position-free K / V per attention layer. Each mixer captures its own part (see
layers/linear.py, layers/attention.py); the entry holds them by layer.
"""

from __future__ import annotations

import time

from ..cache.entry import SegmentEntry
from ..runtime.batch import BatchBuilder
from ..runtime.state import SeqState


def prefill_segments(model, slots, device, forward=None, starts=None) -> list[SegmentEntry]:
    """slots: distinct cold SegmentSlots. Returns their entries in the same order. forward: what runs the
    batch (default: the model's inference forward; training passes `model.logits`, so the entries keep
    their gradients). starts: per slot, None or the SeqState after its anchor (restored from the prefix
    cache), which then does not run again."""
    if not slots:
        return []
    builder = BatchBuilder(device)
    works = []
    for i, slot in enumerate(slots):
        items = [("run", list(slot.tokens[: slot.seam])), ("run", list(slot.tokens[slot.seam:]), {"summarize": True})]
        start = starts[i] if starts is not None else None
        if start is not None and start.length != len(slot.anchor):
            raise ValueError(f"a start state of {start.length} tokens for an anchor of {len(slot.anchor)}")
        if slot.anchor and start is None:      # run first, captured nowhere: the segment's tokens attend to it
            items.insert(0, ("run", list(slot.anchor)))
        st = start if start is not None else SeqState(capacity_hint=len(slot.anchor) + len(slot.tokens))
        works.append(builder.add(st, items, logits="none"))
    batch = builder.build()
    t0 = time.perf_counter()
    (forward or model)(batch)
    elapsed = time.perf_counter() - t0
    total = sum(len(s.tokens) for s in slots)
    entries = []
    for slot, work in zip(slots, works):
        cap = work.pieces[-1].captures              # the summarized run: layer -> LinearSummary | AttnKV
        entries.append(SegmentEntry(slot.key, tuple(slot.tokens[: slot.seam]), len(slot.tokens), slot.seam,
                                    dict(cap), prefill_s=elapsed * len(slot.tokens) / total, origin=len(slot.anchor)))
    return entries
