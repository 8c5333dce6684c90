"""Speed of the simulator: the full Azure conv hour (19,366 requests) on 8
replicas of Llama-3-8B on H100 (roofline cost model), round-robin routing.

    .venv/bin/python benchmarks/simulate_azure_speed.py [--router NAME] [--slow] [--limit N] [--profile]
"""
import argparse
import time

from shepherd.config import SchedulerConfig
from shepherd.sim.simulator import SimConfig, simulate
from shepherd.bench.traces import load_trace

from shepherd.paths import data_path

AZURE = str(data_path("azure_llm_2023", "AzureLLMInferenceTrace_conv.csv"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--trace", default=AZURE)
    ap.add_argument("--router", default="round-robin")
    ap.add_argument("--replicas", type=int, default=8)
    ap.add_argument("--limit", type=int, default=None)
    ap.add_argument("--slow", action="store_true")
    ap.add_argument("--no-prefix-cache", action="store_true")
    ap.add_argument("--profile", action="store_true")
    a = ap.parse_args()
    t0 = time.perf_counter()
    trace = load_trace(a.trace, limit=a.limit)
    t_load = time.perf_counter() - t0
    cfg = SimConfig(model="llama-3-8b", gpu="h100", replicas=a.replicas, router=a.router, fast=not a.slow,
                    scheduler=SchedulerConfig(prefix_cache=not a.no_prefix_cache), progress=True,
                    keep_records=False)
    if a.profile:
        import cProfile
        import pstats
        cProfile.runctx("simulate(trace, cfg)", globals(), {"trace": trace, "cfg": cfg, "simulate": simulate},
                        "/tmp/sim.prof")
        pstats.Stats("/tmp/sim.prof").sort_stats("tottime").print_stats(25)
        return
    t1 = time.perf_counter()
    res = simulate(trace, cfg)
    t_sim = time.perf_counter() - t1
    t2 = time.perf_counter()
    s = res.summary()
    t_sum = time.perf_counter() - t2
    print(f"requests {len(trace):,}  steps {res.steps:,} ({res.fast_steps:,} fast-forwarded)  "
          f"virtual {s['duration_s']:,.0f} s")
    print(f"wall: load {t_load:.2f} s + simulate {t_sim:.2f} s + summarize {t_sum:.2f} s "
          f"= {t_load + t_sim + t_sum:.2f} s")
    print(f"ttft p50 {s['ttft_p50'] * 1e3:.1f} ms  tpot p50 {s['tpot_p50'] * 1e3:.2f} ms  "
          f"throughput {s['throughput_req_s']:.2f} req/s  preemptions {s['preemptions']}")


if __name__ == "__main__":
    main()
