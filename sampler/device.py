"""Sampling with per-row settings kept on the device: a step never waits on the host.

The semantics are ``sampler.Sampler``'s, op for op, so both pick the same tokens from the same
logits and noise. Parameters are written to device tensors indexed by row once, when a row
joins (``RowSettings``); every per-batch decision (which features run, how many top
logprobs) reads host mirrors of them, never the device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from sampler.noise import exponential_noise
from sampler.row_settings import RowSettings

if TYPE_CHECKING:
    import numpy as np


@dataclass(slots=True)
class DeviceSample:
    tokens: torch.Tensor  # int64 [B]
    logprobs: torch.Tensor | None  # float32 [B]: raw logprob of each sampled token
    top_ids: torch.Tensor | None  # int64 [B, K], K = most top logprobs any row asked
    top_logprobs: torch.Tensor | None  # float32 [B, K]
    wanted: list[int | None]  # each row's params.logprobs, to trim its top-K to its own n


class DeviceSampler(RowSettings):
    """Picks one token per row from its settings on the device (see ``RowSettings``)."""

    def sample(
        self,
        logits: torch.Tensor,
        rows: np.ndarray | list[int],
        rows_dev: torch.Tensor,
        noise: torch.Tensor | None = None,
    ) -> DeviceSample:
        """One token per row of ``logits`` [B, >=V]; rows_dev is ``rows`` as int64 on the device.

        ``noise`` [B, V] of Exp(1) draws replaces the rows' seeded noise (tests inject it).
        """
        ids = torch.as_tensor(rows, dtype=torch.int64).view(-1)  # host: the mirrors' index
        B, V = len(ids), self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != B or tuple(rows_dev.shape) != (B,):
            raise ValueError(
                f"logits must be [{B}, V] and rows_dev [{B}], got {tuple(logits.shape)} and "
                f"{tuple(rows_dev.shape)}"
            )
        if logits.shape[1] < V:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {V}")
        if B and (ids.min() < 0 or ids.max() >= self.capacity or not self._live[ids].all()):
            raise ValueError(f"rows {list(rows)} include one that was not added")
        if B == 0:
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return DeviceSample(empty, None, None, None, [])
        raw = logits[:, :V]
        if raw.dtype != torch.float32:
            raw = raw.float()

        tokens = self._pick(raw, ids, rows_dev, noise)
        logprobs, top_ids, top_logprobs, wanted = self._logprobs(raw, tokens, ids)
        if self._counts is not None and self._h_penalised[ids].any():
            # Only penalised rows read their counts, and each of their tokens passes here.
            ones = torch.ones(B, device=logits.device)
            self._counts.view(-1).index_add_(0, rows_dev * V + tokens, ones)
        self._generated.index_add_(0, rows_dev, torch.ones_like(rows_dev))
        self._h_generated[ids] += 1
        return DeviceSample(tokens, logprobs, top_ids, top_logprobs, wanted)

    def _pick(
        self,
        raw: torch.Tensor,
        ids: torch.Tensor,
        rows_dev: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        all_greedy = bool(self._h_greedy[ids].all())
        penalised = bool(self._h_penalised[ids].any())
        banned = bool(
            (self._h_banning[ids] & (self._h_generated[ids] < self._h_min_tokens[ids])).any()
        )
        if all_greedy and not penalised and not banned:
            return raw.argmax(dim=-1)

        logits = raw.clone()  # never modify the caller's logits
        if penalised:
            self._apply_penalties(logits, ids, rows_dev)
        if banned:
            self._ban_stop_ids(logits, rows_dev)
        best = logits.argmax(dim=-1)
        if all_greedy:
            return best
        drawn = self._draw(logits, ids, rows_dev, noise)
        return torch.where(self._greedy[rows_dev], best, drawn)

    def _apply_penalties(
        self, logits: torch.Tensor, ids: torch.Tensor, rows_dev: torch.Tensor
    ) -> None:
        assert self._counts is not None  # allocated when the first penalised row joined
        out_counts = self._counts[rows_dev]
        out_seen = out_counts > 0
        if self._h_rep[ids].any():
            assert self._prompt_seen is not None
            seen = out_seen | self._prompt_seen[rows_dev]
            penalty = torch.where(seen, self._rep[rows_dev].unsqueeze(1), 1.0)
            logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
        freq = self._freq[rows_dev].unsqueeze(1)
        pres = self._pres[rows_dev].unsqueeze(1)
        logits.sub_(freq * out_counts + pres * out_seen)

    def _ban_stop_ids(self, logits: torch.Tensor, rows_dev: torch.Tensor) -> None:
        active = self._generated[rows_dev] < self._min_tokens[rows_dev]
        stops = self._stops[rows_dev]
        # Column V takes the padding; every write to one cell carries the same value.
        ban = torch.zeros(
            logits.shape[0], self.vocab_size + 1, dtype=torch.bool, device=logits.device
        )
        ban.scatter_(1, stops, active.unsqueeze(1).expand_as(stops))
        logits.masked_fill_(ban[:, : self.vocab_size], float("-inf"))

    def _draw(
        self,
        logits: torch.Tensor,
        ids: torch.Tensor,
        rows_dev: torch.Tensor,
        noise: torch.Tensor | None,
    ) -> torch.Tensor:
        logits.div_(self._temp[rows_dev].unsqueeze(1))
        if (self._h_min_p[ids] > 0).any():
            min_p = self._min_p[rows_dev].unsqueeze(1)
            probs = logits.softmax(dim=-1)
            keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
            logits.masked_fill_(~keep, float("-inf"))
        self._top_k_top_p(logits, ids, rows_dev)

        probs = logits.softmax(dim=-1)
        if noise is None:
            # Every row is seeded (unseeded ones at random when they joined), by how many
            # tokens it has generated: the same draw as Sampler's for a seeded request.
            noise = exponential_noise(
                self._seed[rows_dev], self._generated[rows_dev], self.vocab_size
            )
        return (probs / noise).argmax(dim=-1)

    def _top_k_top_p(self, logits: torch.Tensor, ids: torch.Tensor, rows_dev: torch.Tensor) -> None:
        vocab = self.vocab_size
        ks = self._h_top_k[ids]
        use_k = bool((ks < vocab).any())
        use_p = bool((self._h_top_p[ids] < 1.0).any())
        if not use_k and not use_p:
            return
        k = self._top_k[rows_dev].unsqueeze(1)
        if not use_p:
            top = logits.topk(int(ks.max()), dim=-1).values
            kth = top.gather(1, k - 1)
            logits.masked_fill_(logits < kth, float("-inf"))
            return

        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        sorted_logits.masked_fill_(before > self._top_p[rows_dev].unsqueeze(1), float("-inf"))
        logits.scatter_(1, order, sorted_logits)

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[int | None]]:
        """Logprobs of the raw model distribution, before penalties and temperature."""
        asked = self._h_logprobs[ids]
        wanted = [None if n < 0 else n for n in asked.tolist()]  # a CPU tensor: no sync
        if (asked < 0).all():
            return None, None, None, wanted
        logp = raw.log_softmax(dim=-1)
        chosen = logp.gather(1, tokens.unsqueeze(1)).squeeze(1)
        most = min(int(asked.max()), self.vocab_size)
        if most <= 0:
            return chosen, None, None, wanted
        values, top_ids = logp.topk(most, dim=-1)
        return chosen, top_ids, values, wanted
