"""shepherd on Ray Serve, as a library.

    from ray import serve
    from shepherd.deploy.ray_serve import RayServeOptions, build_app

    app = build_app(RayServeOptions(replicas=2, router="cache-aware"), ["--executor", "sim"])
    serve.run(app, name="shepherd", route_prefix="/")      # OpenAI API on Serve's HTTP port

`build_app` returns a Ray Serve application: an ingress deployment
(ray_ingress.py) bound to a deployment of shepherd replicas (ray_replica.py)
whose request router is a shepherd routing policy (ray_router.py). The
second argument is `shepherd serve`'s flags, given to every replica. Bind it
into a larger application, or `serve.run` it under a route prefix of your
own. `deploy` starts (or joins) Ray and Serve and runs it; `shepherd
ray-serve` is `deploy` from the command line.

Pinned to the Ray version in pyproject.toml: the request-router API
(`RequestRouter`, `choose_replicas`, `record_routing_stats`,
`RequestRouterConfig`) is alpha.
"""
from __future__ import annotations

import argparse
from dataclasses import dataclass, field
from typing import Any, Optional

from shepherd.config import INF, check_ranges
from shepherd.deploy.ray_ingress import IngressConfig, ShepherdIngress
from shepherd.deploy.ray_replica import ShepherdReplica, parse_serve_args
from shepherd.deploy.ray_router import ShepherdRouter
from shepherd.routing import make_policy
from shepherd.server import serve_cli

# Ray's own routers, the peers of shepherd's policies (benchmarks/ray_serve.py). The public
# `ray.serve.llm.request_router` path imports ray[llm]'s dependencies (pyarrow, ...); the class
# itself does not need them.
RAY_ROUTERS = {
    "ray-power-of-two": None,       # Ray Serve's default router
    "ray-prefix-cache": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
                        "PrefixCacheAffinityRouter",
}


# (attribute, lowest, highest, strict[, unit]) of config.check_ranges, for RayServeOptions.validate
OPTION_RANGES = [("num_cpus_per_replica", 0, INF, False, "CPUs"), ("ingress_num_cpus", 0, INF, False, "CPUs"),
                 ("max_ongoing_requests", 1, INF, False)]
INGRESS_RANGES = [("retries", 0, INF, False), ("read_timeout", 0, INF, True, "seconds")]


@dataclass
class RayServeOptions:
    replicas: int = 1                        # fixed count; with autoscaling, the initial count
    num_cpus_per_replica: float = 1.0        # Ray's reservation per replica (its engine core included)
    router: str = "least-request"            # a shepherd policy name, or one of RAY_ROUTERS
    router_knobs: dict = field(default_factory=dict)
    min_replicas: Optional[int] = None       # autoscaling when min_replicas or max_replicas is set
    max_replicas: Optional[int] = None
    target_ongoing_requests: float = 16.0    # per replica, what the autoscaler aims at
    upscale_delay_s: float = 30.0
    downscale_delay_s: float = 600.0
    max_ongoing_requests: Optional[int] = None   # per replica; default: the replicas' --max-concurrency
    max_queued_requests: Optional[int] = None    # waiting in front of the replicas; past it 429.
                                                 # default: the replicas' --max-queue
    ingress_replicas: int = 1
    ingress_num_cpus: float = 0.25
    ingress_resources: dict = field(default_factory=dict)   # Ray resources each ingress replica also needs
    routing_stats_period_s: float = 1.0
    health_check_period_s: float = 2.0
    health_check_timeout_s: float = 10.0
    replica_http: bool = False               # each replica also serves its app on its node (for gateways)
    replica_resources: dict = field(default_factory=dict)   # Ray resources each replica also needs
    autoscaling_extra: dict = field(default_factory=dict)   # more of Ray's AutoscalingConfig fields
    replica_name: str = "ShepherdReplica"
    ingress_name: str = "ShepherdIngress"
    ingress: IngressConfig = field(default_factory=IngressConfig)

    @property
    def autoscaling(self) -> bool:
        return self.min_replicas is not None or self.max_replicas is not None

    def validate(self) -> None:
        """ValueError with a clear message on a bad option (before anything is deployed)."""
        if self.replicas < (0 if self.autoscaling else 1):
            raise ValueError(f"--replicas must be >= 1, got {self.replicas}")
        # config.check_ranges, the commands' one range check (NaN fails it too): the library path
        # has no CLI in front of it
        check_ranges(self, OPTION_RANGES)
        check_ranges(self.ingress, INGRESS_RANGES)
        if self.autoscaling:
            lo = self.min_replicas if self.min_replicas is not None else 1
            hi = self.max_replicas if self.max_replicas is not None else max(lo, self.replicas)
            if not 0 <= lo <= hi or hi < 1 or not lo <= self.replicas <= hi:
                raise ValueError(f"need 0 <= --min-replicas <= --replicas <= --max-replicas, max >= 1; got "
                                 f"{lo} <= {self.replicas} <= {hi}")
            check_ranges(self, [("target_ongoing_requests", 0, INF, True)])
        if self.router not in RAY_ROUTERS:
            make_policy(self.router, **self.router_knobs)        # raises ValueError on a bad name or knob
        elif self.router_knobs:
            raise ValueError(f"--router-knob applies to shepherd's policies, not {self.router}")
        # Ray's own values: -1 is no limit, 0 is refused (here it fell back to --max-queue unsaid)
        if self.max_queued_requests is not None and self.max_queued_requests < 1 and self.max_queued_requests != -1:
            raise ValueError(f"--max-queued-requests must be -1 (no limit) or >= 1, got {self.max_queued_requests}")


