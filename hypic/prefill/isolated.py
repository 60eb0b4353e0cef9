"""Cold prefill: segments computed in isolation (positions 0..L-1, zero states), all cold
segments of a batch in one varlen forward, turned into SegmentEntries. With an anchor
(CachePolicy.anchor = "prefix"), each segment's sequence first runs the anchor's tokens (captured
nowhere): the segment sits at positions A..A+L-1 after them, its linear layers start from the
anchor's states and its attention layers see the anchor.

Each segment is two runs: its first w tokens (the seam, recomputed at every reuse) and the
cached part [w, L), whose run is summarized: T and S over [w, L) per linear layer, the conv
tail, and position-free K / V per attention layer. Each mixer captures its own part (see
layers/linear.py, layers/attention.py); the entry holds them by layer.

A segment longer than `max_tokens` runs alone, its cached part in consecutive forwards of at most that many tokens
on one sequence state (bounded activation memory); their summaries join by the composition algebra itself:
T = T_k ... T_1, S = T_k (... (T_2 S_1 + S_2) ...) + S_k, the last part's conv tail, the parts' keys and values
end to end.
"""

from __future__ import annotations

import time

import torch

from ..cache.entry import AttnKV, LinearSummary, SegmentEntry
from ..compose.transition import compose
from ..runtime.batch import BatchBuilder
from ..runtime.state import SeqState

MIN_PART = 64                          # a long segment's last part is at least this long (it holds the conv tail)


def prefill_segments(model, slots, device, forward=None, starts=None, max_tokens: int | None = None
                     ) -> list[SegmentEntry]:
    """slots: distinct cold SegmentSlots. Returns their entries in the same order. forward: what runs the
    batch (default: the model's inference forward; training passes `model.logits`, so the entries keep
    their gradients). starts: per slot, None or the SeqState after its anchor (restored from the prefix
    cache), which then does not run again. max_tokens: a slot whose cached part is longer runs alone, in parts
    (module doc)."""
    if not slots:
        return []
    if max_tokens is not None:
        long = [i for i, s in enumerate(slots) if len(s.tokens) - s.seam > max_tokens]
        if long:
            out = [None] * len(slots)
            short = [i for i in range(len(slots)) if i not in long]
            for i, e in zip(short, prefill_segments(model, [slots[i] for i in short], device, forward,
                                                    None if starts is None else [starts[i] for i in short])):
                out[i] = e
            for i in long:
                out[i] = _prefill_in_parts(model, slots[i], device, forward, None if starts is None else starts[i],
                                           max_tokens)
            return out
    builder = BatchBuilder(device)
    works = []
    for i, slot in enumerate(slots):
        items = [("run", list(slot.tokens[: slot.seam])), ("run", list(slot.tokens[slot.seam:]), {"summarize": True})]
        start = starts[i] if starts is not None else None
        st = _sequence(slot, start)
        if slot.anchor and start is None:      # run first, captured nowhere: the segment's tokens attend to it
            items.insert(0, ("run", list(slot.anchor)))
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


def _sequence(slot, start) -> SeqState:
    """The state a segment's isolated prefill runs on: `start` (after its anchor, restored) or a fresh one."""
    if start is not None and start.length != len(slot.anchor):
        raise ValueError(f"a start state of {start.length} tokens for an anchor of {len(slot.anchor)}")
    return start if start is not None else SeqState(capacity_hint=len(slot.anchor) + len(slot.tokens))


def _parts(n: int, size: int) -> list[tuple[int, int]]:
    """[0, n) cut into consecutive parts of `size` tokens; a last part shorter than MIN_PART joins the one before."""
    cuts = list(range(0, n, size)) + [n]
    if len(cuts) > 2 and cuts[-1] - cuts[-2] < MIN_PART:
        del cuts[-2]
    return list(zip(cuts[:-1], cuts[1:]))


def _prefill_in_parts(model, slot, device, forward, start, size: int) -> SegmentEntry:
    """One segment whose cached part is longer than `size`: the seam and the first part in one forward, each next
    part in its own forward on the same sequence state, the summarized captures joined (module doc)."""
    st = _sequence(slot, start)
    rest = list(slot.tokens[slot.seam:])
    caps, elapsed = [], 0.0
    for j, (a, b) in enumerate(_parts(len(rest), size)):
        items = [("run", rest[a:b], {"summarize": True})]
        if j == 0:
            items.insert(0, ("run", list(slot.tokens[: slot.seam])))
            if slot.anchor and start is None:
                items.insert(0, ("run", list(slot.anchor)))
        builder = BatchBuilder(device)
        work = builder.add(st, items, logits="none")
        batch = builder.build()
        t0 = time.perf_counter()
        (forward or model)(batch)
        elapsed += time.perf_counter() - t0
        caps.append(dict(work.pieces[-1].captures))
    return SegmentEntry(slot.key, tuple(slot.tokens[: slot.seam]), len(slot.tokens), slot.seam,
                        {layer: _join([c[layer] for c in caps]) for layer in caps[0]}, prefill_s=elapsed,
                        origin=len(slot.anchor))


def _join(parts: list):
    """The summary of consecutive runs from theirs: LinearSummary by composition, AttnKV end to end."""
    first = parts[0]
    if isinstance(first, AttnKV):
        return AttnKV(torch.cat([p.k for p in parts]), torch.cat([p.v for p in parts]))
    if not isinstance(first, LinearSummary):
        raise TypeError(f"cannot join captures of type {type(first).__name__}")
    t, s = first.T, first.S
    for p in parts[1:]:
        t, s = t.then(p.T), compose(s, p.T, p.S)
    return LinearSummary(t, s, parts[-1].tail)
