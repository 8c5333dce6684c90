"""A simulated Executor: deterministic tokens, modelled step time, no model.

    ex = SimExecutor(kv_capacity=4096, host_kv_capacity=0, max_model_len=8192,
                     output_lens={"r1": 37}, step_time=my_cost_fn, check=False)
    result = ex.execute(batch)          # StepResult(tokens=..., step_time=...)

Output length (the "target"): a request stops with EOS after exactly
`target` output tokens, where target comes from the `output_lens` dict given
at construction (req_id -> tokens), or `ex.set_output_len(req_id, n)` later;
without one the executor never emits EOS and the request runs to
params.max_tokens (FinishReason.LENGTH). With params.ignore_eos the executor
never emits EOS either. A token is never EOS (or one of
params.stop_token_ids) except that last one.

Tokens are a deterministic function of the previous token and the position
(so two requests with the same prompt generate the same text, like a greedy
model, and a preempted or chunked request regenerates the same tokens).

Like any executor it keeps its own record of each request (SimSeq), built
from the step contract's NewRequest and the tokens each step feeds.

Speculation: a seq with drafts (num_draft) is verified as a greedy model
would, against the tokens above: the tokens up to and including the first that
differs from its draft come back. Asked to propose (seq.propose), the executor
drafts the true next tokens for as long as a deterministic draw per position
says they are accepted (each with `acceptance_rate`, given the ones before it;
the draw is a hash of the request id and the position, so a run repeats), then
one wrong token: the acceptance rate of a real drafter, without a model. The
step time counts the draft rows as tokens (the cost model's verify cost).

Step time: `step_time(batch) -> seconds`, pluggable (the simulator passes
sim/cost_model.py's); the default is affine:
    base + per_token * tokens computed + per_ctx * sum of context lengths
plus, always, swap ops at `swap_time_per_token` per token moved, and each LoRA adapter the
scheduler loads into an adapter slot (batch.lora_loads) at `lora_load_time` seconds: the
host -> pool copy, measured by the engine (shepherd:lora_load_seconds; sim/cost_model.py's
LORA_LOAD_S is this machine's figure). The per-step adapter limit (--max-loras) is the
scheduler's own (scheduler/adapters.py), the same in the simulator as in the engine.

check=True turns the executor into a referee for tests: it keeps a shadow KV
pool (token id, position) per slot and asserts that every position a sequence
attends over holds the right token, that the tokens fed are the prompt and the
tokens it sampled, that no two sequences write one slot in a step, that
swap-in restores exactly what swap-out saved, and that slots are in range.
"""
from __future__ import annotations

import zlib
from typing import Callable, Optional

from shepherd.step import NewRequest, PlainExecutor, ScheduledBatch, ScheduledSeq, StepResult


def affine_step_time(base: float = 0.005, per_token: float = 5e-5, per_ctx: float = 5e-8,
                     per_seq: float = 0.0) -> Callable[[ScheduledBatch], float]:
    def f(batch: ScheduledBatch) -> float:
        if not batch.seqs:
            return 0.0
        toks = 0
        ctx = 0
        for s in batch.seqs:
            n = len(s.token_ids)
            toks += n
            ctx += s.start_pos + n
        return base + per_token * toks + per_ctx * ctx + per_seq * len(batch.seqs)
    return f


class SimSeq:
    """The simulated executor's record of one request; `ids` (prompt + tokens sampled) and
    `slots` (its slot table) only in check mode."""
    __slots__ = ("req_id", "prompt_len", "prompt_last", "stop_token_ids", "ignore_eos", "ids", "slots")

    def __init__(self, new: NewRequest, check: bool):
        self.req_id = new.req_id
        self.prompt_len = len(new.prompt_ids)
        self.prompt_last = new.prompt_ids[-1]
        self.stop_token_ids = new.params.stop_token_ids
        self.ignore_eos = new.params.ignore_eos
        self.ids: list[int] = list(new.prompt_ids) if check else []
        self.slots: list[int] = []


