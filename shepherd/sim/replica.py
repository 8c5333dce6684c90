"""One simulated replica: the real Scheduler and a SimExecutor with the cost
model's step times, stepped by the engine's own EngineCore on a virtual clock;
and the per-request tracking that turns its outputs into RequestRecords. The
loop and the fast path are described in sim/simulator.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np

from shepherd.bench.records import RequestRecord
from shepherd.bench.traces import stream_tokens, token_objects
from shepherd.config import SchedulerConfig
from shepherd.engine.build import assemble
from shepherd.engine.core import VirtualClock
from shepherd.engine.sim_executor import SimExecutor, SimSeq
from shepherd.request import FinishReason, Request, RequestState
from shepherd.sim.cost_model import CostModel

TS_POINTS = 2048     # time-series points kept per replica (thinned by halves beyond)


# --------------------------------------------------------------------------
# per-request tracking
# --------------------------------------------------------------------------

class Track:
    __slots__ = ("rec", "req", "state", "since", "pieces", "ntok", "seen_preempt", "route", "target")

    def __init__(self, rec: RequestRecord, req: Request, target: int):
        self.rec = rec
        self.req = req
        self.state = "queued"
        self.since = rec.arrival
        self.pieces: list = []        # floats (one token) and numpy views (a fast-forward chunk)
        self.ntok = 0
        self.seen_preempt = 0
        self.route = None
        self.target = target          # the trace's output length (EOS position)

    def move(self, state: str, t: float) -> None:
        if state == self.state:
            return
        if t > self.since or self.state != "queued":
            self.rec.intervals.append((self.state, self.since, t))
        self.state = state
        self.since = t

    def close(self, lists: bool = True) -> RequestRecord:
        """The finished (or abandoned) request's record, filled in; the track lets go
        of the request and its token times, so only the record outlives it. lists=False:
        token_times is a numpy array (for the streamed statistics alone: no float object
        per token)."""
        rec = self.rec
        rec.token_times = self.token_times() if lists else self.token_time_array()
        rec.output_tokens = self.ntok
        if self.req is not None:
            rec.cached_tokens = self.req.num_cached
            rec.preemptions = self.req.preemptions
        if rec.finish is None and rec.ok:
            rec.ok = False
            rec.error_kind = "unfinished"
        self.req = None
        self.pieces = []
        return rec

    def token_time_array(self) -> np.ndarray:
        ps = self.pieces
        if not ps:
            return np.empty(0)
        return np.concatenate([[p] if isinstance(p, float) else p for p in ps])

    def token_times(self) -> list[float]:
        out: list[float] = []
        for p in self.pieces:
            if isinstance(p, float):
                out.append(p)
            elif isinstance(p, list):
                out.extend(p)
            else:
                out.extend(p.tolist())
        return out


# --------------------------------------------------------------------------
# executor: the SimExecutor with tokens the fast path can compute k at a time
# --------------------------------------------------------------------------

class SimTokens(SimExecutor):
    """Sampled tokens for the simulator, vectorisable: output token at position
    `pos` of a request is 3 + (a * 1000003 + pos * 7919 + 12345) mod (V - 3), a =
    the prompt's last token (the SimExecutor's recurrence with the prompt's last
    token in place of the previous output token, so k tokens cost one expression;
    two requests with the same prompt still generate the same text). EOS only
    at the request's target length, as in SimExecutor.

    A turn of a multi-turn session answers with its session's own token stream
    (`streams[req_id] = (seed, offset)`: position pos holds the stream's token
    pos - offset), so the next turn's prompt, which continues that stream
    (bench/traces.prompt_token_ids), starts with the answer the replica cached, as
    a real chat client's next turn does."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.streams: dict[str, tuple[int, int]] = {}

    def next_token(self, st: SimSeq, n_out: int, prev: int) -> int:
        t = self.target_len(st)
        if t is not None and n_out + 1 >= t:
            return self.eos_token_id
        return self._tok(st, st.prompt_len + n_out)

    def _tok(self, st: SimSeq, pos: int) -> int:
        s = self.streams.get(st.req_id)
        if s is not None:
            return stream_tokens(s[0], pos - s[1], 1, self.vocab_size)[0]
        m = self.vocab_size - 3
        tok = 3 + (st.prompt_last * 1000003 + pos * 7919 + 12345) % m
        bad = st.stop_token_ids
        while tok == self.eos_token_id or (bad and tok in bad):
            tok = 3 + (tok - 3 + 1) % m
        return tok

    def token_block(self, req_id: str, n_out: int, k: int) -> list[int]:
        """The next k tokens of a request with n_out output tokens so far; the last is EOS
        when it is the request's target position (the caller guarantees no earlier one is)."""
        st = self.seqs[req_id]
        pos = st.prompt_len + n_out
        s = self.streams.get(req_id)
        if s is not None:
            out = stream_tokens(s[0], pos - s[1], k, self.vocab_size)
        elif st.stop_token_ids or self.eos_token_id >= 3:
            out = [self._tok(st, p) for p in range(pos, pos + k)]
        else:
            m = self.vocab_size - 3
            a = st.prompt_last * 1000003 + 12345
            if k < 48:
                out = [3 + (a + p * 7919) % m for p in range(pos, pos + k)]
            else:
                x = 3 + (a + np.arange(pos, pos + k, dtype=np.int64) * 7919) % m
                out = token_objects(self.vocab_size)[x].tolist()
        t = self.target_len(st)
        if t is not None and n_out + k >= t:
            out[-1] = self.eos_token_id
        return out

    def token_blocks(self, running: list[tuple[str, int]], k: int) -> dict[str, list[int]]:
        """token_block of every (req_id, n_out) of a fast-forward chunk, in one numpy pass over
        all of them when no request has stop ids (the same values; it pays from about three
        requests and a hundred tokens)."""
        if self.streams and any(rid in self.streams for rid, _ in running):
            out = {rid: self.token_block(rid, n, k) for rid, n in running if rid in self.streams}
            rest = [(rid, n) for rid, n in running if rid not in self.streams]
            out.update(self.token_blocks(rest, k) if rest else {})
            return out
        seqs = self.seqs
        sts = [seqs[rid] for rid, _ in running]
        if (len(running) < 3 or len(running) * k < 100 or self.eos_token_id >= 3
                or any(st.stop_token_ids for st in sts)):
            return {rid: self.token_block(rid, n, k) for rid, n in running}
        m = self.vocab_size - 3
        a = np.array([st.prompt_last * 1000003 + 12345 for st in sts], dtype=np.int64)
        pos = np.array([st.prompt_len + n for st, (_, n) in zip(sts, running)], dtype=np.int64)
        x = (pos[:, None] + np.arange(k, dtype=np.int64)) * 7919
        x += a[:, None]
        x %= m
        x += 3
        rows = token_objects(self.vocab_size)[x].tolist()
        out = {}
        for st, (rid, n), row in zip(sts, running, rows):
            t = self.target_len(st)
            if t is not None and n + k >= t:
                row[-1] = self.eos_token_id
            out[rid] = row
        return out


