"""Real replicas publishing KV events: two `shepherd serve` processes (simulated executor, real
tokenizer and HTTP) read by NVIDIA Dynamo's runtime-free indexer (optional: the ai-dynamo-runtime
wheel) and by shepherd's own gateway index."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shepherd.bench import loadgen
from shepherd.kv_events.hashing import chain_hashes
from shepherd.kv_events.index import KVBlockIndex
from shepherd.kv_events.subscriber import KVEventSubscriber, Source

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import SERVE_START_S, free_port  # noqa: E402

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wait_until(pred, timeout=30.0, what="condition"):
    end = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < end, f"timed out waiting for {what}"
        time.sleep(0.02)


class Replica:
    """`shepherd serve --executor sim` with KV events on loopback."""

    def __init__(self, capacity: int = 512):
        self.port, self.pub, self.replay = free_port(), free_port(), free_port()
        self.capacity = capacity
        self.proc = None

    @property
    def url(self):
        return f"http://127.0.0.1:{self.port}"

    @property
    def source(self):
        return Source(self.url, f"tcp://127.0.0.1:{self.pub}", f"tcp://127.0.0.1:{self.replay}")

    def start(self):
        cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.pub}",
               "replay_endpoint": f"tcp://*:{self.replay}"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "shepherd", "serve", "--executor", "sim", "--port", str(self.port),
             "--max-total-tokens", str(self.capacity), "--log-level", "warning", "--kv-events-config", json.dumps(cfg)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

        def up():
            assert self.proc.poll() is None, self.proc.stderr.read().decode()[-2000:]
            try:
                return httpx.get(self.url + "/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                return False
        wait_until(up, SERVE_START_S, "the replica to start")
        return self

    def stop(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)

    def serve(self, ids, max_tokens=4):
        r = httpx.post(self.url + "/v1/completions", json={"prompt": ids, "max_tokens": max_tokens,
                                                            "ignore_eos": True}, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()


@pytest.fixture
def two_replicas():
    reps = [Replica().start(), Replica().start()]
    yield reps
    for r in reps:
        r.stop()


@pytest.fixture
def indexed(two_replicas):
    """The two replicas, shepherd's own index of their blocks and the KVEventSubscriber (the
    gateway's) feeding it from both streams; closed before the replicas stop."""
    a, b = two_replicas
    index = KVBlockIndex()
    sub = KVEventSubscriber(index, [a.source, b.source], replay_timeout=5.0)
    sub.start()
    yield a, b, index, sub
    sub.close()


def test_replicas_publish_what_they_cache_and_what_they_evict(indexed):
    a, b, index, sub = indexed
    m = httpx.get(a.url + "/metrics").text
    assert 'vllm:cache_config_info{' in m and 'block_size="16"' in m and 'num_gpu_blocks="32"' in m
    p = list(range(1000, 1100))                 # 100 tokens: 6 full blocks
    a.serve(p)
    wait_until(lambda: index.match(chain_hashes(p), [a.url, b.url]) == {a.url: 6}, what="A's 6 blocks")
    # a second prompt shares p's first 50 tokens; then unrelated prompts fill A's 512-token cache:
    # the least recently used leaf goes first, p's own tail, a node that ends block 5 but starts
    # inside block 3 (a partial node): p keeps the 3 blocks of the shared 50 tokens
    a.serve(p[:50] + list(range(7000, 7100)))
    for k in range(2):
        a.serve(list(range(20000 + 1000 * k, 20000 + 1000 * k + 160)))
    wait_until(lambda: index.match(chain_hashes(p), [a.url]).get(a.url) == 3, what="the eviction")
    assert sub.status()[a.url]["state"] == "complete" and sub.status()[a.url]["drops"] == 0


def test_reset_prefix_cache_over_http_empties_the_cache_and_the_gateway_index(indexed):
    a, b, index, sub = indexed
    p = list(range(1000, 1100))                 # 100 tokens: 6 full blocks
    a.serve(p)
    b.serve(p)
    wait_until(lambda: index.match(chain_hashes(p), [a.url, b.url]) == {a.url: 6, b.url: 6}, what="6 blocks each")
    assert httpx.post(a.url + "/reset_prefix_cache", params={"reset_running_requests": True}).status_code == 400
    r = httpx.post(a.url + "/reset_prefix_cache", timeout=30)
    assert r.status_code == 200, r.text
    wait_until(lambda: index.blocks(a.url) == 0, what="A's blocks dropped")
    assert index.match(chain_hashes(p), [a.url, b.url]) == {b.url: 6}      # B untouched
    assert sub.status()[a.url]["state"] == "complete" and sub.status()[a.url]["drops"] == 0
    # the replica's own cache is empty too: the same prompt is computed again, then cached again
    assert a.serve(p)["usage"].get("prompt_tokens_details", {}).get("cached_tokens", 0) == 0
    assert b.serve(p)["usage"]["prompt_tokens_details"]["cached_tokens"] >= 96
    wait_until(lambda: index.match(chain_hashes(p), [a.url]) == {a.url: 6}, what="A's blocks again")


def _dynamo():
    try:
        from dynamo._core import SelectionService
    except ImportError:
        return None
    return SelectionService


