"""`shepherd calibrate`: time the real torch executor on this machine over a
grid of batches and write a fitted cost model (JSON) that `shepherd simulate
--cost-model FILE` loads.

    shepherd calibrate [MODEL] --out cost.json [--batch-sizes 1,2,4,8,16,32]
        [--prompt-lens 32,128,512] [--decode-steps 12] [--max-num-tokens N]
        [--max-total-tokens N] [--dtype bfloat16] [--num-threads N] [--repeats 1]

How: for every (batch size B, prompt length P) of the grid it submits B
requests of P tokens (max_tokens = decode-steps) to a real Scheduler driving
the real TorchExecutor — the same pair `shepherd serve` runs — and times every
step (the executor's measured step_time): prefill steps of every chunk size
the scheduler forms and decode steps of B sequences at growing contexts. The
samples (BatchShape, seconds) are fitted by cost_model.fit_cost_model: a
piecewise-linear function of the tokens in the step plus linear terms in the
attended context, prefill attention pairs and sequence count. The first
steps of each grid point are warm-up and dropped. The scheduler's own work
around each forward (schedule() + on_step()) is timed too and fitted as the
model's per-step overhead: fixed + per request in the batch (`cpu_fixed`,
`cpu_per_req` in the JSON; `shepherd simulate --step-overhead/--seq-overhead`
override them).

With --served it then measures what the scheduler timing leaves out: it starts
`shepherd serve` with the same model, dtype and threads, streams a few
requests over HTTP at 1 and at each --served-concurrency requests in flight
(--served-rounds times, interleaved, the median of each), and takes TPOT p50
minus the fitted step time at the same batch and context as the per-step
overhead a user sees (fixed + per request, least squares over the points):
the engine loop, the pipe to the server, detokenising and SSE, and the
client, all on the same cores (`served_overhead` in the JSON's meta). The simulator then predicts served
latency, not the bare executor's.
"""
from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path
from typing import Callable, Optional

from shepherd.config import INF, check_ranges

# the served points' requests: the fit subtracts the step at their mean context (prompt plus
# half the output), and the frontend latency the prefill of one such prompt
SERVED_PROMPT, SERVED_OUTPUT = 128, 64


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("model", nargs="?", default=None, help="GGUF file or HF folder (default: the bundled SmolLM2)")
    p.add_argument("--out", required=True, help="where to write the fitted model (JSON)")
    p.add_argument("--batch-sizes", default="1,2,4,8,16,32")
    p.add_argument("--prompt-lens", default="32,128,512")
    p.add_argument("--decode-steps", type=int, default=12, help="output tokens per request at each grid point")
    p.add_argument("--max-num-tokens", type=int, default=None, help="prefill chunk budget (as in serve)")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV capacity of the executor")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None)
    p.add_argument("--num-threads", type=int, default=None)
    p.add_argument("--repeats", type=int, default=1, help="run the grid this many times")
    p.add_argument("--warmup", type=int, default=3, help="steps dropped at the start of the run")
    p.add_argument("--samples-out", default=None, help="raw samples (JSONL; default: OUT with .samples.jsonl)")
    p.add_argument("--from-samples", default=None, help="refit from a samples file instead of timing")
    p.add_argument("--served", action="store_true",
                   help="also measure the per-step overhead of the served path over HTTP (starts `shepherd serve`)")
    p.add_argument("--served-concurrency", default="2,4,8,16",
                   help="requests in flight of the served fit's points beside 1 (comma list)")
    p.add_argument("--served-rounds", type=int, default=3,
                   help="measure every served point this many times, interleaved; each point is the median")
    p.add_argument("--served-args", default="", help="extra `shepherd serve` flags for --served (one string)")
    p.add_argument("--host-path", action="store_true",
                   help="profile the engine's per-step CPU path part by part (schedule, prepare, sample, "
                        "update, front: sim/host_profile.py) and write it to OUT instead of a step-time model "
                        "(`shepherd simulate --host-path OUT`)")


