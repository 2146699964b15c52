"""What the model-runner tests share: the tiny model they run, the recomputing reference and
the runner on it, and the walk that drives both and compares their results."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from plan_walk import PlanWalk
from recompute_runner import RecomputeRunner
from tiny_models import make_tiny_llama

from async_engine.model import LlamaModel
from async_engine.model.loader import build_model
from sampler.params import SamplingParams
from streams.drafting.ahead import follow
from streams.pipeline.runner import SLOTS, PipelinedRunner
from streams.plan import NewRow, StepPlan, int32s, int64s

BLOCK = 4
NUM_BLOCKS = 96
MAX_BLOCKS = 48
PARAMS = [
    SamplingParams(temperature=0, max_tokens=None),
    SamplingParams(temperature=0, max_tokens=None, logprobs=3),
    SamplingParams(temperature=0.8, top_k=20, seed=7, max_tokens=None),
    SamplingParams(temperature=1.0, top_p=0.9, seed=11, max_tokens=None, logprobs=0),
    SamplingParams(temperature=0, presence_penalty=0.5, repetition_penalty=1.3, max_tokens=None),
    SamplingParams(temperature=0.7, frequency_penalty=0.8, seed=3, max_tokens=None),
]


def make_tiny_model(folder: Path) -> str:
    """The tiny random Llama the tests run (vocabulary 160), written to ``folder``."""
    make_tiny_llama(folder, vocab=160, num_layers=2, hidden=64, heads=4, kv_heads=2)
    return str(folder)


def seeded_model(folder: str) -> LlamaModel:
    torch.manual_seed(0)
    return build_model(folder, "float32")


def reference_runner(folder: str) -> RecomputeRunner:
    return RecomputeRunner(seeded_model(folder))


def pipelined_runner(folder: str, block: int = BLOCK, **options) -> PipelinedRunner:
    return PipelinedRunner(seeded_model(folder), NUM_BLOCKS, block, MAX_BLOCKS, **options)


class LookaheadDrafter:
    """Drafts the tokens the reference is about to sample (its own future, one at a time:
    greedy, seeded and penalised rows alike), with one draft of every third proposal made
    wrong: runs of every length are verified, accepted in full and cut short."""

    def __init__(self, reference: RecomputeRunner) -> None:
        self.reference = reference
        self.calls = 0

    def propose(self, rows: list[int], tokens: list, ks: list[int]) -> list[np.ndarray]:
        return [self.one(row, k) for row, k in zip(rows, ks, strict=True)]

    def release(self, row: int, tokens: np.ndarray) -> None:
        pass

    def one(self, row: int, k: int) -> np.ndarray:
        self.calls += 1
        drafts = np.array(self.reference.lookahead(row, k), np.int64)
        if self.calls % 3 == 0:
            wrong = self.calls % k
            drafts[wrong] = (drafts[wrong] + 1) % 160
        return drafts


class DeviceLookahead(LookaheadDrafter):
    """``LookaheadDrafter`` behind the on-device contract (``propose_on_device``): the runner
    drafts inside the step, from its device copy of the rows' tokens (each row found in the
    reference by those tokens), and the reference replays the proposals."""

    drafts_on_device = True

    def __init__(self, reference: RecomputeRunner) -> None:
        super().__init__(reference)
        self.proposals: list[np.ndarray] = []
        self.host_steps = 0  # steps the runner drafted for on the host

    def propose(self, rows: list[int], tokens: list, ks: list[int]) -> list[np.ndarray]:
        self.host_steps += 1
        return super().propose(rows, tokens, ks)

    def one(self, row: int, k: int) -> np.ndarray:
        """A proposal, kept for the reference to replay: the runner drafts here (on the
        host) for a step that waits for its rows' tokens anyway."""
        proposal = super().one(row, k)
        self.proposals.append(proposal)
        return proposal

    def propose_on_device(self, history: torch.Tensor, lengths: torch.Tensor, k: int):
        drafts = torch.zeros(len(lengths), k, dtype=torch.int64)
        found = torch.zeros(len(lengths), dtype=torch.int64)
        for v, n in enumerate(lengths.tolist()):
            tokens = history[v, :n].tolist()
            row = next(r for r, t in self.reference.tokens.items() if t == tokens)
            proposal = self.one(row, k)
            drafts[v, : len(proposal)] = torch.from_numpy(proposal)
            found[v] = len(proposal)
        return drafts.to(history.device), found.to(history.device)


