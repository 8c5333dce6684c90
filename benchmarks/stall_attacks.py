"""Can a few hostile requests stall everyone else? Issue 31's table, measured.

    python benchmarks/stall_attacks.py                          # real model, 10 of each attack at once
    python benchmarks/stall_attacks.py --target gateway         # the same through a gateway over 2 replicas
    python benchmarks/stall_attacks.py --repeat 3 --attacks choice,enum --executor sim
    python benchmarks/stall_attacks.py --write docs/SERVING.md  # replace the table between its markers
    python benchmarks/stall_attacks.py --root /path/to/old/checkout --timeout 120   # a before
    python benchmarks/stall_attacks.py --target gateway --write docs/SERVING.md --section gateway
    python benchmarks/stall_attacks.py --target ray --write docs/SERVING.md --section ray   # Ray Serve
    python benchmarks/stall_attacks.py --target ray --stream-direct   # the stream straight to the replica
    python benchmarks/stall_attacks.py --attacks schema,fullbias --streams 32   # accepted bodies through the core pipe
    python benchmarks/stall_attacks.py --attacks prompt,chat --dump /tmp/w.json  # each window's raw chunk times
    python benchmarks/stall_attacks.py --attacks answer,tok --repeat 1   # large valid answers (server RSS too)
    python benchmarks/stall_attacks.py --attacks head,trailer   # heads and trailers that never end (raw sockets)

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
import gc
import json
import multiprocessing
import os
import re
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from shepherd.bench.loadgen import exit_on_sigterm, free_port, stop_server  # noqa: E402

MARK_BEGIN, MARK_END = "<!-- stall-attacks:begin -->", "<!-- stall-attacks:end -->"
INNOCENT_PROMPT = "Write a long story about a lighthouse keeper and the sea."


def _json(obj) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


PIPE_ATTACKS = ("schema", "fullbias")
VALID_ATTACKS = ("answer", "long")       # valid requests whose size is the load: not in the table
COUNT_ATTACKS = ("msgs", "parts", "mparts")        # bodies under the size cap whose item count is the load
RAW = ""            # an attack's path when its body is the raw start of a request that never ends
RAW_ATTACKS = ("head", "trailer")


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
        # accepted bodies whose request is larger than the core pipe's socket buffer (~210 KB): they reach
        # the engine core, and the server's end of the pipe must not wait for the core to read them
        "schema": ("`json_schema` of 120 KB that compiles (long description)", "/v1/chat/completions",
                   _json({"messages": [{"role": "user", "content": "Give a number."}], "max_tokens": 8,
                          "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
                              "type": "object", "required": ["n"], "description": "a number " * 13_000,
                              "properties": {"n": {"type": "integer"}}}}}})),
        "fullbias": ("`logit_bias` over all 49,152 tokens (the largest accepted)", "/v1/completions",
                     _json({"prompt": "hi", "max_tokens": 8, "logit_bias": {str(i): 0.5 for i in range(vocab)}})),
        # under the body cap (1.3 MB for SmolLM2): what grows is the number of objects to validate and render
        "msgs": ("chat of 43,000 empty messages (1.2 MB)", "/v1/chat/completions",
                 _json({"messages": [{"role": "user", "content": ""}] * 43_000, "max_tokens": 1})),
        "parts": ("chat message of 45,000 empty text parts (1.2 MB)", "/v1/chat/completions",
                  _json({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 45_000}],
                         "max_tokens": 1})),
        # the most objects a chat can still bring past the 2,048-message cap (protocol.MAX_CHAT_MESSAGES)
        "mparts": ("chat of 2,048 messages of 21 empty text parts (1.2 MB)", "/v1/chat/completions",
                   _json({"messages": [{"role": "user", "content": [{"type": "text", "text": ""}] * 21}] * 2048,
                          "max_tokens": 1})),
        "detok": ("`/detokenize` of 1M tokens", "/detokenize",
                  _json({"tokens": [i % vocab for i in range(1_000_000)]})),
        "tok": ("`/tokenize` of 1M characters", "/tokenize", _json({"prompt": "abc def " * 125_000})),
        # a valid request with a large answer: 8 x 2,905 prompt tokens x 21 entries, a 12 MB body the server
        # renders after the work is done (use --repeat 1: each copy prefills its prompt 8 times)
        "answer": ("non-streamed completion, echo + logprobs 20, n 8, a 2,905-token prompt", "/v1/completions",
                   _json({"prompt": " ".join(f"word{i % 97}" for i in range(1000)), "echo": True, "logprobs": 20,
                          "n": 8, "max_tokens": 1})),
        "long": ("completion of a fresh 2,905-token prompt", "/v1/completions",
                 _json({"prompt": " ".join(f"term{i % 89}" for i in range(1000)), "max_tokens": 1})),
        # raw: the request's start, then one header value of 64 MB (server/http_head.py)
        "head": ("a header that never ends (64 MB)", RAW, b"GET /health HTTP/1.1\r\nHost: x\r\nX-Pad: "),
        "trailer": ("a chunked body's trailer that never ends (64 MB)", RAW,
                    b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                    b"Transfer-Encoding: chunked\r\n\r\n1e\r\n" + _json({"prompt": "hi", "max_tokens": 2})
                    + b"\r\n0\r\nX-T: "),
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


async def rss_poller(pid: int, stop_evt: asyncio.Event, out: list) -> None:
    """(time, the process's RSS in MB) every 20 ms, whether or not the server answers meanwhile."""
    from _openai_client import rss_mb
    while not stop_evt.is_set():
        out.append((time.perf_counter(), rss_mb(pid)))
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


def attack_all(url: str, path: str, body: bytes, repeat: int, timeout: float) -> list[tuple[str, float]]:
    """All copies at once, each on its own connection. Runs in a process of its own: sending
    10 x 15 MB would otherwise delay the /health poller and the innocent stream in this one."""
    async def go():
        return await asyncio.gather(*(attacker(url, path, body, timeout) for _ in range(repeat)))
    return asyncio.run(go())


async def raw_attacker(url: str, start: bytes, timeout: float, size: int = 64 << 20) -> tuple[str, float]:
    """`start`, then `size` bytes of one header value as fast as the server reads them: (the
    answer's status, or "cut" when the server closed the connection first, seconds until then)."""
    t0 = time.perf_counter()
    host, port = url.split("//", 1)[1].rsplit(":", 1)
    reader, writer = await asyncio.open_connection(host, int(port))
    piece = b"a" * (64 << 10)
    try:
        writer.write(start)
        for _ in range(size // len(piece)):
            writer.write(piece)
            await writer.drain()
        writer.write(b"\r\n\r\n")
        line = await asyncio.wait_for(reader.readline(), timeout)
        status = line.split()[1].decode() if line.startswith(b"HTTP/1.1 ") else "cut"
    except (ConnectionError, asyncio.IncompleteReadError):
        status = "cut"
    except asyncio.TimeoutError:
        status = "timeout"
    finally:
        writer.close()
    return status, time.perf_counter() - t0


async def attacker(url: str, path: str, body: bytes, timeout: float) -> tuple[str, float]:
    """(the answer's status or the error's name, seconds until it came)."""
    import httpx
    if path == RAW:
        return await raw_attacker(url, body, timeout)
    t0 = time.perf_counter()
    try:
        async with httpx.AsyncClient(timeout=timeout) as c:
            r = await c.post(url + path, content=body, headers={"content-type": "application/json"})
            status = str(r.status_code)
    except httpx.TimeoutException:
        status = "timeout"
    except httpx.HTTPError as e:
        status = type(e).__name__
    return status, time.perf_counter() - t0


def longest_gap(chunks: list, t0: float, t1: float, close: float = 0.005) -> tuple[float, int]:
    """The longest gap between two chunks of one stream that ends inside [t0, t1] (or the first
    after t1), and how many chunks of that stream came right after it, each within `close` s of the
    one before. A burst there means the tokens were made while the gap lasted and held on their
    way (a relay's event loop, a proxy); none means they were made late (the engine's step)."""
    best, held = 0.0, 0
    for i, ((k0, a), (k1, b)) in enumerate(zip(chunks, chunks[1:])):
        if k0 == k1 and b >= t0 and a <= t1 and b - a > best:
            best, held, last = b - a, 0, b
            for k, t in chunks[i + 2:]:
                if k != k1:
                    continue
                if t - last > close:
                    break
                held, last = held + 1, t
    return best, held


def p99(xs: list) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(0.99 * (len(xs) - 1))))] if xs else float("nan")


