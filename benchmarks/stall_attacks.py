"""Can a few hostile requests stall everyone else? Issue 31's table, measured.

    python benchmarks/stall_attacks.py                          # real model, 10 of each attack at once
    python benchmarks/stall_attacks.py --target gateway         # the same through a gateway over 2 replicas
    python benchmarks/stall_attacks.py --repeat 3 --attacks choice,enum --executor sim
    python benchmarks/stall_attacks.py --write docs/SERVING.md  # replace the table between its markers
    python benchmarks/stall_attacks.py --root /path/to/old/checkout --timeout 120   # a before
    python benchmarks/stall_attacks.py --target gateway --write docs/SERVING.md --section gateway
    python benchmarks/stall_attacks.py --target ray --write docs/SERVING.md --section ray   # Ray Serve

For each attack: an innocent client streams a completion (the official
`openai` client, greedy, ignore_eos) and a poller GETs /health every 20 ms;
once the stream has its first token, `--repeat` copies of the attack are sent
at once (raw httpx, each on its own connection). The window ends when every
attacker has its answer. Reported: the attackers' statuses, /health p99 and
max inside the window, and the innocent stream's longest gap between two
chunks inside the window, beside the same figures with no attack (measured
first, in the same run). The goal of issue 31: /health p99 < 0.5 s and the
longest gap < 2x its no-attack figure, and every attacker answered 400, 413
or 429.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing
import os
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.loadgen import free_port, stop_server  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- stall-attacks:begin -->", "<!-- stall-attacks:end -->"
INNOCENT_PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def attacks() -> dict:
    """name -> (label, path, body bytes)."""
    vocab = 49152
    return {
        "prompt": ("10 MB prompt (completions)", "/v1/completions",
                   _json({"prompt": "hello world " * 873_813, "max_tokens": 1})),
        "chat": ("15 MB chat message", "/v1/chat/completions",
                 _json({"messages": [{"role": "user", "content": "hi there " * 1_747_626}], "max_tokens": 1})),
        "bias": ("`logit_bias` with 10^6 entries", "/v1/completions",
                 _json({"prompt": "hi", "max_tokens": 1, "logit_bias": {str(i): 1.0 for i in range(1_000_000)}})),
        "choice": ("`guided_choice` with 10,000 choices", "/v1/completions",
                   _json({"prompt": "Pick one:", "max_tokens": 8,
                          "guided_choice": [f"choice number {i}" for i in range(10_000)]})),
        "enum": ("`json_schema` with an enum of 5,000 values", "/v1/chat/completions",
                 _json({"messages": [{"role": "user", "content": "Pick a value."}], "max_tokens": 32,
                        "response_format": {"type": "json_schema", "json_schema": {"name": "v", "schema": {
                            "type": "object", "required": ["v"], "additionalProperties": False,
                            "properties": {"v": {"enum": [f"value-{i}-of-the-list" for i in range(5000)]}}}}}})),
        "detok": ("`/detokenize` of 1M tokens", "/detokenize",
                  _json({"tokens": [i % vocab for i in range(1_000_000)]})),
        "tok": ("`/tokenize` of 1M characters", "/tokenize", _json({"prompt": "abc def " * 125_000})),
    }


def start(cmd: list[str], log_path: str, root: str = ROOT) -> subprocess.Popen:
    """`python -m shepherd ...` from `root`'s checkout (another checkout measures a before)."""
    log = open(log_path, "w")
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=root, start_new_session=True)


def wait_healthy(url: str, procs: list, timeout: float = 300.0) -> None:
    from shepherd.bench.loadgen import wait_healthy as wait_one
    wait_one(url, procs[-1], timeout=timeout, what=f"the server at {url}")


async def health_poller(url: str, stop_evt: asyncio.Event, out: list) -> None:
    import httpx
    async with httpx.AsyncClient(timeout=60) as c:
        while not stop_evt.is_set():
            t0 = time.perf_counter()
            try:
                await c.get(url + "/health")
            except httpx.HTTPError:
                pass
            out.append((t0, time.perf_counter() - t0))
            await asyncio.sleep(0.02)


