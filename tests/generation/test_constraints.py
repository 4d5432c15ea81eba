"""Constrained decoding (qwen_np/generation/constraints.py): a random-weight Qwen3 with the real tokenizer,
whose unconstrained output is noise, produces JSON that validates against its schema, replies in a Lark or
GBNF grammar's language, and tool calls that validate against their tool's parameters, in generate(), in
the batcher and under speculative decoding (a drafted token the grammar forbids is rejected); the CLI's
--json-schema prints JSON that validates; an unsupported schema keyword is an error naming it."""

from __future__ import annotations

import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import jsonschema
import numpy as np
import pytest

from qwen_np import cli
from qwen_np.core.sampling import SamplingParams
from qwen_np.engine.loading import load_model
from qwen_np.errors import APIError, QwenNPError
from qwen_np.files.model_files import open_model, read_generation_defaults
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation import constraints
from qwen_np.generation.constraints import closed
from qwen_np.generation.batching import BatchGenerator, BatchRunner, Request
from qwen_np.generation.generate import Continuation, Ending, generate, prompt_ids
from qwen_np.generation.speculative import NO_DRAFT, Draft, draft_speculation, lookup_speculation
from qwen_np.generation.tool_calls import parse_reply
from qwen_np.serving import launch
from qwen_np.serving.bodies import read_chat, read_completion
from qwen_np.serving.requests import Service

from tests.conftest import QWEN3_RANDOM, write_random_checkpoint

pytest.importorskip("llguidance")

PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age", "pet", "tags"],
          "properties": {"name": {"type": "string", "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "pet": {"enum": ["cat", "dog", None]},
                         "tags": {"type": "array", "items": {"type": "boolean"}, "maxItems": 3}}}
WEATHER = {"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "additionalProperties": False, "required": ["city", "unit"],
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["C", "F"]}}}}}
CLOCK = {"type": "function", "function": {"name": "get_time"}}          # no parameters: takes {}
TOOL_CALL, THINK = 151657, 151667                                        # <tool_call>, <think>


@pytest.fixture(scope="module")
def model():
    return load_model(QWEN3_RANDOM)


@pytest.fixture(scope="module")
def eos(model) -> tuple[int, ...]:
    return read_generation_defaults(QWEN3_RANDOM, model.config).eos_token_ids


@pytest.fixture(scope="module")
def vocab(tok: Tokenizer, model, eos) -> constraints.Vocabulary:
    return constraints.vocabulary(tok, model.config.vocab_size, eos)


def reply(model, tok, eos, grammar, seed: int, n: int = 120, **kwargs) -> tuple[str, str | None]:
    ids = prompt_ids(tok, "Describe a person as JSON.", enable_thinking=False)
    params = kwargs.pop("params", SamplingParams(temperature=1.0, seed=seed))
    events = list(generate(model, tok, ids, params, n, eos_token_ids=eos, grammar=grammar, **kwargs))
    return "".join(event.text for event in events), events[-1].finish_reason


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(4))
def test_a_random_model_under_a_schema_writes_json_that_validates(model, tok, eos, vocab, seed: int) -> None:
    text, finish = reply(model, tok, eos, constraints.json_schema_grammar(PERSON, vocab), seed)
    assert finish == "stop"                        # the grammar completed: nothing but an end could follow
    jsonschema.validate(json.loads(text), PERSON)


def test_unconstrained_the_same_model_writes_no_json(model, tok, eos) -> None:
    text, _ = reply(model, tok, eos, None, 0, n=40)
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


def test_json_object_gives_an_object_and_the_bias_applies_before_the_mask(model, tok, eos, vocab) -> None:
    # "{}" pushed up everywhere: where the grammar allows it (first), greedy takes it, and the object is whole.
    empty = tok.encode("{}")
    assert len(empty) == 1
    text, finish = reply(model, tok, eos, constraints.json_object_grammar(vocab), 0, n=60,
                         params=SamplingParams(temperature=0.0, logit_bias={empty[0]: 100}))
    assert (text, finish) == ("{}", "stop")


