"""The sampler (per-row settings on the device) picks what the plain reference sampler
(``tests/reference_sampler.py``, one state object per row) picks, and its seeded noise."""

from __future__ import annotations

import random

import pytest
import torch
from reference_sampler import Sampler as ReferenceSampler
from reference_sampler import SlotState

from sampler import Positions, Sample, Sampler, SamplingParams
from sampler.noise import exponential_noise, seed_to_int64

VOCAB = 64
EOS = 7


def random_logits(rows: int, seed: int, vocab: int = VOCAB, scale: float = 1.5) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * scale


def exp_noise(rows: int, seed: int, vocab: int = VOCAB) -> torch.Tensor:
    return torch.empty(rows, vocab).exponential_(generator=torch.Generator().manual_seed(seed))


def sample(sampler: Sampler, logits: torch.Tensor, rows: list[int], noise=None) -> Sample:
    """One token for each of ``rows``, counted as their next output (as a runner does)."""
    at = Positions.one_each(rows, logits.device)
    out = sampler.sample(logits, at, noise)
    sampler.record(at.rows, at.rows_dev, out.tokens)
    return out


class Twin:
    """The reference sampler and the sampler fed the same rows, logits and noise."""

    def __init__(self, vocab: int = VOCAB, capacity: int = 4) -> None:
        self.vocab = vocab
        self.ref = ReferenceSampler(vocab, seed=0)
        self.dev = Sampler(vocab, "cpu", rows=capacity, seed=0)
        self.states: dict[int, SlotState] = {}

    def add(self, row: int, params: SamplingParams, prompt=(), stops=()) -> None:
        prompt_ids = torch.tensor(prompt, dtype=torch.int64) if prompt else None
        self.states[row] = SlotState(params, prompt_ids, list(stops), [])
        self.dev.add_rows([row], [params], [list(prompt)], [list(stops)])

    def release(self, row: int) -> None:
        del self.states[row]
        self.dev.release_rows([row])

    def step(
        self, rows: list[int], logits: torch.Tensor, noise: torch.Tensor | None, monkeypatch
    ) -> tuple[list[int], Sample]:
        """Both samplers on one batch; ``noise`` None leaves each its own noise."""
        states = [self.states[r] for r in rows]
        if noise is None:
            if "_noise" in vars(self.ref):
                monkeypatch.delattr(self.ref, "_noise")  # back to its own
        else:
            monkeypatch.setattr(self.ref, "_noise", lambda shape, states, device: noise)
        want = self.ref.sample(logits, states).tokens
        return want, sample(self.dev, logits, rows, noise)


def run_steps(twin: Twin, steps: int, monkeypatch, seed: int = 0) -> list[tuple[list, list]]:
    """Steps over the twin's rows, in a new order each step; (reference, sampler) tokens."""
    order = random.Random(seed)
    out = []
    for step in range(steps):
        rows = list(twin.states)
        order.shuffle(rows)
        logits = random_logits(len(rows), seed=1000 * seed + step, vocab=twin.vocab)
        noise = exp_noise(len(rows), seed=step, vocab=twin.vocab)
        want, got = twin.step(rows, logits, noise, monkeypatch)
        out.append((want, got.tokens.tolist()))
    return out


# --- Equal to Sampler -----------------------------------------------------------------------


def test_greedy_rows_pick_what_sampler_picks(monkeypatch):
    twin = Twin()
    for row in (0, 2, 3):
        twin.add(row, SamplingParams(temperature=0.0))
    for want, got in run_steps(twin, 5, monkeypatch):
        assert got == want


@pytest.mark.parametrize(
    "kwargs",
    [
        {"temperature": 0.7},
        {"temperature": 1.3, "top_k": 5},
        {"top_p": 0.8},
        {"min_p": 0.1},
        {"temperature": 0.9, "top_k": 8, "top_p": 0.7},
        {"repetition_penalty": 1.8},
        {"presence_penalty": 1.5},
        {"frequency_penalty": 0.9},
        {"repetition_penalty": 0.7, "presence_penalty": -0.5, "frequency_penalty": 0.4},
    ],
    ids=lambda kw: ",".join(kw),
)
def test_each_filter_and_penalty_picks_what_sampler_picks_given_the_same_noise(kwargs, monkeypatch):
    twin = Twin(vocab=50)
    for row in (0, 1, 2, 3):  # the prompt matters to repetition_penalty only
        twin.add(row, SamplingParams(**kwargs), prompt=[row, 10 + row, 20])
    steps = run_steps(twin, 12, monkeypatch)
    for want, got in steps:
        assert got == want


