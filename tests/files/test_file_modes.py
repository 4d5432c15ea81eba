"""Weight files are written with the mode the user's umask allows, as the JSON files beside them are: the
safetensors writer makes its files 0600, which another account or a container could not read (issue 42)."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from tests.conftest import QWEN3_RANDOM
from qwen_np.engine.loading import load_model
from qwen_np.files.checkpoint import save_checkpoint
from qwen_np.training import lora
from qwen_np.training.step import AdamW
from qwen_np.training.run_state import load_state, save_state


def mode(path: Path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


@pytest.fixture(params=[0o022, 0o002, 0o077])
def umask(request: pytest.FixtureRequest) -> Iterator[int]:
    before = os.umask(request.param)
    try:
        yield request.param
    finally:
        os.umask(before)


def test_checkpoints_adapters_and_training_states_get_the_mode_the_umask_allows(tmp_path: Path, umask: int) -> None:
    expected = 0o666 & ~umask
    folder = save_checkpoint(tmp_path / "model", {"a": 1}, [{"w": np.ones((2, 2), np.float32)}])
    assert mode(folder / "model.safetensors") == mode(folder / "config.json") == expected
    model = load_model(QWEN3_RANDOM, memory="fp32", fast=False)
    lora.add_adapters(model, rank=2, targets=("q_proj",), seed=0)
    adapter = lora.save_adapter(tmp_path / "adapter", model, base=str(QWEN3_RANDOM))
    assert mode(adapter / "adapter_model.safetensors") == mode(adapter / "adapter_config.json") == expected
    params = {"w": np.ones(3, np.float32)}
    state = tmp_path / "last.safetensors"
    save_state(state, params, AdamW(m={"w": np.zeros(3, np.float32)}, v={"w": np.zeros(3, np.float32)}), {"step": 1})
    assert mode(state) == expected
    os.chmod(state, 0o600)                              # a file it replaces does not pass its mode on
    save_state(state, params, AdamW(m={"w": np.zeros(3, np.float32)}, v={"w": np.zeros(3, np.float32)}), {"step": 2})
    assert mode(state) == expected and load_state(state)[3]["step"] == 2
