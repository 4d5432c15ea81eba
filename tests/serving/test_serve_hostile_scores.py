"""What a hostile probe of `serve` got through in round three, each reproduced and now answered right, on
servers of the random-weight Qwen3 fixture (subprocesses on loopback, driven by the official `openai` client
where a client would be):

- every id field holds the same rule, the tokenizer's ids: logit_bias refuses the padded embedding rows past
  the tokenizer (Qwen3's 151,669-151,935 decode to nothing) as stop_token_ids, a prompt's ids and an
  embedding's ids do;
- a LoRA adapter's prompt is read by the adapter on every path that reads one (`serve --lora NAME=DIR`, a
  request naming NAME): an echo's scores, with `max_tokens: 0` (what lm-evaluation-harness sends) or
  before generated text, are peft's own log-probabilities and the merged model's, never the base's; so
  are its embeddings and the explorer's views (but the mask, which says it runs the base only); and every
  response names the adapter asked for;
- a model whose numbers are not finite for some tokens (an untied checkpoint with a NaN in one embedding row,
  what a NaN block scale gives) never answers 200 with NaN nor a 500: embeddings (float and base64), an
  echo's scores, generation from such a prompt and generation that reaches such a token are a 422 naming
  the field and the token, and the other requests of the batch get what they get alone.
"""

from __future__ import annotations

import base64
import json
import shutil
import urllib.request
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from qwen_np.files.tokenizer import Tokenizer
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from tests.serving.test_serve import MODEL, ROOT, assert_openai_error, post, serving

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow      # servers in subprocesses


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



# --- a LoRA adapter's prompt is read by the adapter --------------------------------------------------

STORY = "Tell me a story about a dragon who learned to count, and the village that taught it"
TUNED = "tuned"                                      # the adapter's name on the server


@pytest.fixture(scope="module")
def peft_tuned(tmp_path_factory: pytest.TempPathFactory, tok) -> dict:
    """A LoRA adapter made by peft on transformers' Qwen3 of the fixture (random non-zero A and B, every
    projection), its merge_and_unload() saved as a checkpoint of its own, and peft's float64 log-probability
    of each token of STORY given those before it."""
    from tests.reference import hf_reference  # noqa: F401  (sets USE_HUB_KERNELS before transformers loads)

    torch = pytest.importorskip("torch")
    peft = pytest.importorskip("peft")
    transformers = pytest.importorskip("transformers")
    out = tmp_path_factory.mktemp("peft_tuned")
    base = transformers.Qwen3ForCausalLM.from_pretrained(QWEN3_RANDOM, dtype=torch.float32,
                                                         attn_implementation="eager").eval()
    tuned = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                      target_modules="all-linear")).eval()
    generator = torch.Generator().manual_seed(3)
    ids = tok.encode(STORY)
    with torch.no_grad():
        for name, p in tuned.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=generator) * 0.3)
        tuned.save_pretrained(out / "adapter")
        logprobs = torch.log_softmax(tuned(input_ids=torch.tensor([ids])).logits[0].double(), dim=-1).numpy()
    tuned.merge_and_unload().save_pretrained(out / "merged")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(QWEN3_RANDOM / file, out / "merged" / file)
    return {"adapter": out / "adapter", "merged": out / "merged",
            "scores": np.array([logprobs[t - 1, ids[t]] for t in range(1, len(ids))])}


@pytest.fixture(scope="module")
def lora_servers(env, peft_tuned):
    """(a server of the base with the adapter as TUNED, a server of the merged checkpoint): their URLs."""
    with serving(env, MODEL, "--lora", f"{TUNED}={peft_tuned['adapter']}") as tuned, \
            serving(env, str(peft_tuned["merged"])) as merged:
        yield tuned.url, merged.url


def client_of(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=HANG_SECONDS)


def scores(url: str, model: str, **fields) -> list[float]:
    """An echo's log-probabilities of STORY's tokens after the first (`fields`: more of the request)."""
    answer = client_of(url).completions.create(model=model, prompt=STORY, echo=True, logprobs=1,
                                               **{"max_tokens": 0, **fields})
    return answer.choices[0].logprobs.token_logprobs[1:]


def test_an_adapters_echo_scores_the_prompt_with_the_adapter_as_peft_does_and_names_the_adapter(
        lora_servers, peft_tuned) -> None:
    url, merged = lora_servers
    client = client_of(url)
    answer = client.completions.create(model=TUNED, prompt=STORY, max_tokens=0, echo=True, logprobs=1)
    assert answer.model == TUNED and answer.choices[0].text == STORY
    tuned = answer.choices[0].logprobs.token_logprobs[1:]
    np.testing.assert_allclose(tuned, peft_tuned["scores"], atol=1e-4)
    np.testing.assert_allclose(tuned, scores(merged, str(peft_tuned["merged"])), atol=1e-4)
    base = scores(url, MODEL)
    assert np.max(np.abs(np.subtract(base, tuned))) > 0.1, "the adapter must change the scores to mean anything"
    chunks = list(client.completions.create(model=TUNED, prompt=STORY, max_tokens=0, echo=True, logprobs=1,
                                            stream=True))
    assert {chunk.model for chunk in chunks} == {TUNED}
    assert chunks[0].choices[0].logprobs.token_logprobs[1:] == tuned


