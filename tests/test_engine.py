"""Engine loop: continuous batching, detokenisation, stop strings, abort, limits,
crash and watchdog behaviour, metrics. No model: a scripted executor (or the
simulated one) with the real tokenizer."""
from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from shepherd.config import EngineConfig, SchedulerConfig
from shepherd.engine.engine import WATCHDOG_EXIT_CODE, Engine, EngineDeadError, QueueFull, RequestRejected
from shepherd.step import ExecutorFull, PlainExecutor, StepResult
from shepherd.model.loader import load_tokenizer
from shepherd.request import SamplingParams, TokenLogprob

TEXT = "Hello world, this is a test. Stop here! And then some more words follow."


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


class ScriptedExecutor(PlainExecutor):
    """Emits `script` (token ids) in order for every request, then EOS; optional
    per-step delay and a gate that blocks steps until opened."""

    def __init__(self, tokenizer, script, kv_capacity=4096, max_model_len=2048, delay=0.0, fail_at=None):
        self.tokenizer = tokenizer
        self.script = list(script)
        self.kv_capacity = kv_capacity
        self.host_kv_capacity = 0
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        self.model_name = "scripted"
        self.paced = False
        self.reqs = {}          # req_id -> its NewRequest: what an executor keeps of a request
        self.delay = delay
        self.fail_at = fail_at
        self.gate = threading.Event()
        self.gate.set()
        self.steps = 0
        self.batch_sizes: list[int] = []
        self.finished: list[str] = []

    def execute(self, batch):
        self.gate.wait()
        self.steps += 1
        if self.fail_at is not None and self.steps >= self.fail_at:
            raise RuntimeError("injected executor failure")
        if self.delay:
            time.sleep(self.delay)
        self.finished.extend(batch.finished)
        for rid in batch.finished:
            self.reqs.pop(rid, None)
        self.reqs.update((n.req_id, n) for n in batch.new)
        self.batch_sizes.append(len(batch.seqs))
        res = StepResult(step_time=self.delay)
        for s in batch.seqs:
            if not s.sample:
                continue
            new = self.reqs[s.req_id]
            k = s.end_pos - len(new.prompt_ids)        # output tokens so far
            tid = self.script[k] if k < len(self.script) else self.eos_token_ids[0]
            res.tokens[s.req_id] = [tid]
            if new.params.logprobs is not None:
                res.logprobs[s.req_id] = [TokenLogprob(tid, -0.5, [(tid, -0.5), (0, -2.0)][: new.params.logprobs])]
        return res


def make_engine(tok, script=None, sched=None, **kw):
    ex = ScriptedExecutor(tok, script if script is not None else tok.encode(TEXT), **kw)
    cfg = EngineConfig(executor="sim", watchdog_timeout=30.0, scheduler=sched or SchedulerConfig())
    return Engine(cfg, executor=ex, tokenizer=tok), ex


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


async def collect(stream):
    outs = [o async for o in stream]
    return outs


def joined(outs):
    return "".join(o.text for o in outs)


async def wait_idle(engine, timeout=5.0):
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        st = engine.stats()
        if st.num_running == 0 and st.num_waiting == 0 and st.kv_used == 0:
            return st
        await asyncio.sleep(0.01)
    raise AssertionError(f"engine not idle: {engine.stats()}")


def test_generates_script_then_eos(tok):
    async def main():
        engine, ex = make_engine(tok)
        await engine.start()
        try:
            ids = tok.encode("prompt text")
            outs = await collect(await engine.submit(ids, SamplingParams(max_tokens=100, temperature=0)))
            assert sum(o.finished for o in outs) == 1 and outs[-1].finished
            assert outs[-1].finish_reason == "stop"
            assert joined(outs) == TEXT
            # the EOS token is counted but its text is not emitted
            assert outs[-1].completion_tokens == len(tok.encode(TEXT)) + 1
            assert outs[-1].prompt_tokens == len(ids)
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_max_tokens_length(tok):
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            outs = await collect(await engine.submit(tok.encode("x"), SamplingParams(max_tokens=3)))
            assert outs[-1].finish_reason == "length"
            assert outs[-1].completion_tokens == 3
            assert joined(outs) == tok.decode(tok.encode(TEXT)[:3])
        finally:
            await engine.stop()
    run(main())


def test_a_reply_cut_inside_a_character_ends_before_it(tok):
    """max_tokens falls between the tokens of one character: the answer ends on the text before
    it (a JSON string cut there no longer ends in U+FFFD); the token still counts."""
    script = tok.encode("caf\u00e9 \U0001F600 fin")
    cut = next(k for k in range(1, len(script)) if tok.decode(script[:k]).endswith("\ufffd"))

    async def main():
        engine, _ = make_engine(tok, script=script)
        await engine.start()
        try:
            outs = await collect(await engine.submit(tok.encode("x"), SamplingParams(max_tokens=cut)))
            assert outs[-1].finish_reason == "length" and outs[-1].completion_tokens == cut
            assert joined(outs) == tok.decode(script[:cut])[:-1] and "\ufffd" not in joined(outs)
        finally:
            await engine.stop()
    run(main())


