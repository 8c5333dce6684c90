"""Scheduler basics on the simulated executor (no model)."""
from __future__ import annotations

import pytest

from shepherd.config import SchedulerConfig
from shepherd.step import PlainExecutor, StepResult
from sim_targets import run_offline
from shepherd.request import FinishReason, Request, RequestState, SamplingParams
from shepherd.scheduler.scheduler import QueueFull, RequestRejected, Scheduler
from shepherd.engine.sim_executor import SimExecutor

EOS = 2


def mk(rid, n=10, max_tokens=8, out=None, arrival=0.0, base=100, **kw):
    params = kw.pop("params", None) or SamplingParams(max_tokens=max_tokens)
    r = Request(rid, [base + (i % 50) for i in range(n)], params, arrival=arrival, eos_token_ids=(EOS,), **kw)
    if out is not None:
        r.sim_output_len = out
    return r


def sched(**kw):
    host = kw.pop("host", 0)
    mml = kw.pop("max_model_len", 8192)
    return Scheduler(SchedulerConfig(**kw), host_kv_capacity=host, max_model_len=mml)


def run(s, reqs, check=True, **kw):
    ex = SimExecutor(kv_capacity=s.capacity, host_kv_capacity=s.host_kv_capacity, check=check)

    def obs(b, o, t0, t1):
        s.check_integrity()
    done = run_offline(s, ex, reqs, observer=obs, **kw)
    s.check_integrity()
    return done, ex


def test_fcfs_runs_everything_and_idle_invariant():
    s = sched(max_total_tokens=256, max_batch_size=4, max_num_tokens=32)
    reqs = [mk(f"r{i}", n=20 + i, max_tokens=30, out=5 + i) for i in range(10)]
    done, ex = run(s, reqs)
    for i, r in enumerate(reqs):
        assert r.state is RequestState.FINISHED
        assert r.finish_reason is FinishReason.STOP
        assert len(r.output_ids) == 5 + i and r.output_ids[-1] == EOS
    st = s.stats()
    assert st.kv_free + st.kv_evictable == 256 and st.kv_used == 0
    assert not s.has_work


def test_fcfs_admission_order():
    s = sched(max_total_tokens=1024, max_batch_size=1, max_num_tokens=64)
    reqs = [mk(f"r{i}", n=10, max_tokens=3, arrival=0.0, base=100 + 50 * i) for i in range(5)]
    done, _ = run(s, reqs)
    starts = [done[f"r{i}"].admitted_at for i in range(5)]
    assert starts == sorted(starts)
    assert len(set(starts)) == 5          # batch size 1: one at a time


def test_max_tokens_length_and_stop_token_ids():
    s = sched(max_total_tokens=512)
    a = mk("a", max_tokens=7)                     # no target: runs to max_tokens
    ex = SimExecutor(kv_capacity=512)
    c = mk("c", max_tokens=50, out=3, params=SamplingParams(max_tokens=50, ignore_eos=True))
    c.sim_output_len = 3                          # ignored: ignore_eos
    done = run_offline(s, ex, [a, c])
    assert done["a"].finish_reason is FinishReason.LENGTH and len(done["a"].output_ids) == 7
    assert done["c"].finish_reason is FinishReason.LENGTH and len(done["c"].output_ids) == 50


class Scripted(PlainExecutor):
    """Executor that samples a fixed token sequence per request."""
    def __init__(self, script, cap=512):
        self.script, self.kv_capacity, self.host_kv_capacity = script, cap, 0
        self.max_model_len, self.eos_token_ids = 8192, (EOS,)
        self.output_lens, self.prompt_len = {}, {}

    def execute(self, batch):
        self.prompt_len.update((n.req_id, len(n.prompt_ids)) for n in batch.new)
        return StepResult(tokens={s.req_id: [self.script[s.req_id][s.end_pos - self.prompt_len[s.req_id]]]
                                  for s in batch.seqs if s.sample}, step_time=0.01)


def test_stop_token_ids_and_eos_and_ignore_eos():
    s = sched(max_total_tokens=512)
    b = mk("b", max_tokens=50, params=SamplingParams(max_tokens=50, stop_token_ids=[77]))
    e = mk("e", max_tokens=50)
    i = mk("i", max_tokens=5, params=SamplingParams(max_tokens=5, ignore_eos=True))
    ex = Scripted({"b": [5, 6, 7, 77, 8, 9] + [5] * 50, "e": [5, EOS] + [5] * 50, "i": [EOS] * 10})
    done = run_offline(s, ex, [b, e, i])
    assert done["b"].finish_reason is FinishReason.STOP and done["b"].output_ids == [5, 6, 7, 77]
    assert done["e"].finish_reason is FinishReason.STOP and done["e"].output_ids == [5, EOS]
    assert done["i"].finish_reason is FinishReason.LENGTH and done["i"].output_ids == [EOS] * 5


