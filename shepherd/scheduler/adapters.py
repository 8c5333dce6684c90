"""LoRA adapters in the scheduler: which are resident in the executor's adapter slots, and whose
waiting requests may be admitted now.

    ad = Adapters(cfg)              # max_loras slots, adapter_policy fit | rotate, adapter_cycle_time
    ad.begin(now)                   # each schedule(): rotate's active set moves on
    ad.admissible(name)             # may a waiting request of this adapter be admitted now
    ad.flush() -> [LoraLoad]        # the slot changes since the last batch that ran (batch.lora_loads)

Residency (both policies): an adapter is resident while a running request uses it, and at most
max_loras are, so at most max_loras distinct adapters run in a step. A request whose adapter is
not resident gets a slot when it is admitted (or swapped in): a free one, else the one whose
adapter has been idle longest (LRU). The base model (adapter None) needs no slot.

    fit     (vLLM) a waiting request whose adapter cannot get a slot is passed over; an aged one
            (aging_steps) stops admission instead, so the slots drain until it gets one: no
            adapter waits for ever behind busier ones.
    rotate  (LoRAX) an active set of at most max_loras adapters; only their requests are
            admitted. Adapters with waiting requests queue for the set in the order they started
            waiting. An active adapter that has held its place for adapter_cycle_time seconds
            while others queue admits nothing more; once its running requests are done it leaves
            (to the back of the queue if requests of it still wait) and the next one comes in.
            An adapter with nothing waiting or running leaves at once.

Queues calls the on_* hooks for every move (Queues owns where requests are); this class only
counts, and never touches a request. Pure logic: `now` is handed in.
"""
from __future__ import annotations

from collections import Counter
from typing import Optional

from shepherd.config import SchedulerConfig
from shepherd.step import LoraLoad