def test_an_id_in_flight_is_refused_and_free_again_once_its_request_ends(tok):
    """A second request under a live id would take the first one's outputs: refused at submit."""
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            first = engine.submit(tok.encode("x"), SamplingParams(max_tokens=5), req_id="r1")
            with pytest.raises(ValueError, match="r1"):
                engine.submit(tok.encode("y"), SamplingParams(max_tokens=2), req_id="r1")
            assert (await collect(await first))[-1].completion_tokens == 5
            again = await collect(await engine.submit(tok.encode("y"), SamplingParams(max_tokens=2), req_id="r1"))
            assert again[-1].completion_tokens == 2
        finally:
            await engine.stop()
    run(main())


@pytest.mark.parametrize("stop,expected", [
    ("world, th", "Hello "),              # spans three tokens
    ("s a te", "Hello world, this i"),    # starts and ends mid-token
    (". Stop", "Hello world, this is a test"),
    ("not in the text", TEXT),
])
def test_stop_strings_spanning_tokens(tok, stop, expected):
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            outs = await collect(await engine.submit(tok.encode("p"), SamplingParams(max_tokens=100, stop=[stop])))
            assert joined(outs) == expected
            assert outs[-1].finish_reason == "stop"
            # no delta ever contained text past the stop point
            acc = ""
            for o in outs:
                acc += o.text
                assert expected.startswith(acc)
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_min_tokens_holds_stop_strings(tok):
    """A stop string inside the first min_tokens tokens does not end the request (as vLLM);
    the first one after it does."""
    script = tok.encode("a, b, c, d, e, f, g, h")
    async def main():
        engine, _ = make_engine(tok, script)
        await engine.start()
        try:
            free = joined(await collect(await engine.submit(tok.encode("p"), SamplingParams(max_tokens=50,
                                                                                             stop=[","]))))
            held = await collect(await engine.submit(tok.encode("p"), SamplingParams(
                max_tokens=50, stop=[","], min_tokens=4)))
            assert free == "a"                 # tokens: "a" "," " b" "," ...: the 2nd would stop it
            assert joined(held) == "a, b" and held[-1].finish_reason == "stop"
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


class SlowGrammars:
    """The executor's grammar_ready, compiling for as long as the test says: False until `ready`
    is set, and the step must never wait for it."""

    def __init__(self):
        self.ready = threading.Event()
        self.asked = 0
        self.held: set[str] = set()       # requests it said ready for: it holds their grammar
        self.dropped: list[str] = []

    def grammar_ready(self, req_id, spec) -> bool:
        self.asked += 1
        if spec[1] == "bad":
            raise ValueError("no such grammar")
        if spec[1] == "full":
            raise ExecutorFull("compiled grammars held by requests in flight are at the bound", retry_after=3.0)
        if self.ready.is_set():
            self.held.add(req_id)
        return self.ready.is_set()

    def drop_grammar(self, req_id) -> None:
        self.dropped.append(req_id)


