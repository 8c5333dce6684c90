"""Workloads: readers for real traces and synthetic generators (simulate and bench).

    load_trace(path, fmt=None, *, limit=None, time_scale=1.0, rate=None, seed=0) -> list[TraceRequest]
    read_azure(path, *, limit=None)      Azure LLM inference trace 2023 CSV (TIMESTAMP, ContextTokens, GeneratedTokens)
    read_mooncake(path, *, limit=None)   Mooncake JSONL (timestamp ms, input_length, output_length, hash_ids)
    read_servegen(path, *, limit=None)   ServeGen CSV (timestamp_s, client_id, input_tokens, output_tokens)
    synthetic(SyntheticSpec(...))        Poisson/gamma arrivals, length distributions, shared system
                                         prompts, multi-turn sessions, N clients with their own rates
    apply_time(reqs, time_scale=1.0, rate=None) -> list[TraceRequest]
    prompt_token_ids(tr, vocab_size, block_size=512) -> list[int]

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
import json
import math
import random
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterable, Optional, Sequence

import numpy as np

from shepherd.bench.records import TraceRequest

FORMATS = ("azure", "mooncake", "servegen", "synthetic")
RESERVED_IDS = 256


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


def _finish(reqs: list[TraceRequest]) -> list[TraceRequest]:
    """Sort by arrival (stable), shift so the first arrival is 0, number them."""
    reqs.sort(key=lambda r: r.arrival)
    t0 = reqs[0].arrival if reqs else 0.0
    for i, r in enumerate(reqs):
        r.arrival = r.arrival - t0
        if r.index is None:
            r.index = i
    return reqs


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


def read_azure(path, *, limit: Optional[int] = None) -> list[TraceRequest]:
    """Azure LLM inference trace 2023 (conv or code)."""
    out = []
    for lineno, row in _csv_rows(path, ("TIMESTAMP", "ContextTokens", "GeneratedTokens")):
        if limit is not None and len(out) >= limit:
            break
        t = _parse_azure_ts(path, lineno, row["TIMESTAMP"])
        p = _int_field(path, lineno, "ContextTokens", row["ContextTokens"], 1)
        o = _int_field(path, lineno, "GeneratedTokens", row["GeneratedTokens"], 0)
        out.append(TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1)))
    return _finish(out)


def read_mooncake(path, *, limit: Optional[int] = None, block_size: int = 512) -> list[TraceRequest]:
    """Mooncake trace JSONL: timestamp (ms), input_length, output_length, hash_ids."""
    out = []
    path = Path(path)
    with path.open() as f:
        for lineno, line in enumerate(f, 1):
            if limit is not None and len(out) >= limit:
                break
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
            out.append(TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                                    hash_ids=list(h) if h is not None else None))
    return _finish(out)


def read_servegen(path, *, limit: Optional[int] = None) -> list[TraceRequest]:
    """ServeGen-derived multi-tenant CSV: timestamp_s, client_id, input_tokens, output_tokens."""
    out = []
    for lineno, row in _csv_rows(path, ("timestamp_s", "client_id", "input_tokens", "output_tokens")):
        if limit is not None and len(out) >= limit:
            break
        t = _float_field(path, lineno, "timestamp_s", row["timestamp_s"])
        if not row["client_id"]:
            raise _err(path, lineno, "empty client_id")
        p = _int_field(path, lineno, "input_tokens", row["input_tokens"], 1)
        o = _int_field(path, lineno, "output_tokens", row["output_tokens"], 0)
        out.append(TraceRequest(arrival=t, prompt_tokens=p, output_tokens=max(o, 1),
                                client=f"client-{row['client_id']}"))
    return _finish(out)


# --------------------------------------------------------------------------
# synthetic
# --------------------------------------------------------------------------

@dataclass
class LengthDist:
    """A length distribution: 'fixed:N', 'uniform:A:B', 'normal:MEAN:STD',
    'lognormal:MEAN:SIGMA' (mean of the distribution, sigma of the log), 'zipf:A:MAX',
    or 'trace:FILE' (sample lengths from a trace; input or output chosen by use)."""
    spec: str = "fixed:256"

    def sampler(self, rng: random.Random, which: str = "input"):
        kind, *args = self.spec.split(":")
        try:
            if kind == "fixed":
                n = int(args[0])
                return lambda: n
            if kind == "uniform":
                a, b = int(args[0]), int(args[1])
                return lambda: rng.randint(a, b)
            if kind == "normal":
                mu, sd = float(args[0]), float(args[1])
                return lambda: max(1, int(round(rng.gauss(mu, sd))))
            if kind == "lognormal":
                mean, sigma = float(args[0]), float(args[1])
                mu = math.log(mean) - sigma * sigma / 2
                return lambda: max(1, int(round(rng.lognormvariate(mu, sigma))))
            if kind == "zipf":
                a, mx = float(args[0]), int(args[1])
                w = [1.0 / (k ** a) for k in range(1, mx + 1)]
                cum = np.cumsum(w) / sum(w)
                return lambda: int(np.searchsorted(cum, rng.random())) + 1
            if kind == "trace":
                reqs = load_trace(":".join(args))
                vals = [r.prompt_tokens if which == "input" else r.output_tokens for r in reqs]
                return lambda: rng.choice(vals)
        except (IndexError, ValueError):
            pass
        raise ValueError(f"bad length distribution {self.spec!r} (fixed:N, uniform:A:B, normal:M:S, "
                         f"lognormal:MEAN:SIGMA, zipf:A:MAX, trace:FILE)")


@dataclass
class ClientSpec:
    name: str = "default"
    rate: float = 1.0                 # req/s
    input_len: str = "fixed:256"
    output_len: str = "fixed:256"
    arrival: str = "poisson"          # poisson | gamma | constant
    cv: float = 1.0                   # gamma: coefficient of variation of inter-arrival times (burstiness)
    system_prompt_tokens: int = 0     # shared prefix among this client's requests
    num_system_prompts: int = 1       # distinct system prompts, drawn uniformly
    turns: int = 1                    # multi-turn sessions: turns per session (>1 turns share growing prefixes)
    think_time: float = 10.0          # mean seconds between the turns of a session (exponential; 0 = together)
    priority: int = 0


@dataclass
class SyntheticSpec:
    clients: list[ClientSpec] = field(default_factory=lambda: [ClientSpec()])
    num_requests: Optional[int] = None   # total cap (across clients), or
    duration: Optional[float] = None     # generate arrivals in [0, duration)
    seed: int = 0


def _interarrival(rng: random.Random, c: ClientSpec) -> float:
    if c.rate <= 0:
        raise ValueError(f"client {c.name}: rate must be > 0")
    if c.arrival == "poisson":
        return rng.expovariate(c.rate)
    if c.arrival == "gamma":
        shape = 1.0 / (c.cv * c.cv)
        return rng.gammavariate(shape, 1.0 / (c.rate * shape))
    if c.arrival == "constant":
        return 1.0 / c.rate
    raise ValueError(f"client {c.name}: arrival must be poisson, gamma or constant, got {c.arrival!r}")


def synthetic(spec: SyntheticSpec) -> list[TraceRequest]:
    """Each client draws its own arrival process (of sessions, when turns > 1);
    turn k+1 of a session arrives an exponential think time after turn k, and
    its prompt is turn k's prompt + turn k's output length + new user tokens
    (the prompt ids extend turn k's: prompt_token_ids follows the session's
    stream after the shared system prompt)."""
    if spec.num_requests is None and spec.duration is None:
        raise ValueError("synthetic workload needs num_requests or duration")
    total_rate = sum(c.rate for c in spec.clients)
    horizon = spec.duration if spec.duration is not None else 1.5 * spec.num_requests / total_rate + 60
    out: list[TraceRequest] = []
    for ci, c in enumerate(spec.clients):
        rng = random.Random(f"{spec.seed}/{ci}/{c.name}")
        inp = LengthDist(c.input_len).sampler(rng, "input")
        outp = LengthDist(c.output_len).sampler(rng, "output")
        t = 0.0
        sess = 0
        while True:
            t += _interarrival(rng, c)
            if t >= horizon:
                break
            sys_group = None
            sys_len = c.system_prompt_tokens
            if sys_len:
                sys_group = f"{c.name}/sys{rng.randrange(c.num_system_prompts)}"
            # a session: turn k+1's prompt is turn k's prompt + its output + new user tokens
            prompt_so_far = 0
            tt = t
            sess_id = f"{c.name}/s{sess}" if c.turns > 1 else None
            sess += 1
            for turn in range(max(1, c.turns)):
                user = inp()
                o = outp()
                p = (sys_len + user) if turn == 0 else prompt_so_far + user
                out.append(TraceRequest(arrival=tt, prompt_tokens=p, output_tokens=max(1, o), client=c.name,
                                        prefix_group=sys_group, prefix_tokens=sys_len if sys_group else 0,
                                        priority=c.priority, session=sess_id, turn=turn))
                prompt_so_far = p + o
                if turn + 1 < c.turns:
                    tt += rng.expovariate(1.0 / c.think_time) if c.think_time > 0 else 0.0
                    if tt >= horizon:
                        break
    out.sort(key=lambda r: (r.arrival, r.client))
    if spec.num_requests is not None:
        out = out[:spec.num_requests]
    for i, r in enumerate(out):
        r.index = i
    return out


def parse_clients(text: str, *, input_len="fixed:256", output_len="fixed:256", arrival="poisson",
                  cv=1.0, system_prompt_tokens=0, turns=1) -> list[ClientSpec]:
    """'a=1.5,b=3' -> two clients at 1.5 and 3 req/s; 'N@R' -> N clients each at R req/s."""
    kw = dict(input_len=input_len, output_len=output_len, arrival=arrival, cv=cv,
              system_prompt_tokens=system_prompt_tokens, turns=turns)
    text = text.strip()
    if "@" in text:
        n, r = text.split("@")
        return [ClientSpec(name=f"client-{i}", rate=float(r), **kw) for i in range(int(n))]
    out = []
    for part in text.split(","):
        name, _, rate = part.partition("=")
        out.append(ClientSpec(name=name.strip(), rate=float(rate), **kw))
    return out


def read_synthetic_spec(path) -> SyntheticSpec:
    """A JSON file: {"seed": 0, "num_requests": N | "duration": S, "clients": [{ClientSpec fields}]}."""
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise _err(path, e.lineno, f"not valid JSON ({e.msg})") from None
    try:
        clients = [ClientSpec(**c) for c in d.get("clients", [{}])]
        return SyntheticSpec(clients=clients, num_requests=d.get("num_requests"), duration=d.get("duration"),
                             seed=d.get("seed", 0))
    except TypeError as e:
        raise _err(path, 1, f"bad synthetic spec: {e}") from None


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


def load_trace(path, fmt: Optional[str] = None, *, limit: Optional[int] = None, time_scale: float = 1.0,
               rate: Optional[float] = None, seed: int = 0) -> list[TraceRequest]:
    fmt = fmt or detect_format(path)
    if fmt == "azure":
        reqs = read_azure(path, limit=limit)
    elif fmt == "mooncake":
        reqs = read_mooncake(path, limit=limit)
    elif fmt == "servegen":
        reqs = read_servegen(path, limit=limit)
    elif fmt == "synthetic":
        spec = read_synthetic_spec(path)
        if limit is not None:
            spec.num_requests = min(limit, spec.num_requests or limit)
        spec.seed = spec.seed or seed
        reqs = synthetic(spec)
    else:
        raise ValueError(f"unknown trace format {fmt!r}; one of {FORMATS}")
    return apply_time(reqs, time_scale, rate)


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
    return (x % span + RESERVED_IDS).tolist()


def _seed_of(key: str) -> int:
    import hashlib
    return int.from_bytes(hashlib.blake2b(key.encode(), digest_size=8).digest(), "little")


def prompt_token_ids(tr: TraceRequest, vocab_size: int, block_size: int = 512) -> list[int]:
    """Deterministic prompt of exactly tr.prompt_tokens ids (see module doc)."""
    if tr.prompt_ids is not None:
        return list(tr.prompt_ids)
    n = tr.prompt_tokens
    ids: list[int] = []
    if tr.hash_ids:
        for h in tr.hash_ids:
            if len(ids) >= n:
                break
            ids.extend(_stream(_seed_of(f"block/{h}"), 0, min(block_size, n - len(ids)), vocab_size))
    elif tr.prefix_group and tr.prefix_tokens:
        ids = _stream(_seed_of(f"group/{tr.prefix_group}"), 0, min(tr.prefix_tokens, n), vocab_size)
    if tr.session and len(ids) < n:
        # the rest of the prompt comes from the session's stream: a later turn extends an earlier one
        ids.extend(_stream(_seed_of(f"session/{tr.session}"), 0, n - len(ids), vocab_size))
    if len(ids) < n:
        key = tr.index if tr.index is not None else f"{tr.arrival!r}/{tr.prompt_tokens}/{tr.output_tokens}/{tr.client}"
        ids.extend(_stream(_seed_of(f"req/{key}"), len(ids), n - len(ids), vocab_size))
    return ids


__all__ = ["FORMATS", "TraceFormatError", "read_azure", "read_mooncake", "read_servegen", "synthetic",
           "SyntheticSpec", "ClientSpec", "LengthDist", "parse_clients", "read_synthetic_spec", "apply_time",
           "detect_format", "load_trace", "prompt_token_ids"]
