"""OpenAI-compatible HTTP API over an Engine (FastAPI).

    app = build_app(engine, ServerConfig(...))    # uvicorn.run(app) / httpx.ASGITransport(app)

Routes: POST /v1/completions, POST /v1/chat/completions (stream and not),
GET /v1/models, GET /health, GET /metrics.

Errors always carry an OpenAI-style body
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
400 bad input (validation, unknown model, context too long, malformed JSON;
FastAPI's 422 is turned into 400), 401 bad or missing API key (--api-key),
429 queue full (with Retry-After), 503 engine dead, 500 only for real bugs.

Every engine request is aborted in a finally on every exit path: client
disconnect mid-stream (Starlette cancels the generator), client disconnect
while a non-streaming request waits (a watcher on http.disconnect), errors.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from contextlib import asynccontextmanager
from typing import Any, AsyncIterator, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

from shepherd.config import ServerConfig
from shepherd.engine.engine import (Engine, EngineDeadError, EngineOutput, QueueFull, RequestRejected,
                                    RequestStream)
from shepherd.engine.metrics import CONTENT_TYPE_LATEST
from shepherd.request import SamplingParams
from shepherd.server.protocol import ChatCompletionRequest, CompletionRequest

logger = logging.getLogger("shepherd.server")

SAMPLING_EPS = 1e-5


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_body(message: str, type_: str = "invalid_request_error", param: Optional[str] = None,
               code: Optional[Union[str, int]] = None) -> dict:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param, code), status_code=status, headers=headers)


def _validation_message(errors) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = e.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        parts.append(f"{where}: {msg}" if where and not msg.startswith(loc[-1]) else msg)
    return "; ".join(parts) or "invalid request", param


class _AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (finished,
    client gone before the first chunk, cancelled), so engine requests are always aborted."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class _TokenStrings:
    """Token id -> text for logprobs (cached)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tok.decode([tid], skip_special_tokens=False)
            except Exception:  # noqa: BLE001
                s = ""
            self.cache[tid] = s
        return s


