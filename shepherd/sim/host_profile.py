"""Profile shepherd's own per-step CPU path, part by part, on this machine: what
sim/host_path.py's HostPath is fitted from (`shepherd calibrate --host-path --out FILE`).

The engine is the served one (engine/build.py's ServedCore: the real Scheduler and
TorchExecutor on a wall clock), driven here one step at a time in one thread, so each part is
timed alone:

    schedule   Step.schedule_s (EngineCore.step's schedule())
    prepare    the executor's build_input (TorchExecutor.last_parts) and the rest of its execute
               outside the forward and the sample (new and finished requests)
    sample     the executor's Sampler.sample on [rows, vocabulary] logits minus argmax_rows over
               the same logits, back to back (the pass over the vocabulary is the device's on a
               GPU). Not the engine step's own sample time minus an argmax timed apart: the
               step's logits come out of the LM head's GEMM, and the argmax over them (25 MB at
               128 rows) was 16 us a row slower than over the same tensor warm, which on a GPU
               is device time, not host
    update     on_step (Step.scheduler_s - schedule_s), ServedCore.step's own work (the output
               tuples, the stats snapshot) and pickling the CoreStep, as the pipe does
    front      unpickling the CoreStep, the front's metrics update, OutputProcessor.on_outputs
               (the real tokenizer's incremental detokenising, stop strings) and one SSE chunk
               (server/common.sse_chunker) per output, as a completions stream writes it

The forward is timed too and left out: the GPU model prices it. Each part's samples are
grouped by (requests, tokens), the median of each group kept, and fitted by least squares
(host_path.fit_part): fixed + per request (+ per token fed, for the core's parts).
"""
from __future__ import annotations

import asyncio
import pickle
import platform
import statistics
import time
from collections import defaultdict
from dataclasses import asdict
from typing import Callable, Optional

from shepherd.sim.host_path import CORE_PARTS, PARTS, HostPath, fit_part


def profile_host_path(served, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_lens=(64, 512),
                      decode_steps: int = 16, repeats: int = 2, warmup: int = 5,
                      log: Optional[Callable[[str], None]] = None) -> HostPath:
    """Run the grid through `served` (a ServedCore over a TorchExecutor) and fit the parts."""
    from shepherd.bench.traces import seeded_stream
    from shepherd.engine.core_loop import ADD
    from shepherd.request import Request, SamplingParams

    ex = served.core.executor
    info = served.info
    vocab = int(ex.model_config.vocab_size)
    front = _Front(served)
    sampler = _SamplerHost(ex, tuple(info.eos_token_ids), vocab)
    rec = _Samples(warmup)
    n_req = 0
    try:
        for rep in range(repeats):
            for P in prompt_lens:
                for B in batch_sizes:
                    now = time.monotonic()
                    items = []
                    for b in range(B):
                        n_req += 1
                        req = Request(req_id=f"h{n_req}", prompt_ids=seeded_stream(f"host/{rep}/{P}/{B}/{b}", P, vocab),
                                      params=SamplingParams(max_tokens=decode_steps, temperature=0.0, ignore_eos=True),
                                      arrival=now, eos_token_ids=tuple(info.eos_token_ids))
                        front.track(req)
                        items.append((ADD, pickle.loads(pickle.dumps(req))))   # the core's own copy, as over the pipe
                    served.intake(items, now)
                    while served.has_work:
                        _one_step(served, front, sampler, rec)
                    if log:
                        log(f"  B={B:<3} P={P:<5} steps so far {rec.steps}")
    finally:
        front.close()
    return rec.fit(meta={"machine": cpu_name(), "model": info.model_name, "batch_sizes": list(batch_sizes),
                         "prompt_lens": list(prompt_lens), "decode_steps": decode_steps, "repeats": repeats,
                         "vocab_size": vocab})


def _one_step(served, front: "_Front", sampler: "_SamplerHost", rec: "_Samples") -> None:
    """One step of the served core, its CoreStep through the pipe's pickling and the front:
    each part's time into `rec`."""
    from shepherd.engine.core_loop import CoreStep, stats_to_wire
    t0 = time.perf_counter()
    outs, step_time, generated = served.step()
    t1 = time.perf_counter()
    blob = pickle.dumps(CoreStep([], outs, stats_to_wire(served.last_stats), step_time, generated))
    t2 = time.perf_counter()
    n_outputs, n_deltas = front.handle(blob)
    t3 = time.perf_counter()
    st = served.last_step
    if step_time is None or not st.batch.seqs or not rec.count():
        return
    seqs = st.batch.seqs
    n = len(seqs)
    tokens = sum(len(s.token_ids) for s in seqs)
    rows = sum(1 for s in seqs if s.sample)
    p = served.core.executor.last_parts
    execute = st.step_time
    rec.add("schedule", n, tokens, st.schedule_s)
    rec.add("prepare", n, tokens, max(0.0, execute - p["forward"] - p["sample"]))
    # the step's own sample time (its argmax over the forward's fresh logits included) is kept
    # for the record only (meta: step_sample_with_vocab_pass)
    rec.add("sample", n, tokens, sampler.time(rows) if rows else 0.0)
    rec.add("step_sample", n, tokens, p["sample"])
    rec.add("update", n, tokens, (st.scheduler_s - st.schedule_s)
            + max(0.0, (t1 - t0) - (st.scheduler_s + execute)) + (t2 - t1))
    rec.add("front", n_outputs, n_deltas, t3 - t2)
    rec.add("forward", n, tokens, p["forward"])


