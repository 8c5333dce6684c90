"""Prometheus metrics (vLLM's names, plus shepherd's own) and the periodic
SGLang-style log lines.

Every Engine owns one `EngineMetrics` with its own CollectorRegistry, so
several engines in one process (tests, a simulator beside a server) never
clash. Gauges are set from `Scheduler.stats()` by the engine thread after
every step; counters advance by the difference between two stats snapshots;
histograms are observed per request / per token by the engine.
"""
from __future__ import annotations

import logging
from typing import Optional

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST  # noqa: F401  (re-exported for the server)

logger = logging.getLogger("shepherd.engine")

# vLLM's bucket choices, so dashboards built for vLLM read the same shapes.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0,
                2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0)
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0,
                           40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
LORA_LOAD_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0)


# Metrics that mirror one SchedulerStats field, declared with it: a gauge is set to the field
# after every step, a counter advances by the field's change (the field is cumulative).
# (kind, metric name, help, SchedulerStats field)
FROM_STATS = (
    ("gauge", "vllm:num_requests_running", "Requests in the running batch.", "num_running"),
    ("gauge", "vllm:num_requests_swapped", "Requests preempted to the host KV pool.", "num_swapped"),
    ("counter", "vllm:num_preemptions", "Cumulative number of preemptions.", "preemptions"),
    ("counter", "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", "prefix_query_tokens"),
    ("counter", "vllm:prefix_cache_hits", "Prompt tokens served from the prefix cache.", "prefix_hit_tokens"),
    ("gauge", "shepherd:kv_free_tokens", "KV slots never used or released.", "kv_free"),
    ("gauge", "shepherd:kv_evictable_tokens", "KV slots held only by the prefix cache (reclaimable).", "kv_evictable"),
    ("gauge", "shepherd:kv_used_tokens", "KV slots held by requests.", "kv_used"),
    ("gauge", "shepherd:kv_capacity_tokens", "KV capacity in tokens.", "kv_capacity"),
    ("counter", "shepherd:preempted_tokens", "KV tokens thrown away or moved by preemption.", "preempted_tokens"),
    ("counter", "vllm:spec_decode_num_drafts", "Speculative decoding: verifies run (a request's drafts in a step).",
     "spec_drafts"),
    ("counter", "vllm:spec_decode_num_draft_tokens", "Speculative decoding: draft tokens verified.", "spec_draft_tokens"),
    ("counter", "vllm:spec_decode_num_accepted_tokens", "Speculative decoding: draft tokens accepted.",
     "spec_accepted_tokens"),
)


