"""POST /tokenize, POST /detokenize (vLLM's shapes) and GET /version."""
from __future__ import annotations

from importlib import metadata
from types import SimpleNamespace

from fastapi import FastAPI, Request

from shepherd.server.common import APIError
from shepherd.server.protocol import DetokenizeRequest, TokenizeRequest


def shepherd_version() -> str:
    try:
        return metadata.version("shepherd")
    except metadata.PackageNotFoundError:
        return "0.1.0"


def add_tokenize_routes(app: FastAPI, ctx) -> None:
    """ctx: the server's ApiContext (tok, ctx_len, check, encode, render_chat)."""
    tok, check = ctx.tok, ctx.check

    @app.post("/tokenize")
    async def tokenize(request: Request, body: TokenizeRequest):
        check(request, body)
        if body.messages is not None:
            text = ctx.render_chat(SimpleNamespace(messages=body.messages, tools=None, tool_choice=None,
                                                   add_generation_prompt=body.add_generation_prompt))
            special = bool(body.add_special_tokens)
        else:
            text, special = body.prompt, body.add_special_tokens is not False
        ids = await ctx.encode(text, special)
        out = {"count": len(ids), "max_model_len": ctx.ctx_len, "tokens": ids, "token_strs": None}
        if body.return_token_strs:
            out["token_strs"] = [tok.id_to_token(i) for i in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(request: Request, body: DetokenizeRequest):
        check(request, body)
        bad = [t for t in body.tokens if not 0 <= t < tok.vocab_size]
        if bad:
            raise APIError(400, f"token id {bad[0]} is out of range [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(body.tokens, skip_special_tokens=False)}

    @app.get("/version")
    async def version():
        return {"version": shepherd_version()}
