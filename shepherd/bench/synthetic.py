"""Synthetic workloads, drawn on demand (simulate and bench).

    iter_synthetic(SyntheticSpec(...)) -> Iterator[TraceRequest]   Poisson/gamma arrivals (optionally
        with a diurnal rate), length distributions, shared system prompts, multi-turn sessions,
        N clients with their own rates
    synthetic(spec) -> list[TraceRequest]          the same, as a list
    parse_clients("a=1.5,b=3" | "N@R") -> list[ClientSpec]
    read_synthetic_spec(path) -> SyntheticSpec     a JSON file
    with_adapters(reqs, names, zipf=1.0, seed=0)   each request names a LoRA adapter, Zipf-popular
"""
from __future__ import annotations

import heapq
import itertools
import json
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from shepherd.bench.records import TraceRequest
from shepherd.bench.trace_formats import MAX_TRACE_TOKENS, format_error, iter_file


@dataclass
class LengthDist:
    """A length distribution, the one spelling of `shepherd simulate` and `shepherd bench`:
    'N' or 'fixed:N', 'uniform:A:B' ('u'), 'normal:MEAN:STD' ('n'), 'exp:MEAN', 'lognormal:MEAN:SIGMA'
    (mean of the distribution, sigma of the log), 'zipf:A:MAX', or 'trace:FILE' (sample lengths
    from a trace; input or output chosen by use). Draws are at least 1."""
    spec: str = "fixed:256"

    def sampler(self, rng: random.Random, which: str = "input"):
        kind, *args = str(self.spec).strip().split(":")
        kind = kind.lower()
        try:
            if not args:
                kind, args = "fixed", [kind]
            if kind == "fixed" and len(args) == 1:
                n = _length(int(float(args[0])))
                return lambda: n
            if kind in ("uniform", "u") and len(args) == 2:
                a, b = _length(int(float(args[0]))), _length(int(float(args[1])))
                if a > b:       # randint's own message: "empty range for randrange()"
                    raise ValueError
                return lambda: rng.randint(a, b)
            if kind in ("normal", "n") and len(args) == 2:
                mu, sd = _length(float(args[0])), float(args[1])
                return lambda: max(1, int(round(rng.gauss(mu, sd))))
            if kind in ("exp", "exponential") and len(args) == 1:
                mean = _length(float(args[0]))
                return lambda: max(1, int(round(rng.expovariate(1.0 / mean))))
            if kind == "lognormal" and len(args) == 2:
                mean, sigma = _length(float(args[0])), float(args[1])
                mu = math.log(mean) - sigma * sigma / 2
                return lambda: max(1, int(round(rng.lognormvariate(mu, sigma))))
            if kind == "zipf" and len(args) == 2:
                a, mx = float(args[0]), _length(int(args[1]))
                w = [1.0 / (k ** a) for k in range(1, mx + 1)]
                cum = np.cumsum(w) / sum(w)
                return lambda: int(np.searchsorted(cum, rng.random())) + 1
            if kind == "trace" and args:
                vals = [r.prompt_tokens if which == "input" else r.output_tokens for r in iter_file(":".join(args))]
                return lambda: rng.choice(vals)
        except (IndexError, ValueError, OverflowError):
            pass
        raise ValueError(f"bad length distribution {self.spec!r} (N or fixed:N, uniform:A:B with A <= B, normal:M:S, "
                         f"exp:MEAN, lognormal:MEAN:SIGMA, zipf:A:MAX, trace:FILE; lengths 1..{MAX_TRACE_TOKENS:,})")


def _length(n):
    """A length parameter in 1..MAX_TRACE_TOKENS (a 1e12-token prompt ran the machine out of memory);
    NaN fails the comparison too."""
    if not 1 <= n <= MAX_TRACE_TOKENS:
        raise ValueError
    return n


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
    diurnal: float = 0.0              # 0..1: rate(t) = rate x (1 - diurnal x cos(2 pi t / diurnal_period))
    diurnal_period: float = 86400.0   # seconds; t = 0 is the trough (night)


@dataclass
class SyntheticSpec:
    clients: list[ClientSpec] = field(default_factory=lambda: [ClientSpec()])
    num_requests: Optional[int] = None   # total cap (across clients), or
    duration: Optional[float] = None     # generate arrivals in [0, duration)
    seed: int = 0


def _interarrival(rng: random.Random, c: ClientSpec, rate: float) -> float:
    if rate <= 0:
        raise ValueError(f"client {c.name}: rate must be > 0")
    if c.arrival == "poisson":
        return rng.expovariate(rate)
    if c.arrival == "gamma":
        if not c.cv > 0:    # shape 1/cv^2: ZeroDivisionError
            raise ValueError(f"client {c.name}: burstiness (gamma CV) must be > 0, got {c.cv}")
        shape = 1.0 / (c.cv * c.cv)
        return rng.gammavariate(shape, 1.0 / (rate * shape))
    if c.arrival == "constant":
        return 1.0 / rate
    raise ValueError(f"client {c.name}: arrival must be poisson, gamma or constant, got {c.arrival!r}")


