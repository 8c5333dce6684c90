#!/usr/bin/env python
"""Per-step cost of the engine core's message to the server: encode + send + recv + decode of one
CoreStep carrying N requests' new tokens, at N = 64 and 256, over the channels we could use.

    python benchmarks/ipc_cost.py            # prints a table (µs per step, median of many steps)

Channels (the receiver is a spawned process that echoes a 1-byte ack, so each sample is one
message one way plus a tiny ack back; the ack's share is measured alone and subtracted):
  pipe+pickle      multiprocessing.Pipe (socketpair), Connection.send/recv: pickle protocol 5 (chosen)
  queue            multiprocessing.Queue (a feeder thread pickles and writes a pipe)
  zmq+pickle       pyzmq PAIR over ipc://, pickle         (only if pyzmq is installed)
  zmq+msgspec      pyzmq PAIR over ipc://, msgspec msgpack of plain tuples (only if both are installed)
Also the encode step alone: pickle of the CoreStep (its outputs are plain tuples: a NamedTuple per
request pickled ~4x slower), and msgspec msgpack of the same.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from shepherd.engine.core_loop import CoreOutput, CoreStep  # noqa: E402
from shepherd.scheduler.scheduler import SchedulerStats  # noqa: E402

STEPS = 2000


def make_step(n: int) -> CoreStep:
    outs = [tuple(CoreOutput(f"chatcmpl-{i:032x}-0", [1000 + i], [], False, None, None, 57, 0, None, None))
            for i in range(n)]
    return CoreStep([], outs, SchedulerStats(num_running=n, kv_capacity=65536, kv_used=n * 170), 0.07, n)


def as_tuples(step: CoreStep):
    return (step.answers, step.outputs, list(vars(step.stats).values()), step.step_time, step.generated)


# ------------------------------------------------------------------ echo servers (child processes)
def echo_pipe(conn):
    while True:
        msg = conn.recv()
        if msg is None:
            return
        conn.send_bytes(b"k")


def echo_queue(q_in, q_out):
    while True:
        msg = q_in.get()
        if msg is None:
            return
        q_out.put(b"k")


def echo_zmq(addr, codec):
    import zmq
    s = zmq.Context.instance().socket(zmq.PAIR)
    s.connect(addr)
    dec = _decoder(codec)
    while True:
        msg = dec(s.recv())
        if msg is None:
            return
        s.send(b"k")


def _decoder(codec):
    if codec == "msgspec":
        import msgspec
        return msgspec.msgpack.Decoder().decode
    return pickle.loads


# ------------------------------------------------------------------ timing
def timed(send_one, n_steps=STEPS) -> float:
    xs = []
    for _ in range(n_steps):
        t0 = time.perf_counter()
        send_one()
        xs.append(time.perf_counter() - t0)
    return statistics.median(xs) * 1e6


def bench_pipe(step) -> float:
    ctx = mp.get_context("spawn")
    a, b = ctx.Pipe()
    p = ctx.Process(target=echo_pipe, args=(b,), daemon=True)
    p.start()

    def one():
        a.send(step)
        a.recv_bytes()
    one()
    us = timed(one)
    a.send(None)
    p.join()
    return us


def bench_queue(step) -> float:
    ctx = mp.get_context("spawn")
    qi, qo = ctx.Queue(), ctx.Queue()
    p = ctx.Process(target=echo_queue, args=(qi, qo), daemon=True)
    p.start()

    def one():
        qi.put(step)
        qo.get()
    one()
    us = timed(one, STEPS // 2)
    qi.put(None)
    p.join()
    return us


def bench_zmq(step, codec) -> float:
    import zmq
    addr = f"ipc:///tmp/shepherd-ipc-bench-{os.getpid()}"
    s = zmq.Context.instance().socket(zmq.PAIR)
    s.bind(addr)
    ctx = mp.get_context("spawn")
    p = ctx.Process(target=echo_zmq, args=(addr, codec), daemon=True)
    p.start()
    if codec == "msgspec":
        import msgspec
        menc = msgspec.msgpack.Encoder().encode

        def enc(x):   # the conversion from the core's NamedTuples is part of the cost
            return menc(None if x is None else as_tuples(x))
    else:
        def enc(x):
            return pickle.dumps(x, protocol=5)

    def one():
        s.send(enc(step))
        s.recv()
    one()
    us = timed(one)
    s.send(enc(None))
    p.join()
    return us


def main() -> int:
    have_zmq = have_msgspec = True
    try:
        import zmq  # noqa: F401
    except ImportError:
        have_zmq = False
    try:
        import msgspec
    except ImportError:
        have_msgspec = False
    ack = bench_pipe(CoreStep([], [], SchedulerStats(), None, 0))
    rows = [f"empty message round trip over the pipe (subtracted below): {ack:.0f} µs", "",
            "| channel | 64 streams: µs/step | 256 streams: µs/step | bytes at 256 |", "|---|---|---|---|"]
    for n_label, fn in (("encode only: pickle (outputs as tuples)", lambda st: timed(lambda: pickle.dumps(st, 5)) + ack),
                        ("pipe+pickle (chosen)", bench_pipe), ("multiprocessing.Queue", bench_queue)):
        cells, size = [], len(pickle.dumps(make_step(256), 5))
        for n in (64, 256):
            cells.append(f"{fn(make_step(n)) - ack:.0f}")
        rows.append(f"| {n_label} | {cells[0]} | {cells[1]} | {size} |")
    if have_msgspec:
        enc = msgspec.msgpack.Encoder().encode
        cells = []
        for n in (64, 256):
            st = make_step(n)
            cells.append(f"{timed(lambda: enc(as_tuples(st))):.0f}")
        rows.append(f"| encode only: msgspec msgpack (tuples, conversion included) | {cells[0]} | {cells[1]} | "
                    f"{len(enc(as_tuples(make_step(256))))} |")
    if have_zmq:
        for codec in ("pickle",) + (("msgspec",) if have_msgspec else ()):
            cells = [f"{bench_zmq(make_step(n), codec) - ack:.0f}" for n in (64, 256)]
            rows.append(f"| zmq PAIR ipc:// + {codec} | {cells[0]} | {cells[1]} | — |")
    else:
        rows.append("| zmq (pyzmq not installed) | — | — | — |")
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
