"""Token sampling: greedy, temperature, top-k, top-p, min-p, repetition /
frequency / presence penalties, per-request seeds, logprobs with top-N.

Order of processing (as vLLM): penalties -> temperature -> top-k -> top-p ->
min-p -> sample. Logprobs are those of the model's raw distribution
(log_softmax of the unprocessed logits), as vLLM returns by default.

Seeded requests draw from their own torch.Generator (keyed by req_id, seeded
from params.seed), so their samples do not depend on what else is in the
batch; unseeded requests share one global generator.

The sampler keeps its own record of each request (SamplingState: parameters,
prompt, the tokens so far), built from the step contract's NewRequest and
the tokens each step feeds; it never reads the scheduler's Request.

Grammar rows (model/grammar.py) take a bitmask per row. When the only constraints
in the batch are grammars and every row is greedy without logprobs, the bitmask is
applied inside the argmax kernel (kernels.argmax_masked_rows): the logits are neither
copied nor written, and the token is the one masking then argmax would give. Otherwise
a C kernel writes -inf into a constrained copy (apply_constraints), which logprobs and
the random rows read.

`verify` takes a request's logits after its last token and after each of its
drafts (speculative decoding) and keeps the drafts its distribution allows
(model/rejection.py); each row sees the penalties and min_tokens of the tokens
before it, as decoding one token at a time would.
"""
from __future__ import annotations

from typing import Optional, Sequence

import torch

from shepherd.model.constraints import apply_constraints, constrained
from shepherd.model.grammar import TokenMask
from shepherd.model.kernels import argmax_rows
from shepherd.model.rejection import greedy_accept, rejection_accept
from shepherd.request import SamplingParams, TokenLogprob, stop_ids
from shepherd.step import NewRequest

_NEG_INF = float("-inf")


def apply_penalties(logits: torch.Tensor, prompt_ids: Sequence[int], output_ids: Sequence[int],
                    p: SamplingParams) -> torch.Tensor:
    """One row [V]. repetition_penalty over prompt+output tokens (HF/vLLM rule:
    positive logits divided, negative multiplied); frequency/presence over output
    tokens (OpenAI: logit -= count*frequency + (count>0)*presence)."""
    V = logits.shape[-1]
    if p.repetition_penalty != 1.0:
        seen = list(prompt_ids) + list(output_ids)
        if seen:
            idx = torch.tensor(sorted(set(i for i in seen if 0 <= i < V)), dtype=torch.long)
            sel = logits.index_select(0, idx)
            sel = torch.where(sel > 0, sel / p.repetition_penalty, sel * p.repetition_penalty)
            logits = logits.index_copy(0, idx, sel)
    if (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0) and output_ids:
        out = torch.tensor([i for i in output_ids if 0 <= i < V], dtype=torch.long)
        counts = torch.bincount(out, minlength=V).to(logits.dtype)
        logits = logits - counts * p.frequency_penalty - (counts > 0).to(logits.dtype) * p.presence_penalty
    return logits


def filter_logits(logits: torch.Tensor, top_k: int = 0, top_p: float = 1.0, min_p: float = 0.0) -> torch.Tensor:
    """Mask (to -inf) the tokens top-k / top-p / min-p remove. logits: [V] or [S, V]
    (already divided by the temperature). Always keeps the most likely token."""
    V = logits.shape[-1]
    if top_k and 0 < top_k < V:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, _NEG_INF)
    if top_p < 1.0:
        sorted_logits, sorted_idx = torch.sort(logits, dim=-1, descending=True)
        probs = sorted_logits.softmax(-1)
        cum = probs.cumsum(-1)
        remove = (cum - probs) > top_p          # keep the token that crosses top_p
        remove[..., 0] = False
        mask = torch.zeros_like(remove).scatter(-1, sorted_idx, remove)
        logits = logits.masked_fill(mask, _NEG_INF)
    if min_p > 0.0:
        probs = logits.softmax(-1)
        thresh = probs.amax(-1, keepdim=True) * min_p
        logits = logits.masked_fill(probs < thresh, _NEG_INF)
    return logits