class Adapters:
    def __init__(self, cfg: SchedulerConfig):
        self.max_loras = cfg.max_loras
        self.rotate = cfg.adapter_policy == "rotate"
        self.cycle = float(cfg.adapter_cycle_time)
        self.aging_steps = cfg.aging_steps
        self.slots: list[Optional[str]] = [None] * cfg.max_loras
        self._told: list[Optional[str]] = [None] * cfg.max_loras   # as the executor last heard
        self.slot_of: dict[str, int] = {}
        self.users: Counter = Counter()        # running requests per adapter
        self.waiting: Counter = Counter()      # waiting requests per adapter
        self.present: Counter = Counter()      # requests in the system per adapter (any queue)
        self._idle_since: dict[str, int] = {}  # resident, unused: since which tick (LRU)
        self._tick = 0
        self.loads = 0                         # LoraLoads emitted
        # rotate: the active set (adapter -> when it came in), the queue for it, who must leave
        self.active: dict[str, float] = {}
        self.queue: dict[str, None] = {}       # insertion-ordered set
        self.expiring: set[str] = set()

    # ------------------------------------------------------------------ hooks (Queues)
    def on_add(self, name: Optional[str]) -> None:
        if name is not None:
            self.present[name] += 1

    def on_end(self, name: Optional[str]) -> None:
        if name is not None:
            self.present[name] -= 1
            if not self.present[name]:
                del self.present[name]

    def on_wait(self, name: Optional[str]) -> None:
        """A request of `name` joined the waiting queue."""
        if name is None:
            return
        self.waiting[name] += 1
        if self.rotate and name not in self.active:
            self.queue.setdefault(name, None)

    def on_unwait(self, name: Optional[str]) -> None:
        """A request of `name` left the waiting queue (admitted, or ended while waiting)."""
        if name is None:
            return
        self.waiting[name] -= 1
        if not self.waiting[name]:
            del self.waiting[name]
            self.queue.pop(name, None)

    def on_run(self, name: Optional[str]) -> None:
        """A request of `name` became running: its adapter must be resident from this step on."""
        if name is None:
            return
        self._tick += 1
        if name not in self.slot_of:
            slot = self._free_slot()
            if slot is None:
                raise RuntimeError(f"adapter {name!r}: no adapter slot (admissible() was not asked)")
            old = self.slots[slot]
            if old is not None:
                del self.slot_of[old]
                self._idle_since.pop(old, None)
            self.slots[slot] = name
            self.slot_of[name] = slot
        self.users[name] += 1
        self._idle_since.pop(name, None)

    def on_stop(self, name: Optional[str]) -> None:
        """A running request of `name` stopped running (ended, preempted, swapped out)."""
        if name is None:
            return
        self._tick += 1
        self.users[name] -= 1
        if not self.users[name]:
            del self.users[name]
            self._idle_since[name] = self._tick

    # ------------------------------------------------------------------ decisions
    def _free_slot(self) -> Optional[int]:
        """A slot with no adapter, else the one whose adapter has been idle longest."""
        for i, n in enumerate(self.slots):
            if n is None:
                return i
        if not self._idle_since:
            return None
        lru = min(self._idle_since, key=self._idle_since.__getitem__)
        return self.slot_of[lru]

    def can_run(self, name: Optional[str]) -> bool:
        """The adapter is resident or can become resident now."""
        return name is None or name in self.slot_of or None in self.slots or bool(self._idle_since)

    def admissible(self, name: Optional[str]) -> bool:
        """A waiting request of `name` may be admitted now (its slot permitting)."""
        if name is None:
            return True
        if self.rotate and (name not in self.active or name in self.expiring):
            return False
        return self.can_run(name)

    def examined(self, name: Optional[str], waited_steps: int) -> bool:
        """Whether an admission attempt looks at a waiting request at all: if it is admissible,
        and under fit also if it has aged (then, blocked, it stops the attempt: adapters.py doc)."""
        return self.admissible(name) or (not self.rotate and waited_steps >= self.aging_steps)

    def filters(self) -> bool:
        """Some waiting request may be not admissible now: admission orders pass through admissible()."""
        return bool(self.waiting)

    def begin(self, now: float) -> None:
        """The start of a schedule(): rotate's active set moves on (fit: nothing to do)."""
        if not self.rotate:
            return
        act = self.active
        for name in [n for n in act if not self.users[n] and (not self.waiting[n] or n in self.expiring)]:
            del act[name]                    # idle, or expired and drained: leaves the set
            self.expiring.discard(name)
            if self.waiting[name]:
                self.queue.setdefault(name, None)
        if self.queue:
            for name, since in act.items():
                if now - since >= self.cycle:
                    self.expiring.add(name)
        while self.queue and len(act) < self.max_loras:
            name = next(iter(self.queue))
            del self.queue[name]
            act[name] = now

    def flush(self) -> list[LoraLoad]:
        """The loads that make the executor's slots what the scheduler holds (a batch that runs)."""
        out = []
        for i, (n, t) in enumerate(zip(self.slots, self._told)):
            if n is not None and n != t:
                out.append(LoraLoad(i, n))
        self._told = list(self.slots)
        self.loads += len(out)
        return out

    def drop(self, name: str) -> bool:
        """Forget an adapter (it is being unloaded): False, changing nothing, while requests of it
        are in the system (the caller refuses the unload)."""
        if self.present[name]:
            return False
        slot = self.slot_of.pop(name, None)
        if slot is not None:
            self.slots[slot] = None
            self._told[slot] = None          # the executor clears its slot itself
        self._idle_since.pop(name, None)
        self.active.pop(name, None)
        self.queue.pop(name, None)
        self.expiring.discard(name)
        return True

    # ------------------------------------------------------------------ views
    def running_names(self) -> list[str]:
        return sorted(self.users)

    def waiting_names(self) -> list[str]:
        return sorted(self.waiting)

    def in_use(self, name: str) -> bool:
        """Requests of this adapter are in the system (waiting, running or swapped out)."""
        return bool(self.present[name])
