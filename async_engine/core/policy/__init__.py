"""Scheduling policies: which waiting request runs next, whom to preempt, how service is
counted and what shape each step takes. ``base.Policy`` is the contract."""

from __future__ import annotations

from async_engine.core.policy.base import Policy, StepShape
from async_engine.core.policy.fair import FairPolicy
from async_engine.core.policy.ordered import OrderedPolicy
from async_engine.core.policy.tenants import FairTuning, default_overflow_seqs

POLICIES = ("fcfs", "priority", "fair")

__all__ = [
    "POLICIES",
    "FairPolicy",
    "FairTuning",
    "OrderedPolicy",
    "Policy",
    "StepShape",
    "default_overflow_seqs",
    "make_policy",
]


def make_policy(
    name: str,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    weights: dict[str, float] | None = None,
    default_weight: float = 1.0,
    overflow_seqs: int | None = None,
) -> Policy:
    """``overflow_seqs``: the fair policy's extra running slots (None: its default)."""
    if name == "fair":
        return FairPolicy(
            max_num_seqs, max_num_batched_tokens, weights, default_weight, overflow_seqs
        )
    if name in ("fcfs", "priority"):
        return OrderedPolicy(max_num_seqs, max_num_batched_tokens, by_priority=name == "priority")
    raise ValueError(f"scheduling_policy must be {'|'.join(POLICIES)}, got {name!r}")
