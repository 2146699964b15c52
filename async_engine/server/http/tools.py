"""Tool calls for chat: ``tools``, ``tool_choice`` and ``parallel_tool_calls``.

A call is written as a Hermes/Qwen block, ``<tool_call>{"name": ..., "arguments": {...}}
</tool_call>``, under every choice: the chat template (or the tools prompt of
``core.chat`` for templates without tools) shows the model that format, and the calls it
made before come back to it the same way.

- ``"required"`` and a named function constrain the answer to such blocks whose arguments
  follow the tool's JSON Schema, so any model answers with a valid call: one call of a named
  function; under required one or more, or exactly one without ``parallel_tool_calls``.
- ``"auto"`` leaves the model free and parses the blocks it chose to write. A block
  naming a function the request did not declare, or whose arguments break that tool's
  schema, is not a call: it stays in the text, so a model (or a prompt injection it
  echoes) cannot hand an agent a call it never offered. With ``response_format`` the
  answer is constrained to either calls or text that follows the format: one grammar.
- ``"none"`` returns text; ``response_format`` applies to it as without tools.
"""

from __future__ import annotations

import functools
import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

import jsonschema

from async_engine.server.http.errors import bad_request
from streams.grammar import closed_objects

MAX_TOOLS = 128  # OpenAI's own limit; each costs schema checks and grammar size
_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)
# Compact JSON inside the grammar: free whitespace lets a small model spend its budget on
# newlines (the same default as the other structured outputs).
_COMPACT = {"x-guidance": {"whitespace_flexible": False}}


