"""qwen_np reproduces stored transformers FP32 logits for the checkpoints in tests/fixtures.

The fixtures (tests/reference/make_fixtures.py) cover tied and untied lm_heads, GQA groups
1/2/4, head_dim above and below hidden/heads, sharded checkpoints, both config.json styles,
rope theta 1e6/1e4, rms eps 1e-6/1e-5 and positions past 1000. Needs only NumPy: the
reference logits were computed once by transformers and stored in `reference.npz`.
Run with `pytest -s` to see the measured errors.
"""

import functools
import json
from pathlib import Path

import numpy as np
import pytest

import qwen_np

from tests.reference.logit_match import assert_logits_match

FIXTURES_DIR = Path(__file__).resolve().parents[1] / "fixtures"
FIXTURE_NAMES = sorted(p.parent.name for p in FIXTURES_DIR.glob("*/reference.npz"))


# Every way qwen_np can run a checkpoint: the fast path (the default) and the readable path, with
# weights upcast at load (fp32) or kept as stored and upcast per use (bf16).
RUN_MODES = {"fast-auto": dict(fast=True, memory="auto"),      # FP32 as numerics.Panels
             "fast-fp32": dict(fast=True, memory="fp32"), "fast-bf16": dict(fast=True, memory="bf16"),
             "readable-fp32": dict(fast=False, memory="fp32"), "readable-bf16": dict(fast=False, memory="bf16")}
CASES = [(name, mode) for name in FIXTURE_NAMES for mode in RUN_MODES]
CASE_IDS = [f"{name}-{mode}" for name, mode in CASES]


@functools.cache
def load_fixture(name: str, mode: str = "fast-fp32") -> tuple[qwen_np.Qwen3Model, dict[str, np.ndarray]]:
    """Load (once per session) the qwen_np model and the stored reference of one fixture."""
    directory = FIXTURES_DIR / name
    with np.load(directory / "reference.npz", allow_pickle=False) as stored:
        reference = {key: stored[key] for key in stored.files}
    return qwen_np.load_model(directory, **RUN_MODES[mode]), reference


def test_fixture_set_is_present() -> None:
    """The parametrised tests below silently vanish if the fixtures are missing."""
    assert len(FIXTURE_NAMES) >= 5, f"expected the generated fixtures in {FIXTURES_DIR}"


@pytest.mark.parametrize("name", FIXTURE_NAMES, ids=FIXTURE_NAMES)
def test_config_fields_match_transformers_interpretation(name: str) -> None:
    """Both config.json styles parse to the values transformers used for the reference."""
    model, reference = load_fixture(name)
    expected = json.loads(str(reference["hf_config"]))
    actual = {key: getattr(model.config, key) for key in expected}
    assert actual == expected, name


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", CASES, ids=CASE_IDS)
def test_full_forward_matches_transformers_logits_at_every_position(name: str, mode: str) -> None:
    """One uncached forward over the whole input gives the reference logits everywhere."""
    model, reference = load_fixture(name, mode)
    logits = model.forward(reference["input_ids"])
    error = assert_logits_match(logits, reference["logits"], f"{name} {mode} full forward")
    print(f"\n{name} [{mode}]: full forward, T={len(logits)}, max relative error {error:.2e}")


@pytest.mark.slow
@pytest.mark.parametrize("name, mode", CASES, ids=CASE_IDS)
def test_cached_prefill_then_decode_matches_transformers_logits(name: str, mode: str) -> None:
    """Prefilling half the input into a KV cache, then decoding one token at a time,
    gives the same logits as transformers' uncached forward at every position."""
    model, reference = load_fixture(name, mode)
    input_ids, expected = reference["input_ids"], reference["logits"]
    prefill = len(input_ids) // 2
    cache = model.new_cache(len(input_ids))

    errors = [assert_logits_match(model.forward(input_ids[:prefill], cache=cache),
                                  expected[:prefill], f"{name} prefill")]
    for i in range(prefill, len(input_ids)):
        step = model.forward(input_ids[i:i + 1], cache=cache)
        errors.append(assert_logits_match(step, expected[i:i + 1], f"{name} decode step {i}"))
    print(f"\n{name} [{mode}]: prefill {prefill} + {len(input_ids) - prefill} decode steps, "
          f"max relative error {max(errors):.2e}")
