#!/usr/bin/env python
"""lm-evaluation-harness, unmodified, scoring through `shepherd serve` against the same model in
transformers: the prompt logprobs (echo + logprobs) a scoring client reads.

    pip install 'lm_eval[api]==0.4.13' gguf      # not a shepherd dependency; any env with torch
    python benchmarks/lm_eval_parity.py [--dtypes float32,bfloat16] [--docs]

A 40-question multiple-choice task of this script's own (written to a temporary folder as a
local JSON dataset and an lm-eval task YAML: nothing is downloaded) is scored by lm-eval twice:
`--model hf` (transformers in process, float32, the default model's GGUF dequantized by
transformers: the reference) and `--model local-completions` against `shepherd serve` (the
default model, each --dtypes, batch invariance on; lm-eval's own tokenizer, built from the same
GGUF, sends token ids with echo and logprobs=1). Reported per dtype: lm-eval's accuracy, and
per (question, choice) loglikelihood the largest and mean difference from the reference, and how
many of lm-eval's is_greedy flags and per-question picks agree with it.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _docs import footer, publish  # noqa: E402
from shepherd.bench.loadgen import exit_on_sigterm, start_server, stop_server, wait_healthy  # noqa: E402

NAME = "smollm2-135m"
QUESTIONS = [      # (text, choices, answer): facts a 135M model mostly knows, so picks can differ
    ("The capital of France is", ["Paris", "London", "Berlin", "Madrid"], 0),
    ("The capital of Japan is", ["Beijing", "Tokyo", "Seoul", "Bangkok"], 1),
    ("Water freezes at zero degrees", ["Fahrenheit", "Kelvin", "Celsius", "Rankine"], 2),
    ("The largest planet in our solar system is", ["Mars", "Venus", "Earth", "Jupiter"], 3),
    ("A week has seven", ["days", "months", "years", "hours"], 0),
    ("The opposite of hot is", ["warm", "cold", "red", "loud"], 1),
    ("Cats are often kept as", ["engines", "planets", "pets", "tools"], 2),
    ("The sun rises in the", ["west", "north", "south", "east"], 3),
    ("Two plus two equals", ["four", "five", "three", "six"], 0),
    ("Bees make", ["milk", "honey", "silk", "wool"], 1),
    ("The color of a clear daytime sky is", ["green", "purple", "blue", "orange"], 2),
    ("Paper is made from", ["glass", "iron", "plastic", "wood"], 3),
    ("A doctor works in a", ["hospital", "volcano", "submarine", "circus"], 0),
    ("The chemical symbol for water is", ["CO2", "H2O", "NaCl", "O3"], 1),
    ("Penguins live mostly in", ["Africa", "Europe", "Antarctica", "Asia"], 2),
    ("To write on a blackboard you use", ["a spoon", "a hammer", "a sponge", "chalk"], 3),
    ("The first month of the year is", ["January", "March", "October", "June"], 0),
    ("A baby cat is called a", ["puppy", "kitten", "calf", "foal"], 1),
    ("We breathe in", ["sand", "water", "oxygen", "sugar"], 2),
    ("The Earth orbits the", ["Moon", "Mars", "comet", "Sun"], 3),
    ("Ice is frozen", ["water", "bread", "stone", "metal"], 0),
    ("A triangle has three", ["circles", "sides", "wheels", "colors"], 1),
    ("The author of Romeo and Juliet is William", ["Wordsworth", "Blake", "Shakespeare", "Golding"], 2),
    ("The fastest land animal is the", ["snail", "tortoise", "sloth", "cheetah"], 3),
    ("Rain falls from", ["clouds", "rocks", "trees", "roads"], 0),
    ("The number after nine is", ["eight", "ten", "seven", "twelve"], 1),
    ("A car runs on roads, a train runs on", ["water", "clouds", "rails", "sand"], 2),
    ("The tallest animal in the world is the", ["mouse", "rabbit", "frog", "giraffe"], 3),
    ("To cut paper you use", ["scissors", "a pillow", "a cup", "a sock"], 0),
    ("The planet we live on is called", ["Saturn", "Earth", "Pluto", "Neptune"], 1),
    ("Milk comes from", ["chickens", "fish", "cows", "snakes"], 2),
    ("The season after winter is", ["autumn", "summer", "winter", "spring"], 3),
    ("A shoe is worn on the", ["foot", "head", "hand", "ear"], 0),
    ("The language spoken in Spain is", ["German", "Spanish", "Russian", "Hindi"], 1),
    ("A clock tells the", ["weather", "price", "time", "distance"], 2),
    ("Fish live in", ["trees", "deserts", "clouds", "water"], 3),
    ("The boiling point of water at sea level is one hundred degrees", ["Celsius", "Fahrenheit", "Kelvin", "Newton"], 0),
    ("An apple is a kind of", ["vegetable", "fruit", "fish", "stone"], 1),
    ("Night is dark because the sun has", ["exploded", "frozen", "set", "doubled"], 2),
    ("Books are kept in a", ["bakery", "garage", "swimming pool", "library"], 3),
]
TASK = """task: shepherd_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: "{{{{answer}}}}"
metric_list:
  - metric: acc
