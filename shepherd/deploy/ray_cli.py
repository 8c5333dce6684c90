"""`shepherd ray-serve [MODEL]`: shepherd replicas on a Ray cluster, behind Ray Serve.

    shepherd ray-serve --address local --replicas 2 --router cache-aware --port 8000
    shepherd ray-serve --address ray://head:10001 --replicas 8 --num-cpus-per-replica 4 \\
        --router prefix-aware --router-knob block_size=64
    shepherd ray-serve --min-replicas 1 --max-replicas 8 --target-ongoing-requests 16 ...

Every `shepherd serve` flag is accepted and given to each replica (model,
KV size, scheduling, --executor sim, --api-key, ...); --host/--port are where
Ray Serve's HTTP proxy listens. The command runs until Ctrl-C, then deletes
the application (and stops Ray when it started it: --address local).
A configuration error is one clear line and exit status 2; without Ray
installed (`pip install 'shepherd[ray]'`) it says so.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from shepherd.routing import POLICY_NAMES, parse_knobs
from shepherd.server import serve_cli

EXIT_CONFIG = 2
PEER_ROUTERS = ("ray-power-of-two", "ray-prefix-cache")   # Ray's own routers (ray_serve.RAY_ROUTERS)


def add_arguments(p: argparse.ArgumentParser) -> None:
    serve_cli.add_arguments(p)
    r = p.add_argument_group("Ray Serve")
    r.add_argument("--address", default="local",
                   help="Ray cluster to join (e.g. ray://head:10001, or auto), or 'local' to start one here "
                        "(default %(default)s)")
    r.add_argument("--num-cpus", type=float, default=None,
                   help="--address local: CPUs the local Ray instance offers (default: all)")
    r.add_argument("--replicas", type=int, default=1, help="shepherd replicas (with autoscaling: the initial count)")
    r.add_argument("--num-cpus-per-replica", type=float, default=1.0,
                   help="CPUs Ray reserves for each replica (default %(default)s)")
    r.add_argument("--router", default="least-request",
                   help=f"routing policy: {', '.join(POLICY_NAMES)}; or Ray's own: {', '.join(PEER_ROUTERS)} "
                        "(default %(default)s)")
    r.add_argument("--router-knob", action="append", default=[], metavar="NAME=VALUE",
                   help="a knob of the policy (repeatable); `shepherd gateway --list-knobs` shows them")
    r.add_argument("--min-replicas", type=int, default=None, help="autoscaling: fewest replicas")
    r.add_argument("--max-replicas", type=int, default=None, help="autoscaling: most replicas")
    r.add_argument("--target-ongoing-requests", type=float, default=16.0,
                   help="autoscaling: requests per replica the autoscaler aims at (default %(default)s)")
    r.add_argument("--upscale-delay", type=float, default=30.0, help="autoscaling: seconds before scaling up")
    r.add_argument("--downscale-delay", type=float, default=600.0, help="autoscaling: seconds before scaling down")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests Ray sends one replica at once (default: --max-concurrency)")
    r.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for a replica in each ingress; past it 429 (default: --max-queue)")
    r.add_argument("--ingress-replicas", type=int, default=1, help="ingress replicas (each routes on its own)")
    r.add_argument("--retries", type=int, default=2,
                   help="extra attempts on other replicas before the first byte (default %(default)s)")
    r.add_argument("--read-timeout", type=float, default=120.0,
                   help="longest wait for a replica's next message, seconds (default %(default)s)")
    r.add_argument("--routing-stats-period", type=float, default=1.0,
                   help="seconds between the replicas' routing stats (running, waiting, KV use)")
    r.add_argument("--replica-http", action="store_true",
                   help="each replica also serves its own OpenAI app on its node (URL in /metrics)")
    r.add_argument("--proxy-location", choices=["EveryNode", "HeadOnly", "Disabled"], default=None,
                   help="where Ray Serve runs HTTP proxies (default: Ray's, every node)")
    r.add_argument("--app-name", default="shepherd", help="Ray Serve application name")
    r.add_argument("--route-prefix", default="/", help="HTTP route prefix of the application")


def options_from(args: argparse.Namespace):
    """RayServeOptions from parsed flags (imports Ray)."""
    from shepherd.deploy.ray_ingress import IngressConfig
    from shepherd.deploy.ray_serve import RayServeOptions
    return RayServeOptions(
        replicas=args.replicas, num_cpus_per_replica=args.num_cpus_per_replica, router=args.router,
        router_knobs=parse_knobs(args.router_knob), min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
        max_ongoing_requests=args.max_ongoing_requests, max_queued_requests=args.max_queued_requests,
        ingress_replicas=args.ingress_replicas, routing_stats_period_s=args.routing_stats_period,
        replica_http=args.replica_http,
        ingress=IngressConfig(retries=args.retries, read_timeout=args.read_timeout))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        print("shepherd ray-serve: error: Ray is not installed; pip install 'shepherd[ray]'", file=sys.stderr)
        return EXIT_CONFIG
    from shepherd.config import ConfigError
    from shepherd.deploy.ray_serve import build_app, deploy
    try:
        opts = options_from(args)
        build_app(opts, args)            # every flag checked before Ray starts
    except (ConfigError, ValueError) as e:
        print(f"shepherd ray-serve: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    try:
        deploy(opts, args, address=args.address, host=args.host, port=args.port, app_name=args.app_name,
               route_prefix=args.route_prefix, proxy_location=args.proxy_location, num_cpus=args.num_cpus)
        print(f"shepherd ray-serve: {args.replicas} replica(s), router {args.router}, serving on "
              f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}/v1", flush=True)
        stop.wait()
    finally:
        try:
            serve.delete(args.app_name)
        except Exception:  # noqa: BLE001 - Ray may already be gone
            pass
        ray.shutdown()
    return 0
