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
import os
import statistics
import threading
import time

TOPICS = ["the moon", "bread", "rivers", "chess", "volcanoes", "honey bees", "the violin", "glaciers", "trains",
          "coffee", "owls", "deserts", "bridges", "tea", "comets", "forests"]
ASKS = ["Tell me a story about", "Write a poem about", "Explain the history of", "List facts about"]


def questions(n: int) -> list[str]:
    """n distinct short user questions (about 40 tokens once in SmolLM2's chat template)."""
    return [f"{ASKS[i % len(ASKS)]} {TOPICS[i % len(TOPICS)]} (variant {i})." for i in range(n)]


# Texts for the copy/edit and long-prompt workloads: plain prose written for these benchmarks.
PASSAGES = [
    "The old mill stood at the bend of the river for more than two hundred years. Farmers brought their grain "
    "in carts pulled by horses, and the miller weighed each sack on a great iron scale before he poured it "
    "into the hopper. The water turned the wheel, the wheel turned the stones, and the stones turned the "
    "grain into flour. In the spring, when the snow melted in the hills, the river rose so high that the "
    "miller had to close the sluice gate and wait. In the autumn, when the river ran low, he worked through "
    "the night to finish the harvest before the first frost.",
    "Every morning the baker opened her shop at six o'clock. She lit the oven, mixed the dough, and set the "
    "loaves to rise on long wooden boards near the window. By seven the street smelled of fresh bread, and "
    "a line of neighbours waited at the door. Some came for the dark rye, some for the sweet rolls with "
    "raisins, and the children always asked for the small round buns with sugar on top. When the shop closed "
    "in the afternoon, she gave the bread that was left to the shelter at the end of the street.",
    "The train left the city at noon and climbed slowly into the mountains. At first the track ran beside "
    "a wide grey river, past factories and warehouses, then through orchards where the apple trees were in "
    "flower. After an hour the valley grew narrow and the train passed through a long tunnel. When it came "
    "out into the light again, the passengers saw snow on the peaks and a small lake far below. The "
    "conductor walked through the carriages and called out the name of each village as they arrived.",
    "The library was quiet except for the sound of pages turning. Tall shelves of dark wood reached almost "
    "to the ceiling, and a ladder on brass wheels slid along each row. The librarian kept a card for every "
    "book in a long wooden cabinet with a hundred small drawers. Students came in the evening to read by "
    "the green lamps on the tables, and old men came in the morning to read the newspapers. Once a year the "
    "whole town helped to carry the books outside so that the floors could be cleaned and polished.",
    "The lighthouse keeper climbed the spiral stairs four times each night. He trimmed the wick, cleaned "
    "the great glass lens, and wound the clock that turned the light. From the gallery at the top he could "
    "see the lights of the fishing boats coming home and the dark line of the cliffs to the north. In bad "
    "weather the waves broke over the rocks below and the whole tower shook in the wind. He wrote the state "
    "of the sea and the sky in a thick log book, a line for every hour, as the keepers before him had done.",
    "The garden behind the school was planted by the students themselves. Each class had its own bed of "
    "earth, marked with a painted sign, and each spring they chose what to grow. The youngest children liked "
    "sunflowers and pumpkins because they grew so large, while the older ones planted beans, carrots and "
    "tomatoes to cook in the kitchen. A rain barrel stood by the gate, and a schedule on the wall said who "
    "would water the plants during the summer holidays, when the school was closed.",
    "The market in the main square opened on Saturday mornings. Farmers set up their stalls under striped "
    "awnings and laid out cheese, eggs, honey, vegetables and flowers. A man with a barrel organ played old "
    "songs near the fountain, and a woman sold hot chestnuts from a small iron stove. By ten o'clock the "
    "square was so crowded that it was hard to walk from one side to the other. At one o'clock the stalls "
    "were packed away, the square was swept, and the pigeons came back to look for crumbs.",
    "The bridge over the gorge was built of stone by workers who came from many different countries. They "
    "lived in wooden huts on the hillside and worked from dawn until dark for six years. The stones were cut "
    "in a quarry a mile away and carried to the site on a narrow railway. When the last stone of the great "
    "arch was set in place, the workers held a celebration with music and dancing that lasted all night. "
    "The bridge still carries the road today, and a plaque at one end lists the names of the builders.",
]
EDITS = [("river", "canal"), ("morning", "evening"), ("train", "bus"), ("books", "papers"), ("night", "day"),
         ("garden", "field"), ("square", "park"), ("bridge", "tower")]


