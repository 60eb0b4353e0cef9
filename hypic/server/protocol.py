"""OpenAI-compatible request bodies (plus hypic's extensions) and response builders.

Extensions, all optional:
    segments: list[str]   reusable, position-independent documents; `prompt` (completions) is then
                          the query. In chat, they go before the text of the last user message.
    prefix: str           (completions) a shared prefix served by the exact prefix cache
    namespace: str        tenant isolation of the segment cache
    cache_mode, seam, anchor   per-request overrides of the server's cache policy (anchor: "none" | "prefix")
    top_k, ignore_eos, stop_token_ids   as in vLLM
In chat messages a text content part can be marked reusable:
    {"type": "text", "text": "<document>", "segment": true}
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Literal, Optional, Union

from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictFloat, StrictInt, StrictStr

Number = Union[StrictInt, StrictFloat]


class StreamOptions(BaseModel):
    include_usage: StrictBool = False


class SegmentPart(BaseModel):
    """A segment with the document it comes from (hypic.Segment): {"text": ..., "doc_id": ..., "version": ...}."""

    model_config = ConfigDict(extra="forbid")

    text: StrictStr
    doc_id: Optional[StrictStr] = None
    version: Optional[StrictStr] = None


class _Sampling(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: Optional[StrictStr] = None
    max_tokens: Optional[StrictInt] = None
    temperature: Optional[Number] = None
    top_p: Optional[Number] = None
    top_k: Optional[StrictInt] = None
    stop: Optional[Union[StrictStr, list[StrictStr]]] = None
    stop_token_ids: Optional[list[StrictInt]] = None
    ignore_eos: StrictBool = False
    seed: Optional[StrictInt] = None
    stream: StrictBool = False
    stream_options: Optional[StreamOptions] = None
    n: StrictInt = 1
    segments: Optional[list[Union[StrictStr, SegmentPart]]] = None
    namespace: Optional[StrictStr] = None
    cache_mode: Optional[StrictStr] = None     # per-request override: full | prefix | naive | pic
    seam: Optional[StrictInt] = None           # per-request seam width
    anchor: Optional[StrictStr] = None         # per-request: what segments are prefilled after (none | prefix)
    user: Optional[StrictStr] = None


class CompletionRequest(_Sampling):
    prompt: Union[StrictStr, list[StrictInt], list[StrictStr]]
    prefix: Optional[StrictStr] = None
    echo: StrictBool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["text"]
    text: StrictStr
    segment: StrictBool = False
    doc_id: Optional[StrictStr] = None           # with segment: the document it comes from (hypic.Segment)
    version: Optional[StrictStr] = None


class InvalidateRequest(BaseModel):
    """POST /admin/invalidate: a document's entries (every version, or `version`), within `namespace` if given; or,
    with no doc_id, a whole namespace."""

    model_config = ConfigDict(extra="forbid")

    doc_id: Optional[StrictStr] = None
    version: Optional[StrictStr] = None
    namespace: Optional[StrictStr] = None


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Union[StrictStr, list[ContentPart], None] = None
    name: Optional[StrictStr] = None


class ChatCompletionRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    max_completion_tokens: Optional[StrictInt] = None


def error_body(message: str, type_: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def new_id(kind: str) -> str:
    return f"{kind}-{uuid.uuid4().hex[:24]}"


def usage(out, ttft_s: float) -> dict:
    """prompt_tokens_details.cached_tokens counts exact prefix hits only; composed tokens are
    reported apart, under `hypic`, so a composed result is never passed off as an exact hit."""
    p, c = out["prompt_tokens"], out["completion_tokens"]
    return {"prompt_tokens": p, "completion_tokens": c, "total_tokens": p + c,
            "prompt_tokens_details": {"cached_tokens": out["prefix_tokens"]},
            "hypic": {"prefix_tokens": out["prefix_tokens"], "composed_tokens": out["composed_tokens"],
                      "recomputed_tokens": out["recomputed_tokens"], "ttft_ms": round(ttft_s * 1e3, 3)}}


def completion_response(rid: str, model: str, text: str, finish: str | None, use: dict | None) -> dict:
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_response(rid: str, model: str, text: str, finish: str | None, use: dict | None) -> dict:
    body: dict[str, Any] = {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": model,
                            "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                                         "logprobs": None, "finish_reason": finish}]}
    if use is not None:
        body["usage"] = use
    return body


def chat_chunk(rid: str, model: str, delta: dict | None, finish: str | None, use: dict | None = None) -> dict:
    choices = [] if delta is None else [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}]
    body: dict[str, Any] = {"id": rid, "object": "chat.completion.chunk", "created": int(time.time()),
                            "model": model, "choices": choices}
    if use is not None:
        body["usage"] = use
    return body


def completion_chunk(rid: str, model: str, text: str | None, finish: str | None, use: dict | None = None) -> dict:
    choices = [] if text is None else [{"index": 0, "text": text, "logprobs": None, "finish_reason": finish}]
    body: dict[str, Any] = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                            "choices": choices}
    if use is not None:
        body["usage"] = use
    return body
