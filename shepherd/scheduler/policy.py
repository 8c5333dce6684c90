"""Queue orderings: which waiting request is considered for admission first.

fcfs        arrival order (preempted requests go back to the front)
lof         longest output first (largest max_tokens), SGLang
random      a seeded random key drawn once per request (no per-step RNG use)
lpm         longest prefix match against the radix cache first; plain fcfs
            when more than lpm_fcfs_threshold requests wait (SGLang)
dfs-weight  depth-first over the radix tree, heavier subtrees (more waiting
            requests below them) first (SGLang)
priority    higher Request.priority first, then arrival; under optimistic
            admission a higher-priority request also preempts lower ones
            (see Scheduler)
vtc         Virtual Token Counter (Sheng et al., OSDI'24): one counter per
            client (Request.client); admission charges w_in * prompt tokens,
            every generated token w_out; the client with the smallest counter
            is served first; a client that becomes backlogged again is lifted
            to the smallest counter among backlogged clients. The charge is
            made once per token (the finishing step is not charged twice).

Aging: under the policies that can starve a request (lof, random, lpm,
dfs-weight, priority), a request that has waited aging_steps scheduler steps
comes first (in arrival order), so nothing waits forever. fcfs is arrival
order already, and vtc does not age: its counters already serve every
backlogged client in turn, and under a long overload every request ages, so
aging would turn vtc into fcfs (measured in docs/SIMULATION.md, "VTC
reproduction"). Under every policy, an aged request that does not fit also
stops the look-ahead past it, so it is not overtaken forever by smaller ones.

Ordering is computed only when an admission is attempted, and fcfs never
sorts: the queue is a deque kept in order.
"""
from __future__ import annotations

import heapq
from collections import defaultdict
from typing import Iterable, Iterator, Optional


class Policy:
    name = "fcfs"
    needs_sort = False        # order() sorts the queue (non-fcfs)
    dynamic = False           # order can change while only decodes run (vtc)
    charges_tokens = False    # on_tokens does something
    ranked = False            # rank() matters: swap-in, step budget and victims follow it
    preempts = False          # a waiting request may preempt lower-ranked running ones
    ages = True               # order() puts requests waiting aging_steps first (see the module doc)

    def __init__(self, cfg, tree=None, admission=None):
        self.cfg = cfg
        self.tree = tree

    # hooks (no-ops by default)
    def on_add(self, e, waiting) -> None: ...
    def on_leave_queue(self, e, waiting) -> None: ...
    def on_admit(self, e, first: bool) -> None: ...
    def on_tokens(self, e, n: int) -> None: ...

    def order(self, waiting, step: int) -> Iterable:
        return waiting

    # preemption hooks (the priority policy overrides them)
    def rank(self, e) -> int:
        return 0

    def pick_swap_in(self, swapped, top_waiting: Optional[int]):
        """The swapped request to bring back next, or None to stop swapping in."""
        return swapped[0]

    def may_preempt_now(self, waiting, running) -> bool:
        """A waiting request outranks a running one and may preempt it."""
        return bool(self.preempts and waiting and running
                    and max(map(self.rank, waiting)) > min(map(self.rank, running)))

    def swap_floor(self, swapped) -> Optional[int]:
        """Waiting requests ranked above this may be admitted while requests are
        swapped out; None: swapped requests come back before anything new."""
        return None

    # helpers
    def _match(self, e):
        """The radix tree's match of e's known tokens but the last (the prefix its admission
        would reuse), from the entry's memo while the tree has not changed there (see
        RadixCache.match_memo; KVManager.candidate_need keeps the same memo)."""
        r = e.req
        e.prefix_memo = self.tree.match_memo(e.prefix_memo, r.num_tokens - 1, lambda: r.all_ids)[2]
        return e.prefix_memo

    def _aged_split(self, waiting, step: int):
        if not self.ages:
            return [], list(waiting)
        lim = self.cfg.aging_steps
        aged, rest = [], []
        for e in waiting:
            (aged if step - e.enq_step >= lim else rest).append(e)
        return aged, rest


class FCFS(Policy):
    name = "fcfs"


class _Sorted(Policy):
    needs_sort = True

    def key(self, e):
        raise NotImplementedError

    def order(self, waiting, step):
        aged, rest = self._aged_split(waiting, step)
        rest.sort(key=self.key)
        return aged + rest


class LOF(_Sorted):
    name = "lof"

    def key(self, e):
        return (-e.limit, e.seq)


class Random(_Sorted):
    name = "random"

    def key(self, e):
        return e.rand_key


