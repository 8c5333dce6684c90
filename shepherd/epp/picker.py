"""`shepherd epp`: an Envoy ext_proc service that picks the endpoint, as the Gateway API
Inference Extension's endpoint-picker protocol says (docs/proposals/004-endpoint-picker-protocol).

    picker = EndpointPicker(pool, policy, kv)          # gateway/backends.py pool, any routing policy
    server = await serve(picker, "0.0.0.0:9002")       # grpc.aio, envoy.service.ext_proc.v3

One ext_proc stream is one HTTP request. The picker reads the request headers and
the body (the OpenAI JSON: the prompt, the messages, `user`), runs the policy over
the healthy endpoints (restricted to `envoy.lb.subset_hint` /
`x-gateway-destination-endpoint-subset` when the proxy sends one) and answers with
the chosen `ip:port` twice, as the protocol requires: the
`x-gateway-destination-endpoint` request header and the `envoy.lb` dynamic
metadata key of the same name. No ready endpoint: an ImmediateResponse 503 with
an OpenAI-style error body and Retry-After.

Body modes (the proxy's `protocol_config`): BUFFERED (the default when none is
sent) gets a CONTINUE for the headers and the pick with the whole body;
FULL_DUPLEX_STREAMED (what GIE's reference deployment uses) holds the headers
answer until the body is complete, then sends the headers with the pick and the
body back; a request without a body (end_of_stream on the headers) is picked at
once. The request is counted in flight on its endpoint from the pick until the
stream ends (the proxy keeps it open through the response when response
processing is on; `x-gateway-destination-endpoint-served` tells which endpoint
answered), so load-aware policies see the picker's own count, as in the gateway.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Optional

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2 as pm
from envoy.service.ext_proc.v3 import external_processor_pb2 as ep
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as ep_grpc
from envoy.type.v3 import http_status_pb2
from google.protobuf import struct_pb2

from shepherd.gateway.backends import BackendPool
from shepherd.gateway.intake import route_request_from
from shepherd.gateway.kv_routing import KVRouting
from shepherd.routing import NoReplicaAvailable, ReplicaState, RouteRequest, RoutingPolicy
from shepherd.server.guard import error_body

log = logging.getLogger("shepherd.epp")

DEST = "x-gateway-destination-endpoint"
SERVED = "x-gateway-destination-endpoint-served"
SUBSET = "x-gateway-destination-endpoint-subset"
LB_NAMESPACE = "envoy.lb"
SUBSET_NAMESPACE = "envoy.lb.subset_hint"
CHAT_PATHS = ("/v1/chat/completions",)


def endpoint_of(replica: ReplicaState) -> str:
    """http://10.0.0.5:8000 -> 10.0.0.5:8000 (what Envoy connects to)."""
    return replica.url.split("://", 1)[-1]


class EndpointPicker:
    """The decision, apart from gRPC: a pool of endpoints, a routing policy, KV events."""

    def __init__(self, pool: BackendPool, policy: RoutingPolicy, kv: Optional[KVRouting] = None,
                 client=None) -> None:
        self.pool = pool
        self.policy = policy
        self.kv = kv
        self.client = client            # httpx.AsyncClient for /tokenize (KV-event policies)
        self.picks = 0
        self.unavailable = 0

    async def pick(self, headers: dict, body: bytes, subset: Optional[list]) -> tuple[ReplicaState, RouteRequest]:
        """The chosen endpoint's state (already counted in flight) and the request as routed;
        NoReplicaAvailable when no ready endpoint (in the subset) is left."""
        path = headers.get(":path", "").split("?", 1)[0]
        chat = path in CHAT_PATHS
        xh = {k: v for k, v in headers.items() if k.startswith("x-")}
        payload: dict = {}
        try:
            payload = json.loads(body) if body else {}
            rr = route_request_from(payload if isinstance(payload, dict) else {}, chat, xh, time.monotonic())
        except Exception:  # noqa: BLE001 - not JSON, or not a request the gateway could read:
            # not ours to refuse; the model server answers a bad body with its own 4xx
            rr = RouteRequest(headers=xh, now=time.monotonic())
        cands = [r for r in self.pool.replicas() if r.healthy]
        if subset is not None:
            allowed = set(subset)
            cands = [r for r in cands if endpoint_of(r) in allowed]
        if not cands:
            self.unavailable += 1
            raise NoReplicaAvailable("no ready endpoint")
        if self.kv is not None and isinstance(payload, dict):
            await self.kv.fill(rr, payload, chat, cands, self.client)
        chosen = self.policy.choose(rr, cands)
        chosen.in_flight += 1
        self.policy.on_dispatch(rr, chosen)
        self.picks += 1
        return chosen, rr

    def done(self, replica: ReplicaState, rr: RouteRequest) -> None:
        replica.in_flight -= 1
        try:
            self.policy.on_finish(rr, replica, 0)
        except Exception:  # pragma: no cover - a policy bug must not leak in-flight
            log.exception("policy.on_finish")


# ------------------------------------------------------------------ protobuf helpers
def _headers(msg: ep.HttpHeaders) -> dict:
    out = {}
    for h in msg.headers.headers:
        out[h.key.lower()] = h.raw_value.decode("utf-8", "replace") if h.raw_value else h.value
    return out


def _subset(req: ep.ProcessingRequest) -> Optional[list]:
    ns = req.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if ns is None or SUBSET not in ns.fields:
        return None
    v = ns.fields[SUBSET]
    if v.HasField("list_value"):
        return [x.string_value for x in v.list_value.values]
    return [s.strip() for s in v.string_value.split(",") if s.strip()]


