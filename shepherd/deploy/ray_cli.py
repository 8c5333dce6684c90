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
import math
import os
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
    r.add_argument("--num-cpus-per-replica", type=float, default=None,
                   help="CPUs Ray reserves for each replica (default 1; with --address local, at most the "
                        "share of the local Ray's CPUs that lets every replica and the ingress start)")
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
        replicas=args.replicas, router=args.router,
        num_cpus_per_replica=1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica,
        router_knobs=parse_knobs(args.router_knob), min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, target_ongoing_requests=args.target_ongoing_requests,
        upscale_delay_s=args.upscale_delay, downscale_delay_s=args.downscale_delay,
        max_ongoing_requests=args.max_ongoing_requests, max_queued_requests=args.max_queued_requests,
        ingress_replicas=args.ingress_replicas, routing_stats_period_s=args.routing_stats_period,
        replica_http=args.replica_http,
        ingress=IngressConfig(retries=args.retries, read_timeout=args.read_timeout))


def fit_local(opts, have: float, chosen: bool) -> None:
    """--address local: the first replicas and the ingress must fit the CPUs the local Ray offers
    (`have`), or Ray waits for CPUs forever and the command never answers (`--replicas 2` on a
    2-CPU machine needs 2.25). A reservation the user did not choose becomes each replica's share
    of what the ingress leaves, at most 1; one they chose is checked. Raises ConfigError."""
    from shepherd.config import ConfigError
    n = max(opts.replicas, 1)
    ingress = opts.ingress_replicas * opts.ingress_num_cpus
    fit = max(0.0, min(1.0, math.floor((have - ingress) / n * 100) / 100))
    if not chosen:
        opts.num_cpus_per_replica = fit
    need = n * opts.num_cpus_per_replica + ingress
    if need > have + 1e-9:
        raise ConfigError(f"{n} replica(s) x {opts.num_cpus_per_replica:g} CPU + {opts.ingress_replicas} ingress x "
                          f"{opts.ingress_num_cpus:g} CPU need {need:g} CPUs, more than the {have:g} the local Ray "
                          f"offers (--num-cpus, default this machine's), so Ray would wait for them forever: "
                          + (f"--num-cpus-per-replica {fit:g} fits, or fewer --replicas" if have > ingress
                             else "fewer --ingress-replicas"))


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
        if args.address == "local":
            fit_local(opts, args.num_cpus if args.num_cpus is not None else float(os.cpu_count() or 1),
                      chosen=args.num_cpus_per_replica is not None)
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
        print(f"shepherd ray-serve: {args.replicas} replica(s) of {opts.num_cpus_per_replica:g} CPU, router "
              f"{args.router}, serving on "
              f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}/v1", flush=True)
        stop.wait()
    finally:
        try:
            serve.delete(args.app_name)
        except Exception:  # noqa: BLE001 - Ray may already be gone
            pass
        ray.shutdown()
    return 0
