"""What a hostile probe of `serve` got through in round three, each reproduced and now answered right, on
servers of the random-weight Qwen3 fixture (subprocesses on loopback, driven by the official `openai` client
where a client would be):

- every id field holds the same rule, the tokenizer's ids: logit_bias refuses the padded embedding rows past
  the tokenizer (Qwen3's 151,669-151,935 decode to nothing) as stop_token_ids, a prompt's ids and an
  embedding's ids do.
"""

from __future__ import annotations

import os

import pytest

from qwen_np.files.tokenizer import Tokenizer
from test_serve import MODEL, ROOT, assert_openai_error, post, serving

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow      # servers in subprocesses


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    return {**os.environ, "HF_HUB_OFFLINE": "1", "HF_HOME": str(tmp_path_factory.mktemp("hf_home")),
            "PYTHONPATH": str(ROOT)}


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    with serving(env, MODEL) as running:
        yield running.url


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_folder(ROOT / MODEL)


# --- one rule for every id field: the tokenizer's ids ----------------------------------------------------

def id_fields(token: int) -> dict[str, tuple[str, dict]]:
    """Each field that takes a token id, as a request holding `token` there: (endpoint, body)."""
    prompt = {"model": MODEL, "prompt": "Hi", "max_tokens": 1}
    return {"logit_bias": ("/completions", {**prompt, "logit_bias": {str(token): 100}}),
            "stop_token_ids": ("/completions", {**prompt, "stop_token_ids": [token]}),
            "prompt": ("/completions", {**prompt, "prompt": [1, token]}),
            "input": ("/embeddings", {"model": MODEL, "input": [1, token]})}


@pytest.mark.parametrize("param", ["logit_bias", "stop_token_ids", "prompt", "input"])
def test_every_id_field_refuses_the_padded_rows_past_the_tokenizer_and_takes_its_last_id(server, tok, param) -> None:
    padded = 151_936                                             # the model's embedding rows: 267 past the tokenizer
    assert tok.vocab_size == 151_669 < padded
    for token in (tok.vocab_size, padded - 1):
        path, body = id_fields(token)[param]
        code, answer = post(server + path, body)
        assert_openai_error(code, answer, 400, param)
        assert str(tok.vocab_size) in answer["error"]["message"], answer
    path, body = id_fields(tok.vocab_size - 1)[param]
    code, answer = post(server + path, body)
    assert code == 200, answer

