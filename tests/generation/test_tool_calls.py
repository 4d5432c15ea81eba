"""Qwen3's tool calls read out of replies (qwen_np/generation/tool_calls.py), whole and streamed token by
token through the real tokenizer: content never shows raw <tool_call> markup, parallel calls and thinking
come apart, malformed blocks are reported and kept out of the content; and the chat template renders an
agent's turns (tools in the system turn, assistant calls with content null, tool results)."""

from __future__ import annotations

import itertools
import json

import pytest

from qwen_np.files.tokenizer import StreamDecoder, Tokenizer, split_thinking
from qwen_np.generation.tool_calls import (ArgumentsDelta, CallStart, ReplyParser, TextDelta, ToolCall, new_call_id,
                                           parse_reply)

from tests.conftest import QWEN3_RANDOM


def call_block(name: str, arguments: dict | str) -> str:
    """A call as Qwen3 writes it (the form its chat template shows)."""
    text = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
    return f'<tool_call>\n{{"name": "{name}", "arguments": {text}}}\n</tool_call>'


def numbered() -> ReplyParser:
    counter = itertools.count()
    return ReplyParser(new_id=lambda: f"call_{next(counter)}")


def streamed(tok: Tokenizer, text: str) -> tuple[ReplyParser, list]:
    """Feed `text` the way generation produces it: one StreamDecoder piece per token of the real tokenizer."""
    parser, decoder, deltas = numbered(), StreamDecoder(tok), []
    for token in tok.encode(text):
        deltas += parser.feed(decoder.push(token))
    deltas += parser.feed(decoder.flush()) + parser.finish()
    return parser, deltas


def joined(deltas: list, field: str) -> str:
    return "".join(d.text for d in deltas if isinstance(d, TextDelta) and d.field == field)