class PriorityPolicy(_Sorted):
    """Higher Request.priority first. Under an admission mode that may preempt, a
    waiting request also preempts lower-priority running ones (see Scheduler)."""
    name = "priority"
    ranked = True

    def __init__(self, cfg, tree=None, admission=None):
        super().__init__(cfg, tree, admission)
        self.preempts = bool(admission is not None and admission.may_preempt)

    def key(self, e):
        return (-e.req.priority, e.seq)

    def rank(self, e) -> int:
        return e.req.priority

    def pick_swap_in(self, swapped, top_waiting):
        e = max(swapped, key=lambda x: (x.req.priority, -x.seq))
        if top_waiting is not None and e.req.priority < top_waiting:
            return None      # a higher-priority request waits: it goes first
        return e

    def swap_floor(self, swapped):
        return max(e.req.priority for e in swapped)


class LPM(_Sorted):
    name = "lpm"

    def order(self, waiting, step):
        if len(waiting) > self.cfg.lpm_fcfs_threshold or self.tree is None:
            return waiting
        return super().order(waiting, step)

    def key(self, e):
        return (-self._match(e).hit, e.seq)


class DFSWeight(Policy):
    name = "dfs-weight"
    needs_sort = True

    def order(self, waiting, step):
        aged, rest = self._aged_split(waiting, step)
        if self.tree is None or not rest:
            return aged + rest
        tree = self.tree
        at_node = defaultdict(list)
        weight = defaultdict(int)
        for e in rest:
            node = self._match(e).deepest
            at_node[node.id].append(e)
            while node is not None:
                weight[node.id] += 1
                node = node.parent
        out = list(aged)
        stack = [tree.root]
        while stack:
            nd = stack.pop()
            out.extend(sorted(at_node.get(nd.id, ()), key=lambda e: e.seq))
            kids = [c for c in nd.children.values() if weight.get(c.id)]
            kids.sort(key=lambda c: (weight[c.id], -c.id))   # push lightest first: heaviest popped first
            stack.extend(kids)
        return out


class VTC(Policy):
    name = "vtc"
    needs_sort = True
    dynamic = True
    charges_tokens = True
    ages = False

    def __init__(self, cfg, tree=None, admission=None):
        super().__init__(cfg, tree, admission)
        self.counter: dict[str, float] = defaultdict(float)
        self.backlog: dict[str, int] = defaultdict(int)   # waiting requests per client
        self.last_left = 0.0
        # whose counters: the client's, or the LoRA adapter's (S-LoRA's fairness over adapters;
        # the base model counts as one more adapter)
        self._by_adapter = cfg.vtc_unit == "adapter"

    def _unit(self, e) -> str:
        return (e.req.adapter or "") if self._by_adapter else e.req.client

    def on_add(self, e, waiting):
        c = self._unit(e)
        if self.backlog[c] == 0:
            backlogged = [self.counter[k] for k, n in self.backlog.items() if n > 0]
            lift = min(backlogged) if backlogged else self.last_left
            if self.counter[c] < lift:
                self.counter[c] = lift
        self.backlog[c] += 1

    def on_leave_queue(self, e, waiting):
        c = self._unit(e)
        self.backlog[c] -= 1
        if self.backlog[c] == 0:
            self.last_left = self.counter[c]

    def on_admit(self, e, first):
        if first:
            self.counter[self._unit(e)] += self.cfg.vtc_input_weight * len(e.req.prompt_ids)

    def on_tokens(self, e, n):
        self.counter[self._unit(e)] += self.cfg.vtc_output_weight * n

    def order(self, waiting, step) -> Iterator:
        aged, rest = self._aged_split(waiting, step)
        yield from aged
        if not rest:
            return
        per: dict[str, list] = defaultdict(list)
        for e in rest:
            per[self._unit(e)].append(e)
        tmp = {c: self.counter[c] for c in per}
        heap = [(tmp[c], min(x.seq for x in q[:1]), c) for c, q in per.items()]
        heapq.heapify(heap)
        idx = dict.fromkeys(per, 0)
        while heap:
            _, _, c = heapq.heappop(heap)
            q = per[c]
            e = q[idx[c]]
            idx[c] += 1
            yield e
            if idx[c] < len(q):
                # tentatively charge the prompt so one client does not take a whole round
                tmp[c] += self.cfg.vtc_input_weight * len(e.req.prompt_ids)
                heapq.heappush(heap, (tmp[c], q[idx[c]].seq, c))


POLICY_CLASSES = {
    "fcfs": FCFS, "lof": LOF, "random": Random, "lpm": LPM,
    "dfs-weight": DFSWeight, "priority": PriorityPolicy, "vtc": VTC,
}


def make_policy(cfg, tree=None, admission=None) -> Policy:
    return POLICY_CLASSES[cfg.policy](cfg, tree, admission)