def test_dynamo_indexer_reads_shepherd_replicas(indexed):
    """A third-party consumer: Dynamo's runtime-free SelectionService subscribed to both replicas
    (pip install ai-dynamo-runtime; `make test` installs it where its wheel installs), beside
    shepherd's own index (the gateway's) of the same streams."""
    SelectionService = _dynamo()
    if SelectionService is None:
        pytest.skip("ai-dynamo-runtime is not installed")
    a, b, index, _ = indexed

    async def go():
        svc = SelectionService(indexer_threads=1)
        try:
            def worker(wid, r):
                return {"worker_id": wid, "model_name": "m", "endpoint": r.url, "block_size": 16,
                        "kv_events_endpoint": r.source.endpoint, "replay_endpoint": r.source.replay}
            for wid, r in ((1, a), (2, b)):
                await svc.upsert_worker(worker(wid, r))

            async def scores(ids):
                """{worker id: blocks of ids it holds on the device}, as Dynamo's indexer sees them."""
                got = await svc.overlap_scores({"model_name": "m", "token_ids": ids})
                return {w["worker_id"]: w["device_blocks"] for w in got.get("workers") or ()}

            async def until(ids, want, what):
                end = time.monotonic() + 30
                while True:
                    s = await scores(ids)
                    if s.get(1, 0) == want.get(1, 0) and s.get(2, 0) == want.get(2, 0):
                        return s
                    assert time.monotonic() < end, f"{what}: Dynamo says {s}, expected {want}"
                    await asyncio.sleep(0.05)

            await decoded_blocks_are_announced(a, b.url, index, until)
            p = list(range(1000, 1100))
            await asyncio.to_thread(a.serve, p)
            await until(p, {1: 6, 2: 0}, "a 100-token prompt served by A")
            await asyncio.to_thread(a.serve, p[:50] + list(range(7000, 7100)))
            for k in range(2):
                await asyncio.to_thread(a.serve, list(range(20000 + 1000 * k, 20000 + 1000 * k + 160)))
            await until(p, {1: 3, 2: 0}, "after A evicted p's tail")
            await asyncio.to_thread(a.stop)
            await asyncio.to_thread(a.start)                 # same ports, a new process, an empty cache
            # Dynamo 1.6.1 reads a registered worker's sequence as one stream: a restarted publisher's
            # (from 0 again, as vLLM's) is ignored, so a restart is a new instance to its discovery,
            # which re-registers it. After that nothing of A's first life is left.
            await svc.delete_worker(1)
            await svc.upsert_worker(worker(1, a))
            await until(p, {1: 0, 2: 0}, "after A restarted")
            await asyncio.to_thread(a.serve, p)
            await until(p, {1: 6, 2: 0}, "A serves p again")
        finally:
            svc.shutdown()
    asyncio.run(go())


async def decoded_blocks_are_announced(a, b_url, index, until):
    """A chat's next turn: the previous prompt + its answer + the new message, as token ids. A
    replica caches (and announces) an answer's full 16-token blocks as they fill, as vLLM does, so
    Dynamo scores the next turn's prompt and answer blocks on A, and the blocks of the answer
    generated so far already while the answer is still being generated."""
    q = list(range(3000, 3024))          # 24 tokens: 1 full block, the 2nd ends in the answer
    answer: list[int] = []
    seen_running = False
    # 460 tokens (q + answer: 484 of A's 512, 30 full blocks): ~2.3 s paced at >= 5 ms a step
    req = {"prompt": q, "max_tokens": 460, "ignore_eos": True, "stream": True, "return_token_ids": True}
    async with httpx.AsyncClient(timeout=60) as http:
        async with http.stream("POST", a.url + "/v1/completions", json=req) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                c = json.loads(line[len("data: "):])["choices"][0]
                answer += c["token_ids"]
                if not seen_running and len(answer) >= 64:
                    # 64 answer tokens out: the KV of q + answer[:63] is computed, so its 5 full
                    # blocks (q's, then one shared, then 3 of the answer alone) are cached by now
                    ids = q + answer[:64]
                    await until(ids, {1: len(ids) // 16, 2: 0}, "the answer's blocks while it runs")
                    await asyncio.to_thread(wait_until, lambda: index.match(chain_hashes(ids), [a.url, b_url])
                                            == {a.url: len(ids) // 16}, 10, "shepherd's index to agree")
                    # ... and it had not ended when Dynamo saw them (nothing else runs on A)
                    m = loadgen.parse_prometheus((await http.get(a.url + "/metrics")).text)
                    assert m["vllm:num_requests_running"] == 1, "the answer ended before its blocks were seen"
                    seen_running = True
    assert seen_running and len(answer) == 460
    nxt = q + answer + list(range(5000, 5008))         # the next turn: 492 tokens
    full = len(q + answer) // 16                        # 30 blocks: 1 of q, 1 shared, 28 of the answer
    assert (len(q) + len(answer)) % 16 != 0             # so the last block's last token is computed too
    await until(nxt, {1: full, 2: 0}, "the next turn's prompt")
    await asyncio.to_thread(wait_until, lambda: index.match(chain_hashes(nxt), [a.url, b_url]) == {a.url: full},
                            10, "shepherd's index to agree")
    got = await asyncio.to_thread(a.serve, nxt, 1)
    # the replica's own cache agrees (it holds whole pages, more than whole blocks with small pages)
    assert got["usage"]["prompt_tokens_details"]["cached_tokens"] >= 16 * full