def test_max_model_len_caps_output():
    s = sched(max_total_tokens=512, max_model_len=40)
    r = mk("r", n=30, max_tokens=100)
    done, _ = run(s, [r])
    assert r.finish_reason is FinishReason.LENGTH and r.num_tokens == 40


def test_chunked_prefill_respects_max_num_tokens():
    s = sched(max_total_tokens=2048, max_num_tokens=16, max_batch_size=8)
    reqs = [mk(f"r{i}", n=50, max_tokens=4) for i in range(3)]
    seen = []
    ex = SimExecutor(kv_capacity=2048, check=True)
    run_offline(s, ex, reqs, observer=lambda b, o, t0, t1: seen.append(b))
    assert all(b.num_tokens <= 16 for b in seen)
    assert all(len(r.output_ids) == 4 for r in reqs)


def test_max_batch_size():
    s = sched(max_total_tokens=4096, max_batch_size=3)
    reqs = [mk(f"r{i}", n=8, max_tokens=20) for i in range(10)]
    peak = []
    ex = SimExecutor(kv_capacity=4096, check=True)
    run_offline(s, ex, reqs, observer=lambda b, o, t0, t1: peak.append(s.stats().num_running))
    assert max(peak) == 3


def test_queue_full_and_concurrency():
    s = sched(max_queue=2, max_concurrency=3, max_total_tokens=256)
    s.add(mk("a"), 0.0)
    s.add(mk("b"), 0.0)
    with pytest.raises(QueueFull):
        s.add(mk("c"), 0.0)
    s.schedule(0.0)     # admits a and b
    s.add(mk("c"), 0.0)
    with pytest.raises(QueueFull):
        s.add(mk("d"), 0.0)   # 3 in the system


def test_rejects_what_can_never_fit():
    s = sched(max_total_tokens=64, max_model_len=100)
    with pytest.raises(RequestRejected):
        s.add(mk("a", n=64), 0.0)            # prompt + 1 > capacity
    s2 = sched(max_total_tokens=1024, max_model_len=50)
    with pytest.raises(RequestRejected):
        s2.add(mk("b", n=50), 0.0)           # prompt + 1 > max_model_len
    with pytest.raises(RequestRejected):
        s2.add(mk("c", n=0), 0.0)
    s3 = sched(max_total_tokens=64, admission="guaranteed")
    with pytest.raises(RequestRejected):
        s3.add(mk("d", n=10, max_tokens=100), 0.0)   # guaranteed reserves the whole output
    s.add(mk("ok", n=63, max_tokens=1), 0.0)


def test_never_fitting_request_errors_instead_of_looping():
    # optimistic: admitted (prompt fits) but grows past the whole pool
    s = sched(max_total_tokens=64, admission="optimistic")
    r = mk("big", n=40, max_tokens=1000)
    done, _ = run(s, [r])
    assert r.finish_reason is FinishReason.ERROR and "capacity" in r.error
    assert s.stats().kv_free + s.stats().kv_evictable == 64


def test_abort_frees_kv_at_once():
    s = sched(max_total_tokens=256, prefix_cache=False)
    r = mk("a", n=50, max_tokens=100)
    s.add(r, 0.0)
    ex = SimExecutor(kv_capacity=256)
    b = s.schedule(0.0)
    s.on_step(b, ex.execute(b), 0.1)
    assert s.stats().kv_used >= 50
    out = s.abort("a", 0.2)
    assert out.finished and out.finish_reason is FinishReason.ABORT
    st = s.stats()
    assert st.kv_used == 0 and st.kv_free == 256
    assert s.abort("a", 0.3) is None
    assert s.schedule(0.3).empty                 # nothing to run: the end waits for a batch that runs
    s.add(mk("b", n=5), 0.3)
    b = s.schedule(0.3)
    assert "a" in b.finished                     # the executor hears of it with the next batch
    s.check_integrity()


def test_abort_waiting_and_unknown():
    s = sched()
    s.add(mk("a"), 0.0)
    assert s.abort("zzz", 0.0) is None
    assert s.abort("a", 0.0).finish_reason is FinishReason.ABORT
    assert not s.has_work


