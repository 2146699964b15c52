"""Random but valid plan sequences for runner tests: requests join, prefill in chunks, decode
with PLACEHOLDER inputs, verify drafts (with ``max_drafts``: DRAFT slots, some starting at
RESOLVE), are preempted (their block table starts over) and leave, and rows and blocks are
reused. A reference runner supplies the tokens, as the control plane's results would."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

import numpy as np

from sampler.params import SamplingParams
from streams.plan import DRAFT, PLACEHOLDER, RESOLVE, NewRow, StepPlan, StepResult, int32s, int64s


@dataclass(slots=True)
class WalkRequest:
    row: int
    tokens: list[int]  # prompt + sampled so far
    params: SamplingParams
    computed: int = 0  # tokens in the KV cache
    blocks: list[int] = field(default_factory=list)
    carried: bool = False  # its last token was sampled by the device and not yet sent back


class PlanWalk:
    def __init__(
        self,
        seed: int,
        vocab: int,
        block_size: int,
        num_blocks: int,
        params: list[SamplingParams],
        max_drafts: int = 0,
    ) -> None:
        self.rng = random.Random(seed)
        self.vocab, self.block_size = vocab, block_size
        self.free_blocks = list(range(num_blocks))
        self.free_rows: list[int] = []
        self.next_row = 0
        self.params = params
        self.max_drafts = max_drafts
        self.running: list[WalkRequest] = []
        self.step_id = 0
        self._released: list[int] = []

    def plan(self) -> StepPlan:
        rng = self.rng
        new_rows, resets, new_blocks = [], [], []
        if self.running and rng.random() < 0.15:  # a request leaves
            self._release(self.running.pop(rng.randrange(len(self.running))))
        if self.running and rng.random() < 0.1:  # preempted: recompute from scratch
            victim = rng.choice(self.running)
            self.free_blocks += victim.blocks
            victim.blocks, victim.computed, victim.carried = [], 0, False
            resets.append(victim.row)
        while len(self.running) < 6 and rng.random() < 0.5:
            row = self.free_rows.pop(0) if self.free_rows else self._take_row()
            prompt = [rng.randrange(self.vocab) for _ in range(rng.randint(1, 40))]
            req = WalkRequest(row, prompt, rng.choice(self.params))
            self.running.append(req)
            new_rows.append(NewRow(row, req.params, list(prompt), []))
        rows, starts, lens, sampled, ids = [], [], [], [], []
        for req in list(self.running):
            left = len(req.tokens) - req.computed
            count = left if left == 1 else rng.randint(1, min(left, 24))
            drafts = 0
            if left == 1 and self.max_drafts and rng.random() < 0.6:
                drafts = rng.randint(1, self.max_drafts)
            needed = -(-(req.computed + count + drafts) // self.block_size) - len(req.blocks)
            if needed > len(self.free_blocks):
                continue  # waits for blocks this step
            for _ in range(needed):
                block = self.free_blocks.pop(rng.randrange(len(self.free_blocks)))
                req.blocks.append(block)
                new_blocks += (req.row, block)
            chunk = req.tokens[req.computed : req.computed + count]
            if req.carried and req.computed + count == len(req.tokens) and rng.random() < 0.8:
                chunk[-1] = PLACEHOLDER
            # A verifying row's start may come from the device's own count of its tokens.
            start = RESOLVE if drafts and rng.random() < 0.5 else req.computed
            rows.append(req.row)
            starts.append(start)
            lens.append(count + drafts)
            samples = req.computed + count == len(req.tokens)
            sampled.append(int(samples) + drafts)
            ids += chunk + [DRAFT] * drafts
            req.computed += count
        released, self._released = self._released, []
        plan = StepPlan(
            self.step_id,
            int32s(rows),
            int32s(starts),
            int32s(lens),
            int32s(sampled),
            int64s(ids),
            new_rows,
            int32s(released),
            int32s(resets),
            int32s(new_blocks),
        )
        self.step_id += 1
        return plan

    def record(self, plan: StepPlan, result: StepResult) -> None:
        """The reference's result for ``plan``: sampled rows grow by what they emitted, and a
        row that verified drafts has their KV for the ones it kept."""
        by_row = {r.row: r for r in self.running}
        rows = plan.rows[plan.sampled].tolist()
        counts = result.emitted(len(rows)).tolist()
        tokens = np.asarray(result.tokens).tolist()
        at = 0
        for row, count in zip(rows, counts, strict=True):
            req = by_row.get(row)
            if req is not None:
                req.tokens += [int(t) for t in tokens[at : at + count]]
                req.computed += count - 1
                req.carried = True
            at += count
        for req in list(self.running):
            if len(req.tokens) > 120:  # long enough: leave before the table outgrows it
                self.running.remove(req)
                self._release(req)

    def _take_row(self) -> int:
        self.next_row += 1
        return self.next_row - 1

    def _release(self, req: WalkRequest) -> None:
        self.free_blocks += req.blocks
        self.free_rows.append(req.row)
        self._released.append(req.row)