async def innocent(url: str, model: str, max_tokens: int, stop_evt: asyncio.Event, chunks: list) -> None:
    """Stream completions back to back until stop_evt; chunks gets (stream no, arrival time)."""
    import httpx
    import openai
    client = openai.AsyncOpenAI(base_url=url + "/v1", api_key=os.environ.get("SHEPHERD_API_KEY", "none"),
                                max_retries=0, timeout=600, http_client=httpx.AsyncClient(timeout=600))
    k = 0
    while not stop_evt.is_set():
        stream = await client.completions.create(model=model, prompt=INNOCENT_PROMPT, max_tokens=max_tokens,
                                                 temperature=0.0, stream=True, extra_body={"ignore_eos": True})
        async for _ in stream:
            chunks.append((k, time.perf_counter()))
            if stop_evt.is_set():
                break
        k += 1
    await client.close()


def attack_all(url: str, path: str, body: bytes, repeat: int, timeout: float) -> list[str]:
    """All copies at once, each on its own connection. Runs in a process of its own: sending
    10 x 15 MB would otherwise delay the /health poller and the innocent stream in this one."""
    async def go():
        return await asyncio.gather(*(attacker(url, path, body, timeout) for _ in range(repeat)))
    return asyncio.run(go())


async def attacker(url: str, path: str, body: bytes, timeout: float) -> str:
    import httpx
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            r = await c.post(url + path, content=body, headers={"content-type": "application/json"})
            return str(r.status_code)
    except httpx.TimeoutException:
        return "timeout"
    except httpx.HTTPError as e:
        return type(e).__name__


def longest_gap(chunks: list, t0: float, t1: float) -> float:
    """Longest gap between two chunks of one stream that ends inside [t0, t1] (or the first after t1)."""
    best = 0.0
    for (k0, a), (k1, b) in zip(chunks, chunks[1:]):
        if k0 == k1 and b >= t0 and a <= t1:
            best = max(best, b - a)
    return best


def p99(xs: list) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


async def window(url: str, model: str, attack, repeat: int, max_tokens: int, timeout: float, pool) -> dict:
    stop_evt = asyncio.Event()
    health, chunks = [], []
    hp = asyncio.create_task(health_poller(url, stop_evt, health))
    inn = asyncio.create_task(innocent(url, model, max_tokens, stop_evt, chunks))
    while len(chunks) < 8:                       # the stream is flowing
        await asyncio.sleep(0.01)
        if inn.done():
            inn.result()
    t0 = time.perf_counter()
    if attack is None:
        await asyncio.sleep(5.0)
        statuses = []
    else:
        _, path, body = attack
        job = pool.apply_async(attack_all, (url, path, body, repeat, timeout))
        while not job.ready():
            await asyncio.sleep(0.01)
        statuses = job.get()
    t1 = time.perf_counter()
    n_before = len(chunks)
    while len(chunks) < n_before + 2 and not inn.done():     # the gap that spans the window's end
        await asyncio.sleep(0.01)
    stop_evt.set()
    await asyncio.gather(hp, inn, return_exceptions=True)
    lat = [d for t, d in health if t1 >= t >= t0 or (t < t0 <= t + d)]
    gaps = [b - a for (k0, a), (k1, b) in zip(chunks, chunks[1:]) if k0 == k1]
    counts: dict = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    return {"statuses": counts, "window_s": t1 - t0, "health_p99": p99(lat), "health_max": max(lat, default=0.0),
            "gap_max": longest_gap(chunks, t0, t1), "gap_median": statistics.median(gaps) if gaps else 0.0}


def fmt_statuses(c: dict) -> str:
    return ", ".join(f"{k} x{v}" for k, v in sorted(c.items())) or "-"


def table(rows: list, repeat: int, target: str) -> str:
    out = [f"| requests sent ({target}) | their answers | window | `/health` p99 | `/health` max | "
           "innocent stream's longest gap |",
           "|---|---|---:|---:|---:|---:|"]
    for label, r in rows:
        sent = "no attack" if label is None else f"{repeat} x {label}"
        out.append(f"| {sent} | {fmt_statuses(r['statuses'])} | {r['window_s']:.1f} s | {r['health_p99']:.3f} s | "
                   f"{r['health_max']:.3f} s | {r['gap_max']:.3f} s |")
    return "\n".join(out)


