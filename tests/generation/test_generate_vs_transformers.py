"""Greedy generation from the CLI equals transformers' generate(do_sample=False), token for token.

A tiny random Qwen3 with the real 151,936-token vocabulary is saved in BF16 by save_pretrained next
to the real Qwen3 tokenizer; transformers runs it in FP32 with eager attention. The prompt ids come
from each side's own tokenizer and chat template, so those are compared too. Needs the `reference`
extra (torch + transformers); skipped without it.
"""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from tests.conftest import BUNDLED, HANG_SECONDS, QWEN3_RANDOM  # noqa: E402
from tests.reference.hf_reference import build_reference_model, make_config  # noqa: E402
from transformers import AutoTokenizer, Qwen3ForCausalLM  # noqa: E402

pytestmark = pytest.mark.slow      # torch and transformers, and the CLI as a subprocess

ROOT = Path(__file__).resolve().parents[2]
NEW_TOKENS = 24


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("tiny_qwen3_real_vocab")
    config = make_config(vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True)
    config.bos_token_id, config.eos_token_id = 151643, 151645    # the real ids, so the tokenizer agrees
    build_reference_model(config, seed=7).to(torch.bfloat16).save_pretrained(folder)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(QWEN3_RANDOM / name, folder / name)
    return folder


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return Qwen3ForCausalLM.from_pretrained(checkpoint, dtype=torch.float32, attn_implementation="eager").eval()


@pytest.fixture(scope="module")
def tokenizer(checkpoint):
    return AutoTokenizer.from_pretrained(checkpoint)


def hf_greedy(hf_model, prompt_ids: list[int], pad_token_id: int = 151643) -> list[int]:
    ids = torch.tensor([prompt_ids])
    with torch.inference_mode():
        out = hf_model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=NEW_TOKENS, pad_token_id=pad_token_id)
    return out[0, len(prompt_ids):].tolist()


def cli_greedy(checkpoint: Path, *args: str) -> tuple[list[int], list[int], str]:
    """(prompt ids, generated ids, stdout) of a greedy CLI run."""
    result = subprocess.run(
        [sys.executable, "-m", "qwen_np", "generate", "--model", str(checkpoint), "--temperature", "0",
         "-n", str(NEW_TOKENS), "--verbose", *args],
        cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONPATH": str(ROOT)}, capture_output=True, timeout=HANG_SECONDS)
    assert result.returncode == 0, result.stderr.decode()
    lines = result.stderr.decode().splitlines()

    def ids(label: str) -> list[int]:
        return [int(n) for n in re.findall(r"\d+", next(line for line in lines if line.startswith(label))[len(label):])]

    return ids("prompt ids:"), ids("generated ids:"), result.stdout.decode("utf-8")


@pytest.mark.parametrize("prompt, flags", [
    ("Give me a short introduction to large language models.", ()),
    ("你好，请介绍一下你自己", ("--no-think", "--system", "You are Qwen.")),
    ("The capital of France is", ("--no-chat",)),
], ids=["chat", "chat-no-think-system", "completion"])
def test_cli_greedy_equals_transformers_generate(checkpoint, hf_model, tokenizer, prompt, flags) -> None:
    if "--no-chat" in flags:
        hf_prompt = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    else:
        messages = ([{"role": "system", "content": "You are Qwen."}] if "--system" in flags else []) + [
            {"role": "user", "content": prompt}]
        extra = {"enable_thinking": False} if "--no-think" in flags else {}
        hf_prompt = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=False, **extra)
    expected = hf_greedy(hf_model, list(hf_prompt))

    prompt_ids, generated, text = cli_greedy(checkpoint, *flags, prompt)
    assert prompt_ids == list(hf_prompt)
    assert generated == expected
    shown = expected[:-1] if expected[-1] == 151645 else expected
    assert text == tokenizer.decode(shown) + "\n"


@pytest.mark.parametrize("folder, prompt", [(BUNDLED, "ROMEO:"), (QWEN3_RANDOM, "Hello!")],
                         ids=["bundled-shakespeare", "qwen3-tokenizer-fixture"])
def test_shipped_models_greedy_equal_transformers_generate(folder: Path, prompt: str) -> None:
    """The bundled weights/ checkpoint (no chat template: the prompt is continued as text) and the Qwen3
    fixture (a chat turn) are valid transformers checkpoints, decoded identically."""
    hf_model = Qwen3ForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager").eval()
    prompt_ids, generated, _ = cli_greedy(folder, prompt)
    assert generated == hf_greedy(hf_model, prompt_ids, hf_model.generation_config.pad_token_id)
