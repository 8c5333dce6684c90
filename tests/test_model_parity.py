"""Parity of shepherd's own Llama forward with transformers' implementation
loading the same GGUF (a test-only reference), checked the way vLLM's tests
check it: greedy tokens equal, or at the first divergence each side's token is
among the other's top-5 logprobs. float32 and bfloat16, alone and batched."""
import os

import pytest
import torch

from shepherd.config import EngineConfig
from hand_batches import batch, seq
from shepherd.step import ScheduledBatch
from shepherd.request import Request, RequestState, SamplingParams

pytestmark = pytest.mark.model

NEW_TOKENS = 20
TOP = 5
QUESTIONS = [
    "hi",
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three prime numbers greater than 100.",
]
RAW = [
    "The quick brown fox",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n",
    ("In the beginning of the twentieth century, the city grew quickly as factories opened along the "
     "river and workers arrived from the countryside. Housing was scarce, streets were crowded, and "
     "the municipal government struggled to provide clean water and sanitation. Reformers argued that ") * 3,
]


@pytest.fixture(scope="module")
def prompts(default_model_path):
    from shepherd.model.loader import load_tokenizer
    tok = load_tokenizer(default_model_path)
    ps = [tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])) for q in QUESTIONS]
    ps += [tok.encode(t) for t in RAW]
    lens = sorted(len(p) for p in ps)
    assert len(ps) >= 8 and lens[0] < 10 and lens[-1] > 120     # mixed lengths
    return ps


def hf_greedy(model, prompt, n):
    """Greedy continuation with transformers' own forward and KV cache (no EOS stop).
    Returns tokens and, per step, the top-5 (ids, logprobs) and the full logprobs."""
    toks, tops, lps = [], [], []
    with torch.inference_mode():
        out = model(torch.tensor([prompt]), use_cache=True)
        for _ in range(n):
            lp = torch.log_softmax(out.logits[0, -1].float(), -1)
            t = int(lp.argmax())
            toks.append(t)
            tops.append(torch.topk(lp, TOP).indices.tolist())
            lps.append(lp)
            out = model(torch.tensor([[t]]), past_key_values=out.past_key_values, use_cache=True)
    return toks, tops


def shepherd_greedy(ex, prompts, n, chunk=None):
    """Run prompts together through the executor (a tiny synchronous loop)."""
    reqs, next_slot = [], 0
    for i, p in enumerate(prompts):
        r = Request(req_id=f"p{i}", prompt_ids=list(p),
                    params=SamplingParams(max_tokens=n, temperature=0.0, logprobs=TOP))
        r.slots = list(range(next_slot, next_slot + len(p) + n))
        next_slot += len(p) + n
        r.state = RequestState.RUNNING
        reqs.append(r)
    tops = {r.req_id: [] for r in reqs}
    done = {r.req_id: 0 for r in reqs}
    step = 0
    while any(len(r.output_ids) < n for r in reqs):
        seqs = []
        for r in reqs:
            if done[r.req_id] < len(r.prompt_ids):
                st = done[r.req_id]
                k = len(r.prompt_ids) - st if chunk is None else min(chunk, len(r.prompt_ids) - st)
                seqs.append(seq(r, r.prompt_ids[st:st + k], st, sample=st + k == len(r.prompt_ids),
                                fresh=st == 0))
                done[r.req_id] = st + k
            elif len(r.output_ids) < n:
                seqs.append(seq(r, [r.output_ids[-1]], r.num_tokens - 1, sample=True))
        res = ex.execute(batch(ex, step, seqs))
        step += 1
        for r in reqs:
            if r.req_id in res.tokens:
                r.output_ids.append(res.tokens[r.req_id][0])
                lp = res.logprobs[r.req_id][0]
                assert lp.token_id == r.output_ids[-1]
                tops[r.req_id].append([i for i, _ in lp.top])
    for r in reqs:
        r.state = RequestState.FINISHED
    ex.execute(ScheduledBatch(step=step, finished=[r.req_id for r in reqs]))
    return [(r.output_ids, tops[r.req_id]) for r in reqs]


def check_close(ref, got, label):
    """vLLM's check_logprobs_close: equal, or each side's token in the other's top-5 at the
    first divergence (and nothing is compared after it)."""
    (rt, rtop), (gt, gtop) = ref, got
    assert len(rt) == len(gt) == NEW_TOKENS
    for i, (a, b) in enumerate(zip(rt, gt)):
        if a != b:
            assert a in gtop[i], f"{label}: step {i}: reference token {a} not in shepherd's top-5 {gtop[i]}"
            assert b in rtop[i], f"{label}: step {i}: shepherd token {b} not in reference top-5 {rtop[i]}"
            return i
    return None


_HF_REFS: dict = {}


# (dtype, weights): the unquantised forward in both dtypes, the int8 / int4 weight-only kernels
# (bf16 activations) and w8a8 (int8 activations) against the same bf16 reference
@pytest.fixture(scope="module", params=["float32", "bfloat16", "bfloat16-int8", "bfloat16-int4", "bfloat16-w8a8",
                                        "bfloat16-cuda"])
