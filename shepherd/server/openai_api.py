"""OpenAI-compatible HTTP API over an Engine (FastAPI).

    app = build_app(engine, ServerConfig(...))    # uvicorn.run(app) / httpx.ASGITransport(app)

Routes: POST /v1/completions, POST /v1/chat/completions (stream and not),
POST /tokenize, POST /detokenize, GET /version, GET /v1/models, GET /health,
GET /metrics. Request bodies are the pydantic models of protocol.py, so
/openapi.json documents them and FastAPI validates them.

Errors always carry an OpenAI-style body
    {"error": {"message": ..., "type": ..., "param": ..., "code": ...}}
400 bad input (validation, unknown model, context too long, malformed JSON,
bodies nested too deep or holding lone surrogates, a grammar that cannot be
enforced, a request that can never be admitted), 413 body too large, 401 bad
or missing API key (--api-key), 429 queue full now (with Retry-After), 503
engine dead; 500 only for real bugs.

Every engine request is aborted in a finally on every exit path: client
disconnect mid-stream (Starlette cancels the generator), client disconnect
while a non-streaming request waits (a watcher on http.disconnect), errors.
"""
from __future__ import annotations

import asyncio
import logging
import time
import uuid
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shepherd.config import ServerConfig
from shepherd.engine.engine import Engine
from shepherd.engine.metrics import CONTENT_TYPE_LATEST
from shepherd.request import SamplingParams, context_error
from shepherd.server import tools
from shepherd.server.chat_api import ChatRoutes
from shepherd.server.common import APIError, TokenStrings, error_response, validation_message
from shepherd.server.completions_api import CompletionRoutes
from shepherd.server.guard import BodyGuard
from shepherd.server.protocol import ChatCompletionRequest, CompletionRequest
from shepherd.server.structured import SpecError, requested_spec
from shepherd.server.tokenize_api import add_tokenize_routes

logger = logging.getLogger("shepherd.server")

SAMPLING_EPS = 1e-5