class SamplingState:
    """The sampler's record of one request: what it was asked for and the tokens so far."""
    __slots__ = ("req_id", "prompt_ids", "params", "eos_token_ids", "stop_ids", "output_ids")

    def __init__(self, new: NewRequest):
        self.req_id = new.req_id
        self.prompt_ids = new.prompt_ids
        self.params = new.params
        self.eos_token_ids = new.eos_token_ids
        self.stop_ids = stop_ids(new.params, new.eos_token_ids)    # min_tokens masks these
        self.output_ids: list[int] = []

    def feed(self, start_pos: int, token_ids: list[int]) -> None:
        """The request's tokens at positions start_pos..: those past the prompt are its output
        (a decode feeds the token sampled last step; a recompute feeds known ones again)."""
        i = start_pos - len(self.prompt_ids)
        if i == len(self.output_ids) and len(token_ids) == 1:
            self.output_ids.append(token_ids[0])      # the plain decode, every step
        elif i + len(token_ids) > 0:
            skip = max(0, -i)
            self.output_ids[i + skip: i + len(token_ids)] = token_ids[skip:]


class Sampler:
    def __init__(self, seed: Optional[int] = None):
        self.global_gen = torch.Generator()
        if seed is not None:
            self.global_gen.manual_seed(seed)
        else:
            self.global_gen.seed()
        self.generators: dict[str, torch.Generator] = {}
        self.states: dict[str, SamplingState] = {}
        self.grammar = None   # a GrammarMasks (model/grammar.py), set by the executor that has the tokenizer

    def add(self, new: NewRequest) -> SamplingState:
        st = self.states[new.req_id] = SamplingState(new)
        return st

    def forget(self, req_id: str) -> None:
        self.states.pop(req_id, None)
        self.generators.pop(req_id, None)
        if self.grammar is not None:
            self.grammar.forget(req_id)

    def generator_for(self, req: SamplingState) -> torch.Generator:
        if req.params.seed is None:
            return self.global_gen
        g = self.generators.get(req.req_id)
        if g is None:
            g = torch.Generator()
            g.manual_seed(int(req.params.seed) & 0xFFFF_FFFF_FFFF_FFFF)
            self.generators[req.req_id] = g
        return g

    def sample(self, logits: torch.Tensor, reqs: Sequence[SamplingState], mask: Optional[TokenMask] = None,
               ) -> tuple[list[int], list[Optional[TokenLogprob]]]:
        """logits: [S, V] float32, one row per request in `reqs`. Returns the sampled
        token per row and, for requests with params.logprobs set, a TokenLogprob. `mask`: the
        grammar masks of these reqs if they were filled already (GrammarMasks.fill); else they
        are filled here."""
        S = logits.shape[0]
        params = [r.params for r in reqs]
        simple = all(p.temperature == 0.0 and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
                     and p.presence_penalty == 0.0 for p in params)
        fused = None
        if constrained(reqs):   # logit_bias, min_tokens, grammar masks; logprobs see them too
            if mask is None and self.grammar is not None:
                mask = self.grammar.fill(reqs, logits.shape[-1])
            if simple and not any(p.logit_bias or p.min_tokens or p.logprobs is not None for p in params):
                fused = mask        # only grammars, greedy: the bitmask goes into the argmax, no masked copy
            else:
                logits = apply_constraints(logits, reqs, None, mask)
        if simple:
            tokens = argmax_rows(logits).tolist() if fused is None else fused.argmax(logits)
        else:
            logits = logits.cpu()   # the per-request generators and penalties live on the host
            tokens = [0] * S
            greedy_rows, random_rows = [], []
            rows = []
            for i, (r, p) in enumerate(zip(reqs, params)):
                row = logits[i]
                if p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0:
                    row = apply_penalties(row, r.prompt_ids, r.output_ids, p)
                rows.append(row)
                (greedy_rows if p.temperature == 0.0 else random_rows).append(i)
            if greedy_rows:
                g = argmax_rows(torch.stack([rows[i] for i in greedy_rows])).tolist()
                for i, t in zip(greedy_rows, g):
                    tokens[i] = t
            for i in random_rows:
                p = params[i]
                row = rows[i] / max(p.temperature, 1e-5)
                row = filter_logits(row, p.top_k, p.top_p, p.min_p)
                probs = row.softmax(-1)
                q = torch.empty_like(probs).exponential_(1.0, generator=self.generator_for(reqs[i]))
                tokens[i] = int((probs / q).argmax())
        lps: list[Optional[TokenLogprob]] = [None] * S
        want = [i for i, p in enumerate(params) if p.logprobs is not None]
        if want:
            idx = torch.tensor(want, dtype=torch.long, device=logits.device)
            lp = torch.log_softmax(logits.index_select(0, idx), -1)
            n_top = max(int(params[i].logprobs or 0) for i in want)
            top_v, top_i = (torch.topk(lp, n_top, dim=-1) if n_top > 0 else (None, None))
            for j, i in enumerate(want):
                t = tokens[i]
                n = int(params[i].logprobs or 0)
                top = []
                if n > 0:
                    top = list(zip(top_i[j, :n].tolist(), top_v[j, :n].tolist()))
                lps[i] = TokenLogprob(token_id=t, logprob=float(lp[j, t]), top=top)
        return tokens, lps

    def verify(self, logits: torch.Tensor, reqs: Sequence[SamplingState], drafts: Sequence[list[int]],
               rows: Sequence[int]) -> tuple[list[list[int]], list[list[TokenLogprob]]]:
        """Speculative decoding: request i's logits after its last token and after each of its
        drafts are rows rows[i] .. rows[i] + len(drafts[i]) of logits [R, V] float32 (the fed
        tokens, drafts included, already in its output_ids). Returns per request the tokens
        kept (the accepted drafts and the token after them) and, if it asked, their logprobs;
        its output_ids drop the rejected drafts. Requests with a grammar are never given drafts."""
        out_toks: list[list[int]] = []
        out_lps: list[list[TokenLogprob]] = []
        plain = [r.params.temperature == 0.0 and not _penalised(r.params) and not _biased(r, len(d))
                 for r, d in zip(reqs, drafts)]
        targets = argmax_rows(logits).tolist() if any(plain) else None
        for r, d, r0, easy in zip(reqs, drafts, rows, plain):
            k = len(d)
            p = r.params
            base = len(r.output_ids) - k        # output tokens before row 0's sample
            block = logits[r0: r0 + k + 1]
            if easy:
                toks = greedy_accept(targets[r0: r0 + k + 1], d)
            else:
                block = block.cpu().clone()
                probs = []
                for j in range(k + 1):
                    row = _bias_row(block[j], r, base + j)
                    block[j] = row
                    if _penalised(p):
                        row = apply_penalties(row, r.prompt_ids, r.output_ids[: base + j], p)
                    if p.temperature == 0.0:
                        probs.append(row)
                    else:
                        row = filter_logits(row / max(p.temperature, 1e-5), p.top_k, p.top_p, p.min_p)
                        probs.append(row.softmax(-1))
                probs = torch.stack(probs)
                if p.temperature == 0.0:
                    toks = greedy_accept(argmax_rows(probs).tolist(), d)
                else:
                    toks = rejection_accept(probs, d, self.generator_for(r))
            del r.output_ids[base + len(toks) - 1:]
            lps: list[TokenLogprob] = []
            if p.logprobs is not None:
                lp = torch.log_softmax(block[: len(toks)].float(), -1)
                n = int(p.logprobs or 0)
                for j, t in enumerate(toks):
                    top = []
                    if n > 0:
                        v, i = torch.topk(lp[j], n)
                        top = list(zip(i.tolist(), v.tolist()))
                    lps.append(TokenLogprob(token_id=t, logprob=float(lp[j, t]), top=top))
            out_toks.append(toks)
            out_lps.append(lps)
        return out_toks, out_lps


def _penalised(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or p.frequency_penalty != 0.0 or p.presence_penalty != 0.0


def _biased(r: SamplingState, k: int) -> bool:
    """Whether any of a verify's k + 1 rows has a logit_bias or a min_tokens mask."""
    p = r.params
    return bool(p.logit_bias) or bool(p.min_tokens and r.stop_ids and len(r.output_ids) - k < p.min_tokens)


def _bias_row(row: torch.Tensor, r: SamplingState, n_out: int) -> torch.Tensor:
    """logit_bias, and min_tokens' mask of the stop tokens while fewer than min_tokens are out,
    for a row sampled after n_out output tokens (apply_constraints' rules, one row)."""
    p = r.params
    V = row.shape[-1]
    if p.logit_bias:
        ids = [t for t in p.logit_bias if 0 <= t < V]
        if ids:
            row = row.clone()
            row[ids] += torch.tensor([float(p.logit_bias[t]) for t in ids], dtype=row.dtype)
    if p.min_tokens and n_out < p.min_tokens:
        ids = [t for t in r.stop_ids if 0 <= t < V]
        if ids:
            row = row.clone()
            row[ids] = float("-inf")
    return row