async def window(url: str, model: str, attack, repeat: int, max_tokens: int, timeout: float, pool,
                 settle: float = 0.0, streams: int = 0, stream_url: str = "", rss_pid: int = 0) -> dict:
    # this process measures: a full collection of its own (openai, httpx and pydantic bring ~100k
    # objects) stalled its poller and its stream alike, 92 ms once, and read as the server's stall
    gc.collect()
    gc.freeze()
    stop_evt = asyncio.Event()
    health, chunks, rss = [], [], []
    hp = asyncio.create_task(health_poller(url, stop_evt, health))
    rp = asyncio.create_task(rss_poller(rss_pid, stop_evt, rss)) if rss_pid else None
    inn = asyncio.create_task(innocent(stream_url or url, model, max_tokens, stop_evt, chunks))
    # more streams beside the innocent one: the core's steps get longer (their chunks are not measured)
    load = [asyncio.create_task(innocent(url, model, max_tokens, stop_evt, [])) for _ in range(streams)]
    while len(chunks) < 8:                       # the stream is flowing
        await asyncio.sleep(0.01)
        if inn.done():
            inn.result()
    # the burst of starting this window's clients is over, and the engine's thread governor
    # (engine/threads.py) is back at its count for a quiet machine before the attack starts
    await asyncio.sleep(settle)
    t0, wall0 = time.perf_counter(), time.time()
    if attack is None:
        await asyncio.sleep(5.0)
        statuses, answers = [], []
    else:
        _, path, body = attack
        job = pool.apply_async(attack_all, (url, path, body, repeat, timeout))
        while not job.ready():
            await asyncio.sleep(0.01)
        answers = job.get()
        statuses = [s for s, _ in answers]
    t1 = time.perf_counter()
    n_before = len(chunks)
    while len(chunks) < n_before + 2 and not inn.done():     # the gap that spans the window's end
        await asyncio.sleep(0.01)
    t_end = time.perf_counter()
    stop_evt.set()
    await asyncio.gather(hp, inn, *load, *([rp] if rp else []), return_exceptions=True)
    lat = [d for t, d in health if t1 >= t >= t0 or (t < t0 <= t + d)]
    gaps = [b - a for (k0, a), (k1, b) in zip(chunks, chunks[1:]) if k0 == k1]
    gap_max, held = longest_gap(chunks, t0, t1)
    counts: dict = {}
    for s in statuses:
        counts[s] = counts.get(s, 0) + 1
    before = [m for t, m in rss if t <= t0]
    inside = [m for t, m in rss if t0 <= t <= t1]
    return {"rss_rise": max(inside) - before[-1] if before and inside else None,
            "statuses": counts, "window_s": t1 - t0, "health_p99": p99(lat), "health_max": max(lat, default=0.0),
            "gap_max": gap_max, "gap_median": statistics.median(gaps) if gaps else 0.0,
            "held_after_gap": held,
            "answer_s": [d for _, d in answers], "t0": t0, "wall0": wall0, "t1": t1, "t_end": t_end,
            "chunks": [(k, t) for k, t in chunks if t0 - 1.0 <= t <= t_end],
            "all_chunks": chunks}     # --dump: every chunk, so a chunk's place in its stream is known