def test_a_request_waits_for_its_grammar_outside_the_batch(tok):
    async def main():
        ex = ScriptedExecutor(tok, tok.encode(TEXT))
        grammars = SlowGrammars()
        ex.grammar_ready = grammars.grammar_ready
        engine = Engine(EngineConfig(executor="sim", watchdog_timeout=30.0), executor=ex, tokenizer=tok)
        await engine.start()
        try:
            slow = engine.submit(tok.encode("p"), SamplingParams(max_tokens=5, grammar=("regex", "x+")))
            free = await collect(await engine.submit(tok.encode("p"), SamplingParams(max_tokens=6)))
            assert len(free) and free[-1].finish_reason == "length"        # ran while the grammar compiled
            assert not slow.admitted.done() and grammars.asked > 0
            assert all(n <= 1 for n in ex.batch_sizes)                     # the parked one never ran
            grammars.ready.set()
            outs = await collect(await slow)
            assert outs[-1].finish_reason == "length" and sum(len(o.token_ids) for o in outs) == 5
            with pytest.raises(RequestRejected, match="no such grammar"):
                await engine.submit(tok.encode("p"), SamplingParams(max_tokens=5, grammar=("regex", "bad")))
            # the executor's grammars at its memory bound: overload (429 with Retry-After), not a 400
            with pytest.raises(QueueFull, match="at the bound") as full:
                await engine.submit(tok.encode("p"), SamplingParams(max_tokens=5, grammar=("regex", "full")))
            assert full.value.retry_after == 3.0
            grammars.ready.clear()                                # an abort while parked
            parked = engine.submit(tok.encode("p"), SamplingParams(max_tokens=5, grammar=("regex", "y+")))
            parked.abort()
            outs = await collect(parked)
            assert outs[-1].finish_reason == "abort"
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_a_grammar_request_the_queue_refuses_is_dropped_by_the_executor(tok):
    """Ready grammars are held by the executor per request until the request ends; one the
    scheduler refuses once its grammar is ready never reaches the executor, so the core drops it
    there (else each 429 under load would keep a compiled grammar for good), and one that ends is
    dropped as it ends, not with the next batch that runs (an idle engine runs none, and the held
    grammars are bounded: --max-grammar-memory)."""
    async def main():
        ex = ScriptedExecutor(tok, tok.encode(TEXT))
        grammars = SlowGrammars()
        ex.grammar_ready, ex.drop_grammar = grammars.grammar_ready, grammars.drop_grammar
        sched = SchedulerConfig(max_batch_size=1, max_queue=1, max_concurrency=1)
        engine = Engine(EngineConfig(executor="sim", watchdog_timeout=30.0, scheduler=sched), executor=ex,
                        tokenizer=tok)
        await engine.start()
        try:
            subs = [engine.submit(tok.encode(f"p{i}"), SamplingParams(max_tokens=3, grammar=("regex", "x+")))
                    for i in range(4)]
            grammars.ready.set()       # all four parked; now they are admitted at once, beyond the limits
            res = await asyncio.gather(*subs, return_exceptions=True)
            refused = [s.req_id for s, r in zip(subs, res) if isinstance(r, QueueFull)]
            streams = [r for r in res if not isinstance(r, BaseException)]
            assert refused and streams and len(refused) + len(streams) == 4
            for st in streams:
                assert (await collect(st))[-1].finish_reason == "length"
            # every request it said ready for was dropped by the time its answer ended, with no
            # batch run since: the refused at once, the admitted as they finished
            assert len(grammars.held) == 4 and sorted(grammars.dropped) == sorted(grammars.held)
        finally:
            await engine.stop()
    run(main())


def test_holdback_of_possible_stop_prefix(tok):
    """Text that could start a stop string is held back until it is known not to be one."""
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            stream = await engine.submit(tok.encode("p"), SamplingParams(max_tokens=100, stop=["world peace"]))
            outs = await collect(stream)
            assert joined(outs) == TEXT
            acc = ""
            for o in outs:
                acc += o.text
                if not o.finished:
                    # " world" was withheld while it could still become "world peace"
                    assert not acc.endswith("world")
        finally:
            await engine.stop()
    run(main())


def test_stop_token_ids_and_ignore_eos(tok):
    script = tok.encode(TEXT)
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            stop_id = script[3]  # " this"
            outs = await collect(await engine.submit(tok.encode("p"),
                                                     SamplingParams(max_tokens=100, stop_token_ids=[stop_id])))
            assert outs[-1].finish_reason == "stop"
            assert joined(outs) == "Hello world,"
            outs = await collect(await engine.submit(tok.encode("p"),
                                                     SamplingParams(max_tokens=len(script) + 3, ignore_eos=True)))
            assert outs[-1].finish_reason == "length"
            assert outs[-1].completion_tokens == len(script) + 3
        finally:
            await engine.stop()
    run(main())


def test_logprobs_pass_through(tok):
    async def main():
        engine, _ = make_engine(tok)
        await engine.start()
        try:
            outs = await collect(await engine.submit(tok.encode("p"), SamplingParams(max_tokens=4, logprobs=2)))
            lps = [lp for o in outs for lp in o.logprobs]
            ids = [t for o in outs for t in o.token_ids]
            assert len(lps) == len(ids) == 4
            assert [lp.token_id for lp in lps] == ids
            assert all(len(lp.top) == 2 for lp in lps)
        finally:
            await engine.stop()
    run(main())


