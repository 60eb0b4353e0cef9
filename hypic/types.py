"""User-facing nouns: the prompt, the sampling parameters and the output of one request."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence, Union

from .errors import InvalidRequestError

Span = Union[str, Sequence[int]]


@dataclass(frozen=True)
class Segment:
    """A segment with the document it comes from: `doc_id` (and `version`, e.g. a revision or a content date) tag
    its cache entry, so `LLM.invalidate(doc_id=...)` removes it from every tier, and a request that brings a new
    version of a document drops the entries of its other versions (EngineConfig.supersede_versions). The tag is
    part of the entry's key: the same text under two document ids makes two entries."""

    content: Span
    doc_id: str | None = None
    version: str | None = None

    def __post_init__(self):
        for name in ("doc_id", "version"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v or len(v) > 256):
                raise InvalidRequestError(f"segment {name} must be a non-empty string of at most 256 characters")
        if self.version is not None and self.doc_id is None:
            raise InvalidRequestError("a segment version needs a doc_id")


@dataclass(frozen=True)
class Prompt:
    """prefix (optional, shared, exact prefix cache) + segments (position independent) + query.

    Each part is a string (tokenized alone) or a list of token ids (used as is); a segment may also be a
    `Segment` (the same, tagged with its document id and version).
    `namespace` isolates tenants: segments cached under one namespace never serve another.
    """

    segments: Sequence[Span | Segment] = ()
    query: Span = ""
    prefix: Span | None = None
    namespace: str | None = None


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0          # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0                    # 0 = no top-k cut
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    return_logits: bool = False       # keep the fp32 logits of every generated position

    def __post_init__(self):
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise InvalidRequestError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (self.temperature >= 0):
            raise InvalidRequestError(f"temperature must be >= 0, got {self.temperature!r}")
        if not (0 < self.top_p <= 1):
            raise InvalidRequestError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int) or self.top_k < 0:
            raise InvalidRequestError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))


@dataclass
class RequestOutput:
    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str | None
    finish_reason: str                 # "stop" | "length"
    ttft_s: float                      # prompt in (LLM.generate's call; the server: arrival) -> first token on the host
    prefix_tokens: int                 # reused from the exact prefix cache
    composed_tokens: int               # supplied by composed segment entries (never recomputed)
    recomputed_tokens: int             # forwarded through the model in this request's pass
    cold_prefill_tokens: int = 0       # segment tokens prefilled in isolation for this request (misses)
    mode: str = ""
    logits: object = None              # [steps, vocab] fp32 tensor when SamplingParams.return_logits

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)
