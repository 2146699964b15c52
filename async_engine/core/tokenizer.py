"""Tokenizer, chat template and incremental detokenization (transformers tokenizers)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from async_engine.core.byte_table import ByteTable
from async_engine.core.chat import normalize_messages, render_for_template


class Tokenizer:
    def __init__(self, folder: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(folder))
        except Exception as exc:
            raise ValueError(f"cannot load the tokenizer in {folder}: {exc}") from exc
        self.vocab_size = len(self.hf)
        # No token decodes to more characters than its vocabulary entry has (byte-level
        # entries spell each byte as a character): an upper bound used to refuse, before
        # tokenizing, text that cannot fit a context.
        self.max_token_chars = max((len(t) for t in self.hf.get_vocab()), default=1) or 1
        self.byte_table = ByteTable.of(self.hf)  # None: decode through the tokenizer

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf(text, add_special_tokens=add_special_tokens)["input_ids"])

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.byte_table is not None:
            return self.byte_table.decode(token_ids, skip_special_tokens)
        # transformers' decode first checks the type of every id (to_py_obj) and then calls
        # _decode; our ids are a flat list of ints already, and the check was two thirds
        # of a 128-token decode.
        decode = getattr(self.hf, "_decode", None) or self.hf.decode
        return decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The conversation's prompt ids, messages as OpenAI clients send them (``core.chat``);
        ``tools`` (OpenAI function specs) are shown to the model through its template, or in
        a system message where the template has no place for them. The template writes the
        special tokens it wants; ``add_special_tokens`` adds the tokenizer's own on top (what
        vLLM's /tokenize does when asked)."""
        template = self.hf.chat_template
        if not template:
            raise ValueError("messages: this model has no chat template")
        messages = normalize_messages(messages)
        messages, tools = render_for_template(messages, tools, str(template))
        if add_special_tokens:
            text = self.hf.apply_chat_template(
                messages, tools=tools, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            return self.encode(text, add_special_tokens=True)
        ids = self.hf.apply_chat_template(
            messages, tools=tools, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "keys"):
            ids = ids["input_ids"]
        return list(ids)


def decode_continuation(
    tokenizer: Tokenizer, prompt_ids: list[int], output_ids: list[int], skip_special: bool
) -> str:
    """The text of output_ids as it continues the prompt (same result as the incremental path).

    A few prompt tokens go in front because some tokenizers drop a leading space or merge
    bytes across the boundary when a sequence is decoded on its own.
    """
    context = prompt_ids[-IncrementalDetokenizer.CONTEXT :]
    head = tokenizer.decode(context, skip_special)
    return tokenizer.decode(context + output_ids, skip_special)[len(head) :]


class IncrementalDetokenizer:
    """Turns a growing list of output tokens into text deltas.

    Decodes a short window around the newest tokens, and holds text back while it ends
    in an incomplete UTF-8 sequence (U+FFFD), so multi-token characters come out whole.
    """

    CONTEXT = 5

    def __init__(self, tokenizer: Tokenizer, prompt_ids: list[int], skip_special: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special
        self.ids: list[int] = list(prompt_ids[-self.CONTEXT :])
        self.prefix_offset = 0
        self.read_offset = len(self.ids)

    def push(self, token_ids: list[int]) -> str:
        self.ids.extend(token_ids)
        decode = self.tokenizer.decode
        prefix = decode(self.ids[self.prefix_offset : self.read_offset], self.skip_special)
        full = decode(self.ids[self.prefix_offset :], self.skip_special)
        if full.endswith("\ufffd") or len(full) <= len(prefix):
            return ""
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        return full[len(prefix) :]
