"""The server's side of the engine: submit a request's choices all or nothing, merge
their streams, stop waiting when the client disconnects, collect whole answers."""
from __future__ import annotations

import asyncio
import json
import math
from typing import AsyncIterator, Optional

from fastapi import Request

from shepherd.engine.engine import EngineDeadError, EngineOutput, QueueFull, RequestRejected, RequestStream
from shepherd.engine.output import Backlog, logprob_entries
from shepherd.server.common import APIError
from shepherd.server.guard import error_body


def release(streams: list[RequestStream]) -> None:
    for s in streams:
        s.abort()


async def submit_all(engine, jobs: list, client: str, priority: int, prefix: str,
                     adapter: Optional[str] = None, unsent_limit: Optional[int] = None) -> list[RequestStream]:
    """jobs: (prompt ids, SamplingParams) per choice, handed over in one go; all or nothing.
    adapter: the LoRA adapter every choice runs with (None: the base model). unsent_limit: for a
    streamed answer, the tokens and logprob entries its client may leave unread before its
    requests are cut (output.Backlog, shared by its choices)."""
    streams: list[RequestStream] = []
    backlog = Backlog(unsent_limit) if unsent_limit is not None else None
    # the engine's ids must be unique; the prefix carries the client's X-Request-Id, which it may reuse
    prefix = engine.new_request_id(prefix)
    try:
        for k, (ids, params) in enumerate(jobs):
            streams.append(engine.submit(ids, params, req_id=f"{prefix}-{k}", client=client, priority=priority,
                                         adapter=adapter, backlog=backlog))
        results = await asyncio.gather(*(s.wait_admitted() for s in streams), return_exceptions=True)
        errors = [r for r in results if isinstance(r, BaseException)]
        if errors:
            # the most telling error: a full queue (retry later) before a rejection
            raise next((e for e in errors if isinstance(e, QueueFull)), errors[0])
    except BaseException as e:
        release(streams)
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


async def sse_events(streams: list[RequestStream], on_output, usage_chunk, prelude=(), on_error=None):
    """The SSE body of a streamed answer: the `prelude` chunks, then `on_output(i, out)`'s chunks
    for every output of every choice, then (unless one ended in an error: one error event) the
    chunk `usage_chunk(completion_tokens, cached_tokens)` if it gives one, then [DONE]. With
    `on_error` (the Responses API) errors are its event and there is no [DONE]. The requests
    are released however it ends."""
    n = len(streams)
    comp, cached = [0] * n, [0] * n
    try:
        for c in prelude:
            yield c
        async for i, out in merged(streams):
            if out.error is not None:
                yield stream_error_chunk(out) if on_error is None else on_error(out)
                break
            comp[i], cached[i] = out.completion_tokens, out.cached_tokens
            for c in on_output(i, out):
                yield c
            streams[i].sent(out)
        else:
            last = usage_chunk(sum(comp), max(cached))
            if last:
                yield last
        if on_error is None:
            yield "data: [DONE]\n\n"
    finally:
        release(streams)


def too_many_logprobs(entries: int, cap: int, when: str) -> APIError:
    return APIError(400, f"this answer would carry more than {cap:,} logprob entries (choices x tokens x "
                         f"(alternatives + 1); {entries:,} {when}), more than a non-streamed answer may hold "
                         "(--max-logprob-entries); stream it (stream: true) or lower n, max_tokens or the "
                         "number of logprobs", param="n", code="request_too_large")


async def collect(streams: list[RequestStream], max_entries: Optional[int] = None):
    """Non-streaming answer: each choice's whole text, logprobs, terminal output (which carries
    the prompt's logprobs when they were asked for: they come with the first token) and token ids.
    The answer is held whole until it is sent, so once its logprobs pass `max_entries` it ends
    with a 400 (its requests aborted) instead of growing further."""
    n = len(streams)
    held = 0
    texts = [""] * n
    ids: list[list[int]] = [[] for _ in range(n)]
    lps: list[list] = [[] for _ in range(n)]
    plps: list = [None] * n
    final: list[Optional[EngineOutput]] = [None] * n
    try:
        async for i, out in merged(streams):
            if out.error is not None:
                raise_output_error(out)
            texts[i] += out.text
            ids[i].extend(out.token_ids)
            lps[i].extend(out.logprobs)
            held += logprob_entries(out.logprobs)
            if out.prompt_logprobs is not None:
                plps[i] = out.prompt_logprobs
                held += logprob_entries(out.prompt_logprobs)
            if max_entries is not None and held > max_entries:
                raise too_many_logprobs(held, max_entries, "when it was stopped")
            if out.finished:
                final[i] = out
                out.prompt_logprobs = plps[i]
    finally:
        release(streams)
    return texts, lps, final, ids