def assembled(deltas: list) -> dict[int, dict]:
    """What the official client builds from delta.tool_calls chunks: name from the first, arguments concatenated."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        if isinstance(delta, CallStart):
            calls[delta.index] = {"id": delta.id, "name": delta.name, "arguments": ""}
        elif isinstance(delta, ArgumentsDelta):
            calls[delta.index]["arguments"] += delta.text
    return calls


PARALLEL = ("<think>\nTwo cities: call the tool twice. Maybe write <tool_call> here?\n</think>\n\n"
            "I'll check both.\n\n"
            + call_block("get_weather", {"city": "北京", "note": 'a "quoted" } brace'}) + "\n"
            + call_block("get_weather", {"city": "Rome", "days": [1, {"n": 2}]}))


def test_parallel_calls_come_apart_from_content_and_thinking_whole_and_streamed(tok: Tokenizer) -> None:
    whole = parse_reply(PARALLEL, new_id=lambda: "same")
    assert whole.reasoning == "Two cities: call the tool twice. Maybe write <tool_call> here?"
    assert whole.content == "I'll check both."
    assert [(c.name, json.loads(c.arguments)) for c in whole.tool_calls] == [
        ("get_weather", {"city": "北京", "note": 'a "quoted" } brace'}), ("get_weather", {"city": "Rome", "days": [1, {"n": 2}]})]
    assert not whole.malformed
    parser, deltas = streamed(tok, PARALLEL)
    assert joined(deltas, "content") == whole.content and joined(deltas, "reasoning") == whole.reasoning
    assert [c.arguments for c in parser.calls] == [c.arguments for c in whole.tool_calls]
    client = assembled(deltas)
    assert [client[c.index] for c in parser.calls] == [{"id": c.id, "name": c.name, "arguments": c.arguments}
                                                       for c in parser.calls]
    assert [c.id for c in parser.calls] == ["call_0", "call_1"]


def test_arguments_stream_in_fragments_as_the_model_writes_them(tok: Tokenizer) -> None:
    _, deltas = streamed(tok, call_block("get_weather", {"city": "Paris", "unit": "C"}))
    fragments = [d.text for d in deltas if isinstance(d, ArgumentsDelta)]
    assert len(fragments) > 3 and "".join(fragments) == '{"city": "Paris", "unit": "C"}'
    assert isinstance(deltas[0], CallStart) and deltas[0].name == "get_weather"      # announced before its arguments


@pytest.mark.parametrize("size", [1, 2, 3, 5, 11])
def test_no_piece_of_the_markup_reaches_the_content_however_the_text_is_split(size: int) -> None:
    text = "Checking.\n" + call_block("f", {"a": 1}) + "\nDone, see <toolbox> and </tool_call>x"
    parser, deltas = numbered(), []
    for start in range(0, len(text), size):
        deltas += parser.feed(text[start:start + size])
    deltas += parser.finish()
    content = joined(deltas, "content")
    assert content == parse_reply(text).content == "Checking.\nDone, see <toolbox> and </tool_call>x"
    assert [c.arguments for c in parser.calls] == ['{"a": 1}']


def test_a_reply_without_calls_is_read_as_split_thinking_reads_it(tok: Tokenizer) -> None:
    for text in ["Just an answer.\n\n", "<think>\nhmm\n</think>\n\nThe answer.", "a < b and <tool_ x"]:
        parsed = parse_reply(text)
        assert (parsed.reasoning, parsed.content, parsed.tool_calls) == (*split_thinking(text), [])
        _, deltas = streamed(tok, text)
        assert joined(deltas, "content") == parsed.content


@pytest.mark.parametrize("body, why", [
    ("\nnot json at all\n", "no JSON"),
    ('\n{"arguments": {"a": 1}}\n', "no name"),
    ('\n{"name": "", "arguments": {}}\n', "an empty name"),
    ('\n{"name": "f", "arguments": [1, 2]}\n', "arguments that are not an object"),
    ('\n{"name": "f", "arguments": "{not json"}\n', "arguments as a string that is not JSON"),
])
def test_a_block_that_is_not_a_call_is_reported_and_never_shown(tok: Tokenizer, body: str, why: str) -> None:
    text = f"Before.<tool_call>{body}</tool_call>After."
    parsed = parse_reply(text)
    assert parsed.tool_calls == [] and parsed.malformed == [body], why
    assert parsed.content == "Before.After."
    parser, deltas = streamed(tok, text)
    assert parser.malformed == [body] and joined(deltas, "content") == parsed.content


def test_calls_written_otherwise_are_parsed_whole_when_their_block_ends(tok: Tokenizer) -> None:
    text = ('<tool_call>\n{"arguments": {"x": 1}, "name": "later"}\n</tool_call>'
            '<tool_call>{"name":"tight","arguments":"{\\"y\\": 2}"}</tool_call>')
    parser, deltas = streamed(tok, text)
    assert [(c.name, c.arguments) for c in parser.calls] == [("later", '{"x": 1}'), ("tight", '{"y": 2}')]
    assert [(c["name"], c["arguments"]) for c in assembled(deltas).values()] == [("later", '{"x": 1}'), ("tight", '{"y": 2}')]


def test_a_call_cut_off_keeps_what_was_whole(tok: Tokenizer) -> None:
    complete = parse_reply('<tool_call>\n{"name": "f", "arguments": {"a": 1}}')       # -n ended before </tool_call>
    assert [c.arguments for c in complete.tool_calls] == ['{"a": 1}'] and not complete.malformed
    cut = parse_reply('<tool_call>\n{"name": "f", "arguments": {"a": "unfinished')
    assert cut.tool_calls == [] and cut.malformed == ['\n{"name": "f", "arguments": {"a": "unfinished']
    parser, deltas = streamed(tok, '<tool_call>\n{"name": "f", "arguments": {"a": "unfinished')
    assert [d.name for d in deltas if isinstance(d, CallStart)] == ["f"] and parser.calls == [] and parser.malformed


def test_thinking_is_content_when_not_split() -> None:
    parsed = parse_reply("<think>\nx\n</think>\n\n" + call_block("f", {}), split_reasoning=False)
    assert parsed.reasoning == "" and parsed.content == "<think>\nx\n</think>" and len(parsed.tool_calls) == 1


def test_openai_shapes_of_calls_and_their_deltas() -> None:
    assert ToolCall(0, "call_1", "f", '{"a": 1}').openai() == {
        "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}
    assert CallStart(2, "call_1", "f").openai() == {
        "index": 2, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": ""}}
    assert ArgumentsDelta(2, '{"a"').openai() == {"index": 2, "function": {"arguments": '{"a"'}}
    first, second = new_call_id(), new_call_id()
    assert first != second and first.startswith("call_") and len(first) == 29


# --- The chat template side: an agent loop's turns render as Qwen3's template expects -----------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city",
                                                 "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                                "required": ["city"]}}}
AGENT_TURNS = [
    {"role": "user", "content": "Weather in Paris and Rome?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Rome"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'},
    {"role": "tool", "tool_call_id": "call_2", "content": '{"temp": 25}'},
]


def test_an_assistant_call_with_content_null_and_tool_results_render(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(AGENT_TURNS, tools=[WEATHER_TOOL])
    assert rendered.startswith("<|im_start|>system\n# Tools\n") and json.dumps(WEATHER_TOOL) in rendered
    assert ("<|im_start|>assistant\n" + call_block("get_weather", {"city": "Paris"}) + "\n"
            + call_block("get_weather", {"city": "Rome"}) + "<|im_end|>\n") in rendered
    assert rendered.endswith("<|im_start|>user\n<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n"
                             "{\"temp\": 25}\n</tool_response><|im_end|>\n<|im_start|>assistant\n")
    # The calls the model wrote, parsed, render back as they were written.
    reply = call_block("get_weather", {"city": "Paris"}) + "\n" + call_block("get_weather", {"city": "Rome"})
    calls = [call.openai() for call in parse_reply(reply).tool_calls]
    assert tok.apply_chat_template([AGENT_TURNS[0], {"role": "assistant", "content": None, "tool_calls": calls},
                                    *AGENT_TURNS[2:]], tools=[WEATHER_TOOL]) == rendered


@pytest.mark.slow
def test_the_agent_turns_render_as_transformers_renders_them_with_empty_content(tok: Tokenizer) -> None:
    transformers = pytest.importorskip("transformers")
    hf = transformers.AutoTokenizer.from_pretrained(str(QWEN3_RANDOM))
    # transformers hands the template None itself, which Qwen3's template cannot read: "" is what null means.
    spelled = [{**message, "content": ""} if message["content"] is None else message for message in AGENT_TURNS]
    expected = hf.apply_chat_template(spelled, tools=[WEATHER_TOOL], tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(AGENT_TURNS, tools=[WEATHER_TOOL]) == expected