def collect_samples(executor, sched_cfg, batch_sizes, prompt_lens, decode_steps: int,
                    warmup: int = 3, repeats: int = 1, vocab_size: int = 32000, log=None,
                    host: Optional[list] = None):
    """Run the grid through a fresh scheduler (sched_cfg) per point and the executor, stepped by
    the engine's EngineCore on a virtual clock; return [(BatchShape, seconds)]. `host`, when
    given, receives (requests in the batch, seconds of scheduler work: schedule() + on_step())
    per step: the engine's CPU overhead around the forward."""
    from shepherd.bench.traces import seeded_stream
    from shepherd.engine.build import assemble
    from shepherd.engine.core import VirtualClock
    from shepherd.request import Request, SamplingParams
    from shepherd.sim.cost_model import batch_shape
    samples = []
    n = 0
    n_steps = 0
    for rep in range(repeats):
        for P in prompt_lens:
            for B in batch_sizes:
                core = assemble(sched_cfg, executor, VirtualClock())
                for b in range(B):
                    n += 1
                    ids = seeded_stream(f"calib/{rep}/{P}/{B}/{b}", P, vocab_size)
                    core.scheduler.add(Request(req_id=f"c{n}", prompt_ids=ids,
                                               params=SamplingParams(max_tokens=decode_steps, temperature=0.0,
                                                                     ignore_eos=True)), 0.0)
                steps = 0
                clock = 0.0
                while core.scheduler.has_work:
                    step = core.step(clock)
                    if not step.ran:
                        break
                    clock = step.end
                    if n_steps >= warmup and step.batch.seqs:    # warm-up: the first steps of the whole run
                        samples.append((batch_shape(step.batch), step.end - step.start))
                        if host is not None:
                            host.append((len(step.batch.seqs), step.scheduler_s))
                    steps += 1
                    n_steps += 1
                if log:
                    log(f"  B={B:<3} P={P:<5} {steps} steps")
    return samples


def _grid(flag: str, text: str) -> list[int]:
    """'1,2,4' -> [1, 2, 4]; ValueError naming the flag ('abc' was int()'s traceback, 0 a failure mid-run)."""
    try:
        vals = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        vals = []
    if not vals or min(vals) < 1:
        raise ValueError(f"{flag} must be a comma-separated list of integers >= 1, got {text!r}")
    return vals


def main(args) -> int:
    from shepherd.config import EngineConfig, SchedulerConfig, whole_pages
    from shepherd.sim.cost_model import BatchShape
    from shepherd.sim.fitted_cost import fit_cost_model

    try:
        _grid("--batch-sizes", args.batch_sizes)
        _grid("--prompt-lens", args.prompt_lens)
        check_ranges(args, [("decode_steps", 1, INF, False), ("repeats", 1, INF, False), ("warmup", 0, INF, False)])
        if args.from_samples:
            return _refit(args)
    except ValueError as e:
        print(f"shepherd calibrate: {e}", file=sys.stderr)
        return 2
    if args.host_path:
        return _host_path(args)
    try:
        from shepherd.engine.torch_executor import TorchExecutor
    except ModuleNotFoundError as e:
        print(f"shepherd calibrate: needs {e.name} (not in this build)", file=sys.stderr)
        return 2
    bs = [int(x) for x in args.batch_sizes.split(",") if x]
    ps = [int(x) for x in args.prompt_lens.split(",") if x]
    need = max(bs) * (max(ps) + args.decode_steps + 8)
    ecfg = EngineConfig(model=args.model, executor="torch")
    ecfg.dtype = args.dtype or ecfg.dtype
    ecfg.num_threads = args.num_threads or ecfg.num_threads
    ecfg.max_total_tokens = args.max_total_tokens or need
    sc = SchedulerConfig(max_total_tokens=ecfg.max_total_tokens, max_batch_size=max(bs),
                         prefix_cache=False, admission="guaranteed")
    if args.max_num_tokens:
        sc.max_num_tokens = args.max_num_tokens
    ecfg.scheduler = sc
    print(f"calibrate: loading the model ({args.model or 'default SmolLM2'}) ...", file=sys.stderr)
    t0 = time.perf_counter()
    ex = TorchExecutor(ecfg)
    sc.max_total_tokens = whole_pages(int(ex.kv_capacity), sc.page_size)
    sc.validate()
    vocab = int(ex.model_config.vocab_size)
    print(f"calibrate: grid batch sizes {bs} x prompt lengths {ps}, {args.decode_steps} decode steps",
          file=sys.stderr)
    host: list = []
    samples = collect_samples(ex, sc, bs, ps, args.decode_steps, warmup=args.warmup, repeats=args.repeats,
                              vocab_size=vocab, log=lambda m: print(m, file=sys.stderr), host=host)
    kvb = 0
    try:
        from shepherd.sim.cost_model import get_model
        kvb = get_model("smollm2-135m").kv_bytes_per_token if args.model is None else 0
    except KeyError:
        pass
    if len(samples) < 12:
        print(f"calibrate: only {len(samples)} samples; widen the grid", file=sys.stderr)
        return 2
    model = fit_cost_model(samples, features=("ctx_tokens", "prefill_pairs", "num_seqs"),
                           kv_bytes_per_token=kvb, pcie_bw=20e9,
                           name=f"calibrated:{Path(args.model).name if args.model else 'SmolLM2-135M'}/cpu",
                           meta={"kv_capacity_tokens": sc.max_total_tokens,
                                 "machine": platform.processor() or platform.machine(),
                                 "dtype": ecfg.dtype, "num_threads": ecfg.num_threads,
                                 "batch_sizes": bs, "prompt_lens": ps, "decode_steps": args.decode_steps,
                                 "max_num_tokens": sc.max_num_tokens,
                                 "seconds": time.perf_counter() - t0})
    fixed, per_req = fit_overhead(host)
    model.set_overhead(fixed, per_req)
    model.meta["overhead_samples"] = len(host)
    if args.served:
        del ex   # the server loads its own copy; two would compete for memory bandwidth
        fixed, per_req = served_overhead(args, ecfg, model)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    model.save(args.out)
    _write_samples(args.samples_out or _samples_path(args.out), samples)
    m = model.meta
    print(f"calibrate: {len(samples)} samples, fit error mean {m['fit_mean_rel_err']:.1%}, "
          f"median {m['fit_median_rel_err']:.1%}, max {m['fit_max_rel_err']:.1%}; decode step B=1 at 128 ctx "
          f"{model.decode_itl(128) * 1e3:.1f} ms, B=32 {model.decode_itl(128, 32) * 1e3:.1f} ms; "
          f"prefill 512 {model.shape_time(BatchShape.prefill(512)) * 1e3:.0f} ms; per-step overhead "
          f"{fixed * 1e3:.3f} ms + {per_req * 1e6:.1f} us/request per step; frontend latency "
          f"{model.frontend * 1e3:.1f} ms; wrote {args.out}",
          file=sys.stderr)
    return 0


