"""Every knob, one dataclass per layer, with defaults and validation.

Names follow docs/DESIGN.md ("Scheduling: what the seeds ask for, by name").
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass, field, fields
from typing import Optional

ADMISSION_MODES = ("guaranteed", "peak", "optimistic")
PREEMPTION_MODES = ("recompute", "swap")
POLICIES = ("fcfs", "lof", "random", "lpm", "dfs-weight", "priority", "vtc")
VICTIMS = ("last", "fewest-output", "lowest-priority")
SPEC_METHODS = ("ngram", "draft_model")
ADAPTER_POLICIES = ("fit", "rotate")
VTC_UNITS = ("client", "adapter")


class ConfigError(ValueError):
    """A knob has a value that cannot work; the message says which and why."""


INF = math.inf


def check_ranges(args, rows) -> None:
    """The commands' numeric flags, checked before anything runs (simulate, bench, gateway, epp,
    calibrate). rows: (attribute, lowest, highest, strict[, unit]): a flag whose value is not None
    must lie in the range (above `lowest` when strict, else from it). NaN fails every comparison,
    so it is refused too. ConfigError (a ValueError) names the flag: `--page-size must be >= 1, got 0`."""
    for name, lo, hi, strict, *unit in rows:
        v = getattr(args, name, None)
        if v is None:
            continue
        if not ((v > lo if strict else v >= lo) and v <= hi):
            where = (f"> {lo:g}" if strict else f">= {lo:g}") + (f" and <= {hi:g}" if hi != INF else "")
            raise ConfigError(f"--{name.replace('_', '-')} must be {where}{''.join(' ' + u for u in unit)}, got {v}")


@dataclass
class SpeculativeConfig:
    """Speculative decoding, vLLM's --speculative-config (the same keys, as JSON): after each step
    the executor drafts a running request's next tokens, and the next step feeds its last token
    plus up to num_speculative_tokens drafts, verifying them in one forward (docs/SPECULATIVE.md).
    The scheduler counts the drafts against max_num_tokens and the KV budget."""
    method: str = "ngram"                 # ngram (prompt lookup: no weights) | draft_model
    num_speculative_tokens: int = 3       # drafts verified per request and step, at most
    prompt_lookup_max: int = 3            # ngram: the longest suffix looked up in the request's own tokens
    prompt_lookup_min: int = 1            # ngram: the shortest
    model: Optional[str] = None           # draft_model: a smaller Llama (GGUF or HF folder); None: the target
    quantization: Optional[str] = None    # draft_model: its weights (the target's own at int4: self-speculation)
    # no drafts in a step with more requests decoding than this (0: never off): above it a verify
    # row costs more than the tokens it wins (measured: docs/SPECULATIVE.md)
    disable_by_batch_size: int = 8
    # the simulated executor only: each draft's chance to be accepted (given the ones before it)
    acceptance_rate: float = 0.6

    KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min", "model",
            "quantization", "disable_by_batch_size", "acceptance_rate")

    @classmethod
    def from_json(cls, text: Optional[str]) -> Optional["SpeculativeConfig"]:
        """--speculative-config '{"method": "ngram", "num_speculative_tokens": 3}'; None or "" = off."""
        if not text:
            return None
        import json
        try:
            d = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--speculative-config is not valid JSON: {e}") from None
        if not isinstance(d, dict):
            raise ConfigError("--speculative-config must be a JSON object, e.g. "
                              '\'{"method": "ngram", "num_speculative_tokens": 3}\'')
        unknown = sorted(set(d) - set(cls.KEYS))
        if unknown:
            raise ConfigError(f"--speculative-config: unknown keys {unknown}; known: {', '.join(cls.KEYS)}")
        return cls(**d).validate()

    def validate(self) -> "SpeculativeConfig":
        if self.method not in SPEC_METHODS:
            raise ConfigError(f"speculative method must be one of {SPEC_METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ConfigError(f"speculative {name} must be an integer >= 1, got {v!r}")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ConfigError(f"speculative prompt_lookup_min ({self.prompt_lookup_min}) exceeds "
                              f"prompt_lookup_max ({self.prompt_lookup_max})")
        if not isinstance(self.disable_by_batch_size, int) or self.disable_by_batch_size < 0:
            raise ConfigError(f"speculative disable_by_batch_size must be an integer >= 0, "
                              f"got {self.disable_by_batch_size!r}")
        if not (0.0 <= float(self.acceptance_rate) <= 1.0):
            raise ConfigError(f"speculative acceptance_rate must be in [0, 1], got {self.acceptance_rate!r}")
        if self.method == "ngram" and (self.model or self.quantization):
            raise ConfigError("speculative method ngram takes no model or quantization (those are draft_model's)")
        if self.method == "draft_model" and not self.model and self.quantization in (None, "none"):
            raise ConfigError("speculative method draft_model needs a model, or a quantization for the target's "
                              "own weights (self-speculation, e.g. \"quantization\": \"int4\")")
        return self

    def drafts_allowed(self, decoding: int) -> bool:
        """Whether a step with `decoding` requests decoding verifies drafts at all."""
        return not self.disable_by_batch_size or decoding <= self.disable_by_batch_size


# `shepherd serve`'s --max-prefill-ms-with-decodes. Why on there and 30 (docs/SERVING.md, "The enum
# row", measured on a 2-core Xeon): ten requests admitted at once no longer stall the running
# streams for one ~0.4 s step (the time budget gives ~25 prompt tokens a step there), the trace's
# ITL p99 falls to 0.20-0.24x at +5-18 % median TTFT; on a GPU-like cost model the count is
# ~1,700 tokens and the figures barely move. The simulator keeps it off unless asked (its figures
# are GPU ones, and feeding the estimate every fast-forwarded step costs simulator time).
SERVE_PREFILL_MS = 30.0


@dataclass
class SchedulerConfig:
    max_total_tokens: int = 65536        # KV capacity in tokens (the engine sets it from the pool it built)
    max_batch_size: int = 256            # requests running at once
    max_num_tokens: int = 2048           # tokens computed in one step; longer prompts are chunked
    max_concurrency: int = 1024          # requests in the system (running + waiting); beyond -> 429
    max_queue: int = 4096                # requests waiting; beyond -> 429
    page_size: int = 1                   # KV allocation granularity in tokens (1 = token granularity)
    admission: str = "optimistic"
    preemption: str = "recompute"
    victim: str = "last"                 # who is preempted first: last admitted (vLLM), fewest-output (SGLang), lowest-priority
    policy: str = "fcfs"
    prefix_cache: bool = True
    # prefill/decode interleave: prefill-first by default; at most this many
    # consecutive steps may run prefill chunks while decodes wait (0 = unbounded).
    max_consecutive_prefill: int = 8
    # decode-first mode (LightLLM): run decodes, and admit new prefills every N steps (0 = off).
    decode_first_prefill_every: int = 0
    # multi-step scheduling (vLLM v0.6 --num-scheduler-steps N): a decode batch is scheduled
    # for N steps at once, so nothing is admitted until those N steps are done (a prefill
    # step is one step). Counted in steps: the scheduler still reads no clock. 1 = off.
    multi_step: int = 1
    # mixed steps (vLLM): running decodes ride along in every prefill step, within
    # max_num_tokens, so a prefill never stalls decodes. Off: a step is prefill-only or
    # decode-only (SGLang), with max_consecutive_prefill bounding how long decodes wait.
    # admission=peak never mixes: its exact estimate needs requests to grow in lockstep.
    mixed_steps: bool = True
    # Sarathi-Serve's token budget for a step that carries running decodes: at most this many
    # prompt tokens beside them (prefill chunks and admissions; 0 = off, max_num_tokens alone).
    # Ten prompts admitted together otherwise prefill in the one step every running stream
    # waits for (docs/SERVING.md, "The enum row"); a step with no decodes still takes
    # max_num_tokens. Trades the newcomers' time to first token for the running streams' gaps.
    max_prefill_tokens_with_decodes: int = 0
    # the same bound as a time: prompt tokens beside decodes add at most about this many
    # milliseconds to the step (0 = off). The engine core turns it into a token count from the
    # steps it measures (engine/prefill_budget.py) and hands the scheduler that number; with the
    # token cap set too, the smaller applies. A time means the same on a CPU and on a GPU.
    # Off here (the library, offline, simulate); `shepherd serve` defaults to SERVE_PREFILL_MS.
    max_prefill_ms_with_decodes: float = 0.0
    # optimistic admission: SGLang's new_token_ratio reserve for growth
    new_token_ratio_init: float = 0.7
    new_token_ratio_min: float = 0.1
    new_token_ratio_decay_steps: int = 600
    reserve_cap_tokens: int = 4096       # per-request cap on the growth reserve
    # aging: a request that has waited this many scheduler steps is served first under the
    # policies that can starve one (lof, random, lpm, dfs-weight, priority; not vtc, whose
    # counters serve every backlogged client: policy.py), and is never overtaken when it does not fit
    aging_steps: int = 200
    lpm_fcfs_threshold: int = 128        # lpm falls back to fcfs when more requests wait (SGLang)
    lookahead: int = 8                   # waiting requests examined past a head that does not fit
    vtc_input_weight: float = 1.0
    vtc_output_weight: float = 2.0
    vtc_unit: str = "client"             # whose counters vtc keeps: the client's, or the LoRA adapter's
    # LoRA adapters (docs/SCHEDULING.md "Adapters"): at most max_loras distinct adapters run in one
    # step, and as many are resident in the executor's adapter slots. fit: a request whose adapter
    # cannot get a slot is skipped (vLLM), an aged one stops admission until a slot frees; rotate:
    # LoRAX's active set, which admits only its adapters' requests and hands an adapter's place to
    # a waiting one after adapter_cycle_time seconds.
    max_loras: int = 8
    adapter_policy: str = "fit"
    adapter_cycle_time: float = 2.0
    seed: int = 0                        # for --policy random
    # test switch: force a preemption of one running request every k steps (0 = off)
    debug_preempt_every: int = 0
    # speculative decoding (None: off); admission=peak never speculates (as it never mixes: its
    # estimate needs every request to grow one token a step)
    speculative: Optional[SpeculativeConfig] = None

    def validate(self) -> "SchedulerConfig":
        if self.admission not in ADMISSION_MODES:
            raise ConfigError(f"admission must be one of {ADMISSION_MODES}, got {self.admission!r}")
        if self.preemption not in PREEMPTION_MODES:
            raise ConfigError(f"preemption must be one of {PREEMPTION_MODES}, got {self.preemption!r}")
        if self.policy not in POLICIES:
            raise ConfigError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.victim not in VICTIMS:
            raise ConfigError(f"victim must be one of {VICTIMS}, got {self.victim!r}")
        if self.adapter_policy not in ADAPTER_POLICIES:
            raise ConfigError(f"adapter_policy must be one of {ADAPTER_POLICIES}, got {self.adapter_policy!r}")
        if self.vtc_unit not in VTC_UNITS:
            raise ConfigError(f"vtc_unit must be one of {VTC_UNITS}, got {self.vtc_unit!r}")
        if not self.adapter_cycle_time > 0:
            raise ConfigError(f"adapter_cycle_time must be > 0 seconds, got {self.adapter_cycle_time}")
        for name in ("max_total_tokens", "max_batch_size", "max_num_tokens", "page_size",
                     "max_concurrency", "max_queue", "multi_step", "max_loras"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_prefill_tokens_with_decodes < 0:
            raise ConfigError(f"max_prefill_tokens_with_decodes must be >= 0 (0 = off), "
                              f"got {self.max_prefill_tokens_with_decodes}")
        ms = self.max_prefill_ms_with_decodes
        if not (isinstance(ms, (int, float)) and math.isfinite(ms) and ms >= 0):
            raise ConfigError(f"max_prefill_ms_with_decodes must be a finite number >= 0 (0 = off), got {ms!r}")
        if self.decode_first_prefill_every > 0 and self.multi_step > 1:
            raise ConfigError("decode_first_prefill_every and multi_step each choose a step shape "
                              "(LightLLM decode-first, vLLM v0.6 multi-step); set one of them")
        if self.max_total_tokens % self.page_size:
            raise ConfigError("max_total_tokens must be a multiple of page_size")
        if self.speculative is not None:
            self.speculative.validate()
        return self


def whole_pages(tokens: int, page_size: int) -> int:
    """A KV capacity the executor sized, in whole pages (the scheduler allocates pages)."""
    return tokens - tokens % page_size


def host_pool_tokens(host_kv_tokens: int, device_tokens: int, preemption: str) -> int:
    """The host (swap) pool: as asked, else as large as the device pool when preemption swaps."""
    if host_kv_tokens:
        return int(host_kv_tokens)
    return int(device_tokens) if preemption == "swap" else 0


@dataclass
class ModelConfig:
    """Architecture of a Llama-family model. Every field comes from the model itself (GGUF
    metadata or config.json, model/loader.py, with that format's own fallbacks): there is no
    default model architecture to fall back to."""
    architecture: str                 # llama | qwen2
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: Optional[dict]
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool              # Qwen2 has q/k/v biases


@dataclass
class KVEventsConfig:
    """`--kv-events-config JSON`: vLLM's KVEventsConfig, same field names and defaults
    (vllm/config/kv_events.py). docs/ROUTING.md ("Fleets") describes the stream."""
    enable_kv_cache_events: bool = False
    publisher: Optional[str] = None      # "zmq" | "null"; None: "zmq" when enabled, else "null"
    endpoint: str = "tcp://*:5557"       # PUB; a "*" / "::" host (or ipc://, inproc://) binds, else connects
    replay_endpoint: Optional[str] = None  # ROUTER, always bound; None: no replay
    buffer_steps: int = 10_000           # batches kept for replay
    hwm: int = 100_000                   # the PUB socket's high-water mark
    max_queue_size: int = 100_000        # batches waiting for the publisher thread; beyond: see publisher.py
    topic: str = ""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and (self.publisher or "zmq") == "zmq"

    @classmethod
    def from_json(cls, text: str) -> "KVEventsConfig":
        try:
            raw = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--kv-events-config is not JSON: {e}") from None
        if not isinstance(raw, dict):
            raise ConfigError("--kv-events-config must be a JSON object")
        known = {f.name: f for f in fields(cls)}
        unknown = sorted(set(raw) - set(known))
        if unknown:
            raise ConfigError(f"--kv-events-config: unknown field(s) {unknown}; known: {sorted(known)}")
        cfg = cls(**raw)
        if cfg.publisher not in (None, "zmq", "null"):
            raise ConfigError(f"--kv-events-config: publisher must be 'zmq' or 'null', got {cfg.publisher!r}")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            v = getattr(cfg, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"--kv-events-config: {name} must be an integer >= 1, got {v!r}")
        for name in ("endpoint", "topic"):
            if not isinstance(getattr(cfg, name), str):
                raise ConfigError(f"--kv-events-config: {name} must be a string")
        if not isinstance(cfg.enable_kv_cache_events, bool):
            raise ConfigError("--kv-events-config: enable_kv_cache_events must be true or false")
        return cfg


@dataclass
class LoraConfig:
    """LoRA adapters the engine serves beside its base model (docs/SERVING.md "LoRA adapters").
    How many are resident at once is the scheduler's max_loras."""
    enabled: bool = False                 # adapter slots exist (--enable-lora, implied by --lora-modules)
    modules: dict[str, str] = field(default_factory=dict)   # name -> PEFT folder, loaded at start
    max_cpu_loras: int = 0                # adapters kept in host memory; 0 = max(max_loras, modules)
    max_lora_rank: int = 16

    def validate(self, max_loras: int) -> "LoraConfig":
        if self.max_lora_rank < 1:
            raise ConfigError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        if self.max_cpu_loras and self.max_cpu_loras < max_loras:
            raise ConfigError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({max_loras}): "
                              "an adapter in a slot is also kept in host memory")
        if self.max_cpu_loras < 0:
            raise ConfigError(f"max_cpu_loras must be >= 0, got {self.max_cpu_loras}")
        return self

    def host_adapters(self, max_loras: int) -> int:
        """Adapters kept in host memory (the others are read from disk again when needed)."""
        return self.max_cpu_loras or max(max_loras, len(self.modules))


