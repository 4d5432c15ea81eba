"""What agents use of `serve` (issue 31), through the official `openai` client: tool calls, structured outputs,
log-probabilities, logit_bias and the penalties.

Two servers: a scripted model (tests/serving/scripted_serve.py: the real server, template, tokenizer and grammar
masks, over logits that write the replies a conversation's first user message scripts) for what a model
writes, parallel calls, thinking, calls cut off or malformed, the agent loop; and the random-weight Qwen3
fixture for what constraints guarantee whatever the model writes (JSON that validates, calls that validate,
whole and streamed), for log-probabilities equal to transformers' and for the sampling fields.
"""

from __future__ import annotations

import json

import jsonschema
import numpy as np
import pytest

from tests.conftest import HANG_SECONDS
from tests.serving.test_serve import MODEL, assert_openai_error, post

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

SEPARATOR = "\n=====\n"                 # scripted_serve's: between the scripted replies of successive turns
CITY = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
        "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": CITY}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}            # no parameters: takes {}
SCHEMAS = {"get_weather": CITY, "get_time": {"type": "object", "maxProperties": 0}}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pet": {"enum": ["cat", "dog", None]}}}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def call(name: str, arguments: dict) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': arguments})}\n</tool_call>"


def client_of(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=HANG_SECONDS)


def say(client, script: str, *, stream: bool = False, **kwargs):
    """The scripted model's reply to a conversation that scripts `script` (whole, or the client's stream
    assembled by the client: openai's ChatCompletionStream)."""
    messages = kwargs.pop("messages", [{"role": "user", "content": script}])
    if stream:
        with client.chat.completions.stream(model=MODEL, messages=messages, temperature=0, **kwargs) as events:
            return events.get_final_completion().choices[0]
    return client.chat.completions.create(model=MODEL, messages=messages, temperature=0, **kwargs).choices[0]


def calls(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


# --- a scripted model: what it writes comes back as OpenAI's tool_calls ------------------------------------

PARALLEL = ("I'll check both.\n" + call("get_weather", {"city": "Paris", "unit": "C"}) + "\n"
            + call("get_weather", {"city": "Rome", "unit": "F"}))


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_parallel_calls_come_back_as_tool_calls_apart_from_the_content(scripted, stream: bool) -> None:
    choice = say(scripted, PARALLEL, tools=[WEATHER, CLOCK], stream=stream)
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "I'll check both."
    assert calls(choice) == [("get_weather", {"city": "Paris", "unit": "C"}), ("get_weather", {"city": "Rome", "unit": "F"})]
    ids = [c.id for c in choice.message.tool_calls]
    assert len(set(ids)) == 2 and all(i.startswith("call_") and c.type == "function"
                                      for i, c in zip(ids, choice.message.tool_calls))


def test_streamed_calls_are_announced_by_name_then_their_arguments_stream_in_pieces(scripted) -> None:
    chunks = list(scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PARALLEL}],
                                                   tools=[WEATHER], temperature=0, stream=True))
    pieces = [c.choices[0].delta.tool_calls[0] for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    firsts = [p for p in pieces if p.id is not None]
    assert [(p.index, p.type, p.function.name, p.function.arguments) for p in firsts] == [
        (0, "function", "get_weather", ""), (1, "function", "get_weather", "")]
    assert all(p.id is None and p.function.name is None for p in pieces if p not in firsts)
    first = "".join(p.function.arguments for p in pieces if p.index == 0)
    assert json.loads(first) == {"city": "Paris", "unit": "C"} and sum(p.index == 0 for p in pieces) > 3
    assert "<tool_call>" not in "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_thinking_stays_apart_from_the_calls(scripted, stream: bool) -> None:
    script = "<think>\nThe user wants Paris.\n</think>\n\n" + call("get_weather", {"city": "Paris", "unit": "C"})
    choice = say(scripted, script, tools=[WEATHER], stream=stream)
    # Whole: null content beside the calls, as OpenAI's; streamed: the "" of the first delta, where the role is.
    assert choice.message.content == ("" if stream else None) and choice.finish_reason == "tool_calls"
    extra = choice.message.model_extra
    assert extra["reasoning_content"] == extra["reasoning"] == "The user wants Paris."
    assert calls(choice) == [("get_weather", {"city": "Paris", "unit": "C"})]


def test_a_call_cut_off_by_max_tokens_is_never_content_and_says_length(scripted) -> None:
    script = "Let me see." + call("get_weather", {"city": "Paris", "unit": "C"})
    choice = say(scripted, script, tools=[WEATHER], max_tokens=18)
    assert choice.finish_reason == "length" and choice.message.tool_calls is None
    assert choice.message.content == "Let me see."
    [malformed] = choice.message.model_extra["malformed_tool_calls"]          # the block as far as it got
    assert '"arguments": {"city' in malformed and script.split("<tool_call>")[1].startswith(malformed)
    resent = [{"role": "user", "content": script}, choice.message.model_dump(), {"role": "user", "content": "?"}]
    assert say(scripted, script, messages=resent, tools=[WEATHER], max_tokens=1).finish_reason == "length"


@pytest.mark.parametrize("broken", ['{"name": "get_weather", "arguments": {"city": Paris}}',
                                    '{"name": "no_such_tool", "arguments": {}}', "not JSON at all"])
def test_a_call_the_model_gets_wrong_is_held_to_a_declared_tool_and_never_leaks(scripted, broken: str) -> None:
    """Once the model opens <tool_call>, the grammar allows only a declared tool's valid call: the tokens of
    the wrong one are masked out, and what comes back is a call that validates (or, cut off, none)."""
    choice = say(scripted, f"<tool_call>\n{broken}\n</tool_call>", tools=[WEATHER, CLOCK], max_tokens=60)
    assert "<tool_call>" not in (choice.message.content or "") and "</tool_call>" not in (choice.message.content or "")
    for name, arguments in calls(choice):
        jsonschema.validate(arguments, SCHEMAS[name])
    assert choice.finish_reason in ("tool_calls", "length")


def test_tool_choice_none_keeps_the_tools_in_the_prompt_but_no_call_can_be_made(scripted) -> None:
    plain = scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                             max_tokens=1, temperature=0)
    choice = scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": PARALLEL}],
                                              tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=60)
    told = scripted.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=1,
                                            tools=[WEATHER], tool_choice="none", temperature=0)
    assert told.usage.prompt_tokens > plain.usage.prompt_tokens + 50          # the tools' system turn
    reply = choice.choices[0]
    assert reply.message.tool_calls is None and "<tool_call>" not in reply.message.content
    assert reply.message.content.startswith("I'll check both.")


