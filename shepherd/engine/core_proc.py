"""The engine-core process: what runs on the other side of the pipe.

Started with the `spawn` method by CoreProcessEngine (core_client.py): torch's
OpenMP runtime and fork do not mix, and a fresh interpreter does not inherit
the server's threads. The process

  1. leaves the server's process group and ignores SIGINT: Ctrl-C or a
     signal to the group reaches the server alone, which stops the core over
     the pipe (a core killed by the group signal would look like a crash);
     asks the kernel to kill it if the server dies (PR_SET_PDEATHSIG),
  2. binds itself to `cpus` and sets its torch threads before torch is imported,
  3. builds the core (engine/build.py) and answers ("ready", CoreInfo,
     tokenizer, stats) or ("error", kind, message),
  4. runs core_loop.run_loop with the pipe as recv/send until SHUTDOWN, and
     exits quietly when the server goes away (EOF on the pipe: no orphan).

Wire format: multiprocessing.Connection (pickle over a socketpair). Server ->
core messages are lists of intake tuples; core -> server messages are one
CoreStep per step, or ("crash", message). docs/SERVING.md has the measured
cost per step of this against the alternatives.
"""
from __future__ import annotations

import copy
import gc
import logging
import os
import pickle
import select
import signal
import sys
import threading
from typing import Callable, Optional

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


class PipeRecv:
    """core_loop.run_loop's recv over a Connection: every message waiting, each a list of intake items.

    The loop asks with timeout 0 once per step while it has work: that check is a poll object's
    poll(0) on the socket (a readable or hung-up socket counts, as for Connection.poll), not
    Connection.poll(0), which builds a selector and registers the socket on every call (one
    stream's step, cold after the forward: benchmarks/core_loop_cost.py)."""

    def __init__(self, conn):
        self.conn = conn
        self._ready = select.poll()
        self._ready.register(conn.fileno(), select.POLLIN)

    def __call__(self, timeout: Optional[float]) -> list:
        conn = self.conn
        if timeout is None or timeout > 0:
            conn.poll(timeout)
        items: list = []
        while self._ready.poll(0):
            items.extend(conn.recv())     # EOFError when the server is gone
        return items


def pipe_send(conn, tick: Optional[Callable[[], None]] = None) -> Callable[[object], None]:
    """core_loop.run_loop's send over a Connection, then `tick` (the thread governor's, once per
    step). The bytes are Connection.send's (ForkingPickler.dumps gives pickle.dumps's bytes for
    a CoreStep, which holds only tuples, lists, numbers, strings and None), without the copy of
    copyreg's dispatch table that ForkingPickler makes on every call."""
    send_bytes, dumps = conn.send_bytes, pickle.dumps
    if tick is None:
        return lambda msg: send_bytes(dumps(msg))

    def send(msg) -> None:
        send_bytes(dumps(msg))
        tick()
    return send


def pin(cpus: Optional[list[int]], num_threads: Optional[int]) -> None:
    """Bind this process to `cpus` and size the OpenMP pool (before torch is imported)."""
    if cpus:
        os.sched_setaffinity(0, set(cpus))
    n = num_threads or (len(cpus) if cpus else None)
    if n:
        os.environ["OMP_NUM_THREADS"] = str(n)
        os.environ["SHEPHERD_NUM_THREADS"] = str(n)


def detach() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        os.setpgid(0, 0)
    except OSError:
        pass
    try:
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG: no orphan even if this process is stuck
    except Exception:  # noqa: BLE001 - not Linux: the EOF on the pipe still ends the core
        pass
    if os.getppid() == 1:   # the server died before the line above
        os._exit(0)


