"""One shepherd replica inside a Ray Serve deployment.

A replica is what `shepherd serve` runs, minus uvicorn: the engine (with its
engine-core process, built from the same flags by serve_cli) and shepherd's
own OpenAI app (`server/openai_api.build_app`), whose lifespan the replica
runs as uvicorn would (the engine's start and stop, the warm grammar worker). The ingress forwards each
HTTP request as an `HttpCall`; `serve_http` runs it through that app in
process and streams the app's ASGI messages back, so validation, 4xx bodies,
429 with Retry-After, auth and SSE are the server's code, unchanged.

Ray reads `record_routing_stats()` (running, waiting, KV use, prefix-cache
counters) for the router, and `check_health()` (the engine-core process is
alive) to replace a replica whose core died. With `http=True` the replica
also serves its app on a port of its own node (its URL is in the routing
stats), so a `shepherd gateway` or a benchmark can reach the same replicas
directly. With `kv_events=True` (the router's policy reads KV events:
precise-prefix) its engine publishes them (vLLM's ZMQ stream, docs/ROUTING.md)
on two free ports of its node, named in the routing stats, where the router
subscribes.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import time
from typing import AsyncIterator, Optional

from shepherd.bench.loadgen import free_port
from shepherd.deploy.ray_call import HttpCall
from shepherd.server import serve_cli
from shepherd.server.http_head import head_bounded

log = logging.getLogger("shepherd.deploy")

REPLICA_HEADER = b"x-shepherd-replica"


def parse_serve_args(argv: "list[str] | argparse.Namespace") -> argparse.Namespace:
    """`shepherd serve` flags (a list of strings, or an already parsed namespace) -> namespace."""
    if isinstance(argv, argparse.Namespace):
        return argv
    p = argparse.ArgumentParser(prog="shepherd serve", add_help=False)
    serve_cli.add_arguments(p)
    return p.parse_args(list(argv))


def with_kv_events(args: argparse.Namespace, host: str) -> tuple[argparse.Namespace, dict]:
    """The replica's flags with KV events published on two free ports of this node (the user's
    own --kv-events-config fields kept, its endpoints replaced: replicas may share a node), and
    where a subscriber finds them."""
    pub, replay = free_port(), free_port()
    cfg = json.loads(args.kv_events_config) if args.kv_events_config else {}
    cfg.update(enable_kv_cache_events=True, publisher="zmq", endpoint=f"tcp://*:{pub}",
               replay_endpoint=f"tcp://*:{replay}")
    out = argparse.Namespace(**{**vars(args), "kv_events_config": json.dumps(cfg)})
    return out, {"kv_events": f"tcp://{host}:{pub}", "kv_replay": f"tcp://{host}:{replay}",
                 "kv_topic": cfg.get("topic", "")}


class _Lifespan:
    """An ASGI app's lifespan, driven as a server drives it: startup, then shutdown."""

    def __init__(self, app) -> None:
        self.app = app
        self._inbox: asyncio.Queue = asyncio.Queue()
        self._replies: asyncio.Queue = asyncio.Queue()
        self._task: Optional[asyncio.Future] = None

    async def _say(self, kind: str, timeout: float) -> None:
        await self._inbox.put({"type": f"lifespan.{kind}"})
        reply = asyncio.ensure_future(self._replies.get())
        await asyncio.wait({reply, self._task}, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
        if not reply.done():                     # the app ended (it raised) or took too long
            reply.cancel()
            why = repr(self._task.exception()) if self._task.done() and not self._task.cancelled() else "timeout"
            raise RuntimeError(f"shepherd's app did not complete its {kind}: {why}")
        if reply.result()["type"] != f"lifespan.{kind}.complete":
            raise RuntimeError(f"shepherd's app failed its {kind}: {reply.result().get('message', '')}")

    async def startup(self, timeout: float = 300.0) -> None:
        self._task = asyncio.ensure_future(self.app({"type": "lifespan", "asgi": {"version": "3.0"}, "state": {}},
                                                    self._inbox.get, self._replies.put))
        await self._say("startup", timeout)

    async def shutdown(self, timeout: float = 30.0) -> None:
        if self._task is None or self._task.done():
            return
        try:
            await self._say("shutdown", timeout)
        finally:
            if not self._task.done():
                self._task.cancel()


class ShepherdReplica:
    """The Ray Serve deployment class (ray_serve.py wraps it with `serve.deployment`)."""

    async def __init__(self, serve_args: "list[str] | argparse.Namespace", http: bool = False,
                       kv_events: bool = False) -> None:
        from ray import serve
        from ray.serve.exceptions import RayServeException

        from shepherd.server.openai_api import build_app

        try:
            self.replica_id = serve.get_replica_context().replica_id.unique_id
            import ray
            self.node_id, host = ray.get_runtime_context().get_node_id(), ray.util.get_node_ip_address()
        except RayServeException:
            # outside Ray Serve (tests build the class directly); never touch Ray's runtime
            # then: asking it for a node id would start a local Ray instance
            self.replica_id, self.node_id, host = "local", "", "127.0.0.1"
        args = parse_serve_args(serve_args)
        self.kv_events: dict = {}
        if kv_events:
            args, self.kv_events = with_kv_events(args, host)
        eng_cfg, srv_cfg = serve_cli.build_configs(args)
        # built on this (Ray's user-code) thread, which lives as long as the replica: the
        # engine-core process dies with the thread that started it (PR_SET_PDEATHSIG)
        self.engine = serve_cli.build_engine(args, eng_cfg)
        self.app = build_app(self.engine, srv_cfg)
        # the app's own startup, as uvicorn runs it for `shepherd serve`: the engine, and the grammar
        # check's worker process started warm (started on the first grammar request instead, its
        # seconds of imports landed beside the engine on the request path: a 0.6 s gap in an
        # innocent stream under tests/test_ray_stall.py's enum attack)
        self._lifespan = _Lifespan(self.app)
        await self._lifespan.startup()
        self.url: Optional[str] = None
        self._http = None
        if http:
            await self._serve_http_port()

    async def _serve_http_port(self) -> None:
        import ray
        import uvicorn
        host = ray.util.get_node_ip_address()
        server = uvicorn.Server(uvicorn.Config(self.app, host=host, port=0, log_level="warning",
                                               lifespan="off", access_log=False, http=head_bounded()))
        task = asyncio.ensure_future(server.serve())
        deadline = time.monotonic() + 30.0
        while not server.started:
            if task.done() or time.monotonic() > deadline:
                raise RuntimeError(f"the replica's HTTP server did not start on {host}")
            await asyncio.sleep(0.01)
        self._http = (server, task)
        port = server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://{host}:{port}"

    # ------------------------------------------------------------------ Ray Serve hooks
    def record_routing_stats(self) -> dict:
        st = self.engine.stats()
        return {"running": st.num_running, "waiting": st.num_waiting + st.num_swapped,
                "kv_usage": st.kv_used / st.kv_capacity if st.kv_capacity else 0.0,
                "prefix_hit_tokens": st.prefix_hit_tokens, "prefix_query_tokens": st.prefix_query_tokens,
                "alive": self.engine.alive, "url": self.url, "node": self.node_id, "at": time.time(),
                **self.kv_events}

    def check_health(self) -> None:
        if not self.engine.alive:
            raise RuntimeError(f"shepherd engine not running: {self.engine.dead_reason or 'unknown'}")

    async def __del__(self) -> None:
        if self._http is not None:
            self._http[0].should_exit = True
        await self._lifespan.shutdown()
        await self.engine.stop()            # a no-op once the app's shutdown stopped it

    # ------------------------------------------------------------------ requests
    async def serve_http(self, call: HttpCall) -> AsyncIterator[list]:
        """Run one request through shepherd's app; yield its ASGI messages (batched as they come).
        A cancelled call (the ingress's client left) is a disconnect for the app, which aborts
        the engine request."""
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "scheme": "http",
                 "method": call.method, "path": call.path, "raw_path": call.path.encode(), "root_path": "",
                 "query_string": call.query_string, "headers": list(call.headers),
                 "client": None, "server": None, "state": {}}
        out: asyncio.Queue = asyncio.Queue()
        gone = asyncio.Event()
        body_sent = False

        async def receive() -> dict:
            nonlocal body_sent
            if not body_sent:
                body_sent = True
                return {"type": "http.request", "body": call.body, "more_body": False}
            await gone.wait()
            return {"type": "http.disconnect"}

        async def send(msg: dict) -> None:
            if msg["type"] == "http.response.start":
                headers = list(msg.get("headers") or []) + [(REPLICA_HEADER, self.replica_id.encode())]
                msg = dict(msg, headers=headers)
            out.put_nowait(msg)

        task = asyncio.ensure_future(self.app(scope, receive, send))
        task.add_done_callback(lambda _t: out.put_nowait(None))
        try:
            while True:
                batch = [await out.get()]
                while not out.empty():
                    batch.append(out.get_nowait())
                msgs = [m for m in batch if m is not None]
                if msgs:
                    yield msgs
                if batch[-1] is None:
                    break
            task.result()           # an error inside the app surfaces to the ingress
        finally:
            gone.set()
            if not task.done():
                task.cancel()
