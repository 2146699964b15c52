"""The tokenizer llguidance reads: written by the engine's process on the first structured
request, read by the device process instead of loading transformers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from async_engine import LLM, SamplingParams
from streams.grammar import (
    TEXT_FILE_PREFIX,
    Grammars,
    TokenizerSource,
    TokenizerText,
    new_text_file,
)


def test_the_saved_text_is_what_transformers_loads(default_model: Path, tmp_path: Path):
    saved = tmp_path / "tokenizer.json"
    TokenizerText.of_folder(str(default_model)).save(str(saved))
    source = TokenizerSource(str(tmp_path / "no-such-model"), str(saved))
    assert TokenizerText.load(source) == TokenizerText.of_folder(str(default_model))


def test_without_the_saved_text_the_folder_is_read(default_model: Path, tmp_path: Path):
    source = TokenizerSource(str(default_model), str(tmp_path / "not-written-yet.json"))
    text = TokenizerText.load(source)
    assert text == TokenizerText.of_folder(str(default_model)) and text.eos is not None


def test_grammars_from_the_saved_text_constrain_as_from_the_folder(
    default_model: Path, tmp_path: Path
):
    from llguidance import LLMatcher

    saved = tmp_path / "tokenizer.json"
    TokenizerText.of_folder(str(default_model)).save(str(saved))
    spec = ("json_schema", json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}}))
    masks = []
    for text in (TokenizerText.load(TokenizerSource("-", str(saved))),
                 TokenizerText.of_folder(str(default_model))):  # fmt: skip
        grammars = Grammars(text, 49152)
        matcher = LLMatcher(grammars.tokenizer, grammars.compile(*spec), log_level=0)
        masks.append(bytes(matcher.compute_logit_bias()))
    assert masks[0] == masks[1]


def test_an_engine_leaves_the_text_for_its_device_and_removes_it_at_close(default_model: Path):
    params = SamplingParams(temperature=0, max_tokens=8, structured_output=("json", ""))
    with LLM(str(default_model), device="cpu", dtype="float32", num_kv_blocks=64) as llm:
        written = Path(llm.engine.tokenizer_text)
        assert not written.exists()  # nothing asked for a grammar yet
        out = llm.generate(["A JSON object:"], params)[0]
        assert written.exists() and out.token_ids
    assert not written.exists()


def test_a_new_text_file_removes_those_of_processes_that_ended(tmp_path: Path):
    code = "import os; print(os.getpid())"
    dead = int(subprocess.run([sys.executable, "-c", code], capture_output=True).stdout)
    ended = f"{TEXT_FILE_PREFIX}{dead}-abc.json"
    left = [tmp_path / ended, tmp_path / f"{ended}x1y2"]  # its text, and a partial write of it
    kept = [tmp_path / f"{TEXT_FILE_PREFIX}{os.getpid()}-def.json", tmp_path / "other.json"]
    for path in left + kept:
        path.write_text("{}")
    made = Path(new_text_file(str(tmp_path)))
    assert made.parent == tmp_path and made.name.startswith(f"{TEXT_FILE_PREFIX}{os.getpid()}-")
    assert not any(path.exists() for path in left)
    assert all(path.exists() for path in kept)
