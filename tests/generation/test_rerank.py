"""Reranking (generation/rerank.py) as Qwen3-Reranker's model card computes it, against that code run on
transformers: its prefix and suffix tokens around the pair's, the last position's "yes" and "no" logits,
log-softmax, exp. On the random-weight Qwen3 (the real tokenizer and template), readable and fast path."""

from __future__ import annotations

import numpy as np
import pytest

from qwen_np import load_model
from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.generation.rerank import DEFAULT_INSTRUCTION, PREFIX, SUFFIX, Reranking, rerank, rerank_ids
from tests.conftest import BUNDLED, QWEN3_RANDOM

QUERY = "Why is the sky blue?"
DOCUMENTS = ["Rayleigh scattering: short wavelengths scatter more.", "Paris is the capital of France.", "猫が好き",
             "x", "A long document. " * 60]


def model_card_scores(query: str, documents: list[str], instruction: str = DEFAULT_INSTRUCTION) -> np.ndarray:
    """Qwen3-Reranker's own scoring code (its model card), one pair at a time (unpadded), on transformers."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(QWEN3_RANDOM))
    model = transformers.Qwen3ForCausalLM.from_pretrained(str(QWEN3_RANDOM), dtype=torch.float32,
                                                          attn_implementation="eager").eval()
    prefix, suffix = (tokenizer.encode(text, add_special_tokens=False) for text in (PREFIX, SUFFIX))
    yes, no = tokenizer.convert_tokens_to_ids("yes"), tokenizer.convert_tokens_to_ids("no")
    scores = []
    for document in documents:
        pair = tokenizer(f"<Instruct>: {instruction}\n<Query>: {query}\n<Document>: {document}")["input_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([prefix + pair + suffix])).logits[0, -1]
        scores.append(torch.log_softmax(torch.stack([logits[no], logits[yes]]).double(), dim=0)[1].exp().item())
    return np.array(scores)


@pytest.mark.slow
@pytest.mark.parametrize("fast", [False, True], ids=["readable", "fast"])
def test_scores_equal_qwen3_rerankers_model_card_code_on_transformers(fast: bool) -> None:
    tok = Tokenizer.from_folder(QWEN3_RANDOM)
    model = load_model(QWEN3_RANDOM, fast=fast)
    ours = rerank(model, tok, QUERY, DOCUMENTS)
    np.testing.assert_allclose(ours, model_card_scores(QUERY, DOCUMENTS), atol=1e-6)
    custom = "Given a question, find the passage that answers it"
    np.testing.assert_allclose(rerank(model, tok, QUERY, DOCUMENTS[:2], custom),
                               model_card_scores(QUERY, DOCUMENTS[:2], custom), atol=1e-6)


def test_the_prompt_is_the_model_cards_and_a_documents_special_token_text_stays_text() -> None:
    tok = Tokenizer.from_folder(QWEN3_RANDOM)
    ids = rerank_ids(tok, "q", "<|im_end|>")
    text = tok.decode(ids)
    assert text.startswith("<|im_start|>system\nJudge whether the Document meets the requirements")
    assert text.endswith("<Query>: q\n<Document>: <|im_end|><|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert ids.count(tok.token_to_id("<|im_end|>")) == 2             # the system's and the user's, not the text's


def test_a_model_without_yes_and_no_or_without_a_head_is_an_error_naming_rerank() -> None:
    bundled = load_model(BUNDLED)
    with pytest.raises(QwenNPError, match="^rerank: this tokenizer has no 'yes' and 'no' tokens"):
        Reranking(bundled, Tokenizer.from_folder(BUNDLED), [[1, 2, 3]])
