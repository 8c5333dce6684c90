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
import socket
import sys
import threading

from shepherd.config import INF, ConfigError, check_ranges
from shepherd.gateway.gateway_cli import INTERVALS
from shepherd.routing import POLICY_NAMES, parse_knobs
from shepherd.server import serve_cli
from shepherd.server.serve_cli import check_listen

EXIT_CONFIG = 2
PEER_ROUTERS = ("ray-power-of-two", "ray-prefix-cache")   # Ray's own routers (ray_serve.RAY_ROUTERS)
MAX_CPUS = 65536            # a finite bound: --num-cpus inf overflowed in fit_local, a traceback
ADDRESS_PROBE_S = 5.0       # Ray retries an address where nothing listens for ~160 s before it fails

# (flag, lowest, highest, strict[, unit]), checked before Ray starts (config.check_ranges). Ray
# refused most of these only once the application was built, as a many-line pydantic error
# (--upscale-delay -1, --routing-stats-period 0, --ingress-replicas -1), or never: NaN reached
# fit_local's floor(), and a negative delay or target without autoscaling was ignored
RAY_RANGES = [("num_cpus", 0, MAX_CPUS, True, "CPUs"), ("num_cpus_per_replica", 0, MAX_CPUS, False, "CPUs"),
              ("min_replicas", 0, INF, False), ("max_replicas", 1, INF, False),
              ("target_ongoing_requests", 0, INF, True), ("upscale_delay", 0, INF, False, "seconds"),
              ("downscale_delay", 0, INF, False, "seconds"), ("max_ongoing_requests", 1, INF, False),
              ("ingress_replicas", 1, INF, False), ("retries", 0, INF, False),
              ("routing_stats_period", 0, INF, True, "seconds"),
              *[r for r in INTERVALS if r[0] == "read_timeout"]]