@pytest.mark.parametrize("source, language", [
    ('start: ANSWER "."\nANSWER: "yes" | "no" | "maybe"', {"yes.", "no.", "maybe."}),
    ('root ::= ("ab" | "cd") ("ab" | "cd") "!"', {"abab!", "abcd!", "cdab!", "cdcd!"}),       # GBNF
])
def test_lark_and_gbnf_grammars_hold_the_reply_to_their_language(model, tok, eos, vocab, source, language) -> None:
    grammar = constraints.text_grammar(source, vocab)
    for seed in range(3):
        text, finish = reply(model, tok, eos, grammar, seed)
        assert (text, finish) in {(word, "stop") for word in language}


def test_a_think_block_may_open_the_reply_and_the_answer_after_it_is_held_to_the_schema(tok, vocab) -> None:
    grammar = constraints.json_schema_grammar({"type": "object", "properties": {"a": {"type": "integer"}}}, vocab,
                                              thinking=True)
    constraint = grammar.constraint()
    for token in tok.encode('<think>\nan {"a": "x"} example\n</think>\n\n{"a": 12}'):
        assert constraint.allowed()[token]
        constraint.consume(token)
    assert constraint.done
    without = constraints.json_schema_grammar({"type": "object"}, vocab).constraint()
    assert not without.allowed()[THINK]


def test_the_mask_allows_exactly_what_the_grammar_accepts_and_ends_where_it_is_complete(tok, vocab, eos) -> None:
    constraint = constraints.json_schema_grammar({"enum": ["yes", "no"]}, vocab).constraint()
    allowed = constraint.allowed()
    assert allowed.shape == (vocab.size,) and allowed.dtype == np.bool_
    assert allowed[tok.encode('"')[0]] and allowed[tok.encode('"yes')[0]]
    assert not allowed[tok.encode("{")[0]] and not any(allowed[i] for i in eos)
    assert not allowed[tok.vocab_size:].any()                    # the model's padding ids are never allowed
    for token in tok.encode('"no"'):
        constraint.consume(token)
    assert constraint.done and set(np.flatnonzero(constraint.allowed())) == set(eos)
    with pytest.raises(QwenNPError, match="breaks the grammar"):
        constraint.consume(tok.encode("x")[0])


def accepts(grammar: constraints.Grammar, tok: Tokenizer, text: str) -> bool:
    """Whether the grammar allows every token of `text` and could end after it."""
    constraint = grammar.constraint()
    for token in tok.encode(text):
        if not constraint.allowed()[token]:
            return False
        constraint.consume(token)
    return constraint.accepting


