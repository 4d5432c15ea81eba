"""Write tests/fixtures/llama_cpp/: GGUF files made the way people make theirs, by llama.cpp's own converter
(convert_hf_to_gguf.py) and quantizer (llama-quantize), from a tiny random Qwen3.

    python tools/make_llama_cpp_ggufs.py --llama-cpp DIR

DIR is a llama.cpp source tree with llama-quantize built in DIR/build/bin (llama.cpp is not packaged for
Debian 12 and PyPI has it only as source: llama-cpp-python's sdist vendors it, `cmake -B build &&
cmake --build build --target llama-quantize` builds the quantizer in ~10 minutes on two cores). The files
are committed, so the tests need no llama.cpp; this tool is how they were made, and how to remake them
with a newer llama.cpp.

The model: rows of 256 and 512 values (whole K-quant blocks), 2 layers (so Q4_K_M's "more bits" rule
gives layer 1's attn_v and ffn_down Q6_K and leaves layer 0's Q4_K), tied and untied embeddings (a tied
file quantizes token_embd as llama.cpp's output tensor), the bundled model's 2,048-token tokenizer.
The converter recognises a tokenizer by hashing how it splits a test text; it does not know the bundled
one, so it is told the pre-tokenizer's name (qwen2, Qwen3's) instead of guessing.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from qwen_np.core.config import Qwen3Config, expected_tensors
from qwen_np.files.checkpoint import save_checkpoint

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "tests" / "fixtures" / "llama_cpp"
CONFIG = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 2048, "hidden_size": 256,
    "intermediate_size": 512, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
    "head_dim": 64, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "max_position_embeddings": 2048,
    "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16",
}
# (file, llama-quantize's type, tied): the done-when's six mixes on the tied model, Q4_K_M untied too.
FILES = [("Q4_K_M", "Q4_K_M", True), ("Q5_K_M", "Q5_K_M", True), ("Q6_K", "Q6_K", True),
         ("Q3_K_M", "Q3_K_M", True), ("Q8_0", "Q8_0", True), ("Q4_0", "Q4_0", True),
         ("Q4_K_M-untied", "Q4_K_M", False)]
CONVERT = """
import sys
import convert_hf_to_gguf
from conversion import base
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "qwen2"
sys.argv = ["convert_hf_to_gguf.py", *sys.argv[1:]]
convert_hf_to_gguf.main()
"""


def random_qwen3(folder: Path, tied: bool) -> Path:
    """A Qwen3 checkpoint of CONFIG with random BF16 weights (norms around 1, matrices N(0, 0.1^2))."""
    config_json = {**CONFIG, "tie_word_embeddings": tied}
    rng = np.random.default_rng(0)
    tensors = {name: ((1.0 + 0.5 * rng.standard_normal(shape)) if len(shape) == 1 else 0.1 * rng.standard_normal(shape))
               .astype(np.float32) for name, shape in expected_tensors(Qwen3Config.from_dict(config_json)).items()}
    save_checkpoint(folder, config_json, [tensors], dtype="BF16")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "weights" / name, folder / name)
    return folder


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--llama-cpp", type=Path, required=True, help="llama.cpp's source tree, llama-quantize built")
    llama_cpp = parser.parse_args().llama_cpp.resolve()
    quantize = llama_cpp / "build" / "bin" / "llama-quantize"
    env = {"PYTHONPATH": f"{llama_cpp / 'gguf-py'}:{llama_cpp}", "PATH": "/usr/bin:/bin"}
    OUT.mkdir(parents=True, exist_ok=True)
    lines, version = [], ""
    with tempfile.TemporaryDirectory() as work:
        for tied in (True, False):
            source = random_qwen3(Path(work) / f"tied-{tied}", tied)
            if tied:
                (OUT / "config.json").write_text(json.dumps(json.loads((source / "config.json").read_text()), indent=2) + "\n")
            bf16 = Path(work) / f"tied-{tied}.bf16.gguf"
            subprocess.run([sys.executable, "-c", CONVERT, str(source), "--outfile", str(bf16), "--outtype", "bf16"],
                           check=True, env=env, cwd=llama_cpp, capture_output=True)
            for name, kind, file_tied in FILES:
                if file_tied != tied:
                    continue
                done = subprocess.run([str(quantize), str(bf16), str(OUT / f"{name}.gguf"), kind],
                                      check=True, capture_output=True, text=True)
                version = re.search(r"version: (.*)", done.stdout + done.stderr).group(1)   # type: ignore[union-attr]
                types = ", ".join(sorted(set(re.findall(r"converting to (\w+)", done.stdout + done.stderr))))
                embeddings = "tied" if tied else "untied"
                lines.append(f"| {name}.gguf | `llama-quantize bf16.gguf {name}.gguf {kind}` | {embeddings} | {types} |")
    (OUT / "README.md").write_text(
        "# GGUF files made by llama.cpp\n\nWritten by `tools/make_llama_cpp_ggufs.py` (its docstring says how) with "
        f"llama.cpp {version}:\nits `convert_hf_to_gguf.py --outtype bf16` of a tiny random Qwen3 (config.json here, "
        "the tied model's; the untied one differs only in `tie_word_embeddings`), then `llama-quantize`.\n\n"
        "| file | made by | embeddings | tensor types the quantizer chose |\n|---|---|---|---|\n" + "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