def setup(request, default_model_path, prompts):
    transformers = pytest.importorskip("transformers")
    from shepherd.engine.torch_executor import TorchExecutor
    dtype, _, q = request.param.partition("-")
    device = "cuda" if q == "cuda" else "cpu"    # the same forward on a GPU, where there is one
    if device == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("no CUDA device")
        q = ""
    for d in {dtype, "float32"}:
        if d not in _HF_REFS:
            path, gguf = default_model_path, {}
            if not os.path.isdir(path):      # the GGUF; a folder is an HF one ($SHEPHERD_TEST_MODEL)
                path, gguf = os.path.dirname(path), {"gguf_file": os.path.basename(path)}
            model = transformers.AutoModelForCausalLM.from_pretrained(path, **gguf, dtype=getattr(torch, d))
            model.eval()
            _HF_REFS[d] = [hf_greedy(model, p, NEW_TOKENS) for p in prompts]
            del model
    ex = TorchExecutor(EngineConfig(model=default_model_path, dtype=dtype, max_total_tokens=8192,
                                    quantization=q or "none", device=device))
    return request.param, ex, _HF_REFS[dtype], _HF_REFS["float32"]


def test_parity_alone(setup, prompts):
    """The top-5 rule against transformers in the same dtype; and the greedy path may leave the
    float32 model's (the exact one's) within NEW_TOKENS on at most half the prompts. The count is
    taken against float32, not bf16 transformers: two bf16 forwards that sum in different orders
    part on near-ties at random, and the bf16 reference is no closer to the model than we are
    (measured: shepherd's bf16 GEMM follows float32 on 8 of 8 prompts in its vdpbf16ps form and 6 of 8
    in its FMA form, oneDNN's on 4; docs/MODEL.md)."""
    dtype, ex, refs, exact = setup
    diverged = 0
    for i, p in enumerate(prompts):
        got = shepherd_greedy(ex, [p], NEW_TOKENS)[0]
        check_close(refs[i], got, f"{dtype} alone prompt {i}")
        if got[0] != exact[i][0]:
            diverged += 1
    # w8a8 rounds every activation row to int8: greedy paths part on near-ties (6 of 8 prompts
    # within 20 tokens of float32's: at steps 0, 2, 10, 11, 17, 17; docs/MODEL.md), so it is held to the
    # top-5 rule above and to its perplexity budget (test_quant_kernels), not to this count
    if not dtype.endswith("w8a8"):
        assert diverged <= len(prompts) // 2, "too many early divergences"


def test_parity_batched(setup, prompts):
    dtype, ex, refs, _ = setup
    got = shepherd_greedy(ex, prompts, NEW_TOKENS)
    for i in range(len(prompts)):
        check_close(refs[i], got[i], f"{dtype} batched prompt {i}")


def test_parity_batched_chunked_prefill(setup, prompts):
    dtype, ex, refs, _ = setup
    got = shepherd_greedy(ex, prompts, NEW_TOKENS, chunk=37)
    for i in range(len(prompts)):
        check_close(refs[i], got[i], f"{dtype} chunked prompt {i}")


def test_parity_not_batch_invariant_mode(setup, prompts, default_model_path):
    """The fast (non batch-invariant) attention path agrees too."""
    dtype, ex, refs, _ = setup
    ex.model.batch_invariant = False
    try:
        got = shepherd_greedy(ex, prompts, NEW_TOKENS)
    finally:
        ex.model.batch_invariant = True
    for i in range(len(prompts)):
        check_close(refs[i], got[i], f"{dtype} non-invariant prompt {i}")


def test_save_hf_folder_round_trip(default_model_path, tmp_path):
    """The GGUF written out as a Hugging Face folder (what vLLM / transformers load) reloads
    with the same config, weights, tokenizer and chat template."""
    from shepherd.model.loader import context_length, load_model, save_hf_folder
    a = load_model(default_model_path, "bfloat16")
    save_hf_folder(a, str(tmp_path))
    b = load_model(str(tmp_path), "bfloat16")
    assert b.config == a.config
    # what the simulated executor reads instead of loading the model: the metadata alone
    assert context_length(str(tmp_path)) == context_length(default_model_path) == a.config.max_position_embeddings
    assert set(b.weights) == set(a.weights)
    assert all(torch.equal(a.weights[k], b.weights[k]) for k in a.weights)
    text = "Hi 123 😀 <|im_start|>user"
    assert b.tokenizer.encode(text) == a.tokenizer.encode(text)
    assert b.tokenizer.eos_token_ids == a.tokenizer.eos_token_ids
    msgs = [{"role": "user", "content": "hi"}]
    assert b.tokenizer.apply_chat_template(msgs) == a.tokenizer.apply_chat_template(msgs)


@pytest.mark.model
def test_non_invariant_bf16_chat_answer(default_model_path):
    """The default (non batch-invariant) bf16 path answers a chat prompt as the
    batch-invariant path and transformers do: a regression test for a fused-attention
    prefill that produced garbage in bf16 while top-5 parity still passed."""
    from shepherd.config import EngineConfig, SchedulerConfig
    from shepherd.engine.offline import run_offline
    from shepherd.engine.torch_executor import TorchExecutor
    from shepherd.scheduler.scheduler import Scheduler

    answers = {}
    for bi in (True, False):
        ex = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=1024,
                                        batch_invariant=bi))
        tok = ex.tokenizer
        ids = tok.encode(tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}]))
        r = Request("q", ids, SamplingParams(max_tokens=8, temperature=0.0), eos_token_ids=ex.eos_token_ids)
        run_offline(Scheduler(SchedulerConfig(max_total_tokens=1024), max_model_len=8192), ex, [r])
        answers[bi] = tok.decode(r.output_ids)
    assert "Paris" in answers[True]
    assert answers[False] == answers[True]