@dataclass(slots=True)
class ToolSpec:
    tools: list[dict[str, Any]]  # the request's tools, as given (shown to the chat template)
    choice: str  # "auto" | "required" | "none" | a function name
    parallel: bool = True  # parallel_tool_calls: more than one call in an answer
    answer: tuple[str, str] | None = None  # response_format of an answer that is not a call

    def schema_output(self) -> tuple[str, str] | None:
        """The structured output of the answer: calls forced (required, named), calls or the
        answer's format (auto with a format), the format alone (none), or None (free)."""
        if self.choice == "none" or (self.choice == "auto" and self.answer is None):
            return self.answer
        named = self.choice not in ("auto", "required")  # a named function is called once
        many = self.parallel and not named
        rules = [
            f"calls: {'call+' if many else 'call'}",
            self._call_rule({self.choice} if named else None),
        ]
        if self.choice == "auto":
            rules = ["start: calls | answer", *rules, "answer: " + _answer_rule(self.answer)]
        else:
            rules = ["start: calls", *rules]
        return ("lark", "\n".join(rules) + "\n")

    def _call_rule(self, names: set[str] | None) -> str:
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for f in self._functions()
            if names is None or f["name"] in names
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        schema = {**closed_objects(schema), **_COMPACT}
        return f'call: "<tool_call>\\n" %json {json.dumps(schema)} "\\n</tool_call>" "\\n"?'

    def _functions(self) -> list[dict[str, Any]]:
        return [t["function"] for t in self.tools]

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished answer: declared, valid calls only."""
        if self.choice == "none":
            return text, []
        schemas = {f["name"]: f.get("parameters") or {"type": "object"} for f in self._functions()}
        calls: list[dict[str, Any]] = []
        kept: list[str] = []  # what is not a call stays text
        at = 0
        for match in _CALL.finditer(text):
            kept.append(text[at : match.start()])
            at = match.end()
            call = _valid_call(match.group(1), schemas)
            if call is None or (calls and not self.parallel):
                kept.append(match.group(0))
            else:
                calls.append(call)
        if not calls:
            return text, []
        rest = "".join(kept) + text[at:]
        if self.choice != "auto":
            # The grammar allows calls alone: what follows the last one is a call cut short
            # by max_tokens, which no agent could run.
            rest = "".join(kept)
        return rest.strip() or None, calls


class ToolStream:
    """One streamed answer under ``spec``: the text that can go out at once, then the calls.

    Under ``auto`` text streams as it comes until a ``<tool_call>`` tag begins (a tail that
    could still become one waits for the next delta); from the tag on, the rest is held and
    parsed when the answer is whole. ``none`` streams everything; a forced choice is all
    calls, so everything is held."""

    TAG = "<tool_call>"

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.text = ""
        self.sent = 0  # text[:sent] went out as content
        self.holding = spec.choice not in ("auto", "none")

    def push(self, delta: str) -> str:
        """What of the answer so far may go out now as content."""
        self.text += delta
        if self.holding:
            return ""
        end = len(self.text)
        if self.spec.choice == "auto":
            tag = self.text.find(self.TAG, self.sent)
            if tag >= 0:
                end, self.holding = tag, True
            else:
                end -= _partial_tag(self.text, self.TAG)
        out, self.sent = self.text[self.sent : end], end
        return out

    def finish(self) -> tuple[str | None, list[dict[str, Any]]]:
        """(content not yet sent, calls) once the answer is whole."""
        return self.spec.parse(self.text[self.sent :])


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that begins ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


def _valid_call(block: str, schemas: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    try:
        call = json.loads(block)
    except ValueError:
        return None
    if not isinstance(call, dict) or call.get("name") not in schemas:
        return None
    arguments = call.get("arguments", {})
    try:
        jsonschema.validate(arguments, schemas[call["name"]])
    except (jsonschema.ValidationError, jsonschema.SchemaError):
        return None
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": call["name"], "arguments": json.dumps(arguments)},
    }


def _answer_rule(answer: tuple[str, str] | None) -> str:
    kind, spec = answer or ("json", "")
    if kind == "json":
        return "%json " + json.dumps({"type": "object", **_COMPACT})
    if kind == "json_schema":
        return "%json " + json.dumps({**closed_objects(json.loads(spec)), **_COMPACT})
    if kind == "regex":
        return "/" + spec.replace("/", "\\/") + "/"
    raise ValueError(f"{kind} cannot be combined with tools")


@functools.lru_cache(maxsize=1024)
def _schema_problem(schema_json: str) -> str | None:
    """Why a tool's parameters are no JSON Schema (None: they are). Checking one costs about
    half a millisecond of the event loop, and agents send the same tools every turn: cached."""
    schema = json.loads(schema_json)
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        return exc.message
    return None


def tool_spec(body: dict[str, Any], answer: tuple[str, str] | None) -> ToolSpec | None:
    """The request's tools, or None; ``answer`` is its response_format (or guided_regex)."""
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list", "tools")
    if len(tools) > MAX_TOOLS:
        raise bad_request(f"tools has more than {MAX_TOOLS} functions", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (
            isinstance(tool, dict)
            and tool.get("type") == "function"
            and isinstance(fn, dict)
            and isinstance(fn.get("name"), str)
            and fn["name"]
        ):
            raise bad_request(f"tools[{i}] must be a function with a name", "tools")
        params = fn.get("parameters")
        if params is not None:
            if not isinstance(params, dict):
                raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema", "tools")
            problem = _schema_problem(json.dumps(params, sort_keys=True))
            if problem is not None:
                raise bad_request(
                    f"tools[{i}].function.parameters is not a valid JSON Schema: {problem}", "tools"
                )
        if fn["name"] in names:
            raise bad_request("tools declares a function name twice", "tools")
        names.append(fn["name"])
    if choice is None:
        choice = "auto"
    if isinstance(choice, dict):
        fn = choice.get("function") if choice.get("type") == "function" else None
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request("tool_choice names no function among tools", "tool_choice")
        choice = name
    elif choice not in ("auto", "required", "none"):
        raise bad_request("tool_choice must be auto, required, none or a function", "tool_choice")
    parallel = body.get("parallel_tool_calls", True)
    if not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    if answer is not None and answer[0] == "grammar" and choice == "auto":
        raise bad_request(
            "guided_grammar cannot be combined with tools under tool_choice "
            "auto: give tool_choice none, or no grammar",
            "guided_grammar",
        )
    return ToolSpec(tools, choice, parallel, answer)
