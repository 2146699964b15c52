"""The byte table decodes exactly as the tokenizer does, or is not used."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from async_engine.core.byte_table import ByteTable
from async_engine.core.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> Tokenizer:
    return Tokenizer(default_model)


def test_the_default_models_tokenizer_gets_a_byte_table(tokenizer):
    assert tokenizer.byte_table is not None


@settings(max_examples=300, deadline=None)
@given(ids=st.lists(st.integers(0, 49151), max_size=60), skip=st.booleans())
def test_any_ids_decode_as_the_tokenizer_decodes_them(tokenizer, ids, skip):
    expected = tokenizer.hf._tokenizer.decode(ids, skip_special_tokens=skip)
    assert tokenizer.byte_table.decode(ids, skip) == expected


def test_a_character_split_across_tokens_comes_out_whole_or_as_a_replacement(tokenizer):
    ids = tokenizer.encode("naïve café ☕ 日本語")
    table, backend = tokenizer.byte_table, tokenizer.hf._tokenizer
    for end in range(1, len(ids) + 1):  # every cut, including mid-character ones
        assert table.decode(ids[:end]) == backend.decode(ids[:end], skip_special_tokens=True)


def test_special_tokens_are_skipped_or_kept_as_the_tokenizer_does(tokenizer):
    ids = [1, *tokenizer.encode("hi"), 2]  # <|im_start|> hi <|im_end|>
    assert tokenizer.byte_table.decode(ids, True) == "hi"
    assert tokenizer.byte_table.decode(ids, False) == "<|im_start|>hi<|im_end|>"


def test_an_id_past_the_vocabulary_spells_nothing_as_in_the_tokenizer(tokenizer):
    ids = [100, 60_000, 200]
    expected = tokenizer.hf._tokenizer.decode(ids, skip_special_tokens=True)
    assert tokenizer.byte_table.decode(ids) == expected


def test_a_table_that_disagrees_with_the_tokenizer_is_not_used(tokenizer, monkeypatch):
    import async_engine.core.byte_table as byte_table

    wrong = byte_table._unicode_to_byte()
    wrong["a"] = ord("b")  # one character spelled wrong
    monkeypatch.setattr(byte_table, "_unicode_to_byte", lambda: wrong)
    assert ByteTable.of(tokenizer.hf) is None


def test_a_tokenizer_that_is_not_byte_level_bpe_gets_no_table(tokenizer, monkeypatch):
    monkeypatch.setattr(tokenizer.hf, "clean_up_tokenization_spaces", True, raising=False)
    assert ByteTable.of(tokenizer.hf) is None


def test_decoding_random_outputs_gives_the_tokenizers_text(tokenizer):
    rng = random.Random(3)
    runs = [[rng.randrange(49152) for _ in range(rng.randrange(1, 200))] for _ in range(200)]
    expected = tokenizer.hf._tokenizer.decode_batch(runs, skip_special_tokens=True)
    assert [tokenizer.decode(run) for run in runs] == expected
