"""Where a constrained reply ends (issue 42), through the official `openai` client: the promise is one value
valid against its schema (or calls valid against their tools), or a finish_reason that says why not.

A scripted model (tests/serving/scripted_serve.py: the real server, template, tokenizer, batcher and grammar masks,
over logits that write what the conversation's first user message scripts) tries each way a probe cut a
constrained reply and still had it called a success:

    ignore_eos             the grammar never takes the end token as text: a value ends where it is complete
                           (finish "stop"), or at max_tokens (finish "length")
    stop, stop_token_ids   a reply that is all value (response_format, tool_choice "required" or a named tool)
                           refuses them, a 400 naming the field; with tool_choice "auto" they apply to the
                           free text, never inside a call
    min_tokens             a value complete in fewer tokens is an error naming min_tokens (only the end,
                           which it bans, could follow)
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.serving.test_serve import MODEL
from tests.serving.test_serve_tools import CITY, NO_THINKING, call

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "maxLength": 10}, "age": {"type": "integer"}}}
PARIS = {"city": "Paris", "unit": "C"}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def say(client, script: str, *, stream: bool, **kwargs):
    """The scripted model's reply; streamed, assembled by the client's stream helper (which raises on finish
    "length", carrying the completion it assembled: a cut value is what some tests look at)."""
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": script}], temperature=0, **kwargs)
    if not stream:
        return client.chat.completions.create(**kwargs).choices[0]
    try:
        with client.chat.completions.stream(**kwargs) as events:
            return events.get_final_completion().choices[0]
    except openai.LengthFinishReasonError as cut:
        return cut.completion.choices[0]


STREAMS = pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])


# --- ignore_eos: the end token is never the grammar's text ---------------------------------------------

@STREAMS
def test_ignore_eos_under_a_schema_never_writes_the_end_token_as_text_and_a_cut_value_says_length(
        scripted, stream: bool) -> None:
    # The script ends "6" with <|im_end|>: under ignore_eos that token was taken as text ("6<|im_end|>",
    # finish "stop"). An integer can go on after "6", so it does, until max_tokens cuts it: "length".
    choice = say(scripted, "6", stream=stream, response_format=schema_format({"type": "integer"}), max_tokens=4,
                 extra_body={**NO_THINKING, "ignore_eos": True})
    assert "<|im_end|>" not in choice.message.content
    assert choice.finish_reason == "length" and isinstance(json.loads(choice.message.content), int)


@STREAMS
def test_ignore_eos_under_a_schema_ends_where_the_value_is_complete(scripted, stream: bool) -> None:
    script = json.dumps({"name": "Ann", "age": 30})
    choice = say(scripted, script, stream=stream, response_format=schema_format(PERSON), max_tokens=40,
                 extra_body={**NO_THINKING, "ignore_eos": True})
    assert (choice.message.content, choice.finish_reason) == (script, "stop")
    jsonschema.validate(json.loads(choice.message.content), PERSON)


# --- stop and stop_token_ids: refused where the reply is all value ---------------------------------------

VALUES = {"json_schema": {"response_format": schema_format(PERSON)},
          "json_object": {"response_format": {"type": "json_object"}},
          "required": {"tools": [WEATHER], "tool_choice": "required"},
          "named": {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}}
CUTS = {"stop-string": ("stop", '"'), "stop-list": ("stop", ['"', "}"]), "stop-token-ids": ("stop_token_ids", '"'),
        "stop-token-ids-within-min-tokens": ("stop_token_ids", "{")}


@STREAMS
@pytest.mark.parametrize("cut", CUTS, ids=CUTS)
@pytest.mark.parametrize("value", VALUES, ids=VALUES)
def test_a_stop_that_would_cut_a_constrained_value_is_a_400_naming_it(scripted, tok, value, cut, stream) -> None:
    """A stop inside the one value cut it (stop '"' returned `{`, stop_token_ids of `"` or `{` returned "", a
    required call came back as no call at all), reported as finish "stop"."""
    field, value_of = CUTS[cut]
    sent = [tok.token_to_id(value_of)] if field == "stop_token_ids" else value_of
    extra = {**NO_THINKING, **({"min_tokens": 2} if "min-tokens" in cut else {}),
             **({field: sent} if field == "stop_token_ids" else {})}
    fields = {**VALUES[value], **({"stop": sent} if field == "stop" else {})}
    with pytest.raises(openai.BadRequestError) as refused:
        say(scripted, json.dumps({"name": "Ann", "age": 30}), stream=stream, max_tokens=40, extra_body=extra,
            **fields)
    assert refused.value.param == field and refused.value.body["message"].startswith(f"{field}: ")


# --- min_tokens: a value complete before them is a conflict, named -----------------------------------------

@STREAMS
def test_min_tokens_past_a_complete_value_is_an_error_naming_min_tokens(scripted, stream: bool) -> None:
    # "{}" is one token and a whole object: only the end may follow, which min_tokens bans (it came back
    # as "{}", finish "stop", the min_tokens asked for silently unmet).
    with pytest.raises(openai.APIError) as conflict:
        say(scripted, "{}", stream=stream, response_format={"type": "json_object"}, max_tokens=20,
            extra_body={**NO_THINKING, "min_tokens": 5})
    assert conflict.value.param == "min_tokens" and "grammar" in conflict.value.body["message"]
    assert isinstance(conflict.value, openai.BadRequestError) != stream       # streamed: the stream's error
    fine = say(scripted, "{}", stream=stream, response_format={"type": "json_object"}, max_tokens=20,
               extra_body={**NO_THINKING, "min_tokens": 1})
    assert (fine.message.content, fine.finish_reason) == ("{}", "stop")


# --- tool_choice "auto": stops apply to the free text, never inside a call ---------------------------------

@STREAMS
def test_a_stop_string_never_cuts_an_auto_call_but_still_ends_the_free_text(scripted, stream: bool) -> None:
    choice = say(scripted, "Checking.\n" + call("get_weather", PARIS) + '\nSaid "done".', stream=stream,
                 tools=[WEATHER], stop=['"'], max_tokens=80, extra_body=NO_THINKING)
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", PARIS)]
    assert choice.message.content.startswith("Checking.") and "done" not in choice.message.content
    assert choice.finish_reason == "tool_calls" and "malformed_tool_calls" not in (choice.message.model_extra or {})


@STREAMS
def test_a_stop_token_id_never_cuts_an_auto_call_but_still_ends_the_free_text(scripted, tok, stream) -> None:
    quote = tok.encode(' "')                 # a token of the call's JSON (its keys and strings open with it)
    assert len(quote) == 1
    choice = say(scripted, call("get_weather", PARIS) + '\nSaid "done".', stream=stream, tools=[WEATHER],
                 max_tokens=80, extra_body={**NO_THINKING, "stop_token_ids": quote})
    assert [json.loads(c.function.arguments) for c in choice.message.tool_calls] == [PARIS]
    assert (choice.message.content or "").strip() == "Said" and choice.finish_reason == "tool_calls"


# --- a schema's objects closed; json_object's schema held to (issue 44) --------------------------------------

OPEN_PERSON = {key: value for key, value in PERSON.items() if key != "additionalProperties"}   # pydantic's form


@STREAMS
def test_an_object_schema_that_leaves_additional_properties_out_gets_no_other_key(scripted, stream: bool) -> None:
    """instructor's and langchain's schemas leave additionalProperties out; a model that goes on past the last
    key (here: the script) is held to the keys the schema lists, and the value ends."""
    choice = say(scripted, json.dumps({"name": "Ann", "age": 30, "extra": 1}), stream=stream,
                 response_format=schema_format(OPEN_PERSON), max_tokens=60, extra_body=NO_THINKING)
    answer = json.loads(choice.message.content)
    assert choice.finish_reason == "stop" and set(answer) == {"name", "age"} and answer["name"] == "Ann"
    jsonschema.validate(answer, OPEN_PERSON)


def test_json_object_with_a_schema_is_held_to_the_schema_as_llama_cpp_and_vllm_read_it(scripted) -> None:
    """instructor's JSON_SCHEMA mode sends {"type": "json_object", "schema": ...}: the schema is not ignored."""
    script = json.dumps({"name": "Ann", "age": "thirty"})                   # age: a string, the schema's integer
    free = say(scripted, script, stream=False, response_format={"type": "json_object"}, max_tokens=60,
               extra_body=NO_THINKING)
    held = say(scripted, script, stream=False, response_format={"type": "json_object", "schema": OPEN_PERSON},
               max_tokens=60, extra_body=NO_THINKING)
    assert free.message.content == script
    assert held.finish_reason == "stop" and isinstance(json.loads(held.message.content)["age"], int)
    jsonschema.validate(json.loads(held.message.content), OPEN_PERSON)


