"""Regenerate tests/data/kv_events_golden.json: KV-event frames written by vLLM itself.

Run with the vLLM peer's interpreter (benchmarks/_peer_envs.py installs it):

    /work/peers/vllm/venv/bin/python benchmarks/kv_events_golden.py [--out tests/data/kv_events_golden.json]

It builds two event batches from vLLM's own structs (vllm/distributed/kv_events.py),
publishes them with vLLM's ZmqEventPublisher on loopback, and records the frames a
subscriber receives live and the frames its replay socket answers (a replay from
the second batch: that batch, then the end marker). The JSON keeps the events'
values beside the frames (hex), so tests/test_kv_events.py can check that shepherd's
encoder writes the same bytes and its decoder reads vLLM's. This script imports
nothing from shepherd.
"""
from __future__ import annotations

import argparse
import json
import socket
import time
from pathlib import Path

TOPIC = "kv@golden"
TS = [1767225600.125, 1767225600.25]
# the shape shepherd's publisher sends (an AllBlocksCleared first, then a step's events), with values that
# exercise the encodings: a uint64 above 2**63, a None parent, lora fields set and unset
BATCHES = [
    [{"type": "AllBlocksCleared"}],
    [{"type": "BlockStored", "block_hashes": [1311768467463790320, 18364758544493064720],
      "parent_block_hash": None, "token_ids": list(range(1, 33)), "block_size": 16,
      "lora_id": None, "medium": "GPU", "lora_name": None},
     {"type": "BlockStored", "block_hashes": [42], "parent_block_hash": 18364758544493064720,
      "token_ids": [70000 + i for i in range(16)], "block_size": 16, "lora_id": 3, "medium": "GPU",
      "lora_name": "adapter-a"},
     {"type": "BlockRemoved", "block_hashes": [42, 1311768467463790320], "medium": "GPU"}],
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _vllm_batch(kv, events: list, ts: float):
    out = []
    for ev in events:
        args = {k: v for k, v in ev.items() if k != "type"}
        out.append(getattr(kv, ev["type"])(**args))
    return kv.KVEventBatch(ts=ts, events=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(Path(__file__).resolve().parent.parent / "tests/data/kv_events_golden.json"))
    args = ap.parse_args()
    import zmq
    import vllm
    from vllm.distributed import kv_events as kv

    pub_ep = f"tcp://127.0.0.1:{_free_port()}"
    rep_ep = f"tcp://127.0.0.1:{_free_port()}"
    # "tcp://127.0.0.1:P" would make vLLM connect rather than bind; "*" binds
    pub = kv.ZmqEventPublisher(data_parallel_rank=0, endpoint=pub_ep.replace("127.0.0.1", "*"),
                               replay_endpoint=rep_ep.replace("127.0.0.1", "*"), topic=TOPIC)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC.encode())
    sub.connect(pub_ep)
    time.sleep(0.5)     # a generator script, not a test: let the subscription reach the publisher
    for events, ts in zip(BATCHES, TS):
        pub.publish(_vllm_batch(kv, events, ts))
    live = []
    for _ in BATCHES:
        if not sub.poll(5000):
            raise SystemExit("no live frames from vLLM's publisher")
        live.append([f.hex() for f in sub.recv_multipart()])
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep_ep)
    dealer.send_multipart([b"", (1).to_bytes(8, "big")])
    replay = []
    while True:
        if not dealer.poll(5000):
            raise SystemExit("no replay answer from vLLM's publisher")
        frames = dealer.recv_multipart()
        replay.append([f.hex() for f in frames])
        if frames[2] == kv.ZmqEventPublisher.END_SEQ:
            break
    pub.shutdown()
    doc = {"vllm_version": vllm.__version__, "topic": TOPIC, "ts": TS, "data_parallel_rank": 0,
           "batches": BATCHES, "live_frames": live, "replay_from_1_frames": replay}
    Path(args.out).write_text(json.dumps(doc) + "\n")
    print(f"wrote {args.out}: {len(live)} live messages, {len(replay)} replay messages (vLLM {vllm.__version__})")


if __name__ == "__main__":
    main()
