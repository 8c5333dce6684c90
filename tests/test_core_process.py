"""The engine core in its own process, behind the HTTP server: aborts cross the
process boundary, a dead core fails its requests and the server, and stopping
the server leaves no process behind. The simulated executor (real tokenizer,
no weights) keeps these fast."""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import httpx
import pytest

from shepherd.config import EngineConfig
from shepherd.engine.core_client import CoreProcessEngine

try:
    from gateway_fakes import SERVE_START_S, EngineServer, free_port
except ImportError:  # pragma: no cover - when tests/ is a package
    from tests.gateway_fakes import SERVE_START_S, EngineServer, free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LONG = {"prompt": "tell me everything", "max_tokens": 3000, "ignore_eos": True, "stream": True}


def pid_alive(pid: int) -> bool:
    """True while `pid` is a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def core_child(pid: int) -> int:
    """The engine-core process among `pid`'s children (the one started by multiprocessing's spawn)."""
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        kids = [int(k) for k in f.read().split()]
    for k in kids:
        with open(f"/proc/{k}/cmdline", "rb") as f:
            if b"spawn_main" in f.read():
                return k
    raise AssertionError(f"no engine-core child among {kids}")


def wait_for(cond, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while True:
        v = cond()
        if v:
            return v
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=10).text
    m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? ([0-9.e+-]+)$", text, re.M)
    assert m, f"{name} not in /metrics"
    return float(m.group(1))


class Serve:
    """A real `shepherd serve --executor sim` process."""

    def __init__(self, tmp_path, *args):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = tmp_path / "serve.log"
        self.log = open(self.log_path, "w")
        cmd = [sys.executable, "-m", "shepherd", "serve", "--executor", "sim", "--port", str(self.port),
               "--max-total-tokens", "8192", *args]
        self.proc = subprocess.Popen(cmd, cwd=ROOT, stdout=self.log, stderr=subprocess.STDOUT)

    def __enter__(self):
        def healthy():
            assert self.proc.poll() is None, f"serve exited {self.proc.returncode}: {self.text()[-3000:]}"
            try:
                return httpx.get(self.url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False
        wait_for(healthy, SERVE_START_S, "the server to be healthy")
        self.core_pid = core_child(self.proc.pid)
        assert self.core_pid != self.proc.pid and pid_alive(self.core_pid)
        return self

    def text(self) -> str:
        self.log.flush()
        return self.log_path.read_text()

    def __exit__(self, *exc):
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(30)
        self.log.close()


def read_events(lines, n: int) -> list:
    got = []
    for line in lines:
        if line.startswith("data: "):
            got.append(line[6:])
            if len(got) >= n:
                break
    return got


@pytest.mark.e2e
def test_disconnect_aborts_in_the_core_process(tmp_path):
    with Serve(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()   # kept: a dropped iterator closes the connection
            assert len(read_events(lines, 3)) == 3
            assert metric(srv.url, "vllm:num_requests_running") == 1
            assert metric(srv.url, "shepherd:kv_used_tokens") > 0
        # 3000 simulated tokens take minutes: only the abort can free the KV this soon
        wait_for(lambda: metric(srv.url, "vllm:num_requests_running") == 0
                 and metric(srv.url, "shepherd:kv_used_tokens") == 0, 10, "the core to drop the request")
        cap = metric(srv.url, "shepherd:kv_capacity_tokens")
        assert metric(srv.url, "shepherd:kv_free_tokens") + metric(srv.url, "shepherd:kv_evictable_tokens") == cap
        assert metric(srv.url, "shepherd:engine_steps_total") > 0
        text = httpx.get(srv.url + "/metrics").text
        assert re.search(r'^vllm:request_success_total\{[^}]*finished_reason="abort"[^}]*\} 1\.0$', text, re.M)
        assert srv.proc.poll() is None


def test_killed_core_gives_error_terminals_and_503():
    """In process: the server keeps answering, with an error for the stream and 503 on /health."""
    engine = CoreProcessEngine(EngineConfig(executor="sim", max_total_tokens=8192), log_level="warning")
    try:
        with EngineServer(engine) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
            assert c.get("/health").status_code == 200
            with c.stream("POST", "/v1/completions", json=LONG) as r:
                lines = r.iter_lines()
                assert len(read_events(lines, 2)) == 2
                os.kill(engine.pid, signal.SIGKILL)
                rest = read_events(lines, 10_000)
            assert rest[-1] == "[DONE]"
            err = json.loads(rest[-2])["error"]
            assert "engine core process died" in err["message"] and "SIGKILL" in err["message"]
            assert c.get("/health").status_code == 503
            r = c.post("/v1/completions", json={"prompt": "x", "max_tokens": 2})
            assert r.status_code == 503 and r.json()["error"]["message"]
    finally:
        engine.close()
    assert not pid_alive(engine.pid)


@pytest.mark.e2e
def test_killed_core_makes_serve_exit_nonzero(tmp_path):
    with Serve(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()
            assert len(read_events(lines, 2)) == 2
            os.kill(srv.core_pid, signal.SIGKILL)
            rest = read_events(lines, 10_000)
        assert "error" in json.loads(rest[-2])
        code = srv.proc.wait(60)     # never a hang
        assert code not in (0, None), srv.text()[-3000:]
        assert "engine core process died: killed by signal SIGKILL" in srv.text()


@pytest.mark.e2e
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_stops_both_processes(tmp_path, sig):
    with Serve(tmp_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        with c.stream("POST", "/v1/completions", json=LONG) as r:
            lines = r.iter_lines()
            assert len(read_events(lines, 2)) == 2
            srv.proc.send_signal(sig)
            code = srv.proc.wait(60)
        # uvicorn drains for up to 5 s, then re-raises the signal: killed by it, or 0; never 1
        assert code in (0, -sig), (code, srv.text()[-3000:])
        wait_for(lambda: not pid_alive(srv.core_pid), 10, "the core process to go")
        assert "engine core died" not in srv.text()


def test_stopped_core_is_killed_and_its_requests_fail():
    """A core that cannot even run its own watchdog (here: SIGSTOP) is found silent by the server."""
    import asyncio
    from shepherd.request import SamplingParams

    async def main():
        engine = CoreProcessEngine(EngineConfig(executor="sim", max_total_tokens=8192, watchdog_timeout=1.0),
                                   log_level="warning")
        await engine.start()
        try:
            stream = await engine.submit(engine.tokenizer.encode("p"), SamplingParams(max_tokens=3000,
                                                                                      ignore_eos=True))
            await stream.__anext__()
            os.kill(engine.pid, signal.SIGSTOP)
            outs = [o async for o in stream]
            assert outs[-1].finish_reason == "error" and "engine core hung" in outs[-1].error
            assert not engine.alive
        finally:
            await engine.stop()
        return engine.pid

    pid = asyncio.run(asyncio.wait_for(main(), 60))
    assert not pid_alive(pid)


def test_large_messages_to_a_busy_core_under_uvloop():
    """uvloop's add_reader makes the pipe non-blocking; requests worth more than the socket buffer,
    sent while the core does not read (stopped here for 0.5 s, as a long step would), must wait for
    it, not fail part-way and declare a live core dead."""
    import asyncio
    import threading

    import uvloop

    from shepherd.request import SamplingParams

    engine = CoreProcessEngine(EngineConfig(executor="sim", max_total_tokens=8192), log_level="warning")

    async def main():
        await engine.start()
        try:
            os.kill(engine.pid, signal.SIGSTOP)
            threading.Timer(0.5, os.kill, (engine.pid, signal.SIGCONT)).start()
            prompts = [[1 + (i * 7 + j) % 900 for j in range(2000)] for i in range(60)]    # ~0.5 MB pickled

            async def one(p):
                outs = [o async for o in engine.submit(p, SamplingParams(max_tokens=2))]
                return outs[-1]
            last = await asyncio.gather(*(one(p) for p in prompts))
            assert all(o.finished and not o.error for o in last), [o.error for o in last if o.error][:1]
            assert engine.alive
        finally:
            await engine.stop()
    try:
        uvloop.run(main())
    finally:
        engine.close()


def proc_state(pid: int) -> str:
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


def test_a_large_send_to_a_busy_core_leaves_the_event_loop_running():
    """While the core does not read (stopped, as inside a long step), requests worth more than the
    socket buffer are sent: the server's event loop must go on running other callbacks (every other
    stream, /health) meanwhile, not wait in the send until the core reads. The core is let go only
    once the loop has shown it runs (or after 10 s, recorded as a failure)."""
    import asyncio
    import threading

    import uvloop

    from shepherd.request import SamplingParams

    engine = CoreProcessEngine(EngineConfig(executor="sim", max_total_tokens=8192), log_level="warning")
    loop_ran, held = threading.Event(), []

    def let_the_core_read():
        if not loop_ran.wait(10):
            held.append("the event loop ran nothing for 10 s while a send to the busy core was pending")
        os.kill(engine.pid, signal.SIGCONT)

    async def main():
        await engine.start()
        try:
            os.kill(engine.pid, signal.SIGSTOP)
            wait_for(lambda: proc_state(engine.pid) == "T", 10, "the core to stop")
            prompts = [[1 + (i * 7 + j) % 900 for j in range(2000)] for i in range(60)]    # ~0.5 MB pickled
            streams = [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts]  # one flush, next turn
            threading.Thread(target=let_the_core_read, daemon=True).start()
            for _ in range(100):            # loop turns: the flush runs in the first
                await asyncio.sleep(0)
                if held or engine.unsent_bytes:
                    break
            assert not held, held[0]
            unsent = engine.unsent_bytes    # read while the core is still stopped
            loop_ran.set()
            assert unsent > 0, "the message fit in the socket buffer: make it larger"

            async def last(stream):
                await stream
                return [o async for o in stream][-1]
            outs = await asyncio.wait_for(asyncio.gather(*(last(s) for s in streams)), 60)
            assert all(o.finished and not o.error for o in outs), [o.error for o in outs if o.error][:1]
            assert engine.alive and engine.unsent_bytes == 0
        finally:
            loop_ran.set()
            await engine.stop()
    try:
        uvloop.run(main())
    finally:
        engine.close()


def _pipe_on_loop(loop, conn):
    from shepherd.engine.pipe_io import FrameReader, PipeWriter
    errors: list = []
    return PipeWriter(loop, conn.fileno(), errors.append), FrameReader(conn.fileno()), errors


@pytest.mark.parametrize("loop_kind", ["asyncio", "uvloop"])
def test_pipe_io_speaks_connection_wire_format_both_ways(loop_kind):
    """The loop's end (pipe_io) and a plain blocking Connection (the core's end) understand each other:
    messages on both sides of the 16 KB and socket-buffer sizes, in order, whole; the writer never
    waits for a peer that does not read, and later sends queue behind a pending one."""
    import asyncio
    import multiprocessing
    import threading

    import uvloop

    ours, peer = multiprocessing.Pipe(duplex=True)
    msgs = [("small", 1), list(range(4000)), b"x" * 16379, b"y" * 16380, b"z" * 300_000,
            {"big": "w" * 1_000_000}, None]
    peer_may_read, got_by_peer = threading.Event(), []

    def peer_side():
        peer_may_read.wait()
        for _ in msgs:
            got_by_peer.append(peer.recv())
        for m in msgs:                          # and back: each larger one arrives in pieces
            peer.send(m)

    async def main():
        loop = asyncio.get_running_loop()
        writer, reader, errors = _pipe_on_loop(loop, ours)
        t = threading.Thread(target=peer_side, daemon=True)
        t.start()
        for m in msgs:
            writer.send(m)                      # the peer reads nothing yet: returns at once
        assert writer.pending_bytes > 200_000
        ticked = loop.create_future()
        loop.call_soon(ticked.set_result, True)
        assert await ticked                     # the loop runs other callbacks meanwhile
        peer_may_read.set()
        await asyncio.wait_for(writer.drained(), 30)
        assert writer.pending_bytes == 0
        got: list = []
        done = loop.create_future()

        def readable():
            got.extend(reader.read())
            if len(got) >= len(msgs) and not done.done():
                done.set_result(None)
        loop.add_reader(ours.fileno(), readable)
        try:
            await asyncio.wait_for(done, 30)
        finally:
            loop.remove_reader(ours.fileno())
        t.join(10)
        assert got_by_peer == msgs and got == msgs and not errors
        writer.close()
    try:
        (uvloop.run if loop_kind == "uvloop" else asyncio.run)(main())
    finally:
        ours.close()
        peer.close()


def test_pipe_io_frames_match_cpython_and_end_of_file_is_told():
    """Frames as CPython's Connection writes them (a 4-byte signed length; -1 and an 8-byte length for
    huge ones, here forged small), read by both; a message cut by EOF is an OSError after the whole
    ones before it; a write to a closed peer calls on_error once."""
    import asyncio
    import multiprocessing
    import pickle
    import struct

    from shepherd.engine.pipe_io import FrameReader, PipeWriter, frame

    assert frame("hi")[:4] == struct.pack("!i", len(pickle.dumps("hi")))
    a, b = multiprocessing.Pipe(duplex=True)
    payload = pickle.dumps({"huge": "header"})
    huge = struct.pack("!i", -1) + struct.pack("!Q", len(payload)) + payload
    os.write(a.fileno(), huge)
    assert b.recv() == {"huge": "header"}        # CPython reads the huge form
    b.send([1, 2])
    os.write(b.fileno(), huge)
    os.write(b.fileno(), frame("cut")[:-2])
    reader = FrameReader(a.fileno())
    assert reader.read() == [[1, 2], {"huge": "header"}]
    b.close()
    with pytest.raises(OSError, match="end of file"):
        reader.read()
    assert reader.eof

    async def write_to_gone_peer():
        errors: list = []
        writer = PipeWriter(asyncio.get_running_loop(), a.fileno(), errors.append)
        writer.send(b"x" * 1_000_000)
        await asyncio.wait_for(writer.drained(), 10)
        assert len(errors) == 1 and isinstance(errors[0], (BrokenPipeError, ConnectionResetError)), errors
        with pytest.raises(BrokenPipeError):
            writer.send("more")
    asyncio.run(write_to_gone_peer())
    a.close()


def test_stop_sends_shutdown_behind_a_pending_send_and_reads_the_core_last_message():
    """stop() while requests worth more than the socket buffer are still unsent to a busy core: SHUTDOWN
    goes behind them, the core returns by itself (exit code 0, not terminated), and its last message
    (its admission answers and abort terminals) is read: every request was admitted, then ended."""
    import asyncio

    import uvloop

    from shepherd.request import SamplingParams

    engine = CoreProcessEngine(EngineConfig(executor="sim", max_total_tokens=8192), log_level="warning")

    async def main():
        await engine.start()
        os.kill(engine.pid, signal.SIGSTOP)
        try:
            wait_for(lambda: proc_state(engine.pid) == "T", 10, "the core to stop")
            prompts = [[1 + (i * 7 + j) % 900 for j in range(2000)] for i in range(60)]
            streams = [engine.submit(p, SamplingParams(max_tokens=2)) for p in prompts]
            await asyncio.sleep(0)                  # the flush
            assert engine.unsent_bytes > 0
            stopping = asyncio.ensure_future(engine.stop())
            await asyncio.sleep(0)                  # stop() has queued SHUTDOWN and waits for it to go out
            assert not stopping.done()
        finally:
            os.kill(engine.pid, signal.SIGCONT)
        await asyncio.wait_for(stopping, 60)
        assert engine.proc.exitcode == 0
        for s in streams:
            await s                                 # admitted (the core's last message), not failed by stop
            outs = [o async for o in s]
            assert outs and outs[-1].finished
    try:
        uvloop.run(main())
    finally:
        engine.close()
