"""Who drafts a request's next tokens for speculative decoding (SpeculativeConfig.method).

    drafter = make_drafter(spec_cfg, engine_cfg, executor)   # None when speculation is off
    drafts = drafter.propose([(req_id, sampling_state, last_token, k), ...])   # req_id -> up to k tokens
    drafter.forget(req_id)

A drafter keeps its own per-request state, as the executor and the sampler do.
It sees a request's committed tokens only: its prompt, its output_ids (the
sampler's record: fed tokens, rejected drafts already dropped) and the token
just sampled, which the next step feeds.
"""
from __future__ import annotations

from typing import Any, Optional, Protocol

from shepherd.config import EngineConfig, SpeculativeConfig
from shepherd.model.sampler import SamplingState


class Drafter(Protocol):
    def propose(self, items: list[tuple[str, SamplingState, int, int]]) -> dict[str, list[int]]: ...

    def forget(self, req_id: str) -> None: ...


def make_drafter(spec: Optional[SpeculativeConfig], cfg: EngineConfig, executor: Any) -> Optional[Drafter]:
    if spec is None:
        return None
    if spec.method == "ngram":
        from shepherd.engine.spec_ngram import NgramDrafter
        return NgramDrafter(spec.prompt_lookup_min, spec.prompt_lookup_max)
    from shepherd.engine.spec_model import DraftModelDrafter
    return DraftModelDrafter(spec, cfg, executor)