@pytest.mark.parametrize("response_format, key", [
    ({"type": "json_object", "schemas": OPEN_PERSON}, "response_format.schemas"),
    ({"type": "json_schema", "json_schema": {"name": "a", "schema": OPEN_PERSON, "strict": True, "shema": {}}},
     "response_format.json_schema.shema"),
    ({"type": "text", "json_schema": {}}, "response_format.json_schema")])
def test_a_key_of_response_format_it_does_not_read_is_refused_by_name_never_ignored(scripted, response_format,
                                                                                      key) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        say(scripted, "{}", stream=False, response_format=response_format, max_tokens=8)
    assert refused.value.param == "response_format" and refused.value.body["message"].startswith(f"{key}: ")


# --- a thinking budget (issue 44) -----------------------------------------------------------------------

THINKING = "<think>\n" + " ".join(f"step{i}" for i in range(60)) + "\n</think>\n\nThe answer."


@STREAMS
@pytest.mark.parametrize("extra, budget", [({"thinking_budget": 6}, 6), ({"reasoning_effort": "none"}, 0)],
                         ids=["thinking_budget", "reasoning_effort"])
def test_a_thinking_budget_ends_the_thinking_with_qwens_closing_text_and_the_answer_follows(scripted, tok, stream,
                                                                                           extra, budget) -> None:
    """The scripted model thinks for 60 words; at the budget the server closes its thinking and it answers."""
    from qwen_np.generation.thinking import CLOSING

    choice = say(scripted, THINKING, stream=stream, max_tokens=60, extra_body=extra)
    reasoning = choice.message.model_extra["reasoning_content"]
    said, closing = reasoning.split("Considering the limited time")
    assert len(tok.encode(said.strip())) <= budget and closing.startswith(CLOSING.split("Considering the limited time")[1][:30])
    assert choice.message.content and choice.finish_reason in ("stop", "length")