AUTOSCALING_FLAGS = ("target_ongoing_requests", "upscale_delay", "downscale_delay")


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
    # None unless given, so that one given without autoscaling is refused rather than ignored
    r.add_argument("--target-ongoing-requests", type=float, default=None,
                   help="autoscaling: requests per replica the autoscaler aims at (default 16)")
    r.add_argument("--upscale-delay", type=float, default=None,
                   help="autoscaling: seconds before scaling up (default 30)")
    r.add_argument("--downscale-delay", type=float, default=None,
                   help="autoscaling: seconds before scaling down (default 600)")
    r.add_argument("--max-ongoing-requests", type=int, default=None,
                   help="requests Ray sends one replica at once (default: --max-concurrency)")
    r.add_argument("--max-queued-requests", type=int, default=None,
                   help="requests waiting for a replica in each ingress; past it 429; -1: no limit "
                        "(default: --max-queue)")
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
    scaling = {field: getattr(args, flag) for flag, field in zip(
        AUTOSCALING_FLAGS, ("target_ongoing_requests", "upscale_delay_s", "downscale_delay_s"))
        if getattr(args, flag) is not None}
    return RayServeOptions(
        replicas=args.replicas, router=args.router,
        num_cpus_per_replica=1.0 if args.num_cpus_per_replica is None else args.num_cpus_per_replica,
        router_knobs=parse_knobs(args.router_knob), min_replicas=args.min_replicas,
        max_replicas=args.max_replicas, **scaling,
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


def check_flags(args: argparse.Namespace) -> None:
    """The Ray flags that need no Ray: ranges, the address's form, the route prefix and the
    application name, each refused here rather than by Ray after it started. Raises ConfigError."""
    check_ranges(args, RAY_RANGES)
    autoscaling = args.min_replicas is not None or args.max_replicas is not None
    given = [f"--{name.replace('_', '-')}" for name in AUTOSCALING_FLAGS if getattr(args, name) is not None]
    if given and not autoscaling:
        raise ConfigError(f"{', '.join(given)} {'applies' if len(given) == 1 else 'apply'} only with autoscaling: "
                          "give --min-replicas and/or --max-replicas too")
    if args.num_cpus is not None and args.address != "local":
        raise ConfigError(f"--num-cpus sizes the Ray that --address local starts; the cluster at "
                          f"--address {args.address} has its own CPUs")
    address_target(args.address)
    check_route_prefix(args.route_prefix)
    # Ray joins the application name and a replica's into its replica ids with '#', and parses them back
    if not args.app_name.strip() or "#" in args.app_name:
        raise ConfigError(f"--app-name must be non-empty and without '#', got {args.app_name!r}")


def check_route_prefix(prefix: str) -> None:
    """Ray Serve's rules for a route prefix, which serve.run applies only after Ray has started."""
    if not prefix.startswith("/") or (prefix != "/" and prefix.endswith("/")) or "{" in prefix or "}" in prefix:
        raise ConfigError(f"--route-prefix must start with '/', not end with one (but '/' itself) and hold no "
                          f"'{{' or '}}', got {prefix!r}")


def address_target(address: str) -> "tuple[str, int] | None":
    """(host, port) that --address names, or None where Ray finds the cluster itself (local, auto)
    or another client protocol owns the address. Raises ConfigError on a malformed one."""
    scheme, sep, rest = address.rpartition("://")
    if address in ("local", "auto") or (sep and scheme != "ray"):
        return None
    host, colon, port = rest.rpartition(":")
    if not colon:                                   # ray://HOST: the Ray Client's default port
        host, port = rest, "10001" if sep else ""
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(f"--address must be local, auto, HOST:PORT or ray://HOST[:PORT], got {address!r}")
    return host.strip("[]"), int(port)


def probe_address(address: str, timeout: float = ADDRESS_PROBE_S) -> None:
    """Connect to the cluster's port once, so that an address where nothing listens is one line
    within `timeout` seconds rather than Ray's ~160 s of retries and a traceback."""
    target = address_target(address)
    if target is None:
        return
    try:
        socket.create_connection(target, timeout=timeout).close()
    except OSError as e:
        raise ConfigError(f"--address {address}: nothing answers at {target[0]}:{target[1]} "
                          f"({e.strerror or e}); is a Ray cluster's head there?") from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        import ray  # noqa: F401
        from ray import serve
    except ImportError:
        print("shepherd ray-serve: error: Ray is not installed; pip install 'shepherd[ray]'", file=sys.stderr)
        return EXIT_CONFIG
    from shepherd.deploy.ray_serve import build_app, deploy
    try:
        check_flags(args)
        opts = options_from(args)
        if args.address == "local":
            fit_local(opts, args.num_cpus if args.num_cpus is not None else float(os.cpu_count() or 1),
                      chosen=args.num_cpus_per_replica is not None)
        build_app(opts, args)            # every flag checked before Ray starts
        if args.address == "local" and args.proxy_location != "Disabled":
            check_listen(args.host, args.port)   # a taken port: Ray's proxy failed with a traceback
        probe_address(args.address)
    except (ConfigError, ValueError) as e:
        print(f"shepherd ray-serve: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    stop = threading.Event()
    try:
        try:
            deploy(opts, args, address=args.address, host=args.host, port=args.port, app_name=args.app_name,
                   route_prefix=args.route_prefix, proxy_location=args.proxy_location, num_cpus=args.num_cpus)
        except ConnectionError as e:     # a cluster that answers the probe but is not (or no longer) Ray's
            print(f"shepherd ray-serve: error: --address {args.address}: {e}", file=sys.stderr)
            return EXIT_CONFIG
        # only now: ray.init puts its own SIGTERM handler (sys.exit) in place of one set before it
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        print(f"shepherd ray-serve: {args.replicas} replica(s) of {opts.num_cpus_per_replica:g} CPU, router "
              f"{args.router}, serving on "
              f"http://{args.host}:{args.port}{args.route_prefix.rstrip('/')}/v1", flush=True)
        stop.wait()
    except KeyboardInterrupt:            # Ctrl-C while Ray starts
        return 130
    finally:
        if ray.is_initialized():         # else serve.delete would start a local Ray to delete from
            try:
                serve.delete(args.app_name)
            except Exception:  # noqa: BLE001 - Ray may already be gone
                pass
            ray.shutdown()
    return 0
