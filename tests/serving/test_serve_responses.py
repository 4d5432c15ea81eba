"""POST /v1/responses (issue 44), OpenAI's Responses API, through the official `openai` client's
`responses.create` and `responses.stream`: on the scripted model (tests/serving/scripted_serve.py: the real
server, template, tokenizer and grammar masks over logits that write what the first user message scripts)
for what a model writes (text, thinking, calls), and on the random-weight Qwen3 for what the constraints
guarantee whatever it writes (JSON and calls that validate).
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serving.test_serve import MODEL, post
from tests.serving.test_serve_tools import CITY, PERSON, call

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city", "parameters": CITY}
NO_THINKING = {"reasoning": {"effort": "none"}}


def test_a_plain_input_gives_the_scripted_text_with_usage(scripted) -> None:
    response = scripted.responses.create(model=MODEL, input="Hello there.", temperature=0)
    assert response.object == "response" and response.id.startswith("resp_") and response.status == "completed"
    assert response.output_text == "Hello there."
    assert [item.type for item in response.output] == ["message"]
    message = response.output[0]
    assert message.role == "assistant" and message.status == "completed" and message.content[0].type == "output_text"
    usage = response.usage
    assert usage.output_tokens >= 3 and usage.total_tokens == usage.input_tokens + usage.output_tokens
    assert usage.output_tokens_details.reasoning_tokens == 0 and usage.input_tokens_details.cached_tokens >= 0


def test_instructions_come_first_as_the_system_message(scripted) -> None:
    # The scripted model writes the first *user* message: the instructions are not it, and do not change it.
    response = scripted.responses.create(model=MODEL, instructions="Be brief.", input="Brief.", temperature=0)
    assert response.output_text == "Brief." and response.instructions == "Be brief."


def summary_of(item) -> list[tuple[str, str]]:
    return [(part.type, part.text) for part in item.summary]


@pytest.mark.parametrize("summary", [None, "auto", "detailed"])
def test_thinking_is_a_reasoning_items_content_its_summary_when_asked_and_counted(scripted, summary) -> None:
    """The thinking is the reasoning item's content (reasoning_text); a summary, asked for, is the thinking
    verbatim (no summariser); not asked for, the summary is empty, as OpenAI's."""
    response = scripted.responses.create(model=MODEL, input="<think>\nHmm\n</think>\n\nFour.", temperature=0,
                                         reasoning={"effort": "high", "summary": summary})
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert [(part.type, part.text) for part in response.output[0].content] == [("reasoning_text", "Hmm")]
    assert summary_of(response.output[0]) == ([] if summary is None else [("summary_text", "Hmm")])
    assert response.output_text == "Four."
    assert response.usage.output_tokens_details.reasoning_tokens == 5      # <think> \n Hmm \n </think>, each a token


def test_max_output_tokens_cuts_the_reply_incomplete(scripted) -> None:
    response = scripted.responses.create(model=MODEL, input="one two three four five six seven", max_output_tokens=3,
                                         temperature=0)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 3 and response.output[-1].status == "incomplete"


def test_a_scripted_call_and_its_output_round_trip(scripted) -> None:
    script = call("get_weather", {"city": "Paris", "unit": "C"}) + "\n=====\nIt is 21 C."
    first = scripted.responses.create(model=MODEL, input=script, tools=[WEATHER], temperature=0)
    calls = [item for item in first.output if item.type == "function_call"]
    assert len(calls) == 1 and calls[0].name == "get_weather" and calls[0].call_id.startswith("call_")
    assert json.loads(calls[0].arguments) == {"city": "Paris", "unit": "C"}
    items = [{"role": "user", "content": script}, *[item.model_dump(exclude_none=True) for item in first.output],
             {"type": "function_call_output", "call_id": calls[0].call_id, "output": json.dumps({"temp": 21})}]
    second = scripted.responses.create(model=MODEL, input=items, tools=[WEATHER], temperature=0)
    assert second.output_text == "It is 21 C." and second.status == "completed"