"""


def write_task(folder: Path) -> None:
    data = folder / "mc.jsonl"
    data.write_text("".join(json.dumps({"question": q, "choices": c, "answer": a}) + "\n" for q, c, a in QUESTIONS))
    (folder / "shepherd_mc.yaml").write_text(TASK.format(data=data))


def lm_eval(folder: Path, out: str, model: str, model_args: str, *extra: str) -> dict:
    """Runs lm-eval's CLI; returns {doc_id: [(loglikelihood, is_greedy) per choice]} and its acc."""
    env = dict(os.environ, HF_DATASETS_OFFLINE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    cmd = [sys.executable, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--tasks", "shepherd_mc",
           "--include_path", str(folder), "--log_samples", "--output_path", str(folder / out), *extra]
    subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
    samples = sorted(glob.glob(str(folder / out / "**" / "samples_shepherd_mc_*.jsonl"), recursive=True))[-1]
    results = sorted(glob.glob(str(folder / out / "**" / "results_*.json"), recursive=True))[-1]
    per = {}
    for line in open(samples):
        s = json.loads(line)
        per[s["doc_id"]] = [(float(r[0][0]), str(r[0][1]) == "True") for r in s["resps"]]
    acc = json.load(open(results))["results"]["shepherd_mc"]["acc,none"]
    return {"per": per, "acc": acc}


def compare(ref: dict, got: dict) -> dict:
    pairs = [(x, y) for k in ref["per"] for x, y in zip(ref["per"][k], got["per"][k])]
    diffs = [abs(x[0] - y[0]) for x, y in pairs]

    def pick(p):
        return max(range(len(p)), key=lambda i: p[i][0])
    picks = sum(pick(ref["per"][k]) == pick(got["per"][k]) for k in ref["per"])
    return {"n": len(pairs), "max": max(diffs), "mean": sum(diffs) / len(diffs),
            "greedy": sum(x[1] == y[1] for x, y in pairs), "picks": picks, "questions": len(ref["per"])}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="float32,bfloat16", help="shepherd serve --dtype values to score")
    ap.add_argument("--docs", action="store_true")
    a = ap.parse_args()
    exit_on_sigterm()
    from shepherd.model.loader import default_model_path
    gguf = Path(default_model_path())
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_task(folder)
        from transformers import AutoTokenizer          # lm-eval's tokenizer, from the same GGUF
        AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name).save_pretrained(folder / "tok")
        ref = lm_eval(folder, "hf", "hf", f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32,"
                                          f"tokenizer={folder / 'tok'}", "--batch_size", "8")
        rows = [("transformers (lm-eval `hf`, float32): the reference", ref, None)]
        for dtype in a.dtypes.split(","):
            proc, url = start_server(["--dtype", dtype, "--served-model-name", NAME, "--log-level", "warning"], cwd=ROOT)
            try:
                wait_healthy(url, proc, timeout=600)
                got = lm_eval(folder, f"shepherd-{dtype}", "local-completions",
                              f"model={NAME},base_url={url}/v1/completions,tokenizer={folder / 'tok'},"
                              f"tokenized_requests=True,num_concurrent=4,max_retries=1")
            finally:
                stop_server(proc)
            rows.append((f"shepherd serve --dtype {dtype} (lm-eval `local-completions`)", got, compare(ref, got)))
    lines = ["| scored by | accuracy | loglikelihood vs the reference: largest / mean difference, nats | "
             "is_greedy agrees | picks agree |", "|---|---:|---|---:|---:|"]
    for name, r, c in rows:
        if c is None:
            lines.append(f"| {name} | {r['acc']:.3f} | - | - | - |")
        else:
            lines.append(f"| {name} | {r['acc']:.3f} | {c['max']:.2g} / {c['mean']:.2g} | {c['greedy']} of {c['n']} | "
                         f"{c['picks']} of {c['questions']} |")
    import lm_eval as lm
    lines += ["", f"lm_eval {lm.__version__}; " + footer(f"python benchmarks/lm_eval_parity.py --dtypes {a.dtypes}"
                                                        f"{' --docs' if a.docs else ''}")]
    publish("\n".join(lines), "SERVING.md", "lm-eval-parity", a.docs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
