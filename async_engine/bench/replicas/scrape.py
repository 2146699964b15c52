"""Each replica's /metrics, read before and after a phase: what the replica itself saw."""

from __future__ import annotations

import urllib.request
from dataclasses import dataclass, fields


@dataclass(slots=True, frozen=True)
class ReplicaCounters:
    requests: float = 0.0  # finished requests, every finish reason
    aborted: float = 0.0
    prompt_tokens: float = 0.0
    prefix_queries: float = 0.0  # prompt tokens looked up in the prefix cache
    prefix_hits: float = 0.0  # of those, found there
    running: float = 0.0  # a gauge: as of the last refresh, not differenced
    block_size: int | None = None


# sample name -> field; counters end in _total in the exposition format
_SUMMED = {
    "vllm:request_success_total": "requests",
    "vllm:prompt_tokens_total": "prompt_tokens",
    "vllm:prefix_cache_queries_total": "prefix_queries",
    "vllm:prefix_cache_hits_total": "prefix_hits",
    "vllm:num_requests_running": "running",
}


def parse_metrics(text: str) -> ReplicaCounters:
    # Imported here, as the other benches do: `async-engine bench` loads every bench module.
    from prometheus_client.parser import text_string_to_metric_families

    values = {name: 0.0 for name in _SUMMED.values()}
    aborted, block_size = 0.0, None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name in _SUMMED:
                values[_SUMMED[sample.name]] += sample.value
            if (
                sample.name == "vllm:request_success_total"
                and sample.labels.get("finished_reason") == "abort"
            ):
                aborted += sample.value
            if sample.name == "vllm:cache_config_info" and "block_size" in sample.labels:
                block_size = int(sample.labels["block_size"])
    return ReplicaCounters(aborted=aborted, block_size=block_size, **values)


# vllm-router's count of kv_aware placement lookups, labelled by result: "hit" (some of the
# prompt's prefix is in a worker's KV events), "miss", "missing_tokens" (it had no token
# ids for the prompt), ...
ROUTER_KV_LOOKUPS = "vllm_router_kv_placement_lookups_total"


def parse_kv_lookups(text: str) -> dict[str, float]:
    """A router's /metrics: its KV lookups so far, by result."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == ROUTER_KV_LOOKUPS:
                result = sample.labels.get("result", "?")
                out[result] = out.get(result, 0.0) + sample.value
    return out


def delta(before: ReplicaCounters, after: ReplicaCounters) -> ReplicaCounters:
    """What a phase added to the counters (the gauge and block size as of its end)."""
    keep = {"running", "block_size"}
    return ReplicaCounters(
        **{
            f.name: getattr(after, f.name)
            if f.name in keep
            else getattr(after, f.name) - getattr(before, f.name)
            for f in fields(ReplicaCounters)
        }
    )


def scrape(base_url: str, timeout_s: float = 5.0) -> ReplicaCounters:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=timeout_s) as response:
        return parse_metrics(response.read().decode())
