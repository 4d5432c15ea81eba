"""The libraries people drive a local model with, each through its own documented call, against `serve` on the
random-weight Qwen3 (the real tokenizer and template): instructor (TOOLS and JSON_SCHEMA modes),
langchain-openai (`bind_tools`, `with_structured_output`), pydantic-ai (an `output_type`) and the openai-agents
SDK (its default model, the Responses API, with a tool and an `output_type`). Random weights write nonsense, so what is checked
is what the constraints make true: the library gets an object of its schema, or the call it forced.

Before schemas' objects were closed (generation/constraints.closed), instructor's TOOLS mode and langchain's
bind_tools ran to `length`: pydantic's schemas leave additionalProperties out, and the grammar let the
model open a new key forever; instructor's JSON_SCHEMA mode sent json_object with a schema, which was ignored.
"""

from __future__ import annotations

import pytest

from tests.conftest import HANG_SECONDS
from tests.serving.test_serve import MODEL, serving
from tests.serving.test_serve_tools import NO_THINKING as NO_THINKING_BODY

openai = pytest.importorskip("openai")
pydantic = pytest.importorskip("pydantic")
pytest.importorskip("llguidance")

pytestmark = pytest.mark.slow

PROMPT = "Extract the person: Ann is 30 years old."


class Person(pydantic.BaseModel):
    """A person (bounded strings: a random model's text ends where the schema ends it)."""

    name: str = pydantic.Field(max_length=12)
    age: int


def add(a: int, b: int) -> int:
    """Add two integers."""
    return a + b


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    """A server of MODEL, as test_serve.py's."""
    with serving(env, MODEL) as running:
        yield running.url


@pytest.fixture(scope="module")
def openai_client(server: str):
    return openai.OpenAI(base_url=server, api_key="none", max_retries=0, timeout=HANG_SECONDS)


@pytest.mark.parametrize("mode", ["TOOLS", "JSON_SCHEMA"])
def test_instructor_gets_an_object_of_its_response_model(openai_client, mode: str) -> None:
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(openai_client, mode=getattr(instructor.Mode, mode))
    person = client.chat.completions.create(model=MODEL, response_model=Person, max_retries=0, max_tokens=200,
                                            messages=[{"role": "user", "content": PROMPT}], extra_body=NO_THINKING_BODY)
    assert isinstance(person, Person) and len(person.name) <= 12 and abs(person.age) < 10 ** 16


def test_langchain_bind_tools_with_a_forced_tool_gives_its_call(server: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=server, api_key="none", max_retries=0, max_tokens=200,
                                       timeout=HANG_SECONDS, extra_body=NO_THINKING_BODY)
    message = chat.bind_tools([add], tool_choice="add").invoke("What is 2 + 3?")
    assert [call["name"] for call in message.tool_calls] == ["add"]
    assert set(message.tool_calls[0]["args"]) == {"a", "b"} and all(isinstance(v, int)
                                                                    for v in message.tool_calls[0]["args"].values())


@pytest.mark.parametrize("method", ["json_schema", "function_calling"])
def test_langchain_with_structured_output_gives_an_object_of_its_schema(server: str, method: str) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    chat = langchain_openai.ChatOpenAI(model=MODEL, base_url=server, api_key="none", max_retries=0, max_tokens=200,
                                       timeout=HANG_SECONDS, extra_body=NO_THINKING_BODY)
    person = chat.with_structured_output(Person, method=method).invoke(PROMPT)
    assert isinstance(person, Person) and len(person.name) <= 12


def test_pydantic_ai_agent_gets_its_output_type(server: str) -> None:
    """pydantic-ai's structured output: a forced `final_result` tool whose arguments are the output type."""
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=server, api_key="none"))
    agent = Agent(model, output_type=Person, model_settings={"max_tokens": 200, "extra_body": NO_THINKING_BODY},
                  retries=0)
    person = agent.run_sync(PROMPT).output
    assert isinstance(person, Person) and len(person.name) <= 12


def test_openai_agents_sdk_runs_its_default_model_the_responses_api_with_a_tool_and_an_output_type(server: str
                                                                                                ) -> None:
    """The openai-agents SDK's default model speaks the Responses API (/v1/responses): a forced tool call runs
    the tool (the run stops at its result), and an agent with an output type ends with an object of it. (A
    random model left to choose between calling again and answering may call until max_turns: the two are
    run apart, each one a thing the constraints make true; the forced call is one call, parallel_tool_calls
    false: a sampled reply may otherwise hold two, and both run.)"""
    agents = pytest.importorskip("agents")
    calls: list[tuple[int, int]] = []

    @agents.function_tool
    def add_numbers(a: int, b: int) -> int:
        """Add two integers."""
        calls.append((a, b))
        return a + b

    agents.set_tracing_disabled(True)                 # no trace export: there is no network here
    model = agents.OpenAIResponsesModel(model=MODEL, openai_client=openai.AsyncOpenAI(base_url=server, api_key="none",
                                                                                       max_retries=0))
    settings = agents.ModelSettings(max_tokens=200, reasoning={"effort": "none"})
    adder = agents.Agent(name="adder", instructions="Add the numbers.", model=model, tools=[add_numbers],
                         model_settings=settings.resolve(agents.ModelSettings(tool_choice="required",
                                                                              parallel_tool_calls=False)),
                         tool_use_behavior="stop_on_first_tool")
    added = agents.Runner.run_sync(adder, "What is 2 + 3?", max_turns=2)
    assert len(calls) == 1 and added.final_output == str(sum(calls[0]))        # the tool's result, as text
    extractor = agents.Agent(name="extractor", instructions="Extract the person.", model=model, output_type=Person,
                             model_settings=settings)
    assert isinstance(agents.Runner.run_sync(extractor, PROMPT, max_turns=2).final_output, Person)
