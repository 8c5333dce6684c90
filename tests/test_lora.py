"""LoRA adapters on the real model: PEFT parity, batch invariance across adapters, bad adapter
files, and loading/unloading over HTTP while serving.

The adapters are built inside the test with peft on transformers' own copy of the default
model (random weights, saved as PEFT folders): nothing is downloaded. The reference is PEFT's
forward in float32, where shepherd's greedy tokens must be identical."""
from __future__ import annotations

import json
import os
import re
import threading
import time

import httpx
import pytest
import torch

from shepherd.config import EngineConfig, LoraConfig, SchedulerConfig, ServerConfig
from shepherd.request import Request, RequestState, SamplingParams
from shepherd.step import LoraLoad, NewRequest, ScheduledBatch, ScheduledSeq

pytestmark = pytest.mark.model

NEW = 12
TOP = 5
QUESTIONS = ["What is the capital of France?", "Write a haiku about the sea.", "List three prime numbers."]
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def hf_greedy(model, prompt, n):
    toks = []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            t = int(out.logits[0, -1].argmax())
            toks.append(t)
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return toks


@pytest.fixture(scope="module")
def adapters(default_model_path, tmp_path_factory):
    """Two PEFT adapters with random weights (a1: every projection, rank 8; a2: q/v/down, rank 4,
    rsLoRA, another alpha for down_proj) and PEFT's float32 greedy tokens for them and the base."""
    transformers = pytest.importorskip("transformers")
    peft = pytest.importorskip("peft")
    from shepherd.model.loader import load_tokenizer
    tok = load_tokenizer(default_model_path)
    prompts = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    model = transformers.AutoModelForCausalLM.from_pretrained(
        os.path.dirname(default_model_path), gguf_file=os.path.basename(default_model_path), dtype=torch.float32)
    model.eval()
    root = tmp_path_factory.mktemp("adapters")
    refs = {None: [hf_greedy(model, p, NEW) for p in prompts]}
    specs = {"a1": dict(r=8, lora_alpha=16, target_modules=ALL),
             "a2": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], use_rslora=True,
                        alpha_pattern={"down_proj": 2})}
    paths = {}
    for seed, (name, spec) in enumerate(specs.items()):
        torch.manual_seed(seed)
        pm = peft.get_peft_model(model, peft.LoraConfig(init_lora_weights=False, **spec))
        with torch.no_grad():       # B scaled down: the adapter changes the answer without wrecking it
            for n, p in pm.named_parameters():
                if "lora_B" in n:
                    p.mul_(0.2)
        pm.eval()
        paths[name] = str(root / name)
        pm.save_pretrained(paths[name])
        refs[name] = [hf_greedy(pm, p, NEW) for p in prompts]
        model = pm.unload()
    assert refs["a1"] != refs[None] and refs["a2"] != refs[None] and refs["a1"] != refs["a2"]
    return prompts, paths, refs


def executor(model_path, dtype, paths, max_loras=2):
    from shepherd.engine.torch_executor import TorchExecutor
    return TorchExecutor(EngineConfig(model=model_path, dtype=dtype, max_total_tokens=4096, quantization="none",
                                      scheduler=SchedulerConfig(max_loras=max_loras),
                                      lora=LoraConfig(modules=dict(paths))))


