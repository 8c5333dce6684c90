"""Pieces the API routes share: OpenAI error bodies, token strings, logprob formats."""
from __future__ import annotations

import json
from typing import Iterator, Optional, Union

from fastapi.responses import JSONResponse, Response, StreamingResponse

from shepherd.server.guard import error_body


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: Optional[str] = None, code: Optional[str] = None,
                 headers: Optional[dict] = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status: int, message: str, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[Union[str, int]] = None,
                   headers: Optional[dict] = None) -> JSONResponse:
    return JSONResponse(error_body(message, type_, param=param, code=code), status_code=status, headers=headers)


def validation_message(errors) -> tuple[str, Optional[str]]:
    parts, param = [], None
    for e in errors:
        loc = [str(x) for x in e.get("loc", ()) if x not in ("body",)]
        where = ".".join(loc)
        if param is None and loc:
            param = loc[0]
        msg = e.get("msg", "invalid value")
        if msg.startswith("Value error, "):
            msg = msg[len("Value error, "):]
        parts.append(f"{where}: {msg}" if where and not msg.startswith(loc[-1]) else msg)
    return "; ".join(parts) or "invalid request", param


# A list this long or longer is encoded a slice at a time. json.dumps is C code that holds the
# GIL until it returns: one call on a whole answer with 20 logprobs a token froze every other
# request (a 12 MB answer held /health for 1.5 s, jsonable_encoder included: docs/SERVING.md,
# "Large answers"). In process, one 8,192-token chat choice with 20 alternatives took 0.205 s to
# encode whole: ~6 ms a slice of 256 tokens, as long as the event loop then waits.
JSON_SLICE = 256
_dumps = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":")).encode


def json_pieces(obj, depth: int = 5) -> Iterator[str]:
    """obj as JSON text in pieces whose concatenation is exactly starlette's JSONResponse body.
    Dicts and short lists are walked `depth` levels down; a long list goes out JSON_SLICE items
    per json.dumps call. A callable stands for the value it returns, built only when its turn
    comes (an answer's choices: each is rendered, encoded and dropped before the next)."""
    if callable(obj):
        obj = obj()
    if depth <= 0 or not isinstance(obj, (dict, list)) or not obj:
        yield _dumps(obj)
    elif isinstance(obj, dict):
        sep = "{"
        for k, v in obj.items():
            yield sep + _dumps(str(k)) + ":"
            yield from json_pieces(v, depth - 1)
            sep = ","
        yield "}"
    elif len(obj) >= JSON_SLICE and not any(map(callable, obj)):
        # (a long list of lazy choices, 256 or more prompts x n, goes one choice at a time below)
        for i in range(0, len(obj), JSON_SLICE):
            text = _dumps(obj[i:i + JSON_SLICE])
            yield ("[" if i == 0 else ",") + text[1:-1]
        yield "]"
    else:
        sep = "["
        for v in obj:
            yield sep
            yield from json_pieces(v, depth - 1)
            sep = ","
        yield "]"


ANSWER_CHUNK = 256 << 10


def json_chunks(obj) -> list[bytes]:
    """obj's JSON as UTF-8 chunks of about ANSWER_CHUNK bytes: the answer is held once, as the
    bytes that are sent (no joined string and encoded copy beside the pieces)."""
    out, buf, size = [], [], 0
    for piece in json_pieces(obj):
        buf.append(piece)
        size += len(piece)
        if size >= ANSWER_CHUNK:
            out.append("".join(buf).encode("utf-8"))
            buf, size = [], 0
    if buf or not out:
        out.append("".join(buf).encode("utf-8"))
    return out


def json_answer(chunks: list[bytes]) -> Response:
    """An answer of json_chunks: one Response when it is one chunk, else sent chunk by chunk with
    its Content-Length (not chunked transfer: clients see the same response either way)."""
    if len(chunks) == 1:
        return Response(chunks[0], media_type="application/json")

    size = sum(len(c) for c in chunks)
    chunks.reverse()

    async def send():
        while chunks:
            yield chunks.pop()        # a sent chunk is let go as the answer goes out
    return StreamingResponse(send(), media_type="application/json", headers={"content-length": str(size)})