def served_overhead(args, ecfg, model) -> tuple[float, float]:
    """Measure the served path (measure_served), fit its overhead and set it on `model`; the
    served figure includes the scheduler's work, so it replaces the scheduler's fit but never
    goes below it. Returns the (fixed, per request) now set; the details go to model.meta.
    The frontend latency (model.frontend) is what one request's TTFT, alone on the server, has
    beyond the modelled step that prefills it: HTTP, tokenising, the pipes both ways."""
    from shepherd.sim.cost_model import BatchShape
    sched_fixed, sched_per = model.overhead
    points, ttft1 = measure_served(args, ecfg)
    model.set_overhead(0.0, 0.0)
    sfixed, sper = fit_served_overhead(points, model)
    fixed, per_req = max(sched_fixed, sfixed), max(sched_per, sper)
    model.set_overhead(fixed, per_req)
    if ttft1 is not None:
        model.frontend = max(0.0, ttft1 - model.shape_time(BatchShape.prefill(SERVED_PROMPT)))
    model.meta["served_overhead"] = {"points": [list(p) for p in points], "fixed": sfixed, "per_req": sper,
                                     "scheduler_fixed": sched_fixed, "scheduler_per_req": sched_per,
                                     "ttft_1": ttft1, "frontend": model.frontend}
    return fixed, per_req


def fit_served_overhead(points, model) -> tuple[float, float]:
    """Per-step overhead (fixed, per request) from served TPOT p50s: `points` are
    (requests in flight, context tokens, TPOT seconds); each TPOT minus the model's
    step time at that batch and context (the model without overhead) is the
    overhead at that batch; fixed + per request by least squares over all the
    points (fit_overhead: both clamped at 0). A line through two points alone
    turned a 0.5 ms wobble of the one-stream TPOT into a 1.5 ms fixed term."""
    over = [(b, t - model.decode_itl(int(c), int(b))) for b, c, t in points]
    if len(over) == 1:
        return max(over[0][1], 0.0), 0.0
    return fit_overhead(over)