class Recorded:
    """A drafter's proposals, recorded as one runner asks, replayed in order to another."""

    def __init__(self, drafter) -> None:
        self.drafter, self.proposals = drafter, []

    def propose(self, rows: list[int], tokens: list, ks: list[int]) -> list[np.ndarray]:
        self.proposals += self.drafter.propose(rows, tokens, ks)
        return self.proposals[-len(rows) :] if rows else []

    def release(self, row: int, tokens: np.ndarray) -> None:
        pass

    def replay(self):
        proposals = iter(self.proposals)
        return lambda row, tokens, k: next(proposals)


def walk_both(
    folder: str,
    seed: int,
    steps: int,
    max_drafts: int = 0,
    params=PARAMS,
    block: int = BLOCK,
    **options,
) -> tuple[list, list]:
    walk = PlanWalk(seed, 160, block, NUM_BLOCKS, params, max_drafts)
    reference = reference_runner(folder)
    drafter = LookaheadDrafter(reference) if max_drafts else None
    runner = pipelined_runner(folder, block, drafter=drafter, **options)
    return walk_two_deep(walk, reference, runner, steps, drafter)


def walk_two_deep(
    walk: PlanWalk,
    reference: RecomputeRunner,
    runner: PipelinedRunner,
    steps: int,
    drafter=None,
) -> tuple[list, list]:
    """Drive the reference synchronously and the runner two steps deep (``drafter``: the one
    both use, the runner first, so each proposal is made once and replayed)."""

    def launch(plan: StepPlan):
        recorded = Recorded(drafter) if drafter is not None else None
        runner.drafter = recorded
        return runner.launch(plan), recorded.replay() if recorded else None

    return drive(walk, reference, runner, steps, launch)


def drive(
    walk: PlanWalk, reference: RecomputeRunner, runner: PipelinedRunner, steps: int, launch
) -> tuple[list, list]:
    """The walk's plans, each launched on the runner (``launch(plan)``: the pending step and
    the reference's proposals for it) with two steps in flight, and run by the reference at
    once; the results of both."""
    expected, got, in_flight = [], [], []
    for _ in range(steps):
        plan = walk.plan()
        if len(in_flight) == SLOTS:
            got.append(runner.finish(in_flight.pop(0)))
        pending, proposals = launch(plan)
        in_flight.append(pending)
        result = reference.run(plan, proposals)
        assert result.error is None, result.error
        walk.record(plan, result)
        expected.append(result)
    got += [runner.finish(p) for p in in_flight]
    return expected, got


def walk_device_drafts(
    folder: str, seed: int, steps: int, block: int = BLOCK, ngram: bool = False, **options
) -> tuple[list, list, PipelinedRunner]:
    """The walk with rows verifying up to 4 drafts made on the device: the reference's own
    future, one draft of every third proposal wrong (``DeviceLookahead``, replayed to the
    reference), or (``ngram``) the n-gram drafter's, the reference drafting with its numpy
    twin."""
    from streams.drafting.ngram import NgramDrafter

    walk = PlanWalk(seed, 160, block, NUM_BLOCKS, PARAMS, max_drafts=4)
    reference = reference_runner(folder)
    if ngram:
        drafter = NgramDrafter(prompt_lookup_min=1, prompt_lookup_max=3)
        proposals = lambda row, tokens, k: drafter.lookup(tokens, k)  # noqa: E731
    else:
        drafter = DeviceLookahead(reference)
        proposals = lambda row, tokens, k: next(replayed)  # noqa: E731
    runner = pipelined_runner(folder, block, drafter=drafter, **options)

    def launch(plan: StepPlan):
        nonlocal replayed
        if not ngram:
            drafter.proposals = []
        pending = runner.launch(plan)
        replayed = iter(getattr(drafter, "proposals", []))
        return pending, proposals

    replayed = iter([])
    expected, got = drive(walk, reference, runner, steps, launch)
    return expected, got, runner


