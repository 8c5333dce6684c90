"""The engine core's KV-event publisher: vLLM's ZMQ PUB + ROUTER replay, on its own thread.

    pub = KVEventPublisher(cfg, log)    # cfg: KVEventsConfig; log: the scheduler's CacheEventLog
    pub.submit(time.time())             # once per engine iteration, from the core's thread: O(1), never blocks
    pub.close()

The core's thread only swaps the log's list into a queue. Everything else runs
on the publisher thread, off the token path: the tracker (records -> events,
block hashes), msgpack, the socket sends, the replay buffer and the replay
answers. One non-empty iteration is one message: [topic, seq (8 bytes
big-endian), payload]. seq 0 is an AllBlocksCleared sent at start, so a
consumer that joins late replays from 0 and begins from an empty cache.

Replay (ROUTER, vLLM's protocol): a DEALER sends [b"", start seq (8 bytes
big-endian)]; the answer is every buffered batch with seq >= start, each as
[b"", topic, seq, payload], then [b"", b"", -1 (8 bytes), b""]. The buffer holds
the last `buffer_steps` batches: a consumer that asks for older ones sees the
first answer start past what it asked for, which is how it knows the gap
cannot be covered.

Overload: the PUB drops messages for a subscriber past `hwm` (the subscriber
sees the gap and replays). If more than `max_queue_size` iterations wait for
the thread, the tracker cannot keep up: the waiting records are dropped, the
tracker forgets every node (they stay unannounced) and an AllBlocksCleared goes
out, so consumers hold nothing stale.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import Optional

import zmq

from shepherd.config import KVEventsConfig
from shepherd.kv_events.codec import END_SEQ, encode_batch, seq_bytes
from shepherd.kv_events.events import EventBatch
from shepherd.kv_events.tracker import BlockTracker
from shepherd.scheduler.cache_events import CacheEventLog

logger = logging.getLogger("shepherd.kv_events")

_WAKE = 0.05      # seconds the thread waits for records before it looks at the replay socket again
_RECORDS, _CLEAR, _STOP = "records", "clear", "stop"


def binds(endpoint: str) -> bool:
    """vLLM's rule: a wildcard host, ipc:// or inproc:// binds; any other address connects."""
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class KVEventPublisher:
    def __init__(self, cfg: KVEventsConfig, log: Optional[CacheEventLog], data_parallel_rank: int = 0,
                 tracker: Optional[BlockTracker] = None):
        self.cfg = cfg
        self._log = log
        self._rank = data_parallel_rank
        self._tracker = tracker or BlockTracker()
        self._topic = cfg.topic.encode("utf-8")
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._buffer: collections.deque = collections.deque(maxlen=cfg.buffer_steps)
        self._buffer_lock = threading.Lock()
        self._seq = 0
        self.dropped_overflows = 0
        ctx = zmq.Context.instance()
        self._pub = ctx.socket(zmq.PUB)
        self._pub.set_hwm(cfg.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            self.endpoint = self._attach(self._pub, cfg.endpoint, binds(cfg.endpoint))
            self.replay_endpoint = None
            if cfg.replay_endpoint:
                self._replay = ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self.replay_endpoint = self._attach(self._replay, cfg.replay_endpoint, True)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {cfg.endpoint!r} / {cfg.replay_endpoint!r}: "
                             f"{e}") from None
        self._running = True
        self._q.put((_CLEAR, time.time(), None))
        self._thread = threading.Thread(target=self._run, name="shepherd-kv-events", daemon=True)
        self._thread.start()
        logger.info("KV events: publishing on %s (replay %s, topic %r)", self.endpoint, self.replay_endpoint,
                    cfg.topic)

    @staticmethod
    def _attach(sock, endpoint: str, bind: bool) -> str:
        if not bind:
            sock.connect(endpoint)
            return endpoint
        sock.bind(endpoint)
        # the address actually bound (a port 0 becomes the one the OS picked)
        return sock.getsockopt_string(zmq.LAST_ENDPOINT)

    # ------------------------------------------------------------------ core thread
    def submit(self, ts: float) -> None:
        """Hand the cache records of this iteration to the publisher thread."""
        if self._log is not None and self._log.records:
            self._q.put((_RECORDS, ts, self._log.drain()))

    def buffered(self) -> list[int]:
        """The sequence numbers a replay can still return."""
        with self._buffer_lock:
            return [seq for seq, _ in self._buffer]

    def close(self, timeout: float = 2.0) -> None:
        if not self._running:
            return
        self._running = False
        self._q.put((_STOP, 0.0, None))
        self._thread.join(timeout)
        self._close_sockets()

    def _close_sockets(self) -> None:
        for s in (self._pub, self._replay):
            if s is not None:
                s.close(linger=0)

    # ------------------------------------------------------------------ publisher thread
    def _run(self) -> None:
        while True:
            try:
                kind, ts, records = self._q.get(timeout=_WAKE)
            except queue.Empty:
                kind, ts, records = None, 0.0, None
            if kind == _STOP:
                return
            try:
                if kind is not None and self._q.qsize() > self.cfg.max_queue_size:
                    if self._overflow():
                        return
                elif kind == _CLEAR:
                    self._send(ts, [self._tracker.clear()])
                elif kind == _RECORDS:
                    self._send(ts, self._tracker.apply(records))
                if self._replay is not None and self._replay.poll(0):
                    self._answer_replay()
            except Exception:  # noqa: BLE001 - the engine goes on; consumers see a gap and replay
                logger.exception("KV event publisher error")

    def _overflow(self) -> bool:
        """Drop every waiting iteration and tell consumers to clear; True if a stop was among them."""
        n, stop = 1, False
        while True:
            try:
                kind, _, _ = self._q.get_nowait()
            except queue.Empty:
                break
            stop = stop or kind == _STOP
            n += 1
        self.dropped_overflows += 1
        logger.warning("KV events: %d iterations waited for the publisher; dropped, consumers told to clear", n)
        self._send(time.time(), [self._tracker.forget()])
        return stop

    def _send(self, ts: float, events: list) -> None:
        if not events:
            return
        payload = encode_batch(EventBatch(ts, events, self._rank))
        seq = self._seq
        self._seq += 1
        with self._buffer_lock:
            self._buffer.append((seq, payload))
        try:
            self._pub.send_multipart((self._topic, seq_bytes(seq), payload), flags=zmq.NOBLOCK)
        except zmq.Again:       # a connecting PUB with no peer yet: consumers replay
            pass

    def _answer_replay(self) -> None:
        while self._replay.poll(0):
            frames = self._replay.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                logger.warning("KV events: bad replay request (%d frames)", len(frames))
                continue
            ident, _, start = frames
            start_seq = int.from_bytes(start, "big")
            with self._buffer_lock:
                buffered = list(self._buffer)
            for seq, payload in buffered:
                if seq >= start_seq:
                    self._replay.send_multipart((ident, b"", self._topic, seq_bytes(seq), payload))
            self._replay.send_multipart((ident, b"", b"", END_SEQ, b""))


__all__ = ["KVEventPublisher", "binds"]
