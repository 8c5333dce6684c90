"""The front's side of the engine: request streams, detokenisation, stop strings,
per-request metrics. Runs on the server's event loop, never in the core's loop.

    proc = OutputProcessor(tokenizer, metrics)
    proc.track(req, stream)                         # at submit
    finish_ids = proc.on_outputs(core_outputs, now) # per CoreStep; ids whose stop string matched here,
                                                    # or cut (Backlog): the caller tells the core to finish them

One IncrementalDetokenizer per request. Stop strings are searched in the
accumulated text (so they are found when they span tokens), cut from the
output, and the request ends with reason "stop" at once; the core is then told
to finish it (its later outputs, if any, are ignored). Text that could be the
beginning of a stop string is held back until it is known not to be one.
"""
from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from shepherd.request import FinishReason, Request, TokenLogprob


@dataclass
class EngineOutput:
    """One delta of one request, as streamed to the server.

    text / token_ids / logprobs are what is new since the previous output.
    The last output of a request has finished=True and a finish_reason
    ("stop", "length", "abort" or "error"; error carries a message).
    Usage counts are cumulative and present on every output.
    """
    req_id: str
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finished: bool = False
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    error_kind: Optional[str] = None      # "request" (this request cannot be served) | "engine" (engine failed)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    stop_reason: Optional[Any] = None     # the stop string or stop token id that ended it (vLLM's field)
    # with the first token, when SamplingParams.prompt_logprobs asked: one per prompt token (None first)
    prompt_logprobs: Optional[list] = None

    @property
    def usage(self) -> dict:
        return {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens,
                "total_tokens": self.prompt_tokens + self.completion_tokens}


def logprob_entries(lps) -> int:
    """Entries in a list of TokenLogprob (None for the prompt's first token): each one's own plus its alternatives."""
    return sum(1 + len(lp.top) for lp in lps if lp is not None)


def output_weight(out: EngineOutput) -> int:
    """What an output holds until it is sent: its tokens and logprob entries."""
    return len(out.token_ids) + logprob_entries(out.logprobs) + logprob_entries(out.prompt_logprobs or ())


class Backlog:
    """What one streamed answer's requests (its n choices) have produced and its client has not
    read yet, in tokens and logprob entries (output_weight). A client that stops reading leaves
    its outputs in the server for as long as the requests generate (~2.9 KB a token with 20
    logprobs: benchmarks/slow_reader.py); past `limit` the answer's requests are cut
    (OutputProcessor.on_outputs)."""

    __slots__ = ("limit", "pending")

    def __init__(self, limit: int):
        self.limit, self.pending = limit, 0

    @property
    def over(self) -> bool:
        return self.pending > self.limit


class RequestStream:
    """One request's EngineOutputs: awaitable (admission) and async-iterable (deltas).

        stream = await engine.submit(...)   # waits until the scheduler accepted it (or raises)
        async for out in stream: ...        # ends after the terminal output
        async for out in engine.submit(...): ...   # also fine: admission is awaited first

    Leaving the iteration early does not abort by itself: call `abort()` (the
    server does so in a finally on every exit path)."""

    def __init__(self, engine, req_id: str, loop: asyncio.AbstractEventLoop, backlog: Optional[Backlog] = None):
        self.engine = engine
        self.req_id = req_id
        self.loop = loop
        self.backlog = backlog
        self.queue: asyncio.Queue[EngineOutput] = asyncio.Queue()
        self.finished = False
        self.admitted: asyncio.Future = loop.create_future()

    async def wait_admitted(self) -> "RequestStream":
        """Raises QueueFull, RequestRejected or EngineDeadError; a cancelled waiter aborts the request."""
        try:
            await asyncio.shield(self.admitted)
        except asyncio.CancelledError:
            self.engine.abort(self.req_id)
            raise
        return self

    def __await__(self):
        return self.wait_admitted().__await__()

    def __aiter__(self):
        return self

    async def __anext__(self) -> EngineOutput:
        if self.finished:
            raise StopAsyncIteration
        if not self.admitted.done() or self.admitted.exception() is not None:
            await self.wait_admitted()
        out = await self.queue.get()
        if out.finished:
            self.finished = True
        return out

    def abort(self) -> None:
        if not self.finished:
            self.engine.abort(self.req_id)

    def put(self, out: EngineOutput) -> None:   # on the loop
        if self.backlog is not None:
            self.backlog.pending += output_weight(out)
        self.queue.put_nowait(out)

    def sent(self, out: EngineOutput) -> None:
        """The consumer has handed `out` on to its client (the backlog shrinks by it)."""
        if self.backlog is not None:
            self.backlog.pending -= output_weight(out)


