"""The HTTP server: OpenAI-compatible completions and chat (SSE streaming), models, health,
Prometheus metrics and store administration, on top of one LLM and its scheduler thread.

Every bad input is answered with a 4xx and an OpenAI-style JSON error body before the request
reaches the engine; an engine failure fails only the requests it touched.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from contextlib import asynccontextmanager
from dataclasses import dataclass

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import HypicError, InvalidRequestError
from ..runtime.scheduler import Job, QueueFullError, Scheduler, SchedulerClosedError, SchedulerConfig
from ..types import Prompt, SamplingParams, Segment
from . import protocol as P
from .metrics import Metrics


@dataclass(frozen=True)
class ServerConfig:
    model_name: str
    api_key: str | None = None
    separator: str = "<<PIC_SEP>>"
    default_max_tokens: int = 1024
    scheduler: SchedulerConfig = SchedulerConfig()


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


_MARK = re.compile("\ue000(\\d+)\ue001")


class _Channel:
    """Scheduler thread -> event loop bridge for one request."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue = asyncio.Queue()

    def on_event(self, kind, job, payload) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (kind, payload))


class _Text:
    """Incremental detokenization with stop strings (held back while a character is incomplete)."""

    def __init__(self, tokenizer, stops: list[str]):
        self.tok, self.stops = tokenizer, [s for s in stops if s]
        self.ids: list[int] = []
        self.sent = 0
        self.text = ""

    def flush(self) -> str:
        """At the end: whatever was held back (an incomplete character stays as U+FFFD)."""
        if self.tok is None:
            return ""
        text = self.tok.decode(self.ids)
        delta, self.text, self.sent = text[self.sent :], text, len(text)
        return delta

    def add(self, token: int) -> tuple[str, bool]:
        self.ids.append(token)
        if self.tok is None:
            return "", False
        text = self.tok.decode(self.ids)
        for s in self.stops:
            i = text.find(s, max(0, self.sent - len(s)))
            if i >= 0:
                delta, self.text = text[self.sent : i], text[:i]
                self.sent = i
                return delta, True
        if text.endswith("\ufffd"):
            return "", False
        delta, self.text, self.sent = text[self.sent :], text, len(text)
        return delta, False


def _segment(s):
    """A request's segment: plain text as is; one tagged with its document (a `segments` object, or a content part
    with doc_id) as a hypic.Segment."""
    if isinstance(s, str):
        return s
    if s.doc_id is None and s.version is None:
        return s.text
    try:
        return Segment(s.text, s.doc_id, s.version)
    except InvalidRequestError as e:
        raise ApiError(400, str(e), param="segments") from None


