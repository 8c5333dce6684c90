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
               (server/common.sse_chunk) per output, as a completions stream writes it

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

from shepherd.sim.host_path import CORE_PARTS, HostPath, fit_part


def profile_host_path(served, batch_sizes=(1, 2, 4, 8, 16, 32, 64), prompt_lens=(64, 512),
                      decode_steps: int = 16, repeats: int = 2, warmup: int = 5,
                      log: Optional[Callable[[str], None]] = None) -> HostPath:
    """Run the grid through `served` (a ServedCore over a TorchExecutor) and fit the parts."""
    from shepherd.bench.traces import seeded_stream
    from shepherd.engine.core_loop import ADD, CoreStep
    from shepherd.engine.metrics import EngineMetrics
    from shepherd.engine.output import OutputProcessor, RequestStream
    from shepherd.model.kernels import argmax_rows
    from shepherd.request import Request, SamplingParams
    from shepherd.server.common import sse_chunk
    import torch

    ex = served.core.executor
    info = served.info
    vocab = int(ex.model_config.vocab_size)
    metrics = EngineMetrics(info.model_name)
    front = OutputProcessor(served.tokenizer, metrics, info.model_name)
    loop = asyncio.new_event_loop()
    samples: dict[str, list[tuple[int, int, float]]] = defaultdict(list)
    forward: list[tuple[int, int, float]] = []
    sample_step: list[tuple[int, int, float]] = []     # the step's whole sample time, for the record
    vocab_pass: dict[int, float] = {}
    streams: dict[str, RequestStream] = {}
    n_req = n_steps = 0
    meta_sse = {"rid": "cmpl-host-profile", "created": int(time.time()), "model": info.model_name}

    def sample_host(rows: int) -> float:
        """The executor's sampler over `rows` greedy requests, less its argmax: median of 9."""
        if rows not in vocab_pass:
            from shepherd.step import NewRequest
            states = [ex.sampler.add(NewRequest(req_id=f"hs-{rows}-{i}", prompt_ids=[1, 2, 3],
                                                params=SamplingParams(temperature=0.0, ignore_eos=True),
                                                eos_token_ids=tuple(info.eos_token_ids))) for i in range(rows)]
            x = torch.randn(rows, vocab, dtype=torch.float32)
            ex.sampler.sample(x, states)
            ts = []
            for _ in range(9):
                t0 = time.perf_counter()
                argmax_rows(x)
                t1 = time.perf_counter()
                ex.sampler.sample(x, states)
                ts.append(max(0.0, (time.perf_counter() - t1) - (t1 - t0)))
            for st in states:
                ex.sampler.forget(st.req_id)
            vocab_pass[rows] = statistics.median(ts)
        return vocab_pass[rows]

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
                        streams[req.req_id] = RequestStream(None, req.req_id, loop)
                        front.track(req, streams[req.req_id])
                        items.append((ADD, pickle.loads(pickle.dumps(req))))   # the core's own copy, as over the pipe
                    served.intake(items, now)
                    while served.has_work:
                        t0 = time.perf_counter()
                        outs, step_time, generated = served.step()
                        t1 = time.perf_counter()
                        blob = pickle.dumps(CoreStep([], outs, served.last_stats, step_time, generated))
                        t2 = time.perf_counter()
                        got = pickle.loads(blob)
                        metrics.update_from_stats(got.stats)
                        front.on_outputs(got.outputs, time.monotonic())
                        n_out = 0
                        for o in got.outputs:
                            q = streams[o[0]].queue
                            while not q.empty():
                                out = q.get_nowait()
                                n_out += 1
                                sse_chunk("text_completion", meta_sse, info.model_name, False,
                                          [{"index": 0, "text": out.text, "logprobs": None,
                                            "finish_reason": out.finish_reason if out.finished else None,
                                            "stop_reason": out.stop_reason}])
                                if out.finished:
                                    del streams[o[0]]
                        t3 = time.perf_counter()
                        st = served.last_step
                        if step_time is None or not st.batch.seqs:
                            continue
                        n_steps += 1
                        if n_steps <= warmup:
                            continue
                        n = len(st.batch.seqs)
                        tokens = sum(len(s.token_ids) for s in st.batch.seqs)
                        rows = sum(1 for s in st.batch.seqs if s.sample)
                        p = ex.last_parts
                        execute = st.step_time
                        samples["schedule"].append((n, tokens, st.schedule_s))
                        samples["prepare"].append((n, tokens, max(0.0, execute - p["forward"] - p["sample"])))
                        # the step's own sample time (argmax over the forward's fresh logits included) is
                        # kept for the record (meta: step_sample_with_vocab_pass)
                        samples["sample"].append((n, tokens, sample_host(rows) if rows else 0.0))
                        sample_step.append((n, tokens, p["sample"]))
                        core_step = st.scheduler_s + execute
                        samples["update"].append((n, tokens, (st.scheduler_s - st.schedule_s)
                                                  + max(0.0, (t1 - t0) - core_step) + (t2 - t1)))
                        samples["front"].append((len(got.outputs), n_out, t3 - t2))
                        forward.append((n, tokens, p["forward"]))
                    if log:
                        log(f"  B={B:<3} P={P:<5} steps so far {n_steps}")
    finally:
        loop.close()
    fits = {name: fit_part(_medians(samples[name]), per_token=name in CORE_PARTS) for name in samples}
    meta = {"machine": cpu_name(), "model": info.model_name,
            "num_threads": getattr(ex, "num_threads", None), "batch_sizes": list(batch_sizes),
            "prompt_lens": list(prompt_lens), "decode_steps": decode_steps, "repeats": repeats,
            "steps": n_steps - warmup, "vocab_size": vocab,
            "median_s": {name: statistics.median(t for *_, t in v) for name, v in samples.items()},
            "fit_error": {name: _fit_error(fits[name], samples[name]) for name in samples},
            "forward_median_s": statistics.median(t for *_, t in forward) if forward else None,
            "step_sample_with_vocab_pass": asdict(fit_part(_medians(sample_step)))}
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
