"""The wire format of KV events: msgpack, as vLLM 0.32 writes it.

One ZMQ message is three frames: [topic, sequence number as 8 bytes
big-endian, payload]. The payload is the batch as a positional array
`[ts, events, data_parallel_rank]` (the rank left out when None). Each event
is a map whose first key is "type" (the event's class name) followed by its
fields in declaration order; every field without a default is written, None
included (vLLM's msgspec structs with omit_defaults).

decode_batch reads that and the older positional encoding too (SGLang and
vLLM before its events became maps: each event an array `[type, field1,
field2, ...]` in declaration order). Unknown fields are ignored, missing
optional ones take their defaults, unknown event types are skipped (counted
in `DecodedBatch.unknown`). tests/data/kv_events_golden.bin pins the bytes
against vLLM's own encoder (benchmarks/kv_events_golden.py regenerates it).
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional

import msgpack

from shepherd.kv_events.events import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch

EVENT_TYPES = {cls.__name__: cls for cls in (BlockStored, BlockRemoved, AllBlocksCleared)}
_FIELDS = {name: tuple(f.name for f in fields(cls)) for name, cls in EVENT_TYPES.items()}
_REQUIRED = {"BlockStored": 4, "BlockRemoved": 1, "AllBlocksCleared": 0}   # leading fields without a default
END_SEQ = (-1).to_bytes(8, "big", signed=True)                           # the replay's end marker


class DecodeError(ValueError):
    """A payload that is not a KV event batch."""


@dataclass
class DecodedBatch:
    batch: EventBatch
    unknown: int = 0          # events of a type this reader does not know (skipped)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=seq < 0)


def seq_of(frame: bytes) -> int:
    """The sequence number frame; -1 is the replay's end marker."""
    if len(frame) != 8:
        raise DecodeError(f"sequence frame of {len(frame)} bytes, expected 8")
    return -1 if frame == END_SEQ else int.from_bytes(frame, "big")


# ------------------------------------------------------------------ encode
def event_map(ev: Any) -> dict:
    name = type(ev).__name__
    out: dict = {"type": name}
    for f in _FIELDS[name]:
        out[f] = getattr(ev, f)
    return out


def encode_batch(batch: EventBatch) -> bytes:
    arr: list = [float(batch.ts), [event_map(e) for e in batch.events]]
    if batch.data_parallel_rank is not None:
        arr.append(batch.data_parallel_rank)
    return msgpack.packb(arr, use_bin_type=True)


# ------------------------------------------------------------------ decode
def _event(obj: Any) -> Optional[Any]:
    """One event from a tagged map or a positional array; None when the type is unknown."""
    if isinstance(obj, dict):
        name = obj.get("type")
        if name not in EVENT_TYPES:
            return None
        names = _FIELDS[name]
        missing = [f for f in names[:_REQUIRED[name]] if f not in obj]
        if missing:
            raise DecodeError(f"{name} without {', '.join(missing)}")
        return EVENT_TYPES[name](**{f: obj[f] for f in names if f in obj})
    if isinstance(obj, (list, tuple)) and obj and isinstance(obj[0], str):
        name = obj[0]
        if name not in EVENT_TYPES:
            return None
        names = _FIELDS[name]
        vals = obj[1:1 + len(names)]
        if len(vals) < _REQUIRED[name]:
            raise DecodeError(f"{name} with {len(vals)} fields, expected at least {_REQUIRED[name]}")
        return EVENT_TYPES[name](**dict(zip(names, vals)))
    raise DecodeError(f"an event must be a map or an array, got {type(obj).__name__}")


def decode_batch(payload: bytes) -> DecodedBatch:
    try:
        obj = msgpack.unpackb(payload, raw=False, strict_map_key=False)
    except Exception as e:  # noqa: BLE001 - msgpack raises several types for bad input
        raise DecodeError(f"not msgpack: {e}") from None
    if isinstance(obj, dict):          # a map-encoded batch (not what vLLM sends; cheap to accept)
        obj = [obj.get("ts"), obj.get("events"), obj.get("data_parallel_rank")]
    if not isinstance(obj, (list, tuple)) or len(obj) < 2 or not isinstance(obj[1], (list, tuple)):
        raise DecodeError("a batch must be [ts, events, data_parallel_rank]")
    ts = obj[0]
    if not isinstance(ts, (int, float)):
        raise DecodeError(f"batch timestamp {ts!r} is not a number")
    rank = obj[2] if len(obj) > 2 else None
    events, unknown = [], 0
    for raw in obj[1]:
        ev = _event(raw)
        if ev is None:
            unknown += 1
        else:
            events.append(ev)
    return DecodedBatch(EventBatch(float(ts), events, rank), unknown)


__all__ = ["DecodeError", "DecodedBatch", "END_SEQ", "EVENT_TYPES", "decode_batch", "encode_batch", "event_map",
           "seq_bytes", "seq_of"]
