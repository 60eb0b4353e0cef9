"""Prompt -> token spans. Each span (prefix, every segment, query) is tokenized on its own; the
request's token sequence is their concatenation, for every mode and baseline alike."""

from __future__ import annotations

import hashlib
import sys
from array import array
from dataclasses import dataclass, field
from typing import Sequence

import numpy as np

from ..errors import InvalidRequestError
from ..types import Prompt, Segment


@dataclass(frozen=True)
class TokenizedPrompt:
    prefix: tuple[int, ...]
    segments: tuple[tuple[int, ...], ...]
    query: tuple[int, ...]
    namespace: str
    # the digests made while validating, by the span's identity (id of its tuple; the spans live as long as this)
    known_digests: dict = field(default_factory=dict, compare=False, repr=False)
    docs: tuple = ()            # per segment: (doc_id, version or "") or None; empty: no segment is tagged

    def doc(self, i: int) -> tuple[str, str] | None:
        return self.docs[i] if self.docs else None

    def digest(self, span: tuple[int, ...]) -> str:
        """tokens_digest(span), made once per span (while validating, from the ids already in an array)."""
        d = self.known_digests.get(id(span))
        if d is None:
            d = self.known_digests[id(span)] = tokens_digest(span)
        return d

    @property
    def spans(self) -> tuple[tuple[int, ...], ...]:
        """Non-empty spans in order: [prefix], segments..., [query]."""
        out = ([self.prefix] if self.prefix else []) + list(self.segments) + ([self.query] if self.query else [])
        return tuple(out)

    @property
    def token_ids(self) -> list[int]:
        out: list[int] = []
        for span in self.spans:            # list.extend per span: ~5x faster than a flat comprehension (32k ids)
            out.extend(span)
        return out

    def __len__(self) -> int:
        return len(self.prefix) + sum(map(len, self.segments)) + len(self.query)


def tokens_digest(ids: Sequence[int]) -> str:
    """sha256 of the length (8 bytes) and every id as 4 little-endian bytes, hashed in one update (a
    call per id cost ~1 ms per 1,600-token segment: 20 segments were ~20 ms of a warm request)."""
    a = array("I", ids)
    if sys.byteorder != "little":
        a.byteswap()
    return _sha256_ids(len(ids), a.tobytes())


def _sha256_ids(n: int, le_u32: bytes) -> str:
    """The digest of n ids given as 4 little-endian bytes each: sha256 of the length (8 bytes), then the ids."""
    h = hashlib.sha256()
    h.update(n.to_bytes(8, "little"))
    h.update(le_u32)
    return h.hexdigest()


_U32 = next((c for c in "IL" if array(c).itemsize == 4), None)    # the array typecode of 4-byte unsigned ints


def _ids_u32(ids: tuple, vocab_size: int) -> np.ndarray | None:
    """The ids as a uint32 array if every one is an int (not a bool) in [0, vocab_size) (vocab_size <= 2^32),
    else None; checked in C: array('I') takes non-negative integers below 2^32 only (a float, a string,
    None, a negative or a larger id raise), numpy finds the upper bound. bool is an int subclass that array
    takes as 0 / 1, so where 0 or 1 occur the exact type test decides. Its bytes are the digest's (4
    little-endian bytes per id on a little-endian host): a 32k-id prompt in ~0.6 ms instead of ~1.8."""
    if _U32 is None:
        return None
    try:
        a = np.frombuffer(array(_U32, ids), dtype=np.uint32)
    except (TypeError, OverflowError):
        return None
    if a.max() >= vocab_size:
        return None
    if (a <= 1).any() and not set(map(type, ids)) <= {int}:
        return None
    return a


def _digest_of(a: np.ndarray) -> str:
    """tokens_digest of ids already in a uint32 array: the same bytes."""
    return _sha256_ids(len(a), a.astype("<u4", copy=False).tobytes())


def tokenize_prompt(prompt: Prompt, tokenizer, *, vocab_size: int, max_len: int, max_segments: int,
                    default_namespace: str) -> TokenizedPrompt:
    """Validates and tokenizes. Raises InvalidRequestError with the reason; touches no state."""
    if not isinstance(prompt, Prompt):
        raise InvalidRequestError(f"expected a hypic.Prompt, got {type(prompt).__name__}")

    digests: dict = {}

    def span(x, what):
        if x is None:
            return ()
        if isinstance(x, str):
            if tokenizer is None:
                raise InvalidRequestError(f"{what} is text but the model has no tokenizer; pass token ids")
            return tuple(tokenizer.encode(x))
        if isinstance(x, (list, tuple)):
            ids = tuple(x)
            if not ids:
                return ids
            a = _ids_u32(ids, vocab_size) if vocab_size <= 1 << 32 else None
            if a is None:                            # the loop only names what is wrong
                for t in ids:
                    if isinstance(t, bool) or not isinstance(t, int):
                        raise InvalidRequestError(f"{what} token ids must be integers, got {type(t).__name__}")
                    if not 0 <= t < vocab_size:
                        raise InvalidRequestError(f"{what} token id {t} is outside the vocabulary [0, {vocab_size})")
            else:
                digests[id(ids)] = _digest_of(a)     # (the planner's segment key: no second conversion)
            return ids
        raise InvalidRequestError(f"{what} must be a string or a list of token ids, got {type(x).__name__}")

    segs = prompt.segments or ()
    if isinstance(segs, (str, bytes)):
        raise InvalidRequestError("segments must be a list of strings or token-id lists, not a single string")
    if len(segs) > max_segments:
        raise InvalidRequestError(f"too many segments: {len(segs)} > {max_segments}")
    prefix = span(prompt.prefix, "prefix")
    docs = tuple((s.doc_id, s.version or "") if isinstance(s, Segment) and s.doc_id is not None else None
                 for s in segs)
    segments = tuple(span(s.content if isinstance(s, Segment) else s, f"segment {i}") for i, s in enumerate(segs))
    for i, s in enumerate(segments):
        if not s:
            raise InvalidRequestError(f"segment {i} is empty")
    query = span(prompt.query, "query")
    if not query:
        raise InvalidRequestError("the query is empty: a prompt needs at least one query token")
    tp = TokenizedPrompt(prefix, segments, query, prompt.namespace or default_namespace, digests,
                         docs if any(d is not None for d in docs) else ())
    if len(tp) > max_len:
        raise InvalidRequestError(f"prompt of {len(tp)} tokens exceeds the model's maximum of {max_len}")
    return tp
