"""Workloads: readers for real traces (simulate and bench); synthetic ones are in synthetic.py.

    iter_trace(path, fmt=None, *, limit=None, time_scale=1.0, rate=None, seed=0) -> Iterator[TraceRequest]
    load_trace(...)                      the same, as a list (small traces, tests)
    read_azure(path, *, limit=None)      Azure LLM inference trace 2023 CSV (TIMESTAMP, ContextTokens, GeneratedTokens)
    read_mooncake(path, *, limit=None)   Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)
    read_servegen(path, *, limit=None)   ServeGen CSV (timestamp_s, client_id, input_tokens, output_tokens)
    iter_azure / iter_mooncake / iter_servegen   the lazy readers behind them
    apply_time(reqs, time_scale=1.0, rate=None) -> list[TraceRequest]
    prompt_token_ids(tr, vocab_size, block_size=512) -> list[int]

Memory: the readers are generators: a trace of any length is read with a
window of REORDER_WINDOW rows in memory (real traces are sorted by time, up to
small local disorder, which the window absorbs; a row earlier than one already
given out raises TraceFormatError). `rate` needs the trace's span, so it costs
a first counting pass over the file.

Times: every reader returns arrivals in seconds from the first request of the
file (the first request arrives at 0), sorted by arrival (stable).
`time_scale` multiplies every arrival time (0.5 replays twice as fast, 2 at
half speed); `rate` (req/s) rescales arrivals so the mean rate over the trace
is `rate` (applied after `limit`, instead of time_scale when both are given).

Malformed rows raise TraceFormatError naming the file and line number.

Token ids: traces carry lengths, not text. prompt_token_ids() builds a
deterministic prompt of the right length: Mooncake `hash_ids` map each id to a
fixed block of `block_size` tokens (equal ids, equal blocks, so the prefix
cache sees exactly the trace's sharing); synthetic requests that share a
`prefix_group` share their first `prefix_tokens` tokens; everything else is
unique to the request (seeded by `index`). Ids avoid the lowest 256 ids
(special tokens of the usual vocabularies).
"""
from __future__ import annotations

import csv
import functools
import heapq
import itertools
import json
import math
from pathlib import Path
from typing import Iterable, Iterator, Optional, Sequence

import numpy as np

from shepherd.bench.records import TraceRequest

FORMATS = ("azure", "mooncake", "servegen", "synthetic")
RESERVED_IDS = 256
REORDER_WINDOW = 4096


class TraceFormatError(ValueError):
    """A trace row could not be read: the message names the file and line."""


def _err(path, lineno: int, msg: str) -> TraceFormatError:
    return TraceFormatError(f"{path}:{lineno}: {msg}")


def _int_field(path, lineno, name, value, minimum=0) -> int:
    try:
        f = float(value)
        if not math.isfinite(f) or f != int(f):
            raise ValueError
        v = int(f)
    except (TypeError, ValueError):
        raise _err(path, lineno, f"{name} must be an integer, got {value!r}") from None
    if v < minimum:
        raise _err(path, lineno, f"{name} must be >= {minimum}, got {v}")
    return v


def _float_field(path, lineno, name, value) -> float:
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise _err(path, lineno, f"{name} must be a number, got {value!r}") from None
    if not math.isfinite(v) or v < 0:
        raise _err(path, lineno, f"{name} must be a finite number >= 0, got {value!r}")
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


def _csv_rows(path, required: Sequence[str]):
    """Yield (lineno, row dict) with a clear error on a bad header or ragged row."""
    path = Path(path)
    with path.open(newline="") as f:
        reader = csv.reader(f)
        try:
            header = next(reader)
        except StopIteration:
            raise _err(path, 1, "empty file (expected a header row)") from None
        header = [h.strip() for h in header]
        missing = [c for c in required if c not in header]
        if missing:
            raise _err(path, 1, f"header lacks column(s) {missing}; got {header}")
        idx = {c: header.index(c) for c in required}
        for row in reader:
            lineno = reader.line_num
            if not row or all(not c.strip() for c in row):
                continue
            if len(row) != len(header):
                raise _err(path, lineno, f"expected {len(header)} fields, got {len(row)}: {row!r}")
            yield lineno, {c: row[i].strip() for c, i in idx.items()}


