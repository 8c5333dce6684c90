"""POST /v1/chat/completions: the chat template, tools, n choices, stream or not.

With tool_choice auto / required a choice's text is parsed into tool calls
once it is complete, so a streamed answer sends its content or its
tool-call deltas at the end, in OpenAI's chunk shapes (one delta per call:
index, id, type, function name and arguments). A named choice's text is
the call's arguments, streamed as argument deltas as it is generated."""
from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import Response

from shepherd.server import tools
from shepherd.server.common import APIError, chat_logprobs, sse_chunk, usage_dict
from shepherd.server.completions_api import sse_response
from shepherd.server.engine_io import collect, merged, release, stream_error_chunk, submit_all, until_disconnect
from shepherd.server.protocol import ChatCompletionRequest


class ChatRoutes:
    def __init__(self, ctx):
        self.ctx = ctx

    def message(self, body, text: str, finish_reason: str):
        """(message, finish_reason) of one finished choice."""
        if tools.choice_mode(body) == "none":
            return {"role": "assistant", "content": text}, finish_reason
        content, calls = tools.parse_output(text, body, self.ctx.cfg.tool_call_parser)
        msg = {"role": "assistant", "content": content}
        if calls:
            msg["tool_calls"] = calls
            if finish_reason == "stop":
                finish_reason = "tool_calls"
        return msg, finish_reason

    async def handle(self, request: Request, body: ChatCompletionRequest, rid: str):
        ctx = self.ctx
        ids = await ctx.encode(ctx.render_chat(body), False)
        if not ids:
            raise APIError(400, "the chat prompt is empty", param="messages")
        max_tokens = ctx.resolve_max_tokens(len(ids), body.effective_max_tokens, None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        grammar = await ctx.grammar(body, tools.tool_grammar(body))
        jobs = ctx.jobs(body, [ids], [max_tokens], logprobs, grammar)
        streams = await submit_all(ctx.engine, jobs, ctx.client_of(request, body), body.priority, rid)
        meta = {"rid": rid, "created": int(time.time()), "prompt_tokens": len(ids), "logprobs": logprobs}
        if body.stream:
            return sse_response(self.stream(body, streams, meta), streams)
        res = await until_disconnect(request, collect(streams))
        if res is None:
            return Response(status_code=499)
        texts, lps, final = res
        choices = []
        for i in range(len(streams)):
            msg, reason = self.message(body, texts[i], final[i].finish_reason)
            choices.append({"index": i, "message": msg,
                            "logprobs": chat_logprobs(ctx.tokstr, lps[i]) if logprobs is not None else None,
                            "finish_reason": reason, "stop_reason": final[i].stop_reason})
        return {"id": rid, "object": "chat.completion", "created": meta["created"], "model": ctx.served_name,
                "choices": choices,
                "usage": usage_dict(len(ids), sum(f.completion_tokens for f in final),
                                    max(f.cached_tokens for f in final))}

    def final_deltas(self, body, i: int, text: str, out) -> list[dict]:
        """The closing chunk(s) of a choice whose text was held for tool parsing."""
        msg, reason = self.message(body, text, out.finish_reason)
        end = {"index": i, "delta": {}, "logprobs": None, "finish_reason": reason,
               "stop_reason": out.stop_reason}
        if not msg.get("tool_calls"):
            return [dict(end, delta={"content": msg["content"]} if msg["content"] else {})]
        deltas = [{"index": i, "delta": {"tool_calls": [dict(call, index=k)]}, "logprobs": None,
                   "finish_reason": None} for k, call in enumerate(msg["tool_calls"])]
        if msg["content"]:
            deltas.insert(0, {"index": i, "delta": {"content": msg["content"]}, "logprobs": None,
                              "finish_reason": None})
        return deltas + [end]

    @staticmethod
    def named_delta(body, i: int, call_id: str, first: bool, out) -> dict:
        """One streamed piece of a named tool call: the first names the call, the rest add arguments."""
        fn = {"arguments": out.text}
        call = {"index": 0, "function": fn}
        if first:
            fn["name"] = body.tool_choice.function.name
            call.update(id=call_id, type="function")
        reason = None
        if out.finished:
            reason = "tool_calls" if out.finish_reason == "stop" else out.finish_reason
        return {"index": i, "delta": {"tool_calls": [call]}, "logprobs": None, "finish_reason": reason}

    async def stream(self, body: ChatCompletionRequest, streams, meta: dict):
        ctx, n = self.ctx, len(streams)
        include_usage, logprobs = body.include_usage, meta["logprobs"]
        hold = tools.choice_mode(body) != "none"

        def chunk(choices, usage=None) -> str:
            return sse_chunk("chat.completion.chunk", meta, ctx.served_name, include_usage, choices, usage)

        named = tools.choice_mode(body) == "named"
        hold = hold and not named       # a named call's text is its arguments: streamed as they come
        call_ids = [tools.new_call_id() for _ in range(n)] if named else []
        comp, cached, held = [0] * n, [0] * n, [""] * n
        try:
            for i in range(n):
                yield chunk([{"index": i, "delta": {"role": "assistant", "content": ""},
                              "logprobs": None, "finish_reason": None}])
            async for i, out in merged(streams):
                if out.error is not None:
                    yield stream_error_chunk(out)
                    break
                comp[i], cached[i] = out.completion_tokens, out.cached_tokens
                if hold:
                    held[i] += out.text
                    if out.finished:
                        for d in self.final_deltas(body, i, held[i], out):
                            yield chunk([d])
                    continue
                if not out.text and not out.finished and not out.logprobs:
                    continue
                if named:
                    yield chunk([self.named_delta(body, i, call_ids[i], held[i] == "", out)])
                    held[i] += out.text
                    continue
                delta = {"content": out.text} if (out.text or not out.finished) else {}
                yield chunk([{"index": i, "delta": delta,
                              "logprobs": chat_logprobs(ctx.tokstr, out.logprobs) if logprobs is not None else None,
                              "finish_reason": out.finish_reason if out.finished else None,
                              **({"stop_reason": out.stop_reason} if out.finished else {})}])
            else:
                if include_usage:
                    yield chunk([], usage_dict(meta["prompt_tokens"], sum(comp), max(cached)))
            yield "data: [DONE]\n\n"
        finally:
            release(streams)
