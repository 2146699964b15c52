"""Runs plans through a model: row state in, tensors built, forward, sample, tokens kept.

The token buffer holds, per row, the token the last step sampled for it. A plan input
equal to PLACEHOLDER reads from it, which is what lets step N+1 be launched before the
control plane has seen step N's tokens.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np
import torch

from sampler.sampler import Sampler, SlotState
from streams.batch import ForwardBatch
from streams.device import REPLAY_STEP
from streams.grammar import GrammarRows
from streams.plan import StepPlan, StepResult
from streams.rows import RowState


class Model(Protocol):
    cfg: Any  # .vocab_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> Any: ...

    def __call__(self, batch: ForwardBatch, kv_cache: Any) -> torch.Tensor: ...


class ModelRunner:
    def __init__(
        self,
        model: Model,
        num_blocks: int,
        block_size: int,
        max_blocks_per_row: int,
        device: torch.device | str = "cpu",
        tokenizer_folder: str | None = None,
    ) -> None:
        self.model = model
        self.tokenizer_folder = tokenizer_folder
        self.device = torch.device(device)
        self.block_size = block_size
        self.max_blocks_per_row = max_blocks_per_row
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(model.cfg.vocab_size)
        self._fresh_rows()

    def _fresh_rows(self) -> None:
        self.rows = RowState(self.block_size, self.max_blocks_per_row)
        self.states: dict[int, SlotState] = {}
        self.grammars = GrammarRows(self.tokenizer_folder, self.model.cfg.vocab_size)

    def run(self, plan: StepPlan) -> StepResult:
        start = time.monotonic()
        try:
            tokens, logprobs, top = self._run(plan)
        except Exception as exc:  # the step fails alone; the device keeps serving
            return StepResult(
                plan.step_id,
                [],
                device_start=start,
                device_end=time.monotonic(),
                error=f"{type(exc).__name__}: {exc}",
            )
        return StepResult(plan.step_id, tokens, logprobs, top, start, time.monotonic())

    def replay(self, plans: list[StepPlan]) -> StepResult:
        """The same forward passes back to back, on row state of their own (the roofline)."""
        live_rows, live_states, live_grammars = self.rows, self.states, self.grammars
        self._fresh_rows()
        try:
            start = time.monotonic()
            for plan in plans:
                self._run(plan)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            return StepResult(REPLAY_STEP, [], None, None, start, time.monotonic())
        finally:
            self.rows, self.states, self.grammars = live_rows, live_states, live_grammars

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> tuple[np.ndarray, Any, Any]:
        for row in plan.released_rows.tolist():
            self.states.pop(row, None)
            self.grammars.drop(row)
        for new in plan.new_rows:
            self.grammars.add(new.row, new.params.structured_output)
            prompt = None
            if new.params.repetition_penalty != 1.0:
                prompt = torch.tensor(new.prompt_ids, dtype=torch.long, device=self.device)
            self.states[new.row] = SlotState(new.params, prompt, list(new.stop_ids), [])
        self.rows.apply(plan)
        if not len(plan.rows):
            return np.zeros(0, np.int64), None, None

        batch = self._prepare(plan)
        logits = self.model(batch, self.kv_cache)
        sampled_rows = plan.rows[plan.sample]
        if not len(sampled_rows):  # only partial prefill chunks this step
            return np.zeros(0, np.int64), None, None
        rows = sampled_rows.tolist()
        states = [self.states[r] for r in rows]
        constrained = self.grammars.constrain(logits, rows)
        result = self.sampler.sample(logits, states)
        self.grammars.advance(rows, constrained, result.tokens)
        tokens = np.array(result.tokens, dtype=np.int64)
        self.rows.record_sampled(plan, tokens)
        return tokens, result.logprobs, result.top_logprobs

    def _prepare(self, plan: StepPlan) -> ForwardBatch:
        layout = self.rows.layout(plan)
        ids = self.rows.input_ids(plan, layout.token_rows)
        ends = np.cumsum(plan.query_lens) - 1
        dev = self.device

        def tensor(a: np.ndarray) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a, np.int64)).to(dev)

        return ForwardBatch(
            input_ids=tensor(ids),
            positions=tensor(layout.positions),
            slot_mapping=tensor(layout.kv_slots),
            query_lens=plan.query_lens.tolist(),
            context_lens=layout.context_lens.tolist(),
            block_tables=tensor(layout.block_tables),
            logits_indices=tensor(ends[plan.sample]),
        )


def build_model_runner(
    model_factory: Callable[[], Model],
    num_blocks: int,
    block_size: int,
    max_blocks_per_row: int,
    device: str = "cpu",
    tokenizer_folder: str | None = None,
) -> ModelRunner:
    """Module level, so a device process can receive it by name inside a partial."""
    return ModelRunner(
        model_factory(), num_blocks, block_size, max_blocks_per_row, device, tokenizer_folder
    )