_EPOCH_CACHE: dict[str, float] = {}


def _parse_azure_ts(path, lineno, s: str) -> float:
    # "2023-11-16 18:15:46.6805900" (7 fractional digits: too many for fromisoformat on 3.10)
    try:
        date, clock = s.split(" ") if " " in s else s.split("T")
        day = _EPOCH_CACHE.get(date)
        if day is None:
            import datetime as _dt
            day = _dt.date.fromisoformat(date).toordinal() * 86400.0
            _EPOCH_CACHE[date] = day
        hh, mm, ss = clock.rstrip("Z").split(":")
        return day + int(hh) * 3600 + int(mm) * 60 + float(ss)
    except (ValueError, AttributeError):
        raise _err(path, lineno, f"TIMESTAMP not 'YYYY-MM-DD HH:MM:SS[.frac]': {s!r}") from None


def _azure_rows(path) -> Iterator[TraceRequest]:
    for lineno, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        t = _parse_azure_ts(path, lineno, row["TIMESTAMP"])
        p = _int_field(path, lineno, "ContextTokens", row["ContextTokens"], 1)
        o = _int_field(path, lineno, "GeneratedTokens", row["GeneratedTokens"], 0)
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1))


def iter_azure(path, *, limit: Optional[int] = None) -> Iterator[TraceRequest]:
    """Azure LLM inference trace 2023 (conv or code)."""
    return _ordered(_azure_rows(path), path, limit)


def read_azure(path, *, limit: Optional[int] = None) -> list[TraceRequest]:
    return list(iter_azure(path, limit=limit))


def _mooncake_rows(path, block_size: int) -> Iterator[TraceRequest]:
    path = Path(path)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                d = json.loads(line)
            except json.JSONDecodeError as e:
                raise _err(path, lineno, f"not valid JSON ({e.msg})") from None
            if not isinstance(d, dict):
                raise _err(path, lineno, "expected a JSON object")
            for k in ("timestamp", "input_length", "output_length"):
                if k not in d:
                    raise _err(path, lineno, f"missing field {k!r}")
            t = _float_field(path, lineno, "timestamp", d["timestamp"]) / 1e3
            p = _int_field(path, lineno, "input_length", d["input_length"], 1)
            o = _int_field(path, lineno, "output_length", d["output_length"], 0)
            h = d.get("hash_ids")
            if h is not None:
                if not isinstance(h, list) or not all(isinstance(x, int) and not isinstance(x, bool) for x in h):
                    raise _err(path, lineno, "hash_ids must be a list of integers")
                if len(h) * block_size < p - block_size:
                    raise _err(path, lineno, f"{len(h)} hash_ids cover {len(h) * block_size} tokens, "
                                             f"fewer than input_length {p} allows")
            yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                               hash_ids=list(h) if h is not None else None)


def iter_mooncake(path, *, limit: Optional[int] = None, block_size: int = 512) -> Iterator[TraceRequest]:
    """Mooncake trace JSONL: timestamp (ms), input_length, output_length, hash_ids."""
    return _ordered(_mooncake_rows(path, block_size), path, limit)


def read_mooncake(path, *, limit: Optional[int] = None, block_size: int = 512) -> list[TraceRequest]:
    return list(iter_mooncake(path, limit=limit, block_size=block_size))


def _servegen_rows(path) -> Iterator[TraceRequest]:
    for lineno, row in _csv_rows(path, ("timestamp_s", "client_id", "input_tokens", "output_tokens")):
        t = _float_field(path, lineno, "timestamp_s", row["timestamp_s"])
        if not row["client_id"]:
            raise _err(path, lineno, "empty client_id")
        p = _int_field(path, lineno, "input_tokens", row["input_tokens"], 1)
        o = _int_field(path, lineno, "output_tokens", row["output_tokens"], 0)
        yield TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                           client=f"client-{row['client_id']}")


