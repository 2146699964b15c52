"""Shared fixtures: the default model (converted once), a tiny random Llama, HF references."""

from __future__ import annotations

from pathlib import Path

import hypothesis  # noqa: F401  (see below)
import pytest

# Imported here, at collection, on purpose: otherwise hypothesis's plugin imports it at
# session finish from deep inside pytest's hooks, where CPython 3.11.7's assertion-rewrite
# compile can fail with "AST constructor recursion depth mismatch".

# Real English, so greedy decoding has clear winners (random ids invite near-ties).
TEXT = (
    "The history of the lighthouse begins in the ancient world, when fires were lit on hills "
    "to guide ships home. Over centuries, keepers tended lamps of oil and later of gas, "
    "climbing narrow stairs every evening. Sailors learned to read each light by its colour "
    "and rhythm, and harbours grew busy and safe. Today most lights run by themselves, yet "
    "people still visit them to watch the sea, to listen to the wind, and to imagine the "
    "long nights of those who kept them burning. In small towns along the coast, children "
    "hear stories of storms and rescues, of boats that found the harbour by a single flame, "
    "and of keepers who wrote letters by lamplight while the waves struck the rocks below. "
)


@pytest.fixture(scope="session")
def default_model() -> Path:
    from async_engine.model import resolve_model

    return resolve_model("default")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory, default_model: Path) -> Path:
    from tiny_models import make_tiny_llama

    folder = tmp_path_factory.mktemp("tiny-llama")
    make_tiny_llama(folder, tokenizer_from=default_model)
    return folder


@pytest.fixture(scope="session")
def tokenizer(default_model: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(default_model))


@pytest.fixture(scope="session")
def mixed_prompts(tokenizer) -> list[list[int]]:
    """8 prompts of mixed lengths: one spans several 16-token blocks, one gets chunked."""
    ids = tokenizer(TEXT * 3)["input_ids"]
    return [ids[:n] for n in (5, 17, 33, 64, 100, 150, 300, 12)]


@pytest.fixture(scope="module")
def chat_server(default_model: Path):
    """The default model's OpenAI HTTP API (float32, the same greedy answers on every CPU),
    one per test module."""
    from server_helpers import http_server

    srv = http_server(default_model, dtype="float32", device_threads=2)
    yield srv
    srv.close()


@pytest.fixture
def chat_client(chat_server):
    from server_helpers import openai_client

    return openai_client(chat_server)