def test_rows_with_different_settings_each_pick_what_sampler_picks(monkeypatch):
    twin = Twin(vocab=50, capacity=8)
    kinds = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=6),
        SamplingParams(top_p=0.6, min_p=0.05),
        SamplingParams(temperature=0.0, repetition_penalty=2.0, frequency_penalty=0.5),
        SamplingParams(presence_penalty=1.0, min_tokens=4),
        SamplingParams(temperature=1e-6, top_k=3),  # below the greedy threshold
    ]
    for row, params in enumerate(kinds):
        twin.add(row + 2, params, prompt=[1, 2, 3], stops=[EOS])
    for want, got in run_steps(twin, 10, monkeypatch):
        assert got == want


def test_min_tokens_bans_stop_ids_until_reached_then_lifts_it(monkeypatch):
    twin = Twin()
    twin.add(1, SamplingParams(min_tokens=3), stops=[EOS, 99, 3])  # 99 is outside the vocab
    twin.add(0, SamplingParams(temperature=0.0))
    for step in range(5):
        logits = random_logits(2, seed=step)
        logits[:, EOS] = 30.0
        want, got = twin.step([1, 0], logits, exp_noise(2, seed=step), monkeypatch)
        tokens = got.tokens.tolist()
        assert tokens == want
        assert tokens[0] == EOS if step >= 3 else tokens[0] not in (EOS, 3)
        assert tokens[1] == EOS  # a row without stop ids is never banned


def test_a_batch_of_only_some_rows_counts_steps_per_row(monkeypatch):
    twin = Twin()
    for row in range(4):
        twin.add(row, SamplingParams(frequency_penalty=1.0, min_tokens=2), stops=[EOS])
    for step in range(8):
        rows = [3, 1] if step % 2 else [0, 2, 1]
        logits = random_logits(len(rows), seed=step)
        logits[:, EOS] = 5.0
        want, got = twin.step(rows, logits, exp_noise(len(rows), seed=step), monkeypatch)
        assert got.tokens.tolist() == want


def test_low_precision_logits_with_padding_columns(monkeypatch):
    twin = Twin()
    twin.add(0, SamplingParams(top_k=4))
    twin.add(1, SamplingParams(temperature=0.0))
    logits = torch.cat([random_logits(2, seed=3), torch.full((2, 8), 100.0)], dim=1)
    logits = logits.to(torch.bfloat16)
    before = logits.clone()
    want, got = twin.step([0, 1], logits, exp_noise(2, seed=3), monkeypatch)
    assert got.tokens.tolist() == want
    assert torch.equal(logits, before)  # the caller's logits are left alone


# --- Seeded sampling ------------------------------------------------------------------------


def seeded_tokens(seed: int, batch: int, position: int, steps: int = 8) -> list[int]:
    """A seeded row's tokens, among ``batch - 1`` unseeded rows."""
    sampler = Sampler(VOCAB, "cpu", rows=2)
    rows = [10 + i for i in range(batch)]
    params = [SamplingParams(temperature=1.5) for _ in rows]
    params[position] = SamplingParams(temperature=1.5, seed=seed)
    sampler.add_rows(rows, params, [[] for _ in rows], [[] for _ in rows])
    row = random_logits(1, seed=7)[0]
    out = []
    for step in range(steps):
        logits = random_logits(batch, seed=100 * batch + step)
        logits[position] = row
        got = sample(sampler, logits, rows)
        out.append(got.tokens[position].item())
    return out


def test_a_seeded_row_draws_the_same_tokens_in_any_batch_and_position():
    reference = seeded_tokens(1234, batch=1, position=0)
    assert seeded_tokens(1234, batch=5, position=3) == reference
    assert seeded_tokens(1234, batch=9, position=8) == reference
    assert len(set(reference)) > 1  # every step draws fresh noise


def test_different_seeds_draw_different_tokens():
    assert seeded_tokens(1, batch=2, position=0) != seeded_tokens(2, batch=2, position=0)