def test_an_object_that_lists_its_properties_takes_no_other_key_unless_its_schema_opens_it(tok, vocab) -> None:
    """instructor's and langchain's schemas (pydantic's) leave additionalProperties out: the grammar closes the
    object, as llama.cpp's converter does, so a model cannot open new keys forever; `true` or a schema opens it."""
    point = {"type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}
    grammar = constraints.json_schema_grammar(point, vocab)
    assert accepts(grammar, tok, '{"x": 1}') and not accepts(grammar, tok, '{"x": 1, "y": 2}')
    for opened in (True, {"type": "integer"}):
        assert accepts(constraints.json_schema_grammar({**point, "additionalProperties": opened}, vocab), tok, '{"x": 1, "y": 2}')
    nested = {"$defs": {"Point": point}, "type": "object", "required": ["at"],
              "properties": {"at": {"$ref": "#/$defs/Point"}, "tags": {"type": "array", "items": point}}}
    grammar = constraints.json_schema_grammar(nested, vocab)
    assert accepts(grammar, tok, '{"at": {"x": 1}, "tags": [{"x": 2}]}')
    assert not accepts(grammar, tok, '{"at": {"x": 1, "y": 2}}') and not accepts(grammar, tok, '{"at": {"x": 1}, "z": 0}')
    assert not accepts(grammar, tok, '{"at": {"x": 1}, "tags": [{"x": 2, "y": 3}]}')
    # allOf combines its branches' keys: closing one would forbid the other's, so they stay open.
    both = {"allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {"type": "integer"}}}],
            "$defs": {"Base": {"properties": {"a": {"type": "integer"}}}}}
    assert accepts(constraints.json_schema_grammar(both, vocab), tok, '{"a": 1, "b": 2}')


def test_an_unbounded_integer_has_at_most_16_digits_and_a_schemas_own_bounds_are_kept(tok, vocab) -> None:
    grammar = constraints.json_schema_grammar({"type": "integer"}, vocab)
    assert accepts(grammar, tok, "9" * 16) and accepts(grammar, tok, "-" + "9" * 16) and not accepts(grammar, tok, "1" * 17)
    wide = constraints.json_schema_grammar({"type": "integer", "minimum": 0, "maximum": 10 ** 18}, vocab)
    assert accepts(wide, tok, "1" * 18) and not accepts(wide, tok, "-1")
    assert closed({"type": "integer", "enum": [10 ** 30]}) == {"type": "integer", "enum": [10 ** 30]}
    assert closed({"type": "number"}) == {"type": "number"}


@pytest.mark.parametrize("schema, keyword", [
    ({"type": "object", "if": {"properties": {}}, "then": {}}, '"if"'),
    ({"type": "object", "properties": {"a": {"type": "string", "dependentSchemas": {}}}}, '"dependentSchemas"'),
])
def test_an_unsupported_schema_keyword_is_an_error_naming_it(vocab, schema, keyword) -> None:
    with pytest.raises(QwenNPError, match=f"^response_format: unsupported JSON Schema keyword.*{keyword}"):
        constraints.json_schema_grammar(schema, vocab, where="response_format")


def test_bad_schemas_and_tools_are_errors_naming_the_field(vocab) -> None:
    with pytest.raises(QwenNPError, match=r"^json_schema: not valid JSON"):
        constraints.json_schema_grammar("{", vocab)
    with pytest.raises(QwenNPError, match=r"^json_schema: a JSON schema must be an object"):
        constraints.json_schema_grammar([1], vocab)
    with pytest.raises(QwenNPError, match=r"^tools\[1\]\.function\.name: 'get_weather' is declared twice"):
        constraints.tool_call_grammar([WEATHER, WEATHER], vocab)
    with pytest.raises(QwenNPError, match=r"^tools\[0\]\.function\.parameters: unsupported JSON Schema keyword"):
        constraints.tool_call_grammar([{"type": "function", "function": {"name": "f", "parameters": {"if": {}}}}], vocab)
    with pytest.raises(QwenNPError, match=r"^tool_choice: must be 'auto', 'required', 'none' or the name"):
        constraints.tool_call_grammar([WEATHER], vocab, choice="get_time")
    with pytest.raises(QwenNPError, match=r"^grammar: not a valid GBNF grammar"):
        constraints.text_grammar('root ::= ("a"', vocab)
    with pytest.raises(QwenNPError, match=r"^grammar: .*unknown"):
        constraints.text_grammar('start: "a" missing_rule', vocab)


def calls_of(text: str) -> list[tuple[str, dict]]:
    parsed = parse_reply(text)
    assert not parsed.malformed, text
    return [(call.name, json.loads(call.arguments)) for call in parsed.tool_calls]


def validate_calls(calls: list[tuple[str, dict]]) -> None:
    schemas = {tool["function"]["name"]: tool["function"].get("parameters", {"type": "object", "maxProperties": 0})
               for tool in (WEATHER, CLOCK)}
    for name, arguments in calls:
        jsonschema.validate(arguments, schemas[name])


@pytest.mark.parametrize("seed", range(3))
def test_tool_choice_required_gives_only_calls_that_validate(model, tok, eos, vocab, seed: int) -> None:
    grammar = constraints.tool_call_grammar([WEATHER, CLOCK], vocab, "required", parallel=False)
    text, finish = reply(model, tok, eos, grammar, seed)
    calls = calls_of(text)
    assert finish == "stop" and len(calls) == 1 and parse_reply(text).content == ""
    validate_calls(calls)


def test_a_named_tool_choice_calls_that_tool(model, tok, eos, vocab) -> None:
    text, _ = reply(model, tok, eos, constraints.tool_call_grammar([WEATHER, CLOCK], vocab, "get_weather"), 1)
    calls = calls_of(text)
    assert [name for name, _ in calls] == ["get_weather"]
    validate_calls(calls)


@pytest.mark.parametrize("name", ["auto", "none", "required"])
def test_a_tool_named_like_a_choice_is_called_when_named(model, tok, eos, vocab, name: str) -> None:
    """OpenAI's named choice {"type": "function", "function": {"name": ...}} picks the tool, whatever its name:
    a tool called "none" is called (not forbidden), one called "auto" is called at once."""
    from qwen_np.serving.structured import read_tools

    odd = {"type": "function", "function": {"name": name, "parameters": {"type": "object", "maxProperties": 0}}}
    tools = read_tools({"tools": [odd, WEATHER], "tool_choice": {"type": "function", "function": {"name": name}}})
    assert tools is not None and tools.callable and tools.tool == name
    text, finish = reply(model, tok, eos, constraints.tool_call_grammar(tools.declared, vocab, tools.choice, tool=tools.tool), 2)
    assert finish == "stop" and [(call.name, call.arguments) for call in parse_reply(text).tool_calls] == [(name, "{}")]


@pytest.mark.slow
def test_auto_tool_choice_is_free_text_until_the_model_opens_a_call_then_holds_it_to_the_tools(
        model, tok, eos, vocab) -> None:
    grammar = constraints.tool_call_grammar([WEATHER, CLOCK], vocab, "auto")
    free = grammar.constraint()
    assert free.allowed().sum() > 150_000                        # text: nearly every token
    # A bias that makes the random model open calls (<tool_call> near-certain wherever it is allowed).
    pushed = SamplingParams(temperature=1.0, seed=0, logit_bias={TOOL_CALL: 100})
    text, finish = reply(model, tok, eos, grammar, 0, n=160, params=pushed)
    parsed = parse_reply(text)
    assert len(parsed.tool_calls) >= 2                           # parallel calls, each whole ...
    validate_calls([(call.name, json.loads(call.arguments)) for call in parsed.tool_calls])
    assert finish == "length" and len(parsed.malformed) <= 1     # ... but the one -n cut off


def test_tool_choice_none_never_allows_a_call_but_lets_the_reply_think_and_end(tok, vocab, eos) -> None:
    state = constraints.tool_call_grammar([WEATHER], vocab, "none", thinking=True).constraint()
    allowed = state.allowed()
    assert not allowed[TOOL_CALL] and allowed[THINK] and allowed[eos[0]] and allowed.sum() > 150_000
    for token in tok.encode("<think>\nno call\n</think>\n\nText", parse_special=True):
        state.consume(token)
    assert not state.allowed()[TOOL_CALL] and state.allowed()[eos[0]]


@pytest.mark.slow
def test_batched_rows_each_follow_their_own_grammar(model, tok, eos, vocab) -> None:
    generator = BatchGenerator(model, tok, eos_token_ids=eos, max_batch=3)
    ids = prompt_ids(tok, "Describe a person as JSON.", enable_thinking=False)
    grammars = [constraints.json_schema_grammar(PERSON, vocab), None,
                constraints.tool_call_grammar([WEATHER], vocab, "required")]
    rows = [generator.submit(Request(ids, SamplingParams(temperature=1.0, seed=i), 80, grammar=grammar))
            for i, grammar in enumerate(grammars)]
    texts = {row.number: "" for row in rows}
    while not generator.idle:
        for row, event in generator.step():
            assert not isinstance(event, BaseException)
            texts[row.number] += event.text
    jsonschema.validate(json.loads(texts[0]), PERSON)
    validate_calls(calls_of(texts[2]))


@pytest.mark.slow
def test_a_grammar_for_another_vocabulary_is_refused_before_it_joins(model, tok, eos, vocab) -> None:
    other = constraints.vocabulary(tok, 151669, eos)
    generator = BatchGenerator(model, tok, eos_token_ids=eos)
    grammar = constraints.json_object_grammar(other)
    with pytest.raises(QwenNPError, match="^grammar: compiled for 151669 token ids, the model has 151936"):
        generator.submit(Request([1, 2], SamplingParams(), 4, grammar=grammar))


def test_a_drafted_token_the_grammar_forbids_is_rejected_and_the_grammar_sees_only_kept_tokens(tok, vocab) -> None:
    grammar = constraints.json_schema_grammar({"enum": ["yes", "no"]}, vocab)
    quote, yes, closing = tok.encode('"')[0], tok.encode("yes")[0], tok.encode('"')[0]
    brace = tok.encode("{")[0]
    logits = np.full((3, vocab.size), -30.0, dtype=np.float32)
    logits[0, quote] = logits[1, yes] = 10.0
    logits[1, brace] = 20.0                # the target's raw favourite at row 1 is forbidden there
    logits[2, closing] = 10.0
    for params in (SamplingParams(temperature=0.0), SamplingParams(temperature=1.0, seed=0)):
        sequence = Continuation(tok, [1, 2], params, 10, 100, grammar=grammar)
        events = sequence.verify(logits, Draft([quote, brace]))     # "{" after '"' breaks the grammar
        assert [event.token_id for event in events] == [quote, yes]  # kept, then the target's allowed choice
        assert sequence.counts.drafted_tokens == 2 and sequence.counts.accepted_tokens == 1
        assert sequence.constraint is not None and sequence.constraint.allowed()[closing]


def one_token(vocab, token: int) -> np.ndarray:
    logits = np.zeros((1, vocab.size), dtype=np.float32)
    logits[0, token] = 10.0
    return logits


def test_a_stop_id_ends_a_grammar_only_where_it_could_end_and_min_tokens_that_bans_all_it_allows_is_named(
        tok, vocab, eos) -> None:
    """Under `start: "76" | "767"`, "7" is a stop id: inside the value (first) it is the value's text, where
    the grammar could end (after "76") it ends the reply; when min_tokens also bans the grammar's end there,
    nothing is left to sample: an error naming min_tokens (it blamed the model's weights)."""
    six, seven = tok.encode("6")[0], tok.encode("7")[0]
    grammar = constraints.text_grammar('start: "76" | "767"', vocab)
    params = SamplingParams(temperature=0.0)
    sequence = Continuation(tok, [1, 2], params, 10, 100, eos_token_ids=eos, grammar=grammar,
                            ending=Ending(stop_token_ids=(seven,)))
    events = [sequence.verify(one_token(vocab, token), NO_DRAFT)[0] for token in (seven, six, seven)]
    assert [(e.text, e.finish_reason) for e in events] == [("7", None), ("6", None), ("", "stop")]
    held = Continuation(tok, [1, 2], params, 10, 100, eos_token_ids=eos, grammar=grammar,
                        ending=Ending(stop_token_ids=(seven,), min_tokens=3))
    assert [held.verify(one_token(vocab, token), NO_DRAFT)[0].text for token in (seven, six)] == ["7", "6"]
    with pytest.raises(QwenNPError) as conflict:
        held.verify(one_token(vocab, seven), NO_DRAFT)
    assert conflict.value.param == "min_tokens" and "the grammar" in str(conflict.value)


def test_ignore_eos_under_a_grammar_never_takes_the_end_as_text(tok, vocab, eos) -> None:
    grammar = constraints.json_schema_grammar({"type": "integer"}, vocab)
    sequence = Continuation(tok, [1, 2], SamplingParams(temperature=0.0), 3, 100, eos_token_ids=eos,
                            grammar=grammar, ending=Ending(ignore_eos=True))
    events = [sequence.verify(one_token(vocab, token), NO_DRAFT)[0] for token in (tok.encode("6")[0], eos[0], eos[0])]
    assert "".join(e.text for e in events).isdigit() and events[-1].finish_reason == "length"
    assert not set(eos) & {e.token_id for e in events}


@pytest.mark.slow
@pytest.mark.parametrize("drafting", ["lookup", "draft model"])
def test_speculative_decoding_under_a_grammar_gives_plain_decodings_tokens(model, tok, eos, vocab, drafting,
                                                                            tmp_path) -> None:
    grammar = constraints.json_schema_grammar(PERSON, vocab)
    if drafting == "lookup":
        speculation = lookup_speculation(2)
    else:
        draft = load_model(write_random_checkpoint(tmp_path / "draft", seed=5, vocab_size=model.config.vocab_size))
        speculation = draft_speculation(draft, tokens=3)
    ids = prompt_ids(tok, 'Like {"name": "Ann", "age": 3, "pet": "cat", "tags": []}', enable_thinking=False)
    greedy = SamplingParams(temperature=0.0)
    plain = [e.token_id for e in generate(model, tok, ids, greedy, 60, eos_token_ids=eos, grammar=grammar)]
    fast = [e.token_id for e in generate(model, tok, ids, greedy, 60, eos_token_ids=eos, grammar=grammar,
                                         speculation=speculation)]
    assert fast == plain
    sampled = generate(model, tok, ids, SamplingParams(temperature=1.0, seed=3), 100, eos_token_ids=eos,
                       grammar=grammar, speculation=speculation)
    jsonschema.validate(json.loads("".join(e.text for e in sampled)), PERSON)


@pytest.mark.slow
def test_generate_json_schema_prints_json_that_validates(tmp_path, capsys) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    for extra in (["--no-think"], ["--no-chat"], []):        # [] thinks: stdout still shows only the answer
        code = cli.main(["generate", "-m", str(QWEN3_RANDOM), "--json-schema", str(schema), "-n", "200", "-s", "2",
                         *extra, "a person"])
        out = capsys.readouterr().out
        assert code == 0 and "<think>" not in out
        if extra:                                            # a random model may think past -n
            jsonschema.validate(json.loads(out), PERSON)


@pytest.mark.slow
def test_generate_json_schema_constrains_every_prompt_of_a_batch(tmp_path, capsys) -> None:
    schema = tmp_path / "person.json"
    schema.write_text(json.dumps(PERSON))
    assert cli.main(["generate", "-m", str(QWEN3_RANDOM), "--json-schema", str(schema), "--no-think", "-n", "150",
                     "--json", "one", "two"]) == 0
    for line in capsys.readouterr().out.splitlines():
        jsonschema.validate(json.loads(json.loads(line)["text"]), PERSON)


@pytest.mark.slow
def test_generate_grammar_flags_name_the_file_and_the_problem(tmp_path, capsys) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"type": "object", "if": {}}')
    assert cli.main(["generate", "-m", str(QWEN3_RANDOM), "--json-schema", str(bad), "x"]) == 2
    assert capsys.readouterr().err.startswith(f'error: --json-schema {bad}: unsupported JSON Schema keyword "if"')
    assert cli.main(["generate", "-m", str(QWEN3_RANDOM), "--grammar", str(tmp_path / "none.lark"), "x"]) == 2
    assert capsys.readouterr().err.startswith("error: --grammar ")
    with pytest.raises(SystemExit):                            # argparse: one or the other
        cli.main(["generate", "--json-schema", str(bad), "--grammar", str(bad), "x"])


