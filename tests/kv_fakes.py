"""A scripted KV-event publisher for tests: vLLM's wire protocol with every move in the test's hands.

    fake = FakePublisher(positional=False)       # tagged maps (vLLM 0.32) or positional arrays (SGLang, older vLLM)
    fake.publish(events, send=True)              # next seq; send=False keeps it for replay only (a gap)
    fake.forget(seq)                             # the replay buffer lost it (an overflowed buffer)
    fake.endpoint, fake.replay_endpoint          # tcp://127.0.0.1:PORT

and the helpers the KV-event tests share (cached_hashes: the blocks a radix cache truly holds).

The replay socket is answered on a thread, as a real publisher's is.
"""
from __future__ import annotations

import threading
import time

import msgpack
import zmq

from shepherd.kv_events.codec import END_SEQ, event_map, seq_bytes
from shepherd.kv_events.hashing import chain_hashes


def loopback(endpoint: str) -> str:
    """tcp://0.0.0.0:P or tcp://*:P -> tcp://127.0.0.1:P."""
    port = endpoint.rsplit(":", 1)[1]
    return f"tcp://127.0.0.1:{port}"


def cached_hashes(tree) -> set:
    """Every full 16-token block on every root-to-node path of a radix cache, hashed: the truth."""
    out = set()
    stack = [(c, list(c.key)) for c in tree.root.children.values()]
    while stack:
        node, path = stack.pop()
        out.update(chain_hashes(path))
        stack.extend((c, path + list(c.key)) for c in node.children.values())
    return out


def positional(ev) -> list:
    m = event_map(ev)
    return [m.pop("type"), *m.values()]


def encode(events, ts: float, positional_events: bool) -> bytes:
    evs = [positional(e) if positional_events else event_map(e) for e in events]
    return msgpack.packb([ts, evs, 0], use_bin_type=True)


def wait_until(pred, timeout: float = 10.0, what: str = "condition") -> None:
    """Poll an observable condition (the subscriber runs on its own thread)."""
    end = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


class FakePublisher:
    def __init__(self, positional: bool = False, topic: str = "", port: int = 0, replay_port: int = 0):
        self.positional = positional
        self.topic = topic.encode()
        ctx = zmq.Context.instance()
        self.pub = ctx.socket(zmq.PUB)
        self.pub.setsockopt(zmq.LINGER, 0)
        self.pub.bind(f"tcp://127.0.0.1:{port}")
        self.endpoint = self.pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.router.bind(f"tcp://127.0.0.1:{replay_port}")
        self.replay_endpoint = self.router.getsockopt_string(zmq.LAST_ENDPOINT)
        self.buffer: dict[int, bytes] = {}
        self.seq = 0
        self.replays = 0
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def publish(self, events, send: bool = True, ts: float = 1.0) -> int:
        payload = encode(events, ts, self.positional)
        with self._lock:
            seq = self.seq
            self.seq += 1
            self.buffer[seq] = payload
        if send:
            self.pub.send_multipart([self.topic, seq_bytes(seq), payload])
        return seq

    def forget(self, seq: int) -> None:
        with self._lock:
            self.buffer.pop(seq, None)

    def _serve(self) -> None:
        while not self._stop:
            if not self.router.poll(20):
                continue
            ident, _, start = self.router.recv_multipart()
            first = int.from_bytes(start, "big")
            with self._lock:
                items = sorted((s, p) for s, p in self.buffer.items() if s >= first)
                self.replays += 1
            for s, p in items:
                self.router.send_multipart([ident, b"", self.topic, seq_bytes(s), p])
            self.router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def close(self) -> None:
        self._stop = True
        self._thread.join(2)
        self.pub.close(linger=0)
        self.router.close(linger=0)