def test_continuous_batching_joins_next_step(tok):
    async def main():
        engine, ex = make_engine(tok, script=tok.encode(TEXT * 3), delay=0.005)
        await engine.start()
        try:
            s1 = await engine.submit(tok.encode("a"), SamplingParams(max_tokens=40, ignore_eos=True))
            first = await s1.__anext__()
            assert first.token_ids
            s2 = await engine.submit(tok.encode("b"), SamplingParams(max_tokens=5, ignore_eos=True))
            o2 = await collect(s2)
            assert o2[-1].finish_reason == "length"
            o1 = await collect(s1)
            assert o1[-1].finish_reason == "length"
            assert 2 in ex.batch_sizes          # both ran in one step
            assert ex.batch_sizes[-1] == 1      # the short one left early
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_abort_frees_kv_within_a_step(tok):
    async def main():
        engine, ex = make_engine(tok, script=tok.encode(TEXT * 5), delay=0.01)
        await engine.start()
        try:
            stream = await engine.submit(tok.encode("some prompt"), SamplingParams(max_tokens=500, ignore_eos=True))
            got = 0
            async for o in stream:
                got += len(o.token_ids)
                if got >= 3:
                    break
            assert engine.stats().kv_used > 0
            steps_before = ex.steps
            stream.abort()
            rest = await collect(stream)
            assert rest[-1].finished and rest[-1].finish_reason == "abort"
            st = await wait_idle(engine)
            assert st.kv_free + st.kv_evictable == st.kv_capacity
            assert ex.steps - steps_before <= 2
            stream.abort()  # idempotent
            engine.abort("no-such-request")
            # the engine keeps serving
            outs = await collect(await engine.submit(tok.encode("again"), SamplingParams(max_tokens=2)))
            assert outs[-1].finish_reason == "length"
        finally:
            await engine.stop()
    run(main())


def test_queue_full_and_nothing_lost(tok):
    async def main():
        sched = SchedulerConfig(max_batch_size=1, max_queue=2, max_concurrency=3)
        engine, ex = make_engine(tok, sched=sched, delay=0.002)
        await engine.start()
        try:
            # all submitted at once: they land in one intake drain, beyond the limits -> QueueFull
            res = await asyncio.gather(*(engine.submit(tok.encode(f"req {i}"), SamplingParams(max_tokens=4))
                                         for i in range(8)), return_exceptions=True)
            streams = [r for r in res if not isinstance(r, BaseException)]
            rejected = [r for r in res if isinstance(r, BaseException)]
            assert streams and rejected
            for e in rejected:
                assert isinstance(e, QueueFull) and e.retry_after > 0
            results = await asyncio.gather(*(collect(s) for s in streams))
            for outs in results:
                assert sum(o.finished for o in outs) == 1
                assert outs[-1].finish_reason in ("length", "stop")
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_engine_crash_fails_pending_requests(tok):
    async def main():
        engine, ex = make_engine(tok, fail_at=3, delay=0.05)
        await engine.start()
        streams = await asyncio.gather(*(engine.submit(tok.encode(f"r{i}"),
                                                       SamplingParams(max_tokens=50, ignore_eos=True))
                                         for i in range(3)))
        results = await asyncio.gather(*(collect(s) for s in streams))
        for outs in results:
            assert outs[-1].finished and outs[-1].finish_reason == "error"
            assert "injected executor failure" in outs[-1].error
            assert outs[-1].error_kind == "engine"
        assert not engine.alive
        with pytest.raises(EngineDeadError):
            await engine.submit(tok.encode("late"), SamplingParams(max_tokens=2))
        await engine.stop()
    run(main())


def test_stop_aborts_inflight(tok):
    async def main():
        engine, _ = make_engine(tok, delay=0.01, script=tok.encode(TEXT * 5))
        await engine.start()
        stream = await engine.submit(tok.encode("p"), SamplingParams(max_tokens=1000, ignore_eos=True))
        await stream.__anext__()
        await engine.stop()
        outs = await collect(stream)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
    run(main())


def test_watchdog_callback(tok):
    fired = threading.Event()

    async def main():
        ex = ScriptedExecutor(tok, tok.encode(TEXT), delay=1.0)
        cfg = EngineConfig(executor="sim", watchdog_timeout=0.2)
        engine = Engine(cfg, executor=ex, tokenizer=tok, on_watchdog=lambda elapsed: fired.set())
        await engine.start()
        try:
            stream = await engine.submit(tok.encode("p"), SamplingParams(max_tokens=1))
            await collect(stream)
        finally:
            await engine.stop()
    run(main())
    assert fired.is_set()


def test_watchdog_exits_process_with_stacks():
    script = textwrap.dedent("""
        import asyncio, time, threading
        from shepherd.config import EngineConfig
        from shepherd.engine.engine import Engine
        from shepherd.step import PlainExecutor, StepResult
        from shepherd.model.loader import load_tokenizer
        from shepherd.request import SamplingParams

        class Hang(PlainExecutor):
            kv_capacity = 1024; host_kv_capacity = 0; max_model_len = 512; eos_token_ids = (2,)
            model_name = "hang"; tokenizer = None; paced = False
            def execute(self, batch):
                time.sleep(60)
                return StepResult()

        async def main():
            tok = load_tokenizer(None)
            e = Engine(EngineConfig(executor="sim", watchdog_timeout=0.3), executor=Hang(), tokenizer=tok)
            await e.start()
            s = await e.submit([1, 2, 3], SamplingParams(max_tokens=2))
            async for _ in s:
                pass
        asyncio.run(main())
    """)
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert p.returncode == WATCHDOG_EXIT_CODE, p.stderr[-2000:]
    assert "watchdog" in p.stderr
    assert "shepherd-engine" in p.stderr or "Thread 0x" in p.stderr
    assert "execute" in p.stderr  # the hung frame is in the dump


