"""The cost models against vLLM's published single-request ITL of Llama-3-8B on
one H100 (6.44 ms + 4.37e-5 ms per context token), contexts 1k-32k: the
roofline, and the profiled model (`--cost-model vidur`, transferred from
Llama-2-7B's H100 profile).

    .venv/bin/python benchmarks/simulate_itl_check.py
"""
from shepherd.sim.cost_model import RooflineCostModel, vllm_h100_itl
from shepherd.sim.fitted_cost import from_vidur


def main() -> None:
    roof = RooflineCostModel("llama-3-8b", "h100")
    prof = from_vidur("llama-3-8b", "h100")
    print("| context | vLLM blog (ms) | roofline model (ms) | error | profiled model (ms) | error |")
    print("|---:|---:|---:|---:|---:|---:|")
    for c in (1024, 2048, 4096, 8192, 16384, 32768):
        ref, got, pro = vllm_h100_itl(c) * 1e3, roof.decode_itl(c) * 1e3, prof.decode_itl(c) * 1e3
        print(f"| {c:,} | {ref:.2f} | {got:.2f} | {got / ref - 1:+.1%} | {pro:.2f} | {pro / ref - 1:+.1%} |")
    print()
    print("Batch decode, Llama-3-8B / H100, ms per step (roofline):")
    print("| batch \\ context | 512 | 2048 | 8192 |")
    print("|---:|---:|---:|---:|")
    for b in (1, 8, 32, 64, 128, 256):
        print(f"| {b} | " + " | ".join(f"{roof.decode_itl(c, b) * 1e3:.2f}" for c in (512, 2048, 8192)) + " |")


if __name__ == "__main__":
    main()