class AbortingStreamingResponse(StreamingResponse):
    """A StreamingResponse that runs `on_close` however the response ends (finished,
    client gone before the first chunk, cancelled), so engine requests are always aborted."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, **kw)
        self._on_close = on_close

    async def __call__(self, scope, receive, send):
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class TokenStrings:
    """Token id -> text for logprobs (cached)."""

    def __init__(self, tokenizer):
        self.tok = tokenizer
        self.cache: dict[int, str] = {}

    def __call__(self, tid: int) -> str:
        s = self.cache.get(tid)
        if s is None:
            try:
                s = self.tok.decode([tid], skip_special_tokens=False)
            except Exception:  # noqa: BLE001
                s = ""
            self.cache[tid] = s
        return s


LOGPROB_FLOOR = -9999.0      # what vLLM writes for a logprob of -inf (JSON has no infinities)


def finite(logprob: float) -> float:
    """A logprob JSON can carry: -inf (a masked token) and NaN become LOGPROB_FLOOR; nothing is above 0."""
    x = float(logprob)
    return min(x, 0.0) if x > LOGPROB_FLOOR else LOGPROB_FLOOR


def completion_logprobs(tokstr: TokenStrings, lps, offset0: int) -> dict:
    tokens, tlp, tops, offs = [], [], [], []
    off = offset0
    for lp in lps:
        s = tokstr(lp.token_id)
        tokens.append(s)
        tlp.append(finite(lp.logprob))
        tops.append({tokstr(t): finite(v) for t, v in lp.top} if lp.top else None)
        offs.append(off)
        off += len(s)
    return {"tokens": tokens, "token_logprobs": tlp, "top_logprobs": tops, "text_offset": offs}


def echo_logprobs(tokstr: TokenStrings, prompt_ids: list[int], plp, completion: dict) -> dict:
    """completions' logprobs with echo: the prompt's tokens first (the first has no logprob, as in
    OpenAI's legacy API and vLLM), then `completion` (completion_logprobs after the echoed text)."""
    plp = plp or [None] * len(prompt_ids)
    tokens, tlp, tops, offs = [], [], [], []
    off = 0
    for tid, lp in zip(prompt_ids, plp):
        s = tokstr(tid)
        tokens.append(s)
        tlp.append(finite(lp.logprob) if lp is not None else None)
        tops.append({tokstr(t): finite(v) for t, v in lp.top} if lp is not None and lp.top else None)
        offs.append(off)
        off += len(s)
    return {"tokens": tokens + completion["tokens"], "token_logprobs": tlp + completion["token_logprobs"],
            "top_logprobs": tops + completion["top_logprobs"], "text_offset": offs + completion["text_offset"]}


def vllm_prompt_logprobs(tokstr: TokenStrings, plp) -> Optional[list]:
    """vLLM's `prompt_logprobs` field: per prompt token None (the first) or {token id: {logprob,
    rank, decoded_token}} for the prompt token and its top alternatives (rank: 1 = best)."""
    if plp is None:
        return None
    out: list = []
    for lp in plp:
        if lp is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": finite(v), "rank": r + 1, "decoded_token": tokstr(t)} for r, (t, v) in enumerate(lp.top)}
        if str(lp.token_id) not in d:
            d = {str(lp.token_id): {"logprob": finite(lp.logprob), "rank": lp.rank,
                                    "decoded_token": tokstr(lp.token_id)}, **d}
        out.append(d)
    return out


def chat_logprobs(tokstr: TokenStrings, lps) -> dict:
    content = []
    for lp in lps:
        s = tokstr(lp.token_id)
        content.append({"token": s, "logprob": finite(lp.logprob), "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [{"token": tokstr(t), "logprob": finite(v),
                                          "bytes": list(tokstr(t).encode("utf-8"))} for t, v in lp.top]})
    return {"content": content}


def usage_dict(prompt_tokens: int, completion_tokens: int, cached: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached}}


def sse_chunker(obj_type: str, meta: dict, model: str, include_usage: bool, continuous: bool = False):
    """`chunk(choices, usage=None, out=None) -> str`: the SSE `data:` events of one streamed
    completion or chat completion. The id, object, created and model are the same in every event
    of a stream, so they are JSON-encoded once here and each event encodes only its choices (and
    usage): the bytes are exactly `json.dumps` of the whole event dict (same keys, order and
    separators). `continuous` (with include_usage): a chunk made from an engine output `out`
    carries that request's usage so far, as vLLM's continuous_usage_stats."""
    head = (f'data: {{"id": {json.dumps(meta["rid"])}, "object": {json.dumps(obj_type)}, '
            f'"created": {json.dumps(meta["created"])}, "model": {json.dumps(model)}, "choices": ')
    dumps = json.dumps

    if include_usage:
        def chunk(choices: list, usage: Optional[dict] = None, out=None) -> str:
            if continuous and out is not None:
                usage = usage_dict(out.prompt_tokens, out.completion_tokens, out.cached_tokens)
            return f'{head}{dumps(choices)}, "usage": {dumps(usage)}}}\n\n'
    else:
        def chunk(choices: list, usage: Optional[dict] = None, out=None) -> str:
            return f"{head}{dumps(choices)}}}\n\n"
    return chunk

