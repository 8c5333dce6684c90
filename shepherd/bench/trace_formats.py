"""Readers for real traces: Azure LLM inference 2023/2024/2025, Mooncake, RAGPulse, BurstGPT, vidur,
and shepherd's multi-tenant CSV (the "servegen" format: requests generated from ServeGen's
per-client distributions). One row reader per format (`_ROWS`), behind one entry point:

    azure      Azure LLM inference trace CSV (TIMESTAMP, ContextTokens, GeneratedTokens)
    mooncake   Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)
    ragpulse   RAGPulse JSONL (timestamp s, input_length, output_length, hash_ids as chunks)
    burstgpt   BurstGPT CSV (Timestamp s, Model, Request tokens, Response tokens, ...)
    servegen   multi-tenant CSV (timestamp_s, client_id, input_tokens, output_tokens)
    vidur      vidur's trace CSV ([arrived_at s,] num_prefill_tokens, num_decode_tokens)

    iter_file(path, fmt=None, *, limit=None)     the file's requests, read lazily by its format's reader
    detect_format(path) -> str                   from the name and header

Memory: the readers are generators: a trace of any length is read with a
window of REORDER_WINDOW rows in memory (real traces are sorted by time, up to
small local disorder, which the window absorbs; a row earlier than one already
given out raises TraceFormatError).

Times: every reader returns arrivals in seconds from the first request of the
file (the first request arrives at 0), sorted by arrival (stable).

Files: a byte-order mark and CRLF line ends are read; FILE.csv.gz / FILE.jsonl.gz stream
through gzip (open_text).

Malformed rows raise TraceFormatError naming the file and line number.
"""
from __future__ import annotations

import csv
import gzip
import heapq
import itertools
import json
import logging
import math
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

from shepherd.bench.records import TraceRequest

log = logging.getLogger(__name__)

FORMATS = ("azure", "mooncake", "ragpulse", "burstgpt", "servegen", "vidur", "synthetic")
REORDER_WINDOW = 4096


class TraceFormatError(ValueError):
    """A trace row could not be read: the message names the file and line."""


# UTF-8 whatever the locale, and a byte-order mark (a spreadsheet's or Windows editor's "UTF-8")
# dropped, so the first column's name is found in the header
ENCODING = "utf-8-sig"


def open_text(path):
    """The file as text: a trace compressed with gzip (FILE.csv.gz, FILE.jsonl.gz: how week- and
    month-long traces are kept) is read through gzip as it streams, never unpacked whole."""
    if str(path).lower().endswith(".gz"):
        return gzip.open(path, "rt", newline="", encoding=ENCODING)
    return open(path, newline="", encoding=ENCODING)


_SAID: set[str] = set()


def _warn_once(msg: str) -> None:
    """A reader's warning about a file, once a process: --rate and --repeat read a file more than once."""
    if msg not in _SAID:
        _SAID.add(msg)
        log.warning("%s", msg)