def test_an_agent_loop_runs_turn_after_turn(scripted) -> None:
    script = call("get_weather", {"city": "Paris", "unit": "C"}) + SEPARATOR + "It is 21 C in Paris."
    messages = [{"role": "user", "content": script}]
    first = scripted.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0)
    message = first.choices[0].message
    assert first.choices[0].finish_reason == "tool_calls" and message.content is None
    messages.append(message.model_dump(exclude_none=True))        # the client resends the call as it came
    for made in message.tool_calls:
        messages.append({"role": "tool", "tool_call_id": made.id, "content": json.dumps({"temp": 21})})
    final = scripted.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], temperature=0)
    assert final.choices[0].message.content == "It is 21 C in Paris." and final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.tool_calls is None


def test_the_schema_holds_after_the_think_block(scripted) -> None:
    script = '<think>\nA cat owner.\n</think>\n\n{"name": "Ann", "age": 30, "pet": "cat"}'
    response = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choice = say(scripted, script, response_format=response)
    assert choice.message.model_extra["reasoning_content"] == "A cat owner."
    assert json.loads(choice.message.content) == {"name": "Ann", "age": 30, "pet": "cat"}


# --- random weights under constraints: valid whatever the model writes ------------------------------------

@pytest.mark.parametrize("seed", range(4))
def test_json_schema_answers_parse_and_validate(client, seed: int) -> None:
    response = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}
    choice = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "A person?"}],
                                            response_format=response, temperature=1.0, seed=seed, max_tokens=100,
                                            extra_body=NO_THINKING).choices[0]
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_ends_the_reply_where_its_object_closes(client, tok) -> None:
    # "{}" pushed up everywhere: unconstrained, greedy repeats it; under json_object the one object is the reply.
    [empty] = tok.encode("{}")
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "JSON?"}], temperature=0, max_tokens=6,
                  logit_bias={str(empty): 100}, extra_body=NO_THINKING)
    assert client.chat.completions.create(**kwargs).choices[0].message.content == "{}" * 6
    choice = client.chat.completions.create(response_format={"type": "json_object"}, **kwargs).choices[0]
    assert (choice.message.content, choice.finish_reason) == ("{}", "stop")