def measure_served(args, ecfg) -> tuple[list[tuple[int, float, float]], Optional[float]]:
    """(requests in flight, mean context, TPOT p50) at 1 and each --served-concurrency
    of SERVED_PROMPT-token prompts and SERVED_OUTPUT output tokens, against a `shepherd serve` started
    here, and the TTFT p50 of the one-at-a-time requests. The concurrent requests
    start together, so their TPOT spans decode-only steps of that batch, which is
    what the fit subtracts. Each point is the median over --served-rounds rounds, and
    the rounds interleave the points: one point of a round is a few seconds, and a
    slow spell of this machine that long (one round's 16-in-flight TPOT once came out
    22 ms against 15-17 in the others) then moves one round of several points, not
    the median."""
    import subprocess

    from shepherd.bench import loadgen, prompts
    port = loadgen.free_port()
    cmd = [sys.executable, "-m", "shepherd", "serve", *([args.model] if args.model else []),
           "--port", str(port), "--dtype", ecfg.dtype]
    if ecfg.num_threads:
        cmd += ["--num-threads", str(ecfg.num_threads)]
    cmd += args.served_args.split()
    print(f"calibrate: served overhead: {' '.join(cmd[1:])}", file=sys.stderr)
    server = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        loadgen.wait_healthy(url, server, timeout=150, what="`shepherd serve`")
        tok = prompts.load_tokenizer(args.model)
        concs = [1] + [int(c) for c in str(args.served_concurrency).split(",") if c.strip()]
        _served_round(url, tok, 1, seed=7)      # warm-up
        return served_points(lambda conc, seed: _served_round(url, tok, conc, seed), concs, args.served_rounds)
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()