def greedy(ex, jobs, n, chunk=None, step0=0):
    """Run (adapter, prompt) jobs together through the executor: each adapter in its own slot
    (loaded in the first batch); returns per job its tokens and per-step top logprobs."""
    names = sorted({a for a, _ in jobs if a is not None})
    loads = [LoraLoad(i, a) for i, a in enumerate(names)]
    reqs, slot0 = [], 0
    for i, (a, p) in enumerate(jobs):
        r = Request(req_id=f"j{step0}-{i}", prompt_ids=list(p), adapter=a,
                    params=SamplingParams(max_tokens=n, temperature=0.0, logprobs=TOP))
        r.slots = list(range(slot0, slot0 + len(p) + n))
        slot0 += len(p) + n
        ex.add(NewRequest(r.req_id, r.prompt_ids, r.params, (), a))
        reqs.append(r)
    done = {r.req_id: 0 for r in reqs}
    lps = {r.req_id: [] for r in reqs}
    step = step0
    while any(len(r.output_ids) < n for r in reqs):
        seqs = []
        for r in reqs:
            st = done[r.req_id]
            if st < len(r.prompt_ids):
                k = len(r.prompt_ids) - st if chunk is None else min(chunk, len(r.prompt_ids) - st)
                seqs.append(ScheduledSeq(r.req_id, r.prompt_ids[st:st + k], st, st + k == len(r.prompt_ids),
                                         0 if st == 0 else len(r.slots), list(r.slots) if st == 0 else []))
                done[r.req_id] = st + k
            elif len(r.output_ids) < n:
                seqs.append(ScheduledSeq(r.req_id, [r.output_ids[-1]], r.num_tokens - 1, True, len(r.slots), []))
        res = ex.execute(ScheduledBatch(step=step, seqs=seqs, lora_loads=loads))
        loads = []
        step += 1
        for r in reqs:
            if r.req_id in res.tokens:
                r.output_ids.append(res.tokens[r.req_id][0])
                lp = res.logprobs[r.req_id][0]
                lps[r.req_id].append((lp.logprob, [(i, v) for i, v in lp.top]))
    ex.execute(ScheduledBatch(step=step, finished=[r.req_id for r in reqs]))
    return [(r.output_ids, lps[r.req_id]) for r in reqs]


def test_peft_parity_float32(default_model_path, adapters):
    """Greedy tokens identical to PEFT's float32 forward, for each adapter and the base, alone
    and with every adapter and the base in one batch (chunked prefill too)."""
    prompts, paths, refs = adapters
    ex = executor(default_model_path, "float32", paths)
    for k, a in enumerate((None, "a1", "a2")):
        assert greedy(ex, [(a, prompts[k])], NEW, step0=10 * k)[0][0] == refs[a][k], f"adapter {a} alone"
    jobs = [(a, p) for p in prompts for a in (None, "a1", "a2")]
    got = greedy(ex, jobs, NEW, chunk=7, step0=100)
    for (a, p), (toks, _) in zip(jobs, got):
        assert toks == refs[a][prompts.index(p)], f"batched adapter {a}"


def test_bf16_close_to_peft(default_model_path, adapters):
    """bfloat16 (the fused kernels' LoRA inside forward_bf16): greedy tokens equal PEFT's float32
    ones, or at the first divergence each side's token is among the other's top-5 (bf16's
    tolerance, as tests/test_model_parity.py checks the base model)."""
    prompts, paths, refs = adapters
    ex = executor(default_model_path, "bfloat16", paths)
    for a in ("a1", "a2"):
        got = greedy(ex, [(a, p) for p in prompts], NEW)
        for i, (toks, lps) in enumerate(got):
            for k, (x, y) in enumerate(zip(refs[a][i], toks)):
                if x != y:
                    assert x in [t for t, _ in lps[k][1]], f"{a} prompt {i} step {k}"
                    break


def test_batch_invariance_across_adapters(default_model_path, adapters):
    """A request's tokens and logprobs are bit-identical alone and beside requests of the other
    adapter, of the same adapter and of the base model, in one step (bfloat16, the default)."""
    prompts, paths, _ = adapters
    ex = executor(default_model_path, "bfloat16", paths)
    alone = [greedy(ex, [(a, prompts[1])], NEW, step0=10 * k)[0] for k, a in enumerate(("a1", "a2", None))]
    crowd = [(None, prompts[0]), ("a2", prompts[2]), ("a1", prompts[1]), ("a1", prompts[0]),
             ("a2", prompts[1]), (None, prompts[1]), ("a2", prompts[0])]
    got = greedy(ex, crowd, NEW, step0=100)
    assert got[2] == alone[0] and got[4] == alone[1] and got[5] == alone[2]
    got = greedy(ex, crowd, NEW, chunk=5, step0=200)          # prefill chunks beside decodes
    assert got[2] == alone[0] and got[4] == alone[1] and got[5] == alone[2]