def test_a_resent_reasoning_item_is_the_calls_thinking_by_its_content_or_summary(scripted) -> None:
    """The reasoning item of an output, resent before its call, is that turn's thinking (Qwen3's template renders
    it: the turn is after the last user message), read from its content or, without one, its summary."""
    script = "<think>\nWeather.\n</think>\n\n" + call("get_weather", {"city": "Oslo", "unit": "C"}) + "\n=====\nCold."
    first = scripted.responses.create(model=MODEL, input=script, tools=[WEATHER], temperature=0)
    thought, called = first.output
    assert thought.type == "reasoning" and thought.content[0].text == "Weather." and thought.summary == []
    result = {"type": "function_call_output", "call_id": called.call_id, "output": "cold"}

    def input_tokens(*reasoning: dict) -> int:
        items = [{"role": "user", "content": script}, *reasoning, called.model_dump(exclude_none=True), result]
        second = scripted.responses.create(model=MODEL, input=items, tools=[WEATHER], temperature=0)
        assert second.output_text == "Cold."
        return second.usage.input_tokens

    by_content = input_tokens(thought.model_dump(exclude_none=True))
    by_summary = input_tokens({"type": "reasoning", "summary": [{"type": "summary_text", "text": "Weather."}]})
    assert by_content == by_summary > input_tokens()


def test_previous_response_id_continues_a_stored_response(scripted) -> None:
    script = call("get_weather", {"city": "Rome", "unit": "C"}) + "\n=====\nSunny in Rome."
    first = scripted.responses.create(model=MODEL, input=script, tools=[WEATHER], temperature=0)
    assert first.store is True
    called = next(item for item in first.output if item.type == "function_call")
    output = [{"type": "function_call_output", "call_id": called.call_id, "output": "sunny"}]
    second = scripted.responses.create(model=MODEL, previous_response_id=first.id, input=output, tools=[WEATHER],
                                       temperature=0)
    assert second.output_text == "Sunny in Rome." and second.previous_response_id == first.id
    # the same, streamed; and a response with store: false is not kept
    with scripted.responses.stream(model=MODEL, input=script, tools=[WEATHER], temperature=0) as stream:
        streamed = stream.get_final_response()
    third = scripted.responses.create(model=MODEL, previous_response_id=streamed.id, temperature=0, tools=[WEATHER],
                                      input=[{**output[0], "call_id": streamed.output[-1].call_id}])
    assert third.output_text == "Sunny in Rome."
    unkept = scripted.responses.create(model=MODEL, input="Hi.", store=False, temperature=0)
    with pytest.raises(openai.BadRequestError) as refused:
        scripted.responses.create(model=MODEL, previous_response_id=unkept.id, input="Again")
    assert refused.value.param == "previous_response_id" and unkept.id in refused.value.body["message"]


def events_of(client, **fields):
    with client.responses.stream(**fields) as stream:
        events = list(stream)
        final = stream.get_final_response()
    return events, final


