"""POST /v1/embeddings (qwen_np/serving/embeddings.py) through the official `openai` client: on a headless
Qwen3-Embedding-style checkpoint (a bare Qwen3Model, no lm_head, its tokenizer appending <|endoftext|>) and on
the random-weight Qwen3 fixture (with its head), each vector is transformers' last-token pooling of the ids
the tokenizer gives, L2-normalised, within cosine 0.99999, as floats and as base64; the headless server
refuses chat and completions with a 400 saying it has no LM head; bad inputs are 400s naming the field; an
embedding request runs between the batch's steps without changing a running stream; and the batching
thread runs such work one forward pass after each generation step."""

from __future__ import annotations

import base64
import threading

import numpy as np
import pytest

from qwen_np import load_model
from qwen_np.generation.batching import BatchGenerator, BatchRunner, Request
from qwen_np.generation.embedding import Embedding
from qwen_np.core.sampling import SamplingParams
from tests.conftest import HANG_SECONDS, QWEN3_RANDOM
from tests.generation.test_embedding import TEXTS, bare_qwen3, last_token_pooling, with_embedding_tokenizer
from tests.serving.test_serve import MODEL, assert_openai_error, post, serving

openai = pytest.importorskip("openai")
torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

pytestmark = pytest.mark.slow      # servers in subprocesses


@pytest.fixture(scope="module")
def headless(env, tmp_path_factory):
    """A server of a bare Qwen3Model checkpoint (what Qwen3-Embedding ships), and its transformers model."""
    folder = tmp_path_factory.mktemp("qwen3_embedding")
    hf = bare_qwen3(folder, 151936)
    with_embedding_tokenizer(folder)
    with serving(env, str(folder)) as running:
        yield running, folder, hf


@pytest.fixture(scope="module")
def running(env):
    with serving(env, MODEL) as server:
        yield server


def client_of(url: str):
    return openai.OpenAI(base_url=url, api_key="none", max_retries=0, timeout=HANG_SECONDS)


def cosines(vectors, references) -> list[float]:
    return [float(np.asarray(v, dtype=np.float64) @ r / np.linalg.norm(v)) for v, r in zip(vectors, references)]


@pytest.mark.parametrize("encoding", ["base64", "float"])
def test_embeddings_of_a_headless_checkpoint_are_transformers_last_token_pooling(headless, encoding) -> None:
    running, folder, hf = headless
    ids = [transformers.AutoTokenizer.from_pretrained(str(folder))(text)["input_ids"] for text in TEXTS]
    # The client asks for base64 unless told otherwise, and decodes it to floats.
    kwargs = {"encoding_format": "float"} if encoding == "float" else {}
    answer = client_of(running.url).embeddings.create(model=str(folder), input=TEXTS, **kwargs)
    assert [item.index for item in answer.data] == list(range(len(TEXTS))) and answer.model == str(folder)
    assert answer.object == "list" and {item.object for item in answer.data} == {"embedding"}
    assert min(cosines([item.embedding for item in answer.data], [last_token_pooling(hf, one) for one in ids])) >= 0.99999
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(one) for one in ids)
    by_ids = client_of(running.url).embeddings.create(model=str(folder), input=ids, **kwargs)
    np.testing.assert_allclose([item.embedding for item in by_ids.data], [item.embedding for item in answer.data],
                               atol=1e-6)


def test_base64_is_little_endian_float32_bytes_of_the_float_vectors(headless) -> None:
    running, folder, _ = headless
    floats = post(running.url + "/embeddings", {"input": "hello", "encoding_format": "float"})[1]
    code, encoded = post(running.url + "/embeddings", {"input": "hello", "encoding_format": "base64"})
    assert code == 200
    decoded = np.frombuffer(base64.b64decode(encoded["data"][0]["embedding"]), dtype="<f4")
    assert decoded.tolist() == floats["data"][0]["embedding"] and len(decoded) == 32


def test_dimensions_keep_the_first_values_normalised_again(headless) -> None:
    running, folder, _ = headless
    client = client_of(running.url)
    full = np.array(client.embeddings.create(model=str(folder), input="hello").data[0].embedding)
    short = np.array(client.embeddings.create(model=str(folder), input="hello", dimensions=8).data[0].embedding)
    np.testing.assert_allclose(short, full[:8] / np.linalg.norm(full[:8]), atol=1e-6)


def test_a_headless_checkpoint_refuses_chat_and_completions_saying_it_has_no_lm_head(headless) -> None:
    running, folder, _ = headless
    assert any("no LM head" in line for line in running.start)
    for path, body in [("/chat/completions", {"messages": [{"role": "user", "content": "Hi"}]}),
                       ("/completions", {"prompt": "Hi"})]:
        code, answer = post(running.url + path, body)
        assert_openai_error(code, answer, 400)
        assert answer["error"]["code"] == "no_lm_head" and "no language-model head" in answer["error"]["message"]
    assert post(running.url + "/embeddings", {"input": "still serving"})[0] == 200