# --------------------------------------------------------------------------
# replica
# --------------------------------------------------------------------------

class Series:
    """A thinned time series: at most TS_POINTS points; when full, every other
    point goes and the minimum spacing doubles, so memory is flat however long
    the run."""
    __slots__ = ("t", "cols", "gap")

    def __init__(self, ncols: int):
        self.t: list[float] = []
        self.cols: list[list] = [[] for _ in range(ncols)]
        self.gap = 0.0

    def add(self, t: float, *vals) -> None:
        if self.t and t - self.t[-1] < self.gap:
            # too close to the last point: it takes the newer state (an idle replica's
            # last sample must say idle)
            for c, v in zip(self.cols, vals):
                c[-1] = v
            return
        self.t.append(t)
        for c, v in zip(self.cols, vals):
            c.append(v)
        if len(self.t) >= TS_POINTS:
            self.t = self.t[::2]
            self.cols = [c[::2] for c in self.cols]
            self.gap = 2 * (self.t[-1] - self.t[0]) / TS_POINTS


def probe(sched) -> tuple[int, int, int, int, int]:
    """(kv_used, kv_cached, running, waiting+swapped, preemptions), from the
    scheduler's O(1) snapshot and its KV manager's evictable count."""
    sn = sched.snapshot()
    return sn.kv_used, sched.kv.evictable_tokens, sn.num_running, sn.num_waiting + sn.num_swapped, sn.preemptions


