"""TorchExecutor: runs ScheduledBatches on the real model (CPU, torch).

It owns the KV pool (K and V, each [layers, capacity, kv_heads, head_dim],
addressed by slot), a bounded host pool for swapped-out requests, the model
and the sampler, and its own record of every request it runs (its slot table
and the sampler's state), kept from the step contract's changes.
`execute(batch)` forgets finished requests, takes new ones, applies swaps,
runs ONE forward over the ragged batch and samples. With speculative decoding
the same forward verifies each request's drafts (the logits of every fed row
of a seq with num_draft), and after sampling the drafter proposes the next
ones (engine/spec_ngram.py, engine/spec_model.py).
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from concurrent.futures import Future
from typing import Optional

import torch

from shepherd.config import ConfigError, EngineConfig, host_pool_tokens
from shepherd.model.llama import AttnGroup, LlamaModel, StepInput
from shepherd.model.loader import LoadedModel, load_model, model_name_for
from shepherd.model.lora import LoraPool, LoraRegistry
from shepherd.model.grammar import GrammarMasks
from shepherd.model.sampler import Sampler, SamplingState
from shepherd.scheduler.kv_pool import pages_for
from shepherd.engine.drafter import make_drafter
from shepherd.request import TokenLogprob
from shepherd.step import LoraLoad, NewRequest, ScheduledBatch, ScheduledSeq, StepResult

log = logging.getLogger("shepherd")


class ExecutorError(RuntimeError):
    pass


class HostPoolFull(ExecutorError):
    pass


def mem_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError):
        return 4 << 30


def free_memory_bytes(device: torch.device) -> int:
    """Free memory where the KV pool is allocated: the GPU's own (torch.cuda.mem_get_info, read
    after the weights are on it) on cuda, MemAvailable on the CPU. The host's RAM says nothing of
    a GPU's: a pool sized from it would not fit a 24 GB card on a 512 GB host."""
    if device.type == "cuda":
        return int(torch.cuda.mem_get_info(device)[0])
    return mem_available_bytes()


KERNEL_MODES = ("auto", "fused", "torch")


def _to_device(inp: StepInput, dev: torch.device) -> StepInput:
    """The step's index tensors (built on the host) moved to the model's device."""
    mv = lambda t: None if t is None else t.to(dev, non_blocking=True)
    for g in inp.groups:
        g.token_index, g.gather, g.mask = mv(g.token_index), mv(g.gather), mv(g.mask)
    for name in ("input_ids", "positions", "write_index", "logits_index"):
        setattr(inp, name, mv(getattr(inp, name)))
    if inp.lora_rows is not None:     # the torch path's per-slot row indices
        inp.lora_rows.by_slot = {s: mv(t) for s, t in inp.lora_rows.by_slot.items()}
    return inp


def _pick_device(name: str) -> torch.device:
    try:
        dev = torch.device(name or "cpu")
    except RuntimeError as e:
        raise ConfigError(f"--device {name!r}: {e} (use cpu, cuda or cuda:N)") from None
    if dev.type not in ("cpu", "cuda"):
        raise ConfigError(f"--device {name!r} is not supported (use cpu, cuda or cuda:N)")
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"--device {name}: CUDA is not available on this machine (torch "
                                f"{torch.__version__}, {torch.cuda.device_count()} GPUs)")
        if (dev.index or 0) >= torch.cuda.device_count():
            raise ConfigError(f"--device {name}: only {torch.cuda.device_count()} CUDA devices")
    return dev


def _pick_kernels(mode: str, dtype: torch.dtype, device: torch.device):
    """The fused CPU kernels for `mode` (auto: if they build; fused: must build; torch: off)."""
    if mode not in KERNEL_MODES:
        raise ConfigError(f"kernels must be one of {KERNEL_MODES}, got {mode!r}")
    if device.type != "cpu":
        if mode == "fused":
            raise ConfigError(f"--kernels fused runs on CPU only; on {device} use auto or torch")
        return None
    if mode == "torch" or os.environ.get("SHEPHERD_KERNELS") == "torch":
        return None
    from shepherd.model import kernels
    lib = kernels.load() if dtype in (torch.bfloat16, torch.float32) else None
    if lib is None:
        if mode == "fused":
            raise ConfigError("--kernels fused: the fused CPU kernels could not be built or loaded "
                                "(needs gcc and a bfloat16/float32 model); use --kernels torch")
        return None
    return kernels.Kernels(lib, dtype)


def _round_up(x: int, m: int) -> int:
    return pages_for(x, m) * m