def test_without_llguidance_constraints_are_one_clear_error(tok, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)       # what a missing package looks like to import
    with pytest.raises(QwenNPError, match=r"llguidance package \(pip install 'qwen_np\[constraints\]'\)"):
        constraints.vocabulary(Tokenizer.from_folder(QWEN3_RANDOM), 151936, [151645])


# --- serve's vocabulary: built on first need, once ------------------------------------------------------

SCHEMA_BODY = {"messages": [{"role": "user", "content": "Describe a person."}], "max_tokens": 8,
               "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}}


def served(model, announce=lambda line: None):
    """A Service over the random Qwen3 as `serve` makes it: its files read afresh (so its vocabulary is new)."""
    files = open_model(QWEN3_RANDOM)
    generator = BatchGenerator(model, files.tokenizer, eos_token_ids=files.generation_defaults.eos_token_ids,
                               max_batch=2, context=256)
    return Service((str(QWEN3_RANDOM),), files.tokenizer, files.generation_defaults, BatchRunner(generator), 256, 8,
                   vocabulary=launch.grammar_vocabulary(files, announce))


@pytest.fixture
def builds(monkeypatch) -> list[int]:
    """The engine tokenizers built while a test runs (one entry each: the thread that built it). Each build
    waits a moment first, GIL released, as a loaded machine might: a second thread then has every chance to
    start a build of its own."""
    import llguidance

    built, real = [], llguidance.LLTokenizer

    def counted(*args, **kwargs):
        built.append(threading.get_ident())
        time.sleep(0.2)
        return real(*args, **kwargs)

    monkeypatch.setattr(llguidance, "LLTokenizer", counted)
    return built


def ask(service, fields: dict) -> Request:
    body = read_chat(fields, service.limits)
    return service.request(body, service.chat_prompt(body))


@pytest.mark.slow
def test_serve_builds_the_grammar_vocabulary_at_the_first_grammar_request_never_before(model, builds) -> None:
    service = served(model)
    assert ask(service, {**SCHEMA_BODY, "response_format": None}).grammar is None
    completion = read_completion({"prompt": "Hello", "max_tokens": 4}, service.limits)
    service.request(completion, service.completion_prompt(completion))
    assert builds == []                                   # started and served, no grammar asked for: none built
    first, second = ask(service, SCHEMA_BODY), ask(service, {**SCHEMA_BODY, "tools": [WEATHER], "response_format": None})
    assert len(builds) == 1 and first.grammar is not None and second.grammar is not None
    assert first.grammar.vocabulary is second.grammar.vocabulary is service.vocabulary


@pytest.mark.slow
def test_two_grammar_requests_at_once_build_the_vocabulary_once(model, builds) -> None:
    service = served(model)
    start = threading.Barrier(2)
    with ThreadPoolExecutor(2) as pool:
        requests = list(pool.map(lambda body: (start.wait(), ask(service, body))[1], [SCHEMA_BODY, SCHEMA_BODY]))
    assert len(builds) == 1 and all(request.grammar is not None for request in requests)


def test_without_llguidance_serve_says_so_at_start_and_refuses_grammar_requests_by_field(model, monkeypatch) -> None:
    monkeypatch.setitem(sys.modules, "llguidance", None)
    lines: list[str] = []
    service = served(model, lines.append)
    assert service.vocabulary is None and lines == [
        "tools and response_format are refused: constrained decoding needs llguidance (pip install 'qwen_np[constraints]')"]
    assert ask(service, {**SCHEMA_BODY, "response_format": None}).grammar is None
    with pytest.raises(APIError, match="response_format: needs constrained decoding") as refused:
        ask(service, SCHEMA_BODY)
    assert refused.value.status == 400 and refused.value.param == "response_format"


def test_tools_beside_a_response_format_give_that_value_or_calls_never_free_text(tok, vocab) -> None:
    """The openai-agents SDK sends an agent's output type (response_format) with its tools: the reply answers in
    the schema or calls a tool; with tool_choice "required" it calls."""
    answer = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    grammar = constraints.tool_call_grammar([WEATHER], vocab, "auto", answer=answer)
    assert accepts(grammar, tok, '{"city": "Paris"}') and not accepts(grammar, tok, "Paris is sunny.")
    assert not accepts(grammar, tok, '{"city": "Paris", "unit": "C"}')                  # closed, as any schema
    assert accepts(grammar, tok, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}'
                                 '\n</tool_call>')
    required = constraints.tool_call_grammar([WEATHER], vocab, "required", answer=answer)
    assert not accepts(required, tok, '{"city": "Paris"}')
