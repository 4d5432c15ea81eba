"""Write the test fixture tests/fixtures/qwen3_tokenizer_random: a tiny Qwen3 with RANDOM weights and
the real Qwen3 tokenizer and chat template.

It was the bundled model until weights/ became a model trained on Shakespeare (which has its own small
tokenizer and no chat template); the tests of the tokenizer, the chat template, thinking, chat and
serving chat run on it. It is a checkpoint read by exactly the code that loads real ones: an
original-Qwen3-style config.json, BF16 model.safetensors, Qwen3's generation_config.json (as released
on the Hub), and the real Qwen3 tokenizer that tools/build_tokenizer.py already put there (left
untouched). The vocabulary is the real 151,936 ids, so the tokenizer applies; the network is tiny
(hidden 64, 2 layers) so the file stays ~20 MB. The weights are random: the text it produces is
gibberish. Output is byte-identical on every run.

Usage: python tools/make_bundled_model.py [--out tests/fixtures/qwen3_tokenizer_random]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
FIXTURE = REPO_ROOT / "tests" / "fixtures" / "qwen3_tokenizer_random"
sys.path.insert(0, str(REPO_ROOT))   # run from a checkout without installing the package

from qwen_np.files.checkpoint import save_checkpoint  # noqa: E402
from qwen_np.core.config import Qwen3Config, expected_tensors  # noqa: E402

SEED = 20250429   # Qwen3's release date
# Norm weights are 1 + spread * N(0, 1) rather than all ones, so every norm affects the output.
NORM_WEIGHT_SPREAD = 0.1

# The released Qwen3-8B config.json (Qwen/Qwen3-8B on the Hub) with tiny shapes; everything else is as released.
CONFIG_JSON = {
    "architectures": ["Qwen3ForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "head_dim": 32,
    "hidden_act": "silu",
    "hidden_size": 64,
    "initializer_range": 0.02,
    "intermediate_size": 192,
    "max_position_embeddings": 40960,
    "max_window_layers": 2,
    "model_type": "qwen3",
    "num_attention_heads": 4,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-06,
    "rope_scaling": None,
    "rope_theta": 1000000,
    "sliding_window": None,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "transformers_version": "4.51.0",
    "use_cache": True,
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# Qwen3-8B's generation_config.json, as released.
GENERATION_CONFIG_JSON = {
    "bos_token_id": 151643,
    "do_sample": True,
    "eos_token_id": [151645, 151643],
    "pad_token_id": 151643,
    "temperature": 0.6,
    "top_k": 20,
    "top_p": 0.95,
    "transformers_version": "4.51.0",
}

README = """\
# tests/fixtures/qwen3_tokenizer_random: the real Qwen3 tokenizer on a tiny RANDOM-weight Qwen3

The tests of the tokenizer, the chat template, thinking, `chat` and `serve`'s chat endpoint run on
this folder (the bundled model in `weights/` has its own small tokenizer and no chat template). It is
a complete Qwen3 checkpoint, loaded through exactly the same code as real checkpoints:

* `config.json`: Qwen3's architecture and format (original Qwen3 style) at a tiny size:
  hidden 64, 2 layers, 4 query / 2 key-value heads, head_dim 32, MLP 192, tied embeddings,
  the real 151,936-token vocabulary and 40,960-token context.
* `model.safetensors`: BF16 weights. **They are random** (seeded NumPy draws), not trained:
  the text this model writes is gibberish.
* `generation_config.json`: Qwen3-8B's sampling defaults (temperature 0.6, top-p 0.95, top-k 20).
* `tokenizer.json`, `tokenizer_config.json`: the real Qwen3 tokenizer and chat template, built
  offline by `tools/build_tokenizer.py`.
  They are the Qwen team's (Alibaba Cloud), released with Qwen3 under the Apache License 2.0:
  see `LICENSE-tokenizer` here and `NOTICE` at the top of the repository.

`config.json`, `generation_config.json`, `model.safetensors` and this README are written by
`python tools/make_bundled_model.py` (byte-identical on every run).
"""


def random_weights(config: Qwen3Config, seed: int) -> dict[str, np.ndarray]:
    """Every tensor the config needs, drawn in name order from one seeded generator.

    Matrices get std 1/sqrt(fan_in) (shape[1]) so activations stay of order one; norm weights
    1 + NORM_WEIGHT_SPREAD * N(0, 1).
    """
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in sorted(expected_tensors(config).items()):
        values = rng.standard_normal(shape, dtype=np.float32)
        tensors[name] = 1 + NORM_WEIGHT_SPREAD * values if len(shape) == 1 else values / np.sqrt(shape[1])
    return tensors


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=FIXTURE,
                        help="output folder (default: tests/fixtures/qwen3_tokenizer_random)")
    out = parser.parse_args(argv).out
    write_fixture(out)
    print(f"wrote the random-weight Qwen3 test model to {out}")


def write_fixture(out: Path) -> None:
    """config.json, model.safetensors, generation_config.json and README.md into `out` (the tokenizer files
    are tools/build_tokenizer.py's). The tests call it when model.safetensors is missing: it is not committed
    (20 MB, made in about a second, the same bytes every run)."""
    config = Qwen3Config.from_dict(CONFIG_JSON)
    save_checkpoint(out, CONFIG_JSON, [random_weights(config, SEED)], dtype="BF16")
    (out / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG_JSON, indent=2) + "\n")
    (out / "README.md").write_text(README)


if __name__ == "__main__":
    main()
