"""Constrained decoding on the device side: one grammar matcher per row, next to sampling.

The mask for step N+1 depends on the token sampled at step N, which under overlap the
control plane has not seen when it launches N+1. So the device keeps the matcher: before
sampling a constrained row it fills that row's allowed-token mask from the matcher, and
after sampling it advances the matcher by the token, with no round trip to the control
plane.

Grammars come from llguidance (JSON, JSON Schema, regex, EBNF/GBNF). Chosen by measurement
against xgrammar on the default model's tokenizer, a nested JSON Schema, 64 rows each on
its own path: per step (masks, apply, sample, advance) llguidance took 3.6 ms at the median
and xgrammar 11.5 ms; compiling took under 1 ms and 7 ms. Compiled grammars are cached by
spec; the tokenizer's vocabulary is read once, on the first constrained row (from the text
the engine's process wrote of it: ``TokenizerSource``).
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import tempfile
import uuid
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

TEXT_FILE_PREFIX = "async-engine-tokenizer-"


def new_text_file(directory: str | None = None) -> str:
    """A path for an engine's ``TokenizerText``, named by this process; files of processes
    that ended without removing theirs (killed, crashed) are removed on the way."""
    directory = directory or tempfile.gettempdir()
    for name in os.listdir(directory):
        if not name.startswith(TEXT_FILE_PREFIX):
            continue
        owner = name[len(TEXT_FILE_PREFIX) :].split("-", 1)[0]
        if owner.isdigit() and not _alive(int(owner)):
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(directory, name))
    return os.path.join(directory, f"{TEXT_FILE_PREFIX}{os.getpid()}-{uuid.uuid4().hex}.json")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        pass
    return True


@dataclass(frozen=True, slots=True)
class TokenizerSource:
    """Where the device process finds the tokenizer, for llguidance: the model's folder
    (transformers loads it: 3.4 s of a device's first grammar, most of it imports) or, once
    the engine's process has written it, ``text_file`` (``TokenizerText``: 0.4 s)."""

    folder: str
    text_file: str | None = None


@dataclass(frozen=True, slots=True)
class TokenizerText:
    """What llguidance reads of a tokenizer: its JSON as transformers loaded it (added
    tokens included, no padding or truncation) and its EOS id."""

    json: str
    eos: int | None

    @classmethod
    def of(cls, hf_tokenizer: Any) -> TokenizerText:
        if not hasattr(hf_tokenizer, "backend_tokenizer"):
            raise ValueError("structured_output needs a fast (Rust) tokenizer")
        backend = copy.copy(hf_tokenizer.backend_tokenizer)  # left as the engine uses it
        backend.no_padding()
        backend.no_truncation()
        return cls(backend.to_str(), hf_tokenizer.eos_token_id)

    @classmethod
    def of_folder(cls, folder: str) -> TokenizerText:
        from transformers import AutoTokenizer

        return cls.of(AutoTokenizer.from_pretrained(folder))

    def save(self, path: str) -> None:
        """Written whole or not at all (a reader never sees part of it; two writers of the
        same text may race)."""
        handle, partial = tempfile.mkstemp(prefix=os.path.basename(path), dir=os.path.dirname(path))
        with os.fdopen(handle, "w") as f:
            json.dump({"tokenizer": self.json, "eos": self.eos}, f)
        os.replace(partial, path)

    @classmethod
    def load(cls, source: TokenizerSource) -> TokenizerText:
        if source.text_file is not None and os.path.exists(source.text_file):
            with open(source.text_file) as f:
                saved = json.load(f)
            return cls(saved["tokenizer"], saved["eos"])
        return cls.of_folder(source.folder)


class Grammars:
    """llguidance's view of one tokenizer, and its compiled grammars by spec (bounded)."""

    MAX_CACHED = 256

    def __init__(self, text: TokenizerText, vocab_size: int) -> None:
        from llguidance import LLTokenizer

        self.tokenizer = LLTokenizer(text.json, n_vocab=vocab_size, eos_token=text.eos)
        self.vocab_size = vocab_size
        self._cache: dict[tuple[str, str], str] = {}

    def compile(self, kind: str, spec: str) -> str:
        """The grammar for llguidance; a bad spec raises ValueError naming structured_output."""
        key = (kind, spec)
        if key in self._cache:
            return self._cache[key]
        from llguidance import LLMatcher

        try:
            grammar = self._build(kind, spec)
            error = LLMatcher.validate_grammar(grammar, self.tokenizer)
        except (ValueError, RuntimeError, TypeError) as exc:
            error = str(exc) or repr(exc)
        if error and not error.startswith("WARNING"):
            first = error.strip().splitlines()[0] if error.strip() else error
            raise ValueError(f"structured_output: the {kind} does not compile: {first}")
        if len(self._cache) >= self.MAX_CACHED:
            self._cache.pop(next(iter(self._cache)))  # the oldest
        self._cache[key] = grammar
        return grammar

    def matcher(self, kind: str, spec: str) -> Any:
        from llguidance import LLMatcher

        return LLMatcher(self.tokenizer, self.compile(kind, spec), log_level=0)

    @staticmethod
    def _build(kind: str, spec: str) -> str:
        from llguidance import LLMatcher
        from llguidance.gbnf_to_lark import any_to_lark  # a module of that name holds it

        # Compact JSON: free whitespace lets a small model spend its budget on newlines.
        compact = {"whitespace_flexible": False}
        if kind == "json":
            return LLMatcher.grammar_from_json_schema("{}", defaults=compact)
        if kind == "json_schema":
            schema = closed_objects(json.loads(spec))
            return LLMatcher.grammar_from_json_schema(json.dumps(schema), defaults=compact)
        if kind == "regex":
            return LLMatcher.grammar_from_regex(spec)
        if kind == "grammar":  # GBNF (llama.cpp's EBNF) or Lark, as vLLM's guided_grammar
            return LLMatcher.grammar_from_lark(any_to_lark(spec))
        if kind == "lark":  # llguidance's own syntax; tool calls are built in it
            return LLMatcher.grammar_from_lark(spec)
        raise ValueError(f"structured_output kind {kind!r} is not known")


def closed_objects(schema: Any) -> Any:
    """Objects without an ``additionalProperties`` get ``false``: the properties the schema
    names and nothing else, as OpenAI's strict structured outputs (and vLLM) do, instead of
    JSON Schema's open default that lets a model run on with keys of its own."""
    if isinstance(schema, list):
        return [closed_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: closed_objects(v) for k, v in schema.items()}
    if (out.get("type") == "object" or "properties" in out) and "additionalProperties" not in out:
        out["additionalProperties"] = False
    return out


class GrammarRows:
    """The matchers of the device's constrained rows."""

    def __init__(self, tokenizer: TokenizerSource | None, vocab_size: int) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.matchers: dict[int, Any] = {}  # row -> llguidance.LLMatcher
        self._grammars: Grammars | None = None

    def add(self, row: int, spec: tuple[str, str] | None) -> None:
        self.matchers.pop(row, None)
        if spec is not None:
            if self._grammars is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs the model's tokenizer")
                text = TokenizerText.load(self.tokenizer)
                self._grammars = Grammars(text, self.vocab_size)
            self.matchers[row] = self._grammars.matcher(*spec)

    def drop(self, row: int) -> None:
        self.matchers.pop(row, None)

    def constrain_runs(
        self, logits: torch.Tensor, rows: list[int], offsets: list[int], next_drafts: list[int]
    ) -> list[int]:
        """Like ``constrain``, for a step whose rows may verify drafts: logits row i is
        position ``offsets[i]`` of row ``rows[i]``'s run, masked under the grammar's state
        after the drafts before it (``next_drafts[i]``: the draft after position i). A draft
        the grammar refuses ends its row's run there: that position's mask rules it out, so
        it is never verified, and the positions after it keep no mask (never emitted). The
        matchers are left as they were; ``advance`` them by what the rows emitted."""
        matchers, picked = self.matchers, []
        words = (self.vocab_size + 31) // 32
        masks: list[np.ndarray] = []
        i = 0
        while i < len(rows):
            row, n = rows[i], 1
            while i + n < len(rows) and rows[i + n] == row and offsets[i + n] > 0:
                n += 1
            matcher = matchers.get(row)
            if matcher is not None and not matcher.is_error():
                drafts = next_drafts[i : i + n - 1]
                valid = matcher.validate_tokens(drafts) if drafts else 0
                for j in range(min(valid, n - 1) + 1):
                    mask = np.zeros(words, dtype=np.int32)
                    matcher.unsafe_compute_mask_ptr(mask.ctypes.data, words * 4)
                    if mask.any():
                        picked.append(i + j)
                        masks.append(mask)
                    if j < valid:
                        matcher.consume_token(drafts[j])
                matcher.rollback(valid)
            i += n
        if picked:
            self._apply_masks(logits, picked, np.stack(masks))
        return picked

    def constrain(self, logits: torch.Tensor, rows: list[int]) -> list[int]:
        """Mask, in place, the logits of the constrained ``rows`` (logits row i is rows[i]);
        returns the indices that were constrained, for ``advance``. A finished grammar allows
        only EOS. A row whose matcher allows nothing at all (it already took its EOS: under
        overlap the row still had a step in flight, whose token the control plane drops) is
        left free."""
        matchers = self.matchers
        picked = [
            i for i, row in enumerate(rows) if row in matchers and not matchers[row].is_error()
        ]
        if not picked:
            return picked
        words = (self.vocab_size + 31) // 32
        mask = np.zeros((len(picked), words), dtype=np.int32)
        for k, i in enumerate(picked):
            matchers[rows[i]].unsafe_compute_mask_ptr(mask[k].ctypes.data, words * 4)
        live = mask.any(axis=1)
        if not live.all():
            picked = [i for i, keep in zip(picked, live.tolist(), strict=True) if keep]
            mask = mask[live]
            if not picked:
                return picked
        self._apply_masks(logits, picked, mask)
        return picked

    def _apply_masks(self, logits: torch.Tensor, picked: list[int], mask: np.ndarray) -> None:
        """Rule out, in place, the tokens ``mask`` (bit words per logits row ``picked``)
        does not allow."""
        # Bit b of word w allows token 32 w + b: little-endian bytes, least significant first.
        allowed = np.unpackbits(mask.view(np.uint8), axis=1, bitorder="little")
        allowed = torch.from_numpy(allowed[:, : logits.shape[1]].astype(bool))
        index = torch.tensor(picked, device=logits.device)
        rows_logits = logits.index_select(0, index)
        rows_logits.masked_fill_(~allowed.to(logits.device), float("-inf"))
        logits.index_copy_(0, index, rows_logits)

    def advance(self, rows: list[int], picked: list[int], tokens: list[int]) -> None:
        for i in picked:
            self.matchers[rows[i]].consume_token(tokens[i])

    def advance_runs(self, rows: list[int], tokens: list[int]) -> None:
        """Each emitted token of a constrained row (in order) into its matcher."""
        for row, token in zip(rows, tokens, strict=True):
            matcher = self.matchers.get(row)
            if matcher is not None and not matcher.is_error():
                matcher.consume_token(token)
