"""The walkthrough's exercises: each solution worked out again here with qwen_np's functions, and the
committed page's solution checked to say the same, so a solution cannot rot when the code changes."""

from __future__ import annotations

import re

import numpy as np
import pytest

from tests.conftest import BUNDLED, QWEN3_RANDOM, ROOT
from qwen_np import load_model, preset
from qwen_np.core import layers
from qwen_np.core.flash import flash_attention
from qwen_np.engine import memory, step_memory
from qwen_np.files.tokenizer import Tokenizer
from qwen_np.inspection.counts import weight_bytes_read_per_token
from qwen_np.numbers import formats
from qwen_np.training import gradients

PAGE = (ROOT / "docs" / "walkthrough.md").read_text(encoding="utf-8")
HEADING = re.compile(r"^### Exercise (\d+): (.*)$", re.MULTILINE)
PROMPT = "HAMLET:\nTo be, or not to"                 # the page's prompt (its opening quotes it)
GiB = 2 ** 30


def solution(title_part: str) -> str:
    """The page's text of the exercise whose title contains title_part, from its heading to the next one."""
    heads = list(HEADING.finditer(PAGE))
    for i, head in enumerate(heads):
        if title_part in head[2]:
            end = heads[i + 1].start() if i + 1 < len(heads) else len(PAGE)
            text = PAGE[head.start():end]
            return text[:text.find("\n## ")] if "\n## " in text else text
    raise AssertionError(f"no exercise titled with {title_part!r} on the page")


def test_the_page_has_at_least_seven_exercises_numbered_in_order_each_with_a_solution() -> None:
    numbers = [int(m[1]) for m in HEADING.finditer(PAGE)]
    assert len(numbers) >= 7 and numbers == list(range(1, len(numbers) + 1))
    for head in HEADING.finditer(PAGE):
        assert "<summary>Solution</summary>" in solution(head[2])


def test_exercise_chat_prompt_token_count() -> None:
    tokenizer = Tokenizer.from_folder(QWEN3_RANDOM)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "Hello!"}], enable_thinking=False)
    count = len(tokenizer.encode(text))
    assert count > len(tokenizer.encode("Hello!")) + 4                 # the frame costs tokens
    assert f"**{count} tokens**" in solution("chat prompt")


def test_exercise_tile_instead_of_repeat_fails_the_gqa_test(monkeypatch: pytest.MonkeyPatch) -> None:
    from tests.core.test_model import test_gqa_query_head_h_reads_kv_head_h_div_group as gqa_test

    gqa_test()                                                          # passes as the code is
    tile = lambda a, repeats, axis: np.tile(a, (1,) * (a.ndim + axis) + (repeats,) + (1,) * (-axis - 1))  # noqa: E731
    monkeypatch.setattr(layers.np, "repeat", tile)
    with pytest.raises(AssertionError):
        gqa_test()
    assert "test_gqa_query_head_h_reads_kv_head_h_div_group" in solution("np.tile")


def test_exercise_minus_log_p_of_be_is_the_cross_entropy() -> None:
    model, tokenizer = load_model(BUNDLED, memory="fp32", fast=False), Tokenizer.from_folder(BUNDLED)
    assert repr(PROMPT) in PAGE
    logits = model.forward(tokenizer.encode(PROMPT))[-1:].astype(np.float32)            # [1, V]
    be = tokenizer.encode(" be")
    assert len(be) == 1
    nll = -float(layers.log_softmax(logits)[0, be[0]])
    loss, _ = gradients.cross_entropy(logits[None], np.array([be]))
    assert nll == pytest.approx(loss, rel=1e-5)
    assert f"**{nll:.4g} nats**" in solution("loss of one prediction")


def test_exercise_kv_cache_bytes_of_qwen3_14b() -> None:
    c = preset("qwen3-14b")
    per_token = 2 * c.num_hidden_layers * c.num_key_value_heads * c.head_dim * 2
    assert memory.kv_cache_bytes_per_token(c, bytes_per_value=2) == per_token
    text = solution("Qwen3-14B")
    assert f"**{per_token:,} bytes" in text
    assert f"**{per_token * c.max_position_embeddings / GiB:.4g} GiB**" in text


def test_exercise_bf16_step_at_a_thousand_is_four() -> None:
    rounded = formats.round_trip(np.array([1000, 1001, 1002, 1003, 1004], dtype=np.float32), "bf16")
    assert rounded.tolist() == [1000, 1000, 1000, 1004, 1004]
    assert "**4**" in solution("BF16's step")


def test_exercise_decode_bound_at_the_example_bandwidth() -> None:
    real = preset("qwen3-8b")
    text = solution("decode")
    for width in (2, 0.5):
        assert f"**{50e9 / weight_bytes_read_per_token(real, width):.3g} tokens/s**" in text


def test_exercise_the_remedy_that_fits_qwen3_0_6b_in_24_gib() -> None:
    remedies = step_memory.training_remedies(preset("qwen3-0.6b"), 8, 1024)
    fits = {name for name, estimate in remedies.items() if estimate["total"] <= 24 * GiB}
    assert "grad_accum_4" in fits and "baseline" not in fits and "recompute" not in fits
    assert "bf16_activations" not in fits
    assert "**`--grad-accum 4`**" in solution("24 GiB")


def test_exercise_flash_attention_with_one_key_and_all_keys_per_block() -> None:
    T, H, KVH, Dh = 24, 4, 2, 16
    rng = np.random.default_rng(0)
    q = rng.standard_normal((T, H, Dh), dtype=np.float32)
    k, v = (rng.standard_normal((T, KVH, Dh), dtype=np.float32) for _ in range(2))
    plain = layers.attention(q, k, v, np.arange(T))
    for block in (1, T):
        assert np.abs(flash_attention(q, k, v, np.arange(T), block=block) - plain).max() < 1e-6
    assert "less than 1e-06" in solution("FlashAttention")


def test_exercise_the_tiny_model_blows_up_from_a_learning_rate_of_one() -> None:
    from qwen_np.core.config import Qwen3Config
    from qwen_np.training import step as training
    from qwen_np.training import parameters
    from qwen_np.training.settings import PRESET_CONFIGS

    config = Qwen3Config(**PRESET_CONFIGS["tiny"])
    batch = np.random.default_rng(0).integers(0, 64, size=(4, 17))

    def highest_rise(lr: float) -> float:
        params = parameters.init_parameters(config, seed=0)
        model, optimizer = parameters.model_from_parameters(config, params), training.adamw_for(params)
        losses = []
        for _ in range(12):
            loss, grads = training.loss_and_gradients(model, batch)
            training.clip_gradients(grads, 1.0)
            losses.append(loss)
            optimizer.update(params, grads, lr)
        return max(losses) - losses[0]

    assert highest_rise(0.3) < 1.0 < highest_rise(1.0)
    assert "from **1**" in solution("diverges")
