"""Where the CPU goes while a benchmark runs: per process, from /proc, sampled by a thread.

Used by `benchmarks/stall_attacks.py --profile`. Every `period` seconds the
sampler reads, for each watched process and its descendants (an engine core,
a grammar checker), the CPU time it used (user + system, /proc/PID/stat), the
bytes it read and wrote through system calls (/proc/PID/io rchar/wchar:
socket reads count, so a server that reads a refused body shows it), and for
the processes named `engine*` the run and run-queue wait of each of its
threads (/proc/PID/task/*/schedstat: how long the OpenMP team ran, how long
it waited for a CPU, and how many of its threads were busy).
"""
from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field

from _openai_client import descendants, task_files

TICK = os.sysconf("SC_CLK_TCK")


def cpu_io(pid: int) -> tuple[float, int, int]:
    """(CPU seconds, bytes read, bytes written) of a process so far; zeros once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / TICK
        with open(f"/proc/{pid}/io") as f:
            io = dict(line.split(": ") for line in f.read().splitlines())
        return cpu, int(io["rchar"]), int(io["wchar"])
    except (OSError, ValueError, KeyError, IndexError):
        return 0.0, 0, 0


def thread_sched(pid: int) -> dict[int, tuple[int, int]]:
    """tid -> (ns run, ns waited on a run queue)."""
    return {tid: (int(t.split()[0]), int(t.split()[1])) for tid, t in task_files(pid, "schedstat").items()}


@dataclass
class Sample:
    t: float
    procs: dict          # label -> (cpu s, rchar, wchar)
    engines: dict        # label -> {tid: (run ns, wait ns)}


@dataclass
class ProcSampler:
    """Watch `roots` (label -> pid) and what they start (not for the labels in `flat`);
    `label_of(pid)` names a descendant (None: counted into its root's label)."""
    roots: dict
    label_of: object = None
    flat: frozenset = frozenset()
    period: float = 0.02
    samples: list = field(default_factory=list)

    def __post_init__(self):
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._names: dict[int, str] = {}

    def start(self) -> "ProcSampler":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def _label(self, root: str, pid: int) -> str:
        if pid not in self._names:
            name = self.label_of(pid) if self.label_of else None
            self._names[pid] = f"{root}/{name}" if name else root
        return self._names[pid]

    def _run(self) -> None:
        while not self._stop.is_set():
            self.samples.append(self.sample())
            self._stop.wait(self.period)

    def sample(self) -> Sample:
        procs: dict = {}
        engines: dict = {}
        for root, pid in self.roots.items():
            for p in [pid] + ([] if root in self.flat else descendants(pid)):
                label = self._label(root, p)
                c, r, w = cpu_io(p)
                pc, pr, pw = procs.get(label, (0.0, 0, 0))
                procs[label] = (pc + c, pr + r, pw + w)
                if label.endswith("engine"):
                    engines[label] = thread_sched(p)
        return Sample(time.perf_counter(), procs, engines)


def between(samples: list, t0: float, t1: float) -> tuple:
    """(the last sample at or before t0, the first at or after t1), or the closest there are."""
    a = max((s for s in samples if s.t <= t0), key=lambda s: s.t, default=samples[0])
    b = min((s for s in samples if s.t >= t1), key=lambda s: s.t, default=samples[-1])
    return a, b


def usage(a: Sample, b: Sample) -> dict:
    """label -> (CPU s, MB read, MB written) from sample a to b."""
    out = {}
    for label, (c, r, w) in b.procs.items():
        c0, r0, w0 = a.procs.get(label, (0.0, 0, 0))
        out[label] = (c - c0, (r - r0) / 1e6, (w - w0) / 1e6)
    return out


def engine_usage(a: Sample, b: Sample, busy: float = 0.3) -> dict:
    """label -> (s run, s waited for a CPU, threads busy more than `busy` of the time) from a to b."""
    out = {}
    span = max(b.t - a.t, 1e-9)
    for label, threads in b.engines.items():
        before = a.engines.get(label, {})
        run = wait = 0
        n_busy = 0
        for tid, (r, w) in threads.items():
            r0, w0 = before.get(tid, (r, w))
            run, wait = run + r - r0, wait + w - w0
            n_busy += (r - r0) / 1e9 > busy * span
        out[label] = (run / 1e9, wait / 1e9, n_busy)
    return out
