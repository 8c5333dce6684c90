"""Draft-model drafting (vLLM's "draft_model" method): a second, cheaper model proposes the
next tokens greedily, k forwards of it per step for all requests at once.

The draft model is a TorchExecutor of its own (its own KV pool, slot tables and sampler),
driven with the same step contract: each proposal first feeds the request's committed
tokens the draft model has not seen (its prompt on the first call; afterwards the tokens
kept since: the last one, and the drafts the target accepted), then one token at a time.
Its KV past the committed tokens is scratch: the next call feeds from there again.

  {"method": "draft_model", "model": "small.gguf"}          a smaller Llama (same vocabulary)
  {"method": "draft_model", "quantization": "int4"}         self-speculation: the target's own
                                                            weights at int4 draft for bf16

Greedy drafts are deterministic proposals (q one-hot), which rejection sampling takes as
they are (model/rejection.py).
"""
from __future__ import annotations

import dataclasses
import logging

from shepherd.config import ConfigError, EngineConfig, LoraConfig, SchedulerConfig, SpeculativeConfig
from shepherd.model.sampler import SamplingState
from shepherd.request import SamplingParams
from shepherd.scheduler.kv_pool import KVPool
from shepherd.step import NewRequest, ScheduledBatch, ScheduledSeq

log = logging.getLogger("shepherd")

GREEDY = SamplingParams(max_tokens=1 << 30, temperature=0.0, ignore_eos=True)


class _Draft:
    """What the drafter keeps of one request: its slots in the draft pool and how many of its
    committed tokens have their KV there."""
    __slots__ = ("slots", "fed", "synced", "announced")

    def __init__(self):
        self.slots: list[int] = []
        self.fed = 0
        self.synced = 0
        self.announced = False


class DraftModelDrafter:
    def __init__(self, spec: SpeculativeConfig, cfg: EngineConfig, target):
        cap = min(int(target.kv_capacity), 1 << 16)
        dcfg = dataclasses.replace(cfg, model=spec.model or cfg.model, quantization=spec.quantization or "none",
                                   max_total_tokens=cap, host_kv_tokens=0, scheduler=SchedulerConfig(),
                                   lora=LoraConfig())     # drafts come from the base model
        # an executor of the target's own class (the executor builds its drafter: no import back)
        self.model = type(target)(dcfg)
        if self.model.model_config.vocab_size != target.model_config.vocab_size:
            raise ConfigError(f"speculative draft model {spec.model!r} has a vocabulary of "
                              f"{self.model.model_config.vocab_size} tokens, the target {target.model_config.vocab_size}: "
                              "a draft model must share the target's tokenizer")
        self.pool = KVPool(cap, 1)
        self.reqs: dict[str, _Draft] = {}
        self.gone: list[str] = []
        log.info("draft model for speculative decoding: %s (weights %s), KV %d tokens",
                 self.model.model_name, self.model.quantization, cap)

    def forget(self, req_id: str) -> None:
        d = self.reqs.pop(req_id, None)
        if d is not None:
            self.pool.free(d.slots)
            if d.announced:
                self.gone.append(req_id)

    def propose(self, items: list[tuple[str, SamplingState, int, int]]) -> dict[str, list[int]]:
        live = []          # (req_id, draft state, committed tokens, k)
        for rid, st, last, k in items:
            ids = st.prompt_ids + st.output_ids + [last]
            d = self.reqs.get(rid)
            if d is None:
                d = self.reqs[rid] = _Draft()
            if d.fed > len(ids) - 1:
                d.fed = 0                 # never in practice: committed tokens only grow
            want = len(ids) + k - 1       # positions that need a slot: the committed ones and k - 1 drafts fed
            more = want - len(d.slots)
            if more > 0:
                got = self.pool.alloc(more)
                if got is None:           # the draft pool is full: this request goes without drafts
                    continue
                d.slots.extend(got)
            live.append((rid, d, ids, k))
        if not live:
            return {}
        out: dict[str, list[int]] = {rid: [] for rid, *_ in live}
        prompts = {rid: st.prompt_ids for rid, st, _, _ in items}
        new = [NewRequest(rid, prompts[rid], GREEDY) for rid, d, ids, _ in live if not d.announced]
        seqs = []
        for rid, d, ids, k in live:
            d.announced = True
            seqs.append(self._seq(rid, d, ids[d.fed:], d.fed))
            d.fed = len(ids)
        for j in range(max(k for *_, k in live)):
            res = self.model.execute(ScheduledBatch(step=j, new=new, seqs=seqs, finished=self.gone))
            new, self.gone = [], []
            seqs = []
            for rid, d, ids, k in live:
                if j < k and rid in res.tokens:
                    t = res.tokens[rid][-1]
                    out[rid].append(t)
                    if j + 1 < k:
                        seqs.append(self._seq(rid, d, [t], len(ids) + j))
            if not seqs:
                break
        return {rid: v for rid, v in out.items() if v}

    def _seq(self, rid: str, d: _Draft, tokens: list[int], start: int) -> ScheduledSeq:
        s = ScheduledSeq(rid, tokens, start, True, d.synced, d.slots[d.synced:])
        d.synced = len(d.slots)
        return s
