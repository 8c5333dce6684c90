"""OpenAI-compatible HTTP API over an Engine (FastAPI).

    app = build_app(engine, ServerConfig(...))    # uvicorn.run(app) / httpx.ASGITransport(app)

Routes: POST /v1/completions, POST /v1/chat/completions (stream and not),
POST /tokenize, POST /detokenize, GET /version, GET /v1/models, GET /health,
GET /metrics, POST /v1/load_lora_adapter, POST /v1/unload_lora_adapter (vLLM's:
a request names a LoRA adapter by `model`; docs/SERVING.md "LoRA adapters"), POST
/reset_prefix_cache (vLLM's: docs/ROUTING.md "Fleets"). Request bodies are the pydantic models of protocol.py, so
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
from contextlib import asynccontextmanager
from typing import Optional

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from shepherd.config import ServerConfig
from shepherd.engine.engine import Engine, EngineDeadError, LoraOpError
from shepherd.engine.metrics import CONTENT_TYPE_LATEST
from shepherd.request import SamplingParams, context_error
from shepherd.server import tools
from shepherd.server.chat_api import ChatRoutes
from shepherd.server.common import (APIError, TokenStrings, error_response, json_answer, json_chunks,
                                    validation_message)
from shepherd.server.completions_api import CompletionRoutes
from shepherd.server.engine_io import too_many_logprobs
from shepherd.server.grammar_check import GrammarCheck
from shepherd.server.guard import BODY_CAP_HEADER, BodyGuard, JsonRoute, request_id_of
from shepherd.server.limits import Limits
from shepherd.server.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoraAdapterRequest,
                                     UnloadLoraAdapterRequest)
from shepherd.server.responses_api import ResponsesRequest, ResponsesRoutes
from shepherd.server.structured import SpecError, requested_spec
from shepherd.server.tokenize_api import add_tokenize_routes
from shepherd.server.workpool import INLINE_COST, MESSAGE_COST, WorkPool

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
        self.limits = Limits.resolve(cfg, min(engine.max_model_len, engine.kv_capacity), self.tok)
        self.work = WorkPool()
        self.grammars = GrammarCheck(self.tok, self.limits.grammar_timeout, self.limits.max_grammar_bytes)

    # ------------------------------------------------------------------ checks
    def check(self, body) -> None:
        """The model name (the key was checked at the door, before the body was read)."""
        model = getattr(body, "model", None)
        if model is not None and model not in self.aliases and model not in self.engine.lora_adapters:
            names = ", ".join([self.served_name, *self.engine.lora_adapters])
            # vLLM answers an unknown adapter with a 404; without LoRA an unknown model stays a 400
            raise APIError(404 if self.engine.lora_enabled else 400,
                           f"The model `{model}` does not exist. Available: {names}.",
                           "NotFoundError" if self.engine.lora_enabled else "invalid_request_error",
                           param="model", code="model_not_found")

    def adapter_of(self, body) -> Optional[str]:
        """The LoRA adapter the request's `model` names (None: the base model)."""
        model = getattr(body, "model", None)
        return model if model is not None and model not in self.aliases and model in self.engine.lora_adapters \
            else None

    def check_admissible(self, nchoice: int) -> None:
        """A request with more choices than the engine can ever hold at once is a 400, not a 429."""
        sc = self.engine.cfg.scheduler
        for limit, name in ((sc.max_concurrency, "--max-concurrency"), (sc.max_queue, "--max-queue")):
            if nchoice > limit:
                raise APIError(400, f"this request needs {nchoice} sequences at once (prompts x n), more "
                                    f"than the server ever admits ({name} {limit}); split it",
                               param="n", code="request_too_large")

    def unsent_limit(self, body) -> Optional[int]:
        """A streamed answer's bound on what its client leaves unread (None: not streamed; the
        non-streamed answer is bounded whole, engine_io.collect)."""
        return self.limits.max_logprob_entries if body.stream else None

    def check_held(self, body, entries: int) -> None:
        """A non-streamed answer is held whole until it is sent (a streamed one is not): one whose
        prompts' logprobs alone pass --max-logprob-entries is a 400 before any work; the output's
        are counted as they come (engine_io.collect)."""
        cap = self.limits.max_logprob_entries
        if entries > cap and not body.stream:
            raise too_many_logprobs(entries, cap, "in the prompts' logprobs alone")

    def too_long(self, tokens: int, param: str) -> APIError:
        cap = min(self.ctx_len, self.engine.kv_capacity)
        return APIError(400, f"This model's maximum context length is {cap} tokens. However, your prompt has "
                             f"{tokens} tokens; please shorten it.", param=param, code="context_length_exceeded")

    def resolve_max_tokens(self, prompt_len: int, requested: Optional[int], default: Optional[int]) -> int:
        ctx_len, cap = self.ctx_len, self.engine.kv_capacity
        if context_error(prompt_len, min(ctx_len, cap)) is not None:     # the one rule (request.py)
            raise self.too_long(prompt_len, "messages" if default is None else "prompt")
        if requested is None:
            return max(1, (default if default is not None else min(ctx_len, cap) - prompt_len))
        if prompt_len + requested > ctx_len:
            raise APIError(400, f"This model's maximum context length is {ctx_len} tokens. However, you "
                                f"requested {prompt_len + requested} tokens ({prompt_len} in the prompt, "
                                f"{requested} for the completion). Please reduce the prompt or max_tokens.",
                           param="max_tokens", code="context_length_exceeded")
        return requested

    # ------------------------------------------------------------ size-bound work
    def check_chars(self, chars: int, param: str) -> None:
        """A text longer than the context could hold, however it tokenizes: refused untokenized."""
        if chars > self.limits.max_prompt_chars:
            cap = min(self.ctx_len, self.engine.kv_capacity)
            raise APIError(400, f"This model's maximum context length is {cap} tokens; your {param} has {chars} "
                                f"characters, more than {cap} tokens of at most "
                                f"{self.limits.max_prompt_chars // max(cap, 1)} characters each could hold. Please "
                                "shorten it.", param=param, code="context_length_exceeded")

    def _encode_bounded(self, text: str, add_special_tokens: bool, param: str) -> list[int]:
        """Tokenize; a long text is first probed by a prefix, so a text far over the context is
        refused after one context's worth of work (a prefix never has fewer tokens than it
        contributes to the whole, give or take the token it cuts)."""
        cap = min(self.ctx_len, self.engine.kv_capacity)
        probe = 8 * cap
        if len(text) > 2 * probe:
            n = len(self.tok.encode(text[:probe], add_special_tokens=False))
            if n > cap + 1:
                raise self.too_long(n, param)
        return self.tok.encode(text, add_special_tokens=add_special_tokens)

    async def encode(self, text: str, add_special_tokens: bool, param: str = "prompt") -> list[int]:
        """Token ids of a prompt; size-bound: refused by length first, long ones off the event loop."""
        self.check_chars(len(text), param)
        return await self.work.run(self._encode_bounded, text, add_special_tokens, param, cost=len(text))

    def _render(self, messages, add_generation_prompt: bool, extra: dict) -> str:
        try:
            return self.tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, **extra)
        except Exception as e:  # noqa: BLE001 - template errors are the caller's input
            raise APIError(400, f"cannot apply the chat template: {e}", param="messages") from None

    def _render_chat(self, body) -> str:
        self.check_chars(sum(len(m.text()) for m in body.messages), "messages")
        messages, extra = tools.render_messages(body, self.takes_tools)
        return self._render(messages, body.add_generation_prompt, extra)

    async def render_chat(self, body) -> str:
        # The template's work grows with the messages as well as their text: 43,000 empty messages
        # (a 1.3 MB body) took ~120 ms to count, list and render, inline on the event loop when the
        # cost was their characters alone (0). Many messages go to the worker uncounted.
        cost = MESSAGE_COST * len(body.messages)
        if cost < INLINE_COST:
            cost += sum(len(m.text()) for m in body.messages)
        return await self.work.run(self._render_chat, body, cost=cost)

    async def decode(self, ids: list[int]) -> str:
        return await self.work.run(self.tok.decode, ids, False, cost=len(ids))

    async def answer(self, body: dict, cost: int) -> Response:
        """A non-streamed answer as JSON. `cost`: its logprob entries (or token ids); a large one
        is encoded in the worker a slice at a time, and waits its turn there rather than being
        refused: the engine's work is done."""
        return json_answer(await self.work.run(json_chunks, body, cost=cost, may_refuse=False))

    # --------------------------------------------------------------- sampling
    async def grammar(self, body, tool_spec=None) -> Optional[tuple[str, str]]:
        """The request's grammar spec, compiled once (in a worker, on a budget) so that a bad or
        too costly one is a 400 before queueing."""
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
        await self.grammars.check(spec, "tools" if tool_spec is not None else "response_format")
        return spec

    async def logit_bias(self, body) -> Optional[dict[int, float]]:
        """The request's logit_bias with int keys; refused by size first, a large one checked off the loop."""
        if not body.logit_bias:
            return None
        if len(body.logit_bias) > self.limits.max_logit_bias:
            raise APIError(400, f"logit_bias has {len(body.logit_bias)} entries, more than the vocabulary's "
                                f"{self.tok.vocab_size} tokens", param="logit_bias")
        return await self.work.run(self._bias, body.logit_bias, cost=10 * len(body.logit_bias))

    def _bias(self, given: dict) -> dict[int, float]:
        vocab, bias = self.tok.vocab_size, {}
        for k, v in given.items():
            try:
                t = int(k)
            except ValueError:
                raise APIError(400, f"logit_bias keys must be token ids, got {k[:40]!r}", param="logit_bias") from None
            if not 0 <= t < vocab:
                raise APIError(400, f"logit_bias token id {t} is out of range [0, {vocab})", param="logit_bias")
            if not -100.0 <= v <= 100.0:
                raise APIError(400, f"logit_bias values must be in [-100, 100], got {v} for token {t}",
                               param="logit_bias")
            bias[t] = float(v)
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
            include_stop_str_in_output=bool(body.include_stop_str_in_output), grammar=grammar,
            prompt_logprobs=getattr(body, "prompt_logprobs_n", None))

    def jobs(self, body, prompts: list[list[int]], max_tokens: list[int], logprobs: Optional[int],
             grammar, bias) -> list:
        """(prompt ids, SamplingParams) per choice: every prompt n times, seeds counted up."""
        self.check_admissible(len(prompts) * body.n)
        self.check_held(body, body.n * sum(body.logprob_entries(len(ids), 0) for ids in prompts))
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
    # an unexpected error (a bug) is answered by BodyGuard._run, which keeps the connection