def test_metrics_per_engine_registry(tok):
    async def main():
        e1, _ = make_engine(tok)
        e2, _ = make_engine(tok)
        await e1.start()
        await e2.start()
        try:
            await collect(await e1.submit(tok.encode("hello there"), SamplingParams(max_tokens=3)))
            await wait_idle(e1)
            text = e1.metrics.render().decode()
            for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                         "vllm:gpu_cache_usage_perc", "vllm:num_preemptions_total", "vllm:prompt_tokens_total",
                         "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_bucket",
                         "vllm:inter_token_latency_seconds_bucket", "vllm:e2e_request_latency_seconds_bucket",
                         "vllm:request_queue_time_seconds_bucket", "vllm:prefix_cache_queries_total",
                         "vllm:prefix_cache_hits_total", "shepherd:kv_free_tokens", "shepherd:kv_evictable_tokens",
                         "shepherd:kv_used_tokens", "shepherd:kv_capacity_tokens"):
                assert name in text, name
            assert 'vllm:generation_tokens_total{model_name="scripted"} 3.0' in text
            assert 'vllm:num_requests_running{model_name="scripted"} 0.0' in text
            assert 'vllm:generation_tokens_total{model_name="scripted"} 0.0' in e2.metrics.render().decode()
        finally:
            await e1.stop()
            await e2.stop()
    run(main())


def test_sim_executor_engine_serves(tok):
    """The simulated executor with the real tokenizer runs end to end through the engine."""
    async def main():
        cfg = EngineConfig(executor="sim", max_total_tokens=4096)
        engine = Engine(cfg)
        assert engine.kv_capacity > 0
        await engine.start()
        try:
            streams = [await engine.submit(tok.encode(f"hello {i}"), SamplingParams(max_tokens=8, seed=i))
                       for i in range(4)]
            results = await asyncio.gather(*(collect(s) for s in streams))
            for outs in results:
                assert sum(o.finished for o in outs) == 1
                assert outs[-1].finish_reason in ("stop", "length")
                assert 1 <= outs[-1].completion_tokens <= 8
            await wait_idle(engine)
        finally:
            await engine.stop()
    run(main())


def test_sglang_style_log_lines(tok, caplog):
    import logging
    caplog.set_level(logging.INFO, logger="shepherd.engine")

    async def main():
        ex = ScriptedExecutor(tok, tok.encode(TEXT * 3))
        engine = Engine(EngineConfig(executor="sim", log_every_steps=5), executor=ex, tokenizer=tok)
        await engine.start()
        try:
            await collect(await engine.submit(tok.encode("hello"), SamplingParams(max_tokens=20, ignore_eos=True)))
        finally:
            await engine.stop()
    run(main())
    text = caplog.text
    assert "KV cache: capacity 4096 tokens" in text
    assert re.search(r"Prefill batch\. #new-seq: 1, #new-token: \d+, #cached-token: \d+, token usage: [0-9.]+, "
                     r"#running-req: 1, #queue-req: 0", text), text
    assert re.search(r"Decode batch\. #running-req: 1, #token: \d+, token usage: [0-9.]+, "
                     r"gen throughput \(token/s\): [0-9.]+, #queue-req: 0, #preempted: 0", text), text
    assert len(re.findall("Decode batch", text)) == 19 // 5


def test_crash_during_intake_answers_every_submit(tok):
    """A bug while taking requests in must not leave a submitter waiting forever."""
    async def main():
        engine, _ = make_engine(tok, delay=0.01)
        await engine.start()
        running = await engine.submit(tok.encode("first"), SamplingParams(max_tokens=100, ignore_eos=True))

        def broken_add(req, now):
            raise ValueError("scheduler bug")
        engine.scheduler.add = broken_add
        res = await asyncio.gather(*(engine.submit(tok.encode(f"r{i}"), SamplingParams(max_tokens=2))
                                     for i in range(3)), return_exceptions=True)
        assert all(isinstance(r, EngineDeadError) for r in res), res
        outs = await collect(running)
        assert outs[-1].finish_reason == "error" and "scheduler bug" in outs[-1].error
        await engine.stop()
    run(main())