@pytest.mark.parametrize("choice_of, stream", [("required", False), ("required", True), ("named", False),
                                               ("named", True)])
def test_required_and_named_tool_choices_return_calls_that_validate(client, choice_of: str, stream: bool) -> None:
    tool_choice = "required" if choice_of == "required" else {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Weather?"}], tools=[WEATHER, CLOCK],
                  tool_choice=tool_choice, temperature=1.0, seed=3, max_tokens=80, extra_body=NO_THINKING)
    if stream:
        with client.chat.completions.stream(**kwargs) as events:
            choice = events.get_final_completion().choices[0]
    else:
        choice = client.chat.completions.create(**kwargs).choices[0]
    made = calls(choice)
    assert choice.finish_reason == "tool_calls" and made and not choice.message.content
    for name, arguments in made:
        jsonschema.validate(arguments, SCHEMAS[name])
    if choice_of == "named":
        assert [name for name, _ in made] == ["get_weather"]


def test_a_tool_result_turn_is_accepted_and_rendered_as_the_template_renders_it(client, tok) -> None:
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "C"}'}}]},
                {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}]
    answer = client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=3)
    assert answer.usage.prompt_tokens == len(tok.encode_chat(messages, tools=[WEATHER]))
    assert answer.usage.completion_tokens >= 1


# --- log-probabilities -----------------------------------------------------------------------------------

def token_ids(tok, entries) -> list[int]:
    """The ids of the tokens a logprobs list names, by their bytes (each a token of its own in the vocabulary)."""
    by_bytes: dict[bytes, list[int]] = {}
    for i in range(tok.vocab_size):
        by_bytes.setdefault(tok.token_bytes(i), []).append(i)
    ids = [by_bytes[bytes(entry.bytes)] for entry in entries]
    assert all(len(found) == 1 for found in ids)
    return [found[0] for found in ids]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_are_transformers_log_softmax(client, tok, stream: bool) -> None:
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    messages = [{"role": "user", "content": "Count to five."}]
    kwargs = dict(model=MODEL, messages=messages, max_tokens=10, temperature=1.0, seed=5, logprobs=True,
                  top_logprobs=5, frequency_penalty=1.0, logit_bias={"11": 30}, extra_body=NO_THINKING)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kwargs))
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        entries = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(entries) == 10
    prompt, generated = tok.encode_chat(messages, enable_thinking=False), token_ids(tok, entries)
    hf = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + generated[:-1]])).logits[0, len(prompt) - 1:].double()
    expected = torch.log_softmax(logits, dim=-1).numpy()                         # [10, V]: raw, float64
    for entry, token, row in zip(entries, generated, expected):
        assert abs(entry.logprob - row[token]) < 1e-3
        tops = entry.top_logprobs
        assert len(tops) == 5 and [t.logprob for t in tops] == sorted((t.logprob for t in tops), reverse=True)
        best = np.sort(row)[::-1][:5]
        np.testing.assert_allclose([t.logprob for t in tops], best, atol=1e-3)
        assert entry.logprob <= tops[0].logprob + 1e-9 and bytes(tops[0].bytes).decode(errors="replace") == tops[0].token
    assert generated.count(11) >= 1           # the bias moved the sampler (",": 30 up), not the reported logprobs


def test_completions_legacy_logprobs_whole_and_streamed(client) -> None:
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=3).choices[0]
    legacy = whole.logprobs
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 6
    assert "".join(legacy.tokens) == whole.text and legacy.text_offset[0] == 0
    assert legacy.text_offset == [sum(len(t) for t in legacy.tokens[:i]) for i in range(6)]
    for chosen, logprob, top in zip(legacy.tokens, legacy.token_logprobs, legacy.top_logprobs):
        assert len(top) == 3 and top[chosen] == logprob == max(top.values())         # greedy: the most likely
    chunks = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=6, temperature=0, logprobs=3,
                                            stream=True))
    streamed = [c.choices[0].logprobs for c in chunks if c.choices[0].logprobs]
    assert [t for s in streamed for t in s.tokens] == legacy.tokens
    assert [o for s in streamed for o in s.text_offset] == legacy.text_offset
    assert [p for s in streamed for p in s.token_logprobs] == legacy.token_logprobs