def iter_servegen(path, *, limit: Optional[int] = None) -> Iterator[TraceRequest]:
    """ServeGen-derived multi-tenant CSV: timestamp_s, client_id, input_tokens, output_tokens."""
    return _ordered(_servegen_rows(path), path, limit)


def read_servegen(path, *, limit: Optional[int] = None) -> list[TraceRequest]:
    return list(iter_servegen(path, limit=limit))


# --------------------------------------------------------------------------
# time scaling and the one entry point
# --------------------------------------------------------------------------

def apply_time(reqs: list[TraceRequest], time_scale: float = 1.0, rate: Optional[float] = None) -> list[TraceRequest]:
    if rate is not None:
        if rate <= 0:
            raise ValueError("rate must be > 0")
        span = reqs[-1].arrival - reqs[0].arrival if len(reqs) > 1 else 0.0
        if span > 0:
            # mean rate over the trace = (n - 1) / span
            time_scale = (len(reqs) - 1) / span / rate
        else:
            time_scale = 1.0
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if time_scale != 1.0:
        for r in reqs:
            r.arrival *= time_scale
    return reqs


def detect_format(path) -> str:
    p = str(path).lower()
    if p.endswith(".jsonl"):
        return "mooncake"
    if p.endswith(".json"):
        return "synthetic"
    with open(path, newline="") as f:
        header = f.readline()
    if "ContextTokens" in header:
        return "azure"
    if "client_id" in header:
        return "servegen"
    raise TraceFormatError(f"{path}:1: cannot tell the trace format from the header {header.strip()!r}; "
                           f"pass --format {'|'.join(FORMATS)}")


def _reader(path, fmt: str, limit: Optional[int], seed: int) -> Iterator[TraceRequest]:
    if fmt == "azure":
        return iter_azure(path, limit=limit)
    if fmt == "mooncake":
        return iter_mooncake(path, limit=limit)
    if fmt == "servegen":
        return iter_servegen(path, limit=limit)
    if fmt == "synthetic":
        from shepherd.bench.synthetic import iter_synthetic, read_synthetic_spec
        spec = read_synthetic_spec(path)
        if limit is not None:
            spec.num_requests = min(limit, spec.num_requests or limit)
        spec.seed = spec.seed or seed
        return iter_synthetic(spec)
    raise ValueError(f"unknown trace format {fmt!r}; one of {FORMATS}")


def _count_span(path, fmt: str, limit: Optional[int], seed: int) -> tuple[int, float]:
    """(requests, last arrival) in one streaming pass."""
    n, last = 0, 0.0
    for r in _reader(path, fmt, limit, seed):
        n += 1
        last = r.arrival
    return n, last


def iter_trace(path, fmt: Optional[str] = None, *, limit: Optional[int] = None, time_scale: float = 1.0,
               rate: Optional[float] = None, seed: int = 0, repeat: int = 1) -> Iterator[TraceRequest]:
    """The trace, lazily. `repeat` > 1 replays it that many times back to back
    (copy k arrives k x (span + mean gap) later; indices stay unique)."""
    fmt = fmt or detect_format(path)
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    n, span = _count_span(path, fmt, limit, seed) if (rate is not None or repeat > 1) else (0, 0.0)
    if rate is not None:
        # mean rate over the trace = (n - 1) / span
        time_scale = (n - 1) / span / rate if span > 0 else 1.0
    period = span + (span / (n - 1) if n > 1 else 1.0)
    return _replay(path, fmt, limit, seed, time_scale, repeat, n, period)


def _replay(path, fmt, limit, seed, time_scale, repeat, n, period) -> Iterator[TraceRequest]:
    for k in range(repeat):
        for r in _reader(path, fmt, limit, seed):
            r.arrival = (r.arrival + k * period) * time_scale
            if k:
                r.index += k * n
            yield r


def load_trace(path, fmt: Optional[str] = None, *, limit: Optional[int] = None, time_scale: float = 1.0,
               rate: Optional[float] = None, seed: int = 0) -> list[TraceRequest]:
    return list(iter_trace(path, fmt, limit=limit, time_scale=time_scale, rate=rate, seed=seed))


# --------------------------------------------------------------------------
# token ids
# --------------------------------------------------------------------------

