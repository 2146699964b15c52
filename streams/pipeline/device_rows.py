"""The row state of one pipeline: host tables (for the step's layout), device block tables, the
device token buffer, the sampling rows and the grammar matchers of structured output."""

from __future__ import annotations

import numpy as np
import torch

from sampler.device import DeviceSample, DeviceSampler
from streams.grammar import GrammarRows
from streams.plan import StepPlan
from streams.rows import RowState


class DeviceRows:
    """Everything a row keeps between steps. The runner's ``replay`` swaps in a fresh one."""

    def __init__(
        self,
        block_size: int,
        max_blocks_per_row: int,
        vocab_size: int,
        device: torch.device,
        seed: int | None,
        tokenizer_folder: str | None,
    ) -> None:
        self.host = RowState(block_size, max_blocks_per_row)
        rows = len(self.host.live)
        self.tables = torch.zeros(rows, max_blocks_per_row, dtype=torch.int64, device=device)
        self.tokens = torch.zeros(rows, dtype=torch.int64, device=device)
        self.sampler = DeviceSampler(vocab_size, device, rows, seed)
        self.grammars = GrammarRows(tokenizer_folder, vocab_size)

    def apply(self, plan: StepPlan) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """The plan's row changes on the host: released rows leave, new rows' grammars join and
        the host tables take the new blocks. Returns the tables' change for the device."""
        released = plan.released_rows.tolist()
        for row in released:
            self.grammars.drop(row)
        self.sampler.release_rows(released)
        for new in plan.new_rows:
            self.grammars.add(new.row, new.params.structured_output)
        return self.host.apply(plan)

    def join(self, plan: StepPlan) -> None:
        """New rows' sampling settings to the device (called on the compute stream)."""
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
        have = self.tables.shape[0]
        if rows > have:
            self.tables = torch.cat(
                [self.tables, self.tables.new_zeros(rows - have, self.tables.shape[1])]
            )
            self.tokens = torch.cat([self.tokens, self.tokens.new_zeros(rows - have)])

    def sample(
        self, logits: torch.Tensor, sampled_rows: np.ndarray, rows_dev: torch.Tensor
    ) -> tuple[DeviceSample, torch.Tensor]:
        """Sample the rows (on the compute stream); a step with a constrained row waits for its
        tokens on the host."""
        row_list = sampled_rows.tolist()
        if not any(r in self.grammars.matchers for r in row_list):
            sample = self.sampler.sample(logits, sampled_rows, rows_dev)
            return sample, sample.tokens
        # A constrained row: its mask needs the matcher, which needs its last token on the
        # host. Earlier steps with this row were synchronous too, so the matcher is current.
        logits = logits.clone()
        picked = self.grammars.constrain(logits, row_list)
        sample = self.sampler.sample(logits, sampled_rows, rows_dev)
        self.grammars.advance(row_list, picked, sample.tokens.tolist())
        return sample, sample.tokens
