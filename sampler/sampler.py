"""Batched sampling with per-row settings kept on the device: a step never waits on the host.

A step samples *positions*: one logits row each, belonging to a device row. An ordinary
row has one sampled position a step; a row that verifies drafts has one per draft and one
more, each at its own offset past the row's last output. A position at offset j samples
as the row's (generated + j)-th output would: its seeded noise, its min_tokens ban and
its penalty counts (which include the drafts before it) are those of that output, so a
verified token is exactly the token one-at-a-time decoding samples there.

Parameters are written to device tensors indexed by row once, when a row joins
(``RowSettings``); every per-batch decision (which features run, how many top logprobs)
reads host copies of them, never the device. ``record`` counts the tokens a row emits
(which, for a row that verified drafts, only the caller knows).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from sampler.noise import exponential_noise
from sampler.row_settings import RowSettings


@dataclass(slots=True)
class Positions:
    """The positions a step samples, in logits order."""

    rows: torch.Tensor  # int64 [S] on the host: each position's row
    rows_dev: torch.Tensor  # int64 [S]: the same on the device
    offsets: torch.Tensor | None = None  # int64 [S], host: j past the row's last output
    offsets_dev: torch.Tensor | None = None  # the same on the device (None: all 0)
    # Drafts a position follows within its row, for penalties: (position index, token) pairs.
    drafts_before: tuple[torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def one_each(cls, rows: list[int] | torch.Tensor, device: torch.device | str) -> Positions:
        """One position per row, at offset 0 (a decode step)."""
        host = torch.as_tensor(rows, dtype=torch.int64).reshape(-1)
        return cls(host, host.to(device))


@dataclass(slots=True)
class Sample:
    tokens: torch.Tensor  # int64 [S]
    logprobs: torch.Tensor | None  # float32 [S]: raw logprob of each sampled token
    top_ids: torch.Tensor | None  # int64 [S, K], K = most top logprobs any row asked
    top_logprobs: torch.Tensor | None  # float32 [S, K]
    wanted: list[int | None]  # each position's row's logprobs setting, to trim its top-K


class Sampler(RowSettings):
    """Picks one token per position from its row's settings on the device."""

    def sample(
        self, logits: torch.Tensor, at: Positions, noise: torch.Tensor | None = None
    ) -> Sample:
        """One token per row of ``logits`` [S, >=V], the positions ``at``.

        ``noise`` [S, V] of Exp(1) draws replaces the rows' seeded noise (tests inject it).
        """
        ids = at.rows  # the host copies' index
        S, V = len(ids), self.vocab_size
        if logits.dim() != 2 or logits.shape[0] != S or tuple(at.rows_dev.shape) != (S,):
            raise ValueError(
                f"logits must be [{S}, V] and rows_dev [{S}], got {tuple(logits.shape)} and "
                f"{tuple(at.rows_dev.shape)}"
            )
        if logits.shape[1] < V:
            raise ValueError(f"logits have {logits.shape[1]} columns < vocab {V}")
        if S and (ids.min() < 0 or ids.max() >= self.capacity or not self.live[ids].all()):
            raise ValueError(f"rows {at.rows.tolist()} include one that was not added")
        if S == 0:
            empty = torch.empty(0, dtype=torch.int64, device=logits.device)
            return Sample(empty, None, None, None, [])
        raw = logits[:, :V]
        if raw.dtype != torch.float32:
            raw = raw.float()
        tokens = self._pick(raw, ids, at, noise)
        logprobs, top_ids, top_logprobs, wanted = self._logprobs(raw, tokens, ids)
        return Sample(tokens, logprobs, top_ids, top_logprobs, wanted)

    def record(
        self,
        rows: torch.Tensor,
        rows_dev: torch.Tensor,
        tokens: torch.Tensor,
        kept: torch.Tensor | None = None,
    ) -> None:
        """``tokens`` [N] are outputs of ``rows`` [N] (host int64; a row may appear once per
        token, in output order): they count toward min_tokens, the seeded noise's step and
        penalties. ``kept`` (bool [N], on the device): only those are outputs (a verify
        step's, decided on the device); the host's count of them follows in
        ``record_host`` once it knows them, and lags until then."""
        if not len(rows):
            return
        ids = rows
        weight = torch.ones_like(rows_dev) if kept is None else kept.long()
        if self.counts is not None and self.host["penalised"][ids].any():
            # Only penalised rows read their counts, and each of their tokens passes here.
            self.counts.view(-1).index_add_(0, rows_dev * self.vocab_size + tokens, weight.float())
        self.generated.index_add_(0, rows_dev, weight)
        if kept is None:
            self.record_host(ids)

    def record_host(self, rows: torch.Tensor) -> None:
        """The host's count of outputs catches up with ``record``'s (host int64 rows, one
        per output). Decisions read it as a least count (a min_tokens ban is checked on the
        device), so lagging is safe."""
        self.host_generated.index_add_(0, rows, torch.ones_like(rows))

    def _pick(
        self, raw: torch.Tensor, ids: torch.Tensor, at: Positions, noise: torch.Tensor | None
    ) -> torch.Tensor:
        host, rows_dev = self.host, at.rows_dev
        all_greedy = bool(host["greedy"][ids].all())
        penalised = bool(host["penalised"][ids].any())
        ahead = self.host_generated[ids]
        if at.offsets is not None:
            ahead = ahead + at.offsets
        banned = bool((self.banning[ids] & (ahead < host["min_tokens"][ids])).any())
        if all_greedy and not penalised and not banned:
            return _argmax(raw)

        logits = raw.clone()  # never modify the caller's logits
        if penalised:
            self._apply_penalties(logits, ids, at)
        if banned:
            self._ban_stop_ids(logits, at)
        best = _argmax(logits)
        if all_greedy:
            return best
        drawn = self._draw(logits, ids, at, noise)
        return torch.where(self.dev["greedy"][rows_dev], best, drawn)

    def _steps(self, at: Positions) -> torch.Tensor:
        """Each position's output index in its row: generated so far plus its offset."""
        steps = self.generated[at.rows_dev]
        return steps if at.offsets_dev is None else steps + at.offsets_dev

    def _apply_penalties(self, logits: torch.Tensor, ids: torch.Tensor, at: Positions) -> None:
        """vLLM semantics: repetition over prompt + output, presence/frequency over output."""
        dev, rows_dev = self.dev, at.rows_dev
        if self.counts is None:
            raise RuntimeError("a penalised row joined without output counts")
        out_counts = self.counts[rows_dev]
        if at.drafts_before is not None:
            where, tokens = at.drafts_before
            out_counts.index_put_(
                (where, tokens), torch.ones_like(where, dtype=torch.float32), True
            )
        out_seen = out_counts > 0
        if self.host["repeats"][ids].any():
            if self.prompt_seen is None:
                raise RuntimeError("a repetition-penalised row joined without its prompt")
            seen = out_seen | self.prompt_seen[rows_dev]
            penalty = torch.where(seen, dev["repetition_penalty"][rows_dev].unsqueeze(1), 1.0)
            # Dividing a negative logit would raise it; multiplying lowers it, as intended.
            logits.copy_(torch.where(logits > 0, logits / penalty, logits * penalty))
        freq = dev["frequency_penalty"][rows_dev].unsqueeze(1)
        pres = dev["presence_penalty"][rows_dev].unsqueeze(1)
        logits.sub_(freq * out_counts + pres * out_seen)

    def _ban_stop_ids(self, logits: torch.Tensor, at: Positions) -> None:
        active = self._steps(at) < self.dev["min_tokens"][at.rows_dev]
        stops = self.stops[at.rows_dev]
        # Column V takes the padding; every write to one cell carries the same value.
        ban = torch.zeros(
            logits.shape[0], self.vocab_size + 1, dtype=torch.bool, device=logits.device
        )
        ban.scatter_(1, stops, active.unsqueeze(1).expand_as(stops))
        logits.masked_fill_(ban[:, : self.vocab_size], float("-inf"))

    def _draw(
        self, logits: torch.Tensor, ids: torch.Tensor, at: Positions, noise: torch.Tensor | None
    ) -> torch.Tensor:
        dev, rows_dev = self.dev, at.rows_dev
        logits.div_(dev["temperature"][rows_dev].unsqueeze(1))
        if (self.host["min_p"][ids] > 0).any():
            min_p = dev["min_p"][rows_dev].unsqueeze(1)
            probs = logits.softmax(dim=-1)
            keep = probs >= min_p * probs.amax(dim=-1, keepdim=True)
            logits.masked_fill_(~keep, float("-inf"))
        self._top_k_top_p(logits, ids, rows_dev)
        probs = logits.softmax(dim=-1)
        if noise is None:
            # Counter-based noise by (seed, output index): a seeded row draws the same token
            # in any batch, on any device, drafted or not.
            noise = exponential_noise(dev["seed"][rows_dev], self._steps(at), self.vocab_size)
        # Exponential race: argmax(p_i / E_i) with E_i ~ Exp(1) picks i with probability p_i.
        return _argmax(probs / noise)

    def _top_k_top_p(self, logits: torch.Tensor, ids: torch.Tensor, rows_dev: torch.Tensor) -> None:
        vocab = self.vocab_size
        ks = self.host["top_k"][ids]
        use_k = bool((ks < vocab).any())
        use_p = bool((self.host["top_p"][ids] < 1.0).any())
        if not use_k and not use_p:
            return
        k = self.dev["top_k"][rows_dev].unsqueeze(1)
        if not use_p:
            # topk up to the largest k is cheaper than a full sort of the vocabulary.
            top = logits.topk(int(ks.max()), dim=-1).values
            kth = top.gather(1, k - 1)
            logits.masked_fill_(logits < kth, float("-inf"))
            return
        sorted_logits, order = logits.sort(dim=-1, descending=True)
        rank = torch.arange(vocab, device=logits.device).unsqueeze(0)
        sorted_logits.masked_fill_(rank >= k, float("-inf"))
        probs = sorted_logits.softmax(dim=-1)
        before = probs.cumsum(dim=-1) - probs  # mass strictly ahead of each token
        top_p = self.dev["top_p"][rows_dev].unsqueeze(1)
        sorted_logits.masked_fill_(before > top_p, float("-inf"))
        logits.scatter_(1, order, sorted_logits)

    def _logprobs(
        self, raw: torch.Tensor, tokens: torch.Tensor, ids: torch.Tensor
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, list[int | None]]:
        """Logprobs of the raw model distribution, before penalties and temperature."""
        asked = self.host["logprobs"][ids]
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


def _argmax(values: torch.Tensor) -> torch.Tensor:
    """The first maximum of each row. On a CPU ``max``'s indices are the same and ~2.5x
    faster than ``argmax`` (whose reduction is not vectorised there)."""
    if values.device.type == "cpu":
        return values.max(dim=-1).indices
    return values.argmax(dim=-1)