def core_main(conn, cfg, log_level: str = "info", cpus: Optional[list[int]] = None) -> None:
    detach()
    logging.basicConfig(level=getattr(logging, log_level.upper(), logging.INFO), format=LOG_FORMAT)
    log = logging.getLogger("shepherd.core")
    pin(cpus, cfg.num_threads)
    from shepherd.engine.build import build_served_core
    from shepherd.engine.core_loop import start_watchdog, watchdog_exit
    try:
        served = build_served_core(cfg)
    except BaseException as e:  # noqa: BLE001 - reported to the server, which exits with the reason
        kind = "config" if isinstance(e, (ValueError, FileNotFoundError)) else "load"
        log.debug("core build failed", exc_info=True)
        conn.send(("error", kind, f"{e}" or type(e).__name__))
        return
    try:
        import torch
        threads = torch.get_num_threads()
    except Exception:  # noqa: BLE001
        threads = 0
    log.info("engine core pid %d: cpus %s, torch threads %d", os.getpid(),
             sorted(os.sched_getaffinity(0)), threads)
    conn.send(("ready", served.info, served.tokenizer, copy.copy(served.scheduler.stats())))
    # now, while the server starts its own grammar worker: built on the first grammar request, the
    # compiler's GIL-bound build stretched a running stream's step 4x (docs/SERVING.md, "The enum row")
    served.core.executor.warm_grammar()
    if cfg.watchdog_timeout and cfg.watchdog_timeout > 0:
        start_watchdog(served.core, float(cfg.watchdog_timeout), watchdog_exit(cfg.watchdog_timeout),
                       threading.Event())
    # The loop runs in this process's main thread: libgomp (torch's OpenMP) keeps a warm worker
    # team only for the initial thread; driven from another thread, every parallel region paid
    # for a fresh team and a decode step took 40 ms instead of 22 (benchmarks/omp_thread.py).
    gov = governor(cfg, threads)
    if gov is not None and mid_step_rule():
        served.core.executor.watch_layers(gov.between_layers)
    # The startup heap (model, tokenizer, scheduler: ~177,000 objects) is never garbage, yet each
    # collection of the oldest generation walked it, ~96 ms with every step waiting. Frozen, the
    # collector walks only what serving allocates (vLLM's engine core and SGLang do the same).
    gc.collect()
    gc.freeze()
    if not _serve(served, conn, log, gov):
        sys.exit(1)


def mid_step_rule() -> bool:
    """Whether the thread governor's mid-step rule (threads.py) watches the model's layers: yes
    unless SHEPHERD_GOVERNOR_MID_STEP=0 (the window rule alone; benchmarks/threads_contention.py
    and stall_attacks.py measure the two side by side). On the one-call layer stack
    (kernels.layer_stack, this Intel Xeon's default path) it was opt-in until the C call looked
    for itself (each thread's CPU time, so a quiet step is one call) and a drop came back within
    one 0.1 s window once the cores were free: before that it cost 64 served streams 2-10 % of
    their tok/s (docs/SERVING.md). Every path alike: the per-op paths call the hook between
    layers, the stack looks in C."""
    return os.environ.get("SHEPHERD_GOVERNOR_MID_STEP", "") != "0"


def governor(cfg, threads: int):
    """The thread governor (engine/threads.py) when the thread count is the core's to choose."""
    if cfg.num_threads is not None or cfg.executor != "torch" or threads < 2:
        return None
    import torch

    from shepherd.engine.threads import ThreadGovernor
    return ThreadGovernor(threads, torch.set_num_threads)


def _serve(served, conn, log, gov=None) -> bool:
    """Run the engine loop until shutdown; False if it crashed."""
    from shepherd.engine.core_loop import run_loop
    try:
        run_loop(served, PipeRecv(conn), pipe_send(conn, None if gov is None else gov.tick))
    except (EOFError, BrokenPipeError, ConnectionResetError):
        log.info("server went away; engine core exits")
    except BaseException as e:  # noqa: BLE001
        log.exception("engine core crashed")
        try:
            conn.send(("crash", f"engine crashed: {type(e).__name__}: {e}"))
        except Exception:  # noqa: BLE001
            pass
        return False
    return True
