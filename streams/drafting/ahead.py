"""Drafting ahead: a host drafter (``drafts_ahead``) drafts over the step still in flight.

A drafter on the host needs a row's tokens, and a verify step's tokens reach the host only
after the step ends; waiting for them leaves the device idle between steps. Instead, the
host proposes from the tokens it has a chain that runs on past them: first the tokens the
steps in flight will emit (the drafter foresees them as it foresees any), then the next
step's drafts. The device knows what those steps emitted. Where the chain's start equals
those tokens, it keeps the part of the chain that follows them as the row's drafts, so a
row whose runs went as the chain foresaw loses nothing. Where it does not (a run cut short,
a chain that foresaw nothing), the drafter's ``missed`` (a device drafter: prompt lookup,
for suffix decoding) drafts from the row's tokens on the device instead; a drafter without
one drafts nothing for the row in that step, its slots paid for, as a device drafter's
empty ones are.

The rule is written twice: in torch, with no host sync (``ChainsOnDevice``), and in numpy
(``follow``, and ``KeptChains`` for a step), for the simulated device, which loads no torch.
Tests hold the two equal.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    import torch

    from streams.drafting.base import Drafter


@dataclass(slots=True)
class Chains:
    """Each drafting row's chain, in the order of the step's drafting rows."""

    tokens: np.ndarray  # int64 [V, m]: each chain, 0 past its length
    lengths: np.ndarray  # int64 [V]
    base: np.ndarray  # int64 [V]: the row's tokens the chain follows (the host's count)


def propose_chains(
    drafter: Drafter, rows: list[int], histories: list[np.ndarray], ks: list[int]
) -> Chains:
    """Up to ``ks[i]`` tokens to follow ``histories[i]``, for each row, as one array."""
    proposals = [
        np.asarray(p, np.int64)[:k]
        for p, k in zip(drafter.propose(rows, histories, ks), ks, strict=True)
    ]
    tokens = np.zeros((len(rows), max(ks, default=0)), np.int64)
    for i, proposal in enumerate(proposals):
        tokens[i, : len(proposal)] = proposal
    lengths = np.array([len(p) for p in proposals], np.int64)
    return Chains(tokens, lengths, np.array([len(h) for h in histories], np.int64))


def follow(chain: np.ndarray, unseen: np.ndarray, k: int) -> np.ndarray | None:
    """The drafts ``chain`` holds for the next step: its next ``k`` tokens after the row's
    tokens the drafter did not see (``unseen``); None where its start is not them."""
    n = len(unseen)
    if len(chain) < n or (chain[:n] != unseen).any():
        return None
    return chain[n : n + k]


class KeptChains:
    """The device's part on the host (the simulated device): a drafter whose proposal for
    a row is what the device keeps of its chain, given the row's tokens now."""

    def __init__(self, chains: Chains, rows: np.ndarray, missed: object | None = None) -> None:
        self.chains = {int(row): i for i, row in enumerate(rows)}
        self.tokens, self.lengths, self.base = chains.tokens, chains.lengths, chains.base
        self.missed = missed

    def propose(self, rows: list[int], tokens: list[np.ndarray], ks: list[int]) -> list[np.ndarray]:
        kept = []
        for row, held, k in zip(rows, tokens, ks, strict=True):
            i = self.chains[row]
            chain, base = self.tokens[i, : self.lengths[i]], int(self.base[i])
            drafts = follow(chain, np.asarray(held[base:], np.int64), k)
            if drafts is None:
                drafts = chain[:0] if self.missed is None else self.missed.lookup(held, k)
            kept.append(drafts)
        return kept

    def release(self, row: int, tokens: np.ndarray) -> None:
        pass


class ChainsOnDevice:
    """Chains on the device, behind the device drafter's contract (``propose_on_device``):
    each row's drafts are its chain's past the tokens the device's row holds beyond the
    chain's base, where the chain foresaw those tokens, else ``missed``'s (if any)."""

    def __init__(
        self,
        tokens: torch.Tensor,
        lengths: torch.Tensor,
        base: torch.Tensor,
        missed: object | None = None,
    ) -> None:
        self.tokens, self.lengths, self.base, self.missed = tokens, lengths, base, missed

    def propose_on_device(
        self, history: torch.Tensor, lengths: torch.Tensor, k: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Drafts [V, k] (0 past each row's count) and their counts [V], from the rows'
        tokens ``history`` [V, H] (the first ``lengths`` [V] of each meaningful)."""
        import torch

        width, m = history.shape[1], self.tokens.shape[1]
        unseen = (lengths - self.base).unsqueeze(1)  # [V, 1]: tokens the chain had to foresee
        at = torch.arange(m, device=history.device)
        held = history.gather(1, (self.base.unsqueeze(1) + at).clamp(max=width - 1))
        differs = ((at < unseen) & (held.long() != self.tokens)).any(dim=1)
        left = self.lengths - unseen.squeeze(1)
        missed = differs | (left < 0)
        found = torch.where(missed, 0, left.clamp(min=0, max=k))
        steps = torch.arange(k, device=history.device)
        drafts = self.tokens.gather(1, (unseen + steps).clamp(min=0, max=max(m - 1, 0)))
        drafts = torch.where(steps < found.unsqueeze(1), drafts, 0)
        if self.missed is None:
            return drafts, found
        instead, count = self.missed.propose_on_device(history, lengths, k)
        return (
            torch.where(missed.unsqueeze(1), instead, drafts),
            torch.where(missed, count, found),
        )