def served_points(measure: Callable, concs: list[int], rounds: int
                  ) -> tuple[list[tuple[int, float, float]], Optional[float]]:
    """Run measure(conc, seed) -> (TPOTs, TTFTs) for every point of `concs`, `rounds`
    times, round by round; each point's TPOT is the median of its rounds' medians, the
    TTFT the median of every one-at-a-time request's."""
    import statistics
    tpots: dict[int, list[float]] = {c: [] for c in concs}
    ttfts: list[float] = []
    for r in range(max(1, rounds)):
        for i, conc in enumerate(concs):
            tp, ft = measure(conc, 8 + r * len(concs) + i)
            if tp:
                tpots[conc].append(statistics.median(tp))
            if conc == 1:
                ttfts += ft
    points = [(c, SERVED_PROMPT + SERVED_OUTPUT // 2, statistics.median(v)) for c, v in tpots.items() if v]
    for c, _, t in points:
        print(f"calibrate: served, {c} in flight: TPOT p50 {t * 1e3:.2f} ms (rounds: "
              f"{', '.join(f'{x * 1e3:.2f}' for x in tpots[c])})", file=sys.stderr)
    return points, (statistics.median(ttfts) if ttfts else None)


def _served_round(url: str, tok, conc: int, seed: int) -> tuple[list[float], list[float]]:
    """One point: `conc` requests started together (six one at a time when conc is 1);
    their TPOTs and TTFTs."""
    import asyncio

    from shepherd.bench import loadgen, prompts
    from shepherd.bench.stream import tpot_of
    n = conc if conc > 1 else 6
    trace = loadgen.synthetic(n, input_len=str(SERVED_PROMPT), output_len=str(SERVED_OUTPUT), seed=seed)
    builder = prompts.PromptBuilder(tok, seed=seed)
    reqs = [loadgen.BenchRequest(req_id=f"cal-{seed}-{j}", trace=tr, prompt=builder.build(tr, j))
            for j, tr in enumerate(trace)]
    res = asyncio.run(loadgen.run_load(reqs, loadgen.LoadConfig(
        url=url, max_concurrency=conc, progress=False, poll_metrics=False)))
    ok = [r for r in res.records if r.ok]
    return [t for t in (tpot_of(r) for r in ok) if t], [r.ttft for r in ok if r.ttft is not None]


def fit_overhead(host: list) -> tuple[float, float]:
    """Least squares of seconds = fixed + per_request x requests over the host
    samples, both clamped at 0 (a negative slope is noise: then the mean)."""
    import numpy as np
    if len(host) < 2:
        return 0.0, 0.0
    n = np.array([h[0] for h in host], dtype=float)
    t = np.array([h[1] for h in host], dtype=float)
    if np.ptp(n) == 0:
        return float(max(t.mean(), 0.0)), 0.0
    b, a = np.polyfit(n, t, 1)
    if b < 0:
        return float(max(t.mean(), 0.0)), 0.0
    if a < 0:
        return 0.0, float(max((t / n).mean(), 0.0))
    return float(a), float(b)


def _host_path(args) -> int:
    """--host-path: the served engine (serve's build, one thread by default as the validation
    runs it) through sim/host_profile.py; writes the HostPath JSON."""
    from shepherd.config import EngineConfig
    from shepherd.engine.build import build_served_core
    from shepherd.sim.host_profile import profile_host_path
    bs = [int(x) for x in args.batch_sizes.split(",") if x]
    ps = [int(x) for x in args.prompt_lens.split(",") if x]
    ecfg = EngineConfig(model=args.model, executor="torch")
    ecfg.dtype = args.dtype or ecfg.dtype
    ecfg.num_threads = args.num_threads or 1
    ecfg.max_total_tokens = args.max_total_tokens or max(bs) * (max(ps) + args.decode_steps + 16)
    ecfg.scheduler.max_batch_size = max(bs)
    ecfg.scheduler.prefix_cache = False
    if args.max_num_tokens:
        ecfg.scheduler.max_num_tokens = args.max_num_tokens
    t0 = time.perf_counter()
    served = build_served_core(ecfg)
    print(f"calibrate: host path, grid batch sizes {bs} x prompt lengths {ps}, {args.decode_steps} decode steps, "
          f"{args.repeats} repeats", file=sys.stderr)
    host = profile_host_path(served, bs, ps, args.decode_steps, repeats=max(1, args.repeats),
                             warmup=args.warmup, log=lambda m: print(m, file=sys.stderr))
    host.meta.update({"dtype": ecfg.dtype, "num_threads": ecfg.num_threads, "seconds": time.perf_counter() - t0,
                      "command": "shepherd calibrate --host-path " + " ".join(
                          f"--{k.replace('_', '-')} {v}" for k, v in (("batch_sizes", args.batch_sizes),
                                                                       ("prompt_lens", args.prompt_lens),
                                                                       ("decode_steps", args.decode_steps),
                                                                       ("repeats", args.repeats)))})
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    host.save(args.out)
    for name, part in host.parts_time(1, 1).items():
        p = getattr(host, name)
        print(f"calibrate: {name:<8} {p.fixed * 1e6:8.1f} us + {p.per_req * 1e6:6.2f} us/request"
              f" + {p.per_token * 1e6:6.3f} us/token (median error {host.meta['fit_error'].get(name, 0):.1%})",
              file=sys.stderr)
    print(f"calibrate: wrote {args.out} ({host.meta['steps']} steps, {host.meta['seconds']:.0f} s)", file=sys.stderr)
    return 0


def _write_samples(path: str, samples) -> None:
    from dataclasses import asdict
    with open(path, "w") as f:
        for s, t in samples:
            f.write(json.dumps({"shape": asdict(s), "seconds": t}) + "\n")


def _samples_path(out: str) -> str:
    p = Path(out)
    return str(p.with_name(p.stem + ".samples.jsonl"))


def _refit(args) -> int:
    from shepherd.sim.cost_model import BatchShape, get_model
    from shepherd.sim.fitted_cost import fit_cost_model, load_cost_model
    samples = []
    try:
        with open(args.from_samples, encoding="utf-8") as f:
            for lineno, line in enumerate(f, 1):
                try:
                    d = json.loads(line)
                    samples.append((BatchShape(**d["shape"]), float(d["seconds"])))
                except (ValueError, KeyError, TypeError) as e:
                    raise ValueError(f"{args.from_samples}:{lineno}: not a sample line "
                                     f"({{'shape': {{...}}, 'seconds': S}}): {e}") from None
    except OSError as e:
        raise ValueError(f"--from-samples {args.from_samples}: cannot read ({e.strerror or e})") from None
    meta = {}
    try:
        meta = load_cost_model(args.out).meta
    except (OSError, ValueError, KeyError):
        pass
    model = fit_cost_model(samples, features=("ctx_tokens", "prefill_pairs", "num_seqs"),
                           kv_bytes_per_token=get_model("smollm2-135m").kv_bytes_per_token, pcie_bw=20e9,
                           name="calibrated:SmolLM2-135M/cpu", meta={**meta, "refit_from": args.from_samples})
    model.save(args.out)
    m = model.meta
    print(f"calibrate: refit {len(samples)} samples, mean error {m['fit_mean_rel_err']:.1%}, "
          f"median {m['fit_median_rel_err']:.1%}; wrote {args.out}", file=sys.stderr)
    return 0