class _ReqState:
    """What the executor keeps of one request: the sampler's record, its slot table (position
    -> KV slot) and that table as a tensor, copied up to n_slots (slots_c: a ctypes array over
    the tensor's memory, which sync writes through); its LoRA adapter's name; and,
    when it asked for its prompt's logprobs, those found so far (`plp`: the entry of position p is
    prompt token p+1's) until they are handed out with its first token (then plp is None)."""
    __slots__ = ("seq", "slots", "slots_t", "slots_c", "n_slots", "adapter", "prompt", "plp_top", "plp")

    def __init__(self, seq: SamplingState, new: NewRequest):
        self.seq = seq
        self.adapter = new.adapter
        self.slots: list[int] = []
        self.slots_t = torch.empty(0, dtype=torch.long)
        self.slots_c = None
        self.n_slots = 0
        self.prompt = new.prompt_ids
        self.plp_top = new.params.prompt_logprobs
        self.plp: Optional[list[TokenLogprob]] = [] if self.plp_top is not None else None

    def take(self, s: ScheduledSeq) -> None:
        """The step's changes: slot table from s.slots_from on, and the tokens fed."""
        if s.new_slots or s.slots_from < len(self.slots):
            if s.slots_from < self.n_slots:
                self.n_slots = s.slots_from
            self.slots[s.slots_from:] = s.new_slots
        self.seq.feed(s.start_pos, s.token_ids)

    def sync(self, need: int) -> None:
        """Make slots_t[:need] equal slots[:need] (slots_t may be longer). The new slots (one a
        decode step) go in through the ctypes array: with a torch.tensor and a copy into a slice
        of slots_t, and the slice and its clone handed to the kernels, a one-row step's input took
        ~50 us longer, each torch path that runs once a step being slow there
        (benchmarks/core_loop_cost.py; docs/SERVING.md)."""
        if need > self.n_slots:
            if self.slots_t.numel() < need:
                cap = max(need, 2 * self.slots_t.numel(), 64)
                new = torch.empty(cap, dtype=torch.long)
                if self.n_slots:
                    new[: self.n_slots] = self.slots_t[: self.n_slots]
                self.slots_t, self.slots_c = new, (ctypes.c_int64 * cap).from_address(new.data_ptr())
            self.slots_c[self.n_slots: need] = self.slots[self.n_slots: need]
            self.n_slots = need


class _LogitRows:
    """The rows of a step whose logits are wanted: first the sampling seqs' rows (the last
    one's, and one more per draft a seq verifies), then the prompt positions whose next
    token's logprob a request asked for (prompt_logprobs)."""
    __slots__ = ("rows", "sampled", "prompt_rows", "prompt")

    def __init__(self):
        self.rows: list[int] = []
        self.sampled: list[_ReqState] = []
        self.prompt_rows: list[int] = []
        self.prompt: list[tuple[_ReqState, int]] = []     # (request, position p: predicts prompt token p+1)

    def add(self, s: ScheduledSeq, st: _ReqState, row: int, n: int) -> None:
        if s.sample:
            self.rows.extend(range(row + n - 1 - s.num_draft, row + n))
            self.sampled.append(st)
        if st.plp is not None:
            # positions this seq feeds that predict a prompt token and were not scored yet (a
            # request recomputed after preemption feeds them again)
            if s.start_pos > len(st.plp):
                raise ExecutorError(f"{s.req_id}: prompt logprobs asked, but positions {len(st.plp)}.."
                                    f"{s.start_pos - 1} never ran (served from the prefix cache?)")
            for p in range(len(st.plp), min(s.start_pos + n, len(st.prompt) - 1)):
                self.prompt_rows.append(row + p - s.start_pos)
                self.prompt.append((st, p))

    def index(self, num_rows: int) -> Optional[torch.Tensor]:
        if not self.prompt_rows and len(self.rows) == num_rows:
            return None                       # every row, in order
        return torch.tensor(self.rows + self.prompt_rows, dtype=torch.long)


