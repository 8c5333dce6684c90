"""The gateway's precise prefix routing over fake replicas whose KV events come from scripted
publishers: one speaking vLLM 0.32's tagged maps, one the older positional arrays (SGLang), one
with no stream at all."""
from __future__ import annotations

import os
import sys

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from gateway_fakes import FakeBackend, ServerThread  # noqa: E402
from kv_fakes import FakePublisher, loopback, wait_until  # noqa: E402

from shepherd.gateway.app import Gateway, GatewayConfig  # noqa: E402
from shepherd.gateway.backends import BackendPool, HealthConfig  # noqa: E402
from shepherd.gateway.kv_routing import KVRouting  # noqa: E402
from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402
from shepherd.kv_events.hashing import chain_hashes  # noqa: E402
from shepherd.routing import make_policy  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def stored(tokens, engine_hashes=None, parent=None):
    """A BlockStored the way an engine writes it: its own hashes (opaque to the gateway)."""
    hashes = engine_hashes or [hash(("engine", i, tuple(tokens))) & 0xFFFFFFFF for i in range(len(tokens) // 16)]
    return BlockStored(hashes, parent, list(tokens[:16 * len(hashes)]), 16, None, "GPU", None)


class KVCluster:
    def __init__(self, policy: str, **knobs):
        self.fakes = [FakeBackend(name=f"m{i}") for i in range(3)]
        self.servers = [ServerThread(f).start() for f in self.fakes]
        self.pubs = [FakePublisher(positional=False), FakePublisher(positional=True)]
        urls = [s.url for s in self.servers]
        specs = [f"{urls[i]}={loopback(p.endpoint)},replay={loopback(p.replay_endpoint)}"
                 for i, p in enumerate(self.pubs)]
        self.policy = make_policy(policy, **knobs)
        self.kv = KVRouting(self.policy, specs, tokenizer="backend", replay_timeout=5.0)
        pool = BackendPool(urls, health=HealthConfig(health_interval=0.05, metrics_interval=0.05))
        self.gw = Gateway(pool, self.policy, GatewayConfig(retries=1, read_timeout=5.0), kv=self.kv)
        self.gws = ServerThread(self.gw).start()
        self.client = httpx.Client(base_url=self.gws.url, timeout=15.0)
        self.urls = urls

    def backend_of(self, body, path="/v1/completions") -> str:
        r = self.client.post(path, json=dict(body, max_tokens=2))
        assert r.status_code == 200, r.text
        return r.headers["x-shepherd-backend"]

    def close(self):
        self.client.close()
        self.gws.stop()
        for s in self.servers:
            s.stop()
        for p in self.pubs:
            p.close()


@pytest.fixture
def kvc(request):
    made = []

    def make(policy="precise-prefix", **knobs):
        c = KVCluster(policy, **knobs)
        made.append(c)
        return c
    yield make
    for c in made:
        c.close()


@pytest.mark.parametrize("policy,knobs", [("precise-prefix", {}),
                                          ("weighted", {"weights": "precise=2,load=1"})])
def test_requests_go_where_their_prefix_is_cached_in_either_encoding(kvc, policy, knobs):
    c = kvc(policy, **knobs)
    p = list(range(1000, 1100))                 # 100 tokens: 6 full blocks
    q = list(range(5000, 5100))
    c.pubs[0].publish([AllBlocksCleared(), stored(p)])            # tagged maps
    c.pubs[1].publish([AllBlocksCleared(), stored(q)])            # positional arrays
    wait_until(lambda: c.kv.index.blocks(c.urls[0]) == 6 and c.kv.index.blocks(c.urls[1]) == 6, what="indexed")
    for _ in range(3):
        assert c.backend_of({"prompt": p + [7, 8, 9]}) == c.urls[0]
        assert c.backend_of({"prompt": q}) == c.urls[1]
    assert c.policy.reasons["hit"] >= 6
    st = c.kv.status()
    assert st[c.urls[0]]["state"] == st[c.urls[1]]["state"] == "complete"
    # the replica evicts p: nothing holds it now, and no request is sent there for it
    c.pubs[0].publish([BlockRemoved(stored(p).block_hashes, "GPU")])
    wait_until(lambda: c.kv.index.blocks(c.urls[0]) == 0, what="the removal")
    before = c.policy.reasons["hit"]
    c.backend_of({"prompt": p})
    assert c.policy.reasons["hit"] == before
    metrics = c.client.get("/metrics").text
    assert f'shepherd_gateway_kv_events_usable{{backend="{c.urls[0]}",state="complete"}} 1.0' in metrics
    assert "shepherd_gateway_kv_index_blocks" in metrics


def test_text_prompts_are_tokenized_by_a_replica_and_chained_across_events(kvc):
    """A completion's text and a chat's messages become token ids through a replica's /tokenize;
    the replica's events store the prompt in two parts (the second names the first as parent), as
    an engine does when a prompt extends a cached one."""
    c = kvc()
    text = "The quick brown fox jumps over the lazy dog. " * 3          # 135 characters: 8 blocks
    toks = [ord(ch) for ch in text]
    first = stored(toks[:64])
    second = stored(toks[64:128], [77, 78, 79, 80], parent=first.block_hashes[-1])
    c.pubs[1].publish([AllBlocksCleared(), first])
    c.pubs[1].publish([second])
    wait_until(lambda: c.kv.index.blocks(c.urls[1]) == 8, what="indexed")
    assert c.kv.index.match(chain_hashes(toks), [c.urls[1]]) == {c.urls[1]: 8}
    assert c.backend_of({"prompt": text}) == c.urls[1]
    chat = [{"role": "user", "content": "x" * 70}]
    ctoks = [ord(ch) for ch in "user:" + "x" * 70 + "\n"]
    c.pubs[0].publish([AllBlocksCleared(), stored(ctoks)])
    wait_until(lambda: c.kv.index.blocks(c.urls[0]) == 4, what="chat prefix indexed")
    assert c.backend_of({"messages": chat}, "/v1/chat/completions") == c.urls[0]
    assert sum(f.tokenized for f in c.fakes) >= 2


def test_a_replica_without_events_and_an_unreadable_policy_combination():
    with pytest.raises(ValueError, match="does not read KV events"):
        KVRouting(make_policy("least-request"), ["http://a=tcp://127.0.0.1:1"])