def copy_edit(n: int) -> list[str]:
    """n copy/edit requests: a passage to repeat with one word replaced (prompt lookup's case:
    most of the answer is in the prompt)."""
    out = []
    for i in range(n):
        text = PASSAGES[i % len(PASSAGES)]
        old, new = EDITS[i % len(EDITS)]
        out.append(f"Copy the following text exactly, but write '{new}' instead of '{old}'. "
                   f"Do not add anything.\n\n{text}")
    return out


def long_prompts(n: int, words: int = 720) -> list[str]:
    """n distinct documents of ~1,000 tokens (the passages in a rotating order, numbered so that no
    two requests share a prefix past the chat template) with a question after them."""
    out = []
    for i in range(n):
        parts, k = [], i
        while sum(len(p.split()) for p in parts) < words:
            parts.append(PASSAGES[k % len(PASSAGES)])
            k += 3
        out.append(f"Report number {1000 + i}.\n\n" + "\n\n".join(parts) +
                   "\n\nSummarize the report above in a few sentences.")
    return out


# A schema for the constrained workload: free text inside a fixed structure, long enough to fill
# 128 tokens, so constrained and free requests produce the same number of tokens.
STORY_SCHEMA = {"type": "object", "properties": {
    "title": {"type": "string"}, "characters": {"type": "array", "items": {"type": "string"}},
    "story": {"type": "string"}}, "required": ["title", "characters", "story"]}


def json_schema_format(schema: dict = STORY_SCHEMA) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "story", "schema": schema}}


def _p50(xs):
    xs = [x for x in xs if x == x]
    return statistics.median(xs) if xs else float("nan")


async def fixed_concurrency(url: str, model: str, qs: list[str], concurrency: int, num_requests: int,
                            max_tokens: int, extra_body: dict | None = None, timeout: float = 600.0,
                            response_format: dict | None = None) -> dict:
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
    first_error: list[str] = []
    retries = 0
    opts = {"stream_options": {"include_usage": True}}   # dropped if the server refuses it
    fmt = {"response_format": response_format} if response_format else {}

    async def request(i: int) -> None:
        nonlocal total
        t0 = time.perf_counter()
        first = last = usage = None
        chunks = 0
        stream = await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": qs[i % len(qs)]}], max_tokens=max_tokens,
            temperature=0.0, stream=True, extra_body=extra_body or {}, **fmt, **opts)
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
        nonlocal errors, opts, retries
        async with sem:
            for attempt in (0, 1):
                try:
                    return await request(i)
                except openai.BadRequestError:
                    if attempt or not opts:
                        break
                    opts = {}    # e.g. a server without stream_options: count the chunks instead
                except openai.APIConnectionError as e:
                    # a kept-alive connection the server closed between two requests (llama-server does,
                    # one stream at a time): once more on a new one, as a client with retries would
                    if attempt:
                        first_error.append(f"{type(e).__name__}: {str(e)[:300]}")
                        break
                    retries += 1
                except Exception as e:  # noqa: BLE001 - counted; a benchmark run reports, it does not stop
                    first_error.append(f"{type(e).__name__}: {str(e)[:300]}")
                    break
            errors += 1

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(num_requests)))
    wall = time.perf_counter() - t0
    await client.close()
    return {"tok_s": total / wall if wall > 0 else 0.0, "ttft_p50": _p50(ttft), "tpot_p50": _p50(tpot),
            "tokens": total, "wall_s": wall, "errors": errors, "requests": num_requests,
            "first_error": first_error[0] if first_error else None, "retries": retries}


def rss_mb(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return 0.0


def task_files(pid: int, name: str) -> dict[int, str]:
    """tid -> the text of /proc/PID/task/TID/NAME for each thread of `pid` (threads that ended
    meanwhile, or a process that is gone, are left out)."""
    out = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/{name}") as f:
                out[int(tid)] = f.read()
        except OSError:
            continue
    return out


def children(pid: int) -> list[int]:
    """The processes `pid` started, from any of its threads (a server may spawn from a worker thread)."""
    return [int(k) for text in task_files(pid, "children").values() for k in text.split()]


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = children(todo.pop())
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
