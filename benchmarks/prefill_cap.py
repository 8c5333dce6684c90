"""What `--max-prefill-tokens-with-decodes` (a token cap) and `--max-prefill-ms-with-decodes` (a time
budget the engine counts in tokens) cost and buy when nobody attacks: a real trace's shape and 64
streams, served, with the bound off and on, taking turns (A B A B).

    python benchmarks/prefill_cap.py                          # caps 16,32 against off, 2 rounds
    python benchmarks/prefill_cap.py --caps 32 --rounds 2 --docs   # also write the table into docs/SERVING.md
    python benchmarks/prefill_cap.py --caps "" --ms 30 --docs --mark prefill-ms   # the time budget

Each (setting, round) starts its own `shepherd serve` (the real model, the engine core in
its own process) and runs on it:
- trace: `shepherd bench` replaying the first --limit requests of the Azure LLM inference
  trace 2023 (conversation), shipped in shepherd/data/azure_llm_2023 (CC-BY-4.0; its
  SOURCE.md), at its own arrival times, lengths scaled by --length-scale to fit this CPU
  (~900-token prompts become ~90): time to first token, the gaps between a stream's tokens
  (ITL, every gap pooled), output tok/s;
- 64 streams: the official `openai` client, 64 streaming chat completions in flight out of
  3 x 64 (~40-token prompts, 64 tokens each, ignore_eos), so after the first wave every new
  prompt is admitted beside ~63 decodes: median time to first token and served tok/s.
Rounds alternate the order (off first, then the caps first), so a slow spell of a shared
machine falls on both. Ratios are on / off within the run.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
sys.path.insert(0, ROOT)

import _docs  # noqa: E402
from _openai_client import fixed_concurrency, questions  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

TRACE = os.path.join(ROOT, "shepherd", "data", "azure_llm_2023", "AzureLLMInferenceTrace_conv.csv")
SERVED = "smollm2-135m"
FLAG = "--max-prefill-tokens-with-decodes"
MS_FLAG = "--max-prefill-ms-with-decodes"
OFF = "off"


def settings(caps: str, ms: str) -> dict:
    """label -> the serve arguments of that setting; `off` first (neither bound). serve's default
    is the time budget (config.SERVE_PREFILL_MS), so off and the token-cap settings turn it off."""
    no_ms = [MS_FLAG, "0"]
    out = {OFF: no_ms}
    out.update({f"{FLAG} {c}": [FLAG, c, *no_ms] for c in caps.split(",") if c})
    out.update({f"{MS_FLAG} {m}": [MS_FLAG, m] for m in ms.split(",") if m})
    return out


def serve(label: str, extra: list, log: str) -> tuple[subprocess.Popen, str]:
    proc, url = start_server(["--served-model-name", SERVED, "--log-level", "warning", *extra], cwd=ROOT, log=log)
    wait_healthy(url, proc, what=f"shepherd serve ({label})")
    return proc, url


def trace_run(url: str, args) -> dict:
    with tempfile.TemporaryDirectory() as out:
        cmd = [sys.executable, "-m", "shepherd", "bench", "--url", url, "--model", SERVED, "--trace", args.trace,
               "--limit", str(args.limit), "--length-scale", str(args.length_scale), "--out", out,
               "--no-plots", "--no-progress", "--no-metrics"]
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        with open(os.path.join(out, "summary.json")) as f:
            s = json.load(f)
    if s["failed"]:
        raise RuntimeError(f"{s['failed']} trace requests failed")
    return {k: s[k] for k in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "output_tok_s")}


def streams_run(url: str, n: int) -> dict:
    res = asyncio.run(fixed_concurrency(url, SERVED, questions(3 * n), n, 3 * n, 64, {"ignore_eos": True}))
    if res["errors"]:
        raise RuntimeError(f"{res['errors']} stream requests failed: {res['first_error']}")
    return {"s_ttft_p50": res["ttft_p50"], "s_tok_s": res["tok_s"]}


def fmt(rows: dict, limit: int, scale: float, n: int) -> str:
    med = {c: {k: statistics.median(r[k] for r in rows[c]) for k in rows[c][0]} for c in rows}
    out = [f"| setting | trace TTFT p50 / p99 | trace ITL p50 / p99 | trace out tok/s | "
           f"{n} streams TTFT p50 | {n} streams tok/s | rounds |",
           "|---|---:|---:|---:|---:|---:|---:|"]
    for c in rows:
        m = med[c]
        out.append(f"| {'off' if c == OFF else '`' + c + '`'} | {m['ttft_p50'] * 1e3:.0f} / {m['ttft_p99'] * 1e3:.0f} ms | "
                   f"{m['itl_p50'] * 1e3:.1f} / {m['itl_p99'] * 1e3:.1f} ms | {m['output_tok_s']:.1f} | "
                   f"{m['s_ttft_p50'] * 1e3:.0f} ms | {m['s_tok_s']:.0f} | {len(rows[c])} |")
    for c in rows:
        if c == OFF:
            continue
        a, b = med[OFF], med[c]
        out.append(f"\nOn {c} / off (medians): trace TTFT p50 {b['ttft_p50'] / a['ttft_p50']:.2f}x, p99 "
                   f"{b['ttft_p99'] / a['ttft_p99']:.2f}x; ITL p99 {b['itl_p99'] / a['itl_p99']:.2f}x; "
                   f"{n} streams TTFT {b['s_ttft_p50'] / a['s_ttft_p50']:.2f}x, tok/s {b['s_tok_s'] / a['s_tok_s']:.3f}x.")
    out.append(f"\nEach round, each setting: the first {limit} requests of the shipped Azure conversation trace "
               f"at their arrival times, lengths x{scale}; then {3 * n} chat requests, {n} in flight. "
               "Every figure is the median over the rounds; every round's figures are printed above the table.")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--caps", default="16,32", help=f"{FLAG} values measured against off ('' for none)")
    ap.add_argument("--ms", default="", help=f"{MS_FLAG} values measured against off")
    ap.add_argument("--mark", default="prefill-cap", help="the docs/SERVING.md block --docs rewrites")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", default=TRACE)
    ap.add_argument("--limit", type=int, default=150, help="trace requests per run (the first N: ~45 s of it)")
    ap.add_argument("--length-scale", type=float, default=0.1)
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--logs", default=tempfile.gettempdir())
    ap.add_argument("--docs", action="store_true", help="write the table into docs/SERVING.md")
    args = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    sets = settings(args.caps, args.ms)
    labels = list(sets)
    rows: dict = {c: [] for c in labels}
    for r in range(args.rounds):
        order = labels if r % 2 == 0 else labels[1:] + labels[:1]
        for c in order:
            name = "_".join(str(x).strip("-") for x in sets[c]) or OFF
            proc, url = serve(c, sets[c], os.path.join(args.logs, f"prefill_cap_{name}_{r}.log"))
            try:
                fig = trace_run(url, args)
                fig.update(streams_run(url, args.streams))
            finally:
                stop_server(proc)
            rows[c].append(fig)
            print(f"round {r} {c}: " + ", ".join(f"{k} {v:.4g}" for k, v in fig.items()), flush=True)
    cmd = "python benchmarks/prefill_cap.py " + " ".join(sys.argv[1:])
    text = fmt(rows, args.limit, args.length_scale, args.streams) + "\n\n" + _docs.footer(cmd)
    _docs.publish(text, "SERVING.md", args.mark, args.docs)


if __name__ == "__main__":
    main()
