"""KV cache events as vLLM publishes them, and their msgpack-ready wire shapes.

The field order of each event is vLLM's (``vllm/distributed/kv_events.py``): consumers that
read events as positional arrays (llm-d's kv-cache-manager, older vllm-router and Dynamo)
index by it. vLLM encodes each event as a msgspec tagged struct with ``omit_defaults``:

- ``array``: ``[tag, field, ...]``, vLLM up to 0.23 (``array_like=True``);
- ``map``: ``{"type": tag, field: value, ...}``, vLLM from #42892 (0.24) on.

The batch around them is the positional ``[ts, events, data_parallel_rank]`` either way.
Fields vLLM leaves at their defaults (extra_keys, group_idx, the cache spec) are left out,
as ``omit_defaults`` does; vLLM always writes the ones without a default, None or not.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

# vLLM's name for the tier its prefix cache lives on (MEDIUM_GPU), written whatever the
# device: consumers read another medium (llm-d: "cpu") as an offload tier, scored lower.
MEDIUM = "GPU"


@dataclass(slots=True)
class BlockStored:
    block_hashes: list[int]
    parent_block_hash: int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = MEDIUM
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    block_hashes: list[int]
    medium: str | None = MEDIUM


@dataclass(slots=True)
class AllBlocksCleared:
    pass


Event = BlockStored | BlockRemoved | AllBlocksCleared

_FIELDS = {cls: tuple(f.name for f in fields(cls)) for cls in Event.__args__}


def encode_event(event: Event, encoding: str) -> list[Any] | dict[str, Any]:
    """``event`` as vLLM's msgspec writes it: a tagged array (``array``) or map (``map``)."""
    tag = type(event).__name__
    names = _FIELDS[type(event)]
    if encoding == "array":
        return [tag, *(getattr(event, name) for name in names)]
    return {"type": tag, **{name: getattr(event, name) for name in names}}


def encode_batch(ts: float, events: list[Event], encoding: str, dp_rank: int = 0) -> list[Any]:
    """vLLM's ``KVEventBatch`` (always ``array_like``): ``[ts, events, data_parallel_rank]``."""
    return [ts, [encode_event(e, encoding) for e in events], dp_rank]