def answer_times(r: dict) -> str:
    """The attackers' own side: for an accepted attack (the enum row) what a cap on the step's
    prompt tokens costs them (docs/SERVING.md, "The enum row")."""
    a = sorted(r["answer_s"])
    rss = "" if r.get("rss_rise") is None else f"; the server process's RSS rose {r['rss_rise']:.0f} MB at most"
    if not a:
        return "  attackers' answers: -" + rss
    return (f"  attackers' answers: first {a[0]:.2f} s, median {statistics.median(a):.2f} s, "
            f"last {a[-1]:.2f} s after the attack was sent{rss}")


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


ENGINE_PID = re.compile(r"engine core pid (\d+)")
THREAD_CHANGE = re.compile(r"^(\S+ \S+) INFO shepherd.engine: (engine threads \d+ -> \d+ .*)$", re.M)


def log_texts(logs: str) -> dict:
    """name -> text of the server logs this script wrote."""
    out = {}
    for name in ("serve", "replica0", "replica1", "ray-serve", "gateway"):
        try:
            out[name] = open(os.path.join(logs, f"{name}.log"), encoding="utf-8", errors="replace").read()
        except OSError:
            pass
    return out


def sampler_for(procs: list, target: str, pool, logs: str):
    """--profile: a ProcSampler over this process (bench: the innocent client and the /health
    poller), the attacker's process, and the servers with what they started (engine cores)."""
    from proc_sampler import ProcSampler
    names = {"serve": ["serve"], "ray": ["ray-serve"], "gateway": ["replica0", "replica1", "gateway"]}[target]
    engines = {int(p) for text in log_texts(logs).values() for p in ENGINE_PID.findall(text)}
    roots = {"bench": os.getpid(), "attacker": pool.apply(os.getpid)}
    roots.update({n: p.pid for n, p in zip(names, procs)})
    return ProcSampler(roots, label_of=lambda pid: "engine" if pid in engines else None,
                       flat=frozenset({"bench", "attacker"})).start()


