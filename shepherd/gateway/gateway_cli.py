"""`shepherd gateway`: route OpenAI requests across replicas.

    shepherd gateway --backend http://127.0.0.1:8001 --backend http://127.0.0.1:8002 \\
        --policy prefix-aware --port 8000
    shepherd gateway --backend-file backends.txt --policy weighted --scorer-weights prefix=2,load=1
    shepherd gateway ... --policy prefix-aware --policy-knob block_size=64 --policy-knob imbalance_abs_count=16
    shepherd gateway --backend http://h1:8000 --backend http://h2:8000 --policy precise-prefix \
        --kv-events http://h1:8000=tcp://h1:5557,replay=tcp://h1:5558 --kv-events http://h2:8000=tcp://h2:5557

A configuration error is one clear line and exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import os
import sys

from shepherd.config import INF, check_ranges
from shepherd.routing import POLICY_NAMES, make_policy, parse_knobs, policy_knobs
from shepherd.server.http_head import head_bounded
from shepherd.server.serve_cli import DOOR_RANGES, add_door_flags, add_flags, check_listen, check_port

EXIT_CONFIG = 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    from shepherd.gateway.app import GatewayConfig
    from shepherd.gateway.backends import HealthConfig
    g, h = GatewayConfig(), HealthConfig()
    p.add_argument("--backend", action="append", default=[], metavar="URL",
                   help="a replica's base URL (repeat for several), e.g. http://127.0.0.1:8001")
    p.add_argument("--backend-file", default=None, metavar="FILE",
                   help="file with one backend URL per line (or a JSON list); re-read when it changes")
    p.add_argument("--policy", default="least-request",
                   help=f"routing policy: {', '.join(POLICY_NAMES)} (default %(default)s, as `shepherd simulate --router`)")
    p.add_argument("--policy-knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a knob of the policy (repeatable); `--list-knobs` shows them")
    p.add_argument("--scorer-weights", default=None, metavar="S=W,...",
                   help="weighted policy: scorer weights, e.g. prefix=2,queue=1,kv=1,load=1")
    p.add_argument("--kv-events", action="append", default=[], metavar="URL=tcp://HOST:PORT[,replay=tcp://HOST:PORT]",
                   help="subscribe to a backend's KV events (vLLM's ZMQ stream; repeat per backend) for "
                        "precise-prefix (or weighted with a precise weight)")
    p.add_argument("--tokenizer", default="backend", metavar="backend|default|PATH",
                   help="how the gateway gets a prompt's token ids for KV-event routing: a backend's /tokenize "
                        "(default), or this tokenizer (a .gguf / Hugging Face folder; 'default': the default model)")
    p.add_argument("--list-knobs", action="store_true", help="print every policy's knobs and exit")
    add_door_flags(p, 8000, g.max_body_bytes, g.body_timeout, "warning")
    p.add_argument("--connect-timeout", type=float, default=g.connect_timeout)
    add_flags(p, [
        ("--backend-api-key", str, os.environ.get("SHEPHERD_BACKEND_API_KEY"),
         "the key sent to the backends instead of the client's Authorization header "
         "(default: $SHEPHERD_BACKEND_API_KEY, else the client's header goes on)"),
        ("--admin-key", str, os.environ.get("SHEPHERD_ADMIN_KEY"),
         "turn /admin/backends on, for 'Authorization: Bearer KEY' only (default: $SHEPHERD_ADMIN_KEY, "
         "else the admin endpoints are off)"),
        ("--retries", int, g.retries, "extra attempts on other replicas, only where safe (docs/ROUTING.md)"),
        ("--retry-backoff", float, g.retry_backoff, "seconds before the first retry, doubling"),
        ("--read-timeout", float, g.read_timeout,
         "longest silence from a backend, seconds; then 504, not retried and not held against the replica"),
        ("--stall-timeout", float, h.stall_timeout,
         "a replica that sends nothing (health or traffic) this long counts as failing; a slow /health does not"),
        ("--fail-threshold", int, h.fail_threshold, "consecutive failures that eject a backend"),
        ("--success-threshold", int, h.success_threshold, "consecutive good health checks that re-admit it"),
        ("--health-interval", float, h.health_interval, "seconds between health checks"),
        ("--metrics-interval", float, h.metrics_interval, "seconds between backend /metrics scrapes, 0 = off"),
    ])


def policy_from_args(args: argparse.Namespace):
    """The routing policy named by --policy, --policy-knob and --scorer-weights (the gateway's and the EPP's)."""
    knobs = parse_knobs(args.policy_knob)
    if args.scorer_weights is not None:
        knobs["weights"] = args.scorer_weights
    return make_policy(args.policy, **knobs)


# seconds flags: 0 would time out every request or turn the health checks off without a word (only
# --metrics-interval and --retry-backoff take 0, as off); epp checks its two intervals the same way
INTERVALS = [("connect_timeout", 0, INF, True, "seconds"), ("read_timeout", 0, INF, True, "seconds"),
             ("health_interval", 0, INF, True, "seconds"), ("retry_backoff", 0, INF, False, "seconds"),
             ("metrics_interval", 0, INF, False, "seconds")]


def build_gateway(args: argparse.Namespace):
    """(Gateway, policy name) from parsed arguments; ValueError on a bad configuration."""
    from shepherd.gateway.app import Gateway, GatewayConfig
    from shepherd.gateway.backends import BackendPool, HealthConfig
    from shepherd.gateway.kv_routing import KVRouting
    check_port(args.port)
    policy = policy_from_args(args)
    check_ranges(args, DOOR_RANGES + INTERVALS + [("retries", 0, INF, False), ("fail_threshold", 1, INF, False),
                                                  ("success_threshold", 1, INF, False),
                                                  ("stall_timeout", 0, INF, True, "seconds")])
    health = HealthConfig(fail_threshold=args.fail_threshold, success_threshold=args.success_threshold,
                          health_interval=args.health_interval, metrics_interval=args.metrics_interval,
                          stall_timeout=args.stall_timeout)
    pool = BackendPool(args.backend, health=health, backend_file=args.backend_file)
    if not pool.backends() and not args.backend_file:
        raise ValueError("give at least one --backend URL or a --backend-file")
    cfg = GatewayConfig(retries=args.retries, retry_backoff=args.retry_backoff,
                        connect_timeout=args.connect_timeout, read_timeout=args.read_timeout,
                        max_body_bytes=args.max_body_bytes, body_timeout=args.body_timeout,
                        api_key=args.api_key or None, backend_api_key=args.backend_api_key or None,
                        admin_key=args.admin_key or None)
    kv = None
    if args.kv_events or getattr(policy, "kv_index", None) is not None:
        kv = KVRouting(policy, args.kv_events, args.tokenizer)
    return Gateway(pool, policy, cfg, kv=kv), policy.name


def main(args: argparse.Namespace) -> int:
    if args.list_knobs:
        for name in POLICY_NAMES:
            knobs = ", ".join(f"{k}={v!r}" for k, v in policy_knobs(name).items()) or "-"
            print(f"{name}: {knobs}")
        return 0
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        gw, pname = build_gateway(args)
        check_listen(args.host, args.port)      # a taken port: this one line, not uvicorn's exit 3
    except (ValueError, OSError) as e:
        print(f"shepherd gateway: {e}", file=sys.stderr)
        return EXIT_CONFIG
    import uvicorn
    keys = ", API key required" if args.api_key else ""
    keys += ", admin endpoints on" if args.admin_key else ""
    print(f"shepherd gateway: {pname} over {len(gw.pool.backends())} backend(s) "
          f"on http://{args.host}:{args.port}{keys}", file=sys.stderr, flush=True)
    from shepherd.server.guard import settle_heap
    settle_heap()       # as serve does: the startup heap frozen (its imports alone: ~40 ms a full collection)
    uvicorn.run(gw, host=args.host, port=args.port, log_level=args.log_level, access_log=False,
                lifespan="on", timeout_keep_alive=30, http=head_bounded(args.header_timeout))
    return 0