class _Track:
    """Front bookkeeping of one request: detokeniser and stop strings."""

    __slots__ = ("req", "stream", "detok", "text", "sent", "checked", "stops", "max_stop", "stop_ids",
                 "done", "t_last", "first", "matched", "stop_reason", "tokens")

    def __init__(self, req: Request, stream: RequestStream, detok, stop_ids: set[int]):
        self.req = req
        self.stream = stream
        self.detok = detok
        self.text = ""          # generated text so far (cut at a stop string)
        self.sent = 0           # chars of text already streamed
        self.checked = 0        # chars of text already searched for stop strings
        self.stops = [s for s in req.params.stop if s]
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.stop_ids = stop_ids
        self.done = False
        self.t_last: Optional[float] = None
        self.first = True
        self.matched = ""       # the stop string find_stop found
        self.stop_reason: Any = None
        self.tokens = 0         # output tokens pushed to the detokenizer

    def push(self, tid: int) -> None:
        self.text += self.detok.push(tid)
        self.tokens += 1

    def cut_at_stop(self, idx: int) -> None:
        """End the text at the stop string found at idx (keeping it when the request asks)."""
        keep = len(self.matched) if self.req.params.include_stop_str_in_output else 0
        self.text = self.text[:idx + keep]
        self.stop_reason = self.matched

    def find_stop(self) -> int:
        """Index in self.text where the earliest stop string starts, or -1. Before min_tokens
        tokens are out no stop string ends the request (vLLM's rule: min_tokens holds EOS, stop ids
        and stop strings alike); one that ends at or after that token still does."""
        if not self.stops:
            return -1
        if self.tokens < self.req.params.min_tokens:
            self.checked = len(self.text)
            return -1
        start = max(0, self.checked - self.max_stop + 1)
        best = -1
        for s in self.stops:
            i = self.text.find(s, start)
            if i >= 0 and (best < 0 or i < best):
                best, self.matched = i, s
        self.checked = len(self.text)
        return best

    def holdback(self) -> int:
        """Chars at the end of the text that could start a stop string."""
        hold = 0
        avail = len(self.text) - self.sent
        for s in self.stops:
            for k in range(min(len(s) - 1, avail), hold, -1):
                if self.text.endswith(s[:k]):
                    hold = k
                    break
        return hold