def test_seeded_rows_pick_the_same_tokens_as_the_reference(monkeypatch):
    twin = Twin(vocab=200)
    seeds = [0, 7, 2**63, 2**64 - 1]
    for row, seed in enumerate(seeds):
        twin.add(row, SamplingParams(temperature=2.0, top_p=0.95, seed=seed))
    run_steps(twin, 3, monkeypatch)  # injected noise first: the steps count on regardless
    for step in range(6):
        rows = [3, 1, 0, 2]
        logits = random_logits(4, seed=50 + step, vocab=200)
        want, got = twin.step(rows, logits, None, monkeypatch)
        assert got.tokens.tolist() == want


def test_exponential_noise_is_a_deterministic_function_of_seed_step_and_token():
    seeds = torch.tensor([1, 1, 2, seed_to_int64(2**64 - 1)])
    steps = torch.tensor([0, 1, 0, 0])
    noise = exponential_noise(seeds, steps, 300)
    assert torch.equal(noise, exponential_noise(seeds, steps, 300))
    assert torch.equal(noise[:1], exponential_noise(seeds[:1], steps[:1], 300))
    assert torch.equal(noise[:, :100], exponential_noise(seeds, steps, 100))
    assert not torch.equal(noise[0], noise[1])  # another step
    assert not torch.equal(noise[0], noise[2])  # another seed


def test_exponential_noise_is_positive_finite_with_mean_one():
    noise = exponential_noise(torch.arange(64), torch.zeros(64, dtype=torch.int64), 4096)
    assert noise.dtype == torch.float32
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert noise.double().mean().item() == pytest.approx(1.0, abs=0.01)
    assert noise.double().var().item() == pytest.approx(1.0, abs=0.03)  # Exp(1)'s variance


def test_seeds_from_two_to_the_63_up_are_their_own_streams():
    high = [2**63, 2**63 + 1, 2**64 - 1]
    seeds = torch.tensor([seed_to_int64(s) for s in high] + [0, 1])
    noise = exponential_noise(seeds, torch.zeros(5, dtype=torch.int64), 200)
    assert bool((noise > 0).all()) and bool(noise.isfinite().all())
    assert len({tuple(row.tolist()) for row in noise}) == 5


# --- Rows -----------------------------------------------------------------------------------


def test_a_reused_row_starts_with_zero_counts_and_min_tokens_again(monkeypatch):
    params = SamplingParams(frequency_penalty=2.0, repetition_penalty=1.5, min_tokens=2)
    used = Twin()
    used.add(2, params, prompt=[1, 2], stops=[EOS])
    run_steps(used, 6, monkeypatch)
    used.release(2)
    used.add(2, params, prompt=[3], stops=[EOS])
    fresh = Twin()
    fresh.add(2, params, prompt=[3], stops=[EOS])
    for step in range(4):
        logits = random_logits(1, seed=step)
        logits[0, EOS] = 6.0
        noise = exp_noise(1, seed=step)
        want, reused = used.step([2], logits, noise, monkeypatch)
        _, new = fresh.step([2], logits, noise, monkeypatch)
        assert reused.tokens.tolist() == new.tokens.tolist() == want
        if step < 2:
            assert want != [EOS]


def test_a_row_beyond_the_initial_capacity_grows_the_sampler(monkeypatch):
    twin = Twin(capacity=4)
    twin.add(1, SamplingParams(presence_penalty=1.0), stops=[EOS])
    run_steps(twin, 2, monkeypatch)
    twin.add(200, SamplingParams(top_k=3, min_tokens=2), stops=[EOS, 1, 2, 3, 4])
    assert twin.dev.capacity > 200
    for want, got in run_steps(twin, 4, monkeypatch, seed=1):
        assert got == want


def test_sampling_a_row_that_was_not_added_is_an_error():
    sampler = Sampler(VOCAB, "cpu", rows=4)
    sampler.add_rows([0], [SamplingParams()], [[]], [[]])
    sampler.release_rows([0])
    with pytest.raises(ValueError, match="not added"):
        sample(sampler, random_logits(1, seed=0), [0])


# --- Logprobs -------------------------------------------------------------------------------


