"""A chat conversation as clients send it -> the messages a chat template can render.

Clients send what OpenAI's chat API takes: content as a string, as a list of text parts or
(on an assistant message that calls tools) as null or absent; a ``developer`` role; tool
calls with JSON-string arguments; ``tool`` messages answering them. Templates take less:
most read ``message['content']`` as a string, and many (the default model's included)
know nothing of tools. So every message is checked here, naming the bad field, and then
rendered for the template at hand:

- a template that speaks of ``tool_calls`` gets them, arguments as objects (the form
  transformers documents for templates);
- any other template sees the calls as Hermes blocks in the assistant's text,
  ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` (what the tool-call parser
  reads back), and each run of tool results as one user message of
  ``<tool_response>...</tool_response>`` blocks, which keeps user/assistant alternation
  for templates that insist on it;
- a template that cannot show ``tools`` gets them in a system message, with the
  instruction to answer a call in that block format.
"""

from __future__ import annotations

import json
from typing import Any

ROLES = ("system", "user", "assistant", "tool")
ROLE_ALIASES = {"developer": "system"}


def normalize_messages(messages: list[Any]) -> list[dict[str, Any]]:
    """Checked copies of ``messages``: content a string, roles the four a template knows,
    tool calls with object arguments. ValueError names the first bad field."""
    return [_normalize(i, m) for i, m in enumerate(messages)]


def render_for_template(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, template: str
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """(messages, tools) as the template can take them (see the module docstring)."""
    if tools and "tools" not in template:
        messages = _with_tools_prompt(messages, tools)
        tools = None
    if "tool_calls" in template:
        return messages, tools
    rendered: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "assistant" and m.get("tool_calls"):
            blocks = [
                hermes_call(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            text = "\n".join([m["content"], *blocks] if m["content"] else blocks)
            rendered.append({"role": "assistant", "content": text})
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            previous = rendered[-1] if rendered else None
            if previous is not None and previous.get("tool_results"):
                previous["content"] += "\n" + block
            else:
                rendered.append({"role": "user", "content": block, "tool_results": True})
        else:
            rendered.append({k: v for k, v in m.items() if k != "tool_calls"})
    for m in rendered:
        m.pop("tool_results", None)
    return rendered, tools


def hermes_call(name: str, arguments: Any) -> str:
    """One call as a Hermes block, the format ``<tool_call>`` parsers read."""
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}) + "\n</tool_call>"


TOOLS_PROMPT = (
    "You can call functions. Their signatures, as JSON Schema, are inside <tools></tools>:\n"
    "<tools>\n{tools}\n</tools>\n"
    "To call one, answer with a JSON object of its name and arguments inside "
    '<tool_call></tool_call> tags:\n<tool_call>\n{{"name": <function-name>, "arguments": '
    "<args-object>}}\n</tool_call>"
)


def _with_tools_prompt(
    messages: list[dict[str, Any]], tools: list[dict[str, Any]]
) -> list[dict[str, Any]]:
    listed = "\n".join(json.dumps(t.get("function", t)) for t in tools)
    prompt = TOOLS_PROMPT.format(tools=listed)
    if messages and messages[0]["role"] == "system":
        first = dict(messages[0], content=messages[0]["content"] + "\n\n" + prompt)
        return [first, *messages[1:]]
    return [{"role": "system", "content": prompt}, *messages]


def _normalize(i: int, message: Any) -> dict[str, Any]:
    where = f"messages[{i}]"
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise ValueError(f"{where} must be an object with a role")
    role = ROLE_ALIASES.get(message["role"], message["role"])
    if role not in ROLES:
        shown = message["role"]  # quoted short: a huge role must not fill the error
        shown = repr(shown[:32]) + ("..." if len(shown) > 32 else "")
        raise ValueError(f"{where}.role is unknown: {shown} (one of {', '.join(ROLES)}, developer)")
    out: dict[str, Any] = {"role": role}
    calls = message.get("tool_calls")
    if calls is not None and role != "assistant":
        raise ValueError(f"{where}.tool_calls: only an assistant message calls tools")
    if calls is not None:
        if not isinstance(calls, list):
            raise ValueError(f"{where}.tool_calls must be a list")
        out["tool_calls"] = [_tool_call(f"{where}.tool_calls[{k}]", c) for k, c in enumerate(calls)]
    content = message.get("content")
    if content is None:
        if role != "assistant" or not out.get("tool_calls"):
            raise ValueError(
                f"{where}.content is required (it may be null only on an "
                "assistant message with tool_calls)"
            )
        content = ""
    out["content"] = _text(f"{where}.content", content)
    for name in ("name", "tool_call_id"):
        value = message.get(name)
        if value is not None:
            if not isinstance(value, str):
                raise ValueError(f"{where}.{name} must be a string")
            out[name] = value
    return out


def _text(where: str, content: Any) -> str:
    """A string, or a list of text parts joined by newlines."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ValueError(f"{where} must be a string or a list of text parts")
    texts = []
    for k, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("text", "refusal") and isinstance(part.get(kind), str):
            texts.append(part[kind])
        elif isinstance(kind, str) and kind not in ("text", "refusal"):
            raise ValueError(
                f"{where}[{k}]: {kind[:32]!r} parts are not supported (this model reads text only)"
            )
        else:
            raise ValueError(f"{where}[{k}] must be {{'type': 'text', 'text': str}}")
    return "\n".join(texts)


def _tool_call(where: str, call: Any) -> dict[str, Any]:
    fn = call.get("function") if isinstance(call, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
        raise ValueError(
            f"{where} must be {{'type': 'function', 'function': {{'name', 'arguments'}}}}"
        )
    arguments = fn.get("arguments", {})
    if isinstance(arguments, str):
        # Templates take arguments as objects; a string that is not JSON is shown as is.
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except ValueError:
            pass
    out = {"type": "function", "function": {"name": fn["name"], "arguments": arguments}}
    if isinstance(call.get("id"), str):
        out["id"] = call["id"]
    return out
