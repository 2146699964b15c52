"""Groups of prompts that share a long prefix: what a prefix-aware router can exploit.

G groups of M requests; every request of a group starts with the group's prefix and ends
with a suffix of its own. The send order is shuffled (seeded), so that a group's requests
are spread over the run and client-side round robin does not line groups up with
replicas by accident.

The C streams start together unless ``ramp_ms`` staggers them. Together, the first C
requests reach a router within a few ms, before any replica has prefilled (let alone
announced in a KV event) a prefix: a router that learns prefixes only from KV events
(vllm-router ``kv_aware``) cannot place the ones that repeat a group of that opening burst
(``burst_repeats``), and a group it splits then stays split. Unless the group is a session
(``sessions``: as agent clients do, every request names its conversation), which a router
can keep on one replica from its first request on.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# Token ids drawn from here exist in any vocabulary the engine serves (the default model's
# is 49152) and stay clear of the special tokens at the start.
TOKEN_RANGE = (100, 32000)


@dataclass(slots=True, frozen=True)
class Workload:
    groups: int = 8
    per_group: int = 8
    prefix_tokens: int = 512
    suffix_tokens: int = 32
    output_tokens: int = 64
    concurrency: int = 16
    seed: int = 0
    ramp_ms: float = 0.0  # stream k sends its first request k * ramp_ms after the phase starts
    sessions: bool = False  # each group is a session: its requests name it (x-session-id)

    def __post_init__(self) -> None:
        for name in ("groups", "per_group", "prefix_tokens", "suffix_tokens", "output_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.concurrency < 1:
            raise ValueError(f"concurrency must be >= 1, got {self.concurrency}")
        if self.ramp_ms < 0:
            raise ValueError(f"ramp_ms must be >= 0, got {self.ramp_ms}")

    @property
    def requests(self) -> int:
        return self.groups * self.per_group

    @property
    def prompt_tokens(self) -> int:
        """Prompt tokens of the whole run."""
        return self.requests * (self.prefix_tokens + self.suffix_tokens)


@dataclass(slots=True, frozen=True)
class Prompt:
    group: int
    index: int  # within its group
    tokens: list[int]


def build_prompts(workload: Workload, salt: int = 0) -> list[Prompt]:
    """The run's prompts in send order. ``salt`` draws other prefixes (same shape), so that
    a later phase on the same replicas starts with a cold prefix cache."""
    rng = random.Random(workload.seed * 1_000_003 + salt)
    low, high = TOKEN_RANGE
    prompts = []
    for group in range(workload.groups):
        prefix = [rng.randrange(low, high) for _ in range(workload.prefix_tokens)]
        for index in range(workload.per_group):
            suffix = [rng.randrange(low, high) for _ in range(workload.suffix_tokens)]
            prompts.append(Prompt(group, index, prefix + suffix))
    rng.shuffle(prompts)
    return prompts


def max_cached_tokens(workload: Workload, block_size: int) -> int:
    """The most prompt tokens a prefix cache can serve: every request of a group but the
    first reuses the prefix's full blocks (only whole blocks are cached)."""
    cached_prefix = workload.prefix_tokens // block_size * block_size
    return workload.groups * (workload.per_group - 1) * cached_prefix


def burst_repeats(prompts: list[Prompt], workload: Workload) -> int:
    """Requests of the opening burst (the first ``concurrency``, sent together when streams
    are not ramped) whose group an earlier request of the same burst already has."""
    if workload.ramp_ms > 0:
        return 0  # staggered: whether a repeat races its group's first depends on timing
    burst = [p.group for p in prompts[: workload.concurrency]]
    return len(burst) - len(set(burst))