class EngineMetrics:
    """All metrics of one engine, labelled with `model_name` like vLLM's."""

    def __init__(self, model_name: str, registry: Optional[CollectorRegistry] = None, lora: bool = False):
        self.registry = registry or CollectorRegistry()
        self.model_name = model_name
        r, L = self.registry, ["model_name"]
        make = {"gauge": Gauge, "counter": Counter}
        self._mirrors = [(kind, make[kind](name, doc, L, registry=r).labels(model_name), field)
                         for kind, name, doc, field in FROM_STATS]

        def gauge(name, doc):
            return Gauge(name, doc, L, registry=r).labels(model_name)

        def counter(name, doc):
            return Counter(name, doc, L, registry=r).labels(model_name)

        def hist(name, doc, buckets):
            return Histogram(name, doc, L, buckets=buckets, registry=r).labels(model_name)

        # --- vLLM names (beside FROM_STATS) ---
        self.num_waiting = gauge("vllm:num_requests_waiting", "Requests waiting to be admitted (swapped included).")
        self.kv_usage = gauge("vllm:kv_cache_usage_perc",
                              "KV-cache usage, 0..1: slots held by requests / capacity (evictable prefix-cache slots count as free).")
        self.gpu_kv_usage = gauge("vllm:gpu_cache_usage_perc", "Older name of vllm:kv_cache_usage_perc.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Prompt tokens of finished or running requests (counted at admission).")
        self.generation_tokens = counter("vllm:generation_tokens", "Generated tokens.")
        self.ttft = hist("vllm:time_to_first_token_seconds", "Time to first token.", TTFT_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Time between two output tokens.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Request latency, arrival to finish.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds", "Time from arrival to first admission.",
                               REQUEST_LATENCY_BUCKETS)
        self.request_success = Counter("vllm:request_success", "Finished requests by finish reason.",
                                       ["model_name", "finished_reason"], registry=r)
        # --- shepherd's own (beside FROM_STATS) ---
        self.steps = counter("shepherd:engine_steps", "Engine steps executed.")
        self.step_time = hist("shepherd:step_time_seconds", "Wall time of one executor step.", ITL_BUCKETS)
        self.grammar_bytes = gauge("shepherd:grammar_held_bytes", "Bytes of the compiled grammars the requests in "
                                   "flight hold (bounded by --max-grammar-memory; past it, 429).")

        # vLLM's: one series, its labels the adapters running and waiting, its value the time set
        self.lora_info = Gauge("vllm:lora_requests_info", "Running stats on LoRA requests.",
                               ["max_lora", "waiting_lora_adapters", "running_lora_adapters"],
                               registry=r) if lora else None
        # shepherd's: what loading one adapter into an adapter slot took (the simulator's
        # --adapter-load-time is this figure, measured)
        self.lora_load = hist("shepherd:lora_load_seconds", "Time to load one LoRA adapter into an adapter slot "
                              "(host memory or its folder -> the executor's slot).", LORA_LOAD_BUCKETS) if lora else None
        self._last = None  # previous SchedulerStats, for counter deltas

    def set_cache_config(self, **info) -> None:
        """vllm:cache_config_info: an info gauge (always 1) whose labels describe the KV cache, as
        vLLM's CacheConfig does; GIE and llm-d read block_size and num_gpu_blocks from it."""
        labels = {k: str(v) for k, v in info.items()}
        g = Gauge("vllm:cache_config_info", "Information of the engine's KV cache (vLLM's CacheConfig labels).",
                  sorted(labels), registry=self.registry)
        g.labels(**labels).set(1)

    # ---- updates (called from the engine thread) ----
    def update_from_stats(self, st) -> None:
        # Called once per step on the server's event loop: a metric is touched only when its field
        # moved since the last step (a decode step moves a few of them), because every Gauge.set /
        # Counter.inc takes a lock, and at one stream these calls were a tenth of the server's time
        # per step (cProfile). /metrics shows the same: an unchanged gauge already holds the value.
        last = self._last
        waiting = st.num_waiting + st.num_swapped
        if last is None or waiting != last.num_waiting + last.num_swapped:
            self.num_waiting.set(waiting)
        if last is None or st.kv_used != last.kv_used or st.kv_capacity != last.kv_capacity:
            usage = (st.kv_used / st.kv_capacity) if st.kv_capacity else 0.0
            self.kv_usage.set(usage)
            self.gpu_kv_usage.set(usage)
        for kind, metric, field in self._mirrors:
            value = getattr(st, field)
            before = getattr(last, field) if last is not None else None
            if kind == "gauge":
                if value != before:
                    metric.set(value)
                continue
            delta = value - (before or 0)
            if delta > 0:
                metric.inc(delta)
        if self.lora_info is not None:
            self.lora_info.clear()
            self.lora_info.labels(str(st.max_lora), st.waiting_lora_adapters,
                                  st.running_lora_adapters).set_to_current_time()
        self._last = _copy_stats(st)

    def render(self) -> bytes:
        return generate_latest(self.registry)


def _copy_stats(st):
    import copy
    return copy.copy(st)


class StepLogger:
    """SGLang-style log lines: one per step that ran prefill, one every N decode steps."""

    def __init__(self, log_every_steps: int = 40, log: logging.Logger = logger):
        self.every = max(1, int(log_every_steps))
        self.log = log
        self._decode_steps = 0
        self._tokens_since = 0
        self._t_since: Optional[float] = None

    def on_step(self, st, now: float, generated_tokens: int) -> None:
        cap = st.kv_capacity or 1
        usage = st.kv_used / cap
        if self._t_since is None:
            self._t_since = now
        self._tokens_since += generated_tokens
        if st.last_prefill_seqs:
            self.log.info(
                "Prefill batch. #new-seq: %d, #new-token: %d, #cached-token: %d, token usage: %.2f, "
                "#running-req: %d, #queue-req: %d%s",
                st.last_prefill_seqs, st.last_prefill_tokens, st.last_cached_tokens, usage,
                st.num_running, st.num_waiting + st.num_swapped,
                f", #prefill-budget: {st.prefill_budget}" if st.prefill_budget else "")
        if st.last_decode_seqs:
            self._decode_steps += 1
            if self._decode_steps % self.every == 0:
                dt = max(now - self._t_since, 1e-9)
                self.log.info(
                    "Decode batch. #running-req: %d, #token: %d, token usage: %.2f, "
                    "gen throughput (token/s): %.2f, #queue-req: %d, #preempted: %d",
                    st.num_running, st.kv_used, usage, self._tokens_since / dt,
                    st.num_waiting + st.num_swapped, st.preemptions)
                self._tokens_since = 0
                self._t_since = now

    def idle(self) -> None:
        self._t_since = None
        self._tokens_since = 0
