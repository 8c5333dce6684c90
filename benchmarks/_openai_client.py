"""The one client workload every served figure uses: the official `openai`
AsyncOpenAI client, streaming chat completions, a fixed number C of requests
in flight, each asking for exactly `max_tokens` output tokens (ignore_eos, or
the peer's equivalent through `extra_body`). Plus a sampler of the servers'
resident memory (RSS) while it runs.

    res = asyncio.run(fixed_concurrency(url, model, questions, concurrency=64, num_requests=64,
                                        max_tokens=128, extra_body={"ignore_eos": True}))
    res["tok_s"], res["ttft_p50"], res["tpot_p50"], res["tokens"], res["wall_s"]

    with RssSampler(server_pid) as rss:          # peak RSS of the process and of its descendants
        ...
    rss.peak_root_mb, rss.peak_children_mb
"""
from __future__ import annotations

import asyncio
import statistics
import threading
import time

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "honey bees", "the violin", "glaciers", "trains",
          "coffee", "owls", "deserts", "bridges", "tea", "comets", "forests"]
ASKS = ["Tell me a story about", "Write a poem about", "Explain the history of", "List facts about"]


def questions(n: int) -> list[str]:
    """n distinct short user questions (about 40 tokens once in SmolLM2's chat template)."""
    return [f"{ASKS[i % len(ASKS)]} {TOPICS[i % len(TOPICS)]} (variant {i})." for i in range(n)]


def _p50(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


async def fixed_concurrency(url: str, model: str, qs: list[str], concurrency: int, num_requests: int,
                            max_tokens: int, extra_body: dict | None = None, timeout: float = 600.0) -> dict:
    """Run num_requests requests, at most `concurrency` in flight, all queued at t=0."""
    import httpx
    import openai
    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key="none", max_retries=0, timeout=timeout,
                                http_client=httpx.AsyncClient(limits=httpx.Limits(max_connections=concurrency + 8),
                                                              timeout=timeout))
    sem = asyncio.Semaphore(concurrency)
    ttft: list[float] = []
    tpot: list[float] = []
    total = 0
    errors = 0
    opts = {"stream_options": {"include_usage": True}}   # dropped if the server refuses it

    async def request(i: int) -> None:
        nonlocal total
        t0 = time.perf_counter()
        first = last = usage = None
        chunks = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": qs[i % len(qs)]}], max_tokens=max_tokens,
            temperature=0.0, stream=True, extra_body=extra_body or {}, **opts)
        async for ch in stream:
            if ch.usage is not None:
                usage = ch.usage.completion_tokens
            if ch.choices and (ch.choices[0].delta.content or ""):
                last = time.perf_counter()
                first = last if first is None else first
                chunks += 1
        n = usage if usage is not None else chunks
        total += n
        if first is not None:
            ttft.append(first - t0)
            if n > 1:
                tpot.append((last - first) / (n - 1))

    async def one(i: int) -> None:
        nonlocal errors, opts
        async with sem:
            for attempt in (0, 1):
                try:
                    return await request(i)
                except openai.BadRequestError:
                    if attempt or not opts:
                        break
                    opts = {}    # e.g. a server without stream_options: count the chunks instead
                except Exception:  # noqa: BLE001 - counted; a benchmark run reports, it does not stop
                    break
            errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"tok_s": total / wall if wall > 0 else 0.0, "ttft_p50": _p50(ttft), "tpot_p50": _p50(tpot),
            "tokens": total, "wall_s": wall, "errors": errors, "requests": num_requests}


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/task/{p}/children") as f:
                kids = [int(k) for k in f.read().split()]
        except OSError:
            kids = []
        out += kids
        todo += kids
    return out


class RssSampler:
    """Peak RSS of a process (`root`) and of all its descendants together, sampled every `every` s."""

    def __init__(self, root: int, every: float = 0.25):
        self.root, self.every = root, every
        self.peak_root_mb = 0.0
        self.peak_children_mb = 0.0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def sample(self) -> None:
        self.peak_root_mb = max(self.peak_root_mb, rss_mb(self.root))
        self.peak_children_mb = max(self.peak_children_mb, sum(rss_mb(p) for p in descendants(self.root)
                                                                if _is_worker(p)))

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            self.sample()

    def __enter__(self) -> "RssSampler":
        self.sample()
        self._t.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._t.join()
        self.sample()


def _is_worker(pid: int) -> bool:
    """Descendants that do the work (multiprocessing's resource tracker is not one)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"resource_tracker" not in f.read()
    except OSError:
        return False
