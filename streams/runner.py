"""Runs one StepPlan on the device: build tensors, forward, sample, keep the token buffer.

The token buffer holds, per request slot, the token the last step sampled for it. A plan
input equal to PLACEHOLDER reads from it, which is what lets step N+1 be launched before
the control plane has seen step N's tokens.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

import torch

from sampler.sampler import Sampler, SlotState
from streams.batch import ForwardBatch
from streams.plan import PLACEHOLDER, StepPlan, StepResult


class Model(Protocol):
    cfg: Any  # .vocab_size

    def allocate_kv_cache(self, num_blocks: int, block_size: int) -> Any: ...

    def __call__(self, batch: ForwardBatch, kv_cache: Any) -> torch.Tensor: ...


class StepFailed(RuntimeError):
    pass


class ModelRunner:
    def __init__(
        self,
        model: Model,
        num_blocks: int,
        block_size: int,
        device: torch.device | str = "cpu",
        fail_on_token_id: int | None = None,
    ) -> None:
        self.model = model
        self.device = torch.device(device)
        self.block_size = block_size
        self.kv_cache = model.allocate_kv_cache(num_blocks, block_size)
        self.sampler = Sampler(model.cfg.vocab_size)
        self.states: dict[int, SlotState] = {}
        self.token_buffer = torch.zeros(256, dtype=torch.long, device=self.device)
        self.fail_on_token_id = fail_on_token_id
        self.kernels = _cuda_kernels() if self.device.type == "cuda" else None

    def run(self, plan: StepPlan) -> StepResult:
        start = time.monotonic()
        try:
            tokens, logprobs, top = self._run(plan)
        except Exception as exc:  # the step fails alone; the device keeps serving
            return StepResult(
                plan.step_id, [], device_start=start, device_end=time.monotonic(),
                error=f"{type(exc).__name__}: {exc}",
            )  # fmt: skip
        return StepResult(plan.step_id, tokens, logprobs, top, start, time.monotonic())

    @torch.inference_mode()
    def _run(self, plan: StepPlan) -> tuple[list[int], Any, Any]:
        for slot in plan.released_slots:
            self.states.pop(slot, None)
        for new in plan.new_slots:
            prompt = None
            if new.params.repetition_penalty != 1.0:
                prompt = torch.tensor(new.prompt_ids, dtype=torch.long, device=self.device)
            self.states[new.slot] = SlotState(new.params, prompt, list(new.stop_ids), [])
            self._grow_token_buffer(new.slot)
        if not plan.request_ids:
            return [], None, None
        if self.fail_on_token_id is not None and self.fail_on_token_id in plan.input_ids:
            raise StepFailed(f"injected failure on token {self.fail_on_token_id}")

        batch = self._prepare(plan)
        logits = self.model(batch, self.kv_cache)
        sampled_slots = [s for s, do in zip(plan.slots, plan.sample, strict=True) if do]
        if not sampled_slots:  # only partial prefill chunks this step
            return [], None, None
        states = [self.states[s] for s in sampled_slots]
        result = self.sampler.sample(logits, states)
        token_tensor = torch.tensor(result.tokens, dtype=torch.long, device=self.device)
        rows = torch.tensor(sampled_slots, dtype=torch.long, device=self.device)
        if self.kernels is not None:
            self.kernels.scatter_tokens(self.token_buffer, rows, token_tensor)
        else:
            self.token_buffer[rows] = token_tensor
        return result.tokens, result.logprobs, result.top_logprobs

    def _prepare(self, plan: StepPlan) -> ForwardBatch:
        dev = self.device
        input_ids = torch.tensor(plan.input_ids, dtype=torch.long).to(dev)
        if PLACEHOLDER in plan.input_ids:
            token_slots = torch.repeat_interleave(
                torch.tensor(plan.slots), torch.tensor(plan.query_lens)
            ).to(dev)
            if self.kernels is not None:
                self.kernels.fill_placeholders(input_ids, token_slots, self.token_buffer)
            else:  # torch.where, not a boolean gather: no host sync
                carried = self.token_buffer[token_slots]
                input_ids = torch.where(input_ids == PLACEHOLDER, carried, input_ids)
        width = max(len(t) for t in plan.block_tables)
        tables = torch.tensor(
            [t + [0] * (width - len(t)) for t in plan.block_tables], dtype=torch.long
        )
        ends = torch.tensor(plan.query_lens).cumsum(0) - 1
        logits_indices = ends[torch.tensor(plan.sample, dtype=torch.bool)]
        return ForwardBatch(
            input_ids=input_ids,
            positions=torch.tensor(plan.positions, dtype=torch.long, device=dev),
            slot_mapping=torch.tensor(plan.slot_mapping, dtype=torch.long, device=dev),
            query_lens=plan.query_lens,
            context_lens=plan.context_lens,
            block_tables=tables.to(dev),
            logits_indices=logits_indices.to(dev),
        )

    def _grow_token_buffer(self, slot: int) -> None:
        if slot >= self.token_buffer.numel():
            bigger = torch.zeros(2 * (slot + 1), dtype=torch.long, device=self.device)
            bigger[: self.token_buffer.numel()] = self.token_buffer
            self.token_buffer = bigger


def _cuda_kernels():  # noqa: ANN202 - a module or None
    try:
        import cupy  # noqa: F401

        from streams import cuda_kernels
    except ImportError:
        return None  # torch fallbacks do the same work
    return cuda_kernels