_M64 = (1 << 64) - 1


_P = 2_147_483_647  # a prime > any vocabulary


def _stream(seed: int, start: int, n: int, vocab_size: int) -> list[int]:
    """n deterministic token ids, positions start..start+n-1 of the stream `seed`:
    an affine sequence (a + b * pos) mod p folded into the vocabulary, with a and b
    drawn from the seed. Two streams agree at two consecutive positions only if
    they are the same stream (up to a ~1/vocab^2 chance), which is all the prefix
    cache needs; the content is otherwise irrelevant to the simulator."""
    if n <= 0:
        return []
    span = vocab_size - RESERVED_IDS
    if span <= 0:
        raise ValueError(f"vocab_size must exceed {RESERVED_IDS}")
    a = seed % _P
    b = (seed >> 31) % (_P - 1) + 1
    x = (a + b * np.arange(start, start + n, dtype=np.int64)) % _P
    return token_objects(vocab_size)[x % span + RESERVED_IDS].tolist()


@functools.lru_cache(maxsize=8)
def token_objects(vocab_size: int) -> np.ndarray:
    """Every id of the vocabulary as one int object (an object array): prompts and
    outputs made by indexing it share those objects instead of each allocating its
    own, which costs time per token and memory in every cached prompt."""
    return np.arange(vocab_size, dtype=np.int64).astype(object)


def seeded_stream(key: str, n: int, vocab_size: int) -> list[int]:
    """The first n tokens of the stream named `key` (e.g. calibrate's prompts)."""
    return _stream(_seed_of(key), 0, n, vocab_size)


@functools.lru_cache(maxsize=256)
def _shared_stream(key: str, n: int, vocab_size: int) -> tuple:
    """A shared piece (block, system prompt, session) of n tokens; they recur, so kept."""
    return tuple(_stream(_seed_of(key), 0, n, vocab_size))


def _seed_of(key: str) -> int:
    import hashlib
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def prompt_segments(tr: TraceRequest, block_size: int = 512) -> list[tuple[str, int, int]]:
    """The prompt as (stream key, start, length) pieces, in order: Mooncake blocks,
    else the shared group prefix, then the session's stream, then the request's
    own stream. Equal keys at equal positions mean equal tokens; the prefix
    cache bounds (sim/cache_bounds.py) read the sharing from here."""
    n = tr.prompt_tokens
    segs: list[tuple[str, int, int]] = []
    have = 0
    if tr.hash_ids:
        for h in tr.hash_ids:
            if have >= n:
                break
            k = min(block_size, n - have)
            segs.append((f"block/{h}", 0, k))
            have += k
    elif tr.prefix_group and tr.prefix_tokens:
        have = min(tr.prefix_tokens, n)
        segs.append((f"group/{tr.prefix_group}", 0, have))
    if tr.session and have < n:
        # the rest of the prompt comes from the session's stream: a later turn extends an earlier one
        segs.append((f"session/{tr.session}", 0, n - have))
        have = n
    if have < n:
        key = tr.index if tr.index is not None else f"{tr.arrival!r}/{tr.prompt_tokens}/{tr.output_tokens}/{tr.client}"
        segs.append((f"req/{key}", have, n - have))
    return segs


def prompt_token_ids(tr: TraceRequest, vocab_size: int, block_size: int = 512) -> list[int]:
    """Deterministic prompt of exactly tr.prompt_tokens ids (see module doc)."""
    if tr.prompt_ids is not None:
        return list(tr.prompt_ids)
    ids: list[int] = []
    for key, start, n in prompt_segments(tr, block_size):
        if start == 0 and not key.startswith("req/"):
            ids.extend(_shared_stream(key, n, vocab_size))
        else:
            ids.extend(_stream(_seed_of(key), start, n, vocab_size))
    return ids


__all__ = ["FORMATS", "TraceFormatError", "read_azure", "read_mooncake", "read_servegen",
           "iter_azure", "iter_mooncake", "iter_servegen", "apply_time", "detect_format", "iter_trace",
           "load_trace", "prompt_token_ids", "prompt_segments"]