class SimExecutor(PlainExecutor):
    # PlainExecutor: grammars are not enforced (every one is ready) and the server cannot load
    # adapters into it; the simulator's replicas still schedule adapters (batch.lora_loads)
    def __init__(self, kv_capacity: int = 65536, host_kv_capacity: int = 0, max_model_len: int = 8192,
                 eos_token_id: int = 2, output_lens: Optional[dict[str, int]] = None,
                 step_time: Optional[Callable[[ScheduledBatch], float]] = None,
                 swap_time_per_token: float = 1e-6, vocab_size: int = 49152, check: bool = False,
                 eos_token_ids: tuple[int, ...] = (), tokenizer=None, model_name: Optional[str] = None,
                 paced: bool = False, acceptance_rate: float = 0.0, lora_load_time: float = 0.0):
        self.kv_capacity = kv_capacity
        self.host_kv_capacity = host_kv_capacity
        self.max_model_len = max_model_len
        self.eos_token_ids = tuple(eos_token_ids) or (eos_token_id,)
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.paced = paced    # True: the engine waits out the modelled step time on the wall clock
        self.eos_token_id = eos_token_id
        self.output_lens: dict[str, int] = dict(output_lens or {})
        self.step_time = step_time or affine_step_time()
        self.swap_time_per_token = swap_time_per_token
        self.vocab_size = vocab_size
        self.check = check
        self.acceptance_rate = acceptance_rate
        self.lora_load_time = lora_load_time
        self.slots: dict[int, str] = {}       # adapter slot -> the adapter in it (from batch.lora_loads)
        self.seqs: dict[str, SimSeq] = {}
        # counters
        self.steps = 0
        self.tokens_computed = 0
        self.prefill_tokens = 0
        self.decode_tokens = 0
        self.swapped_out_tokens = 0
        self.swapped_in_tokens = 0
        self.busy_time = 0.0
        self.lora_loads = 0
        self.lora_load_s = 0.0
        self._load_times: list[float] = []
        self.tokens_by_req: dict[str, int] = {}   # tokens computed per request (prefix-cache tests)
        # referee state
        self._kv: dict[int, tuple[int, int]] = {}
        self._host: dict[str, list[tuple[int, int]]] = {}

    def set_output_len(self, req_id: str, n: int) -> None:
        self.output_lens[req_id] = n

    def target_len(self, st: SimSeq) -> Optional[int]:
        return None if st.ignore_eos else self.output_lens.get(st.req_id)

    def next_token(self, st: SimSeq, n_out: int, prev: int) -> int:
        """The token sampled after n_out output tokens, the last known token being `prev`
        (deterministic; never EOS or a stop id unless the target is reached)."""
        t = self.target_len(st)
        if t is not None and n_out + 1 >= t:
            return self.eos_token_id
        pos = st.prompt_len + n_out
        tok = 3 + (prev * 1000003 + pos * 7919 + 12345) % (self.vocab_size - 3)
        bad = st.stop_token_ids
        eos = self.eos_token_ids
        while tok in eos or tok == self.eos_token_id or (bad and tok in bad):
            tok = 3 + (tok - 3 + 1) % (self.vocab_size - 3)
        return tok

    def execute(self, batch: ScheduledBatch) -> StepResult:
        self.steps += 1
        seqs = self.seqs
        for rid in batch.finished:       # first: their host copies make room for this step's swaps
            seqs.pop(rid, None)
            self._host.pop(rid, None)
        for new in batch.new:
            seqs[new.req_id] = SimSeq(new, self.check)
        moved = 0
        for op in batch.swap_out:
            moved += len(op.slots)
            self.swapped_out_tokens += len(op.slots)
            if self.check:
                self._host[op.req_id] = [self._kv.get(s, (-1, -1)) for s in op.slots]
        for op in batch.swap_in:
            moved += len(op.slots)
            self.swapped_in_tokens += len(op.slots)
            if self.check:
                saved = self._host.pop(op.req_id, None)
                assert saved is not None, f"swap_in of {op.req_id} without a swap_out"
                assert len(saved) == len(op.slots), (op.req_id, len(saved), len(op.slots))
                for s, v in zip(op.slots, saved):
                    self._kv[s] = v
        for ld in batch.lora_loads:
            self.slots[ld.slot] = ld.name
        load = len(batch.lora_loads) * self.lora_load_time
        self.lora_loads += len(batch.lora_loads)
        self.lora_load_s += load
        self._load_times += [self.lora_load_time] * len(batch.lora_loads)
        tokens: dict[str, list[int]] = {}
        drafts: dict[str, list[int]] = {}
        if self.check:
            self._referee(batch)
        for s in batch.seqs:
            n = len(s.token_ids)
            self.tokens_computed += n
            self.tokens_by_req[s.req_id] = self.tokens_by_req.get(s.req_id, 0) + n
            if s.is_prefill:
                self.prefill_tokens += n
            else:
                self.decode_tokens += n
            if s.sample:
                st = seqs[s.req_id]
                n_out = s.start_pos + n - s.num_draft - st.prompt_len   # output tokens before this sample
                if s.num_draft:
                    toks = self.verify(st, n_out, s.token_ids)
                else:
                    toks = [self.next_token(st, n_out, s.token_ids[-1])]
                tokens[s.req_id] = toks
                if s.propose:
                    drafts[s.req_id] = self.draft(st, n_out + len(toks), toks[-1], s.propose)
                if self.check:
                    st.ids.extend(toks)
        t = self.step_time(batch) + moved * self.swap_time_per_token + load
        self.busy_time += t
        return StepResult(tokens=tokens, step_time=t, drafts=drafts)

    def take_lora_loads(self) -> list[float]:
        """The modelled seconds of each adapter load since the last call (as TorchExecutor's)."""
        out, self._load_times = self._load_times, []
        return out

    def verify(self, st: SimSeq, n_out: int, fed: list[int]) -> list[int]:
        """Greedy verification of fed = [last token, drafts...]: the tokens sampled after each,
        up to and including the first that is not the next draft."""
        out: list[int] = []
        prev = fed[0]
        for j in range(len(fed)):
            t = self.next_token(st, n_out + j, prev)
            out.append(t)
            if j + 1 >= len(fed) or t != fed[j + 1]:
                break
            prev = t
        return out

    def draft(self, st: SimSeq, n_out: int, prev: int, k: int) -> list[int]:
        """Up to k drafts after output token n_out - 1 (= prev): the true tokens while each
        position's draw accepts, then one wrong token."""
        out: list[int] = []
        seed = zlib.crc32(st.req_id.encode())
        for j in range(k):
            t = self.next_token(st, n_out + j, prev)
            u = (zlib.crc32((n_out + j).to_bytes(8, "little"), seed) & 0xFFFFFF) / float(1 << 24)
            if u >= self.acceptance_rate:
                out.append(3 + (t - 3 + 1) % (self.vocab_size - 3))    # not the model's token
                break
            out.append(t)
            if t == self.eos_token_id:
                break
            prev = t
        return out

    def _referee(self, batch: ScheduledBatch) -> None:
        written: dict[int, str] = {}
        for s in batch.seqs:
            st = self.seqs.get(s.req_id)
            assert st is not None, f"{s.req_id}: scheduled but never announced"
            assert s.slots_from <= len(st.slots), f"{s.req_id}: slots from {s.slots_from} of {len(st.slots)}"
            st.slots[s.slots_from:] = s.new_slots
            self._check_seq(s, st, written)
        for s in batch.seqs:
            st = self.seqs[s.req_id]
            for i in range(s.start_pos, s.start_pos + len(s.token_ids)):
                self._kv[st.slots[i]] = (s.token_ids[i - s.start_pos], i)

    def _check_seq(self, s: ScheduledSeq, st: SimSeq, written: dict[int, str]) -> None:
        ids, slots = st.ids, st.slots
        end = s.start_pos + len(s.token_ids)
        known = end - s.num_draft               # drafts are guesses past the known tokens
        assert end <= len(slots), f"{s.req_id}: positions up to {end} but {len(slots)} slots"
        assert s.token_ids[:len(s.token_ids) - s.num_draft] == ids[s.start_pos:known], f"{s.req_id}: wrong token ids"
        assert s.sample == (known == len(ids)), f"{s.req_id}: sample flag"
        assert not s.num_draft or s.sample, f"{s.req_id}: drafts without a sample"
        for i in range(s.start_pos):
            got = self._kv.get(slots[i])
            assert got == (ids[i], i), (
                f"{s.req_id}: position {i} slot {slots[i]} holds {got}, expected {(ids[i], i)}")
        for i in range(s.start_pos, end):
            slot = slots[i]
            assert 0 <= slot < self.kv_capacity, f"slot {slot} out of range"
            assert slot not in written, f"slot {slot} written by {written[slot]} and {s.req_id}"
            written[slot] = s.req_id