@pytest.mark.parametrize("summary", [None, "detailed"])
def test_a_stream_gives_the_documented_events_and_the_whole_response(scripted, summary) -> None:
    fields = {"model": MODEL, "input": "<think>\nHmm\n</think>\n\nFour and five.", "temperature": 0,
              "reasoning": {"summary": summary}}
    whole = scripted.responses.create(**fields)
    events, final = events_of(scripted, **fields)
    kinds = [event.type for event in events]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    assert kinds[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert kinds[-1] == "response.completed"
    for kind in ("response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.added",
                 "response.output_text.delta", "response.output_text.done", "response.content_part.done",
                 "response.output_item.done"):
        assert kind in kinds, kind
    summarised = [kind for kind in kinds if kind.startswith("response.reasoning_summary_")]
    assert summarised == ([] if summary is None else [f"response.reasoning_summary_{kind}" for kind in (
        "part.added", "text.delta", "text.done", "part.done")])
    thinking = "".join(event.delta for event in events if event.type == "response.reasoning_text.delta")
    assert thinking == final.output[0].content[0].text == whole.output[0].content[0].text == "Hmm"
    deltas = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert deltas == whole.output_text == final.output_text == "Four and five."
    assert [item.type for item in final.output] == [item.type for item in whole.output] == ["reasoning", "message"]
    assert summary_of(final.output[0]) == summary_of(whole.output[0]) == ([] if summary is None
                                                                          else [("summary_text", "Hmm")])
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.usage.output_tokens_details.reasoning_tokens == whole.usage.output_tokens_details.reasoning_tokens


def test_a_streamed_call_arrives_as_argument_deltas(scripted) -> None:
    fields = {"model": MODEL, "input": call("get_weather", {"city": "Oslo", "unit": "F"}), "tools": [WEATHER],
              "temperature": 0}
    events, final = events_of(scripted, **fields)
    kinds = [event.type for event in events]
    assert "response.function_call_arguments.delta" in kinds and "response.function_call_arguments.done" in kinds
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    calls = [item for item in final.output if item.type == "function_call"]
    assert len(calls) == 1 and json.loads(calls[0].arguments) == json.loads(deltas) == {"city": "Oslo", "unit": "F"}


def test_create_with_stream_true_and_a_cut_stream_is_incomplete(scripted) -> None:
    events = list(scripted.responses.create(model=MODEL, input="one two three four five", max_output_tokens=2,
                                            temperature=0, stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert [event.sequence_number for event in events] == list(range(len(events)))


PARIS = '{"city": "Paris", "unit": "C"}'         # a call's arguments, as the scripted model writes them


@pytest.mark.parametrize("cut", [17, 4], ids=["mid-arguments", "before-the-name"])
def test_a_call_cut_by_max_output_tokens_is_the_same_items_whole_and_streamed(scripted, cut: int) -> None:
    """A call cut mid-arguments is a function_call item, incomplete, with the arguments written (what the stream
    had announced, before the cut); one cut before its name is no item: an empty incomplete message instead."""
    fields = {"model": MODEL, "input": call("get_weather", json.loads(PARIS)), "tools": [WEATHER], "temperature": 0,
              "max_output_tokens": cut}
    whole = scripted.responses.create(**fields)
    events = list(scripted.responses.create(**fields, stream=True))
    streamed = events[-1].response
    assert events[-1].type == "response.incomplete" and whole.status == streamed.status == "incomplete"
    shown = [[(item.type, item.status, getattr(item, "name", None), getattr(item, "arguments", None))
              for item in response.output] for response in (whole, streamed)]
    assert shown[0] == shown[1], shown
    deltas = "".join(e.delta for e in events if e.type == "response.function_call_arguments.delta")
    if cut == 17:                                        # <tool_call>, then 16 tokens: '... {"city": "Paris'
        (kind, status, name, arguments), = shown[0]
        assert (kind, status, name) == ("function_call", "incomplete", "get_weather")
        assert arguments == deltas and 0 < len(arguments) < len(PARIS) and PARIS.startswith(arguments)
    else:
        assert shown[0] == [("message", "incomplete", None, None)] and deltas == ""


# --- what the constraints guarantee, on random weights --------------------------------------------------

def test_json_schema_format_validates(client) -> None:
    response = client.responses.create(model=MODEL, input="A person", max_output_tokens=200, **NO_THINKING,
                                       text={"format": {"type": "json_schema", "name": "person", "schema": PERSON,
                                                        "strict": True}})
    assert response.status == "completed", response
    jsonschema.validate(json.loads(response.output_text), PERSON)


def test_tool_choice_required_gives_a_call_that_validates(client) -> None:
    for stream in (False, True):
        fields = {"model": MODEL, "input": "Weather?", "tools": [WEATHER], "tool_choice": "required",
                  "max_output_tokens": 200, **NO_THINKING}
        response = events_of(client, **fields)[1] if stream else client.responses.create(**fields)
        calls = [item for item in response.output if item.type == "function_call"]
        assert response.status == "completed" and calls, response
        for item in calls:
            assert item.name == "get_weather"
            jsonschema.validate(json.loads(item.arguments), CITY)


@pytest.mark.parametrize("fields, param", [
    ({"input": 3}, "input"),
    ({"input": [{"role": "robot", "content": "Hi"}]}, "input"),
    ({"input": [{"type": "image", "url": "x"}]}, "input"),
    ({"input": "Hi", "text": {"format": {"type": "xml"}}}, "text"),
    ({"input": "Hi", "text": {"format": {"type": "text"}, "verbosity": "low"}}, "text"),
    ({"input": "Hi", "reasoning": {"effort": "extreme"}}, "reasoning"),
    ({"input": "Hi", "reasoning": {"summary": "concise"}}, "reasoning"),   # the summary is the thinking, verbatim
    ({"input": "Hi", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "Hi", "temperature": 7}, "temperature"),
    ({"input": "Hi", "tools": [{"type": "web_search"}]}, "tools"),
    ({"input": "Hi", "tools": [{**WEATHER, "colour": "red"}]}, "tools"),
    ({"input": "Hi", "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"input": "Hi", "previous_response_id": "resp_1"}, "previous_response_id"),
    ({"input": "Hi", "truncation": "auto"}, "truncation"),
    ({"input": "Hi", "include": ["reasoning.encrypted_content"]}, "include"),
    ({"input": [{"role": "user", "content": "Hi", "colour": "red"}]}, "input"),
    ({"input": [{"type": "function_call_output", "output": "21"}]}, "input"),
])
def test_bad_fields_are_refused_by_name(client, fields, param) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model=MODEL, **fields)
    assert refused.value.status_code == 400 and refused.value.param == param, refused.value.body
    assert refused.value.body["message"].startswith(param), refused.value.body


def test_store_metadata_and_the_off_values_of_include_and_truncation_are_accepted(client, running) -> None:
    response = client.responses.create(model=MODEL, input="Hi", store=True, metadata={"k": "v"}, user="me",
                                       max_output_tokens=2, include=[], truncation="disabled")
    assert response.usage.output_tokens == 2 and response.status == "incomplete"
    code, answer = post(running.url + "/responses", {"input": "Hi", "store": False, "max_output_tokens": 1})
    assert code == 200 and answer["object"] == "response", answer


@pytest.mark.parametrize("body", [
    {"input": [{"role": "user", "content": [{"type": "input_text", "text": 5}]}]},
    {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
    {"input": [{"role": "user", "content": {"text": "Hi"}}]},
    {"input": [{"type": "function_call", "call_id": 1, "name": "f", "arguments": "{}"}]},
    {"input": [{"type": "function_call_output", "call_id": "c", "output": {"x": 1}}]},
    {"input": [{"type": "reasoning", "summary": "thought"}]},
    {"input": [{"type": "reasoning", "summary": [], "content": [{"type": "output_text", "text": "x"}]}]},
    {"input": [None]}, {"input": []}, {"input": [[]]},
    {"input": "Hi", "instructions": ["a"]},
    {"input": "Hi", "text": "json"}, {"input": "Hi", "text": {"format": {"type": "json_schema"}}},
    {"input": "Hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}, "x": 1}}},
    {"input": "Hi", "reasoning": "high"}, {"input": "Hi", "reasoning": {"effort": "low", "summary": "long"}},
    {"input": "Hi", "tools": {"type": "function"}}, {"input": "Hi", "tools": [{"type": "function"}]},
    {"input": "Hi", "tools": [{"type": "function", "name": "f", "strict": "yes"}]},
    {"input": "Hi", "tools": [{"type": "function", "name": "f", "parameters": {"type": "object", "minProperties": 9,
                                                                                "maxProperties": 2}}]},
    {"input": "Hi", "tool_choice": "required"}, {"input": "Hi", "tool_choice": 3},
    {"input": "Hi", "tool_choice": {"type": "function", "name": "f", "x": 1}},
    {"input": "Hi", "parallel_tool_calls": "yes"}, {"input": "Hi", "store": "yes"},
    {"input": "Hi", "max_output_tokens": 10 ** 9}, {"input": "Hi", "max_output_tokens": "5"},
    {"input": "Hi", "top_p": 0}, {"input": "x" * 2_000_000},
])
def test_hostile_bodies_are_a_4xx_naming_a_field(running, body) -> None:
    code, answer = post(running.url + "/responses", body)
    assert 400 <= code < 500 and answer["error"]["param"], (code, answer)
    code, answer = post(running.url + "/responses", {"input": "Hi", "max_output_tokens": 1})
    assert code == 200, answer                                   # and the server keeps serving


def test_the_store_forgets_the_oldest_beyond_its_count_and_its_characters() -> None:
    from qwen_np.errors import APIError
    from qwen_np.serving.openai_responses import Store

    store = Store(size=2, chars=100)
    for name in ("a", "b", "c"):
        store.put(name, [{"role": "user", "content": name}])
    assert store.get("c") == [{"role": "user", "content": "c"}] and store.get("b")
    with pytest.raises(APIError, match="no stored response 'a'"):
        store.get("a")
    store.put("d", [{"role": "user", "content": "x" * 60}])          # 91 characters: with any other, over 100
    assert list(store.conversations) == ["d"] and store.held < 100
