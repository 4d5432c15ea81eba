"""Embeddings (qwen_np.embed, qwen_np/generation/embedding.py) as Qwen3-Embedding defines them: a bare
Qwen3Model checkpoint (no "model." prefix, no lm_head) loads without a head, and each text's vector is
the final norm's output at the last of the ids its tokenizer gives (the post-processor's <|endoftext|>
included), L2-normalised: transformers' last-token pooling within cosine 0.99999, on the readable and the
fast path, batched or alone, short or chunked."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

import qwen_np
from qwen_np.engine.loading import load_model
from qwen_np.engine.budget import PREFILL_CHUNK
from qwen_np.errors import QwenNPError
from qwen_np.files.tokenizer import Tokenizer

from tests.conftest import QWEN3_RANDOM

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

ENDOFTEXT = 151643
TEXTS = ["Instruct: Given a question, retrieve passages that answer it\nQuery:Why is the sky blue?",
         "Rayleigh scattering: short wavelengths scatter more.", "猫が好き", "x"]


def bare_qwen3(folder: Path, vocab_size: int, tie: bool = False, seed: int = 0):
    """A tiny random transformers Qwen3Model saved as it saves itself (what Qwen3-Embedding ships)."""
    config = transformers.Qwen3Config(vocab_size=vocab_size, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6,
                                      max_position_embeddings=2048, tie_word_embeddings=tie)
    torch.manual_seed(seed)
    model = transformers.Qwen3Model(config).eval()
    with torch.no_grad():
        for weight in model.parameters():        # norms random too, so a norm bug shows
            weight.copy_(1 + 0.5 * torch.randn_like(weight) if weight.ndim == 1 else 0.1 * torch.randn_like(weight))
    model.save_pretrained(folder)
    return model


def with_embedding_tokenizer(folder: Path) -> None:
    """The real Qwen3 tokenizer, its post-processor appending <|endoftext|> as Qwen3-Embedding's does."""
    tokenizers = pytest.importorskip("tokenizers")
    backend = tokenizers.Tokenizer.from_file(str(QWEN3_RANDOM / "tokenizer.json"))
    backend.post_processor = tokenizers.processors.Sequence([
        backend.post_processor,
        tokenizers.processors.TemplateProcessing(single="$A <|endoftext|>", special_tokens=[("<|endoftext|>", ENDOFTEXT)])])
    backend.save(str(folder / "tokenizer.json"))
    shutil.copy(QWEN3_RANDOM / "tokenizer_config.json", folder / "tokenizer_config.json")


@pytest.fixture(scope="module")
def embedding_folder(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("qwen3_embedding")
    hf = bare_qwen3(folder, 151936)
    with_embedding_tokenizer(folder)
    return folder, hf


def last_token_pooling(hf, ids: list[int]) -> np.ndarray:
    """The model card's reference: the last hidden state (after the final norm) at the last token, normalised."""
    with torch.no_grad():
        hidden = hf(torch.tensor([ids])).last_hidden_state[0, -1].double().numpy()
    return hidden / np.linalg.norm(hidden)


@pytest.mark.slow
def test_a_bare_qwen3model_checkpoint_loads_without_a_head(embedding_folder) -> None:
    folder, _ = embedding_folder
    names = json.loads((folder / "model.safetensors").read_bytes()[8:8 + int.from_bytes(
        (folder / "model.safetensors").read_bytes()[:8], "little")])
    assert "embed_tokens.weight" in names and "lm_head.weight" not in names         # what it is on disk
    model = load_model(folder)
    assert not model.has_head
    with pytest.raises(QwenNPError, match="no LM head.*qwen_np.embed"):
        model.forward([1, 2, 3])
    assert model.forward_batch([[1, 2, 3]], [None], head=False).shape == (3, 32)


@pytest.mark.slow
@pytest.mark.parametrize("fast", [True, False], ids=["fast", "readable"])
def test_embeddings_are_transformers_last_token_pooling(embedding_folder, fast: bool) -> None:
    folder, hf = embedding_folder
    model, tok = load_model(folder, fast=fast), Tokenizer.from_folder(folder)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(folder))
    vectors = qwen_np.embed(model, TEXTS, tok)
    assert vectors.shape == (len(TEXTS), 32) and vectors.dtype == np.float32
    for text, vector in zip(TEXTS, vectors):
        ids = hf_tok(text)["input_ids"]
        assert ids[-1] == ENDOFTEXT and ids == tok.encode(text, add_special_tokens=True)   # the post-processor's
        assert float(vector @ last_token_pooling(hf, ids)) >= 0.99999
        assert abs(np.linalg.norm(vector) - 1) < 1e-6


def test_batched_alone_and_chunked_inputs_give_the_same_vectors(embedding_folder) -> None:
    folder, hf = embedding_folder
    model, tok = load_model(folder), Tokenizer.from_folder(folder)
    together = qwen_np.embed(model, TEXTS, tok)
    alone = np.concatenate([qwen_np.embed(model, text, tok) for text in TEXTS])
    np.testing.assert_allclose(together, alone, atol=1e-5)
    long = (np.arange(PREFILL_CHUNK + 200) * 7919 % 150000).tolist()           # chunked through a KV cache
    vectors = qwen_np.embed(model, [long, [5, 6, 7], long[:10]])
    assert float(vectors[0] @ last_token_pooling(hf, long)) >= 0.99999
    np.testing.assert_allclose(vectors[1:], qwen_np.embed(model, [[5, 6, 7], long[:10]]), atol=1e-5)
    np.testing.assert_allclose(qwen_np.embed(model, [5, 6, 7]), vectors[1:2], atol=1e-5)   # one list of ids


def test_dimensions_keep_the_first_values_normalised_again(embedding_folder) -> None:
    folder, _ = embedding_folder
    model, tok = load_model(folder), Tokenizer.from_folder(folder)
    full, short = qwen_np.embed(model, TEXTS, tok), qwen_np.embed(model, TEXTS, tok, dimensions=8)
    np.testing.assert_allclose(short, full[:, :8] / np.linalg.norm(full[:, :8], axis=1, keepdims=True), atol=1e-6)


def test_a_tied_bare_checkpoint_keeps_its_head(tmp_path) -> None:
    bare_qwen3(tmp_path, 96, tie=True)
    model = load_model(tmp_path)
    assert model.has_head and model.forward([1, 2]).shape == (2, 96)


def test_bad_inputs_name_what_is_wrong(embedding_folder) -> None:
    folder, _ = embedding_folder
    model = load_model(folder)
    for inputs, message in [([], "^input: no texts or token ids"), (["hi"], "^embed: texts need the checkpoint's tokenizer"),
                            ([[1, 2], [], [3]], r"^input\[1\]: no tokens"), ([[1], 2.5], r"^input\[1\]: must be a text"),
                            ([[1] * 2049], r"^input\[0\]: 2049 tokens, more than the model's 2048-token context"),
                            ([[151936]], r"^input\[0\]: id 151936 is outside the vocabulary")]:
        with pytest.raises(QwenNPError, match=message):
            qwen_np.embed(model, inputs)
    with pytest.raises(QwenNPError, match=r"^dimensions: must be in \[1, 32\]"):
        qwen_np.embed(model, [1, 2], dimensions=33)