def test_an_adapters_echo_before_generated_text_is_the_adapters_and_so_is_the_text(lora_servers, peft_tuned) -> None:
    url, merged = lora_servers
    fields = {"max_tokens": 4, "temperature": 0, "logprobs": 0}
    mine = client_of(url).completions.create(model=TUNED, prompt=STORY, echo=True, **fields)
    theirs = client_of(merged).completions.create(model=str(peft_tuned["merged"]), prompt=STORY, echo=True, **fields)
    assert mine.model == TUNED and mine.choices[0].text == theirs.choices[0].text
    np.testing.assert_allclose(mine.choices[0].logprobs.token_logprobs[1:],
                               theirs.choices[0].logprobs.token_logprobs[1:], atol=1e-4)
    np.testing.assert_allclose(mine.choices[0].logprobs.token_logprobs[1:len(peft_tuned["scores"]) + 1],
                               peft_tuned["scores"], atol=1e-4)


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_an_adapters_embeddings_are_its_merged_models_and_name_the_adapter(lora_servers, peft_tuned, encoding) -> None:
    url, merged = lora_servers
    texts = [STORY, "Hello"]

    def vectors(server: str, model: str) -> tuple[np.ndarray, str]:
        code, answer = post(server + "/embeddings", {"model": model, "input": texts, "encoding_format": encoding})
        assert code == 200, answer
        rows = [np.frombuffer(base64.b64decode(item["embedding"]), "<f4") if encoding == "base64"
                else np.array(item["embedding"]) for item in answer["data"]]
        return np.array(rows, dtype=np.float64), answer["model"]

    tuned, name = vectors(url, TUNED)
    reference, _ = vectors(merged, str(peft_tuned["merged"]))
    base, _ = vectors(url, MODEL)
    assert name == TUNED
    assert np.min(np.sum(tuned * reference, axis=1)) >= 0.99999          # unit vectors: cosines
    assert np.max(np.sum(tuned * base, axis=1)) < 0.999


def test_the_explorers_views_of_an_adapter_are_its_merged_models_and_its_mask_refuses_it(lora_servers,
                                                                                        peft_tuned) -> None:
    url, merged = lora_servers

    def top(server: str, model: str) -> list[tuple[int, float]]:
        code, answer = post(server.removesuffix("/v1") + "/explorer/analyze", {"model": model, "prompt": STORY})
        assert code == 200, answer
        return [(item["id"], item["p"]) for item in answer["model_top"]]

    tuned, reference, base = top(url, TUNED), top(merged, str(peft_tuned["merged"])), top(url, MODEL)
    assert [i for i, _ in tuned] == [i for i, _ in reference] != [i for i, _ in base]
    np.testing.assert_allclose([p for _, p in tuned], [p for _, p in reference], atol=1e-5)
    code, answer = post(url.removesuffix("/v1") + "/explorer/mask",
                        {"model": TUNED, "prompt": STORY, "json_schema": {"type": "integer"}})
    assert_openai_error(code, answer, 400, "model")
    assert "base model only" in answer["error"]["message"]


# --- a model whose numbers are not finite for one token ------------------------------------------------

POISON = " poison"                 # one token, whose embedding row holds a NaN in the checkpoint below
POISONED = "The poison apple fell"


