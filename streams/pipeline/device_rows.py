"""The device's copy of the row state (``streams.rows.RowState`` is the row state): block
tables and a token buffer as device tensors, beside the sampler's rows and the grammar
matchers of structured output.

The token buffer keeps each row's last ``TOKEN_WINDOW`` sampled tokens by position (entry
``row * TOKEN_WINDOW + position % TOKEN_WINDOW``): a PLACEHOLDER input at position p reads
the token sampled there, however many tokens a row took a step, and no row has that many
positions in flight.
"""

from __future__ import annotations

import numpy as np
import torch

from sampler.sampler import Positions, Sample, Sampler
from streams.drafting.base import Drafter
from streams.grammar import GrammarRows, TokenizerSource
from streams.pipeline.row_tokens import RowTokens
from streams.plan import StepPlan
from streams.rows import RowState, StepLayout

TOKEN_WINDOW = 64  # positions a row's token buffer holds: > steps in flight x tokens a step


class DeviceRows:
    """Everything a row keeps between steps. The runner's ``replay`` swaps in a fresh one."""

    def __init__(
        self,
        block_size: int,
        max_blocks_per_row: int,
        vocab_size: int,
        device: torch.device,
        seed: int | None,
        tokenizer: TokenizerSource | None,
        speculative: bool = False,
    ) -> None:
        self.host = RowState(block_size, max_blocks_per_row)
        rows = len(self.host.live)
        self.tables = torch.zeros(rows, max_blocks_per_row, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(rows * TOKEN_WINDOW, dtype=torch.int64, device=device)
        self.sampler = Sampler(vocab_size, device, rows, seed)
        self.grammars = GrammarRows(tokenizer, vocab_size)
        # Rows that speculate keep their tokens and counts on the device too (verify steps'
        # counts are decided there).
        self.row_tokens = RowTokens(rows, device) if speculative else None

    def apply(
        self, plan: StepPlan, drafter: Drafter | None = None
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan's row changes on the host: released rows leave (their tokens go to the
        drafter), new rows' grammars join and the host tables take the new blocks. Returns
        the tables' change for the device."""
        released = plan.released_rows.tolist()
        for row in released:
            self.grammars.drop(row)
        self.sampler.release_rows(released)
        for new in plan.new_rows:
            self.grammars.add(new.row, new.params.structured_output)
        return self.host.apply(plan, drafter)

    def join(self, plan: StepPlan) -> None:
        """New rows' sampling settings (and tokens) to the device (on the compute stream)."""
        if self.row_tokens is not None:
            self.row_tokens.fit(len(self.host.live))
            self.row_tokens.join(plan.new_rows)
        if plan.new_rows:
            new = plan.new_rows
            self.sampler.add_rows(
                [n.row for n in new],
                [n.params for n in new],
                [n.prompt_ids for n in new],
                [n.stop_ids for n in new],
            )

    def fit(self) -> None:
        """Grow the device tables to the host's rows (called on the compute stream)."""
        rows = len(self.host.live)
        if self.row_tokens is not None:
            self.row_tokens.fit(rows)
        have = self.tables.shape[0]
        if rows > have:
            self.tables = torch.cat(
                [self.tables, self.tables.new_zeros(rows - have, self.tables.shape[1])]
            )
            self.tokens = torch.cat(
                [self.tokens, self.tokens.new_zeros((rows - have) * TOKEN_WINDOW)]
            )

    def constrained(self, rows: np.ndarray) -> bool:
        return bool(self.grammars.matchers) and any(
            r in self.grammars.matchers for r in rows.tolist()
        )

    def sample(self, logits: torch.Tensor, at: Positions, layout: StepLayout) -> Sample:
        """Sample the positions (on the compute stream); a step with a constrained row waits
        for its tokens on the host. A verifying step's matchers advance once the rows'
        emitted tokens are known (``advance_grammars``)."""
        if not self.constrained(layout.sample_rows):
            return self.sampler.sample(logits, at)
        # A constrained row: its mask needs the matcher, which needs its last token on the
        # host. Earlier steps with this row were synchronous too, so the matcher is current.
        logits = logits.clone()
        rows = layout.sample_rows.tolist()
        if layout.verifying:
            offsets, drafts = layout.sample_offsets.tolist(), layout.next_drafts.tolist()
            self.grammars.constrain_runs(logits, rows, offsets, drafts)
            return self.sampler.sample(logits, at)
        picked = self.grammars.constrain(logits, rows)
        sample = self.sampler.sample(logits, at)
        self.grammars.advance(rows, picked, sample.tokens.tolist())
        return sample

    def advance_grammars(self, rows: np.ndarray, tokens: list[int]) -> None:
        """A verifying step's emitted tokens (``rows``: each one's row) into the matchers."""
        if self.constrained(rows):
            self.grammars.advance_runs(rows.tolist(), tokens)


def token_slots(rows: np.ndarray, positions: np.ndarray) -> np.ndarray:
    """Where in the token buffer the token of ``rows`` at ``positions`` lives."""
    return rows * TOKEN_WINDOW + positions % TOKEN_WINDOW