def write_docs(path: str, block: str, section: str = "") -> None:
    """Replace the text between the markers (`<!-- stall-attacks-SECTION:begin -->` with a section)."""
    begin, end = MARK_BEGIN, MARK_END
    if section:
        begin, end = (m.replace("stall-attacks:", f"stall-attacks-{section}:") for m in (MARK_BEGIN, MARK_END))
    text = open(path, encoding="utf-8").read()
    a, b = text.index(begin) + len(begin), text.index(end)
    open(path, "w", encoding="utf-8").write(text[:a] + "\n" + block + "\n" + text[b:])


def launch(args) -> tuple[str, list]:
    py = sys.executable
    serve = [py, "-m", "shepherd", "serve", "--executor", args.executor] + args.serve_arg
    if args.model:
        serve.insert(4, args.model)
    if args.target == "serve":
        port = args.port or free_port()
        procs = [start(serve + ["--port", str(port)], os.path.join(args.logs, "serve.log"), args.root)]
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs)
        return url, procs
    if args.target == "ray":
        # `shepherd ray-serve`: a local Ray, Serve's proxy, the ingress and one replica (the same serve
        # flags); SIGTERM (stop_server) makes it delete the app and shut Ray down
        port = args.port or free_port()
        ray = serve[:3] + ["ray-serve"] + serve[4:] + ["--address", "local", "--replicas", "1", "--port", str(port)]
        procs = [start(ray, os.path.join(args.logs, "ray-serve.log"), args.root)]
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, procs)
        return url, procs
    ports = [args.port + 1 if args.port else free_port(), args.port + 2 if args.port else free_port()]
    procs = [start(serve + ["--port", str(p)], os.path.join(args.logs, f"replica{i}.log"), args.root)
             for i, p in enumerate(ports)]
    for p in ports:
        wait_healthy(f"http://127.0.0.1:{p}", procs)
    gport = args.port or free_port()
    gw = [py, "-m", "shepherd", "gateway", "--port", str(gport)] + sum(
        (["--backend", f"http://127.0.0.1:{p}"] for p in ports), [])
    procs.append(start(gw, os.path.join(args.logs, "gateway.log"), args.root))
    url = f"http://127.0.0.1:{gport}"
    wait_healthy(url, procs)
    return url, procs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", choices=["serve", "gateway", "ray"], default="serve",
                    help="a replica; a gateway over two; the Ray Serve ingress over one replica")
    ap.add_argument("--model", default=None)
    ap.add_argument("--executor", default="torch", choices=["torch", "sim"])
    ap.add_argument("--serve-arg", action="append", default=[], help="extra `shepherd serve` argument (repeat)")
    ap.add_argument("--attacks", default=",".join(attacks()), help="comma list of: " + ",".join(attacks()))
    ap.add_argument("--repeat", type=int, default=10, help="copies of each attack sent at once")
    ap.add_argument("--max-tokens", type=int, default=400, help="innocent stream length")
    ap.add_argument("--timeout", type=float, default=180.0, help="an attacker's own timeout, s")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--root", default=ROOT, help="the checkout whose shepherd serves (default: this one)")
    ap.add_argument("--write", default=None, help="a docs file to write the table into (between its markers)")
    ap.add_argument("--section", default="", help="with --write: the markers stall-attacks-SECTION (a second "
                    "table in the same file, e.g. gateway, before)")
    args = ap.parse_args()
    every = attacks()
    chosen = [a for a in args.attacks.split(",") if a]
    url, procs = launch(args)
    pool = multiprocessing.get_context("spawn").Pool(1)
    try:
        import httpx
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        rows = [(None, asyncio.run(window(url, model, None, 0, args.max_tokens, args.timeout, pool)))]
        print(table(rows, args.repeat, args.target), flush=True)
        for name in chosen:
            r = asyncio.run(window(url, model, every[name], args.repeat, args.max_tokens, args.timeout, pool))
            rows.append((every[name][0], r))
            print(table(rows[-1:], args.repeat, args.target).splitlines()[-1], flush=True)
    finally:
        pool.terminate()
        for p in reversed(procs):
            stop_server(p)
    block = table(rows, args.repeat, args.target)
    print("\n" + block)
    if args.write:
        write_docs(args.write, block, args.section)


if __name__ == "__main__":
    main()
