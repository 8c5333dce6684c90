"""Batch invariance (docs/DESIGN.md, "Contracts worth keeping"): in batch-invariant mode, a
request's greedy tokens do not depend on the other requests in its steps or on how its
prompt was chunked. Driven by a tiny synchronous loop of its own (no scheduler)
so that the batch shapes are controlled exactly: staggered arrivals make
prefill chunks and decodes of other requests share forwards, and KV slots are
scattered over the pool."""
import os
import random

import pytest
import torch

from shepherd.config import EngineConfig
from hand_batches import announced, batch, seq
from shepherd.request import Request, RequestState, SamplingParams
from shepherd.step import ScheduledBatch, SwapOp

pytestmark = pytest.mark.model

NEW = 16
N_REQ = 16
CAPACITY = 8192


class Loop:
    def __init__(self, ex, seed=0):
        self.ex = ex
        self.free = list(range(CAPACITY))
        random.Random(seed).shuffle(self.free)      # non-contiguous slots
        self.step = 0
        self.n = 0

    def run(self, prompts, arrive=None, chunk=None, new=NEW, prefix_from=None):
        """Serve `prompts` (arrival step per prompt in `arrive`); a prompt's prefill is
        split into `chunk`-token pieces. Returns the greedy tokens per prompt."""
        arrive = arrive or [0] * len(prompts)
        reqs = []
        for p in prompts:
            r = Request(req_id=f"q{self.n}", prompt_ids=list(p), params=SamplingParams(max_tokens=new, temperature=0.0))
            self.n += 1
            reqs.append(r)
        done = {r.req_id: 0 for r in reqs}
        t = 0
        while any(len(r.output_ids) < new for r in reqs):
            seqs = []
            for r, a in zip(reqs, arrive):
                if a > t or len(r.output_ids) >= new:
                    continue
                if not r.slots:
                    r.slots = [self.free.pop() for _ in range(len(r.prompt_ids) + new)]
                    r.state = RequestState.RUNNING
                st = done[r.req_id]
                if st < len(r.prompt_ids):
                    k = len(r.prompt_ids) - st if chunk is None else min(chunk, len(r.prompt_ids) - st)
                    seqs.append(seq(r, r.prompt_ids[st:st + k], st, sample=st + k == len(r.prompt_ids),
                                    fresh=st == 0))
                    done[r.req_id] = st + k
                else:
                    seqs.append(seq(r, [r.output_ids[-1]], r.num_tokens - 1, sample=True))
            res = self.ex.execute(batch(self.ex, self.step, seqs))
            self.step += 1
            t += 1
            for r in reqs:
                if r.req_id in res.tokens:
                    r.output_ids.append(res.tokens[r.req_id][0])
        for r in reqs:
            r.state = RequestState.FINISHED
            self.free.extend(r.slots)
        self.ex.execute(ScheduledBatch(step=self.step, finished=[r.req_id for r in reqs]))
        return [list(r.output_ids) for r in reqs]


# every forward path: fused CPU kernels (the default where gcc exists), pure torch, and the
# int4 / int8 weight-only kernels and w8a8 (int8 activations too) over the fused path, and w8a8's
# pure-torch twins of the row quantisation
PATHS = {"fused": dict(kernels="fused"), "torch": dict(kernels="torch"),
         "int4": dict(kernels="auto", quantization="int4"), "int8": dict(kernels="auto", quantization="int8"),
         "w8a8": dict(kernels="auto", quantization="w8a8"), "w8a8-torch": dict(kernels="torch", quantization="w8a8"),
         "cuda": dict(device="cuda")}   # runs where a GPU is (skipped elsewhere)


@pytest.fixture(scope="module", params=list(PATHS))
def ex(default_model_path, request):
    from shepherd.engine.torch_executor import TorchExecutor
    if request.param == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if request.param == "fused":
        from shepherd.model import kernels
        if kernels.load() is None:
            pytest.skip("no C compiler for the fused kernels")
    e = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=CAPACITY,
                                   batch_invariant=True, **PATHS[request.param]))
    assert e.model.batch_invariant
    return e


