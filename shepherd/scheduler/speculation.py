"""Speculative decoding, the scheduler's half: which drafts run in a step, and their KV.

The executor drafts a request's next tokens after a step it sampled in
(StepResult.drafts, asked for by ScheduledSeq.propose); they wait on the
request's Entry, and its next decode step feeds as many as fit after its
last token (ScheduledSeq.num_draft):

  - none in a step with more requests decoding than disable_by_batch_size
    (above it a verify row costs more than the tokens it wins), and none
    under admission=peak (its estimate needs every request to grow one token
    a step, as it needs unmixed steps);
  - within max_num_tokens: every decode's own token first, the drafts share
    what is left, in batch order;
  - within the request's length limit (no draft past its last possible token);
  - from free KV only: a draft never preempts; like any allocation it may take
    back evictable prefix-cache pages, never another request's.

After the step a request keeps the KV of its last token and of the drafts the
executor accepted; the slots of the rejected ones are freed at once.
"""
from __future__ import annotations

from dataclasses import dataclass

from shepherd.config import SpeculativeConfig
from shepherd.scheduler.kv_manager import KVManager
from shepherd.scheduler.state import Entry, SchedulerStats
from shepherd.step import ScheduledSeq


@dataclass(eq=False)
class Speculation:
    cfg: SpeculativeConfig
    kv: KVManager
    stats: SchedulerStats
    lockstep: bool          # the admission mode assumes one token a step (peak): never speculate

    def on(self, decoding: int) -> bool:
        """Whether a step with `decoding` requests decoding verifies (and asks for) drafts."""
        return not self.lockstep and self.cfg.drafts_allowed(decoding)

    def plan(self, dec: list[Entry], budget: int) -> list[list[int]]:
        """The drafts each decoder feeds this step (their slots allocated); every decoder's
        drafts are used up either way (the next step brings new ones)."""
        out: list[list[int]] = [[] for _ in dec]
        room = budget - len(dec)
        if self.on(len(dec)):
            cap = self.cfg.num_speculative_tokens
            for i, e in enumerate(dec):
                d = e.drafts
                if d and room > 0:
                    k = min(len(d), cap, e.limit - len(e.req.output_ids) - 1, room)
                    if k > 0:
                        k = self.kv.grow_ahead(e, k)
                        out[i] = d[:k]
                        room -= k
        for e in dec:
            if e.drafts:
                e.drafts = []
        return out

    def ask(self, e: Entry, decoding: int) -> int:
        """How many drafts to ask the executor for after this step of e: none when no later
        step could feed one (e has at most one more token to go)."""
        if not self.on(decoding) or e.limit - len(e.req.output_ids) < 2:
            return 0
        return self.cfg.num_speculative_tokens

    def settle(self, e: Entry, seq: ScheduledSeq, accepted: int) -> None:
        """After a step that verified seq's drafts (`accepted` of them taken; e.req.num_computed
        already counts them): the counters, and the rejected drafts' slots freed."""
        st = self.stats
        st.spec_drafts += 1
        st.spec_draft_tokens += seq.num_draft
        st.spec_accepted_tokens += accepted
        self.kv.trim(e, e.req.num_computed)