class TorchExecutor:
    paced = False    # the forward takes real time: the engine never waits on top of it

    def __init__(self, cfg: Optional[EngineConfig] = None, loaded: Optional[LoadedModel] = None,
                 kv_block: int = 64):
        cfg = cfg or EngineConfig()
        self.cfg = cfg
        threads = (cfg.num_threads or int(os.environ.get("SHEPHERD_NUM_THREADS", "0") or 0)
                   or min(os.cpu_count() or 1, 64))
        torch.set_num_threads(threads)
        t0 = time.perf_counter()
        self.device = _pick_device(cfg.device)
        if self.device.type != "cpu" and cfg.quantization in ("int4", "w8a8"):
            raise ConfigError(f"--quantization {cfg.quantization} runs on CPU only (its kernels are torch's CPU "
                              f"ones); use int8 or none on {self.device}")
        if loaded is None:
            loaded = load_model(cfg.model, cfg.dtype, quantization=cfg.quantization)
        self.quantization = loaded.quantization
        self.loaded = loaded
        self.tokenizer = loaded.tokenizer
        self.model_name = model_name_for(loaded.path)
        self.dtype = loaded.dtype
        self.batch_invariant = bool(cfg.batch_invariant)
        mcfg = loaded.config
        self.model_config = mcfg
        self.model = LlamaModel(mcfg, loaded.weights, loaded.dtype, batch_invariant=self.batch_invariant,
                                kv_block=kv_block, kernels=_pick_kernels(cfg.kernels, loaded.dtype, self.device),
                                qweights=loaded.qweights, device=self.device)
        loaded.qweights = {}
        self.kernels = "fused" if self.model.kernels is not None else "torch"
        loaded.weights = {}  # the model holds its own (fused) copies
        self.kv_block = kv_block
        per_tok = self.model.kv_bytes_per_token()
        if cfg.max_total_tokens:
            cap = int(cfg.max_total_tokens)
        else:
            avail = free_memory_bytes(self.device)
            cap = int(avail * float(cfg.kv_cache_memory_fraction)) // per_tok
            cap = max(256, min(cap, 1 << 22))
        self.kv_capacity = cap
        self.kv_pool = self.model.alloc_kv(cap)           # [layers, 2*kv_heads, cap+1, head_dim]
        KVH = mcfg.num_kv_heads
        self.k_pool = self.kv_pool[:, :KVH]                # views: [layers, kv_heads, cap+1, head_dim]
        self.v_pool = self.kv_pool[:, KVH:]
        self.scratch_slot = cap
        self.max_model_len = min(mcfg.max_position_embeddings, cap)
        self.host_kv_capacity = host_pool_tokens(cfg.host_kv_tokens, cap, cfg.scheduler.preemption)
        self.host_used = 0
        self.host: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.eos_token_ids = tuple(self.tokenizer.eos_token_ids)
        self.sampler = Sampler()
        self.sampler.grammar = GrammarMasks(self.tokenizer, vocab_size=mcfg.vocab_size,
                                            max_held_bytes=cfg.max_grammar_memory)
        # SHEPHERD_GRAMMAR_OVERLAP=1: the grammar rows' masks are filled in a thread while the forward
        # runs (they need only the tokens fed this step). Off by default: on 2 cores the forward has
        # every core and the masks cost ~0.4 ms a step, so it did not pay (benchmarks/grammar_overlap.py)
        self.masks_beside_forward = os.environ.get("SHEPHERD_GRAMMAR_OVERLAP", "0").strip() == "1"
        self.drafter = make_drafter(cfg.scheduler.speculative, cfg, self)
        self.reqs: dict[str, _ReqState] = {}
        # the last step's host and device parts, in seconds (sim/host_profile.py reads them):
        # building the inputs, the forward, the sample and what follows it
        self.last_parts = {"prepare": 0.0, "forward": 0.0, "sample": 0.0}
        self._init_lora(cfg, mcfg)
        self._arange = torch.arange(max(self.max_model_len, 1) + kv_block, dtype=torch.long)
        self._zeros = torch.zeros(16, dtype=torch.long)
        self._scratch = torch.full((16,), cap, dtype=torch.long)
        self._scratch_slot = cap
        self._head_off = (torch.arange(2 * mcfg.num_kv_heads, dtype=torch.long) * (cap + 1)).view(-1, 1)
        log.info("model %s loaded in %.1fs (%s, weights %s, %d layers, batch_invariant=%s, kernels=%s, "
                 "device=%s, threads=%d)", self.model_name, time.perf_counter() - t0,
                 str(self.dtype).replace("torch.", ""), self.quantization, mcfg.num_layers, self.batch_invariant,
                 self.kernels, self.device, threads)
        log.info("KV cache: %d tokens (%.1f MiB, %d bytes/token); host swap pool: %d tokens",
                 cap, cap * per_tok / 2**20, per_tok, self.host_kv_capacity)
        self._probe_gemm()

    # ------------------------------------------------------------------ LoRA adapters
    def _init_lora(self, cfg: EngineConfig, mcfg) -> None:
        """The adapter slots (cfg.scheduler.max_loras of them, as the scheduler keeps them
        resident) and the registry, with the --lora-modules adapters registered."""
        self.lora: Optional[LoraPool] = None
        self.lora_registry: Optional[LoraRegistry] = None
        self.lora_slot_of: dict[str, int] = {}       # resident adapter -> its slot (from batch.lora_loads)
        self.lora_loads = 0
        self.lora_load_s = 0.0
        self._load_times: list[float] = []           # seconds of each load since take_lora_loads
        lc = cfg.lora
        if not (lc.enabled or lc.modules):
            return
        slots = cfg.scheduler.max_loras
        lc.validate(slots)
        if self.quantization == "w8a8":
            raise ConfigError("LoRA adapters cannot run on --quantization w8a8 (its smoothing rescales the inputs "
                              "the adapters read); use none, int8 or int4")
        self.lora = LoraPool(mcfg, slots, lc.max_lora_rank, self.device)
        self.model.lora = self.lora
        self.lora_registry = LoraRegistry(mcfg, lc.max_lora_rank, lc.host_adapters(slots))
        for name, path in lc.modules.items():
            self.lora_registry.register(name, path)
        log.info("LoRA: %d adapter slots, rank <= %d (%.1f MiB), %d adapters kept in host memory, %d registered",
                 slots, lc.max_lora_rank, self.lora.nbytes / 2**20, self.lora_registry.host_capacity,
                 len(lc.modules))

    def register_lora(self, name: str, path: str) -> None:
        """Serve a PEFT adapter folder under `name` (model.lora.LoraError if it cannot be)."""
        if self.lora_registry is None:
            raise ConfigError("this engine serves no LoRA adapters (start it with --enable-lora)")
        self.lora_registry.register(name, path)

    def unregister_lora(self, name: str) -> None:
        """Forget an adapter; the scheduler has made sure no request runs with it."""
        if self.lora_registry is not None:
            self.lora_registry.unregister(name)
        slot = self.lora_slot_of.pop(name, None)
        if slot is not None:
            self.lora.clear(slot)

    @property
    def lora_enabled(self) -> bool:
        """Adapter slots exist (--enable-lora or --lora-modules)."""
        return self.lora is not None

    def lora_names(self) -> list[str]:
        return [] if self.lora_registry is None else self.lora_registry.names()

    def lora_adapters(self) -> list[tuple[str, str]]:
        """(name, folder) of every adapter served."""
        return [] if self.lora_registry is None else list(self.lora_registry.paths.items())

    def _load_lora(self, ld: LoraLoad) -> None:
        t0 = time.perf_counter()
        if self.lora is None:
            raise ExecutorError(f"LoRA load of {ld.name!r}: this executor has no adapter slots")
        old = self.lora.names[ld.slot]
        if old is not None:
            self.lora_slot_of.pop(old, None)
        self.lora.load(ld.slot, self.lora_registry.get(ld.name))
        self.lora_slot_of[ld.name] = ld.slot
        dt = time.perf_counter() - t0
        self.lora_loads += 1
        self.lora_load_s += dt
        self._load_times.append(dt)
        log.debug("LoRA: %s loaded into slot %d in %.2f ms", ld.name, ld.slot, dt * 1000)

    def take_lora_loads(self) -> list[float]:
        """The seconds of each adapter load (host memory or folder -> adapter slot) since the last
        call: the engine core turns them into shepherd:lora_load_seconds."""
        out, self._load_times = self._load_times, []
        return out

    def _row_slots(self, sts: list[_ReqState], rows: list[int]) -> list[int]:
        """Per row of the step, its adapter's slot (-1: the base model), from each seq's rows."""
        out: list[int] = []
        for st, n in zip(sts, rows):
            if st.adapter is None:
                out.extend([-1] * n)
                continue
            slot = self.lora_slot_of.get(st.adapter)
            if slot is None:
                raise ExecutorError(f"{st.seq.req_id}: scheduled with adapter {st.adapter!r}, which is not "
                                    f"in an adapter slot")
            out.extend([slot] * n)
        return out

    # ------------------------------------------------------------------ invariance probe
    def _probe_gemm(self) -> None:
        """Check on this CPU that a GEMM row's bits do not depend on M (>= min_rows) or on
        its position; otherwise fall back to fixed-size row tiles."""
        m = self.model
        g = torch.Generator().manual_seed(0)
        ok = True
        lins = (m.layers[0]["gu"], m.layers[0]["down"], m.layers[0]["qkv"], m.lm_head)

        def invariant(rows) -> bool:
            for lin in lins:
                x = torch.randn(80, lin.in_features, generator=g).to(m.dtype).to(self.device)
                full = lin.raw(x)
                for M in rows:
                    for s in (0, 80 - M):
                        if not torch.equal(lin.raw(x[s:s + M]), full[s:s + M]):
                            return False
            return True
        own_gemm = getattr(m.layers[0]["qkv"], "tiles", None) is not None     # shepherd's bf16 GEMM
        if (m.quantized or own_gemm) and invariant((1, 2, 3)):
            m.min_rows = 1       # shepherd's GEMMs, torch's int8/int4: a row's bits do not depend on M, even M = 1
        ok = invariant((m.min_rows, m.min_rows + 1, 7, 9, 16, 33))
        if not ok:
            m.row_tile = 16
            log.warning("GEMM rows are not batch invariant on %s: using fixed %d-row tiles", self.device, m.row_tile)

    # ------------------------------------------------------------------ protocol
    def execute(self, batch: ScheduledBatch) -> StepResult:
        t0 = time.perf_counter()
        for rid in batch.finished:       # first: their host copies make room for this step's swaps
            self._forget(rid)
        for new in batch.new:
            self.add(new)
        for op in batch.swap_out:
            self._swap_out(op.req_id, op.slots)
        for op in batch.swap_in:
            self._swap_in(op.req_id, op.slots)
        for ld in batch.lora_loads:
            self._load_lora(ld)
        res = StepResult()
        if batch.seqs:
            with torch.inference_mode():
                self._run(batch.seqs, res)
        res.step_time = time.perf_counter() - t0
        return res

    def one_call_stack(self) -> bool:
        """Whether the model runs its layer stack in one C call (kernels.layer_stack)."""
        return self.model.layer_ptrs is not None and self.model.whole_forward

    def watch_layers(self, hook) -> None:
        """Call `hook(layer index, look)` before layers of the model's forward: before its first
        layer, then where the kernels.Watch it returned says (the per-op paths call it before
        every layer, with look None; the one-call stack where its look says return, with that
        kernels.StackLook), and not again in that forward once it returns None (model/llama.py's
        between_layers; the core process's thread governor, engine/threads.py). hook None: none,
        the layer stack in one call."""
        self.model.between_layers = hook

    def warm_grammar(self) -> None:
        """step.Executor.warm_grammar: the compiler is built in the sampler's background thread."""
        self.sampler.grammar.warm_up()

    def grammar_ready(self, req_id: str, spec: tuple[str, str]) -> bool:
        """step.Executor.grammar_ready: compiles in the sampler's background thread."""
        return self.sampler.grammar.prepare(spec, req_id)

    def drop_grammar(self, req_id: str) -> None:
        """step.Executor.drop_grammar."""
        self.sampler.grammar.forget(req_id)

    @property
    def grammar_bytes(self) -> int:
        """step.Executor.grammar_bytes."""
        return self.sampler.grammar.held_bytes

    def add(self, new: NewRequest) -> None:
        """A request seen for the first time (execute does this for batch.new)."""
        if new.adapter is not None and self.lora is None:
            raise ExecutorError(f"{new.req_id}: adapter {new.adapter!r} asked of an executor without LoRA slots")
        self.reqs[new.req_id] = _ReqState(self.sampler.add(new), new)

    # ------------------------------------------------------------------ host pool
    def _swap_out(self, req_id: str, slots: list[int]) -> None:
        n = len(slots)
        if self.host_used + n > self.host_kv_capacity:
            raise HostPoolFull(f"swap out of {req_id} ({n} tokens) exceeds the host KV pool "
                               f"({self.host_used}/{self.host_kv_capacity} tokens used)")
        if req_id in self.host:
            self._drop_host(req_id)
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.host[req_id] = (self.k_pool.index_select(2, idx).cpu(), self.v_pool.index_select(2, idx).cpu())
        self.host_used += n

    def _swap_in(self, req_id: str, slots: list[int]) -> None:
        if req_id not in self.host:
            raise ExecutorError(f"swap in of {req_id}: no host copy")
        k, v = self.host[req_id]
        if k.shape[2] != len(slots):
            raise ExecutorError(f"swap in of {req_id}: {len(slots)} slots for {k.shape[2]} swapped tokens")
        idx = torch.tensor(slots, dtype=torch.long, device=self.device)
        self.k_pool.index_copy_(2, idx, k.to(self.device))
        self.v_pool.index_copy_(2, idx, v.to(self.device))
        self._drop_host(req_id)

    def _drop_host(self, req_id: str) -> None:
        k, _ = self.host.pop(req_id)
        self.host_used -= k.shape[2]

    def _forget(self, req_id: str) -> None:
        self.reqs.pop(req_id, None)
        self.sampler.forget(req_id)
        if self.drafter is not None:
            self.drafter.forget(req_id)
        if req_id in self.host:
            self._drop_host(req_id)

    # ------------------------------------------------------------------ forward
    def _rows(self, seqs: list[ScheduledSeq]):
        """(seq, its state, tokens, context after this step) for each seq with tokens to feed,
        after taking the seq's changes into the state (its slots_t holds its slots up to the
        context)."""
        reqs = self.reqs
        for s in seqs:
            st = reqs.get(s.req_id)
            if st is None:
                raise ExecutorError(f"{s.req_id}: scheduled but never announced as a new request")
            st.take(s)
            n = len(s.token_ids)
            if n == 0:
                continue
            ctx = s.start_pos + n
            if ctx > self.max_model_len:
                raise ExecutorError(f"{s.req_id}: context {ctx} exceeds max_model_len {self.max_model_len}")
            st.sync(ctx)
            yield s, st, n, ctx

    def build_input_fused(self, seqs: list[ScheduledSeq]) -> tuple[StepInput, _LogitRows]:
        """Input of the fused path: per row its slot, and where its keys are in slot_tab. Per-row
        values are gathered as Python ints and become one tensor each: a row costs no torch call of
        its own (64 decode rows, timed alone: 450 us of small tensor ops before, 146 us now)."""
        ids: list[int] = []
        pos: list[int] = []
        write: list[int] = []
        off: list[int] = []
        rctx: list[int] = []
        tab_parts = []
        want = _LogitRows()
        fed: list[tuple[_ReqState, int]] = []
        row = tab = max_ctx = 0
        for s, st, n, ctx in self._rows(seqs):
            fed.append((st, n))
            ids.extend(s.token_ids)
            pos.extend(range(s.start_pos, ctx))
            write.extend(st.slots[s.start_pos: ctx])
            off.extend([tab] * n)
            rctx.extend(range(s.start_pos + 1, ctx + 1))
            tab_parts.append((st.slots_t, ctx))
            tab += ctx
            max_ctx = max(max_ctx, ctx)
            want.add(s, st, row, n)     # a verify: the logits after the last token and after each draft
            row += n
        pad = self.model.min_rows - row if (self.model.batch_invariant and row < self.model.min_rows) else 0
        if pad:  # padding rows: token 0 at position 0 in the scratch slot, attending to itself
            ids.extend([0] * pad)
            pos.extend([0] * pad)
            write.extend([self._scratch_slot] * pad)
            tab_parts.append((self._scratch, 1))
            off.extend([tab] * pad)
            rctx.extend([1] * pad)
            max_ctx = max(max_ctx, 1)
        T = row + pad
        long = lambda xs: torch.tensor(xs, dtype=torch.long)
        inp = StepInput(input_ids=long(ids), positions=long(pos), write_index=None, groups=[],
                        logits_index=want.index(T),
                        num_tokens=T, slots=long(write),
                        # one request: its own table, read up to its context by this forward only
                        slot_tab=(torch.cat([t[:c] for t, c in tab_parts]) if len(tab_parts) > 1
                                  else tab_parts[0][0]),
                        row_off=long(off), row_ctx=long(rctx), max_ctx=max_ctx, lora_rows=self._lora_rows(fed))
        return inp, want

    def _lora_rows(self, fed: list[tuple[_ReqState, int]]):
        """The step's LoRA rows (model/lora.py LoraRows), None when no request fed has an adapter;
        padding rows come after the fed ones and run on the base model."""
        if self.lora is None or not any(st.adapter is not None for st, _ in fed):
            return None
        return LoraPool.rows(self._row_slots([st for st, _ in fed], [n for _, n in fed]))

    def build_input(self, seqs: list[ScheduledSeq]) -> tuple[StepInput, _LogitRows]:
        if self.model.kernels is not None:
            return self.build_input_fused(seqs)
        return self.build_input_torch(seqs)

    def build_input_torch(self, seqs: list[ScheduledSeq]) -> tuple[StepInput, _LogitRows]:
        """Input of the pure-torch path: attention groups with gather indices and masks."""
        inv = self.model.batch_invariant
        ids: list[int] = []
        pos_parts = []
        write_parts = []
        want = _LogitRows()
        dec_rows: list[int] = []
        dec_slots: list[torch.Tensor] = []
        dec_ctx: list[int] = []
        prefills = []
        fed: list[tuple[_ReqState, int]] = []
        row = 0
        for s, st, n, ctx in self._rows(seqs):
            sl = st.slots_t[:ctx]
            fed.append((st, n))
            ids.extend(s.token_ids)
            pos_parts.append(self._arange[s.start_pos: ctx])
            write_parts.append(sl[s.start_pos: ctx])
            if n == 1:
                dec_rows.append(row)
                dec_slots.append(sl)
                dec_ctx.append(ctx)
            else:
                prefills.append((row, n, s.start_pos, sl))
            want.add(s, st, row, n)
            row += n
        T = row
        pad = self.model.min_rows - T if (inv and T < self.model.min_rows) else 0
        if pad:  # padding rows (token 0, position 0, scratch slot) so every GEMM has >= min_rows rows
            ids.extend([0] * pad)
            pos_parts.append(self._zeros[:pad])
            write_parts.append(self._scratch[:pad])
            T += pad
        head_off = self._head_off
        groups = self._torch_groups(dec_rows, dec_slots, dec_ctx, prefills, T)
        write = torch.cat(write_parts) if len(write_parts) > 1 else write_parts[0]
        inp = StepInput(
            input_ids=torch.tensor(ids, dtype=torch.long),
            positions=torch.cat(pos_parts) if len(pos_parts) > 1 else pos_parts[0],
            write_index=(head_off + write.view(1, -1)).view(-1),
            groups=groups,
            logits_index=want.index(T),
            num_tokens=T, lora_rows=self._lora_rows(fed),
        )
        return inp, want

    def _key_span(self, ctx: int) -> tuple[int, int]:
        """(keys padded, blocks) for a context of ctx keys: whole kv_block blocks when batch
        invariant (a row reduces block by block whatever the batch), else one span padded to 16."""
        if self.model.batch_invariant:
            Lp = _round_up(ctx, self.kv_block)
            return Lp, Lp // self.kv_block
        return _round_up(ctx, 16), 1

    def _torch_groups(self, dec_rows, dec_slots, dec_ctx, prefills, T: int) -> list[AttnGroup]:
        """Attention groups of the pure-torch path: all decodes as one padded batch, each
        prefill chunk alone; keys padded to whole blocks (invariant) or to 16."""
        head_off = self._head_off
        groups: list[AttnGroup] = []
        if dec_rows:
            B = len(dec_rows)
            Lp, nb = self._key_span(max(dec_ctx))
            gs = torch.nn.utils.rnn.pad_sequence(dec_slots, batch_first=True)   # [B, Lmax], pads with 0
            if gs.shape[1] < Lp:
                gs = torch.nn.functional.pad(gs, (0, Lp - gs.shape[1]))
            ctx_t = torch.tensor(dec_ctx, dtype=torch.long)
            invalid = self._arange[:Lp].unsqueeze(0) >= ctx_t.unsqueeze(1)        # [B, Lp]
            mask = torch.zeros((B, Lp), dtype=torch.float32).masked_fill_(invalid, float("-inf"))
            tok_idx = None if B == T else torch.tensor(dec_rows, dtype=torch.long)
            groups.append(AttnGroup(token_index=tok_idx, gather=(head_off + gs.view(1, -1)).view(-1),
                                    mask=mask.view(B, nb, 1, 1, Lp // nb), B=B, q_len=1, Lp=Lp, nb=nb))
        for (r0, n, start, sl) in prefills:
            ctx = start + n
            Lp, nb = self._key_span(ctx)
            gs = torch.zeros(Lp, dtype=torch.long)
            gs[:ctx] = sl
            invalid = self._arange[:Lp].unsqueeze(0) > self._arange[start: ctx].unsqueeze(1)   # [n, Lp]
            mask = torch.zeros((n, Lp), dtype=torch.float32).masked_fill_(invalid, float("-inf"))
            mask = mask.view(n, nb, Lp // nb).transpose(0, 1).contiguous().view(1, nb, 1, n, Lp // nb)
            tok_idx = None if (n == T) else torch.arange(r0, r0 + n, dtype=torch.long)
            groups.append(AttnGroup(token_index=tok_idx, gather=(head_off + gs.view(1, -1)).view(-1),
                                    mask=mask, B=1, q_len=n, Lp=Lp, nb=nb))
        return groups

    def forward_logits(self, seqs: list[ScheduledSeq]) -> tuple[torch.Tensor, list[_ReqState]]:
        """Run the forward; returns logits (float32) for the seqs that sample: one row each, and
        one more per draft of a seq that verifies drafts."""
        logits, want, _ = self._forward(seqs)
        return logits[: len(want.rows)], want.sampled

    def _forward(self, seqs: list[ScheduledSeq], fill_masks: bool = False
                 ) -> tuple[torch.Tensor, _LogitRows, Optional[Future]]:
        """The step's logits and rows; with fill_masks, also the grammar masks of the sampled rows
        (a Future, or None), filled in the grammar hook's thread while the forward runs."""
        t0 = time.perf_counter()
        inp, want = self.build_input(seqs)          # takes this step's tokens into the sampler's records
        masks = self._fill_masks_beside(seqs, want) if fill_masks else None
        if self.device.type != "cpu":
            inp = _to_device(inp, self.device)
        t1 = time.perf_counter()
        logits = self.model.forward(inp, self.kv_pool)
        parts = self.last_parts
        parts["prepare"], parts["forward"] = t1 - t0, time.perf_counter() - t1
        return logits, want, masks

    def _fill_masks_beside(self, seqs: list[ScheduledSeq], want: _LogitRows) -> Optional[Future]:
        """None where there is no grammar row, or drafts in the step (verify rows are not one per
        request; grammar rows never draft), or the overlap is off (SHEPHERD_GRAMMAR_OVERLAP)."""
        grammar = self.sampler.grammar
        if (not self.masks_beside_forward or grammar is None or any(s.num_draft for s in seqs)
                or not any(st.seq.params.grammar is not None for st in want.sampled)):
            return None
        return grammar.fill_async([st.seq for st in want.sampled], self.model_config.vocab_size)

    def _run(self, seqs: list[ScheduledSeq], res: StepResult) -> None:
        logits, want, masks = self._forward(seqs, fill_masks=True)
        t0 = time.perf_counter()
        try:
            self._sample(seqs, logits, want, res, masks)
        finally:
            self.last_parts["sample"] = time.perf_counter() - t0

    def _sample(self, seqs: list[ScheduledSeq], logits: torch.Tensor, want: _LogitRows, res: StepResult,
                masks: Optional[Future] = None) -> None:
        mask = masks.result() if masks is not None else None      # TokenMask of the sampled rows, or None
        sampled = want.sampled
        if want.prompt:
            self._score_prompts(logits[len(want.rows):], want.prompt)
            logits = logits[: len(want.rows)]
        if not sampled:
            return
        runs = [s for s in seqs if s.sample and s.token_ids]      # in the order of `sampled`
        if any(s.num_draft for s in runs):
            self._sample_verify(logits, runs, sampled, res)
        else:
            states = [st.seq for st in sampled]
            tokens, lps = self.sampler.sample(logits, states, mask)
            for seq, t, lp in zip(states, tokens, lps):
                res.tokens[seq.req_id] = [t]
                if lp is not None:
                    res.logprobs[seq.req_id] = [lp]
        grammar = self.sampler.grammar
        if grammar is not None and grammar.failed:
            for rid, err in grammar.failed.items():   # the scheduler ends these with the error
                res.errors[rid] = err
                res.tokens.pop(rid, None)
                res.logprobs.pop(rid, None)
            grammar.failed.clear()
        if self.drafter is not None:
            want = [(s, st.seq) for s, st in zip(runs, sampled) if s.propose and s.req_id in res.tokens
                    and st.seq.params.grammar is None]    # a grammar's mask per draft is not built: no drafts
            if want:
                res.drafts = self.drafter.propose([(s.req_id, seq, res.tokens[s.req_id][-1], s.propose)
                                                   for s, seq in want])
        for st in sampled:
            if st.plp is not None and st.seq.req_id in res.tokens:   # its first token: hand them out once
                res.prompt_logprobs[st.seq.req_id] = [None, *st.plp]
                st.plp = None

    def _score_prompts(self, logits: torch.Tensor, where: list[tuple[_ReqState, int]]) -> None:
        """Each scored position's logprob of the prompt token after it (log-softmax of the raw
        logits, as vLLM's prompt_logprobs), with its rank and the request's top-N alternatives."""
        k = max(st.plp_top for st, _ in where)
        for a in range(0, len(where), 256):      # a block at a time: rows x vocabulary floats each
            part = where[a: a + 256]
            lp = torch.log_softmax(logits[a: a + len(part)].float(), dim=-1)
            target = torch.tensor([st.prompt[p + 1] for st, p in part], dtype=torch.long, device=lp.device)
            chosen_t = lp.gather(1, target.view(-1, 1))
            ranks = ((lp > chosen_t).sum(dim=1) + 1).tolist()
            chosen = chosen_t.view(-1).tolist()
            top_v, top_i = [[]] * len(part), [[]] * len(part)
            if k:
                v, ix = lp.topk(k, dim=-1)
                top_v, top_i = v.tolist(), ix.tolist()
            for i, (st, p) in enumerate(part):
                n = st.plp_top
                st.plp.append(TokenLogprob(st.prompt[p + 1], chosen[i], list(zip(top_i[i][:n], top_v[i][:n])),
                                           ranks[i]))

    def _sample_verify(self, logits: torch.Tensor, runs: list[ScheduledSeq], sampled: list[_ReqState],
                       res: StepResult) -> None:
        """A step with drafts: plain rows through Sampler.sample, each verify's rows through
        Sampler.verify (the tokens it keeps)."""
        plain_rows: list[int] = []
        plain: list = []
        ver: list = []
        ver_drafts: list[list[int]] = []
        ver_rows: list[int] = []
        r = 0
        for s, st in zip(runs, sampled):
            if s.num_draft:
                ver.append(st.seq)
                ver_drafts.append(s.token_ids[len(s.token_ids) - s.num_draft:])
                ver_rows.append(r)
            else:
                plain_rows.append(r)
                plain.append(st.seq)
            r += 1 + s.num_draft
        if plain:
            idx = torch.tensor(plain_rows, dtype=torch.long, device=logits.device)
            tokens, lps = self.sampler.sample(logits.index_select(0, idx), plain)
            for seq, t, lp in zip(plain, tokens, lps):
                res.tokens[seq.req_id] = [t]
                if lp is not None:
                    res.logprobs[seq.req_id] = [lp]
        toks, lps = self.sampler.verify(logits, ver, ver_drafts, ver_rows)
        for seq, t, lp in zip(ver, toks, lps):
            res.tokens[seq.req_id] = t
            if lp:
                res.logprobs[seq.req_id] = lp