@pytest.fixture(scope="module")
def prompts(ex):
    tok = ex.tokenizer
    topics = ["the moon", "bread", "rivers", "chess", "volcanoes", "honey bees", "the violin", "glaciers",
              "trains", "coffee", "owls", "deserts", "bridges", "tea", "comets", "forests"]
    ps = []
    for i, t in enumerate(topics[:N_REQ]):
        q = f"Tell me {['one fact', 'a short story', 'two facts', 'a poem'][i % 4]} about {t}."
        if i % 3 == 0:
            q += " Please be detailed and mention history, science and culture. " * (1 + i % 5)
        ps.append(tok.encode(tok.apply_chat_template([{"role": "user", "content": q}])))
    return ps


@pytest.fixture(scope="module")
def alone(ex, prompts):
    loop = Loop(ex, seed=1)
    return [loop.run([p])[0] for p in prompts]


def test_16_concurrent_equal_alone(ex, prompts, alone):
    # staggered arrivals: prefills of late requests share forwards with decodes of early ones
    loop = Loop(ex, seed=2)
    together = loop.run(prompts, arrive=[i // 3 for i in range(len(prompts))])
    for i, (a, b) in enumerate(zip(alone, together)):
        assert a == b, f"request {i}: alone {a} != batched {b}"
    assert len({tuple(x) for x in alone}) > N_REQ // 2   # the prompts really differ


def test_thread_count_changed_between_layers_keeps_the_tokens(ex, prompts, alone):
    """The thread governor (engine/threads.py) may go from 2 threads to 1 in the middle of a
    forward, through the model's between_layers hook: every forward here switches to 1 thread
    before layer 5 and back to all before its next forward, and the tokens stay those of the
    unswitched runs. As the governor does, the hook asks for no look after its drop: on every
    path, the fused one-call stack too (kernels.layer_stack, cut at each layer until then, as
    the hook asks for its next look at once), it is called before layers 0..5 of every forward
    and never later (the stack, cut at each op boundary of layers 0..4, is told the layer it is in)."""
    full, seen = torch.get_num_threads(), []
    if full < 2:
        pytest.skip("one CPU: no thread count to change")

    def hook(layer, look):
        seen.append(layer)
        if layer == 0:
            torch.set_num_threads(full)
        elif layer == 5:
            torch.set_num_threads(1)
        return 0.0 if layer < 5 else None
    together = _run_watched(ex, hook, prompts, seed=4, arrive=[i // 3 for i in range(len(prompts))])
    per = _per_layer(ex)
    once = [li for li in range(5) for _ in range(per)] + [5]
    assert seen and seen == once * (len(seen) // len(once))
    assert together == alone


def _run_watched(ex, hook, prompts, seed: int, **kw) -> list:
    """`Loop(ex, seed).run(prompts, **kw)` with `hook` watching the layers; after it, no hook and
    every thread again, whatever the hook left set."""
    full = torch.get_num_threads()
    ex.watch_layers(hook)
    try:
        return Loop(ex, seed=seed).run(prompts, **kw)
    finally:
        ex.watch_layers(None)
        torch.set_num_threads(full)


def _per_layer(ex) -> int:
    """How often a hook that asks for its next look at once is called per layer: once on the
    per-op paths, at every op boundary (kernels.STACK_OPS) on the one-call stack."""
    from shepherd.model.kernels import STACK_OPS
    return STACK_OPS if ex.one_call_stack() else 1


def test_thread_count_changed_at_every_op_boundary_keeps_the_tokens(ex, prompts, alone):
    """The governor's drop and its way back come at any op boundary of the one-call stack, in
    the middle of a layer too (a layer took 30-92 ms under contention): a hook that asks for its
    next look at once and switches between 1 thread and all at every call (every op boundary of
    the stack, every layer on the per-op paths) keeps the tokens of the unswitched runs, with
    prefills beside decodes. It holds because each op's items are computed whole by one thread."""
    full, calls = torch.get_num_threads(), []
    if full < 2:
        pytest.skip("one CPU: no thread count to change")

    def hook(layer, look):
        calls.append(layer)
        torch.set_num_threads(1 if len(calls) % 2 else full)
        return 0.0
    together = _run_watched(ex, hook, prompts, seed=5, arrive=[i // 3 for i in range(len(prompts))])
    n = len(ex.model.layers) * _per_layer(ex)
    assert calls and len(calls) % n == 0
    assert together == alone


def test_governor_looks_between_layers_of_every_path(ex, prompts):
    """The core process's thread governor (engine/threads.py ThreadGovernor.between_layers, as
    core_proc installs it) is called between layers on every path, the fused one-call stack
    (kernels.layer_stack) included: with a 0 s probe and every look counted short (`least` 2:
    no thread gets twice the wall) it is called before every layer of every forward (on the
    stack: at every op boundary, told the layer it is in), with the stack's look there (a `sharp` of 1 keeps it from dropping a thread: the test is about where
    it looks). With no look ever short (`least` 0) the stack runs each forward in one call: the
    hook is called before layer 0 only, where the per-op paths still call it before every layer."""
    from shepherd.engine.threads import ThreadGovernor
    full = torch.get_num_threads()
    if full < 2:
        pytest.skip("one CPU: the governor has nothing to govern")
    n, stack = len(ex.model.layers), ex.one_call_stack()
    for least in (2.0, 0.0):
        gov = ThreadGovernor(full, torch.set_num_threads, probe=0.0, sharp=1.0, least=least, stretch=0.0)
        seen, looks = [], []

        def hook(layer, look):
            seen.append(layer)
            looks.append(look)
            return gov.between_layers(layer, look)
        _run_watched(ex, hook, prompts[:2], seed=11, new=2)
        assert gov.threads == full and gov.mid_step_drops == 0
        once = [li for li in range(n) for _ in range(_per_layer(ex))]   # the stack: every op boundary
        if least or not stack:
            assert len(seen) >= 2 * len(once) and seen == once * (len(seen) // len(once))
        else:
            assert len(seen) >= 2 and set(seen) == {0}
        if stack:       # the C call's look: each thread's CPU share of the wall since the last
            got = [lk for lk in looks if lk is not None]
            assert len(got) == (len(seen) - len(seen) // len(once) if least else 0)
            assert all(0 <= lk.least <= lk.cpus <= full + 0.1 and lk.wall >= 0 for lk in got)
        else:
            assert looks == [None] * len(seen)


def test_governor_drops_in_a_one_row_step_whose_ops_stretch(ex, prompts, alone):
    """The thread governor's stretch rule (engine/threads.py) on the one-call stack: the partner
    thread pinned to a CPU that a busy process holds (the main thread alone on the other), ops
    of a one-row decode step take a scheduler slice instead of 0.02-0.4 ms; the stack looks at
    the next op boundary after each (kernels.c forward_bf16) and the governor drops to one thread
    at the second. Its 10 ms looks are set to 1 s here, so the two-look rule never looks within
    a step: the drop is the stretch rule's, in a decode step (the prefill, of more rows than
    `stretch_rows`, is not watched so). The tokens stay those of the unwatched run."""
    import subprocess
    import sys
    import threading

    from shepherd.engine.threads import ThreadGovernor
    cpus = sorted(os.sched_getaffinity(0))
    if not ex.one_call_stack() or torch.get_num_threads() < 2 or len(cpus) < 2:
        pytest.skip("the stretch rule watches the one-call stack at two threads or more")
    full, main = torch.get_num_threads(), threading.get_native_id()
    gov = ThreadGovernor(full, torch.set_num_threads, probe=1.0, recheck=1e3, stretch=0.004, stretch_rows=8)
    steps, drops = [], []

    def hook(layer, look):
        if layer == 0 and look is None:
            steps.append(gov.threads)
        before = gov.mid_step_drops
        watch = gov.between_layers(layer, look)
        if gov.mid_step_drops > before:
            drops.append((len(steps), look))
        return watch
    torch.set_num_threads(full)
    hog = subprocess.Popen([sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpus[1]}}})\n"
                            "print('spinning', flush=True)\nwhile True: pass"], stdout=subprocess.PIPE, text=True)
    tids = [int(t) for t in os.listdir("/proc/self/task")]
    try:
        assert hog.stdout.readline().strip() == "spinning"
        for t in tids:     # OpenMP's workers (and any other helper thread) beside the hog
            try:
                os.sched_setaffinity(t, {cpus[0]} if t == main else {cpus[1]})
            except OSError:
                pass        # the thread ended meanwhile
        got = _run_watched(ex, hook, prompts[:1], seed=12)
    finally:
        hog.kill()
        hog.wait()
        for t in tids:
            try:
                os.sched_setaffinity(t, set(cpus))
            except OSError:
                pass
    assert got == alone[:1]
    assert gov.mid_step_drops == 1 and len(drops) == 1
    step, look = drops[0]
    assert step >= 2 and steps[:step] == [full] * step      # a decode step (the prefill is step 1)
    assert look.op >= 0.004 and (1 - look.least) * look.wall >= 0.002


@pytest.mark.parametrize("page", [1, 16])
def test_layer_stack_cut_between_layers_equals_one_call(ex, prompts, page):
    """The layer stack (kernels.layer_stack) cut into one C call per layer (a between_layers hook
    asking for its next look at once), cut at each layer up to layer 7 and run on in one call, or
    cut wherever a 1 ms budget runs out gives the logits bits of no hook (one call), on a ragged
    step of prefills beside decodes, with the KV slots in shuffled pages of `page` tokens."""
    m = ex.model
    if getattr(m, "layer_ptrs", None) is None:
        pytest.skip("this path calls one kernel per op")
    pages = list(range(CAPACITY // page))
    random.Random(9).shuffle(pages)
    free = [p * page + i for p in pages for i in range(page)]
    reqs = []
    for i, p in enumerate(prompts[:8]):
        r = Request(req_id=f"cut{page}-{i}", prompt_ids=list(p), params=SamplingParams(max_tokens=4, temperature=0.0))
        n = -(-(len(p) + 2) // page) * page
        r.slots, free = free[:len(p) + 2], free[n:]
        reqs.append(r)
    first, second = reqs[:4], reqs[4:]
    calls = []

    def run(hook) -> list:
        ex.watch_layers(hook)
        try:
            with torch.inference_mode():
                a, _ = ex.forward_logits(announced(ex, [seq(r, r.prompt_ids, 0, sample=True, fresh=True)
                                                        for r in first]))
                toks = a.argmax(-1).tolist()
                mixed = [seq(r, [t], len(r.prompt_ids), sample=True) for r, t in zip(first, toks)]
                mixed += [seq(r, r.prompt_ids, 0, sample=True, fresh=True) for r in second]
                b, _ = ex.forward_logits(announced(ex, mixed))
        finally:
            ex.watch_layers(None)
        return [a.clone(), b.clone()]

    def every(layer, look):
        calls.append(layer)
        return 0.0
    one = run(None)
    cut = run(every)       # the stack: cut at every op boundary, inside layers too
    assert calls == [li for li in range(len(m.layers)) for _ in range(_per_layer(ex))] * 2
    part = run(lambda layer, look: 0.0 if layer < 7 else None)
    timed_calls = []
    timed = run(lambda layer, look: timed_calls.append(layer) or 0.001)
    assert len(timed_calls) > 2     # the prefills' layers take over 1 ms: the stack was cut
    assert all(torch.equal(x, y) for x, y in zip(one, cut)), "one call per layer changed the logits"
    assert all(torch.equal(x, y) for x, y in zip(one, part)), "cut up to layer 7 changed the logits"
    assert all(torch.equal(x, y) for x, y in zip(one, timed)), "cut at a time budget changed the logits"


def test_16_concurrent_with_chunked_prefill(ex, prompts, alone):
    loop = Loop(ex, seed=3)
    together = loop.run(prompts, chunk=13)
    assert together == alone


def test_prompt_split_in_two_chunks_equals_one_chunk(ex, prompts):
    p = max(prompts, key=len)
    loop = Loop(ex, seed=4)
    one = loop.run([p])[0]
    for split in (1, len(p) // 2, len(p) - 1):
        two = _two_chunks(loop, p, split)
        assert two == one, f"split at {split}"


def _two_chunks(loop, p, split):
    ex = loop.ex
    r = Request(req_id=f"two{split}", prompt_ids=list(p), params=SamplingParams(max_tokens=NEW, temperature=0.0))
    r.slots = [loop.free.pop() for _ in range(len(p) + NEW)]
    r.state = RequestState.RUNNING
    res = ex.execute(batch(ex, 0, [seq(r, p[:split], 0, sample=False, fresh=True)]))
    assert r.req_id not in res.tokens
    res = ex.execute(batch(ex, 1, [seq(r, p[split:], split, sample=True)]))
    r.output_ids.append(res.tokens[r.req_id][0])
    while len(r.output_ids) < NEW:
        res = ex.execute(batch(ex, 2, [seq(r, [r.output_ids[-1]], r.num_tokens - 1, sample=True)]))
        r.output_ids.append(res.tokens[r.req_id][0])
    r.state = RequestState.FINISHED
    loop.free.extend(r.slots)
    ex.execute(ScheduledBatch(step=3, finished=[r.req_id]))
    return r.output_ids


def test_shared_prefix_slots_equal_fresh_prefill(ex, prompts, alone):
    """A prompt whose first tokens' K/V come from another request's slots (what a
    prefix-cache hit does) gives the tokens of a full prefill."""
    p = prompts[0]
    loop = Loop(ex, seed=5)
    # request A computes the shared prefix into its slots
    a = Request(req_id="A", prompt_ids=list(p), params=SamplingParams(max_tokens=1, temperature=0.0))
    a.slots = [loop.free.pop() for _ in range(len(p))]
    ex.execute(batch(ex, 0, [seq(a, p, 0, sample=True, fresh=True)]))
    k = len(p) - 3
    b = Request(req_id="B", prompt_ids=list(p), params=SamplingParams(max_tokens=NEW, temperature=0.0))
    b.slots = a.slots[:k] + [loop.free.pop() for _ in range(len(p) - k + NEW)]
    res = ex.execute(batch(ex, 1, [seq(b, p[k:], k, sample=True, fresh=True)]))
    b.output_ids.append(res.tokens["B"][0])
    while len(b.output_ids) < NEW:
        res = ex.execute(batch(ex, 2, [seq(b, [b.output_ids[-1]], b.num_tokens - 1, sample=True)]))
        b.output_ids.append(res.tokens["B"][0])
    assert b.output_ids == alone[0]


def test_row_bits_do_not_depend_on_batch(ex, prompts):
    """Stronger than tokens: the logits row of a request is bit-identical alone and
    in a batch of 16 mixed with prefill chunks."""
    loop = Loop(ex, seed=6)
    reqs = []
    for i, p in enumerate(prompts):
        r = Request(req_id=f"bits{i}", prompt_ids=list(p), params=SamplingParams(max_tokens=4, temperature=0.0))
        r.slots = [loop.free.pop() for _ in range(len(p) + 4)]
        reqs.append(r)
    def prefill(r):
        return seq(r, r.prompt_ids, 0, sample=True, fresh=True)
    with torch.inference_mode():
        solo = []
        for r in reqs:
            lg, _ = ex.forward_logits(announced(ex, [prefill(r)]))
            solo.append(lg[0].clone())
        # again, everything in one ragged forward: full prefills of all 16 at once
        lg, sampled = ex.forward_logits(announced(ex, [prefill(r) for r in reqs]))
    for i in range(len(reqs)):
        assert torch.equal(lg[i], solo[i]), f"request {i}: logits differ in a batch"


def test_whole_forward_equals_one_call_per_op(ex, prompts):
    """The layer stack in one kernel call (kernels.c forward_bf16) gives the same logits bits as
    one call per op, on a ragged step of prefills beside decodes."""
    m = ex.model
    if getattr(m, "layer_ptrs", None) is None:
        pytest.skip("this path calls one kernel per op")
    loop = Loop(ex, seed=8)
    reqs = []
    for i, p in enumerate(prompts[:8]):
        r = Request(req_id=f"whole{i}", prompt_ids=list(p), params=SamplingParams(max_tokens=4, temperature=0.0))
        r.slots = [loop.free.pop() for _ in range(len(p) + 2)]
        reqs.append(r)
    first, second = reqs[:4], reqs[4:]

    def run(whole: bool) -> list:
        m.whole_forward = whole
        with torch.inference_mode():
            a, _ = ex.forward_logits(announced(ex, [seq(r, r.prompt_ids, 0, sample=True, fresh=True)
                                                    for r in first]))
            toks = a.argmax(-1).tolist()
            mixed = [seq(r, [t], len(r.prompt_ids), sample=True)
                     for r, t in zip(first, toks)]
            mixed += [seq(r, r.prompt_ids, 0, sample=True, fresh=True)
                      for r in second]
            b, _ = ex.forward_logits(announced(ex, mixed))
        return [a.clone(), b.clone()]

    try:
        whole, per_op = run(True), run(False)
    finally:
        m.whole_forward = True
    assert all(torch.equal(x, y) for x, y in zip(whole, per_op))


def test_non_invariant_mode_is_a_real_switch(ex, prompts):
    """Sanity: the fast mode runs the other attention path (and still produces tokens)."""
    ex.model.batch_invariant = False
    try:
        out = Loop(ex, seed=7).run(prompts[:4], new=4)
    finally:
        ex.model.batch_invariant = True
    assert all(len(o) == 4 for o in out)


def _decode(ex, r, until):
    while len(r.output_ids) < until:
        res = ex.execute(batch(ex, 9, [seq(r, [r.output_ids[-1]], r.num_tokens - 1, sample=True)]))
        r.output_ids.append(res.tokens[r.req_id][0])


def test_preempt_recompute_and_swap_give_the_same_tokens(default_model_path, ex, prompts, alone):
    """Preemption by recompute (prefill of prompt + generated tokens) and by swap (KV to the
    host pool and back into other slots) leave a request's greedy tokens unchanged."""
    from shepherd.config import SchedulerConfig
    from shepherd.engine.torch_executor import HostPoolFull, TorchExecutor
    ex2 = TorchExecutor(EngineConfig(model=default_model_path, dtype="bfloat16", max_total_tokens=2048,
                                     kernels=ex.cfg.kernels, quantization=ex.cfg.quantization, host_kv_tokens=600,
                                     device=ex.cfg.device,     # `alone` ran there: on cuda, not the CPU
                                     scheduler=SchedulerConfig(preemption="swap")))
    assert ex2.host_kv_capacity == 600
    p = prompts[1]
    # recompute after 6 tokens
    r = Request(req_id="rc", prompt_ids=list(p), params=SamplingParams(max_tokens=NEW, temperature=0.0))
    r.slots = list(range(len(p) + NEW))
    res = ex2.execute(batch(ex2, 0, [seq(r, p, 0, sample=True, fresh=True)]))
    r.output_ids.append(res.tokens["rc"][0])
    _decode(ex2, r, 6)
    # preempted: its slots are freed; the executor keeps the request (not in `finished`)
    r.slots = list(range(1000, 1000 + len(p) + NEW))               # readmitted elsewhere
    known = r.all_ids
    res = ex2.execute(batch(ex2, 2, [seq(r, known[:-1], 0, sample=False, fresh=True)]))
    _decode(ex2, r, NEW)
    assert r.output_ids == alone[1]
    # swap after 5 tokens
    s = Request(req_id="sw", prompt_ids=list(p), params=SamplingParams(max_tokens=NEW, temperature=0.0))
    s.slots = list(range(len(p) + NEW))
    res = ex2.execute(batch(ex2, 3, [seq(s, p, 0, sample=True, fresh=True)]))
    s.output_ids.append(res.tokens["sw"][0])
    _decode(ex2, s, 5)
    n_kv = s.num_tokens - 1
    ex2.execute(ScheduledBatch(step=4, swap_out=[SwapOp("sw", s.slots[:n_kv])]))
    ex2.kv_pool.zero_()                                             # the device copy is really gone
    assert ex2.host_used == n_kv
    s.slots = list(range(1500, 1500 + len(p) + NEW))
    ex2.execute(ScheduledBatch(step=5, swap_in=[SwapOp("sw", s.slots[:n_kv])]))
    assert ex2.host_used == 0
    res = ex2.execute(batch(ex2, 6, [seq(s, [s.output_ids[-1]], n_kv, sample=True, fresh=True)]))
    s.output_ids.append(res.tokens["sw"][0])
    _decode(ex2, s, NEW)
    assert s.output_ids == alone[1]
    # the host pool is bounded
    with pytest.raises(HostPoolFull):
        ex2.execute(ScheduledBatch(step=7, swap_out=[SwapOp("big", list(range(601)))]))

