"""Anthropic's Messages API on `serve` (issue 44), through the official `anthropic` client's own documented calls:
messages.create (text, system, a forced tool_use, a tool_result round trip, stop sequences, max_tokens, a
thinking budget), messages.stream (text_stream, get_final_message, tool_use and thinking), count_tokens,
Anthropic's error shape for bad bodies, and the API key as `x-api-key`.

Forced tool_use on random weights (their input validates whatever the model writes: the grammar's doing), and
one server of the scripted model (tests/serving/scripted_serve.py: the real server, template, tokenizer and grammar
masks, over logits that write the replies a conversation's first user message scripts), run with --api-key.
"""

from __future__ import annotations

import json

import jsonschema
import pytest

from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from qwen_np.files.tokenizer import Tokenizer
from tests.serving.test_serve import ROOT, post, serving
from tests.serving.test_serve_tools import CITY, SEPARATOR, call

anthropic = pytest.importorskip("anthropic")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

MODEL = str(QWEN3_RANDOM)
KEY = "sesame"
WEATHER = {"name": "get_weather", "description": "The weather in a city", "input_schema": CITY}
PARIS = {"city": "Paris", "unit": "C"}
THINKING = "<think>\n" + " ".join(f"step{i}" for i in range(60)) + "\n</think>\n\nThe answer."


@pytest.fixture(scope="module")
def running(env):
    with serving(env, MODEL, "--api-key", KEY, launcher=(str(ROOT / "tests" / "serving" / "scripted_serve.py"),)) as server:
        yield server


@pytest.fixture(scope="module")
def root(running) -> str:
    return running.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def client(root):
    return anthropic.Anthropic(base_url=root, api_key=KEY, max_retries=0, timeout=HANG_SECONDS)


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(QWEN3_RANDOM)


def say(client, script: str, **kwargs):
    messages = kwargs.pop("messages", [{"role": "user", "content": script}])
    return client.messages.create(model=MODEL, max_tokens=kwargs.pop("max_tokens", 64), messages=messages, **kwargs)


def stream(client, script: str, **kwargs):
    """The streamed reply: its text as text_stream gave it, and get_final_message's message."""
    messages = kwargs.pop("messages", [{"role": "user", "content": script}])
    with client.messages.stream(model=MODEL, max_tokens=kwargs.pop("max_tokens", 64), messages=messages,
                                **kwargs) as events:
        text = "".join(events.text_stream)
        return text, events.get_final_message()


def test_a_plain_message_is_anthropics_message(client) -> None:
    # temperature, top_p and top_k: the client (2.x) sends them as extra_body; cache_control is read and left alone
    message = say(client, "Hello there.", extra_body={"temperature": 0, "top_p": 0.9, "top_k": 20},
                  cache_control={"type": "ephemeral"}, metadata={"user_id": "u1"})
    assert message.id.startswith("msg_") and message.type == "message" and message.role == "assistant"
    assert message.model == MODEL
    assert [(block.type, block.text) for block in message.content] == [("text", "Hello there.")]
    assert message.stop_reason == "end_turn" and message.stop_sequence is None
    counted = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello there."}])
    assert message.usage.input_tokens + (message.usage.cache_read_input_tokens or 0) == counted.input_tokens
    assert message.usage.output_tokens == 4                       # "Hello", " there", ".", <|im_end|>


def test_count_tokens_is_the_rendered_prompts_tokens(client, tok) -> None:
    messages = [{"role": "user", "content": "Hi"}]
    counted = client.messages.count_tokens(model=MODEL, messages=messages, system="You are terse.")
    assert counted.input_tokens == len(tok.encode_chat([{"role": "system", "content": "You are terse."}, *messages],
                                                       add_generation_prompt=True))


def test_system_is_the_system_turn(client) -> None:
    alone = say(client, "Sure.")
    told = say(client, "Sure.", system=[{"type": "text", "text": "You are terse."}])
    assert told.content[0].text == "Sure." and told.usage.input_tokens + (told.usage.cache_read_input_tokens or 0) > (
        alone.usage.input_tokens + (alone.usage.cache_read_input_tokens or 0))


