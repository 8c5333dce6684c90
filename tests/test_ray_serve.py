"""shepherd on a three-node Ray cluster on this machine (ray.cluster_utils.Cluster), served
through Ray Serve and used with the official openai client: precise-prefix routing from the
replicas' KV events, a replica killed mid-load, a node removed, scaling up under load with 429s
past Ray's queue. The replicas run the simulated
executor (a real engine, scheduler, prefix cache, tokenizer and HTTP app; no weights) on one
thread each. The tests share one cluster and one application and run in file order.

Every wait is on a condition with a deadline (`wait_until`); every request has a timeout.
"""
from __future__ import annotations

import asyncio
import contextlib
import os
import re
import sys
import time
from typing import Optional

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import free_port  # noqa: E402

ray = pytest.importorskip("ray")
openai = pytest.importorskip("openai")

pytestmark = [pytest.mark.e2e, pytest.mark.ray_cluster, pytest.mark.timeout(300)]

APP = "shepherd-test"
REPLICAS = "ShepherdReplica"
SERVE_ARGS = ["--executor", "sim", "--num-threads", "1", "--max-total-tokens", "16384", "--log-level", "warning"]
LONG = {"ignore_eos": True}           # the simulated model would stop at once otherwise
# the ingress next to Serve's proxy on the head node: the node test removes a worker node, and an
# ingress there would die with it (Ray restarts it, but a request already in it is lost)
INGRESS_ON_HEAD = {"shepherd_ingress": 0.1}


def wait_until(pred, timeout: float, what: str, every: float = 0.1):
    """`pred()`'s first truthy value, asked every `every` s until `timeout`. An HTTP error from the
    predicate (most ask the ingress's /metrics or /health) counts as "not yet": on two loaded cores
    Serve's proxy once took over 10 s to answer the first /health after a deploy, and that ReadTimeout
    failed the setup of test_ray_stall.py while the deadline still had time left. A condition that is
    never met still fails at the deadline, naming the last error."""
    deadline = time.monotonic() + timeout
    last = None
    while True:
        try:
            got = pred()
        except httpx.HTTPError as e:
            got, last = None, e
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}"
                                 + (f" (last error: {last!r})" if last is not None else ""))
        time.sleep(every)


class Env:
    def __init__(self, cluster, workers, base):
        self.cluster, self.workers, self.base = cluster, workers, base
        self.app = APP

    @property
    def url(self) -> str:
        return f"{self.base}/{self.app}"

    def client(self, timeout: float = 60.0):
        return openai.AsyncOpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0, timeout=timeout)

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def samples(self, name: str) -> list[tuple[dict, float]]:
        out = []
        for m in re.finditer(rf"^{name}(?:\{{([^}}]*)\}})? (\S+)$", self.metrics(), re.M):
            out.append((dict(re.findall(r'(\w+)="([^"]*)"', m.group(1) or "")), float(m.group(2))))
        return out

    def replicas(self) -> dict:
        """replica full id -> (node id, in flight), from the ingress's /metrics."""
        flight = {lab["replica"]: v for lab, v in self.samples("shepherd_ray_replica_in_flight")}
        return {lab["replica"]: (lab["node"], flight.get(lab["replica"], 0.0))
                for lab, _ in self.samples("shepherd_ray_replica_info")}

    def running(self) -> int:
        from ray import serve
        app = serve.status().applications.get(self.app)
        if app is None or REPLICAS not in app.deployments:
            return 0
        return app.deployments[REPLICAS].replica_states.get("RUNNING", 0)

    def counter(self, name: str) -> float:
        return sum(v for _, v in self.samples(name))


@contextlib.contextmanager
def serve_cluster(workers: int = 0, head: Optional[dict] = None, worker: Optional[dict] = None, **serve_start):
    """A local Ray cluster (a head node of 2 CPUs and `workers` nodes of 2) on ports picked here,
    never Ray's defaults (other jobs on this machine may use them), with Serve's HTTP proxy on a
    free port: yields an Env. Serve, Ray and the cluster are shut down after, in that order, each
    even when what came before it failed."""
    from ray import serve
    from ray.cluster_utils import Cluster

    with contextlib.ExitStack() as down:        # callbacks run last-in first-out, all of them
        cluster = Cluster(initialize_head=True, head_node_args=dict(
            num_cpus=2, gcs_server_port=free_port(), include_dashboard=False, dashboard_port=free_port(),
            ray_client_server_port=free_port(), object_store_memory=80 << 20, **(head or {})))
        down.callback(cluster.shutdown)
        nodes = [cluster.add_node(num_cpus=2, object_store_memory=80 << 20, **(worker or {})) for _ in range(workers)]
        ray.init(address=cluster.address, log_to_driver=False)
        down.callback(ray.shutdown)
        port = free_port()
        down.callback(serve.shutdown)
        serve.start(http_options={"host": "127.0.0.1", "port": port}, **serve_start)
        yield Env(cluster, nodes, f"http://127.0.0.1:{port}")