@pytest.mark.parametrize("body, param, words", [
    ({"input": []}, "input", "must be a text"),
    ({"input": 5}, "input", "must be a text"),
    ({"input": ["a", 3]}, "input", r"input[1]: must be a text"),
    ({"input": ["x"] * 2049}, "input", "2049 inputs, more than 2048"),
    ({"input": [[1, 2], [151936]]}, "input", "input[1]: id 151936 is outside the vocabulary"),
    ({"input": "hi", "dimensions": 0}, "dimensions", "must be in [1, 32]"),
    ({"input": "hi", "dimensions": 33}, "dimensions", "must be in [1, 32]"),
    ({"input": "hi", "dimensions": "8"}, "dimensions", "must be an integer"),
    ({"input": "hi", "encoding_format": "int8"}, "encoding_format", "must be one of float, base64"),
    ({"input": "hi", "stream": True}, "stream", "not a field of /v1/embeddings"),
], ids=["empty", "number", "mixed", "too-many", "bad-id", "dimensions-0", "dimensions-33",
        "dimensions-text", "encoding", "stream"])
def test_bad_embedding_requests_are_a_4xx_naming_the_field(headless, body, param, words) -> None:
    running, _, _ = headless
    code, answer = post(running.url + "/embeddings", body)
    assert_openai_error(code, answer, 400, param)
    assert words in answer["error"]["message"]


def test_an_input_longer_than_the_context_is_a_400_naming_input(running) -> None:
    code, answer = post(running.url + "/embeddings", {"input": [[1] * 3000, [1] * 5000]})
    assert_openai_error(code, answer, 400, "input")
    assert answer["error"]["code"] == "context_length_exceeded" and "input[1]: 5000 tokens" in answer["error"]["message"]
    code, answer = post(running.url + "/embeddings", {"input": ["ok", "x" * 80_000]})
    assert_openai_error(code, answer, 400, "input")
    assert "input[1]: 10000 tokens" in answer["error"]["message"]


def test_a_model_with_its_head_embeds_as_transformers_pools_and_a_stream_beside_it_is_untouched(running) -> None:
    client = client_of(running.url)
    hf = transformers.Qwen3Model.from_pretrained(str(QWEN3_RANDOM), torch_dtype=torch.float32).eval()
    ids = [transformers.AutoTokenizer.from_pretrained(str(QWEN3_RANDOM))(text)["input_ids"] for text in TEXTS]
    prompt = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 24, "temperature": 0}
    solo = client.completions.create(**prompt).choices[0].text
    texts: list[str] = []
    stream = threading.Thread(target=lambda: texts.append(
        "".join(chunk.choices[0].text for chunk in client.completions.create(**prompt, stream=True))))
    stream.start()
    answer = client.embeddings.create(model=MODEL, input=TEXTS * 40)          # runs between the stream's steps
    stream.join(HANG_SECONDS)
    assert texts == [solo]
    references = [last_token_pooling(hf, one) for one in ids] * 40
    assert min(cosines([item.embedding for item in answer.data], references)) >= 0.99999


def test_the_batching_thread_runs_work_one_forward_pass_after_each_step(tok) -> None:
    """An embedding job of several passes, queued while a generation decodes: between two of the batch's
    steps at most one of its passes runs, and its vectors are what embed() gives."""
    model = load_model(QWEN3_RANDOM)
    generator = BatchGenerator(model, tok, max_batch=2)
    runner = BatchRunner(generator)
    order: list[str] = []
    step = generator.step

    def counted_step():
        order.append("step")
        return step()

    generator.step = counted_step                         # type: ignore[method-assign]
    long = [list(range(100, 100 + 600)), list(range(5, 700)), [1, 2, 3]]         # 2 + 2 + 1 passes
    job = Embedding(model, long)
    assert job.passes == 5
    piece = job.step

    def counted_piece() -> bool:
        order.append("piece")
        return piece()

    job.step = counted_piece                               # type: ignore[method-assign]
    finished, generated, heard = threading.Event(), threading.Event(), []
    runner.submit(Request(tok.encode("Hello"), SamplingParams(temperature=0), 30),
                  lambda event: generated.set() if getattr(event, "finish_reason", None) == "length" else None)
    runner.start()
    try:
        runner.run_beside(job, lambda error: (heard.append(error), finished.set()))
        assert finished.wait(HANG_SECONDS) and generated.wait(HANG_SECONDS)
    finally:
        runner.stop()
    assert heard == [None] and order.count("piece") == 5
    last_step = max(i for i, what in enumerate(order) if what == "step")
    assert not any(a == b == "piece" for a, b in zip(order[:last_step], order[1:last_step]))   # while it decodes
    reference = Embedding(model, long)
    while not reference.step():
        pass
    np.testing.assert_allclose(job.vectors, reference.vectors, atol=1e-6)


def test_a_failing_task_ends_alone_and_the_batch_goes_on(tok) -> None:
    model = load_model(QWEN3_RANDOM)
    runner = BatchRunner(BatchGenerator(model, tok, max_batch=2))

    class Broken:
        def step(self) -> bool:
            raise ValueError("broken work")

    heard: list = []
    done, generated = threading.Event(), threading.Event()
    runner.start()
    try:
        runner.run_beside(Broken(), lambda error: (heard.append(error), done.set()))
        runner.submit(Request(tok.encode("Hello"), SamplingParams(temperature=0), 3),
                      lambda event: generated.set() if getattr(event, "finish_reason", None) else None)
        assert done.wait(HANG_SECONDS) and generated.wait(HANG_SECONDS)
    finally:
        runner.stop()
    assert isinstance(heard[0], ValueError)
