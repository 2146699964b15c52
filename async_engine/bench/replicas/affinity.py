"""Prefix affinity: how well a router keeps each prompt group on one replica."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass


@dataclass(slots=True, frozen=True)
class Affinity:
    mean: float  # over groups, each weighted alike: 1.0 = every group on one replica
    worst: float
    groups: int


def group_affinity(placements: list[tuple[int, int]]) -> Affinity:
    """``placements``: (group, replica) of every request. A group's affinity is the share of
    its requests that went to the replica that got most of them."""
    by_group: dict[int, Counter[int]] = {}
    for group, replica in placements:
        by_group.setdefault(group, Counter())[replica] += 1
    shares = [max(c.values()) / sum(c.values()) for c in by_group.values()]
    if not shares:
        return Affinity(float("nan"), float("nan"), 0)
    return Affinity(sum(shares) / len(shares), min(shares), len(shares))


def placements_from_counts(counts: list[Counter[str]]) -> list[tuple[int, int]]:
    """(group, replica) pairs from each replica's tally of group tags ("g3" -> 3)."""
    out = []
    for replica, tally in enumerate(counts):
        for tag, n in tally.items():
            if tag.startswith("g") and tag[1:].isdigit():
                out += [(int(tag[1:]), replica)] * n
    return out
