"""Shared test helpers: tiny random Qwen3 checkpoints written through the real checkpoint writer."""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import pytest

from qwen_np.files.checkpoint import save_checkpoint
from qwen_np.core.config import expected_tensors
from qwen_np.files.tokenizer import Tokenizer

ROOT = Path(__file__).resolve().parents[1]
# The bundled default model: a tiny Qwen3 trained on Shakespeare, its own 2,048-token BPE, no chat template.
BUNDLED = ROOT / "weights"
# A tiny random-weight Qwen3 with the real Qwen3 tokenizer and chat template (tools/make_bundled_model.py):
# what the tests of the tokenizer, the chat template, thinking, chat and serving chat run on. Its weights
# are not committed: they are written here on first use (about a second, byte-identical every run,
# test_the_random_fixture_weights_are_the_same_bytes_every_run).
QWEN3_RANDOM = ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"
QWEN3_RANDOM_WEIGHTS_SHA256 = "c7687f6f3188d11d6d54709a7aa22725741ef7227560378a137735d8accf6006"


def _write_qwen3_random_weights() -> None:
    if not (QWEN3_RANDOM / "model.safetensors").is_file():
        import sys

        sys.path.insert(0, str(ROOT / "tools"))
        from make_bundled_model import write_fixture

        write_fixture(QWEN3_RANDOM)


_write_qwen3_random_weights()

TINY_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 96, "hidden_size": 32,
    "intermediate_size": 48, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 16, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2,
}


def write_random_checkpoint(folder: Path, seed: int = 0, shards: int = 1, dtype: str = "BF16",
                            **overrides: object) -> Path:
    """A Qwen3 checkpoint with random weights (norm weights random too, so q/k norm bugs show)."""
    from qwen_np.core.config import Qwen3Config

    config_json = {**TINY_CONFIG, **overrides}
    config = Qwen3Config.from_dict(config_json)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in expected_tensors(config).items():
        if len(shape) == 1:
            tensors[name] = (1.0 + 0.5 * rng.standard_normal(shape)).astype(np.float32)
        else:
            tensors[name] = (0.1 * rng.standard_normal(shape)).astype(np.float32)
    names = sorted(tensors)
    groups = [names[i::shards] for i in range(shards)]
    return save_checkpoint(folder, config_json, [{n: tensors[n] for n in g} for g in groups], dtype=dtype)


# Byte offsets of the FP16 fields (d, and m or dmin) in the block of each GGUF kind qwen_np.numbers.ggml_blocks holds.
FP16_FIELDS = {"Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2),
               "Q5_K": (0, 2), "Q6_K": (208,)}


def random_blocks(kind: str, rows: int, count: int, seed: int,
                  scales: tuple[float, float] | None = None) -> np.ndarray:
    """[rows, count, bytes] blocks of a ggml_blocks kind, every byte random, as a file's: the FP16 fields
    any finite FP16 (subnormals, zeros, negatives), or uniform in `scales` (values of a trained matrix's
    size for scales ~1e-3)."""
    from qwen_np.numbers.ggml_blocks import BLOCK_KINDS

    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(rows, count, BLOCK_KINDS[kind].size), dtype=np.uint8)
    for at in FP16_FIELDS[kind]:
        bits = raw[..., at:at + 2].view(np.uint16)
        if scales is None:
            bits[(bits & 0x7C00) == 0x7C00] &= np.uint16(0xBFFF)      # inf/NaN exponent -> a finite one
        else:
            bits[...] = rng.uniform(*scales, size=bits.shape).astype(np.float16).view(np.uint16)
    return raw


@pytest.fixture
def make_checkpoint(tmp_path: Path) -> Callable[..., Path]:
    """Factory: make_checkpoint(name="ckpt", seed=0, shards=1, dtype="BF16", **config_overrides) -> folder."""
    def make(name: str = "ckpt", **kwargs: object) -> Path:
        return write_random_checkpoint(tmp_path / name, **kwargs)
    return make


@pytest.fixture(autouse=True, scope="session")
def no_weight_cache_in_home() -> Iterator[None]:
    """No test writes an FP32 weight cache into the user's cache folder (a full-width test model is
    2.5 GB in FP32): the cache is off unless a test turns it on in a folder of its own."""
    from qwen_np.engine.weight_cache import CACHE_ENV

    patch = pytest.MonkeyPatch()
    patch.setenv(CACHE_ENV, "off")
    yield
    patch.undo()


@pytest.fixture(scope="session")
def tok() -> Tokenizer:
    """The real Qwen3 tokenizer and chat template (QWEN3_RANDOM's), for every test that needs one."""
    return Tokenizer.from_folder(QWEN3_RANDOM)


@pytest.fixture(autouse=True)
def steady_threads() -> Iterator[None]:
    """Every test runs with the thread count it sets, however busy the machine is (runtime.adapt_to_load
    would use fewer while other processes run: tests/test_runtime.py tests that)."""
    from qwen_np.engine import runtime

    with runtime.steady_threads():
        yield
