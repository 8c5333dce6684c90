"""The gateway's KV-event side: replicas' streams into the policy's index, and prompts as token ids.

    kv = KVRouting(policy, ["http://10.0.0.5:8000=tcp://10.0.0.5:5557,replay=tcp://10.0.0.5:5558"],
                   tokenizer="backend")
    await kv.start() ... await kv.fill(rr, payload, chat, replicas) ... await kv.stop()

- `--kv-events URL=tcp://host:port[,replay=tcp://host:port][,topic=T]` (repeat per replica):
  a KVEventSubscriber (shepherd/kv_events/subscriber.py) feeds `policy.kv_index`, keyed
  by the backend URL. A replica without a stream scores as holding nothing.
- The policy reads `RouteRequest.token_ids`: the prompt as the replica will tokenize it.
  `tokenizer="backend"` (the default) asks a healthy replica's `POST /tokenize` (vLLM's
  endpoint; shepherd and vLLM serve it, with the chat template for `messages`); a path
  (or "default": the default model) tokenizes here with shepherd's own tokenizer and the
  server's chat rendering. A prompt given as token ids is used as is. When tokenizing
  fails the request is routed without token ids (every replica then matches nothing),
  never refused.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Optional, Sequence

import httpx

from shepherd.gateway.backends import normalize_url
from shepherd.kv_events.subscriber import COUNTERS, KVEventSubscriber, Source, parse_source
from shepherd.routing import ReplicaState, RouteRequest, RoutingPolicy
from shepherd.server.protocol import ChatCompletionRequest
from shepherd.server.tools import render_messages, template_takes_tools

log = logging.getLogger("shepherd.gateway")


def parse_sources(specs: Sequence[str]) -> list[Source]:
    out = []
    for spec in specs:
        src = parse_source(spec)
        src.replica = normalize_url(src.replica)
        out.append(src)
    return out


class PromptTokens:
    """Token ids of a request's prompt, from a replica's /tokenize or a local tokenizer."""

    def __init__(self, tokenizer: str = "backend", timeout: float = 2.0) -> None:
        self.local = None
        if tokenizer != "backend":
            from shepherd.model.loader import load_tokenizer
            self.local = load_tokenizer(None if tokenizer == "default" else tokenizer)
            try:        # now, not in the event loop of the first chat request
                self.local.warm_chat_template()
            except Exception as e:  # noqa: BLE001 - chat requests then route without their tokens
                log.warning("the routing tokenizer's chat template does not compile: %s", e)
        self.timeout = timeout
        self._rr = 0
        self.failures = 0

    async def ids(self, payload: dict, chat: bool, replicas: Sequence[ReplicaState],
                  client: Optional[httpx.AsyncClient]) -> Optional[list[int]]:
        if self.local is not None and not (chat and payload.get("tools")):
            try:
                return await asyncio.to_thread(self._local_ids, payload, chat)
            except Exception as e:  # noqa: BLE001 - bad input is the replica's to answer
                log.debug("local tokenizer: %s", e)
                return None
        healthy = [r for r in replicas if r.healthy and r.url]
        if not healthy or client is None:
            return None
        body = {"model": payload.get("model")}
        if chat:
            body.update(messages=payload.get("messages"), add_generation_prompt=payload.get("add_generation_prompt", True))
            if payload.get("tools"):
                body["tools"] = payload["tools"]
        elif isinstance(payload.get("prompt"), str):
            body["prompt"] = payload["prompt"]
        else:
            return None
        self._rr += 1
        url = healthy[self._rr % len(healthy)].url
        try:
            r = await client.post(url + "/tokenize", json=body, timeout=self.timeout)
            if r.status_code == 200:
                toks = r.json().get("tokens")
                if isinstance(toks, list):
                    return toks
        except (httpx.HTTPError, ValueError):
            pass
        self.failures += 1
        return None

    def _local_ids(self, payload: dict, chat: bool) -> list[int]:
        tok = self.local
        if not chat:
            return tok.encode(payload["prompt"], add_special_tokens=True)
        body = ChatCompletionRequest.model_validate(payload)
        messages, extra = render_messages(body, template_takes_tools(tok.chat_template))
        text = tok.apply_chat_template(messages, add_generation_prompt=body.add_generation_prompt, **extra)
        return tok.encode(text, add_special_tokens=False)


class KVRouting:
    def __init__(self, policy: RoutingPolicy, kv_events: Sequence[str] = (), tokenizer: str = "backend",
                 replay_timeout: float = 2.0) -> None:
        self.policy = policy
        self.index = getattr(policy, "kv_index", None)
        if kv_events and self.index is None:
            raise ValueError(f"--kv-events: policy {policy.name!r} does not read KV events; use precise-prefix "
                             "or weighted with a precise weight (--scorer-weights precise=2,load=1)")
        self.sources = parse_sources(kv_events)
        self.subscriber = KVEventSubscriber(self.index, self.sources, replay_timeout) if self.sources else None
        self.tokens = PromptTokens(tokenizer) if self.index is not None else None

    async def start(self) -> None:
        if self.subscriber is not None:
            self.subscriber.start()

    async def stop(self) -> None:
        if self.subscriber is not None:
            await asyncio.to_thread(self.subscriber.close)

    async def fill(self, rr: RouteRequest, payload: dict, chat: bool, replicas: Sequence[ReplicaState],
                   client: Optional[httpx.AsyncClient]) -> None:
        """Give the request its token ids when the policy reads them and the owner does not have them."""
        if self.tokens is not None and rr.token_ids is None:
            rr.token_ids = await self.tokens.ids(payload, chat, replicas, client)

    def status(self) -> dict:
        return self.subscriber.status() if self.subscriber is not None else {}

    def collect(self):
        """Prometheus families for the gateway's registry: each stream's state and counters."""
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
        state = GaugeMetricFamily("shepherd_gateway_kv_events_usable",
                                  "1 while the replica's KV-event index is used for routing (complete or partial)",
                                  labels=["backend", "state"])
        counts = CounterMetricFamily("shepherd_gateway_kv_events", "KV-event stream counters per replica",
                                     labels=["backend", "what"])
        blocks = GaugeMetricFamily("shepherd_gateway_kv_index_blocks", "Blocks the index holds per replica",
                                   labels=["backend"])
        for url, st in self.status().items():
            state.add_metric([url, st["state"]], 1.0 if st["state"] in ("complete", "partial") else 0.0)
            for c in COUNTERS:
                counts.add_metric([url, c], st[c])
            blocks.add_metric([url], self.index.blocks(url))
        tok = CounterMetricFamily("shepherd_gateway_tokenize_failures",
                                  "Prompts routed without token ids (the replica's /tokenize failed)")
        tok.add_metric([], self.tokens.failures if self.tokens is not None else 0)
        return [state, counts, blocks, tok]

    def describe(self):
        return []


__all__ = ["KVRouting", "PromptTokens", "parse_sources"]