def format_error(path, lineno: int, msg: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{lineno}: {msg}")


# The most tokens one prompt or output may have: 10x the longest context of any model served
# today (~1M). A 1e12-token row allocated its prompt (numpy ArrayMemoryError) or hung bench.
MAX_TRACE_TOKENS = 10_000_000


def _int_field(path, lineno, name, value, minimum=0, maximum=MAX_TRACE_TOKENS) -> int:
    try:
        f = float(value)
        if not math.isfinite(f) or f != int(f):
            raise ValueError
        v = int(f)
    except (TypeError, ValueError):
        raise format_error(path, lineno, f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise format_error(path, lineno, f"{name} must be >= {minimum}, got {v}")
    if maximum is not None and v > maximum:
        raise format_error(path, lineno, f"{name} must be <= {maximum:,} tokens, got {v:,}")
    return v


def _float_field(path, lineno, name, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise format_error(path, lineno, f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise format_error(path, lineno, f"{name} must be a finite number >= 0, got {value!r}")
    return v


def _ordered(rows: Iterable[TraceRequest], path, limit: Optional[int] = None) -> Iterator[TraceRequest]:
    """Sort by arrival (stable) within a window of REORDER_WINDOW rows, shift so
    the first arrival is 0, number them; stop after `limit` rows of the file."""
    if limit is not None:
        rows = itertools.islice(rows, limit)
    heap: list = []
    t0: Optional[float] = None
    last = -math.inf
    i = 0
    rows = iter(rows)
    done = False
    while True:
        while not done and len(heap) <= REORDER_WINDOW:
            r = next(rows, None)
            if r is None:
                done = True
            else:
                heapq.heappush(heap, (r.arrival, i + len(heap), r))
        if not heap:
            return
        a, _, r = heapq.heappop(heap)
        if a < last:
            raise TraceFormatError(f"{path}: arrivals go back in time by more than {REORDER_WINDOW} rows "
                                   f"({a} after {last}); sort the trace by time")
        if t0 is None:
            t0 = a
        last = a
        r.arrival = a - t0
        if r.index is None:
            r.index = i
        i += 1
        yield r


def _csv_rows(path, required: Sequence[str], optional: Sequence[str] = ()):
    """Yield (lineno, row dict) with a clear error on a bad header or ragged row; `optional`
    columns are in the dict when the header has them."""
    path = Path(path)
    with open_text(path) as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise format_error(path, 1, "empty file (expected a header row)") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise format_error(path, 1, f"header lacks column(s) {missing}; got {header}")
        idx = {c: header.index(c) for c in (*required, *optional) if c in header}
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise format_error(path, lineno, f"expected {len(header)} fields, got {len(row)}: {row!r}")
            yield lineno, {c: row[i].strip() for c, i in idx.items()}


_EPOCH_CACHE: dict[str, float] = {}


def _parse_azure_ts(path, lineno, s: str) -> float:
    # 2023: "2023-11-16 18:15:46.6805900" (7 fractional digits: too many for fromisoformat on 3.10);
    # 2024 week-long files: "2024-05-10 00:00:00.009930+00:00", and no fraction on a whole second.
    # A UTC offset is taken away so that rows written in different offsets share one time line.
    try:
        date, clock = s.split(" ") if " " in s else s.split("T")
        day = _EPOCH_CACHE.get(date)
        if day is None:
            import datetime as _dt
            day = _dt.date.fromisoformat(date).toordinal() * 86400.0
            _EPOCH_CACHE[date] = day
        offset = 0.0
        if clock.endswith("Z"):
            clock = clock[:-1]
        elif len(clock) > 6 and clock[-6] in "+-" and clock[-3] == ":":
            oh, om = clock[-5:-3], clock[-2:]
            if not (oh.isdigit() and om.isdigit()):
                raise ValueError
            offset = (int(oh) * 3600 + int(om) * 60) * (1 if clock[-6] == "+" else -1)
            clock = clock[:-6]
        hh, mm, ss = clock.split(":")
        h, m, sec = int(hh), int(mm), float(ss)
        if not (0 <= h <= 23 and 0 <= m <= 59 and 0 <= sec < 60):    # 25:99:99 ran on as the next day
            raise ValueError
        return day + h * 3600 + m * 60 + sec - offset
    except (ValueError, AttributeError):
        raise format_error(path, lineno, f"TIMESTAMP not 'YYYY-MM-DD HH:MM:SS[.frac][+HH:MM]': {s!r}") from None


def _azure_rows(path) -> Iterator[TraceRequest]:
    for lineno, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        t = _parse_azure_ts(path, lineno, row["TIMESTAMP"])
        p = _int_field(path, lineno, "ContextTokens", row["ContextTokens"], 1)
        o = _int_field(path, lineno, "GeneratedTokens", row["GeneratedTokens"], 0)
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1))


def _jsonl_objects(path) -> Iterator[tuple[int, dict]]:
    """(lineno, object) for every non-empty line, with a clear error on a line that is not one."""
    path = Path(path)
    with open_text(path) as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise format_error(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise format_error(path, lineno, "expected a JSON object")
            yield lineno, d


def _jsonl_lengths(path, lineno: int, d: dict, per_second: float) -> tuple[float, int, int]:
    """(arrival s, input_length, output_length) of a Mooncake-style object whose timestamp
    counts `per_second` units a second."""
    for k in ("timestamp", "input_length", "output_length"):
        if k not in d:
            raise format_error(path, lineno, f"missing field {k!r}")
    t = _float_field(path, lineno, "timestamp", d["timestamp"]) / per_second
    p = _int_field(path, lineno, "input_length", d["input_length"], 1)
    o = _int_field(path, lineno, "output_length", d["output_length"], 0)
    return t, p, o


def _mooncake_rows(path, block_size: int = 512) -> Iterator[TraceRequest]:
    path = Path(path)
    for lineno, d in _jsonl_objects(path):
        t, p, o = _jsonl_lengths(path, lineno, d, 1e3)
        h = d.get("hash_ids")
        if h is not None:
            if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in h):
                raise format_error(path, lineno, "hash_ids must be a list of integers")
            if len(h) * block_size < p - block_size:
                raise format_error(path, lineno, f"{len(h)} hash_ids cover {len(h) * block_size} tokens, "
                                         f"fewer than input_length {p} allows")
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                           hash_ids=list(h) if h is not None else None)


# the release's side files beside 0_trace.jsonl: {"<part>_id": id, "token_length": n} a line
RAGPULSE_PARTS = ("1_sys_prompt.jsonl", "2_passages.jsonl", "3_history.jsonl", "4_user_input.jsonl",
                  "5_web_search.jsonl")


def _ragpulse_lengths(path) -> Optional[dict[int, int]]:
    """{chunk id: tokens} from the side files beside `path`; None when none is there."""
    files = [Path(path).parent / f for f in RAGPULSE_PARTS]
    if not any(f.exists() for f in files):
        return None
    lengths: dict[int, int] = {}
    for f in files:
        for lineno, d in _jsonl_objects(f):
            ids = [v for k, v in d.items() if k.endswith("_id")]
            if len(ids) != 1 or "token_length" not in d:
                raise format_error(f, lineno, "expected one '<part>_id' and 'token_length'")
            lengths[_int_field(f, lineno, "id", ids[0], maximum=None)] = _int_field(f, lineno, "token_length", d["token_length"])
    return lengths


def _ragpulse_rows(path) -> Iterator[TraceRequest]:
    # flashserve/RAGPulse's 0_trace.jsonl: Mooncake's field names, but timestamp in seconds
    # (a string), and hash_ids a map of the prompt's parts (sys_prompt, passages_ids, history,
    # web_search, user_input, in that order) naming chunks of varying length whose token counts
    # are in the side files beside it. With them the prompt is those chunks in order (the 6-12
    # tokens input_length adds to their sum, the chat template's, end it, unique); without them
    # no sharing is modelled. session_id is not read (prompts are not built on the last turn).
    lengths = _ragpulse_lengths(path)
    if lengths is None:
        _warn_once(f"{path}: none of RAGPulse's side files ({', '.join(RAGPULSE_PARTS)}) beside it: prompts "
                   "share no chunks")
    for lineno, d in _jsonl_objects(path):
        t, p, o = _jsonl_lengths(path, lineno, d, 1.0)
        chunks = None
        h = d.get("hash_ids")
        if lengths is not None and isinstance(h, dict):
            try:
                chunks = [(cid, lengths[cid]) for part in h.values() for cid in part]
            except (KeyError, TypeError):
                raise format_error(path, lineno, "hash_ids names a chunk the side files do not list") from None
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1), chunks=chunks)


