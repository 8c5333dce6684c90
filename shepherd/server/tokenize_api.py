"""POST /tokenize, POST /detokenize (vLLM's shapes) and GET /version."""
from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

from fastapi import FastAPI

from shepherd.server.common import APIError
from shepherd.server.protocol import DetokenizeRequest, TokenizeRequest


def shepherd_version() -> str:
    try:
        return metadata.version("shepherd")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def add_tokenize_routes(app: FastAPI, ctx) -> None:
    """ctx: the server's ApiContext (tok, ctx_len, check, encode, render_chat, decode)."""
    tok = ctx.tok

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        ctx.check(body)
        if body.messages is not None:
            text = await ctx.render_chat(SimpleNamespace(messages=body.messages, tools=None, tool_choice=None,
                                                         add_generation_prompt=body.add_generation_prompt))
            special, param = bool(body.add_special_tokens), "messages"
        else:
            text, special, param = body.prompt, body.add_special_tokens is not False, "prompt"
        ids = await ctx.encode(text, special, param)
        strs = (lambda: [tok.id_to_token(i) for i in ids]) if body.return_token_strs else None
        return await ctx.answer({"count": len(ids), "max_model_len": ctx.ctx_len, "tokens": ids,
                                 "token_strs": strs}, len(ids))

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        ctx.check(body)
        if len(body.tokens) > ctx.ctx_len:
            raise APIError(400, f"{len(body.tokens)} tokens are more than the model's context of {ctx.ctx_len}",
                           param="tokens", code="context_length_exceeded")
        bad = next((t for t in body.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is out of range [0, {tok.vocab_size})", param="tokens")
        return {"prompt": await ctx.decode(body.tokens)}

    @app.get("/version")
    async def version():
        return {"version": shepherd_version()}