class OutputProcessor:
    def __init__(self, tokenizer, metrics, model_name: str):
        self.tokenizer = tokenizer
        self.metrics = metrics
        self.model_name = model_name
        self.tracks: dict[str, _Track] = {}

    def track(self, req: Request, stream: RequestStream) -> None:
        from shepherd.model.tokenizer import IncrementalDetokenizer
        stop_ids = set(req.params.stop_token_ids or ())
        if not req.params.ignore_eos:
            stop_ids |= set(req.eos_token_ids)
        detok = IncrementalDetokenizer(self.tokenizer, prompt_ids=req.prompt_ids)
        self.tracks[req.req_id] = _Track(req, stream, detok, stop_ids)

    def forget(self, req_id: str) -> None:
        self.tracks.pop(req_id, None)

    def on_outputs(self, outs, now: float) -> list[str]:
        """Core outputs -> stream deltas; returns the ids that end here: a stop string matched, or
        their answer's client left too much unread (Backlog), for the core to finish."""
        from shepherd.engine.core_loop import CoreOutput
        finish: list[str] = []
        over: list[Backlog] = []
        for t in outs:
            o = CoreOutput._make(t)
            tr = self.tracks.get(o.req_id)
            if tr is None or tr.done:
                continue
            if self._on_output(tr, o, now):
                finish.append(o.req_id)
            b = tr.stream.backlog
            if b is not None and b.over and b not in over:
                over.append(b)
        for b in over:
            finish += self._cut(b, now)
        return finish

    def _cut(self, backlog: Backlog, now: float) -> list[str]:
        """End every request of an answer whose client is this far behind: an error output each
        (what was produced before it is still sent), and their ids to finish in the core."""
        msg = (f"the client read too slowly: {backlog.pending:,} tokens and logprob entries were waiting to "
               f"be sent, more than one answer may hold (--max-logprob-entries {backlog.limit:,}); the answer "
               "was cut")
        cut = [tr for tr in self.tracks.values() if tr.stream.backlog is backlog and not tr.done]
        for tr in cut:
            self._emit(tr, [], [], now, None, finished=True, reason="error", error=msg, error_kind="request")
        return [tr.req.req_id for tr in cut]

    def _on_output(self, tr: _Track, o, now: float) -> bool:
        req = tr.req
        reason = o.finish_reason
        self._observe(tr, o, now)
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        stop_hit = False
        n = len(o.token_ids)
        for i, tid in enumerate(o.token_ids):
            ids.append(tid)
            if i < len(o.logprobs):
                lps.append(o.logprobs[i])
            final_stop_token = o.finished and reason == FinishReason.STOP.value and i == n - 1 \
                and tid in tr.stop_ids
            if final_stop_token and tid in (req.params.stop_token_ids or ()):
                tr.stop_reason = tid
            if not final_stop_token:
                tr.push(tid)
                idx = tr.find_stop()
                if idx >= 0:
                    tr.cut_at_stop(idx)
                    stop_hit = True
                    break
        if o.error is not None or reason == FinishReason.ERROR.value:
            self._emit(tr, ids, lps, now, o, finished=True, reason="error", error=o.error or "request failed",
                       error_kind="request")
            return False
        finished = o.finished or stop_hit
        if finished and not stop_hit and reason != FinishReason.ABORT.value:
            try:
                tail = tr.detok.flush()
            except Exception:  # noqa: BLE001
                tail = ""
            if tail:
                tr.text += tail
                idx = tr.find_stop()
                if idx >= 0:
                    tr.cut_at_stop(idx)
                    stop_hit = True
        if stop_hit:
            reason = FinishReason.STOP.value
        self._emit(tr, ids, lps, now, o, finished=finished, reason=reason if finished else None)
        return stop_hit and not o.finished

    def _observe(self, tr: _Track, o, now: float) -> None:
        if not o.token_ids:
            return
        m = self.metrics
        m.generation_tokens.inc(len(o.token_ids))
        if tr.first:
            tr.first = False
            m.ttft.observe(max(0.0, now - tr.req.arrival))
            if o.queue_time is not None:
                m.queue_time.observe(o.queue_time)
        elif tr.t_last is not None:
            m.itl.observe(max(0.0, now - tr.t_last))
        tr.t_last = now

    def _emit(self, tr: _Track, ids, lps, now: float, o, finished: bool, reason: Optional[str],
              error: Optional[str] = None, error_kind: Optional[str] = None) -> None:
        end = len(tr.text) if finished else len(tr.text) - tr.holdback()
        text = tr.text[tr.sent:end] if end > tr.sent else ""
        tr.sent = max(tr.sent, end)
        plp = o.prompt_logprobs if o is not None else None
        if not finished and not text and not ids and not lps and plp is None:
            return
        req = tr.req
        out = EngineOutput(req_id=req.req_id, text=text, token_ids=ids, logprobs=lps, finished=finished,
                           finish_reason=reason, error=error, error_kind=error_kind, prompt_logprobs=plp,
                           prompt_tokens=len(req.prompt_ids),
                           completion_tokens=o.completion_tokens if o is not None else 0,
                           cached_tokens=o.cached_tokens if o is not None else 0,
                           stop_reason=tr.stop_reason if finished else None)
        if finished:
            tr.done = True
            self.tracks.pop(req.req_id, None)
            self.metrics.e2e.observe(max(0.0, now - req.arrival))
            self.metrics.request_success.labels(self.model_name, reason or "unknown").inc()
        tr.stream.put(out)

    def fail_all(self, message: str, now: float, reason: str = "error") -> None:
        """End every tracked request: an engine error (or an abort at shutdown)."""
        for tr in list(self.tracks.values()):
            if tr.done:
                continue
            tr.sent = len(tr.text)   # held-back text is dropped
            err = message if reason == "error" else None
            self._emit(tr, [], [], now, None, finished=True, reason=reason, error=err,
                       error_kind="engine" if err else None)
        self.tracks.clear()


def answer_admission(stream: RequestStream, exc: Optional[BaseException],
                     on_accept: Optional[Callable[[], None]] = None) -> None:
    """Resolve a stream's admission future (on the loop)."""
    fut = stream.admitted
    if fut.done():
        return
    if exc is None:
        fut.set_result(None)
        if on_accept is not None:
            on_accept()
    else:
        fut.set_exception(exc)
        fut.exception()   # retrieved: a nobody-awaits rejection is not "never retrieved"