def _servegen_rows(path) -> Iterator[TraceRequest]:
    for lineno, row in _csv_rows(path, ("timestamp_s", "client_id", "input_tokens", "output_tokens")):
        t = _float_field(path, lineno, "timestamp_s", row["timestamp_s"])
        if not row["client_id"]:
            raise format_error(path, lineno, "empty client_id")
        p = _int_field(path, lineno, "input_tokens", row["input_tokens"], 1)
        o = _int_field(path, lineno, "output_tokens", row["output_tokens"], 0)
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                           client=f"client-{row['client_id']}")


def _burstgpt_rows(path) -> Iterator[TraceRequest]:
    # BurstGPT_1/_2: Timestamp, Model, Request tokens, Response tokens, Total tokens, Log Type;
    # BurstGPT_3 puts Session ID and Elapsed time after Timestamp: columns are found by name.
    # Session ID is not read: a turn's Request tokens are not known to include the turns before
    # it, and shepherd's sessions (TraceRequest.session) would build each prompt on the last one.
    empty = 0
    try:
        for lineno, row in _csv_rows(path, ("Timestamp", "Model", "Request tokens", "Response tokens")):
            t = _float_field(path, lineno, "Timestamp", row["Timestamp"])
            if not row["Model"]:
                raise format_error(path, lineno, "empty Model")
            p = _int_field(path, lineno, "Request tokens", row["Request tokens"], 0)
            o = _int_field(path, lineno, "Response tokens", row["Response tokens"], 0)
            if p == 0:
                # a few percent of the published rows log no request tokens (most with no response
                # either): there is no prompt to send or prefill, so the row is not a request
                empty += 1
                continue
            # Response tokens 0 is a failed request (the README): it arrived and is kept, as a
            # request of one output token like Azure's GeneratedTokens 0; BurstGPT_without_fails_N.csv
            # is the same trace without them
            yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1), client=row["Model"])
    finally:
        if empty:
            # said, not silent: the user compares the report's request count with the file's rows
            _warn_once(f"{path}: skipped {empty} row(s) with 0 Request tokens (no prompt to send)")