@dataclass
class ReplicaSpec:
    """What every replica of a simulation is built from (the simulator sizes it once)."""
    sched_cfg: SchedulerConfig          # validated, its max_total_tokens the KV capacity
    cost: CostModel
    host_kv: int
    max_model_len: int
    vocab: int
    fast: bool = True
    timeseries: bool = True
    record_batches: bool = False
    group: int = 0                      # its ReplicaGroup in the fleet (sim/fleet.py)
    role: str = "both"                  # both | prefill | decode
    label: str = ""                     # its GPU type and tensor parallel degree, for reports
    lora_load_time: float = 0.0         # seconds per LoRA adapter load (SimExecutor.lora_load_time)


class Replica:
    def __init__(self, idx: int, spec: ReplicaSpec, on_finish: Callable[["Replica", Track], None]):
        self.idx = idx
        self.group, self.role, self.label = spec.group, spec.role, spec.label
        self.busy = 0.0                  # seconds its steps took (the fleet's energy and utilisation)
        self.on_finish = on_finish       # told of every request that ends here
        self.cost = spec.cost
        self.kv_capacity = spec.sched_cfg.max_total_tokens
        # swap time is in the cost model's step time (PCIe transfer), not the executor's flat rate
        self.exec = SimTokens(kv_capacity=self.kv_capacity, host_kv_capacity=spec.host_kv,
                              max_model_len=spec.max_model_len, eos_token_id=2, step_time=spec.cost.step_time,
                              swap_time_per_token=0.0, vocab_size=spec.vocab, check=False,
                              acceptance_rate=spec.sched_cfg.speculative.acceptance_rate
                              if spec.sched_cfg.speculative else 0.0, lora_load_time=spec.lora_load_time)
        self.core = assemble(spec.sched_cfg, self.exec, VirtualClock(self._charge))
        self.sched = self.core.scheduler
        self.clock = 0.0
        self.tracks: dict[str, Track] = {}
        # multi-step windows hand tokens out at the window's end, which the fast path's
        # per-step token times would not; 500-request runs step one by one quickly enough
        self.fast = spec.fast and not self.sched.shape.windowed
        self.ts = Series(4) if spec.timeseries else None     # kv_used, kv_cached, running, waiting
        self.cached_peak = 0
        self.steps = 0
        self.fast_steps = 0
        self.last_preempt = 0
        self.batches = [] if spec.record_batches else None
        self.requests = 0
        self.prompt_tokens = 0
        self.output_tokens = 0
        # no request joins, leaves or changes state before this time (set by the fast path:
        # the batch is decode-only and its next finish is later); routers that read only
        # counts need not wait for this replica to catch up to an arrival before it
        self.quiet_until = -math.inf
        self._planned = (None, None)   # (state, plan): a plan holds until the replica steps or takes a request
        self._counts = None            # see counts()

    @property
    def kv_peak(self) -> int:
        """KV used by requests at its highest: the scheduler's own peak, noted at every
        schedule() and fast-forward, before a finishing request lets go of its KV."""
        return self.sched.stats().kv_peak_used

    def counters(self) -> dict:
        return {"replica": self.idx, "requests": self.requests, "prompt_tokens": self.prompt_tokens,
                "output_tokens": self.output_tokens, "kv_peak_used_tokens": self.kv_peak,
                "cached_peak_tokens": self.cached_peak, "evicted_tokens": self.sched.kv.evicted_tokens,
                "steps": self.steps, "busy_s": self.busy, "gpu": self.label, "role": self.role, "group": self.group,
                "kv_capacity_tokens": self.kv_capacity, **self._prefill_budget()}

    def _prefill_budget(self) -> dict:
        """--max-prefill-ms-with-decodes: the token count its steps gave at the end, and the
        seconds a prompt token added to a step (engine/prefill_budget.py); nothing when off."""
        b = self.core.prefill_budget
        if b is None:
            return {}
        return {"prefill_budget_tokens": b.tokens, "prefill_token_s": b.per_token_s}

    def _charge(self, step_time: float) -> float:
        """A step's time on the virtual clock: the step shape's window cost of the cost
        model's time (vLLM v0.6 windows pay the fixed step overhead once)."""
        return self.sched.shape.window_cost(step_time, self.cost.overhead[0])

    # -- intake ------------------------------------------------------------
    def add(self, tr: Track, now: float) -> bool:
        if self.clock < now:
            # advance_to(now) ran every step that starts before now: the replica is idle
            # (or stalled on memory) until this arrival
            self.clock = now
        if not tr.req.params.ignore_eos:
            self.exec.set_output_len(tr.req.req_id, tr.target)
        stream = getattr(tr.req, "sim_stream", None)      # a session's turn (Simulator.make_request)
        if stream is not None:
            self.exec.streams[tr.req.req_id] = stream
        self._counts = None
        self.sched.add(tr.req, now)
        self.quiet_until = -math.inf
        self.tracks[tr.req.req_id] = tr
        self.requests += 1
        self.prompt_tokens += tr.rec.prompt_tokens
        return True

    # -- the loop ------------------------------------------------------------
    def advance_to(self, t_limit: float, settle: bool = False) -> None:
        """Run every step that starts before t_limit. settle=True (routers that read
        only counts): stop as soon as no request can join, leave or change state
        before t_limit; the steps left are the same decode-only batch, run when the
        replica is next advanced (the fast path's chunking does not change a token time)."""
        sched = self.sched
        while self.clock < t_limit and sched.has_work:
            if settle and self.quiet_until >= t_limit:
                break
            plan = self._plan() if self.fast else None
            if plan is not None:
                if settle and self._quiet_after(plan, 0) >= t_limit:
                    break
                if self._fast_forward(t_limit, plan):
                    continue
            if not self._step():
                break

    def adapters(self) -> frozenset:
        """The LoRA adapters in its adapter slots (what a replica's vllm:lora_requests_info says)."""
        return frozenset(self.exec.slots.values())

    def counts(self) -> tuple[int, int, int, int, int]:
        """probe() of the scheduler, kept from the last step or chunk (each ends by
        sampling it) until the replica steps again or takes a request."""
        if self._counts is None:
            self._counts = probe(self.sched)
        return self._counts

    def _sample_ts(self) -> None:
        self._counts = probe(self.sched)
        used, cached, nrun, nwait, _ = self._counts
        if cached > self.cached_peak:
            self.cached_peak = cached
        if self.ts is not None:
            self.ts.add(self.clock, used, cached, nrun, nwait)

    def _check_preempted(self, t: float) -> None:
        npre = probe(self.sched)[4]
        if npre == self.last_preempt:
            return
        self.last_preempt = npre
        for tr in self.tracks.values():
            req = tr.req
            if req.preemptions != tr.seen_preempt:
                tr.seen_preempt = req.preemptions
                if req.state is not RequestState.RUNNING:
                    tr.move("preempted", t)

    def _step(self) -> bool:
        self.quiet_until = -math.inf
        self._counts = None
        self._planned = (None, None)    # schedule() may change the state even when it runs nothing
        t0 = self.clock
        step = self.core.step(t0)
        self._check_preempted(t0)
        if not step.ran:
            # schedule() can end a request without running anything (an error such as a
            # request that alone outgrows the pool); the step hands out that terminal output
            self._handle_outputs(step.outputs, t0)
            self._sample_ts()
            return False
        tracks = self.tracks
        for s in step.batch.seqs:
            tr = tracks.get(s.req_id)
            if tr is not None and tr.state in ("queued", "preempted"):
                tr.move("prefill", t0)
        self.busy += step.end - t0
        self.clock = step.end
        if self.batches is not None:
            self.batches.append((self.idx, t0, [(s.req_id, s.start_pos, len(s.token_ids)) for s in step.batch.seqs]))
        self.steps += 1
        self._handle_outputs(step.outputs, step.end)
        self._sample_ts()
        return True

    def _handle_outputs(self, outs, t1: float) -> None:
        tracks = self.tracks
        for o in outs:
            tr = tracks.get(o.req_id)
            if tr is None:
                continue
            n = len(o.new_token_ids)
            if n:
                if n == 1:
                    tr.pieces.append(t1)
                else:
                    tr.pieces.extend([t1] * n)
                tr.ntok += n
                if tr.rec.first_token is None:
                    tr.rec.first_token = t1
                if tr.state != "decode":
                    tr.move("decode", t1)
            if o.finished:
                self._finish(tr, o, t1)

    def _finish(self, tr: Track, o, t: float) -> None:
        rec = tr.rec
        tr.move("done", t)
        rec.intervals = [iv for iv in rec.intervals if iv[0] != "done"]
        rec.finish = t
        if o.finish_reason is FinishReason.ERROR or o.error:
            rec.ok = False
            rec.error_kind = "error"
        rid = tr.req.req_id
        del self.tracks[rid]
        # the executor's per-request entries would otherwise outlive the request
        self.exec.output_lens.pop(rid, None)
        self.exec.streams.pop(rid, None)
        self.exec.tokens_by_req.pop(rid, None)
        self.output_tokens += tr.ntok
        self.on_finish(self, tr)

    # -- fast path ---------------------------------------------------------------
    def _plan(self):
        """(running requests, their total context, stop) when the next steps are a
        decode-only batch: stop = how many of them may run in one go, the last of which
        may end a request (decode_horizon with finishing, and the trace's lengths);
        None when the next step must go through schedule()."""
        key = (self.steps, self.requests)
        if self._planned[0] == key:
            return self._planned[1]
        self._planned = (key, self._make_plan())
        return self._planned[1]

    def _make_plan(self):
        sched = self.sched
        h = sched.decode_horizon(self.clock, finishing=True)
        if h < 2:
            return None
        running = sched.running
        ctx0 = 0
        stop = h
        tracks = self.tracks
        for req in running:
            ctx0 += len(req.prompt_ids) + len(req.output_ids)
            # the step that samples a request's last token (EOS or max_tokens) may be the k-th
            left = tracks[req.req_id].target - len(req.output_ids)
            if left < stop:
                stop = left
        return running, ctx0, stop

    def _quiet_after(self, plan, k: int) -> float:
        """After k of the plan's steps: the time before which nothing changes (the rest
        are the same decode-only batch and only the last of them may end a request, at
        its end: nothing changes before the start of that last one)."""
        running, ctx0, stop = plan
        n = len(running)
        self.quiet_until = self.clock + max(0, stop - k - 1) * self.cost.decode_step_lb(n, ctx0 + k * n)
        return self.quiet_until

    def _fast_forward(self, t_limit: float, plan) -> bool:
        running, ctx0, stop = plan
        n = len(running)
        now = self.clock
        exe = self.exec
        tracks = self.tracks
        k = stop
        if t_limit != math.inf:
            # steps never get shorter as contexts grow: at most this many start before t_limit
            d0 = self.cost.decode_step_lb(n, ctx0)
            if d0 > 0:
                kmax = int((t_limit - now) / d0) + 2
                if kmax < k:
                    k = kmax
        if k < 2:
            return False
        if k <= 24:
            # short runs: a Python loop beats numpy's call overhead (same IEEE operations)
            f = self.cost.decode_step_time
            ends = []
            times = []
            t = now
            c = ctx0
            for _ in range(k):
                if t >= t_limit:      # this step would start at or after the next arrival
                    break
                dt = f(n, c)
                t += dt
                c += n
                ends.append(t)
                times.append(dt)
            k = len(ends)
        else:
            d = self.cost.decode_step_times(n, ctx0, k)
            ends = np.add.accumulate(np.concatenate(([now], d)))[1:]
            if ends.size > 1 and ends[-2] >= t_limit:
                # steps must start before t_limit: step j starts at ends[j-1] (step 0 at now < t_limit)
                k = int(np.searchsorted(ends, t_limit, side="left")) + 1
                ends = ends[:k]
            times = d[:k]
        if k < 2:
            return False
        budget = self.core.prefill_budget
        if budget is not None:
            # the steps taken here are decode-only steps EngineCore.step would have timed: the time
            # budget's decode fit sees them too (with the fast path on, nearly every decode step is one)
            budget.observe_decodes(n, times)
        tokens = exe.token_blocks([(r.req_id, len(r.output_ids)) for r in running], k)
        if self.batches is not None:
            for j in range(k):
                t0 = now if j == 0 else float(ends[j - 1])
                self.batches.append((self.idx, t0, [(r.req_id, len(r.prompt_ids) + len(r.output_ids) - 1 + j, 1)
                                                    for r in running]))
        members = list(running)
        t_end = float(ends[-1])
        self._counts = None
        outs = self.sched.fast_forward(k, tokens, t_end)
        self.busy += t_end - now
        self.clock = t_end
        self._quiet_after(plan, k)
        self.steps += k
        self.fast_steps += k
        view = ends
        for req in members:
            tr = tracks[req.req_id]
            tr.pieces.append(view)
            tr.ntok += k
        for o in outs:
            if o.finished:
                tr = tracks.get(o.req_id)
                if tr is not None:
                    self._finish(tr, o, t_end)
        self._sample_ts()
        return True


