"""Tool calls for chat: ``tools`` and ``tool_choice``.

``"required"`` and a named function constrain the output to a call object
``{"name": ..., "arguments": {...}}`` whose arguments follow the tool's JSON Schema, so any
model answers with a valid call. ``"auto"`` leaves the model free and parses the calls it
chose to write in the Hermes/Qwen format, ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from typing import Any

from async_engine.server.http.errors import bad_request

_CALL = re.compile(r"<tool_call>\s*(\{.*?\})\s*</tool_call>", re.S)


@dataclass(slots=True)
class ToolSpec:
    tools: list[dict[str, Any]]  # the request's tools, as given (shown to the chat template)
    choice: str  # "auto" | "required" | "none" | a function name

    def schema_output(self) -> tuple[str, str] | None:
        """The structured output that forces a call, or None where the model chooses."""
        if self.choice in ("auto", "none"):
            return None
        functions = [t["function"] for t in self.tools]
        if self.choice != "required":
            functions = [f for f in functions if f["name"] == self.choice]
        options = [
            {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    "arguments": f.get("parameters") or {"type": "object"},
                },
                "required": ["name", "arguments"],
            }
            for f in functions
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ("json_schema", json.dumps(schema))

    def parse(self, text: str) -> tuple[str | None, list[dict[str, Any]]]:
        """(content, tool_calls) of a finished answer."""
        if self.choice == "none":
            return text, []
        if self.choice != "auto":
            try:
                call = json.loads(text)
            except ValueError:
                return text, []  # cut short by max_tokens: no complete call to report
            return None, [_call(call)] if isinstance(call, dict) else []
        calls = []
        for block in _CALL.findall(text):
            try:
                call = json.loads(block)
            except ValueError:
                continue
            if isinstance(call, dict) and isinstance(call.get("name"), str):
                calls.append(_call(call))
        if not calls:
            return text, []
        rest = _CALL.sub("", text).strip()
        return rest or None, calls


def _call(call: dict[str, Any]) -> dict[str, Any]:
    arguments = call.get("arguments", {})
    return {
        "id": f"call_{uuid.uuid4().hex[:24]}",
        "type": "function",
        "function": {"name": str(call.get("name", "")), "arguments": json.dumps(arguments)},
    }


def tool_spec(body: dict[str, Any]) -> ToolSpec | None:
    tools = body.get("tools")
    choice = body.get("tool_choice")
    if tools is None:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools", "tool_choice")
        return None
    if not isinstance(tools, list) or not tools:
        raise bad_request("tools must be a non-empty list", "tools")
    names = []
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not (isinstance(tool, dict) and tool.get("type") == "function" and isinstance(fn, dict)
                and isinstance(fn.get("name"), str) and fn["name"]):  # fmt: skip
            raise bad_request(f"tools[{i}] must be a function with a name", "tools")
        if fn.get("parameters") is not None and not isinstance(fn["parameters"], dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON Schema", "tools")
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
    return ToolSpec(tools, choice)
