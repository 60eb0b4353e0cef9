"""A SegmentEntry as one flat byte tensor plus a small picklable description, for moving it between ranks.

    pack(entry)          -> (meta, payload)   payload: uint8 [n] on the entry's device, every tensor's bytes at an
                                              offset aligned to ALIGN bytes
    unpack(meta, payload) -> SegmentEntry     its tensors copied out of `payload`, each owning its storage (the
                                              store's byte accounting counts tensors; tests/test_api.py)

meta holds the entry's scalar fields and, per layer, the part's kind and each tensor's (offset, dtype, shape), in
the order the part's constructor takes them. Layers of a part kind not listed in PARTS cannot be packed.
"""

from __future__ import annotations

import json

import torch

from .entry import AttnKV, LinearSummary, SegmentEntry, SegmentKey
from ..compose.transition import Form, Transition

ALIGN = 64                                     # bytes: a dtype view of the payload at an aligned offset is legal


def _parts(part) -> tuple[str, tuple, list[torch.Tensor | None]]:
    """(kind, extra, tensors) of one layer's part."""
    if isinstance(part, LinearSummary):
        return "linear", (part.T.form.value,), [part.T.t, part.S, part.tail]
    if isinstance(part, AttnKV):
        return "attn", (), [part.k, part.v]
    raise TypeError(f"cannot pack a {type(part).__name__}")


def _build(kind: str, extra: tuple, ts: list[torch.Tensor | None]):
    if kind == "linear":
        return LinearSummary(Transition(Form(extra[0]), ts[0]), ts[1], ts[2])
    return AttnKV(ts[0], ts[1])


def pack(entry: SegmentEntry) -> tuple[dict, torch.Tensor]:
    layers, pieces, off = [], [], 0
    for layer in sorted(entry.layers):
        kind, extra, ts = _parts(entry.layers[layer])
        spec = []
        for t in ts:
            if t is None:
                spec.append(None)
                continue
            b = t.detach().contiguous().reshape(-1).view(torch.uint8)
            pad = -off % ALIGN
            if pad:
                pieces.append(b.new_zeros(pad))
                off += pad
            spec.append((off, str(t.dtype).replace("torch.", ""), tuple(t.shape)))
            pieces.append(b)
            off += b.numel()
        layers.append((layer, kind, extra, spec))
    payload = torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.uint8)
    meta = dict(key=entry.key, seam_ids=entry.seam_ids, length=entry.length, seam=entry.seam,
                prefill_s=entry.prefill_s, created=entry.created, origin=entry.origin, layers=layers,
                nbytes=int(payload.numel()))
    return meta, payload


def unpack(meta: dict, payload: torch.Tensor) -> SegmentEntry:
    if payload.dtype != torch.uint8 or payload.numel() != meta["nbytes"]:
        raise ValueError(f"payload of {payload.numel()} {payload.dtype} for an entry of {meta['nbytes']} bytes")
    layers = {}
    for layer, kind, extra, spec in meta["layers"]:
        ts = []
        for s in spec:
            if s is None:
                ts.append(None)
                continue
            off, dtype, shape = s
            dt = getattr(torch, dtype)
            n = dt.itemsize
            for d in shape:
                n *= d
            ts.append(payload[off:off + n].view(dt).view(shape).clone())
        layers[layer] = _build(kind, extra, ts)
    return SegmentEntry(meta["key"], tuple(meta["seam_ids"]), meta["length"], meta["seam"], layers,
                        prefill_s=meta["prefill_s"], created=meta["created"], origin=meta["origin"])


def meta_to_json(meta: dict) -> str:
    """The description as JSON (for files: reading it back runs no code, unlike a pickle)."""
    d = dict(meta)
    k = d["key"]
    d["key"] = {"model": k.model, "namespace": k.namespace, "tokens": k.tokens, "seam": k.seam, "anchor": k.anchor,
                "doc": k.doc, "version": k.version}
    d["seam_ids"] = list(d["seam_ids"])
    return json.dumps(d, sort_keys=True)


def meta_from_json(text: str) -> dict:
    d = json.loads(text)
    d["key"] = SegmentKey(**d["key"])
    d["seam_ids"] = tuple(d["seam_ids"])
    d["layers"] = [(layer, kind, tuple(extra), [None if x is None else (x[0], x[1], tuple(x[2])) for x in spec])
                   for layer, kind, extra, spec in d["layers"]]
    return d
