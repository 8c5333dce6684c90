"""`shepherd bench`: open-loop load against an OpenAI-compatible endpoint, then a report.

    shepherd bench --url http://127.0.0.1:8000 --out out/bench \\
        [--trace FILE [--format azure|mooncake|ragpulse|burstgpt|servegen|vidur|synthetic] [--limit N] [--time-scale X]]
        [--rate R] [--burstiness B] [--num-requests N] [--input-len DIST] [--output-len DIST]
        [--shared-prefix N] [--clients K] [--max-concurrency C] [--endpoint completions|chat]
        [--model NAME] [--tokenizer PATH|none] [--api-key KEY] [--seed S] [--timeout S]
        [--no-ignore-eos] [--extra-body JSON]

Writes DIR/summary.json (docs/DESIGN.md's keys plus `failures` by kind), the plots
beside it, records.jsonl (one RequestRecord per line), errors.jsonl and
timeseries.json; prints the table. Exit status 1 if any request failed.
"""
from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import math
import sys
import time
from collections import Counter
from pathlib import Path

from shepherd.bench.trace_formats import FORMATS
from shepherd.config import INF, check_ranges


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is fine)")
    p.add_argument("--out", required=True, help="output folder for summary.json, plots and records")
    w = p.add_argument_group("workload from a trace")
    w.add_argument("--trace", help="trace file (Azure CSV, Mooncake or RAGPulse JSONL, BurstGPT CSV, multi-tenant (servegen) CSV, vidur CSV, synthetic JSON spec)")
    w.add_argument("--format", choices=FORMATS,
                   help="trace format (default: from the file name and header)")
    w.add_argument("--limit", type=int, help="use only the first N requests")
    w.add_argument("--time-scale", type=float, default=1.0,
                   help="multiply every arrival time by X (0.1 replays ten times faster); default 1")
    w.add_argument("--length-scale", type=float, default=1.0,
                   help="multiply the trace's input and output lengths by F (to fit a small machine)")
    w.add_argument("--max-input-len", type=int, help="clip prompt lengths to N tokens")
    w.add_argument("--max-output-len", type=int, help="clip output lengths to N tokens")
    w.add_argument("--block-size", type=int, default=512, help="tokens per Mooncake hash id (default 512)")
    s = p.add_argument_group("synthetic workload (or, with --trace, new arrivals)")
    s.add_argument("--rate", type=float, default=math.inf,
                   help="requests per second, open loop (default inf: all at once). With --trace: redraw "
                        "the trace's arrivals at this rate, keeping its lengths and order")
    s.add_argument("--burstiness", type=float, default=1.0,
                   help="gamma shape of the inter-arrival gaps: 1 Poisson, <1 burstier, >1 smoother")
    s.add_argument("--num-requests", type=int, default=100)
    s.add_argument("--input-len", default="256",
                   help="prompt tokens after any shared prefix: N, uniform:LO:HI, normal:MEAN:STD, exp:MEAN, "
                        "lognormal:MEAN:SIGMA, zipf:A:MAX, trace:FILE (as shepherd simulate's; default 256)")
    s.add_argument("--output-len", default="128", help="output tokens (max_tokens), same forms (default 128)")
    s.add_argument("--shared-prefix", type=int, default=0,
                   help="N tokens of system prompt shared by every request (added to --input-len)")
    s.add_argument("--adapters", default=None, metavar="N|NAME,...",
                   help="each request names a LoRA adapter (its `model`), Zipf-popular: N = the first N adapters "
                        "GET /v1/models lists (those with a parent), or the names given")
    s.add_argument("--adapter-zipf", type=float, default=1.0, metavar="S",
                   help="adapter k (from 0) is asked with probability ~ 1/(k+1)^S (0: uniform)")
    s.add_argument("--clients", type=int, default=1, help="spread requests round-robin over K clients (OpenAI `user`)")
    r = p.add_argument_group("requests")
    r.add_argument("--max-concurrency", type=int, help="at most C requests in flight; later ones wait client-side")
    r.add_argument("--endpoint", choices=["completions", "chat"], default="completions")
    r.add_argument("--model", help="model name to send (default: the first of GET /v1/models)")
    r.add_argument("--tokenizer", help="tokenizer for prompt lengths: a GGUF, an HF folder, a tokenizer.json, "
                                       "or 'none' (default: the default model's)")
    r.add_argument("--api-key", help="sent as Authorization: Bearer KEY")
    r.add_argument("--seed", type=int, default=0, help="seed of prompts, lengths and arrivals (and sent as `seed`)")
    r.add_argument("--temperature", type=float, default=0.0)
    r.add_argument("--timeout", type=float, default=600.0, help="per-request limit in seconds, whole stream")
    r.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="do not send ignore_eos/min_tokens (for servers that reject unknown fields)")
    r.add_argument("--extra-body", help="JSON object merged into every request body")
    o = p.add_argument_group("output")
    o.add_argument("--no-progress", dest="progress", action="store_false")
    o.add_argument("--no-plots", dest="plots", action="store_false")
    o.add_argument("--no-metrics", dest="metrics", action="store_false",
                   help="do not poll the server's /metrics for running/waiting requests")
    o.add_argument("--slo-ttft", type=float, help="TTFT SLO (s) for goodput")
    o.add_argument("--slo-tpot", type=float, help="TPOT SLO (s) for goodput")
    o.add_argument("--label", default="", help="title for the plots")


