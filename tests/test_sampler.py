import json
import math

import pytest
import torch
from sampler_rows import SamplerRows

from sampler import Positions, Sampler, SamplingParams

VOCAB = 32


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


def greedy_rows(count: int, vocab: int = VOCAB) -> SamplerRows:
    rows = SamplerRows(vocab)
    rows.add_many(count, temperature=0.0)
    return rows


def test_greedy_equals_argmax():
    logits = random_logits(8)
    out = greedy_rows(8).step(logits)
    assert out.tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_greedy_takes_the_first_of_tied_maxima():
    logits = torch.zeros(3, VOCAB)
    logits[0, [4, 9]] = 2.0
    logits[1, [0, 31]] = 5.0
    logits[2, :] = 1.0
    assert greedy_rows(3).step(logits).tokens.tolist() == [4, 0, 0]


def test_padding_columns_beyond_vocab_are_ignored():
    logits = random_logits(4, VOCAB + 8)
    logits[:, VOCAB:] = 100.0
    out = greedy_rows(4).step(logits)
    assert out.tokens.tolist() == logits[:, :VOCAB].argmax(dim=-1).tolist()


def test_a_row_samples_in_any_order_of_the_batch():
    rows = greedy_rows(3)
    logits = random_logits(3)
    out = rows.step(logits[[2, 0, 1]], rows=[2, 0, 1])
    assert out.tokens.tolist() == logits[[2, 0, 1]].argmax(dim=-1).tolist()


def test_callers_logits_are_not_modified():
    logits = random_logits(3)
    before = logits.clone()
    rows = SamplerRows(VOCAB)
    rows.add_many(3, top_k=3, top_p=0.5, min_p=0.1, repetition_penalty=1.5, prompt=[1, 2])
    rows.step(logits)
    assert torch.equal(logits, before)


@pytest.mark.parametrize(
    "kwargs", [{"top_k": 1}, {"top_p": 1e-6}, {"min_p": 1.0}], ids=["top_k", "top_p", "min_p"]
)
def test_tightest_filter_equals_greedy(kwargs):
    logits = random_logits(16, seed=1)
    rows = SamplerRows(VOCAB, seed=0)
    rows.add_many(16, temperature=1.5, **kwargs)
    assert rows.step(logits).tokens.tolist() == logits.argmax(dim=-1).tolist()


def test_mixed_greedy_and_random_rows_keep_greedy_rows_exact():
    logits = random_logits(6, seed=2)
    rows = SamplerRows(VOCAB, seed=0)
    for i in range(6):
        rows.add(temperature=0.0 if i % 2 else 1.0)
    out = rows.step(logits)
    assert out.tokens.tolist()[1::2] == logits[1::2].argmax(dim=-1).tolist()


def test_top_k_only_samples_from_the_k_best():
    logits = torch.zeros(2000, VOCAB)
    logits[:, 10:13] = 1.0  # three best tokens, the rest are close behind
    rows = SamplerRows(VOCAB, seed=0)
    rows.add_many(2000, top_k=3)
    assert set(rows.step(logits).tokens.tolist()) == {10, 11, 12}


def test_top_p_keeps_the_smallest_prefix_reaching_p():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = probs.log().expand(2000, 4).contiguous()
    rows = SamplerRows(4, seed=0)
    rows.add_many(2000, top_p=0.7)
    assert set(rows.step(logits).tokens.tolist()) == {0, 1}


# --- Penalties and min_tokens ---------------------------------------------------------------


def penalised(rows: SamplerRows, logits: torch.Tensor) -> torch.Tensor:
    """``logits`` after the rows' penalties (row i of logits is row i)."""
    out = logits.clone()
    at = Positions.one_each(list(range(len(logits))), "cpu")
    rows.sampler._apply_penalties(out, at.rows, at)
    return out


def test_repetition_penalty_divides_positive_and_multiplies_negative_seen_logits():
    rows = SamplerRows(4)
    rows.emitted(rows.add(prompt=[0], repetition_penalty=2.0), [1])
    out = penalised(rows, torch.tensor([[2.0, -2.0, 2.0, -2.0]]))
    assert out.tolist() == [[1.0, -4.0, 2.0, -2.0]]


def test_presence_and_frequency_penalties_use_output_tokens_only():
    rows = SamplerRows(4)
    rows.emitted(rows.add(prompt=[3, 3], presence_penalty=0.5, frequency_penalty=0.25), [0, 0, 1])
    assert penalised(rows, torch.zeros(1, 4)).tolist() == [[-1.0, -0.75, 0.0, 0.0]]


def test_negative_presence_penalty_encourages_repeats():
    rows = SamplerRows(4)
    rows.emitted(rows.add(presence_penalty=-1.0), [2])
    assert penalised(rows, torch.zeros(1, 4)).tolist() == [[0.0, 0.0, 1.0, 0.0]]