def test_submit_iterable_without_await(tok):
    async def main():
        sched = SchedulerConfig(max_queue=1, max_concurrency=1)
        engine, _ = make_engine(tok, sched=sched, delay=0.01)
        await engine.start()
        try:
            text = ""
            async for out in engine.submit(tok.encode("p"), SamplingParams(max_tokens=3)):
                text += out.text
            assert text == tok.decode(tok.encode(TEXT)[:3])
            a = engine.submit(tok.encode("a"), SamplingParams(max_tokens=3))
            b = engine.submit(tok.encode("b"), SamplingParams(max_tokens=3))
            with pytest.raises(QueueFull):      # admission errors surface on first iteration too
                async for _ in b:
                    pass
            assert (await collect(a))[-1].finished
        finally:
            await engine.stop()
    run(main())


def test_thread_governor_drops_to_one_thread_under_contention_and_comes_back():
    """engine/threads.py: two contended windows in a row -> one thread; two windows with a CPU's
    worth idle -> all threads again; one odd window changes nothing."""
    from shepherd.engine.threads import ThreadGovernor, cpu_idle, thread_times
    calls = []
    gov = ThreadGovernor(2, calls.append, window=0.0)
    for share, idle in [(0.6, 0.0), (0.02, 0.0), (0.5, 0.0)]:       # a spike, then calm: no change
        gov.decide(share, idle)
    assert calls == [] and gov.threads == 2
    gov.decide(0.45, 0.0)                                          # the second contended window in a row
    assert calls == [1] and gov.threads == 1
    for share, idle in [(0.0, 0.1), (0.0, 0.9), (0.0, 0.2)]:       # still crowded (no CPU free twice)
        gov.decide(share, idle)
    assert calls == [1]
    gov.decide(0.0, 0.9)
    gov.decide(0.0, 1.0)
    assert calls == [1, 2] and gov.threads == 2
    gov.tick()                                                     # reads /proc for real without failing
    run_wait, idle = thread_times(set()), cpu_idle(os.sched_getaffinity(0))
    assert run_wait is None or run_wait[0] > 0
    assert idle is None or idle[1] > 0


def test_mid_step_rule_is_on_by_default_on_every_path(monkeypatch):
    """engine/core_proc.py: the governor watches the layers by default on every path, the
    one-call layer stack included (its C call looks for itself); SHEPHERD_GOVERNOR_MID_STEP=0
    turns it off (the window rule alone), =1 keeps it on."""
    from shepherd.engine.core_proc import mid_step_rule
    monkeypatch.delenv("SHEPHERD_GOVERNOR_MID_STEP", raising=False)
    assert mid_step_rule()
    monkeypatch.setenv("SHEPHERD_GOVERNOR_MID_STEP", "1")
    assert mid_step_rule()
    monkeypatch.setenv("SHEPHERD_GOVERNOR_MID_STEP", "0")
    assert not mid_step_rule()