def test_logprobs_and_top_k_equal_samplers_with_k_the_most_any_row_asked(monkeypatch):
    twin = Twin()
    asked = [3, None, 0, 5]
    for row, n in enumerate(asked):
        twin.add(row, SamplingParams(logprobs=n, temperature=0.8, repetition_penalty=1.3), [0, 1])
    rows = [0, 1, 2, 3]
    states = [twin.states[r] for r in rows]
    monkeypatch.setattr(twin.ref, "_noise", lambda shape, states, device: exp_noise(4, 0))
    logits = random_logits(4, seed=0)
    ref = twin.ref.sample(logits, states)
    got = sample(twin.dev, logits, rows, exp_noise(4, 0))

    assert got.wanted == asked
    assert got.tokens.tolist() == ref.tokens
    assert got.logprobs is not None and got.top_ids is not None and got.top_logprobs is not None
    assert torch.allclose(got.logprobs, torch.tensor(ref.logprobs), atol=1e-6)
    assert got.top_ids.shape == got.top_logprobs.shape == (4, 5)
    assert ref.top_logprobs is not None
    for i, n in enumerate(asked):
        ids = got.top_ids[i, : n or 0].tolist()
        values = got.top_logprobs[i, : n or 0]
        assert ids == [t for t, _ in ref.top_logprobs[i]]
        assert torch.allclose(values, torch.tensor([v for _, v in ref.top_logprobs[i]]), atol=1e-6)


def test_no_logprobs_when_no_row_asked_and_no_top_when_all_asked_zero():
    sampler = Sampler(VOCAB, "cpu")
    sampler.add_rows([0, 1], [SamplingParams(), SamplingParams(logprobs=0)], [[], []], [[], []])
    quiet = sample(sampler, random_logits(1, seed=0), [0])
    assert (quiet.logprobs, quiet.top_ids, quiet.top_logprobs) == (None, None, None)
    assert quiet.wanted == [None]
    zero = sample(sampler, random_logits(2, seed=1), [1, 0])
    assert zero.logprobs is not None and zero.logprobs.shape == (2,)
    assert zero.top_ids is None and zero.top_logprobs is None
    assert zero.wanted == [0, None]


# --- CUDA -----------------------------------------------------------------------------------


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA device")


@pytest.mark.cuda
@needs_gpu
def test_exponential_noise_is_bit_identical_on_cuda():
    seeds = torch.tensor([0, 5, seed_to_int64(2**64 - 1), -12345])
    steps = torch.tensor([0, 3, 9, 2**40])
    cpu = exponential_noise(seeds, steps, 50_000)
    cuda = exponential_noise(seeds.cuda(), steps.cuda(), 50_000)
    assert torch.equal(cuda.cpu(), cpu)


@pytest.mark.cuda
@needs_gpu
def test_sample_on_cuda_never_waits_on_the_host_and_matches_cpu():
    rows = [5, 0, 9, 3]
    params = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(top_k=5, top_p=0.9, seed=11, repetition_penalty=1.4),
        SamplingParams(min_p=0.05, frequency_penalty=0.5, presence_penalty=0.3, min_tokens=3),
        SamplingParams(temperature=0.7, seed=2**64 - 1, logprobs=4),
    ]
    samplers = {}
    for device in ("cpu", "cuda"):
        samplers[device] = Sampler(200, device, rows=4, seed=0)
        samplers[device].add_rows(rows, params, [[1, 2, 3]] * 4, [[EOS]] * 4)
    steps = 6
    logits = [random_logits(4, seed=s, vocab=208) for s in range(steps)]
    noise = [exp_noise(4, seed=s, vocab=200) if s % 2 else None for s in range(steps)]
    at = Positions(torch.tensor(rows), torch.tensor(rows).cuda())
    inputs = [
        (x.cuda(), None if n is None else n.cuda()) for x, n in zip(logits, noise, strict=True)
    ]
    torch.cuda.synchronize()

    on_cuda = []
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, n in inputs:
            got = samplers["cuda"].sample(x, at, n)
            samplers["cuda"].record(at.rows, at.rows_dev, got.tokens)
            on_cuda.append(got)
    finally:
        torch.cuda.set_sync_debug_mode("default")

    for got, x, n in zip(on_cuda, logits, noise, strict=True):
        want = sample(samplers["cpu"], x, rows, n)
        assert got.tokens.tolist() == want.tokens.tolist()
        assert got.logprobs is not None and want.logprobs is not None
        assert torch.allclose(got.logprobs.cpu(), want.logprobs, atol=1e-5)