async def _lora_call(op, param: str) -> None:
    """A load or unload through the core, its refusal as the HTTP error it stands for."""
    try:
        await op
    except LoraOpError as e:
        type_ = {404: "NotFoundError", 409: "conflict_error"}.get(e.status, "invalid_request_error")
        raise APIError(e.status, str(e), type_, param=param if e.status == 400 else "lora_name",
                       code=e.kind) from None
    except EngineDeadError as e:
        raise APIError(503, f"Engine unavailable: {e}", "server_error", code="engine_dead") from None


def build_app(engine: Engine, server_cfg: Optional[ServerConfig] = None) -> FastAPI:
    server_cfg = server_cfg or ServerConfig()
    ctx = ApiContext(engine, server_cfg)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        if server_cfg.warm_grammar_worker:
            ctx.grammars.start()        # its import (~1.5 s of a core) overlaps the engine's start
        await engine.start()
        try:
            await asyncio.to_thread(ctx.tok.warm_chat_template)
        except Exception as e:  # noqa: BLE001 - each chat request then answers 400 naming it
            logger.warning("the chat template does not compile: %s", e)
        # Answer only once the worker is up: importing beside the first requests took a core
        # from the engine (the thread governor dropped to one thread, 32 tokens 0.58-0.76 s
        # against 0.40-0.50, docs/SERVING.md).
        if server_cfg.warm_grammar_worker and not await ctx.grammars.wait_ready():
            logger.warning("the grammar worker did not start; structured outputs start it on first use")
        try:
            yield
        finally:
            ctx.grammars.stop()
            ctx.work.close()
            await engine.stop()

    app = FastAPI(title="shepherd", lifespan=lifespan)
    app.router.route_class = JsonRoute
    app.state.engine = engine
    app.state.served_model_name = ctx.served_name
    app.state.limits = ctx.limits
    app.state.grammars = ctx.grammars
    app.state.workpool = ctx.work          # JsonRoute validates large bodies there
    lim = ctx.limits
    app.add_middleware(BodyGuard, max_body_bytes=lim.max_body_bytes, max_depth=lim.max_json_depth,
                       api_key=server_cfg.api_key, body_timeout=lim.body_timeout)
    _install_error_handlers(app)
    completions, chat = CompletionRoutes(ctx), ChatRoutes(ctx)
    responses = ResponsesRoutes(ctx, chat)

    @app.get("/health")
    async def health():
        cap = {BODY_CAP_HEADER: str(lim.max_body_bytes)}      # for a gateway or Ray ingress in front
        if engine.alive:
            return Response(status_code=200, headers=cap)
        return error_response(503, f"engine not running: {engine.dead_reason or 'not started'}",
                              "server_error", code=503, headers=cap)

    @app.get("/metrics")
    async def metrics():
        return Response(engine.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card() -> dict:
        return {"id": ctx.served_name, "object": "model", "created": int(time.time()), "owned_by": "shepherd",
                "root": str(engine.cfg.model or ctx.served_name), "parent": None, "max_model_len": ctx.ctx_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()] + [adapter_card(n) for n in engine.lora_adapters]}

    def adapter_card(name: str) -> dict:
        return dict(model_card(), id=name, root=engine.lora_adapters[name], parent=ctx.served_name)

    @app.get("/v1/models/{model_id:path}")
    async def retrieve_model(model_id: str):
        if model_id in engine.lora_adapters:
            return adapter_card(model_id)
        if model_id not in ctx.aliases:
            raise APIError(404, f"The model `{model_id}` does not exist. Available: {ctx.served_name}.",
                           param="model", code="model_not_found")
        return model_card()

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoraAdapterRequest):
        if body.lora_name in ctx.aliases:
            raise APIError(400, f"`{body.lora_name}` is the base model's name; pick another for the adapter",
                           param="lora_name")
        if body.lora_name in engine.lora_adapters:
            raise APIError(400, f"The lora adapter '{body.lora_name}' has already been loaded.",
                           param="lora_name", code="lora_already_loaded")
        await _lora_call(engine.load_lora(body.lora_name, body.lora_path), "lora_path")
        return Response(f"Success: LoRA adapter '{body.lora_name}' added successfully.", media_type="text/plain")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoraAdapterRequest):
        await _lora_call(engine.unload_lora(body.lora_name), "lora_name")
        return Response(f"Success: LoRA adapter '{body.lora_name}' removed successfully.", media_type="text/plain")

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache(reset_running_requests: bool = False):
        # vLLM's route (its dev mode; here behind --api-key like every other route). Blocks in use
        # by running requests stay valid and cached (RadixCache.reset); vLLM's
        # reset_running_requests=true would preempt those requests instead, which shepherd does not.
        if reset_running_requests:
            raise APIError(400, "reset_running_requests=true is not supported: blocks in use by running "
                                "requests stay cached and valid, everything else is cleared",
                           param="reset_running_requests")
        try:
            await engine.reset_prefix_cache()
        except EngineDeadError as e:
            raise APIError(503, f"Engine unavailable: {e}", "server_error", code="engine_dead") from None
        return Response(status_code=200)

    @app.post("/v1/completions")
    async def create_completion(request: Request, body: CompletionRequest):
        ctx.check(body)
        return await completions.handle(request, body, f"cmpl-{request_id_of(request)}")

    @app.post("/v1/chat/completions")
    async def create_chat_completion(request: Request, body: ChatCompletionRequest):
        ctx.check(body)
        return await chat.handle(request, body, f"chatcmpl-{request_id_of(request)}")

    @app.post("/v1/responses")
    async def create_response(request: Request, body: ResponsesRequest):
        ctx.check(body)
        return await responses.handle(request, body)

    add_tokenize_routes(app, ctx)
    return app