def test_thread_governor_drops_in_the_middle_of_a_step_another_process_stretches():
    """engine/threads.py's mid-step rule on a fake clock, per-op path (the hook reads the
    process's CPU time): a forward in which two looks in a row found the process short of CPUs
    (under threads x (1 - contended)) and its threads waited for a CPU more than `sharp` of the
    time between them goes to one thread before its next layer; a quiet step, a long one with
    both CPUs (neither reads /proc), a single-threaded stretch nobody waits in, a wait below
    `sharp` and short looks never two in a row do not. After the drop, windows of `recheck` s
    (inside the step too, and the first after an idle engine) bring all threads back at once
    when a CPU stood idle, and keep one thread while the cores stay busy. After a drop by the
    two-window rule nothing is read at one thread and the hook wants no more layers (the model
    runs the rest of its layer stack in one C call)."""
    from shepherd.engine.threads import ThreadGovernor
    now, cpu, main, reads, calls, idle = [0.0], [0.0], [0, 0], [], [], [0.0]

    def times():
        reads.append(now[0])
        return tuple(main)

    gov = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: cpu[0],
                         times=times, probe=0.01, sharp=0.49, recheck=0.1,
                         idle=lambda cpus: (int(idle[0] * 100), int(now[0] * 200)))   # jiffies of 2 CPUs
    reads.clear()

    def forward(layers: list, idle_cpus: float = 0.0) -> int:
        """Run one layer per (seconds, CPUs the process gets, share of the time its threads
        wait for a CPU), with `idle_cpus` of the machine's idle. Returns the layer before which
        the thread count changed (-1: never)."""
        for li, (dt, cpus, waiting) in enumerate(layers):
            before, threads = len(calls), gov.threads
            wait = gov.between_layers(li)       # its next watch; None: no more (at one thread)
            assert wait is None or wait.probe <= gov.recheck
            if len(calls) > before:
                assert wait is not None     # a drop: the short windows after it look inside the step
                return li
            assert wait is not None or threads == 1
            now[0] += dt
            idle[0] += idle_cpus * dt
            cpu[0] += cpus * dt
            main[0] += int((1 - waiting) * dt * 1e9)
            main[1] += int(waiting * dt * 1e9)
        return -1

    assert forward([(0.0005, 2.0, 0.0)] * 30) == -1                 # a quiet 15 ms decode step
    assert forward([(0.01, 1.9, 0.05)] * 30) == -1                  # a 300 ms prefill with both CPUs
    assert reads == []
    assert forward([(0.01, 1.0, 0.0)] * 30) == -1                   # one CPU busy, nobody waiting
    assert forward([(0.01, 1.2, 0.46)] * 30) == -1                  # waiting 46 %: below `sharp`
    assert forward([(0.01, 1.0, 0.5), (0.01, 1.9, 0.0)] * 15) == -1  # contended looks, never two in a row
    assert calls == [] and gov.mid_step_drops == 0
    at = forward([(0.004, 1.0, 0.5)] * 30)                           # a stretched step: half the time waiting
    assert at == 6 and calls == [1] and gov.threads == 1 and gov.mid_step_drops == 1   # looks at 12 and 24 ms
    # the cores stay busy: its 0.1 s windows (between layers and between steps) keep one thread
    assert forward([(0.004, 1.0, 0.0)] * 100) == -1
    reads.clear()
    for _ in range(3):
        now[0] += 0.1
        gov.tick()
    assert calls == [1] and gov.threads == 1 and len(reads) == 3
    now[0] += 1.0                                                    # an idle engine: no step, no tick
    idle[0] += 1.0                                                   # (the first tick after it sees that)
    assert forward([(0.004, 1.0, 0.0)] * 3) == 0 and calls == [1, 2] and gov.threads == 2
    gov.decide(0.5, 0.0)                                             # the two-window rule, as before
    gov.decide(0.5, 0.0)
    assert calls == [1, 2, 1]
    reads.clear()
    assert forward([(0.004, 1.0, 0.5)] * 30) == -1 and reads == []  # at one thread from it: nothing to look at
    gov.decide(0.0, 0.9)                                             # two windows bring it back
    gov.decide(0.0, 1.0)
    assert calls == [1, 2, 1, 2] and gov.threads == 2
    # a burst that ends inside the step: all threads again at the first 0.1 s window with a CPU idle
    assert forward([(0.004, 1.0, 0.5)] * 30) == 6 and calls == [1, 2, 1, 2, 1]
    assert forward([(0.02, 1.0, 0.0)] * 10, idle_cpus=0.9) == 5 and calls == [1, 2, 1, 2, 1, 2] and gov.threads == 2


def test_thread_governor_on_the_one_call_stack_returns_only_at_short_looks():
    """On the one-call layer stack the C call looks (kernels.StackLook: each thread's CPU share
    of the wall) and the governor's watch says when it returns: at layer 0 and after a look
    that found no thread descheduled, only at a look where one got less than `least`; after
    such a look, at the next look whatever it finds. Two short looks in a row with the threads
    waiting more than `sharp` between them: one thread; a short look followed by a quiet one
    (a burst of the server's own work on the last step's output) reads /proc once and goes on."""
    from shepherd.engine.threads import ThreadGovernor
    from shepherd.model.kernels import StackLook, StackWatch
    now, main, reads, calls = [0.0], [0, 0], [], []

    def times():
        reads.append(now[0])
        return tuple(main)

    gov = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: 0.0, times=times,
                         probe=0.01, sharp=0.49, least=0.65, idle=lambda cpus: (0, int(now[0] * 200)),
                         stretch=0.0)    # the two-look rule alone (the stretch rule: the next test)
    reads.clear()
    quiet = StackWatch(0.01, 0.65)
    assert gov.between_layers(0) == quiet and reads == []            # a quiet forward: one call, no /proc

    def look(layer, dt, least, waiting):
        now[0] += dt
        main[0] += int((1 - waiting) * dt * 2e9)
        main[1] += int(waiting * dt * 2e9)
        return gov.between_layers(layer, StackLook(least=least, cpus=2 * least, wall=dt))
    assert gov.between_layers(0) == quiet
    assert look(3, 0.02, 0.3, 0.5) == StackWatch(0.01) and len(reads) == 1    # short: the next look whatever
    assert look(6, 0.01, 0.95, 0.0) == quiet and len(reads) == 1 and calls == []   # quiet again: no drop
    assert look(9, 0.02, 0.3, 0.5) == StackWatch(0.01)
    assert look(11, 0.02, 0.4, 0.3) == StackWatch(0.01) and calls == []         # waiting 30 %: below sharp
    assert look(13, 0.02, 0.35, 0.55) == StackWatch(0.1) and calls == [1] and gov.mid_step_drops == 1