@pytest.fixture(scope="module")
def nan_server(env, tmp_path_factory, tok):
    """A server of the fixture untied (its LM head a copy of the embeddings), embed_tokens' row of POISON
    holding one NaN: every other token's numbers are the fixture's, and the start-up check (token 0) passes."""
    torch = pytest.importorskip("torch")
    from safetensors.torch import load_file, save_file

    folder = tmp_path_factory.mktemp("nan_row")
    for file in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(QWEN3_RANDOM / file, folder / file)
    config = json.loads((QWEN3_RANDOM / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": False}))
    tensors = load_file(QWEN3_RANDOM / "model.safetensors")
    embed = tensors["model.embed_tokens.weight"]
    tensors["lm_head.weight"] = embed.clone()
    [token] = tok.encode(POISON)
    embed[token, 5] = torch.nan
    save_file(tensors, folder / "model.safetensors")
    with serving(env, str(folder)) as running:
        yield running.url, str(folder), token


def assert_not_finite(code: int, answer: dict, param: str | None) -> None:
    assert_openai_error(code, answer, 422, param)
    message = answer["error"]["message"]
    assert "not finite" in message and repr(POISON) in message and answer["error"]["code"] == "non_finite_numbers", message


@pytest.mark.parametrize("encoding", ["float", "base64"])
def test_embeddings_of_a_token_whose_numbers_are_not_finite_are_a_422_naming_the_input(nan_server, encoding) -> None:
    url, model, _ = nan_server
    code, answer = post(url + "/embeddings", {"model": model, "input": ["Hello", POISONED], "encoding_format": encoding})
    assert_not_finite(code, answer, "input")
    assert answer["error"]["message"].startswith("input[1]: "), answer
    code, answer = post(url + "/embeddings", {"model": model, "input": ["Hello"], "encoding_format": encoding})
    assert code == 200, answer


@pytest.mark.parametrize("fields", [{"max_tokens": 0, "echo": True, "logprobs": 1},
                                    {"max_tokens": 3, "echo": True, "logprobs": 0},
                                    {"max_tokens": 3}, {"max_tokens": 3, "logprobs": 2}],
                         ids=["scores-only", "echo-and-generate", "generate", "generate-with-logprobs"])
def test_a_prompt_whose_numbers_are_not_finite_is_a_422_naming_the_prompt(nan_server, fields) -> None:
    url, model, _ = nan_server
    assert_not_finite(*post(url + "/completions", {"model": model, "prompt": POISONED, **fields}), "prompt")


def test_a_chat_whose_numbers_are_not_finite_is_a_422_naming_the_messages_whole_and_streamed(nan_server) -> None:
    url, model, _ = nan_server
    body = {"model": model, "messages": [{"role": "user", "content": POISONED}], "max_tokens": 3}
    assert_not_finite(*post(url + "/chat/completions", body), "messages")
    events = streamed(url + "/chat/completions", {**body, "stream": True})
    assert "error" in events[-1], events
    assert_not_finite(422, events[-1], "messages")


def streamed(url: str, body: dict) -> list[dict]:
    """The JSON events of a stream (before [DONE])."""
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=HANG_SECONDS) as response:
        assert response.status == 200
        lines = response.read().decode().splitlines()
    return [json.loads(line[6:]) for line in lines if line.startswith("data: {")]


def test_a_reply_that_reaches_a_token_whose_numbers_are_not_finite_ends_with_a_422_naming_it(nan_server, tok) -> None:
    url, model, token = nan_server
    body = {"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0, "logit_bias": {str(token): 100}}
    code, answer = post(url + "/completions", body)
    assert_not_finite(code, answer, None)
    assert "generated" in answer["error"]["message"]
    events = streamed(url + "/completions", {**body, "stream": True})
    assert events[0]["choices"][0]["text"] == POISON and "error" in events[-1], events
    assert_not_finite(422, events[-1], None)


def test_the_explorer_of_a_prompt_whose_numbers_are_not_finite_is_a_422(nan_server) -> None:
    url, model, _ = nan_server
    assert_not_finite(*post(url.removesuffix("/v1") + "/explorer/analyze", {"model": model, "prompt": POISONED}),
                      "prompt")


def test_requests_beside_ones_whose_numbers_are_not_finite_get_what_they_get_alone(nan_server) -> None:
    url, model, token = nan_server
    clean = [{"model": model, "prompt": text, "max_tokens": 12, "temperature": 0, "logprobs": 1}
             for text in ("Once upon a time", "The quick brown fox", "1 2 3 4")]
    alone = [post(url + "/completions", body) for body in clean]
    assert all(code == 200 for code, _ in alone)
    poisoned = [("/completions", {"model": model, "prompt": POISONED, "max_tokens": 8}),
                ("/completions", {"model": model, "prompt": POISONED, "max_tokens": 0, "echo": True, "logprobs": 1}),
                ("/completions", {"model": model, "prompt": "Hello", "max_tokens": 8, "logit_bias": {str(token): 100}}),
                ("/embeddings", {"model": model, "input": [POISONED, "Hello"]})]
    with ThreadPoolExecutor(len(clean) + len(poisoned)) as pool:
        bad = [pool.submit(post, url + path, body) for path, body in poisoned]
        together = [pool.submit(post, url + "/completions", body) for body in clean]
        assert [future.result()[0] for future in bad] == [422] * len(poisoned)
        answers = [future.result() for future in together]
    for (code, answer), (_, solo) in zip(answers, alone):
        assert code == 200 and answer["choices"][0]["text"] == solo["choices"][0]["text"]
        np.testing.assert_allclose(answer["choices"][0]["logprobs"]["token_logprobs"],
                                   solo["choices"][0]["logprobs"]["token_logprobs"], atol=1e-4)