def profile_report(samples: list, r: dict, logs: str, step: float = 0.1, timeline: bool = True) -> str:
    """Where the CPU went in one window (from /proc), then a timeline in `step` s bins: the stream's
    longest gap ending in the bin, each engine's busy threads and run-queue wait, each process's CPU."""
    from proc_sampler import between, engine_usage, usage
    t0, t_end = r["t0"], r["t_end"]
    a, b = between(samples, t0, t_end)
    ans = sorted(r["answer_s"])
    out = [f"  profile of {b.t - a.t:.2f} s" + (f"; attackers answered after {ans[0]:.2f}-{ans[-1]:.2f} s" if ans else "")]
    for label, (cpu, rd, wr) in sorted(usage(a, b).items()):
        out.append(f"    {label:<18} CPU {cpu:5.2f} s   read {rd:8.1f} MB   written {wr:8.1f} MB")
    for label, (run, wait, _) in sorted(engine_usage(a, b).items()):
        out.append(f"    {label} threads: ran {run:.2f} s, waited for a CPU {wait:.2f} s "
                   f"({100 * wait / max(run + wait, 1e-9):.0f} %)")
    for name, text in log_texts(logs).items():
        for stamp, msg in THREAD_CHANGE.findall(text):
            when = time.mktime(time.strptime(stamp.split(",")[0], "%Y-%m-%d %H:%M:%S")) + int(stamp.split(",")[1]) / 1e3
            if r["wall0"] - 1.0 <= when <= r["wall0"] + t_end - t0:
                out.append(f"    {name}: t{when - r['wall0']:+.2f} s {msg}")
    if not timeline:
        return "\n".join(out)
    chunks = r["chunks"]
    t = t0 - 2 * step
    while t < t_end:
        a, b = between(samples, t, t + step)
        gaps = [y - x for (k0, x), (k1, y) in zip(chunks, chunks[1:]) if k0 == k1 and t <= y < t + step]
        eng = " ".join(f"{label.split('/')[0]}: {busy} busy, wait {100 * w / max(rn + w, 1e-9):3.0f}%"
                       for label, (rn, w, busy) in sorted(engine_usage(a, b).items()))
        cpu = " ".join(f"{label}={c:.2f}" for label, (c, _, _) in sorted(usage(a, b).items()) if c >= 0.005)
        out.append(f"    t{t - t0:+.1f} gap {max(gaps, default=0.0):.3f} | {eng} | CPU s {cpu}")
        t += step
    return "\n".join(out)