# (flag, lowest, highest, strict), checked before anything is sent (config.check_ranges):
# --time-scale -1 reversed the arrivals, --timeout 0 failed every request, --limit -1 spoke of islice()
BENCH_RANGES = [("limit", 0, INF, False), ("time_scale", 0, INF, True), ("length_scale", 0, INF, True),
                ("max_input_len", 1, INF, False), ("max_output_len", 1, INF, False), ("block_size", 1, INF, False),
                ("burstiness", 0, INF, True), ("num_requests", 0, INF, False),
                ("shared_prefix", 0, 10_000_000, False), ("clients", 1, INF, False),
                ("max_concurrency", 1, INF, False), ("timeout", 0, INF, True),
                ("slo_ttft", 0, INF, True), ("slo_tpot", 0, INF, True)]


def adapter_names(spec: str, url: str, api_key=None) -> list[str]:
    """--adapters: a count (the first N adapters the server lists: /v1/models entries with a
    parent) or comma-separated names."""
    import httpx

    from shepherd.bench import loadgen
    if not spec.strip().isdigit():
        names = [n.strip() for n in spec.split(",") if n.strip()]
        if not names:
            raise ValueError(f"{spec!r}: no adapter names")
        return names
    n = int(spec)
    r = httpx.get(loadgen.base_url(url) + "/v1/models", headers=loadgen.headers(api_key), timeout=30)
    r.raise_for_status()
    names = [m["id"] for m in r.json().get("data") or [] if m.get("parent")]
    if n < 1 or len(names) < n:
        raise ValueError(f"asked for {n} adapters; {url} serves {len(names)} ({', '.join(names) or 'none'})")
    return names[:n]


def build_workload(args):
    from shepherd.bench import loadgen

    if args.trace:
        from shepherd.bench import traces

        reqs = traces.load_trace(args.trace, args.format, limit=args.limit, seed=args.seed)
        reqs = loadgen.reshape(reqs, rate=None if math.isinf(args.rate) else args.rate,
                               burstiness=args.burstiness, length_scale=args.length_scale,
                               max_input=args.max_input_len, max_output=args.max_output_len, seed=args.seed)
    else:
        n = args.num_requests if args.limit is None else min(args.num_requests, args.limit)
        reqs = loadgen.synthetic(n, rate=args.rate, burstiness=args.burstiness, input_len=args.input_len,
                                 output_len=args.output_len, shared_prefix=args.shared_prefix,
                                 clients=max(1, args.clients), seed=args.seed)
        if args.max_input_len or args.max_output_len:
            reqs = loadgen.reshape(reqs, max_input=args.max_input_len, max_output=args.max_output_len)
    if args.time_scale != 1.0:
        for tr in reqs:
            tr.arrival *= args.time_scale
    return reqs


def write_outputs(out: Path, summary: dict, res, args) -> None:
    """summary.json and plots, records.jsonl, errors.jsonl, timeseries.json."""
    from shepherd.bench import report
    out.mkdir(parents=True, exist_ok=True)
    st = res.server_timeseries
    ts = st if len(st.get("t", ())) > 1 and "kv_used" in st else None  # the KV plot needs KV tokens
    title = args.label or f"bench {args.url} ({res.model})"
    report.write_report(out, summary, res.records, timeseries=ts, plots=args.plots, title=title)
    with open(out / "records.jsonl", "w") as f:
        for r in res.records:
            f.write(json.dumps(dataclasses.asdict(r)) + "\n")
    with open(out / "errors.jsonl", "w") as f:
        for e in res.errors:
            f.write(json.dumps(e) + "\n")
    (out / "timeseries.json").write_text(json.dumps({"client": res.timeseries, "server": res.server_timeseries}))


