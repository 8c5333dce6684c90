"""Admission modes side by side, where KV memory is the bottleneck.

    python benchmarks/scheduling.py                 # simulated executor, writes docs/img/ + docs/SCHEDULING.md
    python benchmarks/scheduling.py --real          # also the torch executor with SmolLM2 (CPU: small run)
    python benchmarks/scheduling.py --no-doc        # print only

Workload: a Poisson stream; prompts 64-512 tokens; max_tokens long (1024)
while most requests stop early (EOS after a lognormal number of tokens, mean
~150), and a KV pool small enough that reserving max_tokens (guaranteed)
leaves it mostly empty. For each admission mode it reports throughput, TTFT
p50/p99, preemptions, peak and mean KV use and mean batch size, and draws a
timeline (one row per request: queued / prefill / decode / preempted) like the
figures of the TensorRT-LLM scheduling notes.
"""
from __future__ import annotations

import argparse
import math
import random
import re
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from shepherd.bench.records import RequestRecord  # noqa: E402
from shepherd.config import SchedulerConfig  # noqa: E402
from shepherd.engine.offline import run_offline  # noqa: E402
from shepherd.request import Request, RequestState, SamplingParams  # noqa: E402
from shepherd.scheduler.scheduler import Scheduler  # noqa: E402
from shepherd.engine.sim_executor import SimExecutor, affine_step_time  # noqa: E402

FORCED_EOS = 2
MODES = [("guaranteed", "recompute"), ("peak", "recompute"), ("optimistic", "recompute"), ("optimistic", "swap")]


