"""What the gateway costs per request: added latency and maximum proxied req/s.

    python benchmarks/gateway_overhead.py                  # defaults: 2 fake backends, 2000 sequential, 10 s load
    python benchmarks/gateway_overhead.py --requests 5000 --duration 20 --concurrency 64

Setup (all on this machine, every part its own process):
- backends: tests/gateway_fakes.FakeBackend served by uvicorn: an ASGI app
  that answers /v1/completions at once with a fixed ~300-byte JSON body (or
  a 5-event SSE stream): no model, so what is measured is HTTP + gateway.
- gateway: `python -m shepherd gateway --policy POLICY` over those backends
  (metrics scraping on, 250 ms).
- client: a minimal asyncio HTTP/1.1 keep-alive client (raw sockets, so
  that the load generator is not the bottleneck).

Latency: `--requests` sequential requests (concurrency 1), direct to one
backend and through the gateway; added = gateway - direct at p50 and p99
(non-streaming; and time to last byte for streaming). Throughput:
`--concurrency` connections for `--duration` seconds through the gateway
(and, for reference, direct to one backend), with the gateway process's CPU
time per request (from /proc): on a shared, loaded machine req/s says
more about the neighbours than about the gateway, CPU per request does
not. Writes OUT/gateway_overhead.json.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))

BODY = json.dumps({"model": "fake", "prompt": "Hello, how are you today? " * 4, "max_tokens": 5}).encode()
SBODY = json.dumps({"model": "fake", "prompt": "Hello, how are you today? " * 4, "max_tokens": 5,
                    "stream": True}).encode()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_fake(port: int) -> None:
    import uvicorn
    from gateway_fakes import FakeBackend
    uvicorn.run(FakeBackend(name="fake"), host="127.0.0.1", port=port, log_level="error", access_log=False)


class RawClient:
    """One keep-alive HTTP/1.1 connection; POST and read the whole answer."""

    def __init__(self, host: str, port: int) -> None:
        self.host, self.port = host, port
        self.r = self.w = None

    async def connect(self):
        self.r, self.w = await asyncio.open_connection(self.host, self.port)

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        self.w.write(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = await self.r.readuntil(b"\r\n\r\n")
        lines = head.split(b"\r\n")
        status = int(lines[0].split()[1])
        clen, chunked = None, False
        for ln in lines[1:]:
            k, _, v = ln.partition(b":")
            k = k.strip().lower()
            if k == b"content-length":
                clen = int(v)
            elif k == b"transfer-encoding" and b"chunked" in v.lower():
                chunked = True
        if clen is not None:
            return status, await self.r.readexactly(clen)
        if chunked:
            out = []
            while True:
                size = int((await self.r.readuntil(b"\r\n")).split(b";")[0], 16)
                if size == 0:
                    await self.r.readuntil(b"\r\n")
                    return status, b"".join(out)
                out.append(await self.r.readexactly(size))
                await self.r.readexactly(2)
        raise RuntimeError("no length")

    def close(self):
        if self.w:
            self.w.close()


async def sequential(port: int, n: int, body: bytes) -> list[float]:
    c = RawClient("127.0.0.1", port)
    await c.connect()
    for _ in range(50):                          # warm up
        await c.post("/v1/completions", body)
    lat = []
    for _ in range(n):
        t0 = time.perf_counter()
        st, data = await c.post("/v1/completions", body)
        lat.append(time.perf_counter() - t0)
        assert st == 200, (st, data[:200])
    c.close()
    return lat


async def load(port: int, conc: int, duration: float, body: bytes) -> dict:
    stop = time.perf_counter() + duration
    done, errors = [0], [0]

    async def worker():
        c = RawClient("127.0.0.1", port)
        await c.connect()
        while time.perf_counter() < stop:
            st, _ = await c.post("/v1/completions", body)
            if st == 200:
                done[0] += 1
            else:
                errors[0] += 1
        c.close()
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(conc)))
    el = time.perf_counter() - t0
    return {"requests": done[0], "errors": errors[0], "seconds": el, "req_s": done[0] / el}


def cpu_seconds(pid: int) -> float:
    """user + system CPU time of a process (Linux /proc)."""
    try:
        f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
        return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return float("nan")


def pct(xs, q):
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def wait_up(port, timeout=60):
    import httpx
    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"port {port} not up")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--serve-fake", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument("--backends", type=int, default=2)
    p.add_argument("--policy", default="least-request")
    p.add_argument("--requests", type=int, default=2000)
    p.add_argument("--duration", type=float, default=10.0)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--out", default=os.path.join(ROOT, "out", "gateway_overhead"))
    a = p.parse_args(argv)
    if a.serve_fake:
        serve_fake(a.serve_fake)
        return 0
    procs = []
    try:
        bports = [free_port() for _ in range(a.backends)]
        for bp in bports:
            procs.append(subprocess.Popen([sys.executable, __file__, "--serve-fake", str(bp)]))
        gport = free_port()
        cmd = [sys.executable, "-m", "shepherd", "gateway", "--port", str(gport), "--policy", a.policy]
        for bp in bports:
            cmd += ["--backend", f"http://127.0.0.1:{bp}"]
        procs.append(subprocess.Popen(cmd, cwd=ROOT))
        for bp in bports:
            wait_up(bp)
        wait_up(gport)
        res = {"backends": a.backends, "policy": a.policy, "cpus": os.cpu_count()}
        for label, body in (("json", BODY), ("sse", SBODY)):
            d = asyncio.run(sequential(bports[0], a.requests, body))
            g = asyncio.run(sequential(gport, a.requests, body))
            res[f"latency_{label}"] = {
                "direct_p50_ms": pct(d, 50) * 1e3, "direct_p99_ms": pct(d, 99) * 1e3,
                "gateway_p50_ms": pct(g, 50) * 1e3, "gateway_p99_ms": pct(g, 99) * 1e3,
                "added_p50_ms": (pct(g, 50) - pct(d, 50)) * 1e3, "added_p99_ms": (pct(g, 99) - pct(d, 99)) * 1e3,
                "added_mean_ms": (statistics.mean(g) - statistics.mean(d)) * 1e3}
            print(label, json.dumps(res[f"latency_{label}"], indent=None), flush=True)
        res["throughput_direct_one_backend"] = asyncio.run(load(bports[0], a.concurrency, a.duration, BODY))
        print("direct", res["throughput_direct_one_backend"], flush=True)
        gpid = procs[-1].pid
        c0 = cpu_seconds(gpid)
        tg = asyncio.run(load(gport, a.concurrency, a.duration, BODY))
        used = cpu_seconds(gpid) - c0
        tg["gateway_cpu_s"] = used
        tg["gateway_cpu_ms_per_request"] = used / max(1, tg["requests"]) * 1e3
        tg["capacity_req_s_per_core"] = tg["requests"] / used if used > 0 else None
        tg["gateway_cpu_share"] = used / tg["seconds"]
        res["throughput_gateway"] = tg
        print("gateway", res["throughput_gateway"], flush=True)
        try:
            res["load_average"] = os.getloadavg()
        except OSError:
            pass
        res["concurrency"] = a.concurrency
        os.makedirs(a.out, exist_ok=True)
        with open(os.path.join(a.out, "gateway_overhead.json"), "w") as f:
            json.dump(res, f, indent=1)
        print(json.dumps(res, indent=1))
    finally:
        for pr in procs:
            pr.send_signal(signal.SIGTERM)
        for pr in procs:
            try:
                pr.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pr.kill()
    return 0


if __name__ == "__main__":
    sys.exit(main())
