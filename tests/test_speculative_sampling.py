"""Verified sampling keeps the target's distribution: over many seeds, a sampled row's token
at a verified position follows the model's distribution there whatever was drafted, and a
draft is kept as often as the model would have sampled it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from pipelined_runs import make_tiny_model, reference_runner, seeded_model

from sampler.params import SamplingParams
from streams.pipeline.runner import PipelinedRunner
from streams.plan import DRAFT, NewRow, StepPlan, int32s, int64s

PROMPT = [3, 17, 42, 99, 5]
ROWS = 4000
TEMPERATURE = 0.2  # the tiny model's likeliest token then has about 0.3 of the mass


class Always:
    """Drafts the same token for every row."""

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, rows, tokens, ks):
        return [np.array([self.token] * k, np.int64) for k in ks]

    def release(self, row, tokens):
        pass


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    return make_tiny_model(tmp_path_factory.mktemp("tiny-spec"))


def distribution(folder: str, tokens: list[int]) -> np.ndarray:
    logits = reference_runner(folder)._last_logits(tokens)[0]
    return torch.softmax(logits / TEMPERATURE, -1).double().numpy()


def chi_square(samples: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    """Pearson's statistic over the tokens expected at least 10 times (the rest pooled), and
    its degrees of freedom."""
    expected = probs * len(samples)
    counts = np.bincount(samples, minlength=len(probs)).astype(float)
    big = expected >= 10
    observed = np.append(counts[big], counts[~big].sum())
    wanted = np.append(expected[big], expected[~big].sum())
    keep = wanted > 0
    stat = float(((observed[keep] - wanted[keep]) ** 2 / wanted[keep]).sum())
    return stat, int(keep.sum()) - 1


def critical(dof: int, z: float = 3.09) -> float:
    """The chi-square value a true distribution exceeds with probability 0.001 (z = 3.09),
    by the Wilson-Hilferty approximation."""
    return dof * (1 - 2 / (9 * dof) + z * np.sqrt(2 / (9 * dof))) ** 3


def verify_once(folder: str, draft: int) -> tuple[np.ndarray, np.ndarray]:
    """ROWS seeded rows each verify one draft after the prompt; each row's emitted tokens."""
    runner = PipelinedRunner(
        seeded_model(folder), ROWS + 1, 16, 2, cuda_graphs=False, drafter=Always(draft)
    )
    rows = np.arange(ROWS, dtype=np.int32)
    params = [SamplingParams(temperature=TEMPERATURE, seed=i, max_tokens=None) for i in range(ROWS)]
    head = StepPlan(
        0,
        rows,
        int32s([0] * ROWS),
        int32s([len(PROMPT) - 1] * ROWS),
        int32s([0] * ROWS),
        int64s(PROMPT[:-1] * ROWS),
        [NewRow(i, params[i], PROMPT, []) for i in range(ROWS)],
        new_blocks=np.stack([rows, rows]).T.reshape(-1).astype(np.int32),
    )
    runner.finish(runner.launch(head))
    verify = StepPlan(
        1,
        rows,
        int32s([len(PROMPT) - 1] * ROWS),
        int32s([2] * ROWS),
        int32s([2] * ROWS),
        int64s([PROMPT[-1], DRAFT] * ROWS),
    )
    result = runner.finish(runner.launch(verify))
    assert result.error is None, result.error
    return np.asarray(result.tokens), result.emitted(ROWS)


def test_a_verified_position_samples_the_models_distribution_and_keeps_drafts_as_often(tiny):
    folder = tiny
    first = distribution(folder, PROMPT)
    draft = int(first.argmax())
    tokens, counts = verify_once(folder, draft)
    starts = np.cumsum(counts) - counts
    at_first = tokens[starts]
    stat, dof = chi_square(at_first, first)
    assert stat < critical(dof), (stat, dof)
    kept = counts == 2
    assert np.array_equal(kept, at_first == draft)
    assert abs(kept.mean() - first[draft]) < 4 * np.sqrt(first[draft] * (1 - first[draft]) / ROWS)
    # After a kept draft the next position follows the model's distribution after it.
    second = distribution(folder, [*PROMPT, draft])
    stat, dof = chi_square(tokens[starts[kept] + 1], second)
    assert stat < critical(dof), (stat, dof)


def test_a_biased_verifier_fails_the_same_check(tiny):
    """The check's power: tokens from a distribution with the draft's share grown by a fifth
    (as a verifier that kept drafts too often would give) fail it."""
    first = distribution(tiny, PROMPT)
    draft = int(first.argmax())
    biased = first.copy()
    biased[draft] *= 1.2
    biased /= biased.sum()
    rng = np.random.default_rng(0)
    stat, dof = chi_square(rng.choice(len(first), ROWS, p=biased), first)
    assert stat >= critical(dof)