def _router_config(opts: RayServeOptions) -> Any:
    from ray.serve.config import RequestRouterConfig
    period = {"request_routing_stats_period_s": opts.routing_stats_period_s,
              "request_routing_stats_timeout_s": max(opts.routing_stats_period_s * 5, 5.0)}
    if opts.router in RAY_ROUTERS:
        cls = RAY_ROUTERS[opts.router]
        return RequestRouterConfig(**period, **({"request_router_class": cls} if cls else {}))
    return RequestRouterConfig(request_router_class=ShepherdRouter, **period,
                               request_router_kwargs={"policy": opts.router, "knobs": dict(opts.router_knobs)})


def _scaling(opts: RayServeOptions) -> dict:
    if not opts.autoscaling:
        return {"num_replicas": opts.replicas}
    lo = opts.min_replicas if opts.min_replicas is not None else 1
    hi = opts.max_replicas if opts.max_replicas is not None else max(lo, opts.replicas)
    return {"autoscaling_config": {
        "min_replicas": lo, "max_replicas": hi, "initial_replicas": opts.replicas,
        "target_ongoing_requests": opts.target_ongoing_requests,
        "upscale_delay_s": opts.upscale_delay_s, "downscale_delay_s": opts.downscale_delay_s,
        **opts.autoscaling_extra}}


def build_app(opts: RayServeOptions, serve_args: "list[str] | argparse.Namespace") -> Any:
    """The Ray Serve application (see the module doc). Raises ConfigError / ValueError on bad flags."""
    from ray import serve
    opts.validate()
    args = parse_serve_args(serve_args)
    _, srv_cfg = serve_cli.build_configs(args)           # the replicas' flags, checked here first
    replica = serve.deployment(ShepherdReplica).options(
        name=opts.replica_name,
        ray_actor_options={"num_cpus": opts.num_cpus_per_replica,
                           **({"resources": dict(opts.replica_resources)} if opts.replica_resources else {})},
        max_ongoing_requests=args.max_concurrency if opts.max_ongoing_requests is None else opts.max_ongoing_requests,
        max_queued_requests=args.max_queue if opts.max_queued_requests is None else opts.max_queued_requests,
        request_router_config=_router_config(opts), health_check_period_s=opts.health_check_period_s,
        health_check_timeout_s=opts.health_check_timeout_s, graceful_shutdown_timeout_s=10.0, **_scaling(opts))
    # a policy that reads KV events: the replicas publish them, the ingress tokenizes the prompts
    kv = opts.router not in RAY_ROUTERS and make_policy(opts.router, **opts.router_knobs).kv_index is not None
    # the replicas' --max-body-bytes, unless it is theirs to derive from the context (None): then the
    # ingress's own cap, and each replica's door still applies its own
    ingress_cfg = IngressConfig(**{**vars(opts.ingress), "deployment": opts.replica_name,
                                   "api_key": srv_cfg.api_key, "body_timeout": srv_cfg.body_timeout,
                                   "max_body_bytes": srv_cfg.max_body_bytes or IngressConfig.max_body_bytes,
                                   "tokenizer": (args.model or "default") if kv else None})
    ingress = serve.deployment(serve.ingress()(ShepherdIngress)).options(
        name=opts.ingress_name, num_replicas=opts.ingress_replicas,
        ray_actor_options={"num_cpus": opts.ingress_num_cpus,
                           **({"resources": dict(opts.ingress_resources)} if opts.ingress_resources else {})},
        max_ongoing_requests=100_000)
    return ingress.bind(replica.bind(args, opts.replica_http, kv), ingress_cfg)


def deploy(opts: RayServeOptions, serve_args: "list[str] | argparse.Namespace", *, address: str = "local",
           host: str = "127.0.0.1", port: int = 8000, app_name: str = "shepherd", route_prefix: str = "/",
           proxy_location: Optional[str] = None, num_cpus: Optional[float] = None) -> Any:
    """Join the Ray cluster at `address` ("local": start one in this process, `num_cpus` big), start
    Serve's HTTP proxy on host:port, and run the application; returns the ingress's handle."""
    import ray
    from ray import serve
    app = build_app(opts, serve_args)               # bad flags fail before Ray starts
    if not ray.is_initialized():
        if address == "local":
            ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, log_to_driver=False)
        else:
            ray.init(address=address, log_to_driver=False)
    serve.start(http_options={"host": host, "port": port},
                **({"proxy_location": proxy_location} if proxy_location else {}))
    return serve.run(app, name=app_name, route_prefix=route_prefix)
