"""Consume replicas' KV-event streams (vLLM's ZMQ protocol) into a KVBlockIndex.

    sub = KVEventSubscriber(index, [Source("http://10.0.0.5:8000", "tcp://10.0.0.5:5557",
                                           replay="tcp://10.0.0.5:5558")])
    sub.start() ... sub.status() ... sub.close()

One thread serves every source: a SUB socket per replica (plus a DEALER for
replay and a monitor of the SUB's connection), polled together. Per source it
tracks the sequence number and keeps the index exact or out of use:

- the first message, or the first connection: replay from 0, so a gateway
  that joins late starts from the publisher's first batch (shepherd's seq 0 is
  an AllBlocksCleared): state "complete". If the replay cannot reach back to 0
  (its buffer moved on, or no replay endpoint), the index holds what arrives
  from now on: state "partial" (blocks cached before are not known: never
  wrong, only missing).
- a gap (seq > expected: the PUB dropped messages past its high-water mark):
  replay from the first missing seq. If the answer starts later than asked,
  or times out, the gap cannot be covered: the replica's index is dropped and
  rebuilt from the next batches ("partial", `drops` counted). A batch that does
  not decode is lost the same way. Never routing on a stale index is the rule
  (TensorRT-LLM's).
- seq < expected: a batch seen before (same seq, same bytes: skipped), else
  the publisher restarted: drop, and sync as on the first message.
- the connection dropped: the index is out of use ("unknown") until the
  reconnect is checked: a replay from the last seq seen must return the same
  bytes for it (same publisher: the missed batches are applied), else the
  publisher restarted or moved on (drop and sync). Without a replay endpoint
  the next live message decides.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
from dataclasses import dataclass
from typing import Hashable, Optional

import zmq
from zmq.utils.monitor import recv_monitor_message

from shepherd.kv_events.codec import DecodeError, decode_batch, seq_bytes, seq_of
from shepherd.kv_events.index import KVBlockIndex

logger = logging.getLogger("shepherd.kv_events")

RECENT = 4096          # batches whose digests are kept (to tell a repeat from a restart)
COUNTERS = ("messages", "batches", "gaps", "replays", "replay_timeouts", "drops", "restarts", "repeats",
            "disconnects", "bad_frames", "decode_errors", "unknown_events")


@dataclass
class Source:
    replica: Hashable            # the key the index and the routing policy use (the backend URL)
    endpoint: str                # the replica's PUB, e.g. tcp://10.0.0.5:5557
    replay: Optional[str] = None  # its ROUTER, e.g. tcp://10.0.0.5:5558
    topic: str = ""


def parse_source(spec: str) -> Source:
    """'URL=tcp://host:port[,replay=tcp://host:port][,topic=T]' (the gateway's --kv-events)."""
    head, _, rest = spec.partition(",")
    url, eq, endpoint = head.partition("=")
    if not eq or not url.strip() or not endpoint.strip().startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events {spec!r}: expected URL=tcp://host:port[,replay=tcp://host:port][,topic=T]")
    src = Source(url.strip().rstrip("/"), endpoint.strip())
    for part in filter(None, (p.strip() for p in rest.split(","))):
        k, eq, v = part.partition("=")
        if not eq or k not in ("replay", "topic"):
            raise ValueError(f"--kv-events {spec!r}: unknown option {part!r} (replay=, topic=)")
        setattr(src, k, v)
    return src


class _Stream:
    def __init__(self, src: Source, ctx: zmq.Context):
        self.src = src
        self.sub = ctx.socket(zmq.SUB)
        self.sub.setsockopt(zmq.LINGER, 0)
        self.sub.setsockopt(zmq.RCVHWM, 100_000)
        self.sub.setsockopt(zmq.SUBSCRIBE, src.topic.encode("utf-8"))
        self.monitor = self.sub.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.sub.connect(src.endpoint)
        self.dealer: Optional[zmq.Socket] = None
        self.expected: Optional[int] = None
        self.state = "syncing"            # syncing | complete | partial | unknown
        self.was = "syncing"              # the state before a disconnect
        self.recent: collections.OrderedDict = collections.OrderedDict()   # seq -> hash(payload)
        self.counts = collections.Counter()

    def close(self) -> None:
        self.sub.disable_monitor()
        for s in (self.monitor, self.sub, self.dealer):
            if s is not None:
                s.close(linger=0)


class KVEventSubscriber:
    def __init__(self, index: KVBlockIndex, sources=(), replay_timeout: float = 2.0):
        self.index = index
        self.replay_timeout = replay_timeout
        self._ctx = zmq.Context.instance()
        self._streams: dict[Hashable, _Stream] = {}
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._running = False
        self._lock = threading.Lock()
        for s in sources:
            self.add(s)

    # ------------------------------------------------------------------ owner's side
    def start(self) -> None:
        if self._thread is None:
            self._running = True
            self._thread = threading.Thread(target=self._run, name="shepherd-kv-subscriber", daemon=True)
            self._thread.start()

    def close(self, timeout: float = 5.0) -> None:
        self._running = False
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None
        for st in self._streams.values():
            st.close()
        self._streams.clear()

    def add(self, src: Source) -> None:
        self.index.set_usable(src.replica, False)
        self._cmds.put(("add", src))

    def remove(self, replica: Hashable) -> None:
        self._cmds.put(("remove", replica))

    def status(self) -> dict:
        """{replica: {state, expected, counters}} (a copy)."""
        with self._lock:
            return {k: {"state": st.state, "next_seq": st.expected,
                        **{c: st.counts.get(c, 0) for c in COUNTERS}}
                    for k, st in self._streams.items()}

    # ------------------------------------------------------------------ thread
    def _run(self) -> None:
        poller = zmq.Poller()
        while self._running:
            self._commands(poller)
            for sock, _ in poller.poll(50):
                try:
                    self._ready(sock)
                except Exception:  # noqa: BLE001 - one bad stream must not stop the others
                    logger.exception("KV event subscriber error")

    def _commands(self, poller: zmq.Poller) -> None:
        while True:
            try:
                kind, arg = self._cmds.get_nowait()
            except queue.Empty:
                return
            old = self._streams.get(arg.replica if kind == "add" else arg)
            if old is not None:
                poller.unregister(old.sub)
                poller.unregister(old.monitor)
                with self._lock:
                    del self._streams[old.src.replica]
                old.close()
            if kind == "add":
                st = _Stream(arg, self._ctx)
                with self._lock:
                    self._streams[arg.replica] = st
                poller.register(st.sub, zmq.POLLIN)
                poller.register(st.monitor, zmq.POLLIN)
            else:
                self.index.remove(arg)

    def _ready(self, sock) -> None:
        for st in list(self._streams.values()):
            if sock is st.sub:
                while True:
                    try:
                        frames = st.sub.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        return
                    self._message(st, frames)
            if sock is st.monitor:
                self._monitor(st)
                return

    def _monitor(self, st: _Stream) -> None:
        while st.monitor.poll(0):
            ev = recv_monitor_message(st.monitor)["event"]
            if ev == zmq.EVENT_DISCONNECTED:
                st.counts["disconnects"] += 1
                if st.state != "unknown":
                    st.was = st.state
                self._set(st, "unknown")
            elif ev == zmq.EVENT_CONNECTED:
                if st.expected is None:
                    self._resync(st, 0, None)
                elif st.state == "unknown":
                    self._check_reconnect(st)

    # ------------------------------------------------------------------ the sequence rules
    def _message(self, st: _Stream, frames: list) -> None:
        st.counts["messages"] += 1
        try:
            if len(frames) != 3:
                raise DecodeError(f"{len(frames)} frames, expected 3")
            seq, payload = seq_of(frames[1]), frames[2]
        except DecodeError:
            st.counts["bad_frames"] += 1     # no usable seq: the next message's seq shows any gap
            return
        if st.expected is not None and seq < st.expected:
            if st.recent.get(seq) == hash(payload):
                st.counts["repeats"] += 1
                return
            self._restarted(st)
        if st.expected is None:
            return self._resync(st, 0, (seq, payload))
        if seq > st.expected:
            st.counts["gaps"] += 1
            return self._resync(st, st.expected, (seq, payload))
        if st.state == "unknown":            # reconnected (no replay to check it): nothing was missed
            self._set(st, st.was)
        self._apply(st, seq, payload)

    def _resync(self, st: _Stream, start: int, live: Optional[tuple]) -> None:
        """Batches from `start` on are missing (0: all of them): replay them and apply them with
        the live one; what the replay cannot reach is lost (the index is dropped, see _apply_run)."""
        got = self._replay(st, start) if st.src.replay else None
        batches = (got or []) + ([live] if live is not None else [])
        if not batches:
            return
        if st.expected is None:
            st.expected = start
            self._set(st, "complete" if batches[0][0] == start else "syncing")
        self._apply_run(st, batches)

    def _check_reconnect(self, st: _Stream) -> None:
        """After a reconnect: the same publisher answers the last seq seen with the same bytes."""
        if not st.src.replay:
            return                        # the next live message decides (see _message)
        last = st.expected - 1
        got = self._replay(st, max(0, last))
        if got and last >= 0 and got[0][0] == last and st.recent.get(last) == hash(got[0][1]):
            self._set(st, st.was)
            self._apply_run(st, got[1:])
            return
        self._restarted(st)
        self._resync(st, 0, None)

    def _restarted(self, st: _Stream) -> None:
        st.counts["restarts"] += 1
        self.index.drop(st.src.replica)
        st.expected, st.recent = None, collections.OrderedDict()
        self._set(st, "syncing")

    def _apply_run(self, st: _Stream, batches: list) -> None:
        """Apply batches in seq order: skip what was applied; at a hole, the batches in it are lost."""
        for seq, payload in batches:
            if seq < st.expected:
                continue
            if seq > st.expected:
                self._lose(st, seq)
            self._apply(st, seq, payload)

    def _lose(self, st: _Stream, next_seq: int) -> None:
        """Batches before next_seq cannot be had: drop the replica's index and rebuild it from
        next_seq on (blocks cached before are then unknown, never wrong)."""
        if st.state != "syncing":
            st.counts["drops"] += 1
        self.index.drop(st.src.replica)
        st.expected = next_seq
        self._set(st, "partial")

    def _apply(self, st: _Stream, seq: int, payload: bytes) -> None:
        try:
            decoded = decode_batch(payload)
        except DecodeError:
            st.counts["decode_errors"] += 1
            return self._lose(st, seq + 1)
        st.counts["unknown_events"] += decoded.unknown
        self.index.apply(st.src.replica, decoded.batch.events)
        st.counts["batches"] += 1
        st.expected = seq + 1
        st.recent[seq] = hash(payload)
        if len(st.recent) > RECENT:
            st.recent.popitem(last=False)

    def _set(self, st: _Stream, state: str) -> None:
        st.state = state
        self.index.set_usable(st.src.replica, state in ("complete", "partial"))

    # ------------------------------------------------------------------ replay
    def _replay(self, st: _Stream, start: int) -> Optional[list]:
        """[(seq, payload)] from the replica's replay socket, from `start`; None on timeout."""
        st.counts["replays"] += 1
        if st.dealer is None:
            st.dealer = self._ctx.socket(zmq.DEALER)
            st.dealer.setsockopt(zmq.LINGER, 0)
            st.dealer.connect(st.src.replay)
        st.dealer.send_multipart([b"", seq_bytes(start)])
        out = []
        while True:
            if not st.dealer.poll(int(self.replay_timeout * 1000)):
                st.counts["replay_timeouts"] += 1
                st.dealer.close(linger=0)       # a late answer must not be read as the next one's
                st.dealer = None
                return None
            frames = st.dealer.recv_multipart()
            if len(frames) != 4:
                continue
            try:
                seq = seq_of(frames[2])
            except DecodeError:
                continue
            if seq < 0:
                return out
            out.append((seq, frames[3]))


__all__ = ["COUNTERS", "KVEventSubscriber", "Source", "parse_source"]
