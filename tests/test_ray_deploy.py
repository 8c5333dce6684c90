"""shepherd on Ray Serve, its pieces without a cluster (the cluster test is test_ray_serve.py).

- the router adapter: Ray's replicas and routing stats in, shepherd's policy decides, ranked tiers out,
  in-flight counted exactly, removed replicas forgotten; it decides as the bare policy does;
- the ingress against a scripted handle: retries before the first byte only, 429/503 passed on
  with Retry-After, an SSE error event after it, the key checked before the body, nothing hangs;
- the replica class outside Ray: shepherd's own app answers through `serve_http`, and a cancelled
  call aborts the engine request.
"""
from __future__ import annotations

import asyncio
import json
import multiprocessing
import os
import sys

import httpx
import pytest

pytest.importorskip("ray")
sys.path.insert(0, os.path.dirname(__file__))

from ray.serve._private.common import DeploymentHandleSource, DeploymentID, ReplicaID  # noqa: E402
from ray.serve._private.request_router.common import PendingRequest  # noqa: E402

from shepherd.deploy.ray_call import HttpCall, register_router  # noqa: E402
from shepherd.deploy.ray_ingress import IngressApp, IngressConfig  # noqa: E402
from shepherd.deploy.ray_router import ShepherdRouter  # noqa: E402
from shepherd.routing import POLICY_NAMES, ReplicaState, RouteRequest, make_policy  # noqa: E402

DEP = DeploymentID(name="ShepherdReplica", app_name="t")


class FakeReplica:
    """What the router reads of Ray's RunningReplica."""

    def __init__(self, uid: str, **stats):
        self.replica_id = ReplicaID(unique_id=uid, deployment_id=DEP)
        self.routing_stats = stats
        self.max_ongoing_requests = 100

    async def get_queue_len(self, *, deadline_s: float) -> int:
        return 0


def _pending(call):
    return PendingRequest(args=[call], kwargs={}, metadata=None)