@dataclass
class EngineConfig:
    model: Optional[str] = None                   # path to .gguf or a HF folder; None = the default SmolLM2
    dtype: str = "bfloat16"
    executor: str = "torch"                       # torch | sim
    max_total_tokens: Optional[int] = None        # KV capacity; None = from kv_cache_memory_fraction
    kv_cache_memory_fraction: float = 0.1         # of free memory after loading, on CPU a share of RAM
    host_kv_tokens: int = 0                       # swap pool size; 0 = same as the device pool when preemption=swap
    batch_invariant: bool = True                  # measured cost at 64 streams under 10 % (docs/MODEL.md)
    num_threads: Optional[int] = None
    kernels: str = "auto"                         # auto | fused | torch (docs/MODEL.md "Kernels")
    quantization: str = "none"                    # none | int8 | int4 | auto (GGUF: keep Q4/Q8 blocks)
    device: str = "cpu"                           # cpu | cuda | cuda:N
    watchdog_timeout: float = 300.0
    log_every_steps: int = 40                     # decode log line cadence
    max_grammar_memory: int = 1 << 30             # bytes of compiled grammars requests may hold; beyond -> 429; 0 = no bound
    kv_events: Optional[KVEventsConfig] = None    # publish prefix-cache changes (vLLM's KV events)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: Optional[str] = None
    served_model_name: Optional[str] = None
    max_body_bytes: Optional[int] = None  # larger bodies get 413 before parsing; None = from the context
    max_json_depth: int = 64             # deeper JSON bodies get 400 before parsing
    body_timeout: float = 30.0           # seconds for a whole request body to arrive; slower -> 408
    max_grammar_bytes: int = 128 << 10   # larger grammar specs (schema, regex, choices, EBNF) get 400
    grammar_timeout: float = 5.0         # a grammar that does not compile in this many seconds gets 400
    # what one answer may hold in the server, in logprob entries (choices x tokens x (alternatives
    # + 1); tokens too for a stream): a non-streamed answer whole (more: 400), a streamed one what
    # its client has not read yet (more: the answer is cut). ~150 B an entry (docs/SERVING.md)
    max_logprob_entries: int = 1 << 20
    warm_grammar_worker: bool = False    # start the grammar worker process with the server
    chat_template: Optional[str] = None  # jinja text replacing the model's template (--chat-template FILE)
    tool_call_parser: str = "hermes"     # hermes | json: how tool calls are found in the text (tool_choice auto)