def workload(n: int, rate: float, seed: int, max_tokens: int, prompt=(64, 512), out_mean=100.0,
             vocab=(3, 30000), long_frac: float = 0.2) -> list[Request]:
    rng = random.Random(seed)
    t = 0.0
    reqs = []
    sigma = 0.8
    mu = math.log(out_mean) - sigma * sigma / 2
    for i in range(n):
        t += rng.expovariate(rate)
        pl = rng.randint(*prompt)
        r = Request(f"r{i}", [rng.randint(*vocab) for _ in range(pl)], SamplingParams(max_tokens=max_tokens),
                    arrival=t, eos_token_ids=(2,))
        if rng.random() < long_frac:      # a minority runs long: what makes optimistic admission preempt
            r.sim_output_len = rng.randint(max_tokens // 2, max_tokens)
        else:
            r.sim_output_len = max(1, min(max_tokens, int(rng.lognormvariate(mu, sigma))))
        reqs.append(r)
    return reqs


class Tracker:
    """Per-request state intervals for the timeline, from the scheduler's view after every step."""

    def __init__(self, sched: Scheduler, reqs: list[Request]):
        self.s = sched
        self.reqs = reqs
        self.cur: dict[str, tuple[str, float]] = {}
        self.iv: dict[str, list] = {r.req_id: [] for r in reqs}
        self.kv_t, self.kv_used, self.running = [], [], []

    def _state(self, r: Request) -> str | None:
        st = r.state
        if st is RequestState.FINISHED:
            return None
        if st is RequestState.RUNNING:
            return "decode" if r.num_computed >= r.num_tokens - 1 and r.output_ids else "prefill"
        if r.preemptions:
            return "preempted"
        return "queued"

    def observe(self, batch, outs, t0, t1):
        for r in self.reqs:
            if r.arrival > t1:
                break
            st = self._state(r)
            prev = self.cur.get(r.req_id)
            if prev is None and st is None and not self.iv[r.req_id] and r.finished_at is None:
                continue
            if prev is None:
                if st is not None:
                    self.cur[r.req_id] = (st, r.arrival if st == "queued" else t0)
                    if st != "queued" and r.arrival < t0:
                        self.iv[r.req_id].append(("queued", r.arrival, t0))
                continue
            if st != prev[0]:
                end = t1 if st is None else t0
                self.iv[r.req_id].append((prev[0], prev[1], end))
                if st is None:
                    del self.cur[r.req_id]
                else:
                    self.cur[r.req_id] = (st, t0)
        stt = self.s.stats()
        self.kv_t.append(t1)
        self.kv_used.append(stt.kv_used)
        self.running.append(stt.num_running)

    def records(self) -> list[RequestRecord]:
        out = []
        for r in self.reqs:
            out.append(RequestRecord(req_id=r.req_id, arrival=r.arrival, prompt_tokens=len(r.prompt_ids),
                                     output_tokens=len(r.output_ids), first_token=r.first_token_at,
                                     finish=r.finished_at, preemptions=r.preemptions,
                                     intervals=self.iv[r.req_id]))
        return out


def run_mode(admission: str, preemption: str, reqs: list[Request], cap: int, executor_factory, **kw):
    cfg = SchedulerConfig(max_total_tokens=cap, admission=admission, preemption=preemption,
                          max_batch_size=kw.get("max_batch_size", 256), max_num_tokens=kw.get("max_num_tokens", 2048),
                          prefix_cache=False)
    ex = executor_factory()
    s = Scheduler(cfg, host_kv_capacity=getattr(ex, "host_kv_capacity", 0), max_model_len=8192)
    tr = Tracker(s, reqs)
    w0 = time.perf_counter()
    run_offline(s, ex, reqs, observer=tr.observe)
    wall = time.perf_counter() - w0
    st = s.stats()
    end = max(r.finished_at for r in reqs)
    start = min(r.arrival for r in reqs)
    ttft = np.array([r.first_token_at - r.arrival for r in reqs if r.first_token_at is not None])
    out_tok = sum(len(r.output_ids) for r in reqs)
    kv = np.array(tr.kv_used, dtype=float)
    dt = np.diff(np.array([start] + tr.kv_t))
    mean_kv = float((kv * dt).sum() / dt.sum()) if dt.sum() > 0 else 0.0
    mean_run = float((np.array(tr.running) * dt).sum() / dt.sum()) if dt.sum() > 0 else 0.0
    row = dict(mode=f"{admission}" + ("" if admission != "optimistic" else f" ({preemption})"),
               duration_s=end - start, output_tok_s=out_tok / (end - start),
               ttft_p50=float(np.percentile(ttft, 50)), ttft_p99=float(np.percentile(ttft, 99)),
               preemptions=st.preemptions, preempted_tokens=st.preempted_tokens,
               kv_peak=st.kv_peak_used, kv_peak_pct=100.0 * st.kv_peak_used / cap,
               kv_mean_pct=100.0 * mean_kv / cap, mean_running=mean_run, steps=st.step, wall_s=wall,
               errors=st.errors)
    return row, tr


def fmt_table(rows, cap) -> str:
    lines = [f"KV capacity {cap} tokens.", "",
             "| admission | duration (s) | output tok/s | TTFT p50 (s) | TTFT p99 (s) | preemptions (tokens) | "
             "peak KV | mean KV | mean batch | steps |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['mode']} | {r['duration_s']:.1f} | {r['output_tok_s']:.0f} | {r['ttft_p50']:.2f} | "
                     f"{r['ttft_p99']:.2f} | {r['preemptions']} ({r['preempted_tokens']}) | "
                     f"{r['kv_peak']} ({r['kv_peak_pct']:.0f}%) | {r['kv_mean_pct']:.0f}% | "
                     f"{r['mean_running']:.1f} | {r['steps']} |")
    return "\n".join(lines)


def plot(trackers, titles, path: Path, cap: int, rows_shown: int = 80, window=None):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    try:
        from shepherd.bench.plots import draw_timeline
    except Exception:   # pragma: no cover - fallback when the report module is absent
        draw_timeline = None
    n = len(trackers)
    fig, axes = plt.subplots(2, n, figsize=(4.6 * n, 8.5), gridspec_kw={"height_ratios": [3, 1]}, squeeze=False)
    # show the rows around the first preempted request (the same rows in every panel)
    first = min((i for tr in trackers for i, r in enumerate(tr.reqs) if r.preemptions), default=0)
    lo = max(0, first - rows_shown // 2)
    xmin, xmax = float("inf"), 0.0
    for tr in trackers:
        recs = tr.records()[lo:lo + rows_shown]
        xmax = max(xmax, max((r.finish or 0) for r in recs))
        xmin = min(xmin, min(r.arrival for r in recs))
    xmin = max(0.0, xmin - 0.5)
    for j, (tr, title) in enumerate(zip(trackers, titles)):
        recs = tr.records()[lo:lo + rows_shown]
        ax = axes[0][j]
        if draw_timeline is not None:
            draw_timeline(ax, recs, legend=(j == 0))
        else:
            colors = {"queued": "#bbbbbb", "prefill": "#ff7f0e", "decode": "#1f77b4", "preempted": "#d62728"}
            for y, r in enumerate(recs):
                for st, a, b in r.intervals:
                    ax.plot([a, b], [y, y], color=colors[st], lw=3)
            ax.invert_yaxis()
        ax.set_title(title, fontsize=10)
        ax.set_xlim(xmin, xmax * 1.02)
        if lo:
            ax.set_ylabel(f"request (rows {lo}..{lo + len(recs) - 1})")
        ax2 = axes[1][j]
        ax2.plot(tr.kv_t, np.array(tr.kv_used) / cap * 100, lw=0.8)
        ax2.set_ylim(0, 105)
        ax2.set_xlim(xmin, xmax * 1.02)
        ax2.set_ylabel("KV used (%)")
        ax2.set_xlabel("time (s)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def update_doc(doc: Path, marker: str, text: str) -> None:
    body = doc.read_text() if doc.exists() else ""
    start, end = f"<!-- {marker} -->", f"<!-- /{marker} -->"
    block = f"{start}\n{text}\n{end}"
    if start in body:
        body = re.sub(re.escape(start) + r".*?" + re.escape(end), lambda m: block, body, flags=re.S)
    else:
        body += "\n" + block + "\n"
    doc.write_text(body)


def sim_run(args):
    cap = args.cap
    rows, trackers, titles = [], [], []
    for adm, pre in MODES:
        reqs = workload(args.n, args.rate, args.seed, args.max_tokens)
        lens = {r.req_id: r.sim_output_len for r in reqs}      # where each request's EOS falls
        fac = lambda: SimExecutor(kv_capacity=cap, host_kv_capacity=cap, step_time=affine_step_time(),  # noqa: E731
                                  output_lens=lens)
        row, tr = run_mode(adm, pre, reqs, cap, fac)
        rows.append(row)
        trackers.append(tr)
        titles.append(f"{row['mode']}: {row['preemptions']} preemptions, batch {row['mean_running']:.1f}")
        print(f"  {row['mode']:<24} done in {row['wall_s']:.1f}s wall", file=sys.stderr)
    table = fmt_table(rows, cap)
    img = ROOT / "docs" / "img" / "scheduling_timeline.png"
    plot(trackers, titles, img, cap)
    return rows, table, img


def real_run(args):
    from shepherd.config import EngineConfig
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.step import PlainExecutor
    from shepherd.model.loader import default_model_path
    cap = args.real_cap
    ex = TorchExecutor(EngineConfig(model=default_model_path(), max_total_tokens=cap, host_kv_tokens=cap,
                                    batch_invariant=False))
    tok = ex.tokenizer
    rows, trackers, titles = [], [], []
    for adm, pre in MODES:
        reqs = workload(args.real_n, args.real_rate, args.seed, args.real_max_tokens, prompt=(32, 96),
                        out_mean=args.real_max_tokens / 4, vocab=(100, len(tok) - 1))
        for r in reqs:
            r.eos_token_ids = (FORCED_EOS,)

        # the real model computes every step; a request stops at its drawn length (as if the model
        # had sampled EOS there), so max_tokens stays long for guaranteed/peak to reserve
        lens = {r.req_id: r.sim_output_len for r in reqs}
        prompt_len: dict = {}

        class _Ex(PlainExecutor):     # the real model's tokens, no grammars or adapters
            kv_capacity, host_kv_capacity, max_model_len = ex.kv_capacity, ex.host_kv_capacity, ex.max_model_len
            eos_token_ids = (FORCED_EOS,)

            def execute(self, batch):
                prompt_len.update((n.req_id, len(n.prompt_ids)) for n in batch.new)
                t = time.perf_counter()
                res = ex.execute(batch)
                res.step_time = time.perf_counter() - t
                for sq in batch.seqs:
                    rid = sq.req_id
                    if sq.sample and sq.end_pos - prompt_len[rid] + 1 >= lens[rid]:
                        res.tokens[rid] = [FORCED_EOS]
                    elif sq.sample and res.tokens.get(rid) == [FORCED_EOS]:
                        res.tokens[rid] = [FORCED_EOS + 1]
                return res
        row, tr = run_mode(adm, pre, reqs, cap, _Ex, max_num_tokens=512)
        rows.append(row)
        trackers.append(tr)
        titles.append(f"{row['mode']}: {row['preemptions']} preemptions")
        print(f"  real {row['mode']:<24} done in {row['wall_s']:.1f}s wall", file=sys.stderr)
    table = fmt_table(rows, cap)
    img = ROOT / "docs" / "img" / "scheduling_timeline_real.png"
    plot(trackers, titles, img, cap)
    return rows, table, img


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=400)
    ap.add_argument("--rate", type=float, default=15.0, help="requests per second")
    ap.add_argument("--cap", type=int, default=16384, help="KV capacity in tokens")
    ap.add_argument("--max-tokens", type=int, default=1024)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--real", action="store_true")
    ap.add_argument("--real-n", type=int, default=16)
    ap.add_argument("--real-rate", type=float, default=8.0)
    ap.add_argument("--real-cap", type=int, default=512)
    ap.add_argument("--real-max-tokens", type=int, default=128)
    ap.add_argument("--no-doc", action="store_true")
    args = ap.parse_args(argv)
    rows, table, img = sim_run(args)
    print(table)
    if not args.no_doc:
        update_doc(ROOT / "docs" / "SCHEDULING.md", "results:sim",
                   f"Simulated executor (affine step time), {args.n} requests at {args.rate}/s, prompts 64-512, "
                   f"max_tokens {args.max_tokens}, outputs: 80% lognormal (mean ~100), 20% long (512-1024) (command: "
                   f"`python benchmarks/scheduling.py`).\n\n{table}\n\n![timeline](img/{img.name})")
    if args.real:
        rows, table, img = real_run(args)
        print(table)
        if not args.no_doc:
            update_doc(ROOT / "docs" / "SCHEDULING.md", "results:real",
                       f"Torch executor, SmolLM2-135M on this machine's CPU, {args.real_n} requests at "
                       f"{args.real_rate}/s, wall-clock step times (command: "
                       f"`python benchmarks/scheduling.py --real`). Each request stops at a drawn length "
                       f"(EOS forced there) while max_tokens stays {args.real_max_tokens}. Wall-clock step times "
                       f"on a shared, loaded 2-core CPU vary several-fold between runs, so compare the modes by "
                       f"steps, KV use and batch size more than by seconds.\n\n{table}\n\n![timeline](img/{img.name})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