def test_thread_governor_drops_at_the_second_stretched_op():
    """The stretch rule (engine/threads.py): the governor's watch asks the stack to look right
    after an op that took `stretch` s or more in a forward of at most `stretch_rows` rows
    (kernels.StackWatch); the second such look (StackLook.op: the longest op since the last look)
    within `pair` s where a thread lost at least half of `stretch` of CPU drops to one thread at
    once, without /proc's run-queue waits, and so does the first where a task besides the team's
    threads is runnable at the look. One alone with nobody else runnable goes on; an op that long
    in which no thread lost the CPU (every thread ran: not another process), or an op under
    `stretch`, is no stretch look (a short one takes the two-look road)."""
    from shepherd.engine.threads import ThreadGovernor
    from shepherd.model.kernels import StackLook, StackWatch
    now, reads, calls, tasks = [0.0], [], [], [2]

    def times():
        reads.append(now[0])
        return (0, 0)

    gov = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: 0.0, times=times,
                         probe=0.01, sharp=0.49, least=0.65, idle=lambda cpus: (0, int(now[0] * 200)),
                         stretch=0.004, stretch_rows=8, pair=0.05, tasks=lambda: tasks[0],
                         machine_cpus=2)
    reads.clear()
    quiet = StackWatch(0.01, 0.65, 0.004, 8)
    assert gov.between_layers(0) == quiet and reads == []

    def look(layer, dt, least, op):
        now[0] += dt
        return gov.between_layers(layer, StackLook(least=least, cpus=1 + least, wall=dt, op=op))
    # a 6 ms op, every thread on its CPU throughout (lost 0.6 ms of 6): no drop, and not short
    assert look(2, 0.006, 0.9, 0.006) == quiet and calls == [] and reads == []
    # a 3 ms op (under `stretch`) in a short look: the two-look road (the next look whatever)
    assert look(4, 0.008, 0.5, 0.003) == StackWatch(0.01, None, 0.004, 8) and calls == [] and len(reads) == 1
    assert look(6, 0.01, 0.95, 0.0002) == quiet and calls == []
    # a 5 ms op in which a thread lost 4.5 ms of CPU: a stretch look, the first (a short look too)
    assert look(8, 0.009, 0.5, 0.005) == StackWatch(0.01, None, 0.004, 8) and calls == [] and len(reads) == 2
    assert look(9, 0.001, 0.9, 0.0001) == quiet
    # the next one 60 ms later (over `pair`): the first of a new pair
    assert look(10, 0.06, 0.9, 0.008) == quiet and calls == []
    # and a second within 50 ms: one thread at once, /proc read only for the way back
    assert look(12, 0.02, 0.7, 0.006) == StackWatch(0.1) and calls == [1] and gov.mid_step_drops == 1
    assert len(reads) == 3
    # a first stretch look with a task besides the team's two runnable at it: one thread at once
    gov = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: 0.0, times=times,
                         probe=0.01, least=0.65, idle=lambda cpus: (0, int(now[0] * 200)),
                         stretch=0.004, stretch_rows=8, pair=0.05, tasks=lambda: tasks[0],
                         machine_cpus=2)
    assert gov.between_layers(0) == quiet
    tasks[0] = 3
    assert look(3, 0.008, 0.4, 0.005) == StackWatch(0.1) and calls == [1, 1] and gov.mid_step_drops == 1
    # on a machine of 8 CPUs, 3 runnable besides the team's 2 leave a CPU free: the first stretch
    # look goes on; 7 besides them (more than the 6 CPUs the team leaves) drop at once
    big = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: 0.0, times=times,
                         probe=0.01, least=0.65, idle=lambda cpus: (0, int(now[0] * 200)),
                         stretch=0.004, stretch_rows=8, pair=0.05, tasks=lambda: tasks[0], machine_cpus=8)
    gov = big
    assert big.between_layers(0) == quiet
    tasks[0] = 5
    assert look(3, 0.008, 0.4, 0.005) == StackWatch(0.01, None, 0.004, 8) and calls == [1, 1]
    now[0] += 0.1      # past `pair`: the next stretch look is a first one again
    tasks[0] = 9
    assert look(5, 0.008, 0.4, 0.005) == StackWatch(0.1) and calls == [1, 1, 1] and big.mid_step_drops == 1
    # stretch 0: no stretch looks asked for, and a look's op is never read
    off = ThreadGovernor(2, calls.append, clock=lambda: now[0], cpu_clock=lambda: 0.0, times=times,
                         probe=0.01, least=0.65, idle=lambda cpus: (0, int(now[0] * 200)), stretch=0.0)
    assert off.between_layers(0) == StackWatch(0.01, 0.65)
    now[0] += 0.01
    assert off.between_layers(3, StackLook(least=0.3, cpus=1.3, wall=0.01, op=0.009)) == StackWatch(0.01)
    assert calls == [1, 1, 1] and off.mid_step_drops == 0