class ChainRecorder:
    """A host drafter behind the drafting-ahead contract, its chains recorded (row: the count
    of tokens each follows, the chain) for the reference to keep what the device keeps."""

    drafts_ahead = True

    def __init__(self, drafter) -> None:
        self.drafter = drafter
        self.missed = getattr(drafter, "missed", None)
        self.chains: dict[int, tuple[int, np.ndarray]] = {}
        self.kept_ahead = 0  # drafts kept from chains that foresaw tokens in flight
        self.missed_chains = 0

    def propose(self, rows: list[int], tokens: list, ks: list[int]) -> list[np.ndarray]:
        proposals = self.drafter.propose(rows, tokens, ks)
        for row, history, chain in zip(rows, tokens, proposals, strict=True):
            self.chains[row] = (len(history), np.asarray(chain, np.int64))
        return proposals

    def release(self, row: int, tokens: np.ndarray) -> None:
        self.drafter.release(row, tokens)

    def kept(self, row: int, tokens: list[int], k: int) -> np.ndarray:
        """The drafts the device keeps for ``row``, whose tokens are now ``tokens``."""
        base, chain = self.chains[row]
        drafts = follow(chain, np.array(tokens[base:], np.int64), k)
        if drafts is None:
            self.missed_chains += 1
            if self.missed is None:
                return chain[:0]
            return self.missed.lookup(np.array(tokens, np.int64), k)
        self.kept_ahead += len(drafts) if len(tokens) > base else 0
        return drafts


class AheadLookahead:
    """Drafts ahead as well as can be: the tokens the reference already has past those the
    runner's host saw (the steps in flight), then the reference's future; one chain of every
    third made wrong at one place, so chains fail where the steps in flight were, are kept in
    full, and are cut short."""

    def __init__(self, reference: RecomputeRunner) -> None:
        self.reference = reference
        self.calls = 0

    def propose(self, rows: list[int], tokens: list, ks: list[int]) -> list[np.ndarray]:
        chains = []
        for row, seen, k in zip(rows, tokens, ks, strict=True):
            self.calls += 1
            have = self.reference.tokens[row]
            assert have[: len(seen)] == list(seen)
            ahead = have[len(seen) :]
            future = self.reference.lookahead(row, max(k - len(ahead), 0))
            chain = np.array(ahead + future, np.int64)[:k]
            if self.calls % 3 == 0 and len(chain):
                wrong = self.calls % len(chain)
                chain[wrong] = (chain[wrong] + 1) % 160
            chains.append(chain)
        return chains

    def release(self, row: int, tokens: np.ndarray) -> None:
        pass


def walk_chain_drafts(
    folder: str, seed: int, steps: int, drafter: Callable, **options
) -> tuple[list, list, ChainRecorder]:
    """The walk with rows verifying up to 4 drafts a host drafter (``drafter(reference)``)
    drafted ahead, over the steps in flight, two steps deep; the reference verifies the
    drafts the device kept."""
    walk = PlanWalk(seed, 160, BLOCK, NUM_BLOCKS, PARAMS, max_drafts=4)
    reference = reference_runner(folder)
    recorder = ChainRecorder(drafter(reference))
    runner = pipelined_runner(folder, BLOCK, drafter=recorder, **options)

    def launch(plan: StepPlan):
        recorder.chains = {}
        return runner.launch(plan), recorder.kept

    expected, got = drive(walk, reference, runner, steps, launch)
    return expected, got, recorder


def assert_same_results(expected: list, got: list) -> None:
    assert [r.step_id for r in got] == [r.step_id for r in expected]
    for want, have in zip(expected, got, strict=True):
        assert have.error is None, have.error
        assert np.asarray(have.tokens).tolist() == np.asarray(want.tokens).tolist(), want.step_id
        assert np.asarray(have.emitted(len(have.emitted(0)) or len(have.tokens))).tolist() == (
            np.asarray(want.emitted(len(want.emitted(0)) or len(want.tokens))).tolist()
        )
        if want.logprobs is None:
            assert have.logprobs is None
            continue
        # The reference samples each row alone, so it has logprobs only for rows that asked.
        asked = [i for i, lp in enumerate(want.logprobs) if lp is not None]
        np.testing.assert_allclose(
            [have.logprobs[i] for i in asked], [want.logprobs[i] for i in asked], atol=1e-4
        )
        assert [[t for t, _ in have.top_logprobs[i]] for i in asked] == [
            [t for t, _ in want.top_logprobs[i]] for i in asked
        ]


def first_step_plan() -> StepPlan:
    """Step 0 of one greedy row: a 2-token prompt in a block of its own."""
    greedy = SamplingParams(temperature=0, max_tokens=None)
    return StepPlan(
        0,
        int32s([0]),
        int32s([0]),
        int32s([2]),
        int32s([1]),
        int64s([1, 2]),
        [NewRow(0, greedy, [1, 2], [])],
        new_blocks=int32s([0, 3]),
    )
