"""POST /v1/completions: prompts (text, token ids, batches) x n choices, echo, stream or not."""
from __future__ import annotations

import functools
import time
from typing import Optional

from fastapi import Request
from fastapi.responses import Response

from shepherd.server.common import (APIError, AbortingStreamingResponse, completion_logprobs, echo_logprobs,
                                    sse_chunker, usage_dict, vllm_prompt_logprobs)
from shepherd.server.engine_io import collect, release, sse_events, submit_all, until_disconnect
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
        vocab = ctx.tok.vocab_size
        for p in body.prompts():
            if isinstance(p, str):
                ids = await ctx.encode(p, True)
            else:
                ids = list(p)
                ctx.resolve_max_tokens(len(ids), None, 16)        # too long: refused before the id scan
                bad = next((t for t in ids if not 0 <= t < vocab), None)
                if bad is not None:
                    raise APIError(400, f"prompt token id {bad} is out of range [0, {vocab})", param="prompt")
            if not ids:
                raise APIError(400, "prompt must contain at least one token", param="prompt")
            out.append(ids)
        return out

    async def handle(self, request: Request, body: CompletionRequest, rid: str):
        ctx = self.ctx
        ctx.check_admissible(len(body.prompts()) * body.n)          # before tokenizing a huge batch
        bias = await ctx.logit_bias(body)
        grammar = await ctx.grammar(body)
        prompts = await self.prompts(body)
        max_tokens = [ctx.resolve_max_tokens(len(ids), body.max_tokens, 16) for ids in prompts]
        jobs = ctx.jobs(body, prompts, max_tokens, body.logprobs, grammar, bias)
        echo = [await ctx.decode(ids) if body.echo else "" for ids, _ in jobs]   # may 429: before any work
        streams = await submit_all(ctx.engine, jobs, ctx.client_of(request, body), body.priority, rid,
                                   ctx.adapter_of(body), ctx.unsent_limit(body))
        meta = {"rid": rid, "created": int(time.time()), "model": ctx.adapter_of(body) or ctx.served_name,
                "prompt_tokens": sum(len(p) for p in prompts)}
        prompt_ids = [ids for ids, _ in jobs]
        if body.stream:
            return sse_response(self.stream(body, streams, echo, prompt_ids, meta), streams)
        res = await until_disconnect(request, collect(streams, ctx.limits.max_logprob_entries))
        if res is None:
            return Response(status_code=499)
        texts, lps, final, ids = res

        def choice(i: int) -> dict:
            c = {"index": i, "text": echo[i] + texts[i],
                 "logprobs": self.logprobs(body, prompt_ids[i], final[i].prompt_logprobs, lps[i], len(echo[i])),
                 "finish_reason": final[i].finish_reason, "stop_reason": final[i].stop_reason}
            if body.return_token_ids:
                c["prompt_token_ids"], c["token_ids"] = prompt_ids[i], ids[i]
            if body.prompt_logprobs is not None:
                c["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokstr, final[i].prompt_logprobs)
            return c

        answer = {"id": rid, "object": "text_completion", "created": meta["created"], "model": meta["model"],
                  "choices": [functools.partial(choice, i) for i in range(len(streams))],
                  "usage": usage_dict(meta["prompt_tokens"], sum(f.completion_tokens for f in final),
                                      max(f.cached_tokens for f in final))}
        ids_out = sum(len(p) + len(t) for p, t in zip(prompt_ids, ids)) if body.return_token_ids else 0
        return await ctx.answer(answer, ids_out + sum(body.logprob_entries(len(p), f.completion_tokens)
                                                      for p, f in zip(prompt_ids, final)))

    def logprobs(self, body: CompletionRequest, prompt_ids: list[int], plp, lps, offset: int) -> Optional[dict]:
        """A choice's `logprobs` (or a chunk's): the completion's tokens from `offset` in the text;
        with echo, the prompt's tokens before them."""
        if body.logprobs is None:
            return None
        comp = completion_logprobs(self.ctx.tokstr, lps, offset)
        return echo_logprobs(self.ctx.tokstr, prompt_ids, plp, comp) if body.echo else comp

    def stream(self, body: CompletionRequest, streams, echo: list[str], prompt_ids: list[list[int]], meta: dict):
        ctx = self.ctx
        offsets = [len(e) for e in echo]
        # the prompt's logprobs come with the first token: the echo then goes out in that chunk
        late = body.prompt_logprobs_n is not None
        first = [True] * len(echo)

        chunk = sse_chunker("text_completion", meta, meta["model"], body.include_usage, body.continuous_usage)

        def on_output(i: int, out):
            if not out.text and not out.finished and not out.logprobs and out.prompt_logprobs is None \
                    and not (body.return_token_ids and out.token_ids):
                return
            text, lp = out.text, None
            if body.logprobs is not None:
                lp = completion_logprobs(ctx.tokstr, out.logprobs, offsets[i])
            if late and first[i]:
                text = echo[i] + text
                if body.echo and lp is not None:
                    lp = echo_logprobs(ctx.tokstr, prompt_ids[i], out.prompt_logprobs, lp)
            offsets[i] += len(out.text)
            c = {"index": i, "text": text, "logprobs": lp, "finish_reason": out.finish_reason if out.finished else None,
                 "stop_reason": out.stop_reason}
            if late and first[i] and body.prompt_logprobs is not None:
                c["prompt_logprobs"] = vllm_prompt_logprobs(ctx.tokstr, out.prompt_logprobs)
            if body.return_token_ids:      # vLLM's: the prompt's ids in the first chunk, then each delta's
                c["prompt_token_ids"] = prompt_ids[i] if first[i] else None
                c["token_ids"] = list(out.token_ids)
            first[i] = False
            yield chunk([c], out=out)

        def usage(completion: int, cached: int):
            return chunk([], usage_dict(meta["prompt_tokens"], completion, cached)) if body.include_usage else None

        prelude = [] if late else [
            chunk([{"index": i, "text": e, "logprobs": None, "finish_reason": None, "stop_reason": None}],
                  usage_dict(len(prompt_ids[i]), 0, 0) if body.continuous_usage else None)
            for i, e in enumerate(echo) if e]
        return sse_events(streams, on_output, usage, prelude)
