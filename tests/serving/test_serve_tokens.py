"""POST /tokenize and /detokenize on `serve` of the random-weight Qwen3, as vLLM and llama-server shape them:
the ids the tokenizer and the chat template give, their text back, bad bodies a 400 naming the field."""

from __future__ import annotations

import pytest

from qwen_np.files.tokenizer import Tokenizer
from tests.conftest import QWEN3_RANDOM
from tests.serving.test_serve import MODEL, assert_openai_error, post, serving

pytestmark = pytest.mark.slow

TEXT = "Hello <|im_end|> 世界"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|>"}]


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    with serving(env, MODEL) as running:
        yield running.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(QWEN3_RANDOM)


def test_a_text_tokenizes_as_a_completions_prompt_under_vllms_and_llama_servers_names(server, tok) -> None:
    ids = tok.encode(TEXT, parse_special=True)
    for field in ("prompt", "content"):
        code, answer = post(server + "/tokenize", {"model": MODEL, field: TEXT})
        assert code == 200 and answer["tokens"] == ids and answer["count"] == len(ids)
        assert answer["max_model_len"] > 0
    code, answer = post(server + "/tokenize", {"content": TEXT, "with_pieces": True})
    assert [piece["id"] for piece in answer["tokens"]] == ids
    assert "".join(piece["piece"] for piece in answer["tokens"]) == TEXT


def test_messages_tokenize_as_the_chat_template_renders_them(server, tok) -> None:
    for generation_prompt in (True, False):
        code, answer = post(server + "/tokenize", {"messages": MESSAGES, "add_generation_prompt": generation_prompt})
        assert code == 200 and answer["tokens"] == tok.encode_chat(MESSAGES, add_generation_prompt=generation_prompt)


def test_detokenize_gives_the_ids_text_back_under_both_names(server, tok) -> None:
    code, answer = post(server + "/detokenize", {"tokens": tok.encode(TEXT, parse_special=True)})
    assert code == 200 and answer == {"prompt": TEXT, "content": TEXT}


@pytest.mark.parametrize("path, body, field", [
    ("/tokenize", {"prompt": TEXT, "messages": MESSAGES}, "messages"),
    ("/tokenize", {}, "prompt"),
    ("/tokenize", {"prompt": 5}, "prompt"),
    ("/tokenize", {"prompt": TEXT, "add_special": True}, "add_special"),
    ("/tokenize", {"messages": [{"role": "nobody"}]}, "messages"),
    ("/detokenize", {"tokens": [10 ** 9]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
])
def test_a_bad_body_is_a_400_naming_its_field(server, path: str, body: dict, field: str) -> None:
    assert_openai_error(*post(server + path, body), 400, field)
