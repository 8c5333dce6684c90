"""Prompt logprobs (issue 31 item 3): completions' echo + logprobs and vLLM's prompt_logprobs,
checked against a direct forward of the model over the whole prompt, through chunked prefill
and a warm prefix cache, and with the requests lm-evaluation-harness's `local-completions`
loglikelihood path sends (no dataset: the request and the parsing are lm-eval's)."""
from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch

from hand_batches import announced, seq
from shepherd.config import EngineConfig, SchedulerConfig, ServerConfig
from shepherd.engine.engine import Engine
from shepherd.request import Request, SamplingParams
from shepherd.server.openai_api import build_app

pytestmark = pytest.mark.model

CONTEXT = "The capital of France is"
CONTINUATION = " Paris, a city on the Seine."
TOP = 3


@pytest.fixture(scope="module")
def served(default_model_path):
    """A float32 engine whose prefill runs in chunks of 8 tokens, its executor, and an openai
    client over its app; the reference forward runs on the same executor before it starts."""
    cfg = EngineConfig(model=default_model_path, executor="torch", dtype="float32", max_total_tokens=2048,
                       batch_invariant=False, scheduler=SchedulerConfig(max_num_tokens=8))
    engine = Engine(cfg)
    ex = engine.core.executor
    tok = engine.tokenizer
    prompt = tok.encode(CONTEXT + CONTINUATION)
    ref = reference(ex, prompt)
    loop = asyncio.new_event_loop()
    app = build_app(engine, ServerConfig())
    loop.run_until_complete(engine.start())
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://shepherd", timeout=300)
    oc = openai.AsyncOpenAI(base_url="http://shepherd/v1", api_key="x", http_client=http, max_retries=0)
    oc.model = loop.run_until_complete(oc.models.list()).data[0].id
    yield loop, oc, engine, tok, prompt, ref
    loop.run_until_complete(http.aclose())
    loop.run_until_complete(engine.stop())
    loop.close()


def reference(ex, prompt: list[int]) -> torch.Tensor:
    """log-softmax of the model's logits at every prompt position: one forward of the whole prompt."""
    r = Request(req_id="reference", prompt_ids=list(prompt), params=SamplingParams(max_tokens=1))
    r.slots = list(range(len(prompt)))
    with torch.inference_mode():
        inp, _ = ex.build_input(announced(ex, [seq(r, prompt, 0, sample=True, fresh=True)]))
        inp.logits_index = None                     # every row's logits
        return torch.log_softmax(ex.model.forward(inp, ex.kv_pool).float(), dim=-1)


def check_against(ref: torch.Tensor, prompt: list[int], plp) -> None:
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        lp = plp[p]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - float(ref[p - 1, prompt[p]])) < 1e-3, (p, lp.logprob)
        assert lp.rank == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
        assert [t for t, _ in lp.top] == ref[p - 1].topk(TOP).indices.tolist()


def test_engine_prompt_logprobs_match_a_direct_forward(served):
    loop, _, engine, _, prompt, ref = served

    async def one():
        stream = await engine.submit(list(prompt), SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=TOP))
        outs = [o async for o in stream]
        firsts = [o.prompt_logprobs for o in outs if o.prompt_logprobs is not None]
        assert len(firsts) == 1 and outs[0].prompt_logprobs is not None   # once, with the first token
        return firsts[0]

    check_against(ref, prompt, loop.run_until_complete(one()))       # prefill in chunks of 8
    warm = loop.run_until_complete(one())                              # the prompt is in the prefix cache now
    check_against(ref, prompt, warm)


def test_lm_eval_loglikelihood_request(served):
    """What lm-eval's local-completions sends for loglikelihood (token ids, echo, logprobs=1,
    max_tokens=1, temperature 0) and how it reads the answer (token_logprobs[ctxlen:-1])."""
    loop, oc, _, tok, prompt, ref = served
    ctxlen = len(tok.encode(CONTEXT))
    other = tok.encode(CONTEXT + " Rome.")

    async def main():
        return await oc.completions.create(model=oc.model, prompt=[prompt, other],
                                           max_tokens=1, temperature=0, logprobs=1, echo=True, seed=1234)
    r = loop.run_until_complete(main())
    assert [c.index for c in r.choices] == [0, 1]
    lp = r.choices[0].logprobs
    assert len(lp.token_logprobs) == len(prompt) + 1 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert r.choices[0].text.startswith(CONTEXT + CONTINUATION)
    cont = lp.token_logprobs[ctxlen:-1]
    want = [float(ref[p - 1, prompt[p]]) for p in range(ctxlen, len(prompt))]
    assert len(cont) == len(want) and all(abs(a - b) < 1e-3 for a, b in zip(cont, want))
    # lm-eval's is_greedy: each continuation token's logprob equals the best of its top_logprobs
    greedy = all(t == max(top.values()) for t, top in zip(cont, lp.top_logprobs[ctxlen:-1]))
    assert greedy == all(int(ref[p - 1].argmax()) == prompt[p] for p in range(ctxlen, len(prompt)))
    assert len(r.choices[1].logprobs.token_logprobs) == len(other) + 1


def test_vllm_prompt_logprobs_field_and_stream(served):
    loop, oc, _, tok, prompt, ref = served

    async def main():
        full = await oc.completions.create(model=oc.model, prompt=prompt, max_tokens=2,
                                           temperature=0, extra_body={"prompt_logprobs": 2})
        chunks = [c async for c in await oc.completions.create(
            model=oc.model, prompt=prompt, max_tokens=3, temperature=0, echo=True, logprobs=0,
            stream=True)]
        return full, chunks
    full, chunks = loop.run_until_complete(main())
    plp = full.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(prompt) and plp[0] is None
    for p in range(1, len(prompt)):
        d = plp[p][str(prompt[p])]
        assert abs(d["logprob"] - float(ref[p - 1, prompt[p]])) < 1e-3
        assert d["rank"] == int((ref[p - 1] > ref[p - 1, prompt[p]]).sum()) + 1
    assert full.choices[0].logprobs is None           # prompt_logprobs alone does not turn logprobs on
    first = chunks[0].choices[0]                      # the echo goes out with the prompt's logprobs
    assert first.text.startswith(CONTEXT + CONTINUATION)
    assert first.logprobs.token_logprobs[0] is None
    assert len(first.logprobs.token_logprobs) >= len(prompt)
    got = first.logprobs.token_logprobs[1:len(prompt)]
    assert all(abs(a - float(ref[p, prompt[p + 1]])) < 1e-3 for p, a in enumerate(got))