def test_finish_for_stop_string():
    s = sched(max_total_tokens=256)
    s.add(mk("a", max_tokens=100), 0.0)
    ex = SimExecutor(kv_capacity=256)
    for _ in range(3):
        b = s.schedule(0.0)
        s.on_step(b, ex.execute(b), 0.0)
    out = s.finish("a", FinishReason.STOP, 1.0)
    assert out.finished and out.finish_reason is FinishReason.STOP
    s.check_integrity()
    assert not s.has_work


def test_on_step_outputs_one_per_token():
    s = sched(max_total_tokens=256)
    s.add(mk("a", n=5, max_tokens=3), 0.0)
    ex = SimExecutor(kv_capacity=256)
    outs = []
    while s.has_work:
        b = s.schedule(0.0)
        outs += s.on_step(b, ex.execute(b), 0.0)
    assert [len(o.new_token_ids) for o in outs] == [1, 1, 1]
    assert [o.finished for o in outs] == [False, False, True]


def test_sim_executor_deterministic_and_step_time():
    ex = SimExecutor(kv_capacity=256, step_time=lambda b: 0.5)
    s = sched(max_total_tokens=256)
    done = run_offline(s, ex, [mk("a", max_tokens=4)])
    assert done["a"].finished_at == pytest.approx(0.5 * 4)
    s2 = sched(max_total_tokens=256)
    done2 = run_offline(s2, SimExecutor(kv_capacity=256), [mk("a", max_tokens=4)])
    assert done2["a"].output_ids == done["a"].output_ids


def test_output_lens_dict():
    ex = SimExecutor(kv_capacity=256, output_lens={"a": 2})
    s = sched(max_total_tokens=256)
    done = run_offline(s, ex, [mk("a", max_tokens=10)])
    assert done["a"].output_ids[-1] == EOS and len(done["a"].output_ids) == 2


def test_swap_ops_cost_time():
    ex = SimExecutor(kv_capacity=256, host_kv_capacity=256, step_time=lambda b: 0.0, swap_time_per_token=1.0)
    from shepherd.step import ScheduledBatch, SwapOp
    t = ex.execute(ScheduledBatch(step=1, swap_out=[SwapOp("x", [1, 2, 3])]))
    assert t.step_time == 3.0


def test_snapshot_agrees_with_stats_through_preemption():
    """snapshot() is the cheap public view the simulator samples every step: it must
    say what stats() says (KV used, queue lengths, preemptions) at every step."""
    s = sched(max_total_tokens=128, max_batch_size=8, max_num_tokens=64, preemption="swap", host=128,
              debug_preempt_every=5)
    reqs = [mk(f"r{i}", n=12 + i, max_tokens=20, out=10 + i) for i in range(8)]
    seen = []

    def obs(b, o, t0, t1):
        sn, st = s.snapshot(), s.stats()
        assert (sn.kv_used, sn.num_running, sn.num_waiting, sn.num_swapped, sn.preemptions, sn.step) == \
            (st.kv_used, st.num_running, st.num_waiting, st.num_swapped, st.preemptions, st.step)
        seen.append(sn)
    ex = SimExecutor(kv_capacity=128, host_kv_capacity=128, check=True)
    run_offline(s, ex, reqs, observer=obs)
    assert seen and seen[-1].preemptions > 0 and max(x.num_swapped for x in seen) > 0
    assert s.snapshot().kv_used == 0 and not s.has_work


def test_one_stop_set_and_one_context_rule():
    from shepherd.request import context_error
    r = mk("a", params=SamplingParams(stop_token_ids=[7]))
    assert r.stop_id_set() == {7, EOS}
    r = mk("b", params=SamplingParams(stop_token_ids=[7], ignore_eos=True))
    assert r.stop_id_set() == {7}
    assert context_error(15, 16) is None and "max_model_len=16" in context_error(16, 16)
    s = sched(max_total_tokens=256, max_model_len=16)
    with pytest.raises(RequestRejected, match="max_model_len=16"):
        s.add(mk("c", n=16), 0.0)


def test_executor_error_for_one_request_ends_it_with_that_reason_and_frees_its_kv():
    s = sched(max_total_tokens=256)
    a, b = mk("a", max_tokens=4), mk("b", max_tokens=4)
    s.add(a, 0.0)
    s.add(b, 0.0)
    batch = s.schedule(0.0)
    assert {q.req_id for q in batch.seqs} == {"a", "b"}
    outs = s.on_step(batch, StepResult(tokens={"b": [7]}, errors={"a": "structured output failed"}), 0.1)
    ends = {o.req_id: o for o in outs if o.finished}
    assert ends["a"].finish_reason is FinishReason.ERROR and ends["a"].error == "structured output failed"
    assert "b" not in ends and b.output_ids == [7]      # the other request keeps running
    s.check_integrity()
    assert s.stats().num_running == 1
