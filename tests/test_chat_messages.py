"""Chat messages as OpenAI clients send them, and tool calls as the server reads them back."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_engine.core.chat import normalize_messages, render_for_template
from async_engine.core.tokenizer import Tokenizer
from async_engine.server.http.tools import ToolSpec, ToolStream

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
LOOP = [
    {"role": "developer", "content": "Be brief."},
    {
        "role": "user",
        "content": [{"type": "text", "text": "Weather"}, {"type": "text", "text": "in Oslo?"}],
    },
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "Rain, 9 C"}]},
]
NO_TOOLS_TEMPLATE = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"


@pytest.fixture(scope="module")
def tokenizer(default_model: Path) -> Tokenizer:
    return Tokenizer(default_model)


def test_a_tool_loop_as_clients_send_it_is_accepted():
    out = normalize_messages(LOOP)
    assert [m["role"] for m in out] == ["system", "user", "assistant", "tool"]
    assert out[1]["content"] == "Weather\nin Oslo?", "text parts are joined"
    assert out[2]["content"] == "" and out[2]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Oslo"
    }, "null content with tool_calls; arguments as an object, as templates take them"
    assert out[3] == {"role": "tool", "content": "Rain, 9 C", "tool_call_id": "call_1"}


def test_an_assistant_message_with_calls_may_leave_content_out():
    message = {"role": "assistant", "tool_calls": [CALL]}
    assert normalize_messages([message])[0]["content"] == ""


@pytest.mark.parametrize(
    ("message", "named"),
    [
        ({"role": "user", "content": None}, "messages[0].content is required"),
        ({"role": "assistant"}, "messages[0].content is required"),
        (
            {"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
            "messages[0].content[0]: 'image_url' parts are not supported",
        ),
        ({"role": "user", "content": [{"text": "no type"}]}, "messages[0].content[0] must be"),
        ({"role": "user", "content": 5}, "messages[0].content must be a string or a list"),
        ({"role": "user", "content": "x", "tool_calls": [CALL]}, "messages[0].tool_calls: only"),
        (
            {"role": "assistant", "tool_calls": [{"type": "function"}]},
            "messages[0].tool_calls[0] must be",
        ),
        (
            {"role": "tool", "content": "x", "tool_call_id": 3},
            "messages[0].tool_call_id must be a string",
        ),
        ({"role": "wizard", "content": "x"}, "messages[0].role is unknown: 'wizard'"),
    ],
)
def test_a_bad_message_is_refused_naming_its_field(message: dict, named: str):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        normalize_messages([message])


def test_a_template_without_tools_sees_calls_and_results_as_hermes_blocks():
    rendered, tools = render_for_template(normalize_messages(LOOP), [WEATHER], NO_TOOLS_TEMPLATE)
    assert tools is None, "the template has no place for tools: they go in the system message"
    assert rendered[0]["role"] == "system" and '"name": "get_weather"' in rendered[0]["content"]
    assert rendered[0]["content"].startswith("Be brief."), "the caller's system text comes first"
    call = rendered[2]["content"]
    assert rendered[2]["role"] == "assistant" and call.startswith("<tool_call>")
    assert json.loads(call.split("\n")[1]) == {"name": "get_weather", "arguments": {"city": "Oslo"}}
    assert rendered[3] == {
        "role": "user",
        "content": "<tool_response>\nRain, 9 C\n</tool_response>",
    }


def test_consecutive_tool_results_share_one_user_turn():
    loop = [*LOOP, {"role": "tool", "tool_call_id": "call_2", "content": "Wind"}]
    rendered, _ = render_for_template(normalize_messages(loop), None, NO_TOOLS_TEMPLATE)
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[-1]["content"].count("<tool_response>") == 2


def test_a_template_that_knows_tool_calls_gets_them():
    template = "{% for m in messages %}{{ m.tool_calls }}{% endfor %}{{ tools }}"
    rendered, tools = render_for_template(normalize_messages(LOOP), [WEATHER], template)
    assert tools == [WEATHER] and rendered[2]["tool_calls"][0]["function"]["name"] == "get_weather"
    assert rendered[3]["role"] == "tool"


def test_the_default_models_prompt_shows_its_previous_call_and_the_result(tokenizer: Tokenizer):
    text = tokenizer.decode(tokenizer.apply_chat_template(LOOP, [WEATHER]), False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}' in text
    assert "<tool_response>\nRain, 9 C\n</tool_response>" in text
    assert "<tools>" in text and "Be brief." in text


def test_developer_is_the_system_role(tokenizer: Tokenizer):
    as_developer = [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    as_system = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    assert tokenizer.apply_chat_template(as_developer) == tokenizer.apply_chat_template(as_system)


# ---------------------------------------------------------------- tool calls read back
def _block(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def test_only_declared_tools_with_valid_arguments_come_back_as_calls():
    spec = ToolSpec([WEATHER], "auto")
    undeclared = "Sure.\n" + _block("delete_all_files", {"path": "/"})
    assert spec.parse(undeclared) == (undeclared, []), "an undeclared call stays text"
    bad_arguments = _block("get_weather", {"town": "Oslo"})
    assert spec.parse(bad_arguments) == (bad_arguments, []), "arguments must follow the schema"
    content, calls = spec.parse(undeclared + "\n" + _block("get_weather", {"city": "Oslo"}))
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    assert "delete_all_files" in content, "the refused block is returned as text"


def test_parallel_calls_come_back_all_or_only_the_first():
    text = _block("get_weather", {"city": "Oslo"}) + "\n" + _block("get_weather", {"city": "Rome"})
    _, calls = ToolSpec([WEATHER], "auto").parse(text)
    assert [json.loads(c["function"]["arguments"])["city"] for c in calls] == ["Oslo", "Rome"]
    content, calls = ToolSpec([WEATHER], "auto", parallel=False).parse(text)
    assert len(calls) == 1 and "Rome" in content


def _matches(tokenizer_folder: Path, structured: tuple[str, str], text: str) -> bool:
    from llguidance import LLMatcher

    from streams.grammar import Grammars, TokenizerText

    grammars = Grammars(TokenizerText.of_folder(str(tokenizer_folder)), 49152)
    matcher = LLMatcher(grammars.tokenizer, grammars.compile(*structured), log_level=0)
    ids = Tokenizer(tokenizer_folder).encode(text)
    return matcher.consume_tokens(ids) and matcher.is_accepting()


def test_auto_with_a_response_format_is_a_call_or_the_format(default_model: Path):
    answer = (
        "json_schema",
        json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    )
    grammar = ToolSpec([WEATHER], "auto", answer=answer).schema_output()
    assert _matches(
        default_model, grammar, _block("get_weather", {"city": "Oslo"}).replace(" ", "")
    )
    assert _matches(default_model, grammar, '{"a":1}')
    assert not _matches(default_model, grammar, "plain text")
    assert not _matches(default_model, grammar, _block("delete_all_files", {}).replace(" ", ""))


def test_required_without_parallel_calls_allows_one_call(default_model: Path):
    one = _block("get_weather", {"city": "Oslo"}).replace(" ", "")
    grammar = ToolSpec([WEATHER], "required", parallel=False).schema_output()
    assert _matches(default_model, grammar, one)
    assert not _matches(default_model, grammar, one + "\n" + one)
    assert _matches(
        default_model, ToolSpec([WEATHER], "required").schema_output(), one + "\n" + one
    )


def test_none_keeps_the_response_format():
    answer = ("json", "")
    assert ToolSpec([WEATHER], "none", answer=answer).schema_output() == answer


def test_grpc_takes_the_developer_role_too():
    from async_engine.server.codec import Limits, decode_request
    from async_engine.v1 import generation_pb2 as pb

    msg = pb.GenerateRequest()
    msg.chat.messages.add(role="developer", content="Be brief.")
    msg.chat.messages.add(role="user", content="Hi")
    sub = decode_request(msg, Limits())
    assert normalize_messages(sub.options.messages)[0] == {"role": "system", "content": "Be brief."}


def _stream(spec: ToolSpec, text: str, step: int = 1) -> tuple[str, str | None, list]:
    """Push ``text`` in pieces of ``step`` characters: (streamed, content at the end, calls)."""
    stream = ToolStream(spec)
    sent = "".join(stream.push(text[i : i + step]) for i in range(0, len(text), step))
    content, calls = stream.finish()
    return sent, content, calls


def test_auto_streams_text_up_to_a_call_and_the_call_at_the_end():
    call = _block("get_weather", {"city": "Oslo"})
    sent, content, calls = _stream(ToolSpec([WEATHER], "auto"), "Let me look. " + call)
    assert sent == "Let me look. " and content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather"]


def test_auto_streams_all_text_that_only_looks_like_a_tag_start():
    text = "a <b> and <tool and <tool_cal"
    sent, content, calls = _stream(ToolSpec([WEATHER], "auto"), text)
    assert sent + content == text and calls == [], "a held tail is released at the end"
    assert sent == "a <b> and <tool and ", "only a tail that may still become a tag waits"


def test_a_streamed_undeclared_call_ends_as_text():
    block = _block("delete_all_files", {})
    sent, content, calls = _stream(ToolSpec([WEATHER], "auto"), "Ok " + block, step=5)
    assert sent + content == "Ok " + block and calls == []


def test_forced_calls_are_all_held_and_none_streams_everything():
    call = _block("get_weather", {"city": "Oslo"})
    assert _stream(ToolSpec([WEATHER], "required"), call)[0] == ""
    assert _stream(ToolSpec([WEATHER], "none"), call) == (call, "", [])
