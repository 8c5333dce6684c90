#!/usr/bin/env python
"""Aggregate output throughput, TTFT and TPOT at 1/8/32/64 concurrent streams.

For each concurrency N, N distinct chat prompts are submitted at once, each
asking for exactly `--max-tokens` output tokens (ignore_eos). Reported:
aggregate output tok/s (all output tokens / wall time from submit to the last
token) and TTFT p50. Systems, in the same run, same model and dtype:

  * shepherd, batch-invariant mode on   (in-process Engine: scheduler + TorchExecutor)
  * shepherd served: a real `shepherd serve` (engine core in its own process) over HTTP, driven by the
    official `openai` AsyncOpenAI client, streaming chat completions, ignore_eos via extra_body; printed
    beside the in-process figures with served/in-process ratios, TTFT and TPOT p50 and the peak RSS of
    the server process and of the core process. `--served-variant NAME="ARGS"` (repeatable) adds
    `shepherd serve` configurations (threads, --cpu-bind ...) measured in the same run.
  * shepherd, batch-invariant mode off
  * HF transformers `generate` (batched, left-padded, greedy, min_new_tokens = max_new_tokens)

Prints a table and writes it into docs/BENCHMARKS.md between the markers
<!-- throughput:start --> and <!-- throughput:end --> (other content is kept).

    .venv/bin/python benchmarks/throughput.py            # full: 1, 8, 32, 64 streams, 128 tokens
    .venv/bin/python benchmarks/throughput.py --quick    # 1 and 8 streams, 32 tokens
    .venv/bin/python benchmarks/throughput.py --streams 1,64 --no-hf --no-invariant-off   # served vs in-process
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import os
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _openai_client import RssSampler, fixed_concurrency, questions  # noqa: E402
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

START, END = "<!-- throughput:start -->", "<!-- throughput:end -->"

def make_prompts(tok, n: int) -> list[list[int]]:
    """The served runs send the same questions as chat messages (the server applies the template)."""
    return [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True),
                       add_special_tokens=False) for q in questions(n)]


def p50(xs):
    return statistics.median(xs) if xs else float("nan")


# ----------------------------------------------------------------------------- shepherd
async def _shepherd_run(engine, prompts, max_tokens):
    from shepherd.request import SamplingParams
    t0 = time.perf_counter()
    ttft: list[float] = []
    tpot: list[float] = []
    ntok = 0

    async def one(p):
        nonlocal ntok
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
        stream = engine.submit(p, params)
        await stream
        first = last = None
        got = 0
        async for out in stream:
            if out.token_ids:
                last = time.perf_counter() - t0
                first = last if first is None else first
            got += len(out.token_ids)
            if out.finished:
                if out.error:
                    raise RuntimeError(out.error)
                break
        ttft.append(first if first is not None else float("nan"))
        if got > 1:
            tpot.append((last - first) / (got - 1))
        ntok += got

    await asyncio.gather(*(one(p) for p in prompts))
    wall = time.perf_counter() - t0
    return {"tok_s": ntok / wall, "ttft_p50": p50(ttft), "tpot_p50": p50(tpot), "wall_s": wall, "tokens": ntok}


def bench_shepherd(model, dtype, batch_invariant, streams, max_tokens, prompts_all, device="cpu",
                   quantization="none"):
    from shepherd.config import EngineConfig, SchedulerConfig
    from shepherd.engine.engine import Engine

    cfg = EngineConfig(model=model, dtype=dtype, batch_invariant=batch_invariant, device=device,
                       quantization=quantization,
                       max_total_tokens=max(streams) * (max(len(p) for p in prompts_all) + max_tokens + 16) + 4096,
                       scheduler=SchedulerConfig(max_batch_size=max(256, max(streams))))
    res = {}

    async def main():
        engine = Engine(cfg)
        await engine.start()
        try:
            await _shepherd_run(engine, prompts_all[:2], 8)         # warm-up
            for n in streams:
                res[n] = await _shepherd_run(engine, prompts_all[:n], max_tokens)
                print(f"  shepherd bi={'on' if batch_invariant else 'off'} N={n}: "
                      f"{res[n]['tok_s']:.0f} tok/s, TTFT p50 {res[n]['ttft_p50'] * 1000:.0f} ms", flush=True)
        finally:
            await engine.stop()
    asyncio.run(main())
    return res


# ----------------------------------------------------------------------------- shepherd served
def bench_served(model, dtype, streams, max_tokens, kv_tokens: int, extra_args: list[str], label: str) -> dict:
    """`shepherd serve` in a process of its own, the openai client in this one."""
    import httpx

    from shepherd.bench import loadgen
    port = loadgen.free_port()
    url = f"http://127.0.0.1:{port}"
    cmd = [sys.executable, "-m", "shepherd", "serve", model, "--port", str(port), "--dtype", dtype,
           "--max-total-tokens", str(kv_tokens), "--max-batch-size", str(max(256, max(streams))),
           "--log-level", "warning", *extra_args]
    log = open(ROOT / "out" / f"throughput-serve-{label}.log", "w") if (ROOT / "out").is_dir() else subprocess.DEVNULL
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    res = {}
    try:
        loadgen.wait_healthy(url, proc, timeout=600, what=f"shepherd serve ({' '.join(cmd)})")
        mid = httpx.get(url + "/v1/models").json()["data"][0]["id"]
        body = {"ignore_eos": True}
        asyncio.run(fixed_concurrency(url, mid, questions(2), 2, 2, 8, body))          # warm-up
        for n in streams:
            with RssSampler(proc.pid) as rss:
                r = asyncio.run(fixed_concurrency(url, mid, questions(n), n, n, max_tokens, body))
            r["rss_server_mb"], r["rss_core_mb"] = rss.peak_root_mb, rss.peak_children_mb
            res[n] = r
            print(f"  shepherd served [{label}] N={n}: {r['tok_s']:.0f} tok/s, TTFT p50 {r['ttft_p50'] * 1000:.0f} ms, "
                  f"TPOT p50 {r['tpot_p50'] * 1000:.1f} ms, RSS server {r['rss_server_mb']:.0f} MB, "
                  f"core {r['rss_core_mb']:.0f} MB{', ERRORS ' + str(r['errors']) if r['errors'] else ''}",
                  flush=True)
    finally:
        loadgen.stop_server(proc)
    return res


def served_table(inproc: dict, served: dict[str, dict], streams) -> str:
    rows = ["| streams | shepherd run | tok/s | served / in-process | TTFT p50 | TPOT p50 | RSS server | RSS core |",
            "|---|---|---|---|---|---|---|---|"]
    for n in streams:
        base = inproc.get(n)
        if base:
            rows.append(f"| {n} | in-process `Engine` (no HTTP) | {base['tok_s']:.0f} | 1.00 | "
                        f"{base['ttft_p50'] * 1000:.0f} ms | {base['tpot_p50'] * 1000:.1f} ms | — | — |")
        for label, res in served.items():
            r = res.get(n)
            if not r:
                continue
            ratio = f"{r['tok_s'] / base['tok_s']:.2f}" if base else "—"
            rows.append(f"| {n} | served: `shepherd serve {label}` | {r['tok_s']:.0f} | {ratio} | "
                        f"{r['ttft_p50'] * 1000:.0f} ms | {r['tpot_p50'] * 1000:.1f} ms | "
                        f"{r['rss_server_mb']:.0f} MB | {r['rss_core_mb']:.0f} MB |")
    return "\n".join(rows)


# ----------------------------------------------------------------------------- HF generate
def bench_hf(model_path, dtype, streams, max_tokens, prompts_all, pad_id, device="cpu"):
    import torch
    import transformers
    from transformers import LogitsProcessor, LogitsProcessorList

    tmp = None
    if model_path.endswith(".gguf"):
        # transformers 5 keeps GGUF weights quantized and computes in float32 when loading a
        # .gguf directly; write the dequantised weights as a plain HF folder instead, so HF
        # runs its ordinary bf16/fp32 model (the same weights shepherd runs).
        import tempfile
        from shepherd.model.loader import load_model, save_hf_folder
        tmp = tempfile.TemporaryDirectory(prefix="shepherd-hf-")
        save_hf_folder(load_model(model_path, dtype), tmp.name)
        model_path = tmp.name
    m = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype)).to(device)
    m.eval()

    class FirstToken(LogitsProcessor):
        def __init__(self):
            self.t = None

        def __call__(self, input_ids, scores):
            if self.t is None:
                self.t = time.perf_counter()
            return scores

    def run(prompts, n_new):
        L = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), L), pad_id, dtype=torch.long)
        att = torch.zeros((len(prompts), L), dtype=torch.long)
        for i, p in enumerate(prompts):
            ids[i, L - len(p):] = torch.tensor(p)
            att[i, L - len(p):] = 1
        ft = FirstToken()
        t0 = time.perf_counter()
        with torch.inference_mode():
            out = m.generate(input_ids=ids.to(device), attention_mask=att.to(device), max_new_tokens=n_new, min_new_tokens=n_new,
                             do_sample=False, pad_token_id=pad_id, logits_processor=LogitsProcessorList([ft]))
        wall = time.perf_counter() - t0
        ntok = (out.shape[1] - L) * len(prompts)
        return {"tok_s": ntok / wall, "ttft_p50": (ft.t - t0) if ft.t else float("nan"), "wall_s": wall,
                "tokens": ntok}

    run(prompts_all[:2], 4)   # warm-up
    res = {}
    for n in streams:
        res[n] = run(prompts_all[:n], max_tokens)
        print(f"  HF generate N={n}: {res[n]['tok_s']:.0f} tok/s, TTFT p50 {res[n]['ttft_p50'] * 1000:.0f} ms",
              flush=True)
    del m
    gc.collect()
    if tmp is not None:
        tmp.cleanup()
    return res


# ----------------------------------------------------------------------------- report
def table(results: dict, streams) -> str:
    head = "| system | " + " | ".join(f"{n} stream{'s' if n > 1 else ''}: tok/s (TTFT p50)" for n in streams) + " |"
    sep = "|---|" + "---|" * len(streams)
    rows = [head, sep]
    for name, res in results.items():
        cells = []
        for n in streams:
            r = res.get(n)
            cells.append("—" if r is None else f"{r['tok_s']:.0f} ({r['ttft_p50'] * 1000:.0f} ms)")
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def write_doc(section: str, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    block = f"{START}\n{section}\n{END}"
    if START in text and END in text:
        a = text.index(START)
        b = text.index(END) + len(END)
        text = text[:a] + block + text[b:]
    else:
        text = text.rstrip("\n") + "\n\n" + block + "\n"
    path.write_text(text)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF folder (default: SmolLM2-135M-Instruct)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--streams", default="1,8,32,64")
    ap.add_argument("--device", default="cpu", help="cpu | cuda | cuda:N (shepherd in-process and HF)")
    ap.add_argument("--quantization", default="none", choices=["auto", "none", "int8", "int4"])
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--quick", action="store_true", help="1 and 8 streams, 32 tokens")
    ap.add_argument("--no-hf", action="store_true", help="skip the HF transformers baseline")
    ap.add_argument("--no-invariant-off", action="store_true", help="skip shepherd with --no-batch-invariant")
    ap.add_argument("--no-served", action="store_true", help="skip the served (HTTP) runs")
    ap.add_argument("--served-variant", action="append", default=[], metavar='NAME="ARGS"',
                    help='a `shepherd serve` configuration to measure (repeat); default: one run with the '
                         'default flags. E.g. --served-variant "t1=--num-threads 1 --cpu-bind 1"')
    ap.add_argument("--out", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    ap.add_argument("--no-write", action="store_true")
    args = ap.parse_args(argv)
    from shepherd.bench.loadgen import exit_on_sigterm
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    if args.quick:
        args.streams, args.max_tokens = "1,8", 32
    streams = [int(x) for x in args.streams.split(",") if x]

    import torch
    from shepherd.model.loader import default_model_path, load_tokenizer

    model = args.model or default_model_path()
    tok = load_tokenizer(model)
    prompts = make_prompts(tok, max(streams))
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_ids[0]
    print(f"model {model} dtype {args.dtype}, streams {streams}, {args.max_tokens} output tokens, "
          f"prompt lengths {min(map(len, prompts))}-{max(map(len, prompts))}, torch threads {torch.get_num_threads()}",
          flush=True)

    results = {}
    sfx = "" if (args.device, args.quantization) == ("cpu", "none") else f", {args.device}, {args.quantization}"
    results[f"shepherd (batch-invariant on{sfx})"] = bench_shepherd(model, args.dtype, True, streams, args.max_tokens,
                                                                    prompts, args.device, args.quantization)
    served: dict[str, dict] = {}
    if not args.no_served:
        kv = max(streams) * (max(len(p) for p in prompts) + args.max_tokens + 16) + 4096
        for v in args.served_variant or ["(defaults)="]:
            label, _, extra = v.partition("=")
            served[(extra or label).strip() if label == "(defaults)" else label] = bench_served(
                model, args.dtype, streams, args.max_tokens, kv, shlex.split(extra), label)
        for label, res in served.items():
            results[f"shepherd served `{label}` (openai client, HTTP)"] = res
    if not args.no_invariant_off:
        results[f"shepherd (batch-invariant off{sfx})"] = bench_shepherd(model, args.dtype, False, streams,
                                                                         args.max_tokens, prompts, args.device,
                                                                         args.quantization)
    if not args.no_hf:
        results[f"HF transformers {__import__('transformers').__version__} generate (batched)"] = bench_hf(
            model, args.dtype, streams, args.max_tokens, prompts, pad_id, args.device)

    cmd = "python " + " ".join(shlex.quote(a) for a in ["benchmarks/throughput.py"] + (argv or sys.argv[1:]))
    ncpu = os.cpu_count()
    section = "\n".join([
        "## Throughput: aggregate output tok/s and TTFT p50 by concurrent streams",
        "",
        f"Command: `{cmd}`  ",
        f"Model: {os.path.basename(model)}, dtype {args.dtype}; {args.max_tokens} output tokens per request "
        f"(ignore_eos, greedy); prompts: distinct chat prompts of {min(map(len, prompts))}-"
        f"{max(map(len, prompts))} tokens.  ",
        f"Machine: {platform.processor() or platform.machine()}, {ncpu} CPUs, torch {torch.__version__} "
        f"({torch.get_num_threads()} threads); measured {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}.  ",
        "shepherd is driven in-process through `shepherd.engine.engine.Engine` (scheduler + TorchExecutor, "
        "no HTTP); all N requests are submitted at once. HF runs `generate` on one left-padded batch of N "
        "(its TTFT is the time to the first generated token of the batch); HF loads the GGUF's dequantised "
        "weights written as a plain Hugging Face folder (`save_hf_folder`), in the same dtype.",
        "",
        table(results, streams),
    ] + ([
        "",
        "### Served vs in-process (batch-invariant on)",
        "",
        "Served: `shepherd serve` (HTTP server process + engine-core process, docs/SERVING.md), driven by the "
        "official `openai` AsyncOpenAI client: streaming chat completions, ignore_eos via extra_body, all N "
        "requests in flight at once. TPOT p50: per request (last token - first token) / (tokens - 1). RSS: "
        "peak resident memory sampled every 0.25 s while the N streams run.",
        "",
        served_table(results[f"shepherd (batch-invariant on{sfx})"], served, streams),
    ] if served else []))
    print()
    print(table(results, streams))
    if served:
        print()
        print(served_table(results[f"shepherd (batch-invariant on{sfx})"], served, streams))
    if not args.no_write:
        write_doc(section, Path(args.out))
        print(f"\nwritten to {args.out}")


if __name__ == "__main__":
    main()
