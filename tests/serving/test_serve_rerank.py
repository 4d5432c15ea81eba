"""POST /v1/rerank (and /rerank) on `serve` of the random-weight Qwen3: Jina's and Cohere's shape, the scores
generation.rerank gives in-process (themselves equal to Qwen3-Reranker's model-card code on transformers:
tests/generation/test_rerank.py), best first, and bad bodies a 400 naming the field."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np import load_model
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation.rerank import rerank
from tests.conftest import QWEN3_RANDOM
from tests.serving.test_serve import MODEL, assert_openai_error, post, serving

pytestmark = pytest.mark.slow

QUERY = "Why is the sky blue?"
DOCUMENTS = ["Rayleigh scattering: short wavelengths scatter more.", "Paris is the capital of France.", "猫が好き",
             "x"]


@pytest.fixture(scope="module")
def server(env: dict[str, str]):
    with serving(env, MODEL) as running:
        yield running.url.removesuffix("/v1")


@pytest.fixture(scope="module")
def expected() -> np.ndarray:
    return rerank(load_model(QWEN3_RANDOM), Tokenizer.from_folder(QWEN3_RANDOM), QUERY, DOCUMENTS)


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank"])
def test_rerank_scores_every_document_best_first_with_its_text(server, expected, path: str) -> None:
    code, answer = post(server + path, {"model": MODEL, "query": QUERY, "documents": DOCUMENTS})
    assert code == 200, answer
    results = answer["results"]
    assert [r["index"] for r in results] == list(np.argsort(-expected, kind="stable"))
    np.testing.assert_allclose([r["relevance_score"] for r in results], np.sort(expected)[::-1], atol=1e-6)
    assert [r["document"]["text"] for r in results] == [DOCUMENTS[r["index"]] for r in results]
    assert answer["model"] == MODEL and answer["usage"]["prompt_tokens"] == answer["usage"]["total_tokens"] > 0


def test_top_n_and_return_documents_and_an_instruction(server, expected) -> None:
    code, answer = post(server + "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "top_n": 2,
                                                "return_documents": False})
    assert code == 200 and [r["index"] for r in answer["results"]] == list(np.argsort(-expected, kind="stable")[:2])
    assert all(set(r) == {"index", "relevance_score"} for r in answer["results"])
    code, custom = post(server + "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS, "instruction": "Find cats"})
    assert code == 200 and custom["results"] != answer["results"]


@pytest.mark.parametrize("body, field", [
    ({"documents": DOCUMENTS}, "query"),
    ({"query": QUERY, "documents": "one text"}, "documents"),
    ({"query": QUERY, "documents": [1, 2]}, "documents"),
    ({"query": QUERY, "documents": []}, "documents"),
    ({"query": QUERY, "documents": DOCUMENTS, "top_n": 0}, "top_n"),
    ({"query": QUERY, "documents": DOCUMENTS, "return_documents": "yes"}, "return_documents"),
    ({"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["text"]}, "rank_fields"),
    ({"query": QUERY, "documents": ["word " * 200_000]}, "documents"),
])
def test_a_bad_rerank_body_is_a_400_naming_its_field(server, body, field: str) -> None:
    code, answer = post(server + "/v1/rerank", body)
    assert_openai_error(code, answer, 400, field)
    assert answer["error"]["message"].startswith((f"{field}: ", f"{field}["))