def _served(req: ep.ProcessingRequest) -> Optional[str]:
    ns = req.metadata_context.filter_metadata.get(LB_NAMESPACE)
    if ns is None or SERVED not in ns.fields:
        return None
    return ns.fields[SERVED].string_value


def _pick_common(endpoint: str) -> ep.CommonResponse:
    mutation = ep.HeaderMutation(set_headers=[base_pb2.HeaderValueOption(
        header=base_pb2.HeaderValue(key=DEST, raw_value=endpoint.encode()))])
    return ep.CommonResponse(header_mutation=mutation, clear_route_cache=True)


def _metadata(endpoint: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DEST: endpoint}})
    return md


def unavailable_response(message: str) -> ep.ProcessingResponse:
    body = json.dumps(error_body(message, "service_unavailable", code=503)).encode()
    hm = ep.HeaderMutation(set_headers=[
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=b"application/json")),
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="retry-after", raw_value=b"1"))])
    return ep.ProcessingResponse(immediate_response=ep.ImmediateResponse(
        status=http_status_pb2.HttpStatus(code=http_status_pb2.ServiceUnavailable), headers=hm, body=body,
        details="shepherd epp: no ready endpoint"))


class ExtProcService(ep_grpc.ExternalProcessorServicer):
    def __init__(self, picker: EndpointPicker) -> None:
        self.picker = picker

    async def Process(self, request_iterator, context):  # noqa: N802 - the gRPC method's name
        st = _Request()
        try:
            async for req in request_iterator:
                for resp in await st.on(req, self.picker):
                    yield resp
                if st.finished:
                    return
        finally:
            st.release(self.picker)


class _Request:
    """One ext_proc stream: what arrived so far and what was picked."""

    def __init__(self) -> None:
        self.headers: dict = {}
        self.body = bytearray()
        self.mode = pm.ProcessingMode.BUFFERED
        self.response_mode = pm.ProcessingMode.NONE
        self.subset: Optional[list] = None
        self.picked: Optional[tuple] = None
        self.finished = False

    async def on(self, req: ep.ProcessingRequest, picker: EndpointPicker) -> list:
        kind = req.WhichOneof("request")
        if kind == "request_headers":
            self.headers = _headers(req.request_headers)
            if req.HasField("protocol_config"):
                self.mode = req.protocol_config.request_body_mode
                self.response_mode = req.protocol_config.response_body_mode
            self.subset = _subset(req)
            if req.request_headers.end_of_stream:
                return await self._decide(picker, "request_headers")
            if self.mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED:
                return []                                   # answered with the pick, after the body
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse())]
        if kind == "request_body":
            self.body += req.request_body.body
            if not req.request_body.end_of_stream:
                if self.mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED:
                    return []
                return [ep.ProcessingResponse(request_body=ep.BodyResponse())]
            return await self._decide(picker, "request_body")
        if kind == "request_trailers":
            return [ep.ProcessingResponse(request_trailers=ep.TrailersResponse())]
        if kind == "response_headers":
            served = _served(req)
            if served and self.picked is not None and served != endpoint_of(self.picked[0]):
                log.debug("served by %s, picked %s", served, endpoint_of(self.picked[0]))
            if req.response_headers.end_of_stream:
                self.release(picker)
            return [ep.ProcessingResponse(response_headers=ep.HeadersResponse())]
        if kind == "response_body":
            chunk = req.response_body
            if chunk.end_of_stream:
                self.release(picker)
            if self.response_mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED:   # the body goes back through us
                return [ep.ProcessingResponse(response_body=ep.BodyResponse(response=ep.CommonResponse(
                    body_mutation=ep.BodyMutation(streamed_response=ep.StreamedBodyResponse(
                        body=chunk.body, end_of_stream=chunk.end_of_stream)))))]
            return [ep.ProcessingResponse(response_body=ep.BodyResponse())]
        if kind == "response_trailers":
            self.release(picker)
            return [ep.ProcessingResponse(response_trailers=ep.TrailersResponse())]
        return []

    async def _decide(self, picker: EndpointPicker, phase: str) -> list:
        try:
            self.picked = await picker.pick(self.headers, bytes(self.body), self.subset)
        except NoReplicaAvailable as e:
            self.finished = True
            return [unavailable_response(str(e))]
        endpoint = endpoint_of(self.picked[0])
        common, md = _pick_common(endpoint), _metadata(endpoint)
        if phase == "request_headers":
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=md)]
        if self.mode == pm.ProcessingMode.FULL_DUPLEX_STREAMED:
            body = ep.CommonResponse(body_mutation=ep.BodyMutation(
                streamed_response=ep.StreamedBodyResponse(body=bytes(self.body), end_of_stream=True)))
            return [ep.ProcessingResponse(request_headers=ep.HeadersResponse(response=common), dynamic_metadata=md),
                    ep.ProcessingResponse(request_body=ep.BodyResponse(response=body))]
        return [ep.ProcessingResponse(request_body=ep.BodyResponse(response=common), dynamic_metadata=md)]

    def release(self, picker: EndpointPicker) -> None:
        """The request is over (response complete, or the stream ended): out of flight, once."""
        if self.picked is not None:
            replica, rr = self.picked
            self.picked = None
            picker.done(replica, rr)


async def serve(picker: EndpointPicker, address: str):
    """A started grpc.aio server with the ext_proc service on `address` ("host:port");
    returns (server, bound port)."""
    import grpc
    server = grpc.aio.server()
    ep_grpc.add_ExternalProcessorServicer_to_server(ExtProcService(picker), server)
    port = server.add_insecure_port(address)
    await server.start()
    return server, port


__all__ = ["DEST", "EndpointPicker", "ExtProcService", "SERVED", "endpoint_of", "serve", "unavailable_response"]