@pytest.fixture(scope="module")
def env():
    from shepherd.deploy.ray_ingress import IngressConfig
    from shepherd.deploy.ray_serve import RayServeOptions

    with serve_cluster(workers=2, head=dict(resources={"shepherd_ingress": 1}, _system_config={
                           "health_check_period_ms": 500, "health_check_failure_threshold": 3,
                           "health_check_initial_delay_ms": 0}),
                       worker=dict(resources={"shepherd_replica": 2}), proxy_location="HeadOnly") as e:
        deploy(e, APP, RayServeOptions(
            replicas=2, num_cpus_per_replica=0.5, replica_resources={"shepherd_replica": 1}, router="precise-prefix",
            ingress_resources=INGRESS_ON_HEAD,
            max_ongoing_requests=32, max_queued_requests=64, routing_stats_period_s=0.5, health_check_period_s=1.0,
            ingress=IngressConfig(read_timeout=30.0)))
        wait_until(lambda: len(e.replicas()) == 2, 60, "the ingress to see both replicas")
        yield e


def deploy(env: Env, name: str, opts, serve_args: list = SERVE_ARGS) -> None:
    from ray import serve

    from shepherd.deploy.ray_serve import build_app
    opts.replica_name, opts.ingress_name = REPLICAS, f"Ingress-{name}"
    serve.run(build_app(opts, serve_args), name=name, route_prefix=f"/{name}")
    env.app = name


def test_serves_the_openai_api_with_shepherds_router(env):
    async def go():
        client = env.client()
        model = (await client.models.list()).data[0].id
        r = await client.completions.create(model=model, prompt="The capital of France is", max_tokens=8)
        assert r.usage.completion_tokens == 8 and r.choices[0].text
        chunks = [c async for c in await client.chat.completions.create(
            model=model, messages=[{"role": "user", "content": "hi"}], max_tokens=6, stream=True,
            stream_options={"include_usage": True})]
        assert chunks[-1].usage.completion_tokens == 6
        # one long shared prefix. precise-prefix reads the replicas' own KV events (published by each
        # engine on its node, subscribed to by the ingress's router) and the prompt's token ids (the
        # ingress tokenizes): once the first answer's blocks are in the router's index, every later
        # request goes to the replica that holds them, whose prefix cache then hits
        prefix = "You are a careful assistant. " * 40
        served, cached = set(), []
        for i in range(6):
            raw = await client.completions.with_raw_response.create(model=model, prompt=prefix + f"Q{i}?",
                                                                    max_tokens=2)
            served.add(raw.headers["x-shepherd-replica"])
            cached.append(raw.parse().usage.prompt_tokens_details.cached_tokens)
            # Ray's proxy names the request (X-Request-Id), the ingress forwards it, the replica's
            # answer id is built on it; the answer carries the header once
            assert [f"cmpl-{rid}" for rid in raw.headers.get_list("x-request-id")] == [raw.parse().id]
            if i == 0:
                await asyncio.to_thread(wait_until, lambda: _indexed(env, raw.headers["x-shepherd-replica"]), 30,
                                        "the first prompt's blocks in the router's index, from KV events")
        assert len(served) == 1 and min(cached[1:]) > 100
        await client.close()
    asyncio.run(go())
    assert httpx.get(env.url + "/health", timeout=10).status_code == 200
    assert env.counter("shepherd_ray_routing_decisions_total") >= 8
    assert env.samples("shepherd_ray_routing_decisions_total") and all(
        lab["policy"] == "precise-prefix" for lab, _ in env.samples("shepherd_ray_routing_decisions_total"))
    usable = {lab["replica"] for lab, v in env.samples("shepherd_ray_replica_kv_events_usable") if v == 1.0}
    assert len(usable) == 2, usable


def _indexed(env, short: str) -> bool:
    """The router's index holds blocks of the replica whose short id is `short`."""
    return any(lab["replica"].rsplit("#", 1)[-1] == short and v > 0
               for lab, v in env.samples("shepherd_ray_replica_kv_index_blocks"))