def _route(text: str, user: str = "u") -> RouteRequest:
    return RouteRequest(text=text, user=user, input_tokens=len(text) // 4)


def _router(policy: str, replicas, **knobs) -> ShepherdRouter:
    r = ShepherdRouter(deployment_id=DEP, handle_source=DeploymentHandleSource.UNKNOWN)
    r.initialize_state(policy=policy, knobs=knobs)
    r.update_replicas(replicas)
    return r


def _choose(router, call, replicas):
    return asyncio.run(router.choose_replicas(replicas, _pending(call)))


def test_router_ranks_the_policys_choice_first_and_the_rest_as_fallback():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b"), FakeReplica("c")]
        router = _router("cache-aware", reps)
        first = HttpCall("POST", "/v1/completions", route=_route("system prompt " * 20 + "q1"))
        tiers = await router.choose_replicas(reps, _pending(first))
        assert len(tiers) == 2 and len(tiers[0]) == 1
        assert {r.replica_id.unique_id for r in tiers[0] + tiers[1]} == {"a", "b", "c"}
        chosen = tiers[0][0].replica_id.unique_id
        # the same long prefix goes where the first went: the policy's tree, keyed by replica id
        again = HttpCall("POST", "/v1/completions", route=_route("system prompt " * 20 + "q2"))
        assert (await router.choose_replicas(reps, _pending(again)))[0][0].replica_id.unique_id == chosen
        # a request without a route (GET /v1/models) may go anywhere: one tier of all
        anyone = await router.choose_replicas(reps, _pending(HttpCall("GET", "/v1/models")))
        assert anyone == [reps]
        # a replica that already refused the request is left out
        excl = HttpCall("POST", "/v1/completions", route=_route("system prompt " * 20 + "q3"),
                        exclude=frozenset({chosen}))
        tiers = await router.choose_replicas(reps, _pending(excl))
        assert chosen not in {r.replica_id.unique_id for t in tiers for r in t}
        assert router.policy.reasons["hit"] >= 1
    asyncio.run(go())


def test_router_keeps_one_decision_per_attempt_across_rays_reroutes():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b")]
        router = _router("round-robin", reps)
        call = HttpCall("POST", "/v1/completions", route=_route("x"))
        t1 = await router.choose_replicas(reps, _pending(call))
        t2 = await router.choose_replicas(reps, _pending(call))      # Ray asks again: the replica was full
        assert t1[0][0] is t2[0][0]
        assert sum(router.policy.reasons.values()) == 1
    asyncio.run(go())


def test_router_counts_in_flight_exactly_and_charges_output_at_finish():
    async def go():
        reps = [FakeReplica("a"), FakeReplica("b")]
        router = _router("least-request", reps)
        calls = []
        for i in range(3):
            call = HttpCall("POST", "/v1/completions", route=_route(f"p{i}"))
            tiers = await router.choose_replicas(reps, _pending(call))
            router.on_request_routed(_pending(call), tiers[0][0].replica_id, None)
            calls.append(call)
        # counted at each decision, so least-request spread them 2/1
        assert sorted(st.in_flight for st in router.states.values()) == [1, 2]
        for c in calls:
            router.finished(c, 5)
            router.finished(c, 5)                 # a second end is not a second -1
        assert [st.in_flight for st in router.states.values()] == [0, 0]
        # Ray had to use the second tier (the chosen replica was full): the count moves with it
        moved = HttpCall("POST", "/v1/completions", route=_route("moved"))
        tiers = await router.choose_replicas(reps, _pending(moved))
        router.on_request_routed(_pending(moved), tiers[1][0].replica_id, None)
        assert router.states[tiers[1][0].replica_id.unique_id].in_flight == 1
        assert router.states[tiers[0][0].replica_id.unique_id].in_flight == 0
        router.finished(moved, 0)
        # the ingress gave up before Ray routed it: nothing stays counted
        late = HttpCall("POST", "/v1/completions", route=_route("late"))
        tiers = await router.choose_replicas(reps, _pending(late))
        router.finished(late, 0)
        router.on_request_routed(_pending(late), tiers[1][0].replica_id, None)
        assert [st.in_flight for st in router.states.values()] == [0, 0]
    asyncio.run(go())


def test_router_reads_routing_stats_and_skips_a_dead_engine():
    async def go():
        reps = [FakeReplica("a", running=9, waiting=3), FakeReplica("b", running=1),
                FakeReplica("c", alive=False)]
        router = _router("least-request", reps)
        tiers = await router.choose_replicas(reps, _pending(HttpCall("POST", "/v1/completions", route=_route("x"))))
        assert tiers[0][0].replica_id.unique_id == "b"
        st = router.states["a"]
        assert (st.running, st.waiting, st.load) == (9, 3, 12)
        assert not router.states["c"].healthy
    asyncio.run(go())


def test_router_forgets_a_removed_replica():
    async def go():
        a, b = FakeReplica("a"), FakeReplica("b")
        router = _router("cache-aware", [a, b])
        text = "shared " * 40
        tiers = await router.choose_replicas([a, b], _pending(HttpCall("POST", "/", route=_route(text + "1"))))
        gone = tiers[0][0]
        keep = b if gone is a else a
        router.update_replicas([keep])
        assert set(router.states) == {keep.replica_id.unique_id}
        assert gone.replica_id.unique_id not in router.policy.tree.size
        tiers = await router.choose_replicas([keep], _pending(HttpCall("POST", "/", route=_route(text + "2"))))
        assert tiers[0] == [keep]
    asyncio.run(go())


def test_router_routes_precise_prefix_on_the_replicas_kv_events():
    """precise-prefix on Ray: the router subscribes to the KV-event stream each replica names in its
    routing stats, feeds the policy's index from it, sends a prompt where its blocks are cached,
    follows an eviction, and unsubscribes a replica that leaves."""
    from kv_fakes import FakePublisher, loopback, wait_until

    from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored

    def stored(tokens):
        hashes = [hash(("engine", i, tuple(tokens))) & 0xFFFFFFFF for i in range(len(tokens) // 16)]
        return BlockStored(hashes, None, list(tokens[:16 * len(hashes)]), 16, None, "GPU", None)

    async def go(pubs):
        reps = [FakeReplica(u, kv_events=loopback(pub.endpoint), kv_replay=loopback(pub.replay_endpoint))
                for u, pub in zip("ab", pubs)] + [FakeReplica("c")]            # c publishes nothing
        router = _router("precise-prefix", reps)
        router.snapshot()                          # reads the stats, as /metrics and every decision do
        p, q = list(range(1000, 1100)), list(range(5000, 5100))                 # 6 full blocks each
        pubs[0].publish([AllBlocksCleared(), stored(p)])
        pubs[1].publish([AllBlocksCleared(), stored(q)])
        index = router.policy.kv_index
        await asyncio.to_thread(wait_until, lambda: index.blocks("a") == 6 and index.blocks("b") == 6,
                                what="both streams indexed")

        async def route(tokens) -> str:
            call = HttpCall("POST", "/v1/completions", route=RouteRequest(text="-", token_ids=tokens))
            got = (await router.choose_replicas(reps, _pending(call)))[0][0].replica_id.unique_id
            router.finished(call, 1)
            return got
        for _ in range(3):
            assert await route(p + [7, 8, 9]) == "a" and await route(q) == "b"
        assert router.policy.reasons["hit"] == 6
        assert {k: v["state"] for k, v in router.snapshot()[2].items()} == {"a": "complete", "b": "complete"}
        pubs[0].publish([BlockRemoved(stored(p).block_hashes, "GPU")])          # a evicts p
        await asyncio.to_thread(wait_until, lambda: index.blocks("a") == 0, what="the eviction")
        await route(p)
        assert router.policy.reasons["hit"] == 6
        router.update_replicas(reps[1:])
        assert "a" not in router.kv_streams
        await asyncio.to_thread(wait_until, lambda: "a" not in router.kv.status(),
                                what="the stream of a removed replica to close")
        router.kv.close()

    pubs = [FakePublisher(), FakePublisher()]
    try:
        asyncio.run(go(pubs))
    finally:
        for pub in pubs:
            pub.close()


@pytest.mark.parametrize("policy", POLICY_NAMES)
def test_router_decides_as_the_bare_policy_does(policy):
    """The adapter adds nothing to the decision, for every policy: the same states, the same in-flight
    counts, the same output charged at the end (vtc-basic), the same sessions, the same choices."""
    async def go():
        reps = [FakeReplica(u) for u in "abcd"]
        router = _router(policy, reps)
        bare = make_policy(policy)
        states = {u: ReplicaState(index=i, url=u) for i, u in enumerate("abcd")}
        live = []                       # (call, bare's route, bare's state), two in flight at a time
        for i in range(40):
            text = f"tenant {i % 5} " * 30 + f"turn {i}"
            mine, theirs = (RouteRequest(text=text, user=f"user{i % 3}", session=f"s{i % 4}",
                                         input_tokens=len(text) // 4) for _ in range(2))
            call = HttpCall("POST", "/v1/completions", route=mine)
            got = (await router.choose_replicas(reps, _pending(call)))[0][0]
            want = bare.choose(theirs, list(states.values()))
            want.in_flight += 1
            bare.on_dispatch(theirs, want)
            assert got.replica_id.unique_id == want.url, f"request {i}"
            live.append((call, theirs, want))
            if len(live) > 2:
                done, route, st = live.pop(0)
                out = 600 if route.user == "user0" else 5          # one heavy user (vtc-basic sees it)
                router.finished(done, out)
                st.in_flight -= 1
                bare.on_finish(route, st, out)
        assert router.policy.reasons == bare.reasons
        assert {k: s.in_flight for k, s in router.states.items()} == {k: s.in_flight for k, s in states.items()}
    asyncio.run(go())


# ---------------------------------------------------------------------------------- the ingress
class Died(Exception):
    """Stands for ray.exceptions.ActorDiedError."""


class FakeGen:
    def __init__(self, script):
        self.script = list(script)
        self.cancelled = False
        self.raised = None

    async def __anext__(self):
        if not self.script:
            raise StopAsyncIteration
        item = self.script.pop(0)
        if isinstance(item, BaseException):
            self.raised = item
            raise item
        if item == "hang":
            await asyncio.Event().wait()
        return item

    def cancel(self):
        self.cancelled = True
        if self.raised is not None:          # Ray's cancel re-raises the call's own error
            raise self.raised


class FakeHandle:
    """A DeploymentHandle whose every call plays the next script."""

    def __init__(self, *scripts):
        self.scripts = list(scripts)
        self.calls: list[HttpCall] = []
        self.gens: list[FakeGen] = []

    def options(self, **_):
        return self

    def remote(self, call):
        self.calls.append(call)
        script = self.scripts.pop(0)
        if isinstance(script, BaseException):        # refused at the call itself
            raise script
        gen = FakeGen(script)
        self.gens.append(gen)
        return gen


def _start(status=200, replica="r1", ctype=b"application/json", extra=()):
    return {"type": "http.response.start", "status": status,
            "headers": [(b"content-type", ctype), (b"x-shepherd-replica", replica.encode()), *extra]}


def _body(data: bytes, more=False):
    return {"type": "http.response.body", "body": data, "more_body": more}


OK = json.dumps({"choices": [{"text": "hi"}], "usage": {"completion_tokens": 3}}).encode()
BODY = {"prompt": "hello", "max_tokens": 4}


def _post(app, body=BODY, path="/v1/completions", headers=None):
    async def go():
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return await c.post(path, json=body, headers=headers or {})
    return asyncio.run(go())


def _app(handle, **cfg):
    return IngressApp(handle, IngressConfig(**{"retry_backoff": 0.001, **cfg}))


def test_ingress_relays_an_answer_unchanged():
    handle = FakeHandle([[_start(), _body(OK)]])
    r = _post(_app(handle))
    assert r.status_code == 200 and r.content == OK and r.headers["x-shepherd-replica"] == "r1"
    call = handle.calls[0]
    assert call.route.text == "hello" and call.path == "/v1/completions" and json.loads(call.body) == BODY


def test_ingress_under_a_route_prefix_routes_the_path_below_it():
    handle = FakeHandle([[_start(), _body(OK)]])
    sent, given = [], []

    async def receive():            # the body once, then nothing until the client leaves (never)
        if not given:
            given.append(1)
            return {"type": "http.request", "body": json.dumps(BODY).encode(), "more_body": False}
        await asyncio.Event().wait()

    async def send(msg):
        sent.append(msg)
    scope = {"type": "http", "method": "POST", "path": "/llm/v1/completions", "root_path": "/llm",
             "query_string": b"", "headers": [(b"content-type", b"application/json")]}
    asyncio.run(_app(handle)(scope, receive, send))
    assert sent[0]["status"] == 200 and handle.calls[0].path == "/v1/completions"
    assert handle.calls[0].route is not None


def test_ingress_retries_a_replica_that_died_before_the_first_byte():
    handle = FakeHandle([Died("actor died")], [[_start(replica="r2"), _body(OK)]])
    app = _app(handle)
    r = _post(app)
    assert r.status_code == 200 and r.headers["x-shepherd-replica"] == "r2"
    assert len(handle.calls) == 2 and handle.calls[0].call_id != handle.calls[1].call_id
    assert app.metrics.retries.labels("Died")._value.get() == 1


def test_ingress_passes_on_the_last_429_after_trying_other_replicas():
    busy = json.dumps({"error": {"message": "queue full", "type": "rate_limit_exceeded"}}).encode()
    script = [[[_start(429, replica=f"r{i}", extra=[(b"retry-after", b"3")]), _body(busy)]] for i in range(3)]
    handle = FakeHandle(*script)
    r = _post(_app(handle))
    assert r.status_code == 429 and r.headers["retry-after"] == "3" and r.json()["error"]["message"] == "queue full"
    assert [sorted(c.exclude) for c in handle.calls] == [[], ["r0"], ["r0", "r1"]]


def test_ingress_ends_a_broken_stream_with_one_error_event_and_never_retries_it():
    sse = b"text/event-stream"
    handle = FakeHandle([[_start(ctype=sse), _body(b"data: {\"a\": 1}\n\n", more=True)], Died("actor died")],
                        [[_start(ctype=sse), _body(b"data: [DONE]\n\n")]])
    r = _post(_app(handle), body={**BODY, "stream": True})
    assert r.status_code == 200
    events = [e for e in r.text.split("\n\n") if e]
    assert events[0] == 'data: {"a": 1}'
    assert json.loads(events[-1][len("data: "):])["error"]["type"] == "upstream_error"
    assert len(handle.calls) == 1


def test_ingress_holds_the_headers_until_the_first_body_chunk():
    """A replica that sent its headers and died before any body is retried: nothing reached the client."""
    handle = FakeHandle([[_start(replica="r1")], Died("actor died")], [[_start(replica="r2"), _body(OK)]])
    r = _post(_app(handle))
    assert r.status_code == 200 and r.headers["x-shepherd-replica"] == "r2"


def test_ingress_answers_429_with_retry_after_when_rays_queue_is_full():
    from ray.serve.exceptions import BackPressureError
    for refusal in ([BackPressureError(num_queued_requests=8, max_queued_requests=8)],     # on the first message
                    BackPressureError(num_queued_requests=8, max_queued_requests=8)):      # at the call
        handle = FakeHandle(refusal)
        r = _post(_app(handle, retry_after_s=2))
        assert r.status_code == 429 and r.headers["retry-after"] == "2"
        assert r.json()["error"]["type"] == "rate_limit_exceeded" and len(handle.calls) == 1


def test_ingress_bounds_every_wait_on_a_replica():
    handle = FakeHandle(["hang"], ["hang"])
    r = _post(_app(handle, read_timeout=0.2, retries=1))
    assert r.status_code == 503 and r.headers["retry-after"] == "1"
    assert all(g.cancelled for g in handle.gens)


def test_ingress_checks_the_key_before_reading_the_body():
    app = _app(FakeHandle(), api_key="sekret")
    sent = []

    async def receive():
        raise AssertionError("the body was read before the key was checked")

    async def send(msg):
        sent.append(msg)
    scope = {"type": "http", "method": "POST", "path": "/v1/completions", "query_string": b"",
             "headers": [(b"authorization", b"Bearer wrong")]}
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 401 and json.loads(sent[1]["body"])["error"]["code"] == "invalid_api_key"
    ok = _post(_app(FakeHandle([[_start(), _body(OK)]]), api_key="sekret"),
               headers={"authorization": "Bearer sekret"})
    assert ok.status_code == 200


def test_ingress_bad_input_is_a_400_with_an_openai_body_and_no_replica_call():
    handle = FakeHandle()
    app = _app(handle)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            return [await c.post("/v1/completions", content=b"{not json"),
                    await c.post("/v1/chat/completions", json={"messages": "nope"}),
                    await c.post("/v1/completions", json={"prompt": "x", "stream": "yes"})]
    for r in asyncio.run(go()):
        assert r.status_code == 400 and r.json()["error"]["message"]
    assert handle.calls == []


def test_ingress_learns_the_replicas_body_cap_from_their_health_answer():
    """Once a replica's /health answer names its body cap, a body over it is refused from its
    Content-Length (413, before it is read or parsed, no replica call), as the replica would."""
    cap = (b"x-shepherd-max-body-bytes", b"4096")
    handle = FakeHandle([[_start(extra=(cap,)), _body(b"")]], [[_start(), _body(OK)]])
    app = _app(handle)

    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            assert (await c.get("/health")).status_code == 200
            return [await c.post("/v1/completions", json=dict(BODY, prompt="x" * 10_000)),
                    await c.post("/v1/completions", json=dict(BODY, prompt="x" * 3000))]
    big, small = asyncio.run(go())
    assert big.status_code == 413 and "the replicas' --max-body-bytes" in big.json()["error"]["message"]
    assert small.status_code == 200 and [c.path for c in handle.calls] == ["/health", "/v1/completions"]


def test_ingress_tells_the_router_each_attempt_ended():
    class Counting:
        def __init__(self):
            self.ended = []

        def finished(self, call, tokens):
            self.ended.append((call.call_id, tokens))
    spy = Counting()
    register_router("SpyReplica", spy)
    handle = FakeHandle([Died("x")], [[_start(), _body(OK)]])
    _post(_app(handle, deployment="SpyReplica"))
    assert [cid for cid, _ in spy.ended] == [c.call_id for c in handle.calls]
    assert spy.ended[-1][1] == 3                  # the answer's usage.completion_tokens, for vtc-basic


# ---------------------------------------------------------------------------------- the replica
def test_replica_serves_shepherds_app_and_a_cancelled_call_aborts_the_engine_request():
    from shepherd.deploy.ray_replica import ShepherdReplica

    async def go():
        rep = ShepherdReplica.__new__(ShepherdReplica)
        await rep.__init__(["--executor", "sim", "--engine-core", "thread", "--max-total-tokens", "4096"])
        # the app's lifespan ran, as under uvicorn: the grammar check's worker is already up
        assert [p.name for p in multiprocessing.active_children()].count("shepherd-grammar-check") == 1
        try:
            body = json.dumps({"prompt": "hello there", "max_tokens": 5}).encode()
            msgs = [m async for batch in rep.serve_http(HttpCall("POST", "/v1/completions", body=body,
                                                                 headers=[(b"content-type", b"application/json")]))
                    for m in batch]
            assert msgs[0]["status"] == 200 and (b"x-shepherd-replica", b"local") in msgs[0]["headers"]
            answer = json.loads(b"".join(m.get("body", b"") for m in msgs[1:]))
            assert answer["usage"]["completion_tokens"] == 5
            # a stream cut after its first chunk: the engine request is aborted, nothing keeps running
            body = json.dumps({"prompt": "hello", "max_tokens": 5000, "stream": True, "ignore_eos": True}).encode()
            gen = rep.serve_http(HttpCall("POST", "/v1/completions", body=body,
                                          headers=[(b"content-type", b"application/json")]))
            while not any(m["type"] == "http.response.body" and m.get("body") for m in await gen.__anext__()):
                pass
            assert rep.record_routing_stats()["running"] + rep.record_routing_stats()["waiting"] <= 1
            await gen.aclose()
            deadline = asyncio.get_running_loop().time() + 10
            while rep.engine.stats().num_running and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.01)
            stats = rep.record_routing_stats()
            assert stats["running"] == 0 and stats["alive"] and stats["prefix_query_tokens"] > 0
            rep.check_health()
        finally:
            await rep.__del__()
        with pytest.raises(RuntimeError, match="engine not running"):
            rep.check_health()
        assert "shepherd-grammar-check" not in [p.name for p in multiprocessing.active_children()]
    asyncio.run(go())


@pytest.mark.parametrize("argv,have,per,error", [
    (["--replicas", "2"], 2.0, 0.87, None),                      # DEPLOY.md's one-machine command, 2 CPUs
    (["--replicas", "4", "--executor", "sim"], 2.0, 0.43, None),
    (["--replicas", "1"], 8.0, 1.0, None),                       # room: the default 1 CPU
    (["--replicas", "2", "--num-cpus-per-replica", "1"], 2.0, 1.0, "--num-cpus-per-replica 0.87 fits"),
    (["--replicas", "2", "--num-cpus", "4"], 2.0, 1.0, None),    # --num-cpus is the local Ray's size
    (["--replicas", "1", "--ingress-replicas", "9"], 2.0, 0.0, "need 2.25 CPUs.*fewer --ingress-replicas"),
])
def test_a_local_ray_is_never_asked_for_more_cpus_than_it_has(argv, have, per, error):
    # with --address local, Ray has the machine's CPUs; replicas of 1 CPU each and a 0.25-CPU
    # ingress that do not fit wait for CPUs forever, and `shepherd ray-serve` never answered
    import argparse

    from shepherd.config import ConfigError
    from shepherd.deploy import ray_cli
    p = argparse.ArgumentParser()
    ray_cli.add_arguments(p)
    args = p.parse_args(argv)
    opts = ray_cli.options_from(args)
    have = args.num_cpus if args.num_cpus is not None else have
    if error:
        with pytest.raises(ConfigError, match=error):
            ray_cli.fit_local(opts, have, chosen=args.num_cpus_per_replica is not None)
        return
    ray_cli.fit_local(opts, have, chosen=args.num_cpus_per_replica is not None)
    assert opts.num_cpus_per_replica == per
    assert opts.replicas * per + opts.ingress_replicas * opts.ingress_num_cpus <= have


@pytest.fixture
def ray_serve_cli(monkeypatch):
    """`shepherd ray-serve ARGV` up to the point where it would start Ray: deploy() and Ray's
    clean-up calls are recorded, not run, so no test starts a cluster. run(argv) -> exit status;
    `calls` holds what reached deploy() and the clean-up; set calls["raise"] for deploy() to raise."""
    import signal

    import ray
    from ray import serve

    import shepherd.deploy.ray_serve as ray_serve
    from shepherd.cli import build_parser
    from shepherd.deploy import ray_cli
    calls: dict = {"deploy": [], "cleanup": [], "raise": None}

    def deploy(opts, args, **where):
        calls["deploy"].append(opts)
        if calls["raise"] is not None:
            raise calls["raise"]
        return None

    monkeypatch.setattr(ray_serve, "deploy", deploy)
    monkeypatch.setattr(serve, "delete", lambda name: calls["cleanup"].append("delete"))
    monkeypatch.setattr(ray, "shutdown", lambda: calls["cleanup"].append("shutdown"))
    monkeypatch.setattr(signal, "signal", lambda *a: None)      # the command's handlers stay out of pytest

    def run(argv: list) -> int:
        args = build_parser().parse_args(["ray-serve", "--executor", "sim", *argv])
        if calls["raise"] is None:
            calls["raise"] = SystemExit(99)         # what got past the checks goes no further
        try:
            return ray_cli.main(args)
        except SystemExit as e:
            return e.code
    run.calls = calls
    return run


@pytest.mark.parametrize("argv,error", [
    (["--num-cpus", "nan"], "--num-cpus must be > 0 and <= 65536 CPUs, got nan"),
    (["--num-cpus", "inf"], "--num-cpus must be > 0"),                                  # a traceback
    (["--num-cpus", "0"], "--num-cpus must be > 0"),
    (["--num-cpus-per-replica", "nan"], "--num-cpus-per-replica must be >= 0"),
    (["--min-replicas", "-1"], "--min-replicas must be >= 0, got -1"),
    (["--min-replicas", "1", "--target-ongoing-requests", "nan"], "--target-ongoing-requests must be > 0"),
    (["--min-replicas", "1", "--upscale-delay", "-1"], "--upscale-delay must be >= 0 seconds, got -1.0"),
    (["--min-replicas", "1", "--downscale-delay", "nan"], "--downscale-delay must be >= 0 seconds"),
    (["--max-ongoing-requests", "0"], "--max-ongoing-requests must be >= 1, got 0"),     # fell back unsaid
    (["--max-ongoing-requests", "-1"], "--max-ongoing-requests must be >= 1"),
    (["--max-queued-requests", "0"], r"--max-queued-requests must be -1 \(no limit\) or >= 1, got 0"),
    (["--max-queued-requests", "-2"], "--max-queued-requests must be -1"),
    (["--ingress-replicas", "0"], "--ingress-replicas must be >= 1, got 0"),
    (["--ingress-replicas", "-1"], "--ingress-replicas must be >= 1"),
    (["--read-timeout", "nan"], "--read-timeout must be > 0 seconds, got nan"),
    (["--routing-stats-period", "0"], "--routing-stats-period must be > 0 seconds, got 0.0"),
    (["--routing-stats-period", "nan"], "--routing-stats-period must be > 0 seconds"),
    (["--target-ongoing-requests", "-3"], "--target-ongoing-requests must be > 0"),        # ignored before
    (["--address", "127.0.0.1:1", "--num-cpus", "2"], "--num-cpus sizes the Ray that --address local starts"),
    (["--route-prefix", "api"], "--route-prefix must start with '/'"),
    (["--route-prefix", "/api/"], "got '/api/'"),
    (["--app-name", ""], "--app-name must be non-empty and without '#'"),
    (["--app-name", "a#b"], "--app-name must be non-empty and without '#', got 'a#b'"),
    (["--address", "nonsense"], "--address must be local, auto, HOST:PORT or ray://HOST"),
])
def test_ray_serve_refuses_a_bad_flag_in_one_line_before_ray_starts(ray_serve_cli, capsys, argv, error):
    # each of these reached Ray: refused there after it started, as a traceback or a many-line
    # pydantic error (--upscale-delay -1, --ingress-replicas -1, --route-prefix api), or taken
    # without a word (--max-ongoing-requests 0 became --max-concurrency, --downscale-delay without
    # autoscaling did nothing)
    import re
    assert ray_serve_cli(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("shepherd ray-serve: error: ") and "\n" not in err, err
    assert re.search(error, err), err
    assert ray_serve_cli.calls["deploy"] == [] and ray_serve_cli.calls["cleanup"] == []


def test_ray_serve_autoscaling_flags_apply_only_with_autoscaling(ray_serve_cli, capsys):
    # without --min/--max-replicas they were taken and ignored: a fixed deployment the user
    # believed would scale
    assert ray_serve_cli(["--downscale-delay", "10", "--target-ongoing-requests", "4"]) == 2
    assert capsys.readouterr().err == ("shepherd ray-serve: error: --target-ongoing-requests, --downscale-delay "
                                       "apply only with autoscaling: give --min-replicas and/or --max-replicas "
                                       "too\n")
    assert ray_serve_cli.calls["deploy"] == []
    # with autoscaling they go through, and so do Ray's own values: -1 queued is "no limit", 0
    # replicas an autoscaling deployment that starts from none
    assert ray_serve_cli(["--min-replicas", "0", "--max-replicas", "2", "--replicas", "0",
                          "--target-ongoing-requests", "4", "--upscale-delay", "0",
                          "--max-queued-requests", "-1"]) == 99
    opts = ray_serve_cli.calls["deploy"][0]
    assert (opts.target_ongoing_requests, opts.upscale_delay_s, opts.downscale_delay_s) == (4.0, 0.0, 600.0)
    assert opts.max_queued_requests == -1


def test_ray_serve_refuses_an_address_where_nothing_listens_within_seconds(ray_serve_cli, capsys):
    # Ray retried 127.0.0.1:1 for ~160 s, then `finally` started a local Ray to delete the app from
    import time
    t0 = time.monotonic()
    assert ray_serve_cli(["--address", "127.0.0.1:1"]) == 2
    assert time.monotonic() - t0 < 10
    err = capsys.readouterr().err
    assert "--address 127.0.0.1:1: nothing answers at 127.0.0.1:1" in err and err.count("\n") == 1, err
    assert ray_serve_cli.calls["deploy"] == []


def test_ray_serve_refuses_a_taken_port_before_ray_starts(ray_serve_cli, capsys):
    # Ray's HTTP proxy failed to bind after Ray had started: a RayTaskError traceback, exit 1
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        assert ray_serve_cli(["--port", str(port)]) == 2
    err = capsys.readouterr().err
    assert f"shepherd ray-serve: error: cannot listen on 127.0.0.1 port {port}" in err, err
    assert ray_serve_cli.calls["deploy"] == []


def test_ray_serve_a_cluster_that_is_not_there_is_one_line_and_no_local_ray(ray_serve_cli, capsys):
    # `--address auto` with no cluster, or a ray:// address that answers TCP but not Ray: a
    # ConnectionError traceback, and the clean-up's serve.delete() started a local Ray to delete from
    ray_serve_cli.calls["raise"] = ConnectionError("ray client connection timeout")
    assert ray_serve_cli(["--address", "auto"]) == 2
    err = capsys.readouterr().err
    assert err == "shepherd ray-serve: error: --address auto: ray client connection timeout\n", err
    assert ray_serve_cli.calls["cleanup"] == []


@pytest.mark.parametrize("kw", [{"ingress": IngressConfig(read_timeout=float("nan"))},
                                {"num_cpus_per_replica": float("nan")}, {"ingress_num_cpus": float("nan")},
                                {"min_replicas": 1, "target_ongoing_requests": float("nan")}])
def test_library_options_refuse_nan_as_the_cli_does(kw):
    """RayServeOptions.validate is the check for callers of the library (the CLI's ranges run first
    on its own path): NaN fails every comparison, so "x <= 0" let it through to Ray."""
    from shepherd.deploy.ray_serve import RayServeOptions
    with pytest.raises(ValueError):
        RayServeOptions(**kw).validate()