def _next_start(rng: random.Random, c: ClientSpec, t: float) -> float:
    """The next session start after t; with `diurnal`, a Poisson process thinned
    to rate x (1 - diurnal x cos(2 pi t / period)) (mean rate = rate)."""
    if not c.diurnal:
        return t + _interarrival(rng, c, c.rate)
    if not 0 < c.diurnal <= 1:
        raise ValueError(f"client {c.name}: diurnal must be in (0, 1]")
    top = c.rate * (1 + c.diurnal)
    while True:
        t += _interarrival(rng, c, top)
        if rng.random() * (1 + c.diurnal) < 1 - c.diurnal * math.cos(2 * math.pi * t / c.diurnal_period):
            return t


def _session(rng, c: ClientSpec, t: float, sess: int, inp, outp, horizon: float) -> list[TraceRequest]:
    """One session's turns: turn k+1's prompt is turn k's prompt + its output + new user tokens."""
    sys_group = None
    sys_len = c.system_prompt_tokens
    if sys_len:
        sys_group = f"{c.name}/sys{rng.randrange(c.num_system_prompts)}"
    prompt_so_far = 0
    tt = t
    sess_id = f"{c.name}/s{sess}" if c.turns > 1 else None
    out = []
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
    return out


def _client_stream(spec: SyntheticSpec, ci: int, c: ClientSpec, horizon: float) -> Iterator[TraceRequest]:
    """One client's requests in arrival order, drawn on demand: only the turns of
    sessions still in progress are held (a heap), never the whole workload."""
    rng = random.Random(f"{spec.seed}/{ci}/{c.name}")
    inp = LengthDist(c.input_len).sampler(rng, "input")
    outp = LengthDist(c.output_len).sampler(rng, "output")
    pending: list = []
    seq = 0
    t = 0.0
    sess = 0
    while True:
        t = _next_start(rng, c, t)
        while pending and (pending[0][0] <= t or t >= horizon):
            yield heapq.heappop(pending)[2]
        if t >= horizon:
            return
        for r in _session(rng, c, t, sess, inp, outp, horizon):
            heapq.heappush(pending, (r.arrival, seq, r))
            seq += 1
        sess += 1


def iter_synthetic(spec: SyntheticSpec) -> Iterator[TraceRequest]:
    """Each client draws its own arrival process (of sessions, when turns > 1);
    turn k+1 of a session arrives an exponential think time after turn k, and
    its prompt is turn k's prompt + turn k's output length + new user tokens
    (the prompt ids extend turn k's: prompt_token_ids follows the session's
    stream after the shared system prompt). Requests come in arrival order
    (ties by client name) and are generated as they are taken, so memory does
    not grow with num_requests x rate."""
    if spec.num_requests is None and spec.duration is None:
        raise ValueError("synthetic workload needs num_requests or duration")
    horizon = spec.duration if spec.duration is not None else math.inf
    streams = [_client_stream(spec, ci, c, horizon) for ci, c in enumerate(spec.clients)]
    merged = heapq.merge(*streams, key=lambda r: (r.arrival, r.client))
    if spec.num_requests is not None:
        merged = itertools.islice(merged, spec.num_requests)
    for i, r in enumerate(merged):
        r.index = i
        yield r


def synthetic(spec: SyntheticSpec) -> list[TraceRequest]:
    return list(iter_synthetic(spec))


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
        d = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise format_error(path, e.lineno, f"not valid JSON ({e.msg})") from None
    except UnicodeDecodeError as e:
        raise format_error(path, 1, f"not UTF-8 text ({e.reason} at byte {e.start})") from None
    if not isinstance(d, dict):     # a JSON array: d.get raised AttributeError
        raise format_error(path, 1, f"a synthetic spec is a JSON object, got {type(d).__name__}")
    try:
        clients = [ClientSpec(**c) for c in d.get("clients", [{}])]
        return SyntheticSpec(clients=clients, num_requests=d.get("num_requests"), duration=d.get("duration"),
                             seed=d.get("seed", 0))
    except TypeError as e:
        raise format_error(path, 1, f"bad synthetic spec: {e}") from None


__all__ = ["LengthDist", "ClientSpec", "SyntheticSpec", "iter_synthetic", "synthetic", "parse_clients",
           "read_synthetic_spec"]


def adapter_names(n: int) -> list[str]:
    """The simulator's adapter names, most popular first (`--adapters N`)."""
    return [f"lora-{k}" for k in range(n)]


def with_adapters(reqs, names: list[str], zipf: float = 1.0, seed: int = 0) -> Iterator[TraceRequest]:
    """Each request names one of `names` (a LoRA adapter), the k-th (from 0) with probability
    proportional to 1 / (k + 1) ** zipf: LoRAX's and S-LoRA's many-adapter workload, a few hot
    adapters and a long tail. Drawn from its own generator, so the rest of the workload is the
    one without adapters."""
    if not names:
        raise ValueError("with_adapters: no adapter names")
    if zipf < 0:
        raise ValueError(f"adapter popularity zipf={zipf}: must be >= 0 (0 = uniform)")
    w = [1.0 / (k + 1) ** zipf for k in range(len(names))]
    cum = np.cumsum(w) / sum(w)
    rng = random.Random(f"adapters-{seed}")
    for r in reqs:
        r.adapter = names[min(int(np.searchsorted(cum, rng.random(), side="right")), len(names) - 1)]
        yield r