# ---------------------------------------------------------------- bad adapter files
def _write(folder, config, tensors):
    from safetensors.torch import save_file
    os.makedirs(folder, exist_ok=True)
    if config is not None:
        with open(os.path.join(folder, "adapter_config.json"), "w") as f:
            f.write(config if isinstance(config, str) else json.dumps(config))
    if tensors is not None:
        save_file(tensors, os.path.join(folder, "adapter_model.safetensors"))
    return str(folder)


def _key(layer, mod, ab):
    part = "self_attn" if mod in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
    return f"base_model.model.model.layers.{layer}.{part}.{mod}.lora_{ab}.weight"


@pytest.fixture(scope="module")
def bad_adapters(tmp_path_factory):
    """Folders each wrong in one way, and the words the 400 must name."""
    root = tmp_path_factory.mktemp("bad")
    cfg = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]}
    ok = {_key(0, "q_proj", "A"): torch.randn(4, 576) * 0.01, _key(0, "q_proj", "B"): torch.randn(576, 4) * 0.01}
    cases = {
        "missing": (str(root / "nope"), "not a folder"),
        "no_config": (_write(root / "no_config", None, ok), "adapter_config.json"),
        "bad_json": (_write(root / "bad_json", "{not json", ok), "not valid JSON"),
        "no_weights": (_write(root / "no_weights", cfg, None), "adapter_model.safetensors"),
        "rank": (_write(root / "rank", dict(cfg, r=32), {
            _key(0, "q_proj", "A"): torch.zeros(32, 576), _key(0, "q_proj", "B"): torch.zeros(576, 32)}),
            "max-lora-rank"),
        "shape": (_write(root / "shape", cfg, {
            _key(0, "q_proj", "A"): torch.zeros(4, 100), _key(0, "q_proj", "B"): torch.zeros(576, 4)}), "lora_A"),
        "module": (_write(root / "module", cfg, {
            "base_model.model.lm_head.lora_A.weight": torch.zeros(4, 576),
            "base_model.model.lm_head.lora_B.weight": torch.zeros(49152, 4)}), "not a LoRA weight"),
        "layer": (_write(root / "layer", cfg, {
            _key(99, "q_proj", "A"): torch.zeros(4, 576), _key(99, "q_proj", "B"): torch.zeros(576, 4)}), "layer 99"),
        "half": (_write(root / "half", cfg, {_key(0, "q_proj", "A"): torch.zeros(4, 576)}), "no lora_B"),
        "dora": (_write(root / "dora", dict(cfg, use_dora=True), ok), "DoRA"),
        "nan": (_write(root / "nan", cfg, {_key(0, "q_proj", "A"): torch.full((4, 576), float("nan")),
                                           _key(0, "q_proj", "B"): torch.zeros(576, 4)}), "NaN"),
        "junk": (str(root / "junk"), "safetensors"),
    }
    os.makedirs(root / "junk")
    _write(root / "junk", cfg, None)
    with open(root / "junk" / "adapter_model.safetensors", "wb") as f:
        f.write(b"\x00garbage" * 10)
    return cases, _write(root / "good", cfg, ok)


SMOLLM2 = dict(architecture="llama", vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30,
               num_heads=9, num_kv_heads=3, head_dim=64, rms_norm_eps=1e-5, rope_theta=1e4, rope_scaling=None,
               max_position_embeddings=8192, tie_word_embeddings=True, attention_bias=False)


def test_bad_adapter_files_are_named(bad_adapters):
    from shepherd.config import ModelConfig
    from shepherd.model.lora import LoraError, read_adapter
    cfg = ModelConfig(**SMOLLM2)
    cases, good = bad_adapters
    for what, (path, words) in cases.items():
        with pytest.raises(LoraError) as e:
            read_adapter(what, path, cfg, max_rank=16)
        assert words.lower() in str(e.value).lower(), (what, str(e.value))
    assert read_adapter("good", good, cfg, max_rank=16).rank == 4


