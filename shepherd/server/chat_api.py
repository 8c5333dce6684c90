"""POST /v1/chat/completions: the chat template, tools, n choices, stream or not.

With tool_choice auto / required a choice's text is scanned for tool calls
as it is generated (tool_stream.py), so a streamed answer sends content and
tool-call deltas in OpenAI's chunk shapes as they come: a call's first delta
has its index, id, type and function name, the next ones pieces of its
arguments. A named choice's text is the call's arguments, streamed as
argument deltas as it is generated."""
from __future__ import annotations

import functools
import time

from fastapi import Request
from fastapi.responses import Response

from shepherd.server import tools
from shepherd.server.common import APIError, chat_logprobs, sse_chunker, usage_dict
from shepherd.server.completions_api import sse_response
from shepherd.server.engine_io import collect, sse_events, submit_all, until_disconnect
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

    async def submit(self, request: Request, body: ChatCompletionRequest, rid: str) -> tuple[list, dict]:
        """Everything up to the engine: checks, grammar, template, tokens; (streams, meta).
        /v1/responses goes through here too."""
        ctx = self.ctx
        ctx.check_admissible(body.n)
        bias = await ctx.logit_bias(body)
        grammar = await ctx.grammar(body, tools.tool_grammar(body))
        ids = await ctx.encode(await ctx.render_chat(body), False, "messages")
        if not ids:
            raise APIError(400, "the chat prompt is empty", param="messages")
        max_tokens = ctx.resolve_max_tokens(len(ids), body.effective_max_tokens, None)
        logprobs = (body.top_logprobs or 0) if body.logprobs else None
        jobs = ctx.jobs(body, [ids], [max_tokens], logprobs, grammar, bias)
        streams = await submit_all(ctx.engine, jobs, ctx.client_of(request, body), body.priority, rid,
                                   ctx.adapter_of(body), ctx.unsent_limit(body))
        return streams, {"rid": rid, "created": int(time.time()), "model": ctx.adapter_of(body) or ctx.served_name,
                         "prompt_tokens": len(ids), "logprobs": logprobs}

    async def handle(self, request: Request, body: ChatCompletionRequest, rid: str):
        ctx = self.ctx
        streams, meta = await self.submit(request, body, rid)
        ids_len, logprobs = meta["prompt_tokens"], meta["logprobs"]
        if body.stream:
            return sse_response(self.stream(body, streams, meta), streams)
        res = await until_disconnect(request, collect(streams, ctx.limits.max_logprob_entries))
        if res is None:
            return Response(status_code=499)
        texts, lps, final, _ = res

        def choice(i: int) -> dict:
            msg, reason = self.message(body, texts[i], final[i].finish_reason)
            return {"index": i, "message": msg,
                    "logprobs": chat_logprobs(ctx.tokstr, lps[i]) if logprobs is not None else None,
                    "finish_reason": reason, "stop_reason": final[i].stop_reason}

        answer = {"id": rid, "object": "chat.completion", "created": meta["created"], "model": meta["model"],
                  "choices": [functools.partial(choice, i) for i in range(len(streams))],
                  "usage": usage_dict(ids_len, sum(f.completion_tokens for f in final),
                                      max(f.cached_tokens for f in final))}
        return await ctx.answer(answer, sum(body.logprob_entries(ids_len, f.completion_tokens) for f in final))

    @staticmethod
    def scanned_deltas(i: int, events: list, call_ids: dict) -> list[dict]:
        """OpenAI deltas of a tool scanner's events: content, a call's first delta (id, type, name),
        then its argument pieces."""
        out = []
        for ev in events:
            if ev[0] == "content":
                delta = {"content": ev[1]}
            elif ev[0] == "call":
                call_ids[ev[1]] = tools.new_call_id()
                delta = {"tool_calls": [{"index": ev[1], "id": call_ids[ev[1]], "type": "function",
                                         "function": {"name": ev[2], "arguments": ""}}]}
            else:
                delta = {"tool_calls": [{"index": ev[1], "function": {"arguments": ev[2]}}]}
            out.append({"index": i, "delta": delta, "logprobs": None, "finish_reason": None})
        return out

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

    def stream(self, body: ChatCompletionRequest, streams, meta: dict):
        ctx, n = self.ctx, len(streams)
        logprobs = meta["logprobs"]
        mode = tools.choice_mode(body)
        named = mode == "named"           # a named call's text is its arguments: streamed as they come
        scans = [tools.scanner(body, ctx.cfg.tool_call_parser) for _ in range(n)] if mode in ("auto", "required") \
            else None
        call_ids = [tools.new_call_id() for _ in range(n)] if named else [{} for _ in range(n)]
        held = [""] * n

        chunk = sse_chunker("chat.completion.chunk", meta, meta["model"], body.include_usage, body.continuous_usage)

        def on_output(i: int, out):
            if scans is not None:          # auto / required: calls found as the text comes
                events = scans[i].feed(out.text) + (scans[i].finish() if out.finished else [])
                for d in self.scanned_deltas(i, events, call_ids[i]):
                    yield chunk([d], out=out)
                if out.finished:
                    reason = "tool_calls" if scans[i].calls and out.finish_reason == "stop" else out.finish_reason
                    yield chunk([{"index": i, "delta": {}, "logprobs": None, "finish_reason": reason,
                                  "stop_reason": out.stop_reason}], out=out)
                return
            if not out.text and not out.finished and not out.logprobs:
                return
            if named:
                yield chunk([self.named_delta(body, i, call_ids[i], held[i] == "", out)], out=out)
                held[i] += out.text
                return
            delta = {"content": out.text} if (out.text or not out.finished) else {}
            yield chunk([{"index": i, "delta": delta,
                          "logprobs": chat_logprobs(ctx.tokstr, out.logprobs) if logprobs is not None else None,
                          "finish_reason": out.finish_reason if out.finished else None,
                          **({"stop_reason": out.stop_reason} if out.finished else {})}], out=out)

        def usage(completion: int, cached: int):
            return chunk([], usage_dict(meta["prompt_tokens"], completion, cached)) if body.include_usage else None

        opening = usage_dict(meta["prompt_tokens"], 0, 0) if body.continuous_usage else None
        prelude = [chunk([{"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                           "finish_reason": None}], opening) for i in range(n)]
        return sse_events(streams, on_output, usage, prelude)