def test_a_forced_tool_use_validates_against_its_input_schema(client) -> None:
    message = say(client, call("get_weather", PARIS), tools=[WEATHER], tool_choice={"type": "tool", "name": "get_weather"})
    [use] = message.content
    assert use.type == "tool_use" and use.id.startswith("toolu_") and use.name == "get_weather"
    jsonschema.validate(use.input, CITY)
    assert use.input == PARIS and message.stop_reason == "tool_use"


def test_a_tool_result_round_trip(client) -> None:
    script = call("get_weather", PARIS) + SEPARATOR + "It is sunny in Paris."
    first = say(client, script, tools=[WEATHER])
    [use] = [block for block in first.content if block.type == "tool_use"]
    assert first.stop_reason == "tool_use" and use.input == PARIS
    messages = [{"role": "user", "content": script}, {"role": "assistant", "content": first.content},
                {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]}]
    second = say(client, script, tools=[WEATHER], messages=messages)
    assert [(b.type, b.text) for b in second.content] == [("text", "It is sunny in Paris.")]
    assert second.stop_reason == "end_turn"
    without = client.messages.count_tokens(model=MODEL, messages=messages[:2] + [{"role": "user", "content": "x"}],
                                           tools=[WEATHER])
    assert client.messages.count_tokens(model=MODEL, messages=messages, tools=[WEATHER]).input_tokens > without.input_tokens


def test_stop_sequences_and_max_tokens(client) -> None:
    stopped = say(client, "one two three", stop_sequences=["three", "two"])
    assert stopped.content[0].text == "one " and stopped.stop_reason == "stop_sequence"
    assert stopped.stop_sequence == "two"
    cut = say(client, "one two three four five", max_tokens=2)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2


def test_a_stream_gives_text_stream_and_the_final_message(client) -> None:
    text, message = stream(client, "Hello there.")
    assert text == "Hello there." and [(b.type, b.text) for b in message.content] == [("text", "Hello there.")]
    assert message.stop_reason == "end_turn" and message.usage.output_tokens == 4 and message.id.startswith("msg_")


def test_a_stream_with_thinking_and_a_tool_use(client) -> None:
    script = "<think>\nThe weather, then.\n</think>\n\n" + call("get_weather", PARIS)
    _, message = stream(client, script, tools=[WEATHER])
    assert [block.type for block in message.content] == ["thinking", "tool_use"]
    assert message.content[0].thinking.strip() == "The weather, then." and message.content[0].signature
    assert message.content[1].input == PARIS and message.content[1].id.startswith("toolu_")
    assert message.stop_reason == "tool_use"
    whole = say(client, script, tools=[WEATHER])
    assert [block.type for block in whole.content] == ["thinking", "tool_use"] and whole.content[1].input == PARIS


def test_the_stream_is_anthropics_events_in_order(client) -> None:
    script = "<think>\nHmm.\n</think>\n\nYes. " + call("get_weather", PARIS)
    events = list(say(client, script, tools=[WEATHER], stream=True))
    kinds = [event.type for event in events]        # the client reads the ping after message_start and passes it by
    assert kinds[0] == "message_start" and kinds[-2:] == ["message_delta", "message_stop"] and "ping" not in kinds
    starts = [event.content_block.type for event in events if event.type == "content_block_start"]
    assert starts == ["thinking", "text", "tool_use"]
    deltas = {event.delta.type for event in events if event.type == "content_block_delta"}
    assert {"thinking_delta", "signature_delta", "text_delta", "input_json_delta"} <= deltas
    assert kinds.count("content_block_stop") == 3
    # each block's deltas come between its start and its stop
    index = [(event.type, getattr(event, "index", None)) for event in events if event.type.startswith("content_block")]
    for i in range(3):
        mine = [j for j, (_, at) in enumerate(index) if at == i]
        assert index[mine[0]][0] == "content_block_start" and index[mine[-1]][0] == "content_block_stop"
    arguments = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta"
                        and e.delta.type == "input_json_delta")
    assert json.loads(arguments) == PARIS
    assert events[-2].delta.stop_reason == "tool_use"


