"""Chat template tests: Qwen3's template renders as transformers renders it (five example
chats A-E), and the multi-turn helpers reuse as much of the fed prompt as the template allows."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import ChatDelta, Tokenizer, chat_delta, split_thinking
from tests.conftest import QWEN3_RANDOM


EMPTY_THINK = "<think>\n\n</think>\n\n"
EMPTY_THINK_IDS = [151667, 271, 151668, 271]

EXAMPLE_A = [{"role": "user", "content": "Hello!"}]
EXAMPLE_A_TEXT = "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n"
EXAMPLE_A_IDS = [151644, 872, 198, 9707, 0, 151645, 198, 151644, 77091, 198]
EXAMPLE_C = [{"role": "system", "content": "You are a helpful assistant."}, {"role": "user", "content": "Hi"}]
EXAMPLE_C_IDS = [
    151644, 8948, 198, 2610, 525, 264, 10950, 17847, 13, 151645, 198,
    151644, 872, 198, 13048, 151645, 198, 151644, 77091, 198,
]  # fmt: skip
EXAMPLE_D = [
    {"role": "user", "content": "Q1"},
    {"role": "assistant", "content": "<think>\nR1\n</think>\n\nA1"},
    {"role": "user", "content": "Q2"},
]
EXAMPLE_D_TEXT = (
    "<|im_start|>user\nQ1<|im_end|>\n<|im_start|>assistant\nA1<|im_end|>\n"
    "<|im_start|>user\nQ2<|im_end|>\n<|im_start|>assistant\n"
)
EXAMPLE_E = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
EXAMPLE_E_TEXT = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\nHello<|im_end|>\n"

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather <now> for a city, e.g. 北京",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TOOL_CHAT = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in 北京?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "Need the tool.",
        "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "北京"}}}],
    },
    {"role": "tool", "content": '{"temp": 21}'},
    {"role": "tool", "content": '{"rain": false}'},
]


def render_ids(tok: Tokenizer, messages: list[dict], **kwargs) -> list[int]:
    return tok.encode(tok.apply_chat_template(messages, **kwargs))


def test_example_a(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(EXAMPLE_A) == EXAMPLE_A_TEXT
    assert render_ids(tok, EXAMPLE_A) == EXAMPLE_A_IDS


def test_example_b_enable_thinking_false_appends_empty_think(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(EXAMPLE_A, enable_thinking=False) == EXAMPLE_A_TEXT + EMPTY_THINK
    assert render_ids(tok, EXAMPLE_A, enable_thinking=False) == EXAMPLE_A_IDS + EMPTY_THINK_IDS


def test_enable_thinking_true_is_the_default_prompt(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(EXAMPLE_A, enable_thinking=True) == EXAMPLE_A_TEXT


def test_example_c_system_prompt(tok: Tokenizer) -> None:
    assert render_ids(tok, EXAMPLE_C) == EXAMPLE_C_IDS


def test_example_d_history_reasoning_is_stripped(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(EXAMPLE_D) == EXAMPLE_D_TEXT


def test_example_d_with_reasoning_content_field(tok: Tokenizer) -> None:
    messages = [EXAMPLE_D[0], {"role": "assistant", "content": "A1", "reasoning_content": "R1"}, EXAMPLE_D[2]]
    assert tok.apply_chat_template(messages) == EXAMPLE_D_TEXT


def test_example_e_no_generation_prompt(tok: Tokenizer) -> None:
    assert tok.apply_chat_template(EXAMPLE_E, add_generation_prompt=False) == EXAMPLE_E_TEXT


def test_last_turn_keeps_its_reasoning(tok: Tokenizer) -> None:
    messages = [EXAMPLE_D[0], {"role": "assistant", "reasoning": "R1", "content": "A1"}]
    rendered = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert rendered.endswith("<|im_start|>assistant\n<think>\nR1\n</think>\n\nA1<|im_end|>\n")


def test_tools_render_raw_json(tok: Tokenizer) -> None:
    rendered = tok.apply_chat_template(TOOL_CHAT, tools=[WEATHER_TOOL])
    # transformers' tojson neither escapes HTML nor non-ASCII text.
    assert '"description": "Weather <now> for a city, e.g. 北京"' in rendered
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "北京"}}\n</tool_call>' in rendered
    assert "<tool_response>\n{\"temp\": 21}\n</tool_response>\n<tool_response>\n{\"rain\": false}" in rendered


def test_none_valued_keys_are_dropped(tok: Tokenizer) -> None:
    messages = [EXAMPLE_A[0], {"role": "assistant", "content": "A1", "tool_calls": None, "reasoning_content": None}]
    with_none = tok.apply_chat_template(messages, add_generation_prompt=False)
    plain = [EXAMPLE_A[0], {"role": "assistant", "content": "A1"}]
    without = tok.apply_chat_template(plain, add_generation_prompt=False)
    assert with_none == without


def test_empty_chat_raises(tok: Tokenizer) -> None:
    with pytest.raises(QwenNPError, match="empty"):
        tok.apply_chat_template([])


def folder_with_template(folder: Path, template: str) -> Path:
    """A checkpoint folder whose chat_template.jinja overrides the one in tokenizer_config.json."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (folder / name).symlink_to(QWEN3_RANDOM / name)
    (folder / "chat_template.jinja").write_text(template, encoding="utf-8")
    return folder


