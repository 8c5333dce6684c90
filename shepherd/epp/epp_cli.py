"""`shepherd epp`: pick endpoints for Envoy (or any proxy speaking ext_proc), as GIE's EPP does.

    shepherd epp --endpoint 10.0.0.5:8000 --endpoint 10.0.0.6:8000 --policy weighted --port 9002
    shepherd epp --endpoint-file pool.txt --policy precise-prefix \\
        --kv-events 10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558

Endpoints are model servers (shepherd, vLLM, SGLang): their /health drives readiness and
their /metrics (vLLM or SGLang names) the load the policies read, as in `shepherd gateway`.
A configuration error is one clear line and exit status 2.
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from shepherd.routing import POLICY_NAMES

EXIT_CONFIG = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", action="append", default=[], metavar="HOST:PORT",
                   help="a model server (repeat), e.g. 10.0.0.5:8000")
    p.add_argument("--endpoint-file", default=None, metavar="FILE",
                   help="one HOST:PORT (or URL) per line, or a JSON list; re-read when it changes")
    p.add_argument("--policy", default="weighted", help=f"routing policy: {', '.join(POLICY_NAMES)} (default %(default)s)")
    p.add_argument("--policy-knob", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--scorer-weights", default=None, metavar="S=W,...", help="weighted policy: e.g. precise=2,load=1")
    p.add_argument("--kv-events", action="append", default=[], metavar="HOST:PORT=tcp://HOST:PORT[,replay=...]",
                   help="an endpoint's KV-event stream (vLLM's ZMQ protocol), for precise-prefix")
    p.add_argument("--tokenizer", default="backend", metavar="backend|default|PATH",
                   help="prompt token ids for KV-event policies: an endpoint's /tokenize (default) or this tokenizer")
    p.add_argument("--host", default="0.0.0.0", help="gRPC bind address (default %(default)s)")
    p.add_argument("--port", type=int, default=9002, help="gRPC port (default %(default)s, GIE's)")
    p.add_argument("--metrics-interval", type=float, default=0.05,
                   help="seconds between endpoint /metrics scrapes (default %(default)s, llm-d's 50 ms)")
    p.add_argument("--health-interval", type=float, default=1.0)
    p.add_argument("--log-level", default="warning", choices=["debug", "info", "warning", "error"])


def build_picker(args: argparse.Namespace):
    """(EndpointPicker, httpx client) from parsed arguments; ValueError on a bad configuration."""
    from shepherd.config import check_ranges
    from shepherd.gateway.gateway_cli import INTERVALS
    from shepherd.server.serve_cli import check_port
    check_port(args.port)
    check_ranges(args, [r for r in INTERVALS if r[0] in ("health_interval", "metrics_interval")])
    import httpx

    from shepherd.epp.picker import EndpointPicker
    from shepherd.gateway.backends import BackendPool, HealthConfig
    from shepherd.gateway.gateway_cli import policy_from_args
    from shepherd.gateway.kv_routing import KVRouting
    policy = policy_from_args(args)
    pool = BackendPool(args.endpoint, backend_file=args.endpoint_file,
                       health=HealthConfig(metrics_interval=args.metrics_interval,
                                           health_interval=args.health_interval))
    if not pool.backends() and not args.endpoint_file:
        raise ValueError("give at least one --endpoint HOST:PORT or an --endpoint-file")
    kv = None
    if args.kv_events or getattr(policy, "kv_index", None) is not None:
        kv = KVRouting(policy, args.kv_events, args.tokenizer)
    client = httpx.AsyncClient(timeout=2.0, trust_env=False)
    return EndpointPicker(pool, policy, kv, client), client


async def _run(args, picker, client) -> None:
    from shepherd.epp.picker import serve
    await picker.pool.start()
    if picker.kv is not None:
        await picker.kv.start()
    server, port = await serve(picker, f"{args.host}:{args.port}")
    print(f"shepherd epp: {picker.policy.name} over {len(picker.pool.backends())} endpoint(s), ext_proc on "
          f"{args.host}:{port}", file=sys.stderr, flush=True)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        await server.stop(1.0)
        if picker.kv is not None:
            await picker.kv.stop()
        await picker.pool.stop()
        await client.aclose()


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        picker, client = build_picker(args)
    except ModuleNotFoundError as e:
        print(f"shepherd epp: needs the epp extra (pip install -e '.[epp]'): {e}", file=sys.stderr)
        return EXIT_CONFIG
    except (ValueError, OSError) as e:
        print(f"shepherd epp: {e}", file=sys.stderr)
        return EXIT_CONFIG
    asyncio.run(_run(args, picker, client))
    return 0