def build_app(engine: Engine, server_cfg: Optional[ServerConfig] = None) -> FastAPI:
    server_cfg = server_cfg or ServerConfig()
    served_name = server_cfg.served_model_name or engine.model_name
    model_aliases = {served_name, engine.model_name}
    if engine.cfg.model:
        model_aliases.add(str(engine.cfg.model))
    tok = engine.tokenizer
    tokstr = _TokenStrings(tok)
    ctx_len = engine.max_model_len
    api_key = server_cfg.api_key

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="shepherd", lifespan=lifespan)
    app.state.engine = engine
    app.state.served_model_name = served_name

    # ------------------------------------------------------------ error handlers
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        msg, param = _validation_message(exc.errors())
        return error_response(400, msg, param=param)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_req, exc: StarletteHTTPException):
        type_ = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return error_response(exc.status_code, str(exc.detail), type_, code=exc.status_code,
                              headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_req, exc: Exception):
        logger.exception("unhandled error")
        return error_response(500, f"internal error: {type(exc).__name__}: {exc}", "server_error")

    # ------------------------------------------------------------------ helpers
    def check_auth(request: Request) -> None:
        if not api_key:
            return
        h = request.headers.get("authorization", "")
        scheme, _, token = h.partition(" ")
        if scheme.lower() != "bearer" or token.strip() != api_key:
            raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                           "invalid_request_error", code="invalid_api_key")

    async def parse_body(request: Request, model_cls):
        raw = await request.body()
        try:
            data = json.loads(raw) if raw else None
        except (ValueError, UnicodeDecodeError) as e:
            raise APIError(400, f"Malformed JSON body: {e}", code="invalid_json")
        if not isinstance(data, dict):
            raise APIError(400, "The request body must be a JSON object.", code="invalid_json")
        try:
            body = model_cls.model_validate(data)
        except ValidationError as e:
            msg, param = _validation_message(e.errors())
            raise APIError(400, msg, param=param)
        if body.model is not None and body.model not in model_aliases:
            raise APIError(400, f"The model `{body.model}` does not exist. Available: {served_name}.",
                           param="model", code="model_not_found")
        return body

    def build_params(body, max_tokens: int, logprobs: Optional[int], seed: Optional[int]) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if temperature < SAMPLING_EPS:
            temperature = 0.0   # vLLM's rule: a tiny temperature is greedy (and never divides by ~0)
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
            min_p=float(body.min_p),
            repetition_penalty=float(body.repetition_penalty),
            frequency_penalty=float(body.frequency_penalty),
            presence_penalty=float(body.presence_penalty),
            seed=seed,
            stop=body.stop_list,
            stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos),
            logprobs=logprobs,
        )

    def resolve_max_tokens(prompt_len: int, requested: Optional[int], default: Optional[int]) -> int:
        limit = min(ctx_len, engine.kv_capacity)
        if prompt_len >= ctx_len or prompt_len + 1 > engine.kv_capacity:
            raise APIError(400, f"This model's maximum context length is {min(ctx_len, engine.kv_capacity)} "
                                f"tokens. However, your prompt has {prompt_len} tokens; please shorten it.",
                           param="messages" if default is None else "prompt", code="context_length_exceeded")
        if requested is None:
            return max(1, (default if default is not None else limit - prompt_len))
        if prompt_len + requested > ctx_len:
            raise APIError(400, f"This model's maximum context length is {ctx_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                                f"{requested} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    async def encode(text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize; long texts off the event loop so other requests keep streaming."""
        if len(text) < 20000:
            return tok.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(tok.encode, text, add_special_tokens)

    def client_of(request: Request, body) -> str:
        return body.user or request.headers.get("x-client-id") or "default"

    async def submit_all(request: Request, body, prompts: list[list[int]], max_tokens: list[int],
                         logprobs: Optional[int], prefix: str) -> list[RequestStream]:
        """One engine request per (prompt, n) choice, all handed over in one go; all or nothing."""
        streams: list[RequestStream] = []
        client = client_of(request, body)
        k = 0
        try:
            for pi, ids in enumerate(prompts):
                for i in range(body.n):
                    seed = None if body.seed is None else int(body.seed) + k
                    params = build_params(body, max_tokens[pi], logprobs, seed)
                    streams.append(engine.submit(ids, params, req_id=f"{prefix}-{k}", client=client,
                                                 priority=body.priority))
                    k += 1
            results = await asyncio.gather(*(s.wait_admitted() for s in streams), return_exceptions=True)
            errors = [r for r in results if isinstance(r, BaseException)]
            if errors:
                # the most telling error: a full queue (retry later) before a rejection
                raise next((e for e in errors if isinstance(e, QueueFull)), errors[0])
        except BaseException as e:
            for s in streams:
                s.abort()
            if isinstance(e, QueueFull):
                ra = max(1, int(math.ceil(getattr(e, "retry_after", 1.0) or 1.0)))
                raise APIError(429, f"Server busy: {e}", "rate_limit_error", code="rate_limit_exceeded",
                               headers={"Retry-After": str(ra)}) from None
            if isinstance(e, RequestRejected):
                raise APIError(400, str(e), code="request_rejected") from None
            if isinstance(e, EngineDeadError):
                raise APIError(503, f"Engine unavailable: {e}", "server_error", code="engine_dead") from None
            raise
        return streams

    async def merged(streams: list[RequestStream]) -> AsyncIterator[tuple[int, EngineOutput]]:
        """Interleave several request streams; yields (choice index, output)."""
        if len(streams) == 1:
            async for out in streams[0]:
                yield 0, out
            return
        q: asyncio.Queue = asyncio.Queue()

        async def pump(i: int, s: RequestStream):
            async for out in s:
                q.put_nowait((i, out))

        tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
        remaining = len(streams)
        try:
            while remaining:
                i, out = await q.get()
                if out.finished:
                    remaining -= 1
                yield i, out
        finally:
            for t in tasks:
                t.cancel()

    async def until_disconnect(request: Request, coro):
        """Run `coro`; if the client disconnects first, cancel it (its finally aborts) and return None."""
        task = asyncio.create_task(coro)

        async def watch():
            while True:
                msg = await request.receive()
                if msg.get("type") == "http.disconnect":
                    return

        watcher = asyncio.create_task(watch())
        try:
            done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001
                pass
            return None
        finally:
            watcher.cancel()
            if not task.done():
                task.cancel()

    def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def raise_output_error(out: EngineOutput):
        if out.error_kind == "engine":
            raise APIError(500, out.error or "engine error", "server_error", code="engine_error")
        raise APIError(400, out.error or "request failed", code="request_failed")

    def stream_error_chunk(out: EngineOutput) -> str:
        if out.error_kind == "engine":
            body = error_body(out.error or "engine error", "server_error", code=500)
        else:
            body = error_body(out.error or "request failed", "invalid_request_error", code=400)
        return f"data: {json.dumps(body)}\n\n"

    # logprobs formats
    def completion_logprobs(lps, offset0: int) -> dict:
        tokens, tlp, tops, offs = [], [], [], []
        off = offset0
        for lp in lps:
            s = tokstr(lp.token_id)
            tokens.append(s)
            tlp.append(float(lp.logprob))
            tops.append({tokstr(t): float(v) for t, v in lp.top} if lp.top else None)
            offs.append(off)
            off += len(s)
        return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": tops, "text_offset": offs}

    def chat_logprobs(lps) -> dict:
        content = []
        for lp in lps:
            s = tokstr(lp.token_id)
            content.append({"token": s, "logprob": float(lp.logprob), "bytes": list(s.encode("utf-8")),
                            "top_logprobs": [{"token": tokstr(t), "logprob": float(v),
                                              "bytes": list(tokstr(t).encode("utf-8"))} for t, v in lp.top]})
        return {"content": content}

    def sse_response(gen, streams: list[RequestStream]):
        """The stream out; closing it early (client gone) releases the requests."""
        return _AbortingStreamingResponse(gen, lambda: release(streams), media_type="text/event-stream",
                                          headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def collect(streams: list[RequestStream]):
        """Non-streaming answer: each choice's whole text, logprobs and terminal output."""
        n = len(streams)
        texts = [""] * n
        lps: list[list] = [[] for _ in range(n)]
        final: list[Optional[EngineOutput]] = [None] * n
        try:
            async for i, out in merged(streams):
                if out.error is not None:
                    raise_output_error(out)
                texts[i] += out.text
                lps[i].extend(out.logprobs)
                if out.finished:
                    final[i] = out
        finally:
            release(streams)
        return texts, lps, final

    def release(streams):
        for s in streams:
            s.abort()

    # ------------------------------------------------------------------- routes
    @app.get("/health")
    async def health():
        if engine.alive:
            return Response(status_code=200)
        return error_response(503, f"engine not running: {engine.dead_reason or 'not started'}",
                              "server_error", code=503)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models(request: Request):
        check_auth(request)
        return {"object": "list", "data": [{
            "id": served_name, "object": "model", "created": int(time.time()), "owned_by": "shepherd",
            "root": str(engine.cfg.model or served_name), "parent": None, "max_model_len": ctx_len}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        check_auth(request)
        body: CompletionRequest = await parse_body(request, CompletionRequest)
        prompts: list[list[int]] = []
        for p in body.prompts():
            if isinstance(p, str):
                ids = await encode(p, True)
            else:
                ids = list(p)
                bad = [t for t in ids if not (0 <= t < tok.vocab_size)]
                if bad:
                    raise APIError(400, f"prompt token id {bad[0]} is out of range [0, {tok.vocab_size})",
                                   param="prompt")
            if not ids:
                raise APIError(400, "prompt must contain at least one token", param="prompt")
            prompts.append(ids)
        max_tokens = [resolve_max_tokens(len(ids), body.max_tokens, 16) for ids in prompts]
        rid = f"cmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        nchoice = len(prompts) * body.n
        streams = await submit_all(request, body, prompts, max_tokens, body.logprobs, rid)
        prompt_tokens = sum(len(p) for p in prompts)

        if body.stream:
            include_usage = body.include_usage

            async def gen():
                comp = [0] * nchoice
                cached = [0] * nchoice
                offsets = [0] * nchoice
                try:
                    async for i, out in merged(streams):
                        if out.error is not None:
                            yield stream_error_chunk(out)
                            break
                        comp[i], cached[i] = out.completion_tokens, out.cached_tokens
                        if not out.text and not out.finished and not out.logprobs:
                            continue
                        lp = None
                        if body.logprobs is not None:
                            lp = completion_logprobs(out.logprobs, offsets[i])
                        offsets[i] += len(out.text)
                        chunk = {"id": rid, "object": "text_completion", "created": created,
                                 "model": served_name,
                                 "choices": [{"index": i, "text": out.text, "logprobs": lp,
                                              "finish_reason": out.finish_reason if out.finished else None,
                                              "stop_reason": None}]}
                        if include_usage:
                            chunk["usage"] = None
                        yield f"data: {json.dumps(chunk)}\n\n"
                    else:
                        if include_usage:
                            chunk = {"id": rid, "object": "text_completion", "created": created,
                                     "model": served_name, "choices": [],
                                     "usage": usage_dict(prompt_tokens, sum(comp), max(cached))}
                            yield f"data: {json.dumps(chunk)}\n\n"
                    yield "data: [DONE]\n\n"
                finally:
                    release(streams)

            return sse_response(gen(), streams)

        res = await until_disconnect(request, collect(streams))
        if res is None:
            return Response(status_code=499)
        texts, lps, final = res
        choices = []
        for i in range(nchoice):
            choices.append({"index": i, "text": texts[i],
                            "logprobs": completion_logprobs(lps[i], 0) if body.logprobs is not None else None,
                            "finish_reason": final[i].finish_reason, "stop_reason": None})
        return {"id": rid, "object": "text_completion", "created": created, "model": served_name,
                "choices": choices,
                "usage": usage_dict(prompt_tokens, sum(f.completion_tokens for f in final),
                                    max(f.cached_tokens for f in final))}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        check_auth(request)
        body: ChatCompletionRequest = await parse_body(request, ChatCompletionRequest)
        messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})}
                    for m in body.messages]
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages")
        ids = await encode(text, False)
        if not ids:
            raise APIError(400, "the chat prompt is empty", param="messages")
        max_tokens = resolve_max_tokens(len(ids), body.effective_max_tokens, None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        created = int(time.time())
        streams = await submit_all(request, body, [ids], [max_tokens], logprobs, rid)
        n = body.n

        if body.stream:
            include_usage = body.include_usage

            def chunk(choices, usage=None, with_usage=False):
                c = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": served_name,
                     "choices": choices}
                if include_usage:
                    c["usage"] = usage
                return f"data: {json.dumps(c)}\n\n"

            async def gen():
                comp = [0] * n
                cached = [0] * n
                try:
                    for i in range(n):
                        yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                                      "logprobs": None, "finish_reason": None}])
                    async for i, out in merged(streams):
                        if out.error is not None:
                            yield stream_error_chunk(out)
                            break
                        comp[i], cached[i] = out.completion_tokens, out.cached_tokens
                        if not out.text and not out.finished and not out.logprobs:
                            continue
                        delta = {"content": out.text} if (out.text or not out.finished) else {}
                        yield chunk([{"index": i, "delta": delta,
                                      "logprobs": chat_logprobs(out.logprobs) if logprobs is not None else None,
                                      "finish_reason": out.finish_reason if out.finished else None}])
                    else:
                        if include_usage:
                            yield chunk([], usage_dict(len(ids), sum(comp), max(cached)))
                    yield "data: [DONE]\n\n"
                finally:
                    release(streams)

            return sse_response(gen(), streams)

        res = await until_disconnect(request, collect(streams))
        if res is None:
            return Response(status_code=499)
        texts, lps, final = res
        choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]},
                    "logprobs": chat_logprobs(lps[i]) if logprobs is not None else None,
                    "finish_reason": final[i].finish_reason} for i in range(n)]
        return {"id": rid, "object": "chat.completion", "created": created, "model": served_name,
                "choices": choices,
                "usage": usage_dict(len(ids), sum(f.completion_tokens for f in final),
                                    max(f.cached_tokens for f in final))}

    return app