def _vidur_rows(path) -> Iterator[TraceRequest]:
    # microsoft/vidur's processed traces: arrived_at (s) with the lengths (trace replay), or the
    # lengths alone (its length generator: no arrivals, so every request arrives at 0, a batch;
    # as --input-len/--output-len trace:FILE they give lengths to synthetic arrivals instead)
    for lineno, row in _csv_rows(path, ("num_prefill_tokens", "num_decode_tokens"), ("arrived_at",)):
        t = _float_field(path, lineno, "arrived_at", row["arrived_at"]) if "arrived_at" in row else 0.0
        p = _int_field(path, lineno, "num_prefill_tokens", row["num_prefill_tokens"], 1)
        o = _int_field(path, lineno, "num_decode_tokens", row["num_decode_tokens"], 0)
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1))


def detect_format(path) -> str:
    p = str(path).lower().removesuffix(".gz")
    if p.endswith(".jsonl"):
        # RAGPulse writes Mooncake's field names with hash_ids as a map of the prompt's parts
        objects = _jsonl_objects(path)
        first = next(objects, (0, {}))[1]
        objects.close()
        return "ragpulse" if isinstance(first.get("hash_ids"), dict) else "mooncake"
    if p.endswith(".json"):
        return "synthetic"
    with open_text(path) as f:
        header = f.readline()
    if "ContextTokens" in header:
        return "azure"
    if "Request tokens" in header and "Response tokens" in header:
        return "burstgpt"
    if "client_id" in header:
        return "servegen"
    if "num_prefill_tokens" in header:
        return "vidur"
    cells = header.strip().split(",")
    if len(cells) == 6 and cells[0].replace(".", "", 1).isdigit():
        # alibaba/ServeGen's data/<category>/<pool>/chunk-N-trace.csv: one client's rate, CV and
        # arrival pattern per window, no header; ServeGen publishes no per-request trace
        raise TraceFormatError(f"{path}:1: this looks like ServeGen's per-client rate file (window start, rate, cv, "
                               f"pattern, 2 parameters), not a trace of requests; generate requests with "
                               f"ServeGen and write them as timestamp_s,client_id,input_tokens,output_tokens "
                               f"(the servegen format)")
    raise TraceFormatError(f"{path}:1: cannot tell the trace format from the header {header.strip()!r}; "
                           f"pass --format {'|'.join(FORMATS)}")


_ROWS = {"azure": _azure_rows, "mooncake": _mooncake_rows, "ragpulse": _ragpulse_rows,
         "burstgpt": _burstgpt_rows, "servegen": _servegen_rows, "vidur": _vidur_rows}


def iter_file(path, fmt: Optional[str] = None, *, limit: Optional[int] = None) -> Iterator[TraceRequest]:
    """A real trace file's requests, read lazily by its format's reader (in arrival order, the
    first at 0; module doc)."""
    fmt = fmt or detect_format(path)
    if fmt not in _ROWS:
        raise ValueError(f"{path}: not a trace file format ({fmt!r}; one of {', '.join(_ROWS)})")
    return _ordered(_ROWS[fmt](path), path, limit)


__all__ = ["FORMATS", "TraceFormatError", "format_error", "iter_file", "detect_format"]