# ---------------------------------------------------------------- over HTTP
@pytest.fixture(scope="module")
def server(default_model_path, adapters):
    from shepherd.engine.engine import Engine
    from test_server_api import ServerThread
    _, paths, _ = adapters
    engine = Engine(EngineConfig(model=default_model_path, max_total_tokens=4096, watchdog_timeout=120,
                                 scheduler=SchedulerConfig(max_loras=2),
                                 lora=LoraConfig(modules={"a1": paths["a1"]})))
    with ServerThread(engine, ServerConfig(served_model_name="base")) as srv:
        yield srv


def _complete(c, model, prompt_ids, n=NEW):
    r = c.post("/v1/completions", json={"model": model, "prompt": prompt_ids, "max_tokens": n, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def test_load_select_unload_over_http(server, adapters, bad_adapters):
    prompts, paths, refs = adapters
    cases, _ = bad_adapters
    with httpx.Client(base_url=server.url, timeout=60) as c:
        models = {m["id"]: m for m in c.get("/v1/models").json()["data"]}
        assert models["a1"]["parent"] == "base" and models["base"]["parent"] is None
        r = c.post("/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 2})
        assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
        for what in ("missing", "rank", "shape", "junk"):
            r = c.post("/v1/load_lora_adapter", json={"lora_name": f"bad-{what}", "lora_path": cases[what][0]})
            assert r.status_code == 400 and cases[what][1].lower() in r.json()["error"]["message"].lower(), r.text
        assert c.post("/v1/load_lora_adapter", json={"lora_name": "a1", "lora_path": paths["a1"]}).status_code == 400
        r = c.post("/v1/load_lora_adapter", json={"lora_name": "a2", "lora_path": paths["a2"]})
        assert r.status_code == 200, r.text
        assert {"base", "a1", "a2"} <= {m["id"] for m in c.get("/v1/models").json()["data"]}
        # each model answers as its PEFT reference did (bf16: the first tokens agree)
        out = {m: _complete(c, m, prompts[0]) for m in ("base", "a1", "a2")}
        assert out["a2"]["model"] == "a2"
        texts = {m: o["choices"][0]["text"] for m, o in out.items()}
        assert len(set(texts.values())) == 3
        metrics = c.get("/metrics").text
        assert re.search(r'vllm:lora_requests_info\{max_lora="2",', metrics), metrics[-2000:]
        # a1 and a2 were each loaded into a slot once: the engine's measured load times
        loads = re.search(r'shepherd:lora_load_seconds_count\{[^}]*\} (\S+)', metrics)
        total = re.search(r'shepherd:lora_load_seconds_sum\{[^}]*\} (\S+)', metrics)
        assert loads and float(loads.group(1)) == 2 and 0 < float(total.group(1)) < 10, metrics[-3000:]
        # unload with a request in flight: 409, and the request is unaffected
        body = {"model": "a2", "prompt": prompts[1], "max_tokens": 400, "ignore_eos": True, "stream": True}
        with c.stream("POST", "/v1/completions", json=body) as s:
            it = s.iter_lines()
            assert next(l for l in it if l.startswith("data: "))
            r = c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
            assert r.status_code == 409 and r.json()["error"]["code"] == "lora_busy", r.text
        assert c.post("/v1/unload_lora_adapter", json={"lora_name": "nope"}).status_code == 404
        _wait_idle(server.engine)
        r = c.post("/v1/unload_lora_adapter", json={"lora_name": "a2"})
        assert r.status_code == 200, r.text
        assert "a2" not in {m["id"] for m in c.get("/v1/models").json()["data"]}
        assert c.post("/v1/completions", json={"model": "a2", "prompt": "hi", "max_tokens": 2}).status_code == 404
        # the server is unaffected: the others still answer the same
        assert _complete(c, "a1", prompts[0])["choices"][0]["text"] == texts["a1"]
        assert _complete(c, "base", prompts[0])["choices"][0]["text"] == texts["base"]


def _wait_idle(engine, timeout=60.0):
    """Until the engine reports nothing running or waiting (the aborted stream has ended)."""
    tick = threading.Event()
    t0 = time.monotonic()
    while not tick.wait(0.05):
        st = engine.stats()
        if st.num_running == 0 and st.num_waiting == 0:
            return
        assert time.monotonic() - t0 < timeout, "not idle"