def main(args) -> int:
    from shepherd.bench import loadgen, prompts
    from shepherd.bench import report

    if args.extra_body:
        try:
            extra = json.loads(args.extra_body)
            assert isinstance(extra, dict)
        except Exception:
            print("shepherd bench: --extra-body must be a JSON object", file=sys.stderr)
            return 2
    else:
        extra = {}
    try:
        check_ranges(args, BENCH_RANGES)
        out = report.out_folder(args.out)      # before any request: a bad --out failed after all had run
        trace = build_workload(args)
    except (ValueError, OSError) as e:
        print(f"shepherd bench: {e}", file=sys.stderr)
        return 2
    if not trace:
        print("shepherd bench: the workload is empty", file=sys.stderr)
        return 2
    if args.adapters:
        import httpx

        from shepherd.bench import synthetic
        try:
            names = adapter_names(args.adapters, args.url, args.api_key)
            trace = list(synthetic.with_adapters(iter(trace), names, args.adapter_zipf, args.seed))
        except (ValueError, OSError, httpx.HTTPError) as e:
            print(f"shepherd bench: --adapters: {e}", file=sys.stderr)
            return 2

    t_build = time.perf_counter()
    try:
        tok = prompts.load_tokenizer(args.tokenizer)
    except (ValueError, OSError) as e:      # ModelNotFoundError is both; it was a traceback
        print(f"shepherd bench: --tokenizer {args.tokenizer}: {e}", file=sys.stderr)
        return 2
    builder = prompts.PromptBuilder(tok, seed=args.seed, block_size=args.block_size,
                                    shared_prefix=args.shared_prefix)
    reqs = []
    for i, tr in enumerate(trace):
        bp = builder.build(tr, i)
        reqs.append(loadgen.BenchRequest(req_id=f"bench-{i}", trace=tr, prompt=bp))
    if args.progress:
        print(f"shepherd bench: {len(reqs)} requests, prompts built in {time.perf_counter() - t_build:.1f}s; "
              f"{args.url} ({args.endpoint})", file=sys.stderr)

    cfg = loadgen.LoadConfig(url=args.url, model=args.model, endpoint=args.endpoint, api_key=args.api_key,
                             max_concurrency=args.max_concurrency, timeout=args.timeout,
                             ignore_eos=args.ignore_eos, temperature=args.temperature, seed=args.seed,
                             progress=args.progress, extra_body=extra, poll_metrics=args.metrics)
    try:
        res = asyncio.run(loadgen.run_load(reqs, cfg))
    except KeyboardInterrupt:
        print("shepherd bench: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # the model listing failed: nothing was sent
        print(f"shepherd bench: cannot reach {args.url}: {type(e).__name__}: {e}", file=sys.stderr)
        return 2

    recs = res.records
    m = res.server_metrics
    summary = report.summarize(
        recs, wall_s=res.wall_s, slo_ttft=args.slo_ttft, slo_tpot=args.slo_tpot,
        kv_capacity_tokens=m.get("kv_capacity_tokens"), kv_peak_used_tokens=m.get("kv_peak_used_tokens"),
        prefix_hit_rate=m.get("prefix_hit_rate"),
        extra={"url": args.url, "model": res.model, "endpoint": args.endpoint,
               "max_concurrency": args.max_concurrency,
               "workload": {"trace": args.trace, "format": args.format, "rate": args.rate,
                            "burstiness": args.burstiness, "input_len": args.input_len,
                            "output_len": args.output_len, "shared_prefix": args.shared_prefix,
                            "clients": args.clients, "time_scale": args.time_scale,
                            "length_scale": args.length_scale, "seed": args.seed},
               "client_tokens_requested": sum(r.trace.output_tokens for r in reqs)})
    if m.get("preemptions") is not None:
        summary["preemptions"] = m["preemptions"]
    write_outputs(out, summary, res, args)
    print(report.format_table(summary))
    failed = [r for r in recs if not r.ok]
    if failed:
        kinds = Counter(r.error_kind or "error" for r in failed)
        print(f"shepherd bench: {len(failed)} of {len(recs)} requests failed ("
              + ", ".join(f"{k}: {v}" for k, v in sorted(kinds.items())) + f"); details in {out / 'errors.jsonl'}",
              file=sys.stderr)
        for e in res.errors[:3]:
            print(f"  {e['req_id']} {e['kind']}: {e['message'][:200]}", file=sys.stderr)
        return 1
    return 0