class _Front:
    """The server process's side of a step, as EngineFront and a completions stream run it:
    unpickle the CoreStep, update the metrics, OutputProcessor.on_outputs, one SSE chunk per
    delta."""

    def __init__(self, served):
        from shepherd.engine.metrics import EngineMetrics
        from shepherd.engine.output import OutputProcessor
        self.model = served.info.model_name
        self.metrics = EngineMetrics(self.model)
        self.proc = OutputProcessor(served.tokenizer, self.metrics, self.model)
        self.loop = asyncio.new_event_loop()       # RequestStreams need one; nothing runs on it
        self.streams: dict = {}
        self.meta = {"rid": "cmpl-host-profile", "created": int(time.time()), "model": self.model}
        from shepherd.server.common import sse_chunker
        self.chunk = sse_chunker("text_completion", self.meta, self.model, False)   # one stream's, as the server's

    def track(self, req) -> None:
        from shepherd.engine.output import RequestStream
        self.streams[req.req_id] = RequestStream(None, req.req_id, self.loop)
        self.proc.track(req, self.streams[req.req_id])

    def handle(self, blob: bytes) -> tuple[int, int]:
        """(outputs in the step, deltas streamed)."""
        from shepherd.engine.core_loop import stats_from_wire
        got = pickle.loads(blob)
        self.metrics.update_from_stats(stats_from_wire(got.stats))
        self.proc.on_outputs(got.outputs, time.monotonic())
        n = 0
        for o in got.outputs:
            q = self.streams[o[0]].queue
            while not q.empty():
                out = q.get_nowait()
                n += 1
                self.chunk([{"index": 0, "text": out.text, "logprobs": None,
                             "finish_reason": out.finish_reason if out.finished else None,
                             "stop_reason": out.stop_reason}])
                if out.finished:
                    del self.streams[o[0]]
        return len(got.outputs), n

    def close(self) -> None:
        self.loop.close()


class _SamplerHost:
    """The executor's sampler over `rows` greedy requests, less argmax_rows over the same
    logits (back to back, median of 9): its host work, once per row count."""

    def __init__(self, ex, eos: tuple, vocab: int):
        self.ex, self.eos, self.vocab = ex, eos, vocab
        self.cache: dict[int, float] = {}

    def time(self, rows: int) -> float:
        if rows in self.cache:
            return self.cache[rows]
        import torch

        from shepherd.model.kernels import argmax_rows
        from shepherd.request import SamplingParams
        from shepherd.step import NewRequest
        sampler = self.ex.sampler
        states = [sampler.add(NewRequest(req_id=f"hs-{rows}-{i}", prompt_ids=[1, 2, 3],
                                         params=SamplingParams(temperature=0.0, ignore_eos=True),
                                         eos_token_ids=self.eos)) for i in range(rows)]
        x = torch.randn(rows, self.vocab, dtype=torch.float32)
        sampler.sample(x, states)
        ts = []
        for _ in range(9):
            t0 = time.perf_counter()
            argmax_rows(x)
            t1 = time.perf_counter()
            sampler.sample(x, states)
            ts.append(max(0.0, (time.perf_counter() - t1) - (t1 - t0)))
        for st in states:
            sampler.forget(st.req_id)
        self.cache[rows] = statistics.median(ts)
        return self.cache[rows]


class _Samples:
    """(requests, tokens, seconds) per part, the first `warmup` steps of the run dropped."""

    def __init__(self, warmup: int):
        self.warmup = warmup
        self.steps = 0
        self.parts: dict[str, list[tuple[int, int, float]]] = defaultdict(list)

    def count(self) -> bool:
        """A step that ran: False while it is one of the warm-up steps."""
        self.steps += 1
        return self.steps > self.warmup

    def add(self, part: str, n: int, tokens: int, seconds: float) -> None:
        self.parts[part].append((n, tokens, seconds))

    def fit(self, meta: dict) -> HostPath:
        s = self.parts
        fits = {name: fit_part(_medians(s[name]), per_token=name in CORE_PARTS) for name in PARTS}
        fwd = s.get("forward")
        meta = {**meta, "steps": max(0, self.steps - self.warmup),
                "median_s": {name: statistics.median(t for *_, t in s[name]) for name in PARTS if s[name]},
                "fit_error": {name: _fit_error(fits[name], s[name]) for name in PARTS},
                "forward_median_s": statistics.median(t for *_, t in fwd) if fwd else None,
                "step_sample_with_vocab_pass": asdict(fit_part(_medians(s["step_sample"])))}
        return HostPath(**fits, meta=meta)


def cpu_name() -> str:
    """The CPU's model name (/proc/cpuinfo on Linux) and its core count."""
    import os
    name = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    except OSError:
        pass
    return f"{name}, {os.cpu_count()} cores"


def _medians(samples: list[tuple[int, int, float]]) -> list[tuple[int, int, float]]:
    """One sample per (requests, tokens): the median of its times (a GC pause or a slow
    moment of the machine is one sample of many there)."""
    groups: dict[tuple[int, int], list[float]] = defaultdict(list)
    for n, tok, t in samples:
        groups[(n, tok)].append(t)
    return [(n, tok, statistics.median(ts)) for (n, tok), ts in sorted(groups.items())]


def _fit_error(part, samples) -> float:
    """Median relative error of the fit over the grouped medians."""
    errs = [abs(part.time(n, tok) - t) / t for n, tok, t in _medians(samples) if t > 0]
    return statistics.median(errs) if errs else 0.0