# --- logit_bias and the penalties ----------------------------------------------------------------------

def greedy(client, **kwargs) -> list:
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Go on."}],
                                          temperature=0, max_tokens=12, logprobs=True, top_logprobs=20,
                                          extra_body={**NO_THINKING, "repetition_penalty": 1.0},
                                          **kwargs).choices[0].logprobs.content


def test_a_bias_of_100_forces_a_token_and_minus_100_bans_one(client, tok) -> None:
    plain = token_ids(tok, greedy(client))
    forced = token_ids(tok, greedy(client, logit_bias={"12095": 100}))
    assert forced == [12095] * 12
    banned = token_ids(tok, greedy(client, logit_bias={str(plain[0]): -100}))
    assert plain[0] not in banned and banned != plain


@pytest.mark.parametrize("penalty", ["frequency_penalty", "presence_penalty"])
def test_the_penalties_subtract_count_times_frequency_and_presence_once(client, tok, penalty: str) -> None:
    """Greedy under a penalty takes, at every step, the token with the highest raw log-probability less
    count x frequency_penalty (or presence_penalty once it has appeared), OpenAI's definition; the counts
    are of the reply's tokens so far."""
    plain = token_ids(tok, greedy(client))
    assert len(set(plain)) < len(plain)                     # greedy repeats itself: something to penalise
    entries = greedy(client, **{penalty: 2.0})
    chosen = token_ids(tok, entries)
    assert chosen != plain

    def penalised(token: int, logprob: float, before: list[int]) -> float:
        count = before.count(token)
        return logprob - (2.0 * count if penalty == "frequency_penalty" else 2.0 * (count > 0))

    for step, entry in enumerate(entries):
        tops = dict(zip(token_ids(tok, entry.top_logprobs), (t.logprob for t in entry.top_logprobs)))
        best = max(penalised(token, logprob, chosen[:step]) for token, logprob in tops.items())
        assert penalised(chosen[step], entry.logprob, chosen[:step]) >= best - 1e-4, step


# --- bad fields: a 400 naming the field ------------------------------------------------------------------

BAD = [
    ({"tools": {"type": "function"}}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}]}, "tools"),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}}, "tool_choice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [WEATHER], "parallel_tool_calls": "yes"}, "parallel_tool_calls"),
    ({"response_format": {"type": "xml"}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"schema": {}}}}, "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}}, "response_format"),
    ({"logprobs": 3}, "logprobs"),
    ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ({"top_logprobs": 2}, "top_logprobs"),
    ({"logit_bias": {"abc": 1}}, "logit_bias"),
    ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"151936": 1}}, "logit_bias"),
    ({"logit_bias": {"9" * 5000: 1}}, "logit_bias"),
    ({"logit_bias": {"5": float("nan")}}, "logit_bias"),
    ({"logit_bias": {"5": 101}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": [5]}, "logit_bias"),
    ({"frequency_penalty": 2.5}, "frequency_penalty"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": "call it"}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [{"type": "function"}]}]}, "messages"),
    ({"messages": [{"role": "assistant", "content": None,
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": 5}}]}]}, "messages"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]}, "messages"),
]


@pytest.mark.parametrize("fields, param", BAD, ids=[f"{param}-{i}" for i, (_, param) in enumerate(BAD)])
def test_a_bad_agent_field_is_a_400_naming_it(running, fields: dict, param: str) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, **fields}
    code, answer = post(running.url + "/chat/completions", body)
    assert_openai_error(code, answer, 400, param)
    assert answer["error"]["message"].startswith(param if param != "messages" else "messages["), answer


def test_an_unsupported_schema_keyword_is_named_in_the_400(running) -> None:
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"if": {}}}}}
    message = post(running.url + "/chat/completions", body)[1]["error"]["message"]
    assert message.startswith("response_format.json_schema.schema: unsupported JSON Schema keyword") and "if" in message


@pytest.mark.parametrize("fields, param", [({"logprobs": 21}, "logprobs"), ({"logprobs": True}, "logprobs"),
                                           ({"logit_bias": {"x": 1}}, "logit_bias"), ({"tools": [WEATHER]}, "tools")])
def test_a_bad_completions_field_is_a_400_naming_it(running, fields: dict, param: str) -> None:
    code, answer = post(running.url + "/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2, **fields})
    assert_openai_error(code, answer, 400, param)