@pytest.mark.parametrize("extra, field", [({"thinking_budget": -1}, "thinking_budget"),
                                          ({"reasoning_effort": "extreme"}, "reasoning_effort"),
                                          ({"reasoning_effort": "low", "thinking_budget": 5}, "reasoning_effort")])
def test_a_thinking_budget_it_cannot_keep_is_a_400_naming_its_field(scripted, extra, field) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        say(scripted, THINKING, stream=False, max_tokens=8, extra_body=extra)
    assert refused.value.param == field and refused.value.body["message"].startswith(f"{field}: ")


@STREAMS
def test_tools_beside_a_response_format_answer_in_the_schema_or_call(scripted, stream: bool) -> None:
    """An agent's output type beside its tools (the openai-agents SDK sends both): the reply is the value
    (content) or a call (tool_calls), each valid; free text cannot get in."""
    answered = say(scripted, json.dumps({"name": "Ann", "age": 30}), stream=stream, tools=[WEATHER],
                   response_format=schema_format(PERSON), max_tokens=60, extra_body=NO_THINKING)
    assert answered.finish_reason == "stop" and json.loads(answered.message.content) == {"name": "Ann", "age": 30}
    called = say(scripted, call("get_weather", PARIS), stream=stream, tools=[WEATHER],
                 response_format=schema_format(PERSON), max_tokens=60, extra_body=NO_THINKING)
    assert called.finish_reason == "tool_calls" and json.loads(called.message.tool_calls[0].function.arguments) == PARIS
    free = say(scripted, "Paris is sunny.", stream=stream, tools=[WEATHER], response_format=schema_format(PERSON),
               max_tokens=60, extra_body=NO_THINKING)
    assert free.message.content is None or jsonschema.validate(json.loads(free.message.content), PERSON) is None
