"""Where an engine core is put together: the one place a configuration is validated, the
KV capacity rounded to whole pages and the host pool sized.

    served = build_served_core(cfg)            # serve: the core process and the in-thread Engine
    core = assemble(sched_cfg, executor, clock)  # any driver with a validated config (simulate, calibrate)

build_served_core makes the executor the config names (torch: the real model;
sim: the simulated executor, paced on the wall clock), sizes the scheduler to
the KV pool the executor built, validates the scheduler's knobs once, and
wraps the EngineCore for the server (core_loop.ServedCore). The simulator
sizes its replicas from a cost model instead and calls `assemble` per replica.
"""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional

from shepherd.config import EngineConfig, SchedulerConfig, host_pool_tokens, whole_pages
from shepherd.engine.core import Clock, EngineCore, WallClock
from shepherd.engine.core_loop import CoreInfo, ServedCore
from shepherd.scheduler.scheduler import Scheduler
from shepherd.step import Executor


def assemble(sched_cfg: SchedulerConfig, executor: Executor, clock: Clock) -> EngineCore:
    """A Scheduler over the executor's pools (the config validated, its capacity in whole
    pages of the executor's pool) stepped with it on `clock`."""
    sched = Scheduler(sched_cfg, host_kv_capacity=executor.host_kv_capacity, max_model_len=executor.max_model_len)
    return EngineCore(sched, executor, clock)


def build_served_core(cfg: EngineConfig, executor: Optional[Executor] = None,
                      tokenizer: Any = None) -> ServedCore:
    if executor is None:
        executor = make_executor(cfg, tokenizer)
    if tokenizer is None:
        tokenizer = executor.tokenizer
        if tokenizer is None:
            from shepherd.model.loader import load_tokenizer
            tokenizer = load_tokenizer(cfg.model)
    page = cfg.scheduler.page_size
    # a capacity the user gave must be whole pages (validate says so); one the executor
    # derived from memory is rounded down to them
    cap = executor.kv_capacity if cfg.max_total_tokens else whole_pages(executor.kv_capacity, max(1, page))
    sched_cfg = dataclasses.replace(cfg.scheduler, max_total_tokens=int(cap)).validate()
    core = assemble(sched_cfg, executor, WallClock(executor.paced))
    info = CoreInfo(kv_capacity=int(cap), host_kv_capacity=int(executor.host_kv_capacity),
                    max_model_len=int(executor.max_model_len),
                    eos_token_ids=tuple(executor.eos_token_ids or tokenizer.eos_token_ids or ()),
                    model_name=str(executor.model_name or model_name_from_path(cfg.model)),
                    lora_adapters=tuple(executor.lora_adapters()), lora_enabled=executor.lora_enabled)
    kv_events = None
    if cfg.kv_events is not None and cfg.kv_events.enabled:
        from shepherd.kv_events.publisher import KVEventPublisher
        kv_events = KVEventPublisher(cfg.kv_events, core.scheduler.kv.record_cache_events())
    return ServedCore(core, info, tokenizer, cfg.log_every_steps, kv_events)


def make_executor(cfg: EngineConfig, tokenizer: Any = None) -> Executor:
    if cfg.executor == "sim":
        from shepherd.engine.sim_executor import SimExecutor
        from shepherd.model.loader import context_length, load_tokenizer
        if tokenizer is None:
            tokenizer = load_tokenizer(cfg.model)
        cap = int(cfg.max_total_tokens or cfg.scheduler.max_total_tokens)
        eos = tokenizer.eos_token_ids[0] if tokenizer.eos_token_ids else 0
        return SimExecutor(kv_capacity=cap, host_kv_capacity=host_pool_tokens(cfg.host_kv_tokens, cap,
                                                                              cfg.scheduler.preemption),
                           max_model_len=min(context_length(cfg.model), cap),
                           eos_token_id=eos, vocab_size=tokenizer.vocab_size,
                           eos_token_ids=tuple(tokenizer.eos_token_ids), tokenizer=tokenizer,
                           model_name=model_name_from_path(cfg.model),
                           acceptance_rate=cfg.scheduler.speculative.acceptance_rate
                           if cfg.scheduler.speculative else 0.0,
                           paced=True)  # the engine waits out the modelled step time on the wall clock
    if cfg.executor == "torch":
        from shepherd.engine.torch_executor import TorchExecutor
        return TorchExecutor(cfg)
    raise ValueError(f"executor must be 'torch' or 'sim', got {cfg.executor!r}")


def model_name_from_path(path: Optional[str]) -> str:
    try:
        from shepherd.model.loader import model_name_for
        return model_name_for(path)
    except Exception:  # noqa: BLE001
        pass
    if not path:
        return "SmolLM2-135M-Instruct"
    base = os.path.basename(os.path.normpath(path))
    for ext in (".gguf", ".safetensors"):
        if base.endswith(ext):
            base = base[: -len(ext)]
    return base or str(path)
