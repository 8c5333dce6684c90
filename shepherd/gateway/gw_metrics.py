"""The gateway's own Prometheus registry: counters, and per-backend gauges read at scrape time."""
from __future__ import annotations

from typing import Optional

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.core import GaugeMetricFamily


class GatewayMetrics:
    def __init__(self, gw: "Gateway", registry: Optional[CollectorRegistry] = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.requests = Counter("shepherd_gateway_requests", "Requests answered, by backend and status",
                                ["backend", "status"], registry=r)
        self.decisions = Counter("shepherd_gateway_routing_decisions",
                                 "Routing decisions by policy and reason", ["policy", "reason"], registry=r)
        self.retries = Counter("shepherd_gateway_retries", "Requests retried on another replica, by cause",
                               ["reason"], registry=r)
        self.errors = Counter("shepherd_gateway_errors",
                              "Requests that did not end normally, by kind "
                              "(client_abort, stream_error, no_backend, upstream, bad_request)",
                              ["kind"], registry=r)
        self.ejections = Counter("shepherd_gateway_backend_ejections", "Backends ejected as unhealthy",
                                 ["backend"], registry=r)
        r.register(_PoolCollector(gw))


class _PoolCollector:
    """Per-backend gauges read from the pool when /metrics is scraped."""

    def __init__(self, gw: "Gateway") -> None:
        self.gw = gw

    def describe(self):
        return []

    def collect(self):
        inflight = GaugeMetricFamily("shepherd_gateway_in_flight", "Requests in flight per backend",
                                     labels=["backend"])
        healthy = GaugeMetricFamily("shepherd_gateway_backend_healthy", "1 if the backend takes traffic",
                                    labels=["backend"])
        running = GaugeMetricFamily("shepherd_gateway_backend_running", "Scraped running requests",
                                    labels=["backend"])
        waiting = GaugeMetricFamily("shepherd_gateway_backend_waiting", "Scraped waiting requests",
                                    labels=["backend"])
        kv = GaugeMetricFamily("shepherd_gateway_backend_kv_usage", "Scraped KV-cache use (0..1)",
                               labels=["backend"])
        for b in self.gw.pool.backends():
            s = b.state
            inflight.add_metric([b.url], s.in_flight)
            healthy.add_metric([b.url], 1.0 if s.healthy else 0.0)
            running.add_metric([b.url], s.running)
            waiting.add_metric([b.url], s.waiting)
            kv.add_metric([b.url], s.kv_usage)
        total = GaugeMetricFamily("shepherd_gateway_in_flight_total", "Requests in flight through the gateway")
        total.add_metric([], self.gw.in_flight)
        return [inflight, healthy, running, waiting, kv, total]
