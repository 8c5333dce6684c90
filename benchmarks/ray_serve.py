"""shepherd on Ray Serve: routing quality against Ray's routers, overhead over `shepherd serve`,
and requests in flight through a replica kill. One local Ray instance, every figure from the
official openai client over HTTP.

    python benchmarks/ray_serve.py --docs                 # all three parts, tables into docs/DEPLOY.md
    python benchmarks/ray_serve.py --parts routing --docs # or overhead, kill (comma-separated); the
                                                          # other parts' tables in the docs stay

1. Routing quality (prefix-heavy). 4 replicas of `shepherd serve --executor sim` (the simulated
   executor: the real scheduler, radix prefix cache and tokenizer; step times from its cost model,
   waited out on the wall clock), each with a KV pool of --kv-tokens (6,144): room for its share
   of the tenants' system prompts when a router keeps each tenant on one replica (16 / 4 = 4 of
   ~1,000 tokens each, plus the requests' own tokens), far too little for all 16. --groups
   tenants, each with its own ~1,000-token system prompt; --requests requests, each a random tenant's prompt plus its own question, streamed,
   --concurrency in flight. Five rows, each on freshly started replicas (cold caches):
     - shepherd's cache-aware policy as Ray Serve's request router (`shepherd ray-serve`);
     - shepherd's precise-prefix policy as Ray Serve's request router, fed by the replicas' KV
       events;
     - `shepherd gateway --policy cache-aware` on the same kind of replicas, deployed by Ray
       with --replica-http and reached directly over HTTP;
     - Ray's PrefixCacheAffinityRouter (Ray Serve LLM's prefix router), behind the same ingress;
     - Ray's default power-of-two router, behind the same ingress.
   Prefix hit rate = sum of usage.prompt_tokens_details.cached_tokens / sum of prompt tokens.
2. Overhead: TTFT p50 of one replica behind Ray Serve (proxy -> ingress -> replica) against
   the same flags served directly by `shepherd serve`, at 1 and at 32 streams
   (benchmarks/_openai_client.py's workload: streamed chat, ignore_eos), alternating
   direct/Ray for --rounds rounds; the median per side.
3. Failure: --inflight requests in flight (4 in 5 unstreamed, the rest streamed) on 2
   replicas; the replica holding the most is killed (ray.kill). Counted: unstreamed requests
   that did not complete (must be 0), streams that ended with an error event, retries,
   seconds until Ray's replacement served.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

SIM = ["--executor", "sim", "--num-threads", "1", "--log-level", "warning"]
WORDS = ("policy account shipment invoice refund carrier warehouse customer ledger contract tariff route "
         "schedule priority discount balance region audit supplier pallet manifest quota budget forecast").split()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 120.0) -> None:
    import httpx
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"{url} did not come up in {timeout:.0f}s")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


# ------------------------------------------------------------------ Ray helpers
def start_ray(num_cpus: int):
    import ray
    from ray import serve
    ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    return f"http://127.0.0.1:{port}"


def deploy(name: str, router: str, replicas: int, serve_args: list, replica_http: bool = False):
    from ray import serve

    from shepherd.deploy.ray_serve import RayServeOptions, build_app
    opts = RayServeOptions(replicas=replicas, router=router, num_cpus_per_replica=1, replica_http=replica_http,
                           routing_stats_period_s=0.5, replica_name=f"R{name}", ingress_name=f"I{name}")
    serve.run(build_app(opts, serve_args), name=name, route_prefix=f"/{name}")


def replica_urls(base: str, want: int) -> list:
    import httpx
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        text = httpx.get(base + "/metrics", timeout=5).text
        urls = sorted(set(re.findall(r'shepherd_ray_replica_info\{[^}]*url="(http[^"]+)"', text)))
        if len(urls) == want:
            return urls
        time.sleep(0.2)
    raise SystemExit("the replicas' own URLs did not show in the ingress's /metrics")


def counter(base: str, name: str) -> float:
    import httpx
    text = httpx.get(base + "/metrics", timeout=5).text
    return sum(float(v) for v in re.findall(rf"^{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M))


# ------------------------------------------------------------------ 1. routing quality
def workload(groups: int, n: int, seed: int) -> list:
    rng = random.Random(seed)
    prompts = []
    for g in range(groups):
        r = random.Random(1000 + g)
        prompts.append(f"Tenant {g} operating manual. " + " ".join(r.choice(WORDS) for _ in range(900)) + "\n")
    return [(g, prompts[g] + f"Question {i}: what is the status of order {rng.randrange(10**6)}?")
            for i, g in ((i, rng.randrange(groups)) for i in range(n))]


async def run_prefix(url: str, model: str, reqs: list, concurrency: int, header: str) -> dict:
    import httpx
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 4)))
    sem = asyncio.Semaphore(concurrency)
    rows = []

    async def one(prompt: str):
        async with sem:
            t0 = time.perf_counter()
            raw = await client.completions.with_raw_response.create(
                model=model, prompt=prompt, max_tokens=16, stream=True, stream_options={"include_usage": True},
                extra_body={"ignore_eos": True})
            first, usage = None, None
            async for ch in raw.parse():
                if first is None and ch.choices and ch.choices[0].text:
                    first = time.perf_counter() - t0
                usage = ch.usage or usage
            rows.append((first, usage.prompt_tokens, usage.prompt_tokens_details.cached_tokens,
                         raw.headers.get(header, "?")))
    t0 = time.perf_counter()
    await asyncio.gather(*(one(p) for _, p in reqs))
    wall = time.perf_counter() - t0
    await client.close()
    per = {}
    for r in rows:
        per[r[3]] = per.get(r[3], 0) + 1
    return {"hit": sum(r[2] for r in rows) / sum(r[1] for r in rows),
            "ttft_p50": pct([r[0] for r in rows], 0.5), "ttft_p99": pct([r[0] for r in rows], 0.99),
            "req_s": len(rows) / wall, "max_mean": max(per.values()) / (len(rows) / len(per)),
            "replicas": len(per)}


def part_routing(a, base: str) -> list:
    from ray import serve
    reqs = workload(a.groups, a.requests, a.seed)
    args = SIM + ["--max-total-tokens", str(a.kv_tokens)]
    rows = []
    # the gateway row's ingress only lists the replicas' own URLs (its /metrics): no traffic goes through it
    for label, router, via_gateway in (("shepherd cache-aware, Ray Serve router", "cache-aware", False),
                                       ("shepherd precise-prefix (KV events), Ray Serve router", "precise-prefix",
                                        False),
                                       ("shepherd gateway (cache-aware), same replicas", "least-request", True),
                                       ("Ray PrefixCacheAffinityRouter", "ray-prefix-cache", False),
                                       ("Ray power-of-two (default)", "ray-power-of-two", False)):
        name = f"r{len(rows)}"
        deploy(name, router, a.replicas, args, replica_http=via_gateway)
        url = f"{base}/{name}"
        wait_http(url + "/health")
        gw = None
        try:
            if via_gateway:
                port = free_port()
                backends = sum((["--backend", u] for u in replica_urls(url, a.replicas)), [])
                gw = subprocess.Popen([sys.executable, "-m", "shepherd", "gateway", *backends, "--policy",
                                       "cache-aware", "--port", str(port)], cwd=ROOT)
                url = f"http://127.0.0.1:{port}"
                wait_http(url + "/health")
            res = asyncio.run(run_prefix(url, "SmolLM2-135M-Instruct.Q4_1", reqs, a.concurrency,
                                         "x-shepherd-backend" if via_gateway else "x-shepherd-replica"))
        finally:
            if gw is not None:
                gw.terminate()
                gw.wait(10)
            serve.delete(name)
        rows.append((label, res))
        print(f"{label}: {res}", flush=True)
    return rows


# ------------------------------------------------------------------ 2. overhead
def part_overhead(a, base: str) -> dict:
    from ray import serve

    from _openai_client import fixed_concurrency, questions
    args = SIM + ["--max-total-tokens", "65536"]
    port = free_port()
    direct = subprocess.Popen([sys.executable, "-m", "shepherd", "serve", *args, "--port", str(port)], cwd=ROOT)
    try:
        durl = f"http://127.0.0.1:{port}"
        wait_http(durl + "/health")
        deploy("oh", "least-request", 1, args)
        rurl = f"{base}/oh"
        wait_http(rurl + "/health")
        out = {}
        for c, n in ((1, a.overhead_requests), (32, 32 * max(1, a.overhead_requests // 16))):
            got = {"direct": [], "ray": []}
            for _ in range(a.rounds):
                for side, url in (("direct", durl), ("ray", rurl)):
                    r = asyncio.run(fixed_concurrency(url, "SmolLM2-135M-Instruct.Q4_1", questions(64), c, n,
                                                      a.overhead_tokens, {"ignore_eos": True}))
                    if r["errors"]:
                        raise SystemExit(f"{side} at {c} streams: {r['errors']} errors")
                    got[side].append(r["ttft_p50"])
            out[c] = {k: statistics.median(v) for k, v in got.items()}
            print(f"{c} streams: {out[c]} (rounds {got})", flush=True)
        serve.delete("oh")
        return out
    finally:
        direct.terminate()
        direct.wait(15)


# ------------------------------------------------------------------ 3. failure
def part_kill(a, base: str) -> dict:
    import ray
    from ray import serve
    deploy("kill", "cache-aware", 2, SIM + ["--max-total-tokens", "65536"])
    url = f"{base}/kill"
    wait_http(url + "/health")
    res = asyncio.run(_kill_run(url, a.inflight))
    serve.delete("kill")
    return res


async def _kill_run(url: str, inflight: int) -> dict:
    import httpx
    import openai
    import ray
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=300,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=inflight + 8)))
    model = "SmolLM2-135M-Instruct.Q4_1"
    n_stream = inflight // 5
    retries0 = await asyncio.to_thread(counter, url, "shepherd_ray_retries_total")

    async def plain(i):
        raw = await client.completions.with_raw_response.create(model=model, prompt=f"plain {i} " * 6,
                                                                max_tokens=300, extra_body={"ignore_eos": True})
        return raw.parse().usage.completion_tokens

    started = asyncio.Event()
    first_tokens = []

    async def streamed(i):
        raw = await client.completions.with_raw_response.create(model=model, prompt=f"stream {i} " * 6,
                                                                max_tokens=300, stream=True,
                                                                stream_options={"include_usage": True},
                                                                extra_body={"ignore_eos": True})
        rid, got = raw.headers["x-shepherd-replica"], 0
        try:
            async for ch in raw.parse():
                if ch.choices and ch.choices[0].text and not got:
                    first_tokens.append(rid)
                    if len(first_tokens) == n_stream:
                        started.set()
                got += 1
            return (rid, "done")
        except openai.APIError:
            return (rid, "error" if got else "error-before-first")
    tasks = [asyncio.ensure_future(plain(i)) for i in range(inflight - n_stream)]
    tasks += [asyncio.ensure_future(streamed(i)) for i in range(n_stream)]
    await asyncio.wait_for(started.wait(), 120)
    text = await asyncio.to_thread(lambda: httpx.get(url + "/metrics", timeout=5).text)
    flight = {rep: float(v) for rep, v in re.findall(r'shepherd_ray_replica_in_flight\{replica="([^"]*)"\} (\S+)', text)}
    victim = max(flight, key=flight.get)
    t_kill = time.monotonic()
    ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
    results = await asyncio.gather(*tasks, return_exceptions=True)
    plain_res = results[:inflight - n_stream]
    stream_res = results[inflight - n_stream:]
    short = victim.rsplit("#", 1)[-1]
    lost = [r for r in plain_res if isinstance(r, BaseException) or r != 300]
    retries = await asyncio.to_thread(counter, url, "shepherd_ray_retries_total") - retries0
    # the replacement: a request answered by a replica that was not there before the kill
    before = set(flight)
    deadline = time.monotonic() + 120
    replaced_s = None
    while time.monotonic() < deadline and replaced_s is None:
        text = await asyncio.to_thread(lambda: httpx.get(url + "/metrics", timeout=5).text)
        now = set(re.findall(r'shepherd_ray_replica_info\{[^}]*replica="([^"]*)"', text))
        if len(now) == 2 and now - before:
            replaced_s = time.monotonic() - t_kill
        else:
            await asyncio.sleep(0.2)
    await client.close()
    return {"inflight": inflight, "victim_in_flight": int(flight[victim]), "plain": inflight - n_stream,
            "plain_lost": len(lost), "streams": n_stream,
            "streams_on_victim": sum(1 for r in stream_res if not isinstance(r, BaseException) and r[0] == short),
            "stream_errors": sum(1 for r in stream_res if not isinstance(r, BaseException) and r[1] == "error"),
            "stream_errors_elsewhere": sum(1 for r in stream_res if not isinstance(r, BaseException)
                                           and r[0] != short and r[1] != "done"),
            "retries": int(retries), "replaced_s": replaced_s}


# ------------------------------------------------------------------ report
def tables(a, routing, overhead, kill) -> dict:
    """{part: its markdown table}, for the parts that ran."""
    parts = {}
    if routing:
        out = []
        out.append(f"Routing quality: {a.replicas} replicas (`--executor sim`, {a.kv_tokens:,}-token KV pool each), "
                   f"{a.groups} tenants with ~1,000-token system prompts, {a.requests} streamed requests, "
                   f"{a.concurrency} in flight, 16 output tokens each; fresh replicas per row.\n")
        out.append("| router | prefix hit | vs shepherd gateway | TTFT p50 ms | TTFT p99 ms | req/s | "
                   "max/mean req per replica |\n|---|---:|---:|---:|---:|---:|---:|")
        gw = next(r for label, r in routing if "gateway" in label)["hit"]
        for label, r in routing:
            out.append(f"| {label} | {r['hit']:.1%} | {r['hit'] / gw:.2f} | {r['ttft_p50'] * 1e3:.0f} | "
                       f"{r['ttft_p99'] * 1e3:.0f} | {r['req_s']:.1f} | {r['max_mean']:.2f} |")
        parts["routing"] = out
    if overhead:
        out = []
        out.append("Overhead: one replica (`--executor sim`), streamed chat with the openai client, "
                   f"{a.overhead_tokens} output tokens, medians of {a.rounds} alternating rounds.\n")
        out.append("| streams | TTFT p50 direct `shepherd serve` ms | TTFT p50 through Ray Serve ms | added ms |\n"
                   "|---:|---:|---:|---:|")
        for c, v in overhead.items():
            out.append(f"| {c} | {v['direct'] * 1e3:.1f} | {v['ray'] * 1e3:.1f} | {(v['ray'] - v['direct']) * 1e3:+.1f} |")
        parts["overhead"] = out
    if kill:
        out = []
        k = kill
        out.append(f"Failure: {k['inflight']} requests in flight on 2 replicas ({k['plain']} unstreamed, "
                   f"{k['streams']} streamed, 300 output tokens each); the replica holding {k['victim_in_flight']} "
                   f"of them killed with `ray.kill`.\n")
        out.append("| unstreamed lost | streams on the killed replica | of those ended with an error event | "
                   "streams broken elsewhere | retries | replacement serving after |\n|---:|---:|---:|---:|---:|---:|")
        rep = f"{k['replaced_s']:.1f} s" if k["replaced_s"] is not None else "not within 120 s"
        out.append(f"| {k['plain_lost']} of {k['plain']} | {k['streams_on_victim']} | {k['stream_errors']} | "
                   f"{k['stream_errors_elsewhere']} | {k['retries']} | {rep} |")
        parts["kill"] = out
    return {k: "\n".join(v) + "\n" for k, v in parts.items()}


def write_docs(texts: dict) -> None:
    """Each part's table into its own block of docs/DEPLOY.md (<!-- ray-serve-PART -->); the
    parts that did not run keep what they had."""
    path = os.path.join(ROOT, "docs", "DEPLOY.md")
    doc = open(path).read()
    for part, text in texts.items():
        mark = f"ray-serve-{part}"
        pat = re.compile(rf"<!-- {mark} -->.*?<!-- /{mark} -->", re.S)
        if not pat.search(doc):
            raise SystemExit(f"docs/DEPLOY.md has no <!-- {mark} --> block")
        doc = pat.sub(lambda m: f"<!-- {mark} -->\n{text}<!-- /{mark} -->", doc)
    open(path, "w").write(doc)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--parts", default="routing,overhead,kill")
    p.add_argument("--replicas", type=int, default=4)
    p.add_argument("--kv-tokens", type=int, default=6144)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--requests", type=int, default=480)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--overhead-requests", type=int, default=64)
    p.add_argument("--overhead-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--inflight", type=int, default=100)
    p.add_argument("--num-cpus", type=int, default=8, help="logical CPUs of the local Ray instance")
    p.add_argument("--docs", action="store_true", help="write the table into docs/DEPLOY.md")
    p.add_argument("--out", default=os.path.join(ROOT, "out", "ray_serve_bench.json"))
    a = p.parse_args()
    parts = set(a.parts.split(","))
    import ray
    machine = subprocess.run("lscpu | head -20", shell=True, capture_output=True, text=True).stdout
    print(machine, flush=True)
    base = start_ray(a.num_cpus)
    t0 = time.monotonic()
    try:
        routing = part_routing(a, base) if "routing" in parts else None
        overhead = part_overhead(a, base) if "overhead" in parts else None
        kill = part_kill(a, base) if "kill" in parts else None
    finally:
        from ray import serve
        serve.shutdown()
        ray.shutdown()
    cmd = " ".join(["python benchmarks/ray_serve.py", *sys.argv[1:]])
    texts = {part: text + f"\n`{cmd}` (ray {ray.__version__}), {time.strftime('%Y-%m-%d %H:%M')}.\n"
             for part, text in tables(a, routing, overhead, kill).items()}
    print("\n".join(texts.values()), f"({time.monotonic() - t0:.0f} s)")
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out, "w") as f:
        json.dump({"routing": routing, "overhead": overhead, "kill": kill, "machine": machine}, f, indent=1)
    if a.docs:
        write_docs(texts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