def test_replica_killed_mid_load(env):
    """Unstreamed requests on the killed replica are retried elsewhere; its streams end with an error
    event after their first tokens; Ray starts a replacement."""
    before = env.replicas()
    retries0 = env.counter("shepherd_ray_retries_total")

    async def go():
        client = env.client()
        model = (await client.models.list()).data[0].id
        plain = [asyncio.ensure_future(client.completions.create(
            model=model, prompt=f"request {i} " * 8, max_tokens=400, extra_body=LONG)) for i in range(16)]
        streams = []
        for i in range(4):
            raw = await client.completions.with_raw_response.create(
                model=model, prompt=f"stream {i} " * 8, max_tokens=400, stream=True, extra_body=LONG,
                stream_options={"include_usage": True})
            it = raw.parse().__aiter__()
            first = await it.__anext__()
            streams.append((raw.headers["x-shepherd-replica"], first, it))
        # kill a replica that holds a stream and unstreamed requests too (in-flight, exact, per replica)
        flight = await asyncio.to_thread(wait_until, lambda: _victim(env, streams), 30,
                                         "a replica with a stream and unstreamed requests in flight")
        victim = flight
        ray.kill(ray.get_actor(victim, namespace="serve"), no_restart=True)
        results = await asyncio.gather(*plain, return_exceptions=True)
        ends = []
        for rid, first, it in streams:
            try:
                last = [c async for c in it][-1]
                ends.append((rid, "done", last.usage.completion_tokens))
            except openai.APIError as e:
                ends.append((rid, "error", str(e)))
        await client.close()
        return victim, results, ends
    victim, results, ends = asyncio.run(go())
    bad = [r for r in results if isinstance(r, BaseException)]
    assert not bad, f"unstreamed requests lost: {bad[:3]}"
    assert all(r.usage.completion_tokens == 400 for r in results)
    short = victim.rsplit("#", 1)[-1]
    assert any(rid == short and kind == "error" for rid, kind, _ in ends), ends
    assert all(kind == "done" and n == 400 for rid, kind, n in ends if rid != short), ends
    assert env.counter("shepherd_ray_retries_total") > retries0
    wait_until(lambda: env.running() == 2 and victim not in env.replicas() and len(env.replicas()) == 2, 90,
               "Ray to replace the killed replica")
    assert set(env.replicas()) - set(before)


def _victim(env, streams):
    on = {rid for rid, _, _ in streams}
    for rep, (_node, flight) in env.replicas().items():
        short = rep.rsplit("#", 1)[-1]
        n_streams = sum(1 for rid, _, _ in streams if rid == short)
        if short in on and flight > n_streams:
            return rep
    return None


def test_node_removed_its_replicas_are_rescheduled(env):
    view = wait_until(lambda: (lambda v: v if len(v) == 2 and all(n for n, _ in v.values()) else None)(
        env.replicas()), 30, "both replicas to report their node")
    doomed = next(w for w in env.workers if any(n == w.node_id for n, _ in view.values()))
    survivor = next(w for w in env.workers if w is not doomed)
    lost = {rep for rep, (n, _) in view.items() if n == doomed.node_id}
    env.cluster.remove_node(doomed, allow_graceful=False)
    env.workers.remove(doomed)

    async def go():
        client = env.client()
        model = (await client.models.list()).data[0].id
        rs = await asyncio.gather(*(client.completions.create(model=model, prompt=f"after {i}", max_tokens=16)
                                    for i in range(8)), return_exceptions=True)
        await client.close()
        return rs
    rs = asyncio.run(go())
    assert all(not isinstance(r, BaseException) and r.usage.completion_tokens == 16 for r in rs), rs

    def rescheduled():
        now = env.replicas()
        return (env.running() == 2 and len(now) == 2 and not lost & set(now)
                and all(n == survivor.node_id for n, _ in now.values()))
    wait_until(rescheduled, 120, f"the replicas of the removed node ({len(lost)}) to run again on the survivor")


def test_scales_up_under_load_and_answers_429_past_rays_queue(env):
    """A fresh autoscaling deployment of one replica (16 slots, 8 queued in front of it): of 50
    streams the ones past the queue get 429 with Retry-After at once, the others finish, and the
    load (far over the target of 8 per replica) makes Ray start a second replica."""
    from ray import serve

    from shepherd.deploy.ray_ingress import IngressConfig
    from shepherd.deploy.ray_serve import RayServeOptions
    serve.delete(APP)
    deploy(env, "scale", RayServeOptions(
        replicas=1, min_replicas=1, max_replicas=2, target_ongoing_requests=8, upscale_delay_s=0.0,
        autoscaling_extra={"look_back_period_s": 2.0, "metrics_interval_s": 0.5},
        num_cpus_per_replica=0.5, replica_resources={"shepherd_replica": 1}, router="least-request",
        ingress_resources=INGRESS_ON_HEAD,
        max_ongoing_requests=16, max_queued_requests=8, routing_stats_period_s=0.5,
        ingress=IngressConfig(read_timeout=60.0)))
    wait_until(lambda: env.running() == 1, 60, "the scaling deployment's first replica")

    async def go():
        client = env.client(timeout=120)
        model = (await client.models.list()).data[0].id

        async def one(i):
            try:
                s = await client.completions.create(model=model, prompt=f"load {i} " * 4, max_tokens=600,
                                                    stream=True, extra_body=LONG,
                                                    stream_options={"include_usage": True})
                return ("done", [c async for c in s][-1].usage.completion_tokens)
            except openai.RateLimitError as e:
                return ("429", e.response.headers.get("retry-after"), e.body)
        out = await asyncio.gather(*(one(i) for i in range(50)))
        await client.close()
        return out
    t0 = time.monotonic()
    out = asyncio.run(go())
    assert time.monotonic() - t0 < 120
    busy = [o for o in out if o[0] == "429"]
    done = [o for o in out if o[0] == "done"]
    assert busy and done and len(busy) + len(done) == 50
    assert all(o[1] and int(o[1]) >= 1 for o in busy), busy[:3]
    assert all(o[1] == 600 for o in done)
    wait_until(lambda: env.running() == 2, 90, "the autoscaler to add a second replica")