class ApiContext:
    """What every route needs: the engine, the tokenizer, the limits, and the checks."""

    def __init__(self, engine: Engine, cfg: ServerConfig):
        self.engine, self.cfg = engine, cfg
        self.served_name = cfg.served_model_name or engine.model_name
        self.aliases = {self.served_name, engine.model_name}
        if engine.cfg.model:
            self.aliases.add(str(engine.cfg.model))
        self.tok = engine.tokenizer
        if cfg.chat_template:
            self.tok.set_chat_template(cfg.chat_template)
        self.takes_tools = tools.template_takes_tools(getattr(self.tok, "chat_template", None))
        self.tokstr = TokenStrings(self.tok)
        self.ctx_len = engine.max_model_len
        self._grammar = None

    # ------------------------------------------------------------------ checks
    def check(self, request: Request, body) -> None:
        """API key, then the model name."""
        key = self.cfg.api_key
        if key:
            scheme, _, token = request.headers.get("authorization", "").partition(" ")
            if scheme.lower() != "bearer" or token.strip() != key:
                raise APIError(401, "Invalid or missing API key: send 'Authorization: Bearer <key>'.",
                               "invalid_request_error", code="invalid_api_key")
        model = getattr(body, "model", None)
        if model is not None and model not in self.aliases:
            raise APIError(400, f"The model `{model}` does not exist. Available: {self.served_name}.",
                           param="model", code="model_not_found")

    def check_admissible(self, nchoice: int) -> None:
        """A request with more choices than the engine can ever hold at once is a 400, not a 429."""
        sc = self.engine.cfg.scheduler
        for limit, name in ((sc.max_concurrency, "--max-concurrency"), (sc.max_queue, "--max-queue")):
            if nchoice > limit:
                raise APIError(400, f"this request needs {nchoice} sequences at once (prompts x n), more "
                                    f"than the server ever admits ({name} {limit}); split it",
                               param="n", code="request_too_large")

    def resolve_max_tokens(self, prompt_len: int, requested: Optional[int], default: Optional[int]) -> int:
        ctx_len, cap = self.ctx_len, self.engine.kv_capacity
        if context_error(prompt_len, min(ctx_len, cap)) is not None:     # the one rule (request.py)
            raise APIError(400, f"This model's maximum context length is {min(ctx_len, cap)} tokens. However, "
                                f"your prompt has {prompt_len} tokens; please shorten it.",
                           param="messages" if default is None else "prompt", code="context_length_exceeded")
        if requested is None:
            return max(1, (default if default is not None else min(ctx_len, cap) - prompt_len))
        if prompt_len + requested > ctx_len:
            raise APIError(400, f"This model's maximum context length is {ctx_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                                f"{requested} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    async def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        """Tokenize; long texts off the event loop so other requests keep streaming."""
        if len(text) < 20000:
            return self.tok.encode(text, add_special_tokens=add_special_tokens)
        return await asyncio.to_thread(self.tok.encode, text, add_special_tokens)

    def render_chat(self, body) -> str:
        messages, extra = tools.render_messages(body, self.takes_tools)
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt,
                                                **extra)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    # --------------------------------------------------------------- sampling
    async def grammar(self, body, tool_spec=None) -> Optional[tuple[str, str]]:
        """The request's grammar spec, compiled once here so a bad one is a 400 before queueing."""
        try:
            spec = requested_spec(body)
        except SpecError as e:
            raise APIError(400, str(e), param=e.param, code="invalid_grammar") from None
        if tool_spec is not None:
            if spec is not None:
                raise APIError(400, "tool_choice required / named cannot be combined with a structured "
                                    "output", param="tool_choice")
            spec = tool_spec
        if spec is None:
            return None
        from shepherd.model.grammar import GrammarCompiler, GrammarError
        if self._grammar is None:
            self._grammar = GrammarCompiler(self.tok)
        try:
            await asyncio.to_thread(self._grammar.compile, spec)
        except GrammarError as e:
            raise APIError(400, f"cannot enforce the requested {spec[0]}: {e}", param="response_format",
                           code="invalid_grammar") from None
        return spec

    def logit_bias(self, body) -> Optional[dict[int, float]]:
        if not body.logit_bias:
            return None
        bias = {int(k): float(v) for k, v in body.logit_bias.items()}
        bad = [t for t in bias if not 0 <= t < self.tok.vocab_size]
        if bad:
            raise APIError(400, f"logit_bias token id {bad[0]} is out of range [0, {self.tok.vocab_size})",
                           param="logit_bias")
        return bias

    def params(self, body, max_tokens: int, logprobs: Optional[int], seed: Optional[int],
               grammar, bias) -> SamplingParams:
        temperature = 1.0 if body.temperature is None else float(body.temperature)
        if temperature < SAMPLING_EPS:
            temperature = 0.0   # vLLM's rule: a tiny temperature is greedy (and never divides by ~0)
        return SamplingParams(
            max_tokens=max_tokens, temperature=temperature,
            top_p=1.0 if body.top_p is None else float(body.top_p),
            top_k=body.top_k if body.top_k and body.top_k > 0 else 0,
            min_p=float(body.min_p), repetition_penalty=float(body.repetition_penalty),
            frequency_penalty=float(body.frequency_penalty), presence_penalty=float(body.presence_penalty),
            seed=seed, stop=body.stop_list, stop_token_ids=list(body.stop_token_ids or []),
            ignore_eos=bool(body.ignore_eos), logprobs=logprobs, logit_bias=bias,
            min_tokens=min(int(body.min_tokens), max_tokens),
            include_stop_str_in_output=bool(body.include_stop_str_in_output), grammar=grammar)

    def jobs(self, body, prompts: list[list[int]], max_tokens: list[int], logprobs: Optional[int],
             grammar) -> list:
        """(prompt ids, SamplingParams) per choice: every prompt n times, seeds counted up."""
        self.check_admissible(len(prompts) * body.n)
        bias = self.logit_bias(body)
        out = []
        for pi, ids in enumerate(prompts):
            for _ in range(body.n):
                seed = None if body.seed is None else int(body.seed) + len(out)
                out.append((ids, self.params(body, max_tokens[pi], logprobs, seed, grammar, bias)))
        return out

    @staticmethod
    def client_of(request: Request, body) -> str:
        return body.user or request.headers.get("x-client-id") or "default"


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_req, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, exc: RequestValidationError):
        msg, param = validation_message(exc.errors())
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


def build_app(engine: Engine, server_cfg: Optional[ServerConfig] = None) -> FastAPI:
    server_cfg = server_cfg or ServerConfig()
    ctx = ApiContext(engine, server_cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await engine.start()
        try:
            yield
        finally:
            await engine.stop()

    app = FastAPI(title="shepherd", lifespan=lifespan)
    app.state.engine = engine
    app.state.served_model_name = ctx.served_name
    app.add_middleware(BodyGuard, max_body_bytes=server_cfg.max_body_bytes, max_depth=server_cfg.max_json_depth)
    _install_error_handlers(app)
    completions, chat = CompletionRoutes(ctx), ChatRoutes(ctx)

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
        ctx.check(request, None)
        return {"object": "list", "data": [{
            "id": ctx.served_name, "object": "model", "created": int(time.time()), "owned_by": "shepherd",
            "root": str(engine.cfg.model or ctx.served_name), "parent": None, "max_model_len": ctx.ctx_len}]}

    @app.post("/v1/completions")
    async def create_completion(request: Request, body: CompletionRequest):
        ctx.check(request, body)
        return await completions.handle(request, body, f"cmpl-{uuid.uuid4().hex}")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request, body: ChatCompletionRequest):
        ctx.check(request, body)
        return await chat.handle(request, body, f"chatcmpl-{uuid.uuid4().hex}")

    add_tokenize_routes(app, ctx)
    return app