def test_repetition_penalty_steers_greedy_away_from_a_repeat():
    rows = SamplerRows(4)
    rows.add(prompt=[0], temperature=0.0, repetition_penalty=2.0)
    assert rows.step(torch.tensor([[3.0, 2.0, 0.0, 0.0]])).tokens.tolist() == [1]


def test_penalties_only_touch_their_own_row():
    rows = SamplerRows(VOCAB)
    rows.add(temperature=0.0, repetition_penalty=5.0, prompt=list(range(VOCAB)))
    rows.add()
    logits = random_logits(2)
    out = penalised(rows, logits)
    assert torch.equal(out[1], logits[1])
    assert not torch.equal(out[0], logits[0])


def test_min_tokens_bans_stop_ids_until_reached():
    eos = 5
    logits = torch.zeros(1, 8)
    logits[0, eos] = 10.0
    rows = SamplerRows(8)
    rows.add(stop_ids=[eos], temperature=0.0, min_tokens=2)
    first, second, third = (rows.step(logits).tokens.item() for _ in range(3))
    assert first != eos and second != eos
    assert third == eos


# --- Random sampling ------------------------------------------------------------------------


def test_same_seed_gives_same_tokens_in_any_batch_and_position():
    row = random_logits(1, seed=7)[0] * 0.3  # flat enough that draws vary

    def run(batch: int, position: int) -> list[int]:
        logits = random_logits(batch, seed=batch)
        logits[position] = row
        rows = SamplerRows(VOCAB)
        for i in range(batch):
            rows.add(seed=1234 if i == position else None)
        for _ in range(10):
            rows.step(logits)
        return rows.outputs[position]

    reference = run(1, 0)
    assert run(5, 3) == reference
    assert run(12, 0) == reference
    assert len(set(reference)) > 1  # the steps draw fresh noise


def test_different_seeds_give_different_tokens():
    rows = SamplerRows(1000)
    rows.add(seed=1)
    rows.add(seed=2)
    for _ in range(5):
        rows.step(torch.zeros(2, 1000))
    assert rows.outputs[0] != rows.outputs[1]


def test_unseeded_sampling_from_a_peaked_distribution_picks_the_peak():
    logits = torch.zeros(4, VOCAB)
    logits[:, 9] = 50.0
    rows = SamplerRows(VOCAB)
    rows.add_many(4)
    assert rows.step(logits).tokens.tolist() == [9, 9, 9, 9]


@pytest.mark.parametrize("seeded", [False, True], ids=["unseeded", "per-row-seed"])
def test_sampled_frequencies_follow_probabilities(seeded):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    temperature = 2.0
    count = 4000
    logits = (probs.log() * temperature).expand(count, 4).contiguous()
    rows = SamplerRows(4, seed=0)
    for i in range(count):
        rows.add(temperature=temperature, seed=i if seeded else None)
    out = rows.step(logits)
    counts = torch.bincount(out.tokens, minlength=4).double()
    expected = probs.double() * count
    chi2 = (((counts - expected) ** 2) / expected).sum().item()
    assert chi2 < 16.3  # 3 degrees of freedom, p = 0.001


# --- Logprobs -------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_and_top_n_is_sorted():
    logits = random_logits(3)
    rows = SamplerRows(VOCAB, seed=0)
    rows.add(logprobs=5, temperature=0.7, repetition_penalty=1.3, prompt=[0, 1])
    rows.add(logprobs=0)
    rows.add()
    out = rows.step(logits)
    expected = logits.log_softmax(dim=-1)
    assert out.logprobs is not None and out.top_ids is not None
    for row, tok in enumerate(out.tokens.tolist()):
        assert out.logprobs[row].item() == pytest.approx(expected[row, tok].item(), abs=1e-6)
    assert out.top_ids[0].tolist() == expected[0].topk(5).indices.tolist()
    values = out.top_logprobs[0].tolist()
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(expected[0].topk(5).values.tolist(), abs=1e-6)
    assert out.wanted == [5, 0, None]


def test_no_logprobs_when_no_row_asks():
    rows = SamplerRows(VOCAB)
    rows.add()
    rows.add(temperature=0.0)
    out = rows.step(random_logits(2))
    assert out.logprobs is None and out.top_ids is None


# --- Input checks ---------------------------------------------------------------------------


def test_logits_narrower_than_vocab_are_rejected():
    rows = SamplerRows(VOCAB)
    rows.add()
    with pytest.raises(ValueError, match="vocab"):
        rows.step(torch.zeros(1, VOCAB - 1))


def test_batch_size_must_match_the_positions():
    rows = SamplerRows(VOCAB)
    rows.add()
    with pytest.raises(ValueError, match="logits"):
        rows.step(torch.zeros(2, VOCAB))


def test_a_vocabulary_that_is_not_a_positive_int_is_refused():
    with pytest.raises(ValueError, match="vocab_size"):
        Sampler(0, "cpu")
