import json
import math

import pytest
import torch

from sampler import Sampler, SamplingParams, SlotState
from sampler.sampler import _apply_penalties

VOCAB = 32


def state(prompt: list[int] | None = None, stop_ids: list[int] | None = None, **kw) -> SlotState:
    prompt_ids = torch.tensor(prompt, dtype=torch.int64) if prompt is not None else None
    return SlotState(SamplingParams(**kw), prompt_ids, list(stop_ids or []), [])


def random_logits(rows: int, vocab: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 3


# --- SamplingParams ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens"),
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_p": math.nan}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": -0.1}, "min_p"),
        ({"min_p": 1.1}, "min_p"),
        ({"min_p": math.nan}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"repetition_penalty": math.nan}, "repetition_penalty"),
        ({"repetition_penalty": math.inf}, "repetition_penalty"),
        ({"presence_penalty": math.nan}, "presence_penalty"),
        ({"presence_penalty": math.inf}, "presence_penalty"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -math.inf}, "frequency_penalty"),
        ({"frequency_penalty": -2.5}, "frequency_penalty"),
        ({"n": 0}, "n"),
        ({"stop": ["ok", ""]}, "stop"),
        ({"stop": ""}, "stop"),
        ({"stop": [1]}, "stop"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids"),
        ({"logprobs": -1}, "logprobs"),
        ({"logprobs": 21}, "logprobs"),
        ({"seed": -1}, "seed"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": True}, "max_tokens"),
        ({"top_k": False}, "top_k"),
        ({"n": 1.0}, "n"),
        ({"seed": True}, "seed"),
        ({"stop_token_ids": [True]}, "stop_token_ids"),
        ({"temperature": "hot"}, "temperature"),
        ({"temperature": True}, "temperature"),
        ({"ignore_eos": 1}, "ignore_eos"),
    ],
)
def test_invalid_params_raise_value_error_naming_the_field(kwargs, field):
    with pytest.raises(ValueError) as err:
        SamplingParams(**kwargs)
    assert str(err.value).startswith(field)


def test_valid_edge_values_are_accepted():
    SamplingParams(
        max_tokens=None,
        min_tokens=100,
        temperature=0,
        top_k=0,
        top_p=1e-9,
        min_p=1.0,
        presence_penalty=-2,
        frequency_penalty=2,
        seed=2**64 - 1,
        logprobs=20,
    )


def test_stop_and_stop_token_ids_are_normalised_to_tuples():
    p = SamplingParams(stop=["a", "b"], stop_token_ids=[1, 2])
    assert p.stop == ("a", "b")
    assert p.stop_token_ids == (1, 2)
    assert SamplingParams(stop="end").stop == ("end",)


def test_int_given_for_float_field_is_stored_as_float():
    assert SamplingParams(temperature=1).temperature == 1.0
    assert isinstance(SamplingParams(temperature=1).temperature, float)


def test_greedy_property_means_temperature_zero():
    assert SamplingParams(temperature=0.0).greedy
    assert not SamplingParams(temperature=0.5).greedy


def test_params_are_frozen():
    with pytest.raises(AttributeError):
        SamplingParams().temperature = 2.0  # type: ignore[misc]


def test_to_dict_from_dict_round_trips_through_json():
    p = SamplingParams(max_tokens=7, stop=["x"], stop_token_ids=[3], seed=5, logprobs=2)
    assert SamplingParams.from_dict(json.loads(json.dumps(p.to_dict()))) == p


def test_from_dict_rejects_unknown_fields_by_name():
    with pytest.raises(ValueError, match="bogus.*tempreature"):
        SamplingParams.from_dict({"tempreature": 0.5, "bogus": 1})


def test_from_dict_rejects_non_objects():
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]


# --- Sampler: greedy and filters ------------------------------------------------------------


