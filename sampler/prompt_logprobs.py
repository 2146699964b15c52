"""Prompt logprobs: each scored prompt position's log-softmax of the model's raw logits (no
temperature, penalties or masks: the model's own scores, as eval harnesses read them), the
next prompt token's logprob and rank there, and the top-n. On the device, for the positions
of rows that ask only."""

from __future__ import annotations

import torch


def score_positions(
    logits: torch.Tensor, targets: torch.Tensor, top: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(logprob [P], rank [P] (1: the likeliest), top ids [P, top], top logprobs [P, top])
    for ``logits`` [P, V] and the ``targets`` [P] they score."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, targets.view(-1, 1)).view(-1)
    rank = (logprobs > chosen.view(-1, 1)).sum(dim=1) + 1
    if top:
        top_values, top_ids = logprobs.topk(top, dim=-1)
    else:
        top_values = logprobs.new_zeros((len(targets), 0))
        top_ids = targets.new_zeros((len(targets), 0))
    return chosen, rank, top_ids, top_values
