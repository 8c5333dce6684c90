"""Workloads from files: the one entry point for a trace of any format (simulate and bench),
and the token ids of trace requests. The real formats' readers are trace_formats.py; synthetic
workloads (and their JSON spec files) are synthetic.py.

    iter_trace(path, fmt=None, *, limit=None, time_scale=1.0, rate=None, seed=0) -> Iterator[TraceRequest]
    load_trace(...)                      the same, as a list (small traces, tests)
    apply_time(reqs, time_scale=1.0, rate=None) -> list[TraceRequest]
    prompt_token_ids(tr, vocab_size, block_size=512) -> list[int]

Memory: the readers are generators (trace_formats.py); `rate` needs the
trace's span, so it costs a first counting pass over the file.

Times: arrivals are in seconds from the first request of the file.
`time_scale` multiplies every arrival time (0.5 replays twice as fast, 2 at
half speed); `rate` (req/s) rescales arrivals so the mean rate over the trace
is `rate` (applied after `limit`, instead of time_scale when both are given).

Token ids: traces carry lengths, not text. prompt_token_ids() builds a
deterministic prompt of the right length: Mooncake `hash_ids` map each id to a
fixed block of `block_size` tokens (equal ids, equal blocks, so the prefix
cache sees exactly the trace's sharing); synthetic requests that share a
`prefix_group` share their first `prefix_tokens` tokens; everything else is
unique to the request (seeded by `index`). Ids avoid the lowest 256 ids
(special tokens of the usual vocabularies).
"""
from __future__ import annotations

import contextlib
import functools
import gzip
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from shepherd.bench.records import TraceRequest
from shepherd.bench.synthetic import iter_synthetic, read_synthetic_spec
from shepherd.bench.trace_formats import FORMATS, TraceFormatError, detect_format, iter_file

RESERVED_IDS = 256


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


def _reader(path, fmt: str, limit: Optional[int], seed: int) -> Iterator[TraceRequest]:
    if fmt == "synthetic":
        spec = read_synthetic_spec(path)
        if limit is not None:
            spec.num_requests = min(limit, spec.num_requests or limit)
        spec.seed = spec.seed or seed
        return iter_synthetic(spec)
    if fmt not in FORMATS:
        raise ValueError(f"unknown trace format {fmt!r}; one of {FORMATS}")
    return iter_file(path, fmt, limit=limit)


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
    _check_file(path)
    with _read_errors(path):
        fmt = fmt or detect_format(path)
    if time_scale <= 0:
        raise ValueError("time_scale must be > 0")
    if rate is not None and rate <= 0:
        raise ValueError("rate must be > 0")
    if repeat < 1:
        raise ValueError("repeat must be >= 1")
    if limit is not None and limit < 0:       # islice's own words: "Stop argument for islice() must be None or..."
        raise ValueError(f"--limit must be >= 0, got {limit}")
    with _read_errors(path):
        n, span = _count_span(path, fmt, limit, seed) if (rate is not None or repeat > 1) else (0, 0.0)
    if rate is not None:
        # mean rate over the trace = (n - 1) / span
        time_scale = (n - 1) / span / rate if span > 0 else 1.0
    period = span + (span / (n - 1) if n > 1 else 1.0)
    return _replay(path, fmt, limit, seed, time_scale, repeat, n, period)


def _replay(path, fmt, limit, seed, time_scale, repeat, n, period) -> Iterator[TraceRequest]:
    with _read_errors(path):
        for k in range(repeat):
            for r in _reader(path, fmt, limit, seed):
                r.arrival = (r.arrival + k * period) * time_scale
                if k:
                    r.index += k * n
                yield r


def _check_file(path) -> None:
    """Before any reading: a folder raised IsADirectoryError, and a .gz that is not gzip
    gzip.BadGzipFile without the file's name, from inside the reader."""
    p = Path(path)
    if p.is_dir():
        raise TraceFormatError(f"{path}: is a folder, not a trace file")
    if p.suffix.lower() == ".gz" and p.is_file():
        with open(p, "rb") as f:
            if f.read(2) != b"\x1f\x8b":
                raise TraceFormatError(f"{path}: named .gz but not gzip-compressed")


@contextlib.contextmanager
def _read_errors(path):
    """What a reader can meet below the rows, as one line that names the file."""
    try:
        yield
    except UnicodeDecodeError as e:
        raise TraceFormatError(f"{path}: not UTF-8 text ({e.reason})") from None
    except (EOFError, gzip.BadGzipFile) as e:
        raise TraceFormatError(f"{path}: damaged or truncated gzip file ({e})") from None


def load_trace(path, fmt: Optional[str] = None, *, limit: Optional[int] = None, time_scale: float = 1.0,
               rate: Optional[float] = None, seed: int = 0) -> list[TraceRequest]:
    return list(iter_trace(path, fmt, limit=limit, time_scale=time_scale, rate=rate, seed=seed))


# --------------------------------------------------------------------------
# token ids
# --------------------------------------------------------------------------

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
    else RAGPulse chunks, else the shared group prefix, then the session's stream, then the request's
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
    elif tr.chunks:
        # variable-length chunks (RAGPulse's system prompt, passages, history, ...): two prompts
        # share tokens as far as their leading chunk ids agree
        for cid, k in tr.chunks:
            k = min(k, n - have)
            if k <= 0:
                break
            segs.append((f"chunk/{cid}", 0, k))
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


def stream_tokens(seed: int, start: int, n: int, vocab_size: int) -> list[int]:
    """Positions start..start+n-1 of the token stream `seed` (see session_stream)."""
    return _stream(seed, start, n, vocab_size)


def session_stream(tr: TraceRequest, block_size: int = 512) -> Optional[tuple[int, int]]:
    """(seed, offset) of the session's stream in tr's prompt: prompt position i >= offset holds
    stream token i - offset. None when tr belongs to no session."""
    at = 0
    for key, start, n in prompt_segments(tr, block_size):
        if key.startswith("session/"):
            return _seed_of(key), at - start
        at += n
    return None


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


__all__ = ["apply_time", "iter_trace", "load_trace", "prompt_token_ids", "prompt_segments", "seeded_stream",
           "session_stream", "stream_tokens", "token_objects"]