def test_template_file_overrides_config(tmp_path: Path) -> None:
    template = "{{ messages[0].content }}|{{ eos_token }}|{{ pad_token }}|{{ bos_token is defined }}"
    tok = Tokenizer.from_folder(folder_with_template(tmp_path, template))
    assert tok.apply_chat_template(EXAMPLE_A) == "Hello!|<|im_end|>|<|endoftext|>|False"


def test_raise_exception_in_template_raises_qwen_np_error(tmp_path: Path) -> None:
    tok = Tokenizer.from_folder(folder_with_template(tmp_path, "{{ raise_exception('bad role') }}"))
    with pytest.raises(QwenNPError, match="bad role"):
        tok.apply_chat_template(EXAMPLE_A)


def test_broken_template_names_its_file(tmp_path: Path) -> None:
    with pytest.raises(QwenNPError, match="chat_template.jinja"):
        Tokenizer.from_folder(folder_with_template(tmp_path, "{% if %}"))


# SHA-256 of the chat template in Qwen3's official tokenizer_config.json (the Qwen/Qwen3-8B hub files).
OFFICIAL_TEMPLATE_SHA256 = "87a2728cb8dc9fe424d624542f6060ec05a1d285ebbec578bb078900e33396b5"


def test_fixture_template_is_qwen3s_official_template_byte_for_byte() -> None:
    config = json.loads((QWEN3_RANDOM / "tokenizer_config.json").read_text(encoding="utf-8"))
    assert hashlib.sha256(config["chat_template"].encode("utf-8")).hexdigest() == OFFICIAL_TEMPLATE_SHA256


PARITY_CASES = [
    (EXAMPLE_A, {}),
    (EXAMPLE_A, {"enable_thinking": False}),
    (EXAMPLE_C, {"enable_thinking": True}),
    (EXAMPLE_D, {}),
    (EXAMPLE_E, {"add_generation_prompt": False}),
    (TOOL_CHAT, {"tools": [WEATHER_TOOL]}),
    (TOOL_CHAT, {}),
]


@pytest.fixture(scope="module")
def hf_tok():
    """transformers' own tokenizer on the same folder, when transformers is installed."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(QWEN3_RANDOM))


@pytest.mark.slow
@pytest.mark.parametrize(("messages", "kwargs"), PARITY_CASES)
def test_matches_transformers(tok: Tokenizer, hf_tok, messages: list[dict], kwargs: dict) -> None:
    kwargs = {"add_generation_prompt": True, **kwargs}
    expected = hf_tok.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == expected


def generated_reply(tok: Tokenizer, reply: str) -> list[int]:
    """Ids a model would have produced for ``reply``, ending with its eos token."""
    return tok.encode(reply) + [tok.eos_token_id]


def test_chat_delta_first_turn_feeds_everything(tok: Tokenizer) -> None:
    assert chat_delta(tok, [], EXAMPLE_A) == ChatDelta(keep=0, ids=EXAMPLE_A_IDS)


def test_chat_delta_truncates_to_before_stripped_reasoning(tok: Tokenizer) -> None:
    fed = render_ids(tok, EXAMPLE_D[:1]) + generated_reply(tok, EXAMPLE_D[1]["content"])
    delta = chat_delta(tok, fed, EXAMPLE_D)
    full = render_ids(tok, EXAMPLE_D)
    # The old turn's "<think>" no longer appears: the cache is kept up to "<|im_start|>assistant\n".
    assert delta.keep == len(render_ids(tok, EXAMPLE_D[:1]))
    assert fed[: delta.keep] + delta.ids == full


def test_chat_delta_reuses_an_intact_prefix(tok: Tokenizer) -> None:
    fed = render_ids(tok, EXAMPLE_D) + generated_reply(tok, "A2")
    messages = [*EXAMPLE_D, {"role": "assistant", "content": "A2"}, {"role": "user", "content": "Q3"}]
    delta = chat_delta(tok, fed, messages)
    assert delta.keep == len(fed)
    assert tok.decode(delta.ids) == "\n<|im_start|>user\nQ3<|im_end|>\n<|im_start|>assistant\n"


def test_chat_delta_always_returns_a_token(tok: Tokenizer) -> None:
    delta = chat_delta(tok, EXAMPLE_A_IDS, EXAMPLE_A)
    assert delta == ChatDelta(keep=len(EXAMPLE_A_IDS) - 1, ids=EXAMPLE_A_IDS[-1:])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("<think>\nR1\n</think>\n\nA1", ("R1", "A1")),
        ("<think>\n\n</think>\n\nA1", ("", "A1")),
        ("just an answer", ("", "just an answer")),
        ("<think>\nstill thinking", ("still thinking", "")),
        ("R1</think>A1", ("R1", "A1")),
    ],
)
def test_split_thinking(text: str, expected: tuple[str, str]) -> None:
    assert split_thinking(text) == expected