@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_thinking_budget_ends_the_thinking_block_with_qwens_closing_text(client, tok, streamed) -> None:
    from qwen_np.generation.thinking import CLOSING

    kwargs = dict(max_tokens=60, thinking={"type": "enabled", "budget_tokens": 6})
    message = stream(client, THINKING, **kwargs)[1] if streamed else say(client, THINKING, **kwargs)
    assert [block.type for block in message.content] == ["thinking", "text"]
    said, closing = message.content[0].thinking.split("Considering the limited time")
    assert len(tok.encode(said.strip())) <= 6
    assert closing.startswith(CLOSING.split("Considering the limited time")[1][:30])
    assert message.content[1].text


def test_thinking_disabled_renders_the_empty_think_block(client) -> None:
    on = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])
    off = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       thinking={"type": "disabled"})
    assert off.input_tokens > on.input_tokens


def assert_anthropic_error(problem, status: int, kind: str, starts: str = "") -> None:
    assert problem.status_code == status
    assert problem.body == {"type": "error", "error": {"type": kind, "message": problem.body["error"]["message"]}}
    assert problem.body["error"]["message"].startswith(starts) and "Traceback" not in problem.body["error"]["message"]


@pytest.mark.parametrize("kwargs, starts", [
    ({"max_tokens": anthropic.NOT_GIVEN}, "max_tokens: "),
    ({"extra_body": {"frequency_penalty": 1}}, "frequency_penalty: "),
    ({"tool_choice": {"type": "bogus"}, "tools": [WEATHER]}, "tool_choice: "),
    ({"tool_choice": {"type": "tool", "name": "get_weather", "extra": 1}, "tools": [WEATHER]}, "tool_choice.extra: "),
    ({"tool_choice": {"type": "any"}}, "tool_choice: "),
    ({"thinking": {"type": "enabled"}}, "thinking.budget_tokens: "),
    ({"thinking": {"type": "enabled", "budget_tokens": -1}}, "thinking.budget_tokens: "),
    ({"stop_sequences": "two"}, "stop_sequences: "),
    ({"tool_choice": {"type": "tool", "name": "get_weather"}, "tools": [WEATHER], "stop_sequences": ["x"]},
     "stop_sequences: "),
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, "messages[0].content[0]: "),
    ({"messages": [{"role": "user", "content": [{"type": "text", "text": "Hi", "colour": "red"}]}]},
     "messages[0].content[0].colour: "),
    ({"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "The"}]}, "messages[1]: "),
    ({"tools": [{"type": "web_search_20250305", "name": "web_search"}]}, "tools[0].type: "),
    ({"tools": [{"name": "f", "input_schema": {"type": "object", "properties": {"a": {"type": "nonsense"}}}}]},
     "tools[0].input_schema: "),
    ({"tools": [{"name": "f g", "input_schema": {"type": "object"}}]}, "tools[0].name: "),
    ({"tool_choice": {"type": "tool", "name": "get_time"}, "tools": [WEATHER]}, "tool_choice.name: "),
    ({"extra_body": {"temperature": 1.5}}, "temperature: "),
    ({"extra_body": {"top_k": -2}}, "top_k: ")],
    ids=["no max_tokens", "unknown field", "bad tool_choice", "unknown tool_choice key", "any without tools",
         "no budget", "negative budget", "stop_sequences string", "stop with a named tool", "image", "unknown block key",
         "prefill", "server tool", "bad input_schema", "bad tool name", "undeclared tool", "temperature", "top_k"])
def test_a_bad_body_is_a_bad_request_in_anthropics_shape(client, kwargs, starts) -> None:
    with pytest.raises(anthropic.BadRequestError) as refused:
        say(client, "Hi", **kwargs)
    assert_anthropic_error(refused.value, 400, "invalid_request_error", starts)


def test_an_unknown_model_is_not_found_in_anthropics_shape(client) -> None:
    with pytest.raises(anthropic.NotFoundError) as refused:
        client.messages.create(model="claude-nonesuch", max_tokens=8, messages=[{"role": "user", "content": "Hi"}])
    assert_anthropic_error(refused.value, 404, "not_found_error")


def test_a_wrong_x_api_key_is_an_authentication_error(root) -> None:
    wrong = anthropic.Anthropic(base_url=root, api_key="wrong", max_retries=0, timeout=HANG_SECONDS)
    with pytest.raises(anthropic.AuthenticationError) as refused:
        say(wrong, "Hi")
    assert_anthropic_error(refused.value, 401, "authentication_error")
    with pytest.raises(anthropic.AuthenticationError):
        wrong.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hi"}])


def test_hostile_bodies_are_4xx_in_anthropics_shape(root) -> None:
    for body in (b"{", b"[]", {"max_tokens": 10 ** 5000 // 10 ** 4990, "messages": "Hi"},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": [None]}]},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "system": [{"type": "text"}]},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "tools": [{"name": "x"}]},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "thinking": "on"},
                 {"max_tokens": 8, "messages": [{"role": "user", "content": "Hi"}], "top_k": "many"}):
        status, answer = post(root + "/v1/messages", body, **{"x-api-key": KEY})
        assert status == 400 and answer["type"] == "error" and answer["error"]["type"] == "invalid_request_error", answer
    status, answer = post(root + "/v1/messages/nothing", {}, **{"x-api-key": KEY})
    assert status == 404 and answer["error"]["type"] == "not_found_error"


def test_the_stream_is_server_sent_events_named_as_their_data(root) -> None:
    import urllib.request

    body = {"model": MODEL, "max_tokens": 16, "stream": True, "messages": [{"role": "user", "content": "Hello there."}]}
    request = urllib.request.Request(root + "/v1/messages", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json", "x-api-key": KEY})
    with urllib.request.urlopen(request, timeout=HANG_SECONDS) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        events = response.read().decode().split("\n\n")
    assert events[-1] == ""
    named = [event.split("\n") for event in events[:-1]]
    assert all(len(lines) == 2 and lines[0].startswith("event: ") and lines[1].startswith("data: ") for lines in named)
    assert all(json.loads(data[len("data: "):])["type"] == name[len("event: "):] for name, data in named)
    assert [name[len("event: "):] for name, _ in named] == [      # the ping after message_start, as Anthropic's
        "message_start", "ping", "content_block_start", *["content_block_delta"] * 3, "content_block_stop", "message_delta",
        "message_stop"]


def test_x_api_key_serves_the_openai_routes_too(root) -> None:
    status, answer = post(root + "/v1/chat/completions", {"model": MODEL, "max_tokens": 4,
                                                          "messages": [{"role": "user", "content": "Hi"}]},
                          **{"x-api-key": KEY})
    assert status == 200 and answer["choices"][0]["message"]["content"] == "Hi"
    status, answer = post(root + "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}]},
                          **{"x-api-key": "wrong"})
    assert status == 401 and answer["error"]["code"] == "invalid_api_key"          # OpenAI's shape on its routes


# --- random weights: what the constraints make true whatever the model writes -----------------------------

@pytest.fixture(scope="module")
def random_client(env):
    with serving(env, MODEL) as server:
        yield anthropic.Anthropic(base_url=server.url.removesuffix("/v1"), api_key="none", max_retries=0,
                                  timeout=HANG_SECONDS)


@pytest.mark.parametrize("choice", [{"type": "tool", "name": "get_weather"}, {"type": "any"}], ids=["tool", "any"])
@pytest.mark.parametrize("streamed", [False, True], ids=["whole", "streamed"])
def test_a_forced_tool_use_on_random_weights_validates(random_client, choice, streamed) -> None:
    kwargs = dict(max_tokens=200, tools=[WEATHER], tool_choice=choice, thinking={"type": "disabled"})
    message = stream(random_client, "What is the weather in Paris?", **kwargs)[1] if streamed else say(
        random_client, "What is the weather in Paris?", **kwargs)
    uses = [block for block in message.content if block.type == "tool_use"]
    assert uses and message.stop_reason == "tool_use"
    for use in uses:
        assert use.name == "get_weather" and use.id.startswith("toolu_")
        jsonschema.validate(use.input, CITY)


def test_a_tool_use_cut_by_max_tokens_is_no_call(random_client) -> None:
    message = say(random_client, "What is the weather in Paris?", max_tokens=3, tools=[WEATHER],
                  tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 3
    assert not [block for block in message.content if block.type == "tool_use"]


def test_a_streamed_tool_use_cut_by_max_tokens_ends_as_max_tokens(random_client) -> None:
    _, message = stream(random_client, "What is the weather in Paris?", max_tokens=8, tools=[WEATHER],
                        tool_choice={"type": "tool", "name": "get_weather"}, thinking={"type": "disabled"})
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 8