def test_greedy_equals_argmax():
    logits = random_logits(8)
    out = Sampler(VOCAB).sample(logits, [state(temperature=0.0) for _ in range(8)])
    assert out.tokens == logits.argmax(dim=-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima():
    logits = torch.zeros(3, VOCAB)
    logits[0, [4, 9]] = 2.0
    logits[1, [0, 31]] = 5.0
    logits[2, :] = 1.0
    out = Sampler(VOCAB).sample(logits, [state(temperature=0.0) for _ in range(3)])
    assert out.tokens == [4, 0, 0]


def test_padding_columns_beyond_vocab_are_ignored():
    logits = random_logits(4, VOCAB + 8)
    logits[:, VOCAB:] = 100.0
    out = Sampler(VOCAB).sample(logits, [state(temperature=0.0) for _ in range(4)])
    assert out.tokens == logits[:, :VOCAB].argmax(dim=-1).tolist()


def test_sampled_token_is_appended_to_output_ids():
    states = [state(temperature=0.0), state(seed=3)]
    out = Sampler(VOCAB).sample(random_logits(2), states)
    assert [s.output_ids for s in states] == [[out.tokens[0]], [out.tokens[1]]]


def test_callers_logits_are_not_modified():
    logits = random_logits(3)
    before = logits.clone()
    states = [state(top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5, prompt=[1, 2])] * 3
    Sampler(VOCAB).sample(logits, states)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_tightest_filter_equals_greedy(kwargs):
    logits = random_logits(16, seed=1)
    states = [state(temperature=1.5, **kwargs) for _ in range(16)]
    out = Sampler(VOCAB, seed=0).sample(logits, states)
    assert out.tokens == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_random_rows_keep_greedy_rows_exact():
    logits = random_logits(6, seed=2)
    states = [state(temperature=0.0 if i % 2 else 1.0) for i in range(6)]
    out = Sampler(VOCAB, seed=0).sample(logits, states)
    assert out.tokens[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_top_k_only_samples_from_the_k_best():
    logits = torch.zeros(2000, VOCAB)
    logits[:, 10:13] = 1.0  # three best tokens, the rest are close behind
    out = Sampler(VOCAB, seed=0).sample(logits, [state(top_k=3)] * 2000)
    assert set(out.tokens) == {10, 11, 12}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4).contiguous()
    out = Sampler(4, seed=0).sample(logits, [state(top_p=0.7)] * 2000)
    assert set(out.tokens) == {0, 1}


# --- Penalties and min_tokens ---------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    logits = torch.tensor([[2.0, -2.0, 2.0, -2.0]])
    s = state(prompt=[0], repetition_penalty=2.0)
    s.output_ids.append(1)
    _apply_penalties(logits, [s])
    assert logits.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_use_output_tokens_only():
    logits = torch.zeros(1, 4)
    s = state(prompt=[3, 3], presence_penalty=0.5, frequency_penalty=0.25)
    s.output_ids.extend([0, 0, 1])
    _apply_penalties(logits, [s])
    assert logits.tolist() == [[-1.0, -0.75, 0.0, 0.0]]


def test_negative_presence_penalty_encourages_repeats():
    logits = torch.zeros(1, 4)
    s = state(presence_penalty=-1.0)
    s.output_ids.append(2)
    _apply_penalties(logits, [s])
    assert logits.tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_repetition_penalty_steers_greedy_away_from_a_repeat():
    logits = torch.tensor([[3.0, 2.0, 0.0, 0.0]])
    out = Sampler(4).sample(logits, [state(prompt=[0], temperature=0.0, repetition_penalty=2.0)])
    assert out.tokens == [1]


def test_penalties_only_touch_their_own_row():
    logits = random_logits(2)
    states = [state(temperature=0.0, repetition_penalty=5.0, prompt=list(range(VOCAB))), state()]
    before = logits.clone()
    _apply_penalties(logits, states)
    assert torch.equal(logits[1], before[1])
    assert not torch.equal(logits[0], before[0])


def test_min_tokens_bans_stop_ids_until_reached():
    eos = 5
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    s = state(stop_ids=[eos], temperature=0.0, min_tokens=2)
    sampler = Sampler(8)
    first = sampler.sample(logits, [s]).tokens[0]
    second = sampler.sample(logits, [s]).tokens[0]
    third = sampler.sample(logits, [s]).tokens[0]
    assert first != eos and second != eos
    assert third == eos


# --- Random sampling ------------------------------------------------------------------------


def test_same_seed_gives_same_tokens_in_any_batch_and_position():
    row = random_logits(1, seed=7)[0] * 0.3  # flat enough that draws vary

    def run(batch: int, position: int) -> list[int]:
        logits = random_logits(batch, seed=batch)
        logits[position] = row
        states = [state() for _ in range(batch)]
        states[position] = state(seed=1234)
        sampler = Sampler(VOCAB)
        for _ in range(10):
            sampler.sample(logits, states)
        return states[position].output_ids

    reference = run(1, 0)
    assert run(5, 3) == reference
    assert run(12, 0) == reference
    assert len(set(reference)) > 1  # the steps draw fresh noise


def test_different_seeds_give_different_tokens():
    logits = torch.zeros(2, 1000)
    states = [state(seed=1), state(seed=2)]
    sampler = Sampler(1000)
    for _ in range(5):
        sampler.sample(logits, states)
    assert states[0].output_ids != states[1].output_ids


def test_unseeded_sampling_from_a_peaked_distribution_picks_the_peak():
    logits = torch.zeros(4, VOCAB)
    logits[:, 9] = 50.0
    out = Sampler(VOCAB).sample(logits, [state() for _ in range(4)])
    assert out.tokens == [9, 9, 9, 9]


@pytest.mark.parametrize("seeded", [False, True], ids=["shared", "per-row-seed"])
def test_sampled_frequencies_follow_probabilities(seeded):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    temperature = 2.0
    rows = 4000
    logits = (probs.log() * temperature).expand(rows, 4).contiguous()
    states = [state(temperature=temperature, seed=i if seeded else None) for i in range(rows)]
    out = Sampler(4, seed=0).sample(logits, states)
    counts = torch.bincount(torch.tensor(out.tokens), minlength=4).double()
    expected = probs.double() * rows
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


# --- Logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_n_is_sorted():
    logits = random_logits(3)
    states = [
        state(logprobs=5, temperature=0.7, repetition_penalty=1.3, prompt=[0, 1]),
        state(logprobs=0),
        state(),
    ]
    out = Sampler(VOCAB, seed=0).sample(logits, states)
    expected = logits.log_softmax(dim=-1)
    assert out.logprobs is not None and out.top_logprobs is not None
    for row, tok in enumerate(out.tokens):
        assert out.logprobs[row] == pytest.approx(expected[row, tok].item(), abs=1e-6)
    top = out.top_logprobs[0]
    assert [t for t, _ in top] == expected[0].topk(5).indices.tolist()
    assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
    assert [v for _, v in top] == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-6)
    assert out.top_logprobs[1] == [] and out.top_logprobs[2] == []


def test_no_logprobs_when_no_row_asks():
    out = Sampler(VOCAB).sample(random_logits(2), [state(), state(temperature=0.0)])
    assert out.logprobs is None and out.top_logprobs is None


# --- Input checks ---------------------------------------------------------------------------


def test_logits_narrower_than_vocab_are_rejected():
    with pytest.raises(ValueError, match="vocab"):
        Sampler(VOCAB).sample(torch.zeros(1, VOCAB - 1), [state()])


def test_batch_size_must_match_states():
    with pytest.raises(ValueError, match="logits"):
        Sampler(VOCAB).sample(torch.zeros(2, VOCAB), [state()])