def build_app(llm, config: ServerConfig) -> FastAPI:
    scheduler = Scheduler(llm.engine, config.scheduler)
    metrics = Metrics(llm, scheduler)
    cfg = llm.model_config

    @asynccontextmanager
    async def lifespan(app):
        scheduler.start()
        yield
        scheduler.shutdown()
        print("hypic: scheduler stopped, shut down cleanly", flush=True)

    app = FastAPI(title="hypic", lifespan=lifespan)
    app.state.scheduler, app.state.llm, app.state.metrics = scheduler, llm, metrics

    # -- errors -----------------------------------------------------------------------------------------
    @app.exception_handler(ApiError)
    async def _api_error(_, e: ApiError):
        return JSONResponse(P.error_body(e.message, e.type, e.param, e.code), status_code=e.status)

    @app.exception_handler(RequestValidationError)
    async def _validation(_, e: RequestValidationError):
        errs = e.errors()
        if any(x.get("type") == "json_invalid" for x in errs):
            msg = "the request body is not valid JSON (or not UTF-8)"
        else:
            msg = "; ".join(f"{'.'.join(str(p) for p in x.get('loc', ())[1:]) or 'body'}: {x.get('msg')}"
                            for x in errs[:5])
        return JSONResponse(P.error_body(msg), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_, e: StarletteHTTPException):
        return JSONResponse(P.error_body(str(e.detail), "not_found_error" if e.status_code == 404 else
                                         "invalid_request_error"), status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(_, e: Exception):
        return JSONResponse(P.error_body(f"internal error: {type(e).__name__}: {e}", "server_error"),
                            status_code=500)

    def auth(request: Request) -> None:
        if config.api_key is None:
            return
        if request.headers.get("authorization", "") != f"Bearer {config.api_key}":
            raise ApiError(401, "missing or wrong API key", "authentication_error", code="invalid_api_key")

    # -- request building -----------------------------------------------------------------------------------
    def check_model(name):
        if name is not None and name != config.model_name:
            raise ApiError(404, f"model {name!r} does not exist; this server serves {config.model_name!r}",
                           "not_found_error", "model", "model_not_found")

    def sampling(body, max_tokens) -> SamplingParams:
        if body.n != 1:
            raise ApiError(400, "only n=1 is supported", param="n")
        try:
            return SamplingParams(
                max_tokens=max_tokens if max_tokens is not None else config.default_max_tokens,
                temperature=float(1.0 if body.temperature is None else body.temperature),
                top_p=float(1.0 if body.top_p is None else body.top_p), top_k=body.top_k or 0,
                stop_token_ids=tuple(body.stop_token_ids or ()), ignore_eos=body.ignore_eos, seed=body.seed)
        except InvalidRequestError as e:
            raise ApiError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else None) from None

    def completion_prompt(body: P.CompletionRequest) -> Prompt:
        prompt = body.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], str):
            if len(prompt) != 1:
                raise ApiError(400, "a list of several prompts is not supported; send one prompt", param="prompt")
            prompt = prompt[0]
        if body.segments is not None:
            return Prompt(prefix=body.prefix, segments=[_segment(s) for s in body.segments], query=prompt,
                          namespace=body.namespace)
        if isinstance(prompt, str) and config.separator in prompt:
            *segs, query = prompt.split(config.separator)
            return Prompt(prefix=body.prefix, segments=segs, query=query, namespace=body.namespace)
        return Prompt(prefix=body.prefix, query=prompt, namespace=body.namespace)

    def chat_prompt(body: P.ChatCompletionRequest) -> Prompt:
        tok = llm.tokenizer
        if tok is None or not tok.chat_template:
            raise ApiError(400, "this model has no chat template; use /v1/completions")
        segs: list = []                          # each a str or a hypic.Segment (tagged with its document)
        messages = []
        last_user = max((i for i, m in enumerate(body.messages) if m.role == "user"), default=None)

        def mark(seg):
            segs.append(seg)
            return f"\ue000{len(segs) - 1}\ue001"

        for i, m in enumerate(body.messages):
            parts = m.content if isinstance(m.content, list) else [P.ContentPart(type="text", text=m.content or "")]
            text = ""
            if i == last_user and body.segments:
                text += "".join(mark(_segment(s)) for s in body.segments)
            text += "".join(mark(_segment(p)) if p.segment else p.text for p in parts)
            messages.append({"role": m.role, "content": text})
        if body.segments and last_user is None:
            raise ApiError(400, "`segments` needs a user message to attach to", param="segments")
        rendered = tok.apply_chat_template(messages)
        pieces = _MARK.split(rendered)          # text, index, text, index, ..., text
        prefix, query = pieces[0], pieces[-1]
        spans: list[str] = []
        for k in range(1, len(pieces) - 1, 2):
            spans.append(segs[int(pieces[k])])
            between = pieces[k + 1] if k + 1 < len(pieces) - 1 else ""
            if between:                          # text between two segments: its own short span
                spans.append(between)
        return Prompt(prefix=prefix or None, segments=spans, query=query, namespace=body.namespace)

    def make_job(prompt: Prompt, params: SamplingParams, body):
        try:
            (req,) = llm.make_requests([prompt], [params])
            if body.cache_mode is not None or body.seam is not None or body.anchor is not None:
                req.policy = llm.policy.updated(body.cache_mode, body.seam, body.anchor)
        except HypicError as e:
            raise ApiError(400, str(e)) from None
        if len(req.prompt) + params.max_tokens > cfg.max_position_embeddings:
            raise ApiError(400, f"prompt ({len(req.prompt)} tokens) plus max_tokens ({params.max_tokens}) exceed the "
                                f"model's context of {cfg.max_position_embeddings} tokens", param="max_tokens")
        channel = _Channel(asyncio.get_running_loop())
        job = Job(req, channel.on_event)
        try:
            scheduler.submit(job)
        except QueueFullError as e:
            metrics.requests.labels("rejected").inc()
            raise ApiError(429, str(e), "rate_limit_error") from None
        except SchedulerClosedError as e:
            raise ApiError(503, str(e), "server_error") from None
        return job, channel

    async def events(raw: Request, job: Job, channel: _Channel, stops: list[str]):
        """Yields (delta_text, finish_reason | None); ends after a finish. Raises ApiError on failure."""
        text = _Text(llm.tokenizer, stops)
        finished = False
        try:
            while True:
                try:
                    kind, payload = await asyncio.wait_for(channel.queue.get(), 0.5)
                except asyncio.TimeoutError:
                    if await raw.is_disconnected():
                        return
                    continue
                if kind == "token":
                    delta, stopped = text.add(payload)
                    if stopped:
                        scheduler.cancel(job)
                        finished = True
                        metrics.observe(job.request, time.monotonic() - job.arrival, "ok")
                        yield delta, "stop", text
                        return
                    if delta:
                        yield delta, None, text
                elif kind == "done":
                    finished = True
                    metrics.observe(job.request, time.monotonic() - job.arrival, "ok")
                    yield text.flush(), payload.finish_reason, text
                    return
                else:
                    finished = True
                    status, msg = payload
                    metrics.requests.labels("error").inc()
                    raise ApiError(status, msg, "server_error" if status >= 500 else "invalid_request_error")
        finally:
            if not finished:                       # client gone: drop the request, release its memory
                scheduler.cancel(job)
                metrics.requests.labels("cancelled").inc()

    def usage_of(job: Job) -> dict:
        r = job.request
        return P.usage({"prompt_tokens": len(r.prompt), "completion_tokens": len(r.output_ids), **r.counts},
                       r.ttft_s)

    async def respond(raw: Request, body, prompt: Prompt, max_tokens, chat: bool):
        check_model(body.model)
        params = sampling(body, max_tokens)
        stops = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
        job, channel = make_job(prompt, params, body)
        rid = P.new_id("chatcmpl" if chat else "cmpl")
        gen = events(raw, job, channel, stops)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(_sse(gen, rid, config.model_name, chat, include_usage, job, usage_of),
                                     media_type="text/event-stream")
        pieces, finish = [], None
        async for delta, fin, _ in gen:
            pieces.append(delta)
            finish = fin or finish
        if finish is None:                          # client disconnected while waiting
            return Response(status_code=499)
        build = P.chat_response if chat else P.completion_response
        return JSONResponse(build(rid, config.model_name, "".join(pieces), finish, usage_of(job)))

    # -- endpoints --------------------------------------------------------------------------------------
    @app.post("/v1/completions", dependencies=[Depends(auth)])
    async def completions(raw: Request, body: P.CompletionRequest):
        return await respond(raw, body, completion_prompt(body), body.max_tokens, chat=False)

    @app.post("/v1/chat/completions", dependencies=[Depends(auth)])
    async def chat_completions(raw: Request, body: P.ChatCompletionRequest):
        max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
        return await respond(raw, body, chat_prompt(body), max_tokens, chat=True)

    @app.get("/v1/models", dependencies=[Depends(auth)])
    async def models():
        return {"object": "list", "data": [{"id": config.model_name, "object": "model", "created": 0,
                                            "owned_by": "hypic", "max_model_len": cfg.max_position_embeddings}]}

    @app.get("/health")
    async def health():
        ok = scheduler.alive
        return JSONResponse({"status": "ok" if ok else "unavailable", **scheduler.stats()},
                            status_code=200 if ok else 503)

    @app.get("/metrics")
    async def prometheus():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    async def on_engine(fn):
        """fn() on the engine thread, between two steps (the stores are the engine's: never changed, nor walked,
        while a pass runs)."""
        try:
            return await asyncio.wrap_future(scheduler.call(fn))
        except SchedulerClosedError as e:
            raise ApiError(503, str(e), "server_error") from e

    @app.get("/admin/stats", dependencies=[Depends(auth)])
    async def admin_stats():
        store, par = await on_engine(lambda: (llm.cache_stats(), llm.parallel_stats()))
        return {"store": store, "scheduler": scheduler.stats(), "parallel": par, "policy": {
            "cache_mode": llm.cache_mode, "seam": llm.policy.seam, "anchor": llm.policy.anchor}}

    @app.get("/admin/segments", dependencies=[Depends(auth)])
    async def admin_segments():
        return {"object": "list", "data": await on_engine(lambda: [e.describe() for e in llm.engine.segments.values()])}

    @app.delete("/admin/segments/{key}", dependencies=[Depends(auth)])
    async def admin_delete(key: str):
        if await on_engine(lambda: llm.engine.segments.delete_id(key)):     # every tier: device, host, disk
            return {"deleted": key}
        raise ApiError(404, f"no cached segment {key!r}", "not_found_error")

    @app.post("/admin/invalidate", dependencies=[Depends(auth)])
    async def admin_invalidate(body: P.InvalidateRequest):
        if body.doc_id is None and body.namespace is None:
            raise ApiError(400, "give a doc_id or a namespace (POST /admin/clear drops everything)")
        n = await on_engine(lambda: llm.invalidate(doc_id=body.doc_id, namespace=body.namespace, version=body.version))
        return {"invalidated": n}

    @app.post("/admin/clear", dependencies=[Depends(auth)])
    async def admin_clear():
        await on_engine(llm.clear_cache)
        return {"cleared": True}

    return app


async def _sse(gen, rid, model, chat, include_usage, job, usage_of):
    def line(obj):
        return f"data: {json.dumps(obj)}\n\n"

    finish = None
    try:
        if chat:
            yield line(P.chat_chunk(rid, model, {"role": "assistant", "content": ""}, None))
        async for delta, fin, _ in gen:
            finish = fin or finish
            if delta or fin:
                yield line(P.chat_chunk(rid, model, {"content": delta}, fin) if chat
                           else P.completion_chunk(rid, model, delta, fin))
        if finish is None:
            return
        if include_usage:
            u = usage_of(job)
            yield line(P.chat_chunk(rid, model, None, None, u) if chat else P.completion_chunk(rid, model, None, None, u))
    except ApiError as e:
        yield line(P.error_body(e.message, e.type, e.param, e.code))
    yield "data: [DONE]\n\n"
