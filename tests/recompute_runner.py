"""A reference for the model runner's tests: each step, every sampled row's whole sequence is
computed afresh (one request at a time, no paging kept between steps, no placeholders) and
sampled by the plain reference sampler. It shares only the model with the runner under test:
row state, block tables, token buffers, chunking, pipelining and the sampler's row tensors
are all its own, or absent."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from reference_sampler import Sampler, SlotState

from streams.batch import ForwardBatch
from streams.plan import DRAFT, PLACEHOLDER, RESOLVE, StepPlan, StepResult


class RecomputeRunner:
    def __init__(self, model, block_size: int = 16, max_tokens: int = 512) -> None:
        self.model = model
        self.block_size = block_size
        self.blocks = -(-max_tokens // block_size)
        self.kv_cache = model.allocate_kv_cache(self.blocks, block_size)
        self.sampler = Sampler(model.cfg.vocab_size, seed=0)
        self.tokens: dict[int, list[int]] = {}  # row -> prompt + sampled
        self.states: dict[int, SlotState] = {}

    def run(self, plan: StepPlan, propose: Callable | None = None) -> StepResult:
        """The plan's tokens. ``propose`` drafts for DRAFT slots, as the runner's drafter
        does; a verifying row emits each token one-at-a-time decoding gives while they equal
        the drafts, plus one."""
        for row in plan.released_rows.tolist():
            self.tokens.pop(row, None)
            self.states.pop(row, None)
        for new in plan.new_rows:
            self.tokens[new.row] = list(new.prompt_ids)
            prompt = torch.tensor(new.prompt_ids, dtype=torch.int64)
            self.states[new.row] = SlotState(new.params, prompt, list(new.stop_ids), [])
        emitted, counts, logprobs, top = [], [], [], []
        at = 0
        for row, start, size, sampled in zip(
            plan.rows.tolist(),
            plan.starts.tolist(),
            plan.query_lens.tolist(),
            plan.num_sampled.tolist(),
            strict=True,
        ):
            ids = plan.input_ids[at : at + size].tolist()
            at += size
            tokens = self.tokens[row]
            if start == RESOLVE:
                start = len(tokens) - 1
            for i, token in enumerate(ids):  # the inputs it knows must be the row's tokens
                if token not in (PLACEHOLDER, DRAFT) and start + i < len(tokens):
                    assert token == tokens[start + i], f"row {row}: input {i} differs"
            if not sampled:
                continue
            drafts = []
            if sampled > 1 and propose is not None:
                drafts = list(propose(row, np.array(tokens), sampled - 1))[: sampled - 1]
            run = self._decode(row, drafts)
            emitted += [t for t, _, _ in run]
            logprobs += [lp for _, lp, _ in run]
            top += [tp for _, _, tp in run]
            counts.append(len(run))
        result = StepResult(plan.step_id, np.array(emitted, np.int64))
        if any(lp is not None for lp in logprobs):
            result.logprobs, result.top_logprobs = logprobs, top
        if (plan.num_sampled > 1).any():
            result.counts = np.array(counts, np.int32)
        return result

    def lookahead(self, row: int, k: int) -> list[int]:
        """The next ``k`` tokens the row would sample, one at a time (its state untouched)."""
        tokens, state = list(self.tokens[row]), self.states[row]
        ahead = SlotState(state.params, state.prompt_ids, state.stop_ids, list(state.output_ids))
        for _ in range(k):
            tokens.append(self.sampler.sample(self._last_logits(tokens), [ahead]).tokens[0])
        return tokens[len(self.tokens[row]) :]

    def _decode(self, row: int, drafts: list[int]) -> list:
        """Tokens one at a time after the row's, while they equal the drafts, and one more."""
        tokens, state = self.tokens[row], self.states[row]
        out = []
        for draft in [*drafts, None]:
            logits = self._last_logits(tokens)
            got = self.sampler.sample(logits, [state])
            token = got.tokens[0]
            tokens.append(token)
            lp = got.logprobs[0] if got.logprobs is not None else None
            tp = got.top_logprobs[0] if got.top_logprobs is not None else None
            out.append((token, lp, tp))
            if token != draft:
                break
        return out

    @torch.inference_mode()
    def _last_logits(self, tokens: list[int]) -> torch.Tensor:
        n = len(tokens)
        if n > self.blocks * self.block_size:
            raise ValueError("the reference's cache is too small")
        positions = torch.arange(n)
        table = torch.arange(self.blocks, dtype=torch.int64).unsqueeze(0)
        batch = ForwardBatch(
            input_ids=torch.tensor(tokens, dtype=torch.int64),
            positions=positions,
            slot_mapping=positions.clone(),
            query_lens=[n],
            context_lens=[n],
            block_tables=table,
            logits_indices=torch.tensor([n - 1]),
        )
        return self.model(batch, self.kv_cache)