def replica_url(url: str, wait: float = 60.0) -> str:
    """--stream-direct: the replica's own HTTP server (`ray-serve --replica-http`), from the ingress's
    /metrics (shepherd_ray_replica_info's url label, there once the replica's routing stats came)."""
    import httpx
    deadline = time.monotonic() + wait
    while time.monotonic() < deadline:
        found = re.findall(r'shepherd_ray_replica_info\{[^}]*url="(http[^"]+)"', httpx.get(url + "/metrics", timeout=30).text)
        if found:
            return found[0]
        time.sleep(0.5)
    raise SystemExit("--stream-direct: no replica URL in the ingress's /metrics (is --replica-http set?)")


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
        ray += ["--replica-http"] if args.stream_direct else []
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
    ap.add_argument("--attacks", default=",".join(a for a in attacks() if a not in PIPE_ATTACKS + VALID_ATTACKS
                                                  + COUNT_ATTACKS + RAW_ATTACKS),
                    help="comma list of: " + ",".join(attacks()) + " (default: the issue's table; "
                    + ",".join(PIPE_ATTACKS) + " are accepted bodies that reach the engine core's pipe; "
                    + ",".join(VALID_ATTACKS) + " are valid requests, a large answer and a long prompt, best "
                    "with --repeat 1; " + ",".join(COUNT_ATTACKS) + " are bodies under the size cap made of "
                    "many small objects; " + ",".join(RAW_ATTACKS) + " send a request's head or trailer "
                    "that never ends, on raw sockets)")
    ap.add_argument("--repeat", type=int, default=10, help="copies of each attack sent at once")
    ap.add_argument("--streams", type=int, default=0, help="more streams flowing beside the innocent one, "
                    "unmeasured (longer engine steps: what a send that waits for the core's next read costs)")
    ap.add_argument("--max-tokens", type=int, default=400, help="innocent stream length")
    ap.add_argument("--timeout", type=float, default=180.0, help="an attacker's own timeout, s")
    ap.add_argument("--port", type=int, default=0)
    ap.add_argument("--logs", default="/tmp")
    ap.add_argument("--stream-direct", action="store_true", help="--target ray: the innocent stream goes to "
                    "the replica's own HTTP port (ray-serve --replica-http), the attacks and /health through "
                    "Ray's proxy and the ingress: gaps that stay are the replica's, gaps that go were the hops'")
    ap.add_argument("--root", default=ROOT, help="the checkout whose shepherd serves (default: this one)")
    ap.add_argument("--write", default=None, help="a docs file to write the table into (between its markers)")
    ap.add_argument("--settle", type=float, default=2.0, help="seconds the innocent stream flows before the "
                    "attack (the thread governor needs two 0.5 s windows to return to all threads after "
                    "the burst of starting the clients)")
    ap.add_argument("--profile", action="store_true", help="also print where the CPU went in each window "
                    "(per process, from /proc; benchmarks/proc_sampler.py) and a 0.1 s timeline")
    ap.add_argument("--dump", default=None, help="a JSON file for each window's raw figures: the innocent "
                    "stream's chunk arrival times (time.perf_counter: CLOCK_MONOTONIC, the clock a probe in the "
                    "server and the core can stamp with), the window's bounds, the attackers' statuses")
    ap.add_argument("--attacker-nice", type=int, default=0,
                    help="the attacking client's niceness (a diagnostic: on a 2-core machine its own CPU, "
                         "which a remote attacker would not spend here, competes with the server)")
    ap.add_argument("--section", default="", help="with --write: the markers stall-attacks-SECTION (a second "
                    "table in the same file, e.g. gateway, before)")
    args = ap.parse_args()
    exit_on_sigterm()     # a cut-off run still stops the servers it started
    every = attacks()
    chosen = [a for a in args.attacks.split(",") if a]
    os.makedirs(args.logs, exist_ok=True)
    url, procs = launch(args)
    pool = multiprocessing.get_context("spawn").Pool(1, initializer=os.nice, initargs=(args.attacker_nice,))
    sampler = sampler_for(procs, args.target, pool, args.logs) if args.profile else None
    try:
        import httpx
        model = httpx.get(url + "/v1/models", timeout=30).json()["data"][0]["id"]
        stream_url = replica_url(url) if args.stream_direct else ""
        rows = [(None, asyncio.run(window(url, model, None, 0, args.max_tokens, args.timeout, pool, args.settle,
                                          args.streams, stream_url)))]
        print(table(rows, args.repeat, args.target), flush=True)
        if sampler is not None:
            print(profile_report(sampler.samples, rows[0][1], args.logs, timeline=False), flush=True)
        for name in chosen:
            r = asyncio.run(window(url, model, every[name], args.repeat, args.max_tokens, args.timeout, pool,
                                   args.settle, args.streams, stream_url,
                                   procs[0].pid if args.target == "serve" else 0))
            rows.append((every[name][0], r))
            print(table(rows[-1:], args.repeat, args.target).splitlines()[-1], flush=True)
            print(answer_times(r), flush=True)
            if sampler is not None:
                print(profile_report(sampler.samples, r, args.logs), flush=True)
    finally:
        if sampler is not None:
            sampler.stop()
        pool.terminate()
        for p in reversed(procs):
            stop_server(p)
    block = table(rows, args.repeat, args.target)
    print("\n" + block)
    # where each longest gap was spent: chunks that arrive together right after it were made on time
    print("\nafter each longest gap, chunks within 5 ms of each other (held on the way; 0: made late), "
          "and the stream's median gap:")
    for label, r in rows:
        print(f"  {'no attack' if label is None else label}: {r['held_after_gap']} after {r['gap_max']:.3f} s "
              f"(median {r['gap_median']:.3f} s)")
    if args.dump:
        with open(args.dump, "w", encoding="utf-8") as f:
            json.dump([{"attack": "none" if label is None else label, **r} for label, r in rows], f)
    if args.write:
        write_docs(args.write, block, args.section)


if __name__ == "__main__":
    main()
