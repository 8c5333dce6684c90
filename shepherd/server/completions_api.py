"""POST /v1/completions: prompts (text, token ids, batches) x n choices, echo, stream or not."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from shepherd.server.common import (APIError, AbortingStreamingResponse, completion_logprobs, sse_chunk,
                                    usage_dict)
from shepherd.server.engine_io import collect, merged, release, stream_error_chunk, submit_all, until_disconnect
from shepherd.server.protocol import CompletionRequest


def sse_response(gen, streams) -> AbortingStreamingResponse:
    """The stream out; closing it early (client gone) releases the requests."""
    return AbortingStreamingResponse(gen, lambda: release(streams), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})


class CompletionRoutes:
    def __init__(self, ctx):
        self.ctx = ctx

    async def prompts(self, body: CompletionRequest) -> list[list[int]]:
        ctx, out = self.ctx, []
        for p in body.prompts():
            if isinstance(p, str):
                ids = await ctx.encode(p, True)
            else:
                ids = list(p)
                bad = [t for t in ids if not (0 <= t < ctx.tok.vocab_size)]
                if bad:
                    raise APIError(400, f"prompt token id {bad[0]} is out of range [0, {ctx.tok.vocab_size})",
                                   param="prompt")
            if not ids:
                raise APIError(400, "prompt must contain at least one token", param="prompt")
            out.append(ids)
        return out

    async def handle(self, request: Request, body: CompletionRequest, rid: str):
        ctx = self.ctx
        if len(body.prompts()) * body.n > 1:
            ctx.check_admissible(len(body.prompts()) * body.n)   # before tokenizing a huge batch
        prompts = await self.prompts(body)
        max_tokens = [ctx.resolve_max_tokens(len(ids), body.max_tokens, 16) for ids in prompts]
        grammar = await ctx.grammar(body)
        jobs = ctx.jobs(body, prompts, max_tokens, body.logprobs, grammar)
        streams = await submit_all(ctx.engine, jobs, ctx.client_of(request, body), body.priority, rid)
        echo = [ctx.tok.decode(ids, skip_special_tokens=False) if body.echo else "" for ids, _ in jobs]
        meta = {"rid": rid, "created": int(time.time()), "prompt_tokens": sum(len(p) for p in prompts)}
        if body.stream:
            return sse_response(self.stream(body, streams, echo, meta), streams)
        res = await until_disconnect(request, collect(streams))
        if res is None:
            return Response(status_code=499)
        texts, lps, final = res
        tokstr = ctx.tokstr
        choices = [{"index": i, "text": echo[i] + texts[i],
                    "logprobs": completion_logprobs(tokstr, lps[i], 0) if body.logprobs is not None else None,
                    "finish_reason": final[i].finish_reason, "stop_reason": final[i].stop_reason}
                   for i in range(len(streams))]
        return {"id": rid, "object": "text_completion", "created": meta["created"], "model": ctx.served_name,
                "choices": choices,
                "usage": usage_dict(meta["prompt_tokens"], sum(f.completion_tokens for f in final),
                                    max(f.cached_tokens for f in final))}

    async def stream(self, body: CompletionRequest, streams, echo: list[str], meta: dict):
        ctx, n = self.ctx, len(streams)
        include_usage = body.include_usage

        def chunk(choices, usage=None) -> str:
            return sse_chunk("text_completion", meta, ctx.served_name, include_usage, choices, usage)

        comp, cached, offsets = [0] * n, [0] * n, [len(e) for e in echo]
        try:
            for i, e in enumerate(echo):
                if e:
                    yield chunk([{"index": i, "text": e, "logprobs": None, "finish_reason": None,
                                  "stop_reason": None}])
            async for i, out in merged(streams):
                if out.error is not None:
                    yield stream_error_chunk(out)
                    break
                comp[i], cached[i] = out.completion_tokens, out.cached_tokens
                if not out.text and not out.finished and not out.logprobs:
                    continue
                lp = None
                if body.logprobs is not None:
                    lp = completion_logprobs(ctx.tokstr, out.logprobs, offsets[i])
                offsets[i] += len(out.text)
                yield chunk([{"index": i, "text": out.text, "logprobs": lp,
                              "finish_reason": out.finish_reason if out.finished else None,
                              "stop_reason": out.stop_reason}])
            else:
                if include_usage:
                    yield chunk([], usage_dict(meta["prompt_tokens"], sum(comp), max(cached)))
            yield "data: [DONE]\n\n"
        finally:
            release(streams)
